"""What a benchmark measured, as JSON the documentation renders: `record` writes
bench/results/NAME.json (the commit, the date, the host's CPU and core count, the command and its
settings, and the table of figures with their baselines from the same run), and the docs build
turns `<!-- bench: NAME -->` in docs/benchmarks/ into that table (scripts/docs_hooks.py). So a
benchmark page always shows its last run here, dated once, and its history is in git."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def commit_of(checkout: Path = REPO) -> str:
    """The checkout's short commit, `+changes` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record(name: str, columns: list[str], rows: list[list[Any]], settings: dict[str, Any] | None = None,
           notes: list[str] | None = None, directory: Path = RESULTS) -> Path:
    """Write one benchmark's table (`rows` of already formatted cells under `columns`) as NAME.json."""
    directory.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": name,
        "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "commit": commit_of(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": {"cpu": _cpu(), "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2)},
        "settings": settings or {},
        "columns": columns,
        "rows": [[str(cell) for cell in row] for row in rows],
        "notes": notes or [],
    }
    path = directory / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {os.path.relpath(path)}", file=sys.stderr)
    return path


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    """A table as `record` keeps it, for the terminal: columns padded to their widest cell."""
    widths = [max(len(str(x)) for x in column) for column in zip(columns, *rows)]
    for row in [columns, *rows]:
        print(" | ".join(f"{str(cell):<{w}}" for cell, w in zip(row, widths)))
