"""OpenAPI 3.1 description of every route the REST server serves (served at /openapi.json).

The document is made from what the server serves now: the model names, the row limit, and the
signatures of the default model's latest version (its text input, its outputs, whether it has
classify or regress signatures). Request schemas say exactly what the server accepts, as far as
JSON Schema can: a generated request that fits the schema is answered, one that does not is a
4xx (schemathesis checks both directions in the test suite). What JSON Schema cannot say is in the
descriptions: text limits in UTF-8 bytes, `{"b64": ...}` values, V2 binary tensor data.
"""

from __future__ import annotations

from typing import Any

from common.tf_serving import CLASSIFY_METHOD, EXPLAIN_SIGNATURE, REGRESS_METHOD
from common.versions import MAX_VERSION
from serve.core.loaded_model import Signature

_ERROR = {"$ref": "#/components/responses/Error"}
_VERSION = {"name": "version", "in": "path", "required": True,
            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_VERSION}}
_LABEL = {"name": "label", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
_V1_PREFIXES = {"/v1/models/{model}": [], "/v1/models/{model}/versions/{version}": [_VERSION],
                "/v1/models/{model}/labels/{label}": [_LABEL]}
_V2_PREFIXES = {"/v2/models/{model}": [], "/v2/models/{model}/versions/{version}": [_VERSION]}
V2_TENSOR_SIZES = 4
"""V2 request schemas list BYTES tensors of 1..this many texts (JSON Schema cannot tie a shape to
its data's length); the server takes any number up to --max-rows-per-request."""

TEXT = {"type": "string", "pattern": "[^\\t\\n\\x0b\\x0c\\r ]",
        "description": "A review: at least one character that is not ASCII whitespace, at most "
                       "--max-text-bytes bytes of UTF-8. Binary strings may be sent as {\"b64\": ...}."}


def openapi_spec(model_names: list[str], max_rows: int, signatures: dict[str, Signature] | None = None, *,
                 bearer: bool = False, metrics_open: bool = False) -> dict:
    """The document for models `model_names` (the first is the default) whose latest version of the
    default model has `signatures` (None while nothing is loaded: generic request schemas); with
    `bearer` (--auth-token-file), the token every operation but the probes (and the metrics, when
    `metrics_open`) needs, and its 401."""
    model = {"name": "model", "in": "path", "required": True, "description": "Model name (URL-encoded).",
             "schema": {"type": "string", "enum": model_names}, "example": model_names[0] if model_names else ""}
    schemas = _schemas(max_rows, signatures)
    paths: dict[str, Any] = {}
    for prefix, params in _V1_PREFIXES.items():
        paths.update(_v1_model_paths(prefix, [model, *params], schemas))
    for prefix, params in _V2_PREFIXES.items():
        paths.update(_v2_model_paths(prefix, [model, *params]))
    paths.update(_server_paths())
    document = {
        "openapi": "3.1.0",
        "info": {"title": "sentiment-dtensor serving API", "version": "1", "description": (
            "TensorFlow Serving compatible REST API (routes case-insensitive), the Open Inference Protocol "
            f"(KServe V2) and a friendly sentiment endpoint. Serving {', '.join(repr(n) for n in model_names)}.")},
        "paths": paths,
        "components": {"schemas": schemas, "responses": {"Error": {
            "description": "Error", "content": {"application/json": {"schema": _ref("Error")}}}}},
    }
    if bearer:
        _add_bearer(document, metrics_open)
    return document


_OPEN_PATHS = {"/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"}
_METRICS_PATH = "/monitoring/prometheus/metrics"


def _add_bearer(document: dict, metrics_open: bool) -> None:
    document["components"]["securitySchemes"] = {"bearer": {
        "type": "http", "scheme": "bearer", "description": "A token of the server's --auth-token-file."}}
    document["security"] = [{"bearer": []}]
    for path, item in document["paths"].items():
        open_ = path in _OPEN_PATHS or path.endswith("/ready") or (metrics_open and path == _METRICS_PATH)
        for operation in item.values():
            if open_:
                operation["security"] = []
            else:
                operation["responses"]["401"] = _ERROR


def _v1_model_paths(prefix: str, parameters: list, schemas: dict) -> dict[str, Any]:
    paths = {
        prefix: {"get": {"summary": "Model version status (TF Serving GetModelStatus)", "parameters": parameters,
                         "responses": {"200": _json_ref("ModelStatus"), **_errors(400, 404)}}},
        f"{prefix}/metadata": {"get": {
            "summary": "Signature metadata (TF Serving GetModelMetadata)", "parameters": parameters,
            "responses": {"200": _json_ref("ModelMetadata"), **_errors(400, 404, 503)}}},
        f"{prefix}/monitoring": {"get": {
            "summary": "Drift monitoring: the served reviews' statistics in rolling windows against the held-out "
                       "reviews the export describes, every worker's windows summed (not in TF Serving)",
            "parameters": parameters, "responses": {"200": _json_ref("Monitoring"), **_errors(400, 404, 503)}}},
        f"{prefix}:predict": {"post": _post("Predict (TF Serving REST predict; row or columnar format)",
                                            parameters, "PredictRequest", "PredictResponse")},
    }
    if "ClassifyRequest" in schemas:
        paths[f"{prefix}:classify"] = {"post": _post("Classify tf.Examples (TF Serving REST classify)",
                                                     parameters, "ClassifyRequest", "ClassifyResponse")}
    if "ExplainRequest" in schemas:
        paths[f"{prefix}:explain"] = {"post": _post(
            "Explain: each text's n-grams with their contribution to the predicted class's log-odds (KServe V1's "
            "verb, TF Serving's request body; the explain signature)", parameters, "ExplainRequest", "ExplainResponse")}
    if "RegressRequest" in schemas:
        paths[f"{prefix}:regress"] = {"post": _post("Regress tf.Examples (TF Serving REST regress)",
                                                    parameters, "RegressRequest", "Status")}
    return paths


def _v2_model_paths(prefix: str, parameters: list) -> dict[str, Any]:
    return {
        prefix: {"get": {"summary": "V2 model metadata (the serving_default signature's tensors)",
                         "parameters": parameters, "responses": {"200": _json_ref("Status"), **_errors(400, 404)}}},
        f"{prefix}/ready": {"get": {"summary": "V2 model readiness", "parameters": parameters,
                                    "responses": {"200": _json_ref("Status"), **_errors(400, 404, 503)}}},
        f"{prefix}/infer": {"post": {
            **_post("V2 inference: BYTES inputs as JSON data, or as binary tensor data after the JSON "
                    "(Inference-Header-Content-Length header); outputs selection", parameters, "V2InferRequest",
                    "Status"),
            "responses": {"200": {"description": "Outputs as JSON, or JSON then binary tensor data", "content": {
                "application/json": {"schema": _ref("Status")}, "application/octet-stream": {}}},
                **_errors(400, 404, 413, 429, 503, 504)}}},
    }


def _server_paths() -> dict[str, Any]:
    def get(summary: str, schema: str = "Status", *errors: int) -> dict:
        return {"get": {"summary": summary, "responses": {"200": _json_ref(schema), **_errors(*errors)}}}

    return {
        "/v1/models": get("Every model and the status of its versions", "ModelList"),
        "/v1/sentiment": {"post": _post("Sentiment of each text with the latest version", [], "SentimentRequest",
                                        "SentimentResponse")},
        "/v2": get("Open Inference Protocol (KServe V2): server metadata"),
        "/v2/health/live": get("V2 liveness"),
        "/v2/health/ready": get("V2 readiness: the models the server waits for are loaded", "Status", 400),
        "/healthz": get("Liveness"),
        "/readyz": get("Readiness: the models are loaded and warm, not shutting down", "Status", 503),
        "/monitoring/prometheus/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}}}},
    }


def _post(summary: str, parameters: list, request: str, response: str) -> dict[str, Any]:
    return {"summary": summary, "parameters": parameters,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": _json_ref(response), **_errors(400, 404, 413, 429, 503, 504)}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _ERROR for c in codes}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_ref(name: str) -> dict[str, Any]:
    return {"description": name, "content": {"application/json": {"schema": _ref(name)}}}


# -- request schemas -------------------------------------------------------------------------------


def _text_signature(signatures: dict[str, Signature] | None) -> Signature | None:
    """serving_default, when it takes one string tensor of texts (what this project exports)."""
    signature = (signatures or {}).get("serving_default")
    if signature is None or len(signature.inputs) != 1:
        return None
    (info,) = signature.inputs.values()
    return signature if info.dtype == "DT_STRING" and info.shape in (None, (-1,)) else None


def _schemas(max_rows: int, signatures: dict[str, Signature] | None) -> dict[str, Any]:
    rows = {"type": "array", "minItems": 1, "maxItems": max_rows}
    schemas = dict(_RESPONSES)
    schemas["SentimentRequest"] = {"type": "object", "properties": {"texts": {**rows, "items": TEXT}},
                                   "required": ["texts"]}
    signature = _text_signature(signatures)
    if signature is None:  # nothing loaded yet, or a model of another kind: describe the shape only
        schemas["PredictRequest"] = {"type": "object", "description": "Exactly one of instances or inputs."}
        schemas["V2InferRequest"] = {"type": "object", "required": ["inputs"]}
        schemas["ClassifyRequest"] = {"type": "object", "required": ["examples"]}
        return schemas
    (name,) = signature.inputs
    schemas["PredictRequest"] = _predict_request(name, rows)
    schemas["V2InferRequest"] = _v2_infer_request(name, sorted(signature.outputs))
    if EXPLAIN_SIGNATURE in signatures:
        explain = _predict_request(name, rows)
        explain["properties"]["signature_name"] = {"enum": ["", EXPLAIN_SIGNATURE]}
        schemas["ExplainRequest"] = explain
    classify = [n for n, s in sorted(signatures.items()) if s.method_name == CLASSIFY_METHOD]
    if classify:
        schemas["ClassifyRequest"] = _classify_request(rows, classify)
    if any(s.method_name == REGRESS_METHOD for s in signatures.values()):
        schemas["RegressRequest"] = {"type": "object", "required": ["examples"]}
    return schemas


def _predict_request(name: str, rows: dict) -> dict[str, Any]:
    named = {"type": "object", "properties": {name: TEXT}, "required": [name], "additionalProperties": False}
    column = {"oneOf": [{**rows, "items": TEXT}, TEXT]}
    return {
        "type": "object",
        "description": "Exactly one of instances (row format) or inputs (columnar format).",
        "properties": {
            "signature_name": {"enum": ["", "serving_default"]},
            "instances": {**rows, "items": {"oneOf": [TEXT, named]}},
            "inputs": {"oneOf": [*column["oneOf"], {"type": "object", "properties": {name: column},
                                                     "required": [name], "additionalProperties": False}]},
        },
        "oneOf": [{"required": ["instances"]}, {"required": ["inputs"]}],
    }


def _classify_request(rows: dict, signature_names: list[str]) -> dict[str, Any]:
    """Each example's text, or the context's for examples without one; other features are ignored."""
    text = {"oneOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 1}]}
    with_text = {"type": "object", "properties": {"text": text}}
    return {
        "type": "object",
        "properties": {"signature_name": {"enum": ["", *signature_names]}, "context": with_text,
                       "examples": {**rows, "items": with_text}},
        "required": ["examples"],
        "anyOf": [{"properties": {"examples": {"items": {"required": ["text"]}}}},
                  {"required": ["context"], "properties": {"context": {"required": ["text"]}}}],
    }


def _v2_infer_request(name: str, outputs: list[str]) -> dict[str, Any]:
    def tensor(n: int) -> dict:
        return {"type": "object", "required": ["name", "datatype", "shape", "data"], "properties": {
            "name": {"const": name}, "datatype": {"const": "BYTES"}, "shape": {"const": [n]},
            "data": {"type": "array", "items": TEXT, "minItems": n, "maxItems": n},
            "parameters": {"type": "object", "not": {"required": ["binary_data_size"]}}}}

    flag = {"type": "boolean"}
    return {"type": "object", "required": ["inputs"], "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object", "properties": {"binary_data_output": flag}},
        "inputs": {"type": "array", "minItems": 1, "maxItems": 1,
                   "items": {"anyOf": [tensor(n) for n in range(1, V2_TENSOR_SIZES + 1)]}},
        "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"enum": outputs}, "parameters": {"type": "object", "properties": {"binary_data": flag}}}}},
    }}


_RESPONSES: dict[str, Any] = {
    "Error": {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]},
    "Status": {"type": "object", "additionalProperties": True},
    "ModelStatus": {"type": "object", "properties": {"model_version_status": {"type": "array", "items": {
        "type": "object", "properties": {
            "version": {"type": "string"},
            "state": {"enum": ["START", "LOADING", "AVAILABLE", "UNLOADING", "END"]},
            "status": {"type": "object", "properties": {"error_code": {"type": "string"},
                                                        "error_message": {"type": "string"}}},
        }}}}},
    "ModelList": {"type": "object", "properties": {"models": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "model_version_status": {
            "$ref": "#/components/schemas/ModelStatus/properties/model_version_status"}}}}}},
    "ModelMetadata": {"type": "object", "properties": {
        "model_spec": {"type": "object", "properties": {
            "name": {"type": "string"}, "signature_name": {"type": "string"}, "version": {"type": "string"}}},
        "metadata": {"type": "object", "properties": {"signature_def": {"type": "object", "properties": {
            "signature_def": {"type": "object", "additionalProperties": {"type": "object"}}}}}},
    }},
    "Monitoring": {"type": "object", "required": ["model", "versions"], "properties": {
        "model": {"type": "string"},
        "versions": {"type": "array", "items": {"type": "object", "required": ["version", "monitoring"], "properties": {
            "version": {"type": "string"},
            "monitoring": {"type": "string", "description": "on, or why not (off: ...)"},
            "baseline": {"type": "object", "description": "the held-out reviews: shares, bins' edges, bounds"},
            "reviews_total": {"type": "integer"},
            "windows": {"type": "object", "description": "reviews: the last N reviews; seconds: the last T seconds",
                        "additionalProperties": {"type": "object", "properties": {
                            "reviews": {"type": "integer"},
                            "verdict": {"enum": ["warming_up", "ok", "drifting"]},
                            "summary": {"type": "string"},
                            "unlike_training_share": {"type": ["number", "null"]},
                            "low_confidence_share": {"type": ["number", "null"]},
                            "statistics": {"type": "object", "additionalProperties": {"type": "object", "properties": {
                                "psi": {"type": "number"},
                                "shares": {"type": "array", "items": {"type": "number"}},
                                "baseline_shares": {"type": "array", "items": {"type": "number"}}}}}}}},
            "workers": {"type": "array", "items": {"type": "object"}, "description": "each worker's own scores"},
        }}},
    }},
    "PredictResponse": {"type": "object", "properties": {
        "predictions": {"type": "array", "items": {"type": "object", "properties": {
            "probabilities": {"type": "array", "items": {"type": "number"}},
            "logits": {"type": "array", "items": {"type": "number"}},
            "label": {"type": "string"}}}},
        "outputs": {"type": "object"},
    }},
    "ExplainResponse": {"type": "object", "properties": {
        "predictions": {"type": "array", "items": {"type": "object", "properties": {
            "label": {"type": "string"},
            "probabilities": {"type": "array", "items": {"type": "number"}},
            "ngrams": {"type": "array", "items": {"type": "string"}, "description": "most supporting first"},
            "contributions": {"type": "array", "items": {"type": "number"}},
            "bias": {"type": "number", "description": "sum(contributions) + bias = ln(p_label / p_other)"}}}},
        "outputs": {"type": "object"},
    }},
    "ClassifyResponse": {"type": "object", "properties": {"results": {"type": "array", "items": {
        "type": "array", "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                   "description": "[label, score]"}}}}},
    "SentimentResponse": {"type": "array", "items": {"type": "object", "properties": {
        "label": {"enum": ["negative", "positive"]},
        "score": {"type": "number", "description": "Probability of label"},
        "probabilities": {"type": "object", "properties": {"negative": {"type": "number"},
                                                          "positive": {"type": "number"}}},
    }}},
}
