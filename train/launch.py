"""Multi-client training: the cluster settings of one client, and a local launcher for N clients.

DTensor's distributed runtime reads its cluster from the environment (`DTENSOR_JOBS`,
`DTENSOR_CLIENT_ID`, `DTENSOR_JOB_NAME`); `python -m train` takes the same settings as flags
(`--jobs`, `--client-id`, `--num-clients`), which win over the environment. `--launch-local N` runs
N such clients on this machine over 127.0.0.1 and supervises them: their output is forwarded with a
`[client k] ` prefix, and if one exits with an error the others are stopped and the launcher fails.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Mapping, Sequence

from common.mesh_spec import ENV_CLIENT_ID, ENV_JOBS, MeshError, check_cluster, parse_jobs

log = logging.getLogger(__name__)

LAUNCH_FLAG = "--launch-local"
CLUSTER_FLAGS = ("--num-clients", "--client-id", "--jobs")


class ClusterError(ValueError):
    """Inconsistent multi-client settings; the message names the flag or variable to fix."""


@dataclass(frozen=True)
class Cluster:
    """Where this process sits in a multi-client run."""

    num_clients: int
    client_id: int
    jobs: tuple[str, ...]  # host:port of every client, in client order; empty for one client


def resolve_cluster(
    num_clients: int | None,
    client_id: int | None,
    jobs: str | None,
    environ: Mapping[str, str] | None = None,
) -> Cluster:
    """The cluster from flags (None = not given), falling back to DTENSOR_* variables.

    Flags win over the environment, field by field; the client count is the number of jobs when
    only the job list is given. Raises ClusterError when the pieces disagree.
    """
    environ = os.environ if environ is None else environ
    try:
        job_list = parse_jobs(jobs) if jobs else ()
        if not job_list and environ.get(ENV_JOBS):
            job_list = parse_jobs(environ[ENV_JOBS], ENV_JOBS)
    except MeshError as exc:
        raise ClusterError(str(exc)) from None
    jobs_from = "--jobs" if jobs else ENV_JOBS
    if client_id is None and environ.get(ENV_CLIENT_ID):
        try:
            client_id = int(environ[ENV_CLIENT_ID])
        except ValueError:
            raise ClusterError(f"{ENV_CLIENT_ID}={environ[ENV_CLIENT_ID]!r} is not an integer") from None
    if num_clients is None:
        num_clients = len(job_list) or 1
    client_id = 0 if client_id is None else client_id
    try:
        check_cluster(num_clients, client_id, job_list, jobs_from)
    except MeshError as exc:
        raise ClusterError(str(exc)) from None
    return Cluster(num_clients, client_id, job_list if num_clients > 1 else ())


# -- the local launcher ---------------------------------------------------------------------------


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports nothing listens on right now (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def strip_cluster_args(argv: Sequence[str]) -> list[str]:
    """`argv` without --launch-local and the cluster flags (the launcher sets those per client)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in (LAUNCH_FLAG, *CLUSTER_FLAGS):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def client_commands(num_clients: int, argv: Sequence[str], host: str = "127.0.0.1") -> list[list[str]]:
    """One `python -m train` command per client, on fresh localhost ports."""
    jobs = ",".join(f"{host}:{port}" for port in free_ports(num_clients, host))
    base = [sys.executable, "-m", "train", *strip_cluster_args(argv)]
    return [
        [*base, "--num-clients", str(num_clients), "--client-id", str(k), "--jobs", jobs]
        for k in range(num_clients)
    ]


def _forward(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copy lines (and tqdm's carriage-return updates) from a client to `out` with a prefix."""
    pending = b""
    while chunk := stream.read1(65536):
        pending += chunk
        *lines, pending = _split_keep(pending)
        if lines:
            with lock:
                out.write(b"".join(prefix + line for line in lines))
                out.flush()
    if pending:
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()


def _split_keep(data: bytes) -> list[bytes]:
    """Split after every \\n or \\r, keeping the terminators; the last item is the unfinished rest."""
    parts, start = [], 0
    for i, byte in enumerate(data):
        if byte in (10, 13):
            parts.append(data[start : i + 1])
            start = i + 1
    parts.append(data[start:])
    return parts


def _wait(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live client, then SIGKILL what is still running after `grace` seconds."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start_client(k: int, command: Sequence[str], env: Mapping[str, str] | None, out: IO[bytes],
                  lock: threading.Lock) -> tuple[subprocess.Popen, threading.Thread]:
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(env) if env is not None else None,
        start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only; it forwards once
    )
    thread = threading.Thread(target=_forward, args=(proc.stdout, f"[client {k}] ".encode(), out, lock), daemon=True)
    thread.start()
    return proc, thread


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until every client exited 0 (None) or one failed: (its index, its exit code)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = next(((k, c) for k, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is not None or all(c == 0 for c in codes):
            return failed
        time.sleep(0.1)


def _stop_after_failure(procs: list[subprocess.Popen], threads: list[threading.Thread], failed: tuple[int, int],
                        received: list[int], grace: float) -> int:
    """Stop the others, say why, and return the launcher's exit code."""
    k, code = failed
    if received:  # every client got the signal: let them checkpoint and exit within `grace`
        _wait(procs, grace)
    still_running = [i for i, proc in enumerate(procs) if proc.poll() is None]
    _stop(procs, grace)
    for thread in threads:
        thread.join(timeout=5)
    if received:
        codes = ", ".join(f"client {i}: {_describe(p.returncode)}" for i, p in enumerate(procs))
        message = f"stopped by {signal.Signals(received[0]).name} ({codes})"
    else:
        message = f"client {k} failed with {_describe(code)}"
        if still_running:
            message += f"; stopped client(s) {', '.join(map(str, still_running))}"
    print(f"launch: {message}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def run_clients(
    commands: Sequence[Sequence[str]],
    *,
    grace: float = 10.0,
    out: IO[bytes] | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run one process per command, forward their output, and wait for all of them.

    Returns 0 when every client exits 0. When one fails (or is killed) the others get SIGTERM, then
    SIGKILL after `grace` seconds, a message naming the client goes to stderr, and its exit code is
    returned (128 + signal for a client killed by a signal). SIGINT/SIGTERM to this process are
    passed on to the clients, which checkpoint and exit; the launcher then returns their status.
    """
    out = out if out is not None else sys.stdout.buffer
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    received: list[int] = []

    def forward_signal(signum, _frame):  # noqa: ANN001
        received.append(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        previous = {sig: signal.signal(sig, forward_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for k, command in enumerate(commands):
            proc, thread = _start_client(k, command, env, out, lock)
            procs.append(proc)
            threads.append(thread)
        failed = _first_failure(procs)
        if failed is not None:
            return _stop_after_failure(procs, threads, failed, received, grace)
        for thread in threads:
            thread.join(timeout=5)
        return 0
    except BaseException:
        _stop(procs, grace)
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def launch_local(num_clients: int, argv: Sequence[str], *, grace: float = 10.0) -> int:
    """`python -m train --launch-local N ...`: N clients of one mesh on this machine."""
    if num_clients < 1:
        raise ClusterError(f"--launch-local must be at least 1, got {num_clients}")
    commands = client_commands(num_clients, argv)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_JOBS, ENV_CLIENT_ID)}
    log.info("launching %d client(s) on %s", num_clients, commands[0][-1])
    return run_clients(commands, grace=grace, env=env)
