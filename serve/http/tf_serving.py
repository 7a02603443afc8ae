"""TF Serving's REST API (the V1 protocol), the friendly API, health, metrics and OpenAPI.

Handlers decode HTTP into plain values (`serve.http.tf_serving_codec`), call the shared `ServingCore`, and
encode its answer; the core validates and raises neutral errors that `serve.http.routing` maps to HTTP.
"""

from __future__ import annotations

import urllib.parse

from common.tf_serving import REGRESS_METHOD
from common.versions import version_number
from serve.config import ServeConfig
from serve.core.dataplane import ServingCore, explain_signature
from serve.core.errors import InvalidArgument, ServingError
from serve.core.metrics import CONTENT_TYPE_LATEST
from serve.http import tf_serving_codec as protocol
from serve.http.openapi import openapi_spec
from serve.http.routing import Request, Response, Route, error_body, json_response


class RestApi:
    """Handlers bound to one core."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self.core = core

    # -- TF Serving REST ---------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        path = protocol.parse_model_path(request.method, request.raw_path)
        request.route_label = path.verb or "status"
        if request.method == "GET":
            return self._metadata(path) if path.verb == "metadata" else self._status(path)
        core = self.core
        max_rows = self.config.max_rows_per_request
        with core.receiving(path.name):
            model = core.model(path.name, path.version, path.label)
            body = protocol.parse_json(await request.body(), max_rows)
            if path.verb in ("predict", "explain"):
                if path.verb == "predict":
                    signature_name, answer = protocol.signature_name(body), protocol.format_predict
                else:
                    signature_name = explain_signature(model, protocol.signature_name(body, default="")).name
                    answer = protocol.format_explain  # each row's n-grams cut to its own
                inputs, row_format = protocol.parse_predict(body, model.signature(signature_name), max_rows)
            elif path.verb == "classify":
                signature_name, examples, context = protocol.parse_classify(body, max_rows)
            else:
                model.signature_for_method(REGRESS_METHOD, protocol.signature_name(body, default=""))
                raise InvalidArgument("regression is not supported by this server")
        if path.verb in ("predict", "explain"):
            row_label = protocol.instances_label if row_format else protocol.inputs_label
            outputs = await core.predict(model, signature_name, inputs, row_label=row_label)
            return json_response(answer(outputs, row_format))
        _, outputs = await core.classify(model, signature_name, examples, context)
        return json_response(protocol.format_classify(outputs["classes"], outputs["scores"]))

    def _status(self, path: protocol.ModelPath) -> Response:
        statuses = self.core.status(path.name, path.version, path.label)
        return json_response({"model_version_status": [_status_json(s) for s in statuses]})

    async def list_models(self, _request: Request) -> Response:
        """Every model with its versions' status (what TF Serving users asked for in serving#795)."""
        return json_response({"models": [{"name": name, "model_version_status": [_status_json(s) for s in statuses]}
                                          for name, statuses in self.core.model_statuses().items()]})

    def _metadata(self, path: protocol.ModelPath) -> Response:
        model = self.core.model(path.name, path.version, path.label)
        return json_response({
            "model_spec": {"name": path.name, "signature_name": "", "version": str(model.version)},
            "metadata": {"signature_def": {"signature_def": model.signature_def_json}},
        })

    async def monitoring(self, request: Request) -> Response:
        """Drift monitoring of a model's live versions, or of one (`serve.core.monitor.describe`)."""
        match = request.match
        name = urllib.parse.unquote(match["name"])
        version = label = None
        kind = (match["kind"] or "").lower()
        if kind == "versions":
            version = version_number(match["which"])
            if version is None:
                raise InvalidArgument(f"Malformed request: version {match['which']} is not a version number")
        elif kind == "labels":
            label = urllib.parse.unquote(match["which"])
        return json_response(await self.core.monitoring(name, version, label))

    # -- friendly API ------------------------------------------------------------------------

    async def sentiment(self, request: Request) -> Response:
        max_rows = self.config.max_rows_per_request
        with self.core.receiving(self.core.default_model):
            texts = protocol.parse_sentiment(protocol.parse_json(await request.body(), max_rows), max_rows)
        version, results = await self.core.sentiment(texts)
        return json_response(
            [{"label": r.label, "score": r.score, "probabilities": r.probabilities} for r in results],
            headers=[(b"x-model-version", str(version).encode())],
        )

    # -- health, metrics, OpenAPI ------------------------------------------------------------

    async def healthz(self, _request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(self, _request: Request) -> Response:
        state = self.core.readiness()
        if not state.ready:
            if state.draining:
                return Response(error_body("not ready: shutting down"), 503)
            names = state.waiting or state.unavailable
            what = "no model version loaded and warmed up yet" if len(state.live_versions) == 1 else (
                f"no version of {', '.join(names)} loaded and warmed up yet")
            return Response(error_body(f"not ready: {what}"), 503)
        default = self.core.default_model
        return json_response({"status": "ready", "model": default,
                              "versions": [str(v) for v in state.live_versions.get(default, [])],
                              "models": {n: [str(v) for v in vs] for n, vs in state.live_versions.items()},
                              **({"unavailable": state.unavailable} if state.unavailable else {})})

    async def metrics(self, _request: Request) -> Response:
        return Response(await self.core.metrics_text(), content_type=CONTENT_TYPE_LATEST.encode())

    async def openapi(self, _request: Request) -> Response:
        try:
            signatures = self.core.model(self.core.default_model).signatures
        except ServingError:
            signatures = None  # nothing loaded yet
        auth = self.core.auth
        return json_response(openapi_spec(list(self.core.models), self.config.max_rows_per_request, signatures,
                                          bearer=auth.enabled, metrics_open=auth.metrics_open))


def _status_json(status) -> dict:  # noqa: ANN001 - a registry.VersionStatus
    return {"version": str(status.version), "state": status.state,
            "status": {"error_code": status.error_code, "error_message": status.error_message}}


MODEL_VERB = r"(?i)/v1/models/[^/:]+(?:/(?:versions|labels)/[^/:]+)?:[^/]*"
"""`:predict`, `:classify`, `:regress` (POST only); other verbs are matched here and refused as malformed."""
MODEL_RESOURCE = r"(?i)/v1/models/[^/:]+(?:/(?:versions|labels)/[^/:]+)?(?:/metadata)?"
"""Status and metadata (GET only)."""
MONITORING = r"(?i)/v1/models/(?P<name>[^/:]+)(?:/(?P<kind>versions|labels)/(?P<which>[^/:]+))?/monitoring"
"""Drift monitoring (GET only; not in TF Serving)."""


def routes(api: RestApi) -> list[Route]:
    """TF Serving's REST API, the friendly API, health, metrics and OpenAPI."""
    return [
        Route.of("list_models", "GET", r"(?i)/v1/models/?", api.list_models),
        Route.of("monitoring", "GET", MONITORING, api.monitoring, raw=True),
        Route.of("models", "POST", MODEL_VERB, api.models, raw=True),
        Route.of("models", "GET", MODEL_RESOURCE, api.models, raw=True),
        Route.of("sentiment", "POST", r"(?i)/v1/sentiment", api.sentiment),
        Route.of("healthz", "GET", r"/healthz", api.healthz, scope="open"),
        Route.of("readyz", "GET", r"/readyz", api.readyz, scope="open"),
        Route.of("metrics", "GET", r"/monitoring/prometheus/metrics", api.metrics, scope="metrics"),
        Route.of("openapi", "GET", r"/openapi.json", api.openapi),
    ]
