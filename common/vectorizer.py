"""Text -> TF-IDF features, the same in training (per batch) and in the exported model.

One TensorFlow module does both: `tokens` (lowercase, apostrophes dropped, `<br />` and
punctuation to a space, whitespace split, 1..n-grams) and `sparse` / `dense` (counts of vocabulary
n-grams -> optional sublinear tf `1 + ln(count)` -> times idf, and optionally times the n-gram's
naive-Bayes weight -> optional L2 row normalisation).
The exported SavedModel contains this module, so served text is cleaned and weighted exactly like
training text.

`sparse` never builds an n-gram's string: each word is hashed once (a 64-bit fingerprint), an
n-gram's key is folded from its words' hashes with integer ops (`ngram_key`), and the vocabulary
is an integer-keyed table of the same keys computed from its n-gram strings (`vocabulary_keys`).
That is what every served request pays for, so it is a handful of flat ops; the vocabulary itself
stays readable strings.

The vocabulary is built by streaming the training texts in chunks and counting n-grams
(`build_vocabulary`): no examples x vocabulary array ever exists, here or in the input pipeline,
which vectorizes one batch at a time. Its width is the number of n-grams kept (at most
`max_tokens`), rounded up to a multiple of 8 and of the mesh's feature dimension, so it can be
sharded over the mesh the run started on.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf

from common.model_config import VectorizerSettings
from common.run_dir import atomic_write_text

VOCABULARY_FILE = "vocabulary.json"
FORMAT = 2
WIDTH_MULTIPLE = 8

_APOSTROPHE = r"'"  # don't -> dont (one token)
# IMDB keeps the site's line breaks as HTML (lowercased first); the other punctuation separates words.
_SEPARATORS = r'<br\s*/?>|[!"#$%&()*+,\-./:;<=>?@\[\\\]^_`{|}~]'
_HASH_BUCKETS = 2**62
"""Word hashes and n-gram keys are kept below 2**62, so folding never reaches int64's sign bit."""
_NO_KEY = -2
"""The key of an n-gram that would span two texts (never in the table: keys are >= -1)."""


def standardize(texts: tf.Tensor) -> tf.Tensor:
    texts = tf.strings.lower(texts, encoding="utf-8")
    texts = tf.strings.regex_replace(texts, _APOSTROPHE, "")
    return tf.strings.regex_replace(texts, _SEPARATORS, " ")


def tokens(texts: tf.Tensor, ngrams: int) -> tf.RaggedTensor:
    """Every 1..n-gram of each text, n-grams joined by single spaces: [batch, (tokens)]. The
    vocabulary is counted from these strings; `TfIdf.sparse` computes their keys instead."""
    words = tf.strings.split(standardize(texts))
    if ngrams == 1:
        return words
    return tf.strings.ngrams(words, ngram_width=list(range(1, ngrams + 1)), separator=" ")


def ngram_key(key: tf.Tensor, word_hash: tf.Tensor) -> tf.Tensor:
    """The key of an n-gram extended by one word: (key << 1) ^ hash, kept below 2**62."""
    shifted = tf.bitwise.bitwise_and(tf.bitwise.left_shift(key, tf.constant(1, tf.int64)),
                                     tf.constant(_HASH_BUCKETS - 1, tf.int64))
    return tf.bitwise.bitwise_xor(shifted, word_hash)


def vocabulary_keys(vocabulary: Sequence[str]) -> tf.Tensor:
    """The key `TfIdf.sparse` computes for each vocabulary entry (words joined by single spaces)."""
    if not vocabulary:
        return tf.constant([-1], tf.int64)  # a key no text has: the table needs one entry
    split = tf.strings.split(tf.constant(list(vocabulary), tf.string), sep=" ")
    hashes = tf.ragged.map_flat_values(tf.strings.to_hash_bucket_fast, split, _HASH_BUCKETS).to_tensor(-1)
    keys = hashes[:, 0]
    for n in range(1, hashes.shape[1]):
        keys = tf.where(hashes[:, n] >= 0, ngram_key(keys, hashes[:, n]), keys)
    return keys


class TfIdf(tf.Module):
    """The fitted vectorizer: vocabulary lookup, idf weights, settings. Inputs are UTF-8 strings."""

    def __init__(self, vocabulary: Sequence[str], idf: np.ndarray, settings: VectorizerSettings, width: int,
                 nb: np.ndarray | None = None) -> None:
        super().__init__(name="tfidf")
        if len(vocabulary) > width or len(idf) != len(vocabulary):
            raise ValueError(f"{len(vocabulary)} tokens, {len(idf)} idf weights, width {width}: they do not fit")
        if settings.nb_weighting != (nb is not None) or (nb is not None and len(nb) != len(idf)):
            raise ValueError(f"nb_weighting={settings.nb_weighting} needs one naive-Bayes weight per n-gram")
        # A plain list, not tracked by tf.Module (the SavedModel holds the lookup table instead).
        object.__setattr__(self, "vocabulary", list(vocabulary))
        self.settings = settings
        self.width = width
        keys = vocabulary_keys(self.vocabulary)
        if len(np.unique(keys.numpy())) != len(keys):  # two n-grams, one 62-bit key: ~1e-9 for 100k n-grams
            raise ValueError("two vocabulary n-grams have the same hash key; train again with another --max-tokens")
        values = tf.range(tf.size(keys, out_type=tf.int64), dtype=tf.int64)
        self.table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(keys, values), default_value=-1)
        object.__setattr__(self, "nb", None if nb is None else np.asarray(nb, np.float32))
        object.__setattr__(self, "idf_values", np.asarray(idf, np.float32))
        # One weight per column: idf, times the naive-Bayes weight when there is one (in float64, rounded once).
        padded = np.zeros(width, np.float32)
        padded[: len(idf)] = idf if nb is None else (np.asarray(idf, np.float64) * np.asarray(nb, np.float64))
        self.idf = tf.constant(padded)

    def sparse(self, texts: tf.Tensor) -> tf.SparseTensor:
        """TF-IDF rows as a SparseTensor [batch, width] (float32), in a few flat ops: a call on one
        review costs about as much as the TensorFlow call itself, so every op counts. Its cells are
        not in canonical order (`tf.sparse.reorder` before an op that needs it); matmul takes them
        as they are."""
        ids, rows = self._ngram_ids(texts)
        width = tf.constant(self.width, tf.int64)
        cells, _, counts = tf.unique_with_counts(rows * width + ids, out_idx=tf.int64)
        rows, columns = cells // width, cells % width
        # float64 until the end: vectorized log/rsqrt round differently in SIMD lanes and in the
        # scalar tail, so in float32 a review's features would depend on its place in the batch;
        # float64's differences vanish when rounding to float32 (served answers stay bit-identical).
        values = tf.cast(counts, tf.float64)
        if self.settings.sublinear_tf:
            values = 1.0 + tf.math.log(values)
        values *= tf.cast(tf.gather(self.idf, columns), tf.float64)
        batch = tf.shape(texts, out_type=tf.int64)[0]
        if self.settings.normalize:
            norms = tf.math.unsorted_segment_sum(tf.square(values), rows, batch)
            values *= tf.gather(tf.math.rsqrt(tf.maximum(norms, 1e-24)), rows)
        # Cells in the order their n-grams first occur in each review: per row, the same in any batch.
        return tf.SparseTensor(tf.stack([rows, columns], axis=1), tf.cast(values, tf.float32),
                               tf.stack([batch, width]))

    def _ngram_ids(self, texts: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(vocabulary id, row) of every 1..n-gram of the texts that is in the vocabulary, flat:
        unigrams of all rows first, then bigrams, ... (an n-gram belongs to its first word's row)."""
        split = tf.raw_ops.StringSplitV2(input=standardize(texts), sep="")  # "": on whitespace
        rows = split.indices[:, 0]
        hashes = tf.strings.to_hash_bucket_fast(split.values, _HASH_BUCKETS)
        keys, key_rows, level = [hashes], [rows], hashes
        for n in range(1, self.settings.ngrams):
            same_row = tf.equal(rows[:-n], rows[n:])  # the n-gram's first and last word
            level = tf.where(same_row, ngram_key(level[:-1], hashes[n:]), tf.constant(_NO_KEY, tf.int64))
            keys.append(level)
            key_rows.append(rows[:-n])
        ids = self.table.lookup(tf.concat(keys, axis=0))
        known = tf.where(ids >= 0)[:, 0]
        return tf.gather(ids, known), tf.gather(tf.concat(key_rows, axis=0), known)

    def dense(self, texts: tf.Tensor) -> tf.Tensor:
        """The same rows as a dense [batch, width] float32 tensor (one batch at a time only)."""
        rows = self.sparse(texts)
        return tf.scatter_nd(rows.indices, rows.values, rows.dense_shape)  # each cell once: no order needed

    def state(self) -> dict:
        return {"format": FORMAT, "width": self.width, "ngrams": self.settings.ngrams,
                "sublinear_tf": self.settings.sublinear_tf, "normalize": self.settings.normalize,
                "min_df": self.settings.min_df, "vocabulary": self.vocabulary,
                "nb_weighting": self.settings.nb_weighting, "idf": self.idf_values.tolist(),
                **({"nb": self.nb.tolist()} if self.nb is not None else {})}


def round_width(size: int, multiple: int = WIDTH_MULTIPLE) -> int:
    return max(multiple, -(-size // multiple) * multiple)


def build_vocabulary(
    texts: Sequence[str],
    max_tokens: int,
    settings: VectorizerSettings,
    *,
    labels: Sequence[int] | None = None,
    multiple: int = WIDTH_MULTIPLE,
    chunk: int = 512,
    progress: Callable[[int], None] | None = None,
) -> TfIdf:
    """Count n-grams over the training texts, chunk by chunk, and keep the `max_tokens` most
    frequent (ties broken alphabetically) that occur in at least `min_df` texts. idf is
    scikit-learn's smoothed ln((1 + n) / (1 + df)) + 1. The width is the kept count rounded up to
    a multiple of `multiple` (so the mesh's feature dimension divides it). `progress(k)` is told
    of every k texts done. With `settings.nb_weighting`, `labels` (0 or 1 per text) give each kept
    n-gram its naive-Bayes weight (`nb_weights`)."""
    if settings.nb_weighting and (labels is None or len(labels) != len(texts)):
        raise ValueError("naive-Bayes weighting needs one label per training text")
    term_counts: collections.Counter[bytes] = collections.Counter()
    doc_counts: collections.Counter[bytes] = collections.Counter()
    positive_counts: collections.Counter[bytes] = collections.Counter()
    for start in range(0, len(texts), chunk):
        batch = tokens(tf.constant(list(texts[start : start + chunk])), settings.ngrams)
        for offset, row in enumerate(_rows(batch)):
            term_counts.update(row)
            present = set(row)
            doc_counts.update(present)
            if settings.nb_weighting and labels[start + offset]:
                positive_counts.update(present)
        if progress is not None:
            progress(min(chunk, len(texts) - start))
    kept = [(-count, token) for token, count in term_counts.items() if doc_counts[token] >= settings.min_df]
    kept.sort()
    chosen = [token for _, token in kept[:max_tokens]]
    n = len(texts)
    idf = np.array([math.log((1 + n) / (1 + doc_counts[t])) + 1.0 for t in chosen], np.float32)
    nb = None
    if settings.nb_weighting:
        positive = np.array([positive_counts[t] for t in chosen], np.float64)
        nb = nb_weights(positive, np.array([doc_counts[t] for t in chosen], np.float64) - positive)
    return TfIdf([t.decode("utf-8") for t in chosen], idf, settings, round_width(len(chosen), multiple), nb)


def nb_weights(positive_docs: np.ndarray, negative_docs: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """|r| of NBSVM (Wang & Manning 2012): r = log((p / |p|_1) / (q / |q|_1)), p and q the smoothed
    counts of training texts of each class holding each n-gram. Its sign (which class an n-gram
    points to) is the model's to learn; its size says how much the n-gram separates the classes."""
    p, q = positive_docs + alpha, negative_docs + alpha
    return np.abs(np.log(p / p.sum()) - np.log(q / q.sum())).astype(np.float32)


def _rows(ragged: tf.RaggedTensor) -> Iterable[list[bytes]]:
    values = ragged.flat_values.numpy().tolist()
    splits = ragged.row_splits.numpy().tolist()
    for a, b in zip(splits[:-1], splits[1:]):
        yield values[a:b]


def save_vectorizer(vectorizer: TfIdf, run_dir: Path) -> Path:
    """Write vocabulary.json atomically (temp file + rename)."""
    path = Path(run_dir) / VOCABULARY_FILE
    atomic_write_text(path, json.dumps(vectorizer.state(), ensure_ascii=False))
    return path


def load_vectorizer(run_dir: Path) -> TfIdf:
    """Rebuild the fitted vectorizer from vocabulary.json."""
    state = json.loads((Path(run_dir) / VOCABULARY_FILE).read_text(encoding="utf-8"))
    if state.get("format") != FORMAT:
        raise ValueError(f"{Path(run_dir) / VOCABULARY_FILE} was written by an older version; train a new run")
    settings = VectorizerSettings(ngrams=state["ngrams"], sublinear_tf=state["sublinear_tf"],
                                  normalize=state["normalize"], min_df=state["min_df"],
                                  nb_weighting=state.get("nb_weighting", False))
    nb = np.asarray(state["nb"], np.float32) if settings.nb_weighting else None
    return TfIdf(state["vocabulary"], np.asarray(state["idf"], np.float32), settings, state["width"], nb)
