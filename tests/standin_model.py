"""Stand-in SavedModel builder for serving tests, until `python -m export` lands.

Writes `<model_dir>/<version>/` with exactly the signatures of the export contract:

- `serving_default`: `text` tf.string [None] -> `probabilities` float32 [None, 2],
  `logits` float32 [None, 2], `label` tf.string [None] (class order negative, positive).
- `classify` (method tensorflow/serving/classify): `inputs` tf.string [None] of serialized
  tf.train.Example with bytes feature `text` -> `classes` tf.string [None, 2], `scores` float32 [None, 2].

plus `assets.extra/tf_serving_warmup_requests`. The model is a TextVectorization (multi-hot)
followed by one linear layer whose weights come from a small word list, so predictions are
deterministic, differ between seeds (versions) and do not depend on the rest of the batch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import tensorflow as tf

CLASS_NAMES = ("negative", "positive")

_POSITIVE = "good great excellent wonderful loved love best fun enjoyable brilliant".split()
_NEGATIVE = "bad awful terrible boring worst hated hate waste poor dull".split()
_NEUTRAL = "the a movie film plot actor story and was it this".split()


class StandinModel(tf.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        vocab = _POSITIVE + _NEGATIVE + _NEUTRAL
        self.vectorizer = tf.keras.layers.TextVectorization(
            max_tokens=len(vocab) + 2, output_mode="multi_hot", vocabulary=vocab
        )
        rng = np.random.default_rng(seed)
        width = len(vocab) + 1  # + OOV
        w = rng.normal(0.0, 0.1, size=(width, 2)).astype(np.float32)
        for word in _POSITIVE:
            w[vocab.index(word) + 1] += (-1.0, 1.0)
        for word in _NEGATIVE:
            w[vocab.index(word) + 1] += (1.0, -1.0)
        self.w = tf.Variable(w, name="w")
        self.b = tf.Variable(rng.normal(0.0, 0.05, size=(2,)).astype(np.float32), name="b")
        self.class_names = tf.constant(CLASS_NAMES)

    def _scores(self, text: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x = self.vectorizer(text)
        logits = tf.matmul(tf.cast(x, tf.float32), self.w) + self.b
        return logits, tf.nn.softmax(logits)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serve(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        logits, probabilities = self._scores(text)
        label = tf.gather(self.class_names, tf.argmax(logits, axis=1))
        return {"probabilities": probabilities, "logits": logits, "label": label}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify(self, inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        features = tf.io.parse_example(inputs, {"text": tf.io.FixedLenFeature([], tf.string, default_value="")})
        _, probabilities = self._scores(features["text"])
        classes = tf.tile(self.class_names[tf.newaxis, :], [tf.shape(inputs)[0], 1])
        return {"classes": classes, "scores": probabilities}


def _write_warmup(version_dir: Path) -> None:
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    extra = version_dir / "assets.extra"
    extra.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(extra / "tf_serving_warmup_requests")) as writer:
        for texts in (["a great movie"], ["a terrible movie", "fun", "boring plot"]):
            request = predict_pb2.PredictRequest(
                model_spec=model_pb2.ModelSpec(name="standin", signature_name="serving_default")
            )
            request.inputs["text"].CopyFrom(tf.make_tensor_proto(texts, dtype=tf.string))
            log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(log.SerializeToString())


def build_standin(model_dir: str | os.PathLike, version: int = 1, seed: int | None = None) -> Path:
    """Write a stand-in SavedModel to `<model_dir>/<version>/` atomically (temp dir + rename)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    final = model_dir / str(version)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=model_dir))
    try:
        module = StandinModel(seed if seed is not None else version)
        tf.saved_model.save(
            module,
            str(tmp),
            signatures={
                "serving_default": module.serve.get_concrete_function(),
                "classify": module.classify.get_concrete_function(),
            },
        )
        _write_warmup(tmp)
        _mark_classify(tmp)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _mark_classify(saved_model_dir: Path) -> None:
    """Set method_name of the `classify` signature to tensorflow/serving/classify, as export does."""
    from tensorflow.core.protobuf import saved_model_pb2

    path = saved_model_dir / "saved_model.pb"
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString(path.read_bytes())
    for meta_graph in sm.meta_graphs:
        if "classify" in meta_graph.signature_def:
            meta_graph.signature_def["classify"].method_name = "tensorflow/serving/classify"
    path.write_bytes(sm.SerializeToString())


if __name__ == "__main__":
    import sys

    print(build_standin(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1))
