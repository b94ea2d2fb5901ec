"""The OpenAI endpoints' logic, independent of the web framework that hosts it.

A request is validated (pydantic), rendered (chat template) and tokenised, checked against the
model's context, routed to an engine, then each choice's tokens are detokenised incrementally and
returned as one JSON body or as SSE chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import msgspec
from pydantic import ValidationError

from engine_core.beam_search import BeamSearch, candidates_per_beam
from engine_core.executor import PoolingInfo
from engine_core.kv_transfer import wants_remote_decode
from engine_core.multimodal import ImageGeometry, MultiModalFeature
from engine_core.outputs import EngineCoreOutput, EngineCoreRequest, LogprobsEntry, LoRARequest
from engine_core.prompt_embeds import PromptEmbeds, decode_prompt_embeds
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams, logprobs_count
from router.bad_words import bad_words_token_ids
from router.chat_parsing import ChatOutputParser
from router.content_format import is_media_part, resolve_content_format, template_content
from router.detached import SharedRun, runs_to_completion
from router.detokenizer import IncrementalDetokenizer, fast_decoder, token_bytes, token_text
from router.disaggregation import EngineRoles, needs_remote_prefill, run_prefill
from router.engine_client import (
    EngineClient,
    EngineOverloadedError,
    EngineRefusedError,
    EngineUnavailableError,
    RequestRefusedByEngineError,
    RequestStream,
    RequestTimeoutError,
    UnknownModelError,
)
from router.harmony import HarmonyParser
from router.harmony import marker_ids as harmony_marker_ids
from router.harmony import reasoning_token_count as harmony_reasoning_tokens
from router.image_tiles import tiled_image_tokens
from router.metrics import RouterMetrics
from router.multimodal import (
    DEFAULT_LIMIT_PER_PROMPT,
    MODALITIES,
    MediaConnector,
    MultiModalProcessor,
    image_placeholder,
    image_prompt_text,
    timed_video_tokens,
    video_placeholder,
)
from router.parsed_output import ParsedDelta
from router.protocol import (
    INT64_MIN,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamChunk,
    CompletionTokensDetails,
    DeltaMessage,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    ToolCall,
    UsageInfo,
)
from router.reasoning_parsers import (
    HARMONY_REASONING_PARSER,
    HARMONY_TOOL_CALL_PARSER,
    THINKS_FIRST,
    create_reasoning_parser,
    think_tags,
)
from router.routing import NoHealthyEngineError, RoutingContext, RoutingPolicy
from router.tool_parsers import create_tool_call_parser
from router.video import video_sampling_from

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an OpenAI-style body and an HTTP status."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        # The body's code: the status (vLLM's), or OpenAI's name for the error where clients act on it.
        self.code: int | str = code or status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The longest X-Request-Id taken into an answer's id (a longer one is cut).
MAX_EXTERNAL_ID_LEN = 128
# A LoRA adapter load or unload on one engine: beyond it the engine is taken as not answering (the
# change is undone on the engines asked), so the router's one-at-a-time adapter lock is never held for good.
LORA_CALL_TIMEOUT_S = 120.0


def answer_ids(prefix: str, external_id: str | None) -> tuple[str, str]:
    """(the answer's id, the base of its engine request ids). With the request's X-Request-Id the
    answer is ``<prefix>-<that id>``, as vLLM names it, so the id a gateway or Ray Serve's access log
    knows names it in our logs and the engines'; its engine requests add a random part, since two
    requests may come with one id. Without, a new random id serves as both."""
    external_id = (external_id or "").strip()[:MAX_EXTERNAL_ID_LEN]
    if not external_id:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return request_id, request_id
    request_id = f"{prefix}-{external_id}"
    return request_id, f"{request_id}-{secrets.token_hex(4)}"


T = TypeVar("T")

# Text up to this many characters is tokenized on the event loop (a millisecond or so: less than the
# hop to a thread would add); longer text in the replica's tokenizer thread.
# How many of a request's engine requests (its choices, prompts, inputs) are sent before their
# admissions are awaited together.
OPEN_AT_ONCE = 16
TOKENIZE_INLINE_CHARS = 8192


def conversation_chars(messages: list[ChatMessage], *more: Any) -> int:
    """About how much text a conversation's rendering and tokenization read: its messages' content
    and their other fields (reasoning, tool calls), and ``more`` (tools, documents) the template shows."""
    return sum((len(m.content) if isinstance(m.content, str)
                else len(str([p for p in m.content or () if not is_media_part(p)])))  # (no image's bytes)
               + (len(str(m.model_extra)) if m.model_extra else 0) for m in messages) \
        + sum(len(str(item)) for item in more if item)


def choice_request_id(request_id: str, index: int) -> str:
    """The engines' id for choice ``index`` of an HTTP request (each choice is one engine request)."""
    return f"{request_id}-{index}"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


def validation_problem(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A pydantic error list as one message and the parameter it names (None: the body)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    if first.get("type") == "invalid_param":  # a cross-field check (protocol.invalid) names its parameter
        return first["msg"], first["ctx"]["param"]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query")]
    return f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", loc[0] if loc else None


def required_text(obj: dict[str, Any], key: str, where: str, param: str) -> str:
    """``obj[key]``, a non-empty string, or a 400 naming ``param`` (another API's input item)."""
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} is required", param)
    return value


def chat_request_from(body: dict[str, Any], param_names: dict[str, str], default_param: str) -> ChatCompletionRequest:
    """The chat request another API (Responses, Anthropic's Messages) runs as, from the fields it
    wrote; a field the chat request refuses is a 400 naming the other API's parameter
    (``param_names``: chat names to its own; ``default_param`` when the error names none)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        if first.get("type") == "invalid_param":
            param = first["ctx"]["param"]
            raise bad_request(first["msg"], param_names.get(param, param)) from None
        loc = [str(x) for x in first.get("loc", ())]
        param = param_names.get(loc[0], loc[0]) if loc else default_param
        raise bad_request(f"{'.'.join([param, *loc[1:]])}: {first.get('msg', 'invalid value')}", param) from None


# The sampling parameters a model's generation config may give defaults to (besides max_tokens).
DEFAULTED_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class CORSSettings:
    """Which browsers on other origins may call the API (vLLM's --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials; open by default, as vLLM's)."""

    allow_origins: tuple[str, ...] = ("*",)
    allow_methods: tuple[str, ...] = ("*",)
    allow_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass
class ServingSettings:
    served_model_name: str
    max_model_len: int
    # Further names a request may use for the model (vLLM's --served-model-name a b ...); responses,
    # /v1/models' first card and the metrics carry served_model_name.
    served_model_aliases: tuple[str, ...] = ()
    # The model as the user gave it (--model): the root of its /v1/models cards ("": the served name).
    model_root: str = ""
    block_size: int = 16
    scheduling_policy: str = "fcfs"
    request_timeout_s: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The model's sampling defaults (its generation config, --generation-config): what a request gets for
    # the parameters it leaves unset, and max_tokens, a cap on every request's.
    default_sampling_params: dict[str, float | int] = field(default_factory=dict)
    # The most logprobs a request may ask for per token (--max-logprobs), and the model's vocabulary
    # (what -1, "all", means; 0: the tokenizer's).
    max_logprobs: int = 20
    vocab_size: int = 0
    # The model's hidden size: an embedding's values (0: unknown, not checked).
    hidden_size: int = 0
    # The width of the model's input embeddings (prompt_embeds rows); 0: not checked here.
    input_embedding_size: int = 0
    # The engines' PoolingInfo: whether the model generates (else generation endpoints answer 400),
    # how it pools embeddings, and a classifier's classes.
    pooling: PoolingInfo = field(default_factory=PoolingInfo)
    version: str = "0.1.0"
    # The parser of the model's own tool-call format, when tool_choice "auto" is enabled
    # (--enable-auto-tool-choice --tool-call-parser); None: "auto" is refused, as in vLLM.
    tool_call_parser: str | None = None
    # --reasoning-parser: chat answers' <think>...</think> goes to reasoning_content.
    reasoning_parser: str | None = None
    # --api-key: /v1 requests need one of these as a Bearer token (none: no authentication).
    api_keys: tuple[str, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter exist (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING; --allow-runtime-lora-updating here).
    allow_runtime_lora_updating: bool = False
    # POST /pause, /resume, /reset_prefix_cache and GET /is_paused exist (vLLM's VLLM_SERVER_DEV_MODE
    # endpoints; --server-dev-mode here). They act on every engine, for every router replica.
    server_dev_mode: bool = False
    # --trust-request-chat-template (vLLM's): a request's own chat_template is run (else a 400).
    trust_request_chat_template: bool = False
    # --enable-prompt-tokens-details (vLLM's): usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False
    # --stream-interval (vLLM's): a streamed choice sends its first tokens at once, then waits until
    # it has this many new tokens (or has finished) before its next chunk. Fewer, larger chunks cost
    # the router, the ingress and the client less CPU per request; 1 sends every engine output.
    stream_interval: int = 1
    # Every engine was started with --enable-sleep-mode: the operators' /sleep and /wake_up act on them.
    enable_sleep_mode: bool = False
    # --enable-prompt-embeds on every engine: completions may give prompts as embeddings.
    enable_prompt_embeds: bool = False
    # --enable-server-load-tracking (vLLM's): GET /load counts the requests in progress.
    enable_server_load_tracking: bool = False
    # --enable-tokenizer-info-endpoint (vLLM's): GET /tokenizer_info exists.
    enable_tokenizer_info_endpoint: bool = False
    # --default-chat-template-kwargs (vLLM's): every chat template render gets these, under the
    # request's own chat_template_kwargs (e.g. {"enable_thinking": false} for Qwen3).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # --enable-log-requests and --max-log-len (vLLM's): each engine request's parameters go to the
    # log at INFO, its prompt at DEBUG, cut to max_log_len characters (and token ids).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # --enable-log-outputs (vLLM's): each finished choice's text, token ids and finish reason (INFO).
    enable_log_outputs: bool = False
    # vLLM's --enable-force-include-usage (every stream ends with a usage chunk, as platforms that
    # bill by token need), --return-tokens-as-token-ids (logprobs name tokens token_id:N for every
    # request), --exclude-tools-when-tool-choice-none and --disable-fastapi-docs (no /docs, /redoc,
    # /openapi.json).
    enable_force_include_usage: bool = False
    # JSON constraints leave out optional whitespace, whatever a request says (vLLM's
    # --structured-outputs-config disable_any_whitespace).
    structured_outputs_disable_any_whitespace: bool = False
    return_tokens_as_token_ids: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    disable_fastapi_docs: bool = False
    # vLLM's --response-role (chat answers' role when the prompt opens the assistant's turn) and
    # --chat-template-content-format (router.content_format).
    response_role: str = "assistant"
    chat_template_content_format: str = "auto"
    # CORS (vLLM's --allowed-origins, ...).
    cors: CORSSettings = field(default_factory=CORSSettings)
    # A vision-language model (its engines' ModelInfo): the prompt token an image's placeholders
    # are, and how many stand for one image; None: the model takes text only.
    image_token_id: int | None = None
    image_geometry: ImageGeometry | None = None
    # A model that takes videos too (Qwen2-VL, Qwen2.5-VL): the token a video's rows replace.
    video_token_id: int | None = None
    # vLLM's --limit-mm-per-prompt: the most items of a modality one prompt may carry (a modality
    # not named: DEFAULT_LIMIT_PER_PROMPT, vLLM v1's 999).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    # vLLM's --allowed-local-media-path: file:// image URLs are read from under this directory only
    # ("": none are).
    allowed_local_media_path: str = ""
    # vLLM's --allowed-media-domains: the hosts http(s) images may come from (empty: any).
    allowed_media_domains: tuple[str, ...] = ()
    # vLLM's --mm-processor-cache-gb: GiB of processed images kept (0: none).
    mm_processor_cache_gb: float = 0.0
    # vLLM's --media-io-kwargs: how videos' frames are sampled ({"video": {"num_frames": N}} or fps).
    media_io_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        for modality, limit in self.limit_mm_per_prompt.items():
            if modality not in MODALITIES or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt maps modalities ({', '.join(MODALITIES)}) to counts >= 0, "
                                 f"got {modality!r}: {limit!r}")
        if (self.image_token_id is None) != (self.image_geometry is None):
            raise ValueError("a model that takes images needs both its image token and its image geometry")
        if len(set(self.served_names)) < len(self.served_names):
            raise ValueError(f"served_model_name and served_model_aliases repeat a name: {list(self.served_names)}")

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name of the model, its first the one responses carry."""
        return (self.served_model_name, *self.served_model_aliases)


@dataclass
class _Choice:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # The prompt's logprobs (positions 1..n-1), with the first output, when echo asked for them.
    prompt_logprobs: LogprobsEntry | None = None
    # Chat with a reasoning parser or tools: splits the choice's text into reasoning, content, calls.
    output_parser: ChatOutputParser | None = None
    # Prompt tokens the engine found in its prefix cache (usage's cached tokens).
    num_cached_tokens: int = 0
    # A prefill for a remote decode: the parameters naming its KV blocks (vLLM's kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class _Delta:
    """What one streamed chunk of a choice carries, captured when its outputs arrived (the choice
    itself may have moved on, even finished, by the time a merged stream sends the chunk)."""

    choice: _Choice
    text: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    finish_reason: str | None
    stop_reason: int | str | None
    num_tokens: int  # the choice's tokens so far


def _client_kv_params(params: dict[str, Any] | None, first: bool) -> dict[str, Any] | None:
    """A client's own kv_transfer_params go with its request's first job only: a prefill leg's
    answer carries one set of parameters (holding blocks for the other jobs would only wait for their
    timeout), and a decode leg's name blocks held for one reader (the other jobs compute the prompt)."""
    return params if first else None


class _Job(NamedTuple):
    """One engine request to open: its engine, id, prompt (placeholder ids for a prompt given as
    embeddings, which come in ``prompt_embeds``) and parameters."""

    engine: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_embeds: PromptEmbeds | None = None
    num_choices: int = 1  # (its request's n on its first choice, 0 on the others: for the engine's metrics)
    # A client's own prefill/decode disaggregation parameters (vLLM's kv_transfer_params), passed on.
    kv_transfer_params: dict[str, Any] | None = None
    # The prompt's images (their placeholders in ``prompt_ids``), shared by its choices.
    mm_features: list[MultiModalFeature] | None = None


@dataclass
class _BeamPlan:
    """One prompt's beam search, checked: its one-token round request, its rounds, the logprobs shown."""

    prompt_ids: list[int]
    step: SamplingParams
    rounds: int
    logprobs: int | None


@dataclass
class ChatRun:
    """A chat request sent to its engine: its choices fill in as the outputs are read (beam
    search's come complete, with no streams)."""

    request_id: str
    created: int
    prompt_ids: list[int]
    choices: list[_Choice]
    streams: list[RequestStream]


_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
           FinishReason.ERROR: "error"}


def _copy_of(tokenizer: Any) -> Any | None:
    """A copy of a tokenizer for the tokenizer thread, made as the replica starts (before it serves:
    the copy reads the tokenizer); None for one that does not copy."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:
        logger.warning("the tokenizer does not copy (%s): short text waits while the tokenizer thread "
                       "works on long text", e)
        return None


class OpenAIServing:
    def __init__(self, settings: ServingSettings, client: EngineClient, tokenizer: Any, policy: RoutingPolicy,
                 metrics: RouterMetrics | None = None, image_processor: Any | None = None) -> None:
        """``image_processor``: a vision-language model's (transformers' image processor: its
        preprocessor_config.json), which turns images into the encoder's input."""
        self.settings = settings
        self.client = client
        self._loop_tokenizer = tokenizer
        self._decode = fast_decoder(tokenizer)
        # Long texts are tokenized here (see tokenizer_work); made at the first one, with a copy of
        # the tokenizer of its own (``tokenizer`` in that thread).
        self._tokenizer_thread: ThreadPoolExecutor | None = None
        self._thread_tokenizer = threading.local()
        self._tokenizer_copy = _copy_of(tokenizer)  # (None: one that does not copy; see tokenizer_work)
        self._tokenizer_jobs = 0  # sent to that thread and not finished
        self.policy = policy
        self.metrics = metrics
        # Prefill/decode disaggregation: which engines compute prompts and which decode them (None:
        # every engine serves its requests whole; router.disaggregation).
        self.engine_roles: EngineRoles | None = None
        # A prompt goes to a prefill engine only with more than this many tokens, and more than a KV
        # block, outside its decode engine's prefix cache (as the policy knows it): llm-d's selective P/D.
        self.pd_prefill_threshold = 0
        self.kv_block_size = 16
        # The tokens that open and close a reasoning model's thinking, when each is one token of the
        # vocabulary (as in reasoning models): the engine starts an output constraint after the
        # closing one, and a prompt that already closed the thinking (thinking switched off) is
        # answered without any. Where they are special tokens (Mistral's [THINK] and [/THINK]), an
        # answer the reasoning parser reads is decoded with its special tokens, so it sees them.
        start, end = think_tags(settings.reasoning_parser)
        self._think_start_id = _single_token_id(tokenizer, start)
        self._think_end_id = _single_token_id(tokenizer, end)
        # (Asked of the decoder itself: a tekken vocabulary's control tokens are special to it without
        # being named in the tokenizer's special tokens.)
        self._think_tags_special = any(tag is not None and tokenizer.decode([tag], skip_special_tokens=True) == ""
                                       for tag in (self._think_start_id, self._think_end_id))
        # gpt-oss: answers are harmony messages (router.harmony), decoded with their markers; an output
        # constraint holds over the final channel's body: after the tokens of ``<|channel|>final`` and
        # then the next ``<|message|>`` (its header may name a format between: `` <|constrain|>json``).
        self._harmony = (settings.reasoning_parser == HARMONY_REASONING_PARSER
                         or settings.tool_call_parser == HARMONY_TOOL_CALL_PARSER)
        self._harmony_markers = harmony_marker_ids(tokenizer.get_vocab()) if self._harmony else {}
        self._harmony_marker_ids = frozenset(self._harmony_markers.values())
        self._harmony_final = tokenizer.encode("<|channel|>final", add_special_tokens=False) if self._harmony else []
        self._harmony_message = self._harmony_markers.get("<|message|>")
        # A request's EOS is the tokenizer's, as vLLM's is; the engine adds the model's further EOS
        # ids (its generation config: Llama 3's <|end_of_text|> beside <|eot_id|>) as stop ids, and
        # an answer they end names them as its stop_reason.
        self.eos_token_id = _primary_eos(tokenizer, settings.eos_token_ids)
        # LoRA adapters clients may name as ``model``, by name. The engines are the registry: an
        # unknown name is looked up there (``list_loras``) before it is refused, so adapters loaded
        # through another replica are found.
        self.lora_adapters: dict[str, LoRARequest] = {}
        self.list_loras: Callable[[], Coroutine[Any, Any, list[LoRARequest]]] | None = None
        self._shared_list_loras = SharedRun(lambda: self.list_loras())  # type: ignore[misc]
        self._shadowed_loras: set[str] = set()  # (warned about once)
        self._token_texts: dict[int, str] = {}  # (at most one entry per token of the vocabulary)
        self._token_bytes: dict[int, list[int]] = {}  # (the same)
        # A vision-language model's images (router.multimodal); None: the model takes text only.
        self.images: MultiModalProcessor | None = None
        if settings.image_token_id is not None:
            self.images = MultiModalProcessor(
                settings.image_token_id, settings.image_geometry, image_processor,
                settings.model_root or settings.served_model_name,
                placeholder=image_placeholder(tokenizer, settings.image_token_id, settings.image_geometry),
                media=MediaConnector(settings.allowed_local_media_path,
                                     allowed_media_domains=settings.allowed_media_domains),
                max_images=settings.limit_mm_per_prompt.get("image", DEFAULT_LIMIT_PER_PROMPT),
                cache_bytes=int(settings.mm_processor_cache_gb * 2**30),
                on_cache_lookup=None if metrics is None else metrics.record_mm_cache_lookup,
                prompt_replacement=image_prompt_text(tokenizer, settings.image_token_id, settings.image_geometry),
                video_token_id=settings.video_token_id,
                video_placeholder=video_placeholder(tokenizer, settings.video_token_id),
                max_videos=settings.limit_mm_per_prompt.get("video", DEFAULT_LIMIT_PER_PROMPT),
                video_sampling=video_sampling_from(settings.media_io_kwargs),
                timed_videos=timed_video_tokens(tokenizer, settings.video_token_id, settings.image_geometry),
                tiled_images=tiled_image_tokens(tokenizer, image_processor, settings.image_token_id,
                                                settings.image_geometry))

    # -- request preparation ------------------------------------------------------------------------

    async def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model; 404 for anything else."""
        if model is None or model in self.settings.served_names:
            return None
        lora = self.lora_adapters.get(model)
        if lora is None and self.list_loras is not None:
            await self.refresh_loras()
            lora = self.lora_adapters.get(model)
        if lora is None:
            raise unknown_model(model)
        return lora

    async def refresh_loras(self) -> None:
        """Ask the engines which adapters they hold. Requests that ask while a round of questions is
        under way share it (a burst naming unknown models makes one round); it runs to its end even
        if they leave: an engine's answer cancelled with them would leave its adapters out of those
        every request sees."""
        if self.list_loras is not None:
            loras = {lora.lora_name: lora for lora in await self._shared_list_loras()}
            for name in self.settings.served_names:
                # (An adapter loaded at runtime before a redeploy gave the model this name: the name
                # now means the model, and the adapter cannot be reached by it.)
                if loras.pop(name, None) is not None and name not in self._shadowed_loras:
                    self._shadowed_loras.add(name)
                    logger.warning("the LoRA adapter %r is not served: %r is now a name of the model", name, name)
            self.lora_adapters = loras

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> LoRARequest:
        """Load an adapter on every engine, or on none: an engine that refuses it (a checkpoint the
        model cannot serve) undoes the loads before it. Each load gets a new id, so KV cached under an
        earlier load of the same name (whose files may have changed since) is never reused.

        ``load_inplace`` reloads an adapter already loaded under ``name`` (vLLM's, for a trainer
        publishing new weights): once every engine has the new load, new requests naming it get it,
        while the requests already running under the earlier load finish with it; each engine then
        unloads the earlier one (an unload would be refused while they run)."""
        await self.refresh_loras()
        earlier = self.lora_adapters.get(name)
        if name in self.settings.served_names or (earlier is not None and not load_inplace):
            raise bad_request(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                              "adapter in place, set 'load_inplace' to True.", "lora_name")
        lora = LoRARequest(name, new_dynamic_lora_id(), path)
        replacing = None if earlier is None else earlier.lora_int_id
        asked: list[int] = []  # (one that timed out may load it still: undone too)
        try:
            # (An engine started later, by the autoscaler, is given it when a request needs it there.)
            for engine in self.client.present():
                asked.append(engine)
                # (replacing only when there is one: an engine kept from an earlier release takes one argument)
                add = self.client.handle(engine).add_lora
                await asyncio.wait_for(add.remote(lora) if replacing is None else add.remote(lora, replacing),
                                       LORA_CALL_TIMEOUT_S)
        except Exception as e:
            for engine in asked:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.client.handle(engine).remove_lora.remote(lora.lora_int_id),
                                           LORA_CALL_TIMEOUT_S)
            why = _lora_call_failure(e, asked[-1])
            if isinstance(getattr(e, "cause", None) or e, FileNotFoundError):  # (no such path: vLLM's 404)
                raise APIError(404, f"Failed to load the lora adapter '{name}': {why}", "NotFoundError",
                               "lora_path") from e
            raise bad_request(f"Failed to load the lora adapter '{name}': {why}", "lora_path") from e
        self.lora_adapters[name] = lora
        if replacing is not None:
            await self._retire_lora(replacing, asked)
        return lora

    async def _retire_lora(self, lora_int_id: int, engines: list[int]) -> None:
        """After an in-place reload: the earlier load takes no new requests on these engines and is
        unloaded once its requests finish. (An engine that does not answer keeps listing it beside
        the new load until it restarts: warned, since the new load is in place everywhere.)"""
        results = await asyncio.gather(*(
            asyncio.wait_for(self.client.handle(engine).retire_lora.remote(lora_int_id), LORA_CALL_TIMEOUT_S)
            for engine in engines), return_exceptions=True)
        for engine, result in zip(engines, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("engine %d could not retire LoRA id %d after its in-place reload: %s", engine,
                               lora_int_id, _lora_call_failure(result, engine))

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter from every engine, or from none: while requests still run under it on
        any engine, the unload is refused (and an engine that refuses late gets it back elsewhere)."""
        await self.refresh_loras()
        lora = self.lora_adapters.get(name)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
        engines = self.client.present()
        handles = [self.client.handle(engine) for engine in engines]
        users = sum([await h.lora_users.remote(lora.lora_int_id) for h in handles])
        if users:
            raise bad_request(f"The lora adapter '{name}' is in use by {users} requests; unload it once they "
                              "finish.", "lora_name")
        asked = []
        try:
            for handle in handles:
                asked.append(handle)
                await asyncio.wait_for(handle.remove_lora.remote(lora.lora_int_id), LORA_CALL_TIMEOUT_S)
        except Exception as e:  # (a request arrived since the check, or an engine did not answer)
            for handle in asked:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(handle.add_lora.remote(lora), LORA_CALL_TIMEOUT_S)
            why = _lora_call_failure(e, engines[len(asked) - 1])
            raise bad_request(f"Failed to unload the lora adapter '{name}': {why}", "lora_name") from e
        self.lora_adapters.pop(name, None)

    # -- operators' endpoints (--server-dev-mode): every engine of this model at once ------------------

    @runs_to_completion
    async def _each_engine(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every engine concurrently; a 503 naming the engines that failed. (On
        every engine even if the operator's client leaves: not on some of them.)"""
        engines = self.client.present()
        handles = [self.client.handle(engine) for engine in engines]
        results = await asyncio.gather(*(getattr(h, method).remote(*args) for h in handles), return_exceptions=True)
        failed = {engine: r for engine, r in zip(engines, results, strict=True) if isinstance(r, BaseException)}
        if failed:
            detail = "; ".join(f"engine {e}: {_remote_message(r)}" for e, r in failed.items())  # type: ignore[arg-type]
            raise APIError(503, f"{method} failed on {len(failed)} of {len(handles)} engines: {detail}",
                           "ServiceUnavailableError")
        return results

    async def pause_generation(self, mode: str, clear_cache: bool) -> list[bool]:
        """Per engine, whether its prefix cache was emptied."""
        return await self._each_engine("pause_generation", mode, clear_cache)

    async def resume_generation(self) -> list[bool]:
        """Per engine, whether it resumed (a sleeping engine stays paused until wake_up)."""
        return await self._each_engine("resume")

    async def sleep(self, level: int, mode: str) -> None:
        await self._each_engine("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None) -> list[bool]:
        """Per engine, whether it still sleeps."""
        return await self._each_engine("wake_up", tags)

    async def sleeping_engines(self) -> list[bool]:
        return await self._each_engine("is_sleeping")

    async def paused_engines(self) -> list[bool]:
        return await self._each_engine("is_paused")

    async def reset_prefix_cache(self) -> list[bool]:
        """Per engine, whether its prefix cache was emptied (refused while requests hold blocks)."""
        return await self._each_engine("reset_prefix_cache")

    async def _recover_adapter(self, engine: int, lora: LoRARequest) -> LoRARequest:
        """An engine refused ``lora`` as unknown: the adapter to retry with, or a 404. Either another
        replica reloaded the name (a new id: retry with it), or this engine restarted and lost a
        runtime-loaded adapter the other engines hold (load it there again)."""
        self.lora_adapters.pop(lora.lora_name, None)
        await self.refresh_loras()
        current = self.lora_adapters.get(lora.lora_name)
        if current is None:
            raise unknown_model(lora.lora_name)
        if current == lora:
            try:
                await self.client.handle(engine).add_lora.remote(current)
            except Exception as e:
                raise APIError(503, f"engine {engine} could not load the lora adapter '{lora.lora_name}': "
                                    f"{_remote_message(e)}", "ServiceUnavailableError") from e
        return current

    def pooled_text(self, text: str) -> str:
        """A text as a pooling model reads it: lowercased where its sentence-transformers
        Transformer module says do_lower_case (as vLLM and sentence-transformers do)."""
        return text.lower() if self.settings.pooling.do_lower_case else text

    def model_name(self, model: str | None) -> str:
        """The name responses carry: the adapter's when the request named one, else the model's first
        (whichever alias the request used, as in vLLM)."""
        return model if model is not None and model in self.lora_adapters else self.settings.served_model_name

    @property
    def tokenizer(self) -> Any:
        """The replica's tokenizer as the calling thread may use it: the tokenizer thread has a copy
        of its own. A fast tokenizer is not safe to share between threads: one that truncates sets
        its truncation on the tokenizer, and one used while another thread holds it raises
        "Already borrowed"."""
        return getattr(self._thread_tokenizer, "tokenizer", self._loop_tokenizer)

    async def tokenizer_work(self, chars: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, tokenizer work on ``chars`` characters of text: on the event loop
        when short, and in the replica's tokenizer thread, with its own copy of the tokenizer, when
        longer than TOKENIZE_INLINE_CHARS (a 5 MB prompt took 3.5 s to tokenize, and every stream of
        the replica waited; vLLM tokenizes in a thread too). Short work does not wait for long work;
        only with a tokenizer that cannot be copied does it queue behind it, so that the one
        tokenizer is used by one thread at a time."""
        if chars <= TOKENIZE_INLINE_CHARS and not (self._tokenizer_jobs and self._tokenizer_copy is None):
            return fn(*args, **kwargs)
        if self._tokenizer_thread is None:
            self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer",
                                                        initializer=self._give_thread_its_tokenizer)
        future = asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                            functools.partial(fn, *args, **kwargs))
        self._tokenizer_jobs += 1
        future.add_done_callback(self._tokenizer_job_done)
        # (Shielded: the thread finishes a job whose client left; until then it counts.)
        return await asyncio.shield(future)

    def _tokenizer_job_done(self, future: asyncio.Future) -> None:
        self._tokenizer_jobs -= 1
        if not future.cancelled():
            future.exception()  # (seen: its caller may have left)

    def _give_thread_its_tokenizer(self) -> None:
        """(The tokenizer thread's first step.)"""
        if self._tokenizer_copy is not None:
            self._thread_tokenizer.tokenizer = self._tokenizer_copy

    def render_chat(self, request: ChatCompletionRequest) -> list[int]:
        # (--exclude-tools-when-tool-choice-none, vLLM's: a request that may call no tool shows the
        # template none.)
        tools = request.tools and not (self.settings.exclude_tools_when_tool_choice_none
                                       and request.tool_choice_form() == "none")
        template_kwargs = request.chat_template_kwargs
        if request.reasoning_effort is not None:
            template_kwargs = {"reasoning_effort": request.reasoning_effort, **(template_kwargs or {})}
        return self.render_messages(request.messages, request.add_generation_prompt, request.continue_final_message,
                                    template_kwargs, request.tool_dicts() if tools else None,
                                    add_special_tokens=request.add_special_tokens,
                                    chat_template=request.chat_template, documents=request.documents,
                                    with_images=True)

    def render_messages(self, chat: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None, add_special_tokens: bool = False,
                        chat_template: str | None = None, documents: list[dict[str, Any]] | None = None,
                        with_images: bool = False) -> list[int]:
        """A conversation's token ids, written by the tokenizer's chat template, or by the request's
        own ``chat_template`` when the server trusts request templates (the template writes its
        special tokens itself, unless ``add_special_tokens`` asks the tokenizer to add its own too).
        Messages' content is the text, or OpenAI's list of parts for a template that loops over it
        (--chat-template-content-format); ``documents`` go to a RAG template. Images (a
        vision-language model's) are one image token each, to expand (``prompt_images``), where the
        caller takes them (``with_images``: chat and /tokenize; pooling requests refuse them)."""
        chat_template = chat_template or None  # ("": the server's, as vLLM reads it)
        if chat_template_kwargs and chat_template_kwargs.get("chat_template") == "":
            chat_template_kwargs = {k: v for k, v in chat_template_kwargs.items() if k != "chat_template"}
        if not self.settings.trust_request_chat_template:  # (vLLM's --trust-request-chat-template)
            for param, given in (("chat_template", chat_template),
                                 ("chat_template_kwargs", (chat_template_kwargs or {}).get("chat_template"))):
                if given is not None:
                    raise bad_request("a request's own chat_template is not accepted: the server's chat template "
                                      "(or its --chat-template) writes every conversation unless the server is "
                                      "started with --trust-request-chat-template", param)
        elif (chat_template_kwargs or {}).get("chat_template") is not None:
            # (vLLM drops it there without a word; the request's template is its chat_template field.)
            raise bad_request("give the request's own template as chat_template, not inside chat_template_kwargs",
                              "chat_template_kwargs")
        # Extra message fields (name, tool_calls, tool_call_id) reach the template as sent, except
        # that tool calls' JSON arguments are parsed: templates write them out with ``tojson``.
        content_format = resolve_content_format(self.settings.chat_template_content_format, chat_template,
                                                self.tokenizer.chat_template, bool(tools))
        if (self.chat_images(chat) or self.chat_videos(chat)) and not with_images:  # (refused first if not taken)
            raise bad_request("images are taken by chat completions, the Responses API and /tokenize only "
                              "(videos by chat completions and /tokenize)", "messages")
        placeholder = self.images.placeholder if self.images is not None else None
        video_text = self.images.video_placeholder if self.images is not None else None
        messages = [_template_message(m.model_extra or {}, m.role,
                                      template_content(m.content, content_format, placeholder, video_text))
                    for m in chat]
        if self._harmony:
            messages = [_harmony_tool_turn(m) for m in messages]
        kwargs = {**self.settings.default_chat_template_kwargs, **(chat_template_kwargs or {})}
        if tools:
            kwargs.setdefault("tools", tools)
        if documents is not None:
            kwargs.setdefault("documents", documents)  # (a request's chat_template_kwargs win, as in vLLM)
        try:
            if chat_template is not None:
                kwargs["chat_template"] = chat_template
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                continue_final_message=continue_final_message, **kwargs)
        except Exception as e:
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from e
        if with_images and self.images is not None and self.chat_images(chat):
            text = self.images.prompt_text(text)  # (Gemma 3: each image's sequence, as its processor writes it)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- images (vision-language models: router.multimodal) -----------------------------------------

    def chat_images(self, messages: list[ChatMessage]) -> list[str]:
        """The URLs of a conversation's images, in order; a 400 for a model that takes none, or for
        more than --limit-mm-per-prompt allows."""
        return self._chat_media([url for m in messages for url in m.images()], "image")

    def chat_videos(self, messages: list[ChatMessage]) -> list[str]:
        """The URLs of a conversation's videos, in order; a 400 for a model that takes none, or for
        more than --limit-mm-per-prompt allows."""
        return self._chat_media([url for m in messages for url in m.videos()], "video")

    def _chat_media(self, urls: list[str], modality: str) -> list[str]:
        if not urls:
            return urls
        name = self.settings.served_model_name
        if self.settings.limit_mm_per_prompt.get(modality) == 0:
            raise bad_request(f"At most 0 {modality}(s) may be provided in one prompt (--limit-mm-per-prompt "
                              f"'{{\"{modality}\": 0}}' for model {name!r})", "messages")
        if self.images is None or (modality == "video" and self.images.video_token_id is None):
            why = " (it is not a vision-language model)" if modality == "image" else ""
            raise bad_request(f"model {name!r} does not take {modality}s{why}", "messages")
        try:
            self.images.check_count(len(urls), modality)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return urls

    async def prompt_media(self, urls: list[str], video_urls: list[str], prompt_ids: list[int],
                           count_only: bool = False) -> tuple[list[int], list[MultiModalFeature]]:
        """``prompt_images`` with the conversation's videos too: every image and video is loaded (a
        video's frames, and so its token count, are known only once it is decoded)."""
        if not video_urls:
            return await self.prompt_images(urls, prompt_ids, count_only)
        images = self.images
        assert images is not None  # (chat_videos refused videos for a model without them)
        try:
            loaded, videos = await asyncio.gather(images.load_all(urls), images.load_videos(video_urls))
            ids, offsets, video_offsets = images.expand_media(prompt_ids, [i.image_size for i in loaded], videos)
            if count_only:
                return ids, []
            self.check_prompt_fits(len(ids), "messages")
            return ids, images.features(loaded, ids, offsets, videos, video_offsets)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    async def prompt_images(self, urls: list[str], prompt_ids: list[int],
                            count_only: bool = False) -> tuple[list[int], list[MultiModalFeature]]:
        """The rendered prompt with each image token expanded to its image's placeholders, and the
        images (loaded and processed off the event loop) over them. A 400 unless the prompt has one
        image token per image, for an image that cannot be fetched, read or decoded, and for a
        prompt the context cannot hold (checked before any image is fetched where the counts are
        known beforehand; where they depend on the images' sizes, the shortest the prompt can be is
        checked first). ``count_only`` (/tokenize, token counting): the expanded prompt alone, its
        length unchecked; where the images' sizes set their counts, only their headers are read."""
        if not urls:
            return prompt_ids, []
        images = self.images
        assert images is not None  # (chat_images refused images for a model without them)
        try:
            ids, offsets = images.expand(prompt_ids, len(urls))  # (each image at its fixed or least count)
            if count_only:
                return (images.expand(prompt_ids, len(urls), await images.image_sizes(urls))[0]
                        if images.counts_by_size else ids), []
            self.check_prompt_fits(len(ids), "messages")
            loaded = await images.load_all(urls)
            if images.counts_by_size:
                ids, offsets = images.expand(prompt_ids, len(urls), [image.image_size for image in loaded])
                self.check_prompt_fits(len(ids), "messages")
            return ids, images.features(loaded, ids, offsets)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    def _constraint_start(self, prompt_thinking: str) -> tuple[list[int] | None, int | None]:
        """Where an output constraint starts in an answer that may think (``</think>`` must be one
        token of the vocabulary, as the engine watches for it): (the tokens it waits for, and the
        first token that opens that wait, None when it waits in any case), or (None, None) for a
        constraint from the first token. deepseek_r1 answers think first, and so does one after a
        prompt that opened the thinking: the constraint waits for ``</think>``. A qwen3 answer may
        think or not: the constraint waits only when its first token is ``<think>`` (as vLLM's
        waits for the thinking's end), and otherwise holds from the first token."""
        if self._harmony:  # (a harmony answer's constraint holds over its final channel)
            return list(self._harmony_final), None
        if not self._answer_may_think(prompt_thinking) or self._think_end_id is None:
            return None, None
        if self.settings.reasoning_parser in THINKS_FIRST or prompt_thinking == "open":
            return [self._think_end_id], None
        if self._think_start_id is not None:
            return [self._think_end_id], self._think_start_id
        return None, None

    def _prompt_thinking(self, prompt_ids: list[int]) -> str:
        """How the chat template left the thinking where the answer begins: "closed" (a template
        with thinking switched off ends the prompt with ``<think></think>``: the answer has none to
        parse or wait for), "open" (one that ends it with ``<think>``: the answer starts thinking,
        and writes no opening tag), or "" (neither). Only the prompt's end counts: earlier assistant
        turns a template writes back with their reasoning close nothing for this answer. ("" too
        for a server without a reasoning parser.)"""
        if self.settings.reasoning_parser is None:
            return ""
        last = -1
        for tag in (self._think_start_id, self._think_end_id):
            if tag is not None and tag in prompt_ids:
                last = max(last, len(prompt_ids) - 1 - prompt_ids[::-1].index(tag))
        # (At most blank lines follow a template's tag: a longer tail is an earlier turn's text.)
        if last < 0 or len(prompt_ids) - last > 8 or \
                self.tokenizer.decode(prompt_ids[last + 1:], skip_special_tokens=False).strip():
            return ""
        return "closed" if prompt_ids[last] == self._think_end_id else "open"

    def _chat_skip_special_tokens(self, tool_choice: str | dict[str, Any], prompt_thinking: str) -> bool | None:
        """False where a chat answer's parser must see special tokens (a tool-call parser under "auto",
        a reasoning parser whose tags are special tokens, harmony's markers); None: as the request asks."""
        if tool_choice == "auto" or self._harmony or \
                (self._think_tags_special and self._answer_may_think(prompt_thinking)):
            return False
        return None

    def _answer_may_think(self, prompt_thinking: str) -> bool:
        """A reasoning parser reads the answer: the server has one, and the prompt did not close the thinking."""
        return self.settings.reasoning_parser is not None and prompt_thinking != "closed"

    def _chat_output_parser(self, request: ChatCompletionRequest, tool_choice: str | dict[str, Any],
                            prompt_thinking: str, marker_offsets: list[int] | None = None) -> ChatOutputParser | None:
        """What splits a choice's text, if anything: the server's reasoning parser (when the answer
        may think: not after a prompt that closed the thinking, and under an output constraint only
        when the constraint starts after the thinking) and the tool-call parser the tool choice needs."""
        if self._harmony:  # (one parser reads the channels: reasoning, content and calls)
            calls = tool_choice == "auto" and self.settings.tool_call_parser == HARMONY_TOOL_CALL_PARSER
            harmony = HarmonyParser(calls, marker_offsets=marker_offsets)
            return ChatOutputParser(None, harmony, request.include_reasoning,
                                    parallel_tool_calls=request.parallel_tool_calls or tool_choice != "auto")
        tools = create_tool_call_parser(tool_choice, self.settings.tool_call_parser, request.tool_dicts())
        reasoning = None
        if self._answer_may_think(prompt_thinking) and (
                request.structured_output is None or self._constraint_start(prompt_thinking)[0] is not None):
            name = self.settings.reasoning_parser
            if name == "minimax_m2_append_think" and request.structured_output is not None:
                name = "minimax_m2"  # (a constrained answer is its JSON: the thinking is kept out of it)
            reasoning = create_reasoning_parser(name,  # type: ignore[arg-type]
                                                starts_thinking=prompt_thinking == "open")
        if tools is None and reasoning is None:
            return None
        # (Under "required" the grammar itself allows one call only; under "auto" the parser keeps one.)
        return ChatOutputParser(reasoning, tools, request.include_reasoning,
                                parallel_tool_calls=request.parallel_tool_calls or tool_choice != "auto")

    def truncation_length(self, request: SamplingFields) -> int | None:
        """vLLM's truncate_prompt_tokens as a token count (-1: max_model_len); None when not asked."""
        k = request.truncate_prompt_tokens
        if k is None:
            return None
        max_model_len = self.settings.max_model_len
        if k == 0 or k > max_model_len:
            raise bad_request(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len ({max_model_len}), "
                              f"got {k}", "truncate_prompt_tokens")
        return max_model_len if k == -1 else k

    def truncate_prompt(self, ids: list[int], request: SamplingFields) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as max_model_len)."""
        k = self.truncation_length(request)
        return ids if k is None else ids[-k:]

    def _prompt_logprobs(self, request: SamplingFields, prompt_ids: list[int],
                         entry: LogprobsEntry | None) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs: None for the first token, then each token's logprob and rank, with
        the request's k best alternatives (ranked 1..k). Completions' echo with logprobs asks for
        them too, with that count, unless prompt_logprobs is given (vLLM's). A logprob of -inf (a
        token the model cannot produce) is vLLM's floor, as JSON has no infinity."""
        k = request.prompt_logprobs
        if k is None and isinstance(request, CompletionRequest) and request.echo:
            k = request.logprobs
        if k is None:
            return None
        out: list[dict[int, PromptLogprob] | None] = [None]
        if entry is not None:
            out += [{t: PromptLogprob(logprob=max(lp, LOGPROB_FLOOR), rank=rank, decoded_token=self.token_text(t))
                     for t, lp, rank in row} for row in entry.ranked(prompt_ids[1:], k)]
        return out

    def prompt_embeds(self, request: CompletionRequest) -> list[PromptEmbeds]:
        """The request's prompt_embeds, decoded and checked (400 naming prompt_embeds, or what they
        cannot be combined with); truncate_prompt_tokens keeps each one's last rows."""
        encoded = request.prompt_embeds_list()
        if not encoded:
            return []
        if not self.settings.enable_prompt_embeds:
            raise bad_request("You must set `--enable-prompt-embeds` to input `prompt_embeds`.", "prompt_embeds")
        for refused, what, param in ((request.echo, "Echo is", "echo"),
                                     (request.prompt_logprobs is not None, "prompt_logprobs is", "prompt_logprobs"),
                                     (request.use_beam_search, "Beam search is", "use_beam_search")):
            if refused:
                raise bad_request(f"{what} unsupported with prompt embeds.", param)
        width, out = self.settings.input_embedding_size, []
        keep = self.truncation_length(request)
        for i, text in enumerate(encoded):
            param = "prompt_embeds" if isinstance(request.prompt_embeds, str) else f"prompt_embeds.{i}"
            try:
                embeds = decode_prompt_embeds(text)
            except ValueError as e:
                raise bad_request(str(e), param) from None
            if width and embeds.hidden_size != width:
                raise bad_request(f"prompt embeddings must have rows of the model's hidden size {width}, not "
                                  f"{embeds.hidden_size}", param)
            embeds = embeds if keep is None else embeds.last(keep)
            if embeds.num_tokens >= self.settings.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.settings.max_model_len} tokens; "
                                  f"the prompt has {embeds.num_tokens} embeddings.", param)
            out.append(embeds)
        return out

    @property
    def token_id_limit(self) -> int:
        """One past the largest token id a request may name: the tokenizer's or the model's vocabulary,
        whichever is larger (as vLLM: Qwen's models have ids past their tokenizer's, padding)."""
        return max(len(self.tokenizer), self.settings.vocab_size)

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = True
                        ) -> list[int]:
        """Text's token ids (with the tokenizer's special tokens, a BOS say, unless
        ``add_special_tokens`` is false), or token ids checked against the vocabulary (``param``: the
        field that gave them)."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        vocab = self.token_id_limit if param == "prompt" else len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt):
            raise bad_request(f"{'prompt token ids' if param == 'prompt' else param} must be in [0, {vocab})", param)
        return list(prompt)

    def _with_server_defaults(self, spec: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request's output constraint with the server's settings: its disable_any_whitespace holds
        for every request, as vLLM's (a request may ask for it on a server that does not)."""
        if spec is not None and self.settings.structured_outputs_disable_any_whitespace:
            return {**spec, "disable_any_whitespace": True}
        return spec

    def check_prompt_fits(self, prompt_len: int, param: str) -> None:
        """A 400 for a prompt that leaves no room for an answer in the context."""
        if prompt_len >= self.settings.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.settings.max_model_len} tokens; "
                              f"the prompt has {prompt_len}.", param)

    def sampling_params(self, request: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, seed_offset: int, prompt_logprobs: int | None = None,
                        structured_output_after: list[int] | None = None,
                        structured_output_may_open: int | None = None,
                        structured_output_then: int | None = None) -> SamplingParams:
        self.check_prompt_fits(prompt_len, "messages" if isinstance(request, ChatCompletionRequest) else "prompt")
        room = self.settings.max_model_len - prompt_len
        defaults = self.settings.default_sampling_params
        # (The field the request set: chat prefers max_completion_tokens.)
        limit = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None \
            else "max_tokens"
        if max_tokens is None:
            max_tokens = room
        elif request.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({request.min_tokens}) must be less than or equal to {limit} "
                              f"({max_tokens})", "min_tokens")
        elif max_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.settings.max_model_len} tokens. "
                              f"You requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                              f"{max_tokens} for the completion: {limit}).", limit)
        if defaults.get("max_tokens", max_tokens) < max_tokens:  # (its max_new_tokens: a cap, as in vLLM)
            max_tokens = defaults["max_tokens"]
            if request.min_tokens > max_tokens:
                raise bad_request(f"min_tokens ({request.min_tokens}) must be less than or equal to the model's "
                                  f"largest max_tokens, {max_tokens} (its generation config's max_new_tokens)",
                                  "min_tokens")
        self.check_priority(request.priority)
        min_tokens = request.min_tokens
        stop_ids = list(dict.fromkeys(request.stop_token_ids or []))  # (each once: the engines check them per step)
        vocab = self.token_id_limit
        if any(t < 0 or t >= vocab for t in stop_ids):
            raise bad_request(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
        logit_bias, allowed_ids, bad_words = self._token_filters(request, vocab)
        sampling = self.defaulted_sampling(request)
        if sampling["temperature"] == 0 and request.n > 1 and not request.use_beam_search:
            # (vLLM's refusal: n copies of one greedy answer, at n times the cost; the model's
            # default temperature counts as the request's.)
            raise bad_request(f"n must be 1 when using greedy sampling, got {request.n}", "n")
        # (The model's further EOS ids are added by the engine, for every client.)
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=min_tokens,
                ignore_eos=request.ignore_eos, stop_token_ids=stop_ids,
                **sampling,
                seed=None if request.seed is None else _wrap_int64(request.seed + seed_offset),
                presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias, allowed_token_ids=allowed_ids, bad_words_token_ids=bad_words,
                structured_output=self._with_server_defaults(request.structured_output),
                structured_output_after=structured_output_after if request.structured_output else None,
                structured_output_may_open=structured_output_may_open if request.structured_output else None,
                structured_output_then=structured_output_then if request.structured_output else None,
                extra_args=request.vllm_xargs or None)
        except ValueError as e:
            raise bad_request(str(e), str(e).split(" ", 1)[0]) from e

    def resolve_logprobs(self, request: SamplingFields) -> None:
        """vLLM's --max-logprobs: the logprobs a request asks for per token (completions' logprobs,
        chat's top_logprobs, prompt_logprobs) at most that many, a 400 naming the field otherwise; -1
        (all) becomes the vocabulary's size here, once, so every count below is a count."""
        vocab = self.settings.vocab_size or len(self.tokenizer)
        top = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        for name, kind in ((top, "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(request, name)
            if asked is None:
                continue
            try:
                setattr(request, name, logprobs_count(kind, asked, vocab, self.settings.max_logprobs))
            except ValueError as e:
                raise bad_request(str(e), name) from None

    def defaulted_sampling(self, request: SamplingFields) -> dict[str, float | int]:
        """temperature, top_p, top_k, min_p and repetition_penalty: the request's where it set them
        (null counts as unset), else the model's default (its generation config), else the neutral one."""
        defaults = self.settings.default_sampling_params
        return {name: getattr(request, name) if name in request.model_fields_set or name not in defaults
                else defaults[name] for name in DEFAULTED_SAMPLING_FIELDS}

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.settings.scheduling_policy != "priority":
            raise bad_request("priority needs an engine started with --scheduling-policy priority", "priority")

    def _token_filters(self, request: SamplingFields, vocab: int
                       ) -> tuple[dict[int, float] | None, list[int] | None, list[list[int]] | None]:
        """logit_bias (OpenAI: token ids as strings), allowed_token_ids and bad_words, checked against
        the vocabulary (an id outside it is the client's error, not the engine's)."""
        logit_bias = None
        if request.logit_bias:
            try:
                logit_bias = {int(token): bias for token, bias in request.logit_bias.items()}
            except ValueError as e:
                raise bad_request("logit_bias keys must be token ids (integers as strings)", "logit_bias") from e
            if any(t < 0 or t >= vocab for t in logit_bias):
                raise bad_request(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        allowed = request.allowed_token_ids
        if allowed and any(t < 0 or t >= vocab for t in allowed):
            raise bad_request(f"allowed_token_ids must be in [0, {vocab})", "allowed_token_ids")
        bad = None
        if request.bad_words:
            try:
                bad = bad_words_token_ids(self.tokenizer, request.bad_words)
            except ValueError as e:
                raise bad_request(str(e), "bad_words") from e
        return logit_bias, allowed, bad

    def choose_engine(self, prompt_token_ids: list[int], session_id: str | None,
                      chosen: list[int] | None = None, lora: LoRARequest | None = None, count: int = 1,
                      cache_salt: str | None = None, prompt_embeds: PromptEmbeds | None = None,
                      exclude: int | None = None, prefill: bool = False,
                      mm_features: list[MultiModalFeature] | None = None) -> int:
        """``chosen``: requests this call already placed but has not opened yet, per engine (several
        prompts of one request must see each other's load, or they all go to one engine); the
        ``count`` requests of this prompt are added to the chosen engine's; ``cache_salt`` keys the
        prompt's blocks as the engines key them (prefix-aware routing); ``exclude``: an engine that
        just refused the request (its queue is full); ``prefill``: a client's own prefill leg (its
        kv_transfer_params ask for a remote decode), for a prefill engine where roles are split."""
        t0 = time.perf_counter()
        loads = self.client.loads()
        if chosen is not None:
            loads = [load + extra for load, extra in zip(loads, chosen, strict=True)]
        healthy = self.client.healthy()
        if exclude is not None:
            healthy[exclude] = False
        if self.engine_roles is not None:  # (prefill engines take only prompts: _prefill_elsewhere)
            healthy = (self.engine_roles.prefill_or_any(healthy) if prefill
                       else self.engine_roles.decode_candidates(healthy))
        active = None
        if lora is not None:
            active = self.client.active_adapters()
            if chosen is not None and any(chosen):  # (this request's other prompts, placed already: its adapter)
                active = [a | {lora.cache_key: a.get(lora.cache_key, 0) + n} if n else a
                          for a, n in zip(active, chosen, strict=True)]
        try:
            engine = self.policy.choose(RoutingContext(prompt_token_ids, loads, healthy, session_id,
                                                       None if lora is None else lora.cache_key, cache_salt,
                                                       prompt_embeds=prompt_embeds, mm_features=mm_features,
                                                       active_adapters=active))
        except NoHealthyEngineError as e:
            raise APIError(503, "no healthy engine is available", "ServiceUnavailableError") from e
        if self.metrics is not None:
            self.metrics.record_routing(engine, self.policy.name, time.perf_counter() - t0)
        if chosen is not None:
            chosen[engine] += count
        return engine

    # -- generation ---------------------------------------------------------------------------------

    def _engine_request(self, job: _Job, priority: int, lora: LoRARequest | None,
                        cache_salt: str | None) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=job.request_id, prompt_token_ids=job.prompt_ids, sampling_params=job.params,
                                 eos_token_id=self.eos_token_id, arrival_time=time.time(), priority=priority,
                                 client_index=self.client.client_index, lora_request=lora, cache_salt=cache_salt,
                                 prompt_embeds=job.prompt_embeds, num_choices=job.num_choices,
                                 kv_transfer_params=job.kv_transfer_params, mm_features=job.mm_features)

    async def _open_all(self, jobs: list[_Job], priority: int,
                        lora: LoRARequest | None = None, cache_salt: str | None = None,
                        deadline: float | None = None) -> list[RequestStream]:
        """Send every job's request (engine, request id, prompt, parameters) to its engine now,
        before any response starts, so a refusal is an HTTP status (429 or 503) for streams too;
        what was opened is released on failure. Up to OPEN_AT_ONCE jobs are sent at a time, each
        window's admissions awaited together (a request of 2,000 inputs waited for 2,000 round trips
        one after another). An engine that refuses for want of room or health is replaced once, for
        the jobs it was to take, by the policy's choice among the others; a 429 or 503 comes back
        only when that one refuses too. One deadline (the request timeout, or the caller's) covers
        every job, from admission to the last output. The streams come back in the jobs' order."""
        if deadline is None and self.settings.request_timeout_s:
            deadline = time.monotonic() + self.settings.request_timeout_s
        logged: set[str] = set()  # (a retry logs only what it had not logged yet)
        opened: dict[int, RequestStream] = {}
        pending = list(range(len(jobs)))  # the jobs still to open, in order
        recovered = rerouted = False
        # Prefill/decode disaggregation: prompts computed on prefill engines first (once, whatever
        # retries follow: a job rerouted below takes its KV parameters along).
        producers: dict[int, int] = {}
        try:
            if self.engine_roles is not None:
                jobs, producers = await self._prefill_elsewhere(jobs, priority, lora, cache_salt, deadline)
            while pending:
                window, pending = pending[:OPEN_AT_ONCE], pending[OPEN_AT_ONCE:]
                timeout = None
                if deadline is not None:
                    timeout = deadline - time.monotonic()
                    if timeout <= 0:
                        raise self._timed_out()
                results = await self._open_window([jobs[k] for k in window], priority, lora, cache_salt, timeout,
                                                  logged)
                failed: list[int] = []
                errors: dict[int, BaseException] = {}
                for k, result in zip(window, results, strict=True):
                    if isinstance(result, RequestStream):
                        opened[k] = result
                    else:
                        failed.append(k)
                        errors[k] = result
                if not failed:
                    continue
                first = errors[failed[0]]
                job = jobs[failed[0]]
                pending = failed + pending  # (each failure is tried again once the first is dealt with)
                if isinstance(first, EngineOverloadedError | EngineUnavailableError):
                    # (Moved only when the engine certainly did not take it: under the same id, outputs
                    # of a request it did take could reach the new engine's stream. Every failure on
                    # that engine in this window must be such a refusal.)
                    on_engine = [errors[k] for k in failed if jobs[k].engine == job.engine]
                    unmovable = next((e for e in on_engine
                                      if not isinstance(e, EngineOverloadedError | EngineRefusedError)), None)
                    other = None if rerouted or unmovable is not None else self._other_engine(job, lora, cache_salt)
                    if other is None:
                        refusal = unmovable if isinstance(unmovable, EngineUnavailableError) else first
                        raise _engine_refusal(refusal) from refusal
                    rerouted = True
                    jobs = [j._replace(engine=other) if k in pending and j.engine == job.engine else j
                            for k, j in enumerate(jobs)]
                elif isinstance(first, RequestRefusedByEngineError):  # (checked here first, where it can be)
                    raise bad_request(str(first)) from first
                elif isinstance(first, UnknownModelError) and lora is not None:
                    if recovered:
                        raise unknown_model(lora.lora_name) from first
                    # Unloaded or reloaded through another replica, or lost by a restarted engine.
                    recovered = True
                    lora = await self._recover_adapter(job.engine, lora)
                elif isinstance(first, RequestTimeoutError):  # the engine did not even admit it in time
                    raise self._timed_out() from first
                else:
                    raise first
        except BaseException:
            for stream in opened.values():
                await stream.close()
            for k, engine in producers.items():
                if k not in opened:  # (never reached a decode engine: the prefill engine frees its share)
                    self._release_prefill(engine, jobs[k].kv_transfer_params or {})
            raise
        return [opened[k] for k in range(len(jobs))]

    async def _open_window(self, jobs: list[_Job], priority: int, lora: LoRARequest | None, cache_salt: str | None,
                           timeout: float | None, logged: set[str]) -> list[RequestStream | BaseException]:
        """Each job's stream, or why its engine did not take it, all sent at once. A caller that
        leaves meanwhile leaves nothing open: those already admitted are closed (aborted)."""
        requests = []
        for job in jobs:
            request = self._engine_request(job, priority, lora, cache_salt)
            if self.settings.enable_log_requests and job.request_id not in logged:
                logged.add(job.request_id)
                self._log_request(request)
            requests.append(request)
        if len(jobs) == 1:  # (the usual request, one choice: no task of its own on the hot path)
            try:
                return [await self.client.open(jobs[0].engine, requests[0], timeout)]
            except Exception as e:
                return [e]
        tasks = [asyncio.ensure_future(self.client.open(job.engine, request, timeout))
                 for job, request in zip(jobs, requests, strict=True)]
        try:
            await asyncio.wait(tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    stream = await task
                    await stream.close()
            raise
        return [task.exception() or task.result() for task in tasks]  # type: ignore[misc]

    async def _prefill_elsewhere(self, jobs: list[_Job], priority: int, lora: LoRARequest | None,
                                 cache_salt: str | None, deadline: float | None) -> tuple[list[_Job], dict[int, int]]:
        """Prefill/decode disaggregation: each prompt worth it is computed on a prefill engine (the
        policy's choice among them) first, all at once, one leg for all the choices of one prompt;
        its jobs go on with the parameters naming the prompt's KV (where a leg handed none on, as
        they were). Also returns which prefill engine holds each job's KV."""
        assert self.engine_roles is not None
        healthy = self.engine_roles.prefill_candidates(self.client.healthy())
        if not any(healthy):
            return jobs, {}
        loads = list(self.client.loads())
        legs: dict[tuple[int, tuple[int, ...]], tuple[int, list[int]]] = {}  # -> (prefill engine, its jobs)
        cached_tokens = getattr(self.policy, "cached_tokens", None)  # (prefix_aware: what engines report)
        lora_key = None if lora is None else lora.cache_key
        threshold = max(self.pd_prefill_threshold, self.kv_block_size)
        skipped: set[tuple[int, tuple[int, ...]]] = set()
        first_requests: dict[tuple[int, tuple[int, ...]], EngineCoreRequest] = {}  # (each leg's first job's)
        for k, job in enumerate(jobs):
            key = (job.engine, tuple(job.prompt_ids))  # (a prompt's choices share their decode engine)
            if key in legs:
                legs[key][1].append(k)
                continue
            request = self._engine_request(job, priority, lora, cache_salt)
            if not needs_remote_prefill(request):
                continue
            if key in skipped:
                continue
            ctx = RoutingContext(job.prompt_ids, loads, healthy, None, lora_key, cache_salt)
            uncached = len(job.prompt_ids) - (cached_tokens(ctx, job.engine) if cached_tokens is not None else 0)
            if uncached <= threshold:
                skipped.add(key)  # (computed where it is decoded: little left that its decode engine lacks)
                continue
            engine = self.policy.choose(ctx)
            if engine != job.engine:  # (a kv_both engine picked for both legs computes its prompt itself)
                loads[engine] += 1
                legs[key] = (engine, [k])
                first_requests[key] = request
        if not legs:
            return jobs, {}
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)

        async def leg(engine: int, request: EngineCoreRequest, readers: int) -> tuple[dict[str, Any] | None, float]:
            started = time.perf_counter()
            params = await run_prefill(self.client, engine, request, timeout, readers)
            return params, time.perf_counter() - started

        tasks = [asyncio.ensure_future(leg(engine, first_requests[key], len(members)))
                 for key, (engine, members) in legs.items()]
        try:
            handed = await asyncio.gather(*tasks)
        except BaseException:  # (the client left: legs already done hold blocks nobody will read)
            for task, (engine, members) in zip(tasks, legs.values(), strict=True):
                task.cancel()
                if task.done() and not task.cancelled() and task.exception() is None and task.result()[0]:
                    for _ in members:
                        self._release_prefill(engine, task.result()[0])
            raise
        jobs = list(jobs)
        producers: dict[int, int] = {}
        for (engine, members), (params, seconds) in zip(legs.values(), handed, strict=True):
            if self.metrics is not None:
                self.metrics.record_remote_prefill(params is not None, seconds)
            if params is None:
                continue
            for k in members:
                jobs[k] = jobs[k]._replace(kv_transfer_params=params)
                producers[k] = engine
        return jobs, producers

    def _release_prefill(self, engine: int, params: dict[str, Any]) -> None:
        """Tell a prefill engine that one reader of the KV these parameters name will not read it
        (fire and forget: it frees the blocks at its timeout otherwise)."""
        try:
            self.client.handle(engine).release_kv_blocks.remote(params.get("remote_request_id"),
                                                                str(params.get("remote_nonce") or ""))
        except Exception as e:
            logger.info("could not tell engine %d to free request %s's prefill: %s", engine,
                        params.get("remote_request_id"), e)

    def _other_engine(self, job: _Job, lora: LoRARequest | None, cache_salt: str | None) -> int | None:
        """Where a job goes instead of the engine that refused it: the policy's choice among the
        others (None when none is healthy)."""
        try:
            return self.choose_engine(job.prompt_ids, None, lora=lora, cache_salt=cache_salt,
                                      prompt_embeds=job.prompt_embeds, exclude=job.engine,
                                      prefill=wants_remote_decode(job.kv_transfer_params),
                                      mm_features=job.mm_features)
        except APIError:
            return None

    def _log_request(self, request: EngineCoreRequest) -> None:
        """vLLM's --enable-log-requests lines: the engine request's parameters and adapter at INFO;
        its prompt (text and token ids, each cut to --max-log-len) only at DEBUG
        (VLLM_LOGGING_LEVEL=DEBUG), as vLLM keeps prompts out of the INFO log."""
        logger.info("Received request %s: params: %s, lora_request: %s.", request.request_id,
                    request.sampling_params, request.lora_request)
        if logger.isEnabledFor(logging.DEBUG) and request.prompt_embeds is not None:
            embeds = request.prompt_embeds
            logger.debug("Request %s details: prompt_embeds: [%d, %d] %s.", request.request_id, embeds.num_tokens,
                         embeds.hidden_size, embeds.dtype)
        elif logger.isEnabledFor(logging.DEBUG):
            limit = self.settings.max_log_len
            ids = request.prompt_token_ids if limit is None else request.prompt_token_ids[:limit]
            text = self.tokenizer.decode(ids)
            logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s.", request.request_id,
                         text if limit is None else text[:limit], ids)

    def _log_output(self, request_id: str, choice: _Choice) -> None:
        """vLLM's --enable-log-outputs line, once a choice has finished: its text and token ids (each
        cut to --max-log-len) and why it ended."""
        limit = self.settings.max_log_len
        text, ids = choice.detok.output_text, choice.token_ids
        logger.info("Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s", request_id,
                    text if limit is None else text[:limit], ids if limit is None else ids[:limit],
                    choice.finish_reason)

    async def _run_choice(self, stream: RequestStream, choice: _Choice, sink: asyncio.Queue | None) -> None:
        """Drive one choice to its end; with a sink, push its deltas as they come."""
        async for event in self._deltas(stream, choice):
            if sink is not None:
                sink.put_nowait(event)

    def _apply_output(self, choice: _Choice, output: EngineCoreOutput) -> tuple[str, list]:
        if output.new_prompt_logprobs is not None and choice.prompt_logprobs is None:
            choice.prompt_logprobs = output.new_prompt_logprobs  # (a preempted request never sends them twice)
        if output.num_cached_tokens > choice.num_cached_tokens:
            choice.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            choice.kv_transfer_params = output.kv_transfer_params
        new_lp = []
        if output.new_logprobs is not None:
            new_lp = _logprob_rows(output.new_token_ids, output.new_logprobs)
        text_ids = output.new_token_ids
        if output.finish_reason == FinishReason.STOP and text_ids and not choice.detok.include_stop_str_in_output:
            text_ids = text_ids[:-1]  # the EOS or stop token that ended it is not part of the text (vLLM)
        detok = choice.detok
        consumed = len(detok.token_ids)
        delta = detok.add_tokens(text_ids)
        if detok.stop_reason is not None:
            # A stop string ended the text: tokens after it (several come at once with speculative
            # decoding, or when outputs merge) are not part of the answer, its usage or its logprobs.
            consumed = len(detok.token_ids) - consumed
            choice.token_ids.extend(output.new_token_ids[:consumed])
            choice.logprobs.extend(new_lp[:consumed])
            choice.finish_reason, choice.stop_reason = "stop", detok.stop_reason
            return delta + detok.finish(), new_lp[:consumed]
        choice.token_ids.extend(output.new_token_ids)
        choice.logprobs.extend(new_lp)
        if output.finish_reason is not None:
            if output.finish_reason == FinishReason.ERROR:
                choice.error = str(output.stop_reason or "engine error")
            choice.finish_reason = _FINISH[output.finish_reason]
            choice.stop_reason = output.stop_reason
            delta += choice.detok.finish()
        return delta, new_lp

    def _new_choices(self, n: int, prompt_ids: list[int], fields: SamplingFields,
                     skip_special_tokens: bool | None = None) -> list[_Choice]:
        skip = fields.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
        # (marker_ids: a harmony parser tells the markers' tokens from the same characters spelled)
        return [_Choice(i, IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=fields.stop_strings,
                                                  include_stop_str_in_output=fields.include_stop_str_in_output,
                                                  min_tokens=fields.min_tokens, skip_special_tokens=skip,
                                                  marker_ids=self._harmony_marker_ids),
                        [], []) for i in range(n)]

    async def _generate(self, streams: list[RequestStream], choices: list[_Choice], sink: asyncio.Queue | None) -> None:
        if not streams:  # choices that came complete (beam search)
            return
        tasks = [asyncio.create_task(self._run_choice(stream, choice, sink))
                 for stream, choice in zip(streams, choices, strict=True)]
        try:
            await asyncio.gather(*tasks)
        except _StreamError as e:  # a timeout or an engine error in one choice fails the request
            raise e.error from e
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:  # a task cancelled before it ran never closed its stream
                await stream.close()

    # -- /v1/completions ----------------------------------------------------------------------------

    def check_generates(self) -> None:
        if not self.settings.pooling.generates:
            raise bad_request(f"{self.settings.served_model_name} is an embedding model: it does not generate "
                              "(use /v1/embeddings, /score or /rerank)", "model")

    async def completions(self, request: CompletionRequest, session_id: str | None = None,
                          external_id: str | None = None):
        """``external_id``: the request's X-Request-Id, the answer's id (``cmpl-<id>``) as in vLLM."""
        lora = await self.resolve_model(request.model)
        self.check_generates()
        _no_stream_prompt_logprobs(request)
        self.resolve_logprobs(request)
        # Prompts given as embeddings first, then those of ``prompt`` (vLLM's order); embeddings are
        # decoded off the event loop (up to hundreds of MB: the other streams must not wait).
        embedded = await asyncio.to_thread(self.prompt_embeds, request) if request.prompt_embeds else []
        prompts: list[str | list[int] | PromptEmbeds] = [*embedded, *request.prompts()]
        request_id, engine_base = answer_ids("cmpl", external_id)
        created = int(time.time())
        jobs: list[_Job] = []
        choices: list[_Choice] = []
        prompt_texts: list[str] = []
        prompt_ids: list[list[int]] = []
        num_prompt_tokens = 0
        chosen = [0] * self.client.num_engines
        searches = []
        for p_index, prompt in enumerate(prompts):
            embeds = prompt if isinstance(prompt, PromptEmbeds) else None
            if embeds is not None:  # (placeholder ids: the engine reads the rows instead)
                ids = [0] * embeds.num_tokens
                prompt_texts.append("")
            else:
                ids = await self.tokenizer_work(len(prompt) if isinstance(prompt, str) else 0, self.tokenize_prompt,
                                                prompt, add_special_tokens=request.add_special_tokens)
                if not ids:
                    raise bad_request("prompt must not be empty", "prompt")
                truncated = self.truncate_prompt(ids, request)
                if len(truncated) < len(ids):  # (echo returns the prompt the model saw)
                    ids, prompt = truncated, truncated
                prompt_texts.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
            num_prompt_tokens += len(ids)
            prompt_ids.append(ids)
            if request.use_beam_search:  # (every prompt checked before any search starts)
                searches.append(self._beam_plan(request, ids, request.max_tokens, request.logprobs))
                continue
            engine = self.choose_engine(ids, session_id, chosen, lora, request.n, request.cache_salt, embeds,
                                        prefill=wants_remote_decode(request.kv_transfer_params))
            for c in self._new_choices(request.n, [] if embeds is not None else ids, request):
                # max_tokens=0 (echo only): one token is generated and dropped, as vLLM does.
                params = self.sampling_params(request, len(ids), 1 if request.max_tokens == 0 else request.max_tokens,
                                              request.logprobs, c.index,
                                              prompt_logprobs=_max_or_none(request.logprobs if request.echo else None,
                                                                           request.prompt_logprobs))
                first = c.index == 0
                c.index = p_index * request.n + c.index
                choices.append(c)
                jobs.append(_Job(engine, choice_request_id(engine_base, c.index), ids, params, embeds,
                                 request.n if first else 0,
                                 _client_kv_params(request.kv_transfer_params, p_index == 0 and first)))
        # return_token_ids: a prompt given as embeddings has none (null, as vLLM's).
        shown_ids = [None if isinstance(p, PromptEmbeds) else ids for p, ids in zip(prompts, prompt_ids, strict=True)]
        if searches:  # (beam search: the choices come complete, before any response starts)
            choices = await self._beam_searches(request, searches, engine_base, session_id, lora)
        streams = await self._open_all(jobs, request.priority, lora, request.cache_salt)
        if request.stream:
            return SSEStream(self._stream_completion(request, request_id, created, choices, prompt_texts,
                                                     prompt_ids, num_prompt_tokens, streams, shown_ids), streams)
        await self._generate(streams, choices, None)
        out = []
        for c in choices:
            prefix = prompt_texts[c.index // request.n] if request.echo else ""
            if request.max_tokens == 0:
                _drop_output(c)
            logprobs = None
            if request.logprobs is not None:
                rows, offset = [], len(prefix)
                if request.echo:
                    rows, offset = _prompt_logprob_rows(prompt_ids[c.index // request.n], c.prompt_logprobs), 0
                logprobs = CompletionLogprobs(**self._completion_logprobs(rows + c.logprobs, offset, request.logprobs,
                                                                          self._as_token_ids(request))[0])
            ids = prompt_ids[c.index // request.n]
            out.append(CompletionChoice(index=c.index, text=prefix + c.detok.output_text, logprobs=logprobs,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                        prompt_logprobs=self._prompt_logprobs(request, ids, c.prompt_logprobs),
                                        prompt_token_ids=shown_ids[c.index // request.n]
                                        if request.return_token_ids else None,
                                        token_ids=c.token_ids if request.return_token_ids else None))
        return CompletionResponse(id=request_id, created=created, model=self.model_name(request.model), choices=out,
                                  usage=self._usage(num_prompt_tokens, choices, request.n),
                                  kv_transfer_params=choices[0].kv_transfer_params if choices else None)

    async def _stream_completion(self, request: CompletionRequest, request_id: str, created: int,
                                 choices: list[_Choice], prompt_texts: list[str], prompt_ids: list[list[int]],
                                 num_prompt_tokens: int, streams: list[RequestStream],
                                 shown_ids: list[list[int] | None]) -> AsyncIterator[str | bytes]:
        """Choice i answers prompt i // n (several prompts stream their choices interleaved);
        ``shown_ids``: each prompt's ids as return_token_ids shows them."""
        model = self.model_name(request.model)
        n = request.n
        # Logprobs' text offsets count from the start of the choice's text (the echoed prompt included).
        text_offsets = {c.index: len(prompt_texts[c.index // n]) if request.echo else 0 for c in choices}
        final_usage, running_usage = _stream_usage(request, self.settings.enable_force_include_usage)
        # With logprobs the echoed prompt waits for its logprobs, which come with the first output.
        echo_pending = {c.index for c in choices} if request.echo and request.logprobs is not None else set()
        # return_token_ids: each choice's first chunk carries its prompt's ids, each chunk its own new ids.
        token_ids = _StreamedTokenIds(shown_ids, n) if request.return_token_ids else None

        def echo_usage(index: int) -> dict[str, int] | None:
            return _running_usage(len(prompt_ids[index // n])) if running_usage else None

        if request.echo and not echo_pending:
            for c in choices:
                yield _sse(CompletionStreamChunk(id=request_id, created=created, model=model, choices=[
                    CompletionStreamChoice(index=c.index, text=prompt_texts[c.index // n],
                                           **(token_ids.opening(c.index) if token_ids else {}))],
                    usage=echo_usage(c.index)))
        async for event in self._choice_events(streams, choices):
            index, logprobs = event.choice.index, None
            if index in echo_pending:
                echo_pending.discard(index)
                prompt_lp, text_offsets[index] = self._completion_logprobs(
                    _prompt_logprob_rows(prompt_ids[index // n], event.choice.prompt_logprobs), 0, request.logprobs,
                    self._as_token_ids(request))
                yield completion_token_chunk(request_id, created, model, index, prompt_texts[index // n], prompt_lp,
                                             None, None, echo_usage(index),
                                             ids=token_ids.opening(index) if token_ids else None)
            if request.max_tokens == 0:  # echo only: the one generated token is dropped
                if event.finish_reason:
                    yield completion_token_chunk(request_id, created, model, index, "", None, event.finish_reason,
                                                 event.stop_reason, echo_usage(index),
                                                 ids=token_ids.opening(index) if token_ids else None)
                continue
            if request.logprobs is not None and event.logprobs:
                logprobs, text_offsets[index] = self._completion_logprobs(event.logprobs, text_offsets[index],
                                                                          request.logprobs, self._as_token_ids(request))
            yield completion_token_chunk(request_id, created, model, index, event.text, logprobs,
                                         event.finish_reason, event.stop_reason,
                                         _running_usage(len(prompt_ids[index // n]), event) if running_usage else None,
                                         token_ids.of(event) if token_ids else None)
        if request.max_tokens == 0:
            for c in choices:
                _drop_output(c)
        if final_usage:
            yield _sse(CompletionStreamChunk(id=request_id, created=created, model=model, choices=[],
                                             usage=self._usage(num_prompt_tokens, choices, request.n)))
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions -----------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, session_id: str | None = None,
                   external_id: str | None = None):
        """``external_id``: the request's X-Request-Id, the answer's id (``chatcmpl-<id>``) as in vLLM."""
        run = await self.start_chat(request, session_id, external_id=external_id)
        request_id, created, ids, choices = run.request_id, run.created, run.prompt_ids, run.choices
        if request.stream:
            return SSEStream(self._stream_chat(request, request_id, created, choices, ids, run.streams), run.streams)
        await self.finish_chat(run)
        role, echoed = self._answer_role(request)
        out = []
        for c in choices:
            message, finish_reason = ChatMessageOut(role=role, content=c.detok.output_text), c.finish_reason
            if c.output_parser is not None:
                answer = c.output_parser.whole(c.detok.output_text, cut=c.finish_reason == "length")
                message = ChatMessageOut(role=role, content=answer.content, reasoning=answer.reasoning,
                                         reasoning_content=answer.reasoning,
                                         tool_calls=[ToolCall(**call) for call in answer.tool_calls] or None)
                finish_reason = c.output_parser.finish_reason(finish_reason)
            if echoed:  # (beam search's choices too: vLLM echoes the last message for them as well)
                message.content = echoed + (message.content or "")
            hidden = c.output_parser is not None and c.output_parser.hides_reasoning
            logprobs = (ChatLogprobs(**self.chat_logprobs(c.logprobs, self._as_token_ids(request)))
                        if request.logprobs and not hidden else None)
            out.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                                  stop_reason=c.stop_reason,
                                  token_ids=c.token_ids if request.return_token_ids and not hidden else None))
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name(request.model),
                                      choices=out, usage=self._usage(len(ids), choices, request.n),
                                      prompt_logprobs=self._prompt_logprobs(request, ids, choices[0].prompt_logprobs),
                                      prompt_token_ids=ids if request.return_token_ids else None,
                                      kv_transfer_params=choices[0].kv_transfer_params)

    async def start_chat(self, request: ChatCompletionRequest, session_id: str | None = None,
                         request_id: str | None = None, external_id: str | None = None,
                         engine_base: str | None = None) -> ChatRun:
        """Render, route and send a chat request's choices to their engine; what comes back is read
        with ``finish_chat`` (whole) or ``choice_events`` (streamed). Also the Responses API's way in.
        With beam search, the whole search runs here, and the choices come back complete."""
        lora = await self.resolve_model(request.model)
        self.check_generates()
        _no_stream_prompt_logprobs(request)
        self.resolve_logprobs(request)
        tool_choice = request.tool_choice_form()
        if tool_choice == "auto" and self.settings.tool_call_parser is None:
            raise bad_request('tool_choice "auto" (the default with tools) needs a server started with '
                              "--enable-auto-tool-choice and --tool-call-parser; or name a function, or use "
                              '"required" or "none"', "tool_choice")
        if self._harmony and tool_choice not in ("auto", "none"):
            raise bad_request('harmony answers (gpt-oss) call tools under tool_choice "auto" (or "none"): a named '
                              'or "required" tool_choice is not served for them', "tool_choice")
        urls, video_urls = self.chat_images(request.messages), self.chat_videos(request.messages)
        if urls or video_urls:
            for refused, param in ((request.use_beam_search, "use_beam_search"),
                                   (request.truncate_prompt_tokens is not None, "truncate_prompt_tokens")):
                if refused:
                    raise bad_request(f"{param} is not supported with images or videos", param)
        chars = conversation_chars(request.messages, request.tools, request.documents)
        ids = await self.tokenizer_work(chars, self.render_chat, request)
        # With images: each image token expanded to its placeholders, which the context must hold, and
        # the images loaded (once: the choices share them); their identifiers key the prompt's blocks,
        # for prefix-aware routing as in the engines.
        features: list[MultiModalFeature] | None = None
        if urls or video_urls:
            ids, features = await self.prompt_media(urls, video_urls, ids)
        else:
            ids = self.truncate_prompt(ids, request)
        if request_id is None:
            request_id, engine_base = answer_ids("chatcmpl", external_id)
        elif engine_base is None:
            engine_base = request_id
        created = int(time.time())
        prompt_thinking = self._prompt_thinking(ids)
        top = (request.top_logprobs or 0) if request.logprobs else None
        if request.use_beam_search:
            if tool_choice not in ("none", "auto"):
                raise bad_request("a named or required tool_choice is not supported with use_beam_search",
                                  "tool_choice")
            plan = self._beam_plan(request, ids, request.requested_max_tokens, top)
            choices = await self._beam_searches(request, [plan], engine_base, session_id, lora,
                                                self._chat_skip_special_tokens(tool_choice, prompt_thinking))
            for c in choices:
                c.output_parser = self._chat_output_parser(request, tool_choice, prompt_thinking,
                                                           c.detok.marker_offsets)
            return ChatRun(request_id, created, ids, choices, [])
        engine = self.choose_engine(ids, session_id, lora=lora, cache_salt=request.cache_salt,
                                    prefill=wants_remote_decode(request.kv_transfer_params), mm_features=features)
        # Some models' tool-call tags are special tokens: under "auto" the parser must see them (vLLM);
        # so must the reasoning parser its tags, where they are.
        skip = self._chat_skip_special_tokens(tool_choice, prompt_thinking)
        choices = self._new_choices(request.n, ids, request, skip)
        for c in choices:
            c.output_parser = self._chat_output_parser(request, tool_choice, prompt_thinking, c.detok.marker_offsets)
        # A model that thinks first (deepseek_r1), or chooses to (qwen3), meets its output constraint
        # after its thinking.
        after, may_open = self._constraint_start(prompt_thinking)
        jobs = [_Job(engine, choice_request_id(engine_base, c.index), ids,
                     self.sampling_params(request, len(ids), request.requested_max_tokens, top, c.index,
                                          prompt_logprobs=request.prompt_logprobs, structured_output_after=after,
                                          structured_output_may_open=may_open,
                                          structured_output_then=self._harmony_message),
                     num_choices=request.n if c.index == 0 else 0,
                     kv_transfer_params=_client_kv_params(request.kv_transfer_params, c.index == 0),
                     mm_features=features)
                for c in choices]
        streams = await self._open_all(jobs, request.priority, lora, request.cache_salt)
        return ChatRun(request_id, created, ids, choices, streams)

    async def start_chat_as(self, request: ChatCompletionRequest, session_id: str | None, request_id: str,
                            param_names: dict[str, str], engine_base: str | None = None) -> ChatRun:
        """``start_chat`` for another API (Responses, Anthropic's Messages): its refusals name that
        API's parameters (``param_names``: chat names to its own; ``max_tokens`` in messages too).
        ``engine_base``: its engine requests' ids start with it (by default ``request_id``)."""
        try:
            return await self.start_chat(request, session_id, request_id=request_id, engine_base=engine_base)
        except APIError as e:
            if e.param in param_names:
                e.param = param_names[e.param]
                for chat_name in ("max_completion_tokens", "max_tokens"):
                    e.message = e.message.replace(chat_name, param_names.get(chat_name, chat_name))
            raise

    async def finish_chat(self, run: ChatRun) -> None:
        """Every choice of a started chat, to its end."""
        await self._generate(run.streams, run.choices, None)

    def choice_events(self, run: ChatRun) -> AsyncIterator[_Delta]:
        """A started chat's outputs as they come (its choices' in arrival order); a timeout or an
        engine error raises _StreamError."""
        return self._choice_events(run.streams, run.choices)

    async def parsed_deltas(self, run: ChatRun) -> AsyncIterator[tuple[ParsedDelta, _Delta]]:
        """A started one-choice chat as it streams (the other APIs' answers), split into reasoning,
        content and tool-call deltas by its output parser (all content without one), each with the
        event it came from (its tokens' logprobs, its finish)."""
        parser = run.choices[0].output_parser
        async for event in self.choice_events(run):
            parsed = parser.feed(event.text) if parser is not None else ParsedDelta(content=event.text)
            if event.finish_reason is not None and parser is not None:
                parsed.extend(parser.finish())
            yield parsed, event

    async def _stream_chat(self, request: ChatCompletionRequest, request_id: str, created: int,
                           choices: list[_Choice], prompt_ids: list[int],
                           streams: list[RequestStream]) -> AsyncIterator[str | bytes]:
        model = self.model_name(request.model)
        num_prompt_tokens = len(prompt_ids)
        final_usage, running_usage = _stream_usage(request, self.settings.enable_force_include_usage)
        opening_usage = UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens) \
            if running_usage else None
        # return_token_ids: the role chunk carries the prompt's ids, each later chunk its choice's new ids.
        token_ids = _StreamedTokenIds([prompt_ids], request.n) if request.return_token_ids else None
        role, echoed = self._answer_role(request)
        for c in choices:
            yield _sse(ChatCompletionChunk(id=request_id, created=created, model=model, usage=opening_usage, choices=[
                ChatStreamChoice(index=c.index, delta=DeltaMessage(role=role, content=""))],
                prompt_token_ids=token_ids.prompt(c.index) if token_ids else None))
        if echoed:
            echo_usage = _running_usage(num_prompt_tokens) if running_usage else None
            for c in choices:
                yield chat_token_chunk(request_id, created, model, c.index, echoed, None, None, None, echo_usage)
        async for event in self._choice_events(streams, choices):
            parser = event.choice.output_parser
            hidden = parser is not None and parser.hides_reasoning
            logprobs = (self.chat_logprobs(event.logprobs, self._as_token_ids(request))
                        if request.logprobs and event.logprobs and not hidden else None)
            usage = _running_usage(num_prompt_tokens, event) if running_usage else None
            if parser is None:
                yield chat_token_chunk(request_id, created, model, event.choice.index, event.text, logprobs,
                                       event.finish_reason, None, usage, token_ids.of(event) if token_ids else None,
                                       event.stop_reason)
                continue
            for chunk in self._parsed_chat_chunks(parser, event, logprobs, usage, request_id, created, model,
                                                  None if hidden else token_ids):
                yield chunk
        if final_usage:
            yield _sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                           usage=self._usage(num_prompt_tokens, choices, request.n)))
        yield "data: [DONE]\n\n"

    def _answer_role(self, request: ChatCompletionRequest) -> tuple[str, str]:
        """The answer's role (vLLM's: --response-role when the prompt opens the assistant's turn, else
        the last message's, which the answer continues) and, with echo, the text it starts with (the
        last message's, when it is in that role)."""
        last = request.messages[-1]
        role = self.settings.response_role if request.add_generation_prompt else last.role
        return role, last.text() if request.echo and last.role == role else ""

    def _parsed_chat_chunks(self, parser: ChatOutputParser, event: _Delta, logprobs: dict[str, Any] | None,
                            usage: dict[str, int] | None, request_id: str, created: int, model: str,
                            token_ids: _StreamedTokenIds | None = None) -> list[bytes]:
        """The chunks of one event of a choice whose text is parsed (reasoning, tool calls): none
        while a tag may be starting (its token ids then go with the next chunk); after tool calls,
        the finish in a chunk of its own, as OpenAI ends a stream (the openai client's stream helper
        closes the last call only on a later chunk)."""
        index = event.choice.index
        parsed = parser.feed(event.text)
        finish_reason = event.finish_reason
        if finish_reason is not None:
            parsed.extend(parser.finish())
            finish_reason = parser.finish_reason(finish_reason)
        if not (parsed or logprobs or finish_reason):
            return []
        ids = token_ids.of(event) if token_ids else None
        if finish_reason is not None and parsed.tool_calls:
            return [chat_token_chunk(request_id, created, model, index, parsed.content, logprobs, None, parsed, usage,
                                     ids),
                    chat_token_chunk(request_id, created, model, index, "", None, finish_reason, None, usage,
                                     {"token_ids": []} if ids else None, event.stop_reason)]
        return [chat_token_chunk(request_id, created, model, index, parsed.content, logprobs, finish_reason, parsed,
                                 usage, ids, event.stop_reason if finish_reason is not None else None)]

    async def _deltas(self, stream: RequestStream, choice: _Choice) -> AsyncIterator[_Delta]:
        """One choice read straight from its engine queue. Outputs that queued up while the previous
        delta was being handled are merged into one, and with --stream-interval N > 1 so are those
        that bring fewer than N tokens since the last delta (the first delta and the last are never
        held). A timeout or an engine error raises _StreamError."""
        interval = self.settings.stream_interval
        deltas: list[str] = []
        new_lps: list = []
        num_sent = 0  # the choice's tokens when its last delta left (0: none has)
        try:
            while not stream.finished:
                try:
                    batch = await stream.next_batch()
                except RequestTimeoutError as e:
                    raise _StreamError(self._timed_out()) from e
                for output in batch:
                    delta, new_lp = self._apply_output(choice, output)
                    deltas.append(delta)
                    new_lps += new_lp
                    if choice.finish_reason is not None:
                        break
                if choice.error is not None:
                    raise _StreamError(APIError(500, choice.error, "InternalServerError"))
                if (interval > 1 and choice.finish_reason is None and num_sent
                        and len(choice.token_ids) - num_sent < interval):
                    continue  # held: goes with the next delta
                delta = "".join(deltas)
                if delta or new_lps or choice.finish_reason:
                    num_sent = len(choice.token_ids)
                    yield _Delta(choice, delta, new_lps, choice.finish_reason, choice.stop_reason, num_sent)
                    deltas, new_lps = [], []
                if choice.finish_reason is not None:
                    break
        finally:
            # Finished, a stop string, or the client went away: close() aborts what did not finish
            # (a stop string's as finished, for the engine's metrics).
            stream.stopped = choice.finish_reason == "stop" and not stream.finished
            stream.num_kept_tokens = len(choice.token_ids)
            await stream.close()
            if self.settings.enable_log_outputs and choice.finish_reason is not None:
                self._log_output(stream.request_id, choice)

    def _choice_events(self, streams: list[RequestStream], choices: list[_Choice]
                       ) -> AsyncIterator[_Delta]:
        if not streams:  # choices that came complete (beam search): one event each
            return _complete_events(choices)
        if len(streams) == 1:
            return self._deltas(streams[0], choices[0])
        return self._merged_events(streams, choices)

    async def _merged_events(self, streams: list[RequestStream], choices: list[_Choice]
                             ) -> AsyncIterator[_Delta]:
        """Several choices' events in arrival order (one task per choice); errors become one SSE error event."""
        sink: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run() -> None:
            try:
                await self._generate(streams, choices, sink)
            except Exception as e:  # (anything unexpected too: the stream ends with its error event)
                sink.put_nowait(api_error_of(e))
            finally:
                sink.put_nowait(done)

        runner = asyncio.create_task(run())
        try:
            while True:
                item = await sink.get()
                if item is done:
                    break
                if isinstance(item, APIError):
                    raise _StreamError(item)
                yield item
        finally:
            # A client that goes away cancels this generator: the runner's cancel aborts the requests.
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    # -- beam search (vLLM's use_beam_search) ------------------------------------------------------------

    def _beam_plan(self, request: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                   logprobs: int | None) -> _BeamPlan:
        """A prompt's beam search, checked before anything is sent: each round asks the engines for
        one token and the best 2n alternatives (more when the request's own logprobs ask for more:
        those are shown, they do not compete)."""
        limit = self.settings.max_logprobs if self.settings.max_logprobs >= 0 else len(self.tokenizer)
        try:
            candidates = candidates_per_beam(request.n, limit)
        except ValueError as e:
            raise bad_request(f"use_beam_search: {e} (--max-logprobs)", "n") from e
        base = self.sampling_params(request, len(prompt_ids), max_tokens, max(candidates, logprobs or 0), 0)
        return _BeamPlan(prompt_ids, dataclasses.replace(base, max_tokens=1), base.max_tokens, logprobs)

    async def _beam_searches(self, request: SamplingFields, plans: list[_BeamPlan], engine_base: str,
                             session_id: str | None, lora: LoRARequest | None,
                             skip_special_tokens: bool | None = None) -> list[_Choice]:
        """Every prompt's search at once, under one deadline (--request-timeout counts the whole
        request); one that fails cancels the others (their round's requests are aborted)."""
        timeout = self.settings.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        tasks = [asyncio.create_task(self._beam_search(request, plan, i * request.n, engine_base, session_id, lora,
                                                       deadline, skip_special_tokens))
                 for i, plan in enumerate(plans)]
        try:
            return [c for found in await asyncio.gather(*tasks) for c in found]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _beam_search(self, request: SamplingFields, plan: _BeamPlan, first_index: int, engine_base: str,
                           session_id: str | None, lora: LoRARequest | None, deadline: float | None,
                           skip_special_tokens: bool | None) -> list[_Choice]:
        """One prompt's ``n`` best beams (engine_core.beam_search), as complete choices numbered
        from ``first_index``. The routing policy places each beam of a round, so under prefix_aware
        a prompt's beams follow their cached context."""
        stop_ids = set(request.stop_token_ids or ())
        if not request.ignore_eos:
            stop_ids.update(self.settings.eos_token_ids)
            if self.eos_token_id is not None:
                stop_ids.add(self.eos_token_id)
        search = BeamSearch(plan.prompt_ids, request.n, stop_ids, request.length_penalty)
        num_cached = 0
        for round_index in range(plan.rounds):
            if search.finished:
                break
            # (An adapter a round's engine had lost is loaded again under a new id: later rounds use it.)
            lora = lora if lora is None else self.lora_adapters.get(lora.lora_name, lora)
            chosen = [0] * self.client.num_engines
            jobs = [_Job(self.choose_engine(beam.tokens, session_id, chosen, lora, cache_salt=request.cache_salt),
                         f"{engine_base}-{first_index}-beam{round_index}-{i}", beam.tokens, plan.step)
                    for i, beam in enumerate(search.live)]
            streams = await self._open_all(jobs, request.priority, lora, request.cache_salt, deadline)
            reads = [asyncio.ensure_future(self._ending_output(stream, _brings_a_token)) for stream in streams]
            try:
                outputs = await asyncio.gather(*reads)  # (the first failure ends the round)
            finally:
                for read in reads:
                    read.cancel()
                await asyncio.gather(*reads, return_exceptions=True)
                for stream in streams:  # (aborts the others when one failed, or the client left)
                    await stream.close()
            if round_index == 0:
                num_cached = max(output.num_cached_tokens for output in outputs)
            search.advance([(output.new_token_ids[0], output.new_logprobs.sampled_logprobs[0],
                             [tuple(alt) for alt in output.new_logprobs.top_logprobs[0]])  # type: ignore[union-attr]
                            for output in outputs])
        choices = []
        for i, beam in enumerate(search.best()):
            choice = self._new_choices(1, plan.prompt_ids, request, skip_special_tokens)[0]
            choice.index = first_index + i
            choice.token_ids = search.generated(beam)
            ended_by_stop_token = beam.finish_reason == "stop" and not request.include_stop_str_in_output
            choice.detok.add_tokens(choice.token_ids[:-1] if ended_by_stop_token else choice.token_ids)
            choice.detok.finish()
            if plan.logprobs is not None:
                choice.logprobs = [(token, logprob, top[:plan.logprobs]) for token, logprob, top in beam.steps]
            # The stop token that ended a beam is its stop_reason, an EOS too (as vLLM's beam search).
            choice.finish_reason, choice.stop_reason = beam.finish_reason, beam.stop_reason
            choice.num_cached_tokens = num_cached
            if self.settings.enable_log_outputs:
                self._log_output(f"{engine_base}-{choice.index}", choice)
            choices.append(choice)
        return choices

    # -- /v1/embeddings -------------------------------------------------------------------------------

    async def embed(self, request_id: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                    priority: int, lora: LoRARequest | None, session_id: str | None = None,
                    cache_salt: str | None = None) -> list[list[float]]:
        """Each prompt's embedding (``params.embed``; a list: each prompt's own), their requests sent
        together to the engines the routing policy picks (and read one after another: they run at
        once in the engines); a timeout or an engine error fails them all."""
        chosen = [0] * self.client.num_engines
        each = params if isinstance(params, list) else [params] * len(prompts)
        jobs = [_Job(self.choose_engine(ids, session_id, chosen, lora, cache_salt=cache_salt),
                     choice_request_id(request_id, i), ids, p)
                for i, (ids, p) in enumerate(zip(prompts, each, strict=True))]
        streams = await self._open_all(jobs, priority, lora, cache_salt)
        try:
            return [(await self._ending_output(stream, _brings_a_pooled_output)).pooling_output  # type: ignore[misc]
                    for stream in streams]
        finally:
            for stream in streams:  # (aborts the others when one failed, or the client left)
                await stream.close()

    async def _ending_output(self, stream: RequestStream,
                             wanted: Callable[[EngineCoreOutput], bool]) -> EngineCoreOutput:
        """The output a one-answer request (an embedding, a beam-search round's token) is read for;
        a timeout is a 408, and a request that ends without it (an engine error) a 500."""
        while not stream.finished:
            try:
                batch = await stream.next_batch()
            except RequestTimeoutError as e:
                raise self._timed_out() from e
            for output in batch:
                if wanted(output):
                    return output
                if output.finish_reason is not None:
                    raise APIError(500, str(output.stop_reason or f"the engine ended the request "
                                                               f"({output.finish_reason.name.lower()})"),
                                   "InternalServerError")
        raise APIError(500, "the engine ended the request without its answer", "InternalServerError")

    # -- helpers --------------------------------------------------------------------------------------

    def _usage(self, num_prompt_tokens: int, choices: list[_Choice], n: int) -> UsageInfo:
        """Token counts; with --enable-prompt-tokens-details also the prompt tokens the engines found
        in their prefix caches (per prompt: its n choices share it, so the most any of them found)."""
        completion = sum(len(c.token_ids) for c in choices)
        details = None
        if self.settings.enable_prompt_tokens_details:
            cached = sum(max(c.num_cached_tokens for c in choices[i:i + n]) for i in range(0, len(choices), n))
            details = PromptTokensDetails(cached_tokens=cached)
        reasoning = [self.reasoning_tokens(c) for c in choices]
        return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                         total_tokens=num_prompt_tokens + completion, prompt_tokens_details=details,
                         completion_tokens_details=None if None in reasoning else CompletionTokensDetails(
                             reasoning_tokens=sum(reasoning)))  # type: ignore[arg-type]

    def reasoning_tokens(self, choice: _Choice) -> int | None:
        """How many of a choice's tokens are its thinking (the tags not counted): those before the
        token that closes it, or all when it never closed. None when no reasoning parser read the
        choice, or the tags are not single tokens of the vocabulary."""
        parser = choice.output_parser
        if parser is not None and isinstance(parser.tools, HarmonyParser):  # (its reasoning messages' bodies)
            return harmony_reasoning_tokens(choice.token_ids, self._harmony_markers,
                                            lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
                                            ) if parser.reasoned else 0
        if parser is None or parser.reasoning is None or self._think_end_id is None:
            return None
        if not parser.reasoned:  # (an answer that did not think: all content, even with no closing tag)
            return 0
        ids = choice.token_ids
        end = ids.index(self._think_end_id) if self._think_end_id in ids else len(ids)
        return sum(1 for token in ids[:end] if token != self._think_start_id)

    def _timed_out(self) -> APIError:
        return APIError(408, f"request timed out after {self.settings.request_timeout_s} s", "TimeoutError")

    def token_text(self, token_id: int) -> str:
        """One token's text (logprobs name their tokens by it), decoded once per token id: a request
        may ask for every token of the vocabulary at each position."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = token_text(self.tokenizer, self._decode, token_id)
        return text

    def _as_token_ids(self, request: SamplingFields) -> bool:
        """Logprobs name tokens ``token_id:N``: the request asks, or the server's
        --return-tokens-as-token-ids does for every request (vLLM's)."""
        return request.return_tokens_as_token_ids or self.settings.return_tokens_as_token_ids

    def _token_label(self, as_ids: bool):
        """How logprobs name tokens: their text, or ``token_id:N`` (vLLM's return_tokens_as_token_ids)."""
        return (lambda token_id: f"token_id:{token_id}") if as_ids else self.token_text

    def chat_logprobs(self, rows: list[tuple[int, float, list[tuple[int, float]]]],
                      as_ids: bool = False) -> dict[str, Any]:
        """The ``ChatLogprobs`` JSON of some tokens, as plain data (streamed chunks encode it directly)."""
        label = self._token_label(as_ids)
        name_bytes = (lambda token_id: list(label(token_id).encode())) if as_ids else self.token_bytes
        content = []
        for token_id, logprob, top in rows:
            content.append({"token": label(token_id), "logprob": logprob, "bytes": name_bytes(token_id),
                            "top_logprobs": [{"token": label(tid), "logprob": lp, "bytes": name_bytes(tid)}
                                             for tid, lp in top]})
        return {"content": content}

    def token_bytes(self, token_id: int) -> list[int]:
        """A token's bytes as chat logprobs give them (its own, for one holding part of a character)."""
        found = self._token_bytes.get(token_id)
        if found is None:
            found = self._token_bytes[token_id] = list(token_bytes(self.tokenizer, token_id, self.token_text(token_id)))
        return found

    def _completion_logprobs(self, rows: list[tuple[int, float | None, list[tuple[int, float]]]], offset: int,
                             num_top: int, as_ids: bool = False) -> tuple[dict[str, Any], int]:
        """The ``CompletionLogprobs`` JSON of some tokens whose text starts at ``offset`` in the
        choice's text, and the offset after them (offsets follow the text even when tokens are
        named by id). Each token's ``top_logprobs`` holds the token itself and the ``num_top`` most
        likely (OpenAI's "up to logprobs+1", as vLLM's): {token: logprob} alone for logprobs=0."""
        label = self._token_label(as_ids)
        text_offset, token_logprobs, tokens, top_logprobs = [], [], [], []
        for token_id, logprob, top in rows:
            text = self.token_text(token_id)
            name = label(token_id) if as_ids else text
            tokens.append(name)
            token_logprobs.append(logprob)
            text_offset.append(offset)
            offset += len(text)
            if logprob is None:  # (the prompt's first token: nothing precedes it)
                top_logprobs.append(None)
                continue
            alternatives = {name: logprob}
            for tid, lp in top[:num_top]:
                alternatives.setdefault(label(tid), lp)
            top_logprobs.append(alternatives)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}, offset


class SSEStream:
    """A streamed response body plus the engine requests opened for it. ``aclose()`` releases them
    all, also when the body was never started (the client left before the response began)."""

    def __init__(self, chunks: AsyncIterator[str | bytes], streams: list[RequestStream],
                 error_event: Callable[[Exception], str] | None = None) -> None:
        self._chunks = chunks
        self._streams = streams
        # An error after the response started, as the API's last event (OpenAI's by default).
        self.error_event = error_event or stream_error_event

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:  # (the engine requests are released whatever closing the body raised)
            for stream in self._streams:
                await stream.close()


def _primary_eos(tokenizer: Any, model_eos_ids: tuple[int, ...]) -> int | None:
    """The tokenizer's EOS id, else the model's first (a tokenizer that names none)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    return model_eos_ids[0] if model_eos_ids else None


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


# The names an earlier assistant turn's thinking reaches chat templates under.
_THINKING_NAMES = ("reasoning", "reasoning_content", "thinking")


def _template_message(extra: dict[str, Any], role: str, content: Any) -> dict[str, Any]:
    message = {**extra, "role": role, "content": content}
    # An earlier answer's thinking, sent back under either of vLLM's names (reasoning, or the older
    # reasoning_content): the templates read one or the other (gpt-oss's reads ``thinking``), so all
    # three carry it.
    given = next((message[name] for name in _THINKING_NAMES if message.get(name) is not None), None)
    if given is not None:
        for name in _THINKING_NAMES:
            if message.get(name) is None:
                message[name] = given
    calls = extra.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_parsed_arguments(call) for call in calls]
    return message


def _harmony_tool_turn(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier gpt-oss turn that called tools, as its chat template takes it: the template writes the
    turn's analysis from its content or its thinking and refuses both, so where the turn has its
    thinking, a preamble this server returned as its content is left out (the template has no place
    for a commentary preamble beside the calls)."""
    if message.get("role") == "assistant" and message.get("tool_calls") and message.get("content") \
            and message.get("thinking"):
        return {**message, "content": None}
    return message


def _parsed_arguments(call: Any) -> Any:
    """A tool call of an earlier assistant turn, with its ``arguments`` JSON text parsed (vLLM does
    the same for the templates)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str | None):
        return call
    try:
        # Empty or null arguments (a call without any) are an empty object, as in vLLM.
        arguments = json.loads(function["arguments"]) if (function["arguments"] or "").strip() else None
    except (ValueError, RecursionError) as e:  # (nested past Python's limit: the client's error too)
        raise bad_request(f"a tool call's arguments are not JSON: {e}", "messages") from e
    return {**call, "function": {**function, "arguments": {} if arguments is None else arguments}}


def _wrap_int64(value: int) -> int:
    """Choice i samples with seed + i, kept in the engine's 64-bit range."""
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def new_dynamic_lora_id() -> int:
    """A fresh id for a runtime load: above every static one (1, 2, ...), random so that replicas
    loading at the same time do not collide (the engines are the registry others read it from)."""
    return (1 << 32) + secrets.randbits(56)


def _lora_call_failure(error: BaseException, engine: int) -> str:
    if isinstance(error, TimeoutError):
        return f"engine {engine} did not answer within {LORA_CALL_TIMEOUT_S:g} s"
    return _remote_message(error)


def _remote_message(error: BaseException) -> str:
    """The message of an error raised inside an engine actor, without Ray's traceback wrapper."""
    cause = getattr(error, "cause", None)
    text = str(cause if cause is not None else error).strip()
    return text.splitlines()[-1] if text else type(cause or error).__name__


def unknown_model(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _engine_refusal(error: EngineOverloadedError | EngineUnavailableError) -> APIError:
    """A full queue is the client's 429; an engine that is down or unreachable is a 503."""
    if isinstance(error, EngineOverloadedError):
        return APIError(429, str(error), "RateLimitError")
    return APIError(503, str(error), "ServiceUnavailableError")


def parsed_whole(choice: _Choice) -> ParsedDelta:
    """A finished choice's text, split as its stream would have been (reasoning, content, calls)."""
    text = choice.detok.output_text
    if choice.output_parser is None:
        return ParsedDelta(content=text)
    return choice.output_parser.parse(text, cut=choice.finish_reason == "length")


class _StreamError(Exception):
    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


def api_error_of(error: Exception) -> APIError:
    """What went wrong mid-stream, as an API error (anything unexpected is a 500)."""
    if isinstance(error, _StreamError):
        return error.error
    return error if isinstance(error, APIError) else APIError(500, str(error), "InternalServerError")


def stream_error_event(error: Exception) -> str:
    return f"data: {json.dumps(api_error_of(error).body())}\n\ndata: [DONE]\n\n"


def named_sse_event(payload: dict[str, Any]) -> str:
    """An SSE event named by its payload's type (the Responses and Messages APIs' events)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


# The least logprob an answer carries, as vLLM's: JSON has no -inf, which a token a grammar (or
# allowed_token_ids) forbids has among a structured answer's alternatives.
LOGPROB_FLOOR = -9999.0


def _logprob_rows(token_ids: list[int], entry: LogprobsEntry) -> list[tuple[int, float, list[tuple[int, float]]]]:
    floor = LOGPROB_FLOOR
    return [(tid, max(entry.sampled_logprobs[i], floor), [(t, max(lp, floor)) for t, lp in entry.top_logprobs[i]])
            for i, tid in enumerate(token_ids) if i < len(entry.sampled_logprobs)]


def _no_stream_prompt_logprobs(request: SamplingFields) -> None:
    if request.prompt_logprobs and request.stream:  # (0, the prompt's own tokens only, is allowed: vLLM)
        raise bad_request("prompt_logprobs are not available when stream is true (as in vLLM)", "prompt_logprobs")


def _max_or_none(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _prompt_logprob_rows(prompt_ids: list[int], entry: LogprobsEntry | None
                         ) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
    """Rows of the prompt's tokens for echoed logprobs: the first token has none (nothing precedes it)."""
    rows: list[tuple[int, float | None, list[tuple[int, float]]]] = [(prompt_ids[0], None, [])]
    if entry is not None:
        rows += _logprob_rows(prompt_ids[1:], entry)
    return rows


def _drop_output(choice: _Choice) -> None:
    """max_tokens=0 with echo: the token generated to satisfy the engine is not part of the answer."""
    choice.token_ids.clear()
    choice.logprobs.clear()
    choice.detok.output_text = ""


def _brings_a_token(output: EngineCoreOutput) -> bool:
    return bool(output.new_token_ids) and output.new_logprobs is not None


def _brings_a_pooled_output(output: EngineCoreOutput) -> bool:
    return output.pooling_output is not None


async def _complete_events(choices: list[_Choice]) -> AsyncIterator[_Delta]:
    for c in choices:
        yield _Delta(c, c.detok.output_text, c.logprobs, c.finish_reason, c.stop_reason, len(c.token_ids))


class _StreamedTokenIds:
    """vLLM's return_token_ids in a stream: a choice's first chunk carries its prompt's ids (chat
    puts them in the role chunk, at the chunk's top level), and each chunk the ids generated since
    the choice's previous chunk, so a choice's chunks add up to its ``token_ids``."""

    def __init__(self, prompt_ids: list[list[int] | None], n: int) -> None:
        """``prompt_ids``: None for a prompt given as embeddings (its first chunk says null)."""
        self._prompt_ids, self._n = prompt_ids, n
        self._sent: dict[int, int] = {}  # choice index -> its tokens already sent

    def _first(self, index: int) -> bool:
        first = index not in self._sent
        self._sent.setdefault(index, 0)
        return first

    def prompt(self, index: int) -> list[int] | None:
        """The choice's prompt ids the first time it is asked for (its first chunk), else None."""
        return self._prompt_ids[index // self._n] if self._first(index) else None

    def opening(self, index: int) -> dict[str, list[int] | None]:
        """A chunk that carries no generated token (an echoed prompt, an echo-only finish)."""
        if not self._first(index):
            return {"token_ids": []}
        return {"prompt_token_ids": self._prompt_ids[index // self._n], "token_ids": []}

    def of(self, event: _Delta) -> dict[str, list[int] | None]:
        """The ids of the chunk that sends ``event`` (and those of any event of its choice not sent)."""
        index = event.choice.index
        first = self._first(index)
        start, self._sent[index] = self._sent[index], event.num_tokens
        ids: dict[str, list[int] | None] = {"token_ids": event.choice.token_ids[start:event.num_tokens]}
        if first:
            ids["prompt_token_ids"] = self._prompt_ids[index // self._n]
        return ids


def _stream_usage(request: SamplingFields, forced: bool) -> tuple[bool, bool]:
    """A stream's usage (vLLM's should_include_usage): a last chunk with the request's usage (its
    stream_options.include_usage, or always with --enable-force-include-usage), and with vLLM's
    continuous_usage_stats each token chunk too (only when the request asks for it)."""
    options = request.stream_options
    if options is None:
        return forced, False
    include = bool(options.include_usage) or forced
    return include, include and bool(options.continuous_usage_stats)


def _running_usage(num_prompt_tokens: int, event: _Delta | None = None) -> dict[str, int]:
    """continuous_usage_stats: a choice's usage so far (after ``event``; None: before any token, as
    an echoed prompt's chunks carry it)."""
    num_tokens = 0 if event is None else event.num_tokens
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_tokens,
            "total_tokens": num_prompt_tokens + num_tokens}


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


# The per-token chunks are the hot path of streaming: they are encoded from plain dicts (the same
# JSON as the CompletionStreamChunk / ChatCompletionChunk models give) instead of building models.
_json_encoder = msgspec.json.Encoder()


def completion_token_chunk(request_id: str, created: int, model: str, index: int, text: str,
                           logprobs: dict[str, Any] | None, finish_reason: str | None,
                           stop_reason: int | str | None, usage: dict[str, int] | None = None,
                           ids: dict[str, list[int]] | None = None) -> bytes:
    """``ids``: with return_token_ids, the chunk's ``token_ids`` (and its choice's ``prompt_token_ids``)."""
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason, "stop_reason": stop_reason}
    if ids:
        choice.update(ids)
    return b"data: " + _json_encoder.encode({"id": request_id, "object": "text_completion", "created": created,
                                             "model": model, "choices": [choice], "usage": usage}) + b"\n\n"


def chat_token_chunk(request_id: str, created: int, model: str, index: int, delta: str,
                     logprobs: dict[str, Any] | None, finish_reason: str | None,
                     parsed: ParsedDelta | None = None, usage: dict[str, int] | None = None,
                     ids: dict[str, list[int]] | None = None, stop_reason: int | str | None = None) -> bytes:
    """``parsed``: what a reasoning or tool-call parser made of the text (its reasoning and tool
    calls go in the delta; ``delta`` is then its content). ``ids``: with return_token_ids, the
    chunk's ``token_ids``. ``stop_reason``: on the finish chunk, the stop string or token id that
    ended the choice (vLLM's field)."""
    message: dict[str, Any] = {"role": None, "content": delta or None}
    if parsed is not None:
        if parsed.reasoning:
            # Under both names: vLLM renamed reasoning_content to reasoning; clients read either.
            message["reasoning"] = message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
    choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if ids:
        choice.update(ids)
    return b"data: " + _json_encoder.encode({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                             "model": model, "choices": [choice], "usage": usage}) + b"\n\n"
