"""The input pipeline: splits of the data, and batches of them as DTensors on the mesh.

Texts stay texts until a batch is needed: each batch is vectorized on its own (`TfIdf.dense`), so
memory holds a few batches of features, never the corpus. `DTensorDataset` then gives every device
its shard of each batch without Python work per step.

Callers take exactly as many batches as there are: on TF 2.21, running a DTensorDataset iterator to
its end poisons the eager executor and every later DTensorDataset fails with CancelledError.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common.mesh import ModelLayouts, dim_size
from common.mesh_spec import BATCH
from common.vectorizer import TfIdf
from train.config import TrainConfig
from train.data import Split, load_data, split_validation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Splits:
    train: Split
    validation: Split | None
    """Carved from the training data (`--validation-fraction`); None when it is 0."""
    test: Split
    source: str


def load_splits(config: TrainConfig) -> Splits:
    data = load_data(config.data, text_field=config.text_field, label_field=config.label_field,
                     test_fraction=config.test_fraction, seed=config.seed, limit=config.limit)
    train, validation = data.train, None
    if config.validation_fraction:
        train, validation = split_validation(data.train, config.validation_fraction, config.seed)
    return Splits(train, validation, data.test, data.source)


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled row order of one epoch: a pure function of (seed, epoch), so resume can replay it."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def chunks(total: int, size: int) -> Iterator[int]:
    """Split `total` steps into calls of at most `size` steps."""
    while total > 0:
        yield min(size, total)
        total -= size


class Batches:
    """DTensor batches of texts + labels for one mesh and vectorizer."""

    def __init__(self, mesh: dtensor.Mesh, layouts: ModelLayouts, vectorizer: TfIdf, config: TrainConfig) -> None:
        self.mesh = mesh
        self.layouts = layouts
        self.vectorizer = vectorizer
        self.config = config
        self.replicas = dim_size(mesh, BATCH)
        """Batch replicas of the mesh: each gets `global batch / replicas` rows of every batch."""

    def iterator(self, texts: list[str], labels: np.ndarray, global_batch: int) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Global batches of `texts` (len a multiple of `global_batch`) as (features, labels) DTensors.

        In multi-client mode each client feeds only its own interleaved share of the rows; the
        global batch is then the same set of rows a single process uses.
        """
        config = self.config
        ds = tf.data.Dataset.from_tensor_slices((tf.constant(texts, tf.string), tf.constant(labels, tf.int64)))
        if config.num_clients > 1:
            ds = ds.shard(config.num_clients, config.client_id)
        # Vectorize a batch at a time, then hand DTensorDataset single rows: its already-batched
        # mode gives every device the first feature slice on a feature-sharded mesh (TF 2.21).
        per_replica = global_batch // self.replicas
        vectorizer, shape = self.vectorizer, [None, self.vectorizer.width]
        ds = ds.batch(per_replica).map(
            lambda t, y: (tf.ensure_shape(vectorizer.dense(t), shape), y),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
        dds = dtensor.DTensorDataset(
            dataset=ds, mesh=self.mesh, layouts=(self.layouts.inputs, self.layouts.labels),
            global_batch_size=global_batch, batch_dim=BATCH if BATCH in self.mesh.dim_names else None, prefetch=2,
        )
        return iter(dds)

    def training(self, split: Split, rows: np.ndarray) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        texts = [split.texts[i] for i in rows]
        return self.iterator(texts, split.labels[rows].astype(np.int64), self.config.batch_size)

    def evaluation(self, split: Split) -> tuple[Iterator[tuple[tf.Tensor, tf.Tensor]], int, int]:
        """(iterator, batches, batch size) over a whole split, padded to full batches with rows
        whose label is -1 (DTensorDataset fails on a third component such as a weight)."""
        batch = self.config.batch_size * max(1, min(4, 256 // self.config.batch_size))
        padded = -(-len(split.texts) // batch) * batch
        pad = padded - len(split.texts)
        texts = list(split.texts) + [""] * pad
        labels = np.concatenate([split.labels.astype(np.int64), np.full(pad, -1, np.int64)])
        return self.iterator(texts, labels, batch), padded // batch, batch
