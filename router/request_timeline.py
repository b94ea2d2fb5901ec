"""Where a request's time goes inside a router replica: from its arrival to its first engine
request sent (parsing, validation, tokenization, routing), and from the engine's first output
reaching the replica to the first bytes of a streamed answer handed to the HTTP server (the event
loop's wait, detokenization, the chunk's JSON). The rest of a client's time to first token is the
engines' and the network's.

The ASGI layer starts a timeline per request in a context variable, so each layer the request's
task runs through marks it without it being passed along, and records it when the answer is done.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RequestTimeline:
    """``time.perf_counter()`` instants; 0.0: not reached."""

    arrived: float
    sent: float = 0.0  # its first engine request went out
    first_output: float = 0.0  # its first engine output reached the replica
    first_chunk: float = 0.0  # the first streamed bytes were handed to the server
    # The RouterMetrics of the model the request turned out to be for (None: not known; the default
    # model's): its response and timeline are counted under that model's name.
    metrics: Any = None


current_timeline: ContextVar[RequestTimeline | None] = ContextVar("request_timeline", default=None)
