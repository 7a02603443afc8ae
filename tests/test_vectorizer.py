"""The TF-IDF vectorizer shared by training and the exported model: cleaning, n-grams, vocabulary,
weights, and bounded memory (the corpus is streamed, features exist one batch at a time)."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import pytest
import tensorflow as tf
from conftest import vectorize

from common import vectorizer as vec
from common.vectorizer import VectorizerSettings, build_vocabulary, load_vectorizer, save_vectorizer, tokens

TEXTS = ["A great film.<br /><br />Great acting, don't miss it!", "A dull film; dull plot.", "Great, GREAT fun",
         "Élan and ÉCLAT: a film"]


def test_cleaning_is_part_of_the_vectorizer():
    got = [[t.decode() for t in row] for row in tokens(tf.constant(TEXTS[:1] + TEXTS[3:]), 1).to_list()]
    assert got == [["a", "great", "film", "great", "acting", "dont", "miss", "it"],
                   ["élan", "and", "éclat", "a", "film"]]  # <br /> is a space, case folded beyond ASCII


def test_lower_casing_takes_the_ascii_op_only_where_it_gives_the_same_bytes():
    texts = tf.constant(["Hello WORLD", "Élan and ÉCLAT", "", "naïve ÇA va", b"bad \xff BYTES", "ASCII <BR />"])
    want = tf.strings.lower(texts, encoding="utf-8").numpy().tolist()  # Unicode case mapping on every text
    assert vec._lower(texts).numpy().tolist() == want
    assert vec._lower(tf.constant([], tf.string)).numpy().tolist() == []


def test_ngrams_change_the_vocabulary():
    unigrams = build_vocabulary(TEXTS, 1000, VectorizerSettings(ngrams=1, min_df=1))
    bigrams = build_vocabulary(TEXTS, 1000, VectorizerSettings(ngrams=2, min_df=1))
    assert "great film" in bigrams.vocabulary and "great film" not in unigrams.vocabulary
    assert set(unigrams.vocabulary) < set(bigrams.vocabulary)
    assert all(" " not in t for t in unigrams.vocabulary)


def test_vocabulary_order_min_df_width_and_idf():
    v = build_vocabulary(TEXTS, 3, VectorizerSettings(ngrams=1, min_df=2))
    assert v.vocabulary == ["great", "a", "film"]  # most frequent first, ties alphabetical; "dull" is in one text
    assert v.width == 8  # rounded up to a multiple of 8
    n, df = len(TEXTS), {"great": 2, "film": 3, "a": 3}
    np.testing.assert_allclose(np.asarray(v.idf)[:3], [math.log((1 + n) / (1 + df[t])) + 1 for t in v.vocabulary],
                               rtol=1e-6)
    assert np.asarray(v.idf)[3:].tolist() == [0.0] * 5
    assert build_vocabulary(TEXTS, 3, VectorizerSettings(ngrams=1, min_df=2), multiple=24).width == 24


def test_weights_sublinear_and_normalised():
    plain = build_vocabulary(TEXTS, 100, VectorizerSettings(ngrams=1, min_df=1, sublinear_tf=False, normalize=False))
    row = vectorize(plain, ["great great great film"])[0]
    great, film = plain.vocabulary.index("great"), plain.vocabulary.index("film")
    idf = np.asarray(plain.idf)
    assert row[great] == pytest.approx(3 * idf[great]) and row[film] == pytest.approx(idf[film])
    sub = build_vocabulary(TEXTS, 100, VectorizerSettings(ngrams=1, min_df=1, sublinear_tf=True, normalize=True))
    row = vectorize(sub, ["great great great film"])[0]
    expected = np.array([(1 + math.log(3)) * idf[great], idf[film]])
    expected /= np.linalg.norm(expected)
    assert (row[great], row[film]) == pytest.approx(tuple(expected))
    assert np.linalg.norm(row) == pytest.approx(1.0)
    assert not vectorize(sub, ["zzz qqq"]).any()  # nothing known: an all-zero row, no NaN


def test_sparse_and_dense_agree_and_save_load_round_trips(tmp_path):
    v = build_vocabulary(TEXTS, 100, VectorizerSettings())
    dense = v.dense(tf.constant(TEXTS)).numpy()
    np.testing.assert_array_equal(tf.sparse.to_dense(tf.sparse.reorder(v.sparse(tf.constant(TEXTS)))).numpy(), dense)
    save_vectorizer(v, tmp_path)
    again = load_vectorizer(tmp_path)
    assert (again.vocabulary, again.width, again.settings) == (v.vocabulary, v.width, v.settings)
    np.testing.assert_array_equal(again.dense(tf.constant(TEXTS)).numpy(), dense)


def test_a_huge_max_tokens_on_a_small_corpus_is_as_wide_as_its_vocabulary_and_streamed(monkeypatch):
    """No examples x vocabulary array: the corpus is tokenised chunk by chunk and the width is what
    the corpus holds, not --max-tokens."""
    from train.data import load_data

    texts = load_data(limit=600).train.texts
    seen: list[int] = []
    real = vec._ngram_keys_and_words

    def spy(batch, ngrams):  # noqa: ANN001
        seen.append(int(batch.shape[0]))
        return real(batch, ngrams)

    monkeypatch.setattr(vec, "_ngram_keys_and_words", spy)  # both passes split the texts through it
    v = build_vocabulary(texts, 5_000_000, VectorizerSettings(ngrams=3, min_df=1), chunk=128)
    assert max(seen) <= 128 and sum(seen) <= vec.VOCABULARY_PASSES * len(texts)
    assert len(v.vocabulary) < 100_000 and v.width == -(-len(v.vocabulary) // 8) * 8


def test_counting_by_key_keeps_what_counting_strings_keeps():
    """build_vocabulary counts n-gram keys in numpy; the n-gram strings counted in Python (what it
    did before: gigabytes for IMDB's trigrams) choose the same n-grams, in the same order, with the
    same idf and naive-Bayes weights, ties at the cut included."""
    from train.data import load_data

    data = load_data(limit=600)
    texts, labels = data.train.texts, data.train.labels.tolist()
    settings = VectorizerSettings(ngrams=3, min_df=2, nb_weighting=True)
    terms, docs, positive = collections.Counter(), collections.Counter(), collections.Counter()
    for text, label in zip(texts, labels):
        row = tokens(tf.constant([text]), 3).flat_values.numpy().tolist()
        terms.update(row)
        docs.update(set(row))
        positive.update(set(row) if label else ())
    ranked = sorted((-count, t) for t, count in terms.items() if docs[t] >= 2)
    cut = 5000
    assert ranked[cut - 1][0] == ranked[cut][0]  # a tie at the cut: the alphabetical order decides
    chosen = [t for _, t in ranked[:cut]]
    v = build_vocabulary(texts, cut, settings, labels=labels, chunk=100)
    assert v.vocabulary == [t.decode() for t in chosen]
    n = len(texts)
    np.testing.assert_allclose(v.idf_values, [math.log((1 + n) / (1 + docs[t])) + 1 for t in chosen], rtol=1e-6)
    pos = np.array([positive[t] for t in chosen], float)
    np.testing.assert_allclose(v.nb, vec.nb_weights(pos, np.array([docs[t] for t in chosen], float) - pos), rtol=1e-6)


def test_merging_the_counts_often_counts_what_merging_once_counts(monkeypatch):
    """The chunks' counts are merged whenever enough have piled up: merged after every few chunks
    (and with empty texts among them) the vocabulary, idf and naive-Bayes weights are the same."""
    from train.data import load_data

    data = load_data(limit=600)
    texts, labels = list(data.train.texts), data.train.labels.tolist()
    texts[50:60] = [""] * 10
    settings = VectorizerSettings(ngrams=3, min_df=2, nb_weighting=True)
    once = build_vocabulary(texts, 3000, settings, labels=labels, chunk=50)
    monkeypatch.setattr(vec._NgramCounts, "MERGE_AT", 5_000)
    often = build_vocabulary(texts, 3000, settings, labels=labels, chunk=50)
    assert often.vocabulary == once.vocabulary
    np.testing.assert_array_equal(often.idf_values, once.idf_values)
    np.testing.assert_array_equal(often.nb, once.nb)


@pytest.mark.parametrize("ngrams", [1, 2, 3])
def test_hashed_ngram_keys_find_exactly_the_vocabularys_ngram_strings(ngrams):
    """`sparse` never builds n-gram strings: its integer keys must find the same vocabulary entries,
    as often, as a lookup of the n-gram strings the vocabulary was counted from."""
    from train.data import load_data

    texts = list(load_data(limit=300).train.texts) + TEXTS + ["", "   ", "x"]
    settings = VectorizerSettings(ngrams=ngrams, min_df=1, sublinear_tf=False, normalize=False)  # value = count x idf
    v = build_vocabulary(texts[:200], 50_000, settings)
    by_string = {token: i for i, token in enumerate(v.vocabulary)}
    idf = np.asarray(v.idf)
    for row, grams in zip(v.dense(tf.constant(texts)).numpy(), tokens(tf.constant(texts), ngrams).to_list()):
        counts = collections.Counter(by_string[g.decode()] for g in grams if g.decode() in by_string)
        assert sorted(np.flatnonzero(row)) == sorted(counts)
        np.testing.assert_allclose([row[i] / idf[i] for i in counts], list(counts.values()), rtol=1e-5)
    assert len(set(vec.vocabulary_keys(v.vocabulary).numpy())) == len(v.vocabulary)


def test_a_rows_features_do_not_depend_on_its_batch():
    from train.data import load_data

    texts = list(load_data(limit=64).train.texts)
    v = build_vocabulary(texts, 5000, VectorizerSettings())
    together = v.dense(tf.constant(texts)).numpy()
    for i in (0, 17, len(texts) - 1):
        np.testing.assert_array_equal(v.dense(tf.constant(texts[i:i + 1])).numpy()[0], together[i])
        np.testing.assert_array_equal(v.dense(tf.constant(texts[i:] + texts[:i])).numpy()[0], together[i])


def test_naive_bayes_weights_scale_each_ngram_by_how_it_separates_the_classes(tmp_path):
    labels = [1, 0, 1, 0]
    settings = VectorizerSettings(ngrams=1, min_df=1, sublinear_tf=False, normalize=False, nb_weighting=True)
    v = build_vocabulary(TEXTS, 100, settings, labels=labels)
    rows = [set(t.decode() for t in row) for row in tokens(tf.constant(TEXTS), 1).to_list()]
    p = np.array([sum(word in row for row, y in zip(rows, labels) if y == 1) + 1 for word in v.vocabulary], float)
    q = np.array([sum(word in row for row, y in zip(rows, labels) if y == 0) + 1 for word in v.vocabulary], float)
    r = np.abs(np.log(p / p.sum()) - np.log(q / q.sum()))  # NBSVM's log-count ratio, Wang & Manning 2012
    np.testing.assert_allclose(v.nb, r, rtol=1e-6)
    great, fun, film = (v.vocabulary.index(w) for w in ("great", "fun", "film"))
    assert v.nb[great] > v.nb[fun] > v.nb[film]  # only in positive texts, "great" in more of them; "film" in both
    plain = build_vocabulary(TEXTS, 100, VectorizerSettings(ngrams=1, min_df=1, sublinear_tf=False, normalize=False))
    row, plain_row = vectorize(v, ["great film fun"])[0], vectorize(plain, ["great film fun"])[0]
    np.testing.assert_allclose(row[: len(r)], plain_row[: len(r)] * r, rtol=1e-6)

    save_vectorizer(v, tmp_path)
    again = load_vectorizer(tmp_path)
    assert again.settings == settings and again.vocabulary == v.vocabulary
    np.testing.assert_array_equal(vectorize(again, TEXTS), vectorize(v, TEXTS))
    with pytest.raises(ValueError, match="one label per training text"):
        build_vocabulary(TEXTS, 100, settings)


def test_a_vocabulary_file_from_before_naive_bayes_weights_still_loads(tmp_path):
    plain = build_vocabulary(TEXTS, 100, VectorizerSettings(ngrams=2, min_df=1))
    save_vectorizer(plain, tmp_path)
    path = tmp_path / vec.VOCABULARY_FILE
    state = json.loads(path.read_text())
    del state["nb_weighting"]  # as the previous release wrote it
    path.write_text(json.dumps(state))
    old = load_vectorizer(tmp_path)
    assert not old.settings.nb_weighting and old.nb is None
    np.testing.assert_array_equal(vectorize(old, TEXTS), vectorize(plain, TEXTS))
