"""Work a router replica starts that must not end with the HTTP request that started it.

Ray Serve runs each request as a task of the replica actor, and when the request's client leaves
it cancels that task recursively: every Ray call the request's asyncio tasks have in flight is
cancelled too (Ray finds them through a context variable, which ``asyncio.create_task`` copies
into the tasks a request starts). So a task started from a request that outlives it (a background
response's generation, a prober), or a change that must be made on every engine or on none (loading
a LoRA adapter, pausing the engines), would lose its calls in flight when that client leaves. These
helpers run such work in a context of its own, as Ray Serve does for its own long polls.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

# Detached tasks still running (the event loop keeps only weak references to tasks).
_running: set[asyncio.Task] = set()


def detached_task(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """Start ``coro`` as a task outside the current request's context: the request's cancellation
    does not reach its Ray calls."""
    task = asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


async def run_to_completion(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` run as a detached task. If the awaiting request is cancelled (its client
    left), the cancellation reaches the request but not the work, which finishes on its own; its
    failure then is logged, as nobody is left to hear of it. (A coroutine, not a future: Ray takes
    a call's parent when the call is made, so the calls must be made inside the detached task.)"""
    task = detached_task(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(_log_unheard_failure)  # (also when it ended meanwhile)
        raise


def runs_to_completion(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """A coroutine function each call of which runs to completion (``run_to_completion``)."""

    @functools.wraps(fn)
    async def run(*args: P.args, **kwargs: P.kwargs) -> T:
        return await run_to_completion(fn(*args, **kwargs))

    return run


def _log_unheard_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.warning("work whose request was cancelled failed afterwards: %s", error, exc_info=error)


class SharedRun:
    """A coroutine function run once for all who ask at about the same time: a caller that comes
    while a run is in flight waits for the next run, which starts once that one ends and serves
    every caller that came meanwhile (so each caller's answer is from a run that started after it
    asked: fresh, yet a burst of /health or /metrics requests makes two rounds of engine calls, not
    one per request). Runs are detached (``run_to_completion``): a caller that leaves does not
    cancel a run for the others."""

    def __init__(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> None:
        self._fn = fn
        self._task: asyncio.Task | None = None  # the run in flight
        self._next: asyncio.Task | None = None  # the run that follows it, for those who came meanwhile

    async def __call__(self) -> Any:
        current = self._task
        if current is None or current.done():
            task = self._task = detached_task(self._fn())
        else:
            if self._next is None or self._next.done():
                self._next = detached_task(self._after(current))
            task = self._next
        task.add_done_callback(_retrieved)
        return await asyncio.shield(task)

    async def _after(self, current: asyncio.Task) -> Any:
        await asyncio.wait([current])  # (its outcome is its own callers')
        self._task, self._next = asyncio.current_task(), None  # (now the run in flight)
        return await self._fn()


def _retrieved(task: asyncio.Task) -> None:
    """Mark a shared run's failure as seen (its callers each got it; all of them may have left)."""
    if not task.cancelled():
        task.exception()
