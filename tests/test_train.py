"""Training end to end on the bundled corpus: strategies, mesh-independent checkpoints, resume,
interrupts, model selection, inference mode, and the errors a user meets first."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import vectorize
from tensorflow.experimental import dtensor

from common import mesh as meshlib
from common.checkpoint import checkpoint_steps
from common.mesh_spec import FEATURE, MeshError, parse_mesh
from common.model import DTensorMLP, SparseRows, restore_model, to_mesh
from common.run_dir import BEST_FILE, CHECKPOINT_DIR, METRICS_FILE, TEST_FILE
from common.vectorizer import load_vectorizer
from train.config import TrainConfig
from train.optim import Adam
from train.pipeline import Batches, FirstLayer, first_layer, load_splits
from train.state import to_host
from train.trainer import TrainingError, train

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

# The whole bundled corpus with the default vocabulary, a narrow model: an epoch in seconds.
LEARN = dict(hidden=16, batch_size=64, epochs=1, learning_rate=3e-3, progress=False, refit=False, devices=8)
# Mechanics (checkpoints, resume, errors) only: a capped corpus, small vocabulary, no dropout and
# no validation split unless a test wants them.
TINY = dict(limit=1000, max_tokens=400, hidden=16, batch_size=32, epochs=2, progress=False, learning_rate=3e-3,
            dropout=0.0, validation_fraction=0.0, tensorboard=False, refit=False)
# Run-directory mechanics that do not depend on the mesh: 2 devices (feature=2) dispatch faster.
MECHANICS = dict(TINY, devices=2)


def mesh_of(spec: str):
    return meshlib.build_mesh(parse_mesh(spec), "CPU")


MESHES = ["feature=8", "batch=8", "batch=4,model=2", "batch=2,feature=2,model=2", "batch=1"]
FIRST_LAYERS = {
    "feature=2": FirstLayer(sparse_rows=True, sparse_transposed=True),
    "batch=2": FirstLayer(True, True),
    "batch=2,feature=2,model=2": FirstLayer(True, True),
    "batch=1": FirstLayer(True, True),
    "feature=8": FirstLayer(False, True),
    "batch=8": FirstLayer(True, False),
    "batch=4,model=2": FirstLayer(True, False),
}
"""What `--first-layer auto` takes on each mesh the tests use: sparse rows where `feature` <= 2,
sparse transposed rows (the kernel's gradient) where `batch` <= 2."""


@pytest.mark.parametrize("strategy", ["feature", "data", "model", "spatial"])
def test_each_strategy_learns_the_bundled_corpus(tmp_path: Path, strategy: str) -> None:
    result = train(TrainConfig(run_dir=str(tmp_path), strategy=strategy, steps_per_call=10, **LEARN))
    assert result.test_accuracy > 0.8 and result.validation_accuracy > 0.75, result.history
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [1] and lines[0]["validation_accuracy"] == result.validation_accuracy
    test = json.loads((tmp_path / TEST_FILE).read_text())
    assert (test["checkpoint"], test["test_accuracy"]) == (result.best_checkpoint, result.test_accuracy)
    for name in ("model.json", "vocabulary.json", "train_config.json", BEST_FILE):
        assert (tmp_path / name).is_file()


def test_every_parameter_changes_after_training(tmp_path: Path) -> None:
    config = TrainConfig(run_dir=str(tmp_path), max_steps=3, steps_per_call=1, **TINY)
    mesh = mesh_of("batch=4,model=2")
    train(config, mesh=mesh)
    width = json.loads((tmp_path / "model.json").read_text())["max_tokens"]
    initial = DTensorMLP(config.model_config(width), mesh, seed=config.seed).numpy_weights()
    trained = restore_model(tmp_path, mesh).numpy_weights()
    for name, before in initial.items():
        assert not np.array_equal(before, trained[name]), f"{name} did not change"


def test_adam_takes_the_textbook_step_on_each_shard() -> None:
    """The fused update (one TensorFlow kernel per variable, run by DTensor on each device's shard)
    against Adam written out in numpy, with decoupled weight decay, over a few steps."""
    mesh = mesh_of("batch=2,feature=4")
    layout = dtensor.Layout([FEATURE, dtensor.UNSHARDED], mesh)
    rng = np.random.default_rng(0)
    start, gradients = rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(4, 16, 3)).astype(np.float32)
    param = dtensor.DVariable(to_mesh(start, layout))
    lr, decay, b1, b2, eps = 0.1, 0.5, 0.9, 0.999, 1e-7
    adam = Adam([param], learning_rate=lr, weight_decay=decay)
    step = tf.function(lambda g: adam.apply([g], [param]))
    want, m, v = start.astype(np.float64), np.zeros((16, 3)), np.zeros((16, 3))
    for t, g in enumerate(gradients, start=1):
        step(to_mesh(g, layout))
        want -= lr * decay * want
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * np.square(g)
        want -= lr * math.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    got = dtensor.unpack(dtensor.relayout(param.read_value(), dtensor.Layout.replicated(mesh, 2)))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert dtensor.fetch_layout(param.read_value()) == layout  # each device kept its own shard


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


@pytest.mark.parametrize("spec", FIRST_LAYERS)
def test_the_sparse_first_layer_gives_the_dense_gradients(model_parallel_run: Path, spec: str) -> None:
    """One training-mode step on real reviews, fed dense and as `--first-layer auto` feeds them on
    the mesh (sparse rows, sparse transposed rows or both, cut per device): the same logits, moving
    statistics and gradient of every parameter, within float tolerance."""
    mesh, config = mesh_of(spec), TrainConfig(**TINY)
    vectorizer = load_vectorizer(model_parallel_run)
    split = load_splits(config).train
    results = {}
    for layer in (FirstLayer(False, False), first_layer("auto", mesh)):
        model = restore_model(model_parallel_run, mesh)
        batches = Batches(mesh, model.layouts, vectorizer, config, layer)
        x, y = next(batches.training(split, np.arange(64)))
        assert isinstance(x, SparseRows) == layer.sparse_transposed

        @tf.function
        def logits_and_gradients(x, y):  # noqa: ANN001, ANN202 - (as train_step computes them)
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            return [dtensor.relayout(t, dtensor.Layout.replicated(mesh, t.shape.rank))
                    for t in [logits, *tape.gradient(loss, model.parameters)]]

        results[str(layer)] = [to_host(t) for t in logits_and_gradients(x, y)] + [
            model.numpy_weights()["bn_moving_mean"]]
    dense, sparse = results.pop("dense"), results.popitem()[1]
    names = ["logits", "d dense1_kernel", "d dense1_bias", "d bn_gamma", "d bn_beta", "d dense2_kernel",
             "d dense2_bias", "bn_moving_mean"]
    assert np.count_nonzero(dense[1]) > 100  # the reviews' n-grams reach the first kernel
    for name, want, got in zip(names, dense, sparse):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("spec", FIRST_LAYERS)
def test_first_layer_auto_is_sparse_where_dtensor_lays_sparse_operands_out(spec: str) -> None:
    mesh = mesh_of(spec)
    assert first_layer("auto", mesh) == FIRST_LAYERS[spec]
    assert first_layer("dense", mesh) == FirstLayer(False, False)
    if FIRST_LAYERS[spec] == FirstLayer(True, True):
        assert first_layer("sparse", mesh) == FirstLayer(True, True)
    else:
        with pytest.raises(MeshError, match="--first-layer sparse needs a mesh whose batch and feature dims"):
            first_layer("sparse", mesh)


def test_a_run_stopped_on_one_first_layer_path_resumes_on_another(tmp_path: Path) -> None:
    """Stopped mid-epoch on feature=2 (both products sparse), resumed on feature=8 (a sparse gradient,
    the forward product from rows made dense on the devices): it finishes where an uninterrupted
    feature=2 run does, within the float noise two meshes' sums differ by."""
    base = dict(TINY, epochs=1, steps_per_call=4)
    train(TrainConfig(run_dir=str(tmp_path / "straight"), devices=2, **base))
    stopped = train(TrainConfig(run_dir=str(tmp_path / "moved"), devices=2, max_steps=13, **base))
    assert stopped.step == 13
    resumed = train(TrainConfig(run_dir=str(tmp_path / "moved"), devices=8, **base))
    assert resumed.step > 13
    mesh = mesh_of("feature=8")
    a = restore_model(tmp_path / "straight", mesh, "latest").numpy_weights()
    b = restore_model(tmp_path / "moved", mesh, "latest").numpy_weights()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=3e-5, err_msg=name)


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
    """Stopped part-way through the first epoch and resumed: the same weights, and the epoch's
    metrics line covers the whole epoch (its loss is the mean over all its steps)."""
    base = dict(MECHANICS, epochs=2, steps_per_call=4, dropout=0.5, validation_fraction=0.1)
    straight = train(TrainConfig(run_dir=str(tmp_path / "straight"), **base))
    first = train(TrainConfig(run_dir=str(tmp_path / "resumed"), max_steps=13, **base))
    assert first.step == 13 and first.epoch == 0
    resumed = train(TrainConfig(run_dir=str(tmp_path / "resumed"), **base))
    assert resumed.step == straight.step
    mesh = mesh_of("batch=8")
    a = restore_model(tmp_path / "straight", mesh, "latest").numpy_weights()
    b = restore_model(tmp_path / "resumed", mesh, "latest").numpy_weights()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert resumed.test_accuracy == pytest.approx(straight.test_accuracy, abs=1e-3)
    lines = {name: [json.loads(x) for x in (tmp_path / name / METRICS_FILE).read_text().splitlines()]
             for name in ("straight", "resumed")}
    assert [r["epoch"] for r in lines["resumed"]] == [1, 2]
    for got, want in zip(lines["resumed"], lines["straight"]):
        for key in ("step", "train_loss", "train_accuracy", "validation_loss", "validation_accuracy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4), key


def test_a_crash_between_the_metrics_line_and_the_checkpoint_leaves_one_line_per_epoch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.checkpoint import CheckpointStore

    config = TrainConfig(run_dir=str(tmp_path), **dict(MECHANICS, epochs=2, validation_fraction=0.1))
    real_save = CheckpointStore.save

    def crash_at_the_end_of_epoch_1(self, step, best=None):  # noqa: ANN001
        if json.loads((tmp_path / METRICS_FILE).read_text().splitlines()[-1])["epoch"] == 1:
            raise KeyboardInterrupt("killed after the metrics line, before the checkpoint")
        return real_save(self, step, best)

    monkeypatch.setattr(CheckpointStore, "save", crash_at_the_end_of_epoch_1)
    with pytest.raises(KeyboardInterrupt):
        train(config)
    assert checkpoint_steps(tmp_path) == [] and len((tmp_path / METRICS_FILE).read_text().splitlines()) == 1
    (tmp_path / CHECKPOINT_DIR / "ckpt-7_temp").mkdir(parents=True)  # what a killed sharded save leaves
    monkeypatch.setattr(CheckpointStore, "save", real_save)
    train(replace(config, epochs=1))  # starts over (no checkpoint): epoch 1 again
    result = train(config)
    epochs = [json.loads(x)["epoch"] for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert epochs == [1, 2] and result.epoch == 2
    assert not (tmp_path / CHECKPOINT_DIR / "ckpt-7_temp").exists()  # leftovers removed at the next start


def test_the_best_checkpoint_survives_keep_n_and_is_what_export_takes(tmp_path: Path) -> None:
    from export import ExportConfig, export_model

    run_dir = tmp_path / "run"
    result = train(TrainConfig(run_dir=str(run_dir), **dict(MECHANICS, epochs=4, patience=0, keep_checkpoints=1,
                                                            validation_fraction=0.2, learning_rate=0.05)))
    lines = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines()]
    best_line = max(lines, key=lambda r: (r["validation_accuracy"], -r["validation_loss"]))
    best = json.loads((run_dir / BEST_FILE).read_text())
    assert best["checkpoint"] == f"ckpt-{best_line['step']}" == result.best_checkpoint
    assert best["validation_accuracy"] == best_line["validation_accuracy"]
    assert [r["best"] for r in lines].count(True) >= 1
    steps = checkpoint_steps(run_dir)
    assert steps == sorted({best_line["step"], lines[-1]["step"]})  # keep 1 latest + the best
    exported = export_model(ExportConfig(checkpoint_dir=str(run_dir), model_dir=str(tmp_path / "m")))
    assert Path(exported.checkpoint).name == best["checkpoint"]
    assert exported.validation_accuracy == best["validation_accuracy"]
    assert exported.test_accuracy == result.test_accuracy
    latest = export_model(ExportConfig(checkpoint_dir=str(run_dir), model_dir=str(tmp_path / "m"),
                                       checkpoint="latest"))
    assert Path(latest.checkpoint).name == f"ckpt-{lines[-1]['step']}"


def test_refit_trains_again_on_all_the_data_for_the_epochs_validation_chose(tmp_path: Path) -> None:
    from export import ExportConfig, export_model

    run_dir = tmp_path / "run"
    config = TrainConfig(run_dir=str(run_dir), **dict(MECHANICS, epochs=4, patience=1, validation_fraction=0.2,
                                                       learning_rate=0.05, refit=True))
    result = train(config)
    chosen = [json.loads(x) for x in (run_dir / "selection" / METRICS_FILE).read_text().splitlines()]
    best_epoch = max(r["epoch"] for r in chosen if r["best"])
    selected = json.loads((run_dir / "selection" / BEST_FILE).read_text())
    assert result.validation_accuracy == selected["validation_accuracy"]
    assert not (run_dir / "selection" / TEST_FILE).exists()  # the test split is seen once, by the final model
    final = [json.loads(x) for x in (run_dir / METRICS_FILE).read_text().splitlines()]
    assert [r["epoch"] for r in final] == list(range(1, best_epoch + 1)) and "validation_accuracy" not in final[-1]
    saved = json.loads((run_dir / "train_config.json").read_text())
    assert (saved["validation_fraction"], saved["epochs"], saved["refit"]) == (0.0, best_epoch, False)
    # 1,000 training reviews: 800 (25 batches of 32) to choose, all 1,000 (31 batches) for the model
    assert chosen[0]["step"] == 25 and final[-1]["step"] == 31 * best_epoch
    assert (result.epoch, result.test_accuracy) == (best_epoch, json.loads((run_dir / TEST_FILE).read_text())[
        "test_accuracy"])
    exported = export_model(ExportConfig(checkpoint_dir=str(run_dir), model_dir=str(tmp_path / "m")))
    assert Path(exported.checkpoint).name == result.best_checkpoint == f"ckpt-{final[-1]['step']}"
    again = train(config)  # both runs finished: nothing is trained again
    assert (again.step, again.test_accuracy) == (result.step, result.test_accuracy)


def test_patience_stops_early(tmp_path: Path) -> None:
    result = train(TrainConfig(run_dir=str(tmp_path), **dict(MECHANICS, epochs=10, patience=1, validation_fraction=0.2,
                                                             learning_rate=0.05)))
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert result.epoch == len(lines) < 10
    assert not lines[-1]["best"] and lines[-2]["best"]  # stopped after one epoch without improvement


def test_batch_size_must_divide_by_the_batch_dimension(tmp_path: Path) -> None:
    with pytest.raises(MeshError, match=r"--batch-size 30 does not divide by the mesh's 'batch' dimension \(8\)"):
        train(TrainConfig(run_dir=str(tmp_path), strategy="data", **dict(TINY, batch_size=30, devices=8)))
    assert not (tmp_path / CHECKPOINT_DIR).exists()


def test_changed_model_shape_on_resume_is_refused(model_parallel_run: Path, tmp_path: Path) -> None:
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(model_parallel_run, run_dir)
    with pytest.raises(TrainingError, match="--hidden"):
        train(TrainConfig(run_dir=str(run_dir), **dict(TINY, hidden=32)))


def test_tensorboard_scalars_from_a_real_run(tmp_path: Path) -> None:
    train(TrainConfig(run_dir=str(tmp_path), **dict(TINY, epochs=2, validation_fraction=0.1, tensorboard=True)))
    tags: dict[str, list[float]] = {}
    for events in (tmp_path / "tensorboard").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    for tag, count in [("train/loss", 2), ("train/accuracy", 2), ("validation/loss", 2), ("validation/accuracy", 2),
                       ("learning_rate", 2), ("examples_per_second", 2), ("test/loss", 1), ("test/accuracy", 1)]:
        assert len(tags.get(tag, [])) == count, (tag, sorted(tags))
    assert tags["learning_rate"] == [pytest.approx(3e-3)] * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mesh", "batch=3", "--devices", "8"], "spans 3 devices but --devices is 8"),
        (["--devices", "-1"], "--devices must be at least 1 (or 0"),
        (["--mesh", "batch=4,model"], "expected NAME=SIZE"),
        (["--strategy", "spatial", "--devices", "6"], "divisible by 4"),
        (["--data", "/nonexistent/reviews.csv"], "/nonexistent/reviews.csv"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--dropout", "1"], "--dropout must be in [0, 1)"),
        (["--ngrams", "9"], "--ngrams must be in 1..5"),
        (["--first-layer", "sparse", "--mesh", "feature=8"], "--first-layer sparse needs a mesh whose batch and"),
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


@pytest.mark.parametrize(("flags", "cores", "gpus", "expected"), [
    ({}, 2, 0, 2),  # one virtual CPU device per core...
    ({}, 32, 0, 8),  # ...at most 8
    ({}, 2, 1, 1),  # every GPU when present
    ({"device_type": "CPU"}, 2, 0, 2),
    ({"strategy": "spatial"}, 2, 0, 4),  # rounded up to what the strategy needs
    ({"strategy": "model"}, 3, 0, 4),
    ({"mesh": "batch=3"}, 2, 0, 3),  # the mesh's own size
    ({"num_clients": 2, "jobs": "a:1,b:2"}, 2, 0, 8),  # every client arrives at the same count alone
    ({"devices": 5, "strategy": "data"}, 2, 4, 5),  # asked for: kept
])
def test_devices_0_picks_a_count_that_fits_the_host(monkeypatch, flags: dict, cores: int, gpus: int,
                                                      expected: int) -> None:
    import train.config

    monkeypatch.setattr(train.config, "usable_cpus", lambda: cores)
    config = TrainConfig(**flags)
    assert config.device_count(gpus) == expected
    assert math.prod(size for _, size in config.mesh_dims(expected)) == expected


def test_devices_0_says_when_the_gpus_cannot_hold_the_strategy() -> None:
    with pytest.raises(MeshError, match=r"--strategy spatial needs 4 devices but this host has 1 GPU\(s\)"):
        TrainConfig(strategy="spatial").device_count(visible_gpus=1)


def test_the_default_device_count_is_what_the_run_records(tmp_path: Path) -> None:
    """--devices 0 is made concrete before the run starts: the log line and train_config.json say
    how many devices ran (one per core here, at most 8; the test process has 8)."""
    from common.cpus import usable_cpus

    result = train(TrainConfig(run_dir=str(tmp_path), **dict(TINY, epochs=1)))
    saved = json.loads((tmp_path / "train_config.json").read_text())
    assert saved["devices"] == min(usable_cpus(), 8) and result.step > 0


def test_bad_data_leaves_no_run_directory_behind(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    proc = subprocess.run([sys.executable, "-m", "train", "--data", str(bad), "--run-dir", str(tmp_path / "run"),
                           "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bad.jsonl" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_resume_from_a_damaged_checkpoint_says_which_and_what_to_do(tmp_path: Path) -> None:
    from conftest import TINY_TRAIN, trained_run_dir

    run = Path(shutil.copytree(trained_run_dir(0), tmp_path / "run"))
    steps = checkpoint_steps(run)
    shard = sorted((run / CHECKPOINT_DIR).glob(f"ckpt-{steps[-1]}.data-*"))[0]
    shard.write_bytes(shard.read_bytes()[:10])
    config = TrainConfig(run_dir=str(run), resume=True, **{**TINY_TRAIN, "epochs": TINY_TRAIN["epochs"] + 1})
    with pytest.raises(TrainingError) as info:
        train(config)
    assert str(info.value) == (
        f"checkpoint ckpt-{steps[-1]} in {run / CHECKPOINT_DIR} is damaged (a file of it is truncated or corrupt); "
        f"to resume from ckpt-{steps[-2]} instead, delete its files ({run / CHECKPOINT_DIR}/ckpt-{steps[-1]}.*) "
        "and run again, or pick a new --run-dir")


def test_sigterm_mid_epoch_keeps_a_good_checkpoint_and_resume_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "train", "--run-dir", str(run_dir), "--no-progress", "--epochs", "2",
        "--max-tokens", "400", "--hidden", "16", "--batch-size", "32", "--steps-per-call", "5",
        "--checkpoint-every", "20", "--limit", "2000", "--validation-fraction", "0", "--no-tensorboard",
        "--devices", "2",
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
    assert f"done: step {2 * steps_per_epoch}, epoch 2;" in finished.stdout
    assert "resumed from" in finished.stderr
