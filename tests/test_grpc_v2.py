"""The Open Inference Protocol over gRPC: a real `python -m serve --grpc-port` driven by the real
`tritonclient[grpc]` (its client for raw tensors, its own generated stubs for `contents`), with
answers compared to the V2 REST endpoint of the same server."""

from __future__ import annotations

import struct
import time

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as triton
from conftest import MODEL_NAME, add_model_version, copy_model_base
from serve_process import ServerProcess
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow

TEXTS = ["a great movie, wonderful acting", "awful and boring", "the plot was dull", "naïve fun #3"]


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    """Versions 1 and 2 (different weights), both served."""
    base = copy_model_base(model_base, tmp_path_factory.mktemp("v2grpc"))
    add_model_version(base, 2)
    srv = ServerProcess(base, "--poll-interval", "0", "--version-policy", "all", grpc=True)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with triton.InferenceServerClient(server.grpc_target) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def text_input(texts) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def rest_infer(server, texts, version: str | None = None) -> dict:
    url = f"{server.url}/v2/models/{MODEL_NAME}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    response = requests.post(url, json=body, timeout=10)
    assert response.status_code == 200, response.text
    return {o["name"]: o for o in response.json()["outputs"]}


def contents_request(texts, **fields) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME, **fields)
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    tensor.contents.bytes_contents.extend(t.encode() for t in texts)
    return request


def test_server_and_model_health_and_metadata(client, server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert client.is_server_live() and client.is_server_ready()
    with grpc.insecure_channel(server.grpc_target) as channel:  # what a Kubernetes gRPC probe may name
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert client.is_model_ready(MODEL_NAME) and client.is_model_ready(MODEL_NAME, "2")
    server_metadata = client.get_server_metadata(as_json=True)
    assert server_metadata["name"] == requests.get(f"{server.url}/v2", timeout=10).json()["name"]
    metadata = client.get_model_metadata(MODEL_NAME, as_json=True)
    rest = requests.get(f"{server.url}/v2/models/{MODEL_NAME}", timeout=10).json()
    assert metadata["versions"] == rest["versions"] and sorted(rest["versions"]) == ["1", "2"]
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]  # int64 as JSON strings
    assert {o["name"]: (o["datatype"], [int(d) for d in o["shape"]]) for o in metadata["outputs"]} == {
        o["name"]: (o["datatype"], o["shape"]) for o in rest["outputs"]}


def test_infer_with_raw_tensors_equals_rest(client, server):
    result = client.infer(MODEL_NAME, [text_input(TEXTS)], request_id="req-7")
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (MODEL_NAME, "2", "req-7")
    assert len(response.raw_output_contents) == len(response.outputs)  # raw in, raw out, as Triton answers
    rest = rest_infer(server, TEXTS)
    probabilities = result.as_numpy("probabilities")
    assert probabilities.dtype == np.float32 and probabilities.shape == (len(TEXTS), 2)
    np.testing.assert_array_equal(probabilities, np.array(rest["probabilities"]["data"], np.float32).reshape(-1, 2))
    assert [v.decode() for v in result.as_numpy("label")] == rest["label"]["data"]


def test_infer_with_contents_and_requested_outputs(stub, server):
    request = contents_request(TEXTS, id="c-1")
    request.outputs.add(name="label")
    response = stub.ModelInfer(request, timeout=10)
    (output,) = response.outputs
    assert (response.id, output.name, output.datatype, list(output.shape)) == ("c-1", "label", "BYTES", [len(TEXTS)])
    assert not response.raw_output_contents  # contents in, contents out
    assert [v.decode() for v in output.contents.bytes_contents] == rest_infer(server, TEXTS)["label"]["data"]

    request = contents_request(TEXTS, parameters={"binary_data_output": service_pb2.InferParameter(bool_param=True)})
    response = stub.ModelInfer(request, timeout=10)
    by_name = {o.name: raw for o, raw in zip(response.outputs, response.raw_output_contents)}
    probabilities = np.frombuffer(by_name["probabilities"], np.float32).reshape(-1, 2)
    np.testing.assert_array_equal(probabilities.ravel(), np.array(rest_infer(server, TEXTS)["probabilities"]["data"],
                                                                  np.float32))


def test_versions_answer_with_their_own_weights(client, server):
    answers = {}
    for version in ("1", "2"):
        result = client.infer(MODEL_NAME, [text_input(TEXTS)], model_version=version)
        assert result.get_response().model_version == version
        answers[version] = result.as_numpy("probabilities")
        np.testing.assert_array_equal(answers[version], np.array(
            rest_infer(server, TEXTS, version)["probabilities"]["data"], np.float32).reshape(-1, 2))
    assert not np.array_equal(answers["1"], answers["2"])


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


@pytest.mark.parametrize(("datatype", "shape", "name", "expected"), [
    ("FP32", [1], "text", "input 'text': datatype 'FP32', the model expects BYTES"),
    ("BYTES", [1, 1], "text", "input 'text'"),
    ("BYTES", [1], "review", "unexpected inference input 'review'"),
])
def test_bad_inputs_are_invalid_argument(client, datatype, shape, name, expected):
    tensor = triton.InferInput(name, shape, datatype)
    if datatype == "BYTES":
        tensor.set_data_from_numpy(np.array([b"good"] * int(np.prod(shape)), dtype=object).reshape(shape))
    else:
        tensor.set_data_from_numpy(np.zeros(shape, np.float32))
    error = _error(lambda: client.infer(MODEL_NAME, [tensor]))
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and expected in error.message()


def test_unknown_model_and_version_are_not_found(client):
    for call in (lambda: client.infer("nope", [text_input(["good"])]),
                 lambda: client.infer(MODEL_NAME, [text_input(["good"])], model_version="9"),
                 lambda: client.get_model_metadata("nope"),
                 lambda: client.is_model_ready("nope")):
        assert _error(call).status() == "StatusCode.NOT_FOUND"
    assert _error(lambda: client.infer(MODEL_NAME, [text_input(["good"])], model_version="v1")).status() == (
        "StatusCode.INVALID_ARGUMENT")


def test_a_declared_shape_is_checked_before_anything_is_allocated(stub):
    """A billion strings declared in a 40-byte message: refused at once, nothing allocated."""
    request = service_pb2.ModelInferRequest(model_name=MODEL_NAME)
    request.inputs.add(name="text", datatype="BYTES", shape=[1_000_000_000])
    request.raw_input_contents.append(struct.pack("<I", 4) + b"good")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than the limit" in info.value.details()
    assert time.monotonic() - start < 2

    for tensor_fields, raw, expected in [
        ({"shape": [3]}, [struct.pack("<I", 4) + b"good"], "cannot hold 3 BYTES elements"),
        ({"shape": [2]}, [struct.pack("<I", 4) + b"good"], "the binary data ends before BYTES element 1 of 2"),
        ({"shape": [1]}, [struct.pack("<I", 40) + b"good"], "longer than the data"),
        ({"shape": [1]}, [], "the shape holds 1 elements but contents.bytes_contents has 0"),
        ({"shape": [1]}, [b"", b""], "2 raw_input_contents for 1 inputs"),
    ]:
        request = service_pb2.ModelInferRequest(model_name=MODEL_NAME, raw_input_contents=raw)
        request.inputs.add(name="text", datatype="BYTES", **tensor_fields)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in info.value.details(), expected


def test_parameters_are_validated(stub):
    bad = [({"binary_data_output": service_pb2.InferParameter(string_param="yes")}, "must be a bool"),
           ({"classification": service_pb2.InferParameter(int64_param=2)}, "'classification' is not supported"),
           ({"anything": service_pb2.InferParameter()}, "parameter 'anything' has no value")]
    for parameters, expected in bad:
        request = contents_request(["good"], parameters=parameters)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in info.value.details()
    request = contents_request(["good"])
    request.outputs.add(name="label").parameters["classification"].int64_param = 2
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_triton_only_methods_are_unimplemented(client):
    for call in (lambda: client.get_model_config(MODEL_NAME), lambda: client.get_inference_statistics(MODEL_NAME),
                 lambda: client.get_model_repository_index()):
        assert _error(call).status() == "StatusCode.UNIMPLEMENTED"


def test_metrics_count_v2_grpc_calls(client, server):
    client.infer(MODEL_NAME, [text_input(["good"])])
    metrics = requests.get(f"{server.url}/monitoring/prometheus/metrics", timeout=10).text
    assert 'route="grpc_v2_infer"' in metrics and 'code="OK"' in metrics
