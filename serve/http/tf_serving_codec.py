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

from common.versions import version_number
from serve.core.dataplane import CLASSIFY_FEATURES, EXPLAIN_CONTRIBUTIONS, EXPLAIN_NGRAMS, check_rows
from serve.core.dtypes import NUMPY_DTYPES, bytes_array
from serve.core.errors import InvalidArgument
from serve.core.loaded_model import Signature

# The URL grammar of TF Serving's http_rest_api_handler.cc (case-insensitive).
_PREDICT_RE = re.compile(
    r"(?i)/v1/models/([^/:]+)(?:(?:/versions/([0-9]+))|(?:/labels/([^/:]+)))?:(classify|regress|predict|explain)"
)
_STATUS_RE = re.compile(r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/([0-9]+))|(?:/labels/([^/:]+)))?(?:/(metadata))?")


@dataclass(frozen=True)
class ModelPath:
    name: str
    version: int | None
    label: str | None
    verb: str | None
    """`predict`, `classify`, `regress`, `explain` for POST; `metadata` or None (status) for GET."""


CACHED_PATH_CHARS = 256
"""Paths up to this long are remembered (clients repeat the same few); longer ones are parsed each
time, so the cache cannot be grown by clients sending long made-up model names."""


def parse_model_path(method: str, raw_path: str) -> ModelPath:
    """Match a /v1/models/... path (raw, still URL-encoded) like TF Serving; names are URL-decoded."""
    if len(raw_path) <= CACHED_PATH_CHARS:
        return _cached_model_path(method, raw_path)
    return _model_path(method, raw_path)


def _model_path(method: str, raw_path: str) -> ModelPath:
    regex = _PREDICT_RE if method == "POST" else _STATUS_RE
    match = regex.fullmatch(raw_path)
    if match is None or (method != "POST" and match.group(1) is None):
        raise InvalidArgument(f"Malformed request: {method} {urllib.parse.unquote(raw_path)}")
    name, version, label, verb = match.groups()
    number = version_number(version) if version is not None else None
    if version is not None and number is None:
        raise InvalidArgument(f"Malformed request: version {version} is too large")
    return ModelPath(
        name=urllib.parse.unquote(name),
        version=number,
        label=urllib.parse.unquote(label) if label is not None else None,
        verb=verb.lower() if verb else None,
    )


_cached_model_path = functools.lru_cache(maxsize=1024)(_model_path)

VALUES_PER_ROW = 64
"""JSON values (objects, arrays, strings, numbers...) a request body may hold per row it may send."""
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def max_json_values(max_rows: int) -> int:
    """The most JSON values a request body may hold: what decoding costs is the number of Python
    objects it builds (a 4 MB body is 1.3M empty lists, or 1M one-letter strings), not its bytes."""
    return VALUES_PER_ROW * max_rows + 64


def check_json_values(raw: bytes, limit: int) -> None:
    """InvalidArgument if `raw` would decode into more than `limit` values, in a few milliseconds
    for 4 MB. Every value but the first follows a comma or opens a container, so commas plus
    brackets bound the count; when that bound is too high, the strings (each a pair of unescaped
    quotes) are counted, and if they are few, skipped, since commas and brackets inside them are
    text, and the rest is counted again."""
    if raw.count(b",") + raw.count(b"{") + raw.count(b"[") <= limit:
        return
    count = (raw.count(b'"') - raw.count(b'\\"')) // 2  # at least half the strings, whatever their text
    if count <= limit:
        bare = _JSON_STRING.sub(b"", raw)  # at most 2 x limit strings to skip
        count = bare.count(b",") + bare.count(b"{") + bare.count(b"[")
    if count > limit:
        raise InvalidArgument(f"request body holds about {count} JSON values, more than the limit of {limit} "
                              f"({VALUES_PER_ROW} per row of --max-rows-per-request): send fewer per request")


def parse_json(raw: bytes, max_rows: int | None = None) -> dict[str, Any]:
    """Body bytes -> JSON object; non-UTF-8, invalid JSON and non-objects are InvalidArgument.
    With `max_rows`, a body that would build more values than such a request needs is refused
    before it is decoded."""
    if not raw:
        raise InvalidArgument("request body is empty: expected a JSON object")
    if max_rows is not None:
        check_json_values(raw, max_json_values(max_rows))
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


def parse_predict(
    body: Mapping[str, Any], signature: Signature, max_rows: int
) -> tuple[dict[str, np.ndarray], bool]:
    """Predict request -> (input arrays by name, row_format). The row count is checked against
    `max_rows` before any row is converted."""
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
        check_rows(len(instances), max_rows)
        if len(names) == 1 and signature.inputs[names[0]].dtype == "DT_STRING":
            texts = _texts(instances)
            if texts is not None:  # the common request: a list of strings for a one-string-input model
                return {names[0]: texts}, True
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
        values = by_name[n] if isinstance(by_name[n], list) else [by_name[n]]
        check_rows(len(values), max_rows)
        arrays[n] = _column(n, values, signature.inputs[n].dtype, f"inputs[{n!r}]")
    return arrays, False


def _texts(values: list[Any]) -> np.ndarray | None:
    """A list of JSON strings as an object array of UTF-8 bytes in one pass; None if any value is
    something else (b64 objects, numbers: the general path says what is wrong where)."""
    try:
        encoded = [value.encode("utf-8", "surrogatepass") for value in values]
    except AttributeError:
        return None
    return bytes_array(encoded)


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


def format_explain(outputs: Mapping[str, np.ndarray], row_format: bool) -> dict[str, Any]:
    """The explain signature's answer with each row's n-grams and contributions cut to its own
    (the signature pads them to the longest review of the call)."""
    kept = [int(n) for n in (outputs[EXPLAIN_NGRAMS] != b"").sum(axis=1)]
    columns = {name: _jsonable(name, array) for name, array in outputs.items()}
    for name in (EXPLAIN_NGRAMS, EXPLAIN_CONTRIBUTIONS):
        columns[name] = [row[:n] for row, n in zip(columns[name], kept)]
    if row_format:
        names = list(columns)
        return {"predictions": [dict(zip(names, row)) for row in zip(*columns.values())]}
    return {"outputs": columns}


# -- classify ----------------------------------------------------------------------------------


def _feature(feature, value: Any, where: str):  # noqa: ANN001, ANN202 - a tf.train.Feature
    """A JSON feature value (a value or a list of them) written into `feature`, which is returned."""
    values = value if isinstance(value, list) else [value]
    if not values:
        return feature
    if all(isinstance(v, (bool, int)) for v in values):
        feature.int64_list.value.extend(int(v) for v in values)
    elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        feature.float_list.value.extend(float(v) for v in values)
    else:
        feature.bytes_list.value.extend(_bytes_value(v, where) for v in values)
    return feature


def parse_classify(body: Mapping[str, Any], max_rows: int) -> tuple[str, list[dict], dict]:
    """Classify request -> (signature_name or "", per-example features, context features).

    Only the features the model reads (`CLASSIFY_FEATURES`) are converted, and the example count is
    checked first: a large context or many empty examples cost nothing. The core merges the
    context into each example."""
    from tensorflow.core.example import feature_pb2  # TensorFlow is loaded with the model by now

    name = signature_name(body, default="")
    examples = _rows(body, "examples", "Missing 'examples' key", "objects", max_rows)
    context = body.get("context", {})
    if not isinstance(context, dict):
        raise InvalidArgument("'context' must be an object of features")

    def features(values: dict, where: str) -> dict:
        out = {}
        for key in CLASSIFY_FEATURES:
            if key in values:
                out[key] = _feature(feature_pb2.Feature(), values[key], f"{where}.{key}")
        return out

    rows = []
    for i, ex in enumerate(examples):
        if not isinstance(ex, dict):
            raise InvalidArgument(f"examples[{i}]: expected an object of features, got {describe(ex)}")
        rows.append(features(ex, f"examples[{i}]"))
    return name, rows, features(context, "context")


def _rows(body: Mapping[str, Any], key: str, missing: str, items: str, max_rows: int) -> list:
    """The list of rows under `key`, its length checked before any row is looked at."""
    value = body.get(key)
    if value is None:
        raise InvalidArgument(missing)
    if not isinstance(value, list):
        raise InvalidArgument(f"'{key}' must be a list of {items}, got {describe(value)}")
    check_rows(len(value), max_rows)
    return value


def format_classify(classes: np.ndarray, scores: np.ndarray) -> dict[str, Any]:
    results = []
    for row_classes, row_scores in zip(classes.tolist(), scores):  # scores stay float32 (see dumps)
        results.append([[c.decode("utf-8"), s] for c, s in zip(row_classes, row_scores)])
    return {"results": results}


# -- friendly API ------------------------------------------------------------------------------


def parse_sentiment(body: Mapping[str, Any], max_rows: int) -> list[bytes]:
    """`{"texts": ["...", ...]}` -> UTF-8 texts (checked by the core)."""
    texts = _rows(body, "texts", "Missing 'texts' key: expected {\"texts\": [\"review\", ...]}", "strings", max_rows)
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidArgument(f"texts[{i}]: expected a string, got {describe(text)}")
        out.append(text.encode("utf-8", "surrogatepass"))
    return out
