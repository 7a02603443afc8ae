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

import json
import math
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np
import tensorflow as tf

from common.model_config import VectorizerSettings
from common.run_dir import atomic_write_text

T = TypeVar("T")

VOCABULARY_FILE = "vocabulary.json"
FORMAT = 2
WIDTH_MULTIPLE = 8
VOCABULARY_PASSES = 2
"""How many times `build_vocabulary` reads the texts (and reports them to its `progress`)."""

_APOSTROPHE = r"'"  # don't -> dont (one token)
# IMDB keeps the site's line breaks as HTML (lowercased first); the other punctuation separates words.
_SEPARATORS = r'<br\s*/?>|[!"#$%&()*+,\-./:;<=>?@\[\\\]^_`{|}~]'
_HASH_BUCKETS = 2**62
"""Word hashes and n-gram keys are kept below 2**62, so folding never reaches int64's sign bit."""
_NO_KEY = -2
"""The key of an n-gram that would span two texts (never in the table: keys are >= -1)."""


def standardize(texts: tf.Tensor) -> tf.Tensor:
    texts = _lower(texts)
    texts = tf.strings.regex_replace(texts, _APOSTROPHE, "")
    return tf.strings.regex_replace(texts, _SEPARATORS, " ")


def _lower(texts: tf.Tensor) -> tf.Tensor:
    """Lower-cased texts, Unicode-aware (`É` -> `é`). Unicode case mapping costs about six times
    ASCII's (232 vs 40 us per 32 IMDB reviews), and most texts are all ASCII, where both give the
    same bytes: those take the ASCII op, only the others (and invalid UTF-8) the Unicode one."""
    plain = tf.strings.regex_full_match(texts, r"[\x00-\x7f]*")
    others = tf.where(tf.logical_not(plain))
    unicode = tf.strings.lower(tf.gather_nd(texts, others), encoding="utf-8")
    return tf.tensor_scatter_nd_update(tf.strings.lower(texts), others, unicode)


def tokens(texts: tf.Tensor, ngrams: int) -> tf.RaggedTensor:
    """Every 1..n-gram of each text, n-grams joined by single spaces: [batch, (tokens)]: the strings
    a vocabulary holds. `build_vocabulary` and `TfIdf.sparse` compute their keys instead, without
    building them (the tests check that both find the same n-grams)."""
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
    return ngram_string_keys(tf.constant(list(vocabulary), tf.string))


def ngram_string_keys(ngrams: tf.Tensor) -> tf.Tensor:
    """The keys of n-gram strings (words joined by single spaces), [n] -> [n] int64."""
    split = tf.strings.split(ngrams, sep=" ")
    hashes = tf.ragged.map_flat_values(tf.strings.to_hash_bucket_fast, split, _HASH_BUCKETS).to_tensor(-1)
    keys = hashes[:, 0] if hashes.shape[1] != 0 else tf.zeros([tf.shape(ngrams)[0]], tf.int64)
    for n in range(1, hashes.shape[1] or 0):
        keys = tf.where(hashes[:, n] >= 0, ngram_key(keys, hashes[:, n]), keys)
    return keys


def ngram_keys(texts: tf.Tensor, ngrams: int) -> tuple[tf.Tensor, tf.Tensor]:
    """(key, row) of every 1..n-gram of the texts, flat: unigrams of all rows first, then bigrams,
    ... (an n-gram belongs to its first word's row). A window that would span two texts gets the
    key `_NO_KEY`, which no n-gram has. No n-gram string is built: each word is hashed once."""
    keys, rows, _ = _ngram_keys_and_words(texts, ngrams)
    return keys, rows


def _ngram_keys_and_words(texts: tf.Tensor, ngrams: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """`ngram_keys` and the texts' words, flat: the k-th key of the n-grams of width w (w = 1 ..
    `ngrams`, in that order) is the key of words k .. k + w - 1."""
    split = tf.raw_ops.StringSplitV2(input=standardize(texts), sep="")  # "": on whitespace
    rows = split.indices[:, 0]
    hashes = tf.strings.to_hash_bucket_fast(split.values, _HASH_BUCKETS)
    keys, key_rows, level = [hashes], [rows], hashes
    for n in range(1, ngrams):
        same_row = tf.equal(rows[:-n], rows[n:])  # the n-gram's first and last word
        level = tf.where(same_row, ngram_key(level[:-1], hashes[n:]), tf.constant(_NO_KEY, tf.int64))
        keys.append(level)
        key_rows.append(rows[:-n])
    return tf.concat(keys, axis=0), tf.concat(key_rows, axis=0), split.values


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
        return self._tfidf(texts, ids, rows)

    def sparse_and_counts(self, texts: tf.Tensor) -> tuple[tf.SparseTensor, dict[str, tf.Tensor]]:
        """`sparse(texts)` and, per review, what drift monitoring needs of it (int64 [batch] each):
        its words, its n-grams (1..n-grams within the review) and those found in the vocabulary.
        The n-grams are hashed and looked up once for both, and the counts take a few ops: the
        server answers predict requests through this (`common.drift.MONITOR_SIGNATURE`)."""
        keys, rows, words = _ngram_keys_and_words(texts, self.settings.ngrams)
        ids, found_rows = self._known(keys, rows)
        batch = tf.shape(texts)[0]
        none = tf.zeros([0], tf.int64)

        def per_review(review_of: tf.Tensor) -> tf.Tensor:
            return tf.raw_ops.Bincount(arr=tf.cast(review_of, tf.int32), size=batch, weights=none)

        word_count = per_review(rows[:tf.size(words)])  # the unigrams come first, one per word
        ngrams = sum(tf.maximum(word_count - k, 0) for k in range(self.settings.ngrams))
        counts = {"words": word_count, "ngrams": ngrams, "known_ngrams": per_review(found_rows)}
        return self._tfidf(texts, ids, found_rows), counts

    def _tfidf(self, texts: tf.Tensor, ids: tf.Tensor, rows: tf.Tensor) -> tf.SparseTensor:
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
        """(vocabulary id, row) of every 1..n-gram of the texts that is in the vocabulary."""
        return self._known(*ngram_keys(texts, self.settings.ngrams))

    def _known(self, keys: tf.Tensor, rows: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(vocabulary id, row) of the n-gram keys found in the vocabulary."""
        ids = self.table.lookup(keys)
        known = tf.where(ids >= 0)[:, 0]
        return tf.gather(ids, known), tf.gather(rows, known)

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
    a multiple of `multiple` (so the mesh's feature dimension divides it). With
    `settings.nb_weighting`, `labels` (0 or 1 per text) give each kept n-gram its naive-Bayes
    weight (`nb_weights`). `progress(k)` is told of every k texts done, in each of two passes.

    Counting is by the n-grams' integer keys (`ngram_string_keys`) in numpy, not by their strings:
    trigrams of 25,000 IMDB reviews are ~8 million distinct strings, gigabytes as Python objects;
    a second pass collects the strings of the n-grams that can be kept, and only those."""
    if settings.nb_weighting and (labels is None or len(labels) != len(texts)):
        raise ValueError("naive-Bayes weighting needs one label per training text")
    positive_texts = np.asarray(labels if settings.nb_weighting else np.zeros(len(texts)), bool)
    counts = _NgramCounts()
    starts = range(0, len(texts), chunk)
    for start, (keys, rows) in zip(starts, _one_ahead(lambda at: _chunk_keys(texts[at : at + chunk], settings.ngrams),
                                                      starts)):
        counts.add(keys, rows, positive_texts[start : start + chunk])
        if progress is not None:
            progress(min(chunk, len(texts) - start))
    keys, terms, docs, positive = counts.totals()
    frequent = docs >= settings.min_df
    keys, terms, docs, positive = keys[frequent], terms[frequent], docs[frequent], positive[frequent]
    if len(keys) > max_tokens:  # keep the candidates: counts above the cut, and the ties at it
        cut = np.partition(terms, len(terms) - max_tokens)[len(terms) - max_tokens]
        candidates = terms >= cut
        keys, terms, docs, positive = keys[candidates], terms[candidates], docs[candidates], positive[candidates]
    strings = _strings_of(keys, texts, settings.ngrams, chunk, progress)
    order = sorted(range(len(keys)), key=lambda i: (-terms[i], strings[i]))[:max_tokens]
    chosen = [strings[i] for i in order]
    n = len(texts)
    idf = np.array([math.log((1 + n) / (1 + docs[i])) + 1.0 for i in order], np.float32)
    nb = None
    if settings.nb_weighting:
        pos = positive[order].astype(np.float64)
        nb = nb_weights(pos, docs[order].astype(np.float64) - pos)
    return TfIdf([t.decode("utf-8") for t in chosen], idf, settings, round_width(len(chosen), multiple), nb)


def _one_ahead(compute: Callable[[int], T], items: Sequence[int]) -> Iterator[T]:
    """`compute(item)` for each item, the next one computed on a thread while the caller works on
    this one: TensorFlow's text ops and numpy's sorts both release the GIL, so the two overlap."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(compute, items[0]) if len(items) else None
        for k in range(len(items)):
            result = pending.result()
            pending = pool.submit(compute, items[k + 1]) if k + 1 < len(items) else None
            yield result


def _chunk_keys(texts: Sequence[str], ngrams: int) -> tuple[np.ndarray, np.ndarray]:
    """(key, text index) of every 1..n-gram of `texts`."""
    keys, rows = (t.numpy() for t in ngram_keys(tf.constant(list(texts)), ngrams))
    real = keys != _NO_KEY
    return keys[real], rows[real]


class _NgramCounts:
    """Per n-gram key: occurrences, texts holding it, positive texts holding it; merged in numpy.

    Each chunk's counts are kept sorted by key, so merging them is a stable sort of sorted runs
    (timsort merges runs in linear passes) and sums over equal neighbours, never a hash table of
    Python objects."""

    MERGE_AT = 4_000_000

    def __init__(self) -> None:
        self._parts: list[tuple[np.ndarray, ...]] = []
        self._pending = 0
        """Keys in the parts added since the last merge (duplicates between them counted)."""
        self._merged = 0
        """Keys in the merged part."""

    def add(self, keys: np.ndarray, rows: np.ndarray, positive_texts: np.ndarray) -> None:
        order = np.argsort(keys, kind="stable")
        unique, first = _distinct(keys[order])
        group = np.cumsum(first) - 1
        size = len(unique)
        # The distinct (n-gram, text) pairs: each is one text holding the n-gram.
        texts = len(positive_texts)
        pairs = np.sort(group * texts + rows[order], kind="stable")  # runs of rows: timsort's case
        pairs = pairs[_distinct(pairs)[1]]
        held, held_rows = pairs // texts, pairs % texts
        self._parts.append((unique, np.bincount(group, minlength=size), np.bincount(held, minlength=size),
                            np.bincount(held[positive_texts[held_rows]], minlength=size)))
        self._pending += size
        if self._pending > max(self.MERGE_AT, self._merged // 2):  # geometric: each key merged O(log) times
            self._parts = [self.totals()]
            self._merged, self._pending = len(self._parts[0][0]), 0

    def totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(keys, occurrences, texts, positive texts), summed over the parts, which it consumes:
        one column is concatenated at a time, and freed before the next."""
        if not self._parts:
            return tuple(np.zeros(0, np.int64) for _ in range(4))  # type: ignore[return-value]
        parts, self._parts = [list(part) for part in self._parts], []

        def column(i: int) -> np.ndarray:
            values = np.concatenate([part[i] for part in parts])
            for part in parts:
                part[i] = None
            return values

        keys = column(0)
        order = np.argsort(keys, kind="stable")
        unique, first = _distinct(keys[order])
        del keys
        starts = np.flatnonzero(first)
        return unique, *(np.add.reduceat(column(i)[order], starts) for i in (1, 2, 3))


def _distinct(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of a sorted array, a mask of where each first occurs)."""
    first = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]] if len(sorted_keys) else np.zeros(0, bool)
    return sorted_keys[first], first


def _strings_of(keys: np.ndarray, texts: Sequence[str], ngrams: int, chunk: int,
                progress: Callable[[int], None] | None) -> list[bytes]:
    """The n-gram string of each key (keys sorted, as `np.unique` leaves them), from a second pass
    that computes the same keys as the first and joins the words of a key's first occurrence only:
    an n-gram string is built once per kept n-gram, not once per occurrence."""
    strings: list[bytes | None] = [None] * len(keys)
    missing = np.ones(len(keys), bool)
    index = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(keys, tf.int64), tf.range(len(keys), dtype=tf.int64)), default_value=-1) if len(keys) else None
    for start in range(0, len(texts), chunk):
        if missing.any():
            chunk_keys, _, words = _ngram_keys_and_words(tf.constant(list(texts[start : start + chunk])), ngrams)
            where, words = index.lookup(chunk_keys).numpy(), words.numpy()
            hits = np.flatnonzero(where >= 0)
            hits = hits[missing[where[hits]]]
            wanted, first = np.unique(where[hits], return_index=True)  # each new key's first occurrence
            at = hits[first]
            # Keys of width w start at offset sum(len(words) - v for v < w) of the flat array.
            offsets = np.cumsum([0] + [len(words) - w for w in range(ngrams)])
            widths = np.searchsorted(offsets, at, side="right")
            for i, word, width in zip(wanted.tolist(), (at - offsets[widths - 1]).tolist(), widths.tolist()):
                strings[i] = b" ".join(words[word : word + width].tolist())
            missing[wanted] = False
        if progress is not None:
            progress(min(chunk, len(texts) - start))
    return strings  # type: ignore[return-value] - every key came from these texts


def nb_weights(positive_docs: np.ndarray, negative_docs: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """|r| of NBSVM (Wang & Manning 2012): r = log((p / |p|_1) / (q / |q|_1)), p and q the smoothed
    counts of training texts of each class holding each n-gram. Its sign (which class an n-gram
    points to) is the model's to learn; its size says how much the n-gram separates the classes."""
    p, q = positive_docs + alpha, negative_docs + alpha
    return np.abs(np.log(p / p.sum()) - np.log(q / q.sum())).astype(np.float32)


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
