"""`--workers N`: N serving processes on one port, supervised by the process the user started.

The supervisor binds the REST socket once and every worker accepts from it (pre-fork, as
gunicorn does), each taking a new connection only while no sibling holds fewer open ones (the
shared `loads` array, `serve.sockets.AcceptGate`); the gRPC socket likewise, with its own
`loads`. Each worker is a full server: its own event loop, model copy, batcher, reload
poller and metrics. The supervisor imports neither TensorFlow nor the HTTP layer: it forwards SIGTERM /
SIGINT to the workers, restarts a worker that dies while serving, and exits 0 only if every worker
drained cleanly.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

from serve.config import ServeConfig

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 30.0
"""A worker that dies this soon after starting counts towards giving up."""
MAX_QUICK_DEATHS = 3


PARENT_CHECK_S = 0.25


def _exit_with_parent(parent: int) -> None:
    """A worker whose supervisor died (kill -9, OOM) drains and exits instead of holding the ports:
    a thread notices the new parent and sends this process the SIGTERM the supervisor would have."""
    import os

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        log.warning("the supervisor (pid %d) is gone: draining and exiting", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _worker_main(config: ServeConfig, sock: socket.socket, index: int, parent: int, peer_dir: str,
                 loads, grpc_sock: socket.socket | None, grpc_loads) -> None:  # noqa: ANN001 - multiprocessing.Arrays
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole group: the supervisor decides
    early: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: early.append(signum))  # until the server takes over
    _exit_with_parent(parent)
    # A spawned child does not run serve/__main__.py again (multiprocessing skips `__main__`
    # modules), so it chooses TensorFlow's quiet here, from the same command line and environment.
    from common.quiet import quiet_tensorflow

    quiet_tensorflow()
    from serve.worker import run_worker

    sys.exit(run_worker(config, sock, index, stop_requested=early, peer_dir=peer_dir, loads=loads,
                        grpc_sock=grpc_sock, grpc_loads=grpc_loads))


def _stop_workers(config: ServeConfig, workers: dict[int, multiprocessing.Process]) -> list[int | None]:
    """SIGTERM to each worker (each drains on its own), a kill for one that outlives its drain;
    their exit codes."""
    for process in workers.values():
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + config.drain_timeout_s + 15
    codes = []
    for index, process in workers.items():
        process.join(max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            log.error("worker %d did not stop in time: killing it", index)
            process.kill()
            process.join()
        codes.append(process.exitcode)
    return codes


def supervise(config: ServeConfig, sock: socket.socket, grpc_sock: socket.socket | None = None) -> int:
    """Run `config.workers` workers accepting from `sock` (and `grpc_sock`) until SIGTERM/SIGINT;
    the exit code."""
    peer_dir = tempfile.mkdtemp(prefix="serve-workers-")  # each worker's metrics socket (serve.core.metrics)
    try:
        return _supervise(config, sock, peer_dir, grpc_sock)
    finally:
        shutil.rmtree(peer_dir, ignore_errors=True)


def _supervise(config: ServeConfig, sock: socket.socket, peer_dir: str, grpc_sock: socket.socket | None) -> int:
    context = multiprocessing.get_context("spawn")
    loads = context.Array("i", [-1] * config.workers, lock=False)  # open connections per worker; -1: not accepting
    grpc_loads = context.Array("i", [-1] * config.workers, lock=False) if grpc_sock is not None else None
    signals: list[int] = []

    def on_signal(signum: int, _frame) -> None:  # noqa: ANN001
        # Only this: the handler runs in the main thread between two bytecodes, so taking a lock
        # here (an Event's set()) deadlocks whenever the signal lands while that thread holds it
        # (inside Event.wait): Ctrl-C then left the supervisor hung over its exited workers.
        signals.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def start(index: int) -> tuple[multiprocessing.Process, float]:
        process = context.Process(target=_worker_main, name=f"serve-worker-{index}",
                                  args=(config, sock, index, os.getpid(), peer_dir, loads, grpc_sock, grpc_loads))
        process.start()
        return process, time.monotonic()

    workers = {i: start(i) for i in range(config.workers)}
    log.info("supervising %d workers on port %d (pids %s; metrics exchanged in %s)", config.workers, config.port,
             ", ".join(str(p.pid) for p, _ in workers.values()), peer_dir)
    quick_deaths = 0
    failed = False
    while not signals and not failed:
        time.sleep(0.2)  # a signal runs its handler at once; the loop sees it within 0.2 s
        for index, (process, started) in list(workers.items()):
            if process.is_alive() or signals:
                continue
            loads[index] = -1  # its connections are gone: siblings stop deferring to it
            if grpc_loads is not None:
                grpc_loads[index] = -1
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < RESTART_WINDOW_S else 0
            if quick_deaths >= MAX_QUICK_DEATHS:
                log.error("worker %d exited with %s, %d workers died right after starting: giving up",
                          index, process.exitcode, quick_deaths)
                failed = True
                break
            log.error("worker %d exited with %s while serving: starting a new one", index, process.exitcode)
            workers[index] = start(index)
    sock.close()
    if grpc_sock is not None:
        grpc_sock.close()
    codes = _stop_workers(config, {index: process for index, (process, _) in workers.items()})
    if failed or any(code != 0 for code in codes):
        log.error("workers exited with %s", codes)
        return 1
    log.info("all %d workers shut down cleanly", len(codes))
    return 0
