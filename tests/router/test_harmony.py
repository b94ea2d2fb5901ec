"""gpt-oss's harmony answers (--reasoning-parser openai_gptoss, --tool-call-parser openai): channels
split into reasoning, content and tool calls, streamed in every split as whole, and through the chat
endpoint (the engine's side played by a script) with the markers as special tokens of the vocabulary."""

from __future__ import annotations

import json

import pytest

from router.chat_parsing import ChatOutputParser
from router.detokenizer import IncrementalDetokenizer
from router.harmony import HarmonyParser, message_kind

from .test_reasoning_parsers import _deltas, assert_thinking_split
from .test_tool_calling import MESSAGES, WEATHER, _app, merged_calls
from .tokenizer_factory import byte_level_tokenizer

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
# An answer after a prompt ending "<|start|>assistant": its first header has no role.
THOUGHT_THEN_ANSWER = ("<|channel|>analysis<|message|>User asks the capital of Italy.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>Rome.")
THOUGHT_THEN_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
                     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                     '<|message|>{"city": "Rome"}')


def _parse(text: str, step: int, calls_allowed: bool = True, include_reasoning: bool = True):
    """(reasoning, content, calls) of ``text`` fed ``step`` characters at a time (0: whole)."""
    parser = ChatOutputParser(None, HarmonyParser(calls_allowed), include_reasoning)
    if step == 0:
        answer = parser.whole(text)
        return answer.reasoning or "", answer.content or "", [
            (c["function"]["name"], c["function"]["arguments"]) for c in answer.tool_calls]
    reasoning = content = ""
    deltas = []
    for i in range(0, len(text), step):
        out = parser.feed(text[i:i + step])
        reasoning, content, deltas = reasoning + out.reasoning, content + out.content, deltas + out.tool_calls
    out = parser.finish()
    reasoning, content, deltas = reasoning + out.reasoning, content + out.content, deltas + out.tool_calls
    calls = merged_calls([{"delta": {"tool_calls": deltas}}])
    return reasoning, content, [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("step", [0, 1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("text", "calls_allowed", "expected"), [
    (THOUGHT_THEN_ANSWER, True, ("User asks the capital of Italy.", "Rome.", [])),
    (THOUGHT_THEN_CALL, True, ("Need the weather tool.", "", [("get_weather", '{"city": "Rome"}')])),
    # The recipient before the channel (harmony allows both orders), the arguments' format unnamed.
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary"
     '<|message|>{"city": "Paris"}', True, ("Think.", "", [("get_weather", '{"city": "Paris"}')])),
    # Two calls, one after the other.
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}<|call|>'
     '<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}', True,
     ("", "", [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])),
    # Calls not allowed (tool_choice none, or no --tool-call-parser openai): the call's body is content.
    (THOUGHT_THEN_CALL, False, ("Need the weather tool.", '{"city": "Rome"}', [])),
    # A preamble for the user (commentary, no recipient) is content; a built-in tool's message reasoning.
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>analysis to=browser.search"
     '<|message|>{"query": "rome"}<|end|><|start|>assistant<|channel|>final<|message|>Sunny.', True,
     ('{"query": "rome"}', "Checking.Sunny.", [])),
    # Text that is not harmony is content; "<" alone is held until it is known not to be a marker.
    ("Just text, 1 < 2.", True, ("", "Just text, 1 < 2.", [])),
    # An answer cut off in its final message keeps what it wrote; one cut in a header wrote nothing more.
    ("<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|channel|>fin", True, ("Hm", "", [])),
    ("<|channel|>final<|message|>Partial <|en", True, ("", "Partial <|en", [])),
    # A final header naming its format; a short answer that only looks like a role.
    ('<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>final <|constrain|>json<|message|>{"a": 1}',
     True, ("A.", '{"a": 1}', [])),
    ("assistant is a word", True, ("", "assistant is a word", [])),
])
def test_channels_split_alike_streamed_and_whole(text, calls_allowed, expected, step):
    assert _parse(text, step, calls_allowed) == expected


def test_message_kinds():
    assert message_kind("<|channel|>analysis", True) == ("reasoning", "")
    assert message_kind("<|start|>assistant<|channel|>final", True) == ("content", "")
    assert message_kind("<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json", True) == \
        ("call", "f")
    assert message_kind("<|start|>assistant<|channel|>commentary to=functions.f", False) == ("content", "")
    assert message_kind("<|start|>assistant<|channel|>commentary to=python", True) == ("reasoning", "")


def test_include_reasoning_false_drops_the_analysis():
    assert _parse(THOUGHT_THEN_ANSWER, 0, include_reasoning=False) == ("", "Rome.", [])
    assert _parse(THOUGHT_THEN_ANSWER, 4, include_reasoning=False) == ("", "Rome.", [])


def _harmony_app(answer: str, parser: str | None = "openai"):
    return _app(answer, parser=parser, reasoning="openai_gptoss", special_tokens=MARKERS)


def test_the_chat_endpoint_reads_harmony_with_its_markers_as_special_tokens():
    http, _, serving = _harmony_app(THOUGHT_THEN_ANSWER)
    assert serving.tokenizer.convert_tokens_to_ids("<|channel|>") in serving.tokenizer.all_special_ids
    assert_thinking_split(http, serving, "User asks the capital of Italy.", "Rome.")
    body = {"model": "tiny", "messages": MESSAGES}
    # The same server without the parser: the special tokens are dropped from the text, as asked.
    plain, _, _ = _app(THOUGHT_THEN_ANSWER, special_tokens=MARKERS)
    assert plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == \
        "analysisUser asks the capital of Italy.assistantfinalRome."


def test_the_chat_endpoint_answers_a_harmony_call_with_tool_calls():
    http, _, _ = _harmony_app(THOUGHT_THEN_CALL)
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need the weather tool." and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    deltas = _deltas(http, body)
    assert merged_calls(deltas) == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # Reasoning only (no --tool-call-parser): the call is not read as one.
    reasoning_only, _, _ = _harmony_app(THOUGHT_THEN_CALL, parser=None)
    message = reasoning_only.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}).json()[
        "choices"][0]["message"]
    assert (message["content"], message.get("tool_calls") or []) == ('{"city": "Rome"}', [])


def test_harmony_refuses_forced_tool_choices_and_constrains_the_final_channel():
    http, engine, serving = _harmony_app('<|channel|>analysis<|message|>Think.<|end|><|start|>assistant'
                                         '<|channel|>final<|message|>{"a": 1}')
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER],
                                                    "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert not engine.requests
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                "response_format": {"type": "json_object"}})
    assert r.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    [request] = engine.requests
    # The grammar holds after "<|channel|>final" and the next "<|message|>" (a header may name the
    # format between them: " <|constrain|>json").
    final = serving.tokenizer.encode("<|channel|>final", add_special_tokens=False)
    assert request.sampling_params.structured_output_after == final
    assert request.sampling_params.structured_output_then == serving.tokenizer.convert_tokens_to_ids("<|message|>")


def test_reasoning_effort_reaches_the_chat_template():
    http, engine, serving = _harmony_app(THOUGHT_THEN_ANSWER)
    serving.tokenizer.chat_template = ("{{ 'Reasoning: ' ~ (reasoning_effort | default('medium')) ~ '\\n' }}"
                                       "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    prompts = []
    for extra in ({}, {"reasoning_effort": "high"},
                  {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **extra})
        assert r.status_code == 200, r.text
        prompts.append(serving.tokenizer.decode(engine.requests[-1].prompt_token_ids).split("\n")[0])
    assert prompts == ["Reasoning: medium", "Reasoning: high", "Reasoning: low"]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "reasoning_effort": "max"})
    assert r.status_code == 400 and "reasoning_effort" in json.dumps(r.json())


def test_the_responses_api_gives_harmony_reasoning_and_function_call_items():
    http, _, _ = _harmony_app(THOUGHT_THEN_CALL)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    output = http.post("/v1/responses", json={"model": "tiny", "input": "weather?", "tools": [tool]}).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Need the weather tool."}]
    assert (output[1]["name"], output[1]["arguments"]) == ("get_weather", '{"city": "Rome"}')


def test_markers_spelled_with_ordinary_tokens_are_text():
    """A final answer explaining the format writes "<|end|>" and "<|start|>" with ordinary tokens: the
    detokenizer records where the marker tokens' text lies, and the parser ends messages there only,
    streamed token by token and whole."""
    tokenizer = byte_level_tokenizer.__wrapped__()
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})

    def ordinary(text: str) -> list[int]:  # (one character at a time: no special token matched)
        return [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]

    def special(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = [*special("<|channel|>analysis<|message|>"), *ordinary("Quote <|end|> here."),
           *special("<|end|><|start|>assistant<|channel|>final<|message|>"),
           *ordinary("Messages end with <|end|>, then <|start|>assistant opens one.")]
    markers = frozenset(tokenizer.convert_tokens_to_ids(list(MARKERS)))
    expected = ("Quote <|end|> here.", "Messages end with <|end|>, then <|start|>assistant opens one.")
    for streamed in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, marker_ids=markers)
        parser = ChatOutputParser(None, HarmonyParser(True, marker_offsets=detok.marker_offsets))
        if streamed:
            reasoning = content = ""
            for token in ids:
                out = parser.feed(detok.add_tokens([token]))
                reasoning, content = reasoning + out.reasoning, content + out.content
            out = parser.feed(detok.finish())
            out.extend(parser.finish())
            got = (reasoning + out.reasoning, content + out.content)
        else:
            detok.add_tokens(ids)
            detok.finish()
            answer = parser.whole(detok.output_text)
            got = (answer.reasoning, answer.content)
        assert got == expected, streamed
        assert len(detok.marker_offsets) == 6
    # Through the chat endpoint, whole and streamed (the scripted engine answers with these ids).
    http, engine, serving = _harmony_app("")
    engine.script = lambda _: [*(serving.tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(ids))),
                               serving.tokenizer.eos_token_id]
    body = {"model": "tiny", "messages": MESSAGES}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == expected
    deltas = _deltas(http, body)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == expected[1]
    # Without the offsets every spelled marker counts: the quote would end the analysis.
    plain = ChatOutputParser(None, HarmonyParser(True)).whole(detok.output_text)
    assert plain.reasoning == "Quote "


def test_a_tool_calling_turn_with_a_preamble_goes_back_to_the_template():
    """gpt-oss's template writes a tool-calling turn's analysis from its content or its thinking and
    refuses both: the preamble this server returned as content is left out of that turn."""
    http, engine, serving = _harmony_app("<|channel|>final<|message|>Sunny.")
    serving.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.tool_calls is defined and m.tool_calls and m.content and m.thinking %}"
        "{{ raise_exception('both content and thinking') }}{% endif %}"
        "{{ m.role }}:{{ m.thinking or '' }}|{{ m.content or '' }}\n{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
                            "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert "assistant:Need the tool.|\n" in serving.tokenizer.decode(engine.requests[0].prompt_token_ids)
