"""Flask application factory: TF Serving REST, friendly API, health, metrics, OpenAPI blueprints.

Handlers only translate HTTP <-> plain values (serve.protocol) and call the shared ServingCore.
`GET /` is deliberately left free (a web page is served there by another component).
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from typing import Any

from flask import Blueprint, Flask, Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from serve import protocol
from serve.config import ServeConfig
from serve.core import ServingCore
from serve.errors import InvalidArgument, NotFound, ServingError, TooLarge
from serve.metrics import CONTENT_TYPE_LATEST
from serve.models import CLASSIFY_METHOD, REGRESS_METHOD
from serve.openapi import openapi_spec
from serve.web import web

log = logging.getLogger(__name__)
access_log = logging.getLogger("serve.access")

JSON = "application/json"


class AppState:
    """Per-app state: the shared core, plus in-flight accounting for graceful drain."""

    def __init__(self, config: ServeConfig, core: ServingCore) -> None:
        self.config = config
        self.core = core
        self._lock = threading.Lock()
        self.in_flight = 0

    def enter(self, method: str) -> None:
        with self._lock:
            self.in_flight += 1
        self.core.metrics.in_flight.inc()
        if method == "POST":
            self.core.request_started()

    def leave(self) -> None:
        self.core.request_finished()
        with self._lock:
            self.in_flight -= 1
        self.core.metrics.in_flight.dec()


def _state() -> AppState:
    return current_app.extensions["serve"]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(protocol.dumps(obj), status=status, mimetype=JSON, headers=headers)


def _body() -> dict[str, Any]:
    return protocol.parse_json(request.get_data(cache=False))


# -- TF Serving REST ---------------------------------------------------------------------------

tfserving = Blueprint("tfserving", __name__)


@tfserving.route("/v1/models/<path:rest>", methods=["GET", "POST"])
def models_api(rest: str) -> Response:
    state = _state()
    core, config = state.core, state.config
    raw = request.environ.get("REQUEST_URI") or urllib.parse.quote(request.path)
    path = protocol.parse_model_path(request.method, urllib.parse.urlsplit(raw).path)
    g.route = path.verb or "status"
    if request.method == "GET":
        if path.verb == "metadata":
            model = core.model(path.name, path.version, path.label)
            return json_response({
                "model_spec": {"name": path.name, "signature_name": "", "version": str(model.version)},
                "metadata": {"signature_def": {"signature_def": model.signature_def_json}},
            })
        if path.name != config.model_name:
            raise NotFound(f"Could not find any versions of model {path.name}")
        version = core.registry.label_version(path.label) if path.label is not None else path.version
        statuses = core.registry.status(version)
        return json_response({"model_version_status": [
            {"version": str(s.version), "state": s.state,
             "status": {"error_code": s.error_code, "error_message": s.error_message}}
            for s in statuses
        ]})

    model = core.model(path.name, path.version, path.label)
    body = _body()
    if path.verb == "predict":
        signature_name = body.get("signature_name") or "serving_default"
        if not isinstance(signature_name, str):
            raise InvalidArgument("'signature_name' must be a string")
        signature = model.signature(signature_name)
        inputs, row_format = protocol.parse_predict(body, signature, config)
        outputs = core.run(model, signature_name, inputs)
        return json_response(protocol.format_predict(outputs, row_format))
    if path.verb == "classify":
        signature_name, examples = protocol.parse_classify(body, config)
        signature = model.signature_for_method(CLASSIFY_METHOD, signature_name)
        (input_name,) = signature.inputs
        outputs = core.run(model, signature.name, {input_name: examples})
        return json_response(protocol.format_classify(outputs["classes"], outputs["scores"]))
    # :regress
    signature_name = body.get("signature_name", "")
    model.signature_for_method(REGRESS_METHOD, signature_name if isinstance(signature_name, str) else "")
    raise InvalidArgument("regression is not supported by this server")


# -- friendly API ------------------------------------------------------------------------------

friendly = Blueprint("friendly", __name__)


@friendly.route("/v1/sentiment", methods=["POST"])
def sentiment() -> Response:
    g.route = "sentiment"
    state = _state()
    texts = protocol.parse_sentiment(_body(), state.config)
    version, results = state.core.predict_texts(texts)
    return json_response(
        [{"label": r.label, "score": r.score, "probabilities": r.probabilities} for r in results],
        headers={"X-Model-Version": str(version)},
    )


# -- health, metrics, OpenAPI ------------------------------------------------------------------

health = Blueprint("health", __name__)


@health.route("/healthz", methods=["GET"])
def healthz() -> Response:
    g.route = "healthz"
    return json_response({"status": "ok"})


@health.route("/readyz", methods=["GET"])
def readyz() -> Response:
    g.route = "readyz"
    core = _state().core
    if core.draining:
        return json_response({"error": "not ready: shutting down"}, 503)
    if not core.registry.ready:
        return json_response({"error": "not ready: no model version loaded and warmed up yet"}, 503)
    return json_response({"status": "ready", "model": core.config.model_name,
                          "versions": [str(v) for v in core.registry.live_versions]})


monitoring = Blueprint("monitoring", __name__)


@monitoring.route("/monitoring/prometheus/metrics", methods=["GET"])
def metrics() -> Response:
    g.route = "metrics"
    return Response(_state().core.metrics.render(), mimetype=CONTENT_TYPE_LATEST)


docs = Blueprint("docs", __name__)


@docs.route("/openapi.json", methods=["GET"])
def openapi() -> Response:
    g.route = "openapi"
    return json_response(openapi_spec(_state().config))


# -- the factory -------------------------------------------------------------------------------


class _CaseInsensitivePrefix:
    """TF Serving matches its routes case-insensitively; normalise the fixed prefixes."""

    _PREFIXES = ("/v1/models/", "/v1/sentiment")

    def __init__(self, wsgi_app, state: AppState) -> None:
        self.wsgi_app = wsgi_app
        self.state = state

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        lower = path[:14].lower()
        for prefix in self._PREFIXES:
            if lower.startswith(prefix) and not path.startswith(prefix):
                environ["PATH_INFO"] = prefix + path[len(prefix):]
        self.state.enter(environ.get("REQUEST_METHOD", ""))
        try:
            return self.wsgi_app(environ, start_response)
        finally:
            self.state.leave()


def create_app(config: ServeConfig, core: ServingCore | None = None) -> Flask:
    """Build the REST app. Pass a shared `core` (started by the caller); without one a core is
    created and started here (loading in the background)."""
    if core is None:
        core = ServingCore(config).start()
    app = Flask("serve")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    state = AppState(config, core)
    app.extensions["serve"] = state
    for blueprint in (tfserving, friendly, health, monitoring, docs, web):
        app.register_blueprint(blueprint)
    app.wsgi_app = _CaseInsensitivePrefix(app.wsgi_app, state)

    @app.before_request
    def _start() -> None:
        g.start = time.perf_counter()

    @app.after_request
    def _finish(response: Response) -> Response:
        route = g.get("route", "other")
        core.metrics.requests.labels(route, str(response.status_code)).inc()
        if "start" in g:
            elapsed = time.perf_counter() - g.start
            core.metrics.latency.labels(route).observe(elapsed)
            if config.access_log:
                access_log.info('%s "%s %s" %d %.1fms', request.remote_addr, request.method,
                                request.full_path.rstrip("?"), response.status_code, elapsed * 1e3)
        if config.cors_origins:
            _add_cors(response, config.cors_origins)
        return response

    @app.errorhandler(ServingError)
    def _serving_error(exc: ServingError) -> Response:
        headers = {"Retry-After": "1"} if exc.http_status in (429, 503) else None
        return json_response(exc.to_json(), exc.http_status, headers)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        if exc.code == 413:
            return _serving_error(TooLarge(f"request body larger than the limit of {config.max_body_bytes} bytes"))
        response = json_response({"error": f"{exc.name}: {exc.description}"}, exc.code or 500)
        if exc.code == 405 and exc.valid_methods:
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.errorhandler(Exception)
    def _internal(exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return json_response({"error": f"internal error: {type(exc).__name__}"}, 500)

    return app


def _add_cors(response: Response, origins: tuple[str, ...]) -> None:
    origin = request.headers.get("Origin")
    if not origin:
        return
    if "*" in origins:
        response.headers["Access-Control-Allow-Origin"] = "*"
    elif origin in origins:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")
    else:
        return
    if request.method == "OPTIONS":
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        response.headers["Access-Control-Allow-Headers"] = request.headers.get(
            "Access-Control-Request-Headers", "Content-Type")
        response.headers["Access-Control-Max-Age"] = "600"
    response.headers["Access-Control-Expose-Headers"] = "X-Model-Version"
