"""gRPC transports: TF Serving's PredictionService/ModelService (`GrpcTransport`) and the Open
Inference Protocol's GRPCInferenceService (`V2GrpcTransport`).

Both use the messages generated into `client.protos` from the protocols' .proto files, so they
need grpcio and protobuf only (`pip install "sentiment-client[grpc]"`), never TensorFlow.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import grpc
from google.protobuf import json_format

from client.exceptions import (ClientError, DeadlineExceeded, InvalidInput, ModelNotFound, NotAuthorized,
                               ServerUnavailable, TlsError)
from client.protos import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    grpc_predict_v2_pb2,
    grpc_predict_v2_pb2_grpc,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    status_pb2,
    types_pb2,
)
from client.results import EXPLAIN_SIGNATURE, ModelVersionStatus, RawExplanation, RawPrediction
from client.security import NO_SECURITY, Security

_MAX_MESSAGE = 64 * 1024 * 1024
_STATES = get_model_status_pb2.ModelVersionStatus.State
_ERROR_CODES = status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type
_FLOAT_FIELDS = {types_pb2.DT_FLOAT: ("float_val", "<f"), types_pb2.DT_DOUBLE: ("double_val", "<d")}


class _Endpoint:
    """One gRPC server as a transport talks to it: its channel (TLS for `https://` or `grpcs://`
    targets, or with a CA bundle or client certificate) and the metadata every call carries."""

    def __init__(self, target: str, security: Security) -> None:
        tls = target.startswith(("https://", "grpcs://")) or security.tls_files_given
        for scheme in ("grpcs://", "grpc://", "http://", "https://"):
            if target.startswith(scheme):
                target = target[len(scheme):]
        self.target = target.rstrip("/")
        self.security = security
        self.tls = tls
        options = [("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE)]
        if tls:
            credentials = grpc.ssl_channel_credentials(security.read("ca_file"), security.read("key_file"),
                                                       security.read("cert_file"))
            self.channel = grpc.secure_channel(self.target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(self.target, options=options)
        self.metadata = (("authorization", security.authorization),) if security.authorization else None

    def call(self, method, request, timeout: float):  # noqa: ANN001, ANN201
        try:
            return method(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _grpc_error(exc, self) from None


class GrpcTransport:
    """TF Serving's gRPC API: works against `python -m serve --grpc-port` and `tensorflow_model_server`."""

    def __init__(self, target: str, model: str, version: int | None, version_label: str | None,
                 security: Security = NO_SECURITY) -> None:
        self._endpoint = _Endpoint(target, security)
        self.target, self._channel = self._endpoint.target, self._endpoint.channel
        self.model = model
        self.version = version
        self.version_label = version_label
        self._predict = prediction_service_pb2_grpc.PredictionServiceStub(self._channel)
        self._models = model_service_pb2_grpc.ModelServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call_predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> Any:
        request = predict_pb2.PredictRequest()
        self._spec(request.model_spec, signature_name)
        text = request.inputs["text"]
        text.dtype = types_pb2.DT_STRING
        text.tensor_shape.dim.add().size = len(texts)
        text.string_val.extend(t.encode("utf-8") for t in texts)
        return self._endpoint.call(self._predict.Predict, request, timeout).outputs

    def _spec(self, spec, signature_name: str | None = None) -> None:  # noqa: ANN001 - a ModelSpec
        spec.name = self.model
        if self.version is not None:
            spec.version.value = self.version
        elif self.version_label is not None:
            spec.version_label = self.version_label
        if signature_name:
            spec.signature_name = signature_name

    def predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> list[RawPrediction]:
        outputs = self._call_predict(texts, signature_name, timeout)
        name = "probabilities" if "probabilities" in outputs else "scores" if "scores" in outputs else None
        if name is None:
            raise ClientError(f"unexpected predict response: outputs {sorted(outputs)}, no 'probabilities'")
        probabilities = _rows(outputs[name], len(texts))
        labels: list[str | None] = [None] * len(probabilities)
        if "label" in outputs:
            labels = [v.decode("utf-8", "replace") for v in outputs["label"].string_val]
        return list(zip(labels, probabilities))

    def explain(self, texts: Sequence[str], timeout: float) -> list[RawExplanation]:
        """Predict with the model's `explain` signature (what a stock tensorflow_model_server serves too)."""
        outputs = self._call_predict(texts, EXPLAIN_SIGNATURE, timeout)
        missing = {"label", "probabilities", "ngrams", "contributions", "bias"} - set(outputs)
        if missing:
            raise ClientError(f"unexpected explain response: no {', '.join(sorted(missing))} output")
        count = len(texts)
        probabilities = _rows(outputs["probabilities"], count)
        contributions = _rows(outputs["contributions"], count)
        width = len(contributions[0]) if contributions else 0
        ngrams = [v.decode("utf-8", "replace") for v in outputs["ngrams"].string_val]
        bias = _rows(outputs["bias"], count, flat=True)
        labels = [v.decode("utf-8", "replace") for v in outputs["label"].string_val]
        if len(ngrams) != count * width or len(labels) != count:
            raise ClientError(f"unexpected explain response: {len(ngrams)} n-grams, {len(labels)} labels "
                              f"for {count} texts")
        return [(labels[i], probabilities[i],
                 [(g, c) for g, c in zip(ngrams[i * width:(i + 1) * width], contributions[i]) if g], bias[i][0])
                for i in range(count)]

    def status(self, timeout: float) -> list[ModelVersionStatus]:
        request = get_model_status_pb2.GetModelStatusRequest()
        self._spec(request.model_spec)
        response = self._endpoint.call(self._models.GetModelStatus, request, timeout)
        return [
            ModelVersionStatus(
                version=s.version, state=_STATES.Name(s.state),
                error_code=_ERROR_CODES.values_by_number[s.status.error_code].name
                if s.status.error_code in _ERROR_CODES.values_by_number else str(s.status.error_code),
                error_message=s.status.error_message,
            )
            for s in response.model_version_status
        ]

    def metadata(self, timeout: float) -> dict[str, Any]:
        request = get_model_metadata_pb2.GetModelMetadataRequest()
        self._spec(request.model_spec)
        request.metadata_field.append("signature_def")
        response = self._endpoint.call(self._predict.GetModelMetadata, request, timeout)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        if not response.metadata["signature_def"].Unpack(signatures):
            raise ClientError(f"unexpected metadata: {response.metadata['signature_def'].type_url}")
        spec = response.model_spec
        return {
            "model_spec": {"name": spec.name, "signature_name": spec.signature_name, "version": str(spec.version.value)},
            "metadata": {"signature_def": json_format.MessageToDict(
                signatures, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)},
        }


def _rows(tensor, count: int, flat: bool = False) -> list[list[float]]:  # noqa: ANN001 - a TensorProto
    """A [count, classes] float tensor (or a [count] one, `flat`) as rows of Python floats (values
    in tensor_content or in float_val/double_val, as servers choose)."""
    field, fmt = _FLOAT_FIELDS.get(tensor.dtype, (None, None))
    if field is None:
        raise ClientError(f"unexpected probabilities dtype {types_pb2.DataType.Name(tensor.dtype)}")
    if tensor.tensor_content:
        values = [v for (v,) in struct.iter_unpack(fmt, tensor.tensor_content)]
    else:
        values = list(getattr(tensor, field))
    shape = [d.size for d in tensor.tensor_shape.dim]
    return _split_rows(values, shape + [1] if flat and len(shape) == 1 else shape, count)


def _split_rows(values: list[float], shape: list[int], count: int) -> list[list[float]]:
    """Flat [count, classes] values (either protocol) as one list per text."""
    if len(shape) != 2 or shape[0] != count or len(values) != shape[0] * shape[1]:
        raise ClientError(f"unexpected probabilities shape {shape} ({len(values)} values) for {count} texts")
    return [values[i * shape[1]:(i + 1) * shape[1]] for i in range(count)]


class V2GrpcTransport:
    """The Open Inference Protocol (KServe V2) over gRPC: `python -m serve --grpc-port`, Triton,
    KServe and MLServer answer it. V2 has one function per model (this server runs
    `serving_default`), no version labels, and no per-version status: `status` lists the versions
    the server says are being served, as AVAILABLE."""

    def __init__(self, target: str, model: str, version: int | None, version_label: str | None,
                 security: Security = NO_SECURITY) -> None:
        if version_label is not None:
            raise ValueError("the V2 protocol has no version labels: pass version=N")
        self._endpoint = _Endpoint(target, security)
        self.target, self._channel = self._endpoint.target, self._endpoint.channel
        self.model = model
        self.version = "" if version is None else str(version)
        self._stub = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def predict(self, texts: Sequence[str], signature_name: str, timeout: float) -> list[RawPrediction]:
        if signature_name != "serving_default":
            raise InvalidInput(f"signature {signature_name!r}: the V2 protocol runs the model's default function only")
        request = grpc_predict_v2_pb2.ModelInferRequest(model_name=self.model, model_version=self.version)
        request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
        request.raw_input_contents.append(b"".join(
            struct.pack("<I", len(b)) + b for b in (t.encode("utf-8") for t in texts)))
        response = self._endpoint.call(self._stub.ModelInfer, request, timeout)
        outputs = {tensor.name: (tensor, i) for i, tensor in enumerate(response.outputs)}
        if "probabilities" not in outputs:
            raise ClientError(f"unexpected infer response: outputs {sorted(outputs)}, no 'probabilities'")
        probabilities = _v2_rows(response, *outputs["probabilities"], len(texts))
        labels: list[str | None] = [None] * len(texts)
        if "label" in outputs:
            labels = [v.decode("utf-8", "replace") for v in _v2_bytes(response, *outputs["label"])]
        return list(zip(labels, probabilities))

    def explain(self, texts: Sequence[str], timeout: float) -> list[RawExplanation]:
        raise InvalidInput("explanations are not part of the Open Inference Protocol: use the rest or grpc transport")

    def status(self, timeout: float) -> list[ModelVersionStatus]:
        if self.version:
            request = grpc_predict_v2_pb2.ModelReadyRequest(name=self.model, version=self.version)
            ready = self._endpoint.call(self._stub.ModelReady, request, timeout).ready
            return [ModelVersionStatus(int(self.version), "AVAILABLE" if ready else "LOADING")]
        metadata = self._metadata(timeout)
        return [ModelVersionStatus(int(v), "AVAILABLE") for v in metadata.versions if v.isdigit()]

    def metadata(self, timeout: float) -> dict[str, Any]:
        """V2's model metadata: {name, versions, platform, inputs, outputs}."""
        return json_format.MessageToDict(self._metadata(timeout), preserving_proto_field_name=True)

    def _metadata(self, timeout: float) -> grpc_predict_v2_pb2.ModelMetadataResponse:
        request = grpc_predict_v2_pb2.ModelMetadataRequest(name=self.model, version=self.version)
        return self._endpoint.call(self._stub.ModelMetadata, request, timeout)


def _v2_values(response, tensor, index: int, raw_format: str, contents_field: str) -> list:  # noqa: ANN001
    if response.raw_output_contents:
        return [v for (v,) in struct.iter_unpack(raw_format, response.raw_output_contents[index])]
    return list(getattr(tensor.contents, contents_field))


def _v2_rows(response, tensor, index: int, count: int) -> list[list[float]]:  # noqa: ANN001
    formats = {"FP32": ("<f", "fp32_contents"), "FP64": ("<d", "fp64_contents")}
    if tensor.datatype not in formats:
        raise ClientError(f"unexpected probabilities datatype {tensor.datatype}")
    return _split_rows(_v2_values(response, tensor, index, *formats[tensor.datatype]), list(tensor.shape), count)


def _v2_bytes(response, tensor, index: int) -> list[bytes]:  # noqa: ANN001
    if not response.raw_output_contents:
        return list(tensor.contents.bytes_contents)
    raw, at, out = response.raw_output_contents[index], 0, []
    while at + 4 <= len(raw):
        (length,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4:at + 4 + length])
        at += 4 + length
    return out


def _grpc_error(exc: grpc.RpcError, endpoint: _Endpoint) -> ClientError:
    code: grpc.StatusCode = exc.code()
    message = exc.details() or code.name
    status = code.name
    target = endpoint.target
    if code == grpc.StatusCode.UNAVAILABLE and ("handshake" in message.lower() or "SSL" in message):
        return _tls_error(message, status, endpoint)
    if code == grpc.StatusCode.NOT_FOUND:
        return ModelNotFound(message, status)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return NotAuthorized(message, status)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION):
        return InvalidInput(message, status)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than" in message:  # gRPC's message size limit: retrying cannot help
            return InvalidInput(message, status)
        return ServerUnavailable(message, status)
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = ""
        if endpoint.security.cert_file and ("reset by peer" in message or "Socket closed" in message):  # TLS 1.3
            hint = " (if it asks for client certificates, it may not trust cert_file, CLI --cert)"
        return ServerUnavailable(f"cannot use {target}: {message}{hint}", status)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message, status)
    return ClientError(message, status)


def _tls_error(message: str, status: str, endpoint: _Endpoint) -> ClientError:
    """What to change after a failed handshake (grpc's message names little: say what it means)."""
    ca = endpoint.security.ca_file
    if "CERTIFICATE_VERIFY_FAILED" in message:
        trusted = f"the CA bundle {ca}" if ca else "the system's CA certificates"
        return TlsError(f"the certificate of {endpoint.target} does not verify against {trusted}: pass the CA that "
                        "signed it (ca_file=, CLI --ca-file), or use the host name it was issued for", status)
    if "WRONG_VERSION_NUMBER" in message:
        return TlsError(f"{endpoint.target} does not speak TLS: use a plain host:port target without "
                        "ca_file or a client certificate", status)
    return TlsError(f"TLS with {endpoint.target} failed: {message}", status)
