"""``llm-cluster run-batch``: a file of OpenAI batch requests run through the engines, as vLLM's
``run-batch`` (``python -m vllm.entrypoints.openai.run_batch``) does.

Each input line is one request in OpenAI's batch input format, ``{"custom_id", "method": "POST",
"url": "/v1/chat/completions", "body": {...}}``; each output line, in the input's order, OpenAI's
batch output format, ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}``. The requests go to the router's own FastAPI app, built in this process over the
engines (no HTTP server: httpx's ASGI transport), so a batch line is answered exactly as the same
request over HTTP would be, errors included (``error`` then holds the OpenAI error body, as
vLLM's does). Lines are read and answered as a stream: up to ``max_in_flight`` requests at a time,
each result written as soon as those before it are (memory follows how far ahead answers come,
not the file's length: one slow line holds the results after it). A line that is not a request
(not JSON, a method other than POST, an endpoint a batch cannot use, ``stream: true``) gets an
error line of its own; the others run.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

logger = logging.getLogger(__name__)

# The endpoints a batch line may name (POST, not streamed): OpenAI's batch endpoints, and vLLM's
# scoring and pooling ones.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/score",
                   "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/pooling", "/classify")

UPLOAD_ATTEMPTS = 5
UPLOAD_RETRY_DELAY_S = 5.0
# An input URL that sends nothing for this long has failed.
READ_TIMEOUT_S = 300.0


@dataclass
class BatchSummary:
    requests: int = 0
    succeeded: int = 0
    failed: int = 0


def is_url(path_or_url: str) -> bool:
    return path_or_url.startswith(("http://", "https://"))


def read_lines(path_or_url: str) -> Iterator[str]:
    """The input's non-blank lines, read as they are needed (a URL is read with GET)."""
    if is_url(path_or_url):
        with urllib.request.urlopen(path_or_url, timeout=READ_TIMEOUT_S) as response:
            for raw in response:
                if line := raw.decode("utf-8").strip():
                    yield line
    else:
        with open(path_or_url, encoding="utf-8") as f:
            for raw in f:
                if line := raw.strip():
                    yield line


def upload(url: str, path: str, attempts: int = UPLOAD_ATTEMPTS, delay_s: float = UPLOAD_RETRY_DELAY_S) -> None:
    """PUT the file at ``path`` to ``url`` (a presigned object-store URL, say), tried again on a
    failure that may pass (not on a 4xx: an expired or wrong URL stays so). OSError if it fails."""
    for attempt in range(1, attempts + 1):
        try:
            with open(path, "rb") as f:
                request = urllib.request.Request(url, data=f, method="PUT",
                                                 headers={"Content-Length": str(os.path.getsize(path)),
                                                          "Content-Type": "application/jsonl"})
                with urllib.request.urlopen(request, timeout=1000) as response:
                    if response.status not in (200, 201, 204):
                        raise OSError(f"status {response.status}")
            return
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500:
                raise OSError(f"uploading the results to {url} was refused: {e}") from e
            if attempt == attempts:
                raise OSError(f"uploading the results to {url} failed {attempts} times: {e}") from e
            logger.warning("uploading the results failed (attempt %d of %d): %s; again in %.0f s", attempt,
                           attempts, e, delay_s)
            time.sleep(delay_s)


def _output(custom_id: Any, status: int, body: Any = None, error: Any = None) -> dict[str, Any]:
    return {"id": f"batch-{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": body},
            "error": error}


def _refusal(line: str) -> tuple[Any, str] | None:
    """Why a line cannot be run (with its custom_id, if it has one), or None when it can."""
    try:
        entry = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None, "the line is not JSON"
    if not isinstance(entry, dict):
        return None, "the line is not a JSON object"
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str):
        return custom_id, "custom_id must be a string"
    if entry.get("method") != "POST":
        return custom_id, f"method must be POST, got {entry.get('method')!r}"
    if entry.get("url") not in BATCH_ENDPOINTS:
        return custom_id, f"URL {entry.get('url')!r} is not one a batch can use ({', '.join(BATCH_ENDPOINTS)})"
    if not isinstance(entry.get("body"), dict):
        return custom_id, "body must be a JSON object"
    if entry["body"].get("stream"):
        return custom_id, "a batch request must not be streamed (stream: true)"
    return None


class OrderedWriter:
    """Writes results in the input's order as they come in, holding only those ahead of a gap."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._next = 0
        self._held: dict[int, dict[str, Any]] = {}

    def add(self, index: int, result: dict[str, Any]) -> None:
        self._held[index] = result
        while self._next in self._held:
            self._out.write(json.dumps(self._held.pop(self._next), ensure_ascii=False) + "\n")
            self._next += 1


async def _lines(path_or_url: str) -> AsyncIterator[str]:
    """``read_lines`` without blocking the event loop (each read on a thread)."""
    lines = read_lines(path_or_url)
    done = object()
    while (line := await asyncio.to_thread(next, lines, done)) is not done:
        yield line  # type: ignore[misc]


async def run_batch(app: Any, input_file: str, out: IO[str], max_in_flight: int,
                    headers: dict[str, str] | None = None,
                    progress: Callable[[BatchSummary], None] | None = None) -> BatchSummary:
    """Answer every request of ``input_file`` through ``app`` (the router's ASGI app), writing each
    result line to ``out`` in the input's order."""
    import httpx

    summary = BatchSummary()
    writer = OrderedWriter(out)
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task[None]] = set()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", headers=headers,
                                 timeout=None) as client:

        async def answer(index: int, entry: dict[str, Any]) -> None:
            try:
                response = await client.post(entry["url"], json=entry["body"])
                try:
                    body = response.json()
                except ValueError:
                    body = {"error": {"message": response.text, "type": "InternalServerError", "param": None,
                                      "code": response.status_code}}
                if response.status_code == 200:
                    result = _output(entry["custom_id"], 200, body)
                else:
                    result = _output(entry["custom_id"], response.status_code, error=body)
            except Exception as e:  # (the app answers errors itself: this is ours, or a transport's)
                logger.exception("batch request %r failed", entry["custom_id"])
                result = _output(entry["custom_id"], 500, error=str(e))
            finally:
                slots.release()
            if result["error"] is None:
                summary.succeeded += 1
            else:
                summary.failed += 1
            writer.add(index, result)
            if progress is not None:
                progress(summary)

        failures: list[BaseException] = []

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:  # (writing a result failed)
                failures.append(task.exception())  # type: ignore[arg-type]

        index = 0
        try:
            async for line in _lines(input_file):
                if failures:
                    raise failures[0]
                refusal = _refusal(line)
                summary.requests += 1
                if refusal is not None:
                    custom_id, message = refusal
                    summary.failed += 1
                    writer.add(index, _output(custom_id, 400, error=message))
                else:
                    await slots.acquire()
                    task = asyncio.create_task(answer(index, json.loads(line)))
                    tasks.add(task)
                    task.add_done_callback(done)
                index += 1
            while tasks:
                await asyncio.gather(*list(tasks))
            if failures:
                raise failures[0]
        finally:  # (the input failed, or a result could not be written: nothing goes on behind it)
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*list(tasks), return_exceptions=True)
    return summary


def _output_dir(path_or_url: str, tmp_dir: str | None) -> str:
    """Where the results are written until the batch is done: beside the output file, or for a URL
    in ``tmp_dir`` (the system's temporary directory by default)."""
    if is_url(path_or_url):
        return tmp_dir or tempfile.gettempdir()
    return os.path.dirname(os.path.abspath(path_or_url))


def check_output(path_or_url: str, tmp_dir: str | None = None) -> None:
    """OSError now (before any engine starts) if the results could not be written there."""
    directory = _output_dir(path_or_url, tmp_dir)
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise OSError(f"{directory}: not a directory this process can write to")


@contextlib.contextmanager
def output_file(path_or_url: str, tmp_dir: str | None = None) -> Iterator[IO[str]]:
    """Where the results are written: a temporary file, which becomes the output file once the batch
    is done (the input may be the same file, and a failed run leaves no partial output there), or
    for a URL is uploaded then (and removed; kept, and its path said, if the upload fails)."""
    url = is_url(path_or_url)
    fd, path = tempfile.mkstemp(prefix="batch-output-", suffix=".jsonl", dir=_output_dir(path_or_url, tmp_dir))
    done = False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        if url:
            logger.info("uploading the results to %s", path_or_url)
            try:
                upload(path_or_url, path)
            except OSError as e:
                done = True  # (the results stay where they are)
                raise OSError(f"{e}; the results are kept in {path}") from e
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(path, 0o666 & ~umask)  # (as a file opened for writing would be, not mkstemp's 0600)
            os.replace(path, path_or_url)
        done = True
        if url:
            os.unlink(path)
    finally:
        if not done:
            with contextlib.suppress(OSError):
                os.unlink(path)


async def run_batch_on_engines(config: Any, input_file: str, output: str, tmp_dir: str | None = None,
                               progress: Callable[[BatchSummary], None] | None = None,
                               metrics_at: tuple[str, int] | None = None) -> BatchSummary:
    """The batch through the router app of ``config`` (a ClusterConfig whose engines are running):
    built here, over every served model's engines. ``metrics_at`` (host, port): the router's and
    the engines' Prometheus metrics are served there while the batch runs (vLLM's --enable-metrics)."""
    from cluster.app import router_deployment
    from router.app import create_app
    from router.deployment import build_serving, engine_metrics_texts
    from router.metrics import merge_expositions

    first, *more = router_deployment(config)._bound_deployment.init_args
    built = []
    metrics_server = None
    try:
        for router_config in [first, *(more[0] if more else [])]:
            built.append(await build_serving(router_config))
        servings = [serving for serving, _ in built]
        for _, client in built:
            await client.wait_connected()

        async def render_metrics() -> bytes:
            own = [serving.metrics.render() for serving in servings if serving.metrics is not None]
            engines = [text for _, client in built for text in await engine_metrics_texts(client)]
            return merge_expositions([*own, *engines])

        app = create_app(servings, render_metrics=render_metrics)
        if metrics_at is not None:
            metrics_server = await serve_metrics(render_metrics, *metrics_at)
        # As vLLM's run-batch: twice what the engines run at once, so their queues never run dry.
        max_in_flight = 2 * sum(engine.scheduler.max_num_seqs for engine in config.engine_configs())
        keys = list(config.api_keys)
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else None
        with output_file(output, tmp_dir) as out:
            return await run_batch(app, input_file, out, max_in_flight, headers, progress)
    finally:
        if metrics_server is not None:
            server, task = metrics_server
            server.should_exit = True
            await task
        for _, client in built:
            await client.close()


async def serve_metrics(render: Callable[[], Awaitable[bytes]], host: str, port: int) -> tuple[Any, asyncio.Task]:
    """A server of GET /metrics only (``render``'s exposition), running on this event loop until
    its ``should_exit`` is set; OSError when the address cannot be listened on."""
    import uvicorn
    from fastapi import FastAPI, Response

    metrics_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @metrics_app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=await render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # (Bound here: a port in use is an OSError for the caller, where uvicorn would exit the process.)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.create_server((host, port), family=family)
    server = uvicorn.Server(uvicorn.Config(metrics_app, log_level="warning", lifespan="off", access_log=False))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()
    return server, task
