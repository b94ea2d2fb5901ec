"""The router's Prometheus side: its own metrics, and merging many expositions into one scrape.

The only router module that imports prometheus_client. Each replica's series carry a ``replica``
label; one scrape target returns every replica's series (through a shared hub actor) and every
engine's series (from the engines themselves), merged by metric family so the exposition stays valid.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from router.request_timeline import RequestTimeline

TIMELINE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)

# vLLM exports no *_created series either; they double the scrape size for nothing.
disable_created_metrics()

# vLLM's HTTP metrics (prometheus-fastapi-instrumentator's) leave out these operational paths.
HTTP_METRICS_EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
# (The instrumentator's high-resolution latency buckets.)
HTTP_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5,
                         5.0, 7.5, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, model_name: str, replica: str, engine_indexes: tuple[int, ...] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.replica = replica
        # The router numbers a model's engines from 0; the label is the engines' own (cluster-wide) index.
        self.engine_labels = [str(index) for index in engine_indexes]
        self.requests_routed = Counter(
            "llm_cluster:router_requests_routed", "Requests sent to each engine, by routing policy.",
            ["model_name", "replica", "engine", "policy"], registry=self.registry)
        self.http_responses = Counter(
            "llm_cluster:router_http_responses", "HTTP responses by endpoint and status code.",
            ["model_name", "replica", "endpoint", "status"], registry=self.registry)
        # vLLM's own HTTP series (its dashboards' error ratio reads them): status grouped as 2xx, 4xx, ...
        self.http_requests = Counter(
            "http_requests", "Total number of requests by method, status and handler.",
            ["model_name", "replica", "method", "status", "handler"], registry=self.registry)
        self.http_request_duration = Histogram(
            "http_request_duration_seconds", "Time to the end of each response (streams included), by handler.",
            ["model_name", "replica", "method", "handler"], registry=self.registry, buckets=HTTP_DURATION_BUCKETS)
        self.routing_latency = Histogram(
            "llm_cluster:router_routing_decision_seconds", "Time to pick an engine for a request.",
            ["model_name", "replica", "policy"], registry=self.registry,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2))

        # Where a request's time goes inside the replica (router.request_timeline).
        self.time_to_engine = Histogram(
            "llm_cluster:router_time_to_engine_seconds",
            "From a request's arrival at the router replica to its first engine request sent (parsing, "
            "validation, tokenization, routing).",
            ["model_name", "replica"], registry=self.registry, buckets=TIMELINE_BUCKETS)
        self.first_chunk_delay = Histogram(
            "llm_cluster:router_first_chunk_delay_seconds",
            "Streamed requests: from the engine's first output reaching the router replica to the first "
            "bytes handed to the HTTP server (the event loop's wait, detokenization, the chunk).",
            ["model_name", "replica"], registry=self.registry, buckets=TIMELINE_BUCKETS)

        # vLLM's multi-modal processor cache series (router.multimodal.ProcessedImageCache).
        self.mm_cache_queries = Counter(
            "vllm:mm_cache_queries", "Images looked up in the router replica's processed-image cache.",
            ["model_name", "replica"], registry=self.registry)
        self.mm_cache_hits = Counter(
            "vllm:mm_cache_hits", "Images found in the router replica's processed-image cache (not decoded and "
            "processed again).", ["model_name", "replica"], registry=self.registry)

        # Prefill/decode disaggregation (router.disaggregation).
        self.remote_prefills = Counter(
            "llm_cluster:router_remote_prefills",
            "Prompts sent to a prefill engine, by outcome: handed_on (the decode engine reads their KV) or "
            "decoded_whole (the prefill was refused or failed: the decode engine computes the prompt).",
            ["model_name", "replica", "outcome"], registry=self.registry)
        self.remote_prefill_time = Histogram(
            "llm_cluster:router_remote_prefill_seconds",
            "Time of the prefill leg, from sending the prompt to a prefill engine to its KV parameters back.",
            ["model_name", "replica"], registry=self.registry,
            buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))

    def record_mm_cache_lookup(self, hit: bool) -> None:
        """An image looked up in the processed-image cache (router.multimodal), found or not."""
        self.mm_cache_queries.labels(self.model_name, self.replica).inc()
        if hit:
            self.mm_cache_hits.labels(self.model_name, self.replica).inc()

    def record_remote_prefill(self, handed_on: bool, seconds: float) -> None:
        """One prefill leg, ``seconds`` long: whether it handed KV on to read."""
        self.remote_prefills.labels(self.model_name, self.replica, "handed_on" if handed_on else "decoded_whole").inc()
        self.remote_prefill_time.labels(self.model_name, self.replica).observe(seconds)

    def record_timeline(self, timeline: RequestTimeline) -> None:
        if timeline.sent:
            self.time_to_engine.labels(self.model_name, self.replica).observe(timeline.sent - timeline.arrived)
        if timeline.first_chunk and timeline.first_output:
            self.first_chunk_delay.labels(self.model_name, self.replica).observe(
                timeline.first_chunk - timeline.first_output)

    def _engine_label(self, engine: int) -> str:
        return self.engine_labels[engine] if engine < len(self.engine_labels) else str(engine)

    def record_routing(self, engine: int, policy: str, seconds: float) -> None:
        self.requests_routed.labels(self.model_name, self.replica, self._engine_label(engine), policy).inc()
        self.routing_latency.labels(self.model_name, self.replica, policy).observe(seconds)

    def record_response(self, endpoint: str, status: int, method: str = "GET") -> None:
        self.http_responses.labels(self.model_name, self.replica, endpoint, str(status)).inc()
        if endpoint not in HTTP_METRICS_EXCLUDED:
            self.http_requests.labels(self.model_name, self.replica, method, f"{status // 100}xx", endpoint).inc()

    def record_response_end(self, endpoint: str, method: str, seconds: float) -> None:
        """A response's whole time, from its request's arrival to its last bytes."""
        if endpoint not in HTTP_METRICS_EXCLUDED:
            self.http_request_duration.labels(self.model_name, self.replica, method, endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MergedCollector:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """One valid exposition from many: samples of the same family (e.g. one per engine) are grouped
    under one HELP/TYPE header instead of repeating it, which Prometheus would reject."""
    merged: dict[str, Metric] = {}
    for text in texts:
        if not text:
            continue
        for family in text_string_to_metric_families(text.decode()):
            existing = merged.get(family.name)
            if existing is None:
                merged[family.name] = family
            else:
                existing.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MergedCollector(merged.values()))  # type: ignore[arg-type]
    return generate_latest(registry)
