"""End-to-end: a real `python -m serve` process on localhost (waitress, batching, reload, drain)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import MODEL_NAME, add_model_version, copy_model_base
from serve_process import CPP_LOG, ServerProcess

pytestmark = pytest.mark.slow

WORDS = "good great excellent bad awful boring the a movie plot fun dull story zzz".split()
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + i % 9)) + f" #{i}" for i in range(64)]


@pytest.fixture(scope="module")
def server(model_base):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--batch-timeout-ms", "5", "--max-body-bytes", "100000")
    yield srv
    assert srv.stop() == 0, srv.log()
    log = srv.log(full=True)
    assert not CPP_LOG.search(log), log[:3000]  # no TensorFlow C++ lines in a server's log by default


def _metric(text: str, name: str, missing: float | None = None) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    if match is None and missing is not None:
        return missing  # not observed yet
    assert match, name
    return float(match.group(1))


# -- every route over real HTTP ------------------------------------------------------------------

@pytest.mark.parametrize("method, path, body, status, key", [
    ("POST", f"/v1/models/{MODEL_NAME}:predict", {"instances": ["good movie"]}, 200, "predictions"),
    ("POST", f"/v1/models/{MODEL_NAME}/versions/1:predict", {"inputs": {"text": ["good"]}}, 200, "outputs"),
    ("POST", f"/v1/models/{MODEL_NAME}:classify", {"examples": [{"text": "good"}]}, 200, "results"),
    ("GET", f"/v1/models/{MODEL_NAME}", None, 200, "model_version_status"),
    ("GET", f"/v1/models/{MODEL_NAME}/versions/1/metadata", None, 200, "metadata"),
    ("POST", "/v1/sentiment", {"texts": ["good"]}, 200, None),
    ("GET", "/healthz", None, 200, "status"),
    ("GET", "/readyz", None, 200, "status"),
    ("GET", "/openapi.json", None, 200, "paths"),
    ("POST", "/v1/models/nope:predict", {"instances": ["good"]}, 404, "error"),
    ("POST", f"/v1/models/{MODEL_NAME}:predict", {"instances": [1]}, 400, "error"),
    ("POST", f"/v1/models/{MODEL_NAME}:predict", {"instances": ["x" * 200_000]}, 413, "error"),
    ("GET", f"/v1/models/{MODEL_NAME}/versions/3", None, 404, "error"),
])
def test_routes(server, method, path, body, status, key):
    r = requests.request(method, server.url + path, json=body, timeout=10)
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"] == "application/json"
    if key is not None:
        assert key in r.json()


def test_invalid_utf8_body(server):
    r = requests.post(f"{server.url}/v1/models/{MODEL_NAME}:predict", data=b'{"instances": ["\xff"]}', timeout=10)
    assert (r.status_code, r.json()) == (400, {"error": "request body is not valid UTF-8 (byte 16)"})


def test_metrics_route(server):
    r = requests.get(server.url + "/monitoring/prometheus/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert _metric(r.text, f'serve_model_version{{model="{MODEL_NAME}"}}') == 1.0


# -- concurrency with batching -------------------------------------------------------------------

# The kernels TensorFlow picks for the CPU decide how sums are rounded; the answers must not move
# with the batch under any of them (TensorFlow's defaults, oneDNN held to AVX2 as on CPUs without
# AVX-512, and Eigen alone).
KERNEL_SETTINGS = {"default": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "no-onednn": {"TF_ENABLE_ONEDNN_OPTS": "0"}}


@pytest.fixture(scope="module", params=sorted(KERNEL_SETTINGS))
def kernel_server(request, server, model_base):
    if request.param == "default":
        yield server
        return
    srv = ServerProcess(model_base, "--poll-interval", "0", "--batch-timeout-ms", "5", env=KERNEL_SETTINGS[request.param])
    yield srv
    assert srv.stop() == 0, srv.log()


def test_concurrent_requests_are_batched_and_equal_unbatched(kernel_server):
    server = kernel_server
    session = requests.Session()
    url = f"{server.url}/v1/models/{MODEL_NAME}:predict"
    before = requests.get(server.url + "/monitoring/prometheus/metrics", timeout=10).text
    unbatched = [session.post(url, json={"instances": [t]}, timeout=10).json() for t in TEXTS]
    local = threading.local()

    def one(i):
        s = local.__dict__.setdefault("s", requests.Session())
        r = s.post(url, json={"instances": [TEXTS[i % len(TEXTS)]]}, timeout=20)
        assert r.status_code == 200, r.text
        return i, r.json()

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(4 * len(TEXTS))))
    for i, body in results:
        assert body == unbatched[i % len(TEXTS)]

    after = requests.get(server.url + "/monitoring/prometheus/metrics", timeout=10).text
    count, single = f'serve_batch_requests_count{{model="{MODEL_NAME}"}}', \
        f'serve_batch_requests_bucket{{le="1.0",model="{MODEL_NAME}"}}'
    calls = _metric(after, count) - _metric(before, count, missing=0.0)
    singles = _metric(after, single) - _metric(before, single, missing=0.0)
    requests_made = len(TEXTS) + len(results)
    assert calls < requests_made and calls - singles > 0, (calls, singles)


# -- hot reload under load -----------------------------------------------------------------------

def test_hot_reload_under_load_drops_nothing(model_base, tmp_path):
    base = copy_model_base(model_base, tmp_path)
    srv = ServerProcess(base, "--poll-interval", "0.2")
    stop = threading.Event()
    failures: list[str] = []
    seen: list[list[int]] = [[] for _ in range(8)]

    def load(k):
        s = requests.Session()
        while not stop.is_set():
            try:
                r = s.post(srv.url + "/v1/sentiment", json={"texts": [TEXTS[k]]}, timeout=20)
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text}")
                else:
                    seen[k].append(int(r.headers["X-Model-Version"]))
            except requests.RequestException as exc:
                failures.append(repr(exc))

    try:
        threads = [threading.Thread(target=load, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        add_model_version(base, 2)
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(s and s[-1] == 2 for s in seen):
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        assert not failures, failures[:5]
        for versions in seen:
            assert versions[0] == 1 and versions[-1] == 2
            assert versions == sorted(versions)  # never back to the old version once switched
        status = requests.get(f"{srv.url}/v1/models/{MODEL_NAME}", timeout=10).json()["model_version_status"]
        assert [(s["version"], s["state"]) for s in status] == [("2", "AVAILABLE")]  # 1 retired, as TF Serving
    finally:
        stop.set()
        assert srv.stop() == 0, srv.log()


# -- graceful shutdown ---------------------------------------------------------------------------

def test_sigterm_drains_in_flight_requests(slow_model):
    srv = ServerProcess(slow_model(1.5), "--poll-interval", "0", "--no-warmup")
    result = {}

    def slow_request():
        result["response"] = requests.post(srv.url + "/v1/sentiment", json={"texts": ["good"]}, timeout=20)

    idle = requests.Session()  # an idle keep-alive connection must not hold up the exit
    assert idle.get(srv.url + "/healthz", timeout=5).status_code == 200
    thread = threading.Thread(target=slow_request)
    thread.start()
    srv.wait_in_flight(1)  # the request is now waiting on the (slow) model
    sigterm_at = time.monotonic()
    srv.terminate()
    thread.join()
    assert result["response"].status_code == 200
    assert result["response"].json()[0]["label"] in ("negative", "positive")
    assert srv.proc.wait(15) == 0, srv.log()
    assert time.monotonic() - sigterm_at < 5  # well inside the 10 s drain timeout
    idle.close()
    assert "shut down cleanly" in srv.log()
    with pytest.raises(requests.ConnectionError):
        requests.get(srv.url + "/healthz", timeout=2)
    srv.stop()
