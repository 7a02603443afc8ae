"""Start `python -m serve` as a real process on a free localhost port (end-to-end tests, bench)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]

CPP_LOG = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]|To enable the "
                     r"following instructions)", re.M)
"""TensorFlow's C++ log lines: absl's banner, glog-style lines, the CPU-feature notice."""


def poll_ready(url: str, timeout: float, alive=lambda: True, path: str = "/readyz", **tls) -> float | None:  # noqa: ANN001
    """Seconds until `url + path` answered 200, or None after `timeout` or once `alive()` is false.
    Connection errors count as "not yet": a server still binding, or one whose port accepts
    before a worker does. `tls`: requests' `verify` and `cert` for an https:// URL."""
    start = time.monotonic()
    while time.monotonic() - start < timeout and alive():
        try:
            if requests.get(url + path, timeout=1, **tls).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.1)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real server; with `grpc=True` it also serves gRPC, at `grpc_target`."""

    def __init__(
        self,
        model_dir: Path,
        *args: str,
        grpc: bool = False,
        log_path: Path | None = None,
        ready_timeout: float = 90.0,
        wait_for: str = "/readyz",
        model_args: tuple[str, ...] | None = None,
        prefix: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        tls: dict | None = None,
    ) -> None:
        """Start the server and wait until `wait_for` answers 200 (`/healthz`: only until it listens).
        `model_args` replace `--model-dir model_dir` (e.g. `--model-config-file F`); `prefix` runs
        it under another command (e.g. `setpriv` to drop privileges); `env` is added to the environment;
        `tls`: requests' `verify` (and `cert`) for a server started with --tls-cert, whose `url` is
        then https://localhost:PORT."""
        self.port = free_port()
        self.tls = tls or {}
        self.url = f"https://localhost:{self.port}" if tls else f"http://127.0.0.1:{self.port}"
        self.grpc_target = None
        if grpc:
            grpc_port = free_port()
            self.grpc_target = f"127.0.0.1:{grpc_port}"
            args = ("--grpc-port", str(grpc_port), *args)
        # without a log_path: a private directory, removed with the server (its text stays readable)
        self._own_dir = None if log_path else Path(tempfile.mkdtemp(prefix="serve-"))
        self._final_log: str | None = None
        self.log_path = log_path or self._own_dir / "serve.log"
        self._log = open(self.log_path, "wb")
        # As a user would start it: the server keeps TensorFlow's C++ lines out of its log itself.
        env = {**{k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}, "PYTHONUNBUFFERED": "1",
               **(env or {})}
        if "--workers" not in args:
            # One process unless a test asks for more: it starts in half the time and memory. The
            # default (one worker per CPU) is what test_readme's first command and the --workers
            # tests run.
            args = (*args, "--workers", "1")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "serve", *(model_args or ("--model-dir", str(model_dir))), "--host", "127.0.0.1",
             "--port", str(self.port), *args],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        self.wait_ready(ready_timeout, wait_for)

    def wait_ready(self, timeout: float, path: str = "/readyz") -> None:
        if poll_ready(self.url, timeout, lambda: self.proc.poll() is None, path, **self.tls) is not None:
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def in_flight(self) -> int:
        """Requests the server is handling now (REST and gRPC), not counting this scrape itself."""
        text = requests.get(self.url + "/monitoring/prometheus/metrics", timeout=5).text
        line = next(line for line in text.splitlines() if line.startswith("serve_in_flight_requests "))
        return int(float(line.split()[1])) - 1

    def wait_in_flight(self, count: int, timeout: float = 20.0, at_least: bool = True) -> None:
        """Poll until `count` requests (at least, or exactly) are being handled."""
        end = time.monotonic() + timeout
        while True:
            now = self.in_flight()
            if now >= count if at_least else now == count:
                return
            assert time.monotonic() < end, f"{now} request(s) in flight after {timeout}s, waiting for {count}"
            time.sleep(0.02)

    def rss_mib(self) -> float:
        """The server process's resident memory now."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def log(self, full: bool = False) -> str:
        """The server's output so far (its last 5,000 characters unless `full`), also after stop()."""
        if self._final_log is not None:
            text = self._final_log
        else:
            if not self._log.closed:
                self._log.flush()
            text = self.log_path.read_text(errors="replace")
        return text if full else text[-5000:]

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> int:
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()
            if self._own_dir is not None:
                self._final_log = self.log_path.read_text(errors="replace")
                shutil.rmtree(self._own_dir, ignore_errors=True)


class HealthProbe:
    """While open, asks `/healthz` every 20 ms on its own connection and keeps the slowest answer:
    what a small request costs other clients (`with HealthProbe(url) as probe: ...; probe.worst_s`)."""

    def __init__(self, url: str) -> None:
        self.url = url + "/healthz"
        self.worst_s = 0.0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        session = requests.Session()
        while not self._stop.wait(0.02):
            start = time.perf_counter()
            try:
                ok = session.get(self.url, timeout=5).status_code == 200
            except requests.RequestException:
                ok = False
            self.worst_s = max(self.worst_s, time.perf_counter() - start)
            self.failures += not ok

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join()
