"""Reasoning parsers: thinking split from content, streamed in every split as whole, and through
the chat endpoint (with the engine's side played by a script), alone and before a tool call."""

from __future__ import annotations

import json

import pytest

from router.chat_parsing import ChatOutputParser
from router.reasoning_parsers import create_reasoning_parser
from router.tool_parsers import HermesToolCallParser

from .test_tool_calling import MESSAGES, WEATHER, _app, merged_calls


def _streamed(name: str, text: str, step: int) -> tuple[str, str]:
    parser = create_reasoning_parser(name)
    reasoning = content = ""
    for i in range(0, len(text), step):
        r, c = parser.feed(text[i:i + step])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    # DeepSeek-R1's template opens <think> in the prompt: the answer starts inside it.
    ("deepseek_r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "Still thinking <", ("Still thinking <", "")),  # cut off: all reasoning
    ("deepseek_r1", "", ("", "")),
    ("qwen3", "<think>hmm</think>Paris.", ("hmm", "Paris.")),
    ("qwen3", "  <think>a < b</thinker></think>", ("a < b</thinker>", "")),
    ("qwen3", "Paris. </think> is a tag", ("", "Paris. </think> is a tag")),  # no opening tag: all content
    ("qwen3", "<thi", ("", "<thi")),
    ("mistral", "[THINK]Let me see.[/THINK]Paris.", ("Let me see.", "Paris.")),
    ("mistral", "Paris. [/THINK] is a tag", ("", "Paris. [/THINK] is a tag")),  # no opening tag: all content
    ("mistral", "[THINK]cut off [/THI", ("cut off [/THI", "")),
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_reasoning_parsers_split_thinking_from_content(name, text, expected, step):
    assert _streamed(name, text, step) == expected
    whole = ChatOutputParser(create_reasoning_parser(name), None).whole(text)
    assert (whole.reasoning or "", whole.content or "") == expected


def test_reasoning_then_tool_calls_and_what_a_whole_answer_keeps():
    text = '<think>need weather</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    answer = ChatOutputParser(create_reasoning_parser("qwen3"), HermesToolCallParser()).whole(text)
    assert answer.reasoning == "need weather" and answer.content is None  # (the newline is not content)
    assert answer.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    # Cut off while thinking: reasoning only, no content.
    cut = ChatOutputParser(create_reasoning_parser("deepseek_r1"), None).whole("so far")
    assert (cut.reasoning, cut.content) == ("so far", None)
    hidden = ChatOutputParser(create_reasoning_parser("deepseek_r1"), None, include_reasoning=False).whole(
        "x</think>y")
    assert (hidden.reasoning, hidden.content) == (None, "y")


def _deltas(http, body):
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]


def test_the_chat_endpoint_returns_reasoning_content_whole_and_streamed():
    http, _, _ = _app("<think>The capital of Italy.</think>Rome.", reasoning="qwen3")
    body = {"model": "tiny", "messages": MESSAGES}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The capital of Italy.", "Rome.")
    assert message["reasoning"] == "The capital of Italy."  # (vLLM's current name, beside its older one)
    deltas = _deltas(http, body)
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "The capital of Italy."
    assert all(d["delta"].get("reasoning") == d["delta"].get("reasoning_content") for d in deltas)
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Rome."
    assert deltas[-1]["finish_reason"] == "stop"
    hidden = http.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()
    assert hidden["choices"][0]["message"]["reasoning_content"] is None
    assert hidden["choices"][0]["message"]["content"] == "Rome."
    hidden_deltas = _deltas(http, {**body, "include_reasoning": False})
    assert not any(d["delta"].get("reasoning_content") for d in hidden_deltas)
    assert "".join(d["delta"].get("content") or "" for d in hidden_deltas) == "Rome."
    assert len(deltas) > 4  # streamed token by token


def test_hidden_reasoning_does_not_show_through_logprobs_or_token_ids():
    """include_reasoning false: the thinking's tokens would be readable in logprobs and token ids,
    so the answer has neither, whole or streamed (vLLM's rule); the prompt's ids still come."""
    http, _, _ = _app("<think>secret plan</think>Rome.", reasoning="qwen3")
    body = {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    shown = http.post("/v1/chat/completions", json=body).json()
    assert shown["choices"][0]["logprobs"]["content"] and shown["choices"][0]["token_ids"]
    hidden = http.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()
    choice = hidden["choices"][0]
    assert (choice["message"]["content"], choice["logprobs"], choice.get("token_ids")) == ("Rome.", None, None)
    assert hidden["prompt_token_ids"] == shown["prompt_token_ids"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "include_reasoning": False, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Rome."
    assert not any(d.get("logprobs") or d.get("token_ids") for d in deltas)
    assert not any("secret" in json.dumps(c) for c in chunks)
    assert chunks[0]["prompt_token_ids"] == shown["prompt_token_ids"]


def test_usage_counts_the_thinkings_tokens_whole_and_streamed():
    """completion_tokens_details.reasoning_tokens (OpenAI's and vLLM's): the tokens before the one
    that closes the thinking, the tags not counted; null without a reasoning parser."""
    http, _, serving = _app("<think>Short question.</think>Paris.", reasoning="qwen3", think_tokens=True)
    body = {"model": "tiny", "messages": MESSAGES, "n": 2}
    thought = len(serving.tokenizer.encode("Short question.", add_special_tokens=False))
    usage = http.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * thought}
    assert usage["completion_tokens"] > 2 * thought
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        last = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")][-1]
    assert last["usage"] == usage
    plain, _, _ = _app("Paris.", think_tokens=True)
    assert plain.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens_details"] is None
    # (qwen3 may answer without thinking: no reasoning tokens, though no </think> closed anything)
    direct, _, _ = _app("Paris.", reasoning="qwen3", think_tokens=True)
    usage = direct.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    unclosed, _, _ = _app("<think>Still thinking", reasoning="qwen3", think_tokens=True)
    usage = unclosed.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] - 2  # (2 tags)


def test_reasoning_before_an_auto_tool_call_and_none_under_an_output_constraint():
    answer = '<think>weather</think><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    http, _, _ = _app(answer, parser="hermes", reasoning="qwen3")
    choice = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                     "tools": [WEATHER]}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "weather"
    assert choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    deltas = _deltas(http, {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER]})
    assert merged_calls(deltas) == [{"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert deltas[-1] == {"index": 0, "delta": {"role": None, "content": None}, "logprobs": None,
                          "finish_reason": "tool_calls", "stop_reason": None}


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content", "thinking"])
def test_an_earlier_answers_thinking_reaches_the_template_under_either_name(name):
    """Clients send an answer's thinking back under the name they read it from; the template reads
    reasoning_content (Qwen3's), reasoning, or thinking (gpt-oss's)."""
    http, engine, serving = _app("ok")
    serving.tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {% if m.reasoning_content %}[rc {{ m.reasoning_content }}]{% endif %}"
        "{% if m.reasoning %}[r {{ m.reasoning }}]{% endif %}{% if m.thinking %}[t {{ m.thinking }}]{% endif %}"
        "{{ m.content }}\n{% endfor %}assistant:")
    messages = [*MESSAGES, {"role": "assistant", "content": "Sunny.", name: "looked it up"},
                {"role": "user", "content": "thanks"}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    prompt = serving.tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert "assistant: [rc looked it up][r looked it up][t looked it up]Sunny." in prompt



def test_an_output_constraint_starts_after_deepseek_r1s_thinking_and_rules_out_qwen3s():
    body = {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_object"}}
    # deepseek_r1 thinks first: the engine starts the grammar after the "</think>" token, and the
    # thinking is split off the JSON.
    http, engine, serving = _app('Braces next.</think>{"a": 1}', reasoning="deepseek_r1", think_tokens=True)
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Braces next.", '{"a": 1}')
    params = engine.requests[0].sampling_params
    assert params.structured_output_after == [serving.tokenizer.convert_tokens_to_ids("</think>")]
    assert params.structured_output == {"json_object": True}
    # A prompt that closed the thinking where the answer begins (as a template with thinking switched
    # off writes it; here an assistant turn the answer continues): no wait, no split.
    closed = {**body, "messages": [*MESSAGES, {"role": "assistant", "content": "<think></think>"}],
              "add_generation_prompt": False, "continue_final_message": True}
    http, engine, _ = _app('{"a": "x</think>"}', reasoning="deepseek_r1", think_tokens=True)
    message = http.post("/v1/chat/completions", json=closed).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, '{"a": "x</think>"}')
    assert engine.requests[0].sampling_params.structured_output_after is None
    free = http.post("/v1/chat/completions", json={**closed, "response_format": None}).json()
    assert free["choices"][0]["message"]["reasoning_content"] is None
    # A vocabulary where "</think>" is no single token (the engine could not see it): the grammar
    # holds from the first token, and nothing is parsed as thinking.
    http, engine, _ = _app('{"a": 1}', reasoning="deepseek_r1")
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, '{"a": 1}')
    assert engine.requests[0].sampling_params.structured_output_after is None
    # Without the tags as tokens, a qwen3 answer's grammar applies from the first token, and the text
    # is content.
    http, engine, _ = _app('{"a": "<think>x</think>"}', reasoning="qwen3")
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, '{"a": "<think>x</think>"}')
    assert engine.requests[0].sampling_params.structured_output_after is None
    # With them, a qwen3 answer may think first (as vLLM lets it): a first <think> makes the grammar
    # wait for </think>; an answer that does not open it is held to the grammar from its first token.
    for answer, split in (('<think>Braces.</think>{"a": 1}', ("Braces.", '{"a": 1}')),
                          ('{"a": 1}', (None, '{"a": 1}'))):
        http, engine, serving = _app(answer, reasoning="qwen3", think_tokens=True)
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == split
        params = engine.requests[0].sampling_params
        assert params.structured_output_after == [serving.tokenizer.convert_tokens_to_ids("</think>")]
        assert params.structured_output_may_open == serving.tokenizer.convert_tokens_to_ids("<think>")


def test_only_the_prompts_end_closes_or_opens_the_thinking():
    """An earlier turn's thinking, written back by the template (Qwen3's does after a tool result),
    closes nothing for the next answer; a prompt that ends by opening <think> (Qwen3-2507's
    thinking-only templates) makes the answer's text up to </think> reasoning."""
    earlier = [*MESSAGES, {"role": "assistant", "content": "<think>Look it up.</think>Rome is sunny."},
               {"role": "user", "content": "and Paris?"}]
    http, engine, serving = _app("<think>Again.</think>Paris is cloudy.", reasoning="qwen3", think_tokens=True)
    message = http.post("/v1/chat/completions", json={"model": "tiny", "messages": earlier}).json()["choices"][0][
        "message"]
    assert "</think>" in serving.tokenizer.decode(engine.requests[0].prompt_token_ids)
    assert (message["reasoning_content"], message["content"]) == ("Again.", "Paris is cloudy.")
    opened = {"model": "tiny", "messages": [*MESSAGES, {"role": "assistant", "content": "<think>"}],
              "add_generation_prompt": False, "continue_final_message": True}
    for reasoning in ("qwen3", "deepseek_r1"):
        http, engine, _ = _app("Let me think.</think>\n\nIt is 4.", reasoning=reasoning, think_tokens=True)
        message = http.post("/v1/chat/completions", json=opened).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Let me think.", "\n\nIt is 4."), reasoning
        deltas = _deltas(http, opened)
        assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "Let me think."
        # Under an output constraint the grammar waits for the thinking to end, qwen3's too.
        http, engine, serving = _app('Braces.</think>{"a": 1}', reasoning=reasoning, think_tokens=True)
        message = http.post("/v1/chat/completions", json={**opened, "response_format": {"type": "json_object"}}
                            ).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Braces.", '{"a": 1}')
        assert engine.requests[0].sampling_params.structured_output_after == [
            serving.tokenizer.convert_tokens_to_ids("</think>")]
        assert engine.requests[0].sampling_params.structured_output_may_open is None  # (it waits in any case)


def assert_thinking_split(http, serving, thought: str, answer: str) -> None:
    """The chat endpoint's answer split into its thinking and content, whole (the thinking's tokens
    counted) and streamed."""
    body = {"model": "tiny", "messages": MESSAGES}
    response = http.post("/v1/chat/completions", json=body).json()
    message = response["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thought, answer)
    count = len(serving.tokenizer.encode(thought, add_special_tokens=False))
    assert response["usage"]["completion_tokens_details"] == {"reasoning_tokens": count}
    deltas = _deltas(http, body)
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d["delta"].get("content") or "" for d in deltas) == answer


def test_mistrals_thinking_tags_are_special_tokens_the_parser_still_reads():
    """Magistral / Ministral 3 Reasoning (--reasoning-parser mistral): [THINK] and [/THINK] are special
    tokens of Mistral's vocabularies, which a decode skipping special tokens drops: answers the parser
    reads keep them, so the thinking is split off, whole and streamed, and its tokens counted."""
    answer = "[THINK]The capital of Italy.[/THINK]Rome."
    http, _, serving = _app(answer, reasoning="mistral", special_tokens=("[THINK]", "[/THINK]"))
    assert serving.tokenizer.convert_tokens_to_ids("[THINK]") in serving.tokenizer.all_special_ids
    assert_thinking_split(http, serving, "The capital of Italy.", "Rome.")
    body = {"model": "tiny", "messages": MESSAGES}
    # A model without the parser: its special tokens are left out of the text, as the request asks.
    plain, _, _ = _app(answer, special_tokens=("[THINK]", "[/THINK]"))
    assert plain.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == \
        "The capital of Italy.Rome."


def test_mistrals_thinking_tags_from_its_own_tokenizer_file(tmp_path):
    """Mistral's tokenizer as its releases ship it (tekken.json): [THINK] and [/THINK] are control
    tokens, special to its decoder though not named among the tokenizer's special tokens; the
    parser still gets them, whole and streamed, under an output constraint too."""
    from engine_core.tokenizer_loader import load_tokenizer
    from tests.tiny_model import tekken_vocabulary

    (tmp_path / "tekken.json").write_text(json.dumps(tekken_vocabulary()))
    tokenizer = load_tokenizer(tmp_path)
    start = tokenizer.convert_tokens_to_ids("[THINK]")
    assert start not in tokenizer.all_special_ids and tokenizer.decode([start], skip_special_tokens=True) == ""
    http, _, _ = _app("[THINK]The capital of Italy.[/THINK]Rome.", reasoning="mistral", tokenizer=tokenizer)
    body = {"model": "tiny", "messages": MESSAGES}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The capital of Italy.", "Rome.")
    deltas = _deltas(http, body)
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "The capital of Italy."
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Rome."
    constrained, _, _ = _app('[THINK]Think.[/THINK]{"a": 1}', reasoning="mistral", tokenizer=tokenizer)
    answer = constrained.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
    assert answer.json()["choices"][0]["message"]["content"] == '{"a": 1}'
