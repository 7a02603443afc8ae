"""Serving units without a model: config, error table, batcher, protocol parsing."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from serve import errors
from serve.batching import Batcher
from serve.config import ServeConfig
from serve.models import Signature, TensorInfo, select_versions
from serve.protocol import (
    format_classify, format_predict, parse_classify, parse_json, parse_model_path, parse_predict, parse_sentiment,
)

CONFIG = ServeConfig(model_dir="models/sentiment", max_rows_per_request=4, max_text_bytes=20)
TEXT_SIG = Signature("serving_default", "tensorflow/serving/predict",
                     {"text": TensorInfo("DT_STRING", (-1,))}, {})


# -- config --------------------------------------------------------------------------------------

def test_config_defaults_model_name_from_dir():
    assert ServeConfig(model_dir="models/imdb/").model_name == "imdb"
    assert ServeConfig(model_dir="models/imdb", model_name="x").model_name == "x"


@pytest.mark.parametrize("kwargs, field", [
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"version_policy": "newest"}, "version_policy"),
    ({"version_policy": "specific"}, "versions"),
    ({"versions": (1,)}, "versions"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"overload_status": 500}, "overload_status"),
])
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServeConfig(model_dir="m", **kwargs)


def test_version_policies():
    on_disk = [1, 2, 5]
    assert select_versions(ServeConfig(model_dir="m"), on_disk) == {5}
    assert select_versions(ServeConfig(model_dir="m", version_policy="all"), on_disk) == {1, 2, 5}
    assert select_versions(ServeConfig(model_dir="m", version_policy="specific", versions=(2, 3)), on_disk) == {2}
    assert select_versions(ServeConfig(model_dir="m"), []) == set()


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc, http, code", [
    (errors.InvalidArgument("x"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound("x"), 404, grpc.StatusCode.NOT_FOUND),
    (errors.TooLarge("x"), 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Overloaded("x"), 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Overloaded("x", 503), 503, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded("x"), 504, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable("x"), 503, grpc.StatusCode.UNAVAILABLE),
    (errors.Internal("x"), 500, grpc.StatusCode.INTERNAL),
])
def test_error_table(exc, http, code):
    assert isinstance(exc, errors.ServingError)
    assert (exc.http_status, exc.grpc_code, exc.to_json()) == (http, code, {"error": "x"})


# -- batcher -------------------------------------------------------------------------------------

class Doubler:
    """A fake model: out = 2 * x, recording the batch sizes it was called with."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[int] = []
        self.delay = delay

    def __call__(self, inputs):
        self.calls.append(len(inputs["x"]))
        time.sleep(self.delay)
        if (inputs["x"] < 0).any():
            raise ValueError("negative input")
        return {"y": inputs["x"] * 2}


def _concurrently(n, fn):
    results, threads = [None] * n, []
    for i in range(n):
        def run(i=i):
            try:
                results[i] = fn(i)
            except Exception as exc:  # noqa: BLE001
                results[i] = exc
        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_batcher_merges_concurrent_requests_and_returns_each_its_slice():
    model = Doubler(delay=0.01)
    batcher = Batcher(max_batch_size=16, batch_timeout_s=0.02, max_queued_rows=1000)
    try:
        results = _concurrently(
            32, lambda i: batcher.submit(model, {"x": np.arange(i, i + 2)}, time.monotonic() + 5))
    finally:
        batcher.close()
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result["y"], np.arange(i, i + 2) * 2)
    assert max(model.calls) > 2 and max(model.calls) <= 16 and sum(model.calls) == 64


def test_batcher_overload_fails_fast():
    model = Doubler(delay=0.2)
    batcher = Batcher(max_batch_size=1, batch_timeout_s=0, max_queued_rows=2)
    try:
        results = _concurrently(8, lambda i: batcher.submit(model, {"x": np.array([i])}, time.monotonic() + 5))
    finally:
        batcher.close()
    overloaded = [r for r in results if isinstance(r, errors.Overloaded)]
    assert overloaded and all(isinstance(r, (dict, errors.Overloaded)) for r in results)
    assert "overloaded" in overloaded[0].message


def test_batcher_deadline():
    model = Doubler(delay=0.3)
    batcher = Batcher(max_batch_size=1, batch_timeout_s=0, max_queued_rows=10)
    try:
        with pytest.raises(errors.DeadlineExceeded):
            batcher.submit(model, {"x": np.array([1])}, time.monotonic() + 0.05)
    finally:
        batcher.close()


def test_batcher_bad_request_does_not_fail_its_batch_mates():
    model = Doubler(delay=0.01)
    batcher = Batcher(max_batch_size=64, batch_timeout_s=0.05, max_queued_rows=100)
    try:
        results = _concurrently(8, lambda i: batcher.submit(
            model, {"x": np.array([-1 if i == 3 else i])}, time.monotonic() + 5))
    finally:
        batcher.close()
    assert isinstance(results[3], errors.Internal)
    assert all(r["y"][0] == 2 * i for i, r in enumerate(results) if i != 3)


def test_batcher_closed_is_unavailable():
    batcher = Batcher()
    batcher.close()
    with pytest.raises(errors.Unavailable):
        batcher.submit(Doubler(), {"x": np.array([1])}, time.monotonic() + 1)


# -- protocol ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, expected", [
    ("POST", "/v1/models/m:predict", ("m", None, None, "predict")),
    ("POST", "/V1/MODELS/m/Versions/12:Classify", ("m", 12, None, "classify")),
    ("POST", "/v1/models/my%20model/labels/stable:regress", ("my model", None, "stable", "regress")),
    ("GET", "/v1/models/m", ("m", None, None, None)),
    ("GET", "/v1/models/m/versions/3/metadata", ("m", 3, None, "metadata")),
    ("GET", "/v1/models/m/labels/canary", ("m", None, "canary", None)),
])
def test_parse_model_path(method, path, expected):
    p = parse_model_path(method, path)
    assert (p.name, p.version, p.label, p.verb) == expected


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/models/m"), ("POST", "/v1/models/m:explain"), ("GET", "/v1/models/m/versions/x"),
])
def test_parse_model_path_malformed(method, path):
    with pytest.raises(errors.InvalidArgument, match="Malformed request"):
        parse_model_path(method, path)


@pytest.mark.parametrize("raw, message", [
    (b"", "empty"), (b"\xff{}", "not valid UTF-8"), (b"{", "JSON Parse error"), (b"[1]", "must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_parse_json_errors(raw, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_json(raw)


def test_parse_predict_row_and_columnar_forms():
    for body, row in [
        ({"instances": ["good", {"b64": "YmFk"}, {"text": "ok"}]}, True),
        ({"inputs": ["good", {"b64": "YmFk"}, "ok"]}, False),
        ({"inputs": {"text": ["good", "bad", "ok"]}}, False),
    ]:
        arrays, row_format = parse_predict(body, TEXT_SIG, CONFIG)
        assert row_format is row
        assert list(arrays["text"])[:2] == [b"good", b"bad"]


@pytest.mark.parametrize("body, message", [
    ({"instances": ["a"], "inputs": ["a"]}, "both 'instances' and 'inputs'"),
    ({}, "Missing 'instances'"),
    ({"instances": "a"}, "'instances' must be a list"),
    ({"instances": []}, "at least one"),
    ({"instances": ["a"] * 5}, "5 instances in one request, more than the limit of 4"),
    ({"instances": [3]}, r"instances\[0\]: expected a string"),
    ({"instances": [None]}, r"got null"),
    ({"instances": [""]}, "text is empty"),
    ({"instances": ["x" * 21]}, "21 bytes, more than the limit of 20"),
    ({"instances": [{"b64": "/w=="}]}, "not valid UTF-8"),
    ({"instances": [{"b64": "***"}]}, "not valid base64"),
    ({"instances": ["\ud800"]}, "not valid UTF-8"),
    ({"instances": [{"txt": "a"}]}, "expected keys"),
    ({"inputs": {"txt": ["a"]}}, "must have keys"),
])
def test_parse_predict_errors(body, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_predict(body, TEXT_SIG, CONFIG)


def test_format_predict_shapes():
    outputs = {"label": np.array([b"positive", b"negative"], dtype=object),
               "probabilities": np.array([[0.25, 0.75], [0.5, 0.5]], dtype=np.float32)}
    assert format_predict(outputs, True) == {"predictions": [
        {"label": "positive", "probabilities": [0.25, 0.75]}, {"label": "negative", "probabilities": [0.5, 0.5]}]}
    assert format_predict(outputs, False) == {"outputs": {
        "label": ["positive", "negative"], "probabilities": [[0.25, 0.75], [0.5, 0.5]]}}
    only = {"label": outputs["label"]}
    assert format_predict(only, True) == {"predictions": ["positive", "negative"]}
    assert format_predict(only, False) == {"outputs": ["positive", "negative"]}
    assert format_predict({"x_bytes": np.array([b"\xff"], dtype=object)}, True) == {"predictions": [{"b64": "/w=="}]}


def test_parse_classify_builds_examples_with_context():
    from tensorflow.core.example import example_pb2

    name, serialized = parse_classify(
        {"signature_name": "classify", "context": {"lang": "en"}, "examples": [{"text": "good"}, {"text": "bad", "n": 3}]},
        CONFIG)
    assert name == "classify"
    ex = example_pb2.Example.FromString(serialized[1])
    assert ex.features.feature["text"].bytes_list.value == [b"bad"]
    assert ex.features.feature["lang"].bytes_list.value == [b"en"]
    assert ex.features.feature["n"].int64_list.value == [3]
    results = format_classify(np.array([[b"negative", b"positive"]], dtype=object), np.array([[0.25, 0.75]]))
    assert results == {"results": [[["negative", 0.25], ["positive", 0.75]]]}


@pytest.mark.parametrize("body, message", [
    ({}, "Missing 'examples'"), ({"examples": {}}, "must be a list"), ({"examples": []}, "at least one"),
    ({"examples": ["x"]}, "expected an object"), ({"examples": [{"text": ""}]}, "text is empty"),
    ({"examples": [{"text": "a"}], "context": []}, "'context' must be an object"),
])
def test_parse_classify_errors(body, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_classify(body, CONFIG)


@pytest.mark.parametrize("body, message", [
    ({}, "Missing 'texts'"), ({"texts": "a"}, "must be a list"), ({"texts": []}, "at least one"),
    ({"texts": [1]}, r"texts\[0\]: expected a string, got a number"), ({"texts": [" "]}, "text is empty"),
    ({"texts": ["\udcff"]}, "not valid UTF-8"),
])
def test_parse_sentiment_errors(body, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_sentiment(body, CONFIG)


def test_batcher_does_not_wait_when_nobody_else_is_arriving():
    model = Doubler()
    batcher = Batcher(max_batch_size=64, batch_timeout_s=1.0, arriving=lambda: 0)
    try:
        start = time.monotonic()
        batcher.submit(model, {"x": np.array([1])}, time.monotonic() + 5)
        assert time.monotonic() - start < 0.5
    finally:
        batcher.close()


def test_batcher_pads_single_rows_and_returns_one():
    model = Doubler()
    batcher = Batcher(max_batch_size=8, batch_timeout_s=0)
    try:
        out = batcher.submit(model, {"x": np.array([21])}, time.monotonic() + 5)
    finally:
        batcher.close()
    assert model.calls == [2] and out["y"].tolist() == [42]


def test_batcher_runs_a_lone_request_in_the_callers_thread():
    threads = []

    def runner(inputs):
        threads.append(threading.current_thread())
        return {"y": inputs["x"] * 2}

    batcher = Batcher(max_batch_size=8, batch_timeout_s=1.0, arriving=lambda: 0)
    try:
        out = batcher.submit(runner, {"x": np.array([1])}, time.monotonic() + 5)
    finally:
        batcher.close()
    assert threads == [threading.current_thread()] and out["y"].tolist() == [2]


def test_inline_call_holds_the_model_slot():
    """A runs inline; B must queue behind it (not run concurrently), so C finds the queue full."""
    active, peak = [0], [0]

    def runner(inputs):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        time.sleep(0.3)
        active[0] -= 1
        return {"y": inputs["x"]}

    batcher = Batcher(max_batch_size=1, batch_timeout_s=0, max_queued_rows=1, arriving=lambda: 0)
    results = {}

    def call(name):
        try:
            results[name] = batcher.submit(runner, {"x": np.array([1])}, time.monotonic() + 5)
        except errors.ServingError as exc:
            results[name] = exc

    try:
        threads = []
        for name in "AB":
            threads.append(threading.Thread(target=call, args=(name,)))
            threads[-1].start()
            time.sleep(0.05)
        call("C")
        for t in threads:
            t.join()
    finally:
        batcher.close()
    assert isinstance(results["C"], errors.Overloaded)
    assert isinstance(results["A"], dict) and isinstance(results["B"], dict) and peak[0] == 1
