"""Loopback ports for the servers tests start.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` lies in its ephemeral range, the same
range it draws from for every outgoing connection and for every listener Ray starts on a port of
its choosing (metrics, agents, gRPC). Such a port is free when asked for and can be taken by the
time a slow start (a local Ray, a Serve HAProxy) binds it: CI saw exactly that, "cannot bind socket
(Address already in use)". So ports come from a band where nothing binds unasked: above Ray's
worker ports, below Serve's replica ingress ports and the ephemeral range. None is handed out
twice in one test process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ray's default worker ports are 10002-19999 and its fixed ports (6379, 8265, 10001, ...) lie
# below; Serve's replicas take ports from 30000 up for their direct ingress (HAProxy mode); Ray
# picks its other ports at random above the ephemeral range's start.
_LOWEST = 20000
_HIGHEST = 29999
_handed_out: set[int] = set()
_random = random.Random()  # (its own: a test that seeds the module's random does not steer it)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # (Linux's default)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nothing listens on, from the band above."""
    highest = min(_HIGHEST, _ephemeral_start() - 1)
    if highest <= _LOWEST:  # (a machine whose ephemeral range reaches down here: take the kernel's)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = _random.randint(_LOWEST, highest)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {_LOWEST}-{highest}")
