"""Devices, meshes and layouts shared by training and export.

DTensor needs its devices configured before TensorFlow runs any op, and a mesh over devices that
do not exist crashes (tensorflow#106304), so every entry point calls `configure_devices` first and
every mesh is built over devices we know are there.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Literal

import tensorflow as tf
from tensorflow.experimental import dtensor

log = logging.getLogger(__name__)

BATCH, FEATURE, MODEL = "batch", "feature", "model"
"""Mesh dimension names the model knows how to shard over; other names are replicated."""

Strategy = Literal["data", "model", "spatial"]
STRATEGIES: tuple[str, ...] = ("data", "model", "spatial")
DeviceType = Literal["auto", "CPU", "GPU"]

MeshDims = list[tuple[str, int]]


class MeshError(ValueError):
    """A mesh, strategy or device request that cannot be satisfied; the message names the flag."""


def configure_devices(num_devices: int, device_type: DeviceType = "auto") -> str:
    """Make `num_devices` devices of one type visible to DTensor; return the type used.

    GPUs are used when present (unless CPU is asked for); otherwise the host CPU is split into
    virtual devices. Safe to call again in the same process: the first configuration stays and a
    later call only checks that enough devices exist (virtual devices cannot change once TF runs).
    """
    if num_devices < 1:
        raise MeshError(f"--devices must be at least 1, got {num_devices}")
    gpus = tf.config.list_physical_devices("GPU")
    if device_type == "GPU" and not gpus:
        raise MeshError("--device-type GPU was asked for but TensorFlow sees no GPU")
    if device_type != "CPU" and gpus:
        if num_devices > len(gpus):
            raise MeshError(f"--devices {num_devices} but only {len(gpus)} GPU(s) are visible")
        return "GPU"
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
        )
    except RuntimeError:
        pass  # TensorFlow already initialised: keep what exists, checked below.
    available = len(tf.config.list_logical_devices("CPU"))
    if available < num_devices:
        raise MeshError(
            f"--devices {num_devices} but this process already has {available} CPU device(s); "
            "devices are fixed once TensorFlow starts, so run in a fresh process"
        )
    return "CPU"


_DIM_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*$")


def parse_mesh(spec: str) -> MeshDims:
    """Parse `"batch=4,model=2"` into `[("batch", 4), ("model", 2)]`."""
    dims: MeshDims = []
    for part in spec.split(","):
        match = _DIM_RE.match(part)
        if not match:
            raise MeshError(f"--mesh {spec!r}: expected NAME=SIZE[,NAME=SIZE...], got {part!r}")
        name, size = match.group(1), int(match.group(2))
        if size < 1:
            raise MeshError(f"--mesh {spec!r}: dimension {name!r} must have size >= 1")
        if any(name == existing for existing, _ in dims):
            raise MeshError(f"--mesh {spec!r}: dimension {name!r} appears twice")
        dims.append((name, size))
    return dims


def strategy_mesh(strategy: str, num_devices: int) -> MeshDims:
    """The mesh a named strategy implies on `num_devices` devices (the DTensor tutorial's three)."""
    if strategy == "data":
        return [(BATCH, num_devices)]
    if strategy == "model":
        if num_devices % 2:
            raise MeshError(f"--strategy model needs an even --devices, got {num_devices}")
        return [(BATCH, num_devices // 2), (MODEL, 2)]
    if strategy == "spatial":
        if num_devices % 4:
            raise MeshError(f"--strategy spatial needs --devices divisible by 4, got {num_devices}")
        return [(BATCH, num_devices // 4), (FEATURE, 2), (MODEL, 2)]
    raise MeshError(f"--strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")


def resolve_mesh_dims(mesh: str | None, strategy: str | None, num_devices: int) -> MeshDims:
    """Mesh dims from `--mesh` or `--strategy` (data parallel when neither is given)."""
    if mesh and strategy:
        raise MeshError("give either --mesh or --strategy, not both")
    dims = parse_mesh(mesh) if mesh else strategy_mesh(strategy or "data", num_devices)
    product = 1
    for _, size in dims:
        product *= size
    if product != num_devices:
        raise MeshError(
            f"--mesh {format_mesh(dims)} spans {product} devices but --devices is {num_devices}"
        )
    unknown = [name for name, _ in dims if name not in (BATCH, FEATURE, MODEL)]
    if unknown:
        log.warning("mesh dimension(s) %s are not used by the model: replicated over", unknown)
    return dims


def format_mesh(dims: MeshDims) -> str:
    return ",".join(f"{name}={size}" for name, size in dims)


def build_mesh(dims: MeshDims, device_type: str = "CPU") -> dtensor.Mesh:
    """A single-client mesh over the first N local devices of `device_type`."""
    count = 1
    for _, size in dims:
        count *= size
    devices = [f"{device_type}:{i}" for i in range(count)]
    return dtensor.create_mesh(dims, devices=devices, device_type=device_type)


def single_device_mesh(device_type: str = "CPU") -> dtensor.Mesh:
    """The 1-device mesh export restores onto."""
    return build_mesh([(BATCH, 1)], device_type)


def dim_size(mesh: dtensor.Mesh, name: str) -> int:
    return mesh.dim_size(name) if name in mesh.dim_names else 1


def _axis(mesh: dtensor.Mesh, name: str) -> str:
    return name if name in mesh.dim_names else dtensor.UNSHARDED


@dataclass(frozen=True)
class ModelLayouts:
    """Where every tensor of the MLP lives on a mesh.

    Data parallel shards the batch; model parallel shards the hidden units (`model`); spatial
    parallel also shards the input features (`feature`), like the DTensor tutorial.
    """

    inputs: dtensor.Layout  # [batch, max_tokens]
    labels: dtensor.Layout  # [batch]
    dense1_kernel: dtensor.Layout  # [max_tokens, hidden]
    hidden: dtensor.Layout  # [hidden]: dense1 bias and BatchNorm parameters/statistics
    dense2_kernel: dtensor.Layout  # [hidden, classes]
    replicated1: dtensor.Layout  # [classes]
    scalar: dtensor.Layout

    @classmethod
    def for_mesh(cls, mesh: dtensor.Mesh) -> "ModelLayouts":
        batch, feature, model = (_axis(mesh, n) for n in (BATCH, FEATURE, MODEL))
        return cls(
            inputs=dtensor.Layout([batch, feature], mesh),
            labels=dtensor.Layout([batch], mesh),
            dense1_kernel=dtensor.Layout([feature, model], mesh),
            hidden=dtensor.Layout([model], mesh),
            dense2_kernel=dtensor.Layout([model, dtensor.UNSHARDED], mesh),
            replicated1=dtensor.Layout.replicated(mesh, 1),
            scalar=dtensor.Layout.replicated(mesh, 0),
        )


def check_divisible(mesh: dtensor.Mesh, *, batch_size: int, max_tokens: int, hidden: int) -> None:
    """Shapes must split evenly over the dims that shard them; say which flag to change."""
    for value, flag, dim in (
        (batch_size, "--batch-size", BATCH),
        (max_tokens, "--max-tokens", FEATURE),
        (hidden, "--hidden", MODEL),
    ):
        size = dim_size(mesh, dim)
        if value % size:
            raise MeshError(
                f"{flag} {value} does not divide by the mesh's {dim!r} dimension ({size}); "
                f"use a multiple of {size}"
            )

