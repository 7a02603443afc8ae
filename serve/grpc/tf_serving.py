"""TF Serving's gRPC services on the gRPC port: `PredictionService` (Predict, Classify, Regress,
GetModelMetadata) and `ModelService` (GetModelStatus, HandleReloadConfigRequest), sharing the core
with the REST edge; `GrpcApi.methods` is the port's whole table, V2's `inference.GRPCInferenceService`
(`serve.grpc.v2`) included.

Clients use the stubs of `tensorflow-serving-api` unchanged. Handlers run on the same event loop,
core, batcher and model versions as the REST edge; they decode protos into plain values, the core
validates, and neutral errors become the gRPC status of the same name. The connection
(`serve.grpc.connection`) calls each method with the request's bytes and its call (the deadline)
and sends the bytes it returns, or the status of the `RpcError` it raises.

Requests are parsed here, so an undecodable message is an INVALID_ARGUMENT with a one-line log;
tensors are decoded without ever expanding a declared shape (`serve.grpc.tensors.from_tensor_proto`);
methods this server does not implement (and unknown ones) answer UNIMPLEMENTED (the connection does
that for every path missing from the table).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from google.protobuf.message import DecodeError
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_management_pb2,
    predict_pb2,
    regression_pb2,
)

from common.tf_serving import REGRESS_METHOD
from serve.config import ServeConfig
from serve.core import memory
from serve.core.dataplane import (
    CLASSIFY_FEATURES,
    ServingCore,
    check_declared_shape,
    check_rows,
)
from serve.core.errors import Code, InvalidArgument, ServingError
from serve.core.loaded_model import LoadedModel
from serve.core.model_config_file import ModelConfigError, sources_from_config
from serve.grpc import v2
from serve.grpc.calls import CallContext, Method, RpcError
from serve.grpc.tensors import fill_tensor_proto, from_tensor_proto

log = logging.getLogger(__name__)

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"

_ERROR_CODES = get_model_status_pb2.ModelVersionStatus.DESCRIPTOR.fields_by_name["status"].message_type \
    .fields_by_name["error_code"].enum_type.values_by_name
_STATES = get_model_status_pb2.ModelVersionStatus.State

Handler = Callable[[Any, CallContext], Awaitable[Any]]


class GrpcApi:
    """Handlers for TF Serving's two services and V2's, bound to one core."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self.core = core
        self.open_inference = v2.OpenInferenceGrpc(config, core)

    def _model(self, spec) -> LoadedModel:
        version = spec.version.value if spec.HasField("version") else None
        return self.core.model(spec.name, version, spec.version_label or None)

    @staticmethod
    def _timeout(context: CallContext) -> float | None:
        return context.time_remaining()

    # -- PredictionService -------------------------------------------------------------------------

    async def predict(self, request: predict_pb2.PredictRequest, context) -> predict_pb2.PredictResponse:
        spec = request.model_spec
        model = self._model(spec)
        signature_name = spec.signature_name or "serving_default"
        signature = model.signature(signature_name)
        wanted = list(request.output_filter) or list(signature.outputs)
        for name in wanted:
            if name not in signature.outputs:
                raise InvalidArgument(f"output tensor alias not found in signature: {name}")
        inputs = {}
        for name, proto in request.inputs.items():
            if proto.tensor_shape.unknown_rank:
                raise InvalidArgument(f"input {name!r}: the tensor shape must be known (unknown_rank is set)")
            check_declared_shape(signature, name, [d.size for d in proto.tensor_shape.dim], self.config)
            inputs[name] = from_tensor_proto(proto, f"input {name!r}")  # after the shape check: bounded
        outputs = await self.core.predict(model, signature_name, inputs, timeout_s=self._timeout(context))
        response = predict_pb2.PredictResponse()
        _fill_spec(response.model_spec, spec.name, model, signature_name)
        for name in wanted:
            fill_tensor_proto(response.outputs[name], outputs[name])
        return response

    async def classify(self, request: classification_pb2.ClassificationRequest, context):
        spec = request.model_spec
        model = self._model(spec)
        rows, shared = _examples(request.input, self.config.max_rows_per_request)
        signature, outputs = await self.core.classify(
            model, spec.signature_name, rows, shared, timeout_s=self._timeout(context))
        response = classification_pb2.ClassificationResponse()
        _fill_spec(response.model_spec, spec.name, model, signature.name)
        classes, scores = outputs.get("classes"), outputs.get("scores")
        rows = len(classes if classes is not None else scores)
        for i in range(rows):
            row = response.result.classifications.add()
            for j in range(len(scores[i]) if scores is not None else len(classes[i])):
                cls = row.classes.add()
                if classes is not None:
                    cls.label = classes[i][j].decode("utf-8", "replace")
                if scores is not None:
                    cls.score = float(scores[i][j])
        return response

    async def regress(self, request: regression_pb2.RegressionRequest, _context):
        model = self._model(request.model_spec)
        model.signature_for_method(REGRESS_METHOD, request.model_spec.signature_name)
        raise InvalidArgument("regression is not supported by this server")

    async def get_model_metadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest, _context):
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

    # -- ModelService ------------------------------------------------------------------------------

    async def get_model_status(self, request: get_model_status_pb2.GetModelStatusRequest, _context):
        spec = request.model_spec
        version = spec.version.value if spec.HasField("version") else None
        response = get_model_status_pb2.GetModelStatusResponse()
        for s in self.core.status(spec.name, version, spec.version_label or None):
            status = response.model_version_status.add()
            status.version = s.version
            status.state = _STATES.Value(s.state)
            status.status.error_code = _ERROR_CODES[s.error_code].number if s.error_code in _ERROR_CODES else 2
            status.status.error_message = s.error_message
        return response

    async def handle_reload_config(self, request: model_management_pb2.ReloadConfigRequest, _context):
        """Replace the served models with the request's ModelServerConfig, as a change of
        --model-config-file would (the same validation; new models load while the others serve),
        on every worker; only with --model-management, and only from under the model roots."""
        self.core.check_model_management()
        origin = "ReloadConfigRequest.config"
        try:
            sources = sources_from_config(request.config, origin)
        except ModelConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        await self.core.reload_models(sources, origin)
        log.info("gRPC ReloadConfig: serving %s", ", ".join(s.name for s in sources))
        return model_management_pb2.ReloadConfigResponse()  # status: error_code OK

    # -- plumbing ----------------------------------------------------------------------------------

    def methods(self) -> dict[str, Method]:
        """Every method of the three services by its HTTP/2 path, `/package.Service/Method`."""
        tables = {
            PREDICTION_SERVICE: {
                "Predict": ("predict", predict_pb2.PredictRequest, self.predict),
                "Classify": ("classify", classification_pb2.ClassificationRequest, self.classify),
                "Regress": ("regress", regression_pb2.RegressionRequest, self.regress),
                "GetModelMetadata": ("metadata", get_model_metadata_pb2.GetModelMetadataRequest,
                                     self.get_model_metadata),
            },
            MODEL_SERVICE: {
                "GetModelStatus": ("status", get_model_status_pb2.GetModelStatusRequest, self.get_model_status),
                "HandleReloadConfigRequest": ("reload_config", model_management_pb2.ReloadConfigRequest,
                                              self.handle_reload_config),
            },
            v2.SERVICE: self.open_inference.methods(),
        }
        return {f"/{service}/{method}": Method(self._unary(route, parse, handler))
                for service, table in tables.items() for method, (route, parse, handler) in table.items()}

    def _unary(self, route: str, message_class, handler: Handler):  # noqa: ANN001, ANN202
        """The method as the transport calls it: bytes in, bytes out, a ServingError (or a bug)
        turned into an RpcError of the same code; counted in the metrics either way. With
        --auth-token-file the call's token is checked before its message is even decoded."""
        metrics = self.core.metrics
        label = f"grpc_{route}"
        scope = SCOPES.get(route, "api")
        auth = self.core.auth if self.core.auth.enabled and scope != "open" else None

        async def call(raw: bytes, context: CallContext) -> bytes:
            start = time.perf_counter()
            metrics.in_flight += 1
            code, message = Code.OK, ""
            try:
                if auth is not None:
                    auth.check(context.authorization, scope)
                try:
                    request = message_class.FromString(raw)
                except DecodeError:
                    log.info("gRPC %s: undecodable request (%d bytes)", route, len(raw))
                    raise InvalidArgument(f"request is not a valid {message_class.DESCRIPTOR.full_name}") from None
                response = await handler(request, context)
                return response.SerializeToString()
            except ServingError as exc:
                code, message = exc.code, exc.message
            except asyncio.CancelledError:
                code = Code.CANCELLED  # the client went away (or the drain ran out): nothing to answer
                raise
            except Exception:  # noqa: BLE001 - a bug: log it, never send a traceback
                log.exception("unhandled error in gRPC %s", route)
                code, message = Code.INTERNAL, "internal error"
            finally:
                metrics.in_flight -= 1
                metrics.observe_request(label, code.name, time.perf_counter() - start)
                memory.after_request(len(raw))
            raise RpcError(code, message)

        return call


SCOPES = {"v2_live": "open", "v2_ready": "open", "v2_model_ready": "open", "reload_config": "admin"}
"""Who may call a method with --auth-token-file (by its metrics route): `open` probes, `admin`
model management, and every other method `api`. grpc.health.v1.Health is always open."""


def _fill_spec(out, name: str, model: LoadedModel, signature_name: str) -> None:
    out.name = name
    out.version.value = model.version
    out.signature_name = signature_name


def _model_features(features) -> dict:  # noqa: ANN001 - a tf.train.Features
    """The features the model reads, by reference: nothing else in an Example is looked at."""
    feature_map = features.feature
    return {key: feature_map[key] for key in CLASSIFY_FEATURES if key in feature_map}


def _examples(inp, max_rows: int) -> tuple[list[dict], dict]:  # noqa: ANN001 - a tensorflow.serving.Input
    """Input of a ClassificationRequest -> (the model's features of each row, of the context);
    the core merges the context in. The row count is checked before any row is looked at."""
    kind = inp.WhichOneof("kind")
    if kind == "example_list":
        examples, context = inp.example_list.examples, {}
    elif kind == "example_list_with_context":
        examples = inp.example_list_with_context.examples
        context = _model_features(inp.example_list_with_context.context.features)
    else:
        raise InvalidArgument("Input is empty: set input.example_list or input.example_list_with_context")
    check_rows(len(examples), max_rows)
    return [_model_features(example.features) for example in examples], context


__all__ = ["GrpcApi", "MODEL_SERVICE", "PREDICTION_SERVICE"]
