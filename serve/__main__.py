"""`python -m serve --model-dir models/NAME [--model-name NAME] [--port 8501] ...`"""

from __future__ import annotations

import argparse
import logging
import sys

from serve.config import ServeConfig


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _labels(text: str) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        label, sep, version = item.partition("=")
        if not sep or not version.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected LABEL=VERSION, got {item!r}")
        pairs.append((label.strip(), int(version)))
    return tuple(pairs)


def parse_args(argv: list[str] | None = None) -> ServeConfig:
    d = ServeConfig(model_dir="models/x")  # defaults
    p = argparse.ArgumentParser(prog="python -m serve", description="Serve a sentiment SavedModel (TF Serving REST API).")
    p.add_argument("--model-dir", required=True, help="model base directory models/NAME holding integer versions")
    p.add_argument("--model-name", default="", help="name in /v1/models/NAME (default: base name of --model-dir)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--grpc-port", type=int, default=d.grpc_port, help="TF Serving gRPC API port (e.g. 8500); 0: off")
    p.add_argument("--threads", type=int, default=d.threads, help="WSGI worker threads")
    p.add_argument("--connection-limit", type=int, default=d.connection_limit)
    p.add_argument("--version-policy", choices=["latest", "all", "specific"], default=d.version_policy)
    p.add_argument("--versions", type=_ints, default=(), help="with --version-policy specific: 1,2")
    p.add_argument("--version-labels", type=_labels, default=(), help="stable=1,canary=2")
    p.add_argument("--poll-interval", type=float, default=d.poll_interval_s, help="seconds; 0 disables")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--batch-timeout-ms", type=float, default=d.batch_timeout_s * 1e3)
    p.add_argument("--max-queued-rows", type=int, default=d.max_queued_rows)
    p.add_argument("--num-batch-threads", type=int, default=d.num_batch_threads)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, help="per-request deadline, seconds")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--max-rows-per-request", type=int, default=d.max_rows_per_request)
    p.add_argument("--max-text-bytes", type=int, default=d.max_text_bytes)
    p.add_argument("--cors-origins", default="", help="comma-separated origins, or '*'; CORS is off without it")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--overload-status", type=int, choices=[429, 503], default=d.overload_status)
    p.add_argument("--model-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # tests only
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ServeConfig(
            model_dir=a.model_dir, model_name=a.model_name, host=a.host, port=a.port, grpc_port=a.grpc_port, threads=a.threads,
            connection_limit=a.connection_limit, version_policy=a.version_policy, versions=a.versions,
            version_labels=a.version_labels, poll_interval_s=a.poll_interval, max_batch_size=a.max_batch_size,
            batch_timeout_s=a.batch_timeout_ms / 1e3, max_queued_rows=a.max_queued_rows,
            num_batch_threads=a.num_batch_threads, request_timeout_s=a.request_timeout,
            max_body_bytes=a.max_body_bytes, max_rows_per_request=a.max_rows_per_request,
            max_text_bytes=a.max_text_bytes,
            cors_origins=tuple(o.strip() for o in a.cors_origins.split(",") if o.strip()),
            drain_timeout_s=a.drain_timeout, warmup=not a.no_warmup, access_log=a.access_log,
            overload_status=a.overload_status, model_delay_s=a.model_delay_ms / 1e3,
        )
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    from serve.server import serve

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
