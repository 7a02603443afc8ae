"""The Open Inference Protocol (KServe V2) on the REST port, beside TF Serving's API.

    GET  /v2                                          server metadata
    GET  /v2/health/live, /v2/health/ready            200, or 400 when not ready
    GET  /v2/models/{m}[/versions/{v}]                model metadata (serving_default's tensors)
    GET  /v2/models/{m}[/versions/{v}]/ready          200, or 4xx
    POST /v2/models/{m}[/versions/{v}]/infer          inputs as JSON or as binary tensor data

Spec: kserve/kserve docs/predict-api/v2/required_api.md. Triton's and KServe's clients send and ask
for binary tensor data by default (the `binary_tensor_data` extension: an `Inference-Header-Content-Length`
header, the JSON first, then each tensor's bytes; BYTES elements are 4-byte little-endian lengths
followed by the bytes), so both forms are accepted and answered. Like every edge, this one only
decodes and encodes: the core validates and runs the model.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import numpy as np

from common.versions import version_number
from serve.core import open_inference as oip
from serve.core.dataplane import ServingCore
from serve.core.errors import InvalidArgument
from serve.core.loaded_model import LoadedModel
from serve.http import tf_serving_codec as protocol
from serve.http.routing import JSON, Request, Response, Route, dumps, json_response

HEADER_LENGTH = b"inference-header-content-length"


class V2Api:
    def __init__(self, core: ServingCore) -> None:
        self.core = core
        self.version = oip.server_version()

    # -- server --------------------------------------------------------------------------------

    async def server_metadata(self, _request: Request) -> Response:
        return json_response({"name": oip.SERVER_NAME, "version": self.version, "extensions": oip.EXTENSIONS})

    async def live(self, _request: Request) -> Response:
        return json_response({"live": True})

    async def ready(self, _request: Request) -> Response:
        if not self.core.ready:
            return json_response({"ready": False}, 400)
        return json_response({"ready": True})

    # -- models --------------------------------------------------------------------------------

    def _model(self, request: Request) -> tuple[str, LoadedModel]:
        name = urllib.parse.unquote(request.match["name"])
        version = request.match["version"]
        if version is not None:
            number = version_number(version)
            if number is None:
                raise InvalidArgument(f"model version must be an integer, got {urllib.parse.unquote(version)!r}")
            return name, self.core.model(name, number)
        return name, self.core.model(name)

    async def model(self, request: Request) -> Response:
        verb = request.match.groupdict().get("verb")
        request.route_label = f"v2_{verb or 'metadata'}"
        name, model = self._model(request)
        if verb == "ready":
            return json_response({"name": name, "ready": True})
        return json_response(oip.model_metadata(name, model, self.core.live_versions(name)))

    async def infer(self, request: Request) -> Response:
        name, model = self._model(request)
        with self.core.receiving(name):
            body = await request.body()
            header_length = request.header(HEADER_LENGTH)
            head, binary = _split_body(body, header_length)
            infer = protocol.parse_json(head, self.core.config.max_rows_per_request)
            signature = model.signature(oip.SIGNATURE)
            inputs = _decode_inputs(infer, signature, binary, self.core.config)
            wanted, binary_out = _requested_outputs(infer, signature)
            if not isinstance(infer.get("id", ""), str):
                raise InvalidArgument(f"'id' must be a string, got {protocol.describe(infer['id'])}")
        outputs = await self.core.predict(model, oip.SIGNATURE, inputs, row_label=lambda n, i: f"input {n!r} element {i}")
        response: dict[str, Any] = {"model_name": name, "model_version": str(model.version)}
        if "id" in infer:
            response["id"] = infer["id"]
        tensors, chunks = [], []
        for output in wanted:
            tensor, chunk = _encode_output(output, outputs[output], binary_out[output])
            tensors.append(tensor)
            if chunk is not None:
                chunks.append(chunk)
        response["outputs"] = tensors
        head = dumps(response)
        if not chunks:
            return Response(head, 200, JSON)
        return Response(head + b"".join(chunks), 200, b"application/octet-stream",
                        [(HEADER_LENGTH, str(len(head)).encode())])


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(body):
        raise InvalidArgument(f"Inference-Header-Content-Length {header_length!r} does not fit the {len(body)}-byte body")
    return body[:n], body[n:]


def _parameters(obj: dict, where: str) -> dict:
    """The `parameters` object of a request, an input or an output ({} when absent)."""
    if "parameters" not in obj:
        return {}
    parameters = obj["parameters"]
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be an object, got {protocol.describe(parameters)}")
    return parameters


def _flag(parameters: dict, key: str, default: bool, where: str) -> bool:
    value = parameters.get(key, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where}: parameter {key!r} must be true or false, got {protocol.describe(value)}")
    return value


def _decode_inputs(infer: dict, signature, binary: bytes, config) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Every input tensor; a declared shape is checked (rank, rows, size) before anything is
    allocated for it, and binary data must be long enough for it."""
    inputs = infer.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument("'inputs' must be a non-empty list of tensors")
    arrays, offset = {}, 0
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise InvalidArgument(f"inputs[{i}]: expected an object with 'name', 'shape', 'datatype' and 'data'")
        name = tensor["name"]
        if name in arrays:
            raise InvalidArgument(f"input {name!r} is given twice")
        datatype, shape = tensor.get("datatype"), tensor.get("shape")
        if not isinstance(shape, list):
            raise InvalidArgument(f"input {name!r}: 'shape' must be a list of non-negative integers")
        count = oip.check_input(signature, name, datatype, shape, config)
        parameters = _parameters(tensor, f"input {name!r}")
        if "binary_data_size" in parameters:
            size = parameters["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise InvalidArgument(f"input {name!r}: binary_data_size {size!r} does not fit the binary data")
            values = oip.from_raw(binary[offset:offset + size], datatype, count, name)
            offset += size
        else:
            values = _from_json(tensor.get("data"), datatype, count, len(shape), name)
        arrays[name] = values.reshape(shape)
    if offset != len(binary):
        raise InvalidArgument(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    return arrays


def _flatten(data: Any, count: int, rank: int, name: str) -> list:
    """`data` flat (V2 accepts it flat or nested as the shape), without recursion: nesting deeper
    than the shape's rank, or more values than it holds, is refused as soon as it is seen."""
    if not isinstance(data, list):
        raise InvalidArgument(f"input {name!r}: 'data' must be a list, got {protocol.describe(data)}")
    out: list = []
    stack = [(iter(data), 1)]
    while stack:
        items, depth = stack[-1]
        for item in items:
            if isinstance(item, list):
                if depth >= max(rank, 1):
                    raise InvalidArgument(f"input {name!r}: 'data' is nested deeper than its {rank}-dimensional shape")
                stack.append((iter(item), depth + 1))
                break
            out.append(item)
            if len(out) > count:
                raise InvalidArgument(f"input {name!r}: the shape holds {count} elements but 'data' has more")
        else:
            stack.pop()
    return out


def _from_json(data: Any, datatype: str, count: int, rank: int, name: str) -> np.ndarray:
    if data is None:
        raise InvalidArgument(f"input {name!r}: no 'data' (and no binary_data_size)")
    values = _flatten(data, count, rank, name)
    if len(values) != count:
        raise InvalidArgument(f"input {name!r}: the shape holds {count} elements but 'data' has {len(values)}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise InvalidArgument(f"input {name!r} element {i}: expected a string, got {protocol.describe(value)}")
            array[i] = value.encode("utf-8", "surrogatepass")
        return array
    try:
        return np.asarray(values, dtype=oip.NUMPY[datatype])
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"input {name!r}: 'data' must be {datatype} numbers") from None


def _requested_outputs(infer: dict, signature) -> tuple[list[str], dict[str, bool]]:  # noqa: ANN001
    default_binary = _flag(_parameters(infer, "request"), "binary_data_output", False, "request")
    if "outputs" not in infer:
        return list(signature.outputs), {name: default_binary for name in signature.outputs}
    requested = infer["outputs"]
    if not isinstance(requested, list):
        raise InvalidArgument("'outputs' must be a list of {\"name\": ...} objects")
    wanted, binary = [], {}
    for i, output in enumerate(requested):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise InvalidArgument(f"outputs[{i}]: expected an object with a 'name'")
        name = output["name"]
        oip.check_output(signature, name)
        wanted.append(name)
        binary[name] = _flag(_parameters(output, f"output {name!r}"), "binary_data", default_binary, f"output {name!r}")
    return wanted, binary


def _encode_output(name: str, array: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    datatype = oip.datatype_of(array)
    tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    flat = array.ravel()
    if binary:
        chunk = oip.to_raw(array)
        tensor["parameters"] = {"binary_data_size": len(chunk)}
        return tensor, chunk
    if datatype == "BYTES":
        try:
            tensor["data"] = [v.decode("utf-8") for v in flat.tolist()]
        except UnicodeDecodeError:
            raise InvalidArgument(f"output {name!r} is not UTF-8 text: ask for it as binary data") from None
    else:
        tensor["data"] = flat
    return tensor, None


_MODEL = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"


def routes(api: V2Api) -> list[Route]:
    return [
        Route.of("v2_server", "GET", r"/v2/?", api.server_metadata),
        Route.of("v2_live", "GET", r"/v2/health/live", api.live, scope="open"),
        Route.of("v2_ready", "GET", r"/v2/health/ready", api.ready, scope="open"),
        Route.of("v2_model", "GET", _MODEL + r"/(?P<verb>ready)", api.model, raw=True, scope="open"),
        Route.of("v2_model", "GET", _MODEL, api.model, raw=True),
        Route.of("v2_infer", "POST", _MODEL + r"/infer", api.infer, raw=True),
    ]

