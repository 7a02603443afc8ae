"""A training run's directory, shared by training (writes it) and export (reads it).

    runs/NAME/
      train_config.json  model.json  vocabulary.json   what was trained, and how
      metrics.jsonl                                     one line per finished epoch
      best.json                                         the checkpoint with the best validation score
      held_out.jsonl.gz                                 validation reviews, for export's drift baseline
      selection/                                        with --refit: the run that chose the epochs
      test.json                                         the test split's score, and of which checkpoint
      checkpoints/ckpt-<step>.index, .data-*            sharded DTensor checkpoints (+ TF's state file)
      tensorboard/                                      event files for `tensorboard --logdir runs/`

Every file is written atomically (temp file + rename), so a killed run never leaves half a file.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

MODEL_FILE = "model.json"
CONFIG_FILE = "train_config.json"
METRICS_FILE = "metrics.jsonl"
BEST_FILE = "best.json"
TEST_FILE = "test.json"
CHECKPOINT_DIR = "checkpoints"
SELECTION_DIR = "selection"
"""Inside a run directory trained with --refit: the run that chose the number of epochs."""
HELD_OUT_FILE = "held_out.jsonl.gz"
HELD_OUT_MAX = 5000
"""At most this many held-out reviews are kept for the drift baseline (its deciles need far fewer)."""
TENSORBOARD_DIR = "tensorboard"
TMP_PREFIX = ".tmp-"
"""Exports write `MODEL_DIR/.tmp-<version>-<pid>` and rename it when complete."""


class RunDirError(RuntimeError):
    """A run directory that cannot be used as asked; the message names the flag or file."""


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_text(path, json.dumps(value, indent=2) + "\n")


def write_held_out(run_dir: Path, texts: Sequence[str], labels: Sequence[int]) -> None:
    """The validation reviews (HELD_OUT_MAX of them, evenly spaced, when there are more), which
    export describes in the model's drift baseline: data the model did not train on, kept in the
    run so the export needs no data."""
    step = max(1.0, len(texts) / HELD_OUT_MAX)
    keep = sorted({int(i * step) for i in range(min(len(texts), HELD_OUT_MAX))})
    lines = "".join(json.dumps({"text": texts[i], "label": int(labels[i])}) + "\n" for i in keep)
    path = Path(run_dir) / HELD_OUT_FILE
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as handle:
        handle.write(gzip.compress(lines.encode(), compresslevel=6, mtime=0))
    os.replace(tmp, path)


def read_held_out(run_dir: Path) -> tuple[list[str], list[int]] | None:
    """(texts, labels) of the run's held-out reviews; None when the run kept none."""
    path = Path(run_dir) / HELD_OUT_FILE
    if not path.is_file():
        return None
    try:
        records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
        return [str(r["text"]) for r in records], [int(r["label"]) for r in records]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{path} is damaged ({type(exc).__name__}); delete it to export without a "
                          "drift baseline, or train again") from None


def read_best(run_dir: Path) -> dict | None:
    return _read_record(Path(run_dir) / BEST_FILE)


def read_test(run_dir: Path) -> dict | None:
    return _read_record(Path(run_dir) / TEST_FILE)


def _read_record(path: Path) -> dict | None:
    """A small JSON record of the run; None when it is absent or unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove what killed runs or exports left behind: TensorFlow's `ckpt-*_temp` directories of a
    sharded save that never finished, and export `.tmp-<version>-<pid>` directories whose process is
    gone. Returns what was removed."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        stale = False
        if path.is_dir() and path.name.startswith("ckpt-") and path.name.endswith("_temp"):
            stale = True
        elif path.is_dir() and path.name.startswith(TMP_PREFIX):
            pid = path.name.rsplit("-", 1)[-1]
            stale = not (pid.isdigit() and _alive(int(pid)))
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed leftovers of interrupted runs: %s", ", ".join(p.name for p in removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a torn last line from a crash mid-write (before files were written atomically)
    return records


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    """metrics.jsonl with exactly one line per epoch (the last record of each epoch wins)."""
    by_epoch = {r["epoch"]: r for r in records}
    atomic_write_text(Path(run_dir) / METRICS_FILE, "".join(json.dumps(by_epoch[e]) + "\n" for e in sorted(by_epoch)))
