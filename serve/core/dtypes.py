"""TF dtype names <-> numpy, shared by the core's validation and every edge's codec."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

NUMPY_DTYPES: dict[str, Any] = {
    "DT_FLOAT": np.float32, "DT_DOUBLE": np.float64, "DT_INT32": np.int32, "DT_INT64": np.int64,
    "DT_INT16": np.int16, "DT_INT8": np.int8, "DT_UINT8": np.uint8, "DT_UINT16": np.uint16,
    "DT_UINT32": np.uint32, "DT_UINT64": np.uint64, "DT_BOOL": np.bool_, "DT_HALF": np.float16,
}
"""TF dtype enum names -> numpy dtypes (DT_STRING is an object array of bytes)."""


def bytes_array(values: Sequence[bytes]) -> np.ndarray:
    """A 1-D object array of byte strings (a DT_STRING tensor's values), one element per value."""
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def dtype_name(array: np.ndarray) -> str:
    """The TF dtype name of a numpy array (`DT_STRING` for object/bytes arrays)."""
    if array.dtype == object or array.dtype.kind == "S":
        return "DT_STRING"
    for name, dtype in NUMPY_DTYPES.items():
        if array.dtype == dtype:
            return name
    return f"numpy {array.dtype}"


def short_dtype(name: str) -> str:
    """`DT_STRING` -> `string`, as TF Serving words its dtype errors."""
    return name.removeprefix("DT_").lower()
