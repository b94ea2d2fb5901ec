"""``POST /v1/embeddings``: OpenAI's Embeddings API (and vLLM's extras) on the serving's engines.

Each input is tokenised (or taken as token ids), sent as an embedding request (SamplingParams.embed)
and answered with the final hidden state of its last token: "last" pooling, how decoder embedding
models (Qwen3-Embedding, e5-mistral, gte-Qwen2) are read. Any served model answers; one trained
for embeddings gives useful ones. ``encoding_format: "base64"`` (what the openai client asks for
by default) sends float32 bytes in the machine's order (little-endian here); vLLM's ``bytes`` /
``bytes_only`` send the raw bytes as the body.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.responses import Response

from engine_core.executor import PoolingInfo
from engine_core.sampling_params import SamplingParams
from router.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatMessage,
    IgnoredFieldsLogged,
    cache_salt_field,
    invalid,
    request_id_field,
)
from router.serving import OpenAIServing, answer_ids, bad_request, conversation_chars

TruncationSide = Literal["left", "right"]
TRUNCATION_SIDE_HELP = ('Which end truncate_prompt_tokens cuts: "right" keeps an input\'s first tokens (as '
                        'sentence-transformers and vLLM\'s pooling endpoints do), "left" its last.')


EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
# vLLM's embed_dtype names -> torch dtypes.
_EMBED_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}


class EncodingFields(BaseModel):
    """How /v1/embeddings and /pooling send their vectors: OpenAI's encoding_format (values, or their
    bytes in base64), vLLM's binary forms (``bytes``: every vector's bytes one after another as the
    body, with a ``metadata`` header saying where each lies; ``bytes_only``: the body alone), and
    vLLM's embed_dtype and endianness for the bytes."""

    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: EmbedDType = Field("float32", description="The bytes' element type (fp8: one byte each).")
    endianness: Literal["native", "big", "little"] = Field("native", description="The bytes' order.")

    def encode(self, vector: list[float] | list[list[float]]) -> list[float] | list[list[float]] | str:
        return encoded(vector, self.encoding_format, self.embed_dtype, self.endianness)

    @property
    def binary(self) -> bool:
        return self.encoding_format in ("bytes", "bytes_only")

    def binary_response(self, request_id: str, model: str, vectors: list[Any], num_tokens: int) -> Response:
        """vLLM's binary answer: the vectors' bytes one after another (application/octet-stream) and,
        for ``bytes``, a ``metadata`` header (JSON: id, created, model, usage, and per vector its
        index, embed_dtype, endianness, shape and the body's [start, end) bytes)."""
        parts, items, offset = [], [], 0
        for index, vector in enumerate(vectors):
            raw = to_bytes(vector, self.embed_dtype, self.endianness)
            items.append({"index": index, "embed_dtype": self.embed_dtype, "endianness": self.endianness,
                          "start": offset, "end": offset + len(raw), "shape": list(np.shape(vector))})
            parts.append(raw)
            offset += len(raw)
        headers = None if self.encoding_format == "bytes_only" else {"metadata": json.dumps({
            "id": request_id, "created": int(time.time()), "model": model, "data": items,
            "usage": {"prompt_tokens": num_tokens, "completion_tokens": 0, "total_tokens": num_tokens}})}
        return Response(b"".join(parts), media_type="application/octet-stream", headers=headers)


def to_bytes(vector: list[float] | list[list[float]], embed_dtype: str = "float32", endianness: str = "native"
             ) -> bytes:
    """``vector``'s values as ``embed_dtype`` elements in ``endianness`` order (rows one after
    another, for a 2-D output), as vLLM encodes them."""
    order = {"native": "=", "big": ">", "little": "<"}[endianness]
    if embed_dtype in ("float32", "float16"):  # (numpy holds them: no torch on the common path)
        return np.asarray(vector, dtype=order + ("f4" if embed_dtype == "float32" else "f2")).reshape(-1).tobytes()
    import torch

    values = torch.tensor(vector, dtype=torch.float32).flatten().to(getattr(torch, _EMBED_DTYPES[embed_dtype]))
    bits = values.view(torch.uint8 if values.element_size() == 1 else torch.int16).numpy()
    return bits.astype(bits.dtype.newbyteorder(order), copy=False).tobytes()


def encoded(vector: list[float] | list[list[float]], encoding_format: str, embed_dtype: str = "float32",
            endianness: str = "native") -> list[float] | list[list[float]] | str:
    """``vector`` as asked: the values, or their bytes (``to_bytes``) in base64."""
    if encoding_format != "base64":
        return vector
    return base64.b64encode(to_bytes(vector, embed_dtype, endianness)).decode()


class ActivationField(BaseModel):
    """vLLM's switch for a pooled answer's activation (``activation`` is its older name): a
    classifier's (or a cross-encoder's) function from logits to scores, an embedding's normalisation."""

    use_activation: bool | None = Field(None, description="Apply the model's activation (default): class logits "
                                                          "to probabilities, an embedding normalised; false: "
                                                          "the values as pooled.")
    activation: bool | None = Field(None, description="The older name of use_activation.")
    softmax: bool | None = Field(None, description="The oldest name of use_activation.")

    def wants_activation(self) -> bool | None:
        """What the request asks, by whichever name it uses (None: the model's default)."""
        return next((v for v in (self.use_activation, self.activation, self.softmax) if v is not None), None)

    def class_activation(self, model_activation: str) -> str:
        """The activation applied: the model's, or "none" when the request switches it off."""
        return "none" if self.wants_activation() is False else model_activation


class PooledInputRequest(IgnoredFieldsLogged):
    """What /v1/embeddings, /classify and /pooling share: the inputs pooled into one answer each (or
    one conversation, vLLM's chat form of these requests), and how they are tokenised and scheduled."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name (see GET /v1/models; by default the first).")
    input: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, description="Text, texts, token ids, or lists of token ids: one answer each (or give messages).")
    user: str | None = None
    # vLLM's extras.
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="One conversation instead of input, written by the model's chat template "
                                        "(which adds the special tokens): one answer.")
    add_generation_prompt: bool = Field(False, description="With messages: end with the assistant's turn opening.")
    continue_final_message: bool = Field(False, description="With messages: leave the last message open.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="With messages: the template's extras.")
    chat_template: str | None = Field(None, description="With messages: the request's own template (needs "
                                                        "--trust-request-chat-template).")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="Truncate each input to k tokens "
                                                                         "(-1: max_model_len).")
    truncation_side: TruncationSide = Field("right", description=TRUNCATION_SIDE_HELP)
    add_special_tokens: bool | None = Field(None, description="Let the tokenizer add its special tokens to text "
                                                              "(default: true for input, false for messages).")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = cache_salt_field()
    request_id: str | None = request_id_field()

    @model_validator(mode="after")
    def _not_empty(self) -> PooledInputRequest:
        if (self.input is None) == (self.messages is None):
            raise invalid("input", "give exactly one of input or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot both "
                          "be true")
        if self.input is not None and (self.input == [] or any(
                item in ("", []) for item in (self.input if isinstance(self.input, list) else [self.input]))):
            raise invalid("input", "input must not be empty, nor hold an empty text or token list")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The inputs given as ``input`` (none for a conversation)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(item, int) for item in self.input):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


class EmbeddingFields(ActivationField):
    """How a request's embeddings are shaped (/v1/embeddings, and /pooling's embedding rows)."""

    dimensions: int | None = Field(None, ge=1, description="Keep the first values only (Matryoshka models; "
                                                           "each row's).")
    normalize: bool | None = Field(None, description="L2-normalise (default: the model's pooler config, "
                                                     "true unless its sentence-transformers files omit Normalize); "
                                                     "vLLM's use_activation says the same.")

    def wants_normalized(self) -> bool | None:
        """normalize, or vLLM's use_activation (an embedding's activation is its normalisation)."""
        return self.wants_activation() if self.normalize is None else self.normalize


class EmbeddingRequest(PooledInputRequest, EncodingFields, EmbeddingFields):
    pass


def check_embeds(serving: OpenAIServing, per_token: bool = False) -> None:
    """400 unless the model answers embeddings: not a classifier, pooled as its checkpoint
    declares, and one embedding per input unless ``per_token`` (/pooling reads every token's)."""
    settings = serving.settings
    if settings.pooling.labels and settings.pooling.per_token:
        raise bad_request(f"{settings.served_model_name} classifies every token (a token classifier or reward "
                          "model): /pooling answers each token's classes, not embeddings", "model")
    if settings.pooling.labels:
        raise bad_request(f"{settings.served_model_name} is a sequence classifier: it answers /classify (and "
                          "/score for a cross-encoder), not embeddings", "model")
    if settings.pooling.per_token and not per_token:
        raise bad_request(f"{settings.served_model_name} pools every token ({settings.pooling.pooling_type} "
                          "pooling): /pooling answers each token's embedding", "model")
    if settings.pooling.unavailable:
        raise bad_request(f"{settings.served_model_name} does not serve embeddings: {settings.pooling.unavailable}",
                          "model")


def embedding_params(serving: OpenAIServing, normalize: bool | None = None, dimensions: int | None = None,
                     pooling: PoolingInfo | None = None) -> SamplingParams:
    """An embedding request's parameters: pooled as the model pools (or as ``pooling``, a /pooling
    task's), normalised as asked (None: as its pooler config says), its first ``dimensions`` values."""
    pooling = pooling or serving.settings.pooling
    return SamplingParams(max_tokens=1, temperature=0.0, embed=True,
                          embed_normalize=pooling.normalize if normalize is None else normalize,
                          embed_dimensions=dimensions, **pooling.params_fields())


def check_dimensions(serving: OpenAIServing, dimensions: int | None, param: str = "dimensions",
                     pooling: PoolingInfo | None = None) -> None:
    """400 naming ``param`` unless ``dimensions`` (when given) is a length the model's embeddings
    (``pooling``'s rows, for a /pooling task) may be cut to."""
    settings = serving.settings
    problem = (pooling or settings.pooling).dimensions_problem(dimensions, settings.served_model_name,
                                                               settings.hidden_size)
    if problem:
        raise bad_request(problem, param)


class EmbeddingsServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def admit(self, request: Any, dimensions: int | None, dimensions_param: str = "dimensions") -> Any:
        """What every embeddings endpoint checks first (400s and 404s): the model or adapter named
        (returned: its LoRARequest, or None), the priority, that the model embeds, the dimensions."""
        serving = self.serving
        lora = await serving.resolve_model(request.model)
        serving.check_priority(request.priority)
        check_embeds(serving)
        check_dimensions(serving, dimensions, dimensions_param)
        return lora

    async def create(self, request: EmbeddingRequest, session_id: str | None = None,
                     external_id: str | None = None) -> dict[str, Any] | Response:
        serving = self.serving
        lora = await self.admit(request, request.dimensions)
        prompts = await self.request_prompts(request)
        params = embedding_params(serving, request.wants_normalized(), request.dimensions)
        request_id, engine_base = answer_ids("embd", external_id)
        vectors = await serving.embed(engine_base, prompts, params, request.priority, lora, session_id,
                                      request.cache_salt)
        num_tokens = sum(len(ids) for ids in prompts)
        if request.binary:
            return request.binary_response(request_id, serving.model_name(request.model), vectors, num_tokens)
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": serving.model_name(request.model),
                "data": [{"object": "embedding", "index": i, "embedding": request.encode(v)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "completion_tokens": 0, "total_tokens": num_tokens}}

    async def request_prompts(self, request: PooledInputRequest) -> list[list[int]]:
        """The token ids pooled for each of the request's inputs, or for its one conversation (its
        chat template's text, truncated as the request asks); long texts are tokenized off the event
        loop (``tokenizer_work``)."""
        chars = (conversation_chars(request.messages) if request.messages is not None
                 else sum(len(item) for item in request.inputs() if isinstance(item, str)))
        return await self.serving.tokenizer_work(chars, self._request_prompts, request)

    def _request_prompts(self, request: PooledInputRequest) -> list[list[int]]:
        if request.messages is None:
            return [self.prompt_ids(item, request) for item in request.inputs()]
        ids = self.serving.render_messages(request.messages, request.add_generation_prompt,
                                           request.continue_final_message, request.chat_template_kwargs,
                                           add_special_tokens=bool(request.add_special_tokens),
                                           chat_template=request.chat_template)
        return [self.prompt_ids(ids, request, "messages")]

    def prompt_ids(self, item: str | list[int], request: Any, param: str = "input") -> list[int]:
        """The token ids embedded for one input: ``request`` carries ``truncate_prompt_tokens``,
        ``truncation_side`` and ``add_special_tokens``; ``param`` is the request field a refusal
        names. A text is truncated by its tokenizer, which keeps its special tokens (an encoder's
        [CLS] and [SEP]) around the tokens kept; token ids keep their first (or last) k."""
        serving = self.serving
        max_length = serving.truncation_length(request)
        if isinstance(item, str):
            item = serving.pooled_text(item)
            ids = list(tokenize_truncated(serving.tokenizer, item, None, request.add_special_tokens is not False,
                                          max_length, request.truncation_side)["input_ids"])
        else:
            vocab = len(serving.tokenizer)
            if any(t < 0 or t >= vocab for t in item):
                raise bad_request(f"input token ids must be in [0, {vocab})", param)
            ids = list(item)
            if max_length is not None:
                ids = ids[:max_length] if request.truncation_side == "right" else ids[-max_length:]
        if not ids:  # (an empty text, with nothing the tokenizer adds around it)
            raise bad_request(f"an input is empty: its text gives no tokens to pool ({param})", param)
        max_model_len = serving.settings.max_model_len
        if len(ids) > max_model_len:
            raise bad_request(f"This model's maximum context length is {max_model_len} tokens; an input has "
                              f"{len(ids)}: shorten it, or set truncate_prompt_tokens", param)
        return ids


def tokenize_truncated(tokenizer: Any, text: str, text_pair: str | None, add_special_tokens: bool,
                       max_length: int | None, side: TruncationSide = "right") -> Any:
    """The tokenizer's encoding of a text (or pair), at most ``max_length`` tokens: truncated by the
    tokenizer on ``side`` ("right" keeps the start; a pair loses tokens from its longer text first),
    so that its special tokens stay where they belong. 400 when they alone are longer."""
    if max_length is None:
        return tokenizer(text, text_pair=text_pair, add_special_tokens=add_special_tokens)
    saved = tokenizer.truncation_side
    # (The router tokenizes on its event loop, one call at a time: the side is restored before any other.)
    tokenizer.truncation_side = side
    try:
        encoding = tokenizer(text, text_pair=text_pair, add_special_tokens=add_special_tokens, truncation=True,
                             max_length=max_length)
    finally:
        tokenizer.truncation_side = saved
    if len(encoding["input_ids"]) > max_length:
        raise bad_request(f"truncate_prompt_tokens ({max_length}) leaves no room for the input: the tokenizer's "
                          "special tokens alone are longer", "truncate_prompt_tokens")
    return encoding


