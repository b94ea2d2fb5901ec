"""The FastAPI application: routes, error bodies, SSE. Hosted by the Serve deployment or by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_core.outputs import LoRARequest
from engine_core.sched.scheduler import PAUSE_MODES
from engine_core.sleep_mode import SLEEP_LEVELS, check_sleep, wake_up_tags
from router.classification import CLASSIFY_PATHS, ClassificationRequest, ClassificationServing, classifier_params
from router.cohere_embed import COHERE_EMBED_PATH, CohereEmbedRequest, CohereEmbedServing
from router.detached import runs_to_completion
from router.embeddings import EmbeddingRequest, EmbeddingsServing, check_embeds
from router.invocations import INVOCATIONS_PATH, InvocationType, invoke
from router.messages import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    CountTokensRequest,
    MessagesRequest,
    MessagesServing,
    anthropic_error_body,
)
from router.metrics import RouterMetrics, merge_expositions
from router.model_servings import ModelServings, count_under
from router.paths import ENGINE_PATHS, route_path
from router.pooling import POOLING_PATHS, PoolingRequest, PoolingServing, check_pools
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    tool_dicts,
)
from router.request_timeline import RequestTimeline, current_timeline
from router.response_store import UNFINISHED, Stopped
from router.responses import ResponsesRequest, ResponsesServing
from router.scoring import SCORING_PATHS, RerankRequest, ScoreRequest, ScoringServing, check_scores
from router.server_load import ServerLoad, ServerLoadTracker
from router.serving import (
    APIError,
    OpenAIServing,
    bad_request,
    conversation_chars,
    stream_error_event,
    validation_problem,
)
from router.tokenizer_info import describe_tokenizer

SESSION_HEADER = "x-session-id"
# A request's own id (a gateway's trace id; Ray Serve sets one on every request that lacks it): the
# id completions and chat answers carry, as vLLM takes it.
REQUEST_ID_HEADER = "x-request-id"


# An error message longer than this is cut: many repeat what the request gave (a model's name, a
# schema's keyword, a template's error), and an answer must not grow with a hostile request.
MAX_ERROR_MESSAGE_CHARS = 2000


def _error_response(status: int, message: str, type_: str, param: str | None, path: str = "",
                    code: int | str | None = None) -> JSONResponse:
    """OpenAI's error body (``code``: by default the status); on Anthropic's Messages paths, Anthropic's."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "… (cut)"
    if path.startswith(MESSAGES_PATH):
        return JSONResponse(status_code=status, content=anthropic_error_body(status, message))
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_,
                                                                "param": param, "code": code or status}})


class ResponseCounter:
    """Counts responses by path and status as plain ASGI: it only looks at ``http.response.start``.
    (Starlette's ``@app.middleware("http")`` would copy every SSE chunk through an extra stream and
    task, which costs latency on every streamed token.) Paths outside ``endpoints`` count as
    ``other``: a scanner probing random URLs must not create a series per URL. It also starts each
    request's timeline (router.request_timeline) and records it once the answer is done."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, endpoints: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path not in self.endpoints:
            path = "other"
        started = False
        timeline = RequestTimeline(time.perf_counter())
        current_timeline.set(timeline)

        def endpoint() -> str:
            # The route's template where one matched ("/v1/responses/{response_id}": one series for
            # every id), as vLLM's instrumentator labels its handlers.
            template = getattr(scope.get("route"), "path", None)
            return template if isinstance(template, str) else path

        method = scope.get("method", "GET")

        async def send_counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                (timeline.metrics or self.metrics).record_response(endpoint(), message["status"], method)
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            if not started:  # the outer error middleware answers 500
                (timeline.metrics or self.metrics).record_response(endpoint(), 500, method)
            raise
        finally:
            metrics = timeline.metrics or self.metrics
            metrics.record_timeline(timeline)
            metrics.record_response_end(endpoint(), method, time.perf_counter() - timeline.arrived)


# The operators' endpoints (--server-dev-mode): with --api-key they need a key too, unlike vLLM's.
DEV_MODE_PATHS = frozenset({"/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/sleep", "/wake_up",
                            "/is_sleeping"})


class APIKeyAuth:
    """``--api-key``: requests to ``/v1/...`` (and the dev-mode endpoints) need ``Authorization:
    Bearer <key>`` (one of the keys), else 401 with an OpenAI error body; so do the pooling paths and
    /invocations, which vLLM leaves open. The other endpoints (health, ping, load, metrics, version,
    tokenize, tokenizer_info) stay open, and CORS preflights pass, as in vLLM. Plain ASGI: nothing
    per streamed chunk."""

    def __init__(self, app: ASGIApp, api_keys: Collection[str]) -> None:
        self.app = app
        # Digests are compared, in constant time and against every key: the timing says nothing
        # about a key, not even its length.
        self.expected = [_digest(key.encode()) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # (the lifespan scope has no path)
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if scope["method"] != "OPTIONS" and _needs_key(path):
            # The key comes as "Authorization: Bearer <key>" (the scheme in any case, as HTTP has it
            # and vLLM reads it) or as Anthropic's clients send it, "x-api-key: <key>"; either counts.
            given = [_digest(key) for key in _offered_keys(scope["headers"])] or [_digest(b"")]
            if not any([hmac.compare_digest(offered, expected) for offered in given for expected in self.expected]):
                response = _error_response(401, "Incorrect or missing API key (Authorization: Bearer <key>, or "
                                           "x-api-key: <key>).", "AuthenticationError", None, path)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def external_id(body: Any, request: Request) -> str | None:
    """The id the caller gave its request: the body's request_id, else the X-Request-Id header. (vLLM
    prefers the header, but behind Ray Serve every request has one, which Serve makes up when the
    client sent none: the body's would never count.)"""
    return getattr(body, "request_id", None) or request.headers.get(REQUEST_ID_HEADER)


def _offered_keys(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    keys = []
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                keys.append(token.strip())
        elif name == b"x-api-key":
            keys.append(value)
    return keys


def _needs_key(path: str) -> bool:
    return path.startswith(("/v1", "/v2")) or path in DEV_MODE_PATHS or path in ENGINE_PATHS


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def create_app(serving: OpenAIServing | list[OpenAIServing],
               render_metrics: Callable[[], Awaitable[bytes]] | None = None, response_store: Any = None) -> FastAPI:
    """``serving``: the served model's, or one per served model (the first is the default, and the
    one whose server-wide settings the app takes: API keys, the operators' endpoints; each model
    keeps its own adapters). ``render_metrics``: an async callable
    producing the whole /metrics exposition (every replica's and every engine's series); without
    it, /metrics shows this process's router series only. ``response_store``
    (router.response_store): the Responses API keeps responses there."""
    servings = ModelServings(serving if isinstance(serving, list) else [serving])
    serving = servings.default
    # What generates background responses (set below): a replica that stops (a redeploy, a downscale;
    # Serve runs the app's lifespan shutdown) ends them as failed, rather than leaving them in
    # progress in the shared store.
    background_owners: list[ResponsesServing] = []
    server_load = ServerLoad()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.gather(*(owner.shut_down() for owner in background_owners))

    docs = {} if not serving.settings.disable_fastapi_docs else {"docs_url": None, "redoc_url": None,
                                                                  "openapi_url": None}
    app = FastAPI(title="llm-cluster", version=serving.settings.version, lifespan=lifespan, **docs)
    metrics = serving.metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.type, exc.param, route_path(request.scope), exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        named = servings.named(exc.body.get("model")) if isinstance(exc.body, dict) else None
        if named is not None:  # (refused before its handler ran: counted under the model it named)
            count_under(named)
        message, param = validation_problem(exc.errors())
        return _error_response(400, message, "BadRequestError", param, route_path(request.scope))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404
                               else "HTTPError", None, route_path(request.scope))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # (vLLM answers these with its JSON error body too; Starlette logs the traceback)
        return _error_response(500, str(exc) or type(exc).__name__, "InternalServerError", None,
                               route_path(request.scope))

    def respond(result: Any) -> Response:
        """An answer as its response: an event stream, a response as it is (vLLM's binary
        embeddings), or JSON (of a model or of plain data)."""
        if hasattr(result, "__aiter__"):
            return EventStreamResponse(result)
        if isinstance(result, Response):
            return result
        return JSONResponse(result.model_dump(mode="json") if hasattr(result, "model_dump") else result)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        chosen = await servings.for_model(body.model)
        return respond(await chosen.completions(body, request.headers.get(SESSION_HEADER), external_id(body, request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        chosen = await servings.for_model(body.model)
        return respond(await chosen.chat(body, request.headers.get(SESSION_HEADER), external_id(body, request)))

    # One store for every model: a stored response is found whichever model answered it.
    responses_of = {id(s): ResponsesServing(s, response_store) for s in servings}
    responses = responses_of[id(serving)]
    background_owners.extend(responses_of.values())

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        chosen = responses_of[id(await servings.for_model(body.model))]
        return respond(await chosen.create(body, request.headers.get(SESSION_HEADER)))

    def model_endpoint(serving_class: type, body_type: type,
                       method: str = "create") -> Callable[..., Awaitable[Response]]:
        """An endpoint answered by ``method`` of the chosen model's ``serving_class`` (one per served
        model), its body parsed as ``body_type``: JSON, or an event stream."""
        serving_of = {id(s): serving_class(s) for s in servings}
        named = "request_id" in body_type.model_fields  # (the answer takes the request's id)

        async def endpoint(body: Any, request: Request) -> Response:
            chosen = serving_of[id(await servings.for_model(body.model))]
            ids = {"external_id": external_id(body, request)} if named else {}
            return respond(await getattr(chosen, method)(body, request.headers.get(SESSION_HEADER), **ids))

        endpoint.__annotations__["body"] = body_type  # (what FastAPI validates the body as)
        return endpoint

    embeddings = model_endpoint(EmbeddingsServing, EmbeddingRequest)
    score, rerank = (model_endpoint(ScoringServing, ScoreRequest, "score"),
                     model_endpoint(ScoringServing, RerankRequest, "rerank"))
    classify, pool = (model_endpoint(ClassificationServing, ClassificationRequest),
                      model_endpoint(PoolingServing, PoolingRequest))
    app.post("/v1/embeddings")(embeddings)
    app.post(MESSAGES_PATH)(model_endpoint(MessagesServing, MessagesRequest))
    app.post(COUNT_TOKENS_PATH)(model_endpoint(MessagesServing, CountTokensRequest, "count_tokens"))
    app.post(COHERE_EMBED_PATH)(model_endpoint(CohereEmbedServing, CohereEmbedRequest))
    for path in SCORING_PATHS:
        app.post(path)(rerank if path.endswith("rerank") else score)
    for path in CLASSIFY_PATHS:
        app.post(path)(classify)
    for path in POOLING_PATHS:
        app.post(path)(pool)

    # SageMaker's one path for all of them, tried in vLLM's order.
    invocation_types = (
        InvocationType(ChatCompletionRequest, OpenAIServing.check_generates, chat_completions),
        InvocationType(CompletionRequest, OpenAIServing.check_generates, completions),
        InvocationType(EmbeddingRequest, check_embeds, embeddings),
        InvocationType(ClassificationRequest, classifier_params, classify),
        InvocationType(ScoreRequest, check_scores, score),
        InvocationType(RerankRequest, check_scores, rerank),
        InvocationType(PoolingRequest, check_pools, pool),
    )

    @app.post(INVOCATIONS_PATH)
    async def invocations(request: Request) -> Response:
        return await invoke(invocation_types, servings, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False,
                                starting_after: int | None = Query(None, ge=0)) -> Response:
        if stream:  # (a streamed background response's events, again or still coming)
            return EventStreamResponse(await responses.follow(response_id, starting_after))
        return JSONResponse(await responses.retrieve(response_id))

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, after: str | None = None, before: str | None = None,
                                   limit: int = Query(20, ge=1, le=100),
                                   order: Literal["asc", "desc"] = "desc") -> Response:
        return JSONResponse(await responses.input_items(response_id, after, before, limit, order))

    async def drop_background(stopped: Stopped) -> None:
        """The engines of a stopped background response's model drop its request."""
        try:
            owners = [responses_of[id(await servings.for_model(stopped.response["model"]))]]
        except APIError:  # (an adapter unloaded since: ask every model's engines)
            owners = list(responses_of.values())
        for owner in owners:
            await owner.drop_background(stopped)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        @runs_to_completion  # (both, even if this client leaves)
        async def delete_and_drop() -> None:
            deleted = await responses.delete(response_id)
            if deleted.response.get("status") in UNFINISHED:  # (a background one: nobody will read it)
                await drop_background(deleted)

        await delete_and_drop()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        @runs_to_completion  # (both, even if this client leaves)
        async def cancel_and_drop() -> dict[str, Any]:
            cancelled = await responses.cancel(response_id)
            await drop_background(cancelled)
            return cancelled.response

        return JSONResponse(await cancel_and_drop())

    def model_card(owner: OpenAIServing, lora: LoRARequest | None = None, name: str | None = None) -> ModelCard:
        """A model's card (``name``: one of its aliases), or an adapter's."""
        base = owner.settings.served_model_name
        if lora is None:
            return ModelCard(id=name or base, root=owner.settings.model_root or base,
                             max_model_len=owner.settings.max_model_len)
        # As vLLM lists an adapter: its root is where it was loaded from, its parent the base model.
        return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=base,
                         max_model_len=owner.settings.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = []
        for owner in servings:
            await owner.refresh_loras()
            cards += [*(model_card(owner, name=name) for name in owner.settings.served_names),
                      *(model_card(owner, lora) for lora in owner.lora_adapters.values())]
        return ModelList(data=cards)

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:  # the openai client's models.retrieve()
        owner = await servings.for_model(model)
        return model_card(owner, await owner.resolve_model(model), model)

    @app.get("/health")
    async def health() -> Response:
        """200 while any engine is healthy (each model's own count in ``models``)."""
        # (A round of probes that ended within the last second answers: see refresh_health.)
        counts = {owner.settings.served_model_name: await owner.client.refresh_health(max_age_s=1.0)
                  for owner in servings}
        healthy = [ok for flags in counts.values() for ok in flags]
        content: dict[str, Any] = {"healthy_engines": sum(healthy), "engines": len(healthy)}
        if len(counts) > 1:
            content["models"] = {name: {"healthy_engines": sum(flags), "engines": len(flags)}
                                 for name, flags in counts.items()}
        return JSONResponse(status_code=200 if any(healthy) else 503, content=content)

    app.get("/ping")(health)  # (SageMaker's health check, as vLLM answers it)
    app.post("/ping")(health)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": serving.settings.version}

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's: the requests this replica is answering (0 without --enable-server-load-tracking)."""
        return {"server_load": server_load.count}

    if serving.settings.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info(model: str | None = None) -> dict[str, Any]:
            owner = await servings.for_model(model)
            await owner.resolve_model(model)
            return describe_tokenizer(owner.tokenizer)

    if servings.runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            await servings.load_lora_adapter(body.lora_name, body.lora_path, body.base_model_name,
                                            body.load_inplace)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            await servings.unload_lora_adapter(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    if serving.settings.server_dev_mode:
        @app.post("/pause")
        async def pause(mode: str = Query("abort"), wait_for_inflight_requests: bool = Query(False),
                        clear_cache: bool = Query(True)) -> dict[str, Any]:
            """vLLM's pause for weight updates, on every engine of every model: nothing new is admitted
            until /resume; in-flight requests are aborted ("abort"), finished first ("wait": returns
            once they are) or frozen ("keep"); clear_cache empties the prefix caches after."""
            if wait_for_inflight_requests:  # (vLLM's older spelling of mode=wait)
                mode = "wait"
            if mode not in PAUSE_MODES:
                raise bad_request(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode")
            cleared = await asyncio.gather(*(owner.pause_generation(mode, clear_cache) for owner in servings))
            content: dict[str, Any] = {"status": "paused"}
            if clear_cache and mode != "keep":  # (an engine refuses while a request still holds blocks)
                content["cache_cleared"] = all(flag for flags in cleared for flag in flags)
            return content

        @app.post("/resume")
        async def resume() -> dict[str, str]:
            # (Checked first, so that a refused resume changes no engine; an engine put to sleep
            # in between stays paused, and says so.)
            if any([flag for owner in servings for flag in await owner.sleeping_engines()]) or not all(
                    flag for flags in await asyncio.gather(*(owner.resume_generation() for owner in servings))
                    for flag in flags):
                raise APIError(409, "sleeping engines stay paused until POST /wake_up", "ConflictError")
            return {"status": "resumed"}

        def sleep_capable_servings() -> list[OpenAIServing]:
            """Every model, once each one's engines were all started with --enable-sleep-mode."""
            refused = [owner.settings.served_model_name for owner in servings if not owner.settings.enable_sleep_mode]
            if refused:
                raise bad_request(f"the engines of {refused} were not started with --enable-sleep-mode", None)
            return list(servings)

        @app.post("/sleep")
        async def sleep(level: int = Query(1), mode: str = Query("abort")) -> dict[str, Any]:
            """vLLM's sleep mode, on every engine of every model: requests in flight are aborted (or,
            mode=wait, finished first), the prefix caches emptied, the KV caches released, and the
            weights moved to host memory (level 1) or discarded (level 2). Requests sent meanwhile
            wait for /wake_up."""
            try:
                check_sleep(level, mode)
            except ValueError as e:
                raise bad_request(str(e), "level" if level not in SLEEP_LEVELS else "mode") from None
            await asyncio.gather(*(owner.sleep(level, mode) for owner in sleep_capable_servings()))
            return {"status": "sleeping", "level": level}

        @app.post("/wake_up")
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
            """Restore what ``tags`` name (weights, kv_cache; none: both); generation resumes once
            nothing sleeps."""
            try:
                wake_up_tags(tags)
            except ValueError as e:
                raise bad_request(str(e), "tags") from None
            asleep = await asyncio.gather(*(owner.wake_up(tags) for owner in sleep_capable_servings()))
            return {"is_sleeping": any(flag for flags in asleep for flag in flags)}

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, Any]:
            flags = [flag for owner in servings for flag in await owner.sleeping_engines()]
            return {"is_sleeping": any(flags), "sleeping_engines": sum(flags), "engines": len(flags)}

        @app.get("/is_paused")
        async def is_paused() -> dict[str, Any]:
            """Paused while any engine is; the counts say how many are."""
            flags = [flag for owner in servings for flag in await owner.paused_engines()]
            return {"is_paused": any(flags), "paused_engines": sum(flags), "engines": len(flags)}

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict[str, str]:
            refused = {}
            for owner in servings:
                engines = [engine for engine, reset in enumerate(await owner.reset_prefix_cache()) if not reset]
                if engines:
                    refused[owner.settings.served_model_name] = engines
            if refused:
                which = "; ".join(f"{name!r} engines {engines}" for name, engines in refused.items())
                raise APIError(409, f"{which} hold KV blocks of running requests: a prefix cache is emptied only "
                                    "while idle (POST /pause first, or retry)", "ConflictError")
            return {"status": "reset"}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        owner = await servings.for_model(body.model)
        await owner.resolve_model(body.model)  # (adapters share the base model's tokenizer)
        # (Long texts off the event loop: this path needs no key, and every stream of the replica waits.)
        if body.messages is not None:
            tokens = await owner.tokenizer_work(
                conversation_chars(body.messages, body.tools), owner.render_messages, body.messages,
                body.add_generation_prompt,
                body.continue_final_message, body.chat_template_kwargs, tool_dicts(body.tools) or None,
                add_special_tokens=bool(body.add_special_tokens), chat_template=body.chat_template, with_images=True)
            # (Images: their placeholders, as chat sends them; the images are loaded only where their
            # sizes set their counts; videos are loaded, their frames setting theirs.)
            tokens, _ = await owner.prompt_media(owner.chat_images(body.messages), owner.chat_videos(body.messages),
                                                 tokens, count_only=True)
        else:
            add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await owner.tokenizer_work(len(body.prompt), owner.tokenize_prompt, body.prompt,
                                                add_special_tokens=add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=owner.settings.max_model_len,
                                token_strs=owner.tokenizer.convert_ids_to_tokens(tokens)
                                if body.return_token_strs else None)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        owner = await servings.for_model(body.model)
        await owner.resolve_model(body.model)
        owner.tokenize_prompt(body.tokens, param="tokens")  # validates the id range
        return DetokenizeResponse(prompt=owner.tokenizer.decode(body.tokens))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if render_metrics is not None:
            text = await render_metrics()
        else:
            text = merge_expositions(s.metrics.render() for s in servings if s.metrics is not None)
        return Response(content=text, media_type="text/plain; version=0.0.4; charset=utf-8")

    if serving.settings.enable_server_load_tracking:
        app.add_middleware(ServerLoadTracker, load=server_load, paths=ENGINE_PATHS)
    if serving.settings.api_keys:  # (inside the response counter, which counts its 401s)
        app.add_middleware(APIKeyAuth, api_keys=serving.settings.api_keys)
    if metrics is not None:
        app.add_middleware(ResponseCounter, metrics=metrics,
                           endpoints={route.path for route in app.routes if hasattr(route, "path")})
    # Outermost (vLLM's is inside its key check): preflights are answered here, and the app's answers,
    # its 401s too, carry the CORS headers a browser on another origin needs to read them.
    cors = serving.settings.cors
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allow_origins), allow_methods=list(cors.allow_methods),
                       allow_headers=list(cors.allow_headers), allow_credentials=cors.allow_credentials)
    return app


STREAM_END = b"data: [DONE]\n\n"


class EventStreamResponse(Response):
    """SSE from an async iterable with ``aclose()``, which is always called, even when the client
    left before the body started (the engine request behind it must be aborted either way).

    Streams on the request's own task. A small watcher task awaits ``http.disconnect`` and cancels
    the stream, whatever it is waiting on (an engine queue, a slow send), so the engine request is
    aborted within a step. (Starlette's StreamingResponse runs an anyio task group with two tasks
    per response for the same purpose.) Errors after the response started cannot change the status:
    they go out as an SSE error event. A chunk ending in OpenAI's ``data: [DONE]`` is the last one:
    it is sent with the end of the chunked body (one socket write fewer per stream).
    """

    media_type = "text/event-stream"

    def __init__(self, source: Any) -> None:
        self._source = source
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.current_task()
        assert streamer is not None
        gone = False

        async def watch_disconnect() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            streamer.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        timeline = current_timeline.get()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in self._source:
                    body = chunk if isinstance(chunk, bytes) else chunk.encode()
                    if body.endswith(STREAM_END):
                        break  # OpenAI's end of stream goes out with the end of the body: one write
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    if timeline is not None and not timeline.first_chunk:
                        timeline.first_chunk = time.perf_counter()
                else:
                    body = b""
            except (asyncio.CancelledError, OSError):
                raise
            except Exception as e:
                body = getattr(self._source, "error_event", stream_error_event)(e).encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})
            if body and timeline is not None and not timeline.first_chunk:  # (a stream of one chunk)
                timeline.first_chunk = time.perf_counter()
        except asyncio.CancelledError:
            # Our own cancel (the client left) ends the response quietly; any other cancel goes on.
            if not gone or streamer.uncancel() > 0:
                raise
        except OSError:
            pass  # the client left while we were sending (ASGI 2.4 servers raise on send)
        finally:
            watcher.cancel()
            await self._source.aclose()
