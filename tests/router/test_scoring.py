"""POST /score and /rerank (vLLM's scoring endpoints, for embedding models) through the app, against
a scripted engine: pairing, each text embedded once, cosine scores, ranking, the paths and aliases,
and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engine_core.sampling_params import SamplingParams
from router.app import create_app
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings

from .test_request_fields import TOKENIZER, _app, scripted_embedding

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Berlin is the capital of Germany.", "the quick brown fox"]


def _expected(first: str, second: str) -> float:
    params = SamplingParams(max_tokens=1, embed=True, embed_normalize=True)
    a = np.asarray(scripted_embedding(TOKENIZER.encode(first), params))
    b = np.asarray(scripted_embedding(TOKENIZER.encode(second), params))
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_one_text_against_many_embeds_each_text_once():
    http, engine = _app()
    r = http.post("/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx([_expected(QUERY, doc) for doc in DOCS], abs=1e-9)
    # The query was embedded once, beside each document; all as embedding requests, normalised.
    assert [rq.prompt_token_ids for rq in engine.requests] == [TOKENIZER.encode(t) for t in [QUERY, *DOCS]]
    assert all(rq.sampling_params.embed and rq.sampling_params.embed_normalize for rq in engine.requests)
    tokens = sum(len(TOKENIZER.encode(t)) for t in [QUERY, *DOCS])
    assert body["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


def test_pairs_side_by_side_under_every_path_and_name():
    firsts = ["Hello world", "Paris is the capital of France.", "Hello world"]
    seconds = ["Hello world", "the quick brown fox", "def main():"]
    expected = [1.0, _expected(firsts[1], seconds[1]), _expected(firsts[2], seconds[2])]
    for path, names in (("/v1/score", ("text_1", "text_2")), ("/score", ("queries", "documents")),
                        ("/score", ("data_1", "data_2")), ("/v1/score", ("queries", "items"))):
        http, engine = _app()
        body = http.post(path, json={"model": "tiny", names[0]: firsts, names[1]: seconds}).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-12)
        assert body["data"][0]["score"] == 1.0  # a text against itself, exactly
        assert len(engine.requests) == 4  # "Hello world" once
    single = _app()[0].post("/score", json={"model": "tiny", "text_1": "Hello world", "text_2": "def main():"})
    assert single.json()["data"][0]["score"] == pytest.approx(_expected("Hello world", "def main():"), abs=1e-12)


def test_rerank_orders_documents_by_relevance():
    http, _ = _app()
    expected = [_expected(QUERY, doc) for doc in DOCS]
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = http.post(path, json={"model": "tiny", "query": QUERY, "documents": DOCS}).json()
        assert body["model"] == "tiny" and body["id"].startswith("rerank-")
        assert [r["index"] for r in body["results"]] == order
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in order],
                                                                              abs=1e-9)
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
        assert body["usage"]["total_tokens"] == sum(len(TOKENIZER.encode(t)) for t in [QUERY, *DOCS])
    # Cohere's document objects, the n best only, without the texts.
    top = http.post("/v2/rerank", json={"model": "tiny", "query": QUERY, "top_n": 2, "return_documents": False,
                                        "documents": [{"text": d} for d in DOCS]}).json()
    assert [r["index"] for r in top["results"]] == order[:2] and "document" not in top["results"][0]  # (Cohere's)
    # One document alone (vLLM takes a string), and return_documents null (true).
    one = http.post("/rerank", json={"model": "tiny", "query": QUERY, "documents": DOCS[0],
                                     "return_documents": None}).json()
    assert [(r["index"], r["document"]["text"]) for r in one["results"]] == [(0, DOCS[0])]
    every = http.post("/rerank", json={"model": "tiny", "query": QUERY, "documents": DOCS, "top_n": -1}).json()
    assert [r["index"] for r in every["results"]] == order  # (0 or less: all, as vLLM reads it)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_2"),
    ("/score", {"text_1": [], "text_2": "a"}, 400, "text_1"),
    ("/score", {"text_1": "a", "text_2": ["b", ""]}, 400, "text_2"),
    ("/score", {"text_1": "a"}, 400, "text_2"),
    ("/score", {"queries": "a", "documents": ["b"], "text_1": "a"}, 400, "text_1"),
    ("/score", {"queries": "a", "documents": ["b"], "items": ["c"]}, 400, "queries"),
    ("/score", {"data_1": "a"}, 400, "data_2"),
    ("/score", {"queries": "a"}, 400, "documents"),
    ("/score", {"text_1": "a", "text_2": "x" * 300}, 400, "text_2"),  # beyond max_model_len (256)
    ("/score", {"queries": "x" * 300, "documents": "b"}, 400, "queries"),
    ("/score", {"text_1": "a", "text_2": "b", "priority": 3}, 400, "priority"),
    ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, 404, "model"),
    ("/rerank", {"query": "a", "documents": []}, 400, "documents"),
    ("/rerank", {"query": "", "documents": ["b"]}, 400, "query"),
    ("/rerank", {"query": "a", "documents": [{"title": "no text"}]}, 400, "documents"),
    ("/rerank", {"query": "x" * 300, "documents": ["b"]}, 400, "query"),
])
def test_refusals_name_their_parameter(path, body, status, param):
    http, engine = _app()
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert not engine.requests  # refused before anything ran


def test_an_api_key_guards_every_scoring_classify_and_pooling_path():
    from router.engine_client import EngineClient

    settings = ServingSettings(served_model_name="tiny", max_model_len=64, api_keys=("k",))
    http = TestClient(create_app(OpenAIServing(settings, EngineClient([object()], client_index=1), TOKENIZER,
                                               RoundRobinPolicy())))
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/classify",
                 "/pooling", "/v1/pooling"):
        assert http.post(path, json={}).status_code == 401, path
        assert http.post(path, json={}, headers={"Authorization": "Bearer k"}).status_code == 400, path
