"""SGD (with optional momentum) and Adam on DVariables, with decoupled weight decay (AdamW).

Keras 3 optimizers fail on DVariables, so the update is written by hand. Slot variables are
DVariables with their parameter's layout: each device updates only its own shard, no gathering.
They are attributes of a tf.Module, so they go into the same checkpoint as the weights.

Weight decay is decoupled from the gradient (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization"): `param -= learning_rate * weight_decay * param`, applied to the parameters
flagged in `decay` (the kernels; biases and BatchNorm's scale and shift are left alone).
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor


def _zeros_like(variable: tf.Variable, name: str) -> dtensor.DVariable:
    layout = dtensor.fetch_layout(variable)
    value = dtensor.call_with_layout(tf.zeros, layout, shape=variable.shape, dtype=variable.dtype)
    return dtensor.DVariable(value, trainable=False, name=name)


def _scalar(mesh: dtensor.Mesh, value: float | int, dtype: tf.DType, name: str) -> dtensor.DVariable:
    layout = dtensor.Layout.replicated(mesh, 0)
    return dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(value, dtype), layout), trainable=False, name=name)


def _decay(parameters: Sequence[tf.Variable], decay: Sequence[bool], rate: float) -> None:
    if rate:
        for param, flagged in zip(parameters, decay):
            if flagged:
                param.assign_sub(rate * param)


class SGD(tf.Module):
    def __init__(self, parameters: Sequence[tf.Variable], learning_rate: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, decay: Sequence[bool] = ()) -> None:
        super().__init__(name="sgd")
        self.learning_rate = learning_rate
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.decay = tuple(decay) or (True,) * len(parameters)
        self.velocity = [_zeros_like(p, f"velocity_{i}") for i, p in enumerate(parameters)] if momentum else []

    def apply(self, gradients: Sequence[tf.Tensor], parameters: Sequence[tf.Variable]) -> None:
        _decay(parameters, self.decay, self.learning_rate * self.weight_decay)
        if not self.momentum:
            for grad, param in zip(gradients, parameters):
                param.assign_sub(self.learning_rate * grad)
            return
        for grad, param, velocity in zip(gradients, parameters, self.velocity):
            velocity.assign(self.momentum * velocity - self.learning_rate * grad)
            param.assign_add(velocity)


class Adam(tf.Module):
    def __init__(
        self,
        parameters: Sequence[tf.Variable],
        learning_rate: float,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        weight_decay: float = 0.0,
        decay: Sequence[bool] = (),
    ) -> None:
        super().__init__(name="adam")
        self.learning_rate, self.beta_1, self.beta_2, self.epsilon = learning_rate, beta_1, beta_2, epsilon
        self.weight_decay = weight_decay
        self.decay = tuple(decay) or (True,) * len(parameters)
        self.mesh = dtensor.fetch_layout(parameters[0]).mesh
        self.iterations = _scalar(self.mesh, 0.0, tf.float32, "iterations")
        self.m = [_zeros_like(p, f"m_{i}") for i, p in enumerate(parameters)]
        self.v = [_zeros_like(p, f"v_{i}") for i, p in enumerate(parameters)]

    def apply(self, gradients: Sequence[tf.Tensor], parameters: Sequence[tf.Variable]) -> None:
        """One step with TensorFlow's fused kernel (`ResourceApplyAdam`, which DTensor runs on each
        device's shard): it reads the gradient and the three variables once and writes them once,
        where the same step in separate ops makes ~15 passes over the first kernel and its two slots
        (it matters where the update, not the first layer's matmul, bounds a step)."""
        _decay(parameters, self.decay, self.learning_rate * self.weight_decay)
        step = self.iterations.assign_add(1.0)
        # Bias correction from beta ** step, as Keras does (the kernel folds it into the step size).
        constants = {name: self._replicated(value) for name, value in (
            ("lr", self.learning_rate), ("beta1", self.beta_1), ("beta2", self.beta_2), ("epsilon", self.epsilon))}
        beta1_power, beta2_power = tf.pow(constants["beta1"], step), tf.pow(constants["beta2"], step)
        for grad, param, m, v in zip(gradients, parameters, self.m, self.v):
            tf.raw_ops.ResourceApplyAdam(var=param.handle, m=m.handle, v=v.handle, beta1_power=beta1_power,
                                         beta2_power=beta2_power, grad=grad, **constants)

    def _replicated(self, value: float) -> tf.Tensor:
        return dtensor.copy_to_mesh(tf.constant(value, tf.float32), dtensor.Layout.replicated(self.mesh, 0))


def make_optimizer(name: str, parameters: Sequence[tf.Variable], learning_rate: float, momentum: float = 0.0,
                   weight_decay: float = 0.0, decay: Sequence[bool] = ()):
    if name == "adam":
        return Adam(parameters, learning_rate, weight_decay=weight_decay, decay=decay)
    if name == "sgd":
        return SGD(parameters, learning_rate, momentum, weight_decay=weight_decay, decay=decay)
    raise ValueError(f"--optimizer must be adam or sgd, got {name!r}")
