"""The sentiment MLP: Dense(max_tokens→hidden, relu) → BatchNorm → Dense(hidden→2).

Written on `tf.Module` with DVariables because Keras 3 layers and optimizers reject DTensor. The
forward math lives in `mlp_forward`, a function of plain tensors, so the DTensor model used in
training and the plain-variable model written by export compute exactly the same thing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common.classes import CLASS_NAMES
from common.mesh import ModelLayouts

NUM_CLASSES = len(CLASS_NAMES)

PARAMETERS = ("dense1_kernel", "dense1_bias", "bn_gamma", "bn_beta", "dense2_kernel", "dense2_bias")
"""Trainable variables, in the order gradients and optimizer slots use."""
STATISTICS = ("bn_moving_mean", "bn_moving_variance")
"""BatchNorm's moving statistics: updated in training, used (alone) at inference."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild the model; saved beside the checkpoint as model.json."""

    max_tokens: int = 1200
    """TF-IDF vocabulary size = input width (fixed: pad_to_max_tokens)."""
    hidden: int = 64
    """Units of the hidden Dense layer."""
    bn_momentum: float = 0.9
    """Moving-statistics momentum of BatchNorm (Keras uses 0.99; small corpora want faster)."""
    bn_epsilon: float = 1e-3
    """Added to the variance before the square root."""

    def __post_init__(self) -> None:
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {self.max_tokens}")
        if self.hidden < 1:
            raise ValueError(f"hidden must be at least 1, got {self.hidden}")
        if not 0.0 <= self.bn_momentum < 1.0:
            raise ValueError(f"bn_momentum must be in [0, 1), got {self.bn_momentum}")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelConfig":
        values = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "dense1_kernel": (self.max_tokens, self.hidden),
            "dense1_bias": (self.hidden,),
            "bn_gamma": (self.hidden,),
            "bn_beta": (self.hidden,),
            "bn_moving_mean": (self.hidden,),
            "bn_moving_variance": (self.hidden,),
            "dense2_kernel": (self.hidden, NUM_CLASSES),
            "dense2_bias": (NUM_CLASSES,),
        }


def initial_values(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Glorot-uniform kernels and Keras' other defaults, drawn on the host.

    Drawing on the host (not with a sharded stateless op) gives identical starting weights on
    every mesh for the same seed, which is what makes runs on different meshes comparable.
    """
    rng = np.random.default_rng(seed)

    def glorot(fan_in: int, fan_out: int) -> np.ndarray:
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)

    h = config.hidden
    return {
        "dense1_kernel": glorot(config.max_tokens, h),
        "dense1_bias": np.zeros(h, np.float32),
        "bn_gamma": np.ones(h, np.float32),
        "bn_beta": np.zeros(h, np.float32),
        "bn_moving_mean": np.zeros(h, np.float32),
        "bn_moving_variance": np.ones(h, np.float32),
        "dense2_kernel": glorot(h, NUM_CLASSES),
        "dense2_bias": np.zeros(NUM_CLASSES, np.float32),
    }


def hidden_activations(params: Mapping[str, tf.Tensor], x: tf.Tensor) -> tf.Tensor:
    """The first Dense layer with its ReLU."""
    return tf.nn.relu(tf.matmul(x, params["dense1_kernel"]) + params["dense1_bias"])


def mlp_head(
    params: Mapping[str, tf.Tensor],
    hidden: tf.Tensor,
    mean: tf.Tensor,
    variance: tf.Tensor,
    *,
    epsilon: float,
) -> tf.Tensor:
    """BatchNorm with the given statistics, then the output Dense layer: the logits."""
    normalized = (hidden - mean) * tf.math.rsqrt(variance + epsilon)
    normalized = normalized * params["bn_gamma"] + params["bn_beta"]
    return tf.matmul(normalized, params["dense2_kernel"]) + params["dense2_bias"]


def mlp_forward(params: Mapping[str, tf.Tensor], x: tf.Tensor, *, epsilon: float) -> tf.Tensor:
    """Inference logits for TF-IDF rows `x`.

    BatchNorm uses the moving statistics, so a review's prediction never depends on what else is
    in its batch (the DTensor tutorial's batch-statistics BatchNorm collapses on single reviews).
    """
    return mlp_head(
        params,
        hidden_activations(params, x),
        params["bn_moving_mean"],
        params["bn_moving_variance"],
        epsilon=epsilon,
    )


def variable_layouts(layouts: ModelLayouts) -> dict[str, dtensor.Layout]:
    return {
        "dense1_kernel": layouts.dense1_kernel,
        "dense1_bias": layouts.hidden,
        "bn_gamma": layouts.hidden,
        "bn_beta": layouts.hidden,
        "bn_moving_mean": layouts.hidden,
        "bn_moving_variance": layouts.hidden,
        "dense2_kernel": layouts.dense2_kernel,
        "dense2_bias": layouts.replicated1,
    }


def to_mesh(value: np.ndarray | tf.Tensor, layout: dtensor.Layout) -> tf.Tensor:
    """Place a host value on a mesh with `layout` (replicate, then slice locally: no comms)."""
    replicated = dtensor.copy_to_mesh(
        tf.convert_to_tensor(value), dtensor.Layout.replicated(layout.mesh, layout.rank)
    )
    return dtensor.relayout(replicated, layout)


class DTensorMLP(tf.Module):
    """The MLP's variables as DVariables laid out on a mesh; checkpoint-compatible across meshes.

    Variable names (attribute names) are the checkpoint keys, so a checkpoint written on one mesh
    restores on any other: `tf.train.Checkpoint` reads each variable by its target layout.
    """

    def __init__(self, config: ModelConfig, mesh: dtensor.Mesh, seed: int = 0) -> None:
        super().__init__(name="sentiment_mlp")
        self.config = config
        self.mesh = mesh
        self.layouts = ModelLayouts.for_mesh(mesh)
        var_layouts = variable_layouts(self.layouts)
        for name, value in initial_values(config, seed).items():
            trainable = name in PARAMETERS
            setattr(
                self,
                name,
                dtensor.DVariable(to_mesh(value, var_layouts[name]), trainable=trainable, name=name),
            )

    @property
    def parameters(self) -> list[tf.Variable]:
        return [getattr(self, name) for name in PARAMETERS]

    def params(self) -> dict[str, tf.Variable]:
        return {name: getattr(self, name) for name in PARAMETERS + STATISTICS}

    def __call__(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        params = self.params()
        if not training:
            return mlp_forward(params, x, epsilon=self.config.bn_epsilon)
        hidden = hidden_activations(params, x)
        mean, variance = tf.nn.moments(hidden, axes=[0])
        momentum = self.config.bn_momentum
        self.bn_moving_mean.assign(momentum * self.bn_moving_mean + (1.0 - momentum) * mean)
        self.bn_moving_variance.assign(
            momentum * self.bn_moving_variance + (1.0 - momentum) * variance
        )
        return mlp_head(params, hidden, mean, variance, epsilon=self.config.bn_epsilon)

    def numpy_weights(self) -> dict[str, np.ndarray]:
        """Global (unsharded) values of every variable, gathered to the host."""
        out = {}
        for name, var in self.params().items():
            value = var.read_value()
            replicated = dtensor.relayout(value, dtensor.Layout.replicated(self.mesh, value.shape.rank))
            out[name] = dtensor.unpack(replicated)[0].numpy()
        return out
