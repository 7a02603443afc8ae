"""The TF-IDF TextVectorization shared by training (adapt) and export (rebuild from file).

The vectorizer stays on the host: its IDF weights are regular tensors, and mixing them with
DVariables inside one tf.function fails. The vocabulary and IDF weights are saved beside the
checkpoint so that resume and export use exactly the vocabulary the weights were trained on.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

VOCABULARY_FILE = "vocabulary.json"


def _layer(max_tokens: int, **kwargs) -> keras.layers.TextVectorization:
    return keras.layers.TextVectorization(
        max_tokens=max_tokens, output_mode="tf_idf", pad_to_max_tokens=True, **kwargs
    )


def adapt_vectorizer(texts: Sequence[str], max_tokens: int) -> keras.layers.TextVectorization:
    """Learn the vocabulary and IDF weights from the training texts."""
    layer = _layer(max_tokens)
    layer.adapt(tf.data.Dataset.from_tensor_slices(list(texts)).batch(1024))
    return layer


def vectorizer_state(layer: keras.layers.TextVectorization) -> dict:
    vocabulary = [str(token) for token in layer.get_vocabulary()]
    idf = np.asarray(layer._lookup_layer.idf_weights_const)[: len(vocabulary)]  # noqa: SLF001
    return {"max_tokens": int(layer._max_tokens), "vocabulary": vocabulary, "idf": idf.tolist()}  # noqa: SLF001


def save_vectorizer(layer: keras.layers.TextVectorization, run_dir: Path) -> Path:
    """Write vocabulary.json atomically (temp file + rename)."""
    path = run_dir / VOCABULARY_FILE
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".vocabulary.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(vectorizer_state(layer), handle, ensure_ascii=False)
    os.replace(tmp, path)
    return path


def load_vectorizer(run_dir: Path) -> keras.layers.TextVectorization:
    """Rebuild the adapted vectorizer from vocabulary.json."""
    path = run_dir / VOCABULARY_FILE
    state = json.loads(path.read_text(encoding="utf-8"))
    return _layer(
        state["max_tokens"],
        vocabulary=state["vocabulary"],
        idf_weights=np.asarray(state["idf"], np.float32),
    )


def vectorize(layer: keras.layers.TextVectorization, texts: Sequence[str], batch: int = 4096) -> np.ndarray:
    """TF-IDF rows for `texts` as one float32 array [len(texts), max_tokens]."""
    parts = [
        np.asarray(layer(tf.constant(list(texts[i : i + batch]))), np.float32)
        for i in range(0, len(texts), batch)
    ]
    if not parts:
        return np.zeros((0, int(layer._max_tokens)), np.float32)  # noqa: SLF001
    return np.concatenate(parts)
