"""Export: a tiny trained run → SavedModel, loaded back in a fresh process without project code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_TRAIN

from common.checkpoint import checkpoint_path
from common.model import CLASS_NAMES

pytestmark = pytest.mark.slow  # trains a tiny model, loads exports in fresh processes

TOKENS = TINY_TRAIN["max_tokens"]

TEXTS = [
    "a great and wonderful movie, brilliant acting",
    "boring, the worst plot; a complete waste of time",
    "The pacing was SLOW but the ending was moving!",
    "zzz qqq",  # out-of-vocabulary only
    "",
    "überraschend gut — ça marche ✓",
]

# Runs in a fresh interpreter outside the repository: nothing but TensorFlow is importable.
LOAD_SCRIPT = r"""
import json, sys
import tensorflow as tf
path, texts = sys.argv[1], json.loads(sys.stdin.read())
model = tf.saved_model.load(path)
predict, classify = model.signatures["serving_default"], model.signatures["classify"]
batch = predict(text=tf.constant(texts))
singles = [predict(text=tf.constant([t]))["probabilities"].numpy()[0].tolist() for t in texts]
examples = [tf.train.Example(features=tf.train.Features(feature={"text": tf.train.Feature(
    bytes_list=tf.train.BytesList(value=[t.encode()]))})).SerializeToString() for t in texts]
cls = classify(inputs=tf.constant(examples))
explain = model.signatures["explain"]
why = explain(text=tf.constant(texts))
why_singles = [explain(text=tf.constant([t])) for t in texts]
json.dump({
    "explain": {k: (v.numpy().astype(str) if v.dtype == tf.string else v.numpy()).tolist() for k, v in why.items()},
    "explain_singles": [{k: (v.numpy().astype(str) if v.dtype == tf.string else v.numpy()).tolist()[0]
                         for k, v in w.items()} for w in why_singles],
    "probabilities": batch["probabilities"].numpy().tolist(),
    "logits": batch["logits"].numpy().tolist(),
    "label": [s.decode() for s in batch["label"].numpy()],
    "singles": singles,
    "classes": [[s.decode() for s in row] for row in cls["classes"].numpy()],
    "scores": cls["scores"].numpy().tolist(),
    "project_modules": sorted(m for m in ("common", "train", "export") if m in sys.modules),
}, sys.stdout)
"""


def _fresh_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _export(run: Path, model_dir: Path, **kwargs):
    from export import ExportConfig, export_model

    return export_model(ExportConfig(checkpoint_dir=str(run), model_dir=str(model_dir), **kwargs))


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    return _export(trained_run, tmp_path_factory.mktemp("export") / "sentiment")


@pytest.fixture(scope="module")
def loaded(exported, tmp_path_factory):
    """The exported model's outputs on TEXTS, computed in a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(exported.path)],
        input=json.dumps(TEXTS), capture_output=True, text=True, timeout=120,
        cwd=tmp_path_factory.mktemp("elsewhere"), env=_fresh_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {k: (np.asarray(v) if k in ("probabilities", "logits", "singles", "scores") else v)
            for k, v in json.loads(proc.stdout).items()}


@pytest.fixture(scope="module")
def reference(trained_run):
    """The DTensor model's own inference (restored onto a 1-device mesh) on TEXTS."""
    from conftest import vectorize
    from tensorflow.experimental import dtensor

    from common.mesh import single_device_mesh
    from common.model import restore_model, to_mesh
    from common.vectorizer import load_vectorizer

    model = restore_model(trained_run, single_device_mesh())
    x = vectorize(load_vectorizer(trained_run), TEXTS)
    logits = model(to_mesh(x, model.layouts.inputs), training=False)
    return dtensor.unpack(logits)[0].numpy()


# -- the exported model computes what the trained one does ---------------------------------------

def test_loads_without_project_code_and_matches_the_trained_model(loaded, reference):
    assert loaded["project_modules"] == []
    np.testing.assert_allclose(loaded["logits"], reference, rtol=0, atol=1e-5)
    expected = np.exp(reference) / np.exp(reference).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(loaded["probabilities"], expected, rtol=0, atol=1e-5)
    assert loaded["probabilities"].shape == (len(TEXTS), 2)


def test_a_review_does_not_depend_on_its_batch(loaded):
    np.testing.assert_allclose(loaded["singles"], loaded["probabilities"], rtol=0, atol=1e-6)


def test_labels_are_class_names_of_the_argmax(loaded):
    assert loaded["label"] == [CLASS_NAMES[i] for i in loaded["probabilities"].argmax(axis=1)]


def test_classify_signature_agrees_with_predict(loaded):
    assert loaded["classes"] == [list(CLASS_NAMES)] * len(TEXTS)
    np.testing.assert_allclose(loaded["scores"], loaded["probabilities"], rtol=0, atol=1e-6)


def test_signatures_follow_the_serving_contract(exported):
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel.FromString((exported.path / "saved_model.pb").read_bytes())
    signatures = proto.meta_graphs[0].signature_def

    def spec(tensors):
        return {name: (t.dtype, [d.size for d in t.tensor_shape.dim]) for name, t in tensors.items()}

    string, float32 = 7, 1  # DT_STRING, DT_FLOAT
    predict = signatures["serving_default"]
    assert predict.method_name == "tensorflow/serving/predict"
    assert spec(predict.inputs) == {"text": (string, [-1])}
    assert spec(predict.outputs) == {
        "probabilities": (float32, [-1, 2]), "logits": (float32, [-1, 2]), "label": (string, [-1])}
    classify = signatures["classify"]
    assert classify.method_name == "tensorflow/serving/classify"
    assert spec(classify.inputs) == {"inputs": (string, [-1])}
    assert spec(classify.outputs) == {"classes": (string, [-1, 2]), "scores": (float32, [-1, 2])}
    explain = signatures["explain"]
    assert explain.method_name == "tensorflow/serving/predict"
    assert spec(explain.inputs) == {"text": (string, [-1])}
    assert spec(explain.outputs) == {
        "probabilities": (float32, [-1, 2]), "label": (string, [-1]), "ngrams": (string, [-1, -1]),
        "contributions": (float32, [-1, -1]), "bias": (float32, [-1])}
    monitor = signatures["monitor"]
    assert monitor.method_name == "tensorflow/serving/predict"
    assert spec(monitor.inputs) == {"text": (string, [-1])}
    int64 = 9  # DT_INT64
    assert spec(monitor.outputs) == {**spec(predict.outputs), "words": (int64, [-1]), "ngrams": (int64, [-1]),
                                     "known_ngrams": (int64, [-1])}
    assert set(signatures) - {"__saved_model_init_op"} == {"serving_default", "classify", "explain", "monitor"}


# -- explanations ----------------------------------------------------------------------------------

def test_explain_answers_what_predict_answers(loaded):
    why = loaded["explain"]
    np.testing.assert_array_equal(why["probabilities"], loaded["probabilities"])
    assert why["label"] == loaded["label"]


def test_contributions_and_bias_sum_to_the_log_odds_of_the_label(loaded):
    why = loaded["explain"]
    for i, text in enumerate(TEXTS):
        p = max(why["probabilities"][i])
        total = sum(why["contributions"][i]) + why["bias"][i]
        assert total == pytest.approx(np.log(p / (1 - p)), abs=2e-4), text


def test_no_signature_gathers_from_the_kernel_variable(exported):
    """Every signature reads the first kernel whole. A `ResourceGather` on it (`tf.gather` on the
    variable) puts the variable in copy-on-read mode for the life of the process: from the first
    `explain` on, every predict copied the whole kernel and answered at about half its rate."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((exported.path / "saved_model.pb").read_bytes())
    graph = saved.meta_graphs[0].graph_def
    ops = {node.op for function in graph.library.function for node in function.node_def} | {n.op for n in graph.node}
    assert "ReadVariableOp" in ops and not ops & {"ResourceGather", "ResourceGatherNd"}, sorted(ops)


def test_explanations_list_the_reviews_known_ngrams_most_supporting_first(loaded, trained_run):
    import tensorflow as tf

    from common.vectorizer import load_vectorizer, tokens

    vocabulary = set(load_vectorizer(trained_run).vocabulary)
    why = loaded["explain"]
    for i, text in enumerate(TEXTS):
        ngrams, contributions = why["ngrams"][i], why["contributions"][i]
        kept = ngrams.index("") if "" in ngrams else len(ngrams)
        assert all(g == "" for g in ngrams[kept:]) and all(c == 0 for c in contributions[kept:])  # padding
        expected = {t.decode() for t in tokens(tf.constant([text]), 1).flat_values.numpy()} & vocabulary
        assert set(ngrams[:kept]) == expected and len(set(ngrams[:kept])) == kept, text
        assert contributions[:kept] == sorted(contributions[:kept], reverse=True)
    assert why["ngrams"][3] == [""] * len(why["ngrams"][3])  # out-of-vocabulary only: nothing to show


def test_an_explanation_does_not_depend_on_its_batch(loaded):
    why = loaded["explain"]
    for i, single in enumerate(loaded["explain_singles"]):
        width = len(single["ngrams"])
        assert single["ngrams"] == why["ngrams"][i][:width] and set(why["ngrams"][i][width:]) <= {""}
        assert single["contributions"] == why["contributions"][i][:width]
        assert single["bias"] == why["bias"][i] and single["probabilities"] == why["probabilities"][i]


def test_version_directory_layout(exported):
    from export import DEFAULT_SAMPLES

    names = {p.name for p in exported.path.iterdir()}
    assert {"saved_model.pb", "variables", "assets", "assets.extra"} <= names
    assert exported.version == 1 and exported.path.name == "1"
    assert [p.name for p in exported.path.parent.iterdir()] == ["1"]  # no temporary directory left
    assert [s.text for s in exported.samples] == list(DEFAULT_SAMPLES)


def test_warmup_records_are_prediction_logs(exported):
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    from export import DEFAULT_SAMPLES

    path = exported.path / "assets.extra" / "tf_serving_warmup_requests"
    records = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(path))]
    assert [r.predict_log.request.model_spec.signature_name for r in records] == [
        "serving_default", "serving_default", "explain"]
    for record in records:
        request = record.predict_log.request
        assert request.model_spec.name == "sentiment"
        texts = [t.decode() for t in tf.make_ndarray(request.inputs["text"]).tolist()]
        assert texts and set(texts) <= set(DEFAULT_SAMPLES)
    assert len(tf.make_ndarray(records[0].predict_log.request.inputs["text"])) == len(DEFAULT_SAMPLES)


def test_export_info_names_the_best_checkpoint(exported, trained_run):
    info = json.loads((exported.path / "assets.extra" / "export_info.json").read_text())
    best = json.loads((trained_run / "best.json").read_text())
    test = json.loads((trained_run / "test.json").read_text())
    step = int(best["checkpoint"].rsplit("-", 1)[1])
    assert (info["step"], info["validation_accuracy"], info["test_accuracy"]) == (
        step, best["validation_accuracy"], test["test_accuracy"])
    assert info["checkpoint"] == str((trained_run / "checkpoints" / best["checkpoint"]).resolve())
    assert (exported.step, exported.test_accuracy) == (step, test["test_accuracy"])
    assert info["model"] == json.loads((trained_run / "model.json").read_text())
    assert info["vectorizer"]["ngrams"] == TINY_TRAIN["ngrams"]
    assert info["vectorizer"]["width"] == info["model"]["max_tokens"]


# -- versions ------------------------------------------------------------------------------------

def test_versions_count_up_and_are_never_overwritten(trained_run, tmp_path):
    from export import ExportError

    base = tmp_path / "models" / "sentiment"
    assert _export(trained_run, base).version == 1
    assert _export(trained_run, base, version=7).path == base / "7"
    step = json.loads((trained_run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert _export(trained_run, base, checkpoint=f"ckpt-{step}").version == 8
    (base / ".tmp-9-999999").mkdir()  # left by an export that was killed (no such process)
    assert _export(trained_run, base).version == 9 and not (base / ".tmp-9-999999").exists()
    before = _listing(base)
    with pytest.raises(ExportError, match=r"7 exists already"):
        _export(trained_run, base, version=7)
    assert _listing(base) == before


def test_a_failed_export_leaves_nothing(trained_run, tmp_path, monkeypatch):
    from export import exporter

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(exporter, "_write_warmup", crash)
    base = tmp_path / "sentiment"
    with pytest.raises(RuntimeError, match="disk full"):
        _export(trained_run, base)
    assert not base.exists()


def test_a_version_that_appears_meanwhile_is_not_replaced(trained_run, tmp_path, monkeypatch):
    from export import ExportError, exporter

    base = tmp_path / "sentiment"
    verify = exporter._verify

    def other_exporter_wins(path, *args):
        (base / "1").mkdir()
        (base / "1" / "theirs").write_text("x")
        return verify(path, *args)

    monkeypatch.setattr(exporter, "_verify", other_exporter_wins)
    with pytest.raises(ExportError, match="appeared while exporting"):
        _export(trained_run, base)
    assert _listing(base) == ["1", "1/theirs"]


# -- bad input -----------------------------------------------------------------------------------

def _run_copy(trained_run: Path, dest: Path) -> Path:
    return Path(shutil.copytree(trained_run, dest / "run"))


@pytest.mark.parametrize("case, message", [
    ("missing", r"--checkpoint-dir .*/nope does not exist"),
    ("empty", r"has no checkpoints"),
    ("no checkpoints", r"has no checkpoints"),
    ("unknown name", r"checkpoint 'ckpt-999' not found"),
    ("no vocabulary", r"vocabulary.json is missing"),
    ("incompatible shape",
     rf"does not match .*model\.json: model/dense1_kernel has shape \[{TOKENS}, 16\] in the checkpoint but \[{TOKENS}, 8\]"),
    ("other vocabulary", rf"vocabulary.json is {TOKENS} n-grams wide but .*model.json expects 128"),
    ("missing shard", r"checkpoint ckpt-\d+ in .* is damaged \(a file of it is missing\); export another one with "
                      r"--checkpoint ckpt-\d+ \(have: "),
    ("truncated shard", r"is damaged \(a file of it is truncated or corrupt\); export another one with --checkpoint"),
])
def test_bad_input_is_a_clear_error_and_writes_nothing(trained_run, tmp_path, case, message):
    from export import ExportError

    run = tmp_path / "nope"
    kwargs = {}
    if case == "empty":
        run.mkdir()
    elif case != "missing":
        run = _run_copy(trained_run, tmp_path)
    if case == "no checkpoints":
        shutil.rmtree(run / "checkpoints")
        (run / "checkpoints").mkdir()
    elif case == "unknown name":
        kwargs["checkpoint"] = "ckpt-999"
    elif case == "no vocabulary":
        (run / "vocabulary.json").unlink()
    elif case in ("missing shard", "truncated shard"):
        shard = sorted((run / "checkpoints").glob(f"{Path(checkpoint_path(run, 'best')).name}.data-*"))[-1]
        if case == "missing shard":
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif case in ("incompatible shape", "other vocabulary"):
        config = json.loads((run / "model.json").read_text())
        config.update(hidden=8) if case == "incompatible shape" else config.update(max_tokens=128)
        (run / "model.json").write_text(json.dumps(config))
    base = tmp_path / "models" / "sentiment"
    with pytest.raises(ExportError, match=message):
        _export(run, base, **kwargs)
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"version": 0}, "--version must be at least 1"),
    ({"samples": ()}, "at least one sample"),
    ({"checkpoint": "../ckpt-1"}, "--checkpoint must be best, latest or a name"),
])
def test_config_is_validated(kwargs, message):
    from export import ExportConfig

    with pytest.raises(ValueError, match=message):
        ExportConfig(**kwargs)


# -- CLI -----------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "export", *args], capture_output=True, text=True,
                          timeout=180, cwd=repo, env=_fresh_env())


def test_cli_exports_and_prints_signature_and_samples(trained_run, tmp_path):
    base = tmp_path / "models" / "sentiment"
    proc = _cli("--checkpoint-dir", str(trained_run), "--model-dir", str(base), "--version", "3",
                "--sample", "a brilliant film", "--sample", "an awful film")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"exported version 3 to {base / '3'}" in out
    for line in ("signature_def['serving_default']:", "signature_def['classify']:", "inputs['text'] tensor_info:",
                 "outputs['probabilities'] tensor_info:", "Method name is: tensorflow/serving/predict",
                 "Method name is: tensorflow/serving/classify", "sample predictions:", "'a brilliant film'",
                 "signature_def['monitor']:", "  drift baseline: 100 of the training run's validation reviews\n"):
        assert line in out
    assert (base / "3" / "saved_model.pb").is_file()

    again = _cli("--checkpoint-dir", str(trained_run), "--model-dir", str(base), "--version", "3")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith("export: error: ")
    assert "exists already" in again.stderr and again.stdout == ""
    assert _listing(base).count("3") == 1 and len(_listing(base / "3")) == len(_listing(base)) - 1
