"""OpenAPI 3.1 description of every route the REST server serves (served at /openapi.json)."""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/responses/Error"}
_PREFIXES = {
    "/v1/models/{model}": [],
    "/v1/models/{model}/versions/{version}": [
        {"name": "version", "in": "path", "required": True, "schema": {"type": "integer"}}
    ],
    "/v1/models/{model}/labels/{label}": [
        {"name": "label", "in": "path", "required": True, "schema": {"type": "string"}}
    ],
}
_MODEL_PARAM = {
    "name": "model", "in": "path", "required": True, "schema": {"type": "string"},
    "description": "Model name (URL-encoded).",
}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _ERROR for c in codes}


def openapi_spec(model_names: list[str]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for prefix, params in _PREFIXES.items():
        parameters = [_MODEL_PARAM, *params]
        paths[prefix] = {"get": {
            "summary": "Model version status (TF Serving GetModelStatus)", "parameters": parameters,
            "responses": {"200": _json_ref("ModelStatus"), **_errors(400, 404)},
        }}
        paths[f"{prefix}/metadata"] = {"get": {
            "summary": "Signature metadata (TF Serving GetModelMetadata)", "parameters": parameters,
            "responses": {"200": _json_ref("ModelMetadata"), **_errors(400, 404, 503)},
        }}
        paths[f"{prefix}:predict"] = {"post": {
            "summary": "Predict (TF Serving REST predict; row or columnar format)", "parameters": parameters,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("PredictRequest")}}},
            "responses": {"200": _json_ref("PredictResponse"), **_errors(400, 404, 413, 429, 503, 504)},
        }}
        paths[f"{prefix}:classify"] = {"post": {
            "summary": "Classify tf.Examples (TF Serving REST classify)", "parameters": parameters,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ClassifyRequest")}}},
            "responses": {"200": _json_ref("ClassifyResponse"), **_errors(400, 404, 413, 429, 503, 504)},
        }}
        paths[f"{prefix}:regress"] = {"post": {
            "summary": "Regress (the sentiment model has no regression signature: 400)", "parameters": parameters,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ClassifyRequest")}}},
            "responses": _errors(400, 404),
        }}
    paths["/v1/models"] = {"get": {
        "summary": "Every model and the status of its versions", "responses": {"200": _json_ref("ModelList")},
    }}
    paths["/v1/sentiment"] = {"post": {
        "summary": "Sentiment of each text with the latest version",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("SentimentRequest")}}},
        "responses": {"200": _json_ref("SentimentResponse"), **_errors(400, 413, 429, 503, 504)},
    }}
    paths["/v2"] = {"get": {"summary": "Open Inference Protocol (KServe V2): server metadata",
                            "responses": {"200": _json_ref("Status")}}}
    paths["/v2/health/live"] = {"get": {"summary": "V2 liveness", "responses": {"200": _json_ref("Status")}}}
    paths["/v2/health/ready"] = {"get": {"summary": "V2 readiness: every model has a version loaded",
                                         "responses": {"200": _json_ref("Status"), **_errors(400)}}}
    for prefix, params in (("/v2/models/{model}", []), ("/v2/models/{model}/versions/{version}", _PREFIXES[
            "/v1/models/{model}/versions/{version}"])):
        parameters = [_MODEL_PARAM, *params]
        paths[prefix] = {"get": {"summary": "V2 model metadata (the serving_default signature's tensors)",
                                 "parameters": parameters, "responses": {"200": _json_ref("Status"), **_errors(400, 404)}}}
        paths[f"{prefix}/ready"] = {"get": {"summary": "V2 model readiness", "parameters": parameters,
                                            "responses": {"200": _json_ref("Status"), **_errors(400, 404, 503)}}}
        paths[f"{prefix}/infer"] = {"post": {
            "summary": "V2 inference: BYTES inputs as JSON data or binary tensor data "
                       "(Inference-Header-Content-Length), outputs selection", "parameters": parameters,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("V2InferRequest")}}},
            "responses": {"200": _json_ref("Status"), **_errors(400, 404, 413, 429, 503, 504)}}}
    paths["/healthz"] = {"get": {"summary": "Liveness", "responses": {"200": _json_ref("Status")}}}
    paths["/readyz"] = {"get": {
        "summary": "Readiness: a version is loaded and warm, not shutting down",
        "responses": {"200": _json_ref("Status"), **_errors(503)},
    }}
    paths["/monitoring/prometheus/metrics"] = {"get": {
        "summary": "Prometheus metrics",
        "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    }}
    paths["/openapi.json"] = {"get": {
        "summary": "This document", "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}},
    }}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "sentiment-dtensor serving API",
            "version": "1",
            "description": (
                "TensorFlow Serving compatible REST API (routes case-insensitive) plus a friendly "
                f"sentiment endpoint. Serving {', '.join(repr(n) for n in model_names)}."
            ),
        },
        "paths": paths,
        "components": {"schemas": _SCHEMAS, "responses": {"Error": {
            "description": "Error", "content": {"application/json": {"schema": _ref("Error")}},
        }}},
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_ref(name: str) -> dict[str, Any]:
    return {"description": name, "content": {"application/json": {"schema": _ref(name)}}}


_STRING_OR_B64 = {"oneOf": [{"type": "string"}, {"type": "object", "properties": {"b64": {"type": "string"}}, "required": ["b64"]}]}

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]},
    "Status": {"type": "object", "additionalProperties": True},
    "ModelStatus": {"type": "object", "properties": {"model_version_status": {"type": "array", "items": {
        "type": "object", "properties": {
            "version": {"type": "string"},
            "state": {"enum": ["START", "LOADING", "AVAILABLE", "UNLOADING", "END"]},
            "status": {"type": "object", "properties": {"error_code": {"type": "string"}, "error_message": {"type": "string"}}},
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
    "PredictRequest": {"type": "object", "properties": {
        "signature_name": {"type": "string", "default": "serving_default"},
        "instances": {"type": "array", "items": {"oneOf": [
            _STRING_OR_B64, {"type": "object", "properties": {"text": _STRING_OR_B64}}]}},
        "inputs": {"oneOf": [{"type": "array", "items": _STRING_OR_B64},
                             {"type": "object", "additionalProperties": {"type": "array"}}]},
    }, "description": "Exactly one of instances (row format) or inputs (columnar format)."},
    "PredictResponse": {"type": "object", "properties": {
        "predictions": {"type": "array", "items": {"type": "object", "properties": {
            "probabilities": {"type": "array", "items": {"type": "number"}},
            "logits": {"type": "array", "items": {"type": "number"}},
            "label": {"type": "string"}}}},
        "outputs": {"type": "object"},
    }},
    "ClassifyRequest": {"type": "object", "properties": {
        "signature_name": {"type": "string"},
        "context": {"type": "object"},
        "examples": {"type": "array", "items": {"type": "object", "properties": {"text": _STRING_OR_B64}}},
    }, "required": ["examples"]},
    "ClassifyResponse": {"type": "object", "properties": {"results": {"type": "array", "items": {
        "type": "array", "items": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}]}}}}},
    "V2InferRequest": {"type": "object", "properties": {
        "id": {"type": "string"}, "parameters": {"type": "object"},
        "inputs": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}},
            "datatype": {"type": "string"}, "data": {"type": "array"}, "parameters": {"type": "object"}}}},
        "outputs": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }, "required": ["inputs"]},
    "SentimentRequest": {"type": "object", "properties": {
        "texts": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}}, "required": ["texts"]},
    "SentimentResponse": {"type": "array", "items": {"type": "object", "properties": {
        "label": {"enum": ["negative", "positive"]},
        "score": {"type": "number", "description": "Probability of label"},
        "probabilities": {"type": "object", "properties": {"negative": {"type": "number"}, "positive": {"type": "number"}}},
    }}},
}
