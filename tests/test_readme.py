"""The README's first command, as a new user runs it, in a fresh copy of the repository: train,
export and serve on the bundled corpus, answer a prediction, stop on Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from serve_process import REPO

pytestmark = pytest.mark.slow

SETUP_STEPS = ("python3 -m venv ", ". .venv/bin/activate", "pip install ")
"""Install steps: the test environment already has the package installed."""


def readme_first_command() -> list[str]:
    """The first command of the README's set-up section, split into its `&&` steps."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Set-up", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S).group(1).strip().splitlines()[0]
    return [step.strip() for step in command.split("&&")]


def fresh_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return dest


def test_the_readme_first_command_ends_with_a_served_model(tmp_path):
    steps = readme_first_command()
    assert steps[:3] == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install -e ."], steps
    steps = [s for s in steps if not s.startswith(SETUP_STEPS)]
    assert steps[-1] == "python -m serve", steps
    repo = fresh_copy(tmp_path / "repo")
    env = {**os.environ, "PYTHONPATH": str(repo)}  # the copy's code, not the checkout's
    for step in steps[:-1]:
        args = step.split()
        assert args[0] == "python", step
        done = subprocess.run([sys.executable, *args[1:]], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"{step}:\n{done.stderr[-3000:]}"
    server = subprocess.Popen([sys.executable, "-m", "serve"], cwd=repo, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)
    reader.start()
    try:
        output = _wait_for(server, "Ctrl-C stops the server.", lines)
        curl = re.search(r"curl -s (\S+) -d '(.+)'", output)
        assert curl and "python -m client --url http://localhost:8501" in output, output
        r = requests.post(curl.group(1), data=curl.group(2), timeout=10)
        assert r.status_code == 200 and r.json()["predictions"][0]["label"] == "positive", r.text
    finally:
        server.send_signal(signal.SIGINT)
        code = server.wait(30)
    reader.join(10)
    output = "".join(lines)
    assert code == 0 and "shut down cleanly" in output, output[-3000:]


def _wait_for(process: subprocess.Popen, marker: str, lines: list[str], timeout: float = 120) -> str:
    """Wait until the server has printed `marker` (its lines are collected by a reader thread)."""
    end = time.monotonic() + timeout
    while not any(marker in line for line in lines):
        assert process.poll() is None, f"server exited with {process.returncode}:\n{''.join(lines)}"
        assert time.monotonic() < end, f"no {marker!r} after {timeout}s:\n{''.join(lines)}"
        time.sleep(0.1)
    return "".join(lines)


def test_serve_without_a_model_says_what_to_run(tmp_path):
    done = subprocess.run([sys.executable, "-m", "serve"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "models/sentiment does not exist" in done.stderr and "python -m train && python -m export" in done.stderr
    assert "Traceback" not in done.stderr
