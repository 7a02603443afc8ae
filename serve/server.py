"""Run the REST app under waitress with graceful shutdown.

On SIGTERM (or SIGINT): readiness turns false, the listening socket closes (no new
connections), requests already received run to completion and their responses are flushed,
bounded by `drain_timeout_s`; then the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import create_server

from serve.app import create_app
from serve.config import ServeConfig
from serve.core import ServingCore

log = logging.getLogger(__name__)


def serve(config: ServeConfig, core: ServingCore | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    core = core or ServingCore(config)
    core.start()
    app = create_app(config, core)
    state = app.extensions["serve"]
    server = create_server(
        app,
        host=config.host,
        port=config.port,
        threads=config.threads,
        connection_limit=config.connection_limit,
        backlog=1024,
        channel_timeout=60,
        # A backstop: the app answers 413 with a JSON body below this.
        max_request_body_size=config.max_body_bytes * 2 + 65536,
        ident="sentiment-serve",
        clear_untrusted_proxy_headers=True,
    )
    log.info("serving model %r from %s on http://%s:%s (REST, %d threads)",
             config.model_name, config.model_dir, server.effective_host, server.effective_port, config.threads)

    grpc_server = None
    if config.grpc_port:  # TF Serving's gRPC API on the same core (models, versions, batcher)
        from serve.grpc_server import GrpcServer

        grpc_server = GrpcServer(config, core).start()

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("received %s: draining (up to %.1fs)", signal.Signals(signum).name, config.drain_timeout_s)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    socket_map = server._map  # waitress's asyncore map: listener + open channels
    timeout = 0.05
    while not stop.is_set():
        wasyncore.loop(timeout=timeout, map=socket_map, count=1)

    # Drain: stop accepting, finish received requests, flush their responses.
    core.begin_drain()
    grpc_stopped = grpc_server.stop(config.drain_timeout_s) if grpc_server else None  # drains concurrently
    server.accepting = False
    server.del_channel()
    server.socket.close()
    deadline = time.monotonic() + config.drain_timeout_s
    while time.monotonic() < deadline:
        busy = state.in_flight > 0
        for channel in list(socket_map.values()):
            if not isinstance(channel, HTTPChannel):
                continue
            if channel.requests or channel.total_outbufs_len:
                busy = True
            else:
                channel.will_close = True  # idle keep-alive connection: close it, don't take more work
        if not busy:
            break
        wasyncore.loop(timeout=timeout, map=socket_map, count=1)
    else:
        log.warning("drain timeout: %d request(s) still in flight", state.in_flight)
    server.task_dispatcher.shutdown(cancel_pending=True, timeout=1)
    wasyncore.close_all(socket_map)
    if grpc_stopped is not None and not grpc_stopped.wait(config.drain_timeout_s + 1):
        log.warning("gRPC drain timeout")
    core.close()
    log.info("shut down cleanly")
    return 0
