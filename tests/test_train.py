"""Training end to end on the bundled corpus: strategies, mesh-independent checkpoints, resume,
interrupts, inference mode, and the errors a user meets first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from common import mesh as meshlib
from common.model import DTensorMLP, to_mesh
from common.vectorizer import load_vectorizer, vectorize
from train.config import TrainConfig
from train.trainer import CHECKPOINT_DIR, METRICS_FILE, TrainingError, restore_model, to_host, train

REPO = Path(__file__).resolve().parents[1]

# The whole bundled corpus and the default vocabulary, with a narrow model: one epoch in seconds.
LEARN = dict(hidden=16, batch_size=64, epochs=1, learning_rate=3e-3, progress=False)
# Mechanics (checkpoints, resume, errors) only: a capped corpus and a small vocabulary.
TINY = dict(limit=1000, max_tokens=400, hidden=16, batch_size=32, epochs=2, progress=False, learning_rate=3e-3)


def mesh_of(spec: str):
    dims = meshlib.parse_mesh(spec)
    return meshlib.build_mesh(dims, "CPU")


MESHES = ["batch=8", "batch=4,model=2", "batch=2,feature=2,model=2", "batch=1"]


@pytest.mark.parametrize("strategy", ["data", "model", "spatial"])
def test_each_strategy_learns_the_bundled_corpus(tmp_path: Path, strategy: str) -> None:
    result = train(TrainConfig(run_dir=str(tmp_path), strategy=strategy, steps_per_call=10, **LEARN))
    assert result.test_accuracy > 0.8, result.history
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1]
    assert lines[-1]["test_accuracy"] == pytest.approx(result.test_accuracy)
    for name in ("model.json", "vocabulary.json", "train_config.json"):
        assert (tmp_path / name).is_file()


def test_every_parameter_changes_after_training(tmp_path: Path) -> None:
    config = TrainConfig(run_dir=str(tmp_path), max_steps=3, steps_per_call=1, **TINY)
    mesh = mesh_of("batch=4,model=2")
    initial = DTensorMLP(config.model_config(), mesh, seed=config.seed).numpy_weights()
    train(config, mesh=mesh)
    trained = restore_model(tmp_path, mesh).numpy_weights()
    for name, before in initial.items():
        assert not np.array_equal(before, trained[name]), f"{name} did not change"


@pytest.fixture(scope="module")
def model_parallel_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    train(TrainConfig(run_dir=str(run_dir), mesh="batch=4,model=2", max_steps=10, **TINY))
    return run_dir


@pytest.mark.parametrize("target", MESHES)
def test_checkpoint_restores_identically_on_any_mesh(model_parallel_run: Path, target: str) -> None:
    saved = restore_model(model_parallel_run, mesh_of("batch=4,model=2")).numpy_weights()
    restored = restore_model(model_parallel_run, mesh_of(target)).numpy_weights()
    for name, value in saved.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_checkpoint_files_are_sharded(model_parallel_run: Path) -> None:
    latest = tf.train.latest_checkpoint(str(model_parallel_run / CHECKPOINT_DIR))
    assert latest is not None and latest.endswith("ckpt-10")
    shards = list((model_parallel_run / CHECKPOINT_DIR).glob("ckpt-10.data-*"))
    assert len(shards) > 1, shards


def test_single_review_prediction_does_not_depend_on_its_batch(model_parallel_run: Path) -> None:
    mesh = mesh_of("batch=1")
    model = restore_model(model_parallel_run, mesh)
    vectorizer = load_vectorizer(model_parallel_run)
    texts = ["a wonderful, moving film", "boring and badly acted", "not good at all", "the plot is set in a city"]
    rows = vectorize(vectorizer, texts)

    def probabilities(x: np.ndarray) -> np.ndarray:
        logits = model(to_mesh(x, model.layouts.inputs), training=False)
        return tf.nn.softmax(to_host(logits)).numpy()

    batched = probabilities(rows)
    for i in range(len(texts)):
        np.testing.assert_allclose(probabilities(rows[i : i + 1])[0], batched[i], rtol=1e-6, atol=1e-7)
    assert not np.allclose(batched[0], batched[1])


def test_resume_continues_exactly_where_it_stopped(tmp_path: Path) -> None:
    base = dict(TINY, epochs=2, steps_per_call=4)
    straight = train(TrainConfig(run_dir=str(tmp_path / "straight"), **base))
    # Stop part-way through the first epoch, then resume in a fresh call with the same config.
    first = train(TrainConfig(run_dir=str(tmp_path / "resumed"), max_steps=13, **base))
    assert first.step == 13 and first.epoch == 0
    resumed = train(TrainConfig(run_dir=str(tmp_path / "resumed"), **base))
    assert resumed.step == straight.step
    mesh = mesh_of("batch=8")
    a = restore_model(tmp_path / "straight", mesh).numpy_weights()
    b = restore_model(tmp_path / "resumed", mesh).numpy_weights()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert resumed.test_accuracy == pytest.approx(straight.test_accuracy, abs=1e-3)


def test_resume_on_a_different_mesh(tmp_path: Path) -> None:
    config = TrainConfig(run_dir=str(tmp_path), mesh="batch=8", max_steps=6, **TINY)
    train(config)
    saved = restore_model(tmp_path, mesh_of("batch=8")).numpy_weights()
    result = train(replace(config, mesh="batch=2,feature=2,model=2", max_steps=12))
    assert result.step == 12
    after = restore_model(tmp_path, mesh_of("batch=1")).numpy_weights()
    assert any(not np.allclose(after[k], saved[k]) for k in saved)


def test_batch_size_must_divide_by_the_batch_dimension(tmp_path: Path) -> None:
    with pytest.raises(meshlib.MeshError, match=r"--batch-size 30 does not divide by the mesh's 'batch' dimension \(8\)"):
        train(TrainConfig(run_dir=str(tmp_path), **dict(TINY, batch_size=30)))
    assert not (tmp_path / CHECKPOINT_DIR).exists()


def test_changed_model_shape_on_resume_is_refused(model_parallel_run: Path, tmp_path: Path) -> None:
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(model_parallel_run, run_dir)
    with pytest.raises(TrainingError, match="--hidden"):
        train(TrainConfig(run_dir=str(run_dir), **dict(TINY, hidden=32)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "batch=3"], "spans 3 devices but --devices is 8"),
        (["--mesh", "batch=4,model"], "expected NAME=SIZE"),
        (["--strategy", "spatial", "--devices", "6"], "divisible by 4"),
        (["--data", "/nonexistent/reviews.csv"], "/nonexistent/reviews.csv"),
        (["--epochs", "0"], "--epochs must be at least 1"),
    ],
)
def test_cli_reports_bad_input_clearly(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "train", "--run-dir", str(tmp_path), "--no-progress", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigterm_mid_epoch_keeps_a_good_checkpoint_and_resume_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "train", "--run-dir", str(run_dir), "--no-progress", "--epochs", "2",
        "--max-tokens", "400", "--hidden", "16", "--batch-size", "32", "--steps-per-call", "5",
        "--checkpoint-every", "20", "--limit", "2000",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    checkpoints = run_dir / CHECKPOINT_DIR
    deadline = time.monotonic() + 120
    while tf.train.latest_checkpoint(str(checkpoints)) is None:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "interrupted by SIGTERM" in output
    latest = tf.train.latest_checkpoint(str(checkpoints))
    interrupted_step = int(latest.rsplit("-", 1)[1])
    steps_per_epoch = 2000 // 32
    assert 0 < interrupted_step < 2 * steps_per_epoch
    # Every file the "checkpoint" state names exists: nothing half-written became latest.
    assert Path(latest + ".index").is_file()

    finished = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr
    assert f"done: step {2 * steps_per_epoch}," in finished.stdout
    assert "resumed from" in finished.stderr
