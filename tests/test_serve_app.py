"""Route details through the REST app in process (no sockets) with a real ServingCore on the test
model: every route, error and limit of the REST edge."""

from __future__ import annotations

import base64
import json
import shutil
import time

import pytest
from app_client import AppClient, LoopThread
from conftest import MODEL_NAME, add_model_version, copy_model_base

from serve import ServeConfig, ServingCore, create_app
from serve.core.model_versions import version_dirs

TEXTS = ["a great and wonderful movie", "boring, the worst plot", "the film was fun", "awful acting"]


@pytest.fixture(scope="module")
def two_versions(model_base, tmp_path_factory):
    base = copy_model_base(model_base, tmp_path_factory.mktemp("app"))
    add_model_version(base, 2)
    return base


def wait_for(condition, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def make_app(two_versions, loop):
    """Factory: (config overrides) -> (client, core), the core loaded synchronously."""
    cores = []

    def make(model_dir=None, **overrides):
        config = ServeConfig(model_dir=str(model_dir or two_versions), poll_interval_s=0, **overrides)
        core = ServingCore(config)
        loop.run(core.start())
        cores.append(core)
        wait_for(lambda: core.ready or not any(version_dirs(config.model_dir)[0]))
        return AppClient(create_app(config, core), loop), core

    yield make
    for core in cores:
        loop.run(core.close())


@pytest.fixture(scope="module")
def client(make_app):
    client, _ = make_app(version_policy="all", version_labels=(("stable", 1), ("canary", 2)))
    return client


def predict(client, body, path=f"/v1/models/{MODEL_NAME}:predict"):
    return client.post(path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


# -- status and metadata -------------------------------------------------------------------------

def _status(*versions):
    return {"model_version_status": [
        {"version": str(v), "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
        for v in versions]}


@pytest.mark.parametrize("path, expected", [
    (f"/v1/models/{MODEL_NAME}", _status(2, 1)),
    (f"/v1/models/{MODEL_NAME}/versions/1", _status(1)),
    (f"/v1/models/{MODEL_NAME}/labels/canary", _status(2)),
    (f"/V1/MODELS/{MODEL_NAME}/VERSIONS/2", _status(2)),
])
def test_model_status(client, path, expected):
    r = client.get(path)
    assert (r.status_code, r.json) == (200, expected)


@pytest.mark.parametrize("path, status, error", [
    (f"/v1/models/{MODEL_NAME}/versions/7", 404, f"Could not find version 7 of model {MODEL_NAME}"),
    ("/v1/models/nope", 404, "Could not find any versions of model nope"),
    (f"/v1/models/{MODEL_NAME}/labels/beta", 404, "Unrecognized servable version label: beta"),
    (f"/v1/models/{MODEL_NAME}/versions/x", 400, f"Malformed request: GET /v1/models/{MODEL_NAME}/versions/x"),
    ("/v1/models/nope/metadata", 404, "Servable not found for request: Latest(nope)"),
    (f"/v1/models/{MODEL_NAME}/versions/7/metadata", 404, f"Servable not found for request: Specific({MODEL_NAME}, 7)"),
    (f"/v1/models/{MODEL_NAME}:predict", 405, f"Method Not Allowed: GET /v1/models/{MODEL_NAME}:predict (allowed: POST)"),
    ("/v2/nothing", 404, None),
    ("/v1/models/nope/monitoring", 404, "Servable not found for request: Latest(nope)"),
    (f"/v1/models/{MODEL_NAME}/versions/7/monitoring", 404, f"Servable not found for request: Specific({MODEL_NAME}, 7)"),
    (f"/v1/models/{MODEL_NAME}/versions/x/monitoring", 400, "Malformed request: version x is not a version number"),
])
def test_get_errors(client, path, status, error):
    r = client.get(path)
    assert r.status_code == status and r.is_json and list(r.json) == ["error"]
    if error is not None:
        assert r.json == {"error": error}


def test_metadata_matches_the_saved_model_proto(client, two_versions):
    from google.protobuf import json_format
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString((two_versions / "1" / "saved_model.pb").read_bytes())
    expected = {name: json_format.MessageToDict(sig, preserving_proto_field_name=True,
                                                always_print_fields_with_no_presence=True)
                for name, sig in proto.meta_graphs[0].signature_def.items()}
    r = client.get(f"/v1/models/{MODEL_NAME}/versions/1/metadata")
    assert r.status_code == 200
    assert r.json == {"model_spec": {"name": MODEL_NAME, "signature_name": "", "version": "1"},
                      "metadata": {"signature_def": {"signature_def": expected}}}
    sig = r.json["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["text"]["dtype"] == "DT_STRING"
    assert sig["inputs"]["text"]["tensor_shape"] == {"dim": [{"size": "-1", "name": ""}], "unknown_rank": False}
    assert sig["method_name"] == "tensorflow/serving/predict"
    assert client.get(f"/v1/models/{MODEL_NAME}/metadata").json["model_spec"]["version"] == "2"


# -- predict / classify --------------------------------------------------------------------------

def test_predict_row_format(client):
    r = predict(client, {"instances": TEXTS})
    assert r.status_code == 200
    rows = r.json["predictions"]
    assert len(rows) == len(TEXTS) and set(rows[0]) == {"probabilities", "logits", "label"}
    for row in rows:  # label is the argmax of probabilities, in class order (negative, positive)
        assert row["label"] == ("negative", "positive")[row["probabilities"].index(max(row["probabilities"]))]
    assert all(abs(sum(row["probabilities"]) - 1) < 1e-6 for row in rows)


def test_predict_forms_agree(client):
    rows = predict(client, {"instances": TEXTS}).json["predictions"]
    b64 = [{"b64": base64.b64encode(t.encode()).decode()} for t in TEXTS]
    named = predict(client, {"signature_name": "serving_default", "instances": [{"text": t} for t in TEXTS]})
    assert named.json["predictions"] == rows
    assert predict(client, {"instances": b64}).json["predictions"] == rows
    for inputs in (TEXTS, {"text": TEXTS}):
        cols = predict(client, {"inputs": inputs}).json["outputs"]
        assert cols == {k: [row[k] for row in rows] for k in ("probabilities", "logits", "label")}


def test_versions_and_labels_route_to_their_model(client):
    v1 = predict(client, {"instances": TEXTS}, f"/v1/models/{MODEL_NAME}/versions/1:predict").json
    v2 = predict(client, {"instances": TEXTS}, f"/v1/models/{MODEL_NAME}/versions/2:predict").json
    assert v1 != v2
    assert predict(client, {"instances": TEXTS}, f"/v1/models/{MODEL_NAME}/labels/stable:predict").json == v1
    assert predict(client, {"instances": TEXTS}, f"/v1/models/{MODEL_NAME}:predict").json == v2
    assert predict(client, {"instances": TEXTS}, f"/V1/Models/{MODEL_NAME}/Versions/1:PREDICT").json == v1


def test_monitoring_counts_the_reviews_each_version_answered(client):
    def totals():
        answer = client.get(f"/v1/models/{MODEL_NAME}/monitoring")
        assert answer.status_code == 200
        return {v["version"]: v["reviews_total"] for v in answer.json["versions"]}

    before = totals()
    assert predict(client, {"instances": ["a fine film", "dull", "ok"]},
                   f"/v1/models/{MODEL_NAME}/labels/canary:predict").status_code == 200
    assert totals() == {"2": before["2"] + 3, "1": before["1"]}
    one = client.get(f"/v1/models/{MODEL_NAME}/labels/canary/monitoring").json["versions"]
    assert [v["version"] for v in one] == ["2"] and one[0]["monitoring"] == "on"


def test_classify_matches_predict(client):
    probs = [row["probabilities"] for row in predict(client, {"instances": TEXTS}).json["predictions"]]
    r = client.post(f"/v1/models/{MODEL_NAME}:classify", json={"examples": [{"text": t} for t in TEXTS]})
    assert r.status_code == 200
    assert r.json == {"results": [[["negative", p[0]], ["positive", p[1]]] for p in probs]}
    same = client.post(f"/v1/models/{MODEL_NAME}:classify",
                       json={"signature_name": "classify", "examples": [{"text": t} for t in TEXTS]})
    assert same.json == r.json


def test_predict_on_classify_signature_with_serialized_examples(client):
    from tensorflow.core.example import example_pb2

    def example(text):
        ex = example_pb2.Example()
        ex.features.feature["text"].bytes_list.value.append(text.encode())
        return {"b64": base64.b64encode(ex.SerializeToString()).decode()}

    r = predict(client, {"signature_name": "classify", "instances": [example(t) for t in TEXTS]})
    probs = [row["probabilities"] for row in predict(client, {"instances": TEXTS}).json["predictions"]]
    assert r.status_code == 200
    assert [row["scores"] for row in r.json["predictions"]] == probs
    assert r.json["predictions"][0]["classes"] == ["negative", "positive"]


PREDICT = f"/v1/models/{MODEL_NAME}:predict"


@pytest.mark.parametrize("path, body, status, error", [
    (PREDICT, {"instances": ["a"], "signature_name": "nope"}, 404,
     'Serving signature name: "nope" not found in signature def'),
    (f"/v1/models/{MODEL_NAME}/versions/9:predict", {"instances": ["a"]}, 404,
     f"Servable not found for request: Specific({MODEL_NAME}, 9)"),
    (f"/v1/models/{MODEL_NAME}/labels/beta:predict", {"instances": ["a"]}, 404,
     "Unrecognized servable version label: beta"),
    ("/v1/models/other:predict", {"instances": ["a"]}, 404, "Servable not found for request: Latest(other)"),
    (PREDICT, {"instances": ["a"], "inputs": ["a"]}, 400,
     "Not a valid request: both 'instances' and 'inputs' given; use one of them"),
    (PREDICT, {"instances": [7]}, 400, 'instances[0]: expected a string or {"b64": ...}, got a number (7)'),
    (PREDICT, {"instances": []}, 400, "no instances: at least one input row is required"),
    (PREDICT, {"instances": [""]}, 400, "instances[0]: text is empty"),
    (PREDICT, {"instances": [{"b64": "/w=="}]}, 400, "instances[0]: text is not valid UTF-8"),
    (PREDICT, {"signature_name": 3, "instances": ["a"]}, 400, "'signature_name' key must be a string value."),
    (PREDICT, {"signature_name": False, "instances": ["a"]}, 400, "'signature_name' key must be a string value."),
    (f"/v1/models/{MODEL_NAME}:regress", {"examples": [{"text": "a"}]}, 400,
     "model has no signature with method_name tensorflow/serving/regress"),
    (f"/v1/models/{MODEL_NAME}:classify", {"signature_name": "serving_default", "examples": [{"text": "a"}]}, 400,
     "Expected classify signature method_name to be tensorflow/serving/classify. Was: tensorflow/serving/predict"),
    (f"/v1/models/{MODEL_NAME}:classify", {"instances": ["a"]}, 400, "Missing 'examples' key"),
    (f"/v1/models/{MODEL_NAME}:classify", {"examples": [{"text": " "}]}, 400, "examples[0].text: text is empty"),
    (f"/v1/models/{MODEL_NAME}:classify", {"examples": [{"text": 3}]}, 400,
     "examples[0].text: expected one string, got int64_list"),
    (f"/v1/models/{MODEL_NAME}:classify", {"examples": [{"txt": "a"}]}, 400, "examples[0]: no 'text' feature"),
    (f"/v1/models/{MODEL_NAME}:classify", {"examples": []}, 400, "no instances: at least one input row is required"),
    (PREDICT, {"instances": [{"b64": "YWJj="}]}, 400,
     "instances[0]: Unable to base64 decode: 'b64' value is not valid base64"),
    (f"/v1/models/{MODEL_NAME}", {"instances": ["a"]}, 405,
     f"Method Not Allowed: POST /v1/models/{MODEL_NAME} (allowed: GET, HEAD)"),
    (f"/v1/models/{MODEL_NAME}:explode", {"instances": ["a"]}, 400, f"Malformed request: POST /v1/models/{MODEL_NAME}:explode"),
])
def test_post_errors(client, path, body, status, error):
    r = client.post(path, json=body)
    assert (r.status_code, r.json) == (status, {"error": error})


def test_huge_and_too_many_inputs(make_app):
    c, _ = make_app(max_rows_per_request=3, max_text_bytes=50, warmup=False)
    r = predict(c, {"instances": ["a"] * 4})
    assert (r.status_code, r.json) == (400, {"error": "4 instances in one request, more than the limit of 3"})
    r = c.post("/v1/sentiment", json={"texts": ["x" * 51]})
    assert (r.status_code, r.json) == (400, {"error": "texts[0]: text is 51 bytes, more than the limit of 50"})


@pytest.mark.parametrize("data, error", [
    (b"\xff\xfe{}", "request body is not valid UTF-8 (byte 0)"),
    (b"{not json", "JSON Parse error: unexpected character, expected a string key: line 1 column 2 (char 1)"),
    (b'{"instances": ["\\ud800"]}', "JSON Parse error: no low surrogate in string: line 1 column 17 (char 16)"),
    (b"[" * 5000 + b"]" * 5000, "JSON Parse error: depth limit exceeded: line 1 column 1026 (char 1025)"),
    (b"", "request body is empty: expected a JSON object"),
    (b'["a"]', "request body must be a JSON object, got list"),
])
def test_bad_bodies(client, data, error):
    r = client.post(PREDICT, data=data, headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json) == (400, {"error": error})


# -- friendly API --------------------------------------------------------------------------------

def test_sentiment_endpoint(client):
    r = client.post("/v1/sentiment", json={"texts": TEXTS})
    assert r.status_code == 200 and r.headers["x-model-version"] == "2"
    rows = predict(client, {"instances": TEXTS}).json["predictions"]
    assert r.json == [
        {"label": row["label"], "score": max(row["probabilities"]),
         "probabilities": dict(zip(["negative", "positive"], row["probabilities"]))} for row in rows]
    assert client.post("/V1/Sentiment", json={"texts": TEXTS}).json == r.json


@pytest.mark.parametrize("body, error", [
    ({"texts": [1]}, "texts[0]: expected a string, got a number (1)"),
    ({"text": "a"}, 'Missing \'texts\' key: expected {"texts": ["review", ...]}'),
    ({"texts": []}, "no instances: at least one input row is required"),
])
def test_sentiment_errors(client, body, error):
    r = client.post("/v1/sentiment", json=body)
    assert (r.status_code, r.json) == (400, {"error": error})


def test_unknown_route_and_method_are_json(client):
    r = client.get("/v1/sentiment")
    assert (r.status_code, r.headers["allow"]) == (405, "POST")
    assert r.json == {"error": "Method Not Allowed: GET /v1/sentiment (allowed: POST)"}
    r = client.request("DELETE", "/healthz")
    assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")
    r = client.get("//v1/models/sentiment")
    assert (r.status_code, r.json) == (404, {"error": "Not Found: no route for GET //v1/models/sentiment"})


def test_head_where_get_works(client):
    for path in ("/healthz", "/readyz", f"/v1/models/{MODEL_NAME}", f"/v1/models/{MODEL_NAME}/metadata", "/"):
        get, head = client.get(path), client.request("HEAD", path)
        assert (head.status_code, head.headers["content-length"]) == (200, get.headers["content-length"]), path


def test_gzip_bodies_are_inflated(client):
    import gzip

    plain = predict(client, {"instances": TEXTS}).json
    r = client.post(PREDICT, data=gzip.compress(json.dumps({"instances": TEXTS}).encode()),
                    headers={"Content-Encoding": "gzip"})
    assert (r.status_code, r.json) == (200, plain)
    r = client.post(PREDICT, data=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert (r.status_code, r.json) == (400, {"error": "request body is not valid gzip (Content-Encoding: gzip)"})


# -- health, metrics, openapi --------------------------------------------------------------------

def test_health_and_readiness(client, make_app, two_versions, tmp_path):
    assert (client.get("/healthz").status_code, client.get("/healthz").json) == (200, {"status": "ok"})
    r = client.get("/readyz")
    assert (r.status_code, r.json) == (200, {"status": "ready", "model": MODEL_NAME, "versions": ["1", "2"],
                                             "models": {MODEL_NAME: ["1", "2"]}})
    empty = tmp_path / MODEL_NAME
    empty.mkdir()
    c, core = make_app(model_dir=empty)
    assert c.get("/healthz").status_code == 200
    r = c.get("/readyz")
    assert (r.status_code, r.json) == (503, {"error": "not ready: no model version loaded and warmed up yet"})
    r = predict(c, {"instances": ["a"]})
    assert r.status_code == 503 and "no version loaded" in r.json["error"]
    shutil.copytree(two_versions / "1", empty / "1")  # the poller retries every second until one loads
    wait_for(lambda: c.get("/readyz").status_code == 200)
    core.begin_drain()
    assert (c.get("/readyz").status_code, c.get("/readyz").json) == (503, {"error": "not ready: shutting down"})


def test_metrics(client):
    predict(client, {"instances": TEXTS})
    text = client.get("/monitoring/prometheus/metrics").text
    for needle in ('serve_requests_total{code="200",route="predict"}', "serve_request_latency_seconds_bucket",
                   "serve_batch_size_bucket", f'serve_model_version{{model="{MODEL_NAME}"}} 2.0',
                   "serve_queued_rows", "serve_in_flight_requests"):
        assert needle in text


def test_openapi_describes_every_route(client):
    spec = client.get("/openapi.json").json
    assert spec["openapi"].startswith("3.")
    paths = spec["paths"]
    # Every API route of the routing table is documented (the web page is HTML, not API) ...
    for route in client.app.routes:
        if route.name == "models":  # the exported model has no regress signature: :regress is not offered
            assert {f"/v1/models/{{model}}{s}" for s in ("", "/metadata", ":predict", ":classify")} <= set(paths)
            assert not any(path.endswith(":regress") for path in paths)
            assert "/v1/models/{model}/versions/{version}:predict" in paths
            assert "/v1/models/{model}/labels/{label}/metadata" in paths
        elif route.name != "web":
            assert any(route.pattern.fullmatch(path) for path in paths), route.pattern.pattern
    # ... and every documented path is served (no 404 from routing)
    for path, ops in paths.items():
        url = (path.replace("{model}", MODEL_NAME).replace("{version}", "1").replace("{label}", "stable"))
        for method in ops:
            body = {"examples": [{"text": "a"}], "instances": ["a"], "texts": ["a"]}
            if "classify" in path:
                del body["instances"]
            if path.startswith("/v2"):
                body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}
            r = client.request(method.upper(), url, json=body if method == "post" else None)
            assert r.status_code == 200, (url, r.json)


# -- limits, overload, deadline, CORS ------------------------------------------------------------

def test_body_limit_413(make_app):
    c, _ = make_app(max_body_bytes=2048, warmup=False)
    r = predict(c, {"instances": ["good movie " * 300]})
    assert (r.status_code, r.json) == (413, {"error": "request body larger than the limit of 2048 bytes"})
    assert r.headers["connection"] == "close"


def _parallel_posts(client, n, body):
    async def all_at_once():
        import asyncio

        return await asyncio.gather(*(client.send("POST", PREDICT, json=body) for _ in range(n)))

    return client.loop.run(all_at_once())


@pytest.mark.parametrize("status", [429, 503])
def test_overload(make_app, slow_model, status):
    c, _ = make_app(max_batch_size=1, batch_timeout_s=0, max_queued_rows=1, model_dir=slow_model(0.2),
                    overload_status=status, warmup=False)
    responses = _parallel_posts(c, 6, {"instances": ["good"]})
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and status in codes and set(codes) <= {200, status}
    rejected = next(r for r in responses if r.status_code == status)
    assert rejected.json["error"].startswith("server overloaded: 1 rows queued (max 1)")
    assert rejected.headers["retry-after"] == "1"


def test_deadline_504(make_app, slow_model):
    c, _ = make_app(request_timeout_s=0.05, model_dir=slow_model(0.3), warmup=False)
    r = predict(c, {"instances": ["good"]})
    assert (r.status_code, r.json) == (504, {"error": "deadline exceeded before the model call completed"})


def test_cors_off_by_default(client):
    r = client.post("/v1/sentiment", json={"texts": ["good"]}, headers={"Origin": "https://a.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_on(make_app):
    c, _ = make_app(cors_origins=("https://a.example",), warmup=False)
    r = c.post("/v1/sentiment", json={"texts": ["good"]}, headers={"Origin": "https://a.example"})
    assert r.headers["access-control-allow-origin"] == "https://a.example"
    r = c.post("/v1/sentiment", json={"texts": ["good"]}, headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = c.options(PREDICT, headers={"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "content-type"


def test_url_encoded_model_name(make_app):
    c, _ = make_app(model_name="my model/v", warmup=False)
    r = c.post("/v1/models/my%20model%2Fv:predict", json={"instances": ["good"]})
    assert r.status_code == 200
    assert c.get("/v1/models/my%20model%2Fv").json == _status(2)


def test_broken_new_version_keeps_the_old_one_serving(make_app, model_base, tmp_path):
    base = copy_model_base(model_base, tmp_path)
    c, core = make_app(model_dir=base, warmup=False)
    (base / "3" / "variables").mkdir(parents=True)
    (base / "3" / "saved_model.pb").write_bytes(b"not a saved model")
    (base / "3" / "variables" / "variables.index").write_bytes(b"")
    core.models[MODEL_NAME].refresh(settle=False)
    status = c.get(f"/v1/models/{MODEL_NAME}").json["model_version_status"]
    assert status == [
        {"version": "3", "state": "END", "status": {
            "error_code": "DATA_LOSS",
            "error_message": "version 3 could not be loaded: saved_model.pb is not a valid SavedModel (truncated or corrupt)"}},
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}},
    ]
    r = predict(c, {"instances": ["good"]})
    assert r.status_code == 200 and c.get("/readyz").status_code == 200
