"""Configuration of the serving stage: one frozen dataclass, the CLI maps onto it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

VersionPolicy = Literal["latest", "all", "specific"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    model_dir: str
    """Model base directory `models/NAME`; versions are its integer subdirectories."""

    model_name: str = ""
    """Name in the URL `/v1/models/{name}`; defaults to the base name of `model_dir`."""

    host: str = "0.0.0.0"
    """Address to bind (as TF Serving, all interfaces); use 127.0.0.1 for local only."""

    port: int = 8501
    """REST port (TF Serving's default REST port)."""

    grpc_port: int = 0
    """gRPC port for TF Serving's PredictionService/ModelService (TF Serving uses 8500); 0: no gRPC."""

    threads: int = 64
    """WSGI worker threads; requests wait for the batcher in these, so keep it >= max_batch_size."""

    connection_limit: int = 256
    """Open connections at most; further connections wait in the listen backlog."""

    version_policy: VersionPolicy = "latest"
    """`latest`: serve only the highest version; `all`: every version on disk; `specific`: `versions`."""

    versions: tuple[int, ...] = ()
    """Versions to serve with `version_policy="specific"`."""

    version_labels: tuple[tuple[str, int], ...] = ()
    """Version labels for `/labels/{label}` URLs, e.g. (("stable", 1), ("canary", 2))."""

    poll_interval_s: float = 1.0
    """Seconds between scans of `model_dir` for new versions; 0 disables polling."""

    max_batch_size: int = 64
    """Most rows merged into one model call by the dynamic batcher."""

    batch_timeout_s: float = 0.002
    """Longest the batcher waits for more requests after the first one of a batch arrives."""

    max_queued_rows: int = 4096
    """Bound on rows waiting for the model; beyond it requests fail fast as overloaded (429)."""

    num_batch_threads: int = 1
    """Threads taking batches from the queue and calling the model."""

    pad_single_row: bool = True
    """Run 1-row model calls as 2 rows so results are bit-identical batched or not (CPU matmul
    kernels for one row round differently); costs next to nothing."""

    request_timeout_s: float = 10.0
    """Per-request deadline for queueing plus the model call; past it the request fails with 504."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body accepted; larger bodies get 413."""

    max_rows_per_request: int = 1024
    """Most instances (texts) in one request; more get 400."""

    max_text_bytes: int = 100_000
    """Longest single text (UTF-8 bytes); longer texts get 400."""

    cors_origins: tuple[str, ...] = ()
    """Origins allowed by CORS (`*` for any); empty disables CORS headers (the default)."""

    drain_timeout_s: float = 10.0
    """On SIGTERM, how long to wait for in-flight requests before exiting anyway."""

    warmup: bool = True
    """Replay `assets.extra/tf_serving_warmup_requests` (or a few texts) before a version goes live."""

    access_log: bool = False
    """Log one line per request at INFO."""

    model_delay_s: float = 0.0
    """Artificial delay added to every model call; for tests and load experiments only."""

    overload_status: int = field(default=429)
    """HTTP status for a full queue: 429 (too many requests) or 503 (unavailable)."""

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir: required (--model-dir models/NAME)")
        if not self.model_name:
            object.__setattr__(self, "model_name", os.path.basename(os.path.normpath(self.model_dir)))
        if self.version_policy not in ("latest", "all", "specific"):
            raise ValueError(f"version_policy={self.version_policy!r}: expected latest, all or specific")
        if self.version_policy == "specific" and not self.versions:
            raise ValueError("versions: --version-policy specific needs --versions N[,M...]")
        if self.version_policy != "specific" and self.versions:
            raise ValueError("versions: only valid with --version-policy specific")
        for name in ("threads", "max_batch_size", "max_queued_rows", "num_batch_threads",
                     "max_body_bytes", "max_rows_per_request", "max_text_bytes", "connection_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("batch_timeout_s", "poll_interval_s", "drain_timeout_s", "model_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s}: must be > 0")
        if self.overload_status not in (429, 503):
            raise ValueError(f"overload_status={self.overload_status}: must be 429 or 503")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in 0..65535")
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port={self.grpc_port}: must be in 0..65535 (0: no gRPC server)")

    def replace(self, **changes) -> "ServeConfig":
        return dataclasses.replace(self, **changes)
