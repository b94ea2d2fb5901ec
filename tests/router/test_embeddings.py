"""POST /v1/embeddings through the app and the official openai client (which asks for base64 by
default), against a scripted engine: inputs of every shape, what reaches the engine, the encodings,
usage, and the refusals."""

from __future__ import annotations

import re

import openai
import pytest

from .test_request_fields import TOKENIZER, _app, scripted_embedding


def _client(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_texts_and_token_ids_get_one_embedding_each():
    http, engine = _app()
    client = _client(http)
    texts = ["Hello world", "Paris is the capital of France."]
    out = client.embeddings.create(model="tiny", input=texts)  # (base64 on the wire, decoded by the client)
    assert out.object == "list" and out.model == "tiny" and [d.index for d in out.data] == [0, 1]
    ids = [TOKENIZER.encode(t) for t in texts]
    assert [r.prompt_token_ids for r in engine.requests] == ids
    params = engine.requests[0].sampling_params
    assert params.embed and params.embed_normalize and params.max_tokens == 1 and params.embed_dimensions is None
    for d, prompt in zip(out.data, ids, strict=True):
        assert d.embedding == pytest.approx(scripted_embedding(prompt, params), abs=1e-6)  # float32 on the wire
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(p) for p in ids)
    # Floats as JSON numbers; token ids (one list, or several) as prompts.
    plain = http.post("/v1/embeddings", json={"model": "tiny", "input": ids[0], "encoding_format": "float"}).json()
    assert plain["data"][0]["embedding"] == scripted_embedding(ids[0], params)
    many = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert len(many.data) == 2 and engine.requests[-1].prompt_token_ids == ids[1]


def test_vllm_extras_reach_the_engine():
    http, engine = _app(pooling={"matryoshka": True})
    client = _client(http)
    out = client.embeddings.create(model="tiny", input="Hello world, the quick brown fox", dimensions=3,
                                   extra_body={"normalize": False, "truncate_prompt_tokens": 4})
    params = engine.requests[0].sampling_params
    assert (params.embed_dimensions, params.embed_normalize) == (3, False)
    # (truncate_prompt_tokens keeps the first tokens, as vLLM's pooling endpoints do; or the last ones.)
    prompt = TOKENIZER.encode("Hello world, the quick brown fox")[:4]
    assert engine.requests[0].prompt_token_ids == prompt
    assert out.data[0].embedding == pytest.approx(scripted_embedding(prompt, params), abs=1e-4)
    assert len(out.data[0].embedding) == 3
    client.embeddings.create(model="tiny", input="Hello world, the quick brown fox",
                             extra_body={"truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert engine.requests[-1].prompt_token_ids == TOKENIZER.encode("Hello world, the quick brown fox")[-4:]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": []}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input"),
    ({"input": [[1, 2], []]}, 400, "input"),
    ({"input": [1, "a"]}, 400, "input"),
    ({"input": [len(TOKENIZER)]}, 400, "input"),
    ({"input": "x" * 300}, 400, "input"),  # beyond max_model_len (256)
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "dimensions": 9}, 400, "dimensions"),  # the scripted model's embeddings have 8 values
    ({"input": "hi", "priority": 3}, 400, "priority"),
    ({"input": "hi", "model": "other"}, 404, "model"),
])
def test_refusals_name_their_parameter(body, status, param):
    http, engine = _app(hidden_size=8)
    r = http.post("/v1/embeddings", json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert not engine.requests  # refused before anything ran


@pytest.mark.parametrize(("pooling", "dimensions", "message"), [
    ({}, 4, "does not support matryoshka representation"),  # (vLLM's refusal: not trained for it)
    ({"matryoshka": True, "matryoshka_dimensions": (2, 6)}, 4, r"only supports the matryoshka dimensions \[2, 6\]"),
    ({"matryoshka": True}, 9, r"dimensions \(9\) is larger than the model's embeddings \(8 values\)"),
    ({"matryoshka": True, "matryoshka_dimensions": (2, 6)}, 6, None),
    ({"matryoshka": True}, 5, None)])
def test_dimensions_are_served_for_matryoshka_models_only(pooling, dimensions, message):
    """As vLLM: a model cuts its embeddings short only when its config says it was trained to
    (is_matryoshka), and then to the lengths it lists (matryoshka_dimensions), if it lists any."""
    http, engine = _app(hidden_size=8, pooling=pooling)
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": "hi", "dimensions": dimensions})
    if message is None:
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == dimensions
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        assert re.search(message, r.json()["error"]["message"]) and not engine.requests


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_input_fails_the_request_and_aborts_the_others(failing):
    http, engine = _app()
    texts = ["Hello world", "Paris is the capital of France.", "the quick brown fox"]
    engine.failing_prompt = TOKENIZER.encode(texts[failing])
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": texts})
    assert r.status_code == 500 and "worker died" in r.json()["error"]["message"]
    # The inputs after the failing one (whose outputs were never read) were aborted; nothing is left.
    assert engine.aborted == [rq.request_id for rq in engine.requests[failing + 1:]]
    client = engine.client
    assert client.loads() == [0] and not client._queues


def test_an_embedding_model_pools_as_configured_and_does_not_generate():
    """An engine running an embedding model (runner pooling; MEAN pooling, not normalised by its
    sentence-transformers files): embeddings and scores carry its pooling, a request's normalize
    overrides the model's default, and every generation endpoint answers 400 naming the model."""
    http, engine = _app(pooling={"generates": False, "pooling_type": "MEAN", "normalize": False})
    client = _client(http)
    client.embeddings.create(model="tiny", input="Hello world")
    params = engine.requests[-1].sampling_params
    assert params.embed_pooling == "MEAN" and not params.embed_normalize
    client.embeddings.create(model="tiny", input="Hello world", extra_body={"normalize": True})
    assert engine.requests[-1].sampling_params.embed_normalize
    # vLLM's use_activation is an embedding's normalisation; normalize, when given, decides. A request
    # naming no model gets the first one's.
    for body, normalized in (({"use_activation": True}, True), ({"use_activation": False, "normalize": True}, True),
                             ({}, False)):
        assert http.post("/v1/embeddings", json={"input": "Hello", **body}).status_code == 200
        assert engine.requests[-1].sampling_params.embed_normalize == normalized, body
    assert http.post("/v1/score", json={"model": "tiny", "text_1": "a", "text_2": "b"}).status_code == 200
    assert engine.requests[-1].sampling_params.embed_pooling == "MEAN"
    sent = len(engine.requests)
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/completions", {"prompt": "hi", "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/responses", {"input": "hi"})]:
        r = http.post(path, json={"model": "tiny", **body})
        assert r.status_code == 400, path
        assert r.json()["error"]["param"] == "model" and "is an embedding model" in r.json()["error"]["message"]
    assert len(engine.requests) == sent  # nothing reached the engine


_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}


def _decoded(raw: bytes, embed_dtype: str, endianness: str, shape: list[int]):
    """Bytes of ``embed_dtype`` elements in ``endianness`` order as float32 values, decoded here
    without the router's code: numpy byte-swaps, torch reinterprets the element type."""
    import sys

    import numpy as np
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[embed_dtype])
    width = torch.empty(0, dtype=dtype).element_size()
    ints = np.frombuffer(raw, dtype={1: "u1", 2: "u2", 4: "u4"}[width])
    order = sys.byteorder if endianness == "native" else endianness
    if order != sys.byteorder:
        ints = ints.byteswap()
    view = torch.from_numpy(ints.astype({1: "u1", 2: "i2", 4: "i4"}[width]).copy())
    return view.view(dtype).float().reshape(shape)


@pytest.mark.parametrize("embed_dtype", list(_TORCH_DTYPES))
@pytest.mark.parametrize("endianness", ["native", "big", "little"])
def test_vectors_travel_as_bytes_of_the_dtype_and_order_asked(embed_dtype, endianness):
    """vLLM's embed_dtype and endianness: base64 of the vectors' bytes, or the bytes themselves as
    the body (``bytes``, with a metadata header locating each vector; ``bytes_only`` without), on
    /v1/embeddings and on /pooling's per-token rows; each decodes to the scripted values rounded to
    that dtype."""
    import base64
    import json

    import torch

    http, engine = _app(hidden_size=8, pooling={"row_size": 4})
    texts = ["Hello world", "the quick brown fox"]
    fields = {"embed_dtype": embed_dtype, "endianness": endianness}

    def expected(params, prompt, shape):
        values = torch.tensor(scripted_embedding(prompt, params), dtype=torch.float32)
        return values.to(getattr(torch, _TORCH_DTYPES[embed_dtype])).float().reshape(shape)

    body = http.post("/v1/embeddings", json={"model": "tiny", "input": texts, "encoding_format": "base64",
                                              **fields}).json()
    for item, request in zip(body["data"], engine.requests, strict=True):
        got = _decoded(base64.b64decode(item["embedding"]), embed_dtype, endianness, [8])
        torch.testing.assert_close(got, expected(request.sampling_params, request.prompt_token_ids, [8]))
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": texts, "encoding_format": "bytes", **fields})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta = json.loads(r.headers["metadata"])
    assert meta["model"] == "tiny" and meta["usage"]["prompt_tokens"] == sum(len(TOKENIZER.encode(t)) for t in texts)
    requests = engine.requests[-2:]
    for i, (item, request) in enumerate(zip(meta["data"], requests, strict=True)):
        assert (item["index"], item["embed_dtype"], item["endianness"], item["shape"]) == (i, embed_dtype,
                                                                                            endianness, [8])
        got = _decoded(r.content[item["start"]:item["end"]], embed_dtype, endianness, [8])
        torch.testing.assert_close(got, expected(request.sampling_params, request.prompt_token_ids, [8]))
    assert meta["data"][-1]["end"] == len(r.content)
    only = http.post("/v1/embeddings", json={"model": "tiny", "input": texts, "encoding_format": "bytes_only",
                                             **fields})
    assert "metadata" not in only.headers and only.content == r.content
    # /pooling with every token's embedding (ALL; the scripted engine's 8 values are two rows of 4):
    # one [rows, 4] block per input.
    pooled = http.post("/pooling", json={"model": "tiny", "input": [[5, 6]], "task": "token_embed",
                                         "encoding_format": "bytes", **fields})
    item = json.loads(pooled.headers["metadata"])["data"][0]
    assert item["shape"] == [2, 4]
    request = engine.requests[-1]
    torch.testing.assert_close(_decoded(pooled.content, embed_dtype, endianness, [2, 4]),
                               expected(request.sampling_params, request.prompt_token_ids, [2, 4]))
