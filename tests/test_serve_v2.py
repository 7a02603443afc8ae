"""The Open Inference Protocol (KServe V2) against a real `python -m serve`, through the real
`tritonclient[http]` as a Triton or KServe user would, and the standard gRPC health service."""

from __future__ import annotations

import os
import shutil

import grpc
import numpy as np
import pytest
import requests
import tritonclient.http as triton
from conftest import MODEL_NAME
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import ServerProcess
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow

TEXTS = ["A brilliant, moving film with superb acting.", "An awful, boring, tedious mess."]


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    srv = ServerProcess(model_base, "--poll-interval", "0", grpc=True,
                        log_path=tmp_path_factory.mktemp("v2") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(url=server.url.removeprefix("http://")) as c:
        yield c


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL_NAME) and client.is_model_ready(MODEL_NAME, "1")
    assert not client.is_model_ready(MODEL_NAME, "7") and not client.is_model_ready("nope")
    server = client.get_server_metadata()
    assert server["name"] == "sentiment-dtensor" and "binary_tensor_data" in server["extensions"]
    metadata = client.get_model_metadata(MODEL_NAME)
    outputs = sorted((o["name"], o["datatype"], o["shape"]) for o in metadata.pop("outputs"))
    assert metadata == {"name": MODEL_NAME, "versions": ["1"], "platform": "tensorflow_savedmodel",
                        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}]}
    assert outputs == [("label", "BYTES", [-1]), ("logits", "FP32", [-1, 2]), ("probabilities", "FP32", [-1, 2])]
    assert client.get_model_metadata(MODEL_NAME, "1")["name"] == MODEL_NAME


def _infer(client, binary: bool, outputs=("label", "probabilities")):
    text = triton.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object), binary_data=binary)
    wanted = [triton.InferRequestedOutput(name, binary_data=binary) for name in outputs]
    return client.infer(MODEL_NAME, [text], outputs=wanted, request_id="req-7")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_two_texts_agrees_with_tf_serving_api(client, server, binary):
    result = _infer(client, binary)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == (MODEL_NAME, "1", "req-7")
    assert [o["name"] for o in response["outputs"]] == ["label", "probabilities"]  # only those asked for
    labels = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("label")]  # str from JSON
    probabilities = result.as_numpy("probabilities")
    rest = requests.post(f"{server.url}/v1/models/{MODEL_NAME}:predict", json={"instances": TEXTS}, timeout=10).json()
    assert labels == [p["label"] for p in rest["predictions"]] == ["positive", "negative"]
    np.testing.assert_array_equal(probabilities, np.array([p["probabilities"] for p in rest["predictions"]], np.float32))


def test_infer_with_the_clients_defaults_gets_every_output_in_binary(client):
    text = triton.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([TEXTS[0].encode()], dtype=object))  # binary by default
    result = client.infer(MODEL_NAME, [text])
    assert {o["name"] for o in result.get_response()["outputs"]} == {"label", "probabilities", "logits"}
    assert result.as_numpy("logits").shape == (1, 2)


@pytest.mark.parametrize("call, status, message", [
    (lambda c: c.get_model_metadata("nope"), "404", "Servable not found for request: Latest(nope)"),
    (lambda c: c.get_model_metadata(MODEL_NAME, "7"), "404", f"Specific({MODEL_NAME}, 7)"),
    (lambda c: c.infer("nope", [triton.InferInput("text", [1], "BYTES").set_data_from_numpy(
        np.array([b"good"], dtype=object), binary_data=False)]), "404", "Latest(nope)"),
    (lambda c: c.infer(MODEL_NAME, [triton.InferInput("text", [1], "BYTES").set_data_from_numpy(
        np.array([b" "], dtype=object), binary_data=False)]), "400", "input 'text' element 0: text is empty"),
    (lambda c: c.infer(MODEL_NAME, [triton.InferInput("txt", [1], "BYTES").set_data_from_numpy(
        np.array([b"good"], dtype=object), binary_data=False)]), "400", "unexpected inference input 'txt'"),
    (lambda c: c.infer(MODEL_NAME, [triton.InferInput("text", [1], "FP32").set_data_from_numpy(
        np.array([1.0], dtype=np.float32), binary_data=False)]), "400", "datatype 'FP32', the model expects BYTES"),
    (lambda c: _infer(c, False, outputs=("scores",)), "400", "unexpected inference output 'scores'"),
])
def test_errors_have_v2_status_and_body(client, call, status, message):
    with pytest.raises(InferenceServerException) as info:
        call(client)
    assert info.value.status() == status and message in info.value.message(), (info.value.status(), info.value.message())


@pytest.mark.parametrize("body, error", [
    ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a"]}]},
     "input 'text': the shape holds 2 elements but 'data' has 1"),
    ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1], "data": ["a"]}]},
     "input 'text': 'shape' must be a list of non-negative integers"),
    ({"inputs": []}, "'inputs' must be a non-empty list of tensors"),
    ({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [3]}]},
     "input 'text' element 0: expected a string, got a number (3)"),
])
def test_malformed_infer_json(server, body, error):
    r = requests.post(f"{server.url}/v2/models/{MODEL_NAME}/infer", json=body, timeout=10)
    assert (r.status_code, r.json()) == (400, {"error": error})


def test_binary_data_that_does_not_add_up_is_400(server):
    for rows, size, binary, error in [
        (1, 8, b"\x05\x00\x00\x00good", "binary BYTES element 0 is longer than the data"),
        (1, 9, b"\x04\x00\x00\x00goodX", "1 bytes of binary data after the 1 elements"),
        (1, 9, b"\x04\x00\x00\x00good", "binary_data_size 9 does not fit the binary data"),
        (2, 8, b"\x04\x00\x00\x00good", "the binary data ends before BYTES element 1 of 2"),
    ]:
        head = ('{"inputs":[{"name":"text","datatype":"BYTES","shape":[%d],"parameters":{"binary_data_size":%d}}]}'
                % (rows, size)).encode()
        r = requests.post(f"{server.url}/v2/models/{MODEL_NAME}/infer", data=head + binary, timeout=10,
                          headers={"Inference-Header-Content-Length": str(len(head))})
        assert r.status_code == 400 and error in r.json()["error"], r.text


def test_grpc_health_service(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tensorflow.serving.PredictionService"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_health_follows_readiness_from_loading_to_draining(model_base, tmp_path):
    base = tmp_path / MODEL_NAME
    base.mkdir()  # no version yet: alive but not ready
    srv = ServerProcess(base, "--poll-interval", "0.2", grpc=True, wait_for="/healthz", log_path=tmp_path / "serve.log")
    try:
        with grpc.insecure_channel(srv.grpc_target) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)  # gRPC starts after TensorFlow is imported
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=120)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            shutil.copytree(model_base / "1", tmp_path / "1.tmp")
            os.rename(tmp_path / "1.tmp", base / "1")
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            srv.terminate()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # draining
    finally:
        assert srv.stop() == 0, srv.log()
