"""The container tier: the image, training across two containers, and serving it as deploy/ says.

Runs with `scripts/test -m container` (conftest leaves it out otherwise): builds the image with
`scripts/image --local-base` (the base is kept in podman's image store between runs), then, with real
containers on a podman network this module creates,
1. trains 2 DTensor clients in 2 containers (2 x 4 virtual CPUs, one batch=8 mesh, one shared run
   directory) and checks they follow the loss curve of one `python -m train` process on this host;
2. exports that run in a container and serves it with deploy/serving.yaml through `podman kube play`
   (the copy changes only the models volume into a hostPath and adds host ports on 127.0.0.1),
   queried from here over REST, gRPC (TF Serving's own stubs) and V2 (tritonclient);
3. stops a server container under keep-alive load: every answer a 200, exit 0 within the drain.
Every container, pod and network it made is removed at the end, also after a failure.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from conftest import figure
from serve_process import poll_ready
from test_multiclient import SMALL, assert_same_curve, metrics, train_flags

from train.launch import free_ports

pytestmark = [pytest.mark.container, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
IMAGE = f"localhost/sentiment-dtensor:{VERSION}"
PODMAN_ENV = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(REPO / "scripts/containers.conf"))}
TEXTS = ["a wonderful, moving film with a brilliant cast", "dull, predictable and far too long"]
DTENSOR_PORT = 9991
KUBE_NETWORK = "podman-default-kube-network"
"""The network `podman kube play` puts its pods on, created by the first play."""


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`podman ARGS` with this host's settings; a failure shows podman's own words."""
    proc = subprocess.run(["podman", *args], env=PODMAN_ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


class Made:
    """What this module created in podman, removed (and checked gone) at the end."""

    def __init__(self) -> None:
        self.prefix = f"sdt-test-{secrets.token_hex(3)}"
        self.containers: list[str] = []
        self.networks: list[str] = []
        self.kube_files: list[Path] = []

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def remove_all(self) -> list[str]:
        for kube_file in self.kube_files:
            podman("kube", "down", str(kube_file), check=False, timeout=120)
        if self.containers:
            podman("rm", "--force", "--time", "0", *self.containers, check=False, timeout=120)
        for network in self.networks:
            podman("network", "rm", "--force", network, check=False)
        left = podman("ps", "--all", "--format", "{{.Names}}", "--filter", f"name={self.prefix}", check=False)
        networks = podman("network", "ls", "--format", "{{.Name}}", check=False).stdout.split()
        return left.stdout.split() + [n for n in networks if n.startswith(self.prefix) or n in self.networks]


@pytest.fixture(scope="module")
def made() -> Made:
    if shutil.which("podman") is None:
        pytest.fail("the container tier needs podman (scripts/test installs podman, runc and mmdebstrap)")
    made = Made()
    yield made
    left = made.remove_all()
    assert not left, f"left behind: {left}"


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image, built from this checkout by `scripts/image --local-base`."""
    log = tmp_path_factory.mktemp("image") / "build.log"
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run([str(REPO / "scripts/image"), "--local-base"], cwd=REPO, env=PODMAN_ENV,
                              stdout=out, stderr=subprocess.STDOUT, timeout=1500)
    if proc.returncode != 0:
        pytest.fail(f"scripts/image --local-base failed:\n{log.read_text()[-4000:]}")
    size = int(podman("image", "inspect", IMAGE, "--format", "{{.Size}}").stdout)
    figure(request.config, "image size; scripts/image --local-base",
           f"{size / 1e6:,.0f} MB; built in {time.monotonic() - start:.0f} s (with what the image store held)")
    return IMAGE


def test_the_image_runs_as_a_non_root_user_with_no_build_tools(image: str) -> None:
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001"
    assert {"8500/tcp", "8501/tcp"} <= set(config["ExposedPorts"])
    assert config["Entrypoint"][:2] == ["tini", "--"]
    probe = podman("inspect", "--type", "image", image, "--format", "{{json .HealthCheck}}").stdout
    assert "/readyz" in probe
    inside = podman("run", "--rm", image, "sh", "-c",
                    "id -u; for t in gcc cc g++ pip; do command -v $t || echo no-$t; done; "
                    "python -c 'import tensorflow, os; print(os.path.isdir(os.path.join(tensorflow.__path__[0], \"include\")))'",
                    timeout=180).stdout.split()
    assert inside == ["10001", "no-gcc", "no-cc", "no-g++", "no-pip", "False"]
    # Any other command runs as given: the same image trains, exports and queries.
    for stage in ("train", "export", "serve", "client"):
        assert "usage: python -m" in podman("run", "--rm", image, "python", "-m", stage, "--help", timeout=180).stdout


# -- 1. training across containers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, image: str, made: Made, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two client containers on a podman network of this module, beside one process on this host."""
    root = tmp_path_factory.mktemp("containers")
    runs = root / "runs"
    runs.mkdir()
    flags = train_flags(**SMALL, epochs=2)
    network = made.name("net")
    podman("network", "create", network)
    made.networks.append(network)
    names = [made.name(f"train-{k}") for k in range(2)]
    jobs = ",".join(f"{name}:{DTENSOR_PORT}" for name in names)
    for k, name in enumerate(names):
        podman("create", "--name", name, "--network", network, "-e", f"DTENSOR_CLIENT_ID={k}",
               "-e", f"DTENSOR_JOBS={jobs}", "-v", f"{runs}:/runs:U", image,
               "python", "-m", "train", "--run-dir", "/runs/multi", *flags)
        made.containers.append(name)
    # One after the other, so that the two times compare (both share this host's cores).
    start = time.monotonic()
    host = subprocess.run([sys.executable, "-m", "train", "--run-dir", str(root / "single"), "--devices", "8", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_")})
    host_s = time.monotonic() - start
    assert host.returncode == 0, (host.stdout + host.stderr)[-3000:]
    start = time.monotonic()
    podman("start", *names)
    codes = [podman("wait", name, timeout=600).stdout.strip() for name in names]
    containers_s = time.monotonic() - start
    if codes != ["0", "0"]:
        logs = [podman("logs", name) for name in names]
        pytest.fail("\n".join(f"--- {name} exited {code}\n{(log.stdout + log.stderr)[-3000:]}"
                              for name, code, log in zip(names, codes, logs)))
    figure(request.config, "training the test config for 2 epochs, start to exit",
           f"2 containers x 4 devices {containers_s:.0f} s; 1 process x 8 devices on the host {host_s:.0f} s")
    return {"runs": runs, "single": root / "single", "multi": runs / "multi", "root": root}


def test_two_client_containers_follow_the_one_process_loss_curve(trained: dict) -> None:
    assert_same_curve(metrics(trained["multi"]), metrics(trained["single"]))
    assert (trained["multi"] / "checkpoints").is_dir()


# -- 2. export, and serving through deploy/serving.yaml ---------------------------------------------


@pytest.fixture(scope="module")
def models(trained: dict, image: str, made: Made) -> Path:
    """`python -m export` in a container: the multi-client run as models/sentiment/1."""
    models = trained["root"] / "models"
    models.mkdir()
    name = made.name("export")
    made.containers.append(name)
    podman("run", "--name", name, "-v", f"{trained['runs']}:/runs:ro", "-v", f"{models}:/models:U", image,
           "python", "-m", "export", "--checkpoint-dir", "/runs/multi", "--model-dir", "/models/sentiment",
           timeout=300)
    assert (models / "sentiment" / "1" / "saved_model.pb").is_file()
    return models


def kube_copy(source: Path, dest: Path, models: Path, ports: dict[int, int],
              secrets: dict[str, Path]) -> tuple[Path, dict]:
    """deploy's manifest with the models volume and each Secret as a hostPath (`secrets`: secret name
    -> a directory of its keys as files) and host ports on 127.0.0.1, nothing else."""
    documents = list(yaml.safe_load_all(source.read_text()))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if volume["name"] == "models":
            volume.pop("persistentVolumeClaim")
            volume["hostPath"] = {"path": str(models), "type": "Directory"}
        elif "secret" in volume:
            volume["hostPath"] = {"path": str(secrets[volume.pop("secret")["secretName"]]), "type": "Directory"}
    for port in pod["containers"][0]["ports"]:
        port.update(hostPort=ports[port["containerPort"]], hostIP="127.0.0.1")
    dest.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return dest, deployment


def secret_dir(directory: Path, files: dict[str, bytes]) -> Path:
    """A Secret as Kubernetes mounts it: one file per key, readable by the container's user (0644)."""
    directory.mkdir(mode=0o755)
    for key, value in files.items():
        (directory / key).write_bytes(value)
        (directory / key).chmod(0o644)
    return directory


def wait_ready(url: str, timeout_s: float = 180, **tls) -> float:  # noqa: ANN003 - requests' verify=
    seconds = poll_ready(url, timeout_s, **tls)
    if seconds is None:
        pytest.fail(f"{url}/readyz not 200 after {timeout_s:.0f} s")
    return seconds


def stop_then_kube_down(kube_file: Path, deployment: dict, container: str) -> None:
    """Podman before 5.1 SIGKILLs a pod in `kube down` (containers/podman#22397), so stop it first, as
    Kubernetes would: SIGTERM, then the drain, within terminationGracePeriodSeconds."""
    pod_name = f"{deployment['metadata']['name']}-pod-0"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    start = time.monotonic()
    podman("pod", "stop", "--time", str(grace), pod_name, timeout=grace + 30)
    stop_s = time.monotonic() - start
    logged = podman("logs", container)
    logs = logged.stdout + logged.stderr
    assert podman("inspect", container, "--format", "{{.State.ExitCode}}").stdout.strip() == "0", logs[-3000:]
    assert "received SIGTERM: draining" in logs, logs[-3000:]
    assert re.search(r"all \d+ workers shut down cleanly", logs), logs[-3000:]
    assert stop_s < grace
    podman("kube", "down", str(kube_file), timeout=120)
    assert podman("pod", "exists", pod_name, check=False).returncode == 1


def predict_over_tls(grpc_port: int, ca: Path, token: str) -> np.ndarray:
    """gRPC health (no token) and a Predict with the token over TLS: the probabilities it answers."""
    import grpc
    import tensorflow as tf
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    with grpc.secure_channel(f"localhost:{grpc_port}", credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        grpc_request = predict_pb2.PredictRequest()
        grpc_request.model_spec.name = "sentiment"
        grpc_request.inputs["text"].CopyFrom(tf.make_tensor_proto(TEXTS, dtype=tf.string))
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
            grpc_request, metadata=(("authorization", f"Bearer {token}"),), timeout=10)
    assert answer.model_spec.version.value == 1
    return tf.make_ndarray(answer.outputs["probabilities"])


def test_the_serving_manifest_runs_under_kube_play(request: pytest.FixtureRequest, models: Path, made: Made,
                                                   tmp_path: Path) -> None:
    import tritonclient.http as triton

    from tls_certs import make_pki

    rest_port, grpc_port = free_ports(2)
    pki = make_pki(tmp_path / "pki")
    token = secrets.token_urlsafe(24)
    tls_files = {"tls.crt": pki.server_cert.read_bytes(), "tls.key": pki.server_key.read_bytes(),
                 "ca.crt": pki.ca.read_bytes()}
    kube_file, deployment = kube_copy(REPO / "deploy/serving.yaml", tmp_path / "serving.yaml", models,
                                      {8501: rest_port, 8500: grpc_port},
                                      {"sentiment-tls": secret_dir(tmp_path / "tls", tls_files),
                                       "sentiment-tokens": secret_dir(tmp_path / "tokens", {"tokens": token.encode()})})
    made.kube_files.append(kube_file)
    podman("kube", "down", str(kube_file), check=False)  # a pod left by an interrupted run
    if podman("network", "exists", KUBE_NETWORK, check=False).returncode != 0:
        made.networks.append(KUBE_NETWORK)  # kube play creates it: ours to remove
    start = time.monotonic()
    podman("kube", "play", str(kube_file), timeout=300)
    url, verify, auth = f"https://localhost:{rest_port}", str(pki.ca), {"Authorization": f"Bearer {token}"}
    wait_ready(url, verify=verify)
    figure(request.config, "podman kube play serving.yaml to /readyz 200", f"{time.monotonic() - start:.1f} s")
    container = f"{deployment['metadata']['name']}-pod-0-{deployment['spec']['template']['spec']['containers'][0]['name']}"

    # The liveness probe (httpGet /healthz) became a health check that podman runs inside the container.
    assert podman("healthcheck", "run", container, check=False).returncode == 0

    # Both ports speak TLS and want the token from the mounted Secret; the probes need neither.
    refused = requests.post(f"{url}/v1/models/sentiment:predict", json={"instances": TEXTS}, verify=verify, timeout=10)
    assert refused.status_code == 401, refused.text
    rest = requests.post(f"{url}/v1/models/sentiment:predict", json={"instances": TEXTS}, verify=verify, headers=auth,
                         timeout=10)
    assert rest.status_code == 200, rest.text
    # JSON carries the shortest decimal of each float32: read back as float32, it is the same number.
    rest_probabilities = np.array([p["probabilities"] for p in rest.json()["predictions"]], np.float32)

    np.testing.assert_array_equal(predict_over_tls(grpc_port, pki.ca, token), rest_probabilities)
    with triton.InferenceServerClient(url=f"localhost:{rest_port}", ssl=True, ssl_options={"ca_certs": verify}) as client:
        text = triton.InferInput("text", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
        v2 = client.infer("sentiment", [text], headers=auth)
    np.testing.assert_array_equal(v2.as_numpy("probabilities"), rest_probabilities)

    stop_then_kube_down(kube_file, deployment, container)
    made.kube_files.remove(kube_file)


# -- 3. podman stop under load ---------------------------------------------------------------------


def keep_asking(url: str, stop: threading.Event, outcomes: list) -> None:
    """Predict requests over one keep-alive connection until `stop`; records statuses and failures."""
    with requests.Session() as session:
        while not stop.is_set():
            try:
                reply = session.post(f"{url}/v1/models/sentiment:predict", json={"instances": TEXTS[:1]}, timeout=5)
                outcomes.append((time.monotonic(), reply.status_code))
            except requests.Timeout:
                outcomes.append((time.monotonic(), "timeout"))
            except requests.ConnectionError:
                outcomes.append((time.monotonic(), "refused"))
                time.sleep(0.05)


def test_podman_stop_under_load_drains_and_exits_0(request: pytest.FixtureRequest, models: Path, made: Made) -> None:
    drain_delay, drain_timeout = 1, 10
    (port,) = free_ports(1)
    name = made.name("serve")
    made.containers.append(name)
    start = time.monotonic()
    podman("run", "--detach", "--name", name, "-p", f"127.0.0.1:{port}:8501", "-v", f"{models}:/models:ro", IMAGE,
           f"--drain-delay={drain_delay}", f"--drain-timeout={drain_timeout}")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url)
    figure(request.config, "podman run to /readyz 200", f"{time.monotonic() - start:.1f} s")
    stop, outcomes = threading.Event(), []
    threads = [threading.Thread(target=keep_asking, args=(url, stop, outcomes)) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    signalled = time.monotonic()
    stopped = podman("stop", "--time", "30", name, timeout=60)
    stop_s = time.monotonic() - signalled
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    code = podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
    logged = podman("logs", name)
    logs = logged.stdout + logged.stderr
    answered = [status for at, status in outcomes if isinstance(status, int)]
    during_drain = [status for at, status in outcomes if isinstance(status, int) and at > signalled]
    assert stopped.returncode == 0 and code == "0", logs[-3000:]
    assert stop_s < drain_delay + drain_timeout, f"podman stop took {stop_s:.1f} s"
    assert answered and set(answered) == {200}, sorted(set(map(str, answered)))
    assert "timeout" not in [status for _, status in outcomes]
    assert during_drain, "nothing was answered between SIGTERM and the ports closing"
    assert "shut down cleanly" in logs
    figure(request.config, "podman stop under 4 keep-alive clients",
           f"exit 0 after {stop_s:.1f} s (--drain-delay {drain_delay}), {len(answered):,} answers, all 200")
