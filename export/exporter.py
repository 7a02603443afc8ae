"""Checkpoint → versioned SavedModel that TensorFlow Serving (and `serve/`) can load.

The sharded DTensor checkpoint is restored onto a 1-device mesh, its values are folded for serving
(`common.model.inference_weights`: the first kernel in a plain `tf.Variable`, the small rest as
graph constants), and a `tf.Module` wrapping the TF-IDF vectorizer and `inference_logits` is saved. The
result needs neither DTensor nor project code to load. It is written to a temporary directory
inside the model directory, checked by loading it back, and renamed into place, so a crash or an
error never leaves a half-written version for a server polling the directory to pick up.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import tensorflow as tf

from common.checkpoint import (
    DamagedCheckpoint,
    checkpoint_name,
    checkpoint_path,
    checkpoint_step,
    checkpoint_steps,
    verify_checkpoint,
)
from common.drift import BASELINE_FILE, MONITOR_SIGNATURE, Baseline, BaselineError, review_statistics
from common.mesh import single_device_mesh
from common.model import (
    CLASS_NAMES,
    ModelConfig,
    inference_logits,
    inference_weights,
    margin_attribution,
    restore_model,
    row_softmax,
)
from common.run_dir import (
    CHECKPOINT_DIR,
    MODEL_FILE,
    SELECTION_DIR,
    TMP_PREFIX,
    RunDirError,
    clean_leftovers,
    read_best,
    read_held_out,
    read_test,
)
from common.tf_serving import (
    ASSETS_EXTRA,
    CLASSIFY_METHOD,
    CLASSIFY_SIGNATURE,
    DEFAULT_SIGNATURE,
    EXPLAIN_SIGNATURE,
    WARMUP_FILE,
)
from common.vectorizer import VOCABULARY_FILE, TfIdf, load_vectorizer
from common.versions import version_number
from export.config import ExportConfig

log = logging.getLogger(__name__)

EXPORT_INFO_FILE = "export_info.json"
TOLERANCE = 1e-5
"""Largest difference allowed between the saved model and the model it was built from."""


class ExportError(RuntimeError):
    """An export that cannot be done; the message names the flag or file to fix. Nothing was written."""


@dataclass(frozen=True)
class Prediction:
    text: str
    label: str
    probabilities: tuple[float, float]


@dataclass(frozen=True)
class ExportResult:
    path: Path
    """The version directory, `model_dir/version`."""
    version: int
    checkpoint: str
    """The checkpoint prefix the weights came from."""
    step: int | None
    validation_accuracy: float | None
    """The checkpoint's validation accuracy, when it is the run's best (best.json)."""
    test_accuracy: float | None
    """The test split's accuracy of this checkpoint, when the run measured it (test.json)."""
    samples: list[Prediction]
    """The config's samples as the saved model (loaded back from disk) classifies them."""
    drift_baseline: str | None = None
    """Which held-out reviews the drift baseline describes; None when the export has none."""


class PlainMLP(tf.Module):
    """The trained MLP folded for serving (`common.model.inference_weights`): the first kernel in
    a plain `tf.Variable` (the only large value), the rest as constants of the graph, so a call
    reads one variable and TensorFlow's graph optimizer has nothing left to compute for them."""

    def __init__(self, weights: dict[str, np.ndarray], epsilon: float) -> None:
        super().__init__(name="sentiment_mlp")
        folded = inference_weights(weights, epsilon)
        self.dense1_kernel = tf.Variable(folded.pop("dense1_kernel"), trainable=False, name="dense1_kernel")
        # Plain numpy, not tracked by tf.Module: each traced function makes them Const nodes.
        object.__setattr__(self, "constants", folded)

    def weights(self) -> dict[str, tf.Tensor]:
        """For use inside a traced function (the constants become nodes of that graph). The kernel
        is read as a whole (`ReadVariableOp`, no copy), never gathered from the variable itself: a
        `ResourceGather` (what `tf.gather` on a variable becomes, as `explain` does) puts the
        variable in copy-on-read mode for good, and from then on every call of every signature
        copied the whole kernel (38 MB for 150k n-grams): after some `explain` calls a predict
        answered at half its rate."""
        return {"dense1_kernel": tf.convert_to_tensor(self.dense1_kernel),
                **{k: tf.constant(v) for k, v in self.constants.items()}}

    def __call__(self, x: tf.SparseTensor) -> tf.Tensor:
        return inference_logits(self.weights(), x)

    def attribution(self, x: tf.SparseTensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(logits, contributions, bias): see `common.model.margin_attribution`."""
        return margin_attribution(self.weights(), x)


class SentimentModel(tf.Module):
    """Text in, sentiment out: the training run's TF-IDF vectorizer (its cleaning included) + MLP, in
    inference mode (moving BatchNorm statistics, so a review's prediction never depends on the rest
    of its batch). The first layer multiplies the sparse TF-IDF rows: a review touches a few hundred
    of the vocabulary's n-grams, not all of them."""

    def __init__(self, vectorizer: TfIdf, mlp: PlainMLP) -> None:
        super().__init__(name="sentiment")
        self.vectorizer = vectorizer
        self.mlp = mlp
        self.class_names = tf.constant(CLASS_NAMES)
        names = vectorizer.vocabulary + [""] * (vectorizer.width - len(vectorizer.vocabulary))
        self.ngram_names = tf.constant(names, tf.string)

    def _logits(self, text: tf.Tensor) -> tf.Tensor:
        return self.mlp(self.vectorizer.sparse(text))

    # autograph=False: nothing here branches on a tensor, and converting the Python took ~1 s per export.
    def _answers(self, logits: tf.Tensor) -> dict[str, tf.Tensor]:
        return {
            "probabilities": row_softmax(logits),
            "logits": logits,
            "label": tf.gather(self.class_names, tf.argmax(logits, axis=1)),
        }

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")], autograph=False)
    def serve(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        return self._answers(self._logits(text))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")], autograph=False)
    def monitor(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        """serving_default's outputs, computed by the same ops, and per review what drift monitoring
        needs (`common.drift.COUNT_OUTPUTS`): the server answers predict requests with this one
        call when it monitors the version, and hands clients only serving_default's outputs."""
        features, counts = self.vectorizer.sparse_and_counts(text)
        return {**self._answers(self.mlp(features)), **counts}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")], autograph=False)
    def explain(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        """Why: each review's n-grams that reached the model with their contribution to the
        predicted class's log-odds (`common.model.margin_attribution`), most supporting first;
        `ngrams` and `contributions` are [batch, most n-grams of a review in this call], padded with
        "" and 0. For every row, sum(contributions) + bias = ln(p_label / p_other)."""
        features = self.vectorizer.sparse(text)
        logits, contributions, bias = self.mlp.attribution(features)
        rows, columns = features.indices[:, 0], features.indices[:, 1]
        order = tf.argsort(-contributions, stable=True)  # within a row: most supporting first
        order = tf.gather(order, tf.argsort(tf.gather(rows, order), stable=True))  # then by row
        batch = tf.shape(text, out_type=tf.int64)[0]

        def per_row(values: tf.Tensor, padding: object) -> tf.Tensor:
            return tf.RaggedTensor.from_value_rowids(
                tf.gather(values, order), tf.gather(rows, order), nrows=batch).to_tensor(padding)

        return {
            "probabilities": row_softmax(logits),
            "label": tf.gather(self.class_names, tf.argmax(logits, axis=1)),
            "ngrams": per_row(tf.gather(self.ngram_names, columns), ""),
            "contributions": per_row(contributions, 0.0),
            "bias": bias,
        }

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")], autograph=False)
    def classify(self, inputs: tf.Tensor) -> dict[str, tf.Tensor]:
        """TF Serving's Classify API: serialized tf.train.Example with a bytes feature `text`."""
        features = tf.io.parse_example(inputs, {"text": tf.io.FixedLenFeature([], tf.string, default_value="")})
        scores = row_softmax(self._logits(features["text"]))
        classes = tf.tile(self.class_names[tf.newaxis, :], [tf.shape(inputs)[0], 1])
        return {"classes": classes, "scores": scores}


def next_version(model_dir: Path) -> int:
    """One more than the highest integer version directory in `model_dir` (1 when there is none)."""
    if not model_dir.is_dir():
        return 1
    versions = [version_number(p.name) for p in model_dir.iterdir() if p.is_dir()]
    return max((v for v in versions if v is not None), default=0) + 1


def _check_run_dir(run_dir: Path, checkpoint: str) -> tuple[str, ModelConfig, TfIdf]:
    """The checkpoint prefix to export, the model config and the vectorizer, or an ExportError saying
    what is wrong."""
    if not run_dir.is_dir():
        raise ExportError(f"--checkpoint-dir {run_dir} does not exist")
    if not (run_dir / CHECKPOINT_DIR).is_dir() or not any((run_dir / CHECKPOINT_DIR).iterdir()):
        raise ExportError(
            f"--checkpoint-dir {run_dir} has no checkpoints ({run_dir / CHECKPOINT_DIR} is missing or empty); "
            "train first: python -m train --run-dir ..."
        )
    try:
        prefix = checkpoint_path(run_dir, checkpoint)
    except RunDirError as exc:
        raise ExportError(f"--checkpoint-dir {run_dir}: {exc}") from None
    for name in (MODEL_FILE, VOCABULARY_FILE):
        if not (run_dir / name).is_file():
            raise ExportError(f"{run_dir / name} is missing: --checkpoint-dir must be a training run directory")
    try:
        model_config = ModelConfig.load(run_dir / MODEL_FILE)
    except (ValueError, TypeError) as exc:
        raise ExportError(f"{run_dir / MODEL_FILE} is not a valid model config: {exc}") from None
    try:
        vectorizer = load_vectorizer(run_dir)
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{run_dir / VOCABULARY_FILE} is not a valid vocabulary file: {exc!r}") from None
    if vectorizer.width != model_config.max_tokens:
        raise ExportError(
            f"{run_dir / VOCABULARY_FILE} is {vectorizer.width} n-grams wide but {run_dir / MODEL_FILE} "
            f"expects {model_config.max_tokens}: they come from different runs"
        )
    return prefix, model_config, vectorizer


def _check_shapes(prefix: str, model_config: ModelConfig, model_file: Path) -> None:
    """Compare the checkpoint's variables with the shapes model.json implies, before restoring.

    A failed restore on DTensor poisons the eager executor for the rest of the process, so a
    mismatch must be caught here rather than by catching the restore's error.
    """
    try:
        stored = verify_checkpoint(prefix)
    except DamagedCheckpoint as exc:
        run_dir = Path(prefix).parent.parent
        others = [checkpoint_name(s) for s in checkpoint_steps(run_dir) if checkpoint_name(s) != Path(prefix).name]
        advice = (f"export another one with --checkpoint {others[-1]} (have: {', '.join(others[-5:])})" if others
                  else "train again: it is the run's only checkpoint")
        raise ExportError(f"{exc}; {advice}") from None
    for name, shape in model_config.shapes().items():
        key = f"model/{name}/.ATTRIBUTES/VARIABLE_VALUE"
        if key not in stored:
            raise ExportError(f"checkpoint {prefix} has no variable model/{name}: not a checkpoint of this model")
        if tuple(stored[key]) != shape:
            raise ExportError(
                f"checkpoint {prefix} does not match {model_file}: model/{name} has shape "
                f"{list(stored[key])} in the checkpoint but {list(shape)} for {model_config}"
            )


def _checkpoint_stats(run_dir: Path, prefix: str) -> tuple[int | None, float | None, float | None]:
    """(step, validation accuracy, test accuracy) of the checkpoint, from best.json and test.json."""
    name = Path(prefix).name
    step = checkpoint_step(name)
    best = read_best(run_dir) or {}
    validation = best.get("validation_accuracy") if best.get("checkpoint") == name else None
    record = read_test(run_dir) or {}
    test = record.get("test_accuracy") if record.get("checkpoint") == name else None
    return step, validation, test


def build_serving_model(run_dir: Path, checkpoint: str = "best", vectorizer: TfIdf | None = None) -> SentimentModel:
    """Restore a checkpoint onto a 1-device mesh and wrap its values in a plain-variable SentimentModel
    (with the run's vectorizer, unless it was loaded already)."""
    model = restore_model(run_dir, single_device_mesh(), checkpoint)
    mlp = PlainMLP(model.numpy_weights(), model.config.bn_epsilon)
    return SentimentModel(vectorizer or load_vectorizer(run_dir), mlp)


def drift_baseline(run_dir: Path, module: SentimentModel) -> Baseline | None:
    """The drift baseline (`common.drift`) of reviews the exported model's kind did not train on:
    the run's validation reviews through this model; after a refit (which trained on them), the
    selection run's validation reviews through the selection run's best model and vocabulary, the
    same pair of model and unseen data. None (logged) for a run that kept no validation split."""
    held_out = _held_out(run_dir)
    source, model = "the training run's validation reviews", module
    selection = run_dir / SELECTION_DIR
    if held_out is None and (selection / CHECKPOINT_DIR).is_dir():
        held_out = _held_out(selection)
        if held_out is not None:
            log.info("drift baseline from the selection run's validation reviews and best model")
            source, model = "the selection run's validation reviews (the refit trained on them)", \
                build_serving_model(selection, "best")
    if held_out is None:
        log.warning("%s kept no validation reviews (--validation-fraction 0?): this export has no drift baseline, "
                    "and the server will not monitor it", run_dir)
        return None
    texts, labels = held_out
    outputs: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(texts), 256):
        for name, value in model.monitor(tf.constant(texts[start:start + 256])).items():
            outputs.setdefault(name, []).append(value.numpy())
    joined = {name: np.concatenate(values) for name, values in outputs.items()}
    try:
        baseline = Baseline.from_reviews(review_statistics(joined, joined["probabilities"]), np.asarray(labels),
                                         f"{len(texts)} of {source}")
    except BaselineError as exc:
        log.warning("this export has no drift baseline: %s", exc)
        return None
    log.info("drift baseline: %d held-out reviews, %.1f%% low-confidence answers", baseline.reviews,
             100 * baseline.low_confidence_share)
    return baseline


def _held_out(run_dir: Path) -> tuple[list[str], list[int]] | None:
    try:
        return read_held_out(run_dir)
    except RunDirError as exc:
        raise ExportError(str(exc)) from None


def mark_classify(saved_model_dir: Path) -> None:
    """TF2's saved_model.save writes every signature as a Predict one; TF Serving's Classify API
    needs method_name tensorflow/serving/classify, so set it in saved_model.pb."""
    from tensorflow.core.protobuf import saved_model_pb2

    path = saved_model_dir / "saved_model.pb"
    proto = saved_model_pb2.SavedModel.FromString(path.read_bytes())
    for meta_graph in proto.meta_graphs:
        meta_graph.signature_def[CLASSIFY_SIGNATURE].method_name = CLASSIFY_METHOD
    path.write_bytes(proto.SerializeToString())


def _write_warmup(path: Path, model_name: str, samples: Sequence[str]) -> None:
    """TF Serving replays these PredictionLog records before it marks the version available: predict
    on the whole batch and on a single review, and one explanation."""
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    with tf.io.TFRecordWriter(str(path)) as writer:
        for signature, texts in ((DEFAULT_SIGNATURE, list(samples)), (DEFAULT_SIGNATURE, list(samples[:1])),
                                 (EXPLAIN_SIGNATURE, list(samples[:1]))):
            request = predict_pb2.PredictRequest(
                model_spec=model_pb2.ModelSpec(name=model_name, signature_name=signature)
            )
            request.inputs["text"].CopyFrom(tf.make_tensor_proto(texts, dtype=tf.string))
            record = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(record.SerializeToString())


def _verify(saved_model_dir: Path, module: SentimentModel, samples: Sequence[str]) -> list[Prediction]:
    """Load the written model back and check it against the in-memory one, one review and a batch."""
    loaded = tf.saved_model.load(str(saved_model_dir))
    texts = tf.constant(list(samples))
    expected = module.serve(texts)["probabilities"].numpy()
    out = loaded.signatures[DEFAULT_SIGNATURE](text=texts)
    probabilities = out["probabilities"].numpy()
    single = loaded.signatures[DEFAULT_SIGNATURE](text=texts[:1])["probabilities"].numpy()
    examples = [
        tf.train.Example(
            features=tf.train.Features(feature={"text": tf.train.Feature(bytes_list=tf.train.BytesList(value=[t.encode()]))})
        ).SerializeToString()
        for t in samples
    ]
    scores = loaded.signatures[CLASSIFY_SIGNATURE](inputs=tf.constant(examples))["scores"].numpy()
    for what, value, reference in (
        ("predictions", probabilities, expected),
        ("a single review's prediction", single, expected[:1]),
        ("classify scores", scores, expected),
    ):
        if not np.allclose(value, reference, rtol=0.0, atol=TOLERANCE):
            raise ExportError(f"the saved model's {what} differ from the restored model's by {np.abs(value - reference).max():g}")
    monitored = loaded.signatures[MONITOR_SIGNATURE](text=texts)
    for name in out:
        if not np.array_equal(monitored[name].numpy(), out[name].numpy()):
            raise ExportError(f"the monitor signature's {name} differ from serving_default's")
    labels = [label.decode() for label in out["label"].numpy()]
    return [Prediction(t, label, (float(p[0]), float(p[1]))) for t, label, p in zip(samples, labels, probabilities)]


def _export_info(module: SentimentModel, model_config: ModelConfig, prefix: str, step: int | None,
                 validation_accuracy: float | None, test_accuracy: float | None) -> dict:
    """assets.extra/export_info.json: where the version came from, for people reading it."""
    return {
        "checkpoint": str(Path(prefix).resolve()),
        "step": step,
        "validation_accuracy": validation_accuracy,
        "test_accuracy": test_accuracy,
        "model": dataclasses.asdict(model_config),
        "vocabulary_size": len(module.vectorizer.vocabulary),
        "vectorizer": {k: v for k, v in module.vectorizer.state().items() if k not in ("vocabulary", "idf", "nb")},
        "class_names": list(CLASS_NAMES),
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def export_model(config: ExportConfig) -> ExportResult:
    """Export `config.checkpoint_dir`'s checkpoint to `config.model_dir/<version>`; see the module doc.

    Raises ExportError (with nothing written) for a missing or empty run directory, a checkpoint
    that does not match model.json, or a version that exists already.
    """
    run_dir, model_dir = Path(config.checkpoint_dir), Path(config.model_dir)
    prefix, model_config, vectorizer = _check_run_dir(run_dir, config.checkpoint)
    _check_shapes(prefix, model_config, run_dir / MODEL_FILE)
    version = config.version if config.version is not None else next_version(model_dir)
    final = model_dir / str(version)
    if final.exists():
        raise ExportError(f"{final} exists already: versions are never overwritten; pick another --version")
    step, validation_accuracy, test_accuracy = _checkpoint_stats(run_dir, prefix)

    module = build_serving_model(run_dir, Path(prefix).name, vectorizer)
    log.info("restored %s (step %s); writing %s", prefix, step, final)
    baseline = drift_baseline(run_dir, module)

    created_model_dir = not model_dir.exists()
    model_dir.mkdir(parents=True, exist_ok=True)
    clean_leftovers(model_dir)  # .tmp-* directories of exports that were killed
    tmp = model_dir / f"{TMP_PREFIX}{version}-{os.getpid()}"
    try:
        tf.saved_model.save(
            module,
            str(tmp),
            signatures={
                DEFAULT_SIGNATURE: module.serve.get_concrete_function(),
                CLASSIFY_SIGNATURE: module.classify.get_concrete_function(),
                EXPLAIN_SIGNATURE: module.explain.get_concrete_function(),
                MONITOR_SIGNATURE: module.monitor.get_concrete_function(),
            },
        )
        mark_classify(tmp)
        (tmp / ASSETS_EXTRA).mkdir()
        if baseline is not None:
            baseline.save(tmp / ASSETS_EXTRA / BASELINE_FILE)
        _write_warmup(tmp / WARMUP_FILE, model_dir.resolve().name, config.samples)
        info = _export_info(module, model_config, prefix, step, validation_accuracy, test_accuracy)
        (tmp / ASSETS_EXTRA / EXPORT_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        samples = _verify(tmp, module, config.samples)
        if final.exists():  # another exporter won the race; rename would replace an empty directory
            raise ExportError(f"{final} appeared while exporting: versions are never overwritten")
        try:
            os.rename(tmp, final)
        except OSError as exc:
            raise ExportError(f"cannot move the export into {final}: {exc.strerror}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created_model_dir and not any(model_dir.iterdir()):
            model_dir.rmdir()
    log.info("exported version %d to %s", version, final)
    return ExportResult(final, version, prefix, step, validation_accuracy, test_accuracy, samples,
                        baseline.source if baseline else None)


def describe_signatures(saved_model_dir: Path) -> str:
    """The SavedModel's signatures, laid out like `saved_model_cli show --all`."""
    from tensorflow.core.framework import types_pb2
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString((Path(saved_model_dir) / "saved_model.pb").read_bytes())
    lines = []
    for meta_graph in proto.meta_graphs:
        tags = ", ".join(meta_graph.meta_info_def.tags)
        lines.append(f"MetaGraphDef with tag-set: '{tags}' contains the following SignatureDefs:")
        for key in sorted(meta_graph.signature_def):
            if key.startswith("__"):
                continue
            signature = meta_graph.signature_def[key]
            lines += ["", f"signature_def['{key}']:"]
            for kind, tensors in (("input", signature.inputs), ("output", signature.outputs)):
                lines.append(f"  The given SavedModel SignatureDef contains the following {kind}(s):")
                for name in sorted(tensors):
                    info = tensors[name]
                    dims = [d.size for d in info.tensor_shape.dim]
                    shape = f"({dims[0]})" if len(dims) == 1 else f"({', '.join(map(str, dims))})"
                    lines += [
                        f"    {kind}s['{name}'] tensor_info:",
                        f"        dtype: {types_pb2.DataType.Name(info.dtype)}",
                        f"        shape: {shape}",
                        f"        name: {info.name}",
                    ]
            lines.append(f"  Method name is: {signature.method_name}")
    return "\n".join(lines)
