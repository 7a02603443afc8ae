"""The gRPC port against h2spec, the HTTP/2 conformance suite (`third_party/h2spec`, built here with
Debian's Go packages by its `build` script), every case including the strict ones, in plaintext
and over TLS: none may fail or be skipped.

Where Go cannot be installed the test skips, saying so, unless SERVE_REQUIRE_H2SPEC is set (CI
sets it: there the tier always runs)."""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET

import pytest
from serve_process import REPO, ServerProcess
from tls_certs import make_pki

pytestmark = pytest.mark.slow

SOURCE = REPO / "third_party" / "h2spec"
BINARY = REPO / "build" / "h2spec"


@pytest.fixture(scope="module")
def h2spec() -> str:
    built = subprocess.run([str(SOURCE / "build"), str(BINARY)], capture_output=True, text=True, timeout=900)
    if built.returncode != 0:
        why = f"h2spec could not be built from {SOURCE} (it needs Debian's golang-go):\n{built.stderr[-2000:]}"
        if os.environ.get("SERVE_REQUIRE_H2SPEC"):
            pytest.fail(why)
        pytest.skip(why)
    return built.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_the_grpc_port_passes_every_h2spec_case(h2spec, model_base, tmp_path, tls):
    args, h2spec_tls = (), []
    if tls:  # h2spec -t: TLS with ALPN h2 (-k: it does not know the test CA)
        pki = make_pki(tmp_path / "pki")
        args, h2spec_tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)), ["-t", "-k"]
    server = ServerProcess(model_base, *args, grpc=True, log_path=tmp_path / "serve.log",
                           tls={"verify": str(pki.ca)} if tls else None)
    report = tmp_path / "h2spec.xml"
    try:
        host, port = server.grpc_target.rsplit(":", 1)
        run = subprocess.run([h2spec, "--strict", *h2spec_tls, "-h", host, "-p", port, "-o", "5", "-j", str(report)],
                             capture_output=True, text=True, timeout=600)
    finally:
        assert server.stop() == 0, server.log()
    cases = ET.parse(report).getroot().iter("testcase")
    outcome = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        kind = "failed" if case.find("error") is not None or case.find("failure") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        outcome[kind].append(f"{case.get('package', '')} {case.get('name', '')}".strip())
    print({kind: len(names) for kind, names in outcome.items()})
    assert len(outcome["passed"]) == 147, (outcome, run.stdout[-4000:])
    assert not outcome["failed"] and not outcome["skipped"] and run.returncode == 0, (outcome, run.stdout[-4000:])
    assert "Traceback" not in server.log(full=True)
