"""The Open Inference Protocol's (KServe V2) tensors, for both of its edges (REST in
`serve.http.v2`, gRPC in `serve.grpc.v2`): datatypes, the checks of an input's
declared name, datatype and shape, and the raw byte encoding both carry (elements little-endian;
a BYTES element is a 4-byte little-endian length, then its bytes).

Spec: kserve/kserve docs/predict-api/v2/required_api.md. Each edge decodes its own framing into
these calls, so a tensor is held to the same rules whichever way it came.
"""

from __future__ import annotations

import importlib.metadata
import struct
from typing import Any, Sequence

import numpy as np

from serve.config import ServeConfig
from serve.core.dataplane import check_declared_shape
from serve.core.errors import InvalidArgument
from serve.core.loaded_model import LoadedModel, Signature, TensorInfo

SERVER_NAME = "sentiment-dtensor"
SIGNATURE = "serving_default"
"""The signature V2 requests run (the protocol has no way to name another)."""
PLATFORM = "tensorflow_savedmodel"
EXTENSIONS = ["binary_tensor_data"]

DATATYPES = {
    "DT_STRING": "BYTES", "DT_FLOAT": "FP32", "DT_DOUBLE": "FP64", "DT_HALF": "FP16", "DT_INT8": "INT8",
    "DT_INT16": "INT16", "DT_INT32": "INT32", "DT_INT64": "INT64", "DT_UINT8": "UINT8", "DT_UINT16": "UINT16",
    "DT_UINT32": "UINT32", "DT_UINT64": "UINT64", "DT_BOOL": "BOOL",
}
"""TF dtype names -> V2 datatypes."""
NUMPY = {
    "FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT8": np.int8, "INT16": np.int16,
    "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "BOOL": np.bool_,
}
"""V2 datatypes -> numpy (BYTES is an object array of byte strings)."""


def server_version() -> str:
    try:
        return importlib.metadata.version("sentiment-dtensor")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tensor_metadata(name: str, info: TensorInfo) -> dict[str, Any]:
    """A signature tensor as V2 metadata describes it (-1 for a dimension of any size)."""
    shape = [-1] if info.shape is None else [-1 if d is None or d < 0 else d for d in info.shape]
    return {"name": name, "datatype": DATATYPES.get(info.dtype, info.dtype), "shape": shape}


def model_metadata(name: str, model: LoadedModel, live_versions: Sequence[int]) -> dict[str, Any]:
    """What V2's model metadata answers (both edges): the name, the versions served, the platform
    and the tensors of the signature V2 runs."""
    signature = model.signature(SIGNATURE)
    return {
        "name": name,
        "versions": [str(v) for v in live_versions],
        "platform": PLATFORM,
        "inputs": [tensor_metadata(n, info) for n, info in signature.inputs.items()],
        "outputs": [tensor_metadata(n, info) for n, info in signature.outputs.items()],
    }


def check_input(signature: Signature, name: str, datatype: str, shape: Sequence[Any], config: ServeConfig) -> int:
    """An input's declared name, datatype and shape, before anything is allocated for its values.
    Returns its element count."""
    if name not in signature.inputs:
        raise InvalidArgument(f"unexpected inference input {name!r}; the model takes {sorted(signature.inputs)}")
    expected = DATATYPES.get(signature.inputs[name].dtype)
    if datatype != expected:
        raise InvalidArgument(f"input {name!r}: datatype {datatype!r}, the model expects {expected}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidArgument(f"input {name!r}: 'shape' must be a list of non-negative integers")
    return check_declared_shape(signature, name, shape, config)


def check_output(signature: Signature, name: str) -> None:
    if name not in signature.outputs:
        raise InvalidArgument(f"unexpected inference output {name!r}; the model has {sorted(signature.outputs)}")


def from_raw(raw: bytes, datatype: str, count: int, name: str) -> np.ndarray:
    """`count` elements of `datatype` from their raw bytes (flat); every length is checked
    against the bytes given before anything is allocated."""
    if datatype != "BYTES":
        itemsize = np.dtype(NUMPY[datatype]).itemsize
        if len(raw) != count * itemsize:
            raise InvalidArgument(f"input {name!r}: {len(raw)} bytes of binary data for {count} {datatype} elements")
        return np.frombuffer(raw, dtype=NUMPY[datatype]).copy()
    if len(raw) < 4 * count:  # every element has a 4-byte length: check before allocating
        raise InvalidArgument(f"input {name!r}: {len(raw)} bytes of binary data cannot hold {count} BYTES elements")
    array, at = np.empty(count, dtype=object), 0
    for i in range(count):
        if at + 4 > len(raw):
            raise InvalidArgument(f"input {name!r}: the binary data ends before BYTES element {i} of {count}")
        (length,) = struct.unpack_from("<I", raw, at)
        at += 4
        if at + length > len(raw):
            raise InvalidArgument(f"input {name!r}: binary BYTES element {i} is longer than the data")
        array[i] = raw[at:at + length]
        at += length
    if at != len(raw):
        raise InvalidArgument(f"input {name!r}: {len(raw) - at} bytes of binary data after the {count} elements")
    return array


def datatype_of(array: np.ndarray) -> str:
    if array.dtype == object or array.dtype.kind == "S":
        return "BYTES"
    return next((k for k, v in NUMPY.items() if np.dtype(v) == array.dtype), str(array.dtype))


def to_raw(array: np.ndarray) -> bytes:
    """An output's values in the raw encoding (flat)."""
    if array.dtype == object or array.dtype.kind == "S":
        return b"".join(struct.pack("<I", len(v)) + v for v in array.ravel().tolist())
    return np.ascontiguousarray(array).tobytes()
