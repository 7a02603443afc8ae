"""The REST port's app: one routing table of TF Serving's REST API (`v1_endpoints`), the Open
Inference Protocol (`v2_endpoints`) and the web page, over one shared `ServingCore`."""

from __future__ import annotations

from serve.config import ServeConfig
from serve.core.dataplane import ServingCore
from serve.http import v1_endpoints, v2_endpoints, web
from serve.http.routing import App


def create_app(config: ServeConfig, core: ServingCore) -> App:
    """The REST port's app on a shared core (started by the caller, on the serving loop)."""
    return App(
        v1_endpoints.routes(v1_endpoints.RestApi(config, core)) + v2_endpoints.routes(v2_endpoints.V2Api(core))
        + web.routes(web.WebPage(core.default_model)),
        metrics=core.metrics,
        max_body_bytes=config.max_body_bytes,
        cors_origins=config.cors_origins,
        access_log_enabled=config.access_log,
    )

