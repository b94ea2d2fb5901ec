"""The deepseek_v3, deepseek_v31 and kimi_k2 tool-call parsers (calls in a marked section after the
content): streamed in any split equals whole, arguments released as written, DeepSeek-V3's fence
left out, Kimi K2's ids kept, cut-off and malformed sections; and the app answering with them."""

from __future__ import annotations

import pytest

from router.parsed_output import ParsedDelta
from router.reasoning_parsers import create_reasoning_parser
from router.sectioned_tool_parsers import DeepSeekV3ToolCallParser, DeepSeekV31ToolCallParser, KimiK2ToolCallParser
from router.tool_parsers import create_tool_call_parser

from .test_tool_calling import MESSAGES, _app, _deltas, merged_calls
from .test_tool_parsers_qwen3_coder import agree as agree_with
from .test_tool_parsers_qwen3_coder import streamed

B, S = "\uff5c", "\u2581"


def marker(words: str) -> str:
    return f"<{B}{words.replace(' ', S)}{B}>"


CALLS_BEGIN, CALLS_END = marker("tool calls begin"), marker("tool calls end")
CALL_BEGIN, CALL_END, SEP = marker("tool call begin"), marker("tool call end"), marker("tool sep")


def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def kimi_call(call_id: str, args: str) -> str:
    return f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def kimi_section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


def agree(parser, text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    agree_with(text, content, calls, None, make=lambda _tools: parser(),
               id_prefix="functions." if parser is KimiK2ToolCallParser else "chatcmpl-tool-")


WEATHER = '{"city": "Rome", "days": 2}'


@pytest.mark.parametrize(("parser", "text"), [
    (DeepSeekV3ToolCallParser, f"Let me check.{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}\n"
                               f"{v3_call('get_time', '{}')}{CALLS_END}"),
    (DeepSeekV31ToolCallParser, f"Let me check.{CALLS_BEGIN}{v31_call('get_weather', WEATHER)}"
                                f"{v31_call('get_time', '{}')}{CALLS_END}"),
    (KimiK2ToolCallParser, "Let me check." + kimi_section(kimi_call("functions.get_weather:0", WEATHER),
                                                          kimi_call("functions.get_time:1", "{}"))),
], ids=["deepseek_v3", "deepseek_v31", "kimi_k2"])
def test_streamed_in_any_split_equals_whole(parser, text):
    agree(parser, text, "Let me check.", [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {})])
    agree(parser, text.replace("Let me check.", ""), "", [("get_weather", {"city": "Rome", "days": 2}),
                                                          ("get_time", {})])


def test_arguments_go_out_as_written_and_deepseek_v3s_fence_is_held_back():
    parser = DeepSeekV3ToolCallParser()
    assert parser.feed("Sure." + CALLS_BEGIN[:3]).content == "Sure."
    delta = parser.feed(CALLS_BEGIN[3:] + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n{\"ci")
    assert delta.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert delta.tool_calls[1:] == [{"index": 0, "function": {"arguments": '{"ci'}}]
    assert parser.feed('ty": "Rome"}\n``').tool_calls == [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}]
    assert parser.feed("`" + CALL_END + CALLS_END).tool_calls == []
    assert parser.finish() == ParsedDelta()


def test_kimi_k2_calls_keep_the_ids_they_write():
    text = kimi_section(kimi_call("functions.get_weather:0", WEATHER), kimi_call("functions.get_weather:1", "{}"))
    parser = KimiK2ToolCallParser()
    out = parser.feed(text)
    out.extend(parser.finish())
    assert [d["id"] for d in out.tool_calls if "id" in d] == ["functions.get_weather:0", "functions.get_weather:1"]
    assert [d["function"]["name"] for d in out.tool_calls if "id" in d] == ["get_weather", "get_weather"]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    # Cut off in the arguments: what was written (a whole answer whose arguments are not JSON is text).
    (DeepSeekV31ToolCallParser, f"Hi{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}" + '{"city": "Rome"}', "Hi",
     [("get_weather", {"city": "Rome"})]),
    (DeepSeekV3ToolCallParser, f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n", "", [("get_time", {})]),
    # A header that is no call is dropped; the section's other calls stand.
    (DeepSeekV31ToolCallParser, f"{CALLS_BEGIN}{CALL_BEGIN}not a name{SEP}{{}}{CALL_END}"
                                f"{v31_call('get_time', '{}')}{CALLS_END}", "", [("get_time", {})]),
    (KimiK2ToolCallParser, kimi_section(kimi_call("no_index", "{}"), kimi_call("functions.get_time:0", "{}")), "",
     [("get_time", {})]),
    # A call without its end marker ends where the next call, or the section's end, begins.
    (KimiK2ToolCallParser, "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>"
                           '{"x": 1}' + kimi_call("functions.b:1", '{"y": 2}') + "<|tool_calls_section_end|>", "",
     [("a", {"x": 1}), ("b", {"y": 2})]),
    (DeepSeekV31ToolCallParser, f'{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{{"a": 1}}{CALLS_END}\nDone.', "\nDone.",
     [("get_time", {"a": 1})]),
    # Text after the section is content.
    (KimiK2ToolCallParser, kimi_section(kimi_call("functions.get_time:0", "{}")) + " Done.", " Done.",
     [("get_time", {})]),
    # Without the section's marker, the markers are text.
    (DeepSeekV31ToolCallParser, v31_call("get_time", "{}"), v31_call("get_time", "{}"), []),
])
def test_cut_off_and_malformed_sections(parser, text, content, calls):
    agree(parser, text, content, calls)


def test_the_factory_and_the_app():
    assert isinstance(create_tool_call_parser("auto", "deepseek_v3"), DeepSeekV3ToolCallParser)
    assert isinstance(create_tool_call_parser("auto", "kimi_k2"), KimiK2ToolCallParser)
    answer = "Checking." + CALLS_BEGIN + v31_call("get_weather", WEATHER) + CALLS_END
    http, _, _ = _app(answer, parser="deepseek_v31", special_tokens=(CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": MESSAGES, "tools": [tool]}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": WEATHER}
    deltas = _deltas(http, body)
    assert merged_calls(deltas) == [{"name": "get_weather", "arguments": WEATHER}]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking."
    assert streamed(answer, [3] * 40, None, make=lambda _tools: DeepSeekV31ToolCallParser())[1] == [
        {"name": "get_weather", "arguments": WEATHER}]


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_their_reasoning_parsers_read_thinking_opened_by_the_answer_or_the_prompt(name):
    assert create_reasoning_parser(name).feed("Plain answer.") == ("", "Plain answer.")  # (V3-0324: no thinking)
    assert create_reasoning_parser(name).feed("<think>Hmm.</think>Yes.") == ("Hmm.", "Yes.")
    # DeepSeek-V3.1 with {"thinking": true}: its template ends the prompt with <think>.
    assert create_reasoning_parser(name, starts_thinking=True).feed("Hmm.</think>Yes.") == ("Hmm.", "Yes.")
