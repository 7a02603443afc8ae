"""Devices, meshes and layouts shared by training and export: the one place meshes are made.

DTensor needs its devices configured before TensorFlow runs any op, and a mesh over devices that
do not exist crashes (tensorflow#106304), so every mesh is built over devices we know are there:
`create_mesh` makes a run's mesh, in one process or across the clients of a multi-client run.
Mesh descriptions (parsing, strategies, cluster checks) are TensorFlow-free in `common.mesh_spec`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal, Sequence

import tensorflow as tf
from tensorflow.experimental import dtensor

from common.mesh_spec import (
    BATCH,
    ENV_CLIENT_ID,
    ENV_JOB_NAME,
    ENV_JOBS,
    FEATURE,
    JOB_NAME,
    MODEL,
    MeshDims,
    MeshError,
    check_client_mesh,
    parse_jobs,
)

log = logging.getLogger(__name__)

DeviceType = Literal["auto", "CPU", "GPU"]


def configure_devices(num_devices: int, device_type: DeviceType = "auto") -> str:
    """Make `num_devices` devices of one type visible to DTensor; return the type used.

    GPUs are used when present (unless CPU is asked for); otherwise the host CPU is split into
    virtual devices. Safe to call again in the same process: the first configuration stays and a
    later call only checks that enough devices exist (virtual devices cannot change once TF runs).
    """
    if num_devices < 1:
        raise MeshError(f"--devices must be at least 1, got {num_devices}")
    _without_memory_optimizer()
    gpus = tf.config.list_physical_devices("GPU")
    if device_type == "GPU" and not gpus:
        raise MeshError("--device-type GPU was asked for but TensorFlow sees no GPU "
                        "(--verbose shows what it reported)")
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


def _without_memory_optimizer() -> None:
    """Turn off grappler's memory optimizer for this process's functions, before TensorFlow starts.

    Its cost model does not reconcile the matrix shapes of the DTensor training programs and logs
    "op_level_cost_estimator.cc: Incompatible Matrix dimensions" E-lines between the epoch lines,
    which every log level but 3 lets through (tests/test_cli_quiet.py counts them). What it optimizes (swapping activations to the host, recomputation) has nothing to
    act on in a model of two small layers: the step time is the same without it
    (bench/train_bench.py). TensorFlow has no public switch for it, hence the eager context's
    ConfigProto; once the context runs, this changes nothing (a later call is harmless).
    """
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
    ctx = context.context()
    if ctx._config is None:  # noqa: SLF001 - no public switch (see the docstring)
        ctx._config = config  # noqa: SLF001
    else:
        ctx._config.MergeFrom(config)  # noqa: SLF001


def export_cluster_env(num_clients: int, client_id: int, jobs: Sequence[str]) -> None:
    """Set the DTENSOR_* variables DTensor reads when it initializes (before any TF op).

    With one client the variables are removed, so DTensor runs in local mode; a stale
    DTENSOR_JOBS listing other clients would otherwise make it wait for them.
    """
    if num_clients == 1:
        stale = os.environ.get(ENV_JOBS)
        if stale and len(parse_jobs(stale, ENV_JOBS)) > 1:
            raise MeshError(
                f"{ENV_JOBS}={stale!r} lists several clients but --num-clients is 1; "
                f"pass --num-clients/--client-id or unset {ENV_JOBS}"
            )
        for name in (ENV_JOBS, ENV_CLIENT_ID):
            os.environ.pop(name, None)
        return
    if len(jobs) != num_clients:
        raise MeshError(f"--jobs lists {len(jobs)} client(s) but --num-clients is {num_clients}; they must match")
    os.environ[ENV_JOBS] = ",".join(jobs)
    os.environ[ENV_CLIENT_ID] = str(client_id)
    os.environ[ENV_JOB_NAME] = os.environ.get(ENV_JOB_NAME) or JOB_NAME


def create_mesh(
    dims: MeshDims,
    devices: int,
    device_type: DeviceType = "auto",
    *,
    num_clients: int = 1,
    client_id: int = 0,
    jobs: Sequence[str] = (),
) -> dtensor.Mesh:
    """A run's mesh: this process's devices, or one mesh over every client's (num_clients > 1).

    Multi-client (DTensor's own runtime, started as TensorFlow's multi_client_test_util does): the
    DTENSOR_* variables are set, DTensor's runtime is started with `devices / num_clients` devices
    in this process, and `create_distributed_mesh` numbers devices
    client by client. Each client feeds its own share of every batch, so every batch replica must
    live on one client (`check_client_mesh`).
    """
    unknown = [name for name, _ in dims if name not in (BATCH, FEATURE, MODEL)]
    if unknown:
        log.warning("mesh dimension(s) %s are not used by the model: replicated over", unknown)
    export_cluster_env(num_clients, client_id, jobs)
    if num_clients == 1:
        return build_mesh(dims, configure_devices(devices, device_type))
    check_client_mesh(dims, devices, num_clients)
    per_client = devices // num_clients
    gpus = tf.config.list_physical_devices("GPU")
    kind = "GPU" if device_type == "GPU" or (device_type == "auto" and gpus) else "CPU"
    if kind == "GPU":
        if len(gpus) < per_client:
            raise MeshError(f"--devices {devices} on {num_clients} clients needs {per_client} GPU(s) per client, "
                            f"this one sees {len(gpus)}")
        # The first GPUs this process sees; clients sharing a host need their own CUDA_VISIBLE_DEVICES.
        tf.config.set_visible_devices(gpus[:per_client], "GPU")
    try:
        dtensor.initialize_accelerator_system(kind, num_logical_cpu_devices=per_client if kind == "CPU" else None)
    except ValueError as exc:
        if "already been initialized" not in str(exc) or "Accelerator" not in str(exc):
            raise MeshError(f"multi-client training must start DTensor before TensorFlow runs anything; run it "
                            f"in a fresh process ({exc})") from None
        # DTensor already started in this process (a second train() call): reuse it.
    if dtensor.num_clients() != num_clients or dtensor.num_local_devices(kind) != per_client:
        raise MeshError(f"this process already runs {dtensor.num_clients()} client(s) x "
                        f"{dtensor.num_local_devices(kind)} {kind} device(s), not {num_clients} x {per_client}")
    return dtensor.create_distributed_mesh(dims, device_type=kind)


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
    transposed_inputs: dtensor.Layout  # [max_tokens, batch]: sparse rows for the first kernel's gradient
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
            transposed_inputs=dtensor.Layout([feature, batch], mesh),
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

