"""Request fields through the real FastAPI app and OpenAIServing, with the engine's side of the
channel played by a script: what is refused (400 naming the parameter), what null means, and how
min_tokens and stop token ids shape the text, as vLLM's OpenAI server does."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import pytest
from starlette.testclient import TestClient

from engine_core.channel import AbortRequests, Accepted, AddRequest, encode_frame
from engine_core.executor import PoolingInfo
from engine_core.outputs import EngineCoreOutput, EngineCoreRequest, LogprobsEntry
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams
from router.app import create_app
from router.engine_client import EngineClient
from router.metrics import RouterMetrics
from router.protocol import ChatMessage
from router.routing import RoundRobinPolicy, RoutingContext, RoutingPolicy
from router.serving import OpenAIServing, ServingSettings

from .tokenizer_factory import bos_adding_tokenizer, byte_level_tokenizer

TOKENIZER = byte_level_tokenizer()
# A copy with a chat template (byte_level_tokenizer() is one cached object the router tests share).
CHAT_TOKENIZER = byte_level_tokenizer.__wrapped__()
CHAT_TOKENIZER.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TEXT = "Hello world, the quick brown fox, jumps over the lazy dog."


class ScriptedEngine:
    """Admits every request and answers it with one output per token of ``script(request)``; the
    last output carries ``finish`` (and ``stop_reason``). All outputs are queued at once (a reader
    takes them as one batch), or with ``spaced`` each only once the reader has taken the one
    before, so every output is a batch of its own, as a real engine streams them step by step.
    ``tokens_per_output`` > 1 puts several tokens in each output, as speculative decoding does."""

    def __init__(self, client: EngineClient, script: Callable[[EngineCoreRequest], list[int]],
                 finish: FinishReason = FinishReason.LENGTH, stop_reason: int | None = None, slot: int = 0,
                 spaced: bool = False, tokens_per_output: int = 1, num_cached_tokens: int = 0,
                 num_pooled: int = 8) -> None:
        self.client, self.script, self.finish, self.stop_reason = client, script, finish, stop_reason
        self.slot, self.spaced, self.tokens_per_output = slot, spaced, tokens_per_output
        self.num_cached_tokens = num_cached_tokens  # what the engine reports found in its prefix cache
        self.requests: list[EngineCoreRequest] = []
        self.failing_prompt: list[int] | None = None  # an embedding request of this prompt fails
        self.aborted: list[str] = []
        self.stopped: list[str] = []  # aborted as finished (a stop string the router matched)
        self.kept_tokens: dict[str, int] = {}  # (and the output tokens each kept)
        self.num_pooled = num_pooled  # the values of a pooled output (a classifier's: one per class)
        # Each token's logprob (and its best alternative's, one less); None: -0.5 each, no alternatives.
        self.logprob_of: Callable[[int], float] | None = None
        # How many alternatives each prompt position's logprobs name (tokens 0, 1, ... at -5, -6, ...).
        self.prompt_alternatives = 0

    def send(self, message: object) -> None:
        encode_frame(message)  # what the real channel would put on the wire must encode
        if isinstance(message, AbortRequests):
            self.aborted += message.request_ids
            self.stopped += message.request_ids if message.stopped else []
            self.kept_tokens.update(zip(message.request_ids, message.num_kept_tokens, strict=False))
        if isinstance(message, AddRequest):
            self.requests.append(message.request)
            asyncio.get_running_loop().call_soon(self._answer, message.request)

    def _answer(self, request: EngineCoreRequest) -> None:
        self.client._on_message(self.client._slots[self.slot], Accepted(request.request_id))
        queue = self.client._queues[request.request_id]
        params = request.sampling_params
        if params.embed:  # an embedding request: one finishing output with the prompt's embedding
            if request.prompt_token_ids == self.failing_prompt:
                queue.put_nowait(EngineCoreOutput(request.request_id, [], FinishReason.ERROR, "worker died"))
                return
            queue.put_nowait(EngineCoreOutput(request.request_id, [], FinishReason.STOP,
                                              pooling_output=scripted_embedding(request.prompt_token_ids,
                                                                                params)[:self.num_pooled]))
            return
        tokens = self.script(request)[:request.sampling_params.max_tokens]
        outputs = []
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            logprobs = self._logprobs(token, params.logprobs) if params.logprobs is not None else None
            # Prompt logprobs: position p scores token p + 1 with -p/10, so tests can tell them apart.
            num_prompt = len(request.prompt_token_ids)
            alternatives = [(j, -5.0 - j) for j in range(min(self.prompt_alternatives, params.prompt_logprobs or 0))]
            prompt_logprobs = (LogprobsEntry([-p / 10 for p in range(1, num_prompt)], [alternatives] * (num_prompt - 1))
                               if i == 0 and params.prompt_logprobs is not None else None)
            outputs.append(EngineCoreOutput(request.request_id, [token], self.finish if last else None,
                                            self.stop_reason if last else None, logprobs, self.num_cached_tokens,
                                            prompt_logprobs))
        if self.tokens_per_output > 1:
            outputs = [_joined(outputs[i:i + self.tokens_per_output])
                       for i in range(0, len(outputs), self.tokens_per_output)]
        if not self.spaced:
            for output in outputs:
                queue.put_nowait(output)
            return
        loop = asyncio.get_running_loop()

        def deliver() -> None:
            if queue.empty():  # (the reader took the one before)
                queue.put_nowait(outputs.pop(0))
            if outputs:
                loop.call_later(0.001, deliver)

        deliver()

    def _logprobs(self, token: int, k: int) -> LogprobsEntry:
        if self.logprob_of is None:
            return LogprobsEntry([-0.5], [[]])
        lp = self.logprob_of(token)
        return LogprobsEntry([lp], [[(token, lp), (token + 1, lp - 1.0)][:k]])


def scripted_embedding(prompt: list[int], params: SamplingParams) -> list[float]:
    """What the scripted engine answers an embedding request with: 8 values made from the prompt,
    cut and normalised as the request asks (as the model runner does)."""
    vector = [float(len(prompt)), float(sum(prompt) % 97), 1.0, -2.0, 0.5, float(prompt[0]), float(prompt[-1]), 3.0]
    vector = vector[:params.embed_dimensions] if params.embed_dimensions else vector
    norm = sum(v * v for v in vector) ** 0.5 if params.embed_normalize else 1.0
    return [v / norm for v in vector]


def _joined(outputs: list[EngineCoreOutput]) -> EngineCoreOutput:
    """One output carrying the tokens (and logprobs) of several."""
    first, last = outputs[0], outputs[-1]
    logprobs = None
    if first.new_logprobs is not None:
        logprobs = LogprobsEntry([v for o in outputs for v in o.new_logprobs.sampled_logprobs],
                                 [t for o in outputs for t in o.new_logprobs.top_logprobs])
    return EngineCoreOutput(first.request_id, [t for o in outputs for t in o.new_token_ids], last.finish_reason,
                            last.stop_reason, logprobs, 0, first.new_prompt_logprobs)


def _app(script: Callable[[EngineCoreRequest], list[int]] = lambda _: TOKENIZER.encode(TEXT),
         tokenizer=TOKENIZER, prompt_tokens_details: bool = False, stream_interval: int = 1, hidden_size: int = 0,
         pooling: dict | None = None, trust_request_chat_template: bool = False, handle: object = None,
         settings: dict | None = None, metrics: RouterMetrics | None = None, policy: RoutingPolicy | None = None,
         **engine) -> tuple[TestClient, ScriptedEngine]:
    """An app on one scripted engine; ``handle`` stands for the engine actor (health probes);
    ``settings``: more ServingSettings fields."""
    client = EngineClient([handle or object()], client_index=1)
    scripted = client._slots[0].channel = ScriptedEngine(client, script, **engine)
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256,
                                            enable_prompt_tokens_details=prompt_tokens_details,
                                            stream_interval=stream_interval, hidden_size=hidden_size,
                                            pooling=PoolingInfo(**(pooling or {})),
                                            trust_request_chat_template=trust_request_chat_template,
                                            **(settings or {})),
                            client, tokenizer, policy or RoundRobinPolicy(), metrics)
    return TestClient(create_app(serving)), scripted


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20}, "min_tokens"),  # the default max_tokens is 16
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [len(TOKENIZER)]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "priority": 2**63}, "priority"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # only with echo
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(len(TOKENIZER)): 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-1": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [len(TOKENIZER)]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["fox", "  "]}, "bad_words"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": "s"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": [1]}},
     "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("/detokenize", {"tokens": [len(TOKENIZER)]}, "tokens"),
    ("/tokenize", {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(a"}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}, "guided_choice": ["a"]},
     "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "ignore_eos": True}, "guided_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
])
def test_refused_fields_name_their_parameter(path, body, param):
    http, engine = _app(tokenizer=CHAT_TOKENIZER)
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert param != "messages" or "model 'tiny' does not take images" in r.json()["error"]["message"]
    assert "max_completion_tokens" not in body or "max_completion_tokens" in r.json()["error"]["message"]
    assert not engine.requests  # nothing reached the engine


def test_null_optional_fields_take_their_defaults():
    http, engine = _app()
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": None, "top_p": None, "n": None,
        "presence_penalty": None, "frequency_penalty": None, "stream": None, "seed": None, "stop": None,
        "logprobs": None, "echo": None, "user": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 3
    params = engine.requests[0].sampling_params
    assert (params.temperature, params.top_p, params.presence_penalty, params.seed) == (1.0, 1.0, 0.0, None)
    # Required fields stay required.
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": None}).status_code == 400
    # Completions' max_tokens: left out, OpenAI's 16; null (the openai client's max_tokens=None), up to
    # the context's end, as vLLM reads it.
    prompt_len = len(TOKENIZER.encode("hi"))
    for body, max_tokens in (({}, 16), ({"max_tokens": None}, 256 - prompt_len)):
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **body}).status_code == 200
        assert engine.requests[-1].sampling_params.max_tokens == max_tokens


def test_accepted_forms_of_response_format_and_tools():
    http, engine = _app()
    for extra in ({"response_format": {"type": "text"}}, {"tools": [{"type": "function"}], "tool_choice": "none"}):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra})
        assert r.status_code == 200, r.text
    assert all(req.sampling_params.structured_output is None for req in engine.requests)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("fields", "spec"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[ab]+"}}, {"regex": "[ab]+"}),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, {"grammar": 'root ::= "x"'}),
    # A dumped vLLM StructuredOutputsParams: nulls and other backends' options do not count.
    ({"structured_outputs": {"choice": ["a", "b"], "regex": None, "json": None, "disable_fallback": False,
                             "whitespace_pattern": None, "disable_any_whitespace": True}},
     {"choice": ["a", "b"], "disable_any_whitespace": True}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
])
def test_output_constraints_reach_the_engine_in_one_form(fields, spec):
    http, engine = _app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling_params.structured_output == spec


def test_bare_strings_and_openais_other_text_parts_are_message_text():
    http, engine = _chat_app()
    content = ["Hi", {"type": "input_text", "text": "there"}, {"type": "refusal", "refusal": "no"},
               {"type": "text", "text": ""}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": content}],
                                                "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert CHAT_TOKENIZER.decode(engine.requests[-1].prompt_token_ids) == "user: Hi\nthere\nno\n"


def test_text_parts_of_a_message_are_joined_by_newlines():
    message = ChatMessage(role="user", content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])
    assert message.text() == "Hello\nworld"


def test_seeds_of_several_choices_stay_in_64_bits():
    http, engine = _app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2,
                                           "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    assert sorted(req.sampling_params.seed for req in engine.requests) == [-2**63, 2**63 - 1]


def test_seed_minus_one_means_no_seed_for_every_choice():
    """vLLM reads -1 as "no seed" (clients offering a random seed send it): every regenerate and
    every choice samples afresh; before, all got one fixed stream (and choice 1 the seed 0)."""
    http, engine = _app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2, "seed": -1})
    assert r.status_code == 200, r.text
    assert [req.sampling_params.seed for req in engine.requests] == [None, None]
    engine.requests.clear()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2, "seed": -2})
    assert sorted(req.sampling_params.seed for req in engine.requests) == [-2, -1]  # (choice 1 stays seeded)


@pytest.mark.parametrize(("fields", "defaults", "status"), [
    ({"temperature": 0}, {}, 400),
    ({}, {"temperature": 0.0}, 400),  # (the model's default temperature counts as the request's)
    ({"temperature": 0, "use_beam_search": True}, {}, 200),  # (n is the beam width)
    ({"temperature": 0.5}, {"temperature": 0.0}, 200),
])
def test_greedy_sampling_takes_one_choice_only(fields, defaults, status):
    http, _ = _app(settings={"default_sampling_params": defaults})
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2, **fields})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "n" and "greedy" in r.json()["error"]["message"]


@pytest.mark.parametrize(("penalty", "status"), [(12.0, 200), (0.0, 400), ("inf", 400)])
def test_repetition_penalty_is_any_finite_positive_value(penalty, status):
    http, _ = _app()
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).replace(
        "}", f', "repetition_penalty": {"Infinity" if penalty == "inf" else penalty}}}')
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_count_only_after_min_tokens(stream):
    http, _ = _app()
    comma = len(TOKENIZER.encode("Hello world,"))

    def text(body: dict) -> str:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 40, "stream": stream,
                                               "stop": [","], **body})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["text"]
        import json
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                       if line.startswith("data: {"))

    assert text({}) == "Hello world"
    assert text({"min_tokens": comma - 1}) == "Hello world"  # the comma is the token after min_tokens
    # While min_tokens are not yet generated a stop string does not count, nor later in that text.
    assert text({"min_tokens": comma}) == "Hello world, the quick brown fox"


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_after_a_stop_string_in_the_same_output_are_not_counted(stream):
    """All outputs queued at once reach the reader as one batch, as several tokens per pass do with
    speculative decoding: the stop string ends the answer inside it, and the usage and logprobs end there."""
    http, _ = _app(tokens_per_output=5, spaced=True)
    through_comma = len(TOKENIZER.encode("Hello world,"))
    assert through_comma % 5, "the comma must not end an output"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 40, "stream": stream,
                                           "stop": [","], "logprobs": 0, "stream_options": {"include_usage": True}
                                           if stream else None})
    assert r.status_code == 200, r.text
    if stream:
        events = _events(r.text)
        tokens = [t for e in events if e["choices"] for t in e["choices"][0]["logprobs"]["tokens"]]
        usage = events[-1]["usage"]
    else:
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        usage = r.json()["usage"]
    assert usage["completion_tokens"] == through_comma
    assert len(tokens) == through_comma


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ended_a_choice_is_not_in_its_text(include):
    comma = TOKENIZER.encode(",")[0]
    ids = TOKENIZER.encode("Hello world,")
    assert ids[-1] == comma
    http, _ = _app(lambda _: ids, finish=FinishReason.STOP, stop_reason=comma)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 10,
                                           "stop_token_ids": [comma], "include_stop_str_in_output": include})
    choice = r.json()["choices"][0]
    assert choice["text"] == ("Hello world," if include else "Hello world")
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", comma)
    assert r.json()["usage"]["completion_tokens"] == len(ids)  # the stop token still counts


def _events(text: str) -> list[dict]:
    import json
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs_only(stream):
    http, engine = _app()
    prompt = "Paris is the capital"
    ids = TOKENIZER.encode(prompt)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True,
                                           "logprobs": 0, "stream": stream,
                                           "stream_options": {"include_usage": True} if stream else None})
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling_params.prompt_logprobs == 0
    assert engine.requests[0].sampling_params.max_tokens == 1  # one token, dropped
    if stream:
        events = _events(r.text)
        first, usage = events[0]["choices"][0], events[-1]["usage"]
        assert first["text"] == prompt and [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, "length"]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == prompt
        logprobs = first["logprobs"]
    else:
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
    assert usage["completion_tokens"] == 0
    assert logprobs["tokens"] == [TOKENIZER.decode([t]) for t in ids]
    assert logprobs["token_logprobs"] == [None] + [-p / 10 for p in range(1, len(ids))]
    assert logprobs["text_offset"][0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token_and_the_asked_alternatives(stream):
    """OpenAI's "up to logprobs+1" (vLLM's too): the sampled token is named even when it is not among
    the most likely; logprobs=0 names it alone; echoed prompt rows are cut to logprobs even when
    prompt_logprobs asked the engine for more."""
    http, engine = _app()
    engine._logprobs = lambda token, k: LogprobsEntry([-2.0], [[(token + 1, -0.25), (token + 2, -0.5)][:k]])
    engine.prompt_alternatives = 3
    prompt, text = "Paris is", TOKENIZER.decode

    def logprobs_of(body: dict) -> dict:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "stream": stream,
                                               **body})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["logprobs"]
        parts = [e["choices"][0]["logprobs"] for e in _events(r.text) if e["choices"][0]["logprobs"]]
        return {key: [v for part in parts for v in part[key]] for key in ("tokens", "top_logprobs")}

    answer = TOKENIZER.encode(TEXT)[:3]
    assert logprobs_of({"logprobs": 1})["top_logprobs"] == [{text([t]): -2.0, text([t + 1]): -0.25} for t in answer]
    assert logprobs_of({"logprobs": 0})["top_logprobs"] == [{text([t]): -2.0} for t in answer]
    if not stream:  # (prompt_logprobs are not streamed)
        echoed = logprobs_of({"logprobs": 1, "echo": True, "prompt_logprobs": 3})
        prompt_ids = TOKENIZER.encode(prompt)
        assert echoed["top_logprobs"][0] is None
        assert echoed["top_logprobs"][1:len(prompt_ids)] == [{text([t]): -p / 10, text([0]): -5.0}
                                                             for p, t in enumerate(prompt_ids[1:], 1)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forbidden_tokens_logprob_is_vllms_floor_not_an_unencodable_minus_infinity(stream):
    """A grammar (or allowed_token_ids) leaves forbidden tokens at -inf among the alternatives: the
    answer carries -9999.0 for them, as vLLM's, so it stays JSON."""
    http, engine = _chat_app()
    engine._logprobs = lambda token, k: LogprobsEntry([-0.5], [[(token, -0.5), (token + 1, float("-inf"))][:k]])
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                "logprobs": True, "top_logprobs": 2, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        rows = [t for e in _events(r.text) if e["choices"] and e["choices"][0]["logprobs"]
                for t in e["choices"][0]["logprobs"]["content"]]
    else:
        rows = r.json()["choices"][0]["logprobs"]["content"]
    assert rows and all([alt["logprob"] for alt in row["top_logprobs"]] == [-0.5, -9999.0] for row in rows)
    completion = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 2})
    assert completion.status_code == 200 and sorted(completion.json()["choices"][0]["logprobs"]["top_logprobs"][0]
                                                    .values()) == [-9999.0, -0.5]


def test_streamed_echo_with_logprobs_sends_the_prompt_then_continues_the_offsets():
    http, _ = _app()
    prompt = "Paris is"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "echo": True,
                                           "logprobs": 0, "stream": True})
    events = [e["choices"][0] for e in _events(r.text)]
    assert events[0]["text"] == prompt and events[0]["logprobs"]["token_logprobs"][0] is None
    offsets = [o for e in events for o in e["logprobs"]["text_offset"]]
    tokens = [t for e in events for t in e["logprobs"]["tokens"]]
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    assert "".join(e["text"] for e in events) == prompt + "".join(tokens[len(TOKENIZER.encode(prompt)):])


def test_several_prompts_stream_their_choices_by_index():
    http, engine = _app(lambda request: request.prompt_token_ids[::-1])  # each answer is its prompt reversed
    prompts = ["Paris is", "the quick brown"]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 10,
                                           "stream": True, "echo": True})
    assert r.status_code == 200, r.text
    texts: dict[int, str] = {}
    for event in _events(r.text):
        choice = event["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    for index in range(4):
        ids = TOKENIZER.encode(prompts[index // 2])
        assert texts[index] == prompts[index // 2] + TOKENIZER.decode(ids[::-1])
    assert len(engine.requests) == 4


def test_skip_special_tokens_false_keeps_them_in_the_text():
    eos = TOKENIZER.eos_token_id
    http, _ = _app(lambda _: [*TOKENIZER.encode("Hello"), eos, *TOKENIZER.encode(" world")])
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == "Hello world"
    kept = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    assert kept == "Hello<eos> world"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_count_each_choices_tokens_so_far(path):
    chat_tokenizer = byte_level_tokenizer.__wrapped__()  # its own copy, with a chat template
    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    http, _ = _app(lambda request: TOKENIZER.encode(TEXT)[:6], tokenizer=chat_tokenizer, spaced=True)
    prompt = {"prompt": "Paris is"} if path == "/v1/completions" else {"messages": MESSAGES}
    body = {"model": "tiny", **prompt, "n": 2, "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(http.post(path, json=body).text)
    final = events[-1]["usage"]
    assert events[-1]["choices"] == [] and final["completion_tokens"] == 12
    prompt_tokens = final["prompt_tokens"]
    seen: dict[int, int] = {}
    for event in events[:-1]:
        usage, index = event["usage"], event["choices"][0]["index"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen.get(index, 0)
        seen[index] = usage["completion_tokens"]
    assert seen == {0: 6, 1: 6}
    assert len(events) > 12  # (one chunk per token and choice: the counts grew chunk by chunk)
    # Without it (include_usage alone) only the last chunk has usage.
    body["stream_options"] = {"include_usage": True}
    assert all(e["usage"] is None for e in _events(http.post(path, json=body).text)[:-1])
    # vLLM's defaults: stream_options given means include_usage unless it is false (or null).
    body["stream_options"] = {"continuous_usage_stats": True}
    alone = _events(http.post(path, json=body).text)
    assert alone[-1]["choices"] == [] and alone[-1]["usage"] == final
    assert all(e["usage"] is not None for e in alone)
    for options in ({"include_usage": False, "continuous_usage_stats": True}, {"include_usage": None}):
        body["stream_options"] = options
        assert all(e["usage"] is None for e in _events(http.post(path, json=body).text))
    body["stream_options"] = {}
    assert [e["usage"] is None for e in _events(http.post(path, json=body).text)][-2:] == [True, False]
    if path == "/v1/completions":  # (the echoed prompt's chunks count it too, before any token)
        body["stream_options"] = {"continuous_usage_stats": True}
        for extra in ({"echo": True}, {"echo": True, "max_tokens": 0}, {"echo": True, "logprobs": 0}):
            echoed = _events(http.post(path, json={**body, **extra}).text)
            assert all(e["usage"]["prompt_tokens"] == prompt_tokens for e in echoed), extra
            assert echoed[0]["usage"]["completion_tokens"] == 0


def test_the_prompts_of_one_request_see_each_others_load_when_routed():
    from router.routing import PrefixAwarePolicy

    client = EngineClient([object(), object()], client_index=1)
    engines = []
    for slot in range(2):
        engines.append(ScriptedEngine(client, lambda _: TOKENIZER.encode("x"), slot=slot))
        client._slots[slot].channel = engines[-1]
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256), client, TOKENIZER,
                            PrefixAwarePolicy(2, block_size=4, load_margin=2, seed=0))
    shared = list(range(10, 26))  # four full blocks every prompt shares
    r = TestClient(create_app(serving)).post("/v1/completions", json={
        "model": "tiny", "prompt": [shared + [i] for i in range(20)], "max_tokens": 1})
    assert r.status_code == 200, r.text
    counts = sorted(len(engine.requests) for engine in engines)
    # The shared prefix pulls them together only up to the load margin: not all 20 on one engine.
    assert sum(counts) == 20 and counts[0] >= 8, counts


def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_engine_as_token_ids():
    http, engine = _app()
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "logit_bias": {"17": 250, "3": -1.5},
        "allowed_token_ids": [3, 17, 40], "bad_words": [" fox", "quick brown"]})
    assert r.status_code == 200, r.text
    params = engine.requests[0].sampling_params
    assert params.logit_bias == {17: 100.0, 3: -1.5}  # clamped to [-100, 100], as vLLM does
    assert params.allowed_token_ids == [3, 17, 40]
    # Each word as at the start of the text, and after a space when that tokenises differently.
    expected = []
    for word in ("fox", "quick brown"):
        alone, spaced = TOKENIZER.encode(word), TOKENIZER.encode(" " + word)
        expected.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            expected.append(spaced)
    assert params.bad_words_token_ids == expected
    assert len(expected) == 3  # (" quick brown" tokenises differently, " fox" into fewer tokens)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_xargs_reach_the_engine_as_extra_args_for_its_logits_processors(path):
    http, engine = _app(tokenizer=CHAT_TOKENIZER)
    body = {"model": "tiny", "max_tokens": 2, "n": 2,
            **({"prompt": "hi"} if "chat" not in path else {"messages": MESSAGES})}
    xargs = {"target_token": 7, "scale": 0.5, "name": "x", "ids": [1, "two", 3.0]}
    r = http.post(path, json={**body, "vllm_xargs": xargs})
    assert r.status_code == 200, r.text
    assert [q.sampling_params.extra_args for q in engine.requests] == [xargs, xargs]
    assert type(engine.requests[0].sampling_params.extra_args["target_token"]) is int
    http.post(path, json=body)
    assert engine.requests[-1].sampling_params.extra_args is None
    r = http.post(path, json={**body, "vllm_xargs": {"nested": {"a": 1}}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("vllm_xargs"), r.text


def test_unknown_fields_are_ignored_with_one_warning_each(caplog, monkeypatch):
    from router import protocol

    monkeypatch.setattr(protocol, "_warned_fields", set())
    http, engine = _app()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "max_token": 50, "service_tier": "auto"}
    with caplog.at_level("WARNING", logger="router.protocol"):
        for _ in range(3):
            assert http.post("/v1/completions", json=body).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignoring request field" in r.getMessage()]
    assert warnings == ["CompletionRequest: ignoring request field(s) this server does not support: "
                        "'max_token', 'service_tier'"]
    assert all(req.sampling_params.max_tokens == 2 for req in engine.requests)
    # The names are the client's: a bounded number is remembered, each quoted and shortened.
    for i in range(300):
        http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1, f"x{i}\nforged": 1,
                                           "y" * 500: 1})
    assert len(protocol._warned_fields) == protocol._MAX_WARNED_FIELDS
    assert all("\n" not in r.getMessage() and len(r.getMessage()) < 400 for r in caplog.records)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens():
    chat_tokenizer = byte_level_tokenizer.__wrapped__()  # its own copy, with a chat template
    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    http, engine = _app(tokenizer=chat_tokenizer)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 2,
                                           "truncate_prompt_tokens": 3, "echo": True})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == [7, 8, 9]
    assert r.json()["usage"]["prompt_tokens"] == 3
    assert r.json()["choices"][0]["text"].startswith(chat_tokenizer.decode([7, 8, 9]))
    # Chat: the rendered conversation's last tokens.
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                "truncate_prompt_tokens": 4})
    assert r.status_code == 200, r.text
    whole = chat_tokenizer.encode("user: hi\n", add_special_tokens=False)
    assert engine.requests[-1].prompt_token_ids == whole[-4:] and r.json()["usage"]["prompt_tokens"] == 4
    # -1: as many as max_model_len (256 here), so a short prompt is whole.
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                                           "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and engine.requests[-1].prompt_token_ids == [5, 6, 7]
    for bad in (0, 257, -2):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(stream):
    chat_tokenizer = byte_level_tokenizer.__wrapped__()  # its own copy, with a chat template
    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    ids = chat_tokenizer.encode("Hello world")
    http, _ = _app(lambda _: ids, tokenizer=chat_tokenizer, spaced=True)
    names = [f"token_id:{t}" for t in ids]
    body = {"model": "tiny", "max_tokens": len(ids), "stream": stream, "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json={**body, "prompt": "hi", "logprobs": 0})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [e["choices"][0] for e in _events(r.text) if e["choices"]]
        tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        text = "".join(c["text"] for c in chunks)
    else:
        choice = r.json()["choices"][0]
        tokens, offsets, text = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"], choice["text"]
    assert tokens == names and text == "Hello world"
    # Offsets still follow the text.
    assert offsets == [len(chat_tokenizer.decode(ids[:i])) for i in range(len(ids))]
    r = http.post("/v1/chat/completions", json={**body, "messages": MESSAGES, "logprobs": True})
    assert r.status_code == 200, r.text
    if stream:
        content = [t for e in _events(r.text) if e["choices"] and e["choices"][0]["logprobs"]
                   for t in e["choices"][0]["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in content] == names
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)


def test_prompt_tokens_details_report_the_prefix_cache_hits_when_enabled():
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, per prompt (its n
    choices share one prompt), whole and in the streamed usage chunk; off, the field is null. (Chat
    builds its usage the same way; test_e2e checks it on real engines.)"""
    http, _ = _app(prompt_tokens_details=True, num_cached_tokens=8)
    body = {"model": "tiny", "prompt": ["one prompt", "another"], "n": 2, "max_tokens": 3}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}  # 8 for each of the two prompts
    one = http.post("/v1/completions", json={**body, "prompt": "one prompt", "n": 3}).json()
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    off, _ = _app(num_cached_tokens=8)
    assert off.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"] is None


# A model whose generation_config.json recommends its own sampling (as Qwen's and Llama 3's do).
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def _chat_app(defaults: dict | None = None, **settings) -> tuple[TestClient, ScriptedEngine]:
    return _app(tokenizer=CHAT_TOKENIZER, settings={"default_sampling_params": defaults or {}, **settings})


def _sampled(params: SamplingParams) -> dict[str, float]:
    return {name: getattr(params, name) for name in MODEL_DEFAULTS}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 3}),
])
def test_unset_sampling_parameters_take_the_models_defaults(path, body):
    """vLLM's --generation-config auto: a parameter the request leaves unset (or null) gets the model's
    value; one it sets keeps its own, on every generation API."""
    http, engine = _chat_app(MODEL_DEFAULTS)
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    assert _sampled(engine.requests[-1].sampling_params) == MODEL_DEFAULTS
    if path == "/v1/responses":  # the response repeats what it ran with
        assert (r.json()["temperature"], r.json()["top_p"]) == (0.6, 0.9)
    own = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    # (null is unset: min_p where the API has it, Anthropic's top_p where it has no min_p)
    null = {"min_p": None} if path != "/v1/messages" else {}
    r = http.post(path, json={"model": "tiny", **body, **own, **null})
    assert r.status_code == 200, r.text
    assert _sampled(engine.requests[-1].sampling_params) == {**MODEL_DEFAULTS, **own}
    if path == "/v1/responses":
        assert (r.json()["temperature"], r.json()["top_p"]) == (0.0, 1.0)


def test_without_model_defaults_unset_parameters_are_neutral():
    http, engine = _chat_app()
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}).status_code == 200
    assert _sampled(engine.requests[0].sampling_params) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                            "min_p": 0.0, "repetition_penalty": 1.0}
    # With no max_tokens, a chat answer may fill the context.
    assert engine.requests[0].sampling_params.max_tokens == 256 - len(engine.requests[0].prompt_token_ids)


def test_the_generation_configs_max_new_tokens_caps_max_tokens():
    """Its max_new_tokens is vLLM's default max_tokens and caps a larger one (the least of the
    request's, the model's and the room left in the context)."""
    http, engine = _chat_app({"max_tokens": 5})

    def max_tokens(path: str, **fields) -> int:
        body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
        r = http.post(path, json={"model": "tiny", **body, **fields})
        assert r.status_code == 200, r.text
        return engine.requests[-1].sampling_params.max_tokens

    assert max_tokens("/v1/chat/completions") == 5
    assert max_tokens("/v1/chat/completions", max_completion_tokens=100) == 5
    assert max_tokens("/v1/chat/completions", max_tokens=3) == 3
    assert max_tokens("/v1/completions") == 5  # (its own default is 16)
    # A request beyond the context is still refused; min_tokens above the cap names itself.
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 10, "min_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert "largest max_tokens, 5 (its generation config's max_new_tokens)" in r.json()["error"]["message"]


def test_logprobs_are_bounded_by_the_servers_max_logprobs():
    """vLLM's --max-logprobs (default 20): more is a 400 naming the field; -1 asks for the whole
    vocabulary, which the engine then receives as a count."""
    vocab = len(TOKENIZER)

    def sent(http, engine, path: str, **fields):
        body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
        r = http.post(path, json={"model": "tiny", **body, "max_tokens": 2, **fields})
        return r, (engine.requests[-1].sampling_params if r.status_code == 200 else None)

    http, engine = _chat_app()
    r, params = sent(http, engine, "/v1/completions", logprobs=20, prompt_logprobs=20)
    assert r.status_code == 200 and (params.logprobs, params.prompt_logprobs) == (20, 20)
    for path, fields, param in (("/v1/completions", {"logprobs": 21}, "logprobs"),
                                ("/v1/completions", {"logprobs": -1}, "logprobs"),
                                ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
                                ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs")):
        r, _ = sent(http, engine, path, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
        assert "which is greater than max allowed: 20" in r.json()["error"]["message"]
    assert sent(http, engine, "/v1/completions", logprobs=-2)[0].status_code == 400
    # A server that allows the whole vocabulary (--max-logprobs -1 arrives as the vocabulary's size).
    http, engine = _chat_app(max_logprobs=vocab, vocab_size=vocab)
    r, params = sent(http, engine, "/v1/completions", logprobs=-1, echo=True)
    assert r.status_code == 200 and params.logprobs == vocab
    r, params = sent(http, engine, "/v1/chat/completions", logprobs=True, top_logprobs=-1, prompt_logprobs=30)
    assert r.status_code == 200 and (params.logprobs, params.prompt_logprobs) == (vocab, 30)
    assert sent(http, engine, "/v1/completions", logprobs=vocab + 1)[0].status_code == 400


def test_a_request_the_engine_refuses_is_a_400_and_the_engine_keeps_serving():
    """When the engine refuses what a request asks (its flags differ from what the router knew, say),
    the client gets the engine's reason as a 400, and the engine stays in routing."""
    from engine_core.channel import Accepted

    http, engine = _chat_app()

    def refuse(request: EngineCoreRequest) -> None:
        engine.client._on_message(engine.client._slots[0], Accepted(
            request.request_id, "Requested sample logprobs of 5, which is greater than max allowed: 4", refused=True))

    answer, engine._answer = engine._answer, refuse
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 5})
    assert r.status_code == 400 and "greater than max allowed: 4" in r.json()["error"]["message"]
    assert engine.client.healthy() == [True]
    engine._answer = answer
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_server_default_chat_template_kwargs_sit_under_the_requests_own():
    """--default-chat-template-kwargs (vLLM's): every render gets them (chat, /tokenize, Anthropic's
    Messages), and a request's own chat_template_kwargs win."""
    tokenizer = byte_level_tokenizer.__wrapped__()  # its own copy: the template is set on it
    tokenizer.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}[nothink]{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    http, engine = _app(tokenizer=tokenizer, settings={"default_chat_template_kwargs": {"enable_thinking": False}})

    def prompt() -> str:
        return tokenizer.decode(engine.requests[-1].prompt_token_ids)

    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}).is_success
    assert prompt() == "[nothink]hi"
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                   "chat_template_kwargs": {"enable_thinking": True}}).is_success
    assert prompt() == "hi"
    tokens = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()["tokens"]
    assert tokenizer.decode(tokens) == "[nothink]hi"
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert http.post("/v1/messages", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                           "thinking": thinking}).is_success
    assert prompt() == "hi"  # (Anthropic's thinking sets enable_thinking)


def test_enable_log_requests_logs_each_engine_requests_parameters_and_its_prompt_at_debug(caplog):
    """As vLLM's RequestLogger: the parameters and adapter at INFO (each engine request: a choice
    each), the prompt and its token ids (cut to --max-log-len) only at DEBUG."""
    http, _ = _chat_app(enable_log_requests=True, max_log_len=4)
    with caplog.at_level(logging.INFO, logger="router.serving"):
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 2,
                                                  "n": 2}).is_success
    lines = [r.getMessage() for r in caplog.records]
    received = [line for line in lines if line.startswith("Received request cmpl-")]
    assert len(received) == 2 and "params: SamplingParams(max_tokens=2" in received[0]
    assert "lora_request: None." in received[0] and not any("Hell" in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="router.serving"):
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 2}).is_success
    details = [r.getMessage() for r in caplog.records if " details: " in r.getMessage()]
    assert len(details) == 1 and "prompt: 'Hell'" in details[0]
    assert f"prompt_token_ids: {TOKENIZER.encode('Hello there')[:4]}" in details[0]
    caplog.clear()
    quiet, _ = _chat_app()
    with caplog.at_level(logging.DEBUG, logger="router.serving"):
        assert quiet.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}).is_success
    assert "Received request" not in caplog.text


def test_enable_log_outputs_logs_each_finished_choice(caplog):
    """vLLM's --enable-log-outputs: once a choice has finished, its text, token ids (cut to
    --max-log-len) and finish reason, whole or streamed."""
    http, _ = _chat_app(enable_log_outputs=True, max_log_len=5)
    for stream in (False, True):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="router.serving"):
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 8, "n": 2,
                                                   "stream": stream})
            assert r.status_code == 200
        lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("Generated response")]
        assert len(lines) == 2, lines
        expected = f"output: {TEXT[:5]!r}, output_token_ids: {TOKENIZER.encode(TEXT)[:5]}, finish_reason: length"
        assert expected in lines[0]
    quiet, _ = _chat_app()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="router.serving"):
        assert quiet.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}).is_success
    assert "Generated response" not in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_each_prompts_ids_and_each_choices_generated_ids(stream):
    """vLLM's return_token_ids on completions: each choice carries its prompt's ids (streamed: in
    its first chunk only) and the ids it generated (streamed: each chunk its own, adding up)."""
    http, engine = _app(spaced=True)
    prompts = ["Paris is", "Rome is the capital"]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 6,
                                           "return_token_ids": True, "stream": stream})
    assert r.status_code == 200, r.text
    generated = TOKENIZER.encode(TEXT)[:6]
    if stream:
        chunks = [e["choices"][0] for e in _events(r.text) if e["choices"]]
        by_choice = {i: [c for c in chunks if c["index"] == i] for i in range(4)}
        for index, own in by_choice.items():
            assert [c.get("prompt_token_ids") for c in own if c.get("prompt_token_ids")] == \
                [TOKENIZER.encode(prompts[index // 2])]
            assert own[0].get("prompt_token_ids")  # in the choice's first chunk
            assert [t for c in own for t in c["token_ids"]] == generated
            assert sum(1 for c in own if c["token_ids"]) > 1  # the ids came in pieces, as the text
    else:
        choices = r.json()["choices"]
        assert [c["prompt_token_ids"] for c in choices] == [TOKENIZER.encode(p) for p in prompts for _ in range(2)]
        assert all(c["token_ids"] == generated for c in choices)
    assert sorted(map(tuple, (q.prompt_token_ids for q in engine.requests))) == sorted(
        tuple(TOKENIZER.encode(p)) for p in prompts for _ in range(2))


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_in_chat_puts_the_prompt_ids_at_the_top(stream):
    http, engine = _app(tokenizer=CHAT_TOKENIZER, spaced=True)
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "n": 2, "max_tokens": 5,
                                                "return_token_ids": True, "stream": stream})
    assert r.status_code == 200, r.text
    prompt, generated = engine.requests[0].prompt_token_ids, TOKENIZER.encode(TEXT)[:5]
    if stream:
        events = _events(r.text)
        openings = [e for e in events if e["choices"][0]["delta"].get("role")]
        assert [e["prompt_token_ids"] for e in openings] == [prompt, prompt]
        assert all("prompt_token_ids" not in e for e in events if e not in openings)
        for index in range(2):
            assert [t for e in events if e["choices"][0]["index"] == index
                    for t in e["choices"][0].get("token_ids") or ()] == generated
    else:
        body = r.json()
        assert body["prompt_token_ids"] == prompt
        assert [c["token_ids"] for c in body["choices"]] == [generated, generated]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_without_return_token_ids_no_ids_are_returned(path):
    http, _ = _app(tokenizer=CHAT_TOKENIZER)
    body = {"model": "tiny", "max_tokens": 3, **({"prompt": "hi"} if "chat" not in path else {"messages": MESSAGES})}
    # Not even as nulls: plain answers and chunks are as they were before these fields existed.
    for echo in ([{"echo": True, "max_tokens": 0}] if "chat" not in path else []) + [{}]:
        whole = http.post(path, json={**body, **echo}).json()
        assert "prompt_token_ids" not in whole
        assert all("token_ids" not in c and "prompt_token_ids" not in c for c in whole["choices"])
        events = _events(http.post(path, json={**body, **echo, "stream": True}).text)
        assert events and all("prompt_token_ids" not in e and "token_ids" not in e["choices"][0] for e in events)


def test_streamed_token_ids_end_where_a_stop_string_ends_the_text():
    """Tokens after a stop string in the same output are not part of the answer: nor of its ids."""
    http, _ = _app(tokens_per_output=5, spaced=True)
    through_comma = TOKENIZER.encode("Hello world,")
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 40, "stop": [","],
                                               "return_token_ids": True, "stream": stream})
        if stream:
            ids = [t for e in _events(r.text) for t in e["choices"][0]["token_ids"]]
        else:
            ids = r.json()["choices"][0]["token_ids"]
        assert ids == through_comma


def test_streamed_echo_only_sends_the_prompt_ids_with_the_echo_and_no_generated_ids():
    http, _ = _app()
    prompt = "Paris is the capital"
    for logprobs in (None, 0):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 0, "echo": True,
                                               "logprobs": logprobs, "return_token_ids": True, "stream": True})
        chunks = [e["choices"][0] for e in _events(r.text)]
        assert chunks[0]["text"] == prompt and chunks[0]["prompt_token_ids"] == TOKENIZER.encode(prompt)
        assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in chunks[1:])
        assert all(c["token_ids"] == [] for c in chunks)


class SaltRecordingPolicy(RoundRobinPolicy):
    """Round robin that keeps the cache_salt each routing decision saw."""

    def __init__(self) -> None:
        super().__init__()
        self.salts: list[str | None] = []

    def choose(self, ctx: RoutingContext) -> int:
        self.salts.append(ctx.cache_salt)
        return super().choose(ctx)


SALTED_BODIES = {
    "/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": MESSAGES},
    "/v1/responses": {"input": "hi"}, "/v1/embeddings": {"input": ["hi", "Paris"]}, "/pooling": {"input": "hi"},
    "/score": {"text_1": "hi", "text_2": ["Paris", "Rome"]}, "/rerank": {"query": "hi", "documents": ["Paris"]}}


@pytest.mark.parametrize("path", SALTED_BODIES)
def test_cache_salt_reaches_the_routing_policy_and_the_engine_and_an_empty_one_is_refused(path):
    policy = SaltRecordingPolicy()
    http, engine = _app(tokenizer=CHAT_TOKENIZER, policy=policy)
    body = {"model": "tiny", **SALTED_BODIES[path]}
    for salt in ("tenant-a", None):
        before = len(engine.requests)
        r = http.post(path, json={**body, "cache_salt": salt})
        assert r.status_code == 200, r.text
        assert len(engine.requests) > before
        assert {q.cache_salt for q in engine.requests[before:]} == {salt}
        assert set(policy.salts[before:]) == {salt}
    r = http.post(path, json={**body, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    assert "cache_salt" in r.json()["error"]["message"]


def test_streamed_token_ids_held_by_a_stream_interval_go_with_the_chunk_that_sends_their_text():
    http, _ = _app(spaced=True, stream_interval=3)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 10, "stream": True,
                                           "return_token_ids": True})
    chunks = [e["choices"][0] for e in _events(r.text)]
    assert [t for c in chunks for t in c["token_ids"]] == TOKENIZER.encode(TEXT)[:10]
    assert len(chunks) < 10 and all(len(TOKENIZER.decode(c["token_ids"])) == len(c["text"]) for c in chunks)


def test_model_may_be_left_out_and_n_goes_past_16():
    """vLLM serves the first model when a request names none; OpenAI takes up to 128 choices."""
    http, _ = _app()
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 20})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny" and len(r.json()["choices"]) == 20
    from .test_tool_calling import _app as _chat_app  # (a tokenizer with a chat template)

    chat = _chat_app("Hi.")[0].post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "tiny" and chat.json()["choices"][0]["message"]["content"] == "Hi."
    too_many = http.post("/v1/completions", json={"prompt": "hi", "n": 129})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_an_unexpected_failure_is_a_json_500_not_plain_text(monkeypatch):
    def broken(self, choice, output):
        raise RuntimeError("detokenizer broke")

    monkeypatch.setattr(OpenAIServing, "_apply_output", broken)  # (where outputs turn into text)
    client = TestClient(_app()[0].app, raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "detokenizer broke", "type": "InternalServerError",
                                        "param": None, "code": 500}


@pytest.mark.parametrize(("path", "prompt", "add", "bos_count"), [
    ("/v1/completions", "Paris", None, 1), ("/v1/completions", "Paris", False, 0),
    ("/v1/completions", "<s>Paris", False, 1), ("/v1/completions", "<s>Paris", True, 2),
    # (chat's template writes the BOS itself: the tokenizer adds one more only when asked)
    ("/v1/chat/completions", None, None, 1), ("/v1/chat/completions", None, True, 2)])
def test_special_tokens_are_added_as_asked_and_as_tokenize_counts_them(path, prompt, add, bos_count):
    tokenizer = bos_adding_tokenizer()
    http, engine = _app(tokenizer=tokenizer)
    given = {"prompt": prompt} if prompt is not None else {"messages": MESSAGES}
    fields = {**given, **({} if add is None else {"add_special_tokens": add})}
    r = http.post(path, json={"model": "tiny", "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    ids = engine.requests[-1].prompt_token_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<s>")) == bos_count
    assert http.post("/tokenize", json={"model": "tiny", **fields}).json()["tokens"] == ids


def test_prompt_and_stop_token_ids_may_reach_past_the_tokenizer_into_the_models_padded_vocabulary():
    http, engine = _app(settings={"vocab_size": len(TOKENIZER) + 8})
    padded = len(TOKENIZER) + 7
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, padded], "max_tokens": 1,
                                           "stop_token_ids": [padded]})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == [5, padded]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, padded + 1], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("stop", ["", ["end", ""]])
def test_an_empty_stop_string_is_refused(stop):
    http, _ = _app()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "stop": stop})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_prompt_logprobs_0_may_be_streamed_and_more_may_not():
    http, _ = _app()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    assert http.post("/v1/completions", json={**body, "prompt_logprobs": 0}).status_code == 200
    r = http.post("/v1/completions", json={**body, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs_also_fills_the_choices_prompt_logprobs_and_minus_infinity_is_the_floor():
    """vLLM's echo asks for the prompt's logprobs with the request's count (prompt_logprobs unset),
    and its choice carries them; a prompt token the model rules out (-inf) reads -9999.0, as output
    logprobs do, so the answer stays JSON."""
    http, engine = _app()
    engine.prompt_alternatives = 1
    real = engine._answer

    def answer_with_an_impossible_prompt_token(request):
        real(request)
        first = engine.client._queues[request.request_id]._items[0]
        first.new_prompt_logprobs.sampled_logprobs[0] = float("-inf")

    engine._answer = answer_with_an_impossible_prompt_token
    prompt = "Paris is the capital"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "echo": True,
                                           "logprobs": 1})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"]
    ids = TOKENIZER.encode(prompt)
    assert rows[0] is None and len(rows) == len(ids)
    assert rows[1][str(ids[1])]["logprob"] == -9999.0 and rows[2][str(ids[2])]["logprob"] == -0.2
    assert all(len(row) == 2 for row in rows[1:])  # the token and its best alternative
    plain = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "logprobs": 1})
    assert plain.json()["choices"][0]["prompt_logprobs"] is None  # (no echo: not asked for)


def test_a_long_prompt_is_tokenized_in_the_tokenizer_thread_with_the_same_tokens():
    http, engine = _app()
    prompt = TEXT * 160  # (past TOKENIZE_INLINE_CHARS, and more tokens than the model takes)
    expected = TOKENIZER.encode(prompt)
    assert http.post("/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"] == expected
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and str(len(expected)) in r.json()["error"]["message"]  # (counted right)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                           "truncate_prompt_tokens": 200})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].prompt_token_ids == expected[-200:]


def test_an_error_that_repeats_the_request_is_cut_to_a_bounded_length():
    http, _ = _app()
    r = http.post("/v1/completions", json={"model": "m" * 100_000, "prompt": "hi"})
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and message.endswith("… (cut)") and len(message) < 2100


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_engine_request_as_finished_and_a_client_that_leaves_does_not(stream):
    """The engine counts a request the router stopped on a stop string as finished (reason stop),
    as vLLM's front end does; an abandoned one stays an abort."""
    http, engine = _app(spaced=True)  # (outputs one by one: the stop string comes before the engine's end)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 30, "stop": ["fox"],
                                           "stream": stream})
    assert r.status_code == 200
    [rid] = [req.request_id for req in engine.requests]
    assert engine.aborted == [rid] and engine.stopped == [rid]
    # (with the tokens up to the stop's, for the engine's metrics; the engine had sent more)
    text = TOKENIZER.decode(TOKENIZER.encode(TEXT))
    kept = next(k for k in range(1, 31) if "fox" in TOKENIZER.decode(TOKENIZER.encode(TEXT)[:k]))
    assert "fox" in text and engine.kept_tokens == {rid: kept}
    if stream:  # a client that leaves mid-stream: a plain abort
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 30,
                                                          "stream": True}) as leaving:
            next(leaving.iter_lines())
        gone = engine.requests[-1].request_id
        for _ in range(100):
            if gone in engine.aborted:
                break
            time.sleep(0.01)
        assert gone in engine.aborted and gone not in engine.stopped


def test_each_requests_first_choice_carries_its_n_for_the_engines_metrics():
    chat_tokenizer = byte_level_tokenizer.__wrapped__()  # its own copy, with a chat template
    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    http, engine = _app(tokenizer=chat_tokenizer)
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": ["Paris", "Rome"], "n": 2,
                                              "max_tokens": 2}).status_code == 200
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "n": 3,
                                                   "max_tokens": 2}).status_code == 200
    assert [r.num_choices for r in engine.requests] == [2, 0, 2, 0, 3, 0, 0]
