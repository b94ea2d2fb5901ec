"""SageMaker's ``POST /invocations`` (as vLLM serves it): one path for every task. The body is read as
the first request type, in vLLM's order, that the named model serves and that the body validates
as: chat, completion, embedding, classification, score, rerank, pooling. It is then answered by
that type's own endpoint, streamed or not as the body asks. A body without ``model`` is for the
first served model."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from router.model_servings import ModelServings
from router.serving import APIError, OpenAIServing, bad_request, validation_problem

INVOCATIONS_PATH = "/invocations"


@dataclass(frozen=True)
class InvocationType:
    body_type: type[BaseModel]
    # Raises an APIError when the model does not serve this kind of request (what it returns is unused).
    check_serves: Callable[[OpenAIServing], object]
    # The endpoint that answers it (the one its own path runs), given the validated body.
    endpoint: Callable[[Any, Request], Awaitable[Response]]


async def invoke(types: Sequence[InvocationType], servings: ModelServings, request: Request) -> Response:
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):  # (nested past Python's limit: not a request either)
        raise bad_request("The request body is not valid JSON.", None) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None)
    model = body.get("model")
    serving = await servings.for_model(model if isinstance(model, str) else None)
    if model is None:  # (a SageMaker endpoint serves one model: its clients need not name it)
        body["model"] = serving.settings.served_model_name
    problems = []
    for kind in types:
        name = kind.body_type.__name__
        try:
            kind.check_serves(serving)
        except APIError:
            continue
        try:
            parsed = kind.body_type.model_validate(body)
        except ValidationError as e:
            problems.append(f"{name} ({validation_problem(e.errors())[0]})")
            continue
        return await kind.endpoint(parsed, request)
    raise bad_request("The body is none of the requests this model serves: " + "; ".join(problems), None)
