"""Configuration of the serving stage: one frozen dataclass; `python -m serve` flags are generated
from it (`common.cli`). Importing this module never imports TensorFlow."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

from common.cli import option
from common.versions import version_number

VersionPolicy = Literal["latest", "all", "specific"]
EXIT_OK, EXIT_ABANDONED, EXIT_STARTUP = 0, 1, 2
"""A worker's exit status: drained cleanly; a request was abandoned at the drain timeout; cannot start."""
DEFAULT_MODEL_DIR = "models/sentiment"
"""What `python -m serve` serves without flags: what `python -m export` writes without flags."""


def parse_versions(text: str) -> tuple[int, ...]:
    """`1,2` -> (1, 2); versions are read as version directories are (`common.versions`)."""
    versions = [version_number(v.strip()) for v in text.split(",") if v.strip()]
    if None in versions:
        raise ValueError(f"expected version numbers such as 1,2, got {text!r}")
    return tuple(versions)


def parse_labels(text: str) -> tuple[tuple[str, int], ...]:
    """`stable=1,canary=2` -> (("stable", 1), ("canary", 2))."""
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        label, sep, version = item.partition("=")
        number = version_number(version.strip())
        if not sep or number is None or not label.strip():
            raise ValueError(f"expected LABEL=VERSION, got {item!r}")
        pairs.append((label.strip(), number))
    return tuple(pairs)


def parse_list(text: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _milliseconds(text: str) -> float:
    return float(text) / 1e3


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """What `python -m serve` does; tests build it directly."""

    model_dir: str = option(
        "", "one model: its base directory models/NAME holding integer version subdirectories "
        f"(default: {DEFAULT_MODEL_DIR}, where python -m export writes)", group="models")
    model_name: str = option("", "name in /v1/models/NAME (default: the base name of --model-dir)")
    model_config_file: str = option(
        "", "several models: a TF Serving ModelServerConfig text proto (model_config_list), instead of --model-dir"
    )
    model_config_file_poll_wait_seconds: float = option(
        0.0, "seconds between checks of --model-config-file for changes; 0: read it once", metavar="SECONDS"
    )
    model_management: bool = option(
        False, "let clients replace the served models (gRPC ModelService.HandleReloadConfigRequest, applied by "
               "every worker); off: PERMISSION_DENIED")
    model_roots: tuple[str, ...] = option(
        (), "directories every model base path must lie in, comma-separated, for reloads by gRPC or a changed "
            "--model-config-file (default: the directories holding the models configured at start)",
        flag="--model-root", parse=parse_list, metavar="DIR[,DIR]", shown_default="the models' parent directories")

    host: str = option("0.0.0.0", "address to bind (as TF Serving, all interfaces); 127.0.0.1 for local only",
                       group="ports and workers")
    port: int = option(8501, "REST port (TF Serving's default REST port)")
    grpc_port: int = option(0, "TF Serving gRPC API port (TF Serving uses 8500); 0: no gRPC")
    workers: int = option(
        0, "server processes sharing the ports, each with its own model copy (~600 MB for the default "
           "model), batcher and reload poller; 0: one per CPU this process may use (its CPU affinity "
           "and cgroup CPU limit)"
    )

    tls_cert_file: str = option("", "TLS on both ports: the server's PEM certificate (chain); re-read when it changes",
                                flag="--tls-cert", metavar="FILE", group="TLS")
    tls_key_file: str = option("", "with --tls-cert: its PEM private key", flag="--tls-key", metavar="FILE")
    tls_client_ca_file: str = option("", "mTLS: a PEM CA bundle; clients must present a certificate it signed "
                                         "(see --tls-client-auth)", flag="--tls-client-ca", metavar="FILE")
    tls_client_auth: Literal["required", "optional"] = option(
        "required", "with --tls-client-ca: required, or optional (a certificate is verified when a client sends one)")

    auth_token_file: str = option(
        "", "bearer tokens, one per line, re-read when the file changes: inference, metadata and metrics then "
            "need Authorization: Bearer TOKEN (gRPC metadata authorization); health and readiness stay open",
        metavar="FILE", group="tokens")
    admin_token_file: str = option(
        "", "with --auth-token-file and --model-management: the tokens that may manage models (API tokens may not)",
        metavar="FILE")
    metrics_open: bool = option(False, "with --auth-token-file: serve /monitoring/prometheus/metrics without a token "
                                       "(for a Prometheus that cannot send one)")

    max_connections: int = option(
        1024, "open connections per worker on each port; past it a new REST connection gets an immediate 503, "
              "a new gRPC one a GOAWAY", group="connections and their limits")
    header_timeout_s: float = option(
        10.0, "seconds a client has to send a request's headers (slow clients are cut off with 408)",
        flag="--header-timeout", metavar="SECONDS",
    )
    body_timeout_s: float = option(30.0, "seconds a client has to send a request's body (else 408; over gRPC, "
                                         "its message after its headers, else DEADLINE_EXCEEDED)",
                                   flag="--body-timeout", metavar="SECONDS")
    keepalive_timeout_s: float = option(30.0, "seconds an idle connection stays open (REST: between requests; "
                                              "gRPC: without a call, then GOAWAY, after which clients reconnect)",
                                        flag="--keepalive-timeout", metavar="SECONDS")
    send_timeout_s: float = option(30.0, "seconds an answer may wait for a client that does not read it (its "
                                         "socket, or its gRPC flow-control window, left shut) before the "
                                         "connection is closed", flag="--send-timeout", metavar="SECONDS")
    max_header_bytes: int = option(65536, "largest request line plus headers on the REST port (else 431)")
    grpc_max_header_bytes: int = option(
        16384, "largest request header list (metadata) on the gRPC port; past it RESOURCE_EXHAUSTED and the "
               "connection is retired (gRPC metadata is small, and every header block costs HPACK decoding)")

    version_policy: VersionPolicy = option(
        "latest", "latest: serve the newest version; all: every version on disk; specific: --versions",
        group="versions")
    versions: tuple[int, ...] = option((), "versions to serve with --version-policy specific, e.g. 1,2",
                                       parse=parse_versions)
    version_labels: tuple[tuple[str, int], ...] = option(
        (), "version labels for /labels/LABEL URLs, e.g. stable=1,canary=2", parse=parse_labels
    )
    poll_interval_s: float = option(1.0, "seconds between scans of --model-dir for new versions; 0: never",
                                    flag="--poll-interval", metavar="SECONDS")

    max_batch_size: int = option(64, "most rows merged into one model call by the dynamic batcher", group="batching")
    batch_timeout_s: float = option(
        0.002, "milliseconds a batch waits for requests already being received", flag="--batch-timeout-ms",
        parse=_milliseconds, metavar="MS", shown_default="2",
    )
    max_queued_rows: int = option(4096, "rows waiting for the model at most; beyond it requests fail fast (429)")
    num_batch_threads: int = option(1, "model calls running at once")

    request_timeout_s: float = option(10.0, "per-request deadline for queueing plus the model call, seconds (504)",
                                      flag="--request-timeout", metavar="SECONDS", group="requests")
    max_body_bytes: int = option(4 * 1024 * 1024, "largest request body (413), also the largest gRPC message")
    max_rows_per_request: int = option(1024, "most instances (texts) in one request (400)")
    max_text_bytes: int = option(100_000, "longest single text in UTF-8 bytes (400)")
    cors_origins: tuple[str, ...] = option((), "origins allowed by CORS, comma-separated, or '*'; off without it",
                                           parse=parse_list)
    overload_status: Literal[429, 503] = option(429, "HTTP status of a full queue: 429 or 503")

    drain_delay_s: float = option(0.0, "on SIGTERM, seconds to keep serving (readiness already failing, every "
                                  "answer with Connection: close) before the ports close, so that load balancers "
                                  "and Kubernetes endpoints stop sending first",
                                  flag="--drain-delay", metavar="SECONDS", group="drain and logs")
    drain_timeout_s: float = option(10.0, "after the ports close, seconds to finish requests already received",
                                    flag="--drain-timeout", metavar="SECONDS")
    monitoring: bool = option(True, "drift monitoring: compare the reviews each version answers with the "
                              "held-out reviews its export describes (assets.extra/drift_baseline.json); "
                              "--no-monitoring turns it off", group="monitoring")
    monitoring_window: int = option(500, "reviews in the count window of drift monitoring, per worker", metavar="REVIEWS")
    monitoring_window_s: float = option(300.0, "seconds in the time window of drift monitoring",
                                        flag="--monitoring-seconds", metavar="SECONDS")
    warmup: bool = option(True, "replay assets.extra/tf_serving_warmup_requests before a version goes live")
    access_log: bool = option(False, "log one line per request")
    log_level: str = option("INFO", "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        if self.model_config_file:
            given = [f for f, default in (("--model-dir", ""), ("--model-name", ""), ("--versions", ()),
                                          ("--version-labels", ()), ("--version-policy", "latest"))
                     if getattr(self, f[2:].replace("-", "_")) != default]
            if given:
                raise ValueError(f"{', '.join(given)}: not with --model-config-file, where each model sets its "
                                 "base_path, model_version_policy and version_labels")
        elif not self.model_dir:
            object.__setattr__(self, "model_dir", DEFAULT_MODEL_DIR)
        if self.model_config_file_poll_wait_seconds < 0:
            raise ValueError("--model-config-file-poll-wait-seconds must not be negative")
        if self.model_dir and not self.model_name:
            object.__setattr__(self, "model_name", os.path.basename(os.path.normpath(self.model_dir)))
        if self.version_policy not in ("latest", "all", "specific"):
            raise ValueError(f"--version-policy {self.version_policy!r}: expected latest, all or specific")
        if self.version_policy == "specific" and not self.versions:
            raise ValueError("--version-policy specific needs --versions N[,M...]")
        if self.version_policy != "specific" and self.versions:
            raise ValueError("--versions is only valid with --version-policy specific")
        if self.workers < 0:
            raise ValueError(f"--workers {self.workers}: must be 0 (one per CPU) or more")
        for name in ("max_batch_size", "max_queued_rows", "num_batch_threads", "max_body_bytes",
                     "max_rows_per_request", "max_text_bytes", "max_connections", "max_header_bytes",
                     "grpc_max_header_bytes", "monitoring_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} {getattr(self, name)}: must be at least 1")
        for name in ("batch_timeout_s", "poll_interval_s", "drain_delay_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_flag(name)} {getattr(self, name)}: must not be negative")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "send_timeout_s",
                     "monitoring_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_flag(name)} {getattr(self, name)}: must be positive")
        if self.overload_status not in (429, 503):
            raise ValueError(f"--overload-status {self.overload_status}: must be 429 or 503")
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{_flag(name)} {getattr(self, name)}: must be in 0..65535")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--tls-cert and --tls-key go together: the certificate and its private key")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (client certificates are a part of TLS)")
        if self.tls_client_auth not in ("required", "optional"):
            raise ValueError(f"--tls-client-auth {self.tls_client_auth!r}: expected required or optional")
        if (self.admin_token_file or self.metrics_open) and not self.auth_token_file:
            raise ValueError("--admin-token-file and --metrics-open only apply with --auth-token-file")
        if self.auth_token_file and self.model_management and not self.admin_token_file:
            raise ValueError("--model-management with --auth-token-file needs --admin-token-file: the tokens that "
                             "may replace the served models, apart from those that may only query them")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"--log-level {self.log_level!r}: expected DEBUG, INFO, WARNING or ERROR")


def configure_logging(config: ServeConfig, worker: int | None = None) -> None:
    prefix = f"[worker {worker}] " if worker is not None else ""
    logging.basicConfig(level=config.log_level.upper(), force=True,
                        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")


def _flag(name: str) -> str:
    from common.cli import flag_of

    return flag_of(ServeConfig.__dataclass_fields__[name])
