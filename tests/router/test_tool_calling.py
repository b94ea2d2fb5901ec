"""Tool calling: the parsers on their own (streamed in every split equals whole), the constraint a
tool_choice asks of the engine, and /v1/chat/completions through the real FastAPI app with the
engine's side played by a script (what is refused, what the response and the stream carry)."""

from __future__ import annotations

import functools
import json

import pytest
from starlette.testclient import TestClient

from engine_core.request import FinishReason
from engine_core.structured_output import check_structured_output
from router.app import create_app
from router.chat_parsing import ChatOutputParser
from router.engine_client import EngineClient
from router.parsed_output import ParsedDelta
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings
from router.tool_choice import tool_choice_constraint
from router.tool_parsers import (
    HermesToolCallParser,
    Llama3JsonToolCallParser,
    MistralToolCallParser,
    NamedToolCallParser,
    PythonicToolCallParser,
    RequiredToolCallParser,
    ToolCallParser,
)

from .test_request_fields import ScriptedEngine
from .tokenizer_factory import byte_level_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an object of anything


def _streamed_and_whole_agree(make: type[ToolCallParser], text: str, step: int, content: str,
                              calls: dict[int, dict[str, str]]) -> list[dict]:
    """The parser streamed in pieces of ``step`` and run on the whole text gives ``content`` and
    ``calls`` (a whole answer of calls alone has null content); returns the whole answer's calls."""
    assert _streamed(make(), text, step) == (content, calls)
    whole_content, whole_calls = collect(make(), text)
    assert whole_content == (content if content or not calls else None)
    assert {i: c["function"] for i, c in enumerate(whole_calls)} == calls
    return whole_calls


def collect(parser: ToolCallParser, text: str, parallel_tool_calls: bool = True) -> tuple[str | None, list[dict]]:
    """A whole answer's content and calls, as the server makes them."""
    answer = ChatOutputParser(None, parser, parallel_tool_calls=parallel_tool_calls).whole(text)
    return answer.content, answer.tool_calls


def merged_calls(deltas: list[dict]) -> list[dict[str, str]]:
    """The calls of streamed chunks' deltas, as a client merges them."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for call in d["delta"].get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    return list(calls.values())


def _streamed(parser: ToolCallParser, text: str, step: int,
              parallel_tool_calls: bool = True) -> tuple[str, dict[int, dict[str, str]]]:
    """Feed ``text`` in pieces of ``step`` characters (through the server's per-choice parser) and
    merge the deltas as a client does."""
    choice = ChatOutputParser(None, parser, parallel_tool_calls=parallel_tool_calls)
    out = ParsedDelta()
    for i in range(0, len(text), step):
        out.extend(choice.feed(text[i:i + step]))
    out.extend(choice.finish())
    calls: dict[int, dict[str, str]] = {}
    for delta in out.tool_calls:
        if "id" in delta:
            assert delta["index"] not in calls and delta["type"] == "function"
            assert delta["id"].startswith("chatcmpl-tool-") or isinstance(parser, MistralToolCallParser)
            calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return out.content, calls


def test_a_call_without_arguments_gets_an_empty_object_and_no_trailing_blanks():
    assert collect(RequiredToolCallParser(), '[{"name": "f"}, {"name": "g", "parameters": 5 }]')[1] == [
        {"id": ANY_ID, "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": ANY_ID, "type": "function", "function": {"name": "g", "arguments": "5"}}]
    hermes = '<tool_call>{"name": "f", "arguments": 5 }</tool_call><tool_call>{"name": "g"}</tool_call>'
    assert _streamed(HermesToolCallParser(), hermes, 1)[1] == {0: {"name": "f", "arguments": "5"},
                                                               1: {"name": "g", "arguments": "{}"}}


class _AnyId(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)

    __hash__ = str.__hash__


ANY_ID = _AnyId()


REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris }{", "days": [1, {"a": []}]}},\n'
                 ' {"name":"get_time","parameters":{}}, {"parameters": 5, "name": "n\\u00e9"}]')


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
def test_required_parser_streams_each_call_as_its_name_and_arguments_arrive(step):
    content, calls = _streamed(RequiredToolCallParser(), REQUIRED_TEXT, step)
    assert content == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time", "né"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        {"city": 'Pa"ris }{', "days": [1, {"a": []}]}, {}, 5]
    # Whole, the same calls.
    whole_content, whole = collect(RequiredToolCallParser(), REQUIRED_TEXT)
    assert whole_content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == [
        (c["name"], c["arguments"]) for c in calls.values()]


def test_required_parser_releases_the_name_before_the_arguments_end():
    parser = RequiredToolCallParser()
    assert parser.feed('[{"name": "get_wea').tool_calls == []
    first = parser.feed('ther", "parameters": {"ci').tool_calls
    assert [(d["index"], d["function"]) for d in first] == [(0, {"name": "get_weather", "arguments": '{"ci'})]
    assert parser.feed('ty": "Rome"}}]').tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_named_parser_makes_the_whole_text_the_arguments(step):
    content, calls = _streamed(NamedToolCallParser("get_weather"), '{"city": "Rome"}', step)
    assert content == "" and calls == {0: {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert collect(NamedToolCallParser("f"), "")[1][0]["function"] == {"name": "f", "arguments": ""}


HERMES_TEXT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time"}</tool_call> a < b <tool_call>not json</tool_call> done <tool_c')


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_parser_splits_content_from_calls(step):
    content, calls = _streamed(HermesToolCallParser(), HERMES_TEXT, step)
    # A block that is not a call stays content; a partial tag at the end is released at finish; the
    # blanks before a call are not content.
    assert content == "Let me look. a < b <tool_call>not json</tool_call> done <tool_c"
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                     1: {"name": "get_time", "arguments": "{}"}}


def test_hermes_parser_holds_back_only_what_may_be_a_tag():
    parser = HermesToolCallParser()
    assert parser.feed("Sure <tool").content == "Sure"
    assert parser.feed("box>").content == " <toolbox>"
    # A call is released as soon as its name is read, its arguments as they come; no closing tag
    # is needed at the end.
    assert parser.feed('<tool_call>{"name": "f", "argu').tool_calls[0]["function"] == {"name": "f", "arguments": ""}
    assert parser.feed('ments": {"a"').tool_calls == [{"index": 0, "function": {"arguments": '{"a"'}}]
    assert parser.feed(": 1}}").tool_calls == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert parser.finish() == ParsedDelta()
    assert collect(HermesToolCallParser(), "plain answer") == ("plain answer", [])


def test_hermes_calls_alone_have_no_content_and_nothing_is_invented():
    two_calls = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g"}</tool_call>\n'
    content, calls = collect(HermesToolCallParser(), two_calls)
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert _streamed(HermesToolCallParser(), two_calls, 1)[0] == ""
    # A call cut off keeps the arguments it got (as streamed); a block without a name stays content,
    # without a closing tag the model never wrote.
    cut = ChatOutputParser(None, HermesToolCallParser()).whole('Hi <tool_call>{"name": "f", "arguments": {"a": 1',
                                                               cut=True)
    assert cut.content == "Hi" and cut.tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1'}
    # Not cut off (the model stopped there): a call that is not JSON is no call, the answer its text.
    assert collect(HermesToolCallParser(), 'Hi <tool_call>{"name": "f", "arguments": {"a": 1') == (
        'Hi <tool_call>{"name": "f", "arguments": {"a": 1', [])
    nameless = 'Hi <tool_call>{"arguments": {"a": 1}}'
    assert collect(HermesToolCallParser(), nameless) == (nameless, [])
    # parallel_tool_calls false: the first call only.
    assert [c["function"]["name"] for c in collect(HermesToolCallParser(), two_calls, parallel_tool_calls=False)[1]] \
        == ["f"]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "arguments": {}}', "",
     {0: {"name": "f", "arguments": '{"a": "x;y"}'}, 1: {"name": "g", "arguments": "{}"}}),
    (' {"name": "f", "parameters": {"a": [1, {"b": 2}]}}', "", {0: {"name": "f", "arguments": '{"a": [1, {"b": 2}]}'}}),
    ('Hello {"name": "f"}', 'Hello {"name": "f"}', {}),  # not starting with a call: content
    ('{"name": "f", "param', '{"name": "f", "param', {}),  # cut off: the whole answer is content
    ("{not json}", "{not json}", {}),
    ("  ", "  ", {}),
    ('{"name": "f", "parameters": {}} and then', "and then", {0: {"name": "f", "arguments": "{}"}}),
    # JSON with a name but no arguments is not a call (as vLLM): an answer about Alice stays text.
    ('{"name": "Alice", "email": "a@x.org"}', '{"name": "Alice", "email": "a@x.org"}', {}),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_llama3_json_parser(text, content, calls, step):
    _streamed_and_whole_agree(Llama3JsonToolCallParser, text, step, content, calls)


def test_llama3_json_parser_keeps_one_call_without_parallel_calls():
    text = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'
    calls = collect(Llama3JsonToolCallParser(), text, parallel_tool_calls=False)[1]
    assert [c["function"]["name"] for c in calls] == ["f"]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "[x]"}}, {"name": "g", "arguments": {}}]', "Sure.",
     {0: {"name": "f", "arguments": '{"a": "[x]"}'}, 1: {"name": "g", "arguments": "{}"}}),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "", {0: {"name": "f", "arguments": '{"a": 1}'}}),
    ("No tools needed. [TOOL_", "No tools needed. [TOOL_", {}),
    ("  ", "  ", {}),
    ('[TOOL_CALLS][{"name": "f"}]', "", {0: {"name": "f", "arguments": "{}"}}),  # no arguments: {}
    # No call after the tag (text): the text is content.
    ("Hm. [TOOL_CALLS] sorry, I cannot", "Hm.[TOOL_CALLS] sorry, I cannot", {}),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", {}),
    # Tokenizer v11 on (Mistral-Small-3.x, Magistral, Devstral): name[ARGS]{...}, a tag before each call.
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "",
     {0: {"name": "get_weather", "arguments": '{"city": "Rome"}'}}),
    ('Sure. [TOOL_CALLS]f[ARGS]{"a": "}[x", "b": [1, {"c": "\\"}"}]} [TOOL_CALLS]g_2[ARGS] {}', "Sure.",
     {0: {"name": "f", "arguments": '{"a": "}[x", "b": [1, {"c": "\\"}"}]}'}, 1: {"name": "g_2", "arguments": "{}"}}),
    ('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}\nDone.', "Done.", {0: {"name": "f", "arguments": '{"a": 1}'}}),
    ("[TOOL_CALLS]f[ARGS]", "", {0: {"name": "f", "arguments": "{}"}}),  # cut off: {}
    ("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS] no", "[TOOL_CALLS] no", {0: {"name": "f", "arguments": "{}"}}),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_mistral_parser(text, content, calls, step):
    whole_calls = _streamed_and_whole_agree(MistralToolCallParser, text, step, content, calls)
    # Mistral's templates take back only 9-character alphanumeric call ids.
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in whole_calls)


def test_mistral_parser_keeps_one_call_without_parallel_calls():
    for text in ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]',
                 '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{"b": 2}'):
        assert _streamed(MistralToolCallParser(), text, 3, parallel_tool_calls=False) == (
            "", {0: {"name": "f", "arguments": "{}"}})


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('[get_weather(city="Rome", days=[1, 2]), now()]', "",
     {0: {"name": "get_weather", "arguments": '{"city": "Rome", "days": [1, 2]}'},
      1: {"name": "now", "arguments": "{}"}}),
    ('<|python_start|>[f(a=true, b=null, c={"x": "]"})]<|python_end|>', "",
     {0: {"name": "f", "arguments": '{"a": true, "b": null, "c": {"x": "]"}}'}}),
    ('[f(a=1)] and more', " and more", {0: {"name": "f", "arguments": '{"a": 1}'}}),
    ("Hello [f(a=1)]", "Hello [f(a=1)]", {}),  # not starting with the list: content
    ("[f(a=1)", "[f(a=1)", {}),  # cut off: the whole answer is content
    ("[1, 2]", "[1, 2]", {}),  # a list, but not of calls
    ('[f(x=open("/etc/passwd"))]', '[f(x=open("/etc/passwd"))]', {}),  # only literals are arguments
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_pythonic_parser(text, content, calls, step):
    _streamed_and_whole_agree(PythonicToolCallParser, text, step, content, calls)


def test_constraints_for_named_and_required_choices_compile():
    named = tool_choice_constraint([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert named == {"json": WEATHER["function"]["parameters"]}
    required = tool_choice_constraint([WEATHER, TIME], "required", True)
    one = tool_choice_constraint([WEATHER, TIME], "required", False)
    assert "maxItems" not in required["json"] and one["json"]["maxItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in required["json"]["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    assert required["json"]["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    # An empty parameters schema still means an object (not any JSON value).
    empty = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert tool_choice_constraint([empty], {"type": "function", "function": {"name": "f"}}, True) == {
        "json": {"type": "object", "properties": {}}}
    for spec in (named, required, one):
        check_structured_output(spec)
    assert tool_choice_constraint([WEATHER], "auto", True) is None
    assert tool_choice_constraint([WEATHER], "none", True) is None


def test_required_choice_keeps_each_tools_definitions_reachable():
    """Tools whose parameters "$ref" their own "$defs" (openai.pydantic_function_tool of nested models
    writes them so) are usable under "required": the definitions move to the array's root, where
    the references lead; two tools defining one name differently are refused."""
    import xgrammar as xgr

    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    trip = {"type": "function", "function": {"name": "book_trip", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}}, "required": ["to"],
        "$defs": {"Place": place}}}}
    visit = {"type": "function", "function": {"name": "visit", "parameters": {
        "type": "object", "properties": {"where": {"$ref": "#/definitions/Place"}}, "required": ["where"],
        "definitions": {"Place": place}}}}
    spec = tool_choice_constraint([trip, visit, WEATHER], "required", True)
    check_structured_output(spec)
    grammar = xgr.Grammar.from_json_schema(json.dumps(spec["json"]))
    accepts = functools.partial(xgr.testing._is_grammar_accept_string, grammar)
    assert accepts('[{"name": "book_trip", "parameters": {"to": {"city": "Rome"}}}]')
    assert accepts('[{"name": "visit", "parameters": {"where": {"city": "Oslo"}}}]')
    assert not accepts('[{"name": "book_trip", "parameters": {"to": {"town": "Rome"}}}]')
    assert trip["function"]["parameters"]["$defs"] == {"Place": place}  # (the request's tools are left as sent)
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match="Place"):
        tool_choice_constraint([trip, other], "required", True)
    http, _, _ = _app("[]")
    refused = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [trip, other],
                                                      "tool_choice": "required"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


# -- through the app ------------------------------------------------------------------------------------

# A template that shows the tools and earlier tool calls, as tool-aware templates do.
TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
            "{{ m['content'] }}{% if m.tool_calls %} CALLS {{ m.tool_calls[0].function.arguments.city }}{% endif %}"
            "\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "weather in Rome?"}]


def _app(answer: str, parser: str | None = None, reasoning: str | None = None, spaced: bool = True,
         think_tokens: bool = False, stream_interval: int = 1,
         trust_request_chat_template: bool = False,
         special_tokens: tuple[str, ...] = (), tokenizer=None) -> tuple[TestClient, ScriptedEngine, OpenAIServing]:
    """``spaced``: the answer streams one token per engine output, as from a real engine.
    ``think_tokens``: <think> and </think> are tokens of the vocabulary, as in reasoning models.
    ``special_tokens``: special tokens of the vocabulary (Mistral's control tokens). ``tokenizer``:
    another (its answer encoded without the special tokens it would add)."""
    given = tokenizer is not None
    tokenizer = tokenizer if given else byte_level_tokenizer.__wrapped__()  # (a copy: the template is set on it)
    tokenizer.chat_template = TEMPLATE
    if think_tokens:
        tokenizer.add_tokens(["<think>", "</think>"])
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    client = EngineClient([object()], client_index=1)
    # The answer's tokens, then EOS (finish STOP: the EOS is not part of the text).
    scripted = client._slots[0].channel = ScriptedEngine(
        client, lambda _: [*tokenizer.encode(answer, **({"add_special_tokens": False} if given else {})),
                           tokenizer.eos_token_id], finish=FinishReason.STOP,
        spaced=spaced)
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=512, tool_call_parser=parser,
                                            reasoning_parser=reasoning, stream_interval=stream_interval,
                                            trust_request_chat_template=trust_request_chat_template),
                            client, tokenizer, RoundRobinPolicy())
    return TestClient(create_app(serving)), scripted, serving


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [WEATHER]}, "tool_choice"),  # the default is auto, which this server has not enabled
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),  # tool_choice without tools (as OpenAI and vLLM refuse it)
    ({"tools": [], "tool_choice": NAMED}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "none"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "none", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{not json"}}]}]}, "messages"),
])
def test_refused_tool_requests_name_their_parameter(body, param):
    http, engine, _ = _app("x")
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not engine.requests


def test_named_tool_choice_constrains_the_output_and_answers_with_a_call():
    http, engine, _ = _app('{"city": "Rome"}')
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, TIME],
                                                "tool_choice": NAMED})
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling_params.structured_output == {"json": WEATHER["function"]["parameters"]}
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # as OpenAI answers a forced function
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_the_openai_stream_helper_sees_the_last_call_end():
    """Here the whole answer and its finish arrive in one engine batch: the finish still goes in a
    chunk of its own, or the openai client's stream helper never closes the last call."""
    import openai

    http, _, _ = _app('{"city": "Rome"}', spaced=False)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=[strict], tool_choice=NAMED) as s:
        done = [e for e in s if e.type == "tool_calls.function.arguments.done"]
        final = s.get_final_completion()
    assert [(e.name, e.parsed_arguments) for e in done] == [("get_weather", {"city": "Rome"})]
    assert final.choices[0].finish_reason == "stop"


def test_required_tool_choice_streams_calls_that_add_up_to_the_whole_answer():
    answer = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    http, engine, _ = _app(answer)
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": False}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert engine.requests[0].sampling_params.structured_output["json"]["maxItems"] == 1
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0] for e in events]
    assert deltas[0]["delta"]["role"] == "assistant" and deltas[-1]["finish_reason"] == "tool_calls"
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        assert not d["delta"].get("content")
        for call in d["delta"].get("tool_calls") or ():
            entry = calls.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    # The arguments came in pieces, as the tokens did.
    assert sum(len(d["delta"].get("tool_calls") or ()) for d in deltas) > 6


def test_auto_tool_choice_with_the_hermes_parser():
    answer = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    http, engine, _ = _app(answer, parser="hermes")
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert engine.requests[0].sampling_params.structured_output is None  # the model decides
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    with http.stream("POST", "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                           "tools": [WEATHER], "stream": True}) as s:
        deltas = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert merged_calls(deltas) == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert sum(len(d["delta"].get("tool_calls") or ()) for d in deltas) > 3  # the arguments in pieces
    assert deltas[-1]["finish_reason"] == "tool_calls"
    # A plain answer stays a plain answer.
    http, _, _ = _app("It is sunny.", parser="hermes")
    plain = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]})
    assert plain.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny.",
                                                     "reasoning": None, "reasoning_content": None,
                                                     "tool_calls": None}
    assert plain.json()["choices"][0]["finish_reason"] == "stop"


def test_continue_final_message_leaves_the_last_message_open():
    http, engine, serving = _app("x")
    serving.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|END|{% endfor %}"
    body = {"model": "tiny", "messages": [*MESSAGES, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False}
    assert http.post("/v1/chat/completions", json={**body, "continue_final_message": True}).status_code == 200
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    opened, closed = (serving.tokenizer.decode(r.prompt_token_ids) for r in engine.requests)
    assert opened.endswith("assistant: It is") and closed.endswith("assistant: It is|END|")
    refused = http.post("/v1/chat/completions", json={**body, "continue_final_message": True,
                                                      "add_generation_prompt": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"
    # A request's own template is refused, as vLLM refuses it from an untrusting server.
    for param, extra in (("chat_template", {"chat_template": "{{ messages }}"}),
                         ("chat_template_kwargs", {"chat_template_kwargs": {"chat_template": "{{ messages }}"}})):
        refused = http.post("/v1/chat/completions", json={**body, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    refused = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "chat_template": "x"})
    assert refused.status_code == 400 and "--trust-request-chat-template" in refused.json()["error"]["message"]
    # /tokenize writes a conversation as chat does (continue_final_message too).
    opened_ids = http.post("/tokenize", json={"model": "tiny", "messages": body["messages"], "add_generation_prompt":
                                              False, "continue_final_message": True}).json()["tokens"]
    assert serving.tokenizer.decode(opened_ids) == opened
    for bad in ({"messages": []}, {"messages": MESSAGES, "continue_final_message": True}):
        assert http.post("/tokenize", json={"model": "tiny", **bad}).status_code == 400, bad


def test_tokenize_counts_a_conversation_with_its_tools_as_chat_sends_it():
    """/tokenize with messages and tools gives the prompt chat completions sends for them (clients
    budget max_tokens from it); return_token_strs spells each token as the vocabulary does."""
    http, engine, serving = _app("It is sunny.")
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER],
                                                   "tool_choice": "none", "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    sent = engine.requests[-1].prompt_token_ids
    assert "get_weather" in serving.tokenizer.decode(sent)
    counted = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER],
                                           "return_token_strs": True}).json()
    assert counted["tokens"] == sent and counted["count"] == len(sent)
    assert counted["token_strs"] == serving.tokenizer.convert_ids_to_tokens(sent)
    bare = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    assert bare["count"] < len(sent) and bare["token_strs"] is None


def test_a_trusting_server_runs_the_requests_own_template():
    """Under --trust-request-chat-template, a request's chat_template writes its conversation on
    chat and /tokenize (with the kwargs it is given); requests without one, or with "", keep the
    server's; one inside chat_template_kwargs is refused (the field is where it goes); a broken one
    is a 400 naming messages."""
    http, engine, serving = _app("x", trust_request_chat_template=True)
    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if flag %}!{% endif %}"
    body = {"model": "tiny", "messages": MESSAGES}
    assert http.post("/v1/chat/completions", json={**body, "chat_template": own}).status_code == 200
    assert http.post("/v1/chat/completions", json={**body, "chat_template": own,
                                                   "chat_template_kwargs": {"flag": True}}).status_code == 200
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert http.post("/v1/chat/completions", json={**body, "chat_template": ""}).status_code == 200
    written = [serving.tokenizer.decode(r.prompt_token_ids) for r in engine.requests]
    conversation = "".join(f"<{m['role']}>{m['content']}" for m in MESSAGES)
    assert written[:2] == [conversation, conversation + "!"]
    server_written = serving.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert written[2] == written[3] == server_written
    refused = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"chat_template": own}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
    tokens = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "chat_template": own}).json()
    assert serving.tokenizer.decode(tokens["tokens"]) == conversation
    broken = http.post("/v1/chat/completions", json={**body, "chat_template": "{% for m in messages %}"})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(("parser", "answer"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'),
    ("pythonic", '[get_weather(city="Rome")]'),
])
def test_auto_tool_choice_with_the_other_parsers(parser, answer):
    http, _, _ = _app(answer, parser=parser)
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    deltas = _deltas(http, body)
    assert merged_calls(deltas) == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]


def _deltas(http: TestClient, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]


def test_auto_keeps_special_tokens_in_the_text_the_parser_reads():
    """Some models' tool-call tags are special tokens: under "auto" they stay in the text."""
    http, _, _ = _app("A<eos>B", parser="hermes")
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == "A<eos>B"
    plain = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    assert plain["choices"][0]["message"]["content"] == "AB"


def test_several_streamed_choices_are_parsed_apart():
    answer = ('<think>hm</think>Let me see. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
              '</tool_call>')
    http, _, _ = _app(answer, parser="hermes", reasoning="qwen3")
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "n": 2, "logprobs": True}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        deltas = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        mine = [d for d in deltas if d["index"] == index]
        assert "".join(d["delta"].get("reasoning_content") or "" for d in mine) == "hm"
        assert "".join(d["delta"].get("content") or "" for d in mine) == "Let me see."
        assert merged_calls(mine) == [
            {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
        assert [d["finish_reason"] for d in mine if d["finish_reason"]] == ["tool_calls"]
        # Every token's logprob arrives, also those of text held back while a tag might be starting.
        streamed_logprobs = [lp for d in mine for lp in (d["logprobs"] or {}).get("content") or ()]
        assert len(streamed_logprobs) == len(whole[index]["logprobs"]["content"])
        assert whole[index]["message"] == {"role": "assistant", "content": "Let me see.", "reasoning": "hm",
                                           "reasoning_content": "hm",
                                           "tool_calls": whole[index]["message"]["tool_calls"]}


def test_the_template_sees_the_tools_and_earlier_calls_with_parsed_arguments():
    _, _, serving = _app("x")
    from router.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="tiny", tools=[WEATHER], tool_choice="none", messages=[
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    text = serving.tokenizer.decode(serving.render_chat(request))
    # A call without arguments (as our own named choice can answer) goes back as an empty object.
    for empty in ("", None, "null"):
        no_args = ChatCompletionRequest(model="tiny", tools=[WEATHER], tool_choice="none", messages=[
            *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": empty}}]}])
        serving.render_chat(no_args)
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    # The arguments reached the template as an object (its .city), the tool's answer as content.
    # (Chat templates render with trim_blocks: no newline after a block tag.)
    assert text.endswith("user: weather in Rome?assistant:  CALLS Rometool: sunnyassistant:")


def test_streamed_token_ids_of_text_a_parser_held_back_go_with_the_next_chunk():
    """Reasoning and tool-call parsers send nothing while a tag may be starting: with
    return_token_ids those tokens' ids are not lost, they go with the next chunk, so each choice's
    ids add up to all it generated."""
    answer = ('<think>hm</think>Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
              '</tool_call>')
    http, engine, serving = _app(answer, parser="hermes", reasoning="qwen3")
    with http.stream("POST", "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": [WEATHER],
                                                           "n": 2, "stream": True, "return_token_ids": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    generated = [*serving.tokenizer.encode(answer), serving.tokenizer.eos_token_id]
    for index in (0, 1):
        mine = [e for e in events if e["choices"][0]["index"] == index]
        ids = [t for e in mine for t in e["choices"][0].get("token_ids") or ()]
        assert ids == generated
        assert len(mine) - 1 < len(ids)  # some chunks carry the ids of held-back tokens
        assert mine[0]["prompt_token_ids"] == engine.requests[0].prompt_token_ids
        assert "token_ids" not in mine[0]["choices"][0]  # (the role chunk, as vLLM's)


def test_a_request_ends_at_the_tokenizers_eos_and_the_models_others_are_stop_ids():
    """vLLM's primary EOS is the tokenizer's; a model's further EOS ids (Llama 3.1 lists
    <|end_of_text|> before the tokenizer's <|eot_id|>) stop it as stop ids, named as stop_reason."""
    from router.serving import OpenAIServing, ServingSettings

    http, engine, serving = _app("Hi.")
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}).status_code == 200
    assert engine.requests[0].eos_token_id == serving.tokenizer.eos_token_id
    other = serving.tokenizer.eos_token_id + 1
    llama_style = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=512, eos_token_ids=(other, 0)),
                                serving.client,
                                serving.tokenizer, RoundRobinPolicy())
    assert llama_style.eos_token_id == serving.tokenizer.eos_token_id


@pytest.mark.parametrize(("parser", "answer"), [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome",}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome",}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome",}'),
    ("pythonic", "[get_weather(city=1e999)]"),  # (infinity: no JSON number for it)
])
def test_a_whole_answer_whose_call_is_not_json_is_its_text(parser, answer):
    """vLLM's parsers answer a call they cannot read with the model's text and finish reason stop:
    a client would fail on json.loads(arguments)."""
    http, _, _ = _app(answer, parser=parser)
    choice = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                     "tools": [WEATHER]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert choice["message"]["content"] == answer


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_hermes_reads_arguments_written_as_parameters(step):
    text = '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    _streamed_and_whole_agree(HermesToolCallParser, text, step, "", {0: {"name": "f", "arguments": '{"a": 1}'}})


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_calls_a_mistral_server_is_made_to_make_have_its_9_character_ids(tool_choice):
    answer = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]' if tool_choice == "required" \
        else '{"city": "Rome"}'
    http, _, _ = _app(answer, parser="mistral")
    body = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": tool_choice}
    [call] = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    [first] = [d for d in _deltas(http, {**body, "stream": True}) if d["delta"].get("tool_calls")][:1]
    assert len(first["delta"]["tool_calls"][0]["id"]) == 9


def test_an_earlier_calls_arguments_nested_past_pythons_limit_are_a_400():
    http, _, _ = _app("ok")
    deep = "[" * 100_000 + "]" * 100_000
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "tools": [WEATHER],
                                                "tool_choice": "none"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_call_whose_arguments_nest_past_pythons_limit_is_text_not_a_500():
    deep = "[" * 100_000 + "]" * 100_000
    text = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    assert collect(HermesToolCallParser(), text) == (text, [])


def test_the_servers_disable_any_whitespace_applies_to_every_constraint():
    """vLLM's --structured-outputs-config disable_any_whitespace: every output constraint (a named
    tool's arguments here, and response_format) leaves optional whitespace out, as vLLM's xgrammar
    backend reads only the server's setting; requests without a constraint are left alone."""
    http, engine, serving = _app('{"city": "Rome"}')
    serving.settings.structured_outputs_disable_any_whitespace = True
    for body in ({"tools": [WEATHER], "tool_choice": NAMED}, {"response_format": {"type": "json_object"}},
                 {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}}, {}):
        response = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})
        assert response.status_code == 200, response.text
    assert [(r.sampling_params.structured_output or {}).get("disable_any_whitespace") for r in engine.requests] == [
        True, True, True, None]
