"""Tensors at the gRPC edge: TensorProto <-> numpy.

`from_tensor_proto` is the gRPC edge's decoder. Unlike `tf.make_ndarray` it never expands a
tensor: the shape a client declares must agree with the values it sends, so a 42-byte request
declaring 200 million strings is rejected before anything is allocated.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from serve.core.dtypes import NUMPY_DTYPES, bytes_array, dtype_name
from serve.core.errors import InvalidArgument

_VALUE_FIELDS = {
    "DT_FLOAT": "float_val", "DT_DOUBLE": "double_val", "DT_INT32": "int_val", "DT_INT16": "int_val",
    "DT_INT8": "int_val", "DT_UINT8": "int_val", "DT_UINT16": "int_val", "DT_UINT32": "uint32_val",
    "DT_INT64": "int64_val", "DT_UINT64": "uint64_val", "DT_BOOL": "bool_val", "DT_HALF": "half_val",
}

@functools.cache
def _dtype_names() -> dict[int, str]:
    """DataType enum number -> name (`types_pb2.DataType.Name` builds lists on every call)."""
    from tensorflow.core.framework import types_pb2

    return {number: name for name, number in types_pb2.DataType.items()}


@functools.cache
def _dtype_numbers() -> dict[str, int]:
    return {name: number for number, name in _dtype_names().items()}


def from_tensor_proto(proto: Any, where: str) -> np.ndarray:
    """A TensorProto -> numpy, refusing any tensor whose declared shape disagrees with its values.

    The declared shape itself (known rank, sizes, element count) is checked by the core first
    (`check_declared_shape`), so nothing here allocates more than the limits allow.
    """
    dtype = _dtype_names().get(proto.dtype) or str(proto.dtype)
    dims = [d.size for d in proto.tensor_shape.dim]
    count = math.prod(dims)
    if dtype == "DT_STRING":
        values = proto.string_val
        if len(values) != count:
            raise InvalidArgument(f"{where}: the tensor shape {dims} declares {count} values but {len(values)} are given")
        return bytes_array(values).reshape(dims)
    numpy_dtype = NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        raise InvalidArgument(f"{where}: unsupported dtype {dtype}")
    if proto.tensor_content:
        itemsize = np.dtype(numpy_dtype).itemsize
        if len(proto.tensor_content) != count * itemsize:
            raise InvalidArgument(
                f"{where}: the tensor shape {dims} declares {count} values but tensor_content holds "
                f"{len(proto.tensor_content) // itemsize}"
            )
        return np.frombuffer(proto.tensor_content, dtype=numpy_dtype).reshape(dims).copy()
    values = getattr(proto, _VALUE_FIELDS[dtype])
    if len(values) != count:
        raise InvalidArgument(f"{where}: the tensor shape {dims} declares {count} values but {len(values)} are given")
    if dtype == "DT_HALF":
        return np.array(values, dtype=np.uint16).view(np.float16).reshape(dims)
    return np.array(values, dtype=numpy_dtype).reshape(dims)


def fill_tensor_proto(proto: Any, array: np.ndarray) -> None:
    """numpy -> the (empty) TensorProto `proto`, in place (a response's map entry: no copy);
    strings as string_val, numbers as tensor_content."""
    dims = proto.tensor_shape.dim
    for size in array.shape:
        dims.add().size = size
    name = dtype_name(array)
    proto.dtype = _dtype_numbers()[name]
    if name == "DT_STRING":
        proto.string_val.extend(array.ravel().tolist())
    else:
        proto.tensor_content = np.ascontiguousarray(array).tobytes()
