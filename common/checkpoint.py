"""Checkpoints of a run, for every stage that writes or reads them (torchtitan's checkpoint
component): names (`ckpt-<step>`), lookup by best / latest / name, a check that every shard is
whole, restoring, and the store that saves and prunes during training.

    runs/NAME/checkpoints/ckpt-<step>.index, .data-*   sharded DTensor checkpoints
    runs/NAME/checkpoints/checkpoint                   TensorFlow's state file (latest and kept)
    runs/NAME/best.json                                the checkpoint with the best validation score

Every client calls `CheckpointStore.save` (writing a sharded DTensor checkpoint is a collective);
only the chief (client 0) updates the state files and deletes old checkpoints.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import tensorflow as tf

from common.run_dir import BEST_FILE, CHECKPOINT_DIR, RunDirError, atomic_write_json, atomic_write_text, read_best

log = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")


def checkpoint_name(step: int) -> str:
    """`ckpt-<step>`: the one naming convention of checkpoints (files, best.json, TF's state file)."""
    return f"ckpt-{step}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint name such as `ckpt-40`; None for anything else."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def checkpoint_prefix(run_dir: Path, step: int) -> str:
    return str(Path(run_dir) / CHECKPOINT_DIR / checkpoint_name(step))


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints on disk (an index file exists), ascending."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    steps = []
    for path in directory.glob("ckpt-*.index"):
        step = checkpoint_step(path.name[: -len(".index")])
        if step is not None:
            steps.append(step)
    return sorted(steps)


def checkpoint_path(run_dir: Path, checkpoint: str | None = "best") -> str:
    """The checkpoint prefix to restore: `best` (the best validation score; the latest when the run
    kept no validation split), `latest`, or a name such as `ckpt-40`. RunDirError if absent."""
    run_dir = Path(run_dir)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise RunDirError(f"no checkpoint in {run_dir / CHECKPOINT_DIR}")
    if checkpoint in (None, "best"):
        best = read_best(run_dir)
        if best is not None and Path(f"{run_dir / CHECKPOINT_DIR / best['checkpoint']}.index").is_file():
            return str(run_dir / CHECKPOINT_DIR / best["checkpoint"])
        checkpoint = "latest"
    if checkpoint == "latest":
        return checkpoint_prefix(run_dir, steps[-1])
    prefix = run_dir / CHECKPOINT_DIR / checkpoint
    if not Path(f"{prefix}.index").is_file():
        names = ", ".join(checkpoint_name(s) for s in steps[-5:])
        raise RunDirError(f"checkpoint {checkpoint!r} not found in {run_dir / CHECKPOINT_DIR} (have: {names}, "
                          "or best, latest)")
    return str(prefix)


def remove_checkpoint(run_dir: Path, step: int) -> None:
    for path in (Path(run_dir) / CHECKPOINT_DIR).glob(f"{checkpoint_name(step)}.*"):
        path.unlink(missing_ok=True)


class DamagedCheckpoint(RunDirError):
    """A checkpoint whose index or data shards are missing, truncated or corrupt."""


def verify_checkpoint(prefix: str) -> dict[str, list[int]]:
    """Read every tensor of a checkpoint on the host (checksums included) and return the shapes by
    variable key; DamagedCheckpoint saying which checkpoint is damaged otherwise.

    A DTensor restore that fails part-way leaves the eager executor poisoned for the rest of the
    process, so a damaged checkpoint must be found before restoring, not by catching the restore."""
    name = Path(prefix).name
    try:
        reader = tf.train.load_checkpoint(prefix)
        shapes = reader.get_variable_to_shape_map()
        for key in shapes:
            reader.get_tensor(key)
    except Exception as exc:  # noqa: BLE001 - the reader raises OpError, IndexError ("Read less bytes"), ...
        cause = _short_cause(exc)
        raise DamagedCheckpoint(f"checkpoint {name} in {Path(prefix).parent} is damaged ({cause})") from None
    return shapes


def _short_cause(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "not found" in first.lower() or "no such file" in first.lower():
        return "a file of it is missing"
    if isinstance(exc, (tf.errors.DataLossError, IndexError)) or any(
            word in first.lower() for word in ("truncated", "corrupt", "checksum", "less bytes")):
        return "a file of it is truncated or corrupt"
    return first[:200]


def restore_checkpoint(checkpoint: tf.train.Checkpoint, prefix: str, *, partial: bool = False) -> None:
    """Restore `checkpoint` (its objects, on their meshes) from `prefix`, after `verify`: a DTensor
    restore that fails part-way would poison the eager executor. `partial`: only the objects
    `checkpoint` holds (e.g. the model without its optimizer)."""
    verify_checkpoint(prefix)
    status = checkpoint.read(prefix)
    if partial:
        status.expect_partial()
    else:
        status.assert_existing_objects_matched()  # the pair of write()


class _SaverRetracing(logging.Filter):
    """TF 2.21's sharded saver defines its tf.function inside `MultiDeviceSaver.save`, so every
    DTensor save is traced anew and, from the fifth on, TensorFlow warns about "excessive retracing"
    that no caller can avoid. Only that warning is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "MultiDeviceSaver.save.<locals>" not in record.getMessage()


logging.getLogger("tensorflow").addFilter(_SaverRetracing())


class CheckpointStore:
    def __init__(self, run_dir: Path, checkpoint: tf.train.Checkpoint, keep: int, chief: bool) -> None:
        self.run_dir = Path(run_dir)
        self.directory = self.run_dir / CHECKPOINT_DIR
        self.checkpoint = checkpoint
        self.keep = keep
        self.chief = chief

    def latest(self) -> str | None:
        steps = checkpoint_steps(self.run_dir)
        return checkpoint_prefix(self.run_dir, steps[-1]) if steps else None

    def restore(self, prefix: str) -> None:
        restore_checkpoint(self.checkpoint, prefix)

    def save(self, step: int, best: dict | None = None) -> str:
        """Write checkpoint `ckpt-<step>`; `best` (a record of its validation score) marks it as the
        best so far. Then keep the latest `keep` checkpoints and the best one."""
        prefix = checkpoint_prefix(self.run_dir, step)
        self.checkpoint.write(prefix)
        if self.chief:
            if best is not None:
                atomic_write_json(self.run_dir / BEST_FILE, {"checkpoint": checkpoint_name(step), **best})
            self._prune()
        return prefix

    def _prune(self) -> None:
        steps = checkpoint_steps(self.run_dir)
        best = read_best(self.run_dir)
        best_step = checkpoint_step(best["checkpoint"]) if best else None
        kept = steps[-self.keep:]
        for step in steps:
            if step not in kept and step != best_step:
                remove_checkpoint(self.run_dir, step)
        remaining = sorted(set(kept) | ({best_step} if best_step in steps else set()))
        # TensorFlow's CheckpointState text format, written directly: its writer is deprecated.
        lines = [f'model_checkpoint_path: "{checkpoint_name(steps[-1])}"']
        lines += [f'all_model_checkpoint_paths: "{checkpoint_name(s)}"' for s in remaining]
        atomic_write_text(self.directory / "checkpoint", "\n".join(lines) + "\n")
