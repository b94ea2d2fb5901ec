"""The router's side of the engine boundary.

One ``EngineClient`` per router replica. It is a client of every engine under its own
``client_index``: per engine one request channel (engine_core.channel: requests and aborts out,
pushed outputs in) and one reader task that fans outputs into per-request asyncio queues. It tracks
each engine's in-flight requests for the routing policies. Engines are found by actor name, so a
restarted engine is reconnected; the control plane (health) stays on awaited actor calls, so the
event loop never blocks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine_core.channel import (
    AbortRequests,
    Accepted,
    AddRequest,
    ChannelConnection,
    Draining,
    FrameTooLargeError,
    Outputs,
    Serving,
)
from engine_core.outputs import EngineCoreOutput, EngineCoreRequest
from engine_core.request import FinishReason
from router.detached import SharedRun, detached_task
from router.request_timeline import RequestTimeline, current_timeline

logger = logging.getLogger(__name__)

# Finds the engine actor of a slot by name (None: no engine runs there now).
HandleResolver = Callable[[int], Any]


class EngineUnavailableError(RuntimeError):
    pass


class EngineRefusedError(EngineUnavailableError):
    """The engine certainly did not admit the request (it was never sent, or the engine said no):
    it may go to another engine under the same id. (A channel that broke after the request went
    out leaves it unknown: the engine may run it and send its outputs on reconnecting.)"""


def _actor_died(error: BaseException) -> bool:
    """Whether Ray says the engine actor is dead (not merely slow or restarting): its channel cannot
    carry anything more, even when the socket still looks open (a host that vanished sends no FIN)."""
    try:
        from ray.exceptions import ActorDiedError
    except ImportError:
        return False
    return isinstance(error, ActorDiedError)


class UnknownModelError(LookupError):
    """The engine does not hold the LoRA adapter the request names."""


class RequestRefusedByEngineError(ValueError):
    """The engine cannot serve what the request asks (its model or flags do not allow it); the
    engine stays healthy."""


class EngineOverloadedError(RuntimeError):
    pass


class RequestTimeoutError(TimeoutError):
    pass


# Put into a request's queue by its timer when the request runs past its timeout.
_TIMED_OUT = EngineCoreOutput("", [], None, "timeout")


class OutputQueue:
    """One request's outputs as the channel reader delivers them; a single reader takes all that
    arrived at once. (Lighter than asyncio.Queue: a deque plus one waiter future, set only when
    the reader is actually waiting.)"""

    __slots__ = ("_items", "_waiter", "timeline")

    def __init__(self) -> None:
        self._items: collections.deque[EngineCoreOutput] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        # The HTTP request's timeline, marked at this request's first output.
        self.timeline: RequestTimeline | None = None

    def put_nowait(self, output: EngineCoreOutput) -> None:
        self._items.append(output)
        timeline = self.timeline
        if timeline is not None:
            self.timeline = None
            if not timeline.first_output:
                timeline.first_output = time.perf_counter()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def take_all(self) -> list[EngineCoreOutput]:
        """Wait until at least one output is there; return (and remove) all of them."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class RequestStream:
    """One engine request's outputs, read in batches: everything that arrived since the last read.

    A reader that falls behind (a busy event loop, a slow client) gets several steps' outputs at
    once and can send them as one chunk, so the per-token work shrinks exactly when load grows.
    ``close()`` aborts the request in the engine unless it finished.
    """

    def __init__(self, client: EngineClient, engine: int, request_id: str, queue: OutputQueue,
                 timeout_s: float | None, started: float | None = None) -> None:
        """``timeout_s`` counts from ``started`` (the event loop's time the request was sent; now
        by default): its time in admission is part of it."""
        self.client = client
        self.engine = engine
        self.request_id = request_id
        self.finished = False
        # The reader ended it as finished (a stop string matched on the text): close() tells the
        # engine so, for its metrics, in the abort, with the output tokens it kept.
        self.stopped = False
        self.num_kept_tokens = 0
        self._queue = queue
        loop = asyncio.get_running_loop()
        self._timer = (loop.call_at((loop.time() if started is None else started) + timeout_s,
                                    queue.put_nowait, _TIMED_OUT) if timeout_s else None)

    async def next_batch(self) -> list[EngineCoreOutput]:
        """Wait for at least one output; return all queued ones, ending at the finishing one."""
        if self.finished:
            return []
        batch = await self._queue.take_all()
        for i, output in enumerate(batch):
            if output is _TIMED_OUT:
                raise RequestTimeoutError(f"request {self.request_id} timed out")
            if output.finish_reason is not None:
                self.finished = True
                return batch[: i + 1]
        return batch

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.finished:
            self.client._forget(self.client._slots[self.engine], self.request_id)
        else:
            # Client gone, timeout or stop string: the engine frees the request's blocks (abort forgets it here).
            self.finished = True
            await self.client.abort(self.engine, [self.request_id], stopped=self.stopped,
                                    num_kept_tokens=[self.num_kept_tokens] if self.stopped else None)


@dataclass
class _EngineSlot:
    index: int
    # None: no engine runs in this slot yet (an autoscaled one): the pump looks for it by name.
    handle: Any
    healthy: bool = True
    # The engine is being scaled away (it said so): no new request goes there.
    draining: bool = False
    in_flight: int = 0
    requests: set[str] = field(default_factory=set)
    # This client's requests in flight there under each LoRA adapter (by its cache key: id and
    # name, as the engines tell adapters apart), and each such request's adapter.
    adapters: dict[tuple[int, str], int] = field(default_factory=dict)
    adapter_of: dict[str, tuple[int, str]] = field(default_factory=dict)
    # The adapters the engine says its requests (any client's) are under.
    engine_adapters: frozenset[tuple[int, str]] = frozenset()
    last_error: str | None = None
    channel: ChannelConnection | None = None
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    # AddRequest frames sent and not yet answered, by request id.
    pending: dict[str, asyncio.Future[Accepted]] = field(default_factory=dict)
    prober: asyncio.Task[None] | None = None


class EngineClient:
    def __init__(self, handles: list[Any], client_index: int, resolve_handle: HandleResolver | None = None) -> None:
        """``handles``: one per engine slot, None for a slot no engine runs in yet (it is found by
        name, through ``resolve_handle``, once one does)."""
        self.client_index = client_index
        self._slots = [_EngineSlot(i, h, healthy=h is not None) for i, h in enumerate(handles)]
        self._resolve_handle = resolve_handle
        self._queues: dict[str, OutputQueue] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._closed = False
        self.on_engine_restart: Callable[[int], None] | None = None
        # Set before connecting (a prefix-aware policy): each engine's KV cache events, as they come.
        self.on_kv_events: Callable[[int, list[tuple[int, list[bytes]]]], None] | None = None
        self._health_round = SharedRun(self._probe_health)
        self._health_probed_at = 0.0  # (monotonic) when the last round of health probes ended

    @property
    def num_engines(self) -> int:
        return len(self._slots)

    def loads(self) -> list[int]:
        return [s.in_flight for s in self._slots]

    def active_adapters(self) -> list[dict[tuple[int, str], int]]:
        """Per engine, the LoRA adapters (by id and name) in use there: those the engine last said its
        requests are under (whichever client sent them; 0 here) and those of this client's requests in
        flight (with their count; the engine may not have said so yet)."""
        return [dict.fromkeys(s.engine_adapters, 0) | s.adapters if s.engine_adapters else s.adapters
                for s in self._slots]

    def healthy(self) -> list[bool]:
        """Per slot: whether requests may go there (a running engine that answers and is not draining)."""
        return [s.healthy and not s.draining for s in self._slots]

    def handle(self, engine: int) -> Any:
        """The engine actor of a slot (None while no engine runs there)."""
        return self._slots[engine].handle

    def answering(self) -> list[int]:
        """The slots whose engine answers (draining ones included: they still serve what they have)."""
        return [s.index for s in self._slots if s.handle is not None and s.healthy]

    def present(self) -> list[int]:
        """The slots an engine runs in (healthy or not)."""
        return [s.index for s in self._slots if s.handle is not None]

    def start(self) -> None:
        if not self._pumps:
            self._pumps = [detached_task(self._pump(slot), name=f"engine-{slot.index}-pump")
                           for slot in self._slots]

    async def wait_connected(self, timeout_s: float = 30.0) -> None:
        """Wait until every engine's channel is open (requests to an unconnected engine fail)."""
        self.start()
        async with asyncio.timeout(timeout_s):
            for slot in self._slots:
                if slot.handle is not None:  # (an empty slot connects when its engine starts)
                    await slot.connected.wait()

    async def close(self) -> None:
        self._closed = True
        for task in self._pumps + [s.prober for s in self._slots if s.prober is not None]:
            task.cancel()
        for task in self._pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for slot in self._slots:
            if slot.channel is not None:
                slot.channel.close()

    # -- requests ----------------------------------------------------------------------------------

    async def add_request(self, engine: int, request: EngineCoreRequest,
                          timeout_s: float | None = None) -> OutputQueue:
        """Send the request and wait for the engine to admit it (within ``timeout_s``, the request's
        own timeout: an engine that never answers must not hold the caller forever)."""
        slot = self._slots[engine]
        # (A draining engine still takes a request routed to it before the router heard of the drain,
        # e.g. a later choice of an n > 1 request: routing leaves it out, see healthy().)
        if not slot.healthy or slot.channel is None:
            raise EngineRefusedError(f"engine {engine} is unavailable: {slot.last_error or 'not connected'}")
        rid = request.request_id
        queue = OutputQueue()
        timeline = queue.timeline = current_timeline.get()
        if timeline is not None and not timeline.sent:
            timeline.sent = time.perf_counter()
        self._queues[rid] = queue
        slot.in_flight += 1
        slot.requests.add(rid)
        if request.lora_request is not None:
            key = slot.adapter_of[rid] = request.lora_request.cache_key
            slot.adapters[key] = slot.adapters.get(key, 0) + 1
        answer: asyncio.Future[Accepted] = asyncio.get_running_loop().create_future()
        slot.pending[rid] = answer
        sent = False
        try:
            slot.channel.send(AddRequest(request))
            sent = True
            async with asyncio.timeout(timeout_s):
                accepted = await answer
        except BaseException as e:
            slot.pending.pop(rid, None)
            self._forget(slot, rid)
            if sent and isinstance(e, asyncio.CancelledError | TimeoutError) and slot.channel is not None:
                # The caller left (or gave up) while the engine was admitting it: nobody will read or
                # abort it later.
                with contextlib.suppress(Exception):
                    slot.channel.send(AbortRequests([rid]))
            if isinstance(e, TimeoutError):
                raise RequestTimeoutError(f"request {rid}: engine {engine} did not admit it in {timeout_s} s") from e
            if isinstance(e, EngineUnavailableError | asyncio.CancelledError):
                raise
            if isinstance(e, FrameTooLargeError):  # (nothing was sent: the channel lives on)
                raise RequestRefusedByEngineError(str(e)) from e
            raise EngineUnavailableError(f"engine {engine} is unavailable: {e}") from e
        if accepted.error is not None:
            self._forget(slot, rid)
            if accepted.overloaded:
                raise EngineOverloadedError(accepted.error)
            if accepted.unknown_model:  # the request's fault, not the engine's: it stays healthy
                raise UnknownModelError(accepted.error)
            if accepted.refused:
                raise RequestRefusedByEngineError(accepted.error)
            # It refuses everything for now (e.g. its workers are restarting): route elsewhere until
            # its health check passes again.
            error = EngineRefusedError(f"engine {engine} refused the request: {accepted.error}")
            self._mark_unhealthy(slot, error)
            raise error
        return queue

    async def open(self, engine: int, request: EngineCoreRequest, timeout_s: float | None = None) -> RequestStream:
        """Add the request; its outputs are read from the returned stream, which must be closed."""
        started = asyncio.get_running_loop().time()
        queue = await self.add_request(engine, request, timeout_s)
        return RequestStream(self, engine, request.request_id, queue, timeout_s, started)

    async def stream(self, engine: int, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Add the request and yield its outputs until it finishes. Leaving early aborts it."""
        stream = await self.open(engine, request)
        try:
            while not stream.finished:
                for output in await stream.next_batch():
                    yield output
        finally:
            await stream.close()

    async def abort(self, engine: int, request_ids: list[str], stopped: bool = False,
                    num_kept_tokens: list[int] | None = None) -> None:
        """``stopped``: they ended as finished here (a stop string), not abandoned, each after the
        ``num_kept_tokens`` output tokens it kept."""
        slot = self._slots[engine]
        for rid in request_ids:
            self._forget(slot, rid)
        if slot.channel is not None:  # (also while marked unhealthy: the engine may still run them)
            try:
                slot.channel.send(AbortRequests(list(request_ids), stopped, list(num_kept_tokens or ())))
            except Exception as e:
                logger.warning("abort on engine %d failed: %s", engine, e)

    def _forget(self, slot: _EngineSlot, request_id: str) -> None:
        if request_id in slot.requests:
            slot.requests.discard(request_id)
            slot.in_flight -= 1
            key = slot.adapter_of.pop(request_id, None)
            if key is not None:
                if slot.adapters[key] <= 1:
                    del slot.adapters[key]
                else:
                    slot.adapters[key] -= 1
        self._queues.pop(request_id, None)

    # -- the channel reader ---------------------------------------------------------------------------

    async def _pump(self, slot: _EngineSlot) -> None:
        """Open the engine's channel (messages are routed by ``_on_message`` as their frames arrive),
        then wait for it to break and reconnect (by actor name)."""
        while not self._closed:
            try:
                if slot.channel is None:
                    if slot.handle is None:
                        raise EngineUnavailableError(f"engine {slot.index}: no engine runs in this slot")
                    await self._connect(slot)
                await slot.channel.wait_closed()  # type: ignore[union-attr]
                raise ConnectionError("the request channel closed")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._closed:
                    return
                self._drop_channel(slot)
                self._mark_unhealthy(slot, e)
                await self._wait_for_engine(slot)

    def _on_message(self, slot: _EngineSlot, message: Accepted | Outputs | Draining | Serving) -> None:
        if isinstance(message, Outputs):
            queues = self._queues
            for output in message.outputs.outputs:
                queue = queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            if message.outputs.kv_events and self.on_kv_events is not None:
                self.on_kv_events(slot.index, message.outputs.kv_events)
            if message.outputs.lora_adapters is not None:
                slot.engine_adapters = frozenset(tuple(key) for key in message.outputs.lora_adapters)
        elif isinstance(message, Draining):
            if not slot.draining:
                logger.info("engine %d is draining (scaled away): no new requests go there", slot.index)
            slot.draining = True
        elif isinstance(message, Serving):
            if slot.draining:
                logger.info("engine %d is serving again (its drain was called off)", slot.index)
            slot.draining = False
        else:
            answer = slot.pending.pop(message.request_id, None)
            if answer is not None and not answer.done():
                answer.set_result(message)

    async def _connect(self, slot: _EngineSlot) -> None:
        address = await slot.handle.channel_address.remote()
        slot.draining = False  # (a draining engine says so again on the new channel)
        slot.engine_adapters = frozenset()  # (and says which adapters it runs)
        slot.channel = await ChannelConnection.open(address, self.client_index,
                                                    on_message=functools.partial(self._on_message, slot),
                                                    kv_events=self.on_kv_events is not None)
        slot.connected.set()

    def _drop_channel(self, slot: _EngineSlot) -> None:
        if slot.channel is not None:
            slot.channel.close()
            slot.channel = None
        slot.connected.clear()
        error = EngineUnavailableError(f"engine {slot.index}: the request channel closed")
        for answer in slot.pending.values():
            if not answer.done():
                answer.set_exception(error)
        slot.pending.clear()

    def _mark_unhealthy(self, slot: _EngineSlot, error: Exception) -> None:
        """No new requests go to this engine until it answers again. Requests in flight there are
        failed only when the channel is gone (they can never finish); over a live channel the engine
        reports its own failures, and a slow health probe must not fail requests that are running."""
        if slot.healthy and slot.draining:
            logger.info("engine %d is gone (scaled away)", slot.index)
        elif slot.healthy:
            logger.error("engine %d unhealthy: %s", slot.index, error)
        slot.healthy = False
        slot.last_error = f"{type(error).__name__}: {error}"
        if slot.channel is None:
            for rid in list(slot.requests):
                queue = self._queues.get(rid)
                if queue is not None:
                    queue.put_nowait(EngineCoreOutput(rid, [], FinishReason.ERROR, slot.last_error))
        if slot.channel is not None and (slot.prober is None or slot.prober.done()):
            # Reachable but reported unhealthy (e.g. its workers died): back once it says so.
            slot.prober = detached_task(self._probe_until_healthy(slot))  # (may start from a request)

    async def _probe_until_healthy(self, slot: _EngineSlot) -> None:
        while not self._closed and not slot.healthy and slot.channel is not None:
            await asyncio.sleep(0.5)
            try:
                await slot.handle.check_health.remote()
            except Exception as e:
                self._drop_if_dead(slot, e)
                continue
            if slot.channel is not None:
                self._set_healthy(slot)

    def _drop_if_dead(self, slot: _EngineSlot, error: BaseException) -> None:
        """A dead engine's channel is cut now: the pump then fails the requests that were running
        there (they would otherwise wait for outputs that never come) and looks for a restarted one."""
        if _actor_died(error) and slot.channel is not None:
            slot.channel.abort()

    async def _wait_for_engine(self, slot: _EngineSlot) -> None:
        """Poll until the engine (possibly a restarted actor found by name) answers again; the pump
        then opens a new channel to it."""
        delay = 0.2
        while not self._closed:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            handle = slot.handle
            if self._resolve_handle is not None:
                try:
                    # ray.get_actor is a blocking GCS lookup: off the event loop.
                    handle = await asyncio.to_thread(self._resolve_handle, slot.index)
                except Exception:
                    continue
                if handle is None:  # no engine by that name (stopped, or scaled away): the slot is empty
                    slot.handle = None
                    slot.draining = False
                    continue
            if handle is None:
                continue
            try:
                await handle.check_health.remote()
                slot.handle = handle
                await self._connect(slot)
            except Exception:
                self._drop_channel(slot)
                continue
            self._set_healthy(slot)
            return

    def _set_healthy(self, slot: _EngineSlot) -> None:
        slot.healthy = True
        slot.last_error = None
        if self.on_engine_restart is not None:
            self.on_engine_restart(slot.index)
        logger.info("engine %d is back", slot.index)

    async def refresh_health(self, max_age_s: float = 0.0) -> list[bool]:
        """Ask every engine; a failure marks it unhealthy (the pump brings it back). One round at a
        time: callers that come during a round share it, and with ``max_age_s`` a round that ended
        that recently answers without another (a burst of /health requests, which need no key, must
        not become a burst of probes, whose slow answers would take engines out of routing). A round
        runs to its end even if its callers leave: a probe cancelled with them would mark its
        engine unhealthy."""
        if not (max_age_s and time.monotonic() - self._health_probed_at < max_age_s):
            await self._health_round()
        return self.healthy()

    async def _probe_health(self, timeout_s: float = 2.0) -> None:
        async def probe(slot: _EngineSlot) -> None:
            if slot.handle is None:  # (no engine in this slot: nothing to ask)
                return
            try:
                await asyncio.wait_for(slot.handle.check_health.remote(), timeout_s)
                if not slot.healthy and slot.channel is not None:  # no channel: requests there would fail
                    self._set_healthy(slot)
            except Exception as e:
                self._mark_unhealthy(slot, e)
                self._drop_if_dead(slot, e)

        await asyncio.gather(*(probe(s) for s in self._slots))
        self._health_probed_at = time.monotonic()
