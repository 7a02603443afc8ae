"""gRPC end-to-end: a real `python -m serve --grpc-port` process queried with TF Serving's official
stubs (`tensorflow-serving-api`), exactly as a TF Serving user would, compared with its REST API."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from conftest import MODEL_NAME
from google.protobuf import json_format
from serve_process import ServerProcess
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

pytestmark = pytest.mark.slow

TEXTS = ["a great movie, wonderful acting", "awful and boring", "the plot was dull", "fun story #3",
         "excellent excellent excellent", "bad"]


def _start(model_base, *args: str) -> ServerProcess:
    return ServerProcess(model_base, "--poll-interval", "0", *args, grpc=True)


@pytest.fixture(scope="module")
def server(model_base):
    srv = _start(model_base)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


def predict_request(texts, name=MODEL_NAME, signature="serving_default", version=None) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    request.model_spec.signature_name = signature
    if version is not None:
        request.model_spec.version.value = version
    request.inputs["text"].CopyFrom(tf.make_tensor_proto(texts, dtype=tf.string))
    return request


def classify_request(texts) -> classification_pb2.ClassificationRequest:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name = MODEL_NAME
    request.model_spec.signature_name = "classify"
    for text in texts:
        example = request.input.example_list.examples.add()
        example.features.feature["text"].bytes_list.value.append(text.encode("utf-8"))
    return request


# -- the four RPCs, compared with REST -----------------------------------------------------------

def test_predict_equals_rest(server, stub):
    response = stub.Predict(predict_request(TEXTS), timeout=10)
    assert (response.model_spec.name, response.model_spec.version.value, response.model_spec.signature_name) == (
        MODEL_NAME, 1, "serving_default")
    assert set(response.outputs) == {"probabilities", "logits", "label"}
    probabilities = tf.make_ndarray(response.outputs["probabilities"])
    labels = [v.decode() for v in tf.make_ndarray(response.outputs["label"])]
    assert probabilities.shape == (len(TEXTS), 2) and probabilities.dtype == np.float32

    rest = requests.post(f"{server.url}/v1/models/{MODEL_NAME}:predict", json={"instances": TEXTS}, timeout=10).json()
    # The same rows in one model call: bit-identical whichever frontend sent them.
    np.testing.assert_array_equal(probabilities, np.array([p["probabilities"] for p in rest["predictions"]], np.float32))
    assert labels == [p["label"] for p in rest["predictions"]]
    np.testing.assert_array_equal(tf.make_ndarray(response.outputs["logits"]),
                                  np.array([p["logits"] for p in rest["predictions"]], np.float32))


def test_predict_version_and_output_filter(stub):
    request = predict_request(["good movie"], version=1)
    request.output_filter.append("label")
    response = stub.Predict(request, timeout=10)
    assert list(response.outputs) == ["label"]
    assert response.model_spec.version.value == 1
    assert tf.make_ndarray(response.outputs["label"]).tolist()[0] in (b"negative", b"positive")


def test_classify_equals_rest(server, stub):
    response = stub.Classify(classify_request(TEXTS), timeout=10)
    assert response.model_spec.signature_name == "classify" and response.model_spec.version.value == 1
    got = [[(c.label, c.score) for c in row.classes] for row in response.result.classifications]
    rest = requests.post(f"{server.url}/v1/models/{MODEL_NAME}:classify",
                         json={"signature_name": "classify", "examples": [{"text": t} for t in TEXTS]}, timeout=10)
    want = [[(label, score) for label, score in row] for row in rest.json()["results"]]
    assert [[c for c, _ in row] for row in got] == [[c for c, _ in row] for row in want]
    np.testing.assert_allclose([[s for _, s in row] for row in got], [[s for _, s in row] for row in want],
                               rtol=0, atol=1e-6)  # float32 on the wire vs JSON's shortest repr


def test_get_model_metadata_equals_rest(server, stub):
    request = get_model_metadata_pb2.GetModelMetadataRequest()
    request.model_spec.name = MODEL_NAME
    request.metadata_field.append("signature_def")
    response = stub.GetModelMetadata(request, timeout=10)
    assert response.model_spec.name == MODEL_NAME and response.model_spec.version.value == 1
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    default = signatures.signature_def["serving_default"]
    assert default.inputs["text"].dtype == tf.string.as_datatype_enum
    assert set(default.outputs) == {"probabilities", "logits", "label"}
    assert signatures.signature_def["classify"].method_name == "tensorflow/serving/classify"

    rest = requests.get(f"{server.url}/v1/models/{MODEL_NAME}/metadata", timeout=10).json()
    as_json = json_format.MessageToDict(signatures, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    assert as_json == rest["metadata"]["signature_def"]


def test_get_model_status(channel):
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = MODEL_NAME
    response = stub.GetModelStatus(request, timeout=10)
    (status,) = response.model_version_status
    assert status.version == 1
    assert status.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    assert (status.status.error_code, status.status.error_message) == (0, "")  # tensorflow.error.OK

    request.model_spec.version.value = 1
    assert stub.GetModelStatus(request, timeout=10).model_version_status[0].version == 1


# -- errors map to status codes ------------------------------------------------------------------

def _code(call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value.code(), info.value.details()


def _metadata_request(*fields: str, name: str = MODEL_NAME) -> get_model_metadata_pb2.GetModelMetadataRequest:
    request = get_model_metadata_pb2.GetModelMetadataRequest()
    request.model_spec.name = name
    request.metadata_field.extend(fields)
    return request


def _status_request(name: str, version: int | None = None) -> get_model_status_pb2.GetModelStatusRequest:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = name
    if version is not None:
        request.model_spec.version.value = version
    return request


def test_not_found(stub, channel):
    models = model_service_pb2_grpc.ModelServiceStub(channel)
    cases = [
        (stub.Predict, predict_request(["good"], name="nope"), "Servable not found for request: Latest(nope)"),
        (stub.Predict, predict_request(["good"], version=9), f"Specific({MODEL_NAME}, 9)"),
        (stub.Predict, predict_request(["good"], signature="nope"), 'signature name: "nope" not found'),
        (stub.GetModelMetadata, _metadata_request("signature_def", name="nope"), "Latest(nope)"),
        (models.GetModelStatus, _status_request("nope"), "Could not find any versions of model nope"),
        (models.GetModelStatus, _status_request(MODEL_NAME, 9), f"Could not find version 9 of model {MODEL_NAME}"),
    ]
    for call, request, message in cases:
        code, details = _code(call, request)
        assert code == grpc.StatusCode.NOT_FOUND, details
        assert message in details


def test_invalid_argument(stub):
    wrong_name = predict_request(["good"])
    wrong_name.inputs["review"].CopyFrom(wrong_name.inputs.pop("text"))
    floats = predict_request(["good"])
    floats.inputs["text"].CopyFrom(tf.make_tensor_proto([1.0, 2.0]))
    matrix = predict_request(["good"])
    matrix.inputs["text"].CopyFrom(tf.make_tensor_proto([["a", "b"]], dtype=tf.string))
    no_input = classification_pb2.ClassificationRequest()
    no_input.model_spec.name = MODEL_NAME
    cases = [
        (stub.Predict, predict_request([""]), "text is empty"),
        (stub.Predict, predict_request(np.array([], dtype=object)), "at least one input row"),
        (stub.Predict, wrong_name, "expects inputs ['text'], got ['review']"),
        (stub.Predict, floats, "expects string but float is provided"),
        (stub.Predict, matrix, "rank 1"),
        (stub.Predict, predict_request(["x" * 200_000]), "more than the limit"),
        (stub.Classify, no_input, "Input is empty"),
        (stub.Classify, classify_request(["  "]), "text is empty"),
        (stub.Regress, regression_pb2.RegressionRequest(model_spec=no_input.model_spec), "method_name"),
        (stub.GetModelMetadata, _metadata_request(), "at least one metadata_field"),
        (stub.GetModelMetadata, _metadata_request("signature_def", "graph"), "Metadata field graph is not supported"),
    ]
    for call, request, message in cases:
        code, details = _code(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert message in details, details


def test_message_over_limit_is_resource_exhausted(stub):
    code, details = _code(stub.Predict, predict_request(["y" * 99_000] * 50))  # ~5 MB > max_body_bytes (4 MiB)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details


def test_metrics_count_grpc_calls(server, stub):
    stub.Predict(predict_request(["good"]), timeout=10)
    text = requests.get(server.url + "/monitoring/prometheus/metrics", timeout=10).text
    assert 'serve_requests_total{code="OK",route="grpc_predict"}' in text
    assert 'serve_requests_total{code="NOT_FOUND",route="grpc_predict"}' in text


# -- deadline, overload and drain on a slow model ------------------------------------------------

def warm_up(stub) -> None:
    """Connect and make the first (slowest) model call; on a busy machine it may miss its deadline."""
    for _ in range(3):
        try:
            stub.Predict(predict_request(["warm up"]), timeout=20)
            return
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
    raise AssertionError("the slow server never answered in time")


def test_deadline_overload_and_drain(slow_model):
    """Every model call takes 2 s, requests time out after 3 s, and only 1 row may wait in the queue
    (batches of 1 row, so A and B are never merged).

    t=0.0 A runs alone (done at 2.0: OK, even though SIGTERM arrives at 0.7: drain waits for it);
    t=0.3 B waits for A, runs 2.0-4.0, past its deadline (3.3): DEADLINE_EXCEEDED;
    t=0.6 C finds B queued: RESOURCE_EXHAUSTED at once.
    """
    srv = _start(slow_model(2.0), "--request-timeout", "3", "--max-queued-rows", "1",
                 "--max-batch-size", "1", "--no-warmup", "--drain-timeout", "5")
    try:
        with grpc.insecure_channel(srv.grpc_target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            warm_up(stub)
            a = stub.Predict.future(predict_request(["first"]), timeout=10)
            srv.wait_in_flight(1)
            b = stub.Predict.future(predict_request(["second"]), timeout=10)
            srv.wait_in_flight(2)
            code, details = _code(stub.Predict, predict_request(["third"]))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in details, details
            time.sleep(0.1)
            srv.terminate()  # SIGTERM while A is in the model call
            assert a.result().outputs["label"].string_val[0] in (b"negative", b"positive")
            with pytest.raises(grpc.RpcError) as info:
                b.result()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "deadline exceeded" in info.value.details()
    finally:
        assert srv.stop() == 0, srv.log(full=True)
    assert "shut down cleanly" in srv.log(full=True)
    with grpc.insecure_channel(srv.grpc_target) as channel:  # the gRPC port is closed too
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        code, _ = _code(stub.Predict, predict_request(["after"]))
        assert code == grpc.StatusCode.UNAVAILABLE
