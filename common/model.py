"""The sentiment MLP: Dense(max_tokens→hidden, relu) → BatchNorm → Dense(hidden→2).

Written on `tf.Module` with DVariables because Keras 3 layers and optimizers reject DTensor. The
forward math lives in `mlp_forward`, a function of plain tensors, used by the DTensor model in
training; export folds the trained values into `inference_weights` (BatchNorm's moving statistics
as one scale and shift) and serves `inference_logits`, the same function computed row by row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common.checkpoint import checkpoint_path, restore_checkpoint
from common.classes import CLASS_NAMES
from common.mesh import ModelLayouts
from common.model_config import NUM_CLASSES, ModelConfig
from common.run_dir import MODEL_FILE

__all__ = ["CLASS_NAMES", "NUM_CLASSES", "ModelConfig", "DTensorMLP", "SparseRows", "mlp_forward", "inference_weights",
           "inference_logits", "margin_attribution", "row_softmax", "initial_values", "restore_model"]

PARAMETERS = ("dense1_kernel", "dense1_bias", "bn_gamma", "bn_beta", "dense2_kernel", "dense2_bias")
"""Trainable variables, in the order gradients and optimizer slots use."""
STATISTICS = ("bn_moving_mean", "bn_moving_variance")
"""BatchNorm's moving statistics: updated in training, used (alone) at inference."""


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


def pre_activations(params: Mapping[str, tf.Tensor], x: tf.Tensor | tf.SparseTensor) -> tf.Tensor:
    """The first Dense layer before its ReLU. `x` may be sparse (serving: a review touches a few
    hundred of the vocabulary's n-grams) or dense (training batches on a mesh)."""
    if isinstance(x, tf.SparseTensor):
        product = tf.sparse.sparse_dense_matmul(x, params["dense1_kernel"])
    else:
        product = tf.matmul(x, params["dense1_kernel"])
    return product + params["dense1_bias"]


def hidden_activations(params: Mapping[str, tf.Tensor], x: tf.Tensor | tf.SparseTensor) -> tf.Tensor:
    """The first Dense layer with its ReLU (see `pre_activations`)."""
    return tf.nn.relu(pre_activations(params, x))


def mlp_head(
    params: Mapping[str, tf.Tensor],
    hidden: tf.Tensor,
    mean: tf.Tensor,
    variance: tf.Tensor,
    *,
    epsilon: float,
    dropout: float = 0.0,
    seed: tf.Tensor | None = None,
) -> tf.Tensor:
    """BatchNorm with the given statistics, dropout (training only: `dropout` > 0 with a
    stateless `seed` of shape [2]), then the output Dense layer: the logits."""
    normalized = (hidden - mean) * tf.math.rsqrt(variance + epsilon)
    normalized = normalized * params["bn_gamma"] + params["bn_beta"]
    if dropout:
        normalized = tf.nn.experimental.stateless_dropout(normalized, rate=dropout, seed=seed)
    return tf.matmul(normalized, params["dense2_kernel"]) + params["dense2_bias"]


def row_softmax(logits: tf.Tensor) -> tf.Tensor:
    """Probabilities from logits, the same in any batch: float32's `exp` differs by an ulp between
    SIMD lanes and the scalar tail (Eigen without oneDNN), so which lane a row lands in would
    show; in float64 those differences vanish when the result is rounded to float32."""
    return tf.cast(tf.nn.softmax(tf.cast(logits, tf.float64)), tf.float32)


def mlp_forward(params: Mapping[str, tf.Tensor], x: tf.Tensor, *, epsilon: float) -> tf.Tensor:
    """Inference logits for TF-IDF rows `x`, as training evaluates them.

    BatchNorm uses the moving statistics, so a review's prediction never depends on what else is
    in its batch (the DTensor tutorial's batch-statistics BatchNorm collapses on single reviews).
    Serving computes the same function from `inference_weights` (`inference_logits`).
    """
    return mlp_head(
        params,
        hidden_activations(params, x),
        params["bn_moving_mean"],
        params["bn_moving_variance"],
        epsilon=epsilon,
    )


def inference_weights(weights: Mapping[str, np.ndarray], epsilon: float) -> dict[str, np.ndarray]:
    """The trained values in the form a served call uses: BatchNorm with its moving statistics
    folded into one scale and one shift per hidden unit (computed in float64, rounded once), and
    the output kernel as rows, one per class (`inference_logits` sums along them). Besides the
    first kernel every value is tiny; an exported graph holds them as constants, so TensorFlow
    reads no variable and runs no BatchNorm arithmetic or transpose for them on every call
    (about 30 us of a 0.45 ms batch-1 call on 2 cores)."""
    gamma, beta, mean, variance = (np.asarray(weights[k], np.float64) for k in
                                   ("bn_gamma", "bn_beta", "bn_moving_mean", "bn_moving_variance"))
    scale = gamma / np.sqrt(variance + epsilon)
    return {
        "dense1_kernel": np.asarray(weights["dense1_kernel"], np.float32),
        "dense1_bias": np.asarray(weights["dense1_bias"], np.float32),
        "bn_scale": scale.astype(np.float32),
        "bn_shift": (beta - mean * scale).astype(np.float32),
        "dense2_rows": np.ascontiguousarray(np.asarray(weights["dense2_kernel"], np.float32).T),
        "dense2_bias": np.asarray(weights["dense2_bias"], np.float32),
    }


def inference_logits(weights: Mapping[str, tf.Tensor], x: tf.SparseTensor) -> tf.Tensor:
    """The logits of TF-IDF rows `x` from `inference_weights`, each row computed on its own.

    The output layer is an elementwise product and a sum over the innermost axis, not a GEMM: a
    GEMM (oneDNN's or Eigen's) blocks its sums by the batch's size, so a review's logits would
    change in the last bit with what else was in its batch (measured with ONEDNN_MAX_CPU_ISA=AVX2:
    229 of 240 reviews). Elementwise products are exact IEEE operations in any SIMD lane, and a
    sum over the innermost axis runs the same code for every row. Training keeps the GEMM
    (`mlp_forward`: faster on large batches, sharded on a mesh)."""
    return _inference_head(weights, hidden_activations(weights, x))


def _inference_head(weights: Mapping[str, tf.Tensor], hidden: tf.Tensor) -> tf.Tensor:
    """BatchNorm (folded) and the output layer, row by row (see `inference_logits`)."""
    normalized = hidden * weights["bn_scale"] + weights["bn_shift"]
    products = normalized[:, tf.newaxis, :] * weights["dense2_rows"][tf.newaxis]
    return tf.reduce_sum(products, axis=-1) + weights["dense2_bias"]


def margin_attribution(
    weights: Mapping[str, tf.Tensor], x: tf.SparseTensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The logits of `x` (as `inference_logits` computes them, from the same first-layer product)
    and how much each feature cell adds to its row's predicted-class margin, the log-odds
    `logit[predicted] - logit[other]` (so `sigmoid(margin)` is the predicted class's probability),
    from `inference_weights`.

    At inference the model is piecewise linear: with the ReLU pattern of a review fixed, BatchNorm
    (moving statistics) and both Dense layers are affine, so the margin is exactly
    `sum_i x_i * dmargin/dx_i + bias`, the gradient x input of every cell plus a bias that no
    n-gram accounts for (the layers' biases and BatchNorm's shift, through the same ReLU pattern).
    Returns (the logits; one contribution per cell of `x`, in its order; the bias of each row).
    Computed in closed form with elementwise products and innermost sums only, so, like the forward
    pass, a row's values do not depend on its batch.
    """
    rows, columns = x.indices[:, 0], x.indices[:, 1]
    pre_activation = pre_activations(weights, x)
    logits = _inference_head(weights, tf.nn.relu(pre_activation))  # the first layer's product, once
    active = tf.cast(pre_activation > 0, tf.float32)
    scale = weights["bn_scale"]
    predicted = tf.argmax(logits, axis=1)
    kernel = weights["dense2_rows"]  # [classes, hidden]
    direction = tf.gather(kernel, predicted) - tf.gather(kernel, 1 - predicted)  # [batch, hidden]
    per_unit = direction * active * scale  # d margin / d pre-activation
    gradient = tf.reduce_sum(tf.gather(weights["dense1_kernel"], columns) * tf.gather(per_unit, rows), axis=-1)
    shift = active * scale * weights["dense1_bias"] + weights["bn_shift"]
    output_bias = tf.gather(weights["dense2_bias"], predicted) - tf.gather(weights["dense2_bias"], 1 - predicted)
    return logits, x.values * gradient, tf.reduce_sum(direction * shift, axis=-1) + output_bias


class SparseRows(NamedTuple):
    """A training batch's TF-IDF rows for a sparse kernel gradient: `transposed` [width, batch], a
    packed sparse DTensor laid out [feature, batch], and `rows` [batch, width] laid out like
    dense inputs (sparse or dense), or None where the mesh cannot take them sparse.

    DTensor expands a MatMul whose left operand is a packed SparseTensor into a sparse product per
    device, but the tape's gradient of the kernel, `matmul(x, dy, transpose_a=True)`, would turn x
    dense; with the transposed rows as a left operand of their own the kernel's gradient is a
    sparse product too, and the step costs what the batch's n-grams cost, not the vocabulary width.
    Without `rows` the forward product is `matmul(transposed, kernel, transpose_a=True)`, which
    DTensor computes from the transposed rows made dense on each device (in canonical order, which
    that needs): the host then never builds or copies a dense batch.
    """

    rows: tf.Tensor | None
    transposed: tf.Tensor


def sparse_first_layer(params: Mapping[str, tf.Tensor], x: SparseRows) -> tf.Tensor:
    """`hidden_activations` of `SparseRows` on a mesh, the kernel's gradient as `transposed · dy`."""

    def forward(kernel: tf.Tensor) -> tf.Tensor:
        if x.rows is None:
            return tf.matmul(x.transposed, kernel, transpose_a=True)
        return tf.matmul(x.rows, kernel)

    @tf.custom_gradient
    def product(kernel: tf.Tensor):  # custom_gradient: (the value, its gradient function)
        return forward(kernel), lambda upstream: tf.matmul(x.transposed, upstream)

    return tf.nn.relu(product(params["dense1_kernel"].read_value()) + params["dense1_bias"])


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

    def __call__(self, x: tf.Tensor | SparseRows, training: bool = False, dropout: float = 0.0,
                 seed: tf.Tensor | None = None) -> tf.Tensor:
        """Logits of dense rows, of packed sparse rows (a DTensor: DTensor multiplies it sparsely),
        or of `SparseRows`. Training normalises with the batch's statistics (updating the moving
        ones) and applies `dropout` with the stateless `seed`; inference uses the moving statistics only."""
        params = self.params()
        if not training:
            return mlp_forward(params, x.rows if isinstance(x, SparseRows) else x, epsilon=self.config.bn_epsilon)
        hidden = sparse_first_layer(params, x) if isinstance(x, SparseRows) else hidden_activations(params, x)
        mean, variance = tf.nn.moments(hidden, axes=[0])
        momentum = self.config.bn_momentum
        self.bn_moving_mean.assign(momentum * self.bn_moving_mean + (1.0 - momentum) * mean)
        self.bn_moving_variance.assign(
            momentum * self.bn_moving_variance + (1.0 - momentum) * variance
        )
        return mlp_head(params, hidden, mean, variance, epsilon=self.config.bn_epsilon, dropout=dropout, seed=seed)

    def numpy_weights(self) -> dict[str, np.ndarray]:
        """Global (unsharded) values of every variable, gathered to the host."""
        out = {}
        for name, var in self.params().items():
            value = var.read_value()
            replicated = dtensor.relayout(value, dtensor.Layout.replicated(self.mesh, value.shape.rank))
            out[name] = dtensor.unpack(replicated)[0].numpy()
        return out


def restore_model(run_dir: Path, mesh: dtensor.Mesh, checkpoint: str | None = "best") -> DTensorMLP:
    """Rebuild the model from a run directory and restore a checkpoint onto `mesh`: the best one,
    `latest`, or one by name (`ckpt-40`). Checkpoints restore exactly on any mesh."""
    run_dir = Path(run_dir)
    path = checkpoint_path(run_dir, checkpoint)
    model = DTensorMLP(ModelConfig.load(run_dir / MODEL_FILE), mesh)
    restore_checkpoint(tf.train.Checkpoint(model=model), path, partial=True)
    return model
