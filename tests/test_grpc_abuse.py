"""One abusive HTTP/2 client against a real `python -m serve` (`tests/h2_attacks.py`, in its own
process): while it attacks, a legitimate grpcio client's Predict calls all succeed, REST `/healthz`
and gRPC health on new connections answer within 100 ms (95th percentile; every one answers),
the server's memory grows by less than 100 MB and its log stays small; under every attack at once,
SIGTERM still drains within the drain timeout."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest
import requests
import tensorflow as tf
from conftest import MODEL_NAME
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import REPO, ServerProcess
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from h2_attacks import ATTACKS

pytestmark = pytest.mark.slow

ATTACK_S, HEALTH_S, GROWTH_MIB, LOG_GROWTH = 4.0, 0.1, 100, 20_000
FLAGS = ("--poll-interval", "0", "--header-timeout", "1", "--body-timeout", "2", "--keepalive-timeout", "5",
         "--send-timeout", "2", "--drain-timeout", "10")


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    srv = ServerProcess(model_base, *FLAGS, grpc=True, log_path=tmp_path_factory.mktemp("grpc-abuse") / "serve.log")
    requests.post(f"{srv.url}/v1/models/{MODEL_NAME}:predict", json={"instances": ["warm up"]}, timeout=30)
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(full=True)


def attack(name: str, target: str, seconds: float = ATTACK_S) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "h2_attacks.py"), name, target, str(seconds)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Witnesses:
    """What other clients see meanwhile: Predict calls on one grpcio channel, REST and gRPC health on
    a new connection each time."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.failed: list[str] = []
        self.predicts = 0
        self.health: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._predict, self._rest, self._grpc)]

    def __enter__(self) -> "Witnesses":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(15)

    def _predict(self) -> None:
        with grpc.insecure_channel(self.srv.grpc_target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            request = predict_pb2.PredictRequest()
            request.model_spec.name = MODEL_NAME
            request.inputs["text"].CopyFrom(tf.make_tensor_proto(["a fine film"]))
            while not self._stop.wait(0.05):
                try:
                    stub.Predict(request, timeout=5)
                    self.predicts += 1
                except grpc.RpcError as exc:
                    self.failed.append(f"Predict: {exc.code()} {exc.details()}")

    def _rest(self) -> None:
        while not self._stop.wait(0.05):
            start = time.perf_counter()
            try:
                ok = requests.get(self.srv.url + "/healthz", timeout=5, headers={"Connection": "close"}).ok
            except requests.RequestException:
                ok = False
            self._record("REST /healthz", ok, start)

    def _grpc(self) -> None:
        while not self._stop.wait(0.05):
            start = time.perf_counter()
            try:
                with grpc.insecure_channel(self.srv.grpc_target) as channel:
                    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                ok = answer.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok = False
            self._record("gRPC health", ok, start)

    def _record(self, what: str, ok: bool, start: float) -> None:
        if ok:
            self.health.append(time.perf_counter() - start)
        else:
            self.failed.append(what)

    def p95(self) -> float:
        ordered = sorted(self.health)
        return ordered[int(len(ordered) * 0.95)] if ordered else float("inf")


@pytest.mark.parametrize("name", list(ATTACKS))
def test_one_client_cannot_stall_the_worker(server, name):
    rss, log_size = server.rss_mib(), len(server.log(full=True))
    with Witnesses(server) as seen:
        attacker = attack(name, server.grpc_target)
        attacker.wait(ATTACK_S + 30)
    grown = server.rss_mib() - rss
    logged = len(server.log(full=True)) - log_size
    print(f"{name}: {seen.predicts} Predict, health p95 {seen.p95() * 1e3:.0f} ms / max "
          f"{max(seen.health, default=0) * 1e3:.0f} ms over {len(seen.health)}, RSS {grown:+.0f} MiB, log +{logged} B")
    assert not seen.failed, seen.failed[:5]
    assert seen.predicts > 10 and len(seen.health) > 20
    assert seen.p95() < HEALTH_S, sorted(seen.health)[-10:]
    assert grown < GROWTH_MIB and logged < LOG_GROWTH, (grown, logged, server.log()[-2000:])


def test_sigterm_drains_under_every_attack_at_once(model_base, tmp_path):
    srv = ServerProcess(model_base, *FLAGS, grpc=True, log_path=tmp_path / "serve.log")
    attackers = [attack(name, srv.grpc_target, 20) for name in ATTACKS]
    try:
        time.sleep(2)
        start = time.monotonic()
        code = srv.stop(timeout=30)
        took = time.monotonic() - start
    finally:
        for attacker in attackers:
            attacker.kill()
    print(f"drained in {took:.1f}s")
    assert code == 0 and took < 10 + 3, (code, took, srv.log())
