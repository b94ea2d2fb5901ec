"""The hand-encoded per-token SSE chunks carry exactly what the pydantic chunk models would."""

from __future__ import annotations

import json

import pytest

from router.protocol import (
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionStreamChoice,
    CompletionStreamChunk,
    DeltaMessage,
    TopLogprob,
)
from router.serving import _sse, chat_token_chunk, completion_token_chunk


def _data(chunk: str | bytes) -> dict:
    text = chunk.decode() if isinstance(chunk, bytes) else chunk
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[6:])


COMPLETION_LOGPROBS = CompletionLogprobs(text_offset=[0, 3], token_logprobs=[-0.5, -1.25], tokens=["東京", " é"],
                                         top_logprobs=[{"東京": -0.5, "x": -2.0}, None])


@pytest.mark.parametrize(("text", "logprobs", "finish", "stop"), [
    ("Hello", None, None, None),
    ("東京 😀 \"quoted\"\n", COMPLETION_LOGPROBS, None, None),
    ("", None, "stop", "###"),
    ("end", COMPLETION_LOGPROBS, "stop", 7),
    ("", None, "length", None),
])
def test_completion_chunk_matches_the_model(text, logprobs, finish, stop):
    fast = completion_token_chunk("cmpl-1", 1700000000, "tiny", 2, text, logprobs and logprobs.model_dump(), finish,
                                  stop)
    model = CompletionStreamChunk(id="cmpl-1", created=1700000000, model="tiny", choices=[CompletionStreamChoice(
        index=2, text=text, logprobs=logprobs, finish_reason=finish, stop_reason=stop)])
    assert _data(fast) == _data(_sse(model))
    assert CompletionStreamChunk.model_validate(_data(fast)) == model


CHAT_LOGPROBS = ChatLogprobs(content=[ChatTokenLogprob(token="Pa", logprob=-0.1, bytes=[80, 97], top_logprobs=[
    TopLogprob(token="Pa", logprob=-0.1, bytes=[80, 97])])])


@pytest.mark.parametrize(("delta", "logprobs", "finish", "stop"), [
    ("Hi", None, None, None), ("", None, "length", None), ("ß🚀", CHAT_LOGPROBS, "stop", "###"),
    ("", CHAT_LOGPROBS, None, None), ("", None, "stop", 7)])
def test_chat_chunk_matches_the_model(delta, logprobs, finish, stop):
    fast = chat_token_chunk("chatcmpl-1", 1700000000, "tiny", 0, delta, logprobs and logprobs.model_dump(), finish,
                            stop_reason=stop)
    model = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="tiny", choices=[ChatStreamChoice(
        index=0, delta=DeltaMessage(content=delta or None) if delta else DeltaMessage(), logprobs=logprobs,
        finish_reason=finish, stop_reason=stop)])
    assert _data(fast) == _data(_sse(model))
    assert ChatCompletionChunk.model_validate(_data(fast)) == model


@pytest.mark.parametrize("ids", [None, {"token_ids": [5, 6]}, {"token_ids": [], "prompt_token_ids": [1, 2, 3]}])
def test_chunks_with_return_token_ids_match_the_models(ids):
    fast = completion_token_chunk("cmpl-1", 1700000000, "tiny", 1, "ab", None, None, None, ids=ids)
    model = CompletionStreamChunk(id="cmpl-1", created=1700000000, model="tiny", choices=[CompletionStreamChoice(
        index=1, text="ab", **(ids or {}))])
    assert _data(fast) == _data(_sse(model))
    if ids is None:  # not asked for: not in the JSON at all, as before the field existed
        assert "token_ids" not in _data(fast)["choices"][0] and "prompt_token_ids" not in _data(fast)["choices"][0]
    chat_ids = ids and {"token_ids": ids["token_ids"]}
    fast = chat_token_chunk("chatcmpl-1", 1700000000, "tiny", 0, "ab", None, None, ids=chat_ids)
    model = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="tiny", choices=[ChatStreamChoice(
        index=0, delta=DeltaMessage(content="ab"), **(chat_ids or {}))])
    assert _data(fast) == _data(_sse(model))
