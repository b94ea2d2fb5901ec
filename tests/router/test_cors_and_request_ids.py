"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials; open by
default) and answers named by the request's X-Request-Id, through the real app on a scripted engine."""

from __future__ import annotations

from router.serving import CORSSettings

from .test_request_fields import MESSAGES, _app, _chat_app

PREFLIGHT = {"Origin": "https://ui.example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 3}


def test_browsers_on_any_origin_may_call_by_default_even_with_an_api_key():
    http, engine = _app(settings={"api_keys": ("k",)})
    preflight = http.options("/v1/completions", headers=PREFLIGHT)  # (no key: a preflight carries none)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = http.post("/v1/completions", json=COMPLETION,
                       headers={"Origin": "https://ui.example.com", "Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    # A refusal carries the CORS headers too, so the page can read why.
    refused = http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://ui.example.com"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert len(engine.requests) == 1
    # Without an Origin (no browser) nothing changes.
    assert "access-control-allow-origin" not in http.get("/health").headers


def test_the_allowed_origins_methods_and_credentials_are_the_flags():
    cors = CORSSettings(allow_origins=("https://ui.example.com",), allow_methods=("GET", "POST"),
                        allow_headers=("content-type",), allow_credentials=True)
    http, _ = _app(settings={"cors": cors})
    ok = http.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "content-type"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example.com"
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert http.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example.com"}
                        ).status_code == 400
    assert http.options("/v1/completions", headers={**PREFLIGHT, "Access-Control-Request-Method": "DELETE"}
                        ).status_code == 400
    answer = http.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example.com"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_an_answer_takes_the_requests_x_request_id_as_its_id():
    """As vLLM: a completion or chat answer's id is cmpl-/chatcmpl- and the request's X-Request-Id
    (Ray Serve sets one on every request that lacks it, and answers with it), so a gateway's or Serve's
    id names the request in our logs; two requests with one id stay two requests in the engine."""
    http, engine = _chat_app()
    first = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-42"}).json()
    second = http.post("/v1/completions", json={**COMPLETION, "n": 2}, headers={"X-Request-Id": "trace-42"}).json()
    assert first["id"] == second["id"] == "cmpl-trace-42"
    engine_ids = [r.request_id for r in engine.requests]
    assert all(rid.startswith("cmpl-trace-42-") for rid in engine_ids) and len(set(engine_ids)) == 3
    with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "t-7"},
                     json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "stream": True}) as streamed:
        chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert chunks and all('"id":"chatcmpl-t-7"' in chunk for chunk in chunks)
    unnamed = http.post("/v1/completions", json=COMPLETION).json()["id"]
    assert unnamed.startswith("cmpl-") and len(unnamed) == len("cmpl-") + 32
    assert http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "x" * 500}).json()["id"] == (
        "cmpl-" + "x" * 128)


def test_the_bodys_request_id_names_the_answer_unless_a_header_does():
    """vLLM's request_id field: the answer is <prefix>-<request_id> on the generation and pooling
    endpoints, before an X-Request-Id header's (which Serve gives every request); the engines' ids
    stay distinct."""
    http, engine = _chat_app()
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    assert http.post("/v1/completions", json={**COMPLETION, "request_id": "job-1"}).json()["id"] == "cmpl-job-1"
    assert http.post("/v1/chat/completions", json={**chat, "request_id": "job-2"}).json()["id"] == "chatcmpl-job-2"
    assert http.post("/v1/chat/completions", json={**chat, "request_id": "job-2"},
                     headers={"X-Request-Id": "hdr"}).json()["id"] == "chatcmpl-job-2"
    engine_ids = [r.request_id for r in engine.requests]
    assert engine_ids[0].startswith("cmpl-job-1-") and engine_ids[1].startswith("chatcmpl-job-2-")
    assert len(set(engine_ids)) == 3  # (two requests with one id stay two requests)
    http, engine = _app()
    pooled = {"model": "tiny", "input": "Hello world", "request_id": "emb-9"}
    for path, prefix in (("/v1/embeddings", "embd"), ("/pooling", "pool")):
        assert http.post(path, json=pooled).json()["id"] == f"{prefix}-emb-9"
        assert http.post(path, json={**pooled, "request_id": None}, headers={"X-Request-Id": "h"}
                         ).json()["id"] == f"{prefix}-h"
    assert http.post("/score", json={"model": "tiny", "text_1": "a", "text_2": "b", "request_id": "s"}
                     ).json()["id"] == "score-s"
    assert http.post("/rerank", json={"model": "tiny", "query": "a", "documents": ["b"]},
                     headers={"X-Request-Id": "r"}).json()["id"] == "rerank-r"
    assert all(r.request_id.startswith(("embd-emb-9-", "embd-h-", "pool-emb-9-", "pool-h-", "score-s-", "rerank-r-"))
               for r in engine.requests)
    assert len({r.request_id for r in engine.requests}) == len(engine.requests)
    unnamed = http.post("/v1/embeddings", json={"model": "tiny", "input": "Hi"}).json()["id"]
    assert unnamed.startswith("embd-") and len(unnamed) == len("embd-") + 32
