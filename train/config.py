"""Training configuration: one frozen dataclass; `python -m train` flags are generated from it.

TensorFlow-free, so `python -m train --help` and argument errors answer at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.cli import option
from common.cpus import usable_cpus
from common.mesh_spec import (
    STRATEGIES,
    MeshDims,
    MeshError,
    check_cluster,
    default_device_count,
    parse_jobs,
    resolve_mesh_dims,
)
from common.model_config import ModelConfig, VectorizerSettings

MAX_DEFAULT_CPU_DEVICES = 8
"""The most virtual CPU devices `--devices 0` makes (one per core up to this)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What `python -m train` does; tests build it directly with tiny values."""

    data: str = option(
        "bundled",
        "training data: 'bundled' (offline demo corpus), an aclImdb directory or .tar.gz, "
        "a .csv/.jsonl file (or 'train.csv,test.csv'; .gz read transparently), or tfds:imdb_reviews", group="data")
    text_field: str = option("text", "text column of CSV/JSONL data")
    label_field: str = option("label", "label column of CSV/JSONL data")
    test_fraction: float = option(0.2, "share of a single CSV/JSONL file held out for testing")
    validation_fraction: float = option(
        0.1, "share of the training data held out (per class, seeded) to pick the best epoch; 0: keep the last"
    )
    refit: bool = option(True, "after the validation split has chosen the number of epochs (in RUN_DIR/selection), "
                         "train again from scratch on all the training data, validation reviews included, for that "
                         "many epochs (about twice the time; no effect with --validation-fraction 0)")
    limit: int | None = option(None, "use at most this many examples per split (quick runs)")
    run_dir: str = option("runs/default", "where checkpoints, vocabulary, config and metrics go")

    max_tokens: int = option(150_000, "most n-grams in the TF-IDF vocabulary (the model's input width)", group="model")
    ngrams: int = option(3, "longest n-gram in the vocabulary: 1 words only, 2 words and word pairs, 3 also "
                                "word triples")
    sublinear_tf: bool = option(True, "weigh a repeated n-gram by 1 + ln(count) instead of count")
    normalize: bool = option(True, "scale every review's TF-IDF row to unit length")
    min_df: int = option(2, "keep n-grams found in at least this many training reviews")
    nb_weighting: bool = option(True, "weigh each n-gram's TF-IDF by |its naive-Bayes log-count ratio| between "
                                "the classes in the training reviews (NBSVM's feature scaling)")
    hidden: int = option(64, "hidden units")
    dropout: float = option(0.7, "dropout rate on the hidden layer while training (0: none)")
    bn_momentum: float = option(0.9, "BatchNorm moving-statistics momentum")

    devices: int = option(
        0, "number of devices in the mesh (virtual CPUs, or GPUs when present); 0: every GPU when present, else "
           "one virtual CPU device per core this process may use, at most 8 (the size of --mesh when given; 8 "
           "with several clients)", group="mesh and devices")
    device_type: Literal["auto", "CPU", "GPU"] = option("auto", "device type; auto uses GPUs when present")
    mesh: str | None = option(None, "mesh as NAME=SIZE,... e.g. batch=4,model=2 (dims: batch, feature, model)")
    strategy: Literal["feature", "data", "model", "spatial"] | None = option(
        None,
        "shortcut for a mesh: feature (feature=N: the vocabulary side of the first layer sharded over "
        "every device; the default), data (batch=N), model (batch=N/2,model=2), spatial "
        "(batch=N/4,feature=2,model=2)",
    )

    first_layer: Literal["auto", "sparse", "dense"] = option(
        "auto",
        "how a training step multiplies the first layer: sparse (each batch's TF-IDF rows as sparse tensors: "
        "the step costs what the batch's n-grams cost; needs a mesh whose batch and feature dims are at most 2), "
        "dense (every vocabulary column of every review), auto (each of the two products sparse where DTensor "
        "can lay its operand out: the forward one where feature is at most 2, the kernel's gradient where batch "
        "is at most 2; dense otherwise)",
    )

    optimizer: Literal["adam", "sgd"] = option("adam", "optimizer", group="optimization")
    learning_rate: float = option(1.5e-4, "learning rate (the default suits the default --batch-size; scale it "
                                  "with the batch size)")
    weight_decay: float = option(0.0, "decoupled weight decay of the kernels, per step and unit learning rate (AdamW)")
    momentum: float = option(0.0, "SGD momentum (0 = plain SGD)")
    epochs: int = option(10, "most passes over the training split (fewer when --patience stops it)")
    patience: int = option(2, "stop after this many epochs without a better validation score (0: never)")
    batch_size: int = option(256, "global batch size; must divide by the mesh's batch dimension (a larger batch "
                             "spreads a step's fixed cost, Adam over the whole first kernel, over more reviews)")
    seed: int = option(0, "seed for initial weights, dropout, the validation split and data order")
    max_steps: int | None = option(None, "stop after this many steps in total (for quick runs)")
    steps_per_call: int = option(
        20,
        "train steps dispatched between two looks from the host (progress bar, interrupts, "
        "--checkpoint-every): the host waits for the mesh once per this many steps",
    )

    keep_checkpoints: int = option(2, "latest checkpoints to keep (the best one is always kept too)",
                                   group="checkpoints and output")
    checkpoint_every: int = option(0, "also checkpoint every N steps within an epoch (0: end of epoch only)")
    resume: bool = option(True, "continue from the latest checkpoint in --run-dir if there is one")
    progress: bool = option(True, "show progress bars")
    tensorboard: bool = option(True, "write TensorBoard event files to RUN_DIR/tensorboard")

    # Multi-client (DTensor's distributed runtime): one process per client.
    num_clients: int = option(1, "number of clients (processes) in a multi-client mesh",
                              group="several clients (multi-client DTensor)")
    client_id: int = option(0, "this client's index, 0..num_clients-1")
    jobs: str | None = option(None, "comma-separated host:port of every client (DTENSOR_JOBS)")

    def __post_init__(self) -> None:
        if self.devices < 0:
            raise ValueError(f"--devices must be at least 1 (or 0: one per core or GPU), got {self.devices}")
        positive = ("epochs", "batch_size", "keep_checkpoints", "steps_per_call", "max_tokens", "hidden")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must not be negative, got {self.weight_decay}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(f"--validation-fraction must be in [0, 1), got {self.validation_fraction}")
        if self.patience < 0:
            raise ValueError(f"--patience must not be negative, got {self.patience}")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be at least 1, got {self.max_steps}")
        check_cluster(self.num_clients, self.client_id, parse_jobs(self.jobs) if self.jobs else None)
        # the model's and the vectorizer's settings are checked where they are defined
        self.model_config(8)
        self.vectorizer_settings()

    def _strategy(self) -> str | None:
        """--strategy, else feature for one process (None) and data, which gives each client whole
        batch replicas, for several."""
        return self.strategy or (None if self.num_clients == 1 or self.mesh else "data")

    def device_count(self, visible_gpus: int = 0) -> int:
        """--devices, or what 0 stands for given the GPUs TensorFlow sees (`visible_gpus`; 0 for
        --device-type CPU). On CPUs: one virtual device per usable core, at most
        MAX_DEFAULT_CPU_DEVICES: more virtual devices than cores only slow the same training down
        (the default run on the bundled corpus, 2 cores: 50 s on 8 devices, 33 s on 2, the same
        losses and accuracy; bench/train_bench.py shows it per step)."""
        if self.devices:
            return self.devices
        local = visible_gpus or min(usable_cpus(), MAX_DEFAULT_CPU_DEVICES)
        count = default_device_count(self.mesh, self._strategy(), self.num_clients, local)
        if visible_gpus and self.num_clients == 1 and count > visible_gpus:
            what = f"--mesh {self.mesh}" if self.mesh else f"--strategy {self._strategy()}"
            raise MeshError(f"{what} needs {count} devices but this host has {visible_gpus} GPU(s): choose "
                            "another --strategy or --mesh, or --device-type CPU for virtual CPU devices")
        return count

    def mesh_dims(self, devices: int | None = None) -> MeshDims:
        """The mesh's dimensions over `devices` (default: `device_count()`): --mesh, or the strategy."""
        return resolve_mesh_dims(self.mesh, self._strategy(), devices or self.device_count())

    def model_config(self, width: int) -> ModelConfig:
        """The model for a vocabulary `width` n-grams wide."""
        return ModelConfig(max_tokens=width, hidden=self.hidden, bn_momentum=self.bn_momentum)

    def vectorizer_settings(self) -> VectorizerSettings:
        """How texts become features, as the vocabulary and the export keep it."""
        return VectorizerSettings(ngrams=self.ngrams, sublinear_tf=self.sublinear_tf, normalize=self.normalize,
                                  min_df=self.min_df, nb_weighting=self.nb_weighting)
