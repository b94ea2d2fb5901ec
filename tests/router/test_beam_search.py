"""vLLM's use_beam_search through the real FastAPI app and OpenAIServing, on an engine played by a
next-token table (each request is answered with one token, its logprob and the best alternatives,
as a real engine answers the router's one-token rounds)."""

from __future__ import annotations

import asyncio
import math

import pytest

from engine_core.channel import Accepted
from engine_core.outputs import EngineCoreOutput, EngineCoreRequest, LogprobsEntry
from engine_core.request import FinishReason

from .test_request_fields import CHAT_TOKENIZER, MESSAGES, TOKENIZER, ScriptedEngine, _app, _events

A, B, C, D, E, F = (TOKENIZER.encode(ch)[0] for ch in "ABCDEF")
EOS = TOKENIZER.eos_token_id


def next_token_table(last: int) -> dict[int, float]:
    """What follows a context ending in ``last``: greedy takes A, whose followers are all poor;
    B leads to a sure E (the table of tests/engine_core/test_beam_search.py)."""
    probs = {A: {C: 0.32, D: 0.28, EOS: 0.4}, B: {E: 0.98, EOS: 0.02}}.get(last)
    if probs is None:
        probs = {A: 0.6, B: 0.35, EOS: 0.05} if last not in (C, D, E, F) else {F: 0.7, EOS: 0.3}
    return {token: math.log(p) for token, p in probs.items()}


class TableEngine(ScriptedEngine):
    """Answers each request with its context's most likely next token and the best alternatives
    (as many as the request asks logprobs for), then finishes it; ``delay``: seconds before answering."""

    table = staticmethod(next_token_table)
    delay = 0.0

    def _answer(self, request: EngineCoreRequest) -> None:
        if self.delay:
            asyncio.get_running_loop().call_later(self.delay, self._answer_now, request)
        else:
            self._answer_now(request)

    def _answer_now(self, request: EngineCoreRequest) -> None:
        self.client._on_message(self.client._slots[self.slot], Accepted(request.request_id))
        ranked = sorted(self.table(request.prompt_token_ids[-1]).items(), key=lambda x: -x[1])
        token, logprob = ranked[0]
        k = request.sampling_params.logprobs or 0
        finish = FinishReason.STOP if token == EOS else FinishReason.LENGTH
        self.client._queues[request.request_id].put_nowait(EngineCoreOutput(
            request.request_id, [token], finish, None, LogprobsEntry([logprob], [ranked[:k]]), 0))


def _beam_app(**settings):
    http, engine = _app(tokenizer=CHAT_TOKENIZER, settings={"eos_token_ids": (EOS,), **settings})
    table = engine.client._slots[0].channel = TableEngine(engine.client, engine.script)
    return http, table


def _text(*tokens: int) -> str:
    return TOKENIZER.decode(list(tokens), skip_special_tokens=True)


def test_beam_search_finds_the_beams_greedy_misses_and_each_round_is_one_token():
    http, engine = _beam_app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 2, "max_tokens": 2, "logprobs": 1,
                                           "use_beam_search": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [_text(B, E), _text(A, C)]
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == pytest.approx([math.log(0.35) + math.log(0.98), math.log(0.6) + math.log(0.32)])
    # logprobs=1: each token's row names it and the most likely token (one entry where they are one).
    for c in choices:
        for token, logprob, top in zip(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"],
                                       c["logprobs"]["top_logprobs"], strict=True):
            assert top[token] == logprob and len(top) <= 2 and max(top.values()) >= logprob
    assert r.json()["usage"]["completion_tokens"] == 4
    prompt = TOKENIZER.encode("hi")
    # Round 1 sends the prompt, round 2 each live beam; every request is for one token and 2n alternatives.
    assert [q.prompt_token_ids for q in engine.requests] == [prompt, prompt + [A], prompt + [B]] or \
        [q.prompt_token_ids for q in engine.requests] == [prompt, prompt + [B], prompt + [A]]
    assert {(q.sampling_params.max_tokens, q.sampling_params.logprobs) for q in engine.requests} == {(1, 4)}
    assert engine.aborted == []  # every round's requests finished on their own


def test_an_end_of_sequence_ends_a_beam_and_the_score_follows_length_penalty():
    http, _ = _beam_app()
    body = {"model": "tiny", "prompt": "hi", "n": 2, "max_tokens": 2, "use_beam_search": True,
            "return_token_ids": True}
    # Without length normalisation, A then EOS (ended at 2 tokens) beats A then C.
    choices = http.post("/v1/completions", json={**body, "length_penalty": 0.0}).json()["choices"]
    assert [c["token_ids"] for c in choices] == [[B, E], [A, EOS]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in choices] == [("length", None), ("stop", EOS)]  # (vLLM)
    assert choices[1]["text"] == _text(A)
    # ignore_eos: nothing ends early; an EOS is a token like any other.
    choices = http.post("/v1/completions", json={**body, "length_penalty": 0.0, "ignore_eos": True}).json()["choices"]
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == [([B, E], "length"), ([A, EOS], "length")]
    # A stop_token_ids id ends a beam the same way, and is its stop_reason.
    choices = http.post("/v1/completions", json={**body, "n": 3, "length_penalty": 0.0,
                                                 "stop_token_ids": [C]}).json()["choices"]
    ended = [c for c in choices if c["token_ids"] == [A, C]]
    assert ended and (ended[0]["finish_reason"], ended[0]["stop_reason"]) == ("stop", C)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streamed_beam_search_sends_the_same_choices_once_found(path):
    http, _ = _beam_app()
    body = {"model": "tiny", "n": 2, "max_tokens": 2, "use_beam_search": True, "return_token_ids": True,
            **({"prompt": "hi"} if "chat" not in path else {"messages": MESSAGES})}
    whole = http.post(path, json=body).json()
    events = _events(http.post(path, json={**body, "stream": True}).text)
    for choice in whole["choices"]:
        own = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        text = "".join((c.get("text") if "chat" not in path else c["delta"].get("content")) or "" for c in own)
        assert text == (choice.get("text") if "chat" not in path else choice["message"]["content"])
        assert [t for c in own for t in c.get("token_ids") or ()] == choice["token_ids"]
        assert own[-1]["finish_reason"] == choice["finish_reason"]
    # (The runner-up depends on the prompt's length, which vLLM's score counts.)
    assert whole["choices"][0]["token_ids"] == [B, E] and len(whole["choices"]) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_chats_echo_starts_each_beam_with_the_message_it_continues(stream):
    http, _ = _beam_app()
    body = {"model": "tiny", "n": 2, "max_tokens": 2, "use_beam_search": True, "echo": True, "stream": stream,
            "add_generation_prompt": False, "continue_final_message": True,
            "messages": [*MESSAGES, {"role": "assistant", "content": "So:"}]}
    r = http.post("/v1/chat/completions", json=body)
    if stream:
        texts = ["".join(e["choices"][0]["delta"].get("content") or "" for e in _events(r.text)
                         if e["choices"][0]["index"] == i) for i in range(2)]
    else:
        texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert texts[0] == "So:" + _text(B, E) and texts[1].startswith("So:" + _text(A))  # (runner-up: A, then EOS)


def test_beams_of_several_prompts_are_numbered_per_prompt():
    http, _ = _beam_app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ["hi", "Paris"], "n": 2, "max_tokens": 1,
                                           "use_beam_search": True})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [_text(A), _text(B)] * 2


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"stop": ["x"]}, "stop"),
    ("/v1/completions", {"min_tokens": 1}, "min_tokens"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"logit_bias": {"5": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"vllm_xargs": {"target_token": 3}}, "vllm_xargs"),
    ("/v1/completions", {"guided_choice": ["a", "b"]}, "use_beam_search"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "use_beam_search"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required"}, "tool_choice"),
])
def test_what_beam_search_cannot_honour_is_refused_naming_it(path, extra, param):
    http, engine = _beam_app()
    body = {"model": "tiny", "use_beam_search": True, "n": 2, **extra,
            **({"prompt": "hi"} if "chat" not in path else {"messages": MESSAGES})}
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert engine.requests == []
    # The same with neutral values is served.
    assert http.post(path, json={"model": "tiny", "use_beam_search": True, "n": 2, "max_tokens": 1,
                                 "presence_penalty": 0.0, "stop": [],
                                 **({"prompt": "hi"} if "chat" not in path else {"messages": MESSAGES})}
                     ).status_code == 200


def test_a_failed_round_fails_the_request_and_aborts_the_rounds_other_requests():
    http, engine = _beam_app()
    held: list[str] = []

    def answer(request: EngineCoreRequest) -> None:
        engine.client._on_message(engine.client._slots[0], Accepted(request.request_id))
        if request.prompt_token_ids[-1] == B:  # round 2: beam B fails in its engine, beam A never answers
            engine.client._queues[request.request_id].put_nowait(
                EngineCoreOutput(request.request_id, [], FinishReason.ERROR, "worker died"))
        elif request.prompt_token_ids[-1] == A:
            held.append(request.request_id)
        else:
            TableEngine._answer_now(engine, request)

    engine._answer = answer
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 2, "max_tokens": 3,
                                           "use_beam_search": True})
    assert r.status_code == 500 and "worker died" in r.json()["error"]["message"]
    assert len(engine.requests) == 3  # nothing after the failed round
    assert held and engine.aborted == held  # the round's other request is aborted in its engine


def test_the_logprobs_a_client_asks_to_see_do_not_change_the_beams():
    """Only the best 2n alternatives compete (vLLM's): asking for more logprobs shows more, and an
    end of sequence ranked below them (which, ending a long prompt early, would score well) stays out."""
    http, engine = _beam_app()
    G, H = (TOKENIZER.encode(ch)[0] for ch in "GH")
    engine.table = staticmethod(lambda last: {F: math.log(0.6), G: math.log(0.2), H: math.log(0.1),
                                              A: math.log(0.06), EOS: math.log(0.04)})  # EOS ranked 5th
    prompt = TOKENIZER.encode("Hello world, the quick brown fox jumps over the lazy dog. " * 4)
    answers = []
    for logprobs in (None, 0, 4, 8):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "n": 1, "max_tokens": 8,
                                               "use_beam_search": True, "logprobs": logprobs,
                                               "return_token_ids": True})
        choice = r.json()["choices"][0]
        answers.append((choice["token_ids"], choice["finish_reason"]))
        assert engine.requests[-1].sampling_params.logprobs == max(2, logprobs or 0)
        if logprobs:
            assert all(len(top) == min(logprobs, 5) for top in choice["logprobs"]["top_logprobs"])
    assert answers == [([F] * 8, "length")] * 4


def test_every_prompt_is_checked_before_any_search_starts():
    http, engine = _beam_app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ["hi", "x " * 300], "n": 2,
                                           "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "max_tokens"), r.text
    assert engine.requests == []
    # 2n alternatives beyond --max-logprobs: refused, as vLLM's engines refuse them.
    http, engine = _beam_app(max_logprobs=4)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 3, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and engine.requests == []


def test_the_request_timeout_counts_the_whole_search_not_each_round():
    http, engine = _beam_app(request_timeout_s=0.3)
    engine.delay = 0.1  # each round takes 0.1 s: eight of them are past the timeout, none alone is
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 1, "max_tokens": 8,
                                           "use_beam_search": True, "ignore_eos": True})
    assert r.status_code == 408, r.text
    assert 2 <= len(engine.requests) < 8
