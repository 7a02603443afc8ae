"""Shared fixtures. The serving tests get their SavedModel from `model_base` (one place to
switch from the stand-in builder to the real exporter)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# DTensor meshes in tests use up to 8 virtual CPUs; they must exist before TensorFlow runs any op,
# so configure them when pytest loads this file (every mesh then picks its first N devices).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from common.mesh import configure_devices  # noqa: E402

TEST_DEVICES = 8
configure_devices(TEST_DEVICES, "CPU")

MODEL_NAME = "sentiment"

# A tiny but real training run, shared by the export tests and the serving tests' model versions.
TINY_TRAIN = dict(limit=1000, max_tokens=256, hidden=16, epochs=2, batch_size=32, learning_rate=1e-2,
                  devices=4, strategy="model", progress=False)
_RUNS: dict[int, Path] = {}


def trained_run_dir(seed: int = 0) -> Path:
    """A run directory trained with TINY_TRAIN and `seed`, trained once per session and cached."""
    if seed not in _RUNS:
        import atexit
        import tempfile

        from train.config import TrainConfig
        from train.trainer import train

        root = Path(tempfile.mkdtemp(prefix=f"sentiment-run{seed}-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        train(TrainConfig(run_dir=str(root / "run"), seed=seed, **TINY_TRAIN))
        _RUNS[seed] = root / "run"
    return _RUNS[seed]


@pytest.fixture(scope="session")
def trained_run() -> Path:
    """A tiny trained run directory (checkpoints sharded over a batch=2,model=2 mesh). Read-only:
    copy it before changing anything in it."""
    return trained_run_dir(0)


def add_model_version(model_base: Path, version: int) -> Path:
    """Write version `version` of the model into `model_base` atomically; returns its directory.

    Each version has different weights (seeded by the version number).
    TODO(export): switch to the real exporter (`python -m export`) once it lands.
    """
    from standin_model import build_standin

    return build_standin(model_base, version)


@pytest.fixture(scope="session")
def model_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`models/NAME` holding version 1, built once per session. Do not add versions to it:
    copy it first (`copy_model_base`)."""
    base = tmp_path_factory.mktemp("models") / MODEL_NAME
    add_model_version(base, 1)
    return base


def copy_model_base(model_base: Path, dest: Path) -> Path:
    """A private copy of `model_base` (e.g. to add versions to) at `dest/NAME`."""
    target = dest / model_base.name
    shutil.copytree(model_base, target)
    return target
