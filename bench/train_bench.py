"""Training benchmark: examples/s and peak memory of every strategy, beside two baselines.

    python bench/train_bench.py [--seconds 20] [--config default,tutorial] [--only NAMES] [--breakdown]

For each model configuration (`default`: python -m train's defaults, a TF-IDF vocabulary of the
150k most frequent uni+bi+trigrams; `tutorial`: the DTensor tutorial's 1,200 unigrams) it measures, on the same reviews
(IMDB's training reviews when ../shared/data/imdb exists, else the bundled corpus), each in a
process of its own (devices are fixed once TensorFlow starts):
  - DTensor, the project's trainer (`TrainState.train_step` over the real input pipeline,
    `train.pipeline.Batches`: a batch vectorized at a time, cut per device and packed; the host waits
    once every --steps-per-call steps) on 8 virtual CPUs with the feature (default), data, model and
    spatial strategies, and data parallel on 2 and 1 devices;
  - (a) the DTensor tutorial's input path on a data-parallel mesh of 8: every batch split in Python
    and packed per device (`dtensor.pack`), one step per call;
  - (b) a plain single-device loop: the same math (`common.model`), the same Adam, the same input
    pipeline, on tf.Variables, several steps per call: the practical limit of this machine.
Throughput excludes the first (tracing) call. `--breakdown` also times, for each DTensor strategy,
the compiled step alone on a batch already on the mesh and the input alone, to show which one
bounds a step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMDB = REPO.parent / "shared" / "data" / "imdb" / "train.jsonl.gz"
sys.path.insert(0, str(REPO))
from train.config import TrainConfig  # noqa: E402 - TensorFlow-free; after the path above

from results import record  # noqa: E402 - bench/results.py, beside this script

SETTINGS = {
    "default": {name: getattr(TrainConfig(), name) for name in ("max_tokens", "ngrams", "sublinear_tf", "normalize",
                                                                "min_df")},
    "tutorial": dict(max_tokens=1200, ngrams=1, sublinear_tf=False, normalize=False, min_df=1),
}
# name -> (kind, devices, mesh)
CONFIGS: dict[str, tuple[str, int, str | None]] = {
    "dtensor feature x8": ("dtensor", 8, "feature=8"),
    "dtensor data x8": ("dtensor", 8, "batch=8"),
    "dtensor model x8": ("dtensor", 8, "batch=4,model=2"),
    "dtensor spatial x8": ("dtensor", 8, "batch=2,feature=2,model=2"),
    "dtensor data x2": ("dtensor", 2, "batch=2"),
    "dtensor data x1": ("dtensor", 1, "batch=1"),
    "(a) tutorial repack x8": ("repack", 8, "batch=8"),
    "(b) plain 1 device": ("plain", 1, None),
}


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
    from train.pipeline import Batches
    from train.state import TrainState

    mesh = build_mesh(parse_mesh(mesh_spec), "CPU")
    config = TrainConfig(devices=devices, mesh=mesh_spec, batch_size=G, steps_per_call=K, hidden=args.hidden,
                         dropout=0.0, progress=False)
    state = TrainState(config.model_config(vectorizer.width), mesh, config)
    layouts = state.model.layouts

    if kind == "dtensor":
        batches = Batches(mesh, layouts, vectorizer, config)

        def forever():  # noqa: ANN202 - the trainer's iterator, restarted at the end of the reviews
            while True:
                yield from batches.iterator(texts, labels, G)

        iterator = forever()

        def run_call() -> None:  # what train.trainer does: K steps back to back, then one host wait
            total = None
            for x, y in itertools.islice(iterator, K):
                loss, _ = state.train_step(x, y)
                total = loss if total is None else total + loss
            dtensor.unpack(total)[0].numpy()

        result = _timed(run_call, K, args.seconds)
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
        dtensor.unpack(bx)[0].numpy()

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


def prepare(run_dir: Path, settings: dict, examples: int) -> tuple[int, int, str]:
    """Reviews and their vocabulary, written for the workers (in a child: this process stays TF-free)."""
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
Path({str(run_dir)!r}, "texts.json").write_text(json.dumps(texts[:{examples}]))
print(json.dumps([len(texts), vec.width, source]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def run_config(name: str, run_dir: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", name, "--run-dir", str(run_dir),
               "--seconds", str(args.seconds), "--steps-per-call", str(args.steps_per_call),
               "--batch-size", str(args.batch_size), "--hidden", str(args.hidden)]
    if args.breakdown:
        command.append("--breakdown")
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    result["examples_per_s"] = result["steps_per_s"] * args.batch_size
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per configuration")
    parser.add_argument("--steps-per-call", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--examples", type=int, default=4096, help="reviews cycled through while timing")
    parser.add_argument("--config", default="default,tutorial", help="model configurations: default, tutorial")
    parser.add_argument("--only", default=None, help="comma-separated configuration names")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each DTensor strategy's compiled step and its input alone")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        import resource

        from common.quiet import quiet_tensorflow

        quiet_tensorflow([])
        kind, devices, mesh = CONFIGS[args.worker]
        result = worker(kind, devices, mesh, args.run_dir, args)
        result["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(result))
        return 0

    from common.quiet import quiet_tensorflow

    quiet_tensorflow([])
    names = args.only.split(",") if args.only else list(CONFIGS)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU core(s), load average {os.getloadavg()[0]:.1f}; "
          f"batch {args.batch_size}, hidden {args.hidden}, {args.steps_per_call} steps/call (DTensor and (b))")
    rows, widths = [], {}
    for config_name in args.config.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            total, width, source = prepare(Path(tmp), dict(SETTINGS[config_name]), args.examples)
            widths[config_name] = width
            print(f"\n[{config_name}] {SETTINGS[config_name]}: vocabulary width {width} from {total} reviews of "
                  f"{source}; timed on the first {args.examples}")
            results = {}
            for name in names:
                results[name] = run_config(name, Path(tmp), args)
                print(f"  measured {name}: {results[name]['examples_per_s']:.0f} examples/s", file=sys.stderr,
                      flush=True)
        rows += [[config_name, *row] for row in _table(results)]
    record("train_speed", ["configuration", "mesh", "steps/s", "examples/s", "peak RSS MB", "vs (a)", "vs (b)"], rows,
           settings={"batch_size": args.batch_size, "hidden": args.hidden, "steps_per_call": args.steps_per_call,
                     "examples": f"{args.examples} reviews of {source}", "seconds": args.seconds,
                     "vocabulary widths": widths})
    return 0


def _table(results: dict[str, dict]) -> list[list[str]]:
    """Prints the configuration's table, returns its rows."""
    b = results.get("(b) plain 1 device", {}).get("examples_per_s")
    a = results.get("(a) tutorial repack x8", {}).get("examples_per_s")
    print(f"  {'mesh':<24} {'steps/s':>8} {'examples/s':>11} {'peak RSS MB':>12} {'vs (a) x8':>10} "
          f"{'vs (b)':>7}")
    rows = []
    for name, r in results.items():
        vs_a = f"{r['examples_per_s'] / a:.2f}x" if a and CONFIGS[name][0] == "dtensor" else "-"
        vs_b = f"{100 * r['examples_per_s'] / b:.0f}%" if b else "-"
        print(f"  {name:<24} {r['steps_per_s']:>8.1f} {r['examples_per_s']:>11.0f} {r['peak_rss_mb']:>12.0f} "
              f"{vs_a:>10} {vs_b:>7}")
        rows.append([name, f"{r['steps_per_s']:.1f}", f"{r['examples_per_s']:,.0f}", f"{r['peak_rss_mb']:,.0f}",
                     vs_a, vs_b])
        if "train_ms_per_step" in r:
            print(f"    {1e3 / r['steps_per_s']:.0f} ms/step = compiled step alone {r['train_ms_per_step']:.0f} ms"
                  f" + input alone (vectorize, cut, pack) {r['input_ms_per_step']:.0f} ms, less what overlaps")
    return rows

if __name__ == "__main__":
    sys.exit(main())
