"""The input pipeline: splits of the data, and batches of them as DTensors on the mesh.

Texts stay texts until a batch is needed: each batch is vectorized on its own (`TfIdf.dense`), so
memory holds a few batches of features, never the corpus.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common.mesh import ModelLayouts, dim_size
from common.mesh_spec import BATCH, FEATURE
from common.vectorizer import TfIdf
from train.config import TrainConfig
from train.data import Split, load_data, split_validation

log = logging.getLogger(__name__)

EVALUATION_BATCH_BYTES = 128 << 20
"""The most host memory one evaluation batch's dense float32 features take (see `evaluation`)."""


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
    """Global batches of texts + labels as DTensors laid out for one mesh.

    Each batch is vectorized on the host (a tf.data pipeline one batch ahead: a dense batch takes
    4 bytes per review and vocabulary column, and parallel calls would keep several in flight for no
    faster step), cut into the piece every local device holds (its rows on `batch`, its vocabulary slice on `feature`) and
    packed. On 8 virtual CPUs with a 100k-wide vocabulary this takes ~20 ms a batch; the
    `DTensorDataset` it replaces needed ~300 ms (it re-batches row by row, and its already-batched
    mode hands every device the first feature slice on a feature-sharded mesh, TF 2.21).
    """

    def __init__(self, mesh: dtensor.Mesh, layouts: ModelLayouts, vectorizer: TfIdf, config: TrainConfig) -> None:
        self.mesh = mesh
        self.layouts = layouts
        self.vectorizer = vectorizer
        self.config = config
        self.replicas = dim_size(mesh, BATCH)
        """Batch replicas of the mesh: each gets `global batch / replicas` rows of every batch."""
        self.feature_shards = dim_size(mesh, FEATURE)
        cells = [(loc.get(BATCH, 0), loc.get(FEATURE, 0)) for loc in mesh.local_device_locations()]
        replicas = sorted({replica for replica, _ in cells})
        self.first_replica, self.local_replicas = replicas[0], len(replicas)
        """This process's devices hold batch replicas first_replica.. (contiguous: check_client_mesh)."""
        self.cells = [(replica - self.first_replica, shard) for replica, shard in cells]

    def iterator(self, texts: list[str], labels: np.ndarray, global_batch: int) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Global batches of `texts` (len a multiple of `global_batch`) as (features, labels) DTensors.

        With several clients each vectorizes only the rows its devices hold (a contiguous block of
        every global batch), so the global batch is the same set of rows a single process uses.
        """
        rows = global_batch // self.replicas
        lo, hi = self.first_replica * rows, (self.first_replica + self.local_replicas) * rows
        ds = tf.data.Dataset.from_tensor_slices((tf.constant(texts, tf.string), tf.constant(labels, tf.int64)))
        ds = ds.batch(global_batch, drop_remainder=True).map(
            lambda t, y: self._cut(self.vectorizer.dense(t[lo:hi]), y[lo:hi], rows),
            num_parallel_calls=1, deterministic=True).prefetch(1)
        for x, y in ds:
            yield dtensor.pack(list(x), self.layouts.inputs), dtensor.pack(list(y), self.layouts.labels)

    def _cut(self, x: tf.Tensor, y: tf.Tensor, rows: int) -> tuple[tuple[tf.Tensor, ...], tuple[tf.Tensor, ...]]:
        """This process's rows of a batch, cut into the piece each local device holds (in the pipeline,
        so the host only packs)."""
        F = self.feature_shards
        x = tf.reshape(x, [self.local_replicas, rows, F, self.vectorizer.width // F])
        y = tf.reshape(y, [self.local_replicas, rows])
        return tuple(x[r, :, f, :] for r, f in self.cells), tuple(y[r] for r, _ in self.cells)

    def training(self, split: Split, rows: np.ndarray) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        texts = [split.texts[i] for i in rows]
        return self.iterator(texts, split.labels[rows].astype(np.int64), self.config.batch_size)

    def evaluation(self, split: Split) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Batches over a whole split, padded to full batches with rows whose label is -1. Up to 512
        rows, fewer for a wide vocabulary: a batch is dense on the host, and a few are in flight
        (512 rows of 300k n-grams were 600 MB each, most of a 6.4 GB run)."""
        rows = min(512, EVALUATION_BATCH_BYTES // (4 * self.vectorizer.width))
        batch = self.config.batch_size * max(1, rows // self.config.batch_size)
        padded = -(-len(split.texts) // batch) * batch
        pad = padded - len(split.texts)
        texts = list(split.texts) + [""] * pad
        labels = np.concatenate([split.labels.astype(np.int64), np.full(pad, -1, np.int64)])
        return self.iterator(texts, labels, batch)
