"""The waiting collections: a deque under FCFS, a heap on (priority, arrival_time) under priority."""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from engine_core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Append at the back (FCFS) / insert by key (priority)."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the request to schedule next."""

    @abstractmethod
    def peek_request(self) -> Request:
        """Return the request to schedule next without removing it."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put at the front (FCFS) / insert by key (priority: prepend has no meaning there)."""

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue) -> None:
        """Put all of ``requests`` at the front, one at a time, as vLLM's (a deque's extendleft):
        the last of them ends up first, so a queue built by prepending goes back in the order its
        requests were taken in."""

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Iterate in scheduling order."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class FCFSRequestQueue(deque, RequestQueue):  # type: ignore[misc]
    """Insertion order is the whole ordering; front and back are literal positions."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        self.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = requests if isinstance(requests, set | frozenset) else set(requests)
        kept = [r for r in self if r not in to_remove]
        self.clear()
        self.extend(kept)

    def __contains__(self, request: object) -> bool:
        return deque.__contains__(self, request)

    def __bool__(self) -> bool:
        return deque.__len__(self) > 0

    __len__ = deque.__len__
    __iter__ = deque.__iter__


class PriorityRequestQueue(RequestQueue):
    """Heap ordered by (priority, arrival_time, request_id); lower priority value runs first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.request_id, request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    # Prepending has no meaning in a heap: it collapses into an ordinary insert.
    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[3]) not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __contains__(self, request: object) -> bool:
        return any(entry[3] is request for entry in self._heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
