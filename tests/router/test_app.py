"""The ASGI layers around the app: the response counter (statuses by path, streamed bodies passed
through untouched), the API-key check, and the SSE response's messages."""

from __future__ import annotations

import asyncio
import time

import openai
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from router.app import EventStreamResponse, ResponseCounter, create_app
from router.engine_client import EngineClient
from router.metrics import RouterMetrics
from router.paths import route_path
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings

from .tokenizer_factory import byte_level_tokenizer


def _counts(metrics: RouterMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "llm_cluster:router_http_responses_total":
                out[(sample.labels["endpoint"], sample.labels["status"])] = sample.value
    return out


def test_counts_statuses_and_passes_streams_through():
    async def ok(_):
        return PlainTextResponse("fine")

    async def missing(_):
        return PlainTextResponse("no", status_code=404)

    async def crash(_):
        raise RuntimeError("boom")

    async def stream(_):
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/ok", ok), Route("/missing", missing), Route("/crash", crash),
                            Route("/stream", stream)])
    metrics = RouterMetrics("m", "r0")
    app.add_middleware(ResponseCounter, metrics=metrics, endpoints={"/ok", "/missing", "/crash", "/stream"})
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/ok").text == "fine"
        assert client.get("/ok").status_code == 200
        assert client.get("/missing").status_code == 404
        assert client.get("/crash").status_code == 500
        assert client.get("/stream").text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
        for i in range(5):  # unknown paths share one series
            assert client.get(f"/probe-{i}").status_code == 404
    assert _counts(metrics) == {("/ok", "200"): 2.0, ("/missing", "404"): 1.0, ("/crash", "500"): 1.0,
                                ("/stream", "200"): 1.0, ("other", "404"): 5.0}


def test_a_route_with_path_parameters_counts_under_its_template():
    """/v1/responses/{response_id} is one series whatever the id (it counted as "other", which the
    dashboard's status panel leaves out), as vLLM's instrumentator labels handlers."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict:
        return {"id": response_id}

    metrics = RouterMetrics("m", "r0")
    app.add_middleware(ResponseCounter, metrics=metrics, endpoints={"/v1/models"})
    with TestClient(app) as client:
        for i in range(3):
            assert client.get(f"/v1/responses/resp_{i}").json() == {"id": f"resp_{i}"}
        assert client.get("/v1/nothing/here").status_code == 404
    assert _counts(metrics) == {("/v1/responses/{response_id}", "200"): 3.0, ("other", "404"): 1.0}


def test_vllms_http_series_group_statuses_and_time_whole_responses():
    """http_requests_total{status="2xx"} and http_request_duration_seconds, as vLLM's instrumentator
    exports them (its dashboards' error ratio reads them), without the operational paths."""
    from prometheus_client.parser import text_string_to_metric_families

    async def ok(_):
        return PlainTextResponse("fine")

    async def missing(_):
        return PlainTextResponse("no", status_code=404)

    async def stream(_):
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/ok", ok, methods=["GET", "POST"]), Route("/v1/missing", missing),
                            Route("/v1/stream", stream), Route("/health", ok)])
    metrics = RouterMetrics("m", "r0")
    app.add_middleware(ResponseCounter, metrics=metrics, endpoints={"/v1/ok", "/v1/missing", "/v1/stream", "/health"})
    with TestClient(app) as client:
        client.get("/v1/ok"), client.post("/v1/ok"), client.get("/v1/missing"), client.get("/v1/stream")
        client.get("/health")
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    requests = {(s.labels["handler"], s.labels["method"], s.labels["status"]): s.value for s in samples
                if s.name == "http_requests_total"}
    assert requests == {("/v1/ok", "GET", "2xx"): 1.0, ("/v1/ok", "POST", "2xx"): 1.0,
                        ("/v1/missing", "GET", "4xx"): 1.0, ("/v1/stream", "GET", "2xx"): 1.0}
    timed = {(s.labels["handler"], s.labels["method"]): s.value for s in samples
             if s.name == "http_request_duration_seconds_count"}
    assert timed == {("/v1/ok", "GET"): 1.0, ("/v1/ok", "POST"): 1.0, ("/v1/missing", "GET"): 1.0,
                     ("/v1/stream", "GET"): 1.0}


def test_api_keys_guard_the_v1_endpoints_only():
    """--api-key: /v1 needs a Bearer key (any of them); health, metrics and version stay open; the
    openai client's api_key is what it sends; refusals are counted."""
    metrics = RouterMetrics("tiny", "r0")
    client = EngineClient([object()], client_index=1)
    settings = ServingSettings(served_model_name="tiny", max_model_len=64, api_keys=("k-one", "k-two"))
    app = create_app(OpenAIServing(settings, client, byte_level_tokenizer(), RoundRobinPolicy(), metrics))
    with TestClient(app) as http:  # (with its lifespan, as Serve runs it)
        assert http.get("/v1/models").status_code == 401
    http = TestClient(app)
    refused = http.get("/v1/models", headers={"Authorization": "Bearer k-three"})
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert http.get("/v1/models", headers={"Authorization": "Bearer "}).status_code == 401
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 401
    for key in ("k-one", "k-two"):
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    # The scheme in any case (vLLM's reading), and either header: an x-api-key beside another
    # Authorization (a proxy's, say) still counts.
    assert http.get("/v1/models", headers={"Authorization": "bearer k-one"}).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "Basic abc", "x-api-key": "k-two"}).status_code == 200
    assert http.get("/v1/models", headers={"Authorization": "Token k-one"}).status_code == 401
    assert http.options("/v1/models").status_code != 401  # CORS preflights carry no key
    for open_path in ("/version", "/metrics"):
        assert http.get(open_path).status_code == 200
    assert _counts(metrics)[("/v1/models", "401")] == 4
    good = openai.OpenAI(base_url="http://testserver/v1", api_key="k-two", http_client=http, max_retries=0)
    assert [m.id for m in good.models.list()] == ["tiny"]
    assert good.models.retrieve("tiny").id == "tiny"
    try:
        good.models.retrieve("other")
    except openai.NotFoundError as e:
        assert e.body["param"] == "model"
    else:
        raise AssertionError("an unknown model was found")
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http, max_retries=0)
    try:
        bad.models.list()
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    else:
        raise AssertionError("a wrong key was accepted")
    # Without keys nothing is guarded.
    plain = ServingSettings(served_model_name="tiny", max_model_len=64)
    assert TestClient(create_app(OpenAIServing(plain, client, byte_level_tokenizer(), RoundRobinPolicy()))).get(
        "/v1/models").status_code == 200


class _EngineHandle:
    """Stands for an engine actor's handle: each method's ``.remote(...)`` is awaitable, as a Ray
    ObjectRef is, and records the call (the real engines are exercised in test_e2e)."""

    def __init__(self, resets: bool = True) -> None:
        self.calls: list[tuple] = []
        self.paused = False
        self.resets = resets
        self.asleep: set[str] = set()

    def __getattr__(self, method: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args):
                handle.calls.append((method, *args))

                async def result():
                    if method == "pause_generation":
                        handle.paused = True
                        return args[1] and args[0] != "keep"
                    elif method == "resume":
                        handle.paused = bool(handle.asleep)
                        return not handle.asleep
                    elif method == "sleep":
                        handle.paused, handle.asleep = True, {"weights", "kv_cache"}
                    elif method == "wake_up":
                        handle.asleep -= set(args[0] or ("weights", "kv_cache"))
                        handle.paused = bool(handle.asleep)
                        return bool(handle.asleep)
                    elif method == "is_sleeping":
                        return bool(handle.asleep)
                    elif method == "is_paused":
                        return handle.paused
                    elif method == "reset_prefix_cache":
                        return handle.resets
                    return None
                return result()
        return _Method


def test_dev_mode_endpoints_reach_every_engine_and_need_a_key():
    """--server-dev-mode: /pause, /resume, /is_paused, /reset_prefix_cache act on every engine, with
    vLLM's query parameters; a refused cache reset is a 409 naming the engine; with --api-key they need
    a key; without the flag they do not exist."""
    engines = [_EngineHandle(), _EngineHandle(resets=False)]
    settings = ServingSettings(served_model_name="tiny", max_model_len=64, api_keys=("key",), server_dev_mode=True)
    serving = OpenAIServing(settings, EngineClient(engines, client_index=0), byte_level_tokenizer(),
                            RoundRobinPolicy())
    http = TestClient(create_app(serving), headers={"Authorization": "Bearer key"})
    assert http.get("/is_paused").json() == {"is_paused": False, "paused_engines": 0, "engines": 2}
    assert http.post("/pause").json() == {"status": "paused", "cache_cleared": True}
    assert http.post("/pause?mode=keep&clear_cache=false").json() == {"status": "paused"}
    assert http.post("/pause?wait_for_inflight_requests=true").status_code == 200  # vLLM's older mode=wait
    assert [c for c in engines[1].calls if c[0] == "pause_generation"] == [
        ("pause_generation", "abort", True), ("pause_generation", "keep", False), ("pause_generation", "wait", True)]
    assert http.get("/is_paused").json() == {"is_paused": True, "paused_engines": 2, "engines": 2}
    bad = http.post("/pause?mode=later")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
    assert http.post("/resume").json() == {"status": "resumed"}
    assert not any(engine.paused for engine in engines)
    refused = http.post("/reset_prefix_cache")
    assert refused.status_code == 409 and "'tiny' engines [1]" in refused.json()["error"]["message"]
    engines[1].resets = True
    assert http.post("/reset_prefix_cache").json() == {"status": "reset"}
    anonymous = TestClient(create_app(serving))
    for method, path in (("post", "/pause"), ("post", "/resume"), ("get", "/is_paused"),
                         ("post", "/reset_prefix_cache")):
        assert getattr(anonymous, method)(path).status_code == 401
    off = ServingSettings(served_model_name="tiny", max_model_len=64)
    plain = TestClient(create_app(OpenAIServing(off, EngineClient(engines, client_index=0), byte_level_tokenizer(),
                                                RoundRobinPolicy())))
    assert plain.post("/pause").status_code == 404 and plain.get("/is_paused").status_code == 404


def test_sleep_endpoints_reach_every_engine_with_vllms_parameters():
    """--server-dev-mode with engines started with --enable-sleep-mode: /sleep (level, mode),
    /wake_up (tags, repeated), /is_sleeping on every engine; /resume cannot wake a sleeping engine
    (409); refused with a 400 unless every engine has sleep mode, or for a bad level, mode or tag."""
    engines = [_EngineHandle(), _EngineHandle()]

    def app(sleep_mode: bool) -> TestClient:
        settings = ServingSettings(served_model_name="tiny", max_model_len=64, server_dev_mode=True,
                                   enable_sleep_mode=sleep_mode)
        return TestClient(create_app(OpenAIServing(settings, EngineClient(engines, client_index=0),
                                                   byte_level_tokenizer(), RoundRobinPolicy())))

    http = app(True)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "sleeping_engines": 0, "engines": 2}
    assert http.post("/sleep?level=2&mode=wait").json() == {"status": "sleeping", "level": 2}
    assert [c for c in engines[0].calls if c[0] == "sleep"] == [("sleep", 2, "wait")]
    assert http.get("/is_sleeping").json() == {"is_sleeping": True, "sleeping_engines": 2, "engines": 2}
    refused = http.post("/resume")
    assert refused.status_code == 409 and "/wake_up" in refused.json()["error"]["message"]
    assert not [c for e in engines for c in e.calls if c[0] == "resume"]  # (checked before any engine resumed)
    assert http.post("/wake_up?tags=weights").json() == {"is_sleeping": True}
    assert engines[1].calls[-1] == ("wake_up", ["weights"])
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert engines[1].calls[-1] == ("wake_up", None) and not any(e.paused for e in engines)
    http.post("/sleep")
    assert engines[0].calls[-1] == ("sleep", 1, "abort")  # (vLLM's default level)
    assert http.post("/wake_up?tags=weights&tags=kv_cache").json() == {"is_sleeping": False}
    for path, param in (("/sleep?level=3", "level"), ("/sleep?mode=keep", "mode"), ("/wake_up?tags=all", "tags")):
        bad = http.post(path)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, path
    calls = len(engines[0].calls)
    assert app(False).post("/sleep").status_code == 400 and len(engines[0].calls) == calls


class _Source:
    """An SSE source that records whether it was closed."""

    def __init__(self, chunks: list[str], error: Exception | None = None) -> None:
        self.chunks, self.error, self.closed = chunks, error, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


def _sse_messages(source: _Source) -> list[tuple[bytes, bool]]:
    """(body, more_body) of each body message EventStreamResponse sends for ``source``."""
    sent = []

    async def run() -> None:
        pending = asyncio.Event()  # the client never leaves

        async def receive():
            await pending.wait()

        async def send(message):
            if message["type"] == "http.response.body":
                sent.append((message["body"], message["more_body"]))

        await EventStreamResponse(source)({"type": "http", "method": "POST"}, receive, send)

    asyncio.run(run())
    return sent


def test_sse_end_of_stream_goes_out_with_the_end_of_the_body():
    done = "data: [DONE]\n\n"
    source = _Source(["data: 1\n\n", "data: 2\n\n" + done, "data: never\n\n"])
    assert _sse_messages(source) == [(b"data: 1\n\n", True), (b"data: 2\n\n" + done.encode(), False)]
    assert source.closed
    # A stream without OpenAI's end marker (the Responses API's events) ends with an empty body.
    assert _sse_messages(_Source(["event: a\n\n"])) == [(b"event: a\n\n", True), (b"", False)]
    # An error after the start goes out as the last event, with the end of the body.
    sent = _sse_messages(_Source(["data: 1\n\n"], RuntimeError("engine gone")))
    assert sent[0] == (b"data: 1\n\n", True) and len(sent) == 2
    body, more = sent[1]
    assert not more and b"engine gone" in body and body.endswith(done.encode())


def _histogram(metrics: RouterMetrics, name: str) -> tuple[float, float]:
    """A histogram's (count, sum) over its series."""
    count = total = 0.0
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == f"{name}_count":
                count += sample.value
            elif sample.name == f"{name}_sum":
                total += sample.value
    return count, total


def test_the_replicas_own_time_is_recorded_per_request():
    """Inside the replica: arrival to the first engine request (every request that reaches an
    engine), the engine's first output to the first streamed bytes (streams only); a request
    refused before any engine records neither. Each is within the request's own wall time."""
    from .test_request_fields import _app

    metrics = RouterMetrics("tiny", "r0")
    http, engine = _app(metrics=metrics)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3}
    started = time.perf_counter()
    http.post("/v1/completions", json=body)
    assert http.post("/v1/completions", json={**body, "stream": True}).text.endswith("data: [DONE]\n\n")
    wall = time.perf_counter() - started
    assert http.post("/v1/completions", json={"model": "tiny"}).status_code == 400
    assert len(engine.requests) == 2
    to_engine = _histogram(metrics, "llm_cluster:router_time_to_engine_seconds")
    first_chunk = _histogram(metrics, "llm_cluster:router_first_chunk_delay_seconds")
    assert to_engine[0] == 2 and 0 < to_engine[1] < wall
    assert first_chunk[0] == 1 and 0 < first_chunk[1] < wall


def test_the_root_path_is_cut_only_at_a_segment_boundary():
    assert route_path({"path": "/p/v1/models", "root_path": "/p"}) == "/v1/models"
    assert route_path({"path": "/pause", "root_path": "/p"}) == "/pause"  # (not "ause": a dev path, guarded)
    assert route_path({"path": "/p", "root_path": "/p"}) == ""
    assert route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
