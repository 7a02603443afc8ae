"""The house rules, in the fast tier: the import layers of pyproject.toml (import-linter) and
functions that fit on a screen."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60


def test_import_layers_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is a test dependency: pip install -e '.[test]'"
    done = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted(REPO.glob("*/**/*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] in ("bench", ".venv", "build") or parts[0].startswith("."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}() is {lines} lines")
    assert not long, "\n".join(long)
