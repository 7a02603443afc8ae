"""TF Serving's REST protocol at the edge: JSON in -> plain values, numpy out -> JSON.

Follows tensorflow_serving/util/json_tensor.cc: row format (`instances`) and columnar format
(`inputs`), `{"b64": ...}` for binary strings, `predictions` / `outputs` in the response, and
`results` for :classify. Only decoding lives here: what the values must satisfy (names, dtypes,
row counts, text limits) is checked once by the core for every edge. Malformed JSON structure is
`InvalidArgument` with a message that says where.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import orjson

from serve.errors import InvalidArgument
from serve.models import Signature
from serve.tensors import NUMPY_DTYPES

# The URL grammar of TF Serving's http_rest_api_handler.cc (case-insensitive).
_PREDICT_RE = re.compile(
    r"(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)"
)
_STATUS_RE = re.compile(r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:/(metadata))?")


@dataclass(frozen=True)
class ModelPath:
    name: str
    version: int | None
    label: str | None
    verb: str | None
    """`predict`, `classify`, `regress` for POST; `metadata` or None (status) for GET."""


@functools.lru_cache(maxsize=1024)  # clients repeat the same few paths
def parse_model_path(method: str, raw_path: str) -> ModelPath:
    """Match a /v1/models/... path (raw, still URL-encoded) like TF Serving; names are URL-decoded."""
    regex = _PREDICT_RE if method == "POST" else _STATUS_RE
    match = regex.fullmatch(raw_path)
    if match is None or (method != "POST" and match.group(1) is None):
        raise InvalidArgument(f"Malformed request: {method} {urllib.parse.unquote(raw_path)}")
    name, version, label, verb = match.groups()
    if version is not None and len(version) > 18:
        raise InvalidArgument(f"Malformed request: version {version} is too large")
    return ModelPath(
        name=urllib.parse.unquote(name),
        version=int(version) if version is not None else None,
        label=urllib.parse.unquote(label) if label is not None else None,
        verb=verb.lower() if verb else None,
    )


def parse_json(raw: bytes) -> dict[str, Any]:
    """Body bytes -> JSON object; non-UTF-8, invalid JSON and non-objects are InvalidArgument."""
    if not raw:
        raise InvalidArgument("request body is empty: expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise InvalidArgument(f"request body is not valid UTF-8 (byte {bad.start})") from None
        raise InvalidArgument(f"JSON Parse error: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def signature_name(body: Mapping[str, Any], default: str = "serving_default") -> str:
    """The request's `signature_name` (TF Serving: absent or empty means the default)."""
    name = body.get("signature_name", "")
    if not isinstance(name, str):
        raise InvalidArgument("'signature_name' key must be a string value.")
    return name or default


# -- values ------------------------------------------------------------------------------------


def _bytes_value(value: Any, where: str) -> bytes:
    if isinstance(value, str):
        # Lone surrogates survive as invalid UTF-8, which the core reports for text inputs.
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, dict) and set(value) == {"b64"}:
        return decode_b64(value["b64"], where)
    raise InvalidArgument(f"{where}: expected a string or {{\"b64\": ...}}, got {describe(value)}")


def decode_b64(b64: Any, where: str) -> bytes:
    if not isinstance(b64, str):
        raise InvalidArgument(f"{where}: 'b64' value must be a base64 string")
    try:
        if len(b64) % 4:  # Python would accept extra padding ("YWJj="); TF Serving does not
            raise ValueError
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{where}: Unable to base64 decode: 'b64' value is not valid base64") from None


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:5]}"
    return type(value).__name__


def _column(name: str, values: list[Any], dtype: str, where: str) -> np.ndarray:
    if dtype == "DT_STRING":
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = _bytes_value(value, f"{where}[{i}]")
        return array
    numpy_dtype = NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        raise InvalidArgument(f"input {name!r} has unsupported dtype {dtype}")
    try:
        return np.asarray(values, dtype=numpy_dtype)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{where}: values of input {name!r} must be numbers of one shape ({dtype})") from None


# -- predict -----------------------------------------------------------------------------------


def parse_predict(body: Mapping[str, Any], signature: Signature) -> tuple[dict[str, np.ndarray], bool]:
    """Predict request -> (input arrays by name, row_format)."""
    has_instances, has_inputs = "instances" in body, "inputs" in body
    if has_instances and has_inputs:
        raise InvalidArgument("Not a valid request: both 'instances' and 'inputs' given; use one of them")
    if not has_instances and not has_inputs:
        raise InvalidArgument("Missing 'instances' (row format) or 'inputs' (columnar format) key")
    names = list(signature.inputs)
    if has_instances:
        instances = body["instances"]
        if not isinstance(instances, list):
            raise InvalidArgument(f"'instances' must be a list, got {describe(instances)}")
        columns: dict[str, list[Any]] = {n: [] for n in names}
        for i, item in enumerate(instances):
            named = isinstance(item, dict) and set(item) != {"b64"}
            if len(names) == 1 and not named:
                columns[names[0]].append(item)
                continue
            if not named:
                raise InvalidArgument(f"instances[{i}]: expected an object with keys {names}, got {describe(item)}")
            if set(item) != set(names):
                raise InvalidArgument(f"instances[{i}]: expected keys {names}, got {sorted(item)}")
            for n in names:
                columns[n].append(item[n])
        return {n: _column(n, columns[n], signature.inputs[n].dtype, "instances") for n in names}, True
    inputs = body["inputs"]
    if isinstance(inputs, dict) and set(inputs) != {"b64"}:
        if set(inputs) != set(names):
            raise InvalidArgument(f"'inputs' must have keys {names}, got {sorted(inputs)}")
        by_name = inputs
    elif len(names) == 1:
        by_name = {names[0]: inputs}
    else:
        raise InvalidArgument(f"'inputs' must be an object with keys {names}")
    arrays = {}
    for n in names:
        values = by_name[n]
        arrays[n] = _column(n, values if isinstance(values, list) else [values], signature.inputs[n].dtype,
                            f"inputs[{n!r}]")
    return arrays, False


def instances_label(_name: str, row: int) -> str:
    return f"instances[{row}]"


def inputs_label(name: str, row: int) -> str:
    return f"inputs[{name!r}][{row}]"


def _jsonable(name: str, array: np.ndarray) -> Any:
    """Strings as text (or b64); numbers stay numpy, written directly by the JSON encoder."""
    if array.dtype == object:
        if array.ndim <= 1:
            return [_json_bytes(name, x) for x in array.ravel().tolist()]
        return [_jsonable(name, row) for row in array]
    return array


def _json_bytes(name: str, value: bytes) -> Any:
    if not name.endswith("_bytes"):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return {"b64": base64.b64encode(value).decode("ascii")}


def format_predict(outputs: Mapping[str, np.ndarray], row_format: bool) -> dict[str, Any]:
    columns = {name: _jsonable(name, array) for name, array in outputs.items()}
    if row_format:
        if len(columns) == 1:
            (values,) = columns.values()
            return {"predictions": values}
        names = list(columns)
        return {"predictions": [dict(zip(names, row)) for row in zip(*columns.values())]}
    if len(columns) == 1:
        (values,) = columns.values()
        return {"outputs": values}
    return {"outputs": columns}


# -- classify ----------------------------------------------------------------------------------


def _feature(feature, value: Any, where: str) -> None:
    values = value if isinstance(value, list) else [value]
    if not values:
        return
    if all(isinstance(v, (bool, int)) for v in values):
        feature.int64_list.value.extend(int(v) for v in values)
    elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        feature.float_list.value.extend(float(v) for v in values)
    else:
        feature.bytes_list.value.extend(_bytes_value(v, where) for v in values)


def parse_classify(body: Mapping[str, Any]) -> tuple[str, list]:
    """Classify request -> (signature_name or "", a tf.train.Example per example, context merged in)."""
    from tensorflow.core.example import example_pb2  # TensorFlow is loaded with the model by now

    name = signature_name(body, default="")
    examples = body.get("examples")
    if examples is None:
        raise InvalidArgument("Missing 'examples' key")
    if not isinstance(examples, list):
        raise InvalidArgument(f"'examples' must be a list of objects, got {describe(examples)}")
    context = body.get("context", {})
    if not isinstance(context, dict):
        raise InvalidArgument("'context' must be an object of features")
    protos = []
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise InvalidArgument(f"examples[{i}]: expected an object of features, got {describe(ex)}")
        proto = example_pb2.Example()
        for key, value in {**context, **ex}.items():
            _feature(proto.features.feature[key], value, f"examples[{i}].{key}")
        protos.append(proto)
    return name, protos


def format_classify(classes: np.ndarray, scores: np.ndarray) -> dict[str, Any]:
    results = []
    for row_classes, row_scores in zip(classes.tolist(), scores):  # scores stay float32 (see dumps)
        results.append([[c.decode("utf-8"), s] for c, s in zip(row_classes, row_scores)])
    return {"results": results}


# -- friendly API ------------------------------------------------------------------------------


def parse_sentiment(body: Mapping[str, Any]) -> list[bytes]:
    """`{"texts": ["...", ...]}` -> UTF-8 texts (checked by the core)."""
    texts = body.get("texts")
    if texts is None:
        raise InvalidArgument("Missing 'texts' key: expected {\"texts\": [\"review\", ...]}")
    if not isinstance(texts, list):
        raise InvalidArgument(f"'texts' must be a list of strings, got {describe(texts)}")
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidArgument(f"texts[{i}]: expected a string, got {describe(text)}")
        out.append(text.encode("utf-8", "surrogatepass"))
    return out
