"""The gRPC edge: TF Serving's `PredictionService` and `ModelService` on grpc.aio, sharing the core.

Clients use the stubs of `tensorflow-serving-api` unchanged (`PredictionServiceStub.Predict`,
`Classify`, `GetModelMetadata`; `ModelServiceStub.GetModelStatus`). Handlers run on the same
event loop, core, batcher and model versions as the REST edge; they decode protos into plain
values, the core validates, and neutral errors become the `grpc.StatusCode` of the same name.

Requests arrive as raw bytes and are parsed here, so an undecodable message is an
INVALID_ARGUMENT with a one-line log instead of grpc's traceback; tensors are decoded without
ever expanding a declared shape (`serve.tensors.from_tensor_proto`); methods this server does
not implement (and unknown ones) answer UNIMPLEMENTED with a one-line log.

    server = await GrpcServer(config, core).start()   # listens on config.grpc_port
    ...
    await server.stop(grace_s)                        # new RPCs refused, running ones finish
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    predict_pb2,
    regression_pb2,
)

from serve.config import ServeConfig
from serve.core import ServingCore, check_rows
from serve.errors import InvalidArgument, ServingError
from serve.models import REGRESS_METHOD, LoadedModel
from serve.tensors import from_tensor_proto, to_tensor_proto

log = logging.getLogger(__name__)

PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"
HEALTH_SERVICES = ("", PREDICTION_SERVICE, MODEL_SERVICE)
"""Names the Health service answers for ("" is the whole server, what Kubernetes asks by default)."""
HEALTH_POLL_S = 0.25

_ERROR_CODES = get_model_status_pb2.ModelVersionStatus.DESCRIPTOR.fields_by_name["status"].message_type \
    .fields_by_name["error_code"].enum_type.values_by_name
_STATES = get_model_status_pb2.ModelVersionStatus.State

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class GrpcApi:
    """Handlers for TF Serving's two services, bound to one core."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self.core = core
        self.in_flight = 0

    def _model(self, spec) -> LoadedModel:
        version = spec.version.value if spec.HasField("version") else None
        return self.core.model(spec.name, version, spec.version_label or None)

    @staticmethod
    def _timeout(context: grpc.aio.ServicerContext) -> float | None:
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
            dims = proto.tensor_shape.dim
            if dims:
                check_rows(dims[0].size, self.config)  # before anything is decoded
            inputs[name] = from_tensor_proto(proto, f"input {name!r}", self.config.max_rows_per_request * 1024)
        outputs = await self.core.predict(model, signature_name, inputs, timeout_s=self._timeout(context))
        response = predict_pb2.PredictResponse()
        _fill_spec(response.model_spec, spec.name, model, signature_name)
        for name in wanted:
            response.outputs[name].CopyFrom(to_tensor_proto(outputs[name]))
        return response

    async def classify(self, request: classification_pb2.ClassificationRequest, context):
        spec = request.model_spec
        model = self._model(spec)
        signature, outputs = await self.core.classify(
            model, spec.signature_name, _examples(request.input), timeout_s=self._timeout(context))
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

    # -- plumbing ----------------------------------------------------------------------------------

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        methods = {
            PREDICTION_SERVICE: {
                "Predict": ("predict", predict_pb2.PredictRequest, self.predict),
                "Classify": ("classify", classification_pb2.ClassificationRequest, self.classify),
                "Regress": ("regress", regression_pb2.RegressionRequest, self.regress),
                "GetModelMetadata": ("metadata", get_model_metadata_pb2.GetModelMetadataRequest,
                                     self.get_model_metadata),
            },
            MODEL_SERVICE: {
                "GetModelStatus": ("status", get_model_status_pb2.GetModelStatusRequest, self.get_model_status),
            },
        }
        out = [
            grpc.method_handlers_generic_handler(service, {
                method: grpc.unary_unary_rpc_method_handler(self._unary(route, parse, handler))
                for method, (route, parse, handler) in table.items()
            })
            for service, table in methods.items()
        ]
        out.append(_Unimplemented())  # last: anything not served above
        return out

    def _unary(self, route: str, message_class, handler: Handler):
        metrics = self.core.metrics
        label = f"grpc_{route}"

        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            start = time.perf_counter()
            self.in_flight += 1
            metrics.in_flight += 1
            code, message = grpc.StatusCode.OK, ""
            try:
                try:
                    request = message_class.FromString(raw)
                except DecodeError:
                    log.info("gRPC %s: undecodable request (%d bytes)", route, len(raw))
                    raise InvalidArgument(f"request is not a valid {message_class.DESCRIPTOR.full_name}") from None
                response = await handler(request, context)
                return response.SerializeToString()
            except ServingError as exc:
                code, message = grpc.StatusCode[exc.code.name], exc.message
            except Exception:  # noqa: BLE001 - a bug: log it, never send a traceback
                log.exception("unhandled error in gRPC %s", route)
                code, message = grpc.StatusCode.INTERNAL, "internal error"
            finally:
                self.in_flight -= 1
                metrics.in_flight -= 1
                metrics.observe_request(label, code.name, time.perf_counter() - start)
            await context.abort(code, message)

        return call


class _Unimplemented(grpc.GenericRpcHandler):
    """UNIMPLEMENTED, with one log line, for every method the handlers before it do not serve."""

    def service(self, handler_call_details):
        method = handler_call_details.method

        async def unimplemented(_raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            log.info("gRPC %s: not implemented by this server", method)
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method} is not implemented by this server")

        return grpc.unary_unary_rpc_method_handler(unimplemented)


def _fill_spec(out, name: str, model: LoadedModel, signature_name: str) -> None:
    out.name = name
    out.version.value = model.version
    out.signature_name = signature_name


def _examples(inp) -> list:
    """Input of a ClassificationRequest -> tf.train.Example per row, context merged in."""
    kind = inp.WhichOneof("kind")
    if kind == "example_list":
        return list(inp.example_list.examples)
    if kind == "example_list_with_context":
        context = inp.example_list_with_context.context
        merged = []
        for example in inp.example_list_with_context.examples:
            full = example_pb2.Example()
            full.CopyFrom(context)
            for key, feature in example.features.feature.items():
                full.features.feature[key].CopyFrom(feature)
            merged.append(full)
        return merged
    raise InvalidArgument("Input is empty: set input.example_list or input.example_list_with_context")


def _current_health(base: type, refresh) -> type:  # noqa: ANN001
    """The health servicer, but Check first refreshes the status from the core, so a probe agrees
    with /readyz at once; Watch streams follow the core every HEALTH_POLL_S."""

    class CurrentHealth(base):  # type: ignore[misc, valid-type]
        async def Check(self, request, context):  # noqa: ANN001, ANN201, N802 - gRPC method name
            if not self._gracefully_shutting_down:
                await refresh()
            return await super().Check(request, context)

    return CurrentHealth


class GrpcServer:
    """A grpc.aio server on the serving loop: TF Serving's two services and the standard
    `grpc.health.v1.Health` (SERVING once every model has a live version; Kubernetes gRPC probes)."""

    def __init__(self, config: ServeConfig, core: ServingCore, *, reuse_port: bool = False) -> None:
        from grpc_health.v1 import health, health_pb2_grpc

        self.config = config
        self.core = core
        self.api = GrpcApi(config, core)
        self.health = _current_health(health.aio.HealthServicer, self._update_health)()
        self._health_task: asyncio.Task | None = None
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", config.max_body_bytes),
                ("grpc.max_send_message_length", -1),
                # One server per port, unless this is one of several --workers sharing it.
                ("grpc.so_reuseport", 1 if reuse_port else 0),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._server.add_generic_rpc_handlers(self.api.handlers())  # after Health: ends with a catch-all
        host = f"[{config.host}]" if ":" in config.host else config.host
        address = f"{host}:{config.grpc_port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-port {config.grpc_port}: cannot listen on {address}: {exc}") from None
        if not self.port:
            raise OSError(f"--grpc-port {config.grpc_port}: cannot listen on {address} (in use?)")

    async def start(self) -> "GrpcServer":
        await self._update_health()
        await self._server.start()
        self._health_task = asyncio.ensure_future(self._watch_health())
        log.info("gRPC on %s:%d (PredictionService, ModelService, Health)", self.config.host, self.port)
        return self

    async def _update_health(self) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if self.core.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in HEALTH_SERVICES:
            await self.health.set(service, status)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._update_health()

    async def stop(self, grace_s: float) -> int:
        """Refuse new RPCs now, let running ones finish for up to `grace_s`; returns how many had
        to be abandoned."""
        loop = asyncio.get_running_loop()
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.ensure_future(self._server.stop(grace_s))
        deadline = loop.time() + grace_s
        while self.api.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        abandoned = self.api.in_flight
        await stopping
        return abandoned
