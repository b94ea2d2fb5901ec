"""vLLM's ``POST /pooling`` (and ``/v1/pooling``): each input's pooled output, whatever kind of
pooling model serves it, as that model's own endpoint computes it: a sequence classifier's class
probabilities (as /classify), a token classifier's class probabilities for every prompt token
(one row per token: NER), an embedding model's embedding (as /v1/embeddings, pooled and
normalised as its pooler config says). Under ALL or STEP pooling every input answers one row per
kept token: each token's reward (an outcome reward model), each step separator's two class
probabilities (a process reward model), each token's embedding. Reward models read chat
conversations: ``messages`` instead of ``input``."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal

from pydantic import Field
from starlette.responses import Response

from router.classification import classifier_params, pooled_output
from router.embeddings import (
    EmbeddingFields,
    EmbeddingsServing,
    EncodingFields,
    PooledInputRequest,
    check_dimensions,
    check_embeds,
    embedding_params,
)
from router.serving import OpenAIServing, answer_ids, bad_request

POOLING_PATHS = ("/pooling", "/v1/pooling")


class PoolingRequest(PooledInputRequest, EmbeddingFields, EncodingFields):
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = Field(
        None, description="vLLM's pooling task: one row per input (embed, classify) or per token (token_embed, "
                          "token_classify); default: as the model pools.")


def check_pools(serving: OpenAIServing) -> None:
    """400 unless the model answers /pooling as it pools: a classifier's classes, or embeddings the
    model can serve (one a token allowed)."""
    if not serving.settings.pooling.labels:
        check_embeds(serving, per_token=True)


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.embeddings = EmbeddingsServing(serving)

    async def create(self, request: PoolingRequest, session_id: str | None = None,
                     external_id: str | None = None) -> dict[str, Any] | Response:
        serving = self.serving
        lora = await serving.resolve_model(request.model)
        serving.check_priority(request.priority)
        try:
            pooling = serving.settings.pooling.for_task(request.task)
        except ValueError as e:
            raise bad_request(f"{serving.settings.served_model_name}: {e}", "task") from None
        if pooling.classifies:
            for name in ("dimensions", "normalize"):
                if getattr(request, name) is not None:
                    raise bad_request(f"{name} applies to embeddings; {serving.settings.served_model_name} "
                                      f"answers {request.task or 'classes'} here", name)
            params = (classifier_params(serving, per_token=True, pooling=pooling) if pooling.labels
                      else embedding_params(serving, False, None, pooling))
        else:
            check_embeds(serving, per_token=True)
            check_dimensions(serving, request.dimensions, pooling=pooling)
            params = embedding_params(serving, request.wants_normalized(), request.dimensions, pooling)
        prompts = await self.embeddings.request_prompts(request)
        request_id, engine_base = answer_ids("pool", external_id)
        outputs: list[Any] = await serving.embed(engine_base, prompts, params, request.priority, lora, session_id,
                                                 request.cache_salt)
        activation = request.class_activation(pooling.classifier_activation)
        if request.dimensions is not None:  # (each embedding row cut to it)
            pooling = replace(pooling, row_size=min(pooling.row_size, request.dimensions))
        outputs = [pooled_output(row, pooling, activation) for row in outputs]
        num_tokens = sum(len(ids) for ids in prompts)
        if request.binary:
            return request.binary_response(request_id, serving.model_name(request.model), outputs, num_tokens)
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": serving.model_name(request.model),
                "data": [{"index": i, "object": "pooling", "data": request.encode(row)}
                         for i, row in enumerate(outputs)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
