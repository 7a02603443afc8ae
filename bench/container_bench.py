"""Container benchmark: the container tier's own measurements as the benchmark page's table.

    python bench/container_bench.py

Runs `python -m pytest -m container` (tests/test_containers.py: builds the image with
`scripts/image --local-base`, trains in two client containers and in one process on the host,
serves the export under `podman run` and `podman kube play`, stops a container under load) and
records the figures those tests measured, plus the tier's wall time, as
bench/results/containers.json. The build time depends on what podman's image store already holds
(an empty store builds the base too); the table says which. Needs podman, runc and mmdebstrap
(`scripts/test -m container` installs them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import REPO, record  # bench/results.py, beside this script


def podman_version() -> str:
    out = subprocess.run(["podman", "--version"], capture_output=True, text=True)
    return out.stdout.strip() or "podman not found"


def had_images() -> bool:
    """Whether podman's store held this project's images before the run (a cached build)."""
    out = subprocess.run(["podman", "images", "--quiet", "--filter", "reference=*sentiment-dtensor*"],
                         capture_output=True, text=True)
    return bool(out.stdout.strip())


def main() -> None:
    cached = had_images()
    with tempfile.TemporaryDirectory() as tmp:
        figures_file = Path(tmp) / "figures.json"
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "container", "-q", "-p", "no:cacheprovider",
                               "tests/test_containers.py"], cwd=REPO,
                              env={**os.environ, "SENTIMENT_FIGURES": str(figures_file)})
        tier_s = time.monotonic() - start
        if proc.returncode != 0:
            raise SystemExit(f"the container tier failed (exit {proc.returncode}); nothing recorded")
        figures = json.loads(figures_file.read_text())
    rows = [[what, value] for what, value in figures]
    rows.append(["the tier itself (pytest -m container)",
                 f"{tier_s / 60:.1f} min, {'with' if cached else 'without'} the images cached"])
    for what, value in rows:
        print(f"{what}: {value}")
    record("containers", ["what", "figure"], rows, settings={
        "podman": podman_version(), "image store before the run": "held the images" if cached else "empty"})


if __name__ == "__main__":
    main()
