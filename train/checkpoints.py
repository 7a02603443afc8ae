"""Saving and keeping checkpoints: the latest few, plus the best one, which is never deleted.

Every client calls `save` (writing a sharded DTensor checkpoint is a collective); only the chief
(client 0) updates the state files and deletes old checkpoints. TensorFlow's own `checkpoint` state
file is kept current, so `tf.train.latest_checkpoint` works on a run directory; `best.json` names
the checkpoint with the best validation score.
"""

from __future__ import annotations

import logging
from pathlib import Path

import tensorflow as tf

from common.run_dir import (
    BEST_FILE,
    CHECKPOINT_DIR,
    atomic_write_json,
    atomic_write_text,
    checkpoint_name,
    checkpoint_prefix,
    checkpoint_step,
    checkpoint_steps,
    read_best,
    remove_checkpoint,
)

log = logging.getLogger(__name__)


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
        self.checkpoint.read(prefix).assert_existing_objects_matched()  # the pair of write()

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
