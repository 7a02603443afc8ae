"""Bearer tokens (--auth-token-file, --admin-token-file) against a real `python -m serve`, with the
real clients: requests, grpcio's metadata, tritonclient's headers over both protocols, TF Serving's
own ModelService stub for model management; the token file rotated on disk while the server runs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from conftest import MODEL_NAME
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import REPO, ServerProcess
from tensorflow_serving.apis import (get_model_metadata_pb2, model_management_pb2, model_service_pb2_grpc,
                                     predict_pb2, prediction_service_pb2_grpc)

from serve.core.auth import TokenFile, TokenFileError, read_tokens

pytestmark = pytest.mark.slow

API_TOKENS = ("first-api-token-0123456789", "second-api-token-0123456789")
ADMIN_TOKEN = "admin-token-0123456789abcdef"
PREDICT = f"/v1/models/{MODEL_NAME}:predict"
BODY = {"instances": ["a wonderful film"]}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def server(model_base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    tokens, admin = tmp / "tokens", tmp / "admin-tokens"
    tokens.write_text("# API tokens, one per line\n" + "\n".join(API_TOKENS) + "\n")
    admin.write_text(ADMIN_TOKEN + "\n")
    srv = ServerProcess(model_base, "--poll-interval", "0", "--model-management", "--auth-token-file", str(tokens),
                        "--admin-token-file", str(admin), grpc=True, log_path=tmp / "serve.log")
    srv.token_file = tokens
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(full=True)
    assert not any(t in srv.log(full=True) for t in (*API_TOKENS, ADMIN_TOKEN))  # never logged


def test_rest_needs_a_token_except_for_probes_and_the_page(server):
    for headers in ({}, bearer("not-a-token-at-all-0123"), {"Authorization": API_TOKENS[0]},
                    {"Authorization": f"Basic {API_TOKENS[0]}"}, bearer(ADMIN_TOKEN)):
        r = requests.post(server.url + PREDICT, json=BODY, headers=headers, timeout=10)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json() == {"error": "a valid bearer token is required (Authorization: Bearer TOKEN)"}
    for token in API_TOKENS:
        r = requests.post(server.url + PREDICT, json=BODY, headers=bearer(token), timeout=10)
        assert r.status_code == 200 and r.json()["predictions"][0]["label"] in ("positive", "negative")
    for path in (f"/v1/models/{MODEL_NAME}", f"/v1/models/{MODEL_NAME}/metadata", "/v1/models",
                 "/monitoring/prometheus/metrics", f"/v2/models/{MODEL_NAME}", "/v2", "/openapi.json"):
        assert requests.get(server.url + path, timeout=10).status_code == 401, path
        assert requests.get(server.url + path, headers=bearer(API_TOKENS[1]), timeout=10).status_code == 200, path
    for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL_NAME}/ready", "/"):
        assert requests.get(server.url + path, timeout=10).status_code == 200, path
    spec = requests.get(server.url + "/openapi.json", headers=bearer(API_TOKENS[0]), timeout=10).json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert spec["security"] == [{"bearer": []}] and spec["paths"]["/readyz"]["get"]["security"] == []
    assert "401" in spec["paths"]["/v1/models/{model}:predict"]["post"]["responses"]

    import tritonclient.http as triton_http
    from tritonclient.utils import InferenceServerException

    with triton_http.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        tensor = triton_http.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"a wonderful film"], dtype=object))
        assert client.infer(MODEL_NAME, [tensor], headers=bearer(API_TOKENS[0])).as_numpy("label")[0] in (
            b"positive", b"negative")
        with pytest.raises(InferenceServerException, match="bearer token"):
            client.infer(MODEL_NAME, [tensor])


def test_grpc_needs_a_token_in_its_metadata(server):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = MODEL_NAME
    request.inputs["text"].CopyFrom(tf.make_tensor_proto(["a wonderful film"]))
    with grpc.insecure_channel(server.grpc_target) as channel:
        predict = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),),
                         (("authorization", f"Bearer {ADMIN_TOKEN}"),)):
            with pytest.raises(grpc.RpcError) as info:
                predict.Predict(request, metadata=metadata, timeout=20)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        answer = predict.Predict(request, metadata=(("authorization", f"Bearer {API_TOKENS[0]}"),), timeout=20)
        assert answer.outputs["label"].string_val[0] in (b"positive", b"negative")
        metadata_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        metadata_request.model_spec.name = MODEL_NAME
        with pytest.raises(grpc.RpcError) as info:
            predict.GetModelMetadata(metadata_request, timeout=20)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token

        management = model_service_pb2_grpc.ModelServiceStub(channel)
        reload = model_management_pb2.ReloadConfigRequest()
        entry = reload.config.model_config_list.config.add()
        entry.name, entry.base_path, entry.model_platform = MODEL_NAME, str(server_base(server)), "tensorflow"
        with pytest.raises(grpc.RpcError) as info:  # an API token may not manage models
            management.HandleReloadConfigRequest(reload, metadata=(("authorization", f"Bearer {API_TOKENS[0]}"),),
                                                 timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        done = management.HandleReloadConfigRequest(reload, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
                                                    timeout=60)
        assert done.status.error_code == 0

    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    with triton_grpc.InferenceServerClient(server.grpc_target) as client:
        assert client.is_server_ready() and client.is_model_ready(MODEL_NAME)  # open, as the REST probes
        tensor = triton_grpc.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"a wonderful film"], dtype=object))
        token = {"authorization": f"Bearer {API_TOKENS[1]}"}  # gRPC metadata keys are lower case
        assert client.infer(MODEL_NAME, [tensor], headers=token).as_numpy("label")[0] in (
            b"positive", b"negative")
        with pytest.raises(InferenceServerException, match="bearer token"):
            client.infer(MODEL_NAME, [tensor])


def server_base(server: ServerProcess) -> str:
    return server.proc.args[server.proc.args.index("--model-dir") + 1]


def test_a_rotated_token_file_takes_effect_without_a_restart(server):
    original = server.token_file.read_text()
    new = "rotated-api-token-0123456789"
    try:
        server.token_file.write_text(f"{API_TOKENS[1]}\n{new}\n")  # the first token retired, a new one added
        end = time.monotonic() + 10
        while requests.post(server.url + PREDICT, json=BODY, headers=bearer(new), timeout=10).status_code != 200:
            assert time.monotonic() < end, server.log()
            time.sleep(0.1)
        assert requests.post(server.url + PREDICT, json=BODY, headers=bearer(API_TOKENS[0]), timeout=10).status_code == 401
        server.token_file.write_text("short\n")  # broken: logged, and the tokens already read stay
        end = time.monotonic() + 10
        while "keeping the tokens already read" not in server.log(full=True):
            requests.post(server.url + PREDICT, json=BODY, headers=bearer(new), timeout=10)
            assert time.monotonic() < end, server.log()
            time.sleep(0.1)
        assert requests.post(server.url + PREDICT, json=BODY, headers=bearer(new), timeout=10).status_code == 200
    finally:
        server.token_file.write_text(original)


@pytest.mark.parametrize("args, message", [
    (("--auth-token-file", "{missing}"), "--auth-token-file {missing}: cannot read it"),
    (("--auth-token-file", "{short}"), "every token must be at least 16 printable ASCII characters"),
    (("--auth-token-file", "{empty}"), "holds no token (one per line)"),
    (("--auth-token-file", "{good}", "--model-management"), "--model-management with --auth-token-file needs "
                                                            "--admin-token-file"),
    (("--metrics-open",), "--admin-token-file and --metrics-open only apply with --auth-token-file"),
])
def test_unusable_token_flags_stop_the_start_with_a_clear_message(model_base, tmp_path, args, message):
    files = {"missing": tmp_path / "nope", "short": tmp_path / "short", "empty": tmp_path / "empty",
             "good": tmp_path / "good"}
    files["short"].write_text("tooshort\n")
    files["empty"].write_text("# nothing\n\n")
    files["good"].write_text(API_TOKENS[0])
    args = [a.format(**files) for a in args]
    done = subprocess.run([sys.executable, "-m", "serve", "--model-dir", str(model_base), "--port", "0", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message.format(**files) in done.stderr and "Traceback" not in done.stderr


def test_token_files_read_one_token_per_line(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\n\n  spaced-token-0123456789  \r\nother-token-0123456789\n")
    assert read_tokens("--auth-token-file", str(path)) == (b"spaced-token-0123456789", b"other-token-0123456789")
    tokens = TokenFile("--auth-token-file", str(path))
    assert tokens.accepts("Bearer other-token-0123456789") and tokens.accepts(b"bearer  spaced-token-0123456789")
    assert not tokens.accepts("Bearer other-token-012345678") and not tokens.accepts(None)
    assert not tokens.accepts("Token other-token-0123456789")
    path.write_text("tab\tin-the-middle-0123456789\n")
    with pytest.raises(TokenFileError, match="printable ASCII"):
        read_tokens("--auth-token-file", str(path))


def test_metrics_open_leaves_only_the_metrics_without_a_token(tmp_path):
    from serve.core.auth import Authorizer
    from serve.http.routing import App, Request, Response, Route

    async def ok(_request):
        return Response(b"{}")

    path = tmp_path / "tokens"
    path.write_text(API_TOKENS[0])

    class Metrics:
        in_flight = 0

    def status(app: App, target: str, headers=()) -> int:  # noqa: ANN001
        request = Request("GET", target, list(headers), max_body=10)
        return asyncio.run(app(request)).status

    routes = [Route.of("metrics", "GET", "/metrics", ok, scope="metrics"), Route.of("models", "GET", "/models", ok),
              Route.of("healthz", "GET", "/healthz", ok, scope="open")]
    for metrics_open, metrics_status in ((True, 200), (False, 401)):
        app = App(routes, metrics=Metrics(), max_body_bytes=10,
                  authorizer=Authorizer(TokenFile("--auth-token-file", str(path)), None, metrics_open))
        assert (status(app, "/metrics"), status(app, "/models"), status(app, "/healthz")) == (metrics_status, 401, 200)
        assert status(app, "/models", [(b"authorization", f"Bearer {API_TOKENS[0]}".encode())]) == 200
