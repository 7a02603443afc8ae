"""Training configuration: one frozen dataclass; `python -m train` flags are generated from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.cli import option
from common.mesh import STRATEGIES
from common.model import ModelConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What `python -m train` does; tests build it directly with tiny values."""

    data: str = option(
        "bundled",
        "training data: 'bundled' (offline demo corpus), an aclImdb directory or .tar.gz, "
        "a .csv/.jsonl file (or 'train.csv,test.csv'), or tfds:imdb_reviews",
    )
    text_field: str = option("text", "text column of CSV/JSONL data")
    label_field: str = option("label", "label column of CSV/JSONL data")
    test_fraction: float = option(0.2, "share of a single CSV/JSONL file held out for testing")
    limit: int | None = option(None, "use at most this many examples per split (quick runs)")
    run_dir: str = option("runs/default", "where checkpoints, vocabulary, config and metrics go")

    max_tokens: int = option(1200, "TF-IDF vocabulary size (model input width)")
    hidden: int = option(64, "hidden units")
    bn_momentum: float = option(0.9, "BatchNorm moving-statistics momentum")

    devices: int = option(8, "number of devices in the mesh (virtual CPUs, or GPUs when present)")
    device_type: Literal["auto", "CPU", "GPU"] = option("auto", "device type; auto uses GPUs when present")
    mesh: str | None = option(None, "mesh as NAME=SIZE,... e.g. batch=4,model=2 (dims: batch, feature, model)")
    strategy: Literal["data", "model", "spatial"] | None = option(
        None,
        "shortcut for a mesh: data (batch=N), model (batch=N/2,model=2), "
        "spatial (batch=N/4,feature=2,model=2); data when neither --mesh nor --strategy",
    )

    optimizer: Literal["adam", "sgd"] = option("adam", "optimizer")
    learning_rate: float = option(1e-3, "learning rate")
    momentum: float = option(0.0, "SGD momentum (0 = plain SGD)")
    epochs: int = option(3, "passes over the training split")
    batch_size: int = option(64, "global batch size; must divide by the mesh's batch dimension")
    seed: int = option(0, "seed for initial weights and data order")
    max_steps: int | None = option(None, "stop after this many steps in total (for quick runs)")
    steps_per_call: int = option(
        20,
        "train steps run inside one compiled call (fewer Python round trips; progress and "
        "interrupts are handled between calls)",
    )

    keep_checkpoints: int = option(3, "checkpoints to keep")
    checkpoint_every: int = option(0, "also checkpoint every N steps within an epoch (0: end of epoch only)")
    resume: bool = option(True, "continue from the latest checkpoint in --run-dir if there is one")
    progress: bool = option(True, "show a progress bar")

    # Multi-client (DTensor's distributed runtime): one process per client.
    num_clients: int = option(1, "number of clients (processes) in a multi-client mesh")
    client_id: int = option(0, "this client's index, 0..num_clients-1")
    jobs: str | None = option(None, "comma-separated host:port of every client (DTENSOR_JOBS)")

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
