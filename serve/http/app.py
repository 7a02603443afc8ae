"""The REST port's app: one routing table of TF Serving's REST API (`tf_serving`), the Open
Inference Protocol (`v2`) and the web page, over one shared `ServingCore`."""

from __future__ import annotations

from serve.config import ServeConfig
from serve.core.dataplane import ServingCore
from serve.http import tf_serving, v2, web
from serve.http.routing import App


def create_app(config: ServeConfig, core: ServingCore) -> App:
    """The REST port's app on a shared core (started by the caller, on the serving loop)."""
    return App(
        tf_serving.routes(tf_serving.RestApi(config, core)) + v2.routes(v2.V2Api(core))
        + web.routes(web.WebPage(core.default_model)),
        metrics=core.metrics,
        max_body_bytes=config.max_body_bytes,
        cors_origins=config.cors_origins,
        access_log_enabled=config.access_log,
        authorizer=core.auth,
    )

