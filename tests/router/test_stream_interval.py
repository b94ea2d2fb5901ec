"""--stream-interval: a streamed choice sends its first tokens at once, then one chunk per N new
tokens and its last; the answer, its logprobs and its usage are those of a stream of every step."""

from __future__ import annotations

import json

import pytest

from router.serving import ServingSettings

from .test_request_fields import TEXT, TOKENIZER, _app, _events
from .test_responses import HERMES_ANSWER, WEATHER_TOOL, _client
from .test_tool_calling import _app as _chat_app

NUM_TOKENS = len(TOKENIZER.encode(TEXT))


def _expected_sizes(num_tokens: int, interval: int, per_output: int = 1) -> list[int]:
    """Tokens per chunk when outputs of ``per_output`` tokens arrive one at a time: the first output
    goes at once, later ones wait until ``interval`` tokens have gathered, the last goes in any case."""
    sizes, held, first = [], 0, True
    outputs = [min(per_output, num_tokens - i) for i in range(0, num_tokens, per_output)]
    for i, n in enumerate(outputs):
        held += n
        if first or held >= interval or i == len(outputs) - 1:
            sizes.append(held)
            held, first = 0, False
    return sizes


def _completion_stream(interval: int, n: int = 1, **body) -> list[dict]:
    http, _ = _app(stream_interval=interval, spaced=True)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 100, "stream": True,
                                           "logprobs": 0, "n": n, "stream_options": {"include_usage": True},
                                           **body})
    assert r.status_code == 200, r.text
    return _events(r.text)


@pytest.mark.parametrize("interval", [1, 4, 7, NUM_TOKENS, 1000])
def test_chunks_gather_interval_tokens_after_the_first(interval):
    events = _completion_stream(interval)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    sizes = [len(c["logprobs"]["tokens"]) for c in chunks]
    assert sizes == _expected_sizes(NUM_TOKENS, interval)
    assert "".join(c["text"] for c in chunks) == TEXT
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    # The offsets run on through the merged chunks as through single tokens.
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) == NUM_TOKENS
    assert events[-1]["usage"]["completion_tokens"] == NUM_TOKENS


def test_several_tokens_per_output_count_as_tokens_not_outputs():
    # Speculative decoding brings several tokens in one output: the interval counts tokens.
    http, _ = _app(stream_interval=5, spaced=True, tokens_per_output=3)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 100, "stream": True,
                                           "logprobs": 0})
    chunks = [e["choices"][0] for e in _events(r.text)]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == _expected_sizes(NUM_TOKENS, 5, per_output=3)
    assert "".join(c["text"] for c in chunks) == TEXT


def test_each_of_n_choices_keeps_its_own_interval():
    events = _completion_stream(6, n=2)
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert [len(c["logprobs"]["tokens"]) for c in chunks] == _expected_sizes(NUM_TOKENS, 6)
        assert "".join(c["text"] for c in chunks) == TEXT
    assert events[-1]["usage"]["completion_tokens"] == 2 * NUM_TOKENS


def test_a_stop_string_inside_held_tokens_ends_the_text_there():
    events = _completion_stream(8, stop=[" fox"])
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == TEXT[:TEXT.index(" fox")]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == " fox"
    assert events[-1]["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in chunks)


@pytest.mark.parametrize("interval", [1, 8])
def test_a_streamed_chat_answer_names_the_stop_string_that_ended_it(interval):
    http, _, _ = _chat_app("The quick brown fox jumps.", stream_interval=interval)
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "stream": True, "stop": [" fox"]})
    chunks = [e["choices"][0] for e in _events(r.text) if e["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "The quick brown"
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == " fox"
    assert all(c["stop_reason"] is None for c in chunks[:-1])


def test_continuous_usage_counts_the_tokens_sent_so_far():
    events = _completion_stream(5, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [e for e in events if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in chunks]
    assert counts == [sum(sizes[:i + 1]) for i in range(len(sizes))]


def test_chat_tool_calls_stream_the_same_call_in_fewer_chunks():
    def stream(interval: int) -> list[dict]:
        http, _, _ = _chat_app(HERMES_ANSWER, parser="hermes", stream_interval=interval)
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "?"}],
                                                    "tools": [{"type": "function", "function": {
                                                        "name": "get_weather", "parameters": WEATHER_TOOL[
                                                            "parameters"]}}], "stream": True})
        assert r.status_code == 200, r.text
        return [e["choices"][0] for e in _events(r.text) if e["choices"]]

    def answer(chunks: list[dict]) -> tuple[str, str, str, list]:
        content = "".join(c["delta"].get("content") or "" for c in chunks)
        calls = [call for c in chunks for call in c["delta"].get("tool_calls") or []]
        name = "".join(call["function"].get("name") or "" for call in calls)
        arguments = "".join(call["function"].get("arguments") or "" for call in calls)
        return content, name, arguments, [c["finish_reason"] for c in chunks if c["finish_reason"]]

    every, gathered = stream(1), stream(8)
    assert answer(gathered) == answer(every)
    assert json.loads(answer(gathered)[2]) == {"city": "Rome"}
    assert len(gathered) < len(every) / 2


def test_the_responses_stream_gathers_its_deltas_too():
    def deltas(interval: int) -> list[str]:
        http, _, _ = _chat_app("Paris is the capital of France.", stream_interval=interval)
        with _client(http).responses.stream(model="tiny", input="Capital?") as stream:
            events = list(stream)
            assert stream.get_final_response().output_text == "Paris is the capital of France."
        return [e.delta for e in events if e.type == "response.output_text.delta"]

    every, gathered = deltas(1), deltas(10)
    assert "".join(gathered) == "".join(every) == "Paris is the capital of France."
    assert len(gathered) == len(_expected_sizes(len(every) + 1, 10))  # (+ the EOS, which has no text)


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        ServingSettings(served_model_name="tiny", max_model_len=64, stream_interval=0)
