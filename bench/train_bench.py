"""Training benchmark: reviews/s of every strategy's step, against an earlier commit in the same run.

    python bench/train_bench.py [--baseline a69ad94] [--seconds 6] [--rounds 2] [--config default,tutorial]
                                [--only NAMES] [--scaling] [--breakdown]

For each model configuration (`default`: python -m train's defaults, a TF-IDF vocabulary of the
150k most frequent uni+bi+trigrams; `tutorial`: the DTensor tutorial's 1,200 unigrams) it measures, on the same reviews
(IMDB's training reviews when ../shared/data/imdb exists, else the bundled corpus), each in a
process of its own (devices are fixed once TensorFlow starts):
  - DTensor, the project's trainer (`TrainState.train_step` over the real input pipeline,
    `train.pipeline.Batches`, sparse or dense first layer as `--first-layer auto` picks; the host
    waits once every --steps-per-call steps) on this host's default mesh (feature=2 on 2 cores), on 8
    virtual CPUs with the feature, data, model and spatial strategies, and data parallel on 2 and 1
    devices; each mesh also with the --baseline commit's own trainer (a git worktree made for the
    run), the two taking turns --rounds times, each at its own default batch size;
  - (a) the DTensor tutorial's input path on a data-parallel mesh of 8: every batch split in Python
    and packed per device (`dtensor.pack`), one step per call;
  - (b) a plain single-device loop: the same math (`common.model`, dense), the same Adam, batches
    vectorized per step, on tf.Variables, several steps per call.
`--scaling` instead times the default mesh, both commits, on reviews cut or joined to 10, 100 and
1,000 words, and on 100-word reviews with a 600k-wide vocabulary: a step that costs what its
n-grams cost follows the words, not the width. Throughput excludes the first (tracing) call.
`--breakdown` also times, for each DTensor strategy, the compiled step alone on a batch already on
the mesh and the input alone, to show which one bounds a step.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
IMDB = REPO.parent / "shared" / "data" / "imdb" / "train.jsonl.gz"
sys.path.insert(0, str(REPO))
from train.config import TrainConfig  # noqa: E402 - TensorFlow-free; after the path above

from results import print_table, record  # noqa: E402 - bench/results.py, beside this script

SETTINGS = {
    "default": {name: getattr(TrainConfig(), name) for name in ("max_tokens", "ngrams", "sublinear_tf", "normalize",
                                                                "min_df")},
    "tutorial": dict(max_tokens=1200, ngrams=1, sublinear_tf=False, normalize=False, min_df=1),
}
# name -> (kind, devices, mesh)
CONFIGS: dict[str, tuple[str, int, str | None]] = {
    "dtensor feature x2": ("dtensor", 2, "feature=2"),
    "dtensor feature x8": ("dtensor", 8, "feature=8"),
    "dtensor data x8": ("dtensor", 8, "batch=8"),
    "dtensor model x8": ("dtensor", 8, "batch=4,model=2"),
    "dtensor spatial x8": ("dtensor", 8, "batch=2,feature=2,model=2"),
    "dtensor data x2": ("dtensor", 2, "batch=2"),
    "dtensor data x1": ("dtensor", 1, "batch=1"),
    "(a) tutorial repack x8": ("repack", 8, "batch=8"),
    "(b) plain 1 device": ("plain", 1, None),
}
DEFAULT_MESH = "dtensor feature x2"
"""`python -m train`'s mesh on this 2-core host (--devices 0: one virtual CPU a core, --strategy feature)."""
SCALING = [(10, "default"), (100, "default"), (1000, "default"), (100, "wide")]
"""(words per review, configuration) of --scaling."""
SETTINGS["wide"] = dict(SETTINGS["default"], max_tokens=600_000)


# -- workers (one per process) --------------------------------------------------------------------


def _timed(run_call, steps_per_call: int, seconds: float) -> dict:
    """Warm up (trace) once, then call until `seconds` have passed (at least 3 calls)."""
    run_call()
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < seconds:
        run_call()
        calls += 1
    return {"steps": calls * steps_per_call, "seconds": time.perf_counter() - started}


def worker(kind: str, devices: int, mesh_spec: str | None, run_dir: str, args: argparse.Namespace) -> dict:
    from common.mesh import configure_devices

    configure_devices(devices, "CPU")  # before TensorFlow runs anything
    import numpy as np
    import tensorflow as tf

    from common.vectorizer import load_vectorizer

    texts = json.loads((Path(run_dir) / "texts.json").read_text())
    labels = np.array([i % 2 for i in range(len(texts))], np.int64)  # labels do not change the cost
    vectorizer = load_vectorizer(Path(run_dir))
    G, K = args.batch_size, args.steps_per_call
    if kind == "plain":
        return _plain(vectorizer, texts, labels, args, np, tf)

    from tensorflow.experimental import dtensor

    from common.mesh import build_mesh
    from common.mesh_spec import parse_mesh
    from train.data import Split
    from train.pipeline import Batches, first_layer
    from train.state import TrainState

    mesh = build_mesh(parse_mesh(mesh_spec), "CPU")
    config = TrainConfig(devices=devices, mesh=mesh_spec, batch_size=G, steps_per_call=K, hidden=args.hidden,
                         dropout=0.0, progress=False)
    state = TrainState(config.model_config(vectorizer.width), mesh, config)
    layouts = state.model.layouts

    if kind == "dtensor":
        batches = Batches(mesh, layouts, vectorizer, config, first_layer(config.first_layer, mesh))
        features = batches.features(Split(texts, labels))  # once, as a training run does
        order = np.arange(len(texts) // G * G)

        def forever():  # noqa: ANN202 - the trainer's iterator, restarted at the end of the reviews
            while True:
                yield from batches.iterator(features, order, G, training=True)

        iterator = forever()

        def run_call() -> None:  # what train.trainer does: K steps back to back, then one host wait
            total = None
            for x, y in itertools.islice(iterator, K):
                loss, _ = state.train_step(x, y)
                total = loss if total is None else total + loss
            dtensor.unpack(total)[0].numpy()

        result = _timed(run_call, K, args.seconds)
        result["first_layer"] = str(batches.layer)
        if args.breakdown:
            result.update(_breakdown(state, iterator, K, args.seconds / 2))
        return result

    # (a) The tutorial: a batch comes to Python, is split per device and packed, one step per call.
    host = tf.data.Dataset.from_tensor_slices((texts, labels)).repeat().batch(G, drop_remainder=True)
    host = iter(host.map(lambda t, y: (vectorizer.dense(t), y), num_parallel_calls=tf.data.AUTOTUNE).prefetch(2))

    def pack(value, layout):  # noqa: ANN001 - the tutorial's repack_local_tensor, for a batch-sharded layout
        parts = tf.split(value, layout.mesh.dim_size("batch"), axis=0)
        return dtensor.pack(parts, layout)

    def run_step() -> None:
        bx, by = next(host)
        loss, _ = state.train_step(pack(bx, layouts.inputs), pack(by, layouts.labels))
        dtensor.unpack(loss)[0].numpy()

    return _timed(run_step, 1, args.seconds)


def _breakdown(state, iterator, steps: int, seconds: float) -> dict:  # noqa: ANN001
    """Where a step's time goes: the compiled step alone on one batch already on the mesh, and the
    input alone (vectorize on the host, cut per device, `dtensor.pack`). TensorFlow's profiler sees no
    op-level events inside a DTensor program on CPU, so the split is measured by taking it apart."""
    from tensorflow.experimental import dtensor

    x, y = next(iterator)

    def train_only() -> None:
        total = None
        for _ in range(steps):
            loss, _ = state.train_step(x, y)
            total = loss if total is None else total + loss
        dtensor.unpack(total)[0].numpy()

    def input_only() -> None:
        for bx, _ in itertools.islice(iterator, steps):
            pass
        piece = dtensor.unpack(bx[0] if isinstance(bx, tuple) else bx)[0]  # SparseRows: its rows
        getattr(piece, "values", piece).numpy()  # a packed sparse batch unpacks to SparseTensors

    train = _timed(train_only, steps, seconds)
    data = _timed(input_only, steps, seconds)
    return {"train_ms_per_step": 1e3 * train["seconds"] / train["steps"],
            "input_ms_per_step": 1e3 * data["seconds"] / data["steps"]}


def _plain(vectorizer, texts, labels, args: argparse.Namespace, np, tf) -> dict:  # noqa: ANN001
    """(b): the same forward math and Adam on plain variables on one device, the same input pipeline."""
    from common.model import PARAMETERS, ModelConfig, hidden_activations, initial_values, mlp_head

    config = ModelConfig(max_tokens=vectorizer.width, hidden=args.hidden)
    variables = {name: tf.Variable(value, name=name) for name, value in initial_values(config, 0).items()}
    params = [variables[name] for name in PARAMETERS]
    m = [tf.Variable(tf.zeros_like(p)) for p in params]
    v = [tf.Variable(tf.zeros_like(p)) for p in params]
    iterations = tf.Variable(0.0)
    lr0, beta_1, beta_2, eps, momentum = 1e-3, 0.9, 0.999, 1e-7, config.bn_momentum

    def step(x, y):  # noqa: ANN001 - mirrors TrainState.train_step + train.optim.Adam
        with tf.GradientTape() as tape:
            hidden = hidden_activations(variables, x)
            mean, variance = tf.nn.moments(hidden, axes=[0])
            variables["bn_moving_mean"].assign(momentum * variables["bn_moving_mean"] + (1 - momentum) * mean)
            variables["bn_moving_variance"].assign(
                momentum * variables["bn_moving_variance"] + (1 - momentum) * variance)
            logits = mlp_head(variables, hidden, mean, variance, epsilon=config.bn_epsilon)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, params)
        t = iterations.assign_add(1.0)
        lr = lr0 * tf.sqrt(1.0 - tf.pow(beta_2, t)) / (1.0 - tf.pow(beta_1, t))
        for g, p, mm, vv in zip(grads, params, m, v):
            mm.assign(beta_1 * mm + (1 - beta_1) * g)
            vv.assign(beta_2 * vv + (1 - beta_2) * tf.square(g))
            p.assign_sub(lr * mm / (tf.sqrt(vv) + eps))
        return loss

    @tf.function
    def steps(iterator, num_steps: int):  # noqa: ANN001
        total = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            total += step(x, y)
        return total

    K, G = args.steps_per_call, args.batch_size
    ds = tf.data.Dataset.from_tensor_slices((texts, labels)).repeat().batch(G, drop_remainder=True)
    ds = ds.map(lambda t, y: (vectorizer.dense(t), y), num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)
    iterator = iter(ds)
    return _timed(lambda: steps(iterator, K).numpy(), K, args.seconds)


# -- the driver -----------------------------------------------------------------------------------


WORKER = """
import argparse, json, resource, sys
sys.path[:0] = ["bench", "."]
from common.quiet import quiet_tensorflow
quiet_tensorflow([])
import train_bench
args = argparse.Namespace(**json.loads(sys.argv[1]))
result = train_bench.worker(args.kind, args.devices, args.mesh, args.run_dir, args)
result["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(result))
"""
"""Runs a checkout's own `worker` (this file's, or the baseline's: a69ad94 has the same signature)."""


def prepare(tree: Path, run_dir: Path, settings: dict, examples: int, words: int | None = None) -> tuple[int, int, str]:
    """Reviews and their vocabulary as `tree`'s code builds it, written for its workers (in a child:
    this process stays TF-free). With `words`, the timed reviews are cut or joined to that many words."""
    code = f"""
import gzip, json
from pathlib import Path
from common.vectorizer import VectorizerSettings, build_vocabulary, save_vectorizer
from train.data import load_data
imdb = Path({str(IMDB)!r})
if imdb.is_file():
    texts = [json.loads(l)["text"] for l in gzip.open(imdb, "rt", encoding="utf-8")]
    source = f"IMDB training reviews"
else:
    texts = load_data("bundled").train.texts
    source = "the bundled corpus"
settings = {settings!r}
max_tokens = settings.pop("max_tokens")
vec = build_vocabulary(texts, max_tokens, VectorizerSettings(**settings))
save_vectorizer(vec, Path({str(run_dir)!r}))
timed, words = texts[:{examples}], {words!r}
if words:
    stream = " ".join(texts).split()
    timed = [" ".join(stream[i * words:(i + 1) * words]) for i in range(min({examples}, len(stream) // words))]
Path({str(run_dir)!r}, "texts.json").write_text(json.dumps(timed))
print(json.dumps([len(texts), vec.width, source]))
"""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"preparing the reviews in {tree} failed:\n{out.stderr[-3000:]}")
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def default_batch_size(tree: Path) -> int:
    code = "from train.config import TrainConfig; print(TrainConfig().batch_size)"
    return int(subprocess.run([sys.executable, "-c", code], cwd=tree, check=True, capture_output=True,
                              text=True).stdout.split()[-1])


@contextlib.contextmanager
def baseline_tree(revision: str | None) -> Iterator[Path | None]:
    """A detached git worktree of `revision`, removed afterwards (None: no baseline)."""
    if not revision:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), revision], cwd=REPO, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


def run_config(tree: Path, name: str, run_dir: Path, batch_size: int, args: argparse.Namespace) -> dict:
    kind, devices, mesh = CONFIGS[name]
    options = {"kind": kind, "devices": devices, "mesh": mesh, "run_dir": str(run_dir), "seconds": args.seconds,
               "steps_per_call": args.steps_per_call, "batch_size": batch_size, "hidden": args.hidden,
               "breakdown": args.breakdown}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(options)], cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=args.seconds + 600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise SystemExit(f"{name}: worker hung (killed):\n{err[-3000:]}") from None
    if proc.returncode:
        raise SystemExit(f"{name}: worker failed ({proc.returncode}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = result.pop("maxrss_kb") / 1024
    result["steps_per_s"] = result["steps"] / result["seconds"]
    result["examples_per_s"] = result["steps_per_s"] * batch_size
    result["batch_size"] = batch_size
    return result


class Side:
    """One checkout's prepared reviews and default batch size, for one table."""

    def __init__(self, label: str, tree: Path, run_dir: Path, batch_size: int) -> None:
        self.label, self.tree, self.run_dir, self.batch_size = label, tree, run_dir, batch_size


def measure(name: str, sides: list[Side], args: argparse.Namespace) -> dict[str, dict]:
    """`name` on every side, --rounds times taking turns (the order flips each round); per side the
    median examples/s and the last round's other figures."""
    runs: dict[str, list[dict]] = {side.label: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            if side.label != "now" and CONFIGS[name][0] != "dtensor":
                continue
            runs[side.label].append(run_config(side.tree, name, side.run_dir, side.batch_size, args))
            print(f"  measured {name} ({side.label}): {runs[side.label][-1]['examples_per_s']:.0f} examples/s",
                  file=sys.stderr, flush=True)
    out = {}
    for label, results in runs.items():
        if results:
            out[label] = dict(results[-1], examples_per_s=statistics.median(r["examples_per_s"] for r in results))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="a69ad94", help="commit to measure beside this checkout ('' for none)")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per configuration and side")
    parser.add_argument("--rounds", type=int, default=2, help="turns each side takes per configuration")
    parser.add_argument("--steps-per-call", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--examples", type=int, default=4096, help="reviews cycled through while timing")
    parser.add_argument("--config", default="default,tutorial", help="model configurations: default, tutorial")
    parser.add_argument("--only", default=None, help="comma-separated configuration names")
    parser.add_argument("--scaling", action="store_true",
                        help="time the default mesh at 10, 100 and 1,000 words a review and at a 600k-wide vocabulary")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each DTensor strategy's compiled step and its input alone")
    args = parser.parse_args()

    from common.quiet import quiet_tensorflow

    quiet_tensorflow([])
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU core(s), load average {os.getloadavg()[0]:.1f}; "
          f"hidden {args.hidden}, {args.steps_per_call} steps/call (DTensor and (b)); each checkout at its own "
          "default batch size")
    with baseline_tree(args.baseline) as base, tempfile.TemporaryDirectory() as tmp:
        trees = [("now", REPO)] + ([(args.baseline, base)] if base else [])
        if args.scaling:
            return scaling(trees, Path(tmp), args)
        names = args.only.split(",") if args.only else list(CONFIGS)
        rows, widths, sources = [], {}, {}
        for config_name in args.config.split(","):
            sides = []
            for label, tree in trees:
                run_dir = Path(tmp) / f"{config_name}-{len(sides)}"
                total, widths[config_name], sources[config_name] = prepare(
                    tree, run_dir, dict(SETTINGS[config_name]), args.examples)
                sides.append(Side(label, tree, run_dir, default_batch_size(tree)))
            print(f"\n[{config_name}] {SETTINGS[config_name]}: vocabulary width {widths[config_name]} from {total} "
                  f"reviews of {sources[config_name]}; timed on the first {args.examples}")
            results = {name: measure(name, sides, args) for name in names}
            rows += [[config_name, *row] for row in _table(results, args.baseline if base else None)]
    columns = ["configuration", "mesh", "first layer", "batch", "examples/s", "peak RSS MB"]
    if base:
        columns += [f"{args.baseline} examples/s", f"vs {args.baseline}"]
    record("train_speed", columns, rows,
           settings={"hidden": args.hidden, "steps_per_call": args.steps_per_call, "rounds": args.rounds,
                     "examples": f"{args.examples} reviews of {next(iter(sources.values()))}",
                     "seconds": args.seconds, "vocabulary widths": widths, "baseline": args.baseline or None})
    return 0


def _ratio(now: dict | None, then: dict | None) -> str:
    return f"{now['examples_per_s'] / then['examples_per_s']:.2f}x" if now and then else "-"


def _table(results: dict[str, dict[str, dict]], baseline: str | None) -> list[list[str]]:
    """Prints the configuration's table, returns its rows."""
    rows = []
    for name, sides in results.items():
        now, then = sides["now"], sides.get(baseline) if baseline else None
        row = [name, now.get("first_layer", "dense"), str(now["batch_size"]), f"{now['examples_per_s']:,.0f}",
               f"{now['peak_rss_mb']:,.0f}"]
        if baseline:
            row += [f"{then['examples_per_s']:,.0f} (batch {then['batch_size']})" if then else "-", _ratio(now, then)]
        rows.append(row)
        if "train_ms_per_step" in now:
            print(f"    {name}: {1e3 / now['steps_per_s']:.0f} ms/step = compiled step alone "
                  f"{now['train_ms_per_step']:.0f} ms + input alone (gather, cut, pack) {now['input_ms_per_step']:.0f} "
                  "ms, less what overlaps")
    print_table(["mesh", "first layer", "batch", "examples/s", "peak RSS MB"]
                + ([f"{baseline} examples/s", f"vs {baseline}"] if baseline else []), rows)
    return rows


def scaling(trees: list[tuple[str, Path]], tmp: Path, args: argparse.Namespace) -> int:
    """--scaling: the default mesh on reviews of a given length and vocabulary width, both checkouts."""
    rows, widths = [], {}
    for words, config_name in SCALING:
        sides = []
        for label, tree in trees:
            run_dir = tmp / f"{config_name}-{words}-{len(sides)}"
            _, widths[config_name], source = prepare(tree, run_dir, dict(SETTINGS[config_name]), args.examples, words)
            sides.append(Side(label, tree, run_dir, default_batch_size(tree)))
        print(f"\n{words} words a review, vocabulary width {widths[config_name]}", flush=True)
        result = measure(DEFAULT_MESH, sides, args)
        now, then = result["now"], result.get(trees[-1][0]) if len(trees) > 1 else None
        row = [str(words), f"{widths[config_name]:,}", now["first_layer"], f"{now['examples_per_s']:,.0f}",
               f"{1e3 / now['steps_per_s']:.1f}"]
        if then:
            row += [f"{then['examples_per_s']:,.0f}", f"{1e3 / then['steps_per_s']:.1f}", _ratio(now, then)]
        rows.append(row)
    baseline = trees[-1][0] if len(trees) > 1 else None
    columns = ["words a review", "vocabulary width", "first layer", "examples/s", "ms/step"]
    if baseline:
        columns += [f"{baseline} examples/s", f"{baseline} ms/step", f"vs {baseline}"]
    print_table(columns, rows)
    record("train_scaling", columns, rows,
           settings={"mesh": CONFIGS[DEFAULT_MESH][2], "hidden": args.hidden, "steps_per_call": args.steps_per_call,
                     "rounds": args.rounds, "seconds": args.seconds, "examples": args.examples,
                     "reviews": f"{source}, cut or joined to the given words", "baseline": baseline})
    return 0


if __name__ == "__main__":
    sys.exit(main())
