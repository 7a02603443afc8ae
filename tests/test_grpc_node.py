"""A second gRPC client implementation: Node's `@grpc/grpc-js` (its own HTTP/2 stack, not grpcio's
C core) calls Predict, ModelInfer, health and a call past its deadline on a real `python -m serve`,
through tests/node/check.js; the answers must be those grpcio gets.

The packages come from npm (`npm ci`, pinned by tests/node/package-lock.json). Where Node or npm
is missing the test skips, saying so, unless SERVE_REQUIRE_NODE is set (CI sets it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import grpc
import pytest
import tensorflow as tf
from conftest import MODEL_NAME
from serve_process import REPO, ServerProcess
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

pytestmark = pytest.mark.slow

NODE_DIR = REPO / "tests" / "node"
REVIEWS = ["a wonderful film, great acting", "dull and far too long"]
DELAY_S = 1.0
"""Each call of the slow model takes this long, so a 0.2 s deadline passes while it runs."""


def _unavailable(why: str) -> None:
    if os.environ.get("SERVE_REQUIRE_NODE"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def node_client() -> list[str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _unavailable("node and npm are needed for the @grpc/grpc-js client (Debian: apt-get install nodejs npm)")
    installed = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=NODE_DIR,
                               capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        _unavailable(f"npm ci in {NODE_DIR} failed:\n{installed.stderr[-2000:]}")
    return [node, str(NODE_DIR / "check.js")]


def _grpcio_predict(target: str) -> predict_pb2.PredictResponse:
    with grpc.insecure_channel(target) as channel:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        request.inputs["text"].CopyFrom(tf.make_tensor_proto(REVIEWS))
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)


def test_grpc_js_gets_the_answers_grpcio_gets(node_client, slow_model, tmp_path):
    server = ServerProcess(slow_model(DELAY_S), "--poll-interval", "0", grpc=True, log_path=tmp_path / "serve.log")
    try:
        run = subprocess.run([*node_client, server.grpc_target, MODEL_NAME, *REVIEWS], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "DEADLINE_S": "0.2"})
        assert run.returncode == 0, run.stderr[-3000:]
        node = json.loads(run.stdout.strip().splitlines()[-1])
        expected = _grpcio_predict(server.grpc_target)
    finally:
        assert server.stop() == 0, server.log()
    labels = [b.decode() for b in tf.make_ndarray(expected.outputs["label"]).ravel()]
    probabilities = tf.make_ndarray(expected.outputs["probabilities"]).ravel().tolist()
    assert node["predict"]["model"] == MODEL_NAME
    assert node["predict"]["labels"] == labels
    assert node["predict"]["probabilities"] == pytest.approx(probabilities, abs=1e-6)
    infer = node["infer"]
    assert infer["id"] == "node-1"
    assert infer["outputs"]["label"]["values"] == labels
    assert infer["outputs"]["label"]["shape"] == [len(REVIEWS)]
    assert infer["outputs"]["probabilities"]["values"] == pytest.approx(probabilities, abs=1e-6)
    assert node["health"] == "SERVING"
    assert node["unknown_model"]["code"] == "NOT_FOUND" and "no-such-model" in node["unknown_model"]["details"]
    assert node["past_deadline"] == "DEADLINE_EXCEEDED"
    assert "Traceback" not in server.log(full=True)
