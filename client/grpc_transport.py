"""gRPC transport: TF Serving's PredictionService/ModelService through `tensorflow-serving-api`.

Imported only when a client is created with `transport="grpc"`: the stubs need TensorFlow's
protos (and so TensorFlow itself), which the REST transport avoids.
"""

from __future__ import annotations

from typing import Any, Sequence

import grpc
import tensorflow as tf
from google.protobuf import json_format
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from client.results import ModelVersionStatus, RawPrediction
from client.exceptions import ClientError, DeadlineExceeded, InvalidInput, ModelNotFound, ServerUnavailable

_MAX_MESSAGE = 64 * 1024 * 1024
_STATES = get_model_status_pb2.ModelVersionStatus.State


class GrpcTransport:
    def __init__(self, target: str, model: str, version: int | None, version_label: str | None) -> None:
        for scheme in ("grpc://", "http://", "https://"):
            if target.startswith(scheme):
                target = target[len(scheme):]
        self.target = target.rstrip("/")
        self.model = model
        self.version = version
        self.version_label = version_label
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
        ])
        self._predict = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)
        self._models = model_service_pb2_grpc.ModelServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _spec(self, spec, signature_name: str | None = None) -> None:
        spec.name = self.model
        if self.version is not None:
            spec.version.value = self.version
        elif self.version_label is not None:
            spec.version_label = self.version_label
        if signature_name:
            spec.signature_name = signature_name

    def predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> list[RawPrediction]:
        request = predict_pb2.PredictRequest()
        self._spec(request.model_spec, signature_name)
        request.inputs["text"].CopyFrom(tf.make_tensor_proto([t.encode("utf-8") for t in texts], dtype=tf.string))
        response = self._call(self._predict.Predict, request, timeout)
        outputs = response.outputs
        name = "probabilities" if "probabilities" in outputs else "scores" if "scores" in outputs else None
        if name is None:
            raise ClientError(f"unexpected predict response: outputs {sorted(outputs)}, no 'probabilities'")
        probabilities = tf.make_ndarray(outputs[name]).tolist()
        labels: list[str | None] = [None] * len(probabilities)
        if "label" in outputs:
            labels = [v.decode("utf-8", "replace") for v in tf.make_ndarray(outputs["label"]).ravel()]
        return list(zip(labels, probabilities))

    def status(self, timeout: float) -> list[ModelVersionStatus]:
        request = get_model_status_pb2.GetModelStatusRequest()
        self._spec(request.model_spec)
        response = self._call(self._models.GetModelStatus, request, timeout)
        return [
            ModelVersionStatus(
                version=s.version, state=_STATES.Name(s.state),
                error_code=s.status.DESCRIPTOR.fields_by_name["error_code"].enum_type.values_by_number[
                    s.status.error_code].name,
                error_message=s.status.error_message,
            )
            for s in response.model_version_status
        ]

    def metadata(self, timeout: float) -> dict[str, Any]:
        request = get_model_metadata_pb2.GetModelMetadataRequest()
        self._spec(request.model_spec)
        request.metadata_field.append("signature_def")
        response = self._call(self._predict.GetModelMetadata, request, timeout)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        response.metadata["signature_def"].Unpack(signatures)
        spec = response.model_spec
        return {
            "model_spec": {"name": spec.name, "signature_name": spec.signature_name, "version": str(spec.version.value)},
            "metadata": {"signature_def": json_format.MessageToDict(
                signatures, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)},
        }

    def _call(self, method, request, timeout: float):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise _grpc_error(exc, self.target) from None


def _grpc_error(exc: grpc.RpcError, target: str) -> ClientError:
    code: grpc.StatusCode = exc.code()
    message = exc.details() or code.name
    status = code.name
    if code == grpc.StatusCode.NOT_FOUND:
        return ModelNotFound(message, status)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
        return InvalidInput(message, status)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than" in message:  # gRPC's message size limit: retrying cannot help
            return InvalidInput(message, status)
        return ServerUnavailable(message, status)
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServerUnavailable(f"cannot use {target}: {message}", status)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message, status)
    return ClientError(message, status)
