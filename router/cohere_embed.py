"""Cohere's ``POST /v2/embed`` (as vLLM serves it): the same embeddings as /v1/embeddings, in Cohere's
request and response shapes, so clients written for Cohere's API (``cohere.ClientV2.embed``) work.

* ``texts`` (or ``inputs`` of text content parts), each embedded once;
* ``truncate``: ``END`` (the default) keeps each text's first tokens, ``START`` its last, ``NONE``
  refuses a text longer than the model's context; ``max_tokens`` caps each text's tokens;
* ``output_dimension``: the first values only (Matryoshka models);
* ``embedding_types``: ``float``, ``base64`` (little-endian float32), ``binary`` / ``ubinary`` (one
  bit per value, set where it is >= 0, eight to a byte, signed or not) — each asked type in the
  answer's ``embeddings``.
* ``input_type``: where the model's sentence-transformers config names prompts (prefixes by input
  kind), the one for the type goes before each text: ``search_query`` takes a prompt named
  ``search_query`` or ``query``, ``search_document`` one named ``search_document``, ``document`` or
  ``passage``, ``classification`` and ``clustering`` their own names. A model without prompts, or
  without one for the type, embeds the text as it is.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from router.embeddings import EmbeddingsServing, embedding_params
from router.protocol import INT64_MAX, INT64_MIN, invalid
from router.serving import OpenAIServing, bad_request

COHERE_EMBED_PATH = "/v2/embed"
EmbeddingType = Literal["float", "base64", "binary", "ubinary"]


class CohereContent(BaseModel):
    type: Literal["text"]
    text: str


class CohereInput(BaseModel):
    content: list[CohereContent] = Field(..., min_length=1)


class CohereEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name (default: the first).")
    texts: list[str] | None = Field(None, min_length=1)
    inputs: list[CohereInput] | None = Field(None, min_length=1, description="Text content parts, joined by "
                                                                            "newlines per input.")
    input_type: str | None = Field(None, description="Picks the model's prompt for the kind of input (see the "
                                                     "module's docstring).")
    embedding_types: list[EmbeddingType] = Field(["float"], min_length=1)
    output_dimension: int | None = Field(None, ge=1)
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = Field(None, ge=1, description="Each text's tokens at most.")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)

    @model_validator(mode="after")
    def _one_kind(self) -> CohereEmbedRequest:
        if (self.texts is None) == (self.inputs is None):
            raise invalid("texts", "give exactly one of texts or inputs")
        if any(text == "" for text in self.all_texts()):
            raise invalid("texts", "texts must not hold an empty text")
        return self

    def all_texts(self) -> list[str]:
        if self.texts is not None:
            return list(self.texts)
        return ["\n".join(part.text for part in item.content) for item in self.inputs or ()]



# The sentence-transformers prompt names each Cohere input type may go by, first found first.
_PROMPT_NAMES = {"search_query": ("search_query", "query"),
                 "search_document": ("search_document", "document", "passage"),
                 "classification": ("classification",), "clustering": ("clustering",)}


def input_type_prompt(prompts: tuple[tuple[str, str], ...], input_type: str | None) -> str:
    """The prefix a model's prompts give texts of this Cohere input type ("" for none)."""
    named = dict(prompts)
    for name in _PROMPT_NAMES.get(input_type or "", (input_type,) if input_type else ()):
        if name in named:
            return named[name]
    return ""


@dataclass(frozen=True)
class _Tokenising:
    """What EmbeddingsServing.prompt_ids reads to tokenise and truncate each text."""

    truncate_prompt_tokens: int | None
    truncation_side: str
    add_special_tokens: bool = True


def packed_bits(vectors: np.ndarray, signed: bool) -> list[list[int]]:
    """Cohere's binary embeddings: a bit per value (1 where it is >= 0), the first value in the
    highest bit, eight to a byte; ``signed`` bytes are shifted down by 128 (int8)."""
    if vectors.shape[1] % 8:
        raise bad_request(f"binary embeddings need a dimension that is a multiple of 8, got {vectors.shape[1]}",
                          "embedding_types")
    packed = np.packbits(vectors >= 0, axis=1).astype(np.int16)
    return (packed - 128 if signed else packed).tolist()


class CohereEmbedServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.embeddings = EmbeddingsServing(serving)

    async def create(self, request: CohereEmbedRequest, session_id: str | None = None) -> dict[str, Any]:
        serving = self.serving
        lora = await self.embeddings.admit(request, request.output_dimension, "output_dimension")
        size = request.output_dimension or serving.settings.hidden_size
        if size and size % 8 and {"binary", "ubinary"} & set(request.embedding_types):
            raise bad_request(f"binary embeddings need a dimension that is a multiple of 8, got {size}",
                              "embedding_types")
        prefix = input_type_prompt(serving.settings.pooling.prompts, request.input_type)
        texts = request.all_texts()
        # (The prompt counts in the text's tokens: under truncate START a long text may lose it.)
        prompted = [prefix + text for text in texts]
        # END keeps a text's first tokens, START its last, both at most max_tokens (and the context);
        # NONE refuses a text longer than either.
        limit = min(request.max_tokens or serving.settings.max_model_len, serving.settings.max_model_len)
        tokenising = _Tokenising(None if request.truncate == "NONE" else limit,
                                 "left" if request.truncate == "START" else "right")
        prompts = [self.embeddings.prompt_ids(text, tokenising, "texts") for text in prompted]
        if request.max_tokens is not None and any(len(ids) > request.max_tokens for ids in prompts):
            raise bad_request(f"a text is longer than max_tokens ({request.max_tokens}) and truncate is NONE",
                              "max_tokens")
        params = embedding_params(serving, dimensions=request.output_dimension)
        request_id = f"embd-{uuid.uuid4().hex}"
        vectors = await serving.embed(request_id, prompts, params, request.priority, lora, session_id)
        matrix = np.asarray(vectors, dtype=np.float32)
        by_type: dict[str, Any] = {}
        for kind in dict.fromkeys(request.embedding_types):
            if kind == "float":
                by_type[kind] = vectors
            elif kind == "base64":
                by_type[kind] = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in matrix]
            else:
                by_type[kind] = packed_bits(matrix, signed=kind == "binary")
        return {"id": request_id, "embeddings": by_type, "texts": texts, "response_type": "embeddings_by_type",
                "meta": {"api_version": {"version": "2"},
                         "billed_units": {"input_tokens": sum(len(p) for p in prompts)}}}
