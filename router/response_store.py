"""Stored responses for the Responses API (``--enable-responses-store``, or vLLM's
``VLLM_ENABLE_RESPONSES_API_STORE=1``): ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``.

One store serves every router replica of an application: a named Ray actor in the cluster's
namespace (as the router metrics hub is), so a conversation continues through whichever replica
the ingress picks. Each response keeps its own turn only (the input items it was given and the
output items it produced) and the id of the response it continued; a conversation is rebuilt by
walking that chain. The store holds at most ``max_entries`` responses and forgets the least
recently used first (continuing a conversation uses every response in it); a chain with a
forgotten response can no longer be continued.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

RESPONSE_STORE_NAME = "llm-cluster-responses"


class MissingResponseError(KeyError):
    """A response id the store does not hold (never stored, deleted, or forgotten)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass
class _Entry:
    response: dict[str, Any]
    previous_id: str | None
    items: list[dict[str, Any]]  # this turn: its input items, then its output items


class ResponseStore:
    """The store itself (plain Python: the actor's class, and the in-process store)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def put(self, response: dict[str, Any], previous_id: str | None, items: list[dict[str, Any]]) -> None:
        self._entries[response["id"]] = _Entry(response, previous_id, items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry.response

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def conversation(self, response_id: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """Every item of the conversation up to and including ``response_id``'s output, oldest
        first; or (None, the id of the first response of the chain the store does not hold). (A
        value, not an exception: it crosses the actor boundary as it is.)"""
        turns = []
        seen = set()
        next_id: str | None = response_id
        while next_id is not None and next_id not in seen:
            entry = self._entries.get(next_id)
            if entry is None:
                return None, next_id
            seen.add(next_id)
            self._entries.move_to_end(next_id)
            turns.append(entry.items)
            next_id = entry.previous_id
        return [item for turn in reversed(turns) for item in turn], None

    def __len__(self) -> int:
        return len(self._entries)


class LocalResponseStore:
    """A ResponseStore in this process, behind the async interface the serving code uses (a single
    router process, tests)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.store = ResponseStore(max_entries)

    async def put(self, response: dict[str, Any], previous_id: str | None, items: list[dict[str, Any]]) -> None:
        self.store.put(response, previous_id, items)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        return _found(*self.store.conversation(response_id))


class ActorResponseStore:
    """The application's shared store: the named actor, started by the first replica that needs it."""

    def __init__(self, namespace: str, max_entries: int) -> None:
        import ray

        self.actor = ray.remote(ResponseStore).options(
            name=RESPONSE_STORE_NAME, namespace=namespace, get_if_exists=True, lifetime="detached",
            num_cpus=0).remote(max_entries)

    async def put(self, response: dict[str, Any], previous_id: str | None, items: list[dict[str, Any]]) -> None:
        await self.actor.put.remote(response, previous_id, items)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return await self.actor.get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.actor.delete.remote(response_id)

    async def conversation(self, response_id: str) -> list[dict[str, Any]]:
        return _found(*await self.actor.conversation.remote(response_id))


def _found(items: list[dict[str, Any]] | None, missing_id: str | None) -> list[dict[str, Any]]:
    if items is None:
        raise MissingResponseError(missing_id or "")
    return items
