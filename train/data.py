"""Sentiment data for the trainer: the bundled corpus, aclImdb, CSV/JSONL files or TFDS.

Every source becomes the same `SentimentData` (texts, int32 labels 0 = negative, 1 = positive),
so the trainer never knows where reviews came from. Bad data raises `DataError` naming the file
and line, so users fix their file instead of reading a traceback.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import logging
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from train import corpus

log = logging.getLogger(__name__)

DEFAULT_DATA = "bundled"
LABELS = {"0": 0, "1": 1, "neg": 0, "pos": 1, "negative": 0, "positive": 1}
_EXPECTED_SOURCES = (
    "expected 'bundled', an aclImdb directory or .tar.gz, a .csv/.jsonl file, or tfds:NAME"
)
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar")
_TABLES = {".csv": "csv", ".jsonl": "jsonl", ".csv.gz": "csv", ".jsonl.gz": "jsonl"}


class DataError(ValueError):
    """Unusable data; the message names the file (and line, where there is one) and the problem."""


@dataclass(frozen=True)
class Split:
    texts: list[str]
    labels: np.ndarray  # int32, 0 = negative, 1 = positive, same length as texts


@dataclass(frozen=True)
class SentimentData:
    train: Split
    test: Split
    source: str  # human-readable, for logs and the run's metadata


def load_data(
    spec: str = DEFAULT_DATA,
    *,
    text_field: str = "text",
    label_field: str = "label",
    test_fraction: float = 0.2,
    seed: int = 0,
    limit: int | None = None,
) -> SentimentData:
    """Load train and test reviews from `spec`, the trainer's --data value.

    `spec` is "bundled", an aclImdb directory or .tar.gz, a .csv/.jsonl file (split with
    `test_fraction` and `seed`), two such files "train.csv,test.csv", or "tfds:NAME". The
    other sources have their own train/test split; `seed` also picks the bundled corpus.
    `limit` caps each split at that many examples (a seeded, class-balanced choice).
    """
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    if limit is not None and limit < 1:
        raise DataError(f"limit must be at least 1, got {limit}")
    train, test, source = _load(spec, text_field, label_field, test_fraction, seed)
    if limit is not None and max(len(train.texts), len(test.texts)) > limit:
        train, test = _cap(train, limit, seed), _cap(test, limit, seed)
        source += f", at most {limit} per split"
    for name, split in (("train", train), ("test", test)):
        if not split.texts:
            raise DataError(f"{source}: the {name} split has no examples")
    if len(np.unique(train.labels)) < 2:
        only = "positive" if train.labels[0] else "negative"
        raise DataError(f"{source}: the train split has only {only} examples; need both classes")
    log.debug("%s: %d train, %d test reviews", source, len(train.texts), len(test.texts))
    return SentimentData(train, test, source)


def _load(
    spec: str, text_field: str, label_field: str, test_fraction: float, seed: int
) -> tuple[Split, Split, str]:
    if spec == "bundled":
        train_texts, train_labels, test_texts, test_labels = corpus.generate(seed)
        source = f"bundled corpus (seed {seed}, {len(train_texts) + len(test_texts)} reviews)"
        return _split(train_texts, train_labels), _split(test_texts, test_labels), source
    if spec.startswith("tfds:"):
        return _load_tfds(spec.removeprefix("tfds:"), text_field, label_field)
    path = Path(spec).expanduser()
    if path.is_dir():
        return *_aclimdb_dir(path, seed), f"aclImdb directory {path}"
    if "," in spec and not path.exists():
        files = [Path(part.strip()).expanduser() for part in spec.split(",")]
        if len(files) != 2 or any(_table_kind(f) is None for f in files):
            raise DataError(f"{spec!r}: an explicit split is two .csv/.jsonl files (or .gz) 'train,test'")
        train, test = (_read_table(f, text_field, label_field) for f in files)
        return train, test, f"{files[0]} (train) + {files[1]} (test)"
    if path.name.endswith(_TAR_SUFFIXES):
        return *_aclimdb_tar(path, seed), f"aclImdb archive {path}"
    if _table_kind(path) is not None:
        rows = _read_table(path, text_field, label_field)
        train, test = _split_rows(rows, test_fraction, seed, path)
        return train, test, f"{path} ({test_fraction:g} held out for test, seed {seed})"
    what = "unsupported file type" if path.is_file() else "not a file or directory"
    raise DataError(f"no such data source {spec!r} ({what}): {_EXPECTED_SOURCES}")


def _split(texts: list[str], labels: list[int]) -> Split:
    return Split(texts, np.asarray(labels, dtype=np.int32))


def _label(value: object, where: str) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value in (0, 1):
        return int(value)
    if isinstance(value, str) and value.strip().lower() in LABELS:
        return LABELS[value.strip().lower()]
    raise DataError(f"{where}: unknown label {value!r} (expected one of {', '.join(LABELS)})")


def _decode(data: bytes, name: str) -> str:
    """UTF-8 text without a BOM; on bad bytes, say which line they are on."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{name} line {line}: not valid UTF-8 ({exc.reason})") from None


# --- CSV and JSONL -------------------------------------------------------------------------


def _table_kind(path: Path) -> str | None:
    """"csv" or "jsonl" for a table file (gzipped or not), else None."""
    name = path.name.lower()
    return next((kind for suffix, kind in _TABLES.items() if name.endswith(suffix)), None)


def _read_table(path: Path, text_field: str, label_field: str) -> Split:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    data = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"{path}: not a readable gzip file ({exc})") from None
    text = _decode(data, str(path))
    read = _read_csv if _table_kind(path) == "csv" else _read_jsonl
    texts, labels = read(text, str(path), text_field, label_field)
    if not texts:
        raise DataError(f"{path}: no rows")
    return _split(texts, labels)


def _read_csv(
    text: str, name: str, text_field: str, label_field: str
) -> tuple[list[str], list[int]]:
    rows = csv.reader(io.StringIO(text, newline=""))
    texts: list[str] = []
    labels: list[int] = []
    try:
        header = [column.strip() for column in next(rows, [])]
        for field in (text_field, label_field):
            if field not in header:
                raise DataError(
                    f"{name} line 1: missing column {field!r} (header: {', '.join(header)})"
                )
        text_at, label_at = header.index(text_field), header.index(label_field)
        for row in rows:
            if not row:
                continue
            where = f"{name} line {rows.line_num}"
            if len(row) != len(header):
                raise DataError(f"{where}: expected {len(header)} columns, got {len(row)}")
            texts.append(row[text_at])
            labels.append(_label(row[label_at], where))
    except csv.Error as exc:
        raise DataError(f"{name} line {rows.line_num}: {exc}") from None
    return texts, labels


def _read_jsonl(
    text: str, name: str, text_field: str, label_field: str
) -> tuple[list[str], list[int]]:
    texts: list[str] = []
    labels: list[int] = []
    # Split on "\n" only: str.splitlines would also split at U+2028 inside JSON strings.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: invalid JSON ({exc.msg}, column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for field in (text_field, label_field):
            if field not in row:
                raise DataError(f"{where}: missing key {field!r}")
        if not isinstance(row[text_field], str):
            kind = type(row[text_field]).__name__
            raise DataError(f"{where}: {text_field!r} must be a string, got {kind}")
        texts.append(row[text_field])
        labels.append(_label(row[label_field], where))
    return texts, labels


def _split_rows(rows: Split, test_fraction: float, seed: int, path: Path) -> tuple[Split, Split]:
    """Hold out `test_fraction` of each class (seeded), so both splits keep the class balance."""
    rng = np.random.default_rng(seed)
    is_test = np.zeros(len(rows.texts), dtype=bool)
    for label in (0, 1):
        members = np.flatnonzero(rows.labels == label)
        is_test[rng.permutation(members)[: round(len(members) * test_fraction)]] = True
    if is_test.all() or not is_test.any():
        raise DataError(
            f"{path}: {len(rows.texts)} rows are too few to hold out test_fraction={test_fraction}"
        )
    return _take(rows, np.flatnonzero(~is_test)), _take(rows, np.flatnonzero(is_test))


def split_validation(train: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """(rest, validation): `fraction` of each class held out, chosen by `seed` (the same every time)."""
    rng = np.random.default_rng([seed, 1])
    held = np.zeros(len(train.texts), dtype=bool)
    for label in (0, 1):
        members = np.flatnonzero(train.labels == label)
        held[rng.permutation(members)[: int(round(len(members) * fraction))]] = True
    if fraction and (held.all() or not held.any()):
        raise DataError(f"{len(train.texts)} training examples are too few for --validation-fraction {fraction}")
    return _take(train, np.flatnonzero(~held)), _take(train, np.flatnonzero(held))


def _take(split: Split, indices: np.ndarray) -> Split:
    return Split([split.texts[i] for i in indices], split.labels[indices])


def _cap(split: Split, limit: int, seed: int) -> Split:
    """A seeded choice of `limit` examples, alternating classes so small caps keep both."""
    if len(split.texts) <= limit:
        return split
    order = np.random.default_rng(seed).permutation(len(split.texts))
    rank = np.empty(len(order), dtype=np.int64)  # position among examples of the same class
    for label in (0, 1):
        same = split.labels[order] == label
        rank[same] = np.arange(same.sum())
    return _take(split, order[np.sort(np.argsort(rank, kind="stable")[:limit])])


# --- aclImdb ---------------------------------------------------------------------------------

_ACL_FOLDERS = [(split, cls) for split in ("train", "test") for cls in ("neg", "pos")]


def _review_text(data: bytes, name: str) -> str:
    """A review as stored (IMDB's `<br />` included: the vectorizer's standardization turns it
    into a space, in training and in the exported model alike)."""
    return _decode(data, name).strip()


def _aclimdb_dir(root: Path, seed: int) -> tuple[Split, Split]:
    if not (root / "train").is_dir() and (root / "aclImdb" / "train").is_dir():
        root = root / "aclImdb"  # the folder the archive was extracted into
    reviews: dict[tuple[str, str], list[str]] = {}
    for split, cls in _ACL_FOLDERS:
        folder = root / split / cls
        if not folder.is_dir():
            raise DataError(f"{root}: not an aclImdb directory, {split}/{cls}/ is missing")
        files = sorted(folder.glob("*.txt"))
        reviews[split, cls] = [_review_text(f.read_bytes(), str(f)) for f in files]
    return _aclimdb_splits(reviews, root, seed)


def _aclimdb_tar(path: Path, seed: int) -> tuple[Split, Split]:
    """Stream the archive (the 80 MB original included) without extracting it to disk."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    found: dict[tuple[str, str], list[tuple[str, str]]] = {key: [] for key in _ACL_FOLDERS}
    try:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                key = tuple(parts[-3:-1])
                if member.isfile() and parts[-1].endswith(".txt") and key in found:
                    data = tar.extractfile(member).read()
                    text = _review_text(data, f"{path}: {member.name}")
                    found[key].append((member.name, text))
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: cannot read the archive ({exc})") from None
    # Archive order is arbitrary; sort by name so the result matches the extracted directory.
    reviews = {key: [text for _, text in sorted(items)] for key, items in found.items()}
    return _aclimdb_splits(reviews, path, seed)


def _aclimdb_splits(
    reviews: dict[tuple[str, str], list[str]], where: Path, seed: int
) -> tuple[Split, Split]:
    """Train and test splits, shuffled: aclImdb lists all negatives before all positives."""
    empty = [f"{split}/{cls}/" for (split, cls), texts in reviews.items() if not texts]
    if empty:
        raise DataError(f"{where}: not an aclImdb tree, no reviews in {', '.join(empty)}")
    rng = np.random.default_rng(seed)
    splits = []
    for split in ("train", "test"):
        texts = reviews[split, "neg"] + reviews[split, "pos"]
        labels = [0] * len(reviews[split, "neg"]) + [1] * len(reviews[split, "pos"])
        splits.append(_take(_split(texts, labels), rng.permutation(len(texts))))
    return splits[0], splits[1]


# --- TensorFlow Datasets ---------------------------------------------------------------------


def _load_tfds(name: str, text_field: str, label_field: str) -> tuple[Split, Split, str]:
    """Read a prepared TFDS dataset; never downloads, so training stays offline and quick."""
    import tensorflow_datasets as tfds  # heavy, and only this source needs it

    # tfds reads TFDS_DATA_DIR once, at import; read it here so a late setting counts too.
    try:
        builder = tfds.builder(name, data_dir=os.environ.get("TFDS_DATA_DIR"))
    except tfds.core.DatasetNotFoundError:
        raise DataError(f"tfds:{name}: no such TFDS dataset") from None
    if not builder.is_prepared():
        raise DataError(
            f"tfds:{name} is not prepared in {builder.data_dir}: download it once with network "
            f"access (`tfds build {name}`, and set TFDS_DATA_DIR if it is not the default "
            f"~/tensorflow_datasets), or pass the aclImdb directory or aclImdb_v1.tar.gz instead"
        )
    features = builder.info.features
    for field in (text_field, label_field):
        if field not in features:
            raise DataError(f"tfds:{name}: no feature {field!r} (features: {', '.join(features)})")
    splits = []
    for split in ("train", "test"):
        if split not in builder.info.splits:
            raise DataError(f"tfds:{name}: no {split!r} split")
        texts, labels = [], []
        for number, row in enumerate(tfds.as_numpy(builder.as_dataset(split=split))):
            where = f"tfds:{name} {split} example {number}"
            texts.append(_review_text(row[text_field], where))
            label = row[label_field]
            labels.append(_label(label.decode() if isinstance(label, bytes) else label, where))
        splits.append(_split(texts, labels))
    return splits[0], splits[1], f"tfds:{name} ({builder.data_dir})"
