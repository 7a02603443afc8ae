"""Explanations end to end: the exported model's `explain` signature checked by occlusion on a
bigram model, then `:explain` over REST, `Predict` with `signature_name: explain` over gRPC, the
client library and `python -m client --explain`, against a real `python -m serve` process."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from concurrent import futures

import grpc
import numpy as np
import pytest
import requests
from conftest import MODEL_NAME, TINY_TRAIN, copy_model_base, figure
from serve_process import REPO, ServerProcess

from client import ClientError, Explanation, InvalidInput, SentimentClient

pytestmark = pytest.mark.slow

TEXTS = ["a great movie, wonderful acting", "awful and boring, a complete waste of time", "the plot was dull",
         "zzz qqq", "The pacing was SLOW but the ending was moving!"]


# -- occlusion agrees with the attribution ---------------------------------------------------------

@pytest.fixture(scope="module")
def bigram_model(tmp_path_factory):
    """A model of word pairs too (the tiny shared one has words only), trained on the bundled corpus
    and exported; loaded with TensorFlow alone."""
    import tensorflow as tf

    from export import ExportConfig, export_model
    from train.config import TrainConfig
    from train.trainer import train

    root = tmp_path_factory.mktemp("bigrams")
    config = dict(TINY_TRAIN, ngrams=2, max_tokens=4000, limit=2000, epochs=3)
    train(TrainConfig(run_dir=str(root / "run"), **config))
    export = export_model(ExportConfig(checkpoint_dir=str(root / "run"), model_dir=str(root / "models")))
    return tf.saved_model.load(str(export.path))


def _words(text: str) -> list[str]:
    """The text's words as the model cleans and splits them."""
    import tensorflow as tf

    from common.vectorizer import tokens

    return [w.decode() for w in tokens(tf.constant([text]), 1).flat_values.numpy()]


def _delete(words: list[str], ngram: str) -> str:
    """The text without every occurrence of `ngram`'s words."""
    gram, kept, i = ngram.split(), [], 0
    while i < len(words):
        if words[i : i + len(gram)] == gram:
            i += len(gram)
        else:
            kept.append(words[i])
            i += 1
    return " ".join(kept) or "."


def test_deleting_the_top_ngram_costs_the_answer_more_than_deleting_another(bigram_model, request):
    """For each review, the words of its most supporting n-gram are deleted, and so, one at a time,
    are those of every other n-gram it holds: the first deletion must lower the probability of the
    predicted class more than the others in at least 9 of 10 comparisons."""
    import tensorflow as tf

    from train.corpus import generate

    explain, predict = bigram_model.signatures["explain"], bigram_model.signatures["serving_default"]
    reviews = generate(0)[2][:20]
    wins = comparisons = firsts = 0
    for text in reviews:
        why = explain(text=tf.constant([text]))
        ngrams = [g.decode() for g in why["ngrams"][0].numpy() if g]
        label = int(np.argmax(why["probabilities"][0].numpy()))
        before = why["probabilities"][0, label].numpy()
        variants = [_delete(_words(text), g) for g in ngrams]
        drops = before - predict(text=tf.constant(variants))["probabilities"].numpy()[:, label]
        top = int(np.argmax(why["contributions"][0].numpy()[: len(ngrams)]))
        assert top == 0  # listed most supporting first
        wins += int((drops[0] > drops[1:]).sum())
        comparisons += len(ngrams) - 1
        firsts += int(np.argmax(drops) == 0)
    share = wins / comparisons
    figure(request.config, f"explain occlusion (bundled bigram model, {len(reviews)} reviews)",
           f"the top n-gram's deletion costs more than another's in {wins}/{comparisons} comparisons "
           f"({share:.1%}); it is the costliest of all in {firsts}/{len(reviews)} reviews")
    assert share >= 0.9, f"{wins} of {comparisons}"


def test_contributions_sum_to_the_log_odds_on_a_bigram_model(bigram_model):
    import tensorflow as tf

    from train.corpus import generate

    why = bigram_model.signatures["explain"](text=tf.constant(generate(0)[2][:50]))
    p = why["probabilities"].numpy().max(axis=1)
    total = why["contributions"].numpy().astype(np.float64).sum(axis=1) + why["bias"].numpy()
    np.testing.assert_allclose(total, np.log(p / (1 - p)), rtol=0, atol=2e-4)
    assert any(" " in g.decode() for g in why["ngrams"].numpy().ravel())  # word pairs are explained too


# -- served: REST, gRPC, the client and its CLI ------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_base, slow_model, tmp_path_factory):
    """Version 1 (with the explain signature) and version 2 exported before explanations existed
    (the slow-model wrapper has only predict and classify)."""
    base = copy_model_base(model_base, tmp_path_factory.mktemp("explain"))
    shutil.copytree(slow_model(0.0) / "1", base / "2")
    srv = ServerProcess(base, "--poll-interval", "0", "--version-policy", "all", grpc=True)
    yield srv
    assert srv.stop() == 0, srv.log()


def _explain(server, body, path=f"/v1/models/{MODEL_NAME}/versions/1:explain"):
    return requests.post(server.url + path, json=body, timeout=30)


def test_rest_explain_answers_each_review_with_its_own_ngrams(server):
    r = _explain(server, {"instances": TEXTS})
    assert r.status_code == 200, r.text
    rows = r.json()["predictions"]
    predicted = requests.post(f"{server.url}/v1/models/{MODEL_NAME}/versions/1:predict",
                              json={"instances": TEXTS}, timeout=30).json()["predictions"]
    for text, row, plain in zip(TEXTS, rows, predicted):
        assert set(row) == {"label", "probabilities", "ngrams", "contributions", "bias"}
        assert row["label"] == plain["label"] and row["probabilities"] == plain["probabilities"]
        assert len(row["ngrams"]) == len(row["contributions"]) and "" not in row["ngrams"]  # no padding
        assert set(row["ngrams"]) <= set(_words(text))
        p = max(row["probabilities"])
        assert math.fsum(row["contributions"]) + row["bias"] == pytest.approx(math.log(p / (1 - p)), abs=2e-4)
    assert rows[3]["ngrams"] == []  # nothing the model knows
    alone = _explain(server, {"instances": [TEXTS[0]]}).json()["predictions"][0]
    assert alone == rows[0]
    columnar = _explain(server, {"inputs": {"text": TEXTS[:2]}}).json()["outputs"]
    assert columnar["ngrams"] == [rows[0]["ngrams"], rows[1]["ngrams"]]


def test_concurrent_explanations_do_not_depend_on_each_other(server):
    """Explain calls are never merged into one model call (their padding would change)."""
    texts = [TEXTS[i % 2] * (1 + i % 3) for i in range(24)]
    alone = [_explain(server, {"instances": [t]}).json()["predictions"][0] for t in texts[:6]]
    with futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda t: _explain(server, {"instances": [t]}).json()["predictions"][0], texts))
    for i, answer in enumerate(answers):
        assert answer == alone[i % 6]


@pytest.mark.parametrize("body, path, status, message", [
    ({"instances": TEXTS, "signature_name": "serving_default"}, None, 400,
     "explanations come from the 'explain' signature, not 'serving_default'"),
    ({"instances": TEXTS}, f"/v1/models/{MODEL_NAME}/versions/2:explain", 400,
     "version 2 of model sentiment has no 'explain' signature: export it again"),
    ({"instances": [""]}, None, 400, "instances[0]: text is empty"),
    ({"instances": TEXTS}, "/v1/models/nope:explain", 404, "Servable not found"),
])
def test_rest_explain_errors_say_what_to_change(server, body, path, status, message):
    r = _explain(server, body, *([path] if path else []))
    assert r.status_code == status and message in r.json()["error"], r.text


def test_explain_requests_are_counted_in_the_metrics(server):
    def count(route: str, code: str) -> float:
        text = requests.get(server.url + "/monitoring/prometheus/metrics", timeout=10).text
        found = re.search(rf'^serve_requests_total{{code="{code}",route="{route}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    ok, bad = count("explain", "200"), count("explain", "400")
    assert _explain(server, {"instances": TEXTS[:2]}).status_code == 200
    assert _explain(server, {"instances": [""]}).status_code == 400
    assert (count("explain", "200"), count("explain", "400")) == (ok + 1, bad + 1)


def test_grpc_predict_with_the_explain_signature(server):
    """What a stock tensorflow_model_server serves for the same SavedModel."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    rest = _explain(server, {"instances": TEXTS}).json()["predictions"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        request = predict_pb2.PredictRequest()
        request.model_spec.name, request.model_spec.signature_name = MODEL_NAME, "explain"
        request.model_spec.version.value = 1
        request.inputs["text"].CopyFrom(tf.make_tensor_proto(TEXTS))
        response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    assert response.model_spec.signature_name == "explain"
    ngrams = tf.make_ndarray(response.outputs["ngrams"])
    contributions = tf.make_ndarray(response.outputs["contributions"])
    for i, row in enumerate(rest):
        width = len(row["ngrams"])
        assert [g.decode() for g in ngrams[i][:width]] == row["ngrams"] and set(ngrams[i][width:]) <= {b""}
        np.testing.assert_array_equal(contributions[i][:width], np.float32(row["contributions"]))  # bit for bit
        assert tf.make_ndarray(response.outputs["bias"])[i] == np.float32(row["bias"])


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_client_explain(server, transport):
    url = server.url if transport == "rest" else server.grpc_target
    with SentimentClient(url, MODEL_NAME, transport=transport, version=1, batch_size=2) as client:
        explanations = client.explain(TEXTS)
        predictions = client.predict(TEXTS)
    rest = _explain(server, {"instances": TEXTS}).json()["predictions"]
    for explanation, prediction, row in zip(explanations, predictions, rest):
        assert isinstance(explanation, Explanation)
        assert (explanation.label, explanation.score) == (prediction.label, prediction.score)
        assert [g for g, _ in explanation.contributions] == row["ngrams"]
        np.testing.assert_array_equal(np.float32([c for _, c in explanation.contributions]),
                                      np.float32(row["contributions"]))  # the same float32 either way
        assert np.float32(explanation.bias) == np.float32(row["bias"])
        top = explanation.top(2)
        assert top == sorted(explanation.contributions, key=lambda item: -abs(item[1]))[:2]


def test_client_explain_refuses_the_open_inference_protocol(server):
    with SentimentClient(server.grpc_target, MODEL_NAME, transport="grpc-v2") as client:
        with pytest.raises(InvalidInput, match="use the rest or grpc transport"):
            client.explain(TEXTS)
    with SentimentClient(server.url, MODEL_NAME, version=2, retries=0) as client:
        with pytest.raises(ClientError, match="has no 'explain' signature"):
            client.explain(TEXTS)


def test_cli_explain_prints_the_top_ngrams(server):
    cli = [sys.executable, "-m", "client", "--url", server.url, "--version", "1", "--explain", "--top", "2"]
    out = subprocess.run([*cli, TEXTS[0], TEXTS[1]], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    with SentimentClient(server.url, MODEL_NAME, version=1) as client:
        expected = client.explain(TEXTS[:2])
    assert lines[0].split("\t")[::2] == [expected[0].label, TEXTS[0]]
    assert lines[1:3] == [f"\t{c:+.3f}\t{g}" for g, c in expected[0].top(2)]
    assert lines[3].split("\t")[2] == TEXTS[1] and len(lines) == 6
    usage = subprocess.run([*cli, "--transport", "grpc-v2", TEXTS[0]], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 2 and "--explain needs --transport rest or grpc" in usage.stderr
