"""The router's own Prometheus metrics (the only module of the router that imports prometheus_client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


class RouterMetrics:
    def __init__(self, model_name: str, replica: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.replica = replica
        self.requests_routed = Counter(
            "llm_cluster:router_requests_routed", "Requests sent to each engine, by routing policy.",
            ["model_name", "engine", "policy"], registry=self.registry)
        self.http_responses = Counter(
            "llm_cluster:router_http_responses", "HTTP responses by endpoint and status code.",
            ["model_name", "endpoint", "status"], registry=self.registry)
        self.routing_latency = Histogram(
            "llm_cluster:router_routing_decision_seconds", "Time to pick an engine for a request.",
            ["model_name", "policy"], registry=self.registry,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2))

    def record_routing(self, engine: int, policy: str, seconds: float) -> None:
        self.requests_routed.labels(self.model_name, str(engine), policy).inc()
        self.routing_latency.labels(self.model_name, policy).observe(seconds)

    def record_response(self, endpoint: str, status: int) -> None:
        self.http_responses.labels(self.model_name, endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
