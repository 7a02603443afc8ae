"""Accuracy benchmark: the default training run against scikit-learn baselines on the same split.

    python bench/accuracy_bench.py [--data TRAIN,TEST] [--short N] [--sentences N] [--bundled] [-- extra python -m train flags]

For each dataset it runs `python -m train` with the default configuration (a real process: the
wall time covers vocabulary, training and evaluation; peak RSS is that process's own) and, in the
same run, scikit-learn TF-IDF + logistic regression with the 1,200 most frequent unigrams and with
all uni+bigrams (min_df 2, sublinear tf, C=4), and the strong linear baseline: logistic regression on
all uni+bi+trigrams scaled by their naive-Bayes log-count ratios (NBSVM's features, C=16). Datasets:
  - `--data` (default: the IMDB copy at ../shared/data/imdb when it exists, else the bundled corpus);
  - with `--short N` also N short reviews made from it: the first sentence of each review, at most 30
    words (a stand-in for one-line review data, to check the defaults are not tuned to long texts);
  - with `--sentences N` also a sentence-level corpus made from it: N sentences of its training
    reviews and N/5 of its test reviews (3 to 50 words, each labelled by its review; a stand-in for
    a large set of one-line examples, where a step's cost per example matters most);
  - with `--bundled` also the corpus bundled with the package (what `python -m train` reads by default).
The table goes to bench/results/accuracy.json (the docs' benchmark page renders it).
scikit-learn is a bench extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from results import record  # bench/results.py, beside this script

REPO = Path(__file__).resolve().parents[1]
IMDB = REPO.parent / "shared" / "data" / "imdb"


def default_data() -> str:
    if (IMDB / "train.jsonl.gz").is_file():
        return f"{IMDB / 'train.jsonl.gz'},{IMDB / 'test.jsonl.gz'}"
    return "bundled"


def read_split(spec: str) -> tuple[list[str], list[int], list[str], list[int]]:
    """The same train/test texts the trainer reads (its own loader), for the baselines."""
    sys.path.insert(0, str(REPO))
    from train.data import load_data

    data = load_data(spec)
    return data.train.texts, data.train.labels.tolist(), data.test.texts, data.test.labels.tolist()


def make_short(spec: str, n: int, workdir: Path) -> str:
    """First sentence (<= 30 words) of n training and n test reviews, as a train,test JSONL pair."""
    train_x, train_y, test_x, test_y = read_split(spec)
    paths = []
    for name, texts, labels in (("train", train_x, train_y), ("test", test_x, test_y)):
        path = workdir / f"short-{name}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            for text, label in list(zip(texts, labels))[:n]:
                first = re.split(r"(?<=[.!?])\s+|<br\s*/?>", text.strip(), maxsplit=1)[0]
                handle.write(json.dumps({"text": " ".join(first.split()[:30]), "label": label}) + "\n")
        paths.append(str(path))
    return ",".join(paths)


def sentences_of(text: str) -> list[str]:
    return [" ".join(part.split()[:50]) for part in re.split(r"(?<=[.!?])\s+|<br\s*/?>", text.strip())
            if len(part.split()) >= 3]


def make_sentences(spec: str, n: int, workdir: Path) -> str:
    """n sentences of the training reviews and n/5 of the test reviews, each labelled by its review,
    as a train,test JSONL pair."""
    train_x, train_y, test_x, test_y = read_split(spec)
    paths = []
    for name, texts, labels, count in (("train", train_x, train_y, n), ("test", test_x, test_y, n // 5)):
        pairs = [(sentence, label) for text, label in zip(texts, labels) for sentence in sentences_of(text)]
        if len(pairs) < count:
            raise SystemExit(f"--sentences {n}: the {name} reviews have only {len(pairs)} sentences")
        path = workdir / f"sentences-{name}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            for sentence, label in pairs[:count]:
                handle.write(json.dumps({"text": sentence, "label": label}) + "\n")
        paths.append(str(path))
    return ",".join(paths)


def run_training(spec: str, workdir: Path, extra: list[str]) -> dict:
    run_dir = workdir / f"run-{abs(hash(spec))}"
    cmd = [sys.executable, "-m", "train", "--data", spec, "--run-dir", str(run_dir), "--no-progress", *extra]
    log = workdir / "train.log"
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"training failed:\n{log.read_text()[-3000:]}")
    peak = usage.ru_maxrss / 1024  # MB
    test = json.loads((run_dir / "test.json").read_text())
    selection = run_dir / "selection"  # a --refit run: the epochs were chosen there
    best_file = next((d / "best.json" for d in (selection, run_dir) if (d / "best.json").exists()), None)
    best = json.loads(best_file.read_text()) if best_file else {}
    epochs = [len((d / "metrics.jsonl").read_text().splitlines()) for d in (selection, run_dir)
              if (d / "metrics.jsonl").exists()]
    return {"accuracy": test["test_accuracy"], "seconds": seconds, "peak_rss_mb": peak,
            "epochs": " + ".join(map(str, epochs)), "refit": selection.is_dir(), "best": best.get("checkpoint"),
            "validation_accuracy": best.get("validation_accuracy")}


def baselines(spec: str) -> dict[str, dict]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    train_x, train_y, test_x, test_y = read_split(spec)
    out = {}
    for name, vectorizer, c, nb in (
        ("LR, 1,200 unigrams", TfidfVectorizer(max_features=1200), 1.0, False),
        ("LR, uni+bigrams", TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True), 4.0, False),
        ("NB-weighted LR, uni+bi+trigrams", TfidfVectorizer(ngram_range=(1, 3), min_df=2, sublinear_tf=True), 16.0, True),
    ):
        start = time.perf_counter()
        train_features, test_features = vectorizer.fit_transform(train_x), vectorizer.transform(test_x)
        if nb:  # NBSVM's scaling (Wang & Manning 2012) with a logistic loss: each column times |r|
            train_features, test_features = nb_scaled(train_features, test_features, np.asarray(train_y))
        model = LogisticRegression(C=c, max_iter=3000).fit(train_features, train_y)
        accuracy = model.score(test_features, test_y)
        out[name] = {"accuracy": accuracy, "seconds": time.perf_counter() - start}
    return out


def nb_scaled(train, test, labels):  # noqa: ANN001, ANN201 - scipy sparse matrices
    """Both matrices' columns times |log-count ratio| of the training texts, rows renormalised."""
    from sklearn.preprocessing import normalize

    present = (train > 0).astype(np.float64)
    p = np.asarray(present[labels == 1].sum(axis=0)).ravel() + 1
    q = np.asarray(present[labels == 0].sum(axis=0)).ravel() + 1
    r = np.abs(np.log(p / p.sum()) - np.log(q / q.sum()))
    return normalize(train.multiply(r).tocsr()), normalize(test.multiply(r).tocsr())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=default_data(), help="train,test files or any --data of python -m train")
    p.add_argument("--short", type=int, default=0, help="also N short reviews made from --data (0: not)")
    p.add_argument("--sentences", type=int, default=0, help="also N sentences made from --data (0: not)")
    p.add_argument("--bundled", action="store_true", help="also the bundled corpus (when --data is not it)")
    p.add_argument("train_flags", nargs="*", help="extra flags for python -m train (after --)")
    a = p.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        datasets = [("data", a.data)]
        if a.short:
            datasets.append((f"short ({a.short})", make_short(a.data, a.short, workdir)))
        if a.sentences:
            datasets.append((f"sentences ({a.sentences})", make_sentences(a.data, a.sentences, workdir)))
        if a.bundled and a.data != "bundled":
            datasets.append(("bundled", "bundled"))
        rows = []
        for label, spec in datasets:
            print(f"[{label}] training the default configuration ...", file=sys.stderr, flush=True)
            ours = run_training(spec, workdir, a.train_flags)
            print(f"[{label}] scikit-learn baselines ...", file=sys.stderr, flush=True)
            rows.append((label, spec, ours, baselines(spec)))
    print(f"\nAccuracy benchmark, {started}, {os.cpu_count()} CPU cores; python -m train with default flags"
          f"{' + ' + ' '.join(a.train_flags) if a.train_flags else ''}")
    for label, spec, ours, base in rows:
        print(f"\n{label}: {spec}")
        print(f"  {'model':<44} {'test accuracy':>13} {'wall time':>10} {'peak RSS':>9}")
        print(f"  {'python -m train (default)':<44} {ours['accuracy']:>13.2%} {ours['seconds']:>9.0f}s "
              f"{ours['peak_rss_mb']:>7.0f}MB   ({ours['epochs']} epochs, "
              + (f"refit for the best on validation, {ours['validation_accuracy']:.2%})" if ours["refit"] else
                 f"best {ours['best']}, validation {ours['validation_accuracy']:.2%})"))
        for name, result in base.items():
            print(f"  {'scikit-learn ' + name:<44} {result['accuracy']:>13.2%} {result['seconds']:>9.0f}s")
        best_lr = max(result["accuracy"] for result in base.values())
        print(f"  vs best logistic regression: {ours['accuracy'] - best_lr:+.2%}; vs LR on all uni+bigrams: "
              f"{ours['accuracy'] - base['LR, uni+bigrams']['accuracy']:+.2%}")
    record_table(rows, a)
    label, spec, ours, _ = rows[0]
    if spec.startswith(str(IMDB)):
        checks = [("test accuracy >= 91.9% (NBSVM uni+bi+trigrams, Mesnil et al. 2015)", ours["accuracy"] >= 0.919),
                  ("never below 91.3% (NBSVM uni+bigrams, Wang & Manning 2012)", ours["accuracy"] >= 0.913),
                  ("wall time <= 10 min", ours["seconds"] <= 600),
                  ("peak RSS <= 6 GB", ours["peak_rss_mb"] <= 6 * 1024)]
        print("\nTargets (IMDB, default flags): " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in checks))


def describe(spec: str) -> str:
    if spec.startswith(str(IMDB)):
        return "IMDB, official 25k/25k split"
    return "bundled corpus" if spec == "bundled" else os.path.basename(spec.split(",")[0])


def refit_description(epochs: str) -> str:
    """'6 + 4' (the selection run's epochs, then the refit's) as a reader of the table says it."""
    selection, refit = epochs.split(" + ")
    return f"validation chose {refit} of {selection} epochs; refit on all training data"


def record_table(rows: list[tuple[str, str, dict, dict]], a: argparse.Namespace) -> None:
    """The run as bench/results/accuracy.json: one row per dataset, the baselines beside ours."""
    names = list(rows[0][3])
    table = []
    for label, spec, ours, base in rows:
        how = (refit_description(ours["epochs"]) if ours["refit"]
               else f"{ours['epochs']} epochs, best {ours['best']}")
        data = describe(spec)
        if label.startswith("short"):
            data = f"{a.short:,} short reviews (first sentences of <= 30 words, {describe(a.data)})"
        elif label.startswith("sentences"):
            data = (f"{a.sentences:,} + {a.sentences // 5:,} sentences of {describe(a.data)} reviews, labelled by "
                    "their review")
        table.append([data, f"{ours['accuracy']:.2%} ({how})", f"{ours['seconds']:.0f} s",
                      f"{ours['peak_rss_mb'] / 1024:.1f} GB", *(f"{base[n]['accuracy']:.2%}" for n in names)])
    record("accuracy", ["data", "python -m train (default)", "wall time", "peak RSS", *names], table, settings={
        "train flags": " ".join(a.train_flags) or "defaults",
        "baselines": "scikit-learn TF-IDF + logistic regression (C=1, 4; NB-weighted C=16)"})


if __name__ == "__main__":
    main()
