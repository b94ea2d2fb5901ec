"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the app and
the official ``anthropic`` client, against a scripted engine: the conversation to the chat template,
content blocks (thinking, text, tool_use) whole and streamed, stop reasons, usage, token counts,
and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from engine_core.request import FinishReason
from router.app import create_app
from router.engine_client import EngineClient
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings

from .test_responses import HERMES_ANSWER, _prompt
from .test_tool_calling import _app
from .tokenizer_factory import byte_level_tokenizer

WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _client(http, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key=api_key, http_client=http, max_retries=0)


def _events(http, body: dict) -> list[dict]:
    """The raw event stream of a streamed create, each event checked strictly against Anthropic's
    types (and its SSE event name against its type)."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    for event in events:
        if event["type"] != "error":  # (Anthropic's error event is not one of the message's events)
            TypeAdapter(RawMessageStreamEvent).validate_python(event)
    return events


def test_a_text_answer_with_a_system_prompt():
    http, engine, serving = _app("Paris is the capital.")
    message = _client(http).messages.create(model="tiny", max_tokens=64, system="Be brief.",
                                            messages=[{"role": "user", "content": "Capital of France?"}],
                                            extra_body={"temperature": 0})
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == "tiny" and message.stop_reason == "end_turn" and message.stop_sequence is None
    assert [(b.type, b.text) for b in message.content] == [("text", "Paris is the capital.")]
    # (The template's newlines go with trim_blocks, as HF renders chat templates.)
    assert _prompt(serving, engine) == "system: Be brief.user: Capital of France?assistant:"
    assert message.usage.input_tokens == len(engine.requests[0].prompt_token_ids)
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.output_tokens == len(serving.tokenizer.encode("Paris is the capital.")) + 1  # and EOS
    params = engine.requests[0].sampling_params
    assert params.temperature == 0.0 and params.max_tokens == 64
    Message.model_validate(http.post("/v1/messages", json={
        "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).json(), strict=True)


def test_max_tokens_stop_sequences_and_cached_prompt_tokens():
    http, engine, _ = _app("one two three four five six")
    engine.finish = FinishReason.LENGTH
    engine.num_cached_tokens = 4  # (what the engine found in its prefix cache)
    client = _client(http)
    cut = client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "count"}])
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == "one" and cut.usage.output_tokens == 3
    prompt_tokens = len(engine.requests[0].prompt_token_ids)
    assert (cut.usage.input_tokens, cut.usage.cache_read_input_tokens) == (prompt_tokens - 4, 4)
    stopped = client.messages.create(model="tiny", max_tokens=64, stop_sequences=["four", "three"],
                                     messages=[{"role": "user", "content": "count"}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "three")
    assert stopped.content[0].text == "one two "
    events = _events(http, {"model": "tiny", "max_tokens": 64, "stop_sequences": ["three"],
                            "messages": [{"role": "user", "content": "count"}]})
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "three"}
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "one two "


def test_tool_use_whole_and_streamed_and_its_result_sent_back():
    http, engine, serving = _app(HERMES_ANSWER, parser="hermes")
    client = _client(http)
    ask = {"model": "tiny", "max_tokens": 200, "tools": [WEATHER],
           "messages": [{"role": "user", "content": "weather in Rome?"}]}
    message = client.messages.create(**ask)
    assert message.stop_reason == "tool_use"
    text, call = message.content
    assert (text.type, text.text.strip()) == ("text", "Let me look.")
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Rome"})
    assert call.id
    assert _prompt(serving, engine).startswith("TOOLS ")  # the template was given the tools
    with client.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == \
        [b.model_dump(exclude={"id"}) for b in message.content]
    events = _events(http, ask)
    assert [e["type"] for e in events[:2]] == ["message_start", "content_block_start"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    # The next turn: the call and its result reach the template as the assistant's call and a tool message.
    client.messages.create(model="tiny", max_tokens=50, tools=[WEATHER], tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "weather in Rome?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
                                          {"type": "tool_use", "id": call.id, "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "sunny, 24 C"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert _prompt(serving, engine, 3).endswith("user: weather in Rome?assistant:  CALLS Rome"
                                                "tool: sunny, 24 Cuser: And tomorrow?assistant:")


def test_a_named_tool_choice_and_no_parallel_calls_reach_the_chat_request():
    http, engine, _ = _app('{"city": "Rome"}')
    message = _client(http).messages.create(
        model="tiny", max_tokens=100, tools=[WEATHER], messages=[{"role": "user", "content": "weather?"}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    [call] = message.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Rome"})
    assert engine.requests[0].sampling_params.structured_output is not None  # (the call's arguments, constrained)


def test_thinking_comes_as_a_thinking_block_before_the_text():
    http, _, _ = _app("<think>Short question.</think>Paris.", reasoning="deepseek_r1", think_tokens=True)
    client = _client(http)
    ask = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Capital of France?"}]}
    thinking, text = client.messages.create(**ask).content
    assert (thinking.type, thinking.thinking, text.text) == ("thinking", "Short question.", "Paris.")
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == \
        [("thinking", "Short question."), ("text", "Paris.")]
    deltas = [e["delta"]["type"] for e in _events(http, ask) if e["type"] == "content_block_delta"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"


def test_thinking_switches_the_templates_enable_thinking():
    http, engine, serving = _app("ok")
    serving.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                       "{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}")
    client = _client(http)
    for kind, shown in (("enabled", "[think=True]"), ("adaptive", "[think=True]"), ("disabled", "[think=False]"),
                        ("between_tools", "[think=False]")):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind})
        assert _prompt(serving, engine, len(engine.requests) - 1).endswith(shown)


def test_count_tokens_is_the_prompt_a_create_sends():
    http, engine, _ = _app("ok", parser="hermes")
    client = _client(http)
    conversation = {"system": "Be brief.", "tools": [WEATHER],
                    "messages": [{"role": "user", "content": "weather in Rome?"}]}
    counted = client.messages.count_tokens(model="tiny", **conversation)
    client.messages.create(model="tiny", max_tokens=8, **conversation)
    assert counted.input_tokens == len(engine.requests[0].prompt_token_ids) > 0
    assert len(engine.requests) == 1  # (counting sends nothing to an engine)
    r = http.post("/v1/messages/count_tokens", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(("body", "message_part"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),  # required, as in Anthropic's API
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}, "user turn"),
    ({"max_tokens": 8, "messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": []}]}, "content"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "tool_use_id"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}},
     "thinking"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, "maximum context length"),
])
def test_refusals_are_400s_in_anthropics_shape(body, message_part):
    http, engine, _ = _app("ok")
    r = http.post("/v1/messages", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message_part in error["error"]["message"]
    assert engine.requests == []


def test_errors_reach_the_anthropic_client_as_its_exceptions():
    http, _, _ = _app("ok")
    client = _client(http)
    with pytest.raises(anthropic.NotFoundError) as found:
        client.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert found.value.body["error"]["type"] == "not_found_error" and "nope" in found.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}])
    # (OpenAI's paths keep OpenAI's error shape.)
    assert http.post("/v1/chat/completions", json={"model": "nope", "messages": []}).json()["error"]["code"] == 400


def test_an_engine_error_is_an_error_event_streamed_and_a_500_whole():
    http, engine, _ = _app("never")
    engine.finish = FinishReason.ERROR
    ask = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/v1/messages", json=ask)
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    events = _events(http, ask)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
    assert "message_stop" not in [e["type"] for e in events]


def test_the_api_key_may_come_as_x_api_key():
    client = EngineClient([object()], client_index=1)
    settings = ServingSettings(served_model_name="tiny", max_model_len=64, api_keys=("k-one",))
    app = create_app(OpenAIServing(settings, client, byte_level_tokenizer(), RoundRobinPolicy()))
    body = {"model": "nope", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as http:  # (with its lifespan, as Serve runs it)
        refused = http.post("/v1/messages", json=body, headers={"x-api-key": "k-two"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert http.post("/v1/messages", json=body).status_code == 401
        # The right key (as the anthropic client sends it) gets through, to the unknown model's 404.
        with pytest.raises(anthropic.NotFoundError):
            _client(http, api_key="k-one").messages.create(**body)
        assert http.post("/v1/messages", json=body, headers={"Authorization": "Bearer k-one"}).status_code == 404
        assert http.get("/v1/models", headers={"x-api-key": "k-one"}).status_code == 200


def test_an_unexpected_failure_mid_stream_is_anthropics_error_event(monkeypatch):
    from router.messages import MessagesServing

    def broken(*_):
        raise RuntimeError("could not finish the message")

    monkeypatch.setattr(MessagesServing, "_stop", broken)
    http, _, _ = _app("Paris.")
    ask = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    events = _events(http, ask)
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "could not finish the message"}}
    with pytest.raises(anthropic.APIStatusError) as raised, _client(http).messages.stream(**ask) as stream:
        stream.get_final_message()
    assert "could not finish the message" in str(raised.value)


def test_a_call_that_is_not_whole_json_is_not_a_tool_use():
    http, _, _ = _app('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', parser="hermes")
    message = _client(http).messages.create(model="tiny", max_tokens=200, tools=[WEATHER],
                                            messages=[{"role": "user", "content": "weather in Rome?"}])
    assert message.stop_reason != "tool_use" and "tool_use" not in [b.type for b in message.content]


@pytest.mark.parametrize("tokens_per_output", [1, 19])
def test_a_calls_end_and_the_text_after_it_in_one_output_keep_the_calls_input_whole(tokens_per_output):
    """Engine outputs of several tokens (merged, or speculative decoding) can bring a call's last
    arguments and the text after it at once: the tool_use block gets them all before it closes."""
    answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>Done.'
    http, engine, _ = _app(answer, parser="hermes")
    engine.tokens_per_output = tokens_per_output
    ask = {"model": "tiny", "max_tokens": 200, "tools": [WEATHER], "messages": [{"role": "user", "content": "hi"}]}
    with _client(http).messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None) or getattr(b, "text", None)) for b in final.content] == [
        ("tool_use", {"city": "Rome"}), ("text", "Done.")]
    events = _events(http, ask)
    stops = [i for i, e in enumerate(events) if e["type"] == "content_block_stop" and e["index"] == 0]
    json_deltas = [i for i, e in enumerate(events) if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta"]
    assert json_deltas and max(json_deltas) < stops[0]


def test_the_sdks_other_conversation_shapes():
    """What the anthropic client sends besides the basics: system messages among the turns (joined
    after the top-level system), a final assistant turn to continue (a prefill: the answer is what
    follows it), adaptive thinking, output_config's JSON schema (messages.parse), a tool result's
    text blocks (one a line); and an empty answer has no content blocks, as Anthropic's."""
    http, engine, serving = _app('{"a": 1}')
    client = _client(http)
    client.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Bonjour"}])
    assert _prompt(serving, engine, 0) == "system: Be brief.\n\nAnswer in French.user: hiassistant: Bonjour"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    one_turn = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    r = http.post("/v1/messages", json={**one_turn, "thinking": {"type": "adaptive"},
                                        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].sampling_params.structured_output == {"json": schema}
    bad = http.post("/v1/messages", json={**one_turn, "output_config": {"format": {"type": "xml"}}})
    assert bad.status_code == 400 and "output_config" in bad.json()["error"]["message"]
    prefilled = {**one_turn, "messages": [*one_turn["messages"], {"role": "assistant", "content": "{"}],
                 "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    bad = http.post("/v1/messages", json=prefilled)
    assert bad.status_code == 400 and "prefill" in bad.json()["error"]["message"]
    client.messages.create(model="tiny", max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [
            {"type": "text", "text": "sunny"}, {"type": "text", "text": "24 C"}]}]}])
    assert "tool: sunny\n24 Cassistant:" in _prompt(serving, engine, len(engine.requests) - 1)
    http, engine, _ = _app("")
    empty = _client(http).messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert empty.content == [] and empty.stop_reason == "end_turn"


def test_an_earlier_thinking_block_reaches_the_template_as_its_turns_reasoning():
    from .test_responses import THINKING_TEMPLATE

    http, engine, serving = _app("ok")
    serving.tokenizer.chat_template = THINKING_TEMPLATE
    _client(http).messages.create(model="tiny", max_tokens=5, messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should call it", "signature": ""},
                                          {"type": "redacted_thinking", "data": "x"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}])
    assert _prompt(serving, engine) == "user:qassistant:<think>I should call it</think> CALL get_weathertool:sunny" \
                                       "assistant:"
