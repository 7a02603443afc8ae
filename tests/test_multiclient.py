"""Multi-client training: real client processes on 127.0.0.1 against a single-process reference.

Two clients x 4 virtual CPUs form one 8-device mesh; with the same seed and data they must follow
the single-process 8-device loss curve and end with the same weights, and checkpoints move both
ways (multi-client -> one process, one process -> multi-client on another mesh).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from common.mesh import build_mesh, single_device_mesh
from common.mesh_spec import MeshError, check_client_mesh
from train.config import TrainConfig
from train.launch import (
    Cluster,
    ClusterError,
    client_commands,
    resolve_cluster,
    run_clients,
    strip_cluster_args,
)

REPO = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-4, 1e-6
WEIGHT_ATOL = 1e-4
"""Adam divides by sqrt(v): where a gradient is almost zero (a nearly dead ReLU unit), summation
order noise between meshes turns into a difference of up to lr per step, so weights get an absolute
tolerance of a hundredth of the learning rate; losses and accuracies stay within 1e-4 relative."""

# Tiny and quick: 128 rows, 13 held out for validation -> 3 steps of 32 per epoch, one compiled call per
# epoch. No dropout: its masks depend on how a mesh shards the hidden layer.
SMALL = dict(limit=128, max_tokens=64, hidden=16, batch_size=32, learning_rate=0.01, seed=3, steps_per_call=4,
             strategy="data", dropout=0.0, refit=False)


def train_flags(**values) -> list[str]:
    flags = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        flags += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return flags + ["--no-progress"]


def launch(run_dir: Path, clients: int, *extra: str) -> subprocess.Popen:
    """`python -m train --launch-local N ...` in the background (output captured)."""
    command = [sys.executable, "-m", "train", "--launch-local", str(clients), "--run-dir", str(run_dir)]
    command += train_flags(**SMALL) + list(extra)
    return subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_")},
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"launcher timed out:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    return output


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for key in ("train_loss", "train_accuracy", "validation_loss", "validation_accuracy"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=RTOL, atol=ATOL, err_msg=key)


def restored_weights(run_dir: Path, mesh) -> dict[str, np.ndarray]:  # noqa: ANN001
    from common.model import restore_model

    return restore_model(run_dir, mesh, "latest").numpy_weights()


def assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray], atol: float = WEIGHT_ATOL) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference and the two multi-client runs, overlapped to keep the module fast.

    - single: this process, batch=8 on 8 virtual CPUs, 2 epochs (checkpointed after epoch 1);
    - multi: 2 clients x 4 CPUs, batch=8, 2 epochs from scratch;
    - resumed: the single run's epoch-1 checkpoint continued for epoch 2 by 2 clients on
      batch=2,feature=2,model=2 (another mesh, with the sparse first layer, and another process layout).
    """
    from train.trainer import train

    base = tmp_path_factory.mktemp("multiclient")
    single, multi, resumed = base / "single", base / "multi", base / "resumed"
    config = TrainConfig(run_dir=str(single), epochs=1, devices=8, progress=False, **SMALL)
    multi_proc = launch(multi, 2, "--epochs", "2")
    train(config)
    shutil.copytree(single, resumed)
    resumed_proc = launch(resumed, 2, "--epochs", "2", "--strategy", "spatial")
    train(TrainConfig(**{**config.__dict__, "epochs": 2}))
    outputs = {"multi": finish(multi_proc), "resumed": finish(resumed_proc)}
    for output in outputs.values():
        assert "[client 0] " in output and "[client 1] " in output
    assert "resumed from" in outputs["resumed"] and "first layer sparse" in outputs["resumed"]
    return {"single": single, "multi": multi, "resumed": resumed}


@pytest.mark.slow
def test_two_clients_follow_the_single_process_loss_curve(runs: dict[str, Path]) -> None:
    want = metrics(runs["single"])
    assert len(want) == 2 and want[1]["train_loss"] < want[0]["train_loss"]  # it actually trains
    assert_same_curve(metrics(runs["multi"]), want)


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_two_clients_and_another_mesh(runs: dict[str, Path]) -> None:
    assert_same_curve(metrics(runs["resumed"]), metrics(runs["single"]))


@pytest.mark.slow
def test_two_clients_refit_together(tmp_path: Path) -> None:
    """--refit on a multi-client mesh: every client takes the epoch count from the mesh's own
    progress (not from files only client 0 writes), so all enter the second run together."""
    run_dir = tmp_path / "run"
    output = finish(launch(run_dir, 2, "--epochs", "2", "--patience", "0", "--refit"))
    chosen = metrics(run_dir / "selection")
    best_epoch = max(r["epoch"] for r in chosen if r["best"])
    for client in (0, 1):
        assert f"[client {client}] " in output and f"selection chose {best_epoch} epoch(s)" in output
    assert output.count(f"selection chose {best_epoch} epoch(s)") == 2, output[-3000:]
    final = metrics(run_dir)
    assert [r["epoch"] for r in final] == list(range(1, best_epoch + 1)) and (run_dir / "test.json").is_file()


@pytest.mark.slow
def test_only_client_0_writes_run_files(runs: dict[str, Path]) -> None:
    assert len(metrics(runs["multi"])) == 2  # one line per epoch, not one per client
    saved = json.loads((runs["multi"] / "train_config.json").read_text())
    assert saved["num_clients"] == 2 and saved["client_id"] == 0
    assert len(list((runs["multi"] / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one writer


@pytest.mark.slow
def test_multi_client_checkpoints_restore_in_one_process(runs: dict[str, Path]) -> None:
    on_8 = {name: restored_weights(runs[name], build_mesh([("batch", 8)])) for name in runs}
    on_1 = {name: restored_weights(runs[name], single_device_mesh()) for name in runs}
    for name in runs:  # restoring is exact on any mesh
        assert_same_weights(on_1[name], on_8[name], atol=0.0)
    assert_same_weights(on_8["multi"], on_8["single"])  # training agrees within float noise
    assert_same_weights(on_8["resumed"], on_8["single"])


# -- cluster settings -----------------------------------------------------------------------------


def test_cluster_flags_win_over_environment() -> None:
    env = {"DTENSOR_JOBS": "h:1,h:2,h:3", "DTENSOR_CLIENT_ID": "2"}
    assert resolve_cluster(None, None, None, env) == Cluster(3, 2, ("h:1", "h:2", "h:3"))
    assert resolve_cluster(2, 1, "a:5,b:6", env) == Cluster(2, 1, ("a:5", "b:6"))
    assert resolve_cluster(None, 0, "a:5,b:6", env) == Cluster(2, 0, ("a:5", "b:6"))
    assert resolve_cluster(None, None, None, {}) == Cluster(1, 0, ())


@pytest.mark.parametrize(
    "args, env, message",
    [
        ((2, 0, None), {}, "needs --jobs"),
        ((3, 0, "a:1,a:2"), {}, "lists 2 client(s) but --num-clients is 3"),
        ((2, 0, None), {"DTENSOR_JOBS": "a:1"}, "DTENSOR_JOBS lists 1 client(s)"),
        ((None, 2, "a:1,a:2"), {}, "--client-id must be in 0..1"),
        ((None, None, "a:1,a"), {}, "expected host:port"),
        ((None, None, "a:1,a:1"), {}, "its own host:port"),
        ((None, None, None), {"DTENSOR_CLIENT_ID": "x", "DTENSOR_JOBS": "a:1,a:2"}, "not an integer"),
    ],
)
def test_inconsistent_cluster_settings_are_rejected(args: tuple, env: dict, message: str) -> None:
    with pytest.raises(ClusterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_cluster(*args, env)


def test_client_meshes_must_give_each_client_whole_batch_replicas() -> None:
    check_client_mesh([("batch", 4), ("model", 2)], 8, 2)
    check_client_mesh([("batch", 2), ("feature", 2), ("model", 2)], 8, 2)
    for dims in ([("model", 8)], [("model", 2), ("batch", 4)], [("batch", 2), ("model", 4)], [("feature", 8)]):
        with pytest.raises(MeshError, match="leading 'batch' dimension"):
            check_client_mesh(dims, 8, 4 if dims[0] == ("batch", 2) else 2)
    with pytest.raises(MeshError, match="does not divide among 3 clients"):
        check_client_mesh([("batch", 8)], 8, 3)


def test_client_commands_replace_cluster_flags() -> None:
    argv = ["--launch-local", "2", "--epochs=1", "--jobs", "x:1", "--client-id=1", "--run-dir", "r"]
    assert strip_cluster_args(argv) == ["--epochs=1", "--run-dir", "r"]
    commands = client_commands(2, argv)
    jobs = commands[0][-1].split(",")
    assert len(set(jobs)) == 2 and all(job.startswith("127.0.0.1:") for job in jobs)
    for k, command in enumerate(commands):
        assert command[:3] == [sys.executable, "-m", "train"]
        assert command[3:] == ["--epochs=1", "--run-dir", "r", "--num-clients", "2", "--client-id", str(k), "--jobs", commands[0][-1]]


# -- the launcher's supervision (real processes, no TensorFlow) -----------------------------------


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_launcher_prefixes_output_and_succeeds() -> None:
    out = io.BytesIO()
    commands = [python(f"print('hello'); print('from {k}', flush=True)") for k in range(2)]
    assert run_clients(commands, out=out) == 0
    lines = out.getvalue().decode().splitlines()
    assert sorted(lines) == ["[client 0] from 0", "[client 0] hello", "[client 1] from 1", "[client 1] hello"]


def test_launcher_stops_everyone_when_a_client_fails(capsys: pytest.CaptureFixture) -> None:
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # must be SIGKILLed after the grace period
        print('waiting', flush=True)
        time.sleep(60)
    """
    commands = [python(stubborn), python("import sys, time; time.sleep(0.5); sys.exit(3)"), python("import time; time.sleep(60)")]
    started = time.monotonic()
    assert run_clients(commands, grace=1.0, out=io.BytesIO()) == 3
    assert time.monotonic() - started < 15
    err = capsys.readouterr().err
    assert "client 1 failed with exit code 3" in err and "stopped client(s) 0, 2" in err


def test_launcher_forwards_sigterm_to_clients(tmp_path: Path) -> None:
    client = """
        import signal, sys, time
        def bye(signum, frame):
            print('got', signal.Signals(signum).name, flush=True)
            sys.exit(128 + signum)
        signal.signal(signal.SIGTERM, bye)
        print('ready', flush=True)
        time.sleep(60)
    """
    launcher = f"""
        import sys
        from train.launch import run_clients
        sys.exit(run_clients([{python(client)!r}] * 2, grace=5))
    """
    proc = subprocess.Popen(python(launcher), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    while seen.count("ready") < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        seen += line
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "[client 0] got SIGTERM" in out and "[client 1] got SIGTERM" in out
    assert "stopped by SIGTERM (client 0: exit code 143, client 1: exit code 143)" in err


@pytest.mark.slow
def test_sigterm_to_one_client_stops_all_clients_at_the_same_step(tmp_path: Path) -> None:
    """A signal that reaches one client only: all clients agree to stop and checkpoint together."""
    import tensorflow as tf

    run_dir = tmp_path / "run"
    flags = dict(SMALL, limit=2000, steps_per_call=2, checkpoint_every=2, epochs=5)
    commands = client_commands(2, ["--run-dir", str(run_dir), *train_flags(**flags)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTENSOR_")}
    procs = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    try:
        deadline = time.monotonic() + 180
        while tf.train.latest_checkpoint(str(run_dir / "checkpoints")) is None:
            assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, [o[-3000:] for o in outputs]
    steps = {int(o.split("interrupted by SIGTERM at step ")[1].split(";")[0]) for o in outputs}
    assert len(steps) == 1, outputs
    latest = tf.train.latest_checkpoint(str(run_dir / "checkpoints"))
    assert latest.endswith(f"ckpt-{steps.pop()}")
    restored_weights(run_dir, single_device_mesh())  # the jointly written checkpoint restores
