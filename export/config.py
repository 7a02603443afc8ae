"""Export configuration: one frozen dataclass; `python -m export` flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass

from common.cli import option

DEFAULT_SAMPLES: tuple[str, ...] = (
    "A wonderful, moving film with brilliant performances. I loved every minute of it.",
    "Boring and predictable from start to finish; a complete waste of time.",
    "The plot was thin, but the acting was great and the ending was fun.",
)
"""Reviews run through the exported model as a check, printed, and written as warm-up requests."""


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """What `python -m export` does; tests build it directly."""

    checkpoint_dir: str = option(
        "runs/default", "training run directory (python -m train --run-dir): checkpoints/, model.json, vocabulary.json"
    )
    model_dir: str = option(
        "models/sentiment", "model base directory for TF Serving (models/NAME); the SavedModel goes to MODEL_DIR/VERSION"
    )
    version: int | None = option(None, "version number to write; default: one more than the highest existing")
    checkpoint: str = option(
        "best", "checkpoint to export: best (the best validation score; the latest if the run kept no "
        "validation split), latest, or a name such as ckpt-40"
    )
    samples: tuple[str, ...] = option(DEFAULT_SAMPLES, "reviews to check, print and use as warm-up requests")

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ValueError("--checkpoint-dir must not be empty")
        if not self.model_dir:
            raise ValueError("--model-dir must not be empty")
        if self.version is not None and self.version < 1:
            raise ValueError(f"--version must be at least 1, got {self.version}")
        if not self.checkpoint or "/" in self.checkpoint:
            raise ValueError(f"--checkpoint must be best, latest or a name such as ckpt-40, got {self.checkpoint!r}")
        if not self.samples:
            raise ValueError("at least one sample review is needed (--sample)")
        if not all(isinstance(s, str) for s in self.samples):
            raise ValueError("samples must be strings")
