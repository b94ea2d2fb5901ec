"""The ASGI response counter: statuses by path, streamed bodies passed through untouched."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from router.app import ResponseCounter
from router.metrics import RouterMetrics


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
