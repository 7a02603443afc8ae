"""The input pipeline: splits of the data, and batches of them as DTensors on the mesh.

A split is vectorized once per run (`Features`: each review's few hundred TF-IDF cells, not its
row of the whole vocabulary), and every batch is gathered from it: sparse where DTensor can lay
sparse rows out on the mesh (`first_layer`), else densified one batch at a time, so memory never
holds the corpus as dense rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from common.mesh import ModelLayouts, dim_size
from common.mesh_spec import BATCH, FEATURE, MeshError
from common.model import SparseRows
from common.vectorizer import TfIdf
from train.config import TrainConfig
from train.data import Split, load_data, split_validation

log = logging.getLogger(__name__)

VECTORIZE_CHUNK = 2048
"""Reviews vectorized in one call while a split's `Features` are built."""
EVALUATION_BATCH_BYTES = 128 << 20
"""The most host memory one evaluation batch's dense float32 features take (see `evaluation`)."""
EVALUATION_ROWS = 512


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


SPARSE_MAX_SHARDS = 2
"""DTensor lays a packed SparseTensor's [n, 2] indices out with the tensor's own layout, so a sparse
operand whose second dim is sharded more than 2 ways is refused ("dimension size=2 is not divisible
by ..."): sparse rows need `feature` <= 2, their transpose `batch` <= 2."""


@dataclass(frozen=True)
class FirstLayer:
    """Which of the first layer's two products take sparse operands on a mesh: the forward X·K
    (sparse rows; else dense rows, made on the devices from the transposed rows where there are
    some, see `SparseRows`) and the kernel's gradient Xᵀ·dY (sparse transposed rows, a custom
    gradient; else the tape's product, which DTensor computes from the rows made dense)."""

    sparse_rows: bool
    sparse_transposed: bool

    def __str__(self) -> str:
        if self.sparse_rows == self.sparse_transposed:
            return "sparse" if self.sparse_rows else "dense"
        return "sparse forward, dense gradient" if self.sparse_rows else "sparse gradient, forward dense on the devices"


def first_layer(choice: str, mesh: dtensor.Mesh) -> FirstLayer:
    """`--first-layer` on `mesh`: auto makes each product sparse where DTensor can lay its operand
    out (see SPARSE_MAX_SHARDS); sparse insists on both; dense takes neither."""
    fits = {dim: dim_size(mesh, dim) <= SPARSE_MAX_SHARDS for dim in (BATCH, FEATURE)}
    if choice == "dense":
        return FirstLayer(False, False)
    if choice == "sparse" and not all(fits.values()):
        sizes = ", ".join(f"{dim}={dim_size(mesh, dim)}" for dim in fits)
        raise MeshError(
            f"--first-layer sparse needs a mesh whose {BATCH} and {FEATURE} dims are at most {SPARSE_MAX_SHARDS} "
            f"(DTensor cannot lay sparse rows out over more shards); this mesh has {sizes}: use --first-layer "
            "auto (each product sparse where it can be) or dense")
    return FirstLayer(sparse_rows=fits[FEATURE], sparse_transposed=fits[BATCH])


@dataclass(frozen=True)
class Features:
    """A split's TF-IDF rows, vectorized once: per review its cells' column ids (ascending) and
    weights as ragged rows, and its label; one more row, empty and labelled -1, pads evaluation
    batches (`padding`)."""

    columns: tf.RaggedTensor  # int64 [reviews + 1, None]
    values: tf.RaggedTensor  # float32, the same row lengths
    labels: tf.Tensor  # int64 [reviews + 1]

    @property
    def padding(self) -> int:
        return int(self.labels.shape[0]) - 1

    def __len__(self) -> int:
        return self.padding


def vectorize(vectorizer: TfIdf, split: Split) -> Features:
    """`Features` of a split, VECTORIZE_CHUNK reviews a call (two calls at a time)."""
    def cells(texts: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        rows = tf.sparse.reorder(vectorizer.sparse(texts))
        lengths = tf.math.bincount(rows.indices[:, 0], minlength=tf.size(texts, tf.int64), dtype=tf.int64)
        return rows.indices[:, 1], rows.values, lengths

    started = time.perf_counter()
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(list(split.texts) + [""], tf.string))
    parts = list(ds.batch(VECTORIZE_CHUNK).map(cells, num_parallel_calls=2, deterministic=True))
    columns, values, lengths = (tf.concat([part[i] for part in parts], 0) for i in range(3))
    # The last row ("") has no cells: the padding row.
    labels = tf.constant(np.concatenate([split.labels.astype(np.int64), [-1]]))
    features = Features(tf.RaggedTensor.from_row_lengths(columns, lengths),
                        tf.RaggedTensor.from_row_lengths(values, lengths), labels)
    log.info("vectorized %d reviews (%d vocabulary n-grams in all) in %.1f s", len(split.texts),
             int(columns.shape[0]), time.perf_counter() - started)
    return features


class Batches:
    """Global batches of texts + labels as DTensors laid out for one mesh.

    Each batch is gathered from its split's `Features` (a tf.data pipeline one batch ahead: a dense
    batch takes 4 bytes per review and vocabulary column, so no more are in flight), cut into the
    piece every local device holds (its rows on `batch`, its vocabulary slice on `feature`) and
    packed, as `layer` says: rows dense or sparse, and for training the sparse transposed rows
    too (`SparseRows`). The `DTensorDataset` this replaces was an order of magnitude slower a batch
    (it re-batches row by row, and its already-batched mode hands every device the first feature
    slice on a feature-sharded mesh, TF 2.21).
    """

    def __init__(self, mesh: dtensor.Mesh, layouts: ModelLayouts, vectorizer: TfIdf, config: TrainConfig,
                 layer: FirstLayer = FirstLayer(False, False)) -> None:
        self.mesh = mesh
        self.layouts = layouts
        self.vectorizer = vectorizer
        self.config = config
        self.layer = layer
        self.replicas = dim_size(mesh, BATCH)
        """Batch replicas of the mesh: each gets `global batch / replicas` rows of every batch."""
        self.feature_shards = dim_size(mesh, FEATURE)
        cells = [(loc.get(BATCH, 0), loc.get(FEATURE, 0)) for loc in mesh.local_device_locations()]
        replicas = sorted({replica for replica, _ in cells})
        self.first_replica, self.local_replicas = replicas[0], len(replicas)
        """This process's devices hold batch replicas first_replica.. (contiguous: check_client_mesh)."""
        self.cells = [(replica - self.first_replica, shard) for replica, shard in cells]
        self._features: dict[int, tuple[Split, Features]] = {}

    def features(self, split: Split) -> Features:
        """The split's `Features`, vectorized on first use and kept for the run."""
        key = id(split)
        if key not in self._features:
            self._features[key] = (split, vectorize(self.vectorizer, split))
        return self._features[key][1]

    def iterator(self, features: Features, order: np.ndarray, global_batch: int,
                 training: bool = False) -> Iterator[tuple[tf.Tensor | SparseRows, tf.Tensor]]:
        """Global batches of the `features` rows in `order` (len a multiple of `global_batch`) as
        (features, labels) DTensors: the rows (dense or sparse), or for `training` with a sparse
        gradient `SparseRows`.

        With several clients each gathers only the rows its devices hold (a contiguous block of
        every global batch), so the global batch is the same set of rows a single process uses.
        """
        rows = global_batch // self.replicas
        lo, hi = self.first_replica * rows, (self.first_replica + self.local_replicas) * rows
        mine = np.asarray(order, np.int64).reshape(-1, global_batch)[:, lo:hi]
        transposed = training and self.layer.sparse_transposed

        def cut(batch: tf.Tensor) -> tuple:
            x, y = self._gather(features, batch), tf.gather(features.labels, batch)
            y = tf.reshape(y, [self.local_replicas, rows])
            return (*self._cut(x, rows, transposed), tuple(y[r] for r, _ in self.cells))

        ds = tf.data.Dataset.from_tensor_slices(mine).map(cut, num_parallel_calls=1, deterministic=True).prefetch(1)
        for pieces, flipped, labels in ds:
            x = dtensor.pack(list(pieces), self.layouts.inputs) if pieces else None
            if transposed:
                x = SparseRows(x, dtensor.pack(list(flipped), self.layouts.transposed_inputs))
            yield x, dtensor.pack(list(labels), self.layouts.labels)

    def _gather(self, features: Features, batch: tf.Tensor) -> tf.SparseTensor:
        """Rows `batch` of `features` as a SparseTensor [len(batch), width], in canonical order."""
        columns, values = tf.gather(features.columns, batch), tf.gather(features.values, batch)
        indices = tf.stack([columns.value_rowids(), columns.flat_values], axis=1)
        return tf.SparseTensor(indices, values.flat_values, [tf.size(batch, tf.int64), self.vectorizer.width])

    def _cut(self, x: tf.SparseTensor, rows: int, transposed: bool) -> tuple[tuple, tuple]:
        """This process's rows of a batch cut into the piece each local device holds (in the
        pipeline, so the host only packs): dense, or sparse with the device's own row and column ids
        (canonical order still); and when `transposed` the same cells as [columns, rows]: in the same
        order where the rows go too (the sparse product needs no order, and a fixed one keeps its
        sums deterministic), reordered where the forward product makes them dense (which needs it)."""
        F, columns = self.feature_shards, self.vectorizer.width // self.feature_shards
        if transposed and not self.layer.sparse_rows:
            pieces = ()  # the forward product takes the transposed rows (SparseRows)
        elif not self.layer.sparse_rows:
            dense = tf.reshape(tf.scatter_nd(x.indices, x.values, x.dense_shape), [self.local_replicas, rows, F, columns])
            pieces = tuple(dense[r, :, f, :] for r, f in self.cells)
        if not (self.layer.sparse_rows or transposed):
            return pieces, ()
        replica, shard = x.indices[:, 0] // rows, x.indices[:, 1] // columns
        local = x.indices - tf.stack([replica * rows, shard * columns], axis=1)
        part, parts = tf.cast(replica * F + shard, tf.int32), self.local_replicas * F
        indices, values = tf.dynamic_partition(local, part, parts), tf.dynamic_partition(x.values, part, parts)
        mine = [r * F + f for r, f in self.cells]
        if self.layer.sparse_rows:
            pieces = tuple(tf.SparseTensor(indices[i], values[i], [rows, columns]) for i in mine)
        flipped = tuple(tf.SparseTensor(tf.reverse(indices[i], [1]), values[i], [columns, rows])
                        for i in mine) if transposed else ()
        if not self.layer.sparse_rows:  # the forward product densifies them on the devices: canonical order
            flipped = tuple(tf.sparse.reorder(t) for t in flipped)
        return pieces, flipped

    def training(self, split: Split, rows: np.ndarray) -> Iterator[tuple[tf.Tensor | SparseRows, tf.Tensor]]:
        return self.iterator(self.features(split), rows, self.config.batch_size, training=True)

    def evaluation(self, split: Split) -> Iterator[tuple[tf.Tensor, tf.Tensor]]:
        """Batches over a whole split, padded to full batches with the empty row labelled -1. Up to
        EVALUATION_ROWS rows; fewer for a wide vocabulary when dense: a dense batch is dense on the
        host, and a few are in flight (512 rows of 300k n-grams were 600 MB each, most of a 6.4 GB run)."""
        features = self.features(split)
        rows = EVALUATION_ROWS
        if not self.layer.sparse_rows:
            rows = min(rows, EVALUATION_BATCH_BYTES // (4 * self.vectorizer.width))
        batch = self.config.batch_size * max(1, rows // self.config.batch_size)
        padded = -(-len(features) // batch) * batch
        order = np.concatenate([np.arange(len(features)), np.full(padded - len(features), features.padding)])
        return self.iterator(features, order, batch)
