"""Model speed benchmark: the exported model's cost per call, against the same run exported by an
earlier checkout, interleaved in one process.

    python bench/model_speed_bench.py --baseline CHECKOUT [--run-dir runs/default] [--rounds 5]

Both models are exported from the same training run (`python -m export` of this checkout and of
CHECKOUT, real processes), loaded with `tf.saved_model.load` in this process, and their
`serving_default` called on the same reviews (../shared/data/imdb's test split when present, else
the bundled corpus) at batch 1 and 32, the two models alternating round by round so that machine
noise hits both alike. Prints reviews/s of each and the ratio, and how far their answers are apart
on every review used (the same features and weights: they should agree to the last bit). This
checkout's `explain` signature runs in the same rounds: its cost per review against a predict.
Without --run-dir the default configuration is trained on the bundled corpus first.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import commit_of, print_table, record

REPO = Path(__file__).resolve().parents[1]
IMDB_TEST = REPO.parent / "shared" / "data" / "imdb" / "test.jsonl.gz"


def reviews(count: int) -> tuple[list[str], str]:
    if IMDB_TEST.exists():
        with gzip.open(IMDB_TEST, "rt", encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line, _ in zip(f, range(count))]
        return texts, f"{len(texts)} IMDB test reviews"
    sys.path.insert(0, str(REPO))
    from train.data import load_data

    texts = list(load_data().test.texts)[:count]
    return texts, f"{len(texts)} bundled-corpus test reviews"


def export(checkout: Path, run_dir: Path, out: Path) -> Path:
    """`python -m export` of `checkout` (its own code, this interpreter) -> the SavedModel path."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run([sys.executable, "-m", "export", "--checkpoint-dir", str(run_dir), "--model-dir", str(out),
                    "--version", "1"], cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    return out / "1"


def train_default(work: Path) -> Path:
    run_dir = work / "run"
    subprocess.run([sys.executable, "-m", "train", "--run-dir", str(run_dir)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    return run_dir


def time_calls(fn, batches: list, seconds: float) -> float:  # noqa: ANN001
    """Reviews per second of `fn` over `batches`, cycled for about `seconds`."""
    done = rows = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or done < len(batches):
        batch = batches[done % len(batches)]
        fn(text=batch)
        done += 1
        rows += int(batch.shape[0])
    return rows / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, metavar="CHECKOUT", help="a checkout of the code to compare with")
    p.add_argument("--run-dir", help="training run to export (default: train the default configuration)")
    p.add_argument("--rounds", type=int, default=5, help="alternations per batch size")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per model per round")
    p.add_argument("--reviews", type=int, default=2048, help="reviews to call the models on")
    a = p.parse_args()

    import numpy as np
    import tensorflow as tf

    texts, source = reviews(a.reviews)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        run_dir = Path(a.run_dir).resolve() if a.run_dir else train_default(work)
        paths = {"this": export(REPO, run_dir, work / "this"),
                 "baseline": export(Path(a.baseline).resolve(), run_dir, work / "baseline")}
        loaded = {name: tf.saved_model.load(str(path)) for name, path in paths.items()}
        models = {name: model.signatures["serving_default"] for name, model in loaded.items()}
        answers = {name: np.concatenate([fn(text=tf.constant(texts[i:i + 256]))["probabilities"].numpy()
                                         for i in range(0, len(texts), 256)]) for name, fn in models.items()}
        models["this explain"] = loaded["this"].signatures["explain"]  # what an explanation costs
        rates: dict[int, dict[str, list[float]]] = {}
        for batch in (1, 32):
            batches = [tf.constant(texts[i:i + batch]) for i in range(0, len(texts) - batch + 1, batch)]
            rates[batch] = {name: [] for name in models}
            for r in range(a.rounds):
                order = list(models) if r % 2 == 0 else list(models)[::-1]
                for name in order:
                    rates[batch][name].append(time_calls(models[name], batches, a.seconds))
                print(f"  batch {batch} round {r + 1}: " + ", ".join(
                    f"{n} {v[-1]:,.0f}" for n, v in rates[batch].items()), file=sys.stderr, flush=True)

    rows = []
    for batch, by_name in rates.items():
        this, base = float(np.median(by_name["this"])), float(np.median(by_name["baseline"]))
        explain = float(np.median(by_name["this explain"]))
        rows.append([batch, f"{this:,.0f}", f"{base:,.0f}", f"{this / base:.2f}x",
                     f"{explain:,.0f} ({1e3 / explain:.3f} ms per review)", f"{this / explain:.2f}x"])
    columns = ["batch", "this (reviews/s)", "baseline", "ratio", "explain (reviews/s)", "explain / predict cost"]
    print(f"\nModel speed, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU cores, {source}, "
          f"run {run_dir.name}; median of {a.rounds} alternating rounds of {a.seconds:g}s each:")
    print_table(columns, rows)
    diff = float(np.max(np.abs(answers["this"] - answers["baseline"])))
    same_labels = float(np.mean(answers["this"].argmax(1) == answers["baseline"].argmax(1)))
    agreement = (f"answers on the {len(texts)} reviews: largest probability difference {diff:.3g}, "
                 f"the same label for {same_labels:.2%}")
    print(agreement)
    record("model_speed", columns, rows, notes=[agreement], settings={
        "baseline": commit_of(Path(a.baseline)), "reviews": source, "rounds": a.rounds, "seconds": a.seconds,
        "model": f"{vocabulary_size(run_dir)} n-grams, run {run_dir.name}"})


def vocabulary_size(run_dir: Path) -> int:
    return len(json.loads((run_dir / "vocabulary.json").read_text())["vocabulary"])

if __name__ == "__main__":
    main()
