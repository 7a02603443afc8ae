"""Shared fixtures. The serving tests get their SavedModel from `model_base`: tiny real training
runs exported with `export.export_model`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

# DTensor meshes in tests use up to 8 virtual CPUs; they must exist before TensorFlow runs any op,
# so configure them when pytest loads this file (every mesh then picks its first N devices).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
from common.mesh import configure_devices  # noqa: E402

TEST_DEVICES = 8
configure_devices(TEST_DEVICES, "CPU")

MODEL_NAME = "sentiment"

# A tiny but real training run, shared by the export tests and the serving tests' model versions.
# A model-parallel mesh, so export has to gather sharded variables; 2 devices keep it quick on 2 cores.
# Unigrams and no dropout: on 1,000 reviews a 512-wide vocabulary is better spent on words than word pairs.
TINY_TRAIN = dict(limit=1000, refit=False, max_tokens=512, ngrams=1, dropout=0.0, hidden=16, epochs=2, batch_size=32,
                  learning_rate=1e-2, devices=2, mesh="batch=1,model=2", progress=False, tensorboard=False,
                  patience=0)
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
    """A tiny trained run directory (checkpoints sharded over a model=2 mesh). Read-only:
    copy it before changing anything in it."""
    return trained_run_dir(0)


def add_model_version(model_base: Path, version: int) -> Path:
    """Export version `version` of the real model into `model_base` (`python -m export`'s library call:
    temp dir + rename, so a polling server never sees half a version); returns its directory.

    Versions alternate between two tiny runs trained with different seeds (version v comes from seed
    v % 2), so neighbouring versions have different weights.
    """
    from export import ExportConfig, export_model

    config = ExportConfig(checkpoint_dir=str(trained_run_dir(version % 2)), model_dir=str(model_base), version=version)
    return export_model(config).path


@pytest.fixture(scope="session")
def model_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`models/NAME` holding version 1, built once per session. Do not add versions to it:
    copy it first (`copy_model_base`)."""
    base = tmp_path_factory.mktemp("models") / MODEL_NAME
    add_model_version(base, 1)
    return base


@pytest.fixture(scope="session")
def slow_model(model_base, tmp_path_factory):
    """Factory: delay in seconds -> a model base whose calls take that much longer (cached)."""
    from slow_model import save_slow_model

    made: dict[float, Path] = {}

    def make(delay_s: float) -> Path:
        if delay_s not in made:
            made[delay_s] = save_slow_model(model_base, tmp_path_factory.mktemp("slow"), delay_s)
        return made[delay_s]

    return make


CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps calling Google services on a closed network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium through playwright (no browser download), for the web page and the docs."""
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} not found: the browser tests drive Debian's headless Chromium; "
                    "install it with `apt-get install chromium` (scripts/test does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def copy_model_base(model_base: Path, dest: Path) -> Path:
    """A private copy of `model_base` (e.g. to add versions to) at `dest/NAME`."""
    target = dest / model_base.name
    shutil.copytree(model_base, target)
    return target


def vectorize(vectorizer, texts, batch: int = 1024):  # noqa: ANN001, ANN201 - a TfIdf -> np.ndarray
    """Dense TF-IDF rows for a few texts: what tests inspect (training never densifies a corpus)."""
    import numpy as np
    import tensorflow as tf

    parts = [vectorizer.dense(tf.constant(list(texts[i : i + batch]))).numpy() for i in range(0, len(texts), batch)]
    return np.concatenate(parts) if parts else np.zeros((0, vectorizer.width), np.float32)


# -- the container tier ---------------------------------------------------------------------------

FIGURES = pytest.StashKey[list]()
"""Figures a test measured, as (what, figure) pairs (image size, start-to-ready time...), printed at
the end of the run, and written as JSON to the file $SENTIMENT_FIGURES names (bench/container_bench.py
turns them into the benchmark page's table)."""


def figure(config: pytest.Config, what: str, value: str) -> None:
    """Keep one measured figure for the end of the run (see FIGURES)."""
    config.stash.setdefault(FIGURES, []).append((what, value))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The container tier (podman, an image build) runs only when asked for: `-m container`."""
    if "container" in (config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("container")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("container")]


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:  # noqa: ANN001 - pytest's reporter
    figures = config.stash.get(FIGURES, [])
    if figures:
        terminalreporter.section("measured")
        for what, value in figures:
            terminalreporter.write_line(f"{what}: {value}")
    if os.environ.get("SENTIMENT_FIGURES"):
        Path(os.environ["SENTIMENT_FIGURES"]).write_text(json.dumps(figures))
