"""The data layer: every source on real files, the bundled corpus's properties, every error."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest

from train import corpus
from train.data import DataError, SentimentData, Split, load_data

ROOT = Path(__file__).resolve().parents[1]

# A tiny aclImdb tree: (split, class) -> {file name: review}; unsup must be ignored.
ACL = {
    ("train", "pos"): {"0_9.txt": "Loved it.<br /><br />Great cast.", "1_8.txt": "A superb film",
                       "2_7.txt": "Fun and warm"},
    ("train", "neg"): {"0_1.txt": "Awful.<br/>Boring plot.", "1_2.txt": "Dull and slow",
                       "2_3.txt": "A waste of time"},
    ("test", "pos"): {"0_10.txt": "Wonderful acting", "1_7.txt": "Really moving"},
    ("test", "neg"): {"0_4.txt": "Terrible script", "1_1.txt": "Painful to watch"},
    ("train", "unsup"): {"0_0.txt": "No label here"},
}


def _fingerprint(data: SentimentData) -> str:
    parts = [data.train.texts, data.train.labels.tolist(),
             data.test.texts, data.test.labels.tolist()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _pairs(split: Split) -> set[tuple[str, int]]:
    return set(zip(split.texts, split.labels.tolist()))


def _write_acl(root: Path) -> Path:
    for (split, cls), files in ACL.items():
        folder = root / "aclImdb" / split / cls
        folder.mkdir(parents=True)
        for name, text in files.items():
            (folder / name).write_text(text, encoding="utf-8")
    return root / "aclImdb"


def _tar(folder: Path, archive: Path) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return archive


def _csv(path: Path, rows: list[tuple[str, str]], header: str = "text,label") -> Path:
    body = "".join(f'"{text}",{label}\n' for text, label in rows)
    path.write_text(f"{header}\n{body}", encoding="utf-8")
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


ROWS = [(f"review {i} {['bad', 'good'][i % 2]}", ["neg", "pos"][i % 2]) for i in range(20)]


@pytest.fixture(scope="module")
def bundled() -> SentimentData:
    return load_data()


# --- the bundled corpus ----------------------------------------------------------------------


def test_bundled_shape_balance_and_disjointness(bundled: SentimentData) -> None:
    assert (len(bundled.train.texts), len(bundled.test.texts)) == (corpus.N_TRAIN, corpus.N_TEST)
    assert bundled.source == "bundled corpus (seed 0, 7000 reviews)"
    for split in (bundled.train, bundled.test):
        assert split.labels.dtype == np.int32 and split.labels.shape == (len(split.texts),)
        assert set(split.labels.tolist()) == {0, 1}
        assert 0.45 < split.labels.mean() < 0.55
        lengths = [len(text.split()) for text in split.texts]
        assert min(lengths) >= corpus.MIN_WORDS and max(lengths) <= corpus.MAX_WORDS
    assert not set(bundled.train.texts) & set(bundled.test.texts)
    assert len(set(bundled.train.texts)) == corpus.N_TRAIN


def test_bundled_is_identical_in_another_process(bundled: SentimentData) -> None:
    code = ("import hashlib, json; from train.data import load_data; d = load_data(); print(hashlib"
            ".sha256(json.dumps([d.train.texts, d.train.labels.tolist(), d.test.texts, "
            "d.test.labels.tolist()]).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "123"}, timeout=60)
    assert out.stdout.strip() == _fingerprint(bundled)


def test_bundled_seed_changes_corpus(bundled: SentimentData) -> None:
    other = load_data(seed=1, limit=50)
    assert other.source.startswith("bundled corpus (seed 1,")
    assert not set(other.train.texts) & set(bundled.train.texts)


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", "", text.lower()).split()  # like TextVectorization's default


def test_bundled_is_learnable_but_not_trivial(bundled: SentimentData) -> None:
    """Naive Bayes on word counts learns it well; no single word gives the label away."""
    counts = [collections.Counter(), collections.Counter()]
    doc_freq = [collections.Counter(), collections.Counter()]
    for text, label in zip(bundled.train.texts, bundled.train.labels.tolist()):
        words = _words(text)
        counts[label].update(words)
        doc_freq[label].update(set(words))
    vocab = set(counts[0]) | set(counts[1])
    totals = [sum(c.values()) + len(vocab) for c in counts]
    weight = {w: math.log((counts[1][w] + 1) / totals[1]) - math.log((counts[0][w] + 1) / totals[0])
              for w in vocab}
    predictions = [sum(weight.get(w, 0.0) for w in _words(text)) > 0 for text in bundled.test.texts]
    accuracy = np.mean(np.array(predictions) == bundled.test.labels)
    assert 0.75 < accuracy < 0.95, accuracy

    # Best rule "contains word w -> label", on train: far from the model above.
    n = len(bundled.train.texts)
    positives = int(bundled.train.labels.sum())
    best = max(max(doc_freq[1][w] + (n - positives) - doc_freq[0][w],
                   doc_freq[0][w] + positives - doc_freq[1][w]) / n for w in vocab)
    assert best < 0.7, best


def test_limit_is_balanced_and_deterministic(bundled: SentimentData) -> None:
    small = load_data(limit=100)
    assert (len(small.train.texts), len(small.test.texts)) == (100, 100)
    assert small.train.labels.sum() == 50
    assert _pairs(small.train) <= _pairs(bundled.train)
    assert _fingerprint(small) == _fingerprint(load_data(limit=100))
    assert small.source.endswith("at most 100 per split")


# --- aclImdb directory and archive -----------------------------------------------------------


def test_aclimdb_directory(tmp_path: Path) -> None:
    root = _write_acl(tmp_path)
    data = load_data(str(root))
    assert data.source == f"aclImdb directory {root}"
    expected = {(split, text, int(cls == "pos"))
                for (split, cls), files in ACL.items() if cls != "unsup" for text in files.values()}
    got = {("train", *p) for p in _pairs(data.train)} | {("test", *p) for p in _pairs(data.test)}
    assert got == expected  # as stored: the vectorizer turns <br /> into a space (test_vectorizer)
    # The parent folder (where the archive was extracted) works too, and shuffling is seeded.
    assert _fingerprint(load_data(str(tmp_path))) == _fingerprint(data)
    assert _fingerprint(load_data(str(root), seed=3)) != _fingerprint(data)


def test_aclimdb_archive_matches_directory(tmp_path: Path) -> None:
    root = _write_acl(tmp_path)
    archive = _tar(root, tmp_path / "aclImdb_v1.tar.gz")
    data = load_data(str(archive))
    assert data.source == f"aclImdb archive {archive}"
    assert _fingerprint(data) == _fingerprint(load_data(str(root)))


# --- CSV and JSONL ---------------------------------------------------------------------------


def test_csv_single_file_split_is_stratified_and_seeded(tmp_path: Path) -> None:
    path = _csv(tmp_path / "reviews.csv", ROWS)
    data = load_data(str(path), test_fraction=0.2)
    assert (len(data.train.texts), len(data.test.texts)) == (16, 4)
    assert data.test.labels.sum() == 2 and data.train.labels.sum() == 8
    assert _pairs(data.train) | _pairs(data.test) == {(t, int(l == "pos")) for t, l in ROWS}
    assert _fingerprint(data) == _fingerprint(load_data(str(path), test_fraction=0.2))
    assert _pairs(load_data(str(path), seed=1).test) != _pairs(data.test)


def test_csv_quoted_multiline_text_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    path.write_bytes(b'\xef\xbb\xbfid,label,text\n1,pos,"line one\nline two, with comma"\n'
                     b"2,neg,plain\n3,1,x\n4,0,y\n5,1,z\n")
    data = load_data(str(path), test_fraction=0.4)
    assert "line one\nline two, with comma" in data.train.texts + data.test.texts


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_gzipped_train_test_pair_is_read_transparently(tmp_path: Path, kind: str) -> None:
    import gzip

    def write(name: str, rows: list[tuple[str, str]]) -> Path:
        plain = _csv(tmp_path / f"{name}.csv", rows) if kind == "csv" else _jsonl(
            tmp_path / f"{name}.jsonl", [{"text": t, "label": label} for t, label in rows])
        packed = plain.with_name(plain.name + ".gz")
        packed.write_bytes(gzip.compress(plain.read_bytes()))
        return packed

    train, test = write("train", ROWS[:12]), write("test", ROWS[12:])
    data = load_data(f"{train},{test}")
    assert _pairs(data.train) == {(t, int(l == "pos")) for t, l in ROWS[:12]}
    assert _pairs(data.test) == {(t, int(l == "pos")) for t, l in ROWS[12:]}
    single = load_data(str(train), test_fraction=0.25)
    assert len(single.train.texts) + len(single.test.texts) == 12
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b not gzip")
    assert "broken.jsonl.gz: not a readable gzip file" in _error(str(tmp_path / "broken.jsonl.gz"))


def test_validation_split_is_stratified_seeded_and_disjoint() -> None:
    from train.data import split_validation

    data = load_data(limit=400)
    rest, validation = split_validation(data.train, 0.1, seed=0)
    assert len(validation.texts) == 40 and validation.labels.sum() == 20
    assert sorted(rest.texts + validation.texts) == sorted(data.train.texts)  # a partition of the training rows
    again = split_validation(data.train, 0.1, seed=0)[1]
    assert again.texts == validation.texts and split_validation(data.train, 0.1, seed=1)[1].texts != validation.texts


def test_jsonl_with_custom_fields(tmp_path: Path) -> None:
    rows = [{"review": text, "sentiment": label, "extra": 1} for text, label in ROWS]
    path = _jsonl(tmp_path / "reviews.jsonl", rows)
    data = load_data(str(path), text_field="review", label_field="sentiment")
    assert _pairs(data.train) | _pairs(data.test) == {(t, int(l == "pos")) for t, l in ROWS}


def test_two_files_give_an_explicit_split(tmp_path: Path) -> None:
    train = _csv(tmp_path / "train.csv", ROWS[:10])
    rows = [{"text": "fine", "label": 1}, {"text": "no", "label": 0}]
    test = _jsonl(tmp_path / "test.jsonl", rows)
    data = load_data(f"{train}, {test}")
    assert data.train.texts == [t for t, _ in ROWS[:10]]  # file order kept
    assert data.test.texts == ["fine", "no"] and data.test.labels.tolist() == [1, 0]
    assert data.source == f"{train} (train) + {test} (test)"


@pytest.mark.parametrize("value, label", [
    (0, 0), (1, 1), ("0", 0), ("1", 1), (" POS ", 1), ("neg", 0), ("Positive", 1), ("NEGATIVE", 0),
])
def test_label_spellings(tmp_path: Path, value: object, label: int) -> None:
    rows = [{"text": "a", "label": value}, {"text": "b", "label": 1 - label}]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    data = load_data(f"{path},{path}")
    assert data.train.labels.tolist() == [label, 1 - label]


# --- errors ----------------------------------------------------------------------------------


def _error(spec: str, **kwargs: object) -> str:
    with pytest.raises(DataError) as info:
        load_data(spec, **kwargs)
    return str(info.value)


def test_unknown_sources(tmp_path: Path) -> None:
    message = _error(str(tmp_path / "nothing-here"))
    assert "no such data source" in message and "nothing-here" in message
    assert "expected 'bundled', an aclImdb directory or .tar.gz, a .csv/.jsonl file, or tfds:NAME" \
        in message
    (tmp_path / "notes.txt").write_text("hi")
    assert "unsupported file type" in _error(str(tmp_path / "notes.txt"))
    assert _error(str(tmp_path / "gone.csv")) == f"{tmp_path / 'gone.csv'}: no such file"
    assert _error(str(tmp_path / "gone.tar.gz")).endswith("gone.tar.gz: no such file")
    train = _csv(tmp_path / "a.csv", ROWS)
    assert "test.csv: no such file" in _error(f"{train},{tmp_path}/test.csv")
    assert "two .csv/.jsonl files" in _error("a.csv,b.csv,c.csv")


@pytest.mark.parametrize("content, message", [
    ("", "reviews.csv line 1: missing column 'text' (header: )"),
    ("text,label\n", "reviews.csv: no rows"),
    ("review,label\nnice,1\n", "reviews.csv line 1: missing column 'text' (header: review, label)"),
    ("text,label\na,1\nb,0,extra\n", "reviews.csv line 3: expected 2 columns, got 3"),
    ("text,label\n" + "a,1\n" * 15 + "b,meh\n",
     "reviews.csv line 17: unknown label 'meh' "
     "(expected one of 0, 1, neg, pos, negative, positive)"),
    ("text,label\n" + "a,pos\n" * 19 + "b,pos\n", "only positive examples; need both classes"),
    ("text,label\na,pos\n", "reviews.csv: 1 rows are too few to hold out test_fraction=0.2"),
])
def test_csv_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "reviews.csv"
    path.write_text(content, encoding="utf-8")
    assert message in _error(str(path))


@pytest.mark.parametrize("lines, message", [
    ([], "reviews.jsonl: no rows"),
    (['{"text": "a", "label": 1}', '{"text": "b", label: 0}'],
     "reviews.jsonl line 2: invalid JSON (Expecting property name enclosed in double quotes"),
    (['{"text": "a", "label": 1}', "", '{"text": "b"}'],
     "reviews.jsonl line 3: missing key 'label'"),
    (['["a", 1]'], "reviews.jsonl line 1: expected a JSON object, got list"),
    (['{"text": 5, "label": 1}'], "reviews.jsonl line 1: 'text' must be a string, got int"),
    (['{"text": "a", "label": true}'], "reviews.jsonl line 1: unknown label True"),
    (['{"text": "a", "label": 2}'], "reviews.jsonl line 1: unknown label 2"),
])
def test_jsonl_errors(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "reviews.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    assert message in _error(str(path))


def test_non_utf8_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "reviews.csv"
    path.write_bytes(b"text,label\nok,1\nfine,0\ncaf\xe9,1\n")
    assert "reviews.csv line 4: not valid UTF-8" in _error(str(path))

    root = _write_acl(tmp_path / "d")
    (root / "train" / "pos" / "3_9.txt").write_bytes(b"caf\xe9")
    message = _error(str(root))
    assert str(root / "train" / "pos" / "3_9.txt") in message and "not valid UTF-8" in message
    archive = _tar(root, tmp_path / "acl.tar.gz")
    assert "acl.tar.gz: aclImdb/train/pos/3_9.txt line 1: not valid UTF-8" in _error(str(archive))


def test_aclimdb_errors(tmp_path: Path) -> None:
    root = _write_acl(tmp_path)
    for name in ACL["test", "neg"]:
        (root / "test" / "neg" / name).unlink()
    assert f"{root}: not an aclImdb tree, no reviews in test/neg/" in _error(str(root))
    (root / "test" / "neg").rmdir()
    assert f"{root}: not an aclImdb directory, test/neg/ is missing" in _error(str(root))

    archive = _tar(root, tmp_path / "partial.tar.gz")
    assert "partial.tar.gz: not an aclImdb tree, no reviews in test/neg/" in _error(str(archive))
    (tmp_path / "broken.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    assert "broken.tar.gz: cannot read the archive" in _error(str(tmp_path / "broken.tar.gz"))


def test_empty_split_and_bad_arguments(tmp_path: Path) -> None:
    train = _csv(tmp_path / "train.csv", ROWS)
    (tmp_path / "test.csv").write_text("text,label\n")
    assert _error(f"{train},{tmp_path / 'test.csv'}").endswith("test.csv: no rows")
    assert "test_fraction must be between 0 and 1, got 1.5" in _error("bundled", test_fraction=1.5)
    assert "limit must be at least 1, got 0" in _error("bundled", limit=0)


# --- TensorFlow Datasets ---------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty TFDS data dir, and any network attempt fails at once instead of hanging."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # TFDS makes a /tmp/tmp*tfds dir it never removes
    return tmp_path


def test_tfds_not_prepared_says_how_to_prepare(offline: Path) -> None:
    message = _error("tfds:imdb_reviews")
    assert message.startswith(f"tfds:imdb_reviews is not prepared in {offline}")
    assert "tfds build imdb_reviews" in message and "aclImdb" in message
    assert _error("tfds:no_such_dataset_xyz") == "tfds:no_such_dataset_xyz: no such TFDS dataset"


def test_tfds_prepared_dataset_is_read(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for a prepared builder: TFDS yields bytes and numpy labels, with IMDB's <br />."""
    import tensorflow_datasets as tfds

    rows = {"train": [{"text": b"Great<br />film", "label": np.int64(1)},
                      {"text": b"Dull", "label": np.int64(0)}],
            "test": [{"text": b"Fine", "label": np.int64(1)}]}

    class Builder:
        data_dir = str(offline / "imdb_reviews")
        info = type("Info", (), {"features": {"text": None, "label": None}, "splits": rows})

        def is_prepared(self) -> bool:
            return True

        def as_dataset(self, split: str) -> list[dict]:
            return rows[split]

    monkeypatch.setattr(tfds, "builder", lambda name, data_dir: Builder())
    monkeypatch.setattr(tfds, "as_numpy", lambda dataset: dataset)
    data = load_data("tfds:imdb_reviews")
    assert data.train.texts == ["Great<br />film", "Dull"] and data.train.labels.tolist() == [1, 0]
    assert data.test.texts == ["Fine"] and data.test.labels.dtype == np.int32
    assert data.source == f"tfds:imdb_reviews ({offline / 'imdb_reviews'})"
    assert "tfds:imdb_reviews: no feature 'review'" in _error("tfds:imdb_reviews",
                                                             text_field="review")
