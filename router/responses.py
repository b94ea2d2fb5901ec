"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat pipeline.

A request's ``instructions`` and ``input`` items (messages, earlier function calls and their
outputs) become chat messages; ``tools``, ``tool_choice``, ``text.format``, ``max_output_tokens``
and the sampling fields become the chat request's; the answer goes through the same engines,
chat template, tool-call and reasoning parsers as ``/v1/chat/completions``. Its reasoning, text
and function calls come back as the response's output items: whole, or streamed as the Responses
event sequence (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).

Without a store (the default, as in vLLM, whose store is off unless VLLM_ENABLE_RESPONSES_API_STORE
is set) responses are not kept: ``store`` answers false, ``previous_response_id`` is refused and a
client carries its conversation in ``input`` (as the openai Agents SDK does by default). With one
(router.response_store), a response asked to be stored can be retrieved, deleted, and continued:
``previous_response_id`` puts the stored conversation (its inputs and outputs, not its
instructions) before the new input; and ``background`` responses are generated after the answer
(stored queued, then settled by the replica generating them), read back with GET and stopped with
``POST /v1/responses/{id}/cancel``. Streamed too, a background response's events go to the store as
they come, and any replica streams them again (``GET ?stream=true&starting_after=N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.content_format import IMAGE_PART_TYPE
from router.detached import detached_task, runs_to_completion
from router.parsed_output import ParsedDelta, calls_around_text
from router.protocol import INT64_MAX, INT64_MIN, ChatCompletionRequest, _warn_ignored, cache_salt_field, invalid
from router.response_store import UNFINISHED, EventsPage, MissingResponseError, Stopped
from router.serving import (
    DEFAULTED_SAMPLING_FIELDS,
    MAX_EXTERNAL_ID_LEN,
    APIError,
    SSEStream,
    _StreamError,
    bad_request,
    chat_request_from,
    choice_request_id,
    named_sse_event,
    parsed_whole,
    required_text,
)

if TYPE_CHECKING:
    from router.response_store import AsyncResponseStore
    from router.serving import ChatRun, OpenAIServing, _Delta

logger = logging.getLogger(__name__)
# How long one wait of a follower of a streamed background response lasts in the store (it then asks
# again), and how long a follower waits for a next event before it gives up.
FOLLOW_WAIT_S = 15.0
FOLLOW_IDLE_S = 600.0

# What a response may be asked to include (OpenAI's values): only the message text's logprobs are
# produced here; the others name outputs this server has none of.
ResponseIncludable = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs"]

# Responses fields whose chat counterpart has another name: a chat validation error names the
# Responses parameter.
_CHAT_TO_RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                            "response_format": "text", "chat_template_kwargs": "reasoning"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


class ResponsesRequest(BaseModel):
    """The request body of ``POST /v1/responses``: OpenAI's fields, plus vLLM's sampling extras."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            _warn_ignored(cls.__name__, [k for k in data if k not in fields])
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data

    model: str = Field(..., description="Served model name (see GET /v1/models).")
    input: str | list[dict[str, Any]] = Field(..., description="Text, or a list of input items.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = Field(True, description="Keep the response (with --enable-responses-store; without, the "
                                          "response says store: false).")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object" | '
                                                          '"json_schema", "name", "schema", "strict"}}')
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools.")
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = Field(None, description='{"effort": ...}: passed to the chat template '
                                                               "as reasoning_effort.")
    truncation: Literal["disabled", "auto"] = "disabled"
    background: bool = False
    # Stateful fields: refused (a client relying on them would silently lose its history).
    conversation: Any = None
    prompt: Any = None
    # vLLM's sampling extras.
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = cache_salt_field()
    include: list[ResponseIncludable] | None = Field(
        None, description='Extra output: "message.output_text.logprobs" (the other values OpenAI names are accepted; '
                          "this server has nothing for them).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With message.output_text.logprobs included: "
                                                                     "the best alternatives of each token.")
    request_id: str | None = Field(
        None, min_length=1, max_length=MAX_EXTERNAL_ID_LEN, pattern=r"^[A-Za-z0-9._:-]+$",
        description="vLLM extra: the response's id (as GET /v1/responses/{id} names it; a new resp_ id by "
                    "default). A stored response's id is its own: a second stored with it is refused.")

    @property
    def output_logprobs(self) -> bool:
        """The message's text comes with its tokens' logprobs (OpenAI's include value)."""
        return bool(self.include) and "message.output_text.logprobs" in self.include  # type: ignore[operator]

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.truncation == "auto":
            raise invalid("truncation", 'truncation "auto" is not supported: a prompt beyond the context '
                          "length is refused")
        if isinstance(self.input, list) and not self.input:
            raise invalid("input", "input must not be empty")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise invalid(name, f"{name} needs state this server does not keep (stored conversations and "
                              "prompts): send the conversation in input")
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise invalid("reasoning", "reasoning.effort must be a string (e.g. low, medium, high)")
        return self

    # -- to a chat request ---------------------------------------------------------------------------

    def input_items(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else list(self.input)

    def stored_input_items(self, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The input as the store keeps it and ``input_items`` lists it: OpenAI's item shapes, each
        with an id and a status (messages' text in content parts). An item whose id the conversation
        (``history``) or an earlier item already has gets a new one, so ids page unambiguously.
        Called once the input was read."""
        taken = {item.get("id") for item in history or ()}
        items = []
        for item in self.input_items():
            stored = _as_response_item(item)
            if stored["id"] in taken:
                stored["id"] = _item_id(_ITEM_ID_PREFIXES[stored["type"]])
            taken.add(stored["id"])
            items.append(stored)
        return items

    def chat_request(self, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The chat request this one runs as; ``history``: the items of the conversation it continues."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(history or []),
            "max_completion_tokens": self.max_output_tokens,
            "seed": self.seed, "stop": self.stop, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            # (Only those the client set: the others take the model's defaults, as in chat.)
            **{name: getattr(self, name) for name in DEFAULTED_SAMPLING_FIELDS if name in self.model_fields_set},
            "priority": self.priority, "user": self.user, "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format(), "stream": self.stream, "cache_salt": self.cache_salt,
        }
        if self.tools:
            body["tools"] = [self._tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = self._tool_choice()
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["chat_template_kwargs"] = {"reasoning_effort": self.reasoning["effort"]}
        if self.output_logprobs:
            body["logprobs"], body["top_logprobs"] = True, self.top_logprobs or 0
        if self._continues_final_message():
            if body["response_format"] is not None:  # (the format would hold from the middle of the text)
                raise _bad("text", "a final assistant message to continue cannot be combined with text.format")
            body.update(add_generation_prompt=False, continue_final_message=True)
        return chat_request_from(body, _CHAT_TO_RESPONSES_PARAM, "input")

    def _continues_final_message(self) -> bool:
        """The input ends with an assistant message left unfinished (status in_progress or
        incomplete, as a cut-off answer comes back): the answer continues its text, as vLLM's."""
        items = self.input_items()
        last = items[-1] if items else None
        return isinstance(last, dict) and last.get("type", "message") == "message" \
            and last.get("role") == "assistant" and last.get("status") in ("in_progress", "incomplete")

    def _messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for i, item in enumerate([*history, *self.input_items()]):
            # (A stored conversation's items were checked when they were this request's input.)
            where = f"input[{i - len(history)}]"
            if not isinstance(item, dict):
                raise _bad("input", f"{where} must be an object")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                role = _ROLES.get(role) if isinstance(role, str) else None
                if role is None:
                    raise _bad("input", f"{where}.role must be one of user, assistant, system, developer")
                text = _content(item.get("content"), where)
                last = messages[-1] if messages else None
                if role == "assistant" and last is not None and _thinking_only(last):
                    last["content"] = text  # (the answer of the thinking just before it: one turn)
                else:
                    messages.append({"role": role, "content": text})
            elif kind == "function_call":
                call = {"id": _required(item, "call_id", where), "type": "function",
                        "function": {"name": _required(item, "name", where),
                                     "arguments": item.get("arguments") or "{}"}}
                last = messages[-1] if messages else None
                # Calls right after an assistant message (or after other calls) belong to that turn.
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _required(item, "call_id", where),
                                 "content": output if isinstance(output, str) else _text(output, where, "output")})
            elif kind == "reasoning":
                # An earlier answer's thinking, as the chat endpoint takes it back (vLLM's Responses
                # does too): the template decides whether to show it (Qwen3's does after the last
                # user turn, in a tool loop); the message or calls that follow join its turn.
                thinking = _reasoning_text(item)
                if thinking:
                    messages.append({"role": "assistant", "content": None, "reasoning": thinking})
            else:
                raise _bad("input", f"{where}: input items of type {kind!r} are not supported (message, "
                              "function_call, function_call_output, reasoning)")
        return messages

    def _tool(self, i: int, tool: dict[str, Any]) -> dict[str, Any]:
        if tool.get("type") != "function":
            raise _bad("tools", f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function)")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        return {"type": "function", "function": function}

    def _tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):  # type: ignore[union-attr]
            return {"type": "function", "function": {"name": choice["name"]}}  # type: ignore[index]
        raise _bad("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                      '{"type": "function", "name": ...}')

    def _response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise _bad("text", 'text.format must be an object, e.g. {"type": "json_schema", "name": ..., '
                       '"schema": ...}')
        if fmt is None or fmt.get("type", "text") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            keys = ("name", "schema", "strict", "description")
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
        raise _bad("text", f"text.format type {fmt.get('type')!r} is not supported (text, json_object, "
                      "json_schema)")

    def echo_fields(self, stored: bool, sampling: dict[str, Any]) -> dict[str, Any]:
        """The request's settings as a response repeats them; ``sampling``: the temperature and top_p it
        runs with (the model's defaults where the request left them unset)."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls,
                "previous_response_id": self.previous_response_id, "reasoning": self.reasoning, "store": stored,
                "temperature": sampling["temperature"], "text": self.text or {"format": {"type": "text"}},
                "tool_choice": self.tool_choice or ("auto" if self.tools else "none"),
                "tools": self.tools or [], "top_p": sampling["top_p"], "truncation": self.truncation, "user": self.user,
                "background": self.background, "top_logprobs": self.top_logprobs or 0}


def _bad(param: str, message: str) -> APIError:
    return bad_request(message, param)


def _thinking_only(message: dict[str, Any]) -> bool:
    """An assistant turn that has only thinking so far (a reasoning item's)."""
    return message["role"] == "assistant" and message.get("reasoning") is not None \
        and message.get("content") is None and not message.get("tool_calls")


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's thinking: its reasoning_text parts (as this server writes them), else
    its summary's text (what OpenAI's hosted models return)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
            if texts:
                return "\n".join(texts)
    return ""


def _required(item: dict[str, Any], key: str, where: str) -> str:
    return required_text(item, key, where, "input")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat takes it: its text, or, with images (``input_image`` parts, for a
    vision-language model), chat's text and ``image_url`` parts in their order."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise _bad("input", f"{where}: an input_image part needs its image_url (a URL or a base64 data URL; "
                                    "file_id is not supported)")
            parts.append({"type": IMAGE_PART_TYPE, IMAGE_PART_TYPE: {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _text([part], where)})
    return parts


def _text(content: Any, where: str, field: str = "content") -> str:
    """A message's content (an item's ``field``) as text: a string, or text parts (input_text,
    output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("input", f"{where}.{field} must be a string or a list of content parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad("input", f"{where}: content parts of type {kind!r} are not supported (text only: "
                          "input_text, output_text, refusal)")
        texts.append(part[key])
    return "\n".join(texts)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _as_response_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item (already checked by ``_messages``) in the shape OpenAI lists it: an id and a
    status; a message's content as parts (input_text for user, system and developer, output_text
    for assistant, as in OpenAI's input and output messages)."""
    kind = item.get("type", "message")
    out = {**item, "type": kind, "id": item.get("id") or _item_id(_ITEM_ID_PREFIXES[kind]),
           "status": item.get("status") or "completed"}
    if kind == "message":
        assistant = item["role"] == "assistant"
        content = item["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        out["content"] = [_as_content_part(part, assistant) for part in parts]
    elif kind == "function_call":
        out.setdefault("arguments", "{}")
    elif kind == "reasoning":
        out.setdefault("summary", [])
    return out


def _as_content_part(part: dict[str, Any], assistant: bool) -> dict[str, Any]:
    if part["type"] == "refusal":
        return part
    if assistant:
        return {"annotations": [], **part, "type": "output_text"}
    return {**part, "type": "input_text"}


@dataclass
class _OpenItem:
    """One output item while the answer is produced: reasoning, a message, or one function call."""

    index: int
    item: dict[str, Any]
    text: str = ""
    closed: bool = False
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, when asked for


@dataclass
class OutputItems:
    """Builds the response's output items from the parsed answer, and the stream events that
    announce them (``emit`` receives each event's type and fields). Streamed, items come in the order
    they start, and each is closed (its done events) when the next begins, as OpenAI streams them;
    text after a call opens a new message. Within one delta the order is the parser's: reasoning,
    the end of a call being written, text, new calls; so a whole answer, one delta, gives the
    reasoning, the message, then the calls (as vLLM's whole responses list them)."""

    emit: Callable[..., None]
    items: list[_OpenItem] = field(default_factory=list)
    reasoning: _OpenItem | None = None
    message: _OpenItem | None = None
    calls: dict[int, _OpenItem] = field(default_factory=dict)  # by the parser's call index

    def _open(self, item: dict[str, Any]) -> _OpenItem:
        for earlier in self.items:  # one item streams at a time
            self._close(earlier, "completed")
        opened = _OpenItem(len(self.items), item)
        self.items.append(opened)
        self.emit("response.output_item.added", output_index=opened.index, item=dict(item))
        return opened

    def _open_message(self) -> _OpenItem:
        message = self._open({"type": "message", "id": _item_id("msg"), "role": "assistant",
                              "status": "in_progress", "content": []})
        self.emit("response.content_part.added", item_id=message.item["id"], output_index=message.index,
                  content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        return message

    def open_empty_message(self) -> None:
        self.message = self._open_message()

    def add(self, parsed: ParsedDelta, logprobs: list[dict[str, Any]] | None = None) -> None:
        """``logprobs``: those of the tokens of ``parsed.content`` (OpenAI's output_text logprobs)."""
        if parsed.reasoning:
            if self.reasoning is None or self.reasoning.closed:
                self.reasoning = self._open({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                                             "content": [], "status": "in_progress"})
                self.emit("response.content_part.added", item_id=self.reasoning.item["id"],
                          output_index=self.reasoning.index, content_index=0,
                          part={"type": "reasoning_text", "text": ""})
            self.reasoning.text += parsed.reasoning
            self.emit("response.reasoning_text.delta", item_id=self.reasoning.item["id"],
                      output_index=self.reasoning.index, content_index=0, delta=parsed.reasoning)
        writing = next((index for index, call in self.calls.items() if not call.closed), None)
        before, after = calls_around_text(parsed.tool_calls, writing)
        for delta in before:
            self._add_call_fragment(delta)
        if parsed.content:
            if self.message is None or self.message.closed:
                self.message = self._open_message()
            self.message.text += parsed.content
            self.message.logprobs += logprobs or []
            self.emit("response.output_text.delta", item_id=self.message.item["id"], output_index=self.message.index,
                      content_index=0, delta=parsed.content, logprobs=logprobs or [])
        for delta in after:
            self._add_call_fragment(delta)

    def _add_call_fragment(self, delta: dict[str, Any]) -> None:
        call = self.calls.get(delta["index"])
        if call is None:
            call = self.calls[delta["index"]] = self._open({
                "type": "function_call", "id": _item_id("fc"), "call_id": delta["id"],
                "name": delta["function"]["name"], "arguments": "", "status": "in_progress"})
        arguments = delta["function"].get("arguments") or ""
        if arguments:
            call.text += arguments
            self.emit("response.function_call_arguments.delta", item_id=call.item["id"],
                      output_index=call.index, delta=arguments)

    def _close(self, opened: _OpenItem, status: str) -> None:
        if opened.closed:
            return
        opened.closed = True
        item, index = opened.item, opened.index
        item["status"] = status
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": opened.text}
            item["content"] = [part]
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=opened.text)
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)
        elif item["type"] == "message":
            part = {"type": "output_text", "text": opened.text, "annotations": [], "logprobs": opened.logprobs}
            item["content"] = [part]
            self.emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=opened.text, logprobs=opened.logprobs)
            self.emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)
        else:
            item["arguments"] = opened.text
            self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=opened.text)
        self.emit("response.output_item.done", output_index=index, item=item)

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close what is still open (with the response's status); returns the output items."""
        for opened in self.items:
            self._close(opened, status)
        return [opened.item for opened in self.items]


# Chat parameters named by errors raised past the request's validation (context length, template,
# tool-call arguments), and the Responses parameters they come from.
_CHAT_ERROR_PARAM = {**_CHAT_TO_RESPONSES_PARAM, "max_tokens": "max_output_tokens", "tool_choice": "tool_choice"}


class _ContentLogprobs:
    """Which tokens' logprobs go with the message's text. Without an output parser, every token's
    (an output whose bytes do not yet make a character brings no text: its tokens go with the next
    text). With one, as vLLM's streamed Responses choose them: those of an engine output that
    brings content; not those of reasoning, tool calls, tags, or text held back while a tag might
    be starting. When outputs merge (a busy router, --stream-interval, speculative decoding), an
    event that brings content and reasoning gives the content its last tokens, and one that brings
    content and calls its first tokens, as many as the content's text takes. Never the stop token
    that ended the answer (it is not in the text). Whole answers are read the same way."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.pending: list = []

    def take(self, parsed: ParsedDelta, event: _Delta) -> list[dict[str, Any]]:
        rows = event.logprobs
        if (event.finish_reason == "stop" and rows and not isinstance(event.stop_reason, str)
                and not event.choice.detok.include_stop_str_in_output):
            rows = rows[:-1]
        if event.choice.output_parser is None:
            self.pending += rows
            rows = self.pending
        if not parsed.content:
            return []
        self.pending = []
        if parsed.reasoning or parsed.tool_calls:
            rows = self._covering(rows, len(parsed.content), from_end=bool(parsed.reasoning))
        return self.serving.chat_logprobs(rows)["content"]

    def _covering(self, rows: list, length: int, from_end: bool) -> list:
        """The fewest rows, from the end (content after thinking) or the start (content before
        calls), whose tokens' text is as long as the content."""
        taken, covered = [], 0
        for row in reversed(rows) if from_end else rows:
            if covered >= length:
                break
            taken.append(row)
            covered += len(self.serving.token_text(row[0]))
        return taken[::-1] if from_end else taken


class ResponsesServing:
    """``POST /v1/responses`` through an OpenAIServing's chat path; with a store, also retrieval,
    deletion and ``previous_response_id``."""

    def __init__(self, serving: OpenAIServing, store: AsyncResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store
        # Background responses this replica is generating (held so they are not collected).
        self._background: set[asyncio.Task] = set()
        self._closing = False  # (shut_down began)

    async def _ask_store(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.store, method)(*args)
        except MissingResponseError:
            raise
        except Exception as e:
            logger.warning("response store unavailable: %s", e)
            raise APIError(503, f"the response store is unavailable: {e}", "ServiceUnavailableError") from e

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        response = await self._ask_store("get", response_id) if self.store is not None else None
        if response is None:
            raise _not_found(response_id, "response_id", self.store is not None)
        return response

    async def delete(self, response_id: str) -> Stopped:
        """The deleted response (its model and status: a background one still generating is
        dropped from the engines too, by its engine base id)."""
        deleted = await self._ask_store("delete", response_id) if self.store is not None else None
        if deleted is None:
            raise _not_found(response_id, "response_id", self.store is not None)
        return deleted

    async def input_items(self, response_id: str, after: str | None = None, before: str | None = None,
                          limit: int = 20, order: str = "desc") -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items the response was generated from (the
        conversation it continued, then its own input), a page at a time as OpenAI lists them:
        ``order`` asc is oldest first, ``after``/``before`` are item ids, ``limit`` 1 to 100."""
        if self.store is None:
            raise _not_found(response_id, "response_id", False)
        try:
            items = await self._ask_store("input_items", response_id)
        except MissingResponseError as e:
            if e.response_id == response_id:
                raise _not_found(response_id, "response_id", True) from None
            raise APIError(404, f"Response {response_id!r} continued the conversation of response "
                           f"{e.response_id!r}, which is no longer stored", "NotFoundError", "response_id") from None
        if order == "desc":
            items.reverse()
        ids = [item.get("id") for item in items]  # (items stored by an earlier build may have none)
        start, end = 0, len(items)
        for param, item_id in (("after", after), ("before", before)):
            if item_id is None:
                continue
            if item_id not in ids:
                raise bad_request(f"{param}: response {response_id!r} has no input item {item_id!r}", param)
            if param == "after":
                start = ids.index(item_id) + 1
            else:
                end = ids.index(item_id)
        window = items[start:end]
        page = window[:limit]
        return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None, "has_more": len(window) > limit}

    async def _history(self, request: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, int | None]:
        """The conversation ``previous_response_id`` names, and its entry's serial in the store."""
        if request.previous_response_id is None:
            return None, None
        if self.store is None:
            raise bad_request("previous_response_id needs stored responses, and this server does not store them "
                              "(start it with --enable-responses-store): send the conversation in input",
                              "previous_response_id")
        try:
            history, status, serial = await self._ask_store("continuation", request.previous_response_id)
        except MissingResponseError as e:
            # (OpenAI's answer, a 400 clients recover from by sending the whole conversation; vLLM's is a 404.)
            missing = "" if e.response_id == request.previous_response_id else \
                f" (its conversation goes through {e.response_id!r}, which is not)"
            raise APIError(400, f"Previous response with id {request.previous_response_id!r} not found{missing}: "
                                "it was deleted or is no longer kept; send the conversation in input",
                           "BadRequestError", "previous_response_id", code="previous_response_not_found") from None
        if status in UNFINISHED:
            raise bad_request(f"Response {request.previous_response_id!r} is still {status}: continue its "
                              "conversation once it has ended", "previous_response_id")
        return history, serial

    async def create(self, request: ResponsesRequest, session_id: str | None = None) -> dict[str, Any] | SSEStream:
        history, previous_serial = await self._history(request)
        chat = request.chat_request(history)
        storing = self.store is not None and request.store
        if request.background and not storing:
            raise bad_request("a background response is read back from the response store: start the server "
                              "with --enable-responses-store, and leave store true", "background")
        response_id = request.request_id or f"resp_{uuid.uuid4().hex}"
        if request.request_id is not None and storing and not request.background \
                and await self._ask_store("get", response_id) is not None:
            raise _id_taken(response_id)  # (a background one is refused by its put, before it starts)
        await self.serving.resolve_model(request.model)  # (an unknown model is a 404 first)
        base = {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.serving.model_name(request.model), "error": None, "incomplete_details": None,
                "output": [], "usage": None,
                **request.echo_fields(storing, self.serving.defaulted_sampling(chat))}
        if request.background:
            return await self._start_background(base, chat, session_id, request, history, previous_serial)
        # (A client's id may name two requests at once: their engine requests' ids add a random part.)
        engine_base = response_id if request.request_id is None else f"{response_id}-{secrets.token_hex(4)}"
        run = await self.serving.start_chat_as(chat, session_id, response_id, _CHAT_ERROR_PARAM, engine_base)

        async def keep(final: dict[str, Any]) -> bool:
            # Stored before the client hears of it, so a follow-up through any replica finds it.
            if not storing or final["status"] == "failed":
                return True
            try:
                kept = await self.store.put(final, request.previous_response_id,  # type: ignore[union-attr]
                                            request.stored_input_items(history), previous_serial=previous_serial)
                if not kept:  # (another request named by the same request_id was stored meanwhile)
                    logger.warning("response %s was not stored: the store holds another of that id", final["id"])
                    final["store"] = False
            except Exception as e:  # the answer stands; only its storing failed, and it says so
                logger.warning("could not store response %s: %s", final["id"], e)
                final["store"] = False
            return True

        if request.stream:
            return SSEStream(self._stream(base, run, keep, request.output_logprobs), run.streams)
        final = await self._answer(base, run, request.output_logprobs)
        await keep(final)
        return final

    async def _answer(self, base: dict[str, Any], run: ChatRun, logprobs: bool = False) -> dict[str, Any]:
        """A started (not streamed) response, once its answer is whole; with ``logprobs`` read as it
        streams, to tell the tokens of its text from those of its reasoning and calls."""
        items = OutputItems(lambda *_, **__: None)
        if logprobs:
            content_logprobs = _ContentLogprobs(self.serving)
            try:
                async with contextlib.aclosing(self.serving.parsed_deltas(run)) as deltas:
                    async for parsed, event in deltas:
                        items.add(parsed, content_logprobs.take(parsed, event))
            except _StreamError as e:
                raise e.error from e
        else:
            await self.serving.finish_chat(run)
            items.add(parsed_whole(run.choices[0]))
        return self._final(base, run, items)

    @runs_to_completion  # (stored and started even if the client leaves: no queued entry nobody generates)
    async def _start_background(self, base: dict[str, Any], chat: ChatCompletionRequest, session_id: str | None,
                                request: ResponsesRequest, history: list[dict[str, Any]] | None,
                                previous_serial: int | None) -> dict[str, Any] | SSEStream:
        """OpenAI's background mode: the response is stored ``queued`` and returned at once; this
        replica generates it on its own (``in_progress``, then its end) while the client polls GET
        /v1/responses/{id} through any replica, or cancels it (POST .../cancel). Streamed (``stream``
        too), its events go to the store as they come, and the answer follows them there: a client
        that leaves does not stop it, and any replica streams it again (GET with ``stream``, from
        ``starting_after``)."""
        if self._closing:
            raise APIError(503, "this router replica is shutting down: send the request again",
                           "ServiceUnavailableError")
        input_items = request.stored_input_items(history)
        queued = base | {"status": "queued"}
        streamed = bool(request.stream)
        # Stored before it starts (nobody could read back one the store refused), which reserves its
        # id, with the base id of its engine requests, new for each (an id a delete freed may name
        # another response while this one's requests still run): a cancel through any replica
        # finds them there. Its later calls name its entry by serial, so they never touch another's.
        engine_base = f"{base['id']}-{secrets.token_hex(4)}"
        serial = await self._ask_store("put", queued, request.previous_response_id, input_items, streamed,
                                       previous_serial, engine_base)
        if not serial:
            raise _id_taken(base["id"])
        try:
            run = await self.serving.start_chat_as(chat, session_id, base["id"], _CHAT_ERROR_PARAM, engine_base)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.store.delete(base["id"], serial)  # type: ignore[union-attr]
            raise

        def failed(message: str) -> dict[str, Any]:
            return base | {"status": "failed", "error": {"code": "server_error", "message": message}}

        async def settle(response: dict[str, Any]) -> bool:
            # False: cancelled, deleted or forgotten meanwhile, or the store could not be reached (then
            # a streamed response's followers get no final event, and GET keeps the last status).
            try:
                kept = await self.store.settle(response, serial)  # type: ignore[union-attr]
            except Exception as e:
                logger.warning("could not store background response %s: %s", base["id"], e)
                return False
            if not kept:
                logger.info("background response %s was cancelled, deleted or forgotten: its %s answer is "
                            "dropped", base["id"], response["status"])
            return kept

        recorder = _EventRecorder(self.store, base["id"], serial) if streamed else None

        async def end_failed(message: str) -> None:
            response = failed(message)
            if await settle(response) and recorder is not None:
                recorder.add([sse_event("response.failed", recorder.next_sequence, response=response)])

        async def end_for_shutdown() -> None:
            await end_failed("the router replica generating it shut down")
            if recorder is not None:
                await recorder.finish()

        async def generate() -> None:
            try:
                if not await settle(base | {"status": "in_progress"}):
                    pass  # cancelled or deleted already
                elif recorder is not None:
                    try:
                        async with contextlib.aclosing(self._events(base, run, settle, "queued",
                                                                    request.output_logprobs)) as events_of:
                            async for events in events_of:
                                recorder.add(events)
                                if recorder.stopped:
                                    break  # cancelled or deleted: the engine request is dropped below
                    except Exception as e:  # (not an engine error, which _events ends as failed itself)
                        logger.exception("background response %s failed", base["id"])
                        await end_failed(str(e))
                else:
                    try:
                        final = await self._answer(base, run, request.output_logprobs)
                    except Exception as e:  # an engine failure or a timeout: failed, as a sync answer
                        final = failed(str(e))
                    await settle(final)  # (not over a cancel or a delete)
                if recorder is not None:
                    await recorder.finish()
            except asyncio.CancelledError:  # the replica is shutting down
                await asyncio.shield(end_for_shutdown())
                raise
            finally:
                for stream in run.streams:  # (a finished stream ignores it; another is aborted)
                    await stream.close()

        if self._closing:  # (shut_down began while it started: it ends as those shut_down stopped)
            await end_for_shutdown()
            for stream in run.streams:
                await stream.close()
        else:
            # (Detached: a streamed one's client leaving cancels its request, which must not reach this.)
            task = detached_task(generate(), name=f"background-{base['id']}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        if streamed:
            return SSEStream(self._follow(base["id"], -1, None, serial), [])  # (leaving it leaves the generation)
        return queued

    async def follow(self, response_id: str, starting_after: int | None) -> SSEStream:
        """``GET /v1/responses/{id}?stream=true``: a streamed background response's events after
        ``starting_after`` (all of them without it), those stored and then those to come, through
        whichever replica; a response that was not streamed in the background is a 400."""
        after = -1 if starting_after is None else starting_after
        page = await self._ask_store("events_after", response_id, after, 0.0) if self.store is not None else None
        if page is None:
            raise _not_found(response_id, "response_id", self.store is not None)
        if page.state != "ok":
            why = ("its events are no longer kept (the store keeps a bounded amount)" if page.state == "dropped"
                   else "it was not created with background and stream")
            raise bad_request(f"Response {response_id!r} has no events to stream: {why}; GET it without stream",
                              "stream")
        return SSEStream(self._follow(response_id, after, page, page.serial), [])

    async def _follow(self, response_id: str, after: int, page: EventsPage | None,
                      serial: int | None) -> AsyncIterator[str]:
        """The events of the entry put with ``serial`` (a response that later takes its id, once a
        delete freed it, is not followed)."""
        last_event = time.monotonic()
        while True:
            if page is None:
                if time.monotonic() - last_event > FOLLOW_IDLE_S:  # (its replica died without ending it)
                    yield sse_event("error", after + 1, code="server_error", param=None,
                                    message=f"no events for {FOLLOW_IDLE_S:g} s: the replica generating "
                                            "this response may have stopped")
                    return
                page = await self._ask_store("events_after", response_id, after, FOLLOW_WAIT_S, serial)
            if page is None or page.state != "ok":  # deleted, forgotten, or its events dropped meanwhile
                return
            if page.events:
                yield "".join(page.events)
                after += len(page.events)
                last_event = time.monotonic()
            if page.done:
                return
            page = None

    async def cancel(self, response_id: str) -> Stopped:
        """``POST /v1/responses/{id}/cancel``, the store's part: a queued or in-progress background
        response is marked ``cancelled`` (then ``drop_background`` on its model's serving); one that
        has ended is answered as it is."""
        answer = await self._ask_store("cancel", response_id) if self.store is not None else None
        if answer is None:
            raise _not_found(response_id, "response_id", self.store is not None)
        if isinstance(answer, str):
            raise bad_request(f"Only a background response can be cancelled; {response_id!r} was not created "
                              f"with background (it is {answer})", "response_id")
        return answer

    async def drop_background(self, stopped: Stopped, timeout_s: float = 5.0) -> None:
        """The engines drop a cancelled (or deleted) background response's request and tell the
        replica generating it (whichever replica that is), whose task then ends without storing over
        the cancel."""
        if stopped.engine_base is None:  # (not a background response)
            return
        client = self.serving.client
        request_ids = [choice_request_id(stopped.engine_base, 0)]  # (a response is one choice)

        async def drop(engine: int) -> None:
            try:
                await asyncio.wait_for(client.handle(engine).abort_requests.remote(request_ids, True), timeout_s)
            except Exception as e:
                logger.warning("cancel of %s on engine %d failed: %s", stopped.response["id"], engine, e)

        await asyncio.gather(*(drop(engine) for engine in client.present()))  # (one holds it)

    async def shut_down(self) -> None:
        """The replica is stopping: its background responses end as failed in the store (and no
        new one starts here)."""
        self._closing = True
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _final(self, base: dict[str, Any], run: ChatRun, items: OutputItems) -> dict[str, Any]:
        choice = run.choices[0]
        finish_reason = choice.output_parser.finish_reason(choice.finish_reason) if choice.output_parser \
            else choice.finish_reason
        if finish_reason == "abort":  # the engine dropped the request (a restart, a reset): no full answer
            status, error = "failed", {"code": "server_error", "message": "the engine aborted the request"}
        else:
            status, error = ("incomplete" if finish_reason == "length" else "completed"), None
        if not items.items and status != "failed":
            items.open_empty_message()  # an answer with no text at all still has its (empty) message
        output = items.finish("completed" if status == "completed" else "incomplete")
        prompt, generated = len(run.prompt_ids), len(choice.token_ids)
        # The thinking's share of the output: its tokens, or (tags of several tokens) its text re-encoded.
        reasoning = self.serving.reasoning_tokens(choice)
        if reasoning is None:
            reasoning = sum(len(self.serving.tokenizer.encode(part["text"], add_special_tokens=False))
                            for item in output if item["type"] == "reasoning" for part in item["content"])
        return base | {
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "completed_at": int(time.time()) if status == "completed" else None, "output": output,
            # cache_write_tokens: the engines do not report what they add to their prefix caches.
            "usage": {"input_tokens": prompt,
                      "input_tokens_details": {"cached_tokens": choice.num_cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": prompt + generated}}

    async def _stream(self, base: dict[str, Any], run: ChatRun, keep: Callable[[dict[str, Any]], Awaitable[bool]],
                      logprobs: bool = False) -> AsyncIterator[str]:
        async for events in self._events(base, run, keep, logprobs=logprobs):
            yield "".join(events)

    async def _events(self, base: dict[str, Any], run: ChatRun, keep: Callable[[dict[str, Any]], Awaitable[bool]],
                      created_status: str = "in_progress", logprobs: bool = False) -> AsyncIterator[list[str]]:
        """The response's SSE events, a batch at a time (numbered from 0). ``keep`` has the final
        response before its event goes out, and says whether it goes out (not over a cancel)."""
        sequence = 0
        pending: list[str] = []

        def emit(type_: str, **fields: Any) -> None:
            nonlocal sequence
            pending.append(sse_event(type_, sequence, **fields))
            sequence += 1

        def flush() -> list[str]:
            batch = pending.copy()
            pending.clear()
            return batch

        started = base | {"status": "in_progress"}
        emit("response.created", response=base | {"status": created_status})
        if created_status == "queued":
            emit("response.queued", response=base | {"status": "queued"})
        emit("response.in_progress", response=started)
        yield flush()
        items = OutputItems(emit)
        content_logprobs = _ContentLogprobs(self.serving) if logprobs else None
        try:
            async with contextlib.aclosing(self.serving.parsed_deltas(run)) as deltas:
                async for parsed, event in deltas:
                    items.add(parsed, content_logprobs.take(parsed, event) if content_logprobs else None)
                    if pending:
                        yield flush()
        except _StreamError as e:
            # A timeout or an engine failure: OpenAI's error event, then the response as failed.
            error = e.error
            output = items.finish("incomplete")  # what was produced so far, closed
            emit("error", code="timeout" if error.status == 408 else "server_error", message=error.message, param=None)
            failed = base | {"status": "failed", "output": output,
                             "error": {"code": "server_error", "message": error.message}}
            if await keep(failed):
                emit("response.failed", response=failed)
            yield flush()
            return
        final = self._final(base, run, items)
        if await keep(final):
            emit({"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                final["status"], "response.failed"), response=final)
        yield flush()


class _EventRecorder:
    """Sends a streamed background response's events to the store in order, without holding up the
    generation: events that come while a send is in flight go together in the next. A send that
    fails is sent again with the next (the store skips what it has). ``stopped``: the store has the
    end of the stream, or ended it itself (a cancel, a delete), and the generation should stop."""

    def __init__(self, store: AsyncResponseStore, response_id: str, serial: int) -> None:
        self.store, self.response_id, self.serial = store, response_id, serial
        self.sent = 0  # events the store has
        self.pending: list[str] = []
        self.done = False  # the last events are in pending (or sent)
        self.stopped = False
        self._sending: asyncio.Task | None = None

    @property
    def next_sequence(self) -> int:
        return self.sent + len(self.pending)

    def add(self, events: list[str]) -> None:
        self.pending += events
        if not self.stopped and (self._sending is None or self._sending.done()):
            self._sending = asyncio.create_task(self._send())

    async def finish(self) -> None:
        """Send what is left, marked as the end of the stream."""
        self.done = True
        if self._sending is not None:
            await self._sending
        await self._send()

    async def _send(self) -> None:
        while not self.stopped:
            batch, done = list(self.pending), self.done
            if not batch and not done:
                return
            try:
                kept = await self.store.append_events(self.response_id, self.serial, self.sent, batch, done)
            except Exception as e:  # (sent again with the next events, or at the end)
                logger.warning("could not store events of background response %s: %s", self.response_id, e)
                return
            if not kept:
                self.stopped = True
                return
            self.sent += len(batch)
            del self.pending[:len(batch)]
            if done:
                self.stopped = True  # (nothing may follow the end)
                return


def sse_event(type_: str, sequence: int, **fields: Any) -> str:
    """One Responses API stream event, numbered."""
    return named_sse_event({"type": type_, "sequence_number": sequence, **fields})


def _id_taken(response_id: str) -> APIError:
    return bad_request(f"request_id {response_id!r} is the id of a stored response already: give each "
                       "response an id of its own", "request_id")


def _not_found(response_id: str, param: str, storing: bool) -> APIError:
    why = "" if storing else ": this server does not store responses (start it with --enable-responses-store)"
    return APIError(404, f"Response with id {response_id!r} not found{why}", "NotFoundError", param)
