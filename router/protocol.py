"""OpenAI protocol models (plus vLLM's sampling extras), validated with pydantic at the user edge."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from router.content_format import (
    IMAGE_PART_TYPE,
    TEXT_PART_TYPES,
    VIDEO_PART_TYPE,
    image_part_url,
    is_image_part,
    is_video_part,
    template_content,
)

logger = logging.getLogger(__name__)

# Integers cross to the engine as 64-bit values: larger ones are the client's error (400), not a
# failure to encode on the way to the engine.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# vLLM structured_outputs fields for its other grammar backends (guidance, outlines).
_OTHER_BACKENDS_OPTIONS = ("disable_fallback", "disable_additional_properties", "whitespace_pattern")


_warned_fields: set[tuple[str, str]] = set()
# Field names are the client's: remember (and log) at most this many, each shortened and quoted.
_MAX_WARNED_FIELDS = 256


def _warn_ignored(request_kind: str, names: list[str]) -> None:
    """Fields this server does not know are ignored, as vLLM does; like vLLM it says so in the log
    (once per field, so a client that always sends one does not flood it)."""
    if not names or len(_warned_fields) >= _MAX_WARNED_FIELDS:
        return
    new = [n for n in names if (request_kind, n) not in _warned_fields][:_MAX_WARNED_FIELDS - len(_warned_fields)]
    if new:
        _warned_fields.update((request_kind, n) for n in new)
        logger.warning("%s: ignoring request field(s) this server does not support: %s", request_kind,
                       ", ".join(sorted(repr(str(n)[:64]) for n in new)))


class IgnoredFieldsLogged(BaseModel):
    """A request model whose unknown fields are ignored and said so in the log (once per field), as
    vLLM does."""

    @model_validator(mode="before")
    @classmethod
    def _say_what_is_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _warn_ignored(cls.__name__, [k for k in data if k not in cls.model_fields])
        return data


def invalid(param: str, message: str) -> PydanticCustomError:
    """A cross-field validation error that still names its parameter in the OpenAI error body."""
    return PydanticCustomError("invalid_param", message, {"param": param})


def cache_salt_field() -> Any:
    """vLLM's cache_salt request field (every endpoint whose prompts the engines prefix-cache)."""
    return Field(None, min_length=1, description="vLLM extra: prompts with different salts never share prefix-cache "
                                                 "blocks (so one tenant cannot time whether another's prompt is "
                                                 "cached); the same salt shares as usual.")


def request_id_field() -> Any:
    """vLLM's request_id request field: the answer's id is ``<prefix>-<request_id>``, before the
    X-Request-Id header's (router.app.external_id)."""
    return Field(None, description="vLLM extra: names the answer (its id is <prefix>-<request_id>) and its engine "
                                   "requests in the logs, instead of the X-Request-Id header's id.")


def _is_none(value: Any) -> bool:
    return value is None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    # (vLLM's defaults: stream_options given at all means usage unless include_usage is false or null.)
    include_usage: bool | None = Field(True, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool | None = Field(False, description="vLLM extra: with include_usage, every "
                                                                   "chunk carries its choice's usage so far.")


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")
    # Fields whose null means something other than their default.
    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI lets clients send ``null`` for optional parameters (the openai client does for
        ``temperature=None``): a null optional field takes its default."""
        if isinstance(data, dict):
            fields = cls.model_fields
            _warn_ignored(cls.__name__, [k for k in data if k not in fields])
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required() or k in cls._NULL_KEPT}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options can only be set when stream is true")
        if self.seed == -1:  # vLLM's "no seed" (clients offering a random seed send it): every choice unseeded
            self.seed = None
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise invalid("stop", "stop cannot contain an empty string")  # (vLLM's refusal: it would match anywhere)
        self._structured_output = self._structured_output_spec()
        if self.use_beam_search:
            self._check_beam_search()
        return self

    # What beam search cannot honour: it extends each beam a token at a time in fresh engine requests,
    # so nothing that depends on what a request generated before (stop strings, min_tokens, penalties,
    # grammars) or that reshapes the candidates' logprobs (the engines rank raw logprobs) holds.
    # (Each with the values that ask for nothing; a model's default penalty, not sent, does not count.)
    _NOT_WITH_BEAM_SEARCH: ClassVar[dict[str, tuple[Any, ...]]] = {
        "stop": (None, [], ""), "min_tokens": (0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
        "repetition_penalty": (1.0,), "logit_bias": (None, {}), "allowed_token_ids": (None,), "bad_words": (None, []),
        "prompt_logprobs": (None,), "echo": (False,), "vllm_xargs": (None, {})}

    def _check_beam_search(self) -> None:
        for name, neutral in self._NOT_WITH_BEAM_SEARCH.items():
            if name in self.model_fields_set and getattr(self, name) not in neutral:
                raise invalid(name, f"{name} is not supported with use_beam_search")
        if self._structured_output is not None:
            raise invalid("use_beam_search", "structured output is not supported with use_beam_search")

    def _structured_output_spec(self) -> dict[str, Any] | None:
        """The one output constraint asked for, in the engine's form: OpenAI's response_format, or
        vLLM's structured_outputs (or its older guided_json / guided_regex / guided_choice /
        guided_grammar)."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            if fmt.get("type") == "json_object":
                asked.append(("response_format", {"json_object": True}))
            elif fmt.get("type") == "json_schema":
                json_schema = fmt.get("json_schema")
                schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
                if not isinstance(schema, dict):
                    raise invalid("response_format", "response_format json_schema needs json_schema.schema (an object)")
                asked.append(("response_format", {"json": schema}))
            elif fmt.get("type") == "structural_tag":
                # vLLM's: xgrammar's structural tag ({"type", "format"}), or its older form
                # ({"type", "structures", "triggers"}), the whole object.
                asked.append(("response_format", {"structural_tag": fmt}))
            else:
                raise invalid("response_format", f"response_format type {fmt.get('type')!r} is not supported "
                              "(text, json_object, json_schema or structural_tag)")
        if self.structured_outputs is not None:
            # As vLLM's StructuredOutputsParams: unset (null) fields do not count, and the options
            # only other backends use (xgrammar ignores them in vLLM too) are dropped.
            asked.append(("structured_outputs", {k: v for k, v in self.structured_outputs.items()
                                                 if v is not None and k not in _OTHER_BACKENDS_OPTIONS}))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                asked.append((f"guided_{kind}", {kind: value}))
        if not asked:
            return None
        param, spec = asked[0]
        if len(asked) > 1:
            raise invalid(asked[1][0], f"only one output constraint per request ({', '.join(p for p, _ in asked)})")
        if self.ignore_eos or self.min_tokens:
            raise invalid(param, "structured output cannot be combined with ignore_eos or min_tokens (a "
                          "finished grammar allows only the end of sequence)")
        from engine_core.structured_output import check_structured_output

        try:
            check_structured_output(spec)
        except ValueError as e:
            raise invalid(param, str(e)) from e
        return spec

    @property
    def structured_output(self) -> dict[str, Any] | None:
        return self._structured_output

    model: str | None = Field(None, description="Served model name (see GET /v1/models); by default the first "
                                                "served model (vLLM).")
    max_tokens: int | None = Field(None, ge=1, description="Upper bound on generated tokens.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="vLLM extra: 0 or -1 disables.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM extra.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="Same seed, same tokens.")
    n: int = Field(1, ge=1, le=128, description="Choices per prompt (up to OpenAI's 128).")
    stop: str | list[str] | None = Field(None, description="Stop strings, matched on the text.")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extra: stop on these token ids.")
    include_stop_str_in_output: bool = Field(False, description="vLLM extra.")
    ignore_eos: bool = Field(False, description="vLLM extra: keep generating past EOS.")
    min_tokens: int = Field(0, ge=0, description="vLLM extra: EOS and stop ids are masked until reached.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description="vLLM extra.")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX,
                          description="vLLM extra: lower runs first (needs the priority policy).")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, clamped to [-100, 100].")
    allowed_token_ids: list[int] | None = Field(None, min_length=1,
                                                description="vLLM extra: only these tokens may be sampled.")
    bad_words: list[str] | None = Field(None, description="vLLM extra: words that must not be generated.")
    # Structured output: OpenAI's response_format, or vLLM's extras (at most one of them).
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object, json_schema or structural_tag (vLLM).")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM extra: exactly one of json, json_object, regex, choice, grammar (EBNF), "
                          "structural_tag.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extra (older name).")
    guided_regex: str | None = Field(None, description="vLLM extra (older name).")
    guided_choice: list[str] | None = Field(None, description="vLLM extra (older name).")
    guided_grammar: str | None = Field(None, description="vLLM extra (older name).")
    _structured_output: dict[str, Any] | None = PrivateAttr(default=None)
    skip_special_tokens: bool = Field(True, description="vLLM extra: leave special tokens out of the text.")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM extra: keep only the prompt's last k tokens (-1: max_model_len).")
    prompt_logprobs: int | None = Field(
        None, ge=-1, description="vLLM extra: each prompt token's logprob and the k best alternatives (-1: all; "
                                 "at most --max-logprobs).")
    return_tokens_as_token_ids: bool = Field(
        False, description="vLLM extra: logprobs name tokens 'token_id:N' (for tokens whose text is not valid UTF-8 "
                           "alone, and for callers that work in token ids).")
    use_beam_search: bool = Field(
        False, description="vLLM extra: beam search, n beams wide (n is the beam width); the n best beams are the "
                           "choices.")
    length_penalty: float = Field(1.0, allow_inf_nan=False,
                                  description="vLLM extra: beam scores divide the cumulative logprob by the "
                                              "sequence's length to this power.")
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = Field(
        None, description="vLLM extra: arguments for the engines' custom logits processors (--logits-processors), "
                          "which read them (SamplingParams.extra_args).")
    cache_salt: str | None = cache_salt_field()
    request_id: str | None = request_id_field()
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description="vLLM extra, prefill/decode disaggregation driven by the caller (as vLLM's disaggregated "
                          "proxy does): {\"do_remote_decode\": true} on a prefill (max_tokens 1), whose answer's "
                          "kv_transfer_params go with the same request to a decode engine.")
    return_token_ids: bool = Field(
        False, description="vLLM extra: the answer carries the prompt's token ids and each choice's generated ids "
                           "(streamed: the prompt's in a choice's first chunk, each chunk's own ids).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, description="Text or token ids (may be left out, or empty text, when prompt_embeds is given).")
    prompt_embeds: str | list[str] | None = Field(
        None, description="vLLM extra (--enable-prompt-embeds): prompts given as embeddings, each the base64 of a "
                          "torch.save-d [tokens, hidden_size] float tensor; they come before the prompts of "
                          "``prompt``.")
    echo: bool = Field(False, description="Prepend the prompt to the completion.")
    add_special_tokens: bool = Field(True, description="vLLM extra: the tokenizer adds its special tokens (a BOS) to "
                                                       "a text prompt; false for a prompt that already has them.")
    logprobs: int | None = Field(None, ge=-1, description="Top logprobs per token (-1: all; at most --max-logprobs).")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: the prompt (and its logprobs) alone; "
                                                         "null: up to the context's end (as vLLM's).")
    suffix: str | None = None
    _NULL_KEPT: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    @model_validator(mode="after")
    def _prompt_not_empty(self) -> CompletionRequest:
        if not self.prompt_embeds_list():
            if self.prompt is None:
                raise invalid("prompt", "prompt is required (or prompt_embeds, where the server takes them)")
            if isinstance(self.prompt, list) and len(self.prompt) == 0:
                raise invalid("prompt", "prompt must not be empty")
        if self.suffix:
            raise invalid("suffix", "suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens", "max_tokens must be at least 1 unless echo is true")
        return self

    def prompt_embeds_list(self) -> list[str]:
        p = self.prompt_embeds
        return [] if p is None else [p] if isinstance(p, str) else list(p)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of ``prompt``; with prompt_embeds, none for a missing or empty one (the
        ``openai`` client's way to send embeddings alone is ``prompt=""``)."""
        p = self.prompt
        if p is None or (self.prompt_embeds_list() and (p == "" or (isinstance(p, list) and all(x == "" for x in p)))):
            return []
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any] | str] | None = None

    def text(self) -> str:
        """The content as text (text parts joined by newlines, as vLLM renders them)."""
        return template_content(self.content, "string")

    @model_validator(mode="after")
    def _text_and_images(self) -> ChatMessage:
        # Other kinds of part (audio, image embeddings) cannot be shown to the models served: refused
        # rather than silently dropped. Images go to vision-language models, videos to those that
        # take them (a model's serving refuses what it does not take, naming the model).
        for part in self.content if isinstance(self.content, list) else ():
            if isinstance(part, str) or part.get("type") in TEXT_PART_TYPES:  # (bare strings: text)
                continue
            kind = part.get("type")
            if kind not in (IMAGE_PART_TYPE, VIDEO_PART_TYPE):
                raise invalid("messages", f"message content of type {kind!r} is not supported "
                              f"(text, {IMAGE_PART_TYPE} and {VIDEO_PART_TYPE} only)")
            media = part.get(kind)
            if not isinstance(media, dict) or not isinstance(media.get("url"), str):
                article = "an" if kind == IMAGE_PART_TYPE else "a"
                raise invalid("messages", f'{article} {kind} part must be {{"type": "{kind}", "{kind}": '
                              '{"url": "..."}}')
        return self

    def images(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        return [image_part_url(p) for p in self.content if is_image_part(p)] if isinstance(self.content, list) \
            else []

    def videos(self) -> list[str]:
        """The URLs of the message's video parts, in order."""
        return [p[VIDEO_PART_TYPE]["url"] for p in self.content if is_video_part(p)] \
            if isinstance(self.content, list) else []


class FunctionDefinition(BaseModel):
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class ChatCompletionTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Preferred over max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1, description="-1: all; at most --max-logprobs.")
    add_generation_prompt: bool = Field(True, description="vLLM extra.")
    add_special_tokens: bool = Field(False, description="vLLM extra: the tokenizer adds its special tokens to the "
                                                        "rendered conversation too (templates write their own).")
    continue_final_message: bool = Field(False, description="vLLM extra: the answer continues the last message "
                                                            "(needs add_generation_prompt false).")
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's per-request template: run only under --trust-request-chat-template (otherwise the
    # server's template, or --chat-template, writes every conversation).
    chat_template: str | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool = Field(True, description="More than one call per answer (required, or auto).")
    include_reasoning: bool = Field(True, description="vLLM extra: with --reasoning-parser, return the thinking.")
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="How long the model thinks, where its chat template reads reasoning_effort (gpt-oss's "
                          "system message); chat_template_kwargs' own reasoning_effort is over it.")
    echo: bool = Field(False, description="vLLM extra: an answer in the role of the last message starts with that "
                                          "message's text (the answer continues it).")
    documents: list[dict[str, Any]] | None = Field(
        None, description="vLLM extra: documents for a RAG chat template (each with title and text); a template "
                          "without RAG ignores them.")
    # (Chat's echo repeats the last message: beam search honours it.)
    _NOT_WITH_BEAM_SEARCH: ClassVar[dict[str, tuple[Any, ...]]] = {
        k: v for k, v in SamplingFields._NOT_WITH_BEAM_SEARCH.items() if k != "echo"}
    # OpenAI's older form of tools: refused.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                          "be true")
        if self.functions and self.function_call != "none":
            raise invalid("functions", "functions and function_call are deprecated and not supported: use tools")
        self._check_tool_choice()
        return self

    def _check_tool_choice(self) -> None:
        """A named or required tool choice constrains the output (as structured output does)."""
        choice = self.effective_tool_choice
        names = [t.function.name for t in self.tools or ()]
        if choice != "none" and not names:
            raise invalid("tool_choice", "when tool_choice is set (other than none), tools must be given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid("tool_choice", f"tool_choice names the function {choice.function.name!r}, which is not "
                          "among the tools")
        if choice in ("none", "auto"):  # the model answers freely
            return
        from router.tool_choice import tool_choice_constraint

        try:
            constraint = tool_choice_constraint(self.tool_dicts(), self.tool_choice_form(), self.parallel_tool_calls)
        except ValueError as e:
            raise invalid("tools", str(e)) from e
        assert constraint is not None
        if self._structured_output is not None:
            raise invalid("tool_choice", "a named or required tool_choice cannot be combined with response_format "
                          "or structured outputs")
        if self.ignore_eos or self.min_tokens:
            raise invalid("tool_choice", "a named or required tool_choice cannot be combined with ignore_eos or "
                          "min_tokens")
        from engine_core.structured_output import check_structured_output

        try:
            check_structured_output(constraint)
        except ValueError as e:
            raise invalid("tools", f"a tool's parameters schema is not usable: {e}") from e
        self._structured_output = constraint

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_choice_form(self) -> str | dict[str, Any]:
        """The effective tool_choice as plain data ("none", "auto", "required" or the named form)."""
        choice = self.effective_tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as the chat template and the tool-call code take them."""
        return tool_dicts(self.tools)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (as vLLM: null otherwise).
    prompt_tokens_details: PromptTokensDetails | None = None
    # Chat answers read by a reasoning parser: the thinking's share of completion_tokens (OpenAI's and
    # vLLM's field; null otherwise).
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


FinishReasonLiteral = Literal["stop", "length", "tool_calls", "abort", "error"] | None


class PromptLogprob(BaseModel):
    """vLLM's: a prompt token's (or an alternative's) logprob, its rank and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: one {token id: PromptLogprob} per prompt token (None for the first).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonLiteral = None
    stop_reason: int | str | None = None
    # With return_token_ids (vLLM): the prompt's ids (streamed: in the choice's first chunk) and the generated ids.
    # (Left out of the JSON when not asked for, so plain answers and chunks stay as they were.)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_is_none)
    token_ids: list[int] | None = Field(None, exclude_if=_is_none)


class CompletionChoice(CompletionStreamChoice):
    # (not streamed: prompt_logprobs and stream are refused together, as in vLLM)
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # vLLM extra: a prefill for a remote decode (kv_transfer_params.do_remote_decode): what names its KV.
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=_is_none)


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(..., description="JSON text, as the model wrote it.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: str = "assistant"  # (--response-role)
    content: str | None = None
    # vLLM extra, with --reasoning-parser: the answer's thinking, under vLLM's current name and its
    # earlier one (clients read either).
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonLiteral = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_is_none)  # with return_token_ids (vLLM)


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_is_none)  # with return_token_ids (vLLM)
    # vLLM extra: a prefill for a remote decode (kv_transfer_params.do_remote_decode): what names its KV.
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=_is_none)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonLiteral = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_is_none)  # with return_token_ids (vLLM): this chunk's ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # With return_token_ids (vLLM): in a choice's first (role) chunk.
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_is_none)


class CompletionStreamChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission entry of a model card: everything allowed."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llm-cluster"
    # vLLM's fields: the model as the server was given it (--model; an adapter's path), and an
    # adapter's base model.
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body; ``base_model_name`` (the name vLLM's JSON
    ``--lora-modules`` entries use for an adapter's base) picks the served model it is loaded on
    when several are served (default: the first that takes adapters, or the adapter's own model
    when ``load_inplace`` reloads one). ``load_inplace``: a name already loaded is reloaded from
    ``lora_path`` (a trainer's new weights) rather than refused."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def tool_dicts(tools: list[ChatCompletionTool] | None) -> list[dict[str, Any]]:
    """Tools as the chat template and the tool-call code take them."""
    return [t.model_dump(exclude_none=True) for t in tools or ()]


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize requests in one: ``prompt``, or ``messages`` written as chat writes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # Whether the tokenizer adds its own special tokens (BOS): by default for a prompt, not for
    # messages, whose chat template writes them (as vLLM's defaults, and as chat sends them).
    add_special_tokens: bool | None = None
    return_token_strs: bool = Field(False, description="Also each token as the vocabulary spells it.")
    # With messages, as on chat completions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = Field(None, description="With messages: the tools the template shows.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tools and self.messages is None:
            raise invalid("tools", "tools go with messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                          "be true")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
