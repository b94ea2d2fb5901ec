"""POST /classify and cross-encoder /score and /rerank, against a scripted engine: what reaches the
engine, how logits become probabilities and scores, and the refusals on the wrong kind of model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from router.classification import class_probabilities

from .test_request_fields import TOKENIZER, _app, scripted_embedding

LABELS = ("negative", "neutral", "positive")


def _classifier(labels=LABELS, activation="softmax"):
    return _app(pooling={"generates": False, "labels": labels, "classifier_activation": activation},
                num_pooled=len(labels))


def test_classify_answers_class_probabilities_and_labels():
    http, engine = _classifier()
    body = http.post("/classify", json={"model": "tiny", "input": ["Hello world", "Paris is lovely"]}).json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("classify-")
    prompts = [TOKENIZER.encode(t) for t in ["Hello world", "Paris is lovely"]]
    assert [r.prompt_token_ids for r in engine.requests] == prompts
    params = engine.requests[0].sampling_params
    assert params.embed and not params.embed_normalize and params.embed_dimensions is None
    for item, prompt in zip(body["data"], prompts, strict=True):
        logits = np.array(scripted_embedding(prompt, params)[:3])
        expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert item["probs"] == pytest.approx(expected.tolist(), abs=1e-12)
        assert item["label"] == LABELS[int(expected.argmax())] and item["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    # /v1/classify too, token ids as input; embeddings are refused on a classifier.
    ids = http.post("/v1/classify", json={"model": "tiny", "input": [5, 6, 7]}).json()
    assert engine.requests[-1].prompt_token_ids == [5, 6, 7] and len(ids["data"]) == 1
    refused = http.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert refused.status_code == 400 and "sequence classifier" in refused.json()["error"]["message"]


def test_classify_refusals():
    http, _ = _app()  # a generative model
    r = http.post("/classify", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    http, _ = _classifier()
    for body, param in [({"input": []}, "input"), ({"input": ""}, "input"),
                        ({"input": "hi", "priority": 2}, "priority"), ({"input": "x" * 300}, "input")]:
        r = http.post("/classify", json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body
    assert http.post("/classify", json={"model": "nope", "input": "hi"}).status_code == 404


def test_a_cross_encoder_scores_each_pair_joined_with_the_sigmoid_of_its_logit():
    http, engine = _classifier(labels=("LABEL_0",), activation="sigmoid")
    body = http.post("/v1/score", json={"model": "tiny", "text_1": "what is paris",
                                        "text_2": ["a city", "a person"]}).json()
    joined = [TOKENIZER("what is paris", text_pair=doc)["input_ids"] for doc in ["a city", "a person"]]
    assert [r.prompt_token_ids for r in engine.requests] == joined
    params = engine.requests[0].sampling_params
    scores = [1 / (1 + math.exp(-scripted_embedding(ids, params)[0])) for ids in joined]
    assert [d["score"] for d in body["data"]] == pytest.approx(scores, abs=1e-12)
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in joined)
    ranked = http.post("/rerank", json={"model": "tiny", "query": "what is paris",
                                        "documents": ["a city", "a person"]}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(2), key=lambda i: -scores[i])
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(scores, reverse=True), abs=1e-12)
    # An empty document is scored, as vLLM scores it (the pair template's tokens are the input), not
    # a 400 for the whole list.
    empty = http.post("/rerank", json={"model": "tiny", "query": "what is paris", "documents": ["a city", ""]})
    assert empty.status_code == 200 and len(empty.json()["results"]) == 2
    # A classifier with several classes is not a cross-encoder.
    http, _ = _classifier()
    r = http.post("/score", json={"model": "tiny", "text_1": "a", "text_2": "b"})
    assert r.status_code == 400 and "one output" in r.json()["error"]["message"]


def test_class_probabilities():
    assert class_probabilities([0.0], "sigmoid") == [0.5]
    assert class_probabilities([1000.0, 0.0]) == pytest.approx([1.0, 0.0])
    assert sum(class_probabilities([0.3, -2.0, 5.0])) == pytest.approx(1.0)
    # Multi-label: each class on its own; regression: the logits themselves.
    assert class_probabilities([0.0, 2.0], "sigmoid") == pytest.approx([0.5, 1 / (1 + math.exp(-2.0))])
    assert class_probabilities([-3.5, 2.0], "none") == [-3.5, 2.0]
    # A cross-encoder's Tanh, a head's ReLU (BGE-M3's lexical weights).
    assert class_probabilities([0.5, -1.0], "tanh") == pytest.approx([math.tanh(0.5), math.tanh(-1.0)])
    assert class_probabilities([0.5, -1.0], "relu") == [0.5, 0.0]
    with pytest.raises(ValueError, match="non-finite"):
        class_probabilities([float("nan"), 1.0])


def test_an_llm_reranker_reads_each_pair_as_one_text():
    """An LLM served as a reranker (classifier_from_token: PoolingInfo.joins_pair_text) gets the
    two texts joined, as vLLM tokenizes them, not through the tokenizer's pair template."""
    http, engine = _app(pooling={"generates": False, "labels": ("score",), "cross_encoder_activation": "sigmoid",
                                 "joins_pair_text": True}, num_pooled=1)
    http.post("/rerank", json={"model": "tiny", "query": "what is par", "documents": ["is", "a person"]})
    assert sorted(r.prompt_token_ids for r in engine.requests) == sorted(
        TOKENIZER.encode("what is par" + doc) for doc in ["is", "a person"])


def test_a_cross_encoder_with_an_identity_activation_scores_with_its_raw_logit():
    """/score follows the cross-encoder's sentence-transformers activation (Identity here), /classify
    the problem type (regression here)."""
    http, engine = _app(pooling={"generates": False, "labels": ("LABEL_0",), "classifier_activation": "none",
                                  "cross_encoder_activation": "none"}, num_pooled=1)
    body = http.post("/score", json={"model": "tiny", "text_1": "q", "text_2": "d"}).json()
    joined = TOKENIZER("q", text_pair="d")["input_ids"]
    assert body["data"][0]["score"] == scripted_embedding(joined, engine.requests[0].sampling_params)[0]
    probs = http.post("/classify", json={"model": "tiny", "input": "q"}).json()["data"][0]["probs"]
    assert probs == [scripted_embedding(TOKENIZER.encode("q"), engine.requests[-1].sampling_params)[0]]


def test_scores_use_the_cross_encoder_activation_not_the_problem_type():
    http, engine = _app(pooling={"generates": False, "labels": ("LABEL_0",), "classifier_activation": "none",
                                  "cross_encoder_activation": "sigmoid"}, num_pooled=1)
    body = http.post("/score", json={"model": "tiny", "text_1": "q", "text_2": "d"}).json()
    logit = scripted_embedding(TOKENIZER("q", text_pair="d")["input_ids"], engine.requests[0].sampling_params)[0]
    assert body["data"][0]["score"] == pytest.approx(1 / (1 + math.exp(-logit)))
    # vLLM's use_activation (or its older names) false: the raw logit, on /score and /rerank alike; and
    # with no model named, the first model answers.
    for path, fields in (("/score", {"text_1": "q", "text_2": "d"}), ("/rerank", {"query": "q", "documents": ["d"]})):
        for switch in ("use_activation", "activation", "softmax"):
            raw = http.post(path, json={**fields, switch: False}).json()
            score = raw["data"][0]["score"] if path == "/score" else raw["results"][0]["relevance_score"]
            assert score == pytest.approx(logit), (path, switch)


def test_embeddings_the_checkpoint_declares_unservable_are_refused():
    """A generating model whose sentence-transformers files ask for a pooling we do not serve: its
    embeddings (and embedding scores) answer 400 with the reason, not vectors pooled otherwise."""
    http, engine = _app(pooling={"unavailable": "modules.json lists Dense modules"})
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"})]:
        r = http.post(path, json={"model": "tiny", **body})
        assert r.status_code == 400 and "lists Dense modules" in r.json()["error"]["message"], path
    assert not engine.requests


def test_pooling_answers_each_models_pooled_output():
    """vLLM's /pooling: a classifier's class probabilities (as /classify), an embedding model's
    embedding (as /v1/embeddings, normalised as its pooler config says), floats or base64."""
    import base64

    http, engine = _classifier()
    body = http.post("/pooling", json={"model": "tiny", "input": ["Hello world"]}).json()
    assert body["object"] == "list" and body["id"].startswith("pool-") and body["data"][0]["object"] == "pooling"
    classified = http.post("/classify", json={"model": "tiny", "input": ["Hello world"]}).json()
    assert body["data"][0]["data"] == classified["data"][0]["probs"]
    http, engine = _app(pooling={"normalize": False, "pooling_type": "MEAN"})
    body = http.post("/v1/pooling", json={"model": "tiny", "input": [5, 6, 7], "encoding_format": "base64"}).json()
    params = engine.requests[0].sampling_params
    assert params.embed and not params.embed_normalize and params.embed_pooling == "MEAN"
    expected = np.asarray(scripted_embedding([5, 6, 7], params), dtype="<f4")
    assert np.frombuffer(base64.b64decode(body["data"][0]["data"]), dtype="<f4").tolist() == expected.tolist()
    assert body["usage"]["prompt_tokens"] == 3
    http, _ = _app(pooling={"unavailable": "modules.json lists Dense modules"})
    r = http.post("/pooling", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 400 and "Dense" in r.json()["error"]["message"]


def test_a_token_classifier_answers_pooling_with_each_tokens_classes():
    """A token classifier (NER): /pooling answers a [tokens][classes] array per input, the softmax of
    each token's logits (which arrive flattened); /classify and /score are refused."""
    http, engine = _app(num_pooled=8, pooling={"generates": False, "labels": ("O", "B-LOC"), "pooling_type": "ALL",
                                                   "row_size": 2})
    body = http.post("/pooling", json={"model": "tiny", "input": [5, 6, 7]}).json()
    flat = scripted_embedding([5, 6, 7], engine.requests[0].sampling_params)
    rows = [flat[i: i + 2] for i in range(0, 8, 2)]
    expected = [(np.exp(row) / np.exp(row).sum()).tolist() for row in map(np.asarray, rows)]
    np.testing.assert_allclose(body["data"][0]["data"], expected, atol=1e-12)
    for path, body in (("/classify", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"})):
        r = http.post(path, json={"model": "tiny", **body})
        assert r.status_code == 400 and "token classifier" in r.json()["error"]["message"], path


def test_a_bert_cross_encoder_gets_each_pairs_token_types():
    """A BERT tokenizer marks a pair's second text with token type 1: each pair's request carries
    where type 1 starts (compressed_token_type_ids), as the tokenizer truncates the pair with
    truncate_prompt_tokens; a tokenizer without token types (and /classify's single texts) send none."""
    from router.scoring import tokenize_pair
    from tests.tiny_model import build_wordpiece_tokenizer

    bert = build_wordpiece_tokenizer()
    pooling = {"generates": False, "labels": ("LABEL_0",), "cross_encoder_activation": "sigmoid", "token_types": True}
    http, engine = _app(tokenizer=bert, num_pooled=1, pooling=pooling)
    docs = ["paris is the capital", "berlin"]
    body = http.post("/score", json={"model": "tiny", "text_1": "what is the capital of france",
                                     "text_2": docs}).json()
    assert len(body["data"]) == 2
    for request, doc in zip(engine.requests, docs, strict=True):
        pair = bert("what is the capital of france", text_pair=doc)
        assert request.prompt_token_ids == pair["input_ids"]
        assert request.sampling_params.compressed_token_type_ids == pair["token_type_ids"].index(1) == 8
    # The tokenizer truncates the longer text, keeping its start (truncation_side "right", vLLM's for
    # pooling) or its end, and keeps the special tokens: type 1 from "berlin" on.
    for side, kept in (("right", ["what", "is"]), ("left", ["of", "france"])):
        http.post("/score", json={"model": "tiny", "text_1": "what is the capital of france", "text_2": "berlin",
                                  "truncate_prompt_tokens": 6, "truncation_side": side})
        truncated = engine.requests[-1]
        assert bert.convert_ids_to_tokens(truncated.prompt_token_ids) == ["[CLS]", *kept, "[SEP]", "berlin", "[SEP]"]
        assert truncated.sampling_params.compressed_token_type_ids == 4
    # A text keeps its [CLS] and [SEP] around the tokens kept too; token ids keep their first k.
    http.post("/classify", json={"model": "tiny", "input": "what is the capital of france",
                                 "truncate_prompt_tokens": 4})
    assert bert.convert_ids_to_tokens(engine.requests[-1].prompt_token_ids) == ["[CLS]", "what", "is", "[SEP]"]
    http.post("/classify", json={"model": "tiny", "input": [5, 6, 7, 8], "truncate_prompt_tokens": 2})
    assert engine.requests[-1].prompt_token_ids == [5, 6]
    # Special tokens alone longer than the cut: refused, not silently cut again.
    refused = http.post("/classify", json={"model": "tiny", "input": "paris", "truncate_prompt_tokens": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    http.post("/classify", json={"model": "tiny", "input": "paris"})
    assert engine.requests[-1].sampling_params.compressed_token_type_ids is None
    assert tokenize_pair(TOKENIZER, "a", "b") == (TOKENIZER("a", text_pair="b")["input_ids"], None)
    # A model without token types (a RoBERTa, a decoder) gets none, whatever its tokenizer returns.
    http, engine = _app(tokenizer=bert, num_pooled=1, pooling={**pooling, "token_types": False})
    http.post("/score", json={"model": "tiny", "text_1": "what is the capital of france", "text_2": "berlin"})
    assert engine.requests[-1].sampling_params.compressed_token_type_ids is None
