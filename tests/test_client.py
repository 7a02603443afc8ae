"""`client`: SentimentClient and `python -m client` against real server processes (REST, TF Serving's
gRPC API and V2 over gRPC), retries through real flaky servers, and error mapping on every transport."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
import requests
from conftest import MODEL_NAME
from serve_process import REPO, ServerProcess, free_port

from client import (
    ClientError,
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    ModelVersionStatus,
    Prediction,
    SentimentClient,
    ServerUnavailable,
)

pytestmark = pytest.mark.slow

TEXTS = ["a great movie, wonderful acting", "awful and boring", "the plot was dull", "fun story",
         "excellent excellent excellent", "bad", "not bad at all", "I want my money back", "zzz", "the end"]


def _start(model_base, *args: str) -> ServerProcess:
    return ServerProcess(model_base, "--poll-interval", "0", *args, grpc=True)


@pytest.fixture(scope="module")
def server(model_base):
    srv = _start(model_base)
    yield srv
    assert srv.stop() == 0, srv.log()


def url_of(server: ServerProcess, transport: str) -> str:
    return server.url if transport == "rest" else server.grpc_target


TRANSPORTS = ["rest", "grpc", "grpc-v2"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def client(request, server):
    with SentimentClient(url_of(server, request.param), MODEL_NAME, transport=request.param,
                         backoff_s=0.01, batch_size=4) as c:
        yield c


def dead_url(transport: str) -> str:
    port = free_port()  # nothing listens there
    return f"http://127.0.0.1:{port}" if transport == "rest" else f"127.0.0.1:{port}"


# -- the API on both transports ------------------------------------------------------------------

def test_predict_matches_the_servers_own_answers(client, server):
    got = client.predict(TEXTS)  # 10 texts in requests of 4, 4, 2
    friendly = requests.post(f"{server.url}/v1/sentiment", json={"texts": TEXTS}, timeout=10).json()
    assert [p.text for p in got] == TEXTS
    for p, want in zip(got, friendly):
        assert isinstance(p, Prediction)
        assert p.label == want["label"] and p.label in ("negative", "positive")
        assert p.probabilities == pytest.approx(want["probabilities"], abs=1e-6)
        assert p.score == p.probabilities[p.label] == pytest.approx(want["score"], abs=1e-6)
    assert client.predict("great movie") == client.predict(["great movie"])  # one text is a list of one


def test_every_transport_gives_the_same_answers(server):
    rest = SentimentClient(server.url, MODEL_NAME).predict(TEXTS)
    for transport in ("grpc", "grpc-v2"):
        other = SentimentClient(server.grpc_target, MODEL_NAME, transport=transport).predict(TEXTS)
        assert [p.label for p in other] == [p.label for p in rest], transport
        for r, o in zip(rest, other):  # float32 on the wire; JSON's shortest decimal of it on REST
            assert r.probabilities == pytest.approx(o.probabilities, abs=1e-6)


def test_status_metadata_and_wait_until_ready(client):
    assert client.status() == [ModelVersionStatus(version=1, state="AVAILABLE")]
    assert client.wait_until_ready(timeout=5) == client.status()
    meta = client.metadata()
    if client.transport == "grpc-v2":  # V2's own metadata
        assert (meta["name"], meta["versions"], meta["platform"]) == (MODEL_NAME, ["1"], "tensorflow_savedmodel")
        assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
        return
    assert meta["model_spec"] == {"name": MODEL_NAME, "signature_name": "", "version": "1"}
    signatures = meta["metadata"]["signature_def"]["signature_def"]
    assert signatures["serving_default"]["inputs"]["text"]["dtype"] == "DT_STRING"
    assert signatures["classify"]["method_name"] == "tensorflow/serving/classify"


def test_pinned_version(server):
    for transport in TRANSPORTS:
        c = SentimentClient(url_of(server, transport), MODEL_NAME, transport=transport, version=1)
        assert c.status()[0].version == 1 and c.predict(["good"])[0].label in ("negative", "positive")


# -- errors, on both transports ------------------------------------------------------------------

def test_error_mapping(client):
    url, transport = client.url, client.transport
    with pytest.raises(ModelNotFound, match=r"Servable not found for request: Latest\(nope\)") as info:
        SentimentClient(url, "nope", transport=transport).predict(["good"])
    assert info.value.status == (404 if transport == "rest" else "NOT_FOUND")
    with pytest.raises(ModelNotFound, match=r"Could not find version 9|Specific\(sentiment, 9\)"):
        SentimentClient(url, MODEL_NAME, transport=transport, version=9).status()
    with pytest.raises(InvalidInput, match="text is empty") as info:
        client.predict(["fine", "  "])
    assert info.value.status == (400 if transport == "rest" else "INVALID_ARGUMENT")
    assert isinstance(info.value, ValueError) and isinstance(info.value, ClientError)
    with pytest.raises(InvalidInput, match="no texts"):
        client.predict([])
    with pytest.raises(InvalidInput, match=r"texts\[1\] is int"):
        client.predict(["fine", 3])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_server_down_is_server_unavailable(transport):
    c = SentimentClient(dead_url(transport), MODEL_NAME, transport=transport, retries=2, backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match="Connection refused|Failed to connect") as info:
        c.predict(["good"])
    assert isinstance(info.value, ConnectionError)
    with pytest.raises(ServerUnavailable, match="not ready after 0.3s"):
        c.wait_until_ready(timeout=0.3)
    assert time.monotonic() - start < 5


@pytest.fixture(scope="module")
def slow_server(slow_model):
    """Model calls take 2 s, the server's deadline is 3 s, one queued row at most, batches of one."""
    srv = _start(slow_model(2.0), "--request-timeout", "3", "--max-queued-rows", "1",
                 "--max-batch-size", "1", "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deadlines_and_overload(slow_server, transport):
    url = url_of(slow_server, transport)
    slow = SentimentClient(url, MODEL_NAME, transport=transport, retries=0, timeout=10)
    for _ in range(3):  # the first model call is the slowest; on a busy machine it may miss its deadline
        try:
            slow.predict(["warm up"])
            break
        except DeadlineExceeded:
            pass
    # The client's own timeout.
    with pytest.raises(DeadlineExceeded) as info:
        SentimentClient(url, MODEL_NAME, transport=transport, timeout=0.3).predict(["too slow"])
    assert isinstance(info.value, TimeoutError)
    # The abandoned request's model call still runs for up to 2 s; no gauge shows a call whose gRPC
    # request was cancelled, so wait it out.
    time.sleep(2.2)
    # The server's deadline (504 / DEADLINE_EXCEEDED) and its full queue (429 / RESOURCE_EXHAUSTED).
    with futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(slow.predict, ["first"])
        slow_server.wait_in_flight(1)
        second = pool.submit(slow.predict, ["second"])  # waits for first (2 s), runs past its deadline (3 s)
        slow_server.wait_in_flight(2)
        with pytest.raises(ServerUnavailable, match="overloaded") as info:
            slow.predict(["third"])
        assert info.value.status == (429 if transport == "rest" else "RESOURCE_EXHAUSTED")
        assert first.result()[0].label in ("negative", "positive")
        with pytest.raises(DeadlineExceeded, match="deadline exceeded") as info:
            second.result()
        assert info.value.status == (504 if transport == "rest" else "DEADLINE_EXCEEDED")
    slow_server.wait_in_flight(0, at_least=False)  # the queue is empty again


# -- retries through a real flaky HTTP server ----------------------------------------------------

CLOSE = 0
"""A scripted failure of FlakyServer: close the connection without answering."""


class FlakyServer:
    """A real HTTP server on localhost: answers the scripted failures `(status, headers)` first, then
    forwards every request to `upstream` (the real model server). Records every request it gets."""

    def __init__(self, upstream: str, failures: list[tuple[int, dict[str, str]]]) -> None:
        self.failures = list(failures)
        self.hits: list[tuple[str, str, float]] = []
        lock = threading.Lock()
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    flaky.hits.append((self.command, self.path, time.monotonic()))
                    failure = flaky.failures.pop(0) if flaky.failures else None
                if failure is not None:
                    status, headers = failure
                    if status == CLOSE:  # the request was read, then the connection closes unanswered
                        self.close_connection = True
                        return
                    self._reply(status, json.dumps({"error": f"scripted failure {status}"}).encode(), headers)
                    return
                r = requests.request(self.command, upstream + self.path, data=body or None, timeout=10,
                                     headers={"Content-Type": "application/json"})
                self._reply(r.status_code, r.content, {})

            def _reply(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def __enter__(self) -> "FlakyServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def test_retries_on_503_then_succeeds(server):
    with FlakyServer(server.url, [(503, {}), (503, {})]) as flaky:
        c = SentimentClient(flaky.url, MODEL_NAME, retries=3, backoff_s=0.05)
        got = c.predict(["great movie", "awful"])
        assert [p.label for p in got] == [p.label for p in SentimentClient(server.url, MODEL_NAME).predict(
            ["great movie", "awful"])]
        assert len(flaky.hits) == 3
        gaps = [b[2] - a[2] for a, b in zip(flaky.hits, flaky.hits[1:])]
        assert gaps[0] >= 0.025 and gaps[1] >= 0.05  # exponential backoff with jitter: [d/2, d], d = 0.05 * 2**n


def test_a_connection_closed_before_any_answer_is_retried_at_once(server):
    with FlakyServer(server.url, [(CLOSE, {})]) as flaky:
        c = SentimentClient(flaky.url, MODEL_NAME, retries=1, backoff_s=5.0)
        assert c.predict(["great movie"])[0].label in ("positive", "negative")
        assert len(flaky.hits) == 2 and flaky.hits[1][2] - flaky.hits[0][2] < 1.0  # no backoff


def test_retry_after_is_respected_and_429_retried(server):
    with FlakyServer(server.url, [(429, {"Retry-After": "1"}), (503, {"Retry-After": "0"})]) as flaky:
        start = time.monotonic()
        assert SentimentClient(flaky.url, MODEL_NAME, backoff_s=0.01).status()[0].available
        assert len(flaky.hits) == 3 and 1.0 <= time.monotonic() - start < 5


def test_retries_exhausted_raise_with_the_servers_message(server):
    with FlakyServer(server.url, [(503, {"Retry-After": "0"})] * 10) as flaky:
        with pytest.raises(ServerUnavailable, match="scripted failure 503") as info:
            SentimentClient(flaky.url, MODEL_NAME, retries=2).predict(["good"])
        assert info.value.status == 503 and len(flaky.hits) == 3


@pytest.mark.parametrize("status, error", [(400, InvalidInput), (404, ModelNotFound), (500, ClientError),
                                           (504, DeadlineExceeded)])
def test_no_retry_on_other_errors(server, status, error):
    with FlakyServer(server.url, [(status, {})]) as flaky:
        with pytest.raises(error, match=f"scripted failure {status}") as info:
            SentimentClient(flaky.url, MODEL_NAME, retries=3, backoff_s=0.01).predict(["good"])
        assert type(info.value) is error and info.value.status == status
        assert len(flaky.hits) == 1


def test_large_inputs_are_chunked(server):
    texts = [f"review number {i}, quite good" for i in range(150)]
    with FlakyServer(server.url, []) as flaky:
        got = SentimentClient(flaky.url, MODEL_NAME, batch_size=64).predict(texts)
    assert [p.text for p in got] == texts
    assert [h[:2] for h in flaky.hits] == [("POST", f"/v1/models/{MODEL_NAME}:predict")] * 3  # 64 + 64 + 22


def test_grpc_retries_on_unavailable(server):
    """A real gRPC server in front of the model server: UNAVAILABLE twice, then forwards."""
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    upstream = grpc.insecure_channel(server.grpc_target)
    forward = prediction_service_pb2_grpc.PredictionServiceStub(upstream)
    calls = []

    class Flaky(prediction_service_pb2_grpc.PredictionServiceServicer):
        def Predict(self, request, context):
            calls.append(time.monotonic())
            if len(calls) <= 2:
                context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: warming up")
            return forward.Predict(request, timeout=10)

    front = grpc.server(futures.ThreadPoolExecutor(4))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(Flaky(), front)
    port = front.add_insecure_port("127.0.0.1:0")
    front.start()
    try:
        c = SentimentClient(f"127.0.0.1:{port}", MODEL_NAME, transport="grpc", backoff_s=0.01)
        assert c.predict(["good"])[0].label in ("negative", "positive") and len(calls) == 3
        calls.clear()
        with pytest.raises(ServerUnavailable, match="scripted: warming up"):
            SentimentClient(f"127.0.0.1:{port}", MODEL_NAME, transport="grpc", retries=1, backoff_s=0.01).predict(["x"])
        assert len(calls) == 2
    finally:
        front.stop(0).wait()
        upstream.close()


# -- no TensorFlow on the REST path; the CLI -----------------------------------------------------

def _python(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, input=stdin, timeout=120)


def test_rest_client_does_not_import_tensorflow(server):
    code = f"""
import sys
from client import SentimentClient
(p,) = SentimentClient({server.url!r}, {MODEL_NAME!r}).predict(["great movie"])
assert p.label in ("negative", "positive"), p
print(sorted({{m.split(".")[0] for m in sys.modules}} & {{"tensorflow", "tensorflow_serving", "grpc", "keras"}}))
"""
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_cli_prints_label_and_score_per_line(server, tmp_path):
    reviews = tmp_path / "reviews.txt"
    reviews.write_text("great movie\n\nawful, boring plot\n", encoding="utf-8")
    result = _python("-m", "client", "--url", server.url, "what a film", "--file", str(reviews))
    assert result.returncode == 0, result.stderr
    want = SentimentClient(server.url, MODEL_NAME).predict(["what a film", "great movie", "awful, boring plot"])
    assert result.stdout.splitlines() == [f"{p.label}\t{p.score:.4f}\t{p.text}" for p in want]

    result = _python("-m", "client", "--url", server.url, "--json", "--file", "-", stdin="great movie\n")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert set(row) == {"text", "label", "score", "probabilities"} and row["text"] == "great movie"


@pytest.mark.parametrize("transport", ["grpc", "grpc-v2"])
def test_cli_grpc(server, transport):
    result = _python("-m", "client", "--transport", transport, "--url", server.grpc_target, "--json", "great movie", "bad")
    assert result.returncode == 0, result.stderr
    rest = SentimentClient(server.url, MODEL_NAME).predict(["great movie", "bad"])
    assert [r["label"] for r in json.loads(result.stdout)] == [p.label for p in rest]


def test_cli_errors(server):
    down = _python("-m", "client", "--url", dead_url("rest"), "--retries", "1", "good")
    assert down.returncode == 3 and down.stdout == ""
    assert "error: server unavailable: cannot connect to http://127.0.0.1:" in down.stderr
    assert "Connection refused" in down.stderr and "is the server running" in down.stderr

    missing = _python("-m", "client", "--url", server.url, "--model", "nope", "good")
    assert missing.returncode == 1 and "ModelNotFound: Servable not found" in missing.stderr

    empty = _python("-m", "client", "--url", server.url, "   ")
    assert empty.returncode == 1 and "InvalidInput: instances[0]: text is empty (status 400)" in empty.stderr

    usage = _python("-m", "client", "--url", server.url)
    assert usage.returncode == 2 and "no texts" in usage.stderr


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:99999", "the port must be a number from 1 to 65535"),
    ("http://127.0.0.1:abc", "the port must be a number from 1 to 65535"),
    ("ftp://127.0.0.1:8501", "expected http://host:port or https://host:port"),
])
def test_cli_malformed_url_is_a_usage_error(url, message):
    result = _python("-m", "client", "--url", url, "good")
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_cli_https_against_plain_http_fails_fast_with_a_clear_message(server):
    start = time.monotonic()
    result = _python("-m", "client", "--url", server.url.replace("http://", "https://"), "--timeout", "30", "good")
    assert result.returncode == 2 and time.monotonic() - start < 10, result.stderr
    assert f"the server speaks plain HTTP, use {server.url}" in result.stderr


def test_the_client_installs_alone_without_tensorflow(server, tmp_path):
    """`pip install ./client` in a fresh virtual environment: requests only, no TensorFlow, and the
    CLI answers against a running server; the gRPC transports ask for their extra, and with
    `./client[grpc]` (grpcio and protobuf, still no TensorFlow) answer as REST does."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", str(REPO / "client")],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    no_tf = subprocess.run([python, "-c", "import tensorflow"], capture_output=True, text=True, cwd=tmp_path)
    assert no_tf.returncode != 0 and "No module named 'tensorflow'" in no_tf.stderr
    # run from tmp_path, so only the installed copy of the package can be imported
    cli = subprocess.run([python, "-m", "client", "--url", server.url, "--json", "a wonderful film"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)[0]["label"] in ("negative", "positive")
    script = subprocess.run([str(venv / "bin" / "sentiment-client"), "--url", server.url, "good"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert script.returncode == 0 and script.stdout.split("\t")[0] in ("negative", "positive"), script.stderr
    grpc_ = subprocess.run([python, "-m", "client", "--transport", "grpc", "--url", server.grpc_target, "good"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert grpc_.returncode == 2 and 'pip install "sentiment-client[grpc]"' in grpc_.stderr, grpc_.stderr

    install = subprocess.run([python, "-m", "pip", "install", "-q", f"{REPO / 'client'}[grpc]"],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    rest = SentimentClient(server.url, MODEL_NAME).predict(["good", "a dull film"])
    for transport in ("grpc", "grpc-v2"):
        code = f"""
import json, sys
from client import SentimentClient
with SentimentClient({server.grpc_target!r}, {MODEL_NAME!r}, transport={transport!r}) as c:
    print(json.dumps([(p.label, p.probabilities) for p in c.predict(["good", "a dull film"])]))
    print(c.status()[0].state)
print(sorted({{m.split(".")[0] for m in sys.modules}} & {{"tensorflow", "tensorflow_serving", "tritonclient"}}))
"""
        result = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert result.returncode == 0, result.stderr
        answers, state, modules = result.stdout.splitlines()
        assert (state, modules) == ("AVAILABLE", "[]")
        for (label, probabilities), want in zip(json.loads(answers), rest):
            assert label == want.label and probabilities == pytest.approx(want.probabilities, abs=1e-6)
