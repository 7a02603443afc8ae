"""Serving units without a model: config, error table, batcher, protocol parsing."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from serve.config import ServeConfig
from serve.core import batcher as batcher_module
from serve.core import errors
from serve.core.batcher import Batcher
from serve.core.dataplane import validate_inputs
from serve.core.loaded_model import Signature, TensorInfo
from serve.core.model_versions import ModelSource, select_versions
from serve.http.routing import HTTP_STATUS, dumps, error_response
from serve.http.tf_serving_codec import (
    format_classify,
    format_predict,
    parse_classify,
    parse_json,
    parse_model_path,
    parse_predict,
    parse_sentiment,
)

CONFIG = ServeConfig(model_dir="models/sentiment", max_rows_per_request=4, max_text_bytes=20)
TEXT_SIG = Signature("serving_default", "tensorflow/serving/predict",
                     {"text": TensorInfo("DT_STRING", (-1,))}, {})


# -- config --------------------------------------------------------------------------------------

def test_config_defaults_model_name_from_dir():
    assert ServeConfig(model_dir="models/imdb/").model_name == "imdb"
    assert ServeConfig(model_dir="models/imdb", model_name="x").model_name == "x"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0}, "--max-batch-size 0: must be at least 1"),
    ({"version_policy": "newest"}, "--version-policy 'newest': expected latest, all or specific"),
    ({"version_policy": "specific"}, "--version-policy specific needs --versions N[,M...]"),
    ({"versions": (1,)}, "--versions is only valid with --version-policy specific"),
    ({"request_timeout_s": 0}, "--request-timeout 0: must be positive"),
    ({"header_timeout_s": -1}, "--header-timeout -1: must be positive"),
    ({"overload_status": 500}, "--overload-status 500: must be 429 or 503"),
    ({"grpc_port": 70000}, "--grpc-port 70000: must be in 0..65535"),
])
def test_config_rejects_bad_values_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError) as info:
        ServeConfig(model_dir="m", **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("files, cpus", [
    ({"cpu.max": "150000 100000\n"}, 2),  # cgroup v2, `--cpus 1.5`: rounded up
    ({"cpu.max": "max 100000\n"}, None),  # no limit
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_default_workers_follow_the_cgroup_cpu_limit(tmp_path, files, cpus):
    from common.cpus import _cgroup_cpu_quota, usable_cpus

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cgroup_cpu_quota(str(tmp_path)) == cpus
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
    assert ServeConfig(model_dir="m").workers == 0  # resolved to usable_cpus() when the server starts
    with pytest.raises(ValueError, match="--workers -1: must be 0"):
        ServeConfig(model_dir="m", workers=-1)


def test_version_policies():
    on_disk = [1, 2, 5]
    # in the order to try them: `latest` serves the first of these that loads
    assert select_versions(ModelSource("m", "m"), on_disk) == [5, 2, 1]
    assert select_versions(ModelSource("m", "m", "all"), on_disk) == [5, 2, 1]
    assert select_versions(ModelSource("m", "m", "specific", (2, 3)), on_disk) == [2]
    assert select_versions(ModelSource("m", "m"), []) == []


def test_cli_is_generated_from_the_config():
    from serve.__main__ import parse_args

    config = parse_args(["--model-dir", "models/x", "--batch-timeout-ms", "5", "--versions", "1,2",
                         "--version-policy", "specific", "--version-labels", "stable=1", "--cors-origins", "*",
                         "--no-warmup", "--request-timeout", "3"])
    assert (config.batch_timeout_s, config.versions, config.version_labels, config.cors_origins) == (
        0.005, (1, 2), (("stable", 1),), ("*",))
    assert (config.warmup, config.request_timeout_s, config.model_name) == (False, 3.0, "x")


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc, http, code, retry", [
    (errors.InvalidArgument("x"), 400, grpc.StatusCode.INVALID_ARGUMENT, False),
    (errors.NotFound("x"), 404, grpc.StatusCode.NOT_FOUND, False),
    (errors.Overloaded("x"), 429, grpc.StatusCode.RESOURCE_EXHAUSTED, True),
    (errors.DeadlineExceeded("x"), 504, grpc.StatusCode.DEADLINE_EXCEEDED, False),
    (errors.Unavailable("x"), 503, grpc.StatusCode.UNAVAILABLE, True),
    (errors.Internal("x"), 500, grpc.StatusCode.INTERNAL, False),
])
def test_neutral_errors_map_to_http_and_grpc_at_the_edges(exc, http, code, retry):
    assert isinstance(exc, errors.ServingError)
    response = error_response(exc)
    assert (response.status, json.loads(response.body)) == (http, {"error": "x"})
    assert (("retry-after", "1") in [(k.decode(), v.decode()) for k, v in response.headers]) is retry
    assert grpc.StatusCode[exc.code.name] == code  # the gRPC edge's mapping


def test_http_table_is_tf_servings():
    # tensorflow_serving/model_servers/http_server.cc: ToHTTPStatusCode
    assert {c.name: s for c, s in HTTP_STATUS.items()} == {
        "OK": 200, "CANCELLED": 499, "UNKNOWN": 500, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504,
        "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429,
        "FAILED_PRECONDITION": 400, "ABORTED": 409, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 501, "INTERNAL": 500,
        "UNAVAILABLE": 503, "DATA_LOSS": 500, "UNAUTHENTICATED": 401}
    assert "grpc" not in sys.modules["serve.core.errors"].__dict__


# -- batcher -------------------------------------------------------------------------------------

class Doubler:
    """A fake model: out = 2 * x, recording the batch sizes it was called with."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[int] = []
        self.threads: list[str] = []
        self.delay = delay

    def __call__(self, inputs):
        self.calls.append(len(inputs["x"]))
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        if (inputs["x"] < 0).any():
            raise ValueError("negative input")
        return {"y": inputs["x"] * 2}


def run_batcher(coro_fn, **kwargs):
    """Run `coro_fn(batcher)` on a fresh event loop with a started batcher, then close it."""
    async def main():
        batcher = Batcher(overloaded=errors.Overloaded, **kwargs).start()
        try:
            return await coro_fn(batcher)
        finally:
            await batcher.close(5)

    return asyncio.run(main())


async def _gather(batcher, model, inputs, timeout=5.0):
    return await asyncio.gather(*(batcher.submit(model, x, timeout) for x in inputs), return_exceptions=True)


def test_batcher_merges_concurrent_requests_and_returns_each_its_slice():
    model = Doubler(delay=0.01)
    results = run_batcher(lambda b: _gather(b, model, [{"x": np.arange(i, i + 2)} for i in range(32)]),
                          max_batch_size=16, batch_timeout_s=0.02, max_queued_rows=1000)
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result["y"], np.arange(i, i + 2) * 2)
    assert max(model.calls) > 2 and max(model.calls) <= 16 and sum(model.calls) == 64
    assert set(model.threads) == {"model_0"}  # the model runs off the event loop


@pytest.mark.parametrize("delay, alone, threads", [
    (0.0, True, ["model_0", "MainThread", "MainThread"]),  # fast and alone: no hop to the model thread
    (0.0, False, ["model_0", "model_0", "model_0"]),  # other requests in flight: they may batch
    (0.02, True, ["model_0", "model_0", "model_0"]),  # slower than INLINE_MAX_S: keeps the loop free
])
def test_a_request_alone_on_a_fast_model_runs_without_the_thread_hop(delay, alone, threads, monkeypatch):
    # "fast" is a call well under the limit even on a loaded machine (a thread hop can take
    # milliseconds there); "slow" one well over it
    monkeypatch.setattr(batcher_module, "INLINE_MAX_S", 0.5 if delay == 0 else 0.005)
    model = Doubler(delay=delay)

    async def three(batcher):
        return [await batcher.submit(model, {"x": np.array([i])}, 5) for i in range(3)]

    results = run_batcher(three, max_batch_size=8, batch_timeout_s=0, alone=lambda: alone)
    assert [int(r["y"][0]) for r in results] == [0, 2, 4]
    assert model.threads == threads


def test_batcher_runs_a_request_alone_when_its_runner_cannot_be_merged():
    """The explain signature pads its n-grams to the longest review of a call: each request runs
    alone, so its answer never depends on what else was queued (other runners still batch)."""
    alone, merged = Doubler(delay=0.01), Doubler(delay=0.01)
    alone.mergeable = False

    async def both(batcher):
        return await asyncio.gather(_gather(batcher, alone, [{"x": np.arange(i, i + 2)} for i in range(8)]),
                                    _gather(batcher, merged, [{"x": np.arange(i, i + 2)} for i in range(8)]))

    results, _ = run_batcher(both, max_batch_size=16, batch_timeout_s=0.02, max_queued_rows=1000)
    assert alone.calls == [2] * 8 and max(merged.calls) > 2
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result["y"], np.arange(i, i + 2) * 2)



def test_batcher_overload_fails_fast():
    model = Doubler(delay=0.2)
    results = run_batcher(lambda b: _gather(b, model, [{"x": np.array([i])} for i in range(8)]),
                          max_batch_size=1, batch_timeout_s=0, max_queued_rows=2)
    overloaded = [r for r in results if isinstance(r, errors.Overloaded)]
    assert overloaded and all(isinstance(r, (dict, errors.Overloaded)) for r in results)
    assert "overloaded" in overloaded[0].message


def test_batcher_deadline_while_the_model_runs():
    model = Doubler(delay=0.3)

    async def one(batcher):
        start = time.monotonic()
        with pytest.raises(errors.DeadlineExceeded):
            await batcher.submit(model, {"x": np.array([1])}, 0.05)
        return time.monotonic() - start

    assert run_batcher(one, max_batch_size=1, batch_timeout_s=0) < 0.25  # at the deadline, not after the call


def test_batcher_expired_requests_never_reach_the_model():
    model = Doubler(delay=0.2)

    async def two(batcher):
        first = asyncio.ensure_future(batcher.submit(model, {"x": np.array([1])}, 5))
        await asyncio.sleep(0.05)
        with pytest.raises(errors.DeadlineExceeded):
            await batcher.submit(model, {"x": np.array([2])}, 0.05)  # expires while queued
        return await first

    assert run_batcher(two, max_batch_size=1, batch_timeout_s=0)["y"].tolist() == [2]
    assert model.calls == [1]  # only the first


def test_batcher_bad_request_does_not_fail_its_batch_mates():
    model = Doubler(delay=0.01)
    results = run_batcher(lambda b: _gather(b, model, [{"x": np.array([-1 if i == 3 else i])} for i in range(8)]),
                          max_batch_size=64, batch_timeout_s=0.05, max_queued_rows=100)
    assert isinstance(results[3], errors.Internal)
    assert all(r["y"][0] == 2 * i for i, r in enumerate(results) if i != 3)


def test_batcher_closed_is_unavailable():
    async def after_close(batcher):
        await batcher.close()
        with pytest.raises(errors.Unavailable):
            await batcher.submit(Doubler(), {"x": np.array([1])}, 1)

    run_batcher(after_close)


def test_batcher_waits_only_for_requests_on_their_way():
    model = Doubler()

    async def lone(batcher):
        start = time.monotonic()
        await batcher.submit(model, {"x": np.array([1])}, 5)
        return time.monotonic() - start

    assert run_batcher(lone, max_batch_size=64, batch_timeout_s=1.0) < 0.5

    async def with_one_arriving(batcher):
        with batcher.receiving():  # an edge is still reading a request
            first = asyncio.ensure_future(batcher.submit(model, {"x": np.array([1])}, 5))
            await asyncio.sleep(0.1)
        second = await batcher.submit(model, {"x": np.array([2])}, 5)
        return await first, second

    model.calls.clear()
    run_batcher(with_one_arriving, max_batch_size=64, batch_timeout_s=1.0)
    assert model.calls == [2]  # both rows in one call


# -- protocol ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, path, expected", [
    ("POST", "/v1/models/m:predict", ("m", None, None, "predict")),
    ("POST", "/V1/MODELS/m/Versions/12:Classify", ("m", 12, None, "classify")),
    ("POST", "/v1/models/my%20model/labels/stable:regress", ("my model", None, "stable", "regress")),
    ("GET", "/v1/models/m", ("m", None, None, None)),
    ("GET", "/v1/models/m/versions/3/metadata", ("m", 3, None, "metadata")),
    ("GET", "/v1/models/m/labels/canary", ("m", None, "canary", None)),
    ("POST", "/v1/models/m/versions/2:explain", ("m", 2, None, "explain")),
])
def test_parse_model_path(method, path, expected):
    p = parse_model_path(method, path)
    assert (p.name, p.version, p.label, p.verb) == expected


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/models/m"), ("POST", "/v1/models/m:explain2"), ("GET", "/v1/models/m/versions/x"),
])
def test_parse_model_path_malformed(method, path):
    with pytest.raises(errors.InvalidArgument, match="Malformed request"):
        parse_model_path(method, path)


@pytest.mark.parametrize("raw, message", [
    (b"", "empty"), (b"\xff{}", "not valid UTF-8"), (b"{", "JSON Parse error"), (b"[1]", "must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "depth limit exceeded"),
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
        arrays, row_format = parse_predict(body, TEXT_SIG, CONFIG.max_rows_per_request)
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
def test_predict_decoding_and_validation_errors(body, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        arrays, _ = parse_predict(body, TEXT_SIG, CONFIG.max_rows_per_request)
        validate_inputs(TEXT_SIG, arrays, CONFIG)


@pytest.mark.parametrize("array, message", [
    (np.array([1.0, 2.0], np.float32), "input 'text': expects string but float is provided"),
    (np.array([[b"a", b"b"]], dtype=object), "input 'text': string inputs must have rank 1, got shape [1, 2]"),
    (np.array(b"a", dtype=object), "input 'text': expected a batch (rank >= 1), got a scalar"),
])
def test_validation_of_decoded_tensors(array, message):
    with pytest.raises(errors.InvalidArgument) as info:
        validate_inputs(TEXT_SIG, {"text": array}, CONFIG)
    assert info.value.message == message


def test_format_predict_shapes():
    outputs = {"label": np.array([b"positive", b"negative"], dtype=object),
               "probabilities": np.array([[0.25, 0.75], [0.5, 0.5]], dtype=np.float32)}
    def as_json(obj):
        return json.loads(dumps(obj))

    assert as_json(format_predict(outputs, True)) == {"predictions": [
        {"label": "positive", "probabilities": [0.25, 0.75]}, {"label": "negative", "probabilities": [0.5, 0.5]}]}
    assert as_json(format_predict(outputs, False)) == {"outputs": {
        "label": ["positive", "negative"], "probabilities": [[0.25, 0.75], [0.5, 0.5]]}}
    only = {"label": outputs["label"]}
    assert format_predict(only, True) == {"predictions": ["positive", "negative"]}
    assert format_predict(only, False) == {"outputs": ["positive", "negative"]}
    assert format_predict({"x_bytes": np.array([b"\xff"], dtype=object)}, True) == {"predictions": [{"b64": "/w=="}]}
    # float32 is written in its shortest form, which reads back as exactly the same float32
    p = np.array([[1 / 3, 2 / 3]], np.float32)
    assert dumps(format_predict({"p": p}, True)) == b'{"predictions":[[0.33333334,0.6666667]]}'
    assert np.array(json.loads(dumps(p)), np.float32).tobytes() == p.tobytes()


def test_parse_classify_converts_only_the_model_features():
    name, rows, context = parse_classify(
        {"signature_name": "classify", "context": {"lang": "en", "text": "shared"},
         "examples": [{"text": "good"}, {"n": 3}, {"text": "bad", "k": list(range(10_000))}]}, 4)
    assert name == "classify"
    assert [sorted(r) for r in rows] == [["text"], [], ["text"]]  # `n`, `k` and `lang` are never converted
    assert rows[2]["text"].bytes_list.value == [b"bad"]
    assert list(context) == ["text"] and context["text"].bytes_list.value == [b"shared"]
    results = format_classify(np.array([[b"negative", b"positive"]], dtype=object), np.array([[0.25, 0.75]], np.float32))
    assert json.loads(dumps(results)) == {"results": [[["negative", 0.25], ["positive", 0.75]]]}


@pytest.mark.parametrize("body, message", [
    ({}, "Missing 'examples'"), ({"examples": {}}, "must be a list"), ({"examples": ["x"]}, "expected an object"),
    ({"examples": [{"text": "a"}], "context": []}, "'context' must be an object"),
    ({"examples": [{"text": None}]}, r"examples\[0\].text: expected a string"),
    ({"examples": [{}] * 5}, "5 instances in one request, more than the limit of 4"),
    ({"examples": []}, "at least one"),
])
def test_parse_classify_errors(body, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_classify(body, 4)


@pytest.mark.parametrize("body, message", [
    ({}, "Missing 'texts'"), ({"texts": "a"}, "must be a list"), ({"texts": []}, "at least one"),
    ({"texts": [1]}, r"texts\[0\]: expected a string, got a number"), ({"texts": [" "]}, "text is empty"),
    ({"texts": ["\udcff"]}, "not valid UTF-8"),
])
def test_sentiment_decoding_and_validation_errors(body, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        texts = parse_sentiment(body, CONFIG.max_rows_per_request)
        validate_inputs(TEXT_SIG, {"text": np.array(texts, dtype=object)}, CONFIG, lambda _n, i: f"texts[{i}]")


@pytest.mark.parametrize("flag, text", [("--versions", "\u00b2"), ("--versions", "\u0661\u0662"), ("--versions", "-1"),
                                        ("--version-labels", "stable=\u00b2"), ("--version-labels", "stable=99999999999999999999")])
def test_version_flags_take_versions_as_directories_name_them(flag, text, capsys):
    from serve.__main__ import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--model-dir", "models/sentiment", flag, text, *(["--version-policy", "specific"] if flag == "--versions" else [])])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert ("expected version numbers such as 1,2" if flag == "--versions" else "expected LABEL=VERSION") in err, err


# -- accepting connections among workers --------------------------------------------------------

def _gate_run(sibling_load: int) -> float:
    """Connect once to a socket whose AcceptGate sees a sibling holding `sibling_load` connections
    while it holds one already: seconds until the connection was accepted."""
    from serve.sockets import AcceptGate, bind_socket

    async def main() -> float:
        sock = bind_socket("127.0.0.1", 0)
        accepted = asyncio.Event()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport) -> None:  # noqa: ANN001
                accepted.set()

        gate = AcceptGate(sock, Protocol, lambda: 1, loads=[1, sibling_load], index=0)  # it holds one already
        gate.start()
        start = time.monotonic()
        client = socket.create_connection(sock.getsockname())
        await asyncio.wait_for(accepted.wait(), 10)
        elapsed = time.monotonic() - start
        gate.stop()
        client.close()
        sock.close()
        return elapsed

    return asyncio.run(main())


def test_accept_gate_takes_a_connection_when_no_sibling_is_less_loaded(monkeypatch):
    monkeypatch.setattr("serve.sockets.MAX_DEFER_S", 5.0)
    assert _gate_run(sibling_load=5) < 2.5  # at once: it does not defer


def test_accept_gate_leaves_a_connection_to_a_less_loaded_sibling_but_not_forever(monkeypatch):
    # The sibling (load 0) never accepts, as if its loop were stuck: the gate takes the connection
    # itself after MAX_DEFER_S instead of leaving it queued.
    monkeypatch.setattr("serve.sockets.MAX_DEFER_S", 0.3)
    assert 0.3 <= _gate_run(sibling_load=0) < 5.0


def test_accept_gate_takes_queued_connections_in_one_wake_up_while_it_is_the_least_loaded():
    """Ten connections wait in the queue; a sibling holds three. One wake-up takes connections
    while this worker holds no more than the sibling, so four (loads 0..3), and leaves the rest;
    alone (no sibling) one wake-up takes all ten. A busy worker that fell behind catches up in one
    event-loop turn instead of one connection per turn."""
    from serve.sockets import AcceptGate, bind_socket

    async def taken_in_one_wake_up(loads: list[int] | None) -> int:
        sock = bind_socket("127.0.0.1", 0)
        clients = [socket.create_connection(sock.getsockname()) for _ in range(10)]
        opened: list[asyncio.Protocol] = []
        gate = AcceptGate(sock, asyncio.Protocol, lambda: len(opened), loads=loads, index=0)
        gate._accepting = True  # as start() leaves it, without the reader that would wake it again
        sock.setblocking(False)  # each connect() returned after its handshake: all ten are queued
        gate._on_readable()
        taken = len(gate._connecting)
        await gate.settle()
        for client in clients:
            client.close()
        sock.close()
        return taken

    assert asyncio.run(taken_in_one_wake_up([0, 3])) == 4
    assert asyncio.run(taken_in_one_wake_up(None)) == 10


def test_accept_gate_pauses_when_out_of_file_descriptors():
    """EMFILE leaves the connection queued: the gate pauses instead of spinning on the wake-ups."""
    script = r"""
import asyncio, logging, os, resource, socket, sys
from serve.sockets import AcceptGate, bind_socket
records = []
logging.getLogger("serve.sockets").addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())
async def main():
    sock = bind_socket("127.0.0.1", 0)
    clients = [socket.create_connection(sock.getsockname()) for _ in range(3)]
    used = len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor is closed again
    resource.setrlimit(resource.RLIMIT_NOFILE, (used, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    made = []
    gate = AcceptGate(sock, lambda: type("P", (asyncio.Protocol,), {"connection_made": made.append})(), lambda: 0)
    gate.start()
    await asyncio.sleep(0.5)
    print(len(records), len(made))
asyncio.run(main())
"""
    import subprocess

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    warnings, opened = map(int, done.stdout.split())
    assert opened == 0 and 1 <= warnings <= 10, done.stdout + done.stderr  # one try per PAUSE_ON_ERROR_S


# -- model roots ---------------------------------------------------------------------------------

def test_model_roots_default_to_the_directories_holding_the_models(tmp_path):
    from serve.core.model_config_file import ModelConfigError, check_roots, model_roots

    (tmp_path / "models" / "a").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "models" / "escape").symlink_to(tmp_path / "other")
    config = ServeConfig(model_dir=str(tmp_path / "models" / "a"))
    roots = model_roots(config, [ModelSource.from_config(config)])
    assert roots == (str(tmp_path / "models"),)
    check_roots([ModelSource("b", str(tmp_path / "models" / "b"))], roots, "here")  # beside it: allowed
    for outside in (tmp_path / "other", tmp_path / "models" / "escape", tmp_path / "models" / ".." / "other",
                    tmp_path / "models-evil"):
        with pytest.raises(ModelConfigError, match=r"here: model_config_list.config\[1\] \(x\): base_path is "
                                                    r"outside .*models, where this server takes models from"):
            check_roots([ModelSource("b", str(tmp_path / "models" / "b")), ModelSource("x", str(outside))],
                        roots, "here")
    explicit = ServeConfig(model_dir=str(tmp_path / "models" / "a"), model_roots=(str(tmp_path / "other"),))
    assert model_roots(explicit, []) == (str(tmp_path / "other"),)
    with pytest.raises(ModelConfigError, match="--model-root .*nowhere: not a directory"):
        model_roots(ServeConfig(model_dir="m", model_roots=(str(tmp_path / "nowhere"),)), [])
