"""What training changes, on the mesh: model, optimizer and progress; and the compiled steps.

`train_step` is a function of (state, batch): it reads a batch and updates the model and optimizer
variables, nothing else. Everything with outside effects (files, logs, signals) is in `trainer`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common.model import PARAMETERS, DTensorMLP, ModelConfig
from train.config import TrainConfig
from train.optim import make_optimizer

DECAYED = ("dense1_kernel", "dense2_kernel")
"""Parameters under weight decay: the kernels (not biases, not BatchNorm's scale and shift)."""


def to_host(value: tf.Tensor) -> np.ndarray:
    """A replicated DTensor's value as numpy (every device holds the same copy)."""
    return dtensor.unpack(value)[0].numpy()


@dataclasses.dataclass
class TrainProgress:
    """Where training is: the step, the epoch, the running sums of the epoch's loss and accuracy,
    and the model selection (best validation accuracy so far, its step, epochs since)."""

    step: int = 0
    epoch: int = 0
    examples_in_epoch: int = 0
    epoch_loss_sum: float = 0.0
    epoch_accuracy_sum: float = 0.0
    epoch_steps: int = 0
    epoch_seconds: float = 0.0
    best_accuracy: float = -1.0
    best_loss: float = 0.0
    best_step: int = -1
    since_best: int = 0

    def start_epoch(self) -> None:
        """The next epoch begins: its running sums start over."""
        self.epoch += 1
        self.examples_in_epoch = self.epoch_steps = 0
        self.epoch_loss_sum = self.epoch_accuracy_sum = self.epoch_seconds = 0.0


class Progress(tf.Module):
    """A TrainProgress as replicated DVariables, checkpointed with the weights so that a resume
    continues mid-epoch exactly."""

    FIELDS = {f.name: tf.int64 if f.type in (int, "int") else tf.float64 for f in dataclasses.fields(TrainProgress)}

    def __init__(self, mesh: dtensor.Mesh) -> None:
        super().__init__(name="progress")
        layout = dtensor.Layout.replicated(mesh, 0)
        for name, value in dataclasses.asdict(TrainProgress()).items():
            setattr(self, name, dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(value, self.FIELDS[name]), layout),
                                                  trainable=False, name=name))

    def read(self) -> TrainProgress:
        values = {}
        for name, dtype in self.FIELDS.items():
            value = to_host(getattr(self, name).read_value())
            values[name] = int(value) if dtype == tf.int64 else float(value)
        return TrainProgress(**values)

    def write(self, progress: TrainProgress) -> None:
        for name, value in dataclasses.asdict(progress).items():
            var = getattr(self, name)
            var.assign(dtensor.copy_to_mesh(tf.constant(value, self.FIELDS[name]), dtensor.fetch_layout(var)))


class TrainState:
    """Model, optimizer and progress on one mesh, with the compiled train and eval steps."""

    def __init__(self, model_config: ModelConfig, mesh: dtensor.Mesh, config: TrainConfig) -> None:
        self.mesh = mesh
        self.dropout = config.dropout
        self.model = DTensorMLP(model_config, mesh, seed=config.seed)
        self.optimizer = make_optimizer(
            config.optimizer, self.model.parameters, config.learning_rate, config.momentum,
            weight_decay=config.weight_decay, decay=[name in DECAYED for name in PARAMETERS],
        )
        self.progress = Progress(mesh)
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, progress=self.progress)
        layout = dtensor.Layout.replicated(mesh, 0)
        self._seed = dtensor.copy_to_mesh(tf.constant(config.seed, tf.int64), layout)

    @tf.function(autograph=False)  # no tensor-dependent Python control flow to convert
    def train_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """One optimizer step on a global batch; returns (mean loss, accuracy) of the batch."""
        step = self.progress.step.assign_add(1)  # also the dropout seed: reproducible, and new each step
        seed = tf.stack([self._seed, step])
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True, dropout=self.dropout, seed=seed)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        gradients = tape.gradient(loss, self.model.parameters)
        self.optimizer.apply(gradients, self.model.parameters)
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float32))
        return loss, accuracy

    @tf.function(autograph=False)
    def eval_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(sum of losses, number correct) over the real rows of a batch; padding rows have label -1."""
        real = tf.cast(y >= 0, tf.float32)
        y = tf.maximum(y, 0)
        logits = self.model(x, training=False)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        correct = tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float32)
        return tf.reduce_sum(losses * real), tf.reduce_sum(correct * real)
