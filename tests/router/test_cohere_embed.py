"""Cohere's POST /v2/embed against a scripted engine: what reaches the engine (texts, truncation,
dimensions) and each embedding type Cohere's clients read."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from router.cohere_embed import packed_bits

from .test_request_fields import TOKENIZER, _app, scripted_embedding


def test_v2_embed_answers_each_asked_embedding_type():
    """texts embedded as /v1/embeddings embeds them; float, base64 (little-endian float32), binary
    and ubinary (a bit per value, >= 0 set, first value highest) in Cohere's response shape."""
    http, engine = _app(pooling={"normalize": False})
    texts = ["Hello world", "Paris is lovely"]
    body = http.post("/v2/embed", json={"model": "tiny", "texts": texts, "input_type": "search_document",
                                        "embedding_types": ["float", "base64", "binary", "ubinary"]}).json()
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == texts
    assert body["id"].startswith("embd-") and body["meta"]["api_version"] == {"version": "2"}
    prompts = [TOKENIZER.encode(t) for t in texts]
    assert [r.prompt_token_ids for r in engine.requests] == prompts
    assert body["meta"]["billed_units"]["input_tokens"] == sum(len(p) for p in prompts)
    vectors = [scripted_embedding(p, r.sampling_params) for p, r in zip(prompts, engine.requests, strict=True)]
    assert body["embeddings"]["float"] == vectors
    for encoded, vector in zip(body["embeddings"]["base64"], vectors, strict=True):
        assert np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist() == pytest.approx(vector)
    for packed, vector in zip(body["embeddings"]["ubinary"], vectors, strict=True):
        bits = "".join("1" if v >= 0 else "0" for v in vector)
        assert packed == [int(bits[i: i + 8], 2) for i in range(0, len(bits), 8)]
    assert body["embeddings"]["binary"] == [[b - 128 for b in row] for row in body["embeddings"]["ubinary"]]
    assert packed_bits(np.array([[1.0, -1.0, 0.0, -0.5, 2.0, -3.0, 0.1, -0.1]]), signed=False) == [[0b10101010]]


def test_v2_embed_truncates_as_cohere_says_and_takes_inputs():
    """truncate END keeps a text's first tokens, START its last, NONE refuses a text too long;
    max_tokens caps each text; output_dimension cuts the vectors; inputs join their text parts."""
    http, engine = _app(pooling={"matryoshka": True})
    text = "Hello world, the quick brown fox, jumps over the lazy dog."
    ids = TOKENIZER.encode(text)
    for truncate, kept in (("END", ids[:4]), ("START", ids[-4:])):
        http.post("/v2/embed", json={"model": "tiny", "texts": [text], "truncate": truncate, "max_tokens": 4})
        assert engine.requests[-1].prompt_token_ids == kept, truncate
    r = http.post("/v2/embed", json={"model": "tiny", "texts": ["x" * 300], "truncate": "NONE"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "texts"
    r = http.post("/v2/embed", json={"model": "tiny", "texts": [text], "truncate": "NONE", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # (A max_tokens past the context truncates at the context.)
    http.post("/v2/embed", json={"model": "tiny", "texts": ["x" * 300], "max_tokens": 100_000})
    assert len(engine.requests[-1].prompt_token_ids) == 256
    body = http.post("/v2/embed", json={"model": "tiny", "inputs": [{"content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}], "output_dimension": 3}).json()
    assert engine.requests[-1].prompt_token_ids == TOKENIZER.encode("Hello\nworld")
    assert engine.requests[-1].sampling_params.embed_dimensions == 3 and len(body["embeddings"]["float"][0]) == 3
    for payload, param in (({"texts": ["a"], "inputs": [{"content": [{"type": "text", "text": "b"}]}]}, "texts"),
                           ({}, "texts"), ({"texts": [""]}, "texts"),
                           ({"texts": ["a"], "embedding_types": ["int4"]}, "embedding_types")):
        r = http.post("/v2/embed", json={"model": "tiny", **payload})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, payload
    http, _ = _app(num_pooled=6, pooling={"normalize": False})  # (six values: not whole bytes)
    r = http.post("/v2/embed", json={"model": "tiny", "texts": ["a"], "embedding_types": ["binary"]})
    assert r.status_code == 400 and "multiple of 8" in r.json()["error"]["message"]
    # (A model not trained for shorter vectors refuses output_dimension, naming Cohere's field.)
    r = http.post("/v2/embed", json={"model": "tiny", "texts": ["a"], "output_dimension": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_dimension"
    assert "matryoshka" in r.json()["error"]["message"]


def test_input_type_picks_the_models_prompt_and_lowercasing_follows_its_config():
    """A sentence-transformers model's prompts prefix each text by Cohere's input_type (e5's
    "query"/"passage" names too); a type it has no prompt for embeds the text as it is; a model
    whose Transformer module lowercases gets lowercased texts on every pooling path."""
    http, engine = _app(pooling={"prompts": (("query", "query: "), ("passage", "passage: "))})
    for input_type, prefix in (("search_query", "query: "), ("search_document", "passage: "), ("clustering", ""),
                               (None, "")):
        body = {"model": "tiny", "texts": ["Hello world"], **({"input_type": input_type} if input_type else {})}
        r = http.post("/v2/embed", json=body)
        assert r.status_code == 200 and r.json()["texts"] == ["Hello world"]  # (as sent)
        assert engine.requests[-1].prompt_token_ids == TOKENIZER.encode(prefix + "Hello world"), input_type
    http, engine = _app(pooling={"do_lower_case": True})
    for path, body in (("/v2/embed", {"texts": ["Hello World"]}), ("/v1/embeddings", {"input": "Hello World"}),
                       ("/score", {"text_1": "Hello", "text_2": "HELLO World"})):
        assert http.post(path, json={"model": "tiny", **body}).status_code == 200, path
        assert engine.requests[-1].prompt_token_ids == TOKENIZER.encode("hello world"), path
