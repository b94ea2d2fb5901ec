"""The glm45 tool-call parser (GLM-4.5 to 4.7's ``<tool_call>NAME`` blocks of ``<arg_key>`` /
``<arg_value>`` pairs): streamed in any split equals whole, values read as vLLM's glm45 parser reads
them, cut-off and malformed calls, and /v1/chat/completions through the real app with the glm45
reasoning parser beside it."""

from __future__ import annotations

import pytest

from router.glm45_tool_parser import Glm45ToolCallParser, glm45_value
from router.parsed_output import ParsedDelta
from router.reasoning_parsers import create_reasoning_parser
from router.tool_parsers import create_tool_call_parser

from .test_tool_calling import MESSAGES, _app, _deltas, merged_calls
from .test_tool_parsers_qwen3_coder import TOOLS, whole
from .test_tool_parsers_qwen3_coder import agree as agree_with


def call(name: str, *args: tuple[str, str], same_line: bool = False) -> str:
    """A call as GLM-4.5's chat template writes it (``same_line``: GLM-4.7's, the first key on the
    name's line)."""
    body = "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n" for key, value in args)
    return f"<tool_call>{name}{'' if same_line and args else chr(10)}{body}</tool_call>"


def agree(text: str, content: str, calls: list[tuple[str, dict]], tools: list[dict] | None = TOOLS) -> None:
    agree_with(text, content, calls, tools, make=Glm45ToolCallParser)


def test_streamed_in_any_split_equals_whole_with_several_calls():
    text = ("Let me check both.\n"
            + call("get_weather", ("city", "Paris"), ("days", "3"), ("celsius", "true"))
            + "\n" + call("write_file", ("path", "a.py"), ("content", "def f():\n    return '<tool>'\n"),
                          same_line=True)
            + "\nDone.")
    agree(text, "Let me check both.\nDone.", [
        ("get_weather", {"city": "Paris", "days": 3, "celsius": True}),
        # A string parameter's value is exactly what was written, newlines included.
        ("write_file", {"path": "a.py", "content": "def f():\n    return '<tool>'\n"})])


def test_calls_alone_have_no_content_and_a_call_without_arguments_is_an_empty_object():
    two = call("get_weather", ("city", "Rome")) + "\n" + call("get_weather", ("city", "Oslo"))
    agree(two, "", [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})])
    assert whole(two, make=Glm45ToolCallParser, parallel_tool_calls=False)[1] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    agree(call("get_time"), "", [("get_time", {})])
    agree("<tool_call>get_time</tool_call>", "", [("get_time", {})])  # (no line break either)


@pytest.mark.parametrize(("key", "raw", "value"), [
    ("city", " São Paulo\n", " São Paulo\n"),  # a string parameter: exactly as written
    ("city", "42", "42"),
    ("days", "7", 7),
    ("days", " 7 ", 7),  # any other: the blanks around it are layout
    ("days", "seven", "seven"),  # not JSON, not a literal: the text
    ("threshold", "2.5", 2.5),
    ("celsius", "false", False),
    ("celsius", "True", True),  # a Python literal
    ("hours", "[1, 2, 3]", [1, 2, 3]),
    ("hours", "(1, 2)", [1, 2]),
    ("options", '{"unit": "C", "alerts": null}', {"unit": "C", "alerts": None}),
    ("options", "{1, 2}", "{1, 2}"),  # a set JSON cannot carry: the text
    ("note", "null", None),  # (anyOf: not declared a string, so read as JSON)
    ("country", "42", 42),  # a parameter the tool does not declare is read as JSON too
    ("country", "Italy", "Italy"),
])
def test_values_are_read_as_vllms_glm45_parser_reads_them(key, raw, value):
    agree(call("get_weather", (key, raw)), "", [("get_weather", {key: value})])


def test_a_function_the_request_lacks_and_a_request_without_tools_read_values_as_json():
    agree(call("get_time", ("days", "3"), ("zone", "UTC")), "", [("get_time", {"days": 3, "zone": "UTC"})])
    agree(call("get_weather", ("city", "3")), "", [("get_weather", {"city": 3})], tools=None)
    assert glm45_value("NaN", {"type": "number"}) == "NaN"  # (JSON has no NaN: the text)


def test_content_is_released_at_once_but_what_may_be_a_tag_and_a_call_as_its_parts_end():
    parser = Glm45ToolCallParser(TOOLS)
    assert parser.feed("Sure <tool").content == "Sure"
    assert parser.feed("box> ").content == " <toolbox>"
    assert parser.feed("<tool_call>get_wea").tool_calls == []
    assert parser.feed("ther\n").tool_calls == []  # (a name, if a key or the block's end follows)
    delta = parser.feed("<arg_key>days</arg_key>\n<arg_value>3</arg_va")
    assert delta.content == "" and delta.tool_calls[0]["function"] == {"name": "get_weather", "arguments": "{"}
    assert len(delta.tool_calls) == 1  # (an integer goes out whole, once it has ended)
    # A string parameter's value streams as it is written, escaped for JSON.
    assert parser.feed('lue>\n<arg_key>city</arg_key><arg_value>Par').tool_calls == [
        {"index": 0, "function": {"arguments": '"days": 3'}}, {"index": 0, "function": {"arguments": ', "city": "'}},
        {"index": 0, "function": {"arguments": "Par"}}]
    assert parser.feed('is "C"</arg_val').tool_calls == [{"index": 0, "function": {"arguments": 'is \\"C\\"'}}]
    assert parser.feed("ue>\n").tool_calls == [{"index": 0, "function": {"arguments": '"'}}]
    assert parser.feed("</tool_call>").tool_calls == [{"index": 0, "function": {"arguments": "}"}}]
    assert parser.finish() == ParsedDelta()


def test_a_tag_mentioned_in_prose_does_not_hold_the_answer_back_nor_take_the_next_call():
    parser = Glm45ToolCallParser(TOOLS)
    assert parser.feed("GLM wraps calls in <tool_call> tags").content == "GLM wraps calls in"
    assert parser.feed(". It goes on").content == " <tool_call> tags. It goes on"
    text = "Use <tool_call> tags.\n" + call("get_weather", ("city", "Rome")) + "\nOK"
    agree(text, "Use <tool_call> tags.\nOK", [("get_weather", {"city": "Rome"})])
    text = "A <tool_call>line\n" + call("get_weather", ("city", "Rome"))  # (a "name" followed by a new block)
    agree(text, "A <tool_call>line", [("get_weather", {"city": "Rome"})])
    # A "name" line followed by prose is no call, closed or not.
    agree("See <tool_call>Note\nthis is prose.", "See <tool_call>Note\nthis is prose.", [])
    agree("See <tool_call>Note\nprose</tool_call> end", "See <tool_call>Note\nprose</tool_call> end", [])


@pytest.mark.parametrize(("text", "content", "calls"), [
    # Cut off in a value: the value ends where the text does, and the object is closed.
    ("Hi " + "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n"
     "<arg_key>content</arg_key>\n<arg_value>x = ", "Hi", [("write_file", {"path": "a.py", "content": "x = "})]),
    # Cut off in the value's closing tag: the tag begun is not part of the value.
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_va", "",
     [("get_weather", {"city": "Rome"})]),
    # Cut off in a key, or after a key without its value: that argument is dropped.
    ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Rome</arg_value>\n<arg_key>da",
     "", [("get_weather", {"city": "Rome"})]),
    ("<tool_call>get_weather\n<arg_key>days</arg_key>\n</tool_call>After", "After", [("get_weather", {})]),
    # A value without its closing tag ends at the block's end.
    ("<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>2\n</tool_call>", "", [("get_weather", {"days": 2})]),
    # Cut off after the name's line: a call without arguments.
    ("<tool_call>get_time\n", "", [("get_time", {})]),
    # Cut off before the name ends: no call, the text is content.
    ("Hi <tool_call>get_wea", "Hi <tool_call>get_wea", []),
    ("Hi <tool_call>\n", "Hi <tool_call>\n", []),
])
def test_a_cut_off_or_malformed_call(text, content, calls):
    agree(text, content, calls)


@pytest.mark.parametrize("text", [
    "Use a <tool> tag, or <tool_", "plain answer", "  ",
    "a <tool_call>not a call</tool_call> b",  # a "name" with blanks in it is text
    '<tool_call>{"name": "get_weather"}</tool_call>',  # (hermes's JSON is not this format)
    "<tool_call>\n</tool_call>",  # no name
    "<arg_key>city</arg_key><arg_value>Rome</arg_value> outside a block",
])
def test_text_that_is_not_a_call_is_content(text):
    agree(text, text, [])


def test_blanks_around_the_name_are_layout():
    agree("<tool_call>\n get_weather\n<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>", "",
          [("get_weather", {"city": "Rome"})])
    agree("<tool_call>get_weather <arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>", "",
          [("get_weather", {"city": "Rome"})])


def test_the_factories():
    parser = create_tool_call_parser("auto", "glm45", TOOLS)
    assert isinstance(parser, Glm45ToolCallParser)
    out = parser.feed(call("get_weather", ("days", "4")))
    out.extend(parser.finish())
    assert "".join(d["function"]["arguments"] for d in out.tool_calls) == '{"days": 4}'
    # (vLLM's name for GLM-4.7's: the same parser, the name and first key on one line, or no arguments.)
    parser = create_tool_call_parser("auto", "glm47", TOOLS)
    out = parser.feed("<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
                      "<tool_call>get_weather</tool_call>")
    out.extend(parser.finish())
    assert [d["function"].get("name") for d in out.tool_calls if d["function"].get("name")] == ["get_weather"] * 2
    assert "".join(d["function"]["arguments"] for d in out.tool_calls) == '{"days": 3}{}'
    reasoning = create_reasoning_parser("glm45")
    assert reasoning.feed("Just an answer.") == ("", "Just an answer.")  # (no <think>: content)
    reasoning = create_reasoning_parser("glm45")
    assert reasoning.feed("\n<think>Hmm.</think>Yes.") == ("Hmm.", "Yes.")
    assert create_reasoning_parser("glm45", starts_thinking=True).feed("Hmm.</think>Yes.") == ("Hmm.", "Yes.")


def test_glm45_reasoning_and_tool_calls_through_the_app():
    answer = ("<think>The user wants Rome's weather.</think>Checking.\n"
              + call("get_weather", ("city", "Rome"), ("days", "2")))
    http, _, _ = _app(answer, parser="glm45", reasoning="glm45", think_tokens=True)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    body = {"model": "tiny", "messages": MESSAGES, "tools": [tool]}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants Rome's weather."
    assert choice["message"]["content"] == "Checking."
    arguments = '{"city": "Rome", "days": 2}'
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}
    deltas = _deltas(http, body)
    assert merged_calls(deltas) == [{"name": "get_weather", "arguments": arguments}]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "The user wants Rome's weather."
    assert deltas[-1]["finish_reason"] == "tool_calls"
