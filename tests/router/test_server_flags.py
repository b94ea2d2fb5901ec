"""vLLM's server-wide flags for every request: --enable-force-include-usage,
--return-tokens-as-token-ids, --exclude-tools-when-tool-choice-none, --disable-fastapi-docs."""

from __future__ import annotations

import json

from .test_request_fields import CHAT_TOKENIZER, MESSAGES, _app, _chat_app
from .tokenizer_factory import byte_level_tokenizer


def _chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={"model": "tiny", **body, "stream": True}) as r:
        text = "".join(r.iter_text())
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def test_forced_usage_ends_every_stream_with_a_usage_chunk():
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3})):
        plain, _ = _chat_app()
        assert all(c.get("usage") is None for c in _chunks(plain, path, body))
        forced, _ = _chat_app(enable_force_include_usage=True)
        chunks = _chunks(forced, path, body)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c.get("usage") is None for c in chunks[:-1])  # (continuous usage only when asked for)
        asked = _chunks(forced, path, {**body, "stream_options": {"include_usage": False,
                                                                  "continuous_usage_stats": True}})
        assert all(c.get("usage") for c in asked)  # (forced on: the request's continuous usage applies)


def test_the_server_may_name_every_requests_logprob_tokens_by_id():
    http, _ = _chat_app(return_tokens_as_token_ids=True)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 0}).json()
    assert all(token.startswith("token_id:") for token in r["choices"][0]["logprobs"]["tokens"])
    plain, _ = _chat_app()
    r = plain.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "logprobs": 0}).json()
    assert not any(token.startswith("token_id:") for token in r["choices"][0]["logprobs"]["tokens"])


def test_tool_choice_none_may_hide_the_tools_from_the_template():
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = ("{% if tools %}[tools]{% endif %}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for exclude, expected in ((False, "[tools]hi"), (True, "hi")):
        http, engine = _app(tokenizer=tokenizer, settings={"exclude_tools_when_tool_choice_none": exclude})
        assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                       "tools": [tool], "tool_choice": "none"}).is_success
        assert tokenizer.decode(engine.requests[-1].prompt_token_ids) == expected
        assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                       "tools": [tool], "tool_choice": "required"}).is_success
        assert tokenizer.decode(engine.requests[-1].prompt_token_ids) == "[tools]hi"


def test_the_api_docs_can_be_turned_off():
    http, _ = _app()
    assert all(http.get(path).status_code == 200 for path in ("/docs", "/redoc", "/openapi.json"))
    hidden, _ = _app(settings={"disable_fastapi_docs": True})
    assert all(hidden.get(path).status_code == 404 for path in ("/docs", "/redoc", "/openapi.json"))


PARTS_TEMPLATE = "{% for m in messages %}{% for p in m['content'] %}({{ p['text'] }}){% endfor %}{% endfor %}"
TEXT_TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
MIXED = [{"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]


def _rendered(http, engine, template: str, **body) -> str:
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MIXED, "max_tokens": 1,
                                                "chat_template": template, **body})
    assert r.status_code == 200, r.text
    return CHAT_TOKENIZER.decode(engine.requests[-1].prompt_token_ids)


def test_message_content_reaches_each_template_as_it_reads_it():
    """--chat-template-content-format (vLLM's): auto gives OpenAI's parts to a template that loops
    over a message's content and the text to others; string and openai force one."""
    http, engine = _app(tokenizer=CHAT_TOKENIZER, trust_request_chat_template=True)
    assert _rendered(http, engine, PARTS_TEMPLATE) == "(Hi)(a)(b)"
    assert _rendered(http, engine, TEXT_TEMPLATE) == "[Hi][a\nb]"
    http, engine = _app(tokenizer=CHAT_TOKENIZER, trust_request_chat_template=True,
                        settings={"chat_template_content_format": "openai"})
    assert _rendered(http, engine, TEXT_TEMPLATE) == "[[{'type': 'text', 'text': 'Hi'}]][[{'type': 'text', 'text': " \
                                                     "'a'}, {'type': 'text', 'text': 'b'}]]"
    http, engine = _app(tokenizer=CHAT_TOKENIZER, trust_request_chat_template=True,
                        settings={"chat_template_content_format": "string"})
    assert _rendered(http, engine, PARTS_TEMPLATE) == "()" * 5  # (it loops over the text's characters)


def test_the_servers_own_template_is_read_too_on_every_path_that_renders():
    tokenizer = byte_level_tokenizer.__wrapped__()  # its own copy: the template is set on it
    tokenizer.chat_template = PARTS_TEMPLATE
    http, engine = _app(tokenizer=tokenizer)
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MIXED, "max_tokens": 1}
                     ).status_code == 200
    assert tokenizer.decode(engine.requests[-1].prompt_token_ids) == "(Hi)(a)(b)"
    r = http.post("/tokenize", json={"model": "tiny", "messages": MIXED})
    assert tokenizer.decode(r.json()["tokens"]) == "(Hi)(a)(b)"
    assert http.post("/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 1}).status_code == 200
    assert tokenizer.decode(engine.requests[-1].prompt_token_ids) == "(Hi)"


def test_documents_reach_a_rag_template():
    http, engine = _app(tokenizer=CHAT_TOKENIZER, trust_request_chat_template=True)
    template = "{% for d in documents or [] %}<{{ d.title }}: {{ d.text }}>{% endfor %}" + TEXT_TEMPLATE
    docs = [{"title": "Paris", "text": "capital of France"}, {"title": "Rome", "text": "capital of Italy"}]
    assert _rendered(http, engine, template, documents=docs) == \
        "<Paris: capital of France><Rome: capital of Italy>[Hi][a\nb]"
    assert _rendered(http, engine, template) == "[Hi][a\nb]"


def test_the_answers_role_and_chats_echo():
    """--response-role names answers to a prompt that opens the assistant's turn; one that continues
    the last message is in its role, and with echo starts with its text (vLLM's)."""
    http, _ = _app(tokenizer=CHAT_TOKENIZER, settings={"response_role": "bot"})
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "bot"
    chunks = _chunks(http, "/v1/chat/completions", {k: v for k, v in body.items() if k != "model"})
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    continuing = {"model": "tiny", "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True,
                  "messages": [*MESSAGES, {"role": "assistant", "content": "The answer is"}]}
    whole = http.post("/v1/chat/completions", json={**continuing, "echo": True}).json()["choices"][0]["message"]
    plain = http.post("/v1/chat/completions", json=continuing).json()["choices"][0]["message"]
    assert whole["role"] == plain["role"] == "assistant"
    assert whole["content"] == "The answer is" + plain["content"]
    chunks = _chunks(http, "/v1/chat/completions", {**{k: v for k, v in continuing.items() if k != "model"},
                                                    "echo": True})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole["content"]
    # A prompt that does not open the assistant's turn is answered in the last message's role.
    user_last = {**body, "add_generation_prompt": False}
    assert http.post("/v1/chat/completions", json=user_last).json()["choices"][0]["message"]["role"] == "user"
    # With continuous usage, the echo chunk counts the prompt and nothing generated yet.
    chunks = _chunks(http, "/v1/chat/completions", {**{k: v for k, v in continuing.items() if k != "model"},
                                                    "echo": True, "stream_options": {
                                                        "include_usage": True, "continuous_usage_stats": True}})
    echo_chunk = next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content") == "The answer is")
    assert echo_chunk["usage"]["completion_tokens"] == 0 and echo_chunk["usage"]["prompt_tokens"] > 0
    # Echo repeats only a message in the answer's role: after a user message, nothing.
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["content"] == http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
