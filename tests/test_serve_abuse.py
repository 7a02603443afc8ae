"""Small requests with a large cost, against a real `python -m serve`: each is answered within a
second, the server's memory grows by less than 100 MB, and `/healthz` stays fast meanwhile.
Also the model directories, config changes, supervisor deaths and damaged files that once wedged
the server or printed a traceback."""

from __future__ import annotations

import gzip
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import orjson
import pytest
import requests
from conftest import MODEL_NAME, copy_model_base
from serve_process import REPO, HealthProbe, ServerProcess
from tensorflow_serving.apis import classification_pb2, predict_pb2, prediction_service_pb2_grpc

pytestmark = pytest.mark.slow

PREDICT = f"/v1/models/{MODEL_NAME}:predict"
CLASSIFY = f"/v1/models/{MODEL_NAME}:classify"
INFER = f"/v2/models/{MODEL_NAME}/infer"
ANSWER_S, GROWTH_MIB, HEALTH_S = 1.0, 100, 0.1


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    srv = ServerProcess(model_base, "--poll-interval", "0", grpc=True,
                        log_path=tmp_path_factory.mktemp("abuse") / "serve.log")
    requests.post(srv.url + PREDICT, json={"instances": ["warm up the model"]}, timeout=30)
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(full=True)


def settled_rss(srv: ServerProcess, below: float, timeout: float = 3.0) -> float:
    """The server's RSS once it is below `below` MiB (memory is handed back just after a large
    request), or what it is after `timeout`."""
    end = time.monotonic() + timeout
    while (rss := srv.rss_mib()) >= below and time.monotonic() < end:
        time.sleep(0.1)
    return rss


def bounded(srv: ServerProcess, send):
    """Run `send()` (one request) and check the three bounds; returns its result."""
    before = srv.rss_mib()
    with HealthProbe(srv.url) as probe:
        start = time.perf_counter()
        result = send()
        elapsed = time.perf_counter() - start
    grown = settled_rss(srv, before + GROWTH_MIB) - before
    print(f"answered in {elapsed * 1e3:.0f} ms, /healthz at worst {probe.worst_s * 1e3:.0f} ms, RSS {grown:+.0f} MiB")
    assert elapsed < ANSWER_S, f"answered after {elapsed:.2f}s"
    assert probe.failures == 0 and probe.worst_s < HEALTH_S, f"/healthz took up to {probe.worst_s * 1e3:.0f} ms"
    assert grown < GROWTH_MIB, f"RSS grew by {grown:.0f} MiB"
    return result


def post(srv: ServerProcess, path: str, data: bytes, **headers) -> requests.Response:
    return requests.post(srv.url + path, data=data, headers={"Content-Type": "application/json", **headers}, timeout=30)


def error_of(response: requests.Response) -> str:
    assert response.headers["content-type"] == "application/json"
    return response.json()["error"]


# -- HIGH: classify contexts are not copied into every example ----------------------------------------

@pytest.mark.parametrize("values, per_example", [(10_000, 0), (20_000, 20)])
def test_rest_classify_context_is_not_merged_into_every_example(server, values, per_example):
    body = orjson.dumps({"context": {"text": "a wonderful film", "k": list(range(values))},
                         "examples": [{"n": list(range(per_example))} for _ in range(1000)]})
    r = bounded(server, lambda: post(server, CLASSIFY, body))
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 1000 and results[0] == results[-1]  # every example classified the context's text


def test_grpc_classify_context_is_not_merged_into_every_example(server):
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = MODEL_NAME
    lists = request.input.example_list_with_context
    lists.context.features.feature["text"].bytes_list.value.append(b"a wonderful film")
    lists.context.features.feature["k"].int64_list.value.extend(range(400_000))
    for _ in range(1000):
        lists.examples.add()
    stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(server.grpc_target))
    response = bounded(server, lambda: stub.Classify(request, timeout=30))
    assert len(response.result.classifications) == 1000


def test_a_context_text_repeated_past_the_body_limit_is_refused(server):
    body = orjson.dumps({"context": {"text": "good " * 9000}, "examples": [{}] * 1000})  # 45 KB, 45 MB merged
    r = bounded(server, lambda: post(server, CLASSIFY, body))
    assert r.status_code == 400 and "with the context merged in, more than the limit of" in error_of(r)


# -- HIGH: declared V2 shapes are checked before anything is allocated ---------------------------------

def v2_binary(shape, size: int = 0, data: bytes = b"") -> tuple[bytes, dict]:
    head = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape,
                                     "parameters": {"binary_data_size": size}}]})
    return head + data, {"Inference-Header-Content-Length": str(len(head))}


@pytest.mark.parametrize("shape, error", [
    ([1_000_000_000], "1000000000 instances in one request, more than the limit of 1024"),
    ([10**12], "1000000000000 instances in one request"),
    ([2**32, 2**32], "string inputs must have rank 1"),
    ([1000], "0 bytes of binary data cannot hold 1000 BYTES elements"),
])
def test_v2_declared_shape_is_checked_before_allocation(server, shape, error):
    body, headers = v2_binary(shape)
    r = bounded(server, lambda: post(server, INFER, body, **headers))
    assert r.status_code == 400 and error in error_of(r), r.text


# -- MEDIUM: large bodies are refused by their row or container count before they are built -----------

@pytest.mark.parametrize("path, body, error", [
    (CLASSIFY, b'{"examples":[' + b",".join([b"{}"] * 1_300_000) + b"]}", "JSON values, more than the limit of 65600"),
    (PREDICT, b'{"instances":[' + b",".join([b'"a"'] * 1_000_000) + b"]}", "JSON values, more than the limit of 65600"),
    (PREDICT, b'{"instances":[' + b",".join([b'"a"'] * 50_000) + b"]}", "50000 instances in one request"),
    (PREDICT, b'{"instances":[' + b",".join([b"[]"] * 1_300_000) + b"]}", "JSON values, more than the limit of 65600"),
    (INFER, b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":[' + b",".join([b"[]"] * 1_300_000)
     + b"]}]}", "JSON values, more than the limit of 65600"),
])
def test_a_4mb_body_of_tiny_rows_is_refused_at_once(server, path, body, error):
    assert len(body) < 4 * 1024 * 1024
    r = bounded(server, lambda: post(server, path, body))
    assert r.status_code == 400 and error in error_of(r), r.text


def test_brackets_and_commas_inside_strings_are_not_values(server):
    texts = ["{[," * 2000 + " a wonderful film"] * 30  # 180k of them, all inside strings
    r = bounded(server, lambda: post(server, PREDICT, orjson.dumps({"instances": texts})))
    assert r.status_code == 200 and len(r.json()["predictions"]) == 30


# -- LOW: malformed V2 requests are 400s, not 500s -------------------------------------------------------

def v2_json(**changes) -> bytes:
    tensor = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a wonderful film"]}
    request = {"inputs": [tensor]}
    for key, value in changes.items():
        where, _, field = key.partition("__")
        {"input": tensor, "request": request}[where][field] = value
    return orjson.dumps(request)


def _deep(levels: int) -> bytes:
    """A V2 request whose data is nested `levels` deep (too deep for orjson.dumps to write)."""
    return (b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":' + b"[" * levels + b'"a wonderful film"'
            + b"]" * levels + b"}]}")


@pytest.mark.parametrize("body, error", [
    (_deep(1000), "'data' is nested deeper than its 1-dimensional shape"),
    (v2_json(input__shape=[2**32, 2**32], input__data=[]), "string inputs must have rank 1"),
    (v2_json(input__parameters=[1]), "input 'text': 'parameters' must be an object, got a list"),
    (v2_json(input__parameters="x"), "input 'text': 'parameters' must be an object, got str"),
    (v2_json(request__parameters=[]), "request: 'parameters' must be an object, got a list"),
    (v2_json(request__outputs=[{"name": "label", "parameters": "x"}]), "output 'label': 'parameters' must be"),
    (v2_json(request__parameters={"binary_data_output": "false"}),
     "parameter 'binary_data_output' must be true or false, got str"),
    (v2_json(request__outputs=[{"name": "label", "parameters": {"binary_data": 0}}]),
     "parameter 'binary_data' must be true or false, got a number (0)"),
])
def test_malformed_v2_requests_are_400(server, body, error):
    r = bounded(server, lambda: post(server, INFER, body))
    assert r.status_code == 400 and error in error_of(r), r.text


@pytest.mark.parametrize("version", ["%C2%B2", "%D9%A1%D9%A2", "99999999999999999999"])
def test_version_in_a_url_is_ascii_digits_within_int64(server, version):
    for path in (f"/v2/models/{MODEL_NAME}/versions/{version}", f"/v1/models/{MODEL_NAME}/versions/{version}"):
        r = requests.get(server.url + path, timeout=10)
        assert r.status_code in (400, 404) and "error" in r.json(), (path, r.status_code, r.text)


# -- LOW: gzip bodies are whole, health checks decode their requests, caches are bounded ----------------

def test_gzip_bodies_must_be_complete(server):
    raw = orjson.dumps({"instances": ["a wonderful film"]})
    whole = gzip.compress(raw)
    half_a, half_b = raw[:10], raw[10:]
    cases = [(whole[:-4], 400, "truncated gzip"), (whole + b"garbage!", 400, "not valid gzip"),
             (gzip.compress(half_a) + gzip.compress(half_b), 200, None), (whole, 200, None)]
    for data, status, error in cases:
        r = post(server, PREDICT, data, **{"Content-Encoding": "gzip"})
        assert r.status_code == status, (data, r.text)
        if error:
            assert error in error_of(r)


def test_grpc_health_check_with_undecodable_bytes_is_invalid_argument(server):
    channel = grpc.insecure_channel(server.grpc_target)
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    with pytest.raises(grpc.RpcError) as info:
        check(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "HealthCheckRequest" in info.value.details() and "Error" not in info.value.details()


def test_long_made_up_model_names_do_not_grow_a_cache(server):
    session = requests.Session()
    before = server.rss_mib()
    with HealthProbe(server.url) as probe:
        for i in range(1100):
            r = session.get(f"{server.url}/v1/models/{i:05d}{'m' * 60_000}", timeout=10)
            assert r.status_code == 404
    assert settled_rss(server, before + GROWTH_MIB) - before < GROWTH_MIB
    assert probe.worst_s < 1.0


# -- model directories and configs that must not wedge the poller --------------------------------------

BAD_NAMES = ("\u00b2", "\u0661\u0662", "99999999999999999999", "01")  # "01" beside "1"


def test_odd_version_directory_names_are_skipped_and_reported_once(model_base, tmp_path):
    base = copy_model_base(model_base, tmp_path)
    for name in BAD_NAMES:
        (base / name).mkdir()
    (base / "12").mkdir()  # what "١٢" would have been read as: empty, so never loaded
    srv = ServerProcess(base, "--poll-interval", "0.2", grpc=True, log_path=tmp_path / "serve.log")
    try:
        assert requests.get(srv.url + "/readyz", timeout=10).json()["versions"] == ["1"]
        time.sleep(1)  # several polls
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        request.inputs["text"].CopyFrom(_string_tensor([b"a wonderful film"]))
        stub = prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(srv.grpc_target))
        assert stub.Predict(request, timeout=10).model_spec.version.value == 1
        metrics = requests.get(srv.url + "/monitoring/prometheus/metrics", timeout=10).text
        assert re.search(r'serve_model_version\{model="sentiment"\} 1\.0', metrics)
        log = srv.log()
        for name in BAD_NAMES:
            assert log.count(f"ignoring {name!r} under its base path") == 1, log
        assert "Traceback" not in log
    finally:
        assert srv.stop() == 0


def _string_tensor(values: list[bytes]):
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

    return tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=values, tensor_shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(values))]))


def test_an_unreadable_version_directory_does_not_stop_later_versions(model_base, tmp_path):
    """chmod 000 on a version directory: skipped with one log line; a later version still loads.
    As root, the server runs without the capabilities that ignore file permissions."""
    from conftest import add_model_version

    base = copy_model_base(model_base, tmp_path)
    locked = base / "2"
    locked.mkdir()
    (locked / "saved_model.pb").write_bytes(b"")
    locked.chmod(0)
    prefix = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--") if os.getuid() == 0 else ()
    srv = ServerProcess(base, "--poll-interval", "0.2", prefix=prefix, log_path=tmp_path / "serve.log")
    try:
        add_model_version(base, 3)
        end = time.monotonic() + 60
        while requests.get(srv.url + "/readyz", timeout=10).json()["versions"] != ["3"]:
            assert time.monotonic() < end, srv.log()
            time.sleep(0.2)
        log = srv.log()
        assert log.count("version 2: cannot read its directory (Permission denied)") == 1, log
        assert "Traceback" not in log
    finally:
        locked.chmod(0o755)
        assert srv.stop() == 0


def test_a_model_without_a_base_path_does_not_make_the_server_unready(model_base, tmp_path):
    config = tmp_path / "models.config"

    def write(*models: tuple[str, str]) -> None:
        entries = "".join(f'config {{ name: "{n}" base_path: "{p}" model_platform: "tensorflow" }}\n' for n, p in models)
        config.write_text(f"model_config_list {{\n{entries}}}\n")

    write((MODEL_NAME, str(model_base)))
    srv = ServerProcess(model_base, "--poll-interval", "0.2", "--model-config-file-poll-wait-seconds", "0.2",
                        "--model-root", f"{model_base.parent},{tmp_path}", grpc=True,
                        model_args=("--model-config-file", str(config)), log_path=tmp_path / "serve.log")
    try:
        write((MODEL_NAME, str(model_base)), ("ghost", str(tmp_path / "no-such-dir")))
        end = time.monotonic() + 30
        while "ghost" not in srv.log():
            assert time.monotonic() < end, srv.log()
            time.sleep(0.1)
        time.sleep(1)  # the new model's first poll is done
        ready = requests.get(srv.url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["unavailable"] == ["ghost"], ready.text
        assert requests.get(srv.url + "/v2/health/ready", timeout=10).status_code == 200
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(srv.grpc_target))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        status = requests.get(srv.url + "/v1/models/ghost", timeout=10)
        assert status.status_code == 404 and "ghost" in error_of(status)
        assert requests.post(srv.url + PREDICT, json={"instances": ["good"]}, timeout=10).status_code == 200
        assert "model ghost: its base path" in srv.log() and "does not exist" in srv.log()
    finally:
        assert srv.stop() == 0


# -- a supervisor that dies takes its workers with it ----------------------------------------------------

def test_workers_exit_when_their_supervisor_is_killed(model_base, tmp_path):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--workers", "2", log_path=tmp_path / "serve.log")
    match = re.search(r"\(pids ([\d, ]+); metrics exchanged in (\S+)\)", srv.log())
    workers, peer_dir = [int(p) for p in match.group(1).split(", ")], match.group(2)
    assert os.path.isdir(peer_dir)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    end = time.monotonic() + 20
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < end, f"workers {workers} still running:\n{srv.log()}"
        time.sleep(0.1)
    assert not os.path.exists(peer_dir)  # the last worker out removed it
    again = ServerProcess(model_base, "--poll-interval", "0", log_path=tmp_path / "again.log")  # the port is free
    assert again.stop() == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return state != "Z"


# -- the client's usage errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http//bad", "http:/bad", "localhost/path"])
def test_client_mistyped_url_is_a_usage_error(url):
    done = subprocess.run([sys.executable, "-m", "client", "--url", url, "a film"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "expected http://host:port" in done.stderr, done.stderr
