"""TLS on both ports against a real `python -m serve`, with the real clients: `requests` and curl
over HTTPS, grpcio's `ssl_channel_credentials` with and without a client certificate, and
tritonclient over both protocols; mTLS; certificates replaced on disk while connections stay open;
plaintext clients on a TLS port. The certificates are made here (`tls_certs`)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from conftest import MODEL_NAME
from serve_process import REPO, ServerProcess
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc
from tls_certs import make_pki

pytestmark = pytest.mark.slow

PREDICT = f"/v1/models/{MODEL_NAME}:predict"
BODY = {"instances": ["a wonderful film"]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_server(model_base, pki, *args: str, cert: tuple[str, str] | None = None, **kwargs) -> ServerProcess:
    """A server whose ports both speak TLS (its `url` is https://localhost:PORT)."""
    tls = {"verify": str(pki.ca), **({"cert": cert} if cert else {})}
    return ServerProcess(model_base, "--poll-interval", "0", "--tls-cert", str(pki.server_cert), "--tls-key",
                         str(pki.server_key), *args, grpc=True, tls=tls, **kwargs)


def grpc_predict(target: str, credentials: grpc.ChannelCredentials, text: str = "a wonderful film") -> str:
    with grpc.secure_channel(target.replace("127.0.0.1", "localhost"), credentials) as channel:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = MODEL_NAME
        request.inputs["text"].CopyFrom(tf.make_tensor_proto([text]))
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=20)
        return answer.outputs["label"].string_val[0].decode()


def test_both_ports_over_tls_with_the_real_clients(model_base, pki, tmp_path):
    srv = tls_server(model_base, pki, log_path=tmp_path / "serve.log")
    try:
        expected = requests.post(srv.url + PREDICT, json=BODY, verify=str(pki.ca), timeout=10).json()
        assert expected["predictions"][0]["label"] in ("positive", "negative")
        with pytest.raises(requests.exceptions.SSLError):  # a client that does not trust the CA
            requests.post(srv.url + PREDICT, json=BODY, timeout=10)
        curl = subprocess.run(["curl", "-s", "--cacert", str(pki.ca), srv.url + PREDICT, "-d", json.dumps(BODY)],
                              capture_output=True, text=True, timeout=30)
        assert json.loads(curl.stdout) == expected, curl.stderr

        trusted = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        assert grpc_predict(srv.grpc_target, trusted) == expected["predictions"][0]["label"]

        import tritonclient.grpc as triton_grpc
        import tritonclient.http as triton_http

        texts = np.array([b"a wonderful film"], dtype=object)
        with triton_http.InferenceServerClient(f"localhost:{srv.port}", ssl=True,
                                               ssl_options={"ca_certs": str(pki.ca)}) as c:
            tensor = triton_http.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(texts)
            assert c.infer(MODEL_NAME, [tensor]).as_numpy("label")[0].decode() == expected["predictions"][0]["label"]
        with triton_grpc.InferenceServerClient(srv.grpc_target.replace("127.0.0.1", "localhost"), ssl=True,
                                               root_certificates=str(pki.ca)) as c:
            tensor = triton_grpc.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(texts)
            assert c.infer(MODEL_NAME, [tensor]).as_numpy("label")[0].decode() == expected["predictions"][0]["label"]

        with ssl.create_default_context(cafile=str(pki.ca)).wrap_socket(
                socket.create_connection(("127.0.0.1", int(srv.grpc_target.rsplit(":", 1)[1]))),
                server_hostname="localhost") as tls:
            assert tls.selected_alpn_protocol() is None  # the client offered none; the port still answers
        alpn = ssl.create_default_context(cafile=str(pki.ca))
        alpn.set_alpn_protocols(["h2", "http/1.1"])
        for port, protocol in ((srv.port, "http/1.1"), (int(srv.grpc_target.rsplit(":", 1)[1]), "h2")):
            with alpn.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost") as tls:
                assert tls.selected_alpn_protocol() == protocol

        for _ in range(30):  # plaintext clients: a clear answer, a clean close, one log line
            r = requests.get(srv.url.replace("https://", "http://") + "/healthz", timeout=10)
            assert (r.status_code, r.text) == (400, "This port speaks HTTPS: use an https:// URL.\n")
        with pytest.raises(grpc.RpcError) as info:  # at once, not at the deadline
            with grpc.insecure_channel(srv.grpc_target) as channel:
                prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(predict_pb2.PredictRequest(),
                                                                                   timeout=20)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    finally:
        assert srv.stop() == 0, srv.log()
    log = srv.log(full=True)
    assert log.count("plaintext request on a TLS port") <= 2, log[-3000:]  # once per port and address
    assert "Traceback" not in log


def test_mutual_tls_asks_every_client_for_a_certificate(model_base, pki, tmp_path):
    srv = tls_server(model_base, pki, "--tls-client-ca", str(pki.ca), log_path=tmp_path / "serve.log",
                     cert=(str(pki.client_cert), str(pki.client_key)))
    try:
        cert = (str(pki.client_cert), str(pki.client_key))
        assert requests.post(srv.url + PREDICT, json=BODY, verify=str(pki.ca), cert=cert, timeout=10).ok
        # refused in the handshake (TLS 1.3 tells the client after it: a closed connection, or an SSLError)
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.post(srv.url + PREDICT, json=BODY, verify=str(pki.ca), timeout=10)
        with_cert = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                                 pki.client_cert.read_bytes())
        assert grpc_predict(srv.grpc_target, with_cert) in ("positive", "negative")
        with pytest.raises(grpc.RpcError) as info:
            grpc_predict(srv.grpc_target, grpc.ssl_channel_credentials(pki.ca.read_bytes()))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        stranger = make_pki(tmp_path / "stranger", "stranger")  # a certificate from a CA the server does not trust
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.post(srv.url + PREDICT, json=BODY, verify=str(pki.ca),
                          cert=(str(stranger.client_cert), str(stranger.client_key)), timeout=10)
    finally:
        assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(full=True)


def test_replaced_certificates_reach_new_connections_and_spare_open_ones(model_base, pki, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    cert_path, key_path = live / "server.pem", live / "server.key"
    shutil.copy(pki.server_cert, cert_path)
    shutil.copy(pki.server_key, key_path)
    srv = ServerProcess(model_base, "--poll-interval", "0", "--tls-cert", str(cert_path), "--tls-key", str(key_path),
                        log_path=tmp_path / "serve.log", tls={"verify": str(pki.ca)})
    try:
        old = http.client.HTTPSConnection("localhost", srv.port, timeout=10,
                                          context=ssl.create_default_context(cafile=str(pki.ca)))
        old.request("POST", PREDICT, json.dumps(BODY))
        answer = old.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["predictions"]
        assert old.sock is not None  # this keep-alive connection stays open

        rotated = make_pki(tmp_path / "rotated", "rotated")
        for source, target in ((rotated.server_cert, cert_path), (rotated.server_key, key_path)):
            shutil.copy(source, target.with_suffix(".new"))
            os.replace(target.with_suffix(".new"), target)  # as a secret volume swaps its files
        end = time.monotonic() + 20
        while True:
            try:
                requests.get(srv.url + "/healthz", verify=str(rotated.ca), timeout=5)
                break
            except requests.exceptions.SSLError:
                assert time.monotonic() < end, srv.log()
                time.sleep(0.2)
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(srv.url + "/healthz", verify=str(pki.ca), timeout=5)
        sock = old.sock
        old.request("POST", PREDICT, json.dumps(BODY))  # the connection made before still works
        assert old.getresponse().status == 200 and old.sock is sock
        old.close()

        cert_path.write_text("not a certificate")  # a broken replacement: the last good one stays
        end = time.monotonic() + 20
        while "keeping the certificate already in use" not in srv.log():
            requests.get(srv.url + "/healthz", verify=str(rotated.ca), timeout=5)
            assert time.monotonic() < end, srv.log()
            time.sleep(0.2)
        assert requests.get(srv.url + "/healthz", verify=str(rotated.ca), timeout=5).ok
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("args, message", [
    (("--tls-cert", "{dir}/none.pem", "--tls-key", "{dir}/none.key"), "--tls-cert {dir}/none.pem: no such file"),
    (("--tls-cert", "{dir}/garbage.pem", "--tls-key", "{dir}/garbage.pem"), "--tls-cert {dir}/garbage.pem / --tls-key"),
    (("--tls-cert", "{dir}/garbage.pem"), "--tls-cert and --tls-key go together"),
    (("--tls-client-ca", "{dir}/garbage.pem"), "--tls-client-ca needs --tls-cert and --tls-key"),
])
def test_unusable_tls_flags_stop_the_start_with_a_clear_message(model_base, tmp_path, args, message):
    (tmp_path / "garbage.pem").write_text("garbage")
    args = [a.format(dir=tmp_path) for a in args]
    out = subprocess.run([sys.executable, "-m", "serve", "--model-dir", str(model_base), "--port", "0", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message.format(dir=tmp_path) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
