"""Run the server: the REST port (this project's HTTP/1.1 protocol on uvloop + httptools) and gRPC
(its sans-IO HTTP/2 machine, `serve.http2`), one event loop and one core per process; `--workers N`
runs N such processes on the same ports.

Shutdown on SIGTERM or SIGINT: readiness turns false and every answer carries `Connection: close`;
after `--drain-delay` the listening sockets close (the connections already in their queues are
accepted first), every request already received or still arriving on an open connection is
answered, connections idle for a second are closed, then the process exits 0 - or 1, with a log
line, if some request was still running when `--drain-timeout` ran out and had to be abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import logging
import os
import resource
import signal
import socket

from common.cpus import usable_cpus
from serve.config import EXIT_ABANDONED, EXIT_OK, ServeConfig, configure_logging
from serve.core.dataplane import ServingCore
from serve.core.peers import Peers, saved_models
from serve.tls import tls_for
from serve.core.model_config_file import ModelConfigError, config_sources, file_fingerprint, read_model_config
from serve.http.app import create_app
from serve.host import ConnectionHost, PortLimits
from serve.http.server import RestServer
from serve.sockets import AcceptGate

log = logging.getLogger(__name__)

WORKER_READY_WAIT_S = 120.0
"""How long one of several workers waits for its model before it takes connections anyway."""
_PLAINTEXT_TEXT = b"This port speaks HTTPS: use an https:// URL.\n"
PLAINTEXT_ANSWER = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(_PLAINTEXT_TEXT), _PLAINTEXT_TEXT))
"""What a plaintext HTTP client gets on a TLS REST port before the connection closes."""


def raise_open_file_limit() -> None:
    """Each connection is a file descriptor: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))


class _Worker:
    """One serving process: the core, the REST server, gRPC, and their drain. Made on the serving loop."""

    def __init__(self, config: ServeConfig, sock: socket.socket, index: int | None,
                 peer_dir: str | None = None, loads=None, grpc_sock: socket.socket | None = None,
                 grpc_loads=None) -> None:  # noqa: ANN001
        """`sock`, `grpc_sock`: the listening sockets; for one of several workers, `peer_dir` is where
        they exchange metrics and `loads`, `grpc_loads` their open connections on each port (see
        `serve.sockets.AcceptGate`)."""
        self.config, self.sock, self.index, self.loads = config, sock, index, loads
        self.grpc_sock, self.grpc_loads = grpc_sock, grpc_loads
        several = peer_dir is not None and index is not None
        # a worker started after a reload (a restart) serves what its siblings were told to
        sources = (saved_models(peer_dir) if several else None) or config_sources(config)
        self.core = ServingCore(config, sources)
        if several:
            self.core.peers = Peers(peer_dir, index, config.workers, self.core.metrics.render, self.core.apply_sources,
                                    self.core.monitoring_windows)
        self.rest_host = ConnectionHost("REST", PortLimits.of(config),
                                        report=functools.partial(self.core.metrics.connection_event, "rest"))
        self.rest = RestServer(create_app(config, self.core), self.rest_host)
        self.gate: AcceptGate | None = None
        self.stop_rest = asyncio.Event()
        self.abandoned = 0
        self.grpc_server = None
        self.grpc_stopped: asyncio.Future | None = None
        self.draining = False
        self._freezing: asyncio.Future | None = None

    def on_signal(self, signum: int) -> None:
        if self.draining:
            log.warning("second %s: stopping now", signal.Signals(signum).name)
            self.rest_host.force_exit = True
            self.stop_rest.set()
            if self.grpc_server is not None:
                self.grpc_server.host.force_exit = True
            self._close_grpc(0)
            return
        self.draining = True
        delay = self.config.drain_delay_s
        log.info("received %s: draining (%sup to %gs for requests in progress)", signal.Signals(signum).name,
                 f"ports open {delay:g}s more, then " if delay else "", self.config.drain_timeout_s)
        self.core.begin_drain()  # readiness fails from now on
        self.rest_host.begin_drain()  # every answer from now on: Connection: close
        asyncio.get_running_loop().call_later(delay, self._close_ports)

    def _close_ports(self) -> None:
        self.stop_rest.set()  # `_run_rest` drains the REST port
        self._close_grpc(self.config.drain_timeout_s)

    def _close_grpc(self, grace_s: float) -> None:
        if self.grpc_server is not None and self.grpc_stopped is None:
            self.grpc_stopped = asyncio.ensure_future(self.grpc_server.stop(grace_s))

    async def start(self) -> asyncio.Future:
        """Load the models and open the ports; returns the REST server's task."""
        serving = None
        if self.core.peers is not None:
            await self.core.peers.start()
        if self.index is None:  # one process: answer /healthz and /readyz while the model loads
            serving = self._serve_rest()
        # TensorFlow is imported once, here, before the model loaders and the gRPC edge need it: two
        # threads importing it at the same time deadlock in its module locks.
        tf = await asyncio.to_thread(importlib.import_module, "tensorflow")
        # The gRPC edge's modules (protos, stubs) are imported off the loop too: imported on it once
        # the REST port was open, they held this worker's loop while a burst of new connections
        # waited for it, and its sibling took them all.
        grpc_server = await asyncio.to_thread(importlib.import_module, "serve.grpc.server") if self.grpc_sock else None
        if self.index is not None:
            # One of several workers: each takes its share of the CPUs for the model's thread pools,
            # instead of every worker's pools spanning all of them (and fighting over them).
            share = max(1, usable_cpus() // self.config.workers)
            tf.config.threading.set_intra_op_parallelism_threads(share)
            tf.config.threading.set_inter_op_parallelism_threads(share)
        if not self.draining:
            await self.core.start()
        if serving is None:
            # One of several workers: join the shared ports only once the model is loaded, so a
            # restarted worker never answers 503 while its siblings are ready.
            await self._wait_ready(WORKER_READY_WAIT_S)
            _freeze_heap()
            serving = self._serve_rest()
        else:
            self._freezing = asyncio.ensure_future(self._freeze_when_ready())  # kept: a task nobody holds may vanish
        if grpc_server is not None and not self.draining:
            self.grpc_server = await grpc_server.GrpcServer(self.config, self.core, self.grpc_sock,
                                                            loads=self.grpc_loads, index=self.index or 0).start()
        return serving

    async def _wait_ready(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.core.ready and not self.draining and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _freeze_when_ready(self) -> None:
        await self._wait_ready(WORKER_READY_WAIT_S)
        _freeze_heap()

    def _serve_rest(self) -> asyncio.Future:
        host, port = self.sock.getsockname()[:2]
        tls = tls_for(self.config, "rest")
        log.info("serving %s on %s://%s:%d (REST)", _describe(self.core), "https" if tls else "http", host, port)
        self.gate = AcceptGate(self.sock, self.rest.protocol_factory, lambda: self.rest_host.open,
                               loads=self.loads, index=self.index or 0, tls=tls,
                               handshake_timeout_s=self.config.header_timeout_s, plaintext_answer=PLAINTEXT_ANSWER)
        self.rest_host.on_change = self.gate.publish
        self.rest_host.excess = self.gate.excess
        self.rest.start()
        self.gate.start()
        return asyncio.ensure_future(self._run_rest())

    async def _run_rest(self) -> None:
        await self.stop_rest.wait()
        self.abandoned = await self.rest.drain(self.gate, self.config.drain_timeout_s)

    async def finish(self) -> int:
        """After the REST server stopped: stop gRPC and the core; the exit code."""
        abandoned = self.abandoned
        if self.grpc_stopped is not None:
            abandoned += await self.grpc_stopped
        await self.core.close()
        received, answered = self.rest_host.received, self.rest_host.answered
        if abandoned:
            log.error("drain timeout (%gs): %d request(s) abandoned; %d received, %d answered",
                      self.config.drain_timeout_s, abandoned, received, answered)
            return EXIT_ABANDONED
        log.info("shut down cleanly: %d HTTP request(s) received, %d answered", received, answered)
        return EXIT_OK


def _freeze_heap() -> None:
    """Leave what is loaded by now (TensorFlow, the model: ~280k tracked objects) out of the garbage
    collector's full passes: one took 166-200 ms here, a stall for every request in flight. Runs
    on the serving loop, so it must be quick itself: a collection of the young generations (~2 ms;
    measured, a full pass after it finds nothing more), then the freeze (microseconds)."""
    gc.collect(1)
    gc.freeze()
    log.debug("%d objects left out of garbage collection", gc.get_freeze_count())


async def serve_async(
    config: ServeConfig, sock: socket.socket, *, worker: int | None = None,
    stop_requested: list[int] | None = None, peer_dir: str | None = None, loads=None,  # noqa: ANN001
    grpc_sock: socket.socket | None = None, grpc_loads=None,  # noqa: ANN001
) -> int:
    """Serve on `sock` (and config.grpc_port) until SIGTERM (or SIGINT, unless this is one of
    several workers: their supervisor turns Ctrl+C into one SIGTERM each); returns the exit code."""
    process = _Worker(config, sock, worker, peer_dir, loads, grpc_sock, grpc_loads)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM,) if worker is not None else (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, process.on_signal, sig)
    if stop_requested:  # a signal that arrived while this process was starting
        process.on_signal(stop_requested[0])
    serving = await process.start()
    tasks = []
    if not worker:  # the only process, or the first of several
        tasks.append(asyncio.ensure_future(_announce_when_ready(config, process.core, sock.getsockname()[1])))
    if config.model_config_file and config.model_config_file_poll_wait_seconds > 0:
        tasks.append(asyncio.ensure_future(watch_model_config(config, process.core)))
    await serving
    for task in tasks:
        task.cancel()
    return await process.finish()


async def _announce_when_ready(config: ServeConfig, core: ServingCore, port: int) -> None:
    """Once the models are ready, say where to look: the page, a curl line, the client."""
    while not core.ready:
        await asyncio.sleep(0.1)
    host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    url = f"{'https' if config.tls_cert_file else 'http'}://{host}:{port}"
    name = core.default_model
    log.info("ready: open %s/ in a browser, or try\n"
             "  curl -s %s/v1/models/%s:predict -d '{\"instances\": [\"a wonderful film\"]}'\n"
             "  python -m client --url %s --model %s \"a wonderful film\"\n"
             "Ctrl-C stops the server.", url, url, name, url, name)


def _describe(core: ServingCore) -> str:
    return ", ".join(f"model {name!r} from {r.source.base_path}" for name, r in core.models.items())


async def watch_model_config(config: ServeConfig, core: ServingCore) -> None:
    """Re-read --model-config-file when its contents change (TF Serving's
    --model_config_file_poll_wait_seconds); a broken file is logged and the current models kept."""
    path = config.model_config_file
    last = await asyncio.to_thread(file_fingerprint, path)
    while True:
        await asyncio.sleep(config.model_config_file_poll_wait_seconds)
        current = await asyncio.to_thread(file_fingerprint, path)
        if current == last or current is None:
            continue
        last = current
        try:
            sources = await asyncio.to_thread(read_model_config, path)
            core.check_sources(sources, path)
        except ModelConfigError as exc:
            log.error("%s; keeping the models already served", exc)
            continue
        log.info("model config changed: serving %s", ", ".join(s.name for s in sources))
        if core.peers is not None:
            core.peers.forget_saved()
        await core.apply_sources(sources)


def run_worker(
    config: ServeConfig, sock: socket.socket, worker: int | None = None,
    stop_requested: list[int] | None = None, peer_dir: str | None = None, loads=None,  # noqa: ANN001
    grpc_sock: socket.socket | None = None, grpc_loads=None,  # noqa: ANN001
) -> int:
    """One serving process on an already bound socket (also the body of each --workers process)."""
    import uvloop

    configure_logging(config, worker)
    raise_open_file_limit()
    code = uvloop.run(serve_async(config, sock, worker=worker, stop_requested=stop_requested,
                                   peer_dir=peer_dir, loads=loads, grpc_sock=grpc_sock, grpc_loads=grpc_loads))
    if code == EXIT_ABANDONED:
        # A model call may still be running in its thread; the interpreter would wait for it.
        logging.shutdown()
        os._exit(code)
    return code


__all__ = ["serve_async", "run_worker"]
