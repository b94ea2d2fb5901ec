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
import uuid
from typing import Any

import numpy as np

from engine_core.sampling_params import SamplingParams
from router.embeddings import EmbeddingsServing, PooledInputRequest, embedding_params
from router.serving import OpenAIServing, bad_request

CLASSIFY_PATHS = ("/classify", "/v1/classify")


class ClassificationRequest(PooledInputRequest):
    """vLLM's classify request: ``input`` and the shared fields (router.embeddings)."""


def class_probabilities(logits: list[float], activation: str = "softmax") -> list[float]:
    """The classes' scores from their logits (in float64): ``activation`` "softmax", "sigmoid" (per
    class) or "none" (the logits)."""
    values = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("the model produced a non-finite class logit")
    if activation == "none":
        return values.tolist()
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-values))).tolist()
    exp = np.exp(values - values.max())
    return (exp / exp.sum()).tolist()


def token_class_probabilities(flat_logits: list[float], num_labels: int, activation: str) -> list[list[float]]:
    """A token classifier's answer: each prompt token's class scores (its logits arrive flattened,
    ``num_labels`` values per token)."""
    return [class_probabilities(flat_logits[i: i + num_labels], activation)
            for i in range(0, len(flat_logits), num_labels)]


def classifier_params(serving: OpenAIServing, per_token: bool = False) -> SamplingParams:
    """What a classifier's engine is asked: the class logits of the pooled prompt (``per_token``: of
    each token, which only /pooling answers), unnormalised. Refused (400) for a model without a
    classification head, or of the other kind."""
    pooling = serving.settings.pooling
    if not pooling.labels:
        raise bad_request(f"{serving.settings.served_model_name} is not a sequence classifier "
                          "(a *ForSequenceClassification checkpoint)", "model")
    if pooling.per_token and not per_token:
        raise bad_request(f"{serving.settings.served_model_name} is a token classifier: /pooling answers each "
                          "token's classes", "model")
    return embedding_params(serving, normalize=False)


class ClassificationServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.embeddings = EmbeddingsServing(serving)

    async def create(self, request: ClassificationRequest, session_id: str | None = None) -> dict[str, Any]:
        serving = self.serving
        lora = await serving.resolve_model(request.model)
        serving.check_priority(request.priority)
        params = classifier_params(serving)
        prompts = [self.embeddings.prompt_ids(item, request) for item in request.inputs()]
        request_id = f"classify-{uuid.uuid4().hex}"
        logits = await serving.embed(request_id, prompts, params, request.priority, lora, session_id)
        labels = serving.settings.pooling.labels
        data = []
        for i, row in enumerate(logits):
            probs = class_probabilities(row, serving.settings.pooling.classifier_activation)
            data.append({"index": i, "label": labels[int(np.argmax(probs))], "probs": probs,
                         "num_classes": len(probs)})
        num_tokens = sum(len(ids) for ids in prompts)
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": serving.model_name(request.model), "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}
