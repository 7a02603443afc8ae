"""gRPC frontend: TF Serving's `PredictionService` and `ModelService` on the shared ServingCore.

Clients use the stubs of `tensorflow-serving-api` unchanged (`PredictionServiceStub.Predict`,
`Classify`, `GetModelMetadata`; `ModelServiceStub.GetModelStatus`). Handlers only translate
protos <-> numpy arrays and call the same `ServingCore` as the REST app, so both frontends serve
the same model versions through the same batcher. Errors are `ServingError`s, aborted with their
`grpc_code` (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE).

    server = GrpcServer(config, core).start()   # listens on config.grpc_port
    ...
    server.stop(grace_s).wait()                 # new RPCs refused, running ones finish
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from typing import Callable, TypeVar

import grpc
import numpy as np
import tensorflow as tf
from tensorflow.core.example import example_pb2
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
    status_pb2,
)

from serve.config import ServeConfig
from serve.core import ServingCore
from serve.errors import InvalidArgument, NotFound, ServingError
from serve.models import CLASSIFY_METHOD, REGRESS_METHOD, LoadedModel
from serve.protocol import check_text

log = logging.getLogger(__name__)

T = TypeVar("T")

_ERROR_CODES = status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type.values_by_name
_STATES = get_model_status_pb2.ModelVersionStatus.State


class _Frontend:
    """Shared plumbing: resolve the model of a ModelSpec, run a handler, map errors to codes."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self.core = core

    def _model(self, spec) -> LoadedModel:
        version = spec.version.value if spec.HasField("version") else None
        return self.core.model(spec.name, version, spec.version_label or None)

    def _call(self, route: str, context: grpc.ServicerContext, handler: Callable[[], T], runs_model: bool) -> T:
        metrics = self.core.metrics
        metrics.in_flight.inc()
        if runs_model:
            self.core.request_started()  # lets the batcher wait for this request
        start = time.perf_counter()
        code, message = grpc.StatusCode.OK, ""
        try:
            return handler()
        except ServingError as exc:
            code, message = exc.grpc_code, exc.message
        except Exception as exc:  # noqa: BLE001 - never leak a traceback to the client
            log.exception("unhandled error in gRPC %s", route)
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"
        finally:
            if runs_model:
                self.core.request_finished()
            metrics.in_flight.dec()
            metrics.requests.labels(f"grpc_{route}", code.name).inc()
            metrics.latency.labels(f"grpc_{route}").observe(time.perf_counter() - start)
        context.abort(code, message)  # raises


def _fill_spec(out, name: str, model: LoadedModel, signature_name: str) -> None:
    out.name = name
    out.version.value = model.version
    out.signature_name = signature_name


def _check_rows(rows: int, config: ServeConfig) -> None:
    if rows == 0:
        raise InvalidArgument("no instances: at least one input row is required")
    if rows > config.max_rows_per_request:
        raise InvalidArgument(f"{rows} instances in one request, more than the limit of {config.max_rows_per_request}")


def _input_array(name: str, proto, expected_dtype: str, config: ServeConfig) -> np.ndarray:
    """One TensorProto of a PredictRequest -> numpy, checked against the signature's input."""
    got = types_pb2.DataType.Name(proto.dtype)
    if got != expected_dtype:
        raise InvalidArgument(
            f"input {name!r}: expects {expected_dtype.removeprefix('DT_').lower()} "
            f"but {got.removeprefix('DT_').lower()} is provided"
        )
    try:
        array = tf.make_ndarray(proto)
    except Exception as exc:  # noqa: BLE001 - malformed TensorProto
        raise InvalidArgument(f"input {name!r}: malformed tensor: {exc}") from None
    if array.ndim == 0:
        raise InvalidArgument(f"input {name!r}: expected a batch (rank >= 1), got a scalar")
    _check_rows(len(array), config)
    if expected_dtype == "DT_STRING":
        if array.ndim != 1:
            raise InvalidArgument(f"input {name!r}: string inputs must have rank 1, got shape {list(array.shape)}")
        for i, value in enumerate(array):
            where = f"inputs[{name!r}][{i}]"
            if name == "text":
                check_text(value, where, config)
            elif len(value) > config.max_text_bytes:
                raise InvalidArgument(f"{where}: value is {len(value)} bytes, more than {config.max_text_bytes}")
    return array


class PredictionServicer(_Frontend, prediction_service_pb2_grpc.PredictionServiceServicer):
    """`tensorflow.serving.PredictionService`: Predict, Classify, Regress, GetModelMetadata."""

    def Predict(self, request: predict_pb2.PredictRequest, context) -> predict_pb2.PredictResponse:
        def handle() -> predict_pb2.PredictResponse:
            spec = request.model_spec
            model = self._model(spec)
            signature_name = spec.signature_name or "serving_default"
            signature = model.signature(signature_name)
            if set(request.inputs) != set(signature.inputs):
                raise InvalidArgument(
                    f"signature {signature_name!r} expects inputs {sorted(signature.inputs)}, "
                    f"got {sorted(request.inputs)}"
                )
            wanted = list(request.output_filter) or list(signature.outputs)
            for name in wanted:
                if name not in signature.outputs:
                    raise InvalidArgument(f"output tensor alias not found in signature: {name}")
            inputs = {
                name: _input_array(name, proto, signature.inputs[name].dtype, self.config)
                for name, proto in request.inputs.items()
            }
            outputs = self.core.run(model, signature_name, inputs)
            response = predict_pb2.PredictResponse()
            _fill_spec(response.model_spec, spec.name, model, signature_name)
            for name in wanted:
                response.outputs[name].CopyFrom(tf.make_tensor_proto(outputs[name]))
            return response

        return self._call("predict", context, handle, runs_model=True)

    def Classify(self, request: classification_pb2.ClassificationRequest, context):
        def handle() -> classification_pb2.ClassificationResponse:
            spec = request.model_spec
            model = self._model(spec)
            signature = model.signature_for_method(CLASSIFY_METHOD, spec.signature_name)
            examples = _examples(request.input, self.config)
            (input_name,) = signature.inputs
            outputs = self.core.run(model, signature.name, {input_name: examples})
            response = classification_pb2.ClassificationResponse()
            _fill_spec(response.model_spec, spec.name, model, signature.name)
            classes, scores = outputs.get("classes"), outputs.get("scores")
            rows = len(classes if classes is not None else scores)
            for i in range(rows):
                row = response.result.classifications.add()
                n = len(scores[i]) if scores is not None else len(classes[i])
                for j in range(n):
                    cls = row.classes.add()
                    if classes is not None:
                        cls.label = classes[i][j].decode("utf-8", "replace")
                    if scores is not None:
                        cls.score = float(scores[i][j])
            return response

        return self._call("classify", context, handle, runs_model=True)

    def Regress(self, request: regression_pb2.RegressionRequest, context):
        def handle() -> regression_pb2.RegressionResponse:
            model = self._model(request.model_spec)
            model.signature_for_method(REGRESS_METHOD, request.model_spec.signature_name)
            raise InvalidArgument("regression is not supported by this server")

        return self._call("regress", context, handle, runs_model=False)

    def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest, context):
        def handle() -> get_model_metadata_pb2.GetModelMetadataResponse:
            spec = request.model_spec
            model = self._model(spec)
            if not request.metadata_field:
                raise InvalidArgument("GetModelMetadataRequest must specify at least one metadata_field")
            for field in request.metadata_field:
                if field != "signature_def":
                    raise InvalidArgument(f"Metadata field {field} is not supported")
            signature_map = get_model_metadata_pb2.SignatureDefMap()
            for name, sig in model.signature_defs.items():
                signature_map.signature_def[name].CopyFrom(sig)
            response = get_model_metadata_pb2.GetModelMetadataResponse()
            _fill_spec(response.model_spec, spec.name, model, "")
            response.metadata["signature_def"].Pack(signature_map)
            return response

        return self._call("metadata", context, handle, runs_model=False)


def _examples(inp, config: ServeConfig) -> np.ndarray:
    """Input of a ClassificationRequest -> serialized tf.Example per row (context merged in)."""
    kind = inp.WhichOneof("kind")
    if kind == "example_list":
        examples, context = list(inp.example_list.examples), None
    elif kind == "example_list_with_context":
        examples, context = list(inp.example_list_with_context.examples), inp.example_list_with_context.context
    else:
        raise InvalidArgument("Input is empty: set input.example_list or input.example_list_with_context")
    _check_rows(len(examples), config)
    serialized = np.empty(len(examples), dtype=object)
    for i, example in enumerate(examples):
        if context is not None:
            merged = example_pb2.Example()
            merged.CopyFrom(context)
            for key, feature in example.features.feature.items():
                merged.features.feature[key].CopyFrom(feature)
            example = merged
        text = example.features.feature.get("text")
        if text is not None:
            for value in text.bytes_list.value:
                check_text(value, f"examples[{i}].text", config)
        serialized[i] = example.SerializeToString()
    return serialized


class ModelServicer(_Frontend, model_service_pb2_grpc.ModelServiceServicer):
    """`tensorflow.serving.ModelService`: GetModelStatus (config reload is not supported)."""

    def GetModelStatus(self, request: get_model_status_pb2.GetModelStatusRequest, context):
        def handle() -> get_model_status_pb2.GetModelStatusResponse:
            spec = request.model_spec
            if spec.name != self.config.model_name:
                raise NotFound(f"Could not find any versions of model {spec.name}")
            registry = self.core.registry
            if spec.version_label:
                version = registry.label_version(spec.version_label)
            else:
                version = spec.version.value if spec.HasField("version") else None
            response = get_model_status_pb2.GetModelStatusResponse()
            for s in registry.status(version):
                status = response.model_version_status.add()
                status.version = s.version
                status.state = _STATES.Value(s.state)
                status.status.error_code = _ERROR_CODES[s.error_code].number if s.error_code in _ERROR_CODES else 2
                status.status.error_message = s.error_message
            return response

        return self._call("status", context, handle, runs_model=False)


class GrpcServer:
    """A `grpc.server` with a thread pool serving both services on `config.grpc_port`."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="grpc"),
            options=[
                ("grpc.max_receive_message_length", config.max_body_bytes),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
            ],
        )
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionServicer(config, core), self._server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(config, core), self._server)
        host = f"[{config.host}]" if ":" in config.host else config.host
        address = f"{host}:{config.grpc_port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-port {config.grpc_port}: cannot listen on {address}: {exc}") from None
        if not self.port:
            raise OSError(f"--grpc-port {config.grpc_port}: cannot listen on {address}")

    def start(self) -> "GrpcServer":
        self._server.start()
        log.info("serving model %r on grpc://%s:%d (PredictionService, ModelService)",
                 self.config.model_name, self.config.host, self.port)
        return self

    def stop(self, grace_s: float) -> threading.Event:
        """Refuse new RPCs now; RPCs still running after `grace_s` are cancelled. Returns an
        event set when the server has stopped."""
        return self._server.stop(grace_s)
