"""Drift monitoring: the baseline export writes, the monitor signature, the server's windows and
scores, the endpoint, the Prometheus families and the alert rules, on real exports and servers."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from common.drift import (
    BASELINE_FILE,
    DRIFT_THRESHOLD,
    MIN_REVIEWS,
    STATISTICS,
    Baseline,
    BaselineError,
    review_statistics,
)
from conftest import MODEL_NAME, TINY_TRAIN, copy_model_base
from serve.core.monitor import Report, VersionMonitor
from serve_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
IMDB = REPO.parent / "shared" / "data" / "imdb" / "test.jsonl.gz"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"


def statistics(rng: np.random.Generator, n: int, shift: float = 0.0) -> dict[str, np.ndarray]:
    positive = rng.beta(0.6, 0.6, n)
    return {"words": rng.poisson(80 * (1 + shift), n).astype(float),
            "unknown_ngram_share": np.clip(rng.normal(0.2 + shift, 0.05, n), 0, 1),
            "positive_probability": positive, "predicted_class": (positive > 0.5).astype(float)}


def outputs(stats: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the monitor signature would answer for these statistics."""
    ngrams = (stats["words"] * 2).astype(np.int64)
    p = stats["positive_probability"]
    return {"probabilities": np.stack([1 - p, p], axis=1), "words": stats["words"].astype(np.int64),
            "ngrams": ngrams, "known_ngrams": np.round(ngrams * (1 - stats["unknown_ngram_share"])).astype(np.int64)}


@pytest.fixture(scope="module")
def baseline() -> Baseline:
    rng = np.random.default_rng(0)
    return Baseline.from_reviews(statistics(rng, 2000), rng.integers(0, 2, 2000), "test")


# -- the baseline and its score --------------------------------------------------------------------

def test_a_baseline_survives_its_file_and_bad_files_say_what_is_wrong(baseline, tmp_path):
    path = tmp_path / BASELINE_FILE
    baseline.save(path)
    assert Baseline.load(path) == baseline
    assert all(abs(sum(baseline.shares[name]) - 1) < 1e-9 for name in STATISTICS)
    assert 0.005 < baseline.unlike_share < 0.05  # outside the 1-99% range of length, or above 99% unknown
    data = json.loads(path.read_text())
    data["statistics"]["words"]["shares"].pop()
    path.write_text(json.dumps(data))
    with pytest.raises(BaselineError, match="words: .* need .* shares"):
        Baseline.load(path)
    path.write_text("{")
    with pytest.raises(BaselineError, match="cannot be read as JSON"):
        Baseline.load(path)
    path.write_text(json.dumps({**baseline.to_json(), "format": 99}))
    with pytest.raises(BaselineError, match="another release"):
        Baseline.load(path)


def test_psi_stays_low_for_reviews_like_the_baseline_and_rises_for_shifted_ones(baseline):
    rng = np.random.default_rng(1)
    for shift, expect_drift in ((0.0, False), (0.5, True)):
        stats = statistics(rng, 1000, shift)
        bins = baseline.bins(stats)
        psi = {name: baseline.psi(name, np.bincount(bins[name], minlength=len(baseline.shares[name])))
               for name in STATISTICS}
        for name in ("words", "unknown_ngram_share"):
            assert (psi[name] > DRIFT_THRESHOLD) == expect_drift, (shift, psi)
        assert psi["positive_probability"] < 0.1  # not shifted either time


def test_the_windows_count_the_last_reviews_and_the_last_seconds(baseline):
    now = [1000.0]
    monitor = VersionMonitor(baseline, window_reviews=300, window_seconds=60, clock=lambda: now[0])
    rng = np.random.default_rng(2)
    sent = []
    for step in range(40):  # 40 calls of 7..29 reviews, 5 s apart
        out = outputs(statistics(rng, int(rng.integers(7, 30))))
        sent.append((now[0], review_statistics(out, out["probabilities"])))
        monitor.observe(out)
        now[0] += 5
    now[0] -= 5
    report = Report(baseline, [monitor.counts()])
    everything = {name: np.concatenate([s[name] for _, s in sent]) for name in STATISTICS}
    recent = {name: values[-300:] for name, values in everything.items()}
    in_time = {name: np.concatenate([s[name] for t, s in sent if t > now[0] - 60]) for name in STATISTICS}
    for window, expected in (("reviews", recent), ("seconds", in_time), ("total", everything)):
        bins = baseline.bins(expected)
        for name in STATISTICS:
            np.testing.assert_array_equal(
                report.of(window, name), np.bincount(bins[name], minlength=len(baseline.shares[name])), (window, name))
    assert report.reviews("reviews") == 300
    now[0] += 3600  # an hour without traffic empties the time window, not the count window
    report = Report(baseline, [monitor.counts()])
    assert (report.reviews("seconds"), report.reviews("reviews")) == (0, 300)
    assert report.window("seconds")["verdict"] == "warming_up"


def test_several_workers_windows_are_summed_before_scoring(baseline):
    rng = np.random.default_rng(3)
    monitors = [VersionMonitor(baseline, 1000, 300) for _ in range(2)]
    for monitor, shift in zip(monitors, (0.0, 0.6)):
        monitor.observe(outputs(statistics(rng, 400, shift)))
    both = Report(baseline, [m.counts() for m in monitors])
    assert both.reviews("reviews") == 800
    alone = [Report(baseline, [m.counts()]).psi("reviews")["words"] for m in monitors]
    assert alone[0] < both.psi("reviews")["words"] < alone[1]


# -- the export --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(model_base: Path) -> Path:
    return model_base / "1"


@pytest.mark.slow
def test_export_writes_a_baseline_of_the_held_out_reviews(exported, trained_run):
    baseline = Baseline.load(exported / "assets.extra" / BASELINE_FILE)
    with gzip.open(trained_run / "held_out.jsonl.gz", "rt") as f:
        held_out = [json.loads(line) for line in f]
    assert baseline.reviews == len(held_out) == 100  # 10% of TINY_TRAIN's 1,000 reviews
    assert baseline.label_prior == pytest.approx(np.mean([r["label"] for r in held_out]))
    assert baseline.source == "100 of the training run's validation reviews"
    assert all(len(baseline.edges[name]) >= 5 for name in ("words", "positive_probability"))


@pytest.mark.slow
def test_the_monitor_signature_counts_words_and_ngrams_and_answers_what_serving_default_answers(tmp_path):
    """On a bigram vocabulary, in a fresh interpreter outside the repository (as TF Serving sees the export)."""
    from export import ExportConfig, export_model
    from train.config import TrainConfig
    from train.trainer import train

    run = tmp_path / "run"
    train(TrainConfig(run_dir=str(run), **{**TINY_TRAIN, "ngrams": 2, "epochs": 1}))
    version = export_model(ExportConfig(checkpoint_dir=str(run), model_dir=str(tmp_path / "m"))).path
    vocabulary = set(json.loads((run / "vocabulary.json").read_text())["vocabulary"])
    texts = ["A great film , truly great .", "zzqx unknownword film", "", "boring boring boring"]
    script = (
        "import json, sys, tensorflow as tf\n"
        "m = tf.saved_model.load(sys.argv[1])\n"
        "t = tf.constant(json.loads(sys.argv[2]))\n"
        "a, b = m.signatures['serving_default'](text=t), m.signatures['monitor'](text=t)\n"
        "assert all((a[k].numpy() == b[k].numpy()).all() for k in a), 'answers differ'\n"
        "print(json.dumps({k: b[k].numpy().tolist() for k in ('words', 'ngrams', 'known_ngrams')}))\n")
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", script, str(version), json.dumps(texts)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    for i, text in enumerate(texts):
        words = text.lower().replace(",", " ").replace(".", " ").split()
        grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
        assert (counts["words"][i], counts["ngrams"][i]) == (len(words), len(grams)), text
        assert counts["known_ngrams"][i] == sum(g in vocabulary for g in grams), text


@pytest.mark.slow
def test_a_refit_run_takes_its_baseline_from_the_selection_run(tmp_path):
    from export import ExportConfig, export_model
    from train.config import TrainConfig
    from train.trainer import train

    run = tmp_path / "run"
    train(TrainConfig(run_dir=str(run), **{**TINY_TRAIN, "refit": True, "epochs": 1}))
    assert not (run / "held_out.jsonl.gz").exists() and (run / "selection" / "held_out.jsonl.gz").exists()
    version = export_model(ExportConfig(checkpoint_dir=str(run), model_dir=str(tmp_path / "m"))).path
    baseline = Baseline.load(version / "assets.extra" / BASELINE_FILE)
    assert baseline.source.startswith("100 of the selection run's validation reviews")


@pytest.mark.slow
def test_a_run_without_validation_reviews_exports_without_a_baseline(tmp_path, caplog):
    from export import ExportConfig, export_model
    from train.config import TrainConfig
    from train.trainer import train

    run = tmp_path / "run"
    train(TrainConfig(run_dir=str(run), **{**TINY_TRAIN, "validation_fraction": 0.0, "epochs": 1}))
    result = export_model(ExportConfig(checkpoint_dir=str(run), model_dir=str(tmp_path / "m")))
    assert result.drift_baseline is None and not (result.path / "assets.extra" / BASELINE_FILE).exists()
    assert "kept no validation reviews (--validation-fraction 0?)" in caplog.text


# -- the server ---------------------------------------------------------------------------------------

def like_training(n: int) -> list[str]:
    """Reviews drawn like the training data: the bundled corpus's test split (never trained on)."""
    from train.data import load_data

    return load_data().test.texts[:n]


def product_descriptions(n: int) -> list[str]:
    """Text of another kind: product listings."""
    rng = random.Random(0)
    items = ["stainless steel skillet", "wireless earbuds", "cotton bath towel set", "LED desk lamp",
             "ergonomic office chair", "USB-C charging cable", "ceramic coffee mug", "hiking backpack"]
    traits = ["dishwasher safe", "2-year warranty", "ships in 2 days", "BPA free", "fits 15.6 inch laptops",
              "induction compatible", "available in 6 colours", "water resistant IPX4", "includes carry case"]
    return [f"{rng.choice(items).capitalize()}, {rng.choice(traits)}; {rng.choice(traits)}. "
            f"Model {rng.randint(100, 999)}-{rng.choice('ABCDEFG')}, {rng.randint(1, 12)} pack." for _ in range(n)]


def imdb_reviews(n: int) -> list[str]:
    with gzip.open(IMDB, "rt") as f:
        return [json.loads(line)["text"] for line, _ in zip(f, range(n))]


SHIFTED = {"product descriptions": product_descriptions,
           "IMDB reviews": pytest.param(imdb_reviews, marks=pytest.mark.skipif(
               not IMDB.exists(), reason="../shared/data/imdb is not beside this checkout"))}


def monitoring(server: ServerProcess, path: str = "") -> dict:
    answer = requests.get(f"{server.url}/v1/models/{MODEL_NAME}{path}/monitoring", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def send(server: ServerProcess, texts: list[str], per_request: int = 4) -> None:
    """A connection per request, as many clients would: the kernel spreads connections over the workers."""
    for i in range(0, len(texts), per_request):
        answer = requests.post(f"{server.url}/v1/models/{MODEL_NAME}:predict",
                               json={"instances": texts[i:i + per_request]}, timeout=30)
        assert answer.status_code == 200, answer.text


def gauges(server: ServerProcess, name: str) -> dict[tuple[str, str], float]:
    """(worker, statistic) -> value of the count window's `name` samples."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/monitoring/prometheus/metrics", timeout=10).text
    return {(s.labels["worker"], s.labels.get("statistic", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name and s.labels["window"] == "reviews"}


@pytest.mark.slow
@pytest.mark.parametrize("shifted", SHIFTED.values(), ids=SHIFTED.keys())
def test_every_worker_sees_traffic_like_training_stay_and_shifted_traffic_drift(model_base, tmp_path, shifted):
    server = ServerProcess(copy_model_base(model_base, tmp_path / MODEL_NAME), "--workers", "2",
                           "--monitoring-window", "200", log_path=tmp_path / "serve.log")
    try:
        send(server, like_training(600))  # 150 requests
        version = monitoring(server)["versions"][0]
        assert version["monitoring"] == "on" and version["reviews_total"] == 600
        assert len(version["workers"]) == 2
        for worker in version["workers"]:
            assert worker["reviews"]["reviews"] >= MIN_REVIEWS and worker["reviews"]["verdict"] == "ok", worker
            assert max(worker["reviews"]["psi"].values()) < DRIFT_THRESHOLD, worker
        assert version["windows"]["reviews"]["summary"].startswith("looks like training data")
        psi = gauges(server, "serve_drift_psi")
        assert {w for w, _ in psi} == {"0", "1"} and max(psi.values()) < DRIFT_THRESHOLD

        send(server, shifted(400))  # 100 requests
        version = monitoring(server, "/versions/1")["versions"][0]
        for worker in version["workers"]:
            assert worker["reviews"]["verdict"] == "drifting", worker
            assert max(worker["reviews"]["psi"][s] for s in ("words", "unknown_ngram_share")) > DRIFT_THRESHOLD
        window = version["windows"]["reviews"]
        assert window["verdict"] == "drifting" and window["summary"].startswith("drifting: ")
        assert window["unlike_training_share"] > 5 * version["baseline"]["unlike_training_share"]
        psi = gauges(server, "serve_drift_psi")
        for worker in ("0", "1"):
            assert max(psi[(worker, s)] for s in ("words", "unknown_ngram_share")) > DRIFT_THRESHOLD
        unlike = gauges(server, "serve_drift_unlike_training_ratio")
        assert set(unlike) == {("0", ""), ("1", "")} and min(unlike.values()) > 0.2
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.slow
def test_answers_are_the_same_with_monitoring_off_and_old_exports_are_served_unmonitored(model_base, tmp_path):
    base = copy_model_base(model_base, tmp_path / MODEL_NAME)
    shutil.copytree(base / "1", base / "2")
    (base / "2" / "assets.extra" / BASELINE_FILE).unlink()  # as exported before monitoring
    texts = like_training(8) + product_descriptions(8)
    answers = {}
    for flags in ((), ("--no-monitoring",)):
        server = ServerProcess(base, "--version-policy", "all", *flags, log_path=tmp_path / "serve.log")
        try:
            for version in ("1", "2"):
                answers[flags, version] = requests.post(
                    f"{server.url}/v1/models/{MODEL_NAME}/versions/{version}:predict", json={"instances": texts},
                    timeout=30).content
            states = {v["version"]: v["monitoring"] for v in monitoring(server)["versions"]}
        finally:
            assert server.stop() == 0, server.log()
        if flags:
            assert states == {"1": "off (--no-monitoring)", "2": "off (--no-monitoring)"}
        else:
            assert states["1"] == "on" and states["2"].startswith("off: its export has no drift baseline")
            assert server.log(full=True).count("version 2 is not monitored") == 1
    assert len(set(answers.values())) == 1  # byte for byte, monitored or not, with or without a baseline


# -- alerts ------------------------------------------------------------------------------------------

promtool = shutil.which("promtool")


@pytest.mark.skipif(promtool is None, reason="promtool (Debian's prometheus package) is not installed")
def test_the_alert_rules_are_valid_and_fire_on_drift_and_on_low_confidence():
    checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", str(ALERTS.with_name("alerts_test.yml"))],
                            capture_output=True, text=True, timeout=60, cwd=ALERTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
