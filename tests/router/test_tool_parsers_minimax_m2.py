"""The minimax_m2 tool-call parser (MiniMax-M2's ``<minimax:tool_call>`` blocks of ``<invoke>`` /
``<parameter>`` tags) and the minimax_m2 reasoning parsers: streamed in any split equals whole,
values read by the request's tool schema as vLLM's minimax_m2 parser reads them, cut-off and
malformed calls, and /v1/chat/completions through the real app."""

from __future__ import annotations

import pytest

from router.minimax_m2_tool_parser import MiniMaxM2ToolCallParser, minimax_m2_value
from router.parsed_output import ParsedDelta
from router.reasoning_parsers import create_reasoning_parser
from router.tool_parsers import create_tool_call_parser

from .test_tool_calling import MESSAGES, _app, _deltas, merged_calls
from .test_tool_parsers_qwen3_coder import TOOLS, whole
from .test_tool_parsers_qwen3_coder import agree as agree_with


def invoke(name: str, *params: tuple[str, str]) -> str:
    """One call as MiniMax-M2's chat template writes it."""
    body = "".join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in params)
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def agree(text: str, content: str, calls: list[tuple[str, dict]], tools: list[dict] | None = TOOLS) -> None:
    agree_with(text, content, calls, tools, make=MiniMaxM2ToolCallParser)


def test_streamed_in_any_split_equals_whole_with_several_calls_in_a_block():
    text = ("Let me check both.\n\n"
            + block(invoke("get_weather", ("city", "Paris"), ("days", "3"), ("celsius", "true")),
                    invoke("write_file", ("path", "a.py"), ("content", "def f():\n    return '<tool>'")))
            + "\nDone.")
    # (The content is the text before the first block; the blanks before it are layout.)
    agree(text, "Let me check both.", [
        ("get_weather", {"city": "Paris", "days": 3, "celsius": True}),
        ("write_file", {"path": "a.py", "content": "def f():\n    return '<tool>'"})])


def test_calls_alone_have_no_content_and_parallel_tool_calls_false_keeps_the_first():
    two = block(invoke("get_weather", ("city", "Rome")), invoke("get_weather", ("city", "Oslo")))
    agree(two, "", [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})])
    assert whole(two, make=MiniMaxM2ToolCallParser, parallel_tool_calls=False)[1] == [
        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    # Calls in a second block are calls too; text between and after blocks is not content.
    text = block(invoke("get_time")) + "\nand\n" + block(invoke("get_weather", ("city", "Oslo"))) + " bye"
    agree(text, "", [("get_time", {}), ("get_weather", {"city": "Oslo"})])


@pytest.mark.parametrize(("key", "raw", "value"), [
    ("city", " São Paulo\n", "São Paulo"),  # (the blanks around a value are layout)
    ("city", "42", "42"),  # a string parameter: as written
    ("city", "null", None),  # (null words are null, whatever the type)
    ("days", "7", 7),
    ("days", "seven", "seven"),  # not an integer: then JSON, else the text
    ("threshold", "2.5", 2.5),
    ("threshold", "3.0", 3),  # (a whole number as an integer, as vLLM)
    ("celsius", "false", False),
    ("celsius", "Yes", True),
    ("hours", "[1, 2, 3]", [1, 2, 3]),
    ("options", '{"unit": "C", "alerts": null}', {"unit": "C", "alerts": None}),
    ("options", "{'unit': 'C'}", "{'unit': 'C'}"),  # not JSON: the text
    ("note", "a note", "a note"),  # anyOf string / null
    ("limit", "5", 5),  # type [integer, null]
    ("country", "42", "42"),  # a parameter the tool does not declare is a string
])
def test_values_are_read_as_vllms_minimax_m2_parser_reads_them(key, raw, value):
    agree(block(invoke("get_weather", (key, raw))), "", [("get_weather", {key: value})])


def test_schema_types_from_enums_and_options_and_values_json_cannot_carry():
    assert minimax_m2_value("2", {"enum": [1, 2, 3]}) == 2
    assert minimax_m2_value("on", {"oneOf": [{"type": "boolean"}, {"type": "string"}]}) is True
    assert minimax_m2_value("maybe", {"oneOf": [{"type": "boolean"}, {"type": "string"}]}) == "maybe"
    assert minimax_m2_value("NaN", {"type": "number"}) == "NaN"
    assert minimax_m2_value("[1]", {"type": "object"}) == [1]  # (JSON, even of another kind)
    agree(block(invoke("get_time", ("zone", "UTC"))), "", [("get_time", {"zone": "UTC"})], tools=None)
    deep = "[" * 5000 + "]" * 5000  # (nested past what the JSON reader takes: the text, not a crash)
    assert minimax_m2_value(deep, {"type": "array"}) == deep and minimax_m2_value(deep, None) == deep


def test_content_streams_at_once_and_each_call_goes_out_whole_when_it_ends():
    parser = MiniMaxM2ToolCallParser(TOOLS)
    assert parser.feed("Sure <minimax:to").content == "Sure"
    assert parser.feed("ol_call>\n<invoke name=\"get_weather\">\n").content == ""
    assert parser.feed('<parameter name="days">3</parameter>\n</inv').tool_calls == []
    delta = parser.feed("oke>\n")
    assert delta.content == "" and delta.tool_calls[0]["function"] == {"name": "get_weather",
                                                                      "arguments": '{"days": 3}'}
    assert parser.feed("</minimax:tool_call>").tool_calls == []
    assert parser.finish() == ParsedDelta()


@pytest.mark.parametrize(("text", "content", "calls"), [
    # Cut off in a call: no call (as vLLM); the block is text while it has none.
    ("Hi " + "<minimax:tool_call>\n" + '<invoke name="get_weather">\n<parameter name="city">Ro',
     "Hi <minimax:tool_call>\n" + '<invoke name="get_weather">\n<parameter name="city">Ro', []),
    # A call after one that was cut off: the first kept, the second dropped.
    (block(invoke("get_weather", ("city", "Rome"))).removesuffix("</minimax:tool_call>")
     + '<invoke name="get_time">', "", [("get_weather", {"city": "Rome"})]),
    # A call the block's end cuts off is none; the block, holding none, is text.
    ('<minimax:tool_call><invoke name="get_time"></minimax:tool_call> ok',
     '<minimax:tool_call><invoke name="get_time"></minimax:tool_call> ok', []),
    # Names and keys without quotes, and a parameter without its end (dropped).
    ('<minimax:tool_call><invoke name=get_weather><parameter name=days>2</parameter>'
     '<parameter name="city">Rome</invoke></minimax:tool_call>', "", [("get_weather", {"days": 2})]),
    # A value mentioning the tag: each parameter ends at the first </parameter> after it (vLLM's).
    (block(invoke("write_file", ("content", 'see <parameter name="x">1'), ("path", "a.txt"))), "",
     [("write_file", {"content": 'see <parameter name="x">1', "path": "a.txt"})]),
    # A parameter without a name is dropped.
    ('<minimax:tool_call><invoke name="get_time"><parameter name="">v</parameter></invoke></minimax:tool_call>', "",
     [("get_time", {})]),
    # An invoke without a name is no call.
    ('<minimax:tool_call><invoke name="">x</invoke>' + invoke("get_time") + "</minimax:tool_call>", "",
     [("get_time", {})]),
])
def test_a_cut_off_or_malformed_call(text, content, calls):
    agree(text, content, calls)


@pytest.mark.parametrize("text", [
    "Use <minimax:tool_call> tags", "plain answer", "  ", "<minimax:tool_call>\nnothing here</minimax:tool_call>",
    '<invoke name="get_time"></invoke> outside a block',
])
def test_text_that_is_not_a_call_is_content(text):
    agree(text, text, [])


def test_the_factories_and_the_reasoning_parsers():
    parser = create_tool_call_parser("auto", "minimax_m2", TOOLS)
    assert isinstance(parser, MiniMaxM2ToolCallParser)
    out = parser.feed(block(invoke("get_weather", ("days", "4"))))
    out.extend(parser.finish())
    assert [d["function"] for d in out.tool_calls] == [{"name": "get_weather", "arguments": '{"days": 4}'}]
    # minimax_m2: the model writes no <think>: everything up to </think> is reasoning.
    reasoning = create_reasoning_parser("minimax_m2")
    assert reasoning.feed("Hmm, rain.</think>\nYes.") == ("Hmm, rain.", "\nYes.")
    assert create_reasoning_parser("minimax_m2").feed("<think>Hmm.</think>Yes.") == ("Hmm.", "Yes.")
    # minimax_m2_append_think: nothing split off, the thinking kept in the content behind <think>.
    appended = create_reasoning_parser("minimax_m2_append_think")
    assert appended.feed("Hmm.</thi") == ("", "<think>Hmm.</thi")
    assert appended.feed("nk>Yes.") == ("", "nk>Yes.") and appended.finish() == ("", "")
    assert create_reasoning_parser("minimax_m2_append_think").finish() == ("", "<think>")


@pytest.mark.parametrize("reasoning", ["minimax_m2", "minimax_m2_append_think"])
def test_minimax_m2_reasoning_and_tool_calls_through_the_app(reasoning):
    answer = "The user wants Rome's weather.</think>Checking.\n" + block(invoke("get_weather", ("city", "Rome"),
                                                                              ("days", "2")))
    http, _, _ = _app(answer, parser="minimax_m2", reasoning=reasoning, think_tokens=True)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    body = {"model": "tiny", "messages": MESSAGES, "tools": [tool]}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    arguments = '{"city": "Rome", "days": 2}'
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}
    if reasoning == "minimax_m2":
        thinking, content = "The user wants Rome's weather.", "Checking."
    else:
        thinking, content = None, "<think>The user wants Rome's weather.</think>Checking."
    assert choice["message"].get("reasoning_content") == thinking and choice["message"]["content"] == content
    deltas = _deltas(http, body)
    assert merged_calls(deltas) == [{"name": "get_weather", "arguments": arguments}]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == content
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == (thinking or "")
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_append_think_keeps_the_thinking_out_of_a_constrained_answer():
    """A named tool_choice (an output constraint after the thinking): its arguments are the JSON
    alone, the thinking split off as minimax_m2 would, not put in front of them."""
    http, _, _ = _app('Think about Rome.</think>{"city": "Rome"}', parser="minimax_m2",
                      reasoning="minimax_m2_append_think", think_tokens=True)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    body = {"model": "tiny", "messages": MESSAGES, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert message["reasoning_content"] == "Think about Rome."
