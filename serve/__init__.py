"""Serving stage: TF Serving's REST and gRPC APIs for the exported sentiment SavedModel.

`ServingCore` (models + validation + batcher + metrics) is shared by every protocol edge;
`create_app(config, core)` builds the REST port's app, `serve(config)` runs everything on uvloop
(REST on its HTTP/1.1 protocol, gRPC on its HTTP/2 one). Importing this package imports neither TensorFlow nor the HTTP layer.
"""

import logging

from serve.config import ServeConfig

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["ServeConfig", "ServingCore", "create_app", "serve"]


def __getattr__(name: str):
    """Heavier pieces on first use, so `python -m serve --help` stays instant."""
    if name == "ServingCore":
        from serve.core.dataplane import ServingCore

        return ServingCore
    if name == "create_app":
        from serve.http.app import create_app

        return create_app
    if name == "serve":
        from serve.server import serve

        return serve
    raise AttributeError(f"module 'serve' has no attribute {name!r}")
