"""vLLM's serving routes beside the APIs: SageMaker's /ping and /invocations, /load
(--enable-server-load-tracking) and /tokenizer_info (--enable-tokenizer-info-endpoint), on a
scripted engine."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from router.app import create_app
from router.engine_client import EngineClient
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings
from router.tokenizer_info import describe_tokenizer
from tests.tiny_model import CHAT_TEMPLATE

from .test_app import _EngineHandle
from .test_request_fields import TOKENIZER, _app, scripted_embedding

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CHAT_TOKENIZER = copy.deepcopy(TOKENIZER)
CHAT_TOKENIZER.chat_template = CHAT_TEMPLATE
CLASSIFIER = {"generates": False, "labels": ("neg", "pos")}
CROSS_ENCODER = {"generates": False, "labels": ("LABEL_0",), "token_types": True}
REWARD_MODEL = {"generates": False, "labels": ("LABEL_0",), "pooling_type": "ALL", "classifier_activation": "none",
                "row_size": 1}


def test_ping_answers_as_health_does():
    """SageMaker's health check, GET or POST: 200 while an engine answers, else 503, as /health."""
    for handle, status in ((_EngineHandle(), 200), (object(), 503)):  # (object(): a probe that fails)
        http, _ = _app(handle=handle)
        health = http.get("/health")
        assert health.status_code == status
        for method in (http.get, http.post):
            ping = method("/ping")
            assert (ping.status_code, ping.json()) == (status, health.json())


def test_invocations_answers_each_kind_of_body_as_its_own_endpoint():
    """A generating model: a chat body is a chat completion (streamed when asked), a prompt a
    completion, an input an embedding, each as its own path answers it."""
    http, engine = _app(tokenizer=CHAT_TOKENIZER)
    chat = http.post("/invocations", json={"model": "tiny", **CHAT})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    direct = http.post("/v1/chat/completions", json={"model": "tiny", **CHAT}).json()
    assert chat.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    streamed = http.post("/invocations", json={**CHAT, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.endswith("data: [DONE]\n\n") and '"chat.completion.chunk"' in streamed.text
    completion = http.post("/invocations", json={"prompt": "hi", "max_tokens": 3}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 3
    assert engine.requests[-1].prompt_token_ids == CHAT_TOKENIZER.encode("hi")
    embedding = http.post("/invocations", json={"input": "hi"}).json()
    params = engine.requests[-1].sampling_params
    assert params.embed and embedding["data"][0]["embedding"] == scripted_embedding(CHAT_TOKENIZER.encode("hi"),
                                                                                     params)
    # A body the chat request refuses on its merits is the chat endpoint's 400, not another kind's.
    refused = http.post("/invocations", json={**CHAT, "max_tokens": 1000})  # (max_model_len is 256)
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]


def test_invocations_skips_what_the_model_does_not_serve():
    """Request kinds the model does not serve are not tried: an embedding-only model reads messages
    as an embedding request; a classifier's input is classified; a cross-encoder scores and reranks;
    a reward model pools every token."""
    http, engine = _app(tokenizer=CHAT_TOKENIZER, pooling={"generates": False})
    body = http.post("/invocations", json={"messages": CHAT["messages"]}).json()
    assert body["data"][0]["object"] == "embedding" and engine.requests[-1].sampling_params.embed

    http, _ = _app(num_pooled=2, pooling=CLASSIFIER)
    body = http.post("/invocations", json={"input": ["good", "bad"]}).json()
    assert [item["label"] for item in body["data"]] == [item["label"] for item in http.post(
        "/classify", json={"model": "tiny", "input": ["good", "bad"]}).json()["data"]]
    assert {"neg", "pos"} >= {item["label"] for item in body["data"]}

    http, _ = _app(num_pooled=1, pooling=CROSS_ENCODER)
    score = http.post("/invocations", json={"text_1": "a", "text_2": ["b", "c"]}).json()
    assert [d["object"] for d in score["data"]] == ["score", "score"]
    rerank = http.post("/invocations", json={"query": "a", "documents": ["b", "c"]}).json()
    assert sorted(r["index"] for r in rerank["results"]) == [0, 1]
    assert http.post("/invocations", json={"input": "a"}).json()["data"][0]["probs"]  # (classified: one class)

    http, engine = _app(num_pooled=4, pooling=REWARD_MODEL)
    body = http.post("/invocations", json={"input": [5, 6, 7, 8]}).json()
    assert engine.requests[-1].sampling_params.embed_pooling == "ALL"
    assert body["data"][0]["data"] == [[v] for v in scripted_embedding([5, 6, 7, 8],
                                                                        engine.requests[-1].sampling_params)[:4]]


@pytest.mark.parametrize(("content", "status", "needle"), [
    (b'{"foo": 1}', 400, "ChatCompletionRequest (messages: Field required)"),
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "other", "prompt": "hi"}', 404, "other"),
])
def test_invocations_refusals(content, status, needle):
    http, _ = _app()
    r = http.post("/invocations", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    if status == 400 and "foo" in content.decode():  # every kind the model serves is named
        for name in ("CompletionRequest", "EmbeddingRequest", "ScoreRequest", "RerankRequest", "PoolingRequest"):
            assert name in r.json()["error"]["message"]
        assert "ClassificationRequest" not in r.json()["error"]["message"]  # (not a classifier)


def test_invocations_does_not_try_embeddings_a_model_cannot_serve():
    """A generating model whose checkpoint asks for embeddings that are not served: an input body is
    neither an embedding nor a pooling request there, and the 400 names only what it serves."""
    http, engine = _app(pooling={"unavailable": "its Dense layer is not served"})
    r = http.post("/invocations", json={"input": "hi"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and not engine.requests
    assert "ChatCompletionRequest" in message and "CompletionRequest" in message
    assert "EmbeddingRequest" not in message and "PoolingRequest" not in message


def test_invocations_needs_the_api_key():
    http, _ = _app(settings={"api_keys": ("k",)})
    assert http.post("/invocations", json={"prompt": "hi"}).status_code == 401
    assert http.post("/invocations", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"}).status_code == 200
    assert http.get("/ping").status_code != 401 and http.get("/load").status_code == 200


async def _asgi(app, method: str, path: str, body: dict | None = None, on_body=None) -> tuple[int, bytes]:
    """One request through the ASGI app; ``on_body`` is awaited at each body message, before it is
    taken (the request is still in progress then)."""
    payload = json.dumps(body).encode() if body is not None else b""
    sent = False
    status, chunks = 0, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # (the client never leaves)

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            if on_body is not None:
                await on_body()
            chunks.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return status, b"".join(chunks)


@pytest.mark.parametrize("tracking", [True, False])
def test_load_counts_requests_until_their_streams_end(tracking):
    """With tracking, /load counts the generation requests in progress (a stream until its last
    chunk has gone); other paths are not counted; without it, /load answers 0."""
    http, _ = _app(settings={"enable_server_load_tracking": tracking})
    app = http.app
    seen: list[int] = []

    async def read_load():
        status, body = await _asgi(app, "GET", "/load")
        assert status == 200
        seen.append(json.loads(body)["server_load"])

    async def scenario():
        await _asgi(app, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True},
                    on_body=read_load)
        inside = list(seen)
        seen.clear()
        await _asgi(app, "POST", "/tokenize", {"prompt": "hi"}, on_body=read_load)  # (not an engine path)
        await read_load()
        return inside

    inside = asyncio.run(scenario())
    assert len(inside) >= 2 and set(inside) == ({1} if tracking else {0})
    assert seen == [0, 0]


def test_tokenizer_info_is_off_unless_enabled(tiny_model_dir):
    """A tokenizer loaded as a replica loads it: its init arguments as JSON (special tokens as their
    text, the added tokens' table by id), no path into the replica's copy, the template in force."""
    from transformers import AutoTokenizer

    http, _ = _app()
    assert http.get("/tokenizer_info").status_code == 404
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE  # (as --chat-template sets it)
    http, _ = _app(tokenizer=tokenizer, settings={"enable_tokenizer_info_endpoint": True})
    info = http.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    body = info.json()
    assert body["tokenizer_class"] == type(tokenizer).__name__ and body["chat_template"] == CHAT_TEMPLATE
    assert "name_or_path" in tokenizer.init_kwargs and "vocab_file" in tokenizer.init_kwargs
    assert not [key for key in body if key.endswith("_file") or key == "name_or_path"]
    assert body["eos_token"] == str(tokenizer.eos_token) and body["bos_token"] == str(tokenizer.bos_token)
    assert body["model_max_length"] == tokenizer.model_max_length
    decoder = tokenizer.init_kwargs["added_tokens_decoder"]
    assert body["added_tokens_decoder"] == {str(i): token.content for i, token in decoder.items()}
    assert http.get("/tokenizer_info", params={"model": "nope"}).status_code == 404


def test_tokenizer_info_keeps_only_data():
    """Values that are not data (a tokenizer object, say) are left out, a non-finite number is null,
    and a tokenizer without init arguments still answers its class."""
    class Odd:
        init_kwargs = {"tokenizer_object": object(), "limit": float("inf"), "nested": {"x": [object(), 1.5]}}
        chat_template = None

    class Bare:
        init_kwargs = None

    assert describe_tokenizer(Odd()) == {"limit": None, "nested": {"x": [1.5]}, "tokenizer_class": "Odd"}
    assert describe_tokenizer(Bare()) == {"tokenizer_class": "Bare"}


def test_load_sums_only_this_apps_requests():
    """Each app (router replica) keeps its own count."""
    client = EngineClient([object()], client_index=1)
    settings = ServingSettings(served_model_name="tiny", max_model_len=64, enable_server_load_tracking=True)
    first = create_app(OpenAIServing(settings, client, TOKENIZER, RoundRobinPolicy()))
    second = create_app(OpenAIServing(settings, client, TOKENIZER, RoundRobinPolicy()))
    loads: list[tuple[int, int]] = []

    async def read_both():
        loads.append(tuple([json.loads((await _asgi(app, "GET", "/load"))[1])["server_load"]
                            for app in (first, second)]))

    async def scenario():
        # (No engine is reachable: the request ends in an error, counted until its answer is sent.)
        await _asgi(first, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"}, on_body=read_both)

    asyncio.run(scenario())
    assert loads and set(loads) == {(1, 0)}
