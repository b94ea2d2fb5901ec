"""The qwen3_coder tool-call parser (Qwen3-Coder's XML-like calls): streamed in any split equals
whole, values read by the request's tool schema as vLLM reads them, cut-off and malformed calls,
and /v1/chat/completions through the real app with the request's tools reaching the parser."""

from __future__ import annotations

import json
import random

import pytest

from router.chat_parsing import ChatOutputParser
from router.parsed_output import ParsedDelta
from router.tool_parsers import Qwen3CoderToolCallParser, create_tool_call_parser, qwen3_coder_value

from .test_tool_calling import MESSAGES, _app, _deltas, merged_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
    "threshold": {"type": "number"}, "hours": {"type": "array", "items": {"type": "integer"}},
    "options": {"type": "object"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "limit": {"type": ["integer", "null"]}}}}}
WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}
TOOLS = [WEATHER, WRITE]


def call(name: str, *params: tuple[str, str]) -> str:
    """A call as Qwen3-Coder's chat template writes it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def whole(text: str, tools: list[dict] | None = TOOLS, make=Qwen3CoderToolCallParser,
          **kwargs) -> tuple[str | None, list[dict[str, str]]]:
    """``make``: the parser's class (each XML-like format's tests share these helpers)."""
    answer = ChatOutputParser(None, make(tools), **kwargs).whole(text)
    return answer.content, [c["function"] for c in answer.tool_calls]


def streamed(text: str, pieces: list[int], tools: list[dict] | None = TOOLS,
             make=Qwen3CoderToolCallParser, id_prefix: str = "chatcmpl-tool-") -> tuple[str, list[dict[str, str]]]:
    """Feed ``text`` in pieces of the given sizes, merging the deltas as a client does."""
    choice = ChatOutputParser(None, make(tools))
    out, at = ParsedDelta(), 0
    for size in pieces:
        out.extend(choice.feed(text[at:at + size]))
        at += size
    out.extend(choice.feed(text[at:]))
    out.extend(choice.finish())
    calls: list[dict[str, str]] = []
    for delta in out.tool_calls:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["id"].startswith(id_prefix)
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return out.content, calls


def random_pieces(text: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    pieces, total = [], 0
    while total < len(text):
        pieces.append(rng.randint(1, 9))
        total += pieces[-1]
    return pieces


def agree(text: str, content: str, calls: list[tuple[str, dict]], tools: list[dict] | None = TOOLS,
          make=Qwen3CoderToolCallParser, id_prefix: str = "chatcmpl-tool-") -> None:
    """Whole, one character at a time and in random pieces: the same content and calls, whose
    arguments are ``json.dumps`` of the values (as vLLM writes them)."""
    expected = [{"name": name, "arguments": json.dumps(args, ensure_ascii=False)} for name, args in calls]
    assert whole(text, tools, make) == ((content if content or not calls else None), expected)
    assert streamed(text, [1] * len(text), tools, make, id_prefix) == (content, expected)
    for seed in range(30):
        assert streamed(text, random_pieces(text, seed), tools, make, id_prefix) == (content, expected), seed


SEVERAL = ("Let me check both.\n\n"
           + call("get_weather", ("city", "Paris"), ("days", "3"), ("celsius", "true"))
           + "\n" + call("write_file", ("path", "a.py"), ("content", "def f():\n    return '<tool>'\n"))
           + "\nDone.")


def test_streamed_in_any_split_equals_whole_with_several_calls():
    agree(SEVERAL, "Let me check both.\nDone.", [
        ("get_weather", {"city": "Paris", "days": 3, "celsius": True}),
        # A string keeps its newlines but the one after the opening tag and the one before the closing.
        ("write_file", {"path": "a.py", "content": "def f():\n    return '<tool>'\n"})])


def test_calls_alone_have_no_content_and_parallel_tool_calls_false_keeps_the_first():
    two = call("get_weather", ("city", "Rome")) + "\n" + call("get_weather", ("city", "Oslo")) + "\n"
    agree(two, "", [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})])
    assert whole(two, parallel_tool_calls=False)[1] == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    agree(call("get_weather"), "", [("get_weather", {})])  # no parameters: an empty object


@pytest.mark.parametrize(("key", "raw", "value"), [
    ("city", "\nSão Paulo\n", "\nSão Paulo\n"),  # only one newline at each end is layout
    ("city", "  42 ", "  42 "),  # a string is the text, whatever it looks like
    ("city", "null", "null"),  # a string that admits no null keeps "null"
    ("days", "7", 7),
    ("days", "seven", "seven"),  # not an integer: the text
    ("days", "3.5", "3.5"),
    ("days", "NULL", None),
    ("threshold", "2.5", 2.5),
    ("threshold", "3.0", 3),  # a whole number is an integer
    ("threshold", "1e999", "1e999"),  # no JSON number for it: the text
    ("threshold", "None", None),
    ("celsius", "True", True),
    ("celsius", "yes", False),  # anything but true is false
    ("hours", "[1, 2, 3]", [1, 2, 3]),
    ("hours", "(1, 2)", [1, 2]),  # not JSON: a Python literal
    ("hours", "[1, 2", "[1, 2"),  # neither: the text
    ("options", '{"unit": "C", "alerts": null}', {"unit": "C", "alerts": None}),
    ("options", "{'unit': 'C', 'alerts': None}", {"unit": "C", "alerts": None}),
    ("options", '"{\'unit\': \'C\'}"', {"unit": "C"}),  # JSON of a Python repr
    ("options", "{1, 2}", "{1, 2}"),  # a set JSON cannot carry: the text
    ("note", "null", None),  # anyOf string or null: null is null
    ("note", "warm", "warm"),
    ("limit", "5", 5),  # a list of types reads as anyOf
    ("limit", "none", None),
    ("country", "42", "42"),  # not in the tool's schema: a string
])
def test_values_are_read_by_the_parameters_type(key, raw, value):
    agree(call("get_weather", (key, raw)), "", [("get_weather", {key: value})])


def test_a_function_the_request_lacks_gets_strings_and_so_does_a_request_without_tools():
    text = call("get_time", ("days", "3"), ("utc", "true"))
    agree(text, "", [("get_time", {"days": "3", "utc": "true"})])
    agree(call("get_weather", ("days", "3")), "", [("get_weather", {"days": "3"})], tools=None)


def test_type_readings_of_other_schemas():
    assert qwen3_coder_value("3", {"type": "whatever"}) == 3  # another type: a Python literal
    assert qwen3_coder_value("Paris", {"type": "whatever"}) == "Paris"
    assert qwen3_coder_value("null", {"type": "null"}) is None
    assert qwen3_coder_value("3", {"description": "no type"}) == "3"  # no type: a string
    assert qwen3_coder_value("3", {"type": "int64"}) == 3 and qwen3_coder_value("3", {"type": " Float"}) == 3
    assert qwen3_coder_value("[1]", {"type": "List[int]"}) == [1]


def test_content_is_released_at_once_but_what_may_be_a_tag_and_a_call_as_its_parts_end():
    parser = Qwen3CoderToolCallParser(TOOLS)
    assert parser.feed("Sure <tool").content == "Sure"
    assert parser.feed("box> ").content == " <toolbox>"
    # The name goes out as soon as it is read, each parameter when it ends, and the brace at the end.
    delta = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert delta.content == "" and delta.tool_calls[0]["function"] == {"name": "get_weather", "arguments": "{"}
    assert parser.feed("is\n</param").tool_calls == []
    assert parser.feed("eter>\n<parameter=days>\n2\n</parameter>\n").tool_calls == [
        {"index": 0, "function": {"arguments": '"city": "Paris"'}},
        {"index": 0, "function": {"arguments": ', "days": 2'}}]
    assert parser.feed("</function>\n</tool_call>").tool_calls == [{"index": 0, "function": {"arguments": "}"}}]
    assert parser.finish() == ParsedDelta()


@pytest.mark.parametrize(("text", "content", "calls"), [
    # Cut off in a value: the value ends where the text does, and the object is closed.
    ("Hi " + "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\nx = ",
     "Hi", [("write_file", {"path": "a.py", "content": "x = "})]),
    # Cut off in the value's closing tag: the tag begun is not part of the value.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</param",
     "", [("get_weather", {"city": "Rome"})]),
    # Cut off in a parameter's name: that parameter is dropped.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=da",
     "", [("get_weather", {"city": "Rome"})]),
    # No closing tags at all, and a missing </parameter>: the next tag ends the value.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>",
     "", [("get_weather", {"city": "Rome", "days": 2})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</tool_call>\nAfter.",
     "\nAfter.", [("get_weather", {"city": "Rome"})]),
    # Cut off before the name ends: no call, the text is content.
    ("Hi <tool_call>\n<function=get_wea", "Hi <tool_call>\n<function=get_wea", []),
    ("Hi <tool_call>\n", "Hi <tool_call>\n", []),
])
def test_a_cut_off_or_malformed_call(text, content, calls):
    agree(text, content, calls)


@pytest.mark.parametrize("text", [
    "Use a <tool> tag, or <tool_", "plain answer", "  ",
    "a <tool_call>not a call</tool_call> b",  # a block without a function is text
    "<tool_call>\n<function={{ tool.name }}>\n</function>\n</tool_call>",  # no name (a template's text)
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "Write <function=f> outside a block",  # only a block holds calls
])
def test_text_that_is_not_a_call_is_content(text):
    agree(text, text, [])


def test_two_functions_in_one_block_are_two_calls_and_text_after_a_function_in_it_is_not_content():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\nignored\n"
            "<function=get_weather>\n<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>")
    agree(text, "", [("get_weather", {"city": "Rome"}), ("get_weather", {"days": 1})])


def test_the_factory_gives_the_parser_the_requests_tools():
    parser = create_tool_call_parser("auto", "qwen3_coder", TOOLS)
    assert isinstance(parser, Qwen3CoderToolCallParser)
    out = parser.feed(call("get_weather", ("days", "4")))
    out.extend(parser.finish())
    assert "".join(d["function"]["arguments"] for d in out.tool_calls) == '{"days": 4}'


def test_auto_tool_choice_with_the_qwen3_coder_parser_reads_the_requests_schema():
    answer = "Checking.\n" + call("get_weather", ("city", "Rome"), ("days", "2"))
    http, _, _ = _app(answer, parser="qwen3_coder")
    # (A small schema: the tiny test model's context holds the prompt, which shows the tools.)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    body = {"model": "tiny", "messages": MESSAGES, "tools": [tool]}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    arguments = '{"city": "Rome", "days": 2}'
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}
    deltas = _deltas(http, body)
    assert merged_calls(deltas) == [{"name": "get_weather", "arguments": arguments}]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert deltas[-1]["finish_reason"] == "tool_calls"
