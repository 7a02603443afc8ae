"""Thousands of random-but-plausible requests against a real `python -m serve`: every answer is a
2xx/4xx JSON (REST, V2) or a client-error gRPC code, never a 5xx, a traceback in the log or a server
path in an answer, and `/healthz` stays fast meanwhile.

REST and V2 are driven by schemathesis from the server's own `/openapi.json` with every check, so
the document and the server must agree in both directions (what the schema allows is answered,
what it forbids is refused); gRPC by a seeded generator of TF Serving and health messages."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import MODEL_NAME
from serve_process import HealthProbe, ServerProcess
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    predict_pb2,
    regression_pb2,
)

pytestmark = pytest.mark.slow

SEED = 20261203


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    srv = ServerProcess(model_base, "--poll-interval", "0", "--version-labels", "stable=1", grpc=True,
                        log_path=tmp_path_factory.mktemp("fuzz") / "serve.log")
    yield srv
    assert srv.stop() == 0, srv.log()


def _clean_log(srv: ServerProcess) -> None:
    log = srv.log(full=True)
    assert "Traceback" not in log and "unhandled error" not in log, log[-5000:]


def test_schemathesis_finds_no_disagreement_between_the_openapi_document_and_the_server(server, tmp_path):
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st, "schemathesis is a test dependency: pip install -e '.[test]'"
    with HealthProbe(server.url) as probe:
        done = subprocess.run(
            [st, "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", "60", "--seed", "1",
             "--generation-codec", "utf-8", "--generation-database", "none", "--workers", "1", "--no-color",
             "--request-timeout", "20"],
            cwd=tmp_path, capture_output=True, text=True, timeout=900)
    summary = done.stdout[-6000:]
    assert done.returncode == 0, summary
    assert " passed" in summary and "failures" not in summary.split("SUMMARY")[-1].lower(), summary
    assert probe.failures == 0 and probe.worst_s < 0.5, f"/healthz took up to {probe.worst_s * 1e3:.0f} ms"
    _clean_log(server)


# -- gRPC --------------------------------------------------------------------------------------------

SERVICE = "/tensorflow.serving.PredictionService/"
TEXTS = [b"a wonderful film", b"", b"   ", b"\xff\xfe", "caf\u00e9 \U0001f600".encode(), b"x" * 200_001, b"bad, dull"]
FEATURE_TEXTS = [t for t in TEXTS if len(t) < 1000]
"""Example features stay small: a thousand examples of 200 KB would only test the client's memory."""
DTYPES = [types_pb2.DT_STRING] * 4 + [types_pb2.DT_FLOAT, types_pb2.DT_INT64, types_pb2.DT_BOOL, types_pb2.DT_HALF,
                                      types_pb2.DT_INT32, 999]
SIZES = [0, 1, 1, 2, 3, 1025, 2**31, 2**62]


class Requests:
    """Plausible TF Serving messages, mostly valid in structure, wrong in some detail."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def spec(self, spec) -> None:  # noqa: ANN001 - a ModelSpec
        rng = self.rng
        spec.name = rng.choice([MODEL_NAME] * 6 + ["", "nope", "x" * 300, "sentiment/../x"])
        if rng.random() < 0.3:
            spec.version.value = rng.choice([0, 1, 1, 2, 2**62])
        elif rng.random() < 0.1:
            spec.version_label = rng.choice(["stable", "canary", ""])
        spec.signature_name = rng.choice(["", "", "serving_default", "classify", "nope"])

    def tensor(self, tensor) -> None:  # noqa: ANN001 - a TensorProto
        rng = self.rng
        tensor.dtype = rng.choice(DTYPES)
        dims = [rng.choice(SIZES) for _ in range(rng.choice([0, 1, 1, 1, 2, 3]))]
        for size in dims:
            tensor.tensor_shape.dim.add().size = size
        count = dims[0] if dims and dims[0] < 5 and rng.random() < 0.7 else rng.randrange(0, 5)
        if rng.random() < 0.05:
            tensor.tensor_shape.unknown_rank = True
        if tensor.dtype == types_pb2.DT_STRING:
            tensor.string_val.extend(rng.choice(TEXTS) for _ in range(count))
        elif rng.random() < 0.5:
            tensor.tensor_content = rng.randbytes(rng.choice([0, 3, 4, 8, 16]))
        else:
            tensor.float_val.extend(rng.random() for _ in range(count))

    def predict(self) -> predict_pb2.PredictRequest:
        request = predict_pb2.PredictRequest()
        self.spec(request.model_spec)
        for _ in range(self.rng.choice([0, 1, 1, 1, 2])):
            self.tensor(request.inputs[self.rng.choice(["text", "text", "inputs", "other"])])
        if self.rng.random() < 0.2:
            request.output_filter.append(self.rng.choice(["label", "probabilities", "nope"]))
        return request

    def examples(self, request) -> None:  # noqa: ANN001 - a Classification/RegressionRequest
        rng = self.rng
        with_context = rng.random() < 0.4
        lists = request.input.example_list_with_context if with_context else request.input.example_list
        if with_context and rng.random() < 0.7:
            self.features(lists.context)
        if rng.random() < 0.05:
            return
        for _ in range(rng.choice([0, 1, 2, 3, 1025])):
            self.features(lists.examples.add())

    def features(self, example) -> None:  # noqa: ANN001 - an Example
        rng = self.rng
        for key in rng.sample(["text", "text", "other", "n"], rng.randrange(0, 3)):
            feature = example.features.feature[key]
            kind = rng.choice(["bytes", "bytes", "bytes", "int", "float", "none"])
            if kind == "bytes":
                feature.bytes_list.value.extend(rng.choice(FEATURE_TEXTS) for _ in range(rng.choice([1, 1, 2, 0])))
            elif kind == "int":
                feature.int64_list.value.extend(range(rng.randrange(0, 50)))
            elif kind == "float":
                feature.float_list.value.append(rng.random())

    def any(self) -> tuple[str, bytes]:
        """(method path, serialized request)."""
        rng = self.rng
        kind = rng.choice(["predict"] * 5 + ["classify"] * 3 + ["regress", "metadata", "status", "health", "garbage"])
        if kind == "predict":
            return SERVICE + "Predict", self.predict().SerializeToString()
        if kind in ("classify", "regress"):
            request = (classification_pb2.ClassificationRequest if kind == "classify"
                       else regression_pb2.RegressionRequest)()
            self.spec(request.model_spec)
            self.examples(request)
            return SERVICE + kind.capitalize(), request.SerializeToString()
        if kind == "metadata":
            request = get_model_metadata_pb2.GetModelMetadataRequest()
            self.spec(request.model_spec)
            request.metadata_field.extend(rng.sample(["signature_def", "signature_def", "other"], rng.randrange(0, 3)))
            return SERVICE + "GetModelMetadata", request.SerializeToString()
        if kind == "status":
            request = get_model_status_pb2.GetModelStatusRequest()
            self.spec(request.model_spec)
            return "/tensorflow.serving.ModelService/GetModelStatus", request.SerializeToString()
        if kind == "health":
            from grpc_health.v1 import health_pb2

            service = rng.choice(["", "tensorflow.serving.PredictionService", "nope"])
            return "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest(service=service).SerializeToString()
        method = rng.choice(["Predict", "Classify", "GetModelMetadata", "Nope"])
        return SERVICE + method, rng.randbytes(rng.randrange(1, 64))


ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_grpc_fuzz_gets_client_error_codes_only(server, model_base):
    channel = grpc.insecure_channel(server.grpc_target)
    generator = Requests(SEED)
    codes: dict[str, int] = {}
    with HealthProbe(server.url) as probe:
        for i in range(3000):
            method, payload = generator.any()
            call = channel.unary_unary(method)
            try:
                call(payload, timeout=30)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
            assert code in ALLOWED, f"request {i} to {method}: {code} {details!r}"
            assert str(model_base) not in details and "Traceback" not in details, details
            codes[code.name] = codes.get(code.name, 0) + 1
    print("gRPC answers:", codes)
    assert codes.get("OK", 0) > 100 and codes.get("INVALID_ARGUMENT", 0) > 100  # both kinds were reached
    assert probe.failures == 0 and probe.worst_s < 0.5, f"/healthz took up to {probe.worst_s * 1e3:.0f} ms"
    _clean_log(server)
