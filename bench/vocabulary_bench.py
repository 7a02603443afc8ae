"""Vocabulary benchmark: how long `build_vocabulary` takes per review, and its peak memory,
against another checkout of this repository on the same reviews, alternating.

    python bench/vocabulary_bench.py --baseline CHECKOUT [--rounds 3] [--reviews 25000]

Each build runs in a process of its own (`common.vectorizer.build_vocabulary` with
`python -m train`'s default vectorizer settings and `--max-tokens`, on IMDB's training reviews when
../shared/data/imdb exists, else the bundled corpus), the two checkouts taking turns; the table
gives the median per checkout, the peak RSS the build added to the process, and whether both
checkouts chose the same vocabulary (the same n-grams, idf and naive-Bayes weights).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from results import REPO, commit_of, print_table, record  # bench/results.py, beside this script

IMDB = REPO.parent / "shared" / "data" / "imdb"
DATA = f"{IMDB / 'train.jsonl.gz'},{IMDB / 'test.jsonl.gz'}" if (IMDB / "train.jsonl.gz").is_file() else "bundled"

BUILD = r"""
import dataclasses, hashlib, json, resource, sys, time
from common.vectorizer import VectorizerSettings, build_vocabulary
from train.config import TrainConfig
from train.data import load_data

limit, spec = int(sys.argv[1]), sys.argv[2]
train = load_data(spec).train
texts, labels = list(train.texts)[:limit], train.labels[:limit].tolist()
c = TrainConfig()
# The settings both checkouts know: the baseline may predate a field.
names = [f.name for f in dataclasses.fields(VectorizerSettings) if hasattr(c, f.name)]
settings = VectorizerSettings(**{n: getattr(c, n) for n in names})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
v = build_vocabulary(texts, c.max_tokens, settings, labels=labels)
seconds = time.perf_counter() - start
state = v.state()
digest = hashlib.sha1(json.dumps([state["vocabulary"], state["idf"], state.get("nb")]).encode()).hexdigest()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"reviews": len(texts), "seconds": seconds, "added_mb": (peak - before) / 1024,
                  "ngrams": len(v.vocabulary), "digest": digest}))
"""


def build(checkout: Path, reviews: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", BUILD, str(reviews), DATA],
                         cwd=checkout, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the build in {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, metavar="CHECKOUT", help="a checkout of the code to compare with")
    p.add_argument("--rounds", type=int, default=3, help="builds per checkout, alternating")
    p.add_argument("--reviews", type=int, default=25_000, help="training reviews to build from")
    a = p.parse_args()
    checkouts = {"this": REPO, "baseline": Path(a.baseline).resolve()}
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for r in range(a.rounds):
        for name in (list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]):
            runs[name].append(build(checkouts[name], a.reviews))
            done = runs[name][-1]
            print(f"  round {r + 1} {name}: {done['seconds']:.1f} s, peak RSS +{done['added_mb']:,.0f} MB",
                  file=sys.stderr, flush=True)
    reviews = runs["this"][0]["reviews"]
    per_review = {name: statistics.median(run["seconds"] for run in done) / reviews * 1e3
                  for name, done in runs.items()}
    added = {name: max(run["added_mb"] for run in done) for name, done in runs.items()}
    same = len({run["digest"] for done in runs.values() for run in done}) == 1
    source = "the bundled corpus" if DATA == "bundled" else "IMDB training reviews"
    columns = ["checkout", "ms per review", "speed-up", "peak RSS added", "n-grams kept"]
    rows = [[f"{name} ({commit_of(path)})", f"{per_review[name]:.3f}",
             f"{per_review['baseline'] / per_review[name]:.2f}x", f"{added[name]:,.0f} MB",
             f"{runs[name][0]['ngrams']:,}"] for name, path in checkouts.items()]
    note = ("both chose the same vocabulary (n-grams, idf and naive-Bayes weights)" if same
            else "the two checkouts chose different vocabularies")
    print_table(columns, rows)
    print(note)
    record("vocabulary", columns, rows, notes=[note], settings={
        "reviews": f"{reviews:,} {source}", "rounds": a.rounds, "vectorizer": "python -m train's defaults"})


if __name__ == "__main__":
    main()
