"""vLLM's scoring endpoints: ``POST /score`` (``/v1/score``) and ``POST /rerank`` (``/v1/rerank``,
``/v2/rerank``, the Jina/Cohere shape), for embedding (bi-encoder) and cross-encoder models.

* An embedding model: each distinct text is embedded once, as ``/v1/embeddings`` embeds it (on the
  serving's engines, all of a request's texts sent together), and a pair's score is the cosine
  similarity of its two embeddings.
* A cross-encoder (a sequence classifier with one output): each pair is tokenised together, as the
  tokenizer joins a text pair, and its score is the sigmoid of the classifier's logit.
That is how vLLM scores with each kind of model.

Pairing, as vLLM's: one first text against every second text (1 to N), or the i-th with the i-th
(N to N).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
from pydantic import ConfigDict, Field, model_validator

from engine_core.outputs import LoRARequest
from engine_core.sampling_params import SamplingParams
from router.classification import class_probabilities, classifier_params
from router.embeddings import (
    TRUNCATION_SIDE_HELP,
    ActivationField,
    EmbeddingsServing,
    TruncationSide,
    check_embeds,
    embedding_params,
    tokenize_truncated,
)
from router.protocol import INT64_MAX, INT64_MIN, IgnoredFieldsLogged, cache_salt_field, invalid, request_id_field
from router.serving import APIError, OpenAIServing, answer_ids, bad_request

# The paths these endpoints answer on (every one needs the API key when one is set, as /classify's do).
SCORING_PATHS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


class _ScoringFields(IgnoredFieldsLogged, ActivationField):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name (see GET /v1/models; by default the first).")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="Truncate each text (a cross-encoder's "
                                                                         "pair) to k tokens (-1: max_model_len).")
    truncation_side: TruncationSide = Field("right", description=TRUNCATION_SIDE_HELP)
    add_special_tokens: bool = Field(True, description="Let the tokenizer add its special tokens to text.")
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    cache_salt: str | None = cache_salt_field()
    request_id: str | None = request_id_field()


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """(first, second) index pairs, as vLLM pairs them: one first text against every second text,
    or the i-th with the i-th. ValueError otherwise."""
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first == num_second:
        return [(i, i) for i in range(num_second)]
    raise ValueError(f"the first side must hold one text, or as many as the second ({num_first} vs {num_second})")


def tokenize_pair(tokenizer: Any, first: str, second: str, add_special_tokens: bool = True,
                  max_length: int | None = None, side: TruncationSide = "right",
                  joined: bool = False) -> tuple[list[int], int | None]:
    """A cross-encoder's input: the pair's ids as the tokenizer joins them (at most ``max_length``,
    the tokenizer truncating the longer text on ``side``), and where its token types turn to 1
    (vLLM's compressed_token_type_ids: a BERT tokenizer marks the second text with type 1; None
    where the tokenizer gives no types, or all 0, as RoBERTa's and decoders' do). ``joined``: the two
    texts as one (an LLM reranker's, PoolingInfo.joins_pair_text)."""
    if joined:
        return list(tokenize_truncated(tokenizer, first + second, None, add_special_tokens, max_length,
                                       side)["input_ids"]), None
    encoding = tokenize_truncated(tokenizer, first, second, add_special_tokens, max_length, side)
    ids = list(encoding["input_ids"])
    types = list(encoding.get("token_type_ids") or ())
    if 1 not in types:
        return ids, None
    start = types.index(1)
    if any(t != 1 for t in types[start:]) or any(t != 0 for t in types[:start]):
        raise ValueError(f"token types of a text pair must be 0s then 1s, got {types}")
    return ids, start


def pair_params(params: SamplingParams, type_start: int | None, takes_token_types: bool) -> SamplingParams:
    """A cross-encoder pair's request parameters: with where its token type 1 starts, for a model
    that takes token types (a BERT); ``params`` itself otherwise."""
    if type_start is None or not takes_token_types:
        return params
    return dataclasses.replace(params, compressed_token_type_ids=type_start)


def cosine_scores(vectors: list[list[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's cosine similarity, computed in float64 and held to [-1, 1]; equal embeddings (a
    text against itself) score exactly 1, not 1 give or take a rounding error."""
    matrix = np.asarray(vectors, dtype=np.float64)
    if not np.isfinite(matrix).all():
        raise ValueError("the model produced a non-finite embedding")
    equal = [i == j or np.array_equal(matrix[i], matrix[j]) for i, j in pairs]
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    return [1.0 if same else min(1.0, max(-1.0, float(matrix[i] @ matrix[j])))
            for (i, j), same in zip(pairs, equal, strict=True)]


def maxsim_scores(token_vectors: list[list[float]], row_size: int, pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's late-interaction score (ColBERT's MaxSim): for every token vector of the first
    text, its largest dot product with the second's, summed. Each text's vectors arrive flattened,
    ``row_size`` values a token (normalised, so a dot product is a cosine)."""
    matrices = [np.asarray(flat, dtype=np.float64).reshape(-1, row_size) for flat in token_vectors]
    if not all(np.isfinite(m).all() for m in matrices):
        raise ValueError("the model produced a non-finite embedding")
    return [float((matrices[i] @ matrices[j].T).max(axis=1).sum()) if len(matrices[i]) and len(matrices[j])
            else 0.0 for i, j in pairs]


def _texts(value: str | list[str], param: str) -> list[str]:
    """A side's texts. An empty text is scored as vLLM scores it (a cross-encoder reads the pair's
    special tokens; an embedding of nothing is refused when it is tokenized): a RAG chunk list with
    an empty chunk is not refused whole."""
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise invalid(param, f"{param} must not be empty")
    return texts


class ScoreRequest(_ScoringFields):
    """The two sides to score, by any of vLLM's names for them: ``text_1``/``text_2``, ``data_1``/
    ``data_2``, or ``queries`` with ``documents`` (or ``items``)."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None

    def side_names(self) -> tuple[str, str]:
        """The names of the two sides the request gave (the first family of names it used)."""
        for first, second in (("text_1", "text_2"), ("data_1", "data_2")):
            if getattr(self, first) is not None or getattr(self, second) is not None:
                return first, second
        return "queries", "items" if self.items is not None else "documents"

    @model_validator(mode="after")
    def _one_pair_of_sides(self) -> ScoreRequest:
        names = self.side_names()
        given = [n for n in ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")
                 if getattr(self, n) is not None]
        if other := [n for n in given if n not in names]:
            raise invalid(names[0], f"give one pair of sides: {names[0]} and {names[1]}, without {', '.join(other)}")
        first, second = getattr(self, names[0]), getattr(self, names[1])
        if first is None or second is None:
            raise invalid(names[0] if first is None else names[1], f"{names[0]} and {names[1]} are both required")
        left, right = _texts(first, names[0]), _texts(second, names[1])
        try:
            score_pairs(len(left), len(right))
        except ValueError:
            raise invalid(names[1], f"{names[0]} must hold one text, or as many as {names[1]} "
                                    f"({len(left)} vs {len(right)})") from None
        return self

    def sides(self) -> tuple[list[str], list[str]]:
        first, second = self.side_names()
        return _texts(getattr(self, first), first), _texts(getattr(self, second), second)


class RerankRequest(_ScoringFields):
    query: str
    # Texts, or Cohere's {"text": ...} objects (one text alone too, as vLLM takes it).
    documents: str | list[str | dict[str, Any]]
    top_n: int = Field(0, description="Return the n best documents (0 or less: all, as vLLM reads it).")
    return_documents: bool | None = Field(True, description="Include each document's text in its result (null: "
                                                            "true); false leaves the document out, as Cohere.")

    @model_validator(mode="after")
    def _texts_present(self) -> RerankRequest:
        if isinstance(self.documents, str):
            self.documents = [self.documents]
        if not self.documents:
            raise invalid("documents", "documents must not be empty")
        for doc in self.documents:
            if isinstance(doc, dict) and not isinstance(doc.get("text"), str):
                raise invalid("documents", 'a document object must carry its text as {"text": "..."}')
        _texts(self.document_texts(), "documents")
        return self

    def document_texts(self) -> list[str]:
        return [doc if isinstance(doc, str) else doc["text"] for doc in self.documents]  # type: ignore[index]


def check_scores(serving: OpenAIServing) -> None:
    """400 unless the model scores text pairs: a cross-encoder with one output (a pair's score is its
    logit's), or an embedding model (the cosine similarity of the two embeddings; a ColBERT model's
    MaxSim of its per-token vectors)."""
    pooling = serving.settings.pooling
    if pooling.labels:
        classifier_params(serving)  # (refuses a token classifier)
        if len(pooling.labels) != 1:
            raise bad_request(f"scoring needs a cross-encoder with one output; {serving.settings.served_model_name} "
                              f"has {len(pooling.labels)} classes (use /classify)", "model")
    else:
        check_embeds(serving, per_token=pooling.late_interaction)


class ScoringServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.embeddings = EmbeddingsServing(serving)

    async def score(self, request: ScoreRequest, session_id: str | None = None,
                    external_id: str | None = None) -> dict[str, Any]:
        left, right = request.sides()
        pairs = score_pairs(len(left), len(right))
        request_id, engine_base = answer_ids("score", external_id)
        names = request.side_names()
        scores, num_tokens = await self._scores(engine_base, request, left, right, pairs, session_id, names)
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": self.serving.model_name(request.model),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": num_tokens, "completion_tokens": 0, "total_tokens": num_tokens}}

    async def rerank(self, request: RerankRequest, session_id: str | None = None,
                     external_id: str | None = None) -> dict[str, Any]:
        documents = request.document_texts()
        request_id, engine_base = answer_ids("rerank", external_id)
        scores, num_tokens = await self._scores(engine_base, request, [request.query], documents,
                                                [(0, i) for i in range(len(documents))], session_id,
                                                ("query", "documents"))
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])  # (stable: ties keep their order)
        if request.top_n > 0:
            ranked = ranked[: request.top_n]
        return {"id": request_id, "model": self.serving.model_name(request.model),
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": documents[i]}} if request.return_documents is not False else {})}
                            for i in ranked]}

    async def _scores(self, request_id: str, request: _ScoringFields, left: list[str], right: list[str],
                      pairs: list[tuple[int, int]], session_id: str | None, names: tuple[str, str]
                      ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens that ran: each distinct text once for an
        embedding model (vLLM counts each pair's two texts), each pair for a cross-encoder."""
        serving = self.serving
        lora = await serving.resolve_model(request.model)
        serving.check_priority(request.priority)
        check_scores(serving)
        pooling = serving.settings.pooling
        if pooling.labels:
            return await self._cross_encoded(request_id, request, left, right, pairs, session_id, names, lora)
        texts = list(dict.fromkeys(left + right))
        where = {text: i for i, text in enumerate(texts)}
        firsts = set(left)
        prompts = await serving.tokenizer_work(
            sum(len(text) for text in texts), lambda: [
                self.embeddings.prompt_ids(text, request, names[0] if text in firsts else names[1]) for text in texts])
        # (Cosine similarity normalises; MaxSim reads the vectors as the model gives them, as LLM.score.)
        params = embedding_params(serving, normalize=None if pooling.late_interaction else True)
        vectors = await serving.embed(request_id, prompts, params, request.priority, lora, session_id,
                                      request.cache_salt)
        indices = [(where[left[i]], where[right[j]]) for i, j in pairs]
        try:
            scores = (maxsim_scores(vectors, pooling.row_size, indices) if pooling.late_interaction
                      else cosine_scores(vectors, indices))
        except ValueError as e:
            raise APIError(500, str(e), "InternalServerError") from None
        return scores, sum(len(p) for p in prompts)

    async def _cross_encoded(self, request_id: str, request: _ScoringFields, left: list[str], right: list[str],
                             pairs: list[tuple[int, int]], session_id: str | None, names: tuple[str, str],
                             lora: LoRARequest | None) -> tuple[list[float], int]:
        """A cross-encoder's score of each pair: the sigmoid of its one logit over the pair (the logit
        itself where its sentence-transformers activation is Identity), tokenised as the tokenizer
        joins a text pair (truncate_prompt_tokens truncates the longer text on truncation_side)."""
        serving = self.serving
        params = classifier_params(serving)
        prompts, each = [], []

        def tokenize_pairs() -> None:
            for i, j in pairs:
                ids, type_start = tokenize_pair(serving.tokenizer, serving.pooled_text(left[i]),
                                                serving.pooled_text(right[j]), request.add_special_tokens,
                                                serving.truncation_length(request), request.truncation_side,
                                                serving.settings.pooling.joins_pair_text)
                prompts.append(self.embeddings.prompt_ids(ids, request, names[1]))
                each.append(pair_params(params, type_start, serving.settings.pooling.token_types))

        # (Long texts off the event loop, as every tokenization of a request.)
        await serving.tokenizer_work(sum(len(left[i]) + len(right[j]) for i, j in pairs), tokenize_pairs)
        logits = await serving.embed(request_id, prompts, each, request.priority, lora, session_id,
                                     request.cache_salt)
        try:
            # (use_activation false: a cross-encoder's raw logits, as vLLM gives them.)
            activation = request.class_activation(serving.settings.pooling.cross_encoder_activation)
            scores = [class_probabilities(row, activation)[0] for row in logits]
        except ValueError as e:
            raise APIError(500, str(e), "InternalServerError") from None
        return scores, sum(len(p) for p in prompts)
