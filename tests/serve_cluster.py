"""Start engines and router apps on the session's Ray cluster, for end-to-end tests (loopback only)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from cluster.app import router_deployment, start_cluster, stop_cluster, stop_router_helpers
from cluster.config import ClusterConfig
from cluster.launcher import EngineHandle
from tests.ports import free_port


def wait_ready(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{base} did not come up")


def wait_until_healthy(actor: Any, timeout: float = 60.0) -> None:
    """Poll an engine actor's health check until it passes (after its workers were restarted)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(actor.check_health.remote())
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass
class ServedCluster:
    base: str
    config: ClusterConfig
    engines: list[EngineHandle]
    extra: dict[str, Any] = field(default_factory=dict)

    def stats(self) -> list[Any]:
        import ray

        return [ray.get(e.actor.get_stats.remote()) for e in self.engines]


@contextlib.contextmanager
def serve_cluster(config: ClusterConfig, extra_apps: dict[str, ClusterConfig] | None = None) -> Iterator[ServedCluster]:
    """Engines from ``config`` plus its router at /, and each extra router config at /<name>."""
    from ray import serve

    engines = start_cluster(config)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(router_deployment(config), name="llm-cluster", route_prefix="/")
        for name, app_config in (extra_apps or {}).items():
            serve.run(router_deployment(app_config), name=name, route_prefix=f"/{name}")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        for name in extra_apps or {}:
            wait_ready(f"{base}/{name}")
        yield ServedCluster(base, config, engines)
    finally:
        serve.shutdown()
        stop_cluster(config, engines)
        stop_router_helpers(config.namespace)  # the replicas' shared actors outlive them by design
