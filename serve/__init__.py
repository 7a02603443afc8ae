"""Serving stage: a TF-Serving-compatible REST server for the exported sentiment SavedModel.

`ServingCore` (model registry + dynamic batcher + metrics) is shared by every frontend;
`create_app(config, core)` builds the Flask REST app; `serve(config)` runs it under waitress.
"""

import logging

from serve.app import create_app
from serve.config import ServeConfig
from serve.core import ServingCore

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["ServeConfig", "ServingCore", "create_app"]
