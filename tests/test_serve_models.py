"""Several models from a TF Serving model config file, against a real `python -m serve`: the file
format TF Serving users already have, GET /v1/models, per-model versions and labels on every
protocol, re-reading the file when it changes, and clear errors for a broken file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
from conftest import add_model_version
from serve_process import REPO, ServerProcess
from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc

pytestmark = pytest.mark.slow

CONFIG = """
# An ordinary TF Serving model config (as passed to tensorflow_model_server --model_config_file).
model_config_list {
  config {
    name: "alpha"
    base_path: "%(alpha)s"
    model_platform: "tensorflow"
    model_version_policy { all {} }
    version_labels { key: "stable" value: 1 }
    version_labels { key: "canary" value: 2 }
    logging_config { sampling_config { sampling_rate: 0.1 } }
  }
  config {
    name: "beta"
    base_path: "%(beta)s"
    model_platform: "tensorflow"
    model_version_policy { latest { num_versions: 2 } }
  }
}
"""


@pytest.fixture(scope="module")
def bases(model_base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name in ("alpha", "beta", "gamma"):
        out[name] = root / name
        shutil.copytree(model_base, out[name])
    add_model_version(out["alpha"], 2)
    shutil.copytree(out["alpha"] / "2", out["beta"] / "2")
    shutil.copytree(out["alpha"] / "2", out["beta"] / "3")
    return out


def write_config(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # as an operator's deploy tool would: never half a file


def model_list(srv: ServerProcess) -> dict[str, list[tuple[str, str]]]:
    body = requests.get(f"{srv.url}/v1/models", timeout=10).json()
    return {m["name"]: [(s["version"], s["state"]) for s in m["model_version_status"]] for m in body["models"]}


def predict(srv: ServerProcess, path: str) -> requests.Response:
    return requests.post(f"{srv.url}/v1/models/{path}:predict", json={"instances": ["a great film"]}, timeout=10)


def test_a_tf_serving_config_file_serves_every_model_on_every_protocol(bases, tmp_path):
    config = tmp_path / "models.config"
    write_config(config, CONFIG % {k: str(v) for k, v in bases.items()})
    srv = ServerProcess(Path("unused"), "--poll-interval", "0", grpc=True, log_path=tmp_path / "serve.log",
                        model_args=("--model-config-file", str(config)))
    try:
        assert model_list(srv) == {"alpha": [("2", "AVAILABLE"), ("1", "AVAILABLE")],
                                   "beta": [("3", "AVAILABLE"), ("2", "AVAILABLE")]}
        ready = requests.get(f"{srv.url}/readyz", timeout=10).json()
        assert ready["models"] == {"alpha": ["1", "2"], "beta": ["2", "3"]}
        stable, canary = predict(srv, "alpha/labels/stable"), predict(srv, "alpha/labels/canary")
        assert stable.status_code == canary.status_code == 200 and stable.json() != canary.json()
        assert predict(srv, "alpha").json() == canary.json()  # latest of `all` is 2
        assert predict(srv, "beta").status_code == 200
        r = predict(srv, "gamma")
        assert (r.status_code, r.json()) == (404, {"error": "Servable not found for request: Latest(gamma)"})
        v2 = requests.get(f"{srv.url}/v2/models/beta", timeout=10).json()
        assert (v2["name"], v2["versions"]) == ("beta", ["2", "3"])
        with grpc.insecure_channel(srv.grpc_target) as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            request = get_model_status_pb2.GetModelStatusRequest()
            request.model_spec.name = "beta"
            assert [s.version for s in stub.GetModelStatus(request, timeout=10).model_version_status] == [3, 2]
    finally:
        assert srv.stop() == 0, srv.log()


def test_the_config_file_is_re_read_when_it_changes(bases, tmp_path):
    config = tmp_path / "models.config"
    write_config(config, CONFIG % {k: str(v) for k, v in bases.items()})
    srv = ServerProcess(Path("unused"), "--poll-interval", "0.2", log_path=tmp_path / "serve.log",
                        model_args=("--model-config-file", str(config), "--model-config-file-poll-wait-seconds", "0.2"))
    try:
        changed = (CONFIG.replace('"beta"', '"gamma"').replace("%(beta)s", "%(gamma)s")
                   .replace("all {}", "specific { versions: 1 }"))
        write_config(config, changed % {k: str(v) for k, v in bases.items()})
        expected = {"alpha": [("1", "AVAILABLE")], "gamma": [("1", "AVAILABLE")]}
        end = time.monotonic() + 60
        while model_list(srv) != expected and time.monotonic() < end:
            time.sleep(0.1)
        assert model_list(srv) == expected
        assert predict(srv, "beta").status_code == 404 and predict(srv, "gamma").status_code == 200

        write_config(config, "model_config_list { config { name: 'x' base_path: }")  # broken: keep serving
        end = time.monotonic() + 10
        while "keeping the models already served" not in srv.log() and time.monotonic() < end:
            time.sleep(0.1)
        assert f"{config} line 1, column " in srv.log() and "keeping the models already served" in srv.log()
        assert model_list(srv) == expected and predict(srv, "gamma").status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("text, message", [
    ("model_config_list { config { name: 'a' base_path: '/x' model_platform: 'pytorch' } }",
     "model_platform 'pytorch' is not supported"),
    ("model_config_list { config { name: 'a' } }", "model_config_list.config[0] (a): 'base_path' is required"),
    ("model_config_list { config { name: 'a' base_path: '/x' nonsense: 1 } }",
     'line 1, column 56: Message type "tensorflow.serving.ModelConfig" has no field named "nonsense"'),
    ("", "model_config_list has no config entries"),
])
def test_a_broken_config_file_stops_the_start_with_a_clear_message(tmp_path, text, message):
    config = tmp_path / "models.config"
    config.write_text(text)
    out = subprocess.run([sys.executable, "-m", "serve", "--model-config-file", str(config), "--port", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and str(config) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_model_dir_and_config_file_exclude_each_other(tmp_path):
    out = subprocess.run([sys.executable, "-m", "serve", "--model-config-file", "x.config", "--model-dir", "m"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--model-dir: not with --model-config-file" in out.stderr, out.stderr


def test_grpc_reload_config_replaces_the_models(bases, tmp_path):
    """ModelService.HandleReloadConfigRequest with the official stub, --model-management on: the
    same validation and behaviour as a change of the file."""
    from google.protobuf import text_format
    from tensorflow_serving.apis import model_management_pb2
    from tensorflow_serving.config import model_server_config_pb2

    config = tmp_path / "models.config"
    write_config(config, f'model_config_list {{ config {{ name: "alpha" base_path: "{bases["alpha"]}" }} }}')
    srv = ServerProcess(Path("unused"), "--poll-interval", "0.2", "--model-management", grpc=True,
                        log_path=tmp_path / "serve.log", model_args=("--model-config-file", str(config)))
    try:
        stub = model_service_pb2_grpc.ModelServiceStub(grpc.insecure_channel(srv.grpc_target))
        wanted = model_server_config_pb2.ModelServerConfig()
        text_format.Parse(f'model_config_list {{ config {{ name: "gamma" base_path: "{bases["gamma"]}" }} }}', wanted)
        response = stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=wanted), timeout=30)
        assert response.status.error_code == 0, response
        end = time.monotonic() + 60
        while model_list(srv) != {"gamma": [("1", "AVAILABLE")]}:
            assert time.monotonic() < end, model_list(srv)
            time.sleep(0.1)
        assert predict(srv, "gamma").status_code == 200 and predict(srv, "alpha").status_code == 404
        with pytest.raises(grpc.RpcError) as info:  # an unusable config changes nothing
            stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "ReloadConfigRequest.config: model_config_list has no config entries"
        assert model_list(srv) == {"gamma": [("1", "AVAILABLE")]}
    finally:
        assert srv.stop() == 0, srv.log()


# -- who may reload, and from where -------------------------------------------------------------------

def reload_request(**models: Path):  # noqa: ANN201 - a ReloadConfigRequest
    from tensorflow_serving.apis import model_management_pb2

    request = model_management_pb2.ReloadConfigRequest()
    for name, base in models.items():
        entry = request.config.model_config_list.config.add()
        entry.name, entry.base_path, entry.model_platform = name, str(base), "tensorflow"
    return request


def test_reload_config_is_refused_unless_model_management_is_on(bases, tmp_path):
    srv = ServerProcess(bases["alpha"], "--poll-interval", "0", grpc=True, log_path=tmp_path / "serve.log")
    try:
        stub = model_service_pb2_grpc.ModelServiceStub(grpc.insecure_channel(srv.grpc_target))
        with pytest.raises(grpc.RpcError) as info:
            stub.HandleReloadConfigRequest(reload_request(etc=Path("/etc")), timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--model-management" in info.value.details() and "/etc" not in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # not even its config is read
            stub.HandleReloadConfigRequest(reload_request(), timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert model_list(srv) == {"alpha": [("2", "AVAILABLE")]}
    finally:
        assert srv.stop() == 0, srv.log()
    assert "/etc" not in srv.log(full=True)


def test_reload_config_reaches_every_worker_and_stays_under_the_root(bases, tmp_path):
    """--workers 2: the call answers once both workers serve the new models, so every connection
    sees them at once; a worker restarted afterwards serves them too. A base path outside the
    root (default: the directory holding the models configured at start) is INVALID_ARGUMENT
    naming the root, and nothing under it is looked at or logged."""
    import os
    import re
    import signal

    root = bases["alpha"].parent
    srv = ServerProcess(bases["alpha"], "--poll-interval", "0.2", "--model-management", "--workers", "2",
                        grpc=True, log_path=tmp_path / "serve.log")
    try:
        end = time.monotonic() + 60
        while srv.log().count(" live after ") < 2 and time.monotonic() < end:
            time.sleep(0.1)
        stub = model_service_pb2_grpc.ModelServiceStub(grpc.insecure_channel(srv.grpc_target))
        response = stub.HandleReloadConfigRequest(reload_request(alpha=bases["alpha"], gamma=bases["gamma"]),
                                                  timeout=60)
        assert response.status.error_code == 0, response
        for _ in range(20):  # new connections, spread over both workers: each already knows gamma
            r = requests.get(f"{srv.url}/v1/models", timeout=10, headers={"Connection": "close"})
            assert sorted(m["name"] for m in r.json()["models"]) == ["alpha", "gamma"], r.text
        end = time.monotonic() + 60
        while not all(predict(srv, "gamma").status_code == 200 for _ in range(10)):
            assert time.monotonic() < end, srv.log()
            time.sleep(0.2)

        outside = tmp_path / "elsewhere" / "secret"
        shutil.copytree(bases["gamma"], outside)
        link = root / "inside-but-links-out"
        if not link.exists():
            link.symlink_to(outside)
        for base in (outside, Path("/etc"), root / ".." / root.name / ".." / "x", link):
            with pytest.raises(grpc.RpcError) as info:
                stub.HandleReloadConfigRequest(reload_request(alpha=bases["alpha"], evil=base), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = info.value.details()
            assert f"config[1] (evil): base_path is outside {os.path.realpath(root)}" in details, details
            assert "--model-root" in details and str(base) not in details and "secret" not in details

        pids = [int(p) for p in re.search(r"\(pids ([\d, ]+);", srv.log(full=True)).group(1).split(", ")]
        os.kill(pids[1], signal.SIGKILL)
        end = time.monotonic() + 90
        while srv.log().count(" live after ") < 6:  # the new worker loads alpha and gamma
            assert time.monotonic() < end, srv.log()
            time.sleep(0.2)
        for _ in range(20):
            r = requests.get(f"{srv.url}/v1/models", timeout=10, headers={"Connection": "close"})
            assert sorted(m["name"] for m in r.json()["models"]) == ["alpha", "gamma"], r.text
    finally:
        srv.stop()
    log = srv.log(full=True)
    assert "secret" not in log and "/etc" not in log


def test_a_config_file_change_outside_the_root_is_refused(bases, tmp_path):
    config = tmp_path / "models.config"
    entry = 'config {{ name: "{}" base_path: "{}" }}'
    write_config(config, f"model_config_list {{ {entry.format('alpha', bases['alpha'])} }}")
    srv = ServerProcess(Path("unused"), "--poll-interval", "0", "--model-config-file-poll-wait-seconds", "0.2",
                        "--model-root", str(bases["alpha"]), log_path=tmp_path / "serve.log",
                        model_args=("--model-config-file", str(config)))
    try:
        write_config(config, "model_config_list { %s %s }" % (entry.format("alpha", bases["alpha"]),
                                                              entry.format("beta", bases["beta"])))
        end = time.monotonic() + 30
        while "keeping the models already served" not in srv.log():
            assert time.monotonic() < end, srv.log()
            time.sleep(0.1)
        assert "config[1] (beta): base_path is outside" in srv.log() and str(bases["beta"]) not in srv.log()
        assert model_list(srv) == {"alpha": [("2", "AVAILABLE")]}
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_model_root_that_is_not_a_directory_stops_the_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "serve", "--model-root", str(tmp_path / "nowhere"), "--port", "0",
                          "--model-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--model-root {tmp_path / 'nowhere'}: not a directory" in out.stderr, out.stderr
