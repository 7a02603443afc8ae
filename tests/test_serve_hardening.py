"""The HTTP layer under abuse, against a real `python -m serve` process: slow and malformed clients,
connection floods, SIGTERM under load, hostile gRPC messages, several workers on one port."""

from __future__ import annotations

import http.client
import json
import os
import re
import selectors
import signal
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
import requests
from conftest import MODEL_NAME
from serve_process import ServerProcess
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

pytestmark = pytest.mark.slow

PREDICT = f"/v1/models/{MODEL_NAME}:predict"
BODY = json.dumps({"instances": ["a wonderful film, great acting"]}).encode()


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response from a raw socket: (status, lower-case headers, body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock, timeout)


def request_bytes(method: str = "POST", path: str = PREDICT, body: bytes = BODY, extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--header-timeout", "1", "--body-timeout", "1",
                        "--max-connections", "256", "--max-header-bytes", "8192", "--max-body-bytes", "100000",
                        grpc=True, log_path=tmp_path_factory.mktemp("hardening") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log()


# -- the HTTP layer's own errors are JSON ----------------------------------------------------------

@pytest.mark.parametrize("data, status, error", [
    (b"GARBAGE\r\n\r\n", 400, "malformed HTTP request: "),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "malformed HTTP request: "),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "malformed HTTP request: "),
    (request_bytes(extra="X-Big: " + "a" * 9000 + "\r\n"), 431, "request headers larger than the limit of 8192 bytes"),
    (request_bytes(extra="".join(f"X-{i}: 1\r\n" for i in range(300))), 431, "more than 256 request headers"),
    (request_bytes(body=b"x" * 100_001), 413, "request body larger than the limit of 100000 bytes"),
    # No length declared: counted as it comes. To a route that takes a body (POST / is a 405 as soon as
    # its headers are read, which may be before the body has come in).
    (f"POST {PREDICT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
     + (b"3e8\r\n" + b"x" * 1000 + b"\r\n") * 101, 413, "request body larger than the limit of 100000 bytes"),
    (request_bytes(extra="Transfer-Encoding: gzip, chunked\r\n").replace(b"Content-Length: ", b"X-Length: "), 501,
     "Transfer-Encoding 'gzip, chunked' is not implemented: send the body with Content-Length or"),
    (request_bytes().replace(b"Host: x\r\n", b""), 400, "a request needs exactly one Host header"),
    (request_bytes(extra="Host: y\r\n"), 400, "a request needs exactly one Host header"),
    (request_bytes(path="/v1/models/" + "m" * 70_000), 414, "request target longer than the limit of 8192 bytes"),
    (request_bytes(method="PUT"), 405, f"Method Not Allowed: PUT {PREDICT} (allowed: POST)"),
    (request_bytes(method="GET", path="/nope", body=b""), 404, "Not Found: no route for GET /nope"),
    (request_bytes(method="GET", path="//healthz", body=b""), 404, "Not Found: no route for GET //healthz"),
])
def test_every_error_body_is_json(server, data, status, error):
    got, headers, body = exchange(server.port, data)
    assert got == status and headers["content-type"] == "application/json", (got, headers, body)
    assert json.loads(body)["error"].startswith(error)


@pytest.mark.parametrize("first", [
    request_bytes(extra="Connection: close\r\n"),
    request_bytes().replace(b"HTTP/1.1", b"HTTP/1.0"),
])
def test_a_request_that_closes_the_connection_is_answered_whatever_follows_it(server, first):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(first + b"GARBAGE AFTER THE REQUEST\r\n\r\n")  # one segment
        status, headers, body = read_response(sock)
        assert status == 200 and headers["connection"] == "close" and "predictions" in json.loads(body)
        assert sock.recv(65536) == b""  # then closed, neither reset nor a second answer


def test_an_http10_keep_alive_answer_says_so_and_the_connection_goes_on(server):
    request = f"GET /v1/models/{MODEL_NAME} HTTP/1.0\r\nConnection: keep-alive\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(request)
            status, headers, _ = read_response(sock)
            assert status == 200 and headers["connection"] == "keep-alive"
        sock.sendall(request.replace(b"Connection: keep-alive\r\n", b""))  # HTTP/1.0's default: close
        status, headers, _ = read_response(sock)
        assert status == 200 and headers["connection"] == "close" and sock.recv(10) == b""


def test_json_answers_list_their_members_in_one_order(server):
    orders = set()
    for _ in range(20):
        answer = requests.post(f"{server.url}{PREDICT}", data=BODY, timeout=10).json()
        orders.add(tuple(answer["predictions"][0]))
    assert len(orders) == 1 and list(orders.pop()) == sorted(answer["predictions"][0])


def test_head_answers_like_get_without_a_body(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("HEAD", f"/v1/models/{MODEL_NAME}")
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b""
    assert int(response.headers["Content-Length"]) == len(requests.get(f"{server.url}/v1/models/{MODEL_NAME}").content)


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """`count` responses read in order from one connection: (status, body)."""
    reader = sock.makefile("rb")
    answers = []
    for _ in range(count):
        status = int(reader.readline().split()[1])
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        answers.append((status, reader.read(length)))
    return answers


def test_pipelined_chunked_and_expect_continue_requests_are_answered_in_order(server):
    chunked = (f"POST {PREDICT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               f"{len(BODY) - 5:x}\r\n").encode() + BODY[:-5] + b"\r\n5\r\n" + BODY[-5:] + b"\r\n0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request_bytes(method="GET", path="/nope", body=b"") + request_bytes() + chunked
                     + request_bytes(method="GET", path="/healthz", body=b""))
        answers = _read_answers(sock, 4)
    assert [status for status, _ in answers] == [404, 200, 200, 200], answers
    assert answers[1][1] == answers[2][1] and json.loads(answers[3][1]) == {"status": "ok"}
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request_bytes(body=b"", extra=f"Content-Length: {len(BODY)}\r\nExpect: 100-continue\r\n")
                     .replace(b"Content-Length: 0\r\n", b""))
        assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"  # before any of the body is sent
        sock.sendall(BODY)
        assert _read_answers(sock, 1)[0] == answers[1]


# -- slow clients and connection floods ------------------------------------------------------------

def _slow_clients(port: int, n: int) -> list[socket.socket]:
    """Slowloris: connections that send a request line and one header, then nothing more."""
    slow = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST " + PREDICT.encode() + b" HTTP/1.1\r\nHost: x\r\n")
        slow.append(sock)
    return slow


def test_slow_header_clients_neither_lock_out_others_nor_stay_forever(server):
    slow = _slow_clients(server.port, 200)
    try:
        start = time.monotonic()
        r = requests.post(server.url + PREDICT, data=BODY, timeout=10)
        assert r.status_code == 200 and time.monotonic() - start < 2
        # --header-timeout 1: each slow client gets a JSON 408 and the connection closes
        answers = [read_response(sock, 10) for sock in slow]
        assert [status for status, _, _ in answers] == [408] * 200
        assert json.loads(answers[0][2]) == {"error": "request headers not received within 1s"}
        assert all(sock.recv(1) == b"" for sock in slow)
    finally:
        for sock in slow:
            sock.close()


def test_at_the_connection_limit_slow_clients_make_room_for_new_ones(model_base, tmp_path):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--max-connections", "50", "--header-timeout", "60",
                        log_path=tmp_path / "serve.log")
    slow = _slow_clients(srv.port, 50)
    try:
        time.sleep(1.5)  # they have held their connections for a while
        for _ in range(3):
            assert requests.post(srv.url + PREDICT, data=BODY, timeout=10).status_code == 200
        status, _, body = read_response(slow[0], 10)  # the longest-waiting one made room
        assert (status, json.loads(body)["error"]) == (
            408, "request headers not received in time (the server needed the connection)")
    finally:
        for sock in slow:
            sock.close()
        assert srv.stop() == 0, srv.log()


def test_a_body_that_never_arrives_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request_bytes(body=BODY)[:-5])
        status, _, body = read_response(sock, 10)
    assert (status, json.loads(body)) == (408, {"error": "request body not received within 1s"})


def test_512_connections_get_answers_or_503_never_a_timeout(server):
    """--max-connections 256: every connection past it is answered 503 at once, with Retry-After."""
    selector = selectors.DefaultSelector()
    socks = []
    try:
        for _ in range(512):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            sock.sendall(request_bytes())
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, bytearray())
            socks.append(sock)
        done: dict[socket.socket, bytes] = {}
        deadline = time.monotonic() + 30
        while len(done) < len(socks) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1):
                chunk = key.fileobj.recv(65536)
                key.data.extend(chunk)
                head, sep, body = bytes(key.data).partition(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head, re.I)
                if not chunk or (sep and length and len(body) >= int(length.group(1))):
                    done[key.fileobj] = bytes(key.data)
                    selector.unregister(key.fileobj)
        statuses = [int(done[s].split(b" ", 2)[1]) if s in done and done[s] else None for s in socks]
    finally:
        for sock in socks:
            sock.close()
    assert None not in statuses, f"{statuses.count(None)} connections got no answer"
    assert set(statuses) == {200, 503} and statuses.count(503) >= 512 - 256
    refused = next(done[s] for s, status in zip(socks, statuses) if status == 503)
    assert b"retry-after: 1" in refused.lower() and b'{"error":"server busy: ' in refused


# -- gRPC messages that lie about their size ---------------------------------------------------------

def _rss_kib(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))


def test_grpc_declared_shape_is_checked_before_anything_is_allocated(server):
    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(server.grpc_target))
    before = _rss_kib(server.proc.pid)
    for declared, expected in [(200_000_000, "200000000 instances in one request, more than the limit of 1024"),
                               (5, "input 'text': the tensor shape [5] declares 5 values but 1 are given")]:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        tensor = request.inputs["text"]
        tensor.dtype = 7  # DT_STRING
        tensor.tensor_shape.dim.add().size = declared
        tensor.string_val.append(b"x")
        assert len(request.SerializeToString()) < 60
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Predict(request, timeout=10)
        assert time.monotonic() - start < 0.5
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
    assert _rss_kib(server.proc.pid) - before < 20_000  # KiB: nothing was expanded


def test_grpc_garbage_and_unimplemented_methods_get_a_code_and_one_log_line(server):
    channel = grpc.insecure_channel(server.grpc_target)
    cases = [("/tensorflow.serving.PredictionService/Predict", b"\xff\xff\xff\x01garbage", grpc.StatusCode.INVALID_ARGUMENT),
             ("/tensorflow.serving.SessionService/SessionRun", b"", grpc.StatusCode.UNIMPLEMENTED),
             ("/no.such.Service/Method", b"", grpc.StatusCode.UNIMPLEMENTED)]
    for method, payload, code in cases:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(method)(payload, timeout=10)
        assert info.value.code() == code, info.value.details()
    log = server.log()
    assert "Traceback" not in log
    assert "gRPC predict: undecodable request (11 bytes)" in log
    assert "SessionRun: not implemented by this server" in log


# -- SIGTERM under keep-alive load ------------------------------------------------------------------

def _refused(exc: requests.RequestException) -> bool:
    """A new connection the server did not accept (it stopped listening): the request never left."""
    return "NewConnectionError" in repr(exc) or "Connection refused" in str(exc)


class KeepAliveLoad:
    """`clients` threads, each with its own keep-alive `requests.Session`, posting back to back; a
    session whose connection the server closed reconnects, as a real client does, until the
    server refuses new connections. Anything else that ends a request without a response is lost."""

    def __init__(self, url: str, clients: int = 32) -> None:
        self.url = url + PREDICT
        self.statuses: dict[int, int] = {}
        self.lost: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            try:
                r = session.post(self.url, data=BODY, timeout=20)
            except requests.RequestException as exc:
                if not _refused(exc):
                    with self._lock:
                        self.lost.append(repr(exc))
                return
            with self._lock:
                self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1

    def answered(self) -> int:
        with self._lock:
            return sum(self.statuses.values())

    def stop(self, timeout: float = 20.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_under_keep_alive_load_loses_no_request(model_base, workers):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--drain-timeout", "10", "--workers", str(workers))
    load = KeepAliveLoad(srv.url)
    end = time.monotonic() + 30
    while load.answered() < 1000 and time.monotonic() < end:
        time.sleep(0.05)
    sigterm_at = time.monotonic()
    srv.terminate()
    code = srv.proc.wait(15)
    drain_s = time.monotonic() - sigterm_at
    load.stop()
    srv.stop()
    log = srv.log(full=True)
    assert code == 0 and drain_s < 10, log[-3000:]  # within --drain-timeout (about 1 s on a quiet machine)
    assert load.lost == [], (len(load.lost), load.answered(), load.lost[:5])
    assert set(load.statuses) == {200}, load.statuses
    assert load.answered() >= 1000


def test_drain_delay_keeps_serving_while_readiness_fails(model_base):
    """Kubernetes' order: readiness fails first, the endpoints stop sending, then the ports close."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = ServerProcess(model_base, "--poll-interval", "0", "--drain-delay", "2", grpc=True)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(srv.grpc_target))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    sigterm_at = time.monotonic()
    srv.terminate()
    assert requests.get(srv.url + "/readyz", timeout=5).status_code == 503
    r = requests.post(srv.url + PREDICT, data=BODY, timeout=10)  # a new connection, still accepted
    assert r.status_code == 200 and r.headers["Connection"] == "close", r.headers
    answer = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert time.monotonic() - sigterm_at < 2
    code = srv.proc.wait(15)
    assert code == 0 and time.monotonic() - sigterm_at >= 2, srv.log()
    with pytest.raises(requests.ConnectionError):
        requests.post(srv.url + PREDICT, data=BODY, timeout=5)
    srv.stop()
    assert "ports open 2s more" in srv.log()


def test_drain_timeout_abandons_with_exit_1_and_says_so(slow_model, tmp_path):
    srv = ServerProcess(slow_model(3.0), "--poll-interval", "0", "--no-warmup",
                        "--drain-timeout", "0.5", log_path=tmp_path / "serve.log")
    result = {}

    def slow() -> None:
        try:
            result["r"] = requests.post(srv.url + PREDICT, data=BODY, timeout=20)
        except requests.RequestException as exc:
            result["r"] = exc

    thread = threading.Thread(target=slow)
    thread.start()
    srv.wait_in_flight(1)
    start = time.monotonic()
    srv.terminate()
    code = srv.proc.wait(15)
    elapsed = time.monotonic() - start
    thread.join()
    log = srv.log()
    srv.stop()
    assert code == 1 and elapsed < 3, log
    assert "drain timeout (0.5s): 1 request(s) abandoned" in log
    assert isinstance(result["r"], requests.RequestException)


def _per_worker(metrics: str, series: str) -> dict[str, float]:
    """{worker: value} of one series (its labels but `worker`) in a merged scrape."""
    found = {}
    for labels, value in re.findall(rf"^{re.escape(series)}\{{([^}}]*)\}} (\S+)$", metrics, re.M):
        worker = re.search(r'worker="(\d+)"', labels)
        if worker:
            found[worker.group(1)] = found.get(worker.group(1), 0.0) + float(value)
    return found


def _grpc_calls_on_separate_connections(target: str, connections: int, calls: int) -> None:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = MODEL_NAME
    request.inputs["text"].string_val.append(b"great")
    request.inputs["text"].dtype = 7
    request.inputs["text"].tensor_shape.dim.add().size = 1
    # grpcio shares one connection between channels to the same target unless told otherwise.
    channels = [grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]
    stubs = [prediction_service_pb2_grpc.PredictionServiceStub(channel) for channel in channels]
    for _ in range(calls):
        for stub in stubs:
            assert stub.Predict(request, timeout=30).outputs["label"].string_val
    for channel in channels:
        channel.close()


def test_workers_share_connections_and_one_scrape_shows_them_all(model_base):
    """32 keep-alive connections opened at once: each of 2 workers serves 30-70% of the requests,
    counted by any worker's metrics, which cover all; 8 gRPC connections split 4/4 (both ports
    go through the same AcceptGate logic)."""
    srv = ServerProcess(model_base, "--poll-interval", "0", "--workers", "2", grpc=True)
    try:
        end = time.monotonic() + 60
        while srv.log().count("version 1 live") < 2 and time.monotonic() < end:
            time.sleep(0.2)
        load = KeepAliveLoad(srv.url, clients=32)
        while load.answered() < 3000 and time.monotonic() < end + 60:
            time.sleep(0.05)
        load.stop()
        assert load.lost == [] and set(load.statuses) == {200}, (load.statuses, load.lost[:3])
        _grpc_calls_on_separate_connections(srv.grpc_target, connections=8, calls=5)
        scrapes = [requests.get(srv.url + "/monitoring/prometheus/metrics", timeout=10).text for _ in range(6)]
    finally:
        assert srv.stop() == 0, srv.log()
    grpc_calls = {}
    for labels, value in re.findall(r'^serve_requests_total\{([^}]*route="grpc_predict"[^}]*)\} (\S+)$', scrapes[-1], re.M):
        grpc_calls[re.search(r'worker="(\d+)"', labels).group(1)] = float(value)
    assert grpc_calls == {"0": 20.0, "1": 20.0}, grpc_calls
    for text in scrapes:  # whichever worker answered the scrape
        served = _per_worker(text, "serve_requests_total")
        assert set(served) == {"0", "1"}, served
        predicts = _per_worker(text, "serve_batch_size_count")
        assert sum(predicts.values()) > 0
    served = _per_worker(scrapes[-1], "serve_requests_total")
    total = sum(served.values())
    assert total >= load.answered()
    shares = {w: v / total for w, v in served.items()}
    assert all(0.3 <= share <= 0.7 for share in shares.values()), shares


def _established_per_worker(port: int, pids: list[int]) -> dict[int, int]:
    """{pid: established connections on `port`} from the kernel's socket table (what `ss -tnp`
    shows): where keep-alive connections really are, whatever the server thinks."""
    inodes = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    counts = dict.fromkeys(pids, 0)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            if local_port == port and state == "01" and inode in inodes:
                counts[inodes[inode]] += 1
    return counts


class Burst:
    """`clients` keep-alive connections opened at once, as wrk opens them, then each posting back
    to back on its own thread (and reconnecting where the server closed it)."""

    def __init__(self, port: int, clients: int = 32) -> None:
        self.answered, self.failures = 0, []
        self._lock, self._stop = threading.Lock(), threading.Event()
        connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=20) for _ in range(clients)]
        for conn in connections:
            conn.connect()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in connections]
        for t in self._threads:
            t.start()

    def _client(self, conn: http.client.HTTPConnection) -> None:
        while not self._stop.is_set():
            try:
                conn.request("POST", PREDICT, BODY, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    raise ValueError(f"status {response.status}")
            except (OSError, http.client.HTTPException, ValueError) as exc:
                with self._lock:
                    self.failures.append(repr(exc))
                return
            with self._lock:
                self.answered += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(20)


def test_a_burst_right_after_readiness_spreads_over_the_workers(model_base):
    """A load balancer starts sending as soon as the first predict answers: 32 keep-alive
    connections opened at once then all landed on one worker (32/0), and keep-alive connections
    stay where they land. The worker over its share sheds the excess (Connection: close), so the
    clients' reconnections even it out."""
    srv = ServerProcess(model_base, "--poll-interval", "0", "--workers", "2")
    burst = None
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if requests.post(srv.url + PREDICT, data=BODY, timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.05)
        burst = Burst(srv.port, clients=32)
        while srv.log().count("version 1 live") < 2 and time.monotonic() < end:
            time.sleep(0.1)
        pids = [int(p) for p in re.search(r"\(pids ([\d, ]+);", srv.log()).group(1).split(", ")]
        deadline = time.monotonic() + 10  # the excess is shed within a tick of the port (1 s here)
        counts = _established_per_worker(srv.port, pids)
        while min(counts.values()) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
            counts = _established_per_worker(srv.port, pids)
        answered = burst.answered
        while burst.answered < answered + 1000 and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        counts = _established_per_worker(srv.port, pids)  # and it stays so
    finally:
        if burst is not None:
            burst.stop()
        assert srv.stop() == 0, srv.log()
    assert burst.failures == [], burst.failures[:3]
    assert sum(counts.values()) >= 28, counts  # a few may be reconnecting at the moment of counting
    assert all(n >= 8 for n in counts.values()), counts  # 15-17 each when measured by hand


def test_a_burst_of_signals_still_stops_the_supervisor(model_base):
    """Ctrl-C pressed repeatedly, or SIGTERM sent again by an impatient orchestrator: every signal
    lands somewhere in the supervisor's loop, and it still drains its workers and exits 0. (Its
    handler once set a threading.Event: a signal landing in the few instructions where the loop
    held the Event's lock deadlocked the supervisor above its exited workers, seen once after a
    Ctrl-C; that window is too narrow for this test to hit on demand, so it pins the behaviour,
    and serve/supervisor.py's handler now takes no lock at all.)"""
    srv = ServerProcess(model_base, "--poll-interval", "0", "--workers", "2")
    try:
        end = time.monotonic() + 60
        while srv.log().count("version 1 live") < 2 and time.monotonic() < end:
            time.sleep(0.2)
        for i in range(500):  # until the supervisor has left its loop (it tells the workers to drain)
            if "received SIGTERM: draining" in srv.log():
                break
            srv.proc.send_signal(signal.SIGINT if i % 2 else signal.SIGTERM)
            time.sleep(0.002)
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        srv.stop()
    assert "all 2 workers shut down cleanly" in srv.log()


# -- several workers on one port --------------------------------------------------------------------

def test_workers_share_the_port_restart_when_killed_and_drain_together(model_base, tmp_path):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--workers", "2", grpc=True,
                        log_path=tmp_path / "serve.log")
    try:
        for _ in range(20):
            assert requests.post(srv.url + PREDICT, data=BODY, timeout=10).status_code == 200
        end = time.monotonic() + 60
        while srv.log().count("version 1 live") < 2 and time.monotonic() < end:
            time.sleep(0.2)
        assert "[worker 0]" in srv.log() and "[worker 1]" in srv.log()
        pids = [int(p) for p in re.search(r"\(pids ([\d, ]+);", srv.log()).group(1).split(", ")]
        import os

        os.kill(pids[0], signal.SIGKILL)
        end = time.monotonic() + 60
        while "starting a new one" not in srv.log() and time.monotonic() < end:
            time.sleep(0.2)
        for _ in range(20):  # the other worker (then the new one) keeps answering
            assert requests.post(srv.url + PREDICT, data=BODY, timeout=20).status_code == 200
        stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(srv.grpc_target))
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        request.inputs["text"].string_val.append(b"great")
        request.inputs["text"].dtype = 7
        request.inputs["text"].tensor_shape.dim.add().size = 1
        assert stub.Predict(request, timeout=30).outputs["label"].string_val[0] in (b"negative", b"positive")
    finally:
        code = srv.stop()
    assert code == 0, srv.log(full=True)[-3000:]
    assert "all 2 workers shut down cleanly" in srv.log(full=True)
