"""TF Serving's SavedModel contract, written by export and read by serve: method names, the warm-up
file, the signature names. TensorFlow-free, so the server's HTTP layer may import it."""

from __future__ import annotations

import os

CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
DEFAULT_SIGNATURE = "serving_default"
CLASSIFY_SIGNATURE = "classify"
EXPLAIN_SIGNATURE = "explain"
"""Predict-method signature: each review's n-grams with their contribution to the answer."""
ASSETS_EXTRA = "assets.extra"
WARMUP_FILE = os.path.join(ASSETS_EXTRA, "tf_serving_warmup_requests")
"""Inside a version directory: PredictionLog records TF Serving replays before serving the version."""
