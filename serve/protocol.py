"""TF Serving REST protocol at the edge: JSON in -> numpy arrays, numpy out -> JSON.

Follows tensorflow_serving/util/json_tensor.cc: row format (`instances`) and columnar format
(`inputs`), `{"b64": ...}` for binary strings, `predictions` / `outputs` in the response, and
`results` for :classify. Every validation failure is `InvalidArgument` with a clear message.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from serve.config import ServeConfig
from serve.errors import InvalidArgument
from serve.models import Signature

# The URL grammar of TF Serving's http_rest_api_handler.cc (case-insensitive).
_PREDICT_RE = re.compile(
    r"(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)"
)
_STATUS_RE = re.compile(r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:/(metadata))?")

_DTYPES = {
    "DT_FLOAT": np.float32, "DT_DOUBLE": np.float64, "DT_INT32": np.int32, "DT_INT64": np.int64,
    "DT_INT16": np.int16, "DT_INT8": np.int8, "DT_UINT8": np.uint8, "DT_BOOL": np.bool_,
    "DT_HALF": np.float16,
}


@dataclass(frozen=True)
class ModelPath:
    name: str
    version: int | None
    label: str | None
    verb: str | None
    """`predict`, `classify`, `regress` for POST; `metadata` or None (status) for GET."""


def parse_model_path(method: str, raw_path: str) -> ModelPath:
    """Match a /v1/models/... path (raw, still URL-encoded) like TF Serving; names are URL-decoded."""
    regex = _PREDICT_RE if method == "POST" else _STATUS_RE
    match = regex.fullmatch(raw_path)
    if match is None or (method == "GET" and match.group(1) is None):
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
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"JSON Parse error: {exc}") from None
    except RecursionError:
        raise InvalidArgument("JSON Parse error: nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# -- values ------------------------------------------------------------------------------------


def _bytes_value(value: Any, where: str) -> bytes:
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{where}: string is not valid UTF-8 (lone surrogate escape)") from None
    if isinstance(value, dict) and set(value) == {"b64"}:
        b64 = value["b64"]
        if not isinstance(b64, str):
            raise InvalidArgument(f"{where}: 'b64' value must be a base64 string")
        try:
            return base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"{where}: 'b64' value is not valid base64") from None
    raise InvalidArgument(f"{where}: expected a string or {{\"b64\": ...}}, got {_describe(value)}")


def _describe(value: Any) -> str:
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


def check_text(data: bytes, where: str, config: ServeConfig) -> None:
    """A review text: non-empty, valid UTF-8, at most `max_text_bytes`."""
    if not data.strip():
        raise InvalidArgument(f"{where}: text is empty")
    if len(data) > config.max_text_bytes:
        raise InvalidArgument(f"{where}: text is {len(data)} bytes, more than the limit of {config.max_text_bytes}")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(f"{where}: text is not valid UTF-8") from None


def _column(name: str, values: list[Any], info, config: ServeConfig, where: str) -> np.ndarray:
    if info.dtype == "DT_STRING":
        arr = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            data = _bytes_value(value, f"{where}[{i}]")
            if name == "text":
                check_text(data, f"{where}[{i}]", config)
            elif len(data) > config.max_text_bytes:
                raise InvalidArgument(f"{where}[{i}]: value is {len(data)} bytes, more than {config.max_text_bytes}")
            arr[i] = data
        if info.shape is not None and len(info.shape) != 1:
            raise InvalidArgument(f"{where}: input {name!r} needs rank {len(info.shape)}, string inputs of rank 1 only")
        return arr
    dtype = _DTYPES.get(info.dtype)
    if dtype is None:
        raise InvalidArgument(f"input {name!r} has unsupported dtype {info.dtype}")
    try:
        arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{where}: values of input {name!r} must be numbers of one shape ({info.dtype})") from None
    if info.shape is not None:
        if arr.ndim != len(info.shape) or any(d not in (-1, a) for d, a in zip(info.shape[1:], arr.shape[1:])):
            raise InvalidArgument(f"{where}: input {name!r} has shape {list(arr.shape)}, expected {list(info.shape)}")
    return arr


def _check_rows(rows: int, config: ServeConfig) -> None:
    if rows == 0:
        raise InvalidArgument("no instances: at least one input row is required")
    if rows > config.max_rows_per_request:
        raise InvalidArgument(f"{rows} instances in one request, more than the limit of {config.max_rows_per_request}")


# -- predict -----------------------------------------------------------------------------------


def parse_predict(body: Mapping[str, Any], signature: Signature, config: ServeConfig) -> tuple[dict[str, np.ndarray], bool]:
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
            raise InvalidArgument(f"'instances' must be a list, got {_describe(instances)}")
        _check_rows(len(instances), config)
        columns: dict[str, list[Any]] = {n: [] for n in names}
        for i, item in enumerate(instances):
            named = isinstance(item, dict) and not (set(item) == {"b64"})
            if len(names) == 1 and not named:
                columns[names[0]].append(item)
                continue
            if not named:
                raise InvalidArgument(f"instances[{i}]: expected an object with keys {names}, got {_describe(item)}")
            if set(item) != set(names):
                raise InvalidArgument(f"instances[{i}]: expected keys {names}, got {sorted(item)}")
            for n in names:
                columns[n].append(item[n])
        arrays = {n: _column(n, columns[n], signature.inputs[n], config, "instances") for n in names}
        return arrays, True
    inputs = body["inputs"]
    if isinstance(inputs, dict) and not (set(inputs) == {"b64"}):
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
        if not isinstance(values, list):
            values = [values]
        _check_rows(len(values), config)
        arrays[n] = _column(n, values, signature.inputs[n], config, f"inputs[{n!r}]")
    if len({len(a) for a in arrays.values()}) > 1:
        raise InvalidArgument("all 'inputs' must have the same number of rows")
    return arrays, False


def _jsonable(name: str, array: np.ndarray) -> list[Any]:
    if array.dtype == object:
        return [_json_bytes(name, x) for x in array.ravel()] if array.ndim <= 1 else [
            _jsonable(name, row) for row in array
        ]
    return array.tolist()


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


def _feature(feature, value: Any, where: str, key: str, config: ServeConfig) -> None:
    values = value if isinstance(value, list) else [value]
    if not values:
        return
    if all(isinstance(v, bool) or isinstance(v, int) for v in values):
        feature.int64_list.value.extend(int(v) for v in values)
    elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        feature.float_list.value.extend(float(v) for v in values)
    else:
        data = [_bytes_value(v, f"{where}.{key}") for v in values]
        if key == "text":
            for d in data:
                check_text(d, f"{where}.{key}", config)
        feature.bytes_list.value.extend(data)


def parse_classify(body: Mapping[str, Any], config: ServeConfig) -> tuple[str, np.ndarray]:
    """Classify request -> (signature_name or "", serialized tf.train.Example per example)."""
    from tensorflow.core.example import example_pb2

    signature_name = body.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise InvalidArgument("'signature_name' must be a string")
    examples = body.get("examples")
    if examples is None:
        raise InvalidArgument("Missing 'examples' key")
    if not isinstance(examples, list):
        raise InvalidArgument(f"'examples' must be a list of objects, got {_describe(examples)}")
    _check_rows(len(examples), config)
    context = body.get("context", {})
    if not isinstance(context, dict):
        raise InvalidArgument("'context' must be an object of features")
    serialized = np.empty(len(examples), dtype=object)
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise InvalidArgument(f"examples[{i}]: expected an object of features, got {_describe(ex)}")
        proto = example_pb2.Example()
        for key, value in {**context, **ex}.items():
            _feature(proto.features.feature[key], value, f"examples[{i}]", key, config)
        serialized[i] = proto.SerializeToString()
    return signature_name, serialized


def format_classify(classes: np.ndarray, scores: np.ndarray) -> dict[str, Any]:
    results = []
    for row_classes, row_scores in zip(classes, scores.tolist()):
        results.append([[c.decode("utf-8"), s] for c, s in zip(row_classes, row_scores)])
    return {"results": results}


# -- friendly API ------------------------------------------------------------------------------


def parse_sentiment(body: Mapping[str, Any], config: ServeConfig) -> list[str]:
    """`{"texts": ["...", ...]}` -> texts."""
    texts = body.get("texts")
    if texts is None:
        raise InvalidArgument("Missing 'texts' key: expected {\"texts\": [\"review\", ...]}")
    if not isinstance(texts, list):
        raise InvalidArgument(f"'texts' must be a list of strings, got {_describe(texts)}")
    _check_rows(len(texts), config)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidArgument(f"texts[{i}]: expected a string, got {_describe(text)}")
        check_text(text.encode("utf-8", "surrogatepass"), f"texts[{i}]", config)
    return texts
