"""Training configuration: one frozen dataclass; `python -m train` flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.mesh import STRATEGIES
from common.model import ModelConfig


def _help(text: str, default):  # noqa: ANN001 - tiny helper for field(...) with help metadata
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What `python -m train` does; tests build it directly with tiny values."""

    data: str = _help(
        "training data: 'bundled' (offline demo corpus), an aclImdb directory or .tar.gz, "
        "a .csv/.jsonl file (or 'train.csv,test.csv'), or tfds:imdb_reviews",
        "bundled",
    )
    text_field: str = _help("text column of CSV/JSONL data", "text")
    label_field: str = _help("label column of CSV/JSONL data", "label")
    test_fraction: float = _help("share of a single CSV/JSONL file held out for testing", 0.2)
    limit: int | None = _help("use at most this many examples per split (quick runs)", None)
    run_dir: str = _help("where checkpoints, vocabulary, config and metrics go", "runs/default")

    max_tokens: int = _help("TF-IDF vocabulary size (model input width)", 1200)
    hidden: int = _help("hidden units", 64)
    bn_momentum: float = _help("BatchNorm moving-statistics momentum", 0.9)

    devices: int = _help("number of devices in the mesh (virtual CPUs, or GPUs when present)", 8)
    device_type: Literal["auto", "CPU", "GPU"] = _help("device type; auto uses GPUs when present", "auto")
    mesh: str | None = _help("mesh as NAME=SIZE,... e.g. batch=4,model=2 (dims: batch, feature, model)", None)
    strategy: Literal["data", "model", "spatial"] | None = _help(
        "shortcut for a mesh: data (batch=N), model (batch=N/2,model=2), "
        "spatial (batch=N/4,feature=2,model=2); data when neither --mesh nor --strategy",
        None,
    )

    optimizer: Literal["adam", "sgd"] = _help("optimizer", "adam")
    learning_rate: float = _help("learning rate", 1e-3)
    momentum: float = _help("SGD momentum (0 = plain SGD)", 0.0)
    epochs: int = _help("passes over the training split", 3)
    batch_size: int = _help("global batch size; must divide by the mesh's batch dimension", 64)
    seed: int = _help("seed for initial weights and data order", 0)
    max_steps: int | None = _help("stop after this many steps in total (for quick runs)", None)
    steps_per_call: int = _help(
        "train steps run inside one compiled call (fewer Python round trips; progress and "
        "interrupts are handled between calls)",
        20,
    )

    keep_checkpoints: int = _help("checkpoints to keep", 3)
    checkpoint_every: int = _help("also checkpoint every N steps within an epoch (0: end of epoch only)", 0)
    resume: bool = _help("continue from the latest checkpoint in --run-dir if there is one", True)
    progress: bool = _help("show a progress bar", True)

    # Multi-client (DTensor's distributed runtime): one process per client.
    num_clients: int = _help("number of clients (processes) in a multi-client mesh", 1)
    client_id: int = _help("this client's index, 0..num_clients-1", 0)
    jobs: str | None = _help("comma-separated host:port of every client (DTENSOR_JOBS)", None)

    def __post_init__(self) -> None:
        positive = ("devices", "epochs", "batch_size", "keep_checkpoints", "num_clients", "steps_per_call")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        if not 0 <= self.client_id < self.num_clients:
            raise ValueError(f"--client-id must be in 0..{self.num_clients - 1}, got {self.client_id}")
        self.model_config()  # validates max_tokens, hidden, bn_momentum

    def model_config(self) -> ModelConfig:
        return ModelConfig(max_tokens=self.max_tokens, hidden=self.hidden, bn_momentum=self.bn_momentum)
