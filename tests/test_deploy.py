"""deploy/, offline: every Kubernetes object against the API schema of a named Kubernetes version
(kubernetes-validate, strict: an unknown field fails), every KServe InferenceService built with the
kserve SDK's own model classes (unknown fields fail too), and what the manifests tell the programs
(flags, ports, drain times, the training cluster) accepted by the programs' own parsers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERNETES_VERSION = "1.31.0"
"""The oldest Kubernetes the manifests are for: Indexed Jobs' completion-index annotation, gRPC
probes and autoscaling/v2 are all GA there."""
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects(kind: str) -> list[dict]:
    return [doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == kind]


def container(pod_template: dict) -> dict:
    (only,) = pod_template["spec"]["containers"]
    return only


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kubernetes_objects_match_the_api_schema(path: Path) -> None:
    docs = documents(path)
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("serving.kserve.io/"):
            continue  # a custom resource: the next test
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelled_field() -> None:
    deployment = objects("Deployment")[0]
    container(deployment["spec"]["template"])["readinesProbe"] = {"httpGet": {"path": "/readyz", "port": 8501}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# -- KServe ------------------------------------------------------------------------------------------


def kserve_check(doc: dict) -> dict:
    """tests/kserve_check.py on `doc`, in a process of its own (see there why)."""
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("kserve_check.py"))], input=json.dumps(doc),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("path", sorted((DEPLOY / "kserve").glob("*.yaml")), ids=lambda p: p.name)
def test_inference_services_build_with_the_kserve_sdk(path: Path) -> None:
    for doc in documents(path):
        built = kserve_check(doc)
        assert built == {"built": "V1beta1InferenceService", "predictor": ["containers"] if "containers" in
                         doc["spec"]["predictor"] else ["model"]}, built


def test_the_kserve_check_catches_a_misspelled_field_and_a_missing_one() -> None:
    (doc, *_) = documents(DEPLOY / "kserve/sentiment-custom.yaml")
    doc["spec"]["predictor"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert "V1Container has no field imagePullPolicyy" in kserve_check(doc)["error"]
    missing = kserve_check({"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "spec": {}})
    assert "predictor" in missing["error"]


def test_the_stock_tensorflow_runtime_gets_the_export_layout() -> None:
    (service,) = documents(DEPLOY / "kserve/sentiment-tensorflow.yaml")
    model = service["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "tensorflow"
    # the model base directory (integer versions inside), where export.yaml writes
    (export_job,) = documents(DEPLOY / "export.yaml")
    export_args = container(export_job["spec"]["template"])["args"]
    assert "--model-dir=/models/sentiment" in export_args
    assert model["storageUri"] == "pvc://sentiment-models/sentiment"


# -- what the manifests tell the programs ------------------------------------------------------------


def entrypoint_serve_args(spec: dict) -> list[str]:
    """The `python -m serve` flags the image's entry point makes of a container's env and args."""
    env = {item["name"]: item["value"] for item in spec.get("env", []) if "value" in item}
    base, name = env.get("MODEL_BASE_PATH", "/models"), env.get("MODEL_NAME", "sentiment")
    return ["--port", env.get("REST_API_PORT", "8501"), "--grpc-port", env.get("GRPC_PORT", "8500"),
            "--model-dir", f"{base}/{name}", "--model-name", name, *spec.get("args", [])]


def test_the_server_accepts_the_manifests_flags_and_drains_within_the_grace_period() -> None:
    from serve.__main__ import parse_args

    (deployment,) = objects("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment["spec"]["template"])
    config = parse_args(entrypoint_serve_args(spec))
    assert config.drain_delay_s + config.drain_timeout_s < pod["terminationGracePeriodSeconds"]
    ports = {port["name"]: port["containerPort"] for port in spec["ports"]}
    assert ports == {"http": config.port, "grpc": config.grpc_port}
    scheme = "HTTPS" if config.tls_cert_file else "HTTP"
    assert spec["startupProbe"]["httpGet"] == {"path": "/readyz", "port": config.port, "scheme": scheme}
    assert spec["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": config.port, "scheme": scheme}
    assert spec["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": config.port, "scheme": scheme}
    # The certificate, its key and the tokens come from the Secrets the pod mounts, under the keys
    # `kubectl create secret tls` and `--from-file=tokens=` write; model management stays off.
    mounts = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    files = {config.tls_cert_file: "tls.crt", config.tls_key_file: "tls.key", config.auth_token_file: "tokens"}
    for path, key in files.items():
        directory, name = path.rsplit("/", 1)
        assert name == key and mounts[directory] in secrets, (path, mounts, secrets)
    assert set(secrets.values()) == {"sentiment-tls", "sentiment-tokens"} and not config.model_management
    assert {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v} <= {
        claim["metadata"]["name"] for claim in objects("PersistentVolumeClaim")}
    (service,) = [s for s in objects("Service") if s["metadata"]["name"] == deployment["metadata"]["name"]]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()

    for isvc in objects("InferenceService"):
        for spec in isvc["spec"]["predictor"].get("containers", []):
            config = parse_args(entrypoint_serve_args(spec))
            assert config.model_dir == "/mnt/models"  # where KServe's storage initializer puts storageUri
            assert {port["containerPort"] for port in spec["ports"]} <= {config.port, config.grpc_port}


def test_the_training_job_is_one_cluster_of_dtensor_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    import train.__main__ as train_cli
    from common.mesh_spec import check_client_mesh

    job = next(j for j in objects("Job") if j["spec"].get("completionMode") == "Indexed")
    pod = job["spec"]["template"]["spec"]
    spec = container(job["spec"]["template"])
    env = {item["name"]: item for item in spec["env"]}
    assert env["DTENSOR_CLIENT_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    (headless,) = [s for s in objects("Service") if s["metadata"]["name"] == pod["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    assert headless["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    port = headless["spec"]["ports"][0]["port"]
    completions = job["spec"]["completions"]
    # Indexed Job pods are named JOB-INDEX and, with a subdomain, resolvable as JOB-INDEX.SUBDOMAIN.
    assert env["DTENSOR_JOBS"]["value"].split(",") == [
        f"{job['metadata']['name']}-{k}.{pod['subdomain']}:{port}" for k in range(completions)]
    assert job["spec"]["parallelism"] == completions  # every client must run at once

    parser = train_cli._parser()
    for client_id in range(completions):
        monkeypatch.setenv("DTENSOR_JOBS", env["DTENSOR_JOBS"]["value"])
        monkeypatch.setenv("DTENSOR_CLIENT_ID", str(client_id))
        config = train_cli._config(parser, parser.parse_args(spec["args"]))
        assert (config.num_clients, config.client_id) == (completions, client_id)
        check_client_mesh(config.mesh_dims(), config.devices, config.num_clients)

    from export.__main__ import parse_args as export_args

    export_job = next(j for j in objects("Job") if j is not job and j["metadata"]["name"].endswith("export"))
    export = export_args(container(export_job["spec"]["template"])["args"])
    assert export.checkpoint_dir == config.run_dir
