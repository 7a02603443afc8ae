"""Mesh and cluster descriptions, checked before TensorFlow starts (so command lines answer fast).

A mesh is a list of named dimensions, `[("batch", 4), ("model", 2)]`, from `--mesh` or a named
`--strategy`; a cluster is the client processes of a multi-client run. Building the actual DTensor
mesh (which needs TensorFlow) is `common.mesh.create_mesh`.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

BATCH, FEATURE, MODEL = "batch", "feature", "model"
"""Mesh dimension names the model knows how to shard over; other names are replicated."""

STRATEGIES: tuple[str, ...] = ("feature", "data", "model", "spatial")

MeshDims = list[tuple[str, int]]

ENV_JOBS = "DTENSOR_JOBS"
ENV_CLIENT_ID = "DTENSOR_CLIENT_ID"
ENV_JOB_NAME = "DTENSOR_JOB_NAME"
JOB_NAME = "worker"
"""DTensor's multi-client runtime reads its cluster from these variables."""


class MeshError(ValueError):
    """A mesh, strategy, device or cluster request that cannot be satisfied; the message names the flag."""


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
    """The mesh a named strategy implies on `num_devices` devices: the DTensor tutorial's three
    (data, model, spatial) and `feature`, which shards the vocabulary side of the first layer over
    every device (the default: with a wide vocabulary, replicating that layer makes every device
    repeat the whole optimizer update, while feature sharding splits it and only all-reduces the
    small [batch, hidden] partial sums)."""
    if strategy == "feature":
        return [(FEATURE, num_devices)]
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


DEFAULT_STRATEGY = "feature"

STRATEGY_MULTIPLE = {"model": 2, "spatial": 4}
"""Device counts a strategy's mesh needs a multiple of."""

MULTI_CLIENT_DEVICES = 8
"""`--devices 0` with several clients: every client must arrive at the same global count without
asking the others, so it is this fixed number (what the multi-client examples and manifests use)."""


def default_device_count(mesh: str | None, strategy: str | None, num_clients: int, local_devices: int) -> int:
    """What `--devices 0` stands for: the size of `--mesh`; MULTI_CLIENT_DEVICES with several
    clients; else `local_devices` (the visible GPUs, or the virtual CPU devices this host should
    have), rounded up to what `--strategy` needs."""
    if mesh:
        return mesh_size(parse_mesh(mesh))
    if num_clients > 1:
        return MULTI_CLIENT_DEVICES
    multiple = STRATEGY_MULTIPLE.get(strategy or DEFAULT_STRATEGY, 1)
    return -(-max(1, local_devices) // multiple) * multiple


def resolve_mesh_dims(mesh: str | None, strategy: str | None, num_devices: int) -> MeshDims:
    """Mesh dims from `--mesh` or `--strategy` (DEFAULT_STRATEGY when neither is given)."""
    if mesh and strategy:
        raise MeshError("give either --mesh or --strategy, not both")
    dims = parse_mesh(mesh) if mesh else strategy_mesh(strategy or DEFAULT_STRATEGY, num_devices)
    spans = mesh_size(dims)
    if spans != num_devices:
        raise MeshError(f"--mesh {format_mesh(dims)} spans {spans} devices but --devices is {num_devices}")
    return dims


def mesh_size(dims: Sequence[tuple[str, int]]) -> int:
    """How many devices a mesh of `dims` spans."""
    return math.prod(size for _, size in dims)


def format_mesh(dims: MeshDims) -> str:
    return ",".join(f"{name}={size}" for name, size in dims)


def check_client_mesh(dims: Sequence[tuple[str, int]], devices: int, num_clients: int) -> None:
    """Can `num_clients` clients share a mesh of `dims` over `devices` global devices?

    `create_distributed_mesh` gives client k the k-th contiguous block of devices (row-major), and
    each client feeds its own rows of every batch, so every batch replica must sit on one client:
    a leading `batch` dimension (or only size-1 dimensions before it) divisible by the client count.
    """
    if num_clients == 1:
        return
    if devices % num_clients:
        raise MeshError(f"--devices {devices} (the global device count) does not divide among {num_clients} clients")
    names = [name for name, _ in dims]
    whole_replicas = (
        BATCH in names
        and all(size == 1 for _, size in dims[: names.index(BATCH)])
        and dict(dims)[BATCH] % num_clients == 0
    )
    if not whole_replicas:
        raise MeshError(
            f"--mesh {format_mesh(list(dims))} on {num_clients} clients: each client feeds whole batch replicas, "
            f"so the mesh needs a leading 'batch' dimension divisible by {num_clients}"
        )


def check_cluster(num_clients: int, client_id: int, jobs: Sequence[str] | None, jobs_from: str = "--jobs") -> None:
    """A multi-client cluster that holds together: MeshError naming the flag otherwise. The one
    check of these settings, for the flags, DTENSOR_* variables and TrainConfig alike. `jobs` None:
    not known yet (a launcher checking the flags it will hand its clients)."""
    if num_clients < 1:
        raise MeshError(f"--num-clients must be at least 1, got {num_clients}")
    if jobs is None:
        jobs = ()
    elif num_clients > 1 and not jobs:
        raise MeshError(
            f"--num-clients {num_clients} needs --jobs host:port,... (one per client) or DTENSOR_JOBS; "
            f"or use --launch-local {num_clients} to run them all on this machine"
        )
    if jobs and len(jobs) != num_clients:
        raise MeshError(f"{jobs_from} lists {len(jobs)} client(s) but --num-clients is {num_clients}; they must match")
    if not 0 <= client_id < num_clients:
        raise MeshError(f"--client-id must be in 0..{num_clients - 1}, got {client_id}")


def parse_jobs(text: str, source: str = "--jobs") -> tuple[str, ...]:
    """`host:port,host:port` -> the clients' addresses, in client order."""
    jobs = tuple(part.strip() for part in text.split(",") if part.strip())
    for job in jobs:
        host, sep, port = job.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise MeshError(f"{source} {text!r}: expected host:port[,host:port...], got {job!r}")
    if len(set(jobs)) != len(jobs):
        raise MeshError(f"{source} {text!r}: every client needs its own host:port")
    return jobs
