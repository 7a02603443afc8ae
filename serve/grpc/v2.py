"""The Open Inference Protocol (KServe V2) on the gRPC port: `inference.GRPCInferenceService`.

    ServerLive, ServerReady, ServerMetadata     the server
    ModelReady, ModelMetadata                   a model (and version: "" is the latest)
    ModelInfer                                  inputs in `contents` or in `raw_input_contents`

Messages are KServe's `grpc_predict_v2.proto` (generated into `client.protos`, which the client
shares). tritonclient calls more methods of Triton's superset of this service (model config,
statistics, repository, shared memory...): those answer UNIMPLEMENTED, as KServe's server does.
Like the REST V2 edge, this one only decodes and encodes: `serve.core.open_inference` holds each
tensor to the protocol's rules and the core validates and runs the model. Answers carry
`raw_output_contents` when the request sent raw inputs (what tritonclient does), `contents`
otherwise; the request parameter `binary_data_output` (a bool) chooses explicitly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from client.protos import grpc_predict_v2_pb2 as pb
from common.versions import version_number
from serve.config import ServeConfig
from serve.core import open_inference as oip
from serve.core.dataplane import ServingCore
from serve.core.dtypes import bytes_array
from serve.core.errors import InvalidArgument, Unavailable
from serve.core.loaded_model import LoadedModel

SERVICE = "inference.GRPCInferenceService"

_CONTENTS = {
    "BYTES": "bytes_contents", "BOOL": "bool_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
}
"""V2 datatype -> the InferTensorContents field holding its values (FP16 has none: raw only)."""
_UNSUPPORTED_PARAMETERS = ("classification",)
"""Parameters that would change what an answer means; refused rather than ignored."""


class OpenInferenceGrpc:
    """Handlers of `inference.GRPCInferenceService`, bound to one core."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self.core = core
        self.version = oip.server_version()

    def methods(self) -> dict[str, tuple[str, Any, Any]]:
        """method -> (metrics route, request message class, handler)."""
        return {
            "ServerLive": ("v2_live", pb.ServerLiveRequest, self.server_live),
            "ServerReady": ("v2_ready", pb.ServerReadyRequest, self.server_ready),
            "ServerMetadata": ("v2_server", pb.ServerMetadataRequest, self.server_metadata),
            "ModelReady": ("v2_model_ready", pb.ModelReadyRequest, self.model_ready),
            "ModelMetadata": ("v2_metadata", pb.ModelMetadataRequest, self.model_metadata),
            "ModelInfer": ("v2_infer", pb.ModelInferRequest, self.model_infer),
        }

    # -- server --------------------------------------------------------------------------------

    async def server_live(self, _request: pb.ServerLiveRequest, _context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _request: pb.ServerReadyRequest, _context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.core.ready)

    async def server_metadata(self, _request: pb.ServerMetadataRequest, _context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=oip.SERVER_NAME, version=self.version, extensions=oip.EXTENSIONS)

    # -- models --------------------------------------------------------------------------------

    def _model(self, name: str, version: str) -> LoadedModel:
        if not version:
            return self.core.model(name)
        number = version_number(version)
        if number is None:
            raise InvalidArgument(f"model version must be an integer, got {version!r}")
        return self.core.model(name, number)

    async def model_ready(self, request: pb.ModelReadyRequest, _context) -> pb.ModelReadyResponse:
        """Unknown model: NOT_FOUND; a known one with no version loaded (yet): ready false."""
        try:
            self._model(request.name, request.version)
        except Unavailable:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def model_metadata(self, request: pb.ModelMetadataRequest, _context) -> pb.ModelMetadataResponse:
        model = self._model(request.name, request.version)
        return pb.ModelMetadataResponse(**oip.model_metadata(request.name, model, self.core.live_versions(request.name)))

    async def model_infer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        model = self._model(request.model_name, request.model_version)
        signature = model.signature(oip.SIGNATURE)
        raw_out = _raw_outputs(request)
        inputs = _decode_inputs(request, signature, self.config)
        wanted = [output.name for output in request.outputs] or list(signature.outputs)
        for i, output in enumerate(request.outputs):
            oip.check_output(signature, output.name)
            _check_parameters(output.parameters, f"output {output.name!r}")
            if output.name in wanted[:i]:
                raise InvalidArgument(f"output {output.name!r} is asked for twice")
        outputs = await self.core.predict(model, oip.SIGNATURE, inputs, timeout_s=context.time_remaining(),
                                          row_label=lambda n, i: f"input {n!r} element {i}")
        response = pb.ModelInferResponse(model_name=request.model_name, model_version=str(model.version),
                                         id=request.id)
        datatypes = {name: oip.datatype_of(outputs[name]) for name in wanted}
        # All raw or none (clients index raw_output_contents by output), and FP16 has no contents field.
        raw_out = raw_out or any(datatype not in _CONTENTS for datatype in datatypes.values())
        for name in wanted:
            array = outputs[name]
            tensor = response.outputs.add(name=name, datatype=datatypes[name], shape=array.shape)
            if raw_out:
                response.raw_output_contents.append(oip.to_raw(array))
            else:
                getattr(tensor.contents, _CONTENTS[datatypes[name]]).extend(array.ravel().tolist())
        return response


def _check_parameters(parameters, where: str) -> None:  # noqa: ANN001 - map<string, InferParameter>
    for key, value in parameters.items():
        if value.WhichOneof("parameter_choice") is None:
            raise InvalidArgument(f"{where}: parameter {key!r} has no value")
        if key in _UNSUPPORTED_PARAMETERS:
            raise InvalidArgument(f"{where}: parameter {key!r} is not supported by this server")


def _raw_outputs(request: pb.ModelInferRequest) -> bool:
    _check_parameters(request.parameters, "request")
    if "binary_data_output" not in request.parameters:
        return bool(request.raw_input_contents)
    choice = request.parameters["binary_data_output"]
    if choice.WhichOneof("parameter_choice") != "bool_param":
        raise InvalidArgument("request: parameter 'binary_data_output' must be a bool")
    return choice.bool_param


def _decode_inputs(request: pb.ModelInferRequest, signature, config: ServeConfig) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Every input, its declared shape checked before anything is allocated for it; values come
    from `raw_input_contents` (one entry per input, in order) or from each input's `contents`."""
    if not request.inputs:
        raise InvalidArgument("'inputs' must be a non-empty list of tensors")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give one per input")
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
        if name in arrays:
            raise InvalidArgument(f"input {name!r} is given twice")
        count = oip.check_input(signature, name, datatype, shape, config)
        _check_parameters(tensor.parameters, f"input {name!r}")
        if raw:
            if tensor.HasField("contents"):
                raise InvalidArgument(f"input {name!r}: values in both contents and raw_input_contents")
            values = oip.from_raw(raw[i], datatype, count, name)
        else:
            values = _from_contents(tensor.contents, datatype, count, name)
        arrays[name] = values.reshape(shape)
    return arrays


def _from_contents(contents: pb.InferTensorContents, datatype: str, count: int, name: str) -> np.ndarray:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise InvalidArgument(f"input {name!r}: {datatype} values can only be sent in raw_input_contents")
    values = getattr(contents, field)
    if len(values) != count:
        raise InvalidArgument(f"input {name!r}: the shape holds {count} elements but contents.{field} has {len(values)}")
    for other, _ in contents.ListFields():
        if other.name != field:
            raise InvalidArgument(f"input {name!r}: a {datatype} tensor's values go in contents.{field}, not {other.name}")
    if datatype == "BYTES":
        return bytes_array(values)
    return np.array(values, dtype=oip.NUMPY[datatype])
