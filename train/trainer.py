"""The training loop: data onto the mesh, the train step, evaluation, checkpoints, progress.

The step itself (`TrainState.train_step`) only reads a batch and updates model/optimizer state;
everything with side effects on the outside world (files, logs, signals) lives in `train()`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common import mesh as meshlib
from common.model import DTensorMLP, ModelConfig
from common.vectorizer import VOCABULARY_FILE, adapt_vectorizer, load_vectorizer, save_vectorizer, vectorize
from train.config import TrainConfig
from train.data import SentimentData, load_data
from train.optim import make_optimizer

log = logging.getLogger(__name__)

MODEL_FILE = "model.json"
CONFIG_FILE = "train_config.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"


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
    test_loss: float
    test_accuracy: float
    history: list[dict]


def to_host(value: tf.Tensor) -> np.ndarray:
    """A replicated DTensor's value as numpy (every device holds the same copy)."""
    return dtensor.unpack(value)[0].numpy()


class Progress(tf.Module):
    """Where training is: checkpointed with the weights so resume continues mid-epoch."""

    def __init__(self, mesh: dtensor.Mesh) -> None:
        super().__init__(name="progress")
        layout = dtensor.Layout.replicated(mesh, 0)

        def counter(name: str) -> dtensor.DVariable:
            return dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(0, tf.int64), layout), trainable=False, name=name)

        self.step = counter("step")
        self.epoch = counter("epoch")
        self.examples_in_epoch = counter("examples_in_epoch")

    def read(self) -> tuple[int, int, int]:
        return tuple(int(to_host(v.read_value())) for v in (self.step, self.epoch, self.examples_in_epoch))

    def set(self, step: int, epoch: int, examples_in_epoch: int) -> None:
        for var, value in ((self.step, step), (self.epoch, epoch), (self.examples_in_epoch, examples_in_epoch)):
            var.assign(dtensor.copy_to_mesh(tf.constant(value, tf.int64), dtensor.fetch_layout(var)))


class TrainState:
    """Model, optimizer and progress on one mesh, with the compiled train and eval steps."""

    def __init__(self, model_config: ModelConfig, mesh: dtensor.Mesh, config: TrainConfig) -> None:
        self.mesh = mesh
        self.model = DTensorMLP(model_config, mesh, seed=config.seed)
        self.optimizer = make_optimizer(
            config.optimizer, self.model.parameters, config.learning_rate, config.momentum
        )
        self.progress = Progress(mesh)
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, progress=self.progress)

    @tf.function
    def train_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """One optimizer step on a global batch; returns (mean loss, accuracy) of the batch."""
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        gradients = tape.gradient(loss, self.model.parameters)
        self.optimizer.apply(gradients, self.model.parameters)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float32))
        return loss, accuracy

    @tf.function
    def eval_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(sum of losses, number correct) over the real rows of a batch; padding rows have label -1.

        Padding is marked in the labels because DTensorDataset fails on a third component.
        """
        real = tf.cast(y >= 0, tf.float32)
        y = tf.maximum(y, 0)
        logits = self.model(x, training=False)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float32)
        return tf.reduce_sum(losses * real), tf.reduce_sum(correct * real)

    @tf.function
    def train_steps(self, iterator, num_steps: int) -> tuple[tf.Tensor, tf.Tensor]:
        """`num_steps` train steps in one call (sums of batch losses and accuracies).

        Looping inside the graph removes the per-step Python dispatch, which on a mesh of
        virtual devices costs several times the step itself. `num_steps` is a Python int, so each
        distinct value traces once (in practice: steps_per_call and one remainder).
        """
        loss_sum = acc_sum = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            loss, accuracy = self.train_step(x, y)
            loss_sum += loss
            acc_sum += accuracy
        return loss_sum, acc_sum

    @tf.function
    def eval_steps(self, iterator, num_steps: int) -> tuple[tf.Tensor, tf.Tensor]:
        loss_sum = correct = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            batch_loss, batch_correct = self.eval_step(x, y)
            loss_sum += batch_loss
            correct += batch_correct
        return loss_sum, correct


def mesh_iterator(
    mesh: dtensor.Mesh, arrays: tuple[np.ndarray, np.ndarray], layouts: tuple, global_batch: int, config: TrainConfig
) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
    """An iterator of global batches of `arrays` as DTensors on the mesh.

    DTensorDataset gives each device only its own shard, with no Python split+pack per step. In
    multi-client mode it only splits among this client's devices, so each client first takes its
    interleaved share of rows; the global batch is then the same set of rows a single process uses.
    Callers take exactly len/global_batch batches: on TF 2.21, running a DTensorDataset iterator
    to its end poisons the eager executor and every later DTensorDataset fails with CancelledError.
    """
    ds = tf.data.Dataset.from_tensor_slices(arrays)
    if config.num_clients > 1:
        ds = ds.shard(config.num_clients, config.client_id)
    dds = dtensor.DTensorDataset(
        dataset=ds,
        mesh=mesh,
        layouts=layouts,
        global_batch_size=global_batch,
        batch_dim=meshlib.BATCH if meshlib.BATCH in mesh.dim_names else None,
        prefetch=2,
    )
    return iter(dds)


def chunks(total: int, size: int) -> Iterator[int]:
    """Split `total` steps into calls of at most `size` steps."""
    while total > 0:
        yield min(size, total)
        total -= size


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled row order of one epoch: a pure function of (seed, epoch), so resume can replay it."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def _atomic_write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def has_checkpoint(run_dir: Path) -> bool:
    return tf.train.latest_checkpoint(str(run_dir / CHECKPOINT_DIR)) is not None


def _prepare_vocabulary(config: TrainConfig, run_dir: Path, data: SentimentData, resuming: bool):
    model_config = config.model_config()
    if resuming:
        saved = ModelConfig.load(run_dir / MODEL_FILE)
        if saved != model_config:
            raise TrainingError(
                f"--run-dir {run_dir} holds a model with {saved}, but this run asks for {model_config}; "
                "use the same --max-tokens/--hidden/--bn-momentum or a new --run-dir"
            )
        return load_vectorizer(run_dir), model_config
    vectorizer = adapt_vectorizer(data.train.texts, config.max_tokens)
    if config.client_id == 0:
        save_vectorizer(vectorizer, run_dir)
        model_config.save(run_dir / MODEL_FILE)
        _atomic_write_json(run_dir / CONFIG_FILE, dataclasses.asdict(config))
    return vectorizer, model_config


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


def build_mesh(config: TrainConfig) -> dtensor.Mesh:
    """The run's mesh: this process's devices, or one mesh over every client's (num_clients > 1).

    Multi-client (DESIGN.md): the DTENSOR_* variables are set from the config, DTensor's runtime is
    started with `devices / num_clients` devices in this process, and `create_distributed_mesh`
    numbers devices client by client. Each client feeds its own interleaved share of every batch
    (`mesh_iterator`), so every batch replica must live on one client (`check_client_mesh`).
    """
    from train.launch import ClusterError, check_client_mesh, export_cluster_env

    dims = meshlib.resolve_mesh_dims(config.mesh, config.strategy, config.devices)
    try:
        export_cluster_env(config.num_clients, config.client_id, config.jobs)
    except ClusterError as exc:
        raise meshlib.MeshError(str(exc)) from None
    if config.num_clients == 1:
        device_type = meshlib.configure_devices(config.devices, config.device_type)
        return meshlib.build_mesh(dims, device_type)

    n = config.num_clients
    try:
        check_client_mesh(dims, config.devices, n)
    except ClusterError as exc:
        raise meshlib.MeshError(str(exc)) from None
    per_client = config.devices // n
    gpus = tf.config.list_physical_devices("GPU")
    device_type = "GPU" if config.device_type == "GPU" or (config.device_type == "auto" and gpus) else "CPU"
    if device_type == "GPU":
        if len(gpus) < per_client:
            raise meshlib.MeshError(
                f"--devices {config.devices} on {n} clients needs {per_client} GPU(s) per client, this one sees {len(gpus)}"
            )
        # The first GPUs this process sees; clients sharing a host need their own CUDA_VISIBLE_DEVICES.
        tf.config.set_visible_devices(gpus[:per_client], "GPU")
    try:
        dtensor.initialize_accelerator_system(
            device_type, num_logical_cpu_devices=per_client if device_type == "CPU" else None
        )
    except ValueError as exc:
        if "already been initialized" not in str(exc) or "Accelerator" not in str(exc):
            raise meshlib.MeshError(
                f"multi-client training must start DTensor before TensorFlow runs anything; run it in a "
                f"fresh process ({exc})"
            ) from None
        # DTensor already started in this process (a second train() call): reuse it.
    if dtensor.num_clients() != n or dtensor.num_local_devices(device_type) != per_client:
        raise meshlib.MeshError(
            f"this process already runs {dtensor.num_clients()} client(s) x "
            f"{dtensor.num_local_devices(device_type)} {device_type} device(s), not {n} x {per_client}"
        )
    return dtensor.create_distributed_mesh(dims, device_type=device_type)


def train(config: TrainConfig, mesh: dtensor.Mesh | None = None) -> TrainResult:
    """Train (or resume) per `config`; checkpoints, vocabulary and metrics go to `config.run_dir`."""
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = mesh or build_mesh(config)
    meshlib.check_divisible(mesh, batch_size=config.batch_size, max_tokens=config.max_tokens, hidden=config.hidden)

    resuming = has_checkpoint(run_dir)
    if resuming and not config.resume:
        raise TrainingError(f"--run-dir {run_dir} already has checkpoints; pass --resume or pick a new --run-dir")
    if resuming and not (run_dir / VOCABULARY_FILE).exists():
        raise TrainingError(f"{run_dir / VOCABULARY_FILE} is missing: cannot resume without the vocabulary")

    data = load_data(
        config.data,
        text_field=config.text_field,
        label_field=config.label_field,
        test_fraction=config.test_fraction,
        seed=config.seed,
        limit=config.limit,
    )
    log.info("data: %s (%d train, %d test)", data.source, len(data.train.texts), len(data.test.texts))
    if len(data.train.texts) < config.batch_size:
        raise TrainingError(
            f"--batch-size {config.batch_size} is larger than the {len(data.train.texts)} training examples"
        )
    vectorizer, model_config = _prepare_vocabulary(config, run_dir, data, resuming)
    train_x = vectorize(vectorizer, data.train.texts)
    train_y = data.train.labels.astype(np.int64)
    test_x = vectorize(vectorizer, data.test.texts)
    test_y = data.test.labels.astype(np.int64)

    state = TrainState(model_config, mesh, config)
    manager = tf.train.CheckpointManager(
        state.checkpoint, str(run_dir / CHECKPOINT_DIR), max_to_keep=config.keep_checkpoints
    )
    if resuming:
        state.checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        log.info("resumed from %s", manager.latest_checkpoint)
    step, epoch, examples_in_epoch = state.progress.read()

    G = config.batch_size
    layouts = state.model.layouts
    steps_per_epoch = len(train_y) // G
    history: list[dict] = []
    metrics_path = run_dir / METRICS_FILE
    is_chief = config.client_id == 0
    show_progress = config.progress and is_chief
    log.info(
        "mesh %s on %d %s device(s); %d steps/epoch, batch %d",
        ",".join(f"{n}={mesh.dim_size(n)}" for n in mesh.dim_names), mesh.num_local_devices() * config.num_clients,
        mesh.device_type(), steps_per_epoch, G,
    )

    def save() -> None:
        state.progress.set(step, epoch, examples_in_epoch)
        manager.save(checkpoint_number=step)

    def evaluate() -> tuple[float, float]:
        padded = -(-len(test_y) // G) * G
        pad = padded - len(test_y)
        xs = np.concatenate([test_x, np.zeros((pad, test_x.shape[1]), np.float32)])
        ys = np.concatenate([test_y, np.full(pad, -1, np.int64)])
        loss_sum = correct = 0.0
        iterator = mesh_iterator(mesh, (xs, ys), (layouts.inputs, layouts.labels), G, config)
        for num_steps in chunks(padded // G, config.steps_per_call):
            batch_loss, batch_correct = state.eval_steps(iterator, num_steps)
            loss_sum += float(to_host(batch_loss))
            correct += float(to_host(batch_correct))
        return loss_sum / len(test_y), correct / len(test_y)

    with _stop_on_signals() as stop:
        while epoch < config.epochs and not _done(step, config):
            order = epoch_order(len(train_y), config.seed, epoch)
            start_batch = examples_in_epoch // G
            rows = order[start_batch * G : steps_per_epoch * G]
            iterator = mesh_iterator(mesh, (train_x[rows], train_y[rows]), (layouts.inputs, layouts.labels), G, config)
            bar = _progress_bar(show_progress, steps_per_epoch, start_batch, epoch, config.epochs)
            loss_sum = acc_sum = 0.0
            seen = 0
            started = time.perf_counter()
            todo = len(rows) // G
            if config.max_steps is not None:
                todo = min(todo, config.max_steps - step)
            for num_steps in chunks(todo, config.steps_per_call):
                losses, accuracies = state.train_steps(iterator, num_steps)
                loss_sum += float(to_host(losses))
                acc_sum += float(to_host(accuracies))
                previous_step, step, seen = step, step + num_steps, seen + num_steps
                examples_in_epoch += num_steps * G
                if bar is not None:
                    bar.update(num_steps)
                    bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{acc_sum / seen:.3f}", refresh=False)
                if stop_agreed(mesh, config, stop.is_set()):
                    save()
                    if bar is not None:
                        bar.close()
                    raise TrainingInterrupted(stop.signum or signal.SIGTERM, step)  # type: ignore[attr-defined]
                every = config.checkpoint_every
                if every and step // every > previous_step // every:
                    save()
            elapsed = time.perf_counter() - started
            if bar is not None:
                bar.close()
            finished_epoch = examples_in_epoch >= steps_per_epoch * G
            if finished_epoch:
                epoch += 1
                examples_in_epoch = 0
            test_loss, test_accuracy = evaluate()
            record = {
                "epoch": epoch,
                "step": step,
                "train_loss": loss_sum / max(seen, 1),
                "train_accuracy": acc_sum / max(seen, 1),
                "test_loss": test_loss,
                "test_accuracy": test_accuracy,
                "examples_per_second": seen * G / elapsed if elapsed > 0 else None,
                "time": time.time(),
            }
            history.append(record)
            if is_chief:
                with metrics_path.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
            log.info(
                "epoch %d step %d train_loss %.4f train_acc %.4f test_loss %.4f test_acc %.4f",
                epoch, step, record["train_loss"], record["train_accuracy"], test_loss, test_accuracy,
            )
            save()

    if not history:  # nothing left to do (already finished): report the restored model
        test_loss, test_accuracy = evaluate()
    else:
        test_loss, test_accuracy = history[-1]["test_loss"], history[-1]["test_accuracy"]
    return TrainResult(run_dir, step, epoch, test_loss, test_accuracy, history)


def _done(step: int, config: TrainConfig) -> bool:
    return config.max_steps is not None and step >= config.max_steps


def _progress_bar(enabled: bool, total: int, initial: int, epoch: int, epochs: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{epochs}", unit="step", dynamic_ncols=True)


def checkpoint_path(run_dir: Path, checkpoint: str | None = None) -> str:
    """The checkpoint prefix to restore: the latest one, or `checkpoint` (e.g. "ckpt-40") by name."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if checkpoint is None:
        latest = tf.train.latest_checkpoint(str(directory))
        if latest is None:
            raise TrainingError(f"no checkpoint in {directory}")
        return latest
    prefix = directory / checkpoint
    if not Path(f"{prefix}.index").exists():
        raise TrainingError(f"checkpoint {checkpoint!r} not found: no {prefix}.index")
    return str(prefix)


def restore_model(run_dir: Path, mesh: dtensor.Mesh, checkpoint: str | None = None) -> DTensorMLP:
    """Rebuild the model from a run directory and restore a checkpoint onto `mesh`.

    The latest checkpoint unless `checkpoint` names one (a prefix in run_dir/checkpoints, e.g. "ckpt-40").
    """
    run_dir = Path(run_dir)
    path = checkpoint_path(run_dir, checkpoint)
    model = DTensorMLP(ModelConfig.load(run_dir / MODEL_FILE), mesh)
    tf.train.Checkpoint(model=model).restore(path).expect_partial()
    return model
