"""`python -m serve`: bind the ports, then run one worker in this process or supervise
`--workers N` worker processes (gunicorn's arbiter and workers, apart: `serve.supervisor` starts
`serve.worker.run_worker` in each child). Importing this module imports neither TensorFlow nor
the HTTP layer; the single-process path imports the worker when it starts it."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from common.cpus import usable_cpus
from serve.config import DEFAULT_MODEL_DIR, EXIT_STARTUP, ServeConfig, configure_logging
from serve.core.auth import TokenFileError, authorizer_for
from serve.core.model_config_file import ModelConfigError, config_sources, model_roots
from serve.sockets import StartupError, bind_socket
from serve.tls import TlsError, build_context

log = logging.getLogger(__name__)

def serve(config: ServeConfig) -> int:
    """`python -m serve`: bind the ports, then run one worker here or supervise `config.workers`."""
    configure_logging(config)
    if config.model_dir == DEFAULT_MODEL_DIR and not config.model_config_file and not os.path.isdir(DEFAULT_MODEL_DIR):
        print(f"serve: error: no model to serve: {DEFAULT_MODEL_DIR} does not exist. Train and export one first:\n"
              "  python -m train && python -m export\n"
              "or name one with --model-dir models/NAME (or several with --model-config-file)", file=sys.stderr)
        return EXIT_STARTUP
    try:
        sources = config_sources(config)  # a broken --model-config-file stops here, before any port is taken
        config = dataclasses.replace(config, model_roots=model_roots(config, sources))  # fixed from now on
        if config.tls_cert_file:
            build_context(config, "rest")  # unusable certificate files stop here too
        authorizer_for(config)  # and unusable token files
        sock = bind_socket(config.host, config.port)
        grpc_sock = bind_socket(config.host, config.grpc_port, "--grpc-port") if config.grpc_port else None
    except (StartupError, ModelConfigError, TlsError, TokenFileError) as exc:
        print(f"serve: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    if config.workers == 0:
        config = dataclasses.replace(config, workers=usable_cpus())
    if config.workers == 1:
        from serve.worker import run_worker

        return run_worker(config, sock, grpc_sock=grpc_sock)
    from serve.supervisor import supervise

    return supervise(config, sock, grpc_sock)


__all__ = ["serve", "StartupError"]
