"""prompt_embeds on /v1/completions through the real app, the engine played by a script: what reaches
the engine, the answer's shape, and every refusal (400 naming its parameter)."""

from __future__ import annotations

import json

import pytest
import torch

from engine_core.prompt_embeds import encode_prompt_embeds
from router.routing import PrefixAwarePolicy

from .test_request_fields import TEXT, TOKENIZER, _app

ENABLED = {"enable_prompt_embeds": True, "input_embedding_size": 8}


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("stream", [False, True])
def test_embeddings_reach_the_engine_with_placeholders_first_and_are_counted_as_prompt_tokens(stream):
    http, engine = _app(settings=ENABLED)
    rows = [_rows(5), _rows(3, seed=1).half()]
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi there", "prompt_embeds": [encode_prompt_embeds(t) for t in rows],
        "max_tokens": 4, "return_token_ids": True, "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {})})
    assert r.status_code == 200, r.text
    sent = engine.requests
    assert [len(q.prompt_token_ids) for q in sent] == [5, 3, len(TOKENIZER.encode("hi there"))]
    assert sent[0].prompt_token_ids == [0] * 5 and sent[2].prompt_embeds is None
    assert torch.equal(sent[0].prompt_embeds.to_tensor(), rows[0])
    assert sent[1].prompt_embeds.dtype == "float16" and torch.equal(sent[1].prompt_embeds.to_tensor(), rows[1])
    expected_text = TOKENIZER.decode(TOKENIZER.encode(TEXT)[:4])
    if not stream:
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert all(c["text"] == expected_text for c in body["choices"])
        # return_token_ids: a prompt given as embeddings has no ids to show.
        assert [c.get("prompt_token_ids") for c in body["choices"]] == [None, None, sent[2].prompt_token_ids]
        usage = body["usage"]
    else:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        firsts = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                firsts.setdefault(c["index"], c)
        assert firsts[0].get("prompt_token_ids") is None and firsts[2]["prompt_token_ids"] == sent[2].prompt_token_ids
        text = {i: "".join(c["text"] for ch in chunks for c in ch["choices"] if c["index"] == i) for i in range(3)}
        assert text == {0: expected_text, 1: expected_text, 2: expected_text}
        usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == 5 + 3 + len(sent[2].prompt_token_ids) and usage["completion_tokens"] == 12


@pytest.mark.parametrize("prompt", [None, "", [""], ["", ""]])
def test_an_empty_or_missing_prompt_beside_embeddings_adds_no_prompt(prompt):
    http, engine = _app(settings=ENABLED)
    body = {"model": "tiny", "prompt_embeds": encode_prompt_embeds(_rows(4)), "max_tokens": 2}
    if prompt is not None:
        body["prompt"] = prompt
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(engine.requests) == 1 and len(r.json()["choices"]) == 1


def test_truncate_prompt_tokens_keeps_the_last_rows():
    http, engine = _app(settings=ENABLED)
    rows = _rows(10)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt_embeds": encode_prompt_embeds(rows),
                                           "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert r.status_code == 200, r.text
    assert torch.equal(engine.requests[0].prompt_embeds.to_tensor(), rows[-4:])
    assert r.json()["usage"]["prompt_tokens"] == 4


def test_prefix_aware_routing_keys_blocks_by_the_embeddings_not_the_placeholders():
    from engine_core.core.kv_cache_utils import extend_block_hashes
    from engine_core.prompt_embeds import PromptEmbeds

    policy = PrefixAwarePolicy(1, block_size=4, load_margin=100, seed=0)
    http, engine = _app(settings=ENABLED, policy=policy)
    rows = _rows(13)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt_embeds": encode_prompt_embeds(rows),
                                           "max_tokens": 1})
    assert r.status_code == 200, r.text

    def hashes(embeds: PromptEmbeds | None) -> list[bytes]:
        out: list[bytes] = []
        extend_block_hashes(out, [0] * 13, 3, 4, prompt_embeds=embeds)
        return out

    # What the engine will key its blocks by is what the router remembers having sent there.
    assert engine.requests[0].prompt_embeds == PromptEmbeds.from_tensor(rows)
    assert policy.match_lengths(hashes(PromptEmbeds.from_tensor(rows))) == [3]
    # Neither the placeholders alone nor other rows match it.
    assert policy.match_lengths(hashes(None)) == [0]
    assert policy.match_lengths(hashes(PromptEmbeds.from_tensor(_rows(13, seed=5)))) == [0]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt_embeds": "%%%"}, "prompt_embeds", "base64"),
    ({"prompt_embeds": ["AAAA"]}, "prompt_embeds.0", "torch.save"),
    ({"prompt_embeds": encode_prompt_embeds(torch.zeros(3, 5))}, "prompt_embeds", "hidden size 8, not 5"),
    ({"prompt_embeds": encode_prompt_embeds(torch.zeros(3, 8, dtype=torch.int32))}, "prompt_embeds", "float32"),
    ({"prompt_embeds": encode_prompt_embeds(torch.zeros(3, 8)), "echo": True}, "echo", "Echo is unsupported"),
    ({"prompt_embeds": encode_prompt_embeds(torch.zeros(3, 8)), "prompt_logprobs": 1}, "prompt_logprobs",
     "unsupported with prompt embeds"),
    ({"prompt_embeds": encode_prompt_embeds(torch.zeros(3, 8)), "use_beam_search": True, "n": 2},
     "use_beam_search", "unsupported with prompt embeds"),
    ({"prompt_embeds": encode_prompt_embeds(torch.zeros(300, 8))}, "prompt_embeds", "maximum context length"),
    ({"prompt_embeds": [encode_prompt_embeds(torch.zeros(3, 8)), encode_prompt_embeds(torch.zeros(256, 8))]},
     "prompt_embeds.1", "maximum context length"),
    ({}, "prompt", "prompt is required"),
])
def test_refusals_name_their_parameter(body, param, message):
    http, engine = _app(settings=ENABLED)
    r = http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert engine.requests == []


def test_a_request_too_large_for_a_channel_frame_is_a_400_and_the_channel_lives_on(monkeypatch):
    from engine_core import channel

    http, engine = _app(settings=ENABLED)
    monkeypatch.setattr(channel, "MAX_FRAME_BYTES", 2000)
    r = http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                           "prompt_embeds": encode_prompt_embeds(_rows(100))})
    assert r.status_code == 400 and "more than one request may be" in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                           "prompt_embeds": encode_prompt_embeds(_rows(4))})
    assert r.status_code == 200, r.text
    assert len(engine.requests) == 1


def test_without_enable_prompt_embeds_they_are_refused_as_vllm_refuses_them():
    http, engine = _app()
    r = http.post("/v1/completions", json={"model": "tiny", "max_tokens": 2,
                                           "prompt_embeds": encode_prompt_embeds(_rows(3))})
    assert r.status_code == 400 and "--enable-prompt-embeds" in r.json()["error"]["message"], r.text
    assert engine.requests == []
