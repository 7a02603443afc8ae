"""A slow copy of the real exported model, for tests of deadlines, overload and drain: the same
signatures (serving_default, classify) and answers, each call taking `delay_s` longer. The delay is
a sleep inside the SavedModel's graph (tf.data's sleep dataset), so the server needs no test hook
and the model burns no CPU while it waits."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import MODEL_NAME


def save_slow_model(model_base: Path, dest: Path, delay_s: float) -> Path:
    """`dest/NAME/1`: version 1 of `model_base`, `delay_s` slower per call; returns `dest/NAME`."""
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import testing

    from export.exporter import mark_classify

    loaded = tf.saved_model.load(str(model_base / "1"))
    # get_single_element reads twice (the element, then the end): each read sleeps half the delay
    half_us = int(delay_s * 1e6 / 2)

    def sleep(tensor: tf.Tensor) -> tf.Tensor:
        return tf.data.Dataset.from_tensors(tensor).apply(testing.sleep(half_us)).get_single_element()

    class Slow(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = loaded

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def serve(self, text: tf.Tensor) -> dict:
            return self.model.signatures["serving_default"](text=sleep(text))

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def classify(self, inputs: tf.Tensor) -> dict:
            return self.model.signatures["classify"](inputs=sleep(inputs))

    module = Slow()
    base = dest / MODEL_NAME
    if base.exists():
        shutil.rmtree(base)
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve,
                                                             "classify": module.classify})
    mark_classify(base / "1")
    return base
