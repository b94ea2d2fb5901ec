"""The router's side of the engine boundary.

One ``EngineClient`` per router replica. It is a client of every engine under its own
``client_index``, runs one output pump per engine (a ``get_output`` long-poll that fans outputs into
per-request asyncio queues) and tracks each engine's in-flight requests for the routing policies.
It never blocks the event loop: every actor call is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine_core.outputs import EngineCoreOutput, EngineCoreRequest
from engine_core.request import FinishReason

logger = logging.getLogger(__name__)

HandleResolver = Callable[[int], Any]


class EngineUnavailableError(RuntimeError):
    pass


class EngineOverloadedError(RuntimeError):
    pass


@dataclass
class _EngineSlot:
    index: int
    handle: Any
    healthy: bool = True
    in_flight: int = 0
    requests: set[str] = field(default_factory=set)
    last_error: str | None = None
    last_probe: float = 0.0


class EngineClient:
    def __init__(self, handles: list[Any], client_index: int, resolve_handle: HandleResolver | None = None,
                 poll_timeout_s: float = 1.0) -> None:
        self.client_index = client_index
        self._slots = [_EngineSlot(i, h) for i, h in enumerate(handles)]
        self._resolve_handle = resolve_handle
        self._poll_timeout_s = poll_timeout_s
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._closed = False
        self.on_engine_restart: Callable[[int], None] | None = None

    @property
    def num_engines(self) -> int:
        return len(self._slots)

    def loads(self) -> list[int]:
        return [s.in_flight for s in self._slots]

    def healthy(self) -> list[bool]:
        return [s.healthy for s in self._slots]

    def handle(self, engine: int) -> Any:
        return self._slots[engine].handle

    def start(self) -> None:
        if not self._pumps:
            self._pumps = [asyncio.create_task(self._pump(slot), name=f"engine-{slot.index}-pump")
                           for slot in self._slots]

    async def close(self) -> None:
        self._closed = True
        for task in self._pumps:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- requests ----------------------------------------------------------------------------------

    async def add_request(self, engine: int, request: EngineCoreRequest) -> asyncio.Queue[EngineCoreOutput]:
        slot = self._slots[engine]
        if not slot.healthy:
            raise EngineUnavailableError(f"engine {engine} is unavailable: {slot.last_error}")
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        slot.in_flight += 1
        slot.requests.add(request.request_id)
        try:
            await slot.handle.add_request.remote(request)
        except Exception as e:
            self._forget(slot, request.request_id)
            if isinstance(e, OverflowError) or "OverflowError" in type(e).__name__ or "queue is full" in str(e):
                raise EngineOverloadedError(str(e)) from e
            self._mark_unhealthy(slot, e)
            raise EngineUnavailableError(f"engine {engine} is unavailable: {e}") from e
        return queue

    async def stream(self, engine: int, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Add the request and yield its outputs until it finishes. Leaving early aborts it."""
        queue = await self.add_request(engine, request)
        slot = self._slots[engine]
        finished = False
        try:
            while True:
                output = await queue.get()
                if output.finish_reason is not None:
                    finished = True
                yield output
                if finished:
                    return
        finally:
            self._forget(slot, request.request_id)
            if not finished:
                # Client gone, timeout or stop string: the engine frees the request's blocks.
                await self.abort(engine, [request.request_id])

    async def abort(self, engine: int, request_ids: list[str]) -> None:
        slot = self._slots[engine]
        for rid in request_ids:
            self._forget(slot, rid)
        if slot.healthy:
            try:
                await asyncio.shield(slot.handle.abort_requests.remote(request_ids))
            except Exception as e:
                logger.warning("abort on engine %d failed: %s", engine, e)

    def _forget(self, slot: _EngineSlot, request_id: str) -> None:
        if request_id in slot.requests:
            slot.requests.discard(request_id)
            slot.in_flight -= 1
        self._queues.pop(request_id, None)

    # -- the output pump ------------------------------------------------------------------------------

    async def _pump(self, slot: _EngineSlot) -> None:
        while not self._closed:
            try:
                outputs = await slot.handle.get_output.remote(self.client_index, self._poll_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._mark_unhealthy(slot, e)
                await self._wait_for_engine(slot)
                continue
            for output in outputs.outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            if not slot.healthy and time.monotonic() - slot.last_probe > 0.5:
                # Reachable but reported unhealthy (e.g. its workers died): back once it says so.
                slot.last_probe = time.monotonic()
                with contextlib.suppress(Exception):
                    await slot.handle.check_health.remote()
                    self._set_healthy(slot)

    def _mark_unhealthy(self, slot: _EngineSlot, error: Exception) -> None:
        if slot.healthy:
            logger.error("engine %d unreachable: %s", slot.index, error)
        slot.healthy = False
        slot.last_error = f"{type(error).__name__}: {error}"
        # Requests in flight there will never finish: tell their waiters now rather than hang.
        for rid in list(slot.requests):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(EngineCoreOutput(rid, [], FinishReason.ERROR, slot.last_error))

    async def _wait_for_engine(self, slot: _EngineSlot) -> None:
        """Poll until the engine (possibly a restarted actor found by name) answers again."""
        delay = 0.2
        while not self._closed:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            handle = slot.handle
            if self._resolve_handle is not None:
                try:
                    handle = self._resolve_handle(slot.index)
                except Exception:
                    continue
            try:
                await handle.check_health.remote()
            except Exception:
                continue
            slot.handle = handle
            self._set_healthy(slot)
            return

    def _set_healthy(self, slot: _EngineSlot) -> None:
        slot.healthy = True
        slot.last_error = None
        if self.on_engine_restart is not None:
            self.on_engine_restart(slot.index)
        logger.info("engine %d is back", slot.index)

    async def refresh_health(self, timeout_s: float = 2.0) -> list[bool]:
        """Ask every engine; a failure marks it unhealthy (the pump brings it back)."""

        async def probe(slot: _EngineSlot) -> None:
            try:
                await asyncio.wait_for(slot.handle.check_health.remote(), timeout_s)
                if not slot.healthy:
                    self._set_healthy(slot)
            except Exception as e:
                self._mark_unhealthy(slot, e)

        await asyncio.gather(*(probe(s) for s in self._slots))
        return self.healthy()
