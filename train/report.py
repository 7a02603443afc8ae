"""What a run tells the outside: metrics.jsonl, TensorBoard event files, log lines, progress bars.

Only client 0 writes files. metrics.jsonl holds exactly one line per finished epoch, also across
interruptions: on resume, lines of epochs the checkpoint does not cover (written just before a
crash) are dropped, and the epoch is recorded once when it finishes again.
"""

from __future__ import annotations

import logging
from pathlib import Path

from common.run_dir import TENSORBOARD_DIR, read_metrics, write_metrics

log = logging.getLogger(__name__)


class Report:
    def __init__(self, run_dir: Path, *, chief: bool, progress: bool, tensorboard: bool, finished_epochs: int) -> None:
        self.run_dir = Path(run_dir)
        self.chief = chief
        self.show_progress = progress and chief
        self.history = [r for r in read_metrics(self.run_dir) if r.get("epoch", 0) <= finished_epochs]
        if chief:
            write_metrics(self.run_dir, self.history)
        self._writer = None
        if chief and tensorboard:
            import tensorflow as tf

            self._writer = tf.summary.create_file_writer(str(self.run_dir / TENSORBOARD_DIR))

    def epoch(self, record: dict, learning_rate: float) -> None:
        """One finished epoch: a metrics line, TensorBoard scalars, a log line."""
        self.history.append(record)
        if self.chief:
            write_metrics(self.run_dir, self.history)
        self._scalars(record["step"], {
            "train/loss": record["train_loss"], "train/accuracy": record["train_accuracy"],
            "validation/loss": record.get("validation_loss"), "validation/accuracy": record.get("validation_accuracy"),
            "learning_rate": learning_rate, "examples_per_second": record.get("examples_per_second"),
        })
        validation = ""
        if record.get("validation_accuracy") is not None:
            validation = f" val_loss {record['validation_loss']:.4f} val_acc {record['validation_accuracy']:.4f}"
        log.info("epoch %d step %d train_loss %.4f train_acc %.4f%s%s", record["epoch"], record["step"],
                 record["train_loss"], record["train_accuracy"], validation, " (best)" if record.get("best") else "")

    def test(self, step: int, loss: float, accuracy: float, checkpoint: str) -> None:
        self._scalars(step, {"test/loss": loss, "test/accuracy": accuracy})
        log.info("test loss %.4f test accuracy %.4f (%s)", loss, accuracy, checkpoint)

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._writer is None:
            return
        import tensorflow as tf

        with self._writer.as_default():
            for name, value in values.items():
                if value is not None:
                    tf.summary.scalar(name, value, step=step)
        self._writer.flush()

    def bar(self, total: int, initial: int, description: str, unit: str = "step"):  # noqa: ANN201
        return progress_bar(self.show_progress, total, description, unit, initial)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def progress_bar(show: bool, total: int, description: str, unit: str = "step", initial: int = 0):  # noqa: ANN201
    """A tqdm bar on the terminal, or None (not shown: no progress, or not the chief client)."""
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=description, unit=unit, dynamic_ncols=True, leave=False)
