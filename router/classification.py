"""vLLM's ``POST /classify`` (and ``/v1/classify``) for sequence classifiers
(``*ForSequenceClassification`` checkpoints: classifiers, reward models, cross-encoder rerankers).

Each input runs through the engines as an embedding request; a classifier's engine answers with the
class logits of the input's last token (its ``score`` head over the final hidden state), and they
are turned into probabilities here by the checkpoint's problem_type: softmax over the classes
(single-label), a sigmoid per class (multi-label, and a one-output model without a problem_type),
or the logits as they are (regression).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from engine_core.executor import PoolingInfo
from engine_core.sampling_params import SamplingParams
from router.embeddings import ActivationField, EmbeddingsServing, PooledInputRequest, embedding_params
from router.serving import OpenAIServing, answer_ids, bad_request

CLASSIFY_PATHS = ("/classify", "/v1/classify")


class ClassificationRequest(PooledInputRequest, ActivationField):
    """vLLM's classify request: ``input`` (or ``messages``) and the shared fields (router.embeddings)."""


def class_probabilities(logits: list[float], activation: str = "softmax") -> list[float]:
    """The classes' scores from their logits (in float64): ``activation`` "softmax", "sigmoid" (per
    class), "tanh" or "relu" (a cross-encoder's or a head's), or "none" (the logits). A softmax over
    one value would always be 1: one value takes a sigmoid, as vLLM counts the columns (a STEP
    model's returned_token_ids keeping one)."""
    values = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("the model produced a non-finite class logit")
    if activation == "softmax" and values.size == 1:
        activation = "sigmoid"
    if activation == "none":
        return values.tolist()
    if activation == "relu":
        return np.maximum(values, 0.0).tolist()
    if activation == "tanh":
        return np.tanh(values).tolist()
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-values))).tolist()
    exp = np.exp(values - values.max())
    return (exp / exp.sum()).tolist()


def token_rows(flat: list[float], row_size: int) -> list[list[float]]:
    """A per-token pooled output (ALL / STEP pooling) as its rows: it arrives flattened, ``row_size``
    values per kept token."""
    return [flat[i: i + row_size] for i in range(0, len(flat), row_size)]


def token_class_probabilities(flat_logits: list[float], row_size: int, activation: str) -> list[list[float]]:
    """A token classifier's answer: each kept token's class scores (its logits arrive flattened,
    ``row_size`` values per token)."""
    return [class_probabilities(row, activation) for row in token_rows(flat_logits, row_size)]


def pooled_output(values: list[float], pooling: PoolingInfo, activation: str) -> list[float] | list[list[float]]:
    """One input's answer from the values its engine pooled (as /pooling and LLM.encode give it): an
    embedding as it is; a classifier's class scores by ``activation``; under ALL / STEP pooling a row
    per kept token, each scored so; a head's single value a token (BGE-M3's lexical weights) as one
    flat list, as vLLM squeezes it."""
    if not pooling.per_token:
        return class_probabilities(values, activation) if pooling.classifies else values
    if not pooling.classifies:
        return token_rows(values, pooling.row_size)
    rows = token_class_probabilities(values, pooling.row_size, activation)
    return [row[0] for row in rows] if pooling.task == "token_classify" else rows


def classifier_params(serving: OpenAIServing, per_token: bool = False,
                      pooling: PoolingInfo | None = None) -> SamplingParams:
    """What a classifier's engine is asked: the class logits of the pooled prompt (``per_token``: of
    each token, which only /pooling answers), unnormalised, pooled as the model pools (or as
    ``pooling``, a /pooling task's). Refused (400) for a model without a classification head, or of
    the other kind."""
    pooling = pooling or serving.settings.pooling
    if not pooling.labels:
        raise bad_request(f"{serving.settings.served_model_name} is not a sequence classifier "
                          "(a *ForSequenceClassification checkpoint)", "model")
    if pooling.per_token and not per_token:
        raise bad_request(f"{serving.settings.served_model_name} classifies every token ({pooling.pooling_type} "
                          "pooling: a token classifier or reward model): /pooling answers each token's classes",
                          "model")
    return embedding_params(serving, normalize=False, pooling=pooling)


class ClassificationServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.embeddings = EmbeddingsServing(serving)

    async def create(self, request: ClassificationRequest, session_id: str | None = None,
                     external_id: str | None = None) -> dict[str, Any]:
        serving = self.serving
        lora = await serving.resolve_model(request.model)
        serving.check_priority(request.priority)
        params = classifier_params(serving)
        prompts = await self.embeddings.request_prompts(request)
        request_id, engine_base = answer_ids("classify", external_id)
        logits = await serving.embed(engine_base, prompts, params, request.priority, lora, session_id,
                                     request.cache_salt)
        labels = serving.settings.pooling.labels
        activation = request.class_activation(serving.settings.pooling.classifier_activation)
        data = []
        for i, row in enumerate(logits):
            probs = class_probabilities(row, activation)
            data.append({"index": i, "label": labels[int(np.argmax(probs))], "probs": probs,
                         "num_classes": len(probs)})
        num_tokens = sum(len(ids) for ids in prompts)
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": serving.model_name(request.model), "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
