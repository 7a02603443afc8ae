"""The client library and CLI against a server that speaks TLS, asks for client certificates
(optional) and needs a bearer token, over each of the three transports; and the clear errors a user
gets for a CA that does not sign the server's certificate or a missing token."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import MODEL_NAME
from serve_process import REPO, ServerProcess
from tls_certs import make_pki

from client import NotAuthorized, SentimentClient, ServerUnavailable, TlsError

pytestmark = pytest.mark.slow

TOKEN = "client-test-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(model_base, pki, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secure")
    tokens = tmp / "tokens"
    tokens.write_text(TOKEN + "\n")
    srv = ServerProcess(model_base, "--poll-interval", "0", "--tls-cert", str(pki.server_cert), "--tls-key",
                        str(pki.server_key), "--tls-client-ca", str(pki.ca), "--tls-client-auth", "optional",
                        "--auth-token-file", str(tokens), grpc=True, tls={"verify": str(pki.ca)},
                        log_path=tmp / "serve.log")
    srv.grpc_url = srv.grpc_target.replace("127.0.0.1", "localhost")
    srv.token_file = tokens
    yield srv
    assert srv.stop() == 0, srv.log()


def urls(server) -> dict[str, str]:  # noqa: ANN001
    return {"rest": server.url, "grpc": server.grpc_url, "grpc-v2": server.grpc_url}


@pytest.mark.parametrize("transport", ["rest", "grpc", "grpc-v2"])
def test_every_transport_with_a_ca_a_client_certificate_and_a_token(server, pki, transport):
    url = urls(server)[transport]
    labels = set()
    for cert in ({}, {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}):
        with SentimentClient(url, MODEL_NAME, transport=transport, ca_file=str(pki.ca), token=TOKEN, **cert) as c:
            (prediction,) = c.predict(["a wonderful film"])
            labels.add(prediction.label)
            assert any(s.available for s in c.status())
    assert len(labels) == 1 and labels <= {"positive", "negative"}

    with SentimentClient(url, MODEL_NAME, transport=transport, ca_file=str(pki.ca), retries=0) as c:
        with pytest.raises(NotAuthorized, match="bearer token"):
            c.predict(["a wonderful film"])
    with SentimentClient(url, MODEL_NAME, transport=transport, token=TOKEN, retries=0, timeout=5,
                         **({} if transport == "rest" else {"ca_file": str(make_pki(pki.ca.parent / transport,
                                                                                     "other").ca)})) as c:
        with pytest.raises(TlsError, match="does not verify against") as info:  # a CA that did not sign it
            c.predict(["a wonderful film"])
        assert "--ca-file" in str(info.value)
    stranger = make_pki(pki.ca.parent / f"stranger-{transport}", "stranger")
    with SentimentClient(url, MODEL_NAME, transport=transport, ca_file=str(pki.ca), token=TOKEN, retries=0, timeout=5,
                         cert_file=str(stranger.client_cert), key_file=str(stranger.client_key)) as c:
        # a client certificate the server's CA did not sign: refused in the handshake, which TLS 1.3
        # reports to the client when it reads (a TlsError), or, once its request went out, as a close
        with pytest.raises((TlsError, ServerUnavailable)) as info:
            c.predict(["a wonderful film"])
        assert "client certificate" in str(info.value)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "client", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_the_cli_takes_a_ca_a_certificate_and_a_token_file(server, pki):
    done = cli("--url", server.url, "--ca-file", str(pki.ca), "--token-file", str(server.token_file), "a wonderful film")
    assert done.returncode == 0, done.stderr
    label = done.stdout.split("\t")[0]
    done = cli("--url", server.grpc_url, "--transport", "grpc-v2", "--cert", str(pki.client_cert), "--key",
               str(pki.client_key), "a wonderful film", env={"SENTIMENT_CA_FILE": str(pki.ca), "SENTIMENT_TOKEN": TOKEN})
    assert done.returncode == 0 and done.stdout.split("\t")[0] == label, done.stderr

    done = cli("--url", server.url, "--ca-file", str(pki.ca), "a wonderful film")
    assert done.returncode == 1 and "--token-file" in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = cli("--url", server.url, "--token-file", str(server.token_file), "--retries", "0", "a wonderful film")
    assert done.returncode == 2, done.stderr
    assert f"the certificate of {server.url} does not verify against the system's CA certificates" in done.stderr
    assert "Traceback" not in done.stderr
    done = cli("--url", server.grpc_url, "--transport", "grpc", "--cert", str(pki.client_cert), "a wonderful film")
    assert done.returncode == 2 and "--cert and --key go together" in done.stderr
    done = cli("--url", server.url, "--ca-file", "/no/such/ca.pem", "a wonderful film")
    assert done.returncode == 2 and "ca_file='/no/such/ca.pem': no such file" in done.stderr, done.stderr
