"""Quiet, quick, readable command lines: no TensorFlow C++ log lines on the terminal unless asked
for, `--help` in sections with examples that use only flags the command has."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time

import pytest
from serve_process import CPP_LOG, REPO, ServerProcess


IMPORT_LINES = re.compile(r"All log messages before absl|oneDNN custom operations|cudart_stub|cpu_feature_guard")


def _env() -> dict[str, str]:
    """The environment of a user who set nothing (the test session sets TF_CPP_MIN_LOG_LEVEL)."""
    return {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "SENTIMENT_QUIET_TENSORFLOW")}


def run(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**_env(), **env}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("stage", ["train", "export", "serve", "client"])
def test_help_is_quiet(stage):
    out = run("-m", stage, "--help")
    assert out.returncode == 0 and "usage: python -m" in out.stdout
    assert out.stderr == "", out.stderr


@pytest.mark.parametrize("stage", ["train", "export", "serve", "client"])
def test_help_has_sections_and_examples_that_use_its_own_flags(stage):
    from serve.config import ServeConfig
    from train.config import TrainConfig

    text = run("-m", stage, "--help").stdout
    options, _, examples = text.partition("\nexamples:\n")
    commands = [line.strip() for line in examples.splitlines() if line.strip().startswith(f"python -m {stage}")]
    assert commands, text
    used = {flag for command in commands for flag in re.findall(r"(?<=\s)--[a-z][\w-]*", command)}
    assert all(re.search(rf"^\s+{flag}\b", options, re.M) for flag in used), (used, options)
    config = {"train": TrainConfig, "serve": ServeConfig}.get(stage)
    groups = [f.metadata["group"] for f in dataclasses.fields(config) if f.metadata.get("group")] if config else []
    assert all(f"\n{group}:\n" in options for group in groups), groups


@pytest.mark.parametrize("stage", ["export", "serve", "client"])
def test_help_is_quick_and_imports_no_tensorflow(stage):
    code = (f"import sys, runpy; sys.argv = ['{stage}', '--help']\n"
            f"try:\n    runpy.run_module('{stage}', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('TF', 'tensorflow' in sys.modules, file=sys.stderr)")
    start = time.monotonic()
    out = run("-c", code)
    assert out.stderr.strip() == "TF False" and time.monotonic() - start < 3, out.stderr


@pytest.mark.slow
def test_a_real_export_is_quiet_and_verbose_brings_the_lines_back(trained_run, tmp_path):
    out = run("-m", "export", "--checkpoint-dir", str(trained_run), "--model-dir", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    assert not CPP_LOG.search(out.stderr), out.stderr
    # the usual recipe for quiet TensorFlow must not bring back the lines `import tensorflow` prints
    # (what the user's level lets through later, such as ERROR lines, is theirs to see)
    usual = run("-m", "export", "--checkpoint-dir", str(trained_run), "--model-dir", str(tmp_path / "m"),
                TF_CPP_MIN_LOG_LEVEL="2")
    assert usual.returncode == 0 and not IMPORT_LINES.search(usual.stderr), usual.stderr
    verbose = run("-m", "export", "--checkpoint-dir", str(trained_run), "--model-dir", str(tmp_path / "m"),
                  "--verbose")
    assert verbose.returncode == 0 and CPP_LOG.search(verbose.stderr), verbose.stderr


@pytest.mark.slow
def test_serving_workers_are_quiet_too(model_base, tmp_path):
    """Workers are spawned processes, which do not run `python -m serve`'s entry point again."""
    server = ServerProcess(model_base, "--workers", "2", log_path=tmp_path / "serve.log")
    assert server.stop() == 0, server.log()
    log = server.log(full=True)
    assert log.count("version 1 live") == 2 and not CPP_LOG.search(log), log[:3000]


@pytest.mark.slow
@pytest.mark.parametrize("level", [None, "2"], ids=["level-unset", "level-2"])
def test_a_real_training_run_prints_no_tensorflow_lines(tmp_path, level):
    """On the default (feature-sharded) mesh, where grappler's cost model used to log "Incompatible
    Matrix dimensions" E-lines between the epochs, and with the usual TF_CPP_MIN_LOG_LEVEL=2, which
    lets ERROR lines such as the failed cuInit of a machine without a GPU through."""
    out = run("-m", "train", "--no-progress", "--no-refit", "--limit", "400", "--epochs", "2", "--max-tokens", "2000",
              "--run-dir", str(tmp_path / "run"), **({"TF_CPP_MIN_LOG_LEVEL": level} if level else {}))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "epoch 2" in out.stderr and "test accuracy" in out.stdout + out.stderr, out.stderr[-3000:]
    lines = CPP_LOG.findall(out.stdout + out.stderr)
    assert lines == [], out.stderr[-3000:]
