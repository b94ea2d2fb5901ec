"""Stored responses for the Responses API (``--enable-responses-store``, or vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE=1``): ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``.

One store serves every router replica: a named Ray actor in the cluster's namespace (as the
router metrics hub is), so a conversation continues through whichever replica the ingress picks.
(Every application of the namespace shares it, and the latest replica's ``max_entries`` applies.)
Each response keeps its own input items and the id of the response it continued (its output items
are in the response); a conversation is rebuilt by walking that chain. The store holds at most
``max_entries`` responses and forgets the least recently used first (continuing a conversation
uses every response in it); a chain with a forgotten response can no longer be continued. It
lives in memory: a restarted store process starts empty. A background response is put queued, then
settled by the replica generating it (in progress, then its end) unless a cancel (or a delete)
through any replica came first. A streamed background response also keeps its event stream, which
the generating replica appends to and any replica follows (from any sequence number).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

# (Versioned: the store outlives deployments, and a build whose calls differ gets a store of its own.)
RESPONSE_STORE_NAME = "llm-cluster-responses-2"
# The names earlier builds gave it (``llm-cluster stop`` removes those too).
EARLIER_RESPONSE_STORE_NAMES = ("llm-cluster-responses",)
# The text of streamed background responses' events the store keeps: beyond it, the events of the
# least recently used ended streams are dropped (their responses stay). Streams still running are
# never dropped, so they alone may go beyond it.
EVENT_BYTES_BUDGET = 256 * 2**20
# Calls the store actor runs at once (each waiting follower holds one).
STORE_MAX_CONCURRENCY = 10_000
# The statuses of a background response still being generated.
UNFINISHED = ("queued", "in_progress")


@dataclass
class EventsPage:
    """What ``events_after`` found: ``state`` ok (``events`` after the asked sequence number, and
    whether the stream has ended), not_streamed (not a streamed background response) or dropped
    (its events were dropped for EVENT_BYTES_BUDGET)."""

    events: list[str]
    done: bool
    state: str = "ok"
    # The entry's serial (a follower's later pages name it: never a later response of that id).
    serial: int | None = field(default=None, compare=False)


@dataclass
class Stopped:
    """A background response a cancel or delete stopped (or any deleted response), and the base id
    of its engine requests (None for a response that had none of its own)."""

    response: dict[str, Any]
    engine_base: str | None = None


class MissingResponseError(KeyError):
    """A response id the store does not hold (never stored, deleted, or forgotten)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass
class _Entry:
    response: dict[str, Any]
    previous_id: str | None
    input_items: list[dict[str, Any]]  # this turn's input (its output items are the response's)
    # The store's number for this entry, and the number of the previous response's when it was put:
    # a chain whose response was deleted and whose id was then given to a new response (a client's
    # request_id) ends there, rather than going on through the new one.
    serial: int = 0
    previous_serial: int | None = None
    # A background response's engine requests' base id (their ids are it plus "-<choice>"), which a
    # cancel or delete through any replica aborts.
    engine_base: str | None = None
    # A streamed background response's SSE events (index = sequence number), None for the others
    # (and once dropped for the budget: ``events_dropped``).
    events: list[str] | None = None
    events_done: bool = False
    events_dropped: bool = False
    event_bytes: int = 0
    # Set (and replaced) when events arrive or the entry goes: wakes the followers waiting on it.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


def replayable_output(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored response's output items as the next turn's input: a function call cut off before
    its arguments were whole (an ``incomplete`` answer) is left out, as it could not be sent again."""
    out = []
    for item in response.get("output") or []:
        if item.get("type") == "function_call":
            try:
                json.loads(item.get("arguments") or "{}")
            except ValueError:
                continue
        out.append(item)
    return out


class ResponseStore:
    """The store itself (plain Python: the actor's class, and the in-process store)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._event_bytes = 0  # of every entry's events
        self._serials = 0

    def set_max_entries(self, max_entries: int) -> None:
        """The latest deployment's limit applies (the actor outlives the replicas that made it)."""
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._forget_beyond_limit()

    def put(self, response: dict[str, Any], previous_id: str | None, input_items: list[dict[str, Any]],
            streamed: bool = False, previous_serial: int | None = None, engine_base: str | None = None) -> int:
        """Keep a new response, and return its serial (the store's number for it, which later calls
        name it by); 0 (and nothing kept) when the store holds one of that id already (two requests
        named by one request_id). It continues ``previous_id`` as the store held it at
        ``previous_serial`` (the serial ``continuation`` gave); without, as it is held now.
        ``streamed``: a background response whose events are kept (``append_events``)."""
        if response["id"] in self._entries:
            return 0
        if previous_id is not None and previous_serial is None:
            previous = self._entries.get(previous_id)
            previous_serial = previous.serial if previous is not None else None
        self._serials += 1
        self._entries[response["id"]] = _Entry(response, previous_id, input_items, events=[] if streamed else None,
                                               serial=self._serials, previous_serial=previous_serial,
                                               engine_base=engine_base)
        self._forget_beyond_limit()
        return self._serials

    def _held(self, response_id: str, serial: int | None) -> _Entry | None:
        """The entry of ``response_id`` if it is the one put with ``serial`` (None: any)."""
        entry = self._entries.get(response_id)
        return entry if entry is not None and (serial is None or entry.serial == serial) else None

    def _forget_beyond_limit(self) -> None:
        while len(self._entries) > self.max_entries:
            self._gone(self._entries.popitem(last=False)[1])

    def _gone(self, entry: _Entry) -> None:
        """An entry leaves the store: its events' bytes are freed, its followers end."""
        self._event_bytes -= entry.event_bytes
        entry.event_bytes = 0
        entry.wake()

    def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry.response

    def delete(self, response_id: str, serial: int | None = None) -> Stopped | None:
        """The deleted response, with its engine requests' base id (None when not held, or, given
        ``serial``, when the entry held is another's)."""
        entry = self._held(response_id, serial)
        if entry is None:
            return None
        del self._entries[response_id]
        self._gone(entry)  # (its followers end)
        return Stopped(entry.response, entry.engine_base)

    def append_events(self, response_id: str, serial: int, first: int, events: list[str], done: bool) -> bool:
        """Events of the streamed background response put with ``serial``, from sequence number
        ``first`` (those the store has already are skipped: a sender may send again what a failed
        call may have delivered); ``done``: its stream has ended. False when its stream was ended (a
        cancel), or the store no longer holds it or its events: the sender stops."""
        entry = self._held(response_id, serial)
        if entry is None or entry.events is None or entry.events_done or first > len(entry.events):
            return False
        new = events[len(entry.events) - first:]
        entry.events.extend(new)
        added = sum(len(event) for event in new)
        entry.event_bytes += added
        self._event_bytes += added
        entry.events_done = done
        entry.wake()
        self._trim_events()
        return True

    def _trim_events(self) -> None:
        """Within EVENT_BYTES_BUDGET: drop the events of the least recently used ended streams."""
        for entry in self._entries.values():
            if self._event_bytes <= EVENT_BYTES_BUDGET:
                return
            if entry.events is not None and entry.events_done:
                self._event_bytes -= entry.event_bytes
                entry.events, entry.event_bytes, entry.events_dropped = None, 0, True

    async def events_after(self, response_id: str, after: int, wait_s: float,
                           serial: int | None = None) -> EventsPage | None:
        """A streamed background response's events after sequence number ``after`` (-1: all), and
        whether its stream has ended; when there are none yet, waits up to ``wait_s`` for some.
        None when the store does not hold the response (given ``serial``: that entry)."""
        entry = self._held(response_id, serial)
        if entry is not None and entry.events is not None and len(entry.events) <= after + 1 \
                and not entry.events_done and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), wait_s)
            entry = self._held(response_id, entry.serial)  # (deleted or forgotten meanwhile: gone)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        if entry.events is None:
            return EventsPage([], True, "dropped" if entry.events_dropped else "not_streamed", entry.serial)
        return EventsPage(entry.events[after + 1:], entry.events_done, serial=entry.serial)

    def settle(self, response: dict[str, Any], serial: int) -> bool:
        """A background response's progress or end, over its entry (the one put with ``serial``) while
        it is unfinished: False when it was cancelled, deleted (or forgotten: its id may be another's
        since), or has ended already. (One call, so a cancel or delete through another replica cannot
        slip between the check and the update.)"""
        entry = self._held(response["id"], serial)
        if entry is None or entry.response.get("status") not in UNFINISHED:
            return False
        entry.response = response
        self._entries.move_to_end(response["id"])  # (in use, as a put would count it)
        return True

    def cancel(self, response_id: str) -> Stopped | str | None:
        """Mark a queued or in-progress background response cancelled, and return it (with its engine
        requests' base id); a background response that has ended already, as it ended (no engine
        requests to stop: cancelling again, or after the end, is harmless, as OpenAI's is); None when
        the store does not hold it; the status of a response that is not a background one."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        status = entry.response.get("status")
        if not entry.response.get("background"):
            return str(status)
        if status not in UNFINISHED:
            return Stopped(entry.response)
        entry.response = {**entry.response, "status": "cancelled"}
        if entry.events is not None:  # its stream ends here: followers stop, the generating replica too
            entry.events_done = True
            entry.wake()
        return Stopped(entry.response, entry.engine_base)

    def conversation(self, response_id: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """Every item of the conversation up to and including ``response_id``'s output, oldest
        first; or (None, the id of the first response of the chain the store does not hold). (A
        value, not an exception: it crosses the actor boundary as it is.)"""
        turns, _ = self._walk(response_id)
        return turns

    def continuation(self, response_id: str
                     ) -> tuple[tuple[list[dict[str, Any]] | None, str | None], str | None, int | None]:
        """``conversation``, and the status and serial of ``response_id`` (the response a new turn
        continues: the new turn's put links to that entry, not to whichever holds the id then)."""
        head = self._entries.get(response_id)
        turns, status = self._walk(response_id)
        return turns, status, None if head is None else head.serial

    def _walk(self, response_id: str, serial: int | None = None
              ) -> tuple[tuple[list[dict[str, Any]] | None, str | None], str | None]:
        """The conversation up to ``response_id`` (which, given ``serial``, must be that entry: a
        link of a chain), and its status."""
        head = self._entries.get(response_id)
        status = None if head is None else head.response.get("status")
        turns = []
        next_id: str | None = response_id
        while next_id is not None:
            entry = self._entries.get(next_id)
            if entry is None or (serial is not None and entry.serial != serial):
                return (None, next_id), status  # (forgotten, deleted, or its id since given to another)
            self._entries.move_to_end(next_id)
            turns.append([*entry.input_items, *replayable_output(entry.response)])
            # (Serials only decrease along a chain, so it cannot loop.)
            next_id, serial = entry.previous_id, entry.previous_serial
            if next_id is not None and serial is None:
                return (None, next_id), status  # (not held when this one was put)
        return ([item for turn in reversed(turns) for item in turn], None), status

    def input_items(self, response_id: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """The items ``response_id`` was generated from, oldest first: the conversation it continued
        (as ``conversation`` gives it) and its own input; or (None, the first id not held)."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None, response_id
        self._entries.move_to_end(response_id)
        earlier: list[dict[str, Any]] | None = []
        if entry.previous_id is not None:
            if entry.previous_serial is None:  # (not held when this one was put)
                return None, entry.previous_id
            (earlier, missing_id), _ = self._walk(entry.previous_id, entry.previous_serial)
            if earlier is None:
                return None, missing_id
        return [*earlier, *entry.input_items], None

    def __len__(self) -> int:
        return len(self._entries)


class AsyncResponseStore:
    """The async interface the serving code uses; ``_call`` runs one ResponseStore method wherever
    the store lives."""

    async def _call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    async def put(self, response: dict[str, Any], previous_id: str | None, input_items: list[dict[str, Any]],
                  streamed: bool = False, previous_serial: int | None = None, engine_base: str | None = None) -> int:
        """The new entry's serial; 0 when the store holds a response of that id already (nothing is kept)."""
        return await self._call("put", response, previous_id, input_items, streamed, previous_serial, engine_base)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return await self._call("get", response_id)

    async def delete(self, response_id: str, serial: int | None = None) -> Stopped | None:
        return await self._call("delete", response_id, serial)

    async def settle(self, response: dict[str, Any], serial: int) -> bool:
        return await self._call("settle", response, serial)

    async def cancel(self, response_id: str) -> Stopped | str | None:
        return await self._call("cancel", response_id)

    async def append_events(self, response_id: str, serial: int, first: int, events: list[str], done: bool) -> bool:
        return await self._call("append_events", response_id, serial, first, events, done)

    async def events_after(self, response_id: str, after: int, wait_s: float,
                           serial: int | None = None) -> EventsPage | None:
        return await self._call("events_after", response_id, after, wait_s, serial)

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        return self._found(await self._call("conversation", response_id))

    async def continuation(self, response_id: str) -> tuple[list[dict[str, Any]], str | None, int | None]:
        """The conversation a new turn continues, and the status and serial of the response it continues."""
        answer, status, serial = await self._call("continuation", response_id)
        return self._found(answer), status, serial

    async def input_items(self, response_id: str) -> list[dict[str, Any]]:
        return self._found(await self._call("input_items", response_id))

    @staticmethod
    def _found(answer: tuple[list[dict[str, Any]] | None, str | None]) -> list[dict[str, Any]]:
        items, missing_id = answer
        if items is None:
            raise MissingResponseError(missing_id or "")
        return items


class LocalResponseStore(AsyncResponseStore):
    """A ResponseStore in this process (for an app built with ``create_app`` outside Ray Serve, as
    the tests do)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.store = ResponseStore(max_entries)

    async def _call(self, method: str, *args: Any) -> Any:
        answer = getattr(self.store, method)(*args)
        return await answer if inspect.isawaitable(answer) else answer


class ActorResponseStore(AsyncResponseStore):
    """The application's shared store: the named actor, started by the first replica that needs it
    (restarted empty if its process dies; a replica that finds its handle dead looks it up, or
    starts it, again)."""

    def __init__(self, namespace: str, max_entries: int) -> None:
        self.namespace = namespace
        self.max_entries = max_entries
        self.actor = self._connect()

    def _connect(self) -> Any:
        import ray

        # (An async actor: followers of streamed background responses each hold a call while they wait.)
        actor = ray.remote(ResponseStore).options(
            name=RESPONSE_STORE_NAME, namespace=self.namespace, get_if_exists=True, lifetime="detached",
            num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=STORE_MAX_CONCURRENCY,
        ).remote(self.max_entries)
        actor.set_max_entries.remote(self.max_entries)  # an existing store takes this deployment's limit
        return actor

    async def _call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError

        try:
            return await self._await(getattr(self.actor, method).remote(*args))
        except RayActorError:  # killed (llm-cluster stop) or lost with its node: find or start it again
            self.actor = self._connect()
            return await self._await(getattr(self.actor, method).remote(*args))

    @staticmethod
    async def _await(ref: Any) -> Any:
        import ray

        try:
            return await ref
        except asyncio.CancelledError:  # (a follower that left: its wait in the store ends too)
            ray.cancel(ref)
            raise
