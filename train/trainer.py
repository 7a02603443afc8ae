"""The training run, from data to the best checkpoint's test score.

    train(config)
      run directory       create, or resume (leftovers of killed runs removed)
      data                train / validation / test splits
      vocabulary          built from the training split (or the run's own, on resume)
      epochs              train steps -> validation -> metrics line -> checkpoint (best kept)
                          until --epochs, --max-steps, or --patience epochs without improvement
      test                the best checkpoint, once

The pieces live beside this file: `pipeline` (batches on the mesh), `state` (model, optimizer,
compiled steps), `checkpoints` (keeping the latest and the best), `report` (metrics.jsonl,
TensorBoard, logs). Interrupts (SIGINT/SIGTERM) are checkpointed at the last finished step.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import tensorflow as tf
from tensorflow.experimental import dtensor

from common import mesh as meshlib
from common.checkpoint import (
    CheckpointStore,
    DamagedCheckpoint,
    checkpoint_name,
    checkpoint_path,
    checkpoint_prefix,
    checkpoint_steps,
    restore_checkpoint,
    verify_checkpoint,
)
from common.mesh_spec import FEATURE
from common.model import ModelConfig
from common.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    MODEL_FILE,
    SELECTION_DIR,
    TEST_FILE,
    atomic_write_json,
    clean_leftovers,
    read_best,
    read_test,
    write_held_out,
)
from common.vectorizer import (
    VOCABULARY_FILE,
    VOCABULARY_PASSES,
    TfIdf,
    build_vocabulary,
    load_vectorizer,
    save_vectorizer,
)
from train.config import TrainConfig
from train.data import Split
from train.pipeline import Batches, chunks, epoch_order, first_layer, load_splits
from train.report import Report, progress_bar
from train.state import TrainProgress, TrainState, to_host

log = logging.getLogger(__name__)

class TrainingError(RuntimeError):
    """A run that cannot start or continue; the message says which flag or file to fix."""


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM arrived; the last completed step was checkpointed before raising."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}; checkpoint saved")
        self.signum, self.step = signum, step


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    epoch: int
    best_checkpoint: str
    validation_accuracy: float | None
    test_loss: float | None
    test_accuracy: float | None
    """None for the run that only chose the epochs of a refit."""
    history: list[dict]
    best_epoch: int | None = None
    """The epoch of the best validation score, for the run that only chose the epochs of a refit."""


def train(config: TrainConfig, mesh: dtensor.Mesh | None = None) -> TrainResult:
    """Train (or resume) per `config`; everything goes to `config.run_dir` (see common.run_dir).

    With `--refit` (and a validation split) that run only chooses the number of epochs, in
    RUN_DIR/selection; the model in RUN_DIR is then trained again from scratch, vocabulary
    included, on all the training data (validation reviews too) for that many epochs. Held-out
    reviews find the stopping point; they are not lost to the model that gets exported."""
    config = _with_device_count(config, mesh)
    mesh = mesh or make_mesh(config)
    if not (config.refit and config.validation_fraction > 0):
        return _train_run(config, mesh)
    selection = _train_run(dataclasses.replace(config, run_dir=str(Path(config.run_dir) / SELECTION_DIR),
                                               refit=False), mesh, test=False)
    epochs = selection.best_epoch or selection.epoch
    log.info("refit: %s chose %d epoch(s) (validation accuracy %.4f); training again on all the training data",
             SELECTION_DIR, epochs, selection.validation_accuracy or float("nan"))
    final = _train_run(dataclasses.replace(config, validation_fraction=0.0, epochs=epochs, patience=0, refit=False),
                       mesh)
    return dataclasses.replace(final, validation_accuracy=selection.validation_accuracy)


def _train_run(config: TrainConfig, mesh: dtensor.Mesh, test: bool = True) -> TrainResult:
    """One training run in `config.run_dir`; the test split is evaluated when `test`."""
    run_dir, resuming = _prepare_run_dir(config)
    splits = load_splits(config)
    log.info("data: %s (%d train, %s validation, %d test)", splits.source, len(splits.train.texts),
             len(splits.validation.texts) if splits.validation else "no", len(splits.test.texts))
    if len(splits.train.texts) < config.batch_size:
        raise TrainingError(f"--batch-size {config.batch_size} is larger than the {len(splits.train.texts)} "
                            "training examples")
    layer = first_layer(config.first_layer, mesh)
    run_dir.mkdir(parents=True, exist_ok=True)  # only now: bad data or flags leave no empty run directory
    chief = config.client_id == 0
    vectorizer, model_config = _prepare_vocabulary(config, run_dir, splits.train, resuming, mesh, chief)
    if chief and splits.validation is not None:
        write_held_out(run_dir, splits.validation.texts, splits.validation.labels)
    meshlib.check_divisible(mesh, batch_size=config.batch_size, max_tokens=model_config.max_tokens,
                            hidden=config.hidden)
    state = TrainState(model_config, mesh, config)
    store = CheckpointStore(run_dir, state.checkpoint, config.keep_checkpoints, chief)
    if resuming:
        store.restore(store.latest())
        log.info("resumed from %s", store.latest())
    progress = state.progress.read()
    report = Report(run_dir, chief=chief, progress=config.progress, tensorboard=config.tensorboard,
                    finished_epochs=progress.epoch)
    batches = Batches(mesh, state.model.layouts, vectorizer, config, layer)
    steps_per_epoch = len(splits.train.texts) // config.batch_size  # the last partial batch is dropped
    log.info("mesh %s on %d %s device(s), vocabulary of %d n-grams (width %d); %d steps/epoch, batch %d, "
             "first layer %s", ",".join(f"{n}={mesh.dim_size(n)}" for n in mesh.dim_names),
             mesh.num_local_devices() * config.num_clients, mesh.device_type(), len(vectorizer.vocabulary),
             model_config.max_tokens, steps_per_epoch, config.batch_size, layer)
    run = _Run(config, run_dir, state, batches, store, report, steps_per_epoch)
    try:
        with _stop_on_signals() as stop:
            while not _finished(progress, config):
                if _train_epoch(run, splits.train, progress, stop):
                    _end_epoch(run, splits.validation, progress)
                else:
                    _save(run, progress)  # stopped mid-epoch by --max-steps
        if not test:
            return _selected(run, progress)
        return _test(run, splits.test, progress)
    finally:
        report.close()


# -- run directory and vocabulary ----------------------------------------------------------------


def _prepare_run_dir(config: TrainConfig) -> tuple[Path, bool]:
    """(run directory, resuming?), after checking that a run to resume can be resumed; the
    directory itself is created once the data has loaded."""
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"--run-dir {run_dir} is a file, not a directory")
    if config.client_id == 0:
        clean_leftovers(run_dir / CHECKPOINT_DIR)
    resuming = bool(checkpoint_steps(run_dir))
    if resuming and not config.resume:
        raise TrainingError(f"--run-dir {run_dir} already has checkpoints; pass --resume or pick a new --run-dir")
    if resuming and not (run_dir / VOCABULARY_FILE).exists():
        raise TrainingError(f"{run_dir / VOCABULARY_FILE} is missing: cannot resume without the vocabulary")
    if resuming:
        _check_latest_checkpoint(run_dir)
    return run_dir, resuming


def _check_latest_checkpoint(run_dir: Path) -> None:
    """A damaged latest checkpoint stops the resume with what to do, before DTensor touches it."""
    steps = checkpoint_steps(run_dir)
    try:
        verify_checkpoint(checkpoint_prefix(run_dir, steps[-1]))
    except DamagedCheckpoint as exc:
        earlier = f"resume from {checkpoint_name(steps[-2])} instead" if len(steps) > 1 else "start over"
        raise TrainingError(f"{exc}; to {earlier}, delete its files ({run_dir / CHECKPOINT_DIR}/"
                            f"{checkpoint_name(steps[-1])}.*) and run again, or pick a new --run-dir") from None


def _prepare_vocabulary(config: TrainConfig, run_dir: Path, train: Split, resuming: bool, mesh: dtensor.Mesh,
                        chief: bool) -> tuple[TfIdf, ModelConfig]:
    settings = config.vectorizer_settings()
    if resuming:
        vectorizer = load_vectorizer(run_dir)
        saved = ModelConfig.load(run_dir / MODEL_FILE)
        wanted = config.model_config(saved.max_tokens)
        if saved != wanted or vectorizer.settings != settings:
            raise TrainingError(
                f"--run-dir {run_dir} holds a model with {saved} and {vectorizer.settings}, but this run asks for "
                f"{wanted} and {settings}; use the same --hidden/--bn-momentum/--ngrams/--min-df/--sublinear-tf/"
                "--normalize/--nb-weighting, or a new --run-dir"
            )
        return vectorizer, saved
    multiple = math.lcm(8, meshlib.dim_size(mesh, FEATURE))
    bar = progress_bar(config.progress and config.client_id == 0, VOCABULARY_PASSES * len(train.texts),
                       f"vocabulary, {VOCABULARY_PASSES} passes", "review")
    vectorizer = build_vocabulary(train.texts, config.max_tokens, settings, labels=train.labels, multiple=multiple,
                                  progress=bar.update if bar is not None else None)
    if bar is not None:
        bar.close()
    model_config = config.model_config(vectorizer.width)
    if chief:
        save_vectorizer(vectorizer, run_dir)
        model_config.save(run_dir / MODEL_FILE)
        atomic_write_json(run_dir / CONFIG_FILE, dataclasses.asdict(config))
    return vectorizer, model_config


# -- epochs --------------------------------------------------------------------------------------


def _finished(progress: TrainProgress, config: TrainConfig) -> bool:
    if config.max_steps is not None and progress.step >= config.max_steps:
        return True
    if config.patience and config.validation_fraction and progress.since_best >= config.patience:
        return True
    return progress.epoch >= config.epochs


@dataclass(frozen=True)
class _Run:
    """What every part of a training run works with (the loop's progress travels apart)."""

    config: TrainConfig
    run_dir: Path
    state: TrainState
    batches: Batches
    store: CheckpointStore
    report: Report
    steps_per_epoch: int
    """Full batches in the training split (the last partial batch is dropped)."""


def _train_epoch(run: _Run, split: Split, progress: TrainProgress, stop: threading.Event) -> bool:
    """Train (the rest of) the current epoch; True when it finished, False when --max-steps cut it."""
    G = run.config.batch_size
    steps_per_epoch = run.steps_per_epoch
    start_batch = progress.examples_in_epoch // G
    rows = epoch_order(len(split.texts), run.config.seed, progress.epoch)[start_batch * G : steps_per_epoch * G]
    todo = len(rows) // G
    if run.config.max_steps is not None:
        todo = min(todo, run.config.max_steps - progress.step)
    iterator = run.batches.training(split, rows[: todo * G])
    bar = run.report.bar(steps_per_epoch, start_batch, f"epoch {progress.epoch + 1}/{run.config.epochs}")
    started = time.perf_counter()
    try:
        for num_steps in chunks(todo, run.config.steps_per_call):
            losses, accuracies = _sum_steps(run.state.train_step, iterator, num_steps)
            previous = progress.step
            progress.step += num_steps
            progress.examples_in_epoch += num_steps * G
            progress.epoch_steps += num_steps
            progress.epoch_loss_sum += float(to_host(losses))
            progress.epoch_accuracy_sum += float(to_host(accuracies))
            elapsed = time.perf_counter() - started
            if bar is not None:
                bar.update(num_steps)
                bar.set_postfix(loss=f"{progress.epoch_loss_sum / progress.epoch_steps:.4f}", refresh=False)
            if stop_agreed(run.state.mesh, run.config, stop.is_set()):
                progress.epoch_seconds += elapsed
                _save(run, progress)
                raise TrainingInterrupted(stop.signum or signal.SIGTERM, progress.step)  # type: ignore[attr-defined]
            every = run.config.checkpoint_every
            if every and progress.step // every > previous // every:
                _save(run, dataclasses.replace(progress, epoch_seconds=progress.epoch_seconds + elapsed))
    finally:
        if bar is not None:
            bar.close()
    progress.epoch_seconds += time.perf_counter() - started
    return progress.examples_in_epoch >= steps_per_epoch * G


def _end_epoch(run: _Run, validation: Split | None, progress: TrainProgress) -> None:
    """Validation, model selection, the metrics line, the checkpoint (in that order: a crash before the
    checkpoint drops the line on resume, and the epoch is recorded once when it is run again)."""
    steps = max(progress.epoch_steps, 1)
    record = {
        "epoch": progress.epoch + 1,
        "step": progress.step,
        "train_loss": progress.epoch_loss_sum / steps,
        "train_accuracy": progress.epoch_accuracy_sum / steps,
        "examples_per_second": steps * run.config.batch_size / progress.epoch_seconds if progress.epoch_seconds else None,
        "time": time.time(),
    }
    best = None
    if validation is not None:
        loss, accuracy = evaluate(run.state, run.batches, validation)
        record.update(validation_loss=loss, validation_accuracy=accuracy)
        improved = accuracy > progress.best_accuracy or (
            accuracy == progress.best_accuracy and loss < progress.best_loss)
        if improved:
            progress.best_accuracy, progress.best_loss, progress.best_step, progress.since_best = (
                accuracy, loss, progress.step, 0)
            best = {"epoch": record["epoch"], "step": progress.step, "validation_loss": loss,
                    "validation_accuracy": accuracy}
        else:
            progress.since_best += 1
        record["best"] = improved
    progress.start_epoch()
    run.report.epoch(record, run.config.learning_rate)
    _save(run, progress, best)
    if validation is not None and run.config.patience and progress.since_best >= run.config.patience \
            and progress.epoch < run.config.epochs:
        log.info("stopping early: no better validation accuracy for %d epoch(s); best %s", run.config.patience,
                 checkpoint_name(progress.best_step))


def _save(run: _Run, progress: TrainProgress, best: dict | None = None) -> None:
    run.state.progress.write(progress)
    run.store.save(progress.step, best)


def evaluate(state: TrainState, batches: Batches, split: Split) -> tuple[float, float]:
    """(mean loss, accuracy) of the model (inference mode) over a whole split."""
    iterator = batches.evaluation(split)
    loss_sum, correct = _sum_steps(state.eval_step, iterator, None)
    return float(to_host(loss_sum)) / len(split.texts), float(to_host(correct)) / len(split.texts)


def _sum_steps(step, iterator: Iterator, num_steps: int | None) -> tuple[tf.Tensor, tf.Tensor]:  # noqa: ANN001
    """Run `step` on the next `num_steps` batches (all when None); the sums of its two outputs.

    The sums stay on the mesh, so steps are dispatched back to back and the host waits once.
    """
    first = second = None
    for x, y in itertools.islice(iterator, num_steps):
        a, b = step(x, y)
        first, second = (a, b) if first is None else (first + a, second + b)
    return first, second


def _chosen_step(progress: TrainProgress) -> int:
    """The step of the checkpoint a run stands by: its best (by validation), else its latest."""
    return progress.best_step if progress.best_step >= 0 else progress.step


def _test(run: _Run, test: Split, progress: TrainProgress) -> TrainResult:
    """The test split, once, on the best checkpoint (the latest without a validation split).

    Which checkpoint comes from the mesh's progress variables, not from best.json or a directory
    listing: every client of a multi-client mesh must pick the same one, and only client 0 writes
    those files (another client may look before they are there)."""
    best = read_best(run.run_dir)
    step = _chosen_step(progress)
    checkpoint = checkpoint_name(step)
    done = read_test(run.run_dir)
    if done is not None and done["checkpoint"] == checkpoint:
        loss, accuracy = done["test_loss"], done["test_accuracy"]  # a finished run asked again
    else:
        if step != progress.step:  # the model holds the latest weights; the best came earlier
            model_only = tf.train.Checkpoint(model=run.state.model)
            restore_checkpoint(model_only, checkpoint_path(run.run_dir, checkpoint), partial=True)
        loss, accuracy = evaluate(run.state, run.batches, test)
        if run.store.chief:
            atomic_write_json(run.run_dir / TEST_FILE, {"checkpoint": checkpoint, "test_loss": loss,
                                                        "test_accuracy": accuracy, "examples": len(test.texts)})
        run.report.test(progress.step, loss, accuracy, checkpoint)
    return TrainResult(run.run_dir, progress.step, progress.epoch, checkpoint,
                       best.get("validation_accuracy") if best else None, loss, accuracy, run.report.history)


def _selected(run: _Run, progress: TrainProgress) -> TrainResult:
    """A run that only selects (the refit's first run): its best checkpoint and epoch, no test
    score. The epoch comes from the mesh's own progress variables, which every client holds alike
    (a client's metrics history may be partial: only client 0 writes the file it resumes from)."""
    best = read_best(run.run_dir) or {}
    best_epoch = progress.best_step // run.steps_per_epoch if progress.best_step > 0 else None
    checkpoint = checkpoint_name(_chosen_step(progress))
    return TrainResult(run.run_dir, progress.step, progress.epoch, checkpoint,
                       best.get("validation_accuracy"), None, None, run.report.history, best_epoch)


# -- signals and the mesh ------------------------------------------------------------------------


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """Turn SIGINT/SIGTERM into a flag the loop checks between steps (never mid-step or mid-save)."""
    stop = threading.Event()
    stop.signum = None  # type: ignore[attr-defined]
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, _frame):  # noqa: ANN001
        stop.signum = signum  # type: ignore[attr-defined]
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_agreed(mesh: dtensor.Mesh, config: TrainConfig, requested: bool) -> bool:
    """Whether any client was asked to stop.

    Saving a DTensor checkpoint is a collective, so all clients must stop after the same step:
    with several clients the flags are all-reduced once per call (a signal may reach one client
    only, or reach them between two of their checks). Each client's devices hold whole replicas
    of the leading `batch` dimension (`check_client_mesh`), so they all carry the same flag.
    """
    if config.num_clients == 1:
        return requested
    layout = dtensor.Layout.batch_sharded(mesh, mesh.dim_names[0], rank=1)
    flags = dtensor.pack([tf.constant([float(requested)])] * mesh.num_local_devices(), layout)
    return bool(to_host(tf.reduce_max(flags)) > 0)


def _with_device_count(config: TrainConfig, mesh: dtensor.Mesh | None) -> TrainConfig:
    """`config` with --devices 0 made concrete (the mesh's, or what 0 stands for on this host), so
    that the log and RUN_DIR/train_config.json say what ran."""
    if config.devices:
        return config
    if mesh is not None:
        devices = mesh.num_local_devices() * config.num_clients
    else:
        devices = config.device_count(0 if config.device_type == "CPU" else len(tf.config.list_physical_devices("GPU")))
    return dataclasses.replace(config, devices=devices)


def make_mesh(config: TrainConfig) -> dtensor.Mesh:
    """The run's mesh from --mesh/--strategy, --devices and the cluster flags."""
    dims = config.mesh_dims()
    jobs = tuple(j.strip() for j in (config.jobs or "").split(",") if j.strip())
    return meshlib.create_mesh(dims, config.devices, config.device_type, num_clients=config.num_clients,
                               client_id=config.client_id, jobs=jobs)

