"""Prometheus metrics of one engine, with vLLM v1's names, types and labels (model_name, engine).

The only engine_core module that imports prometheus_client. The scheduler hands over a
``SchedulerStats`` per pass; request-level latencies come from the requests' own timestamps.
Each engine keeps its own registry, rendered by the engine actor, so whichever router replica
answers a scrape returns the same engine series.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.outputs import EngineCoreOutputs, SchedulerStats
from engine_core.request import EngineCoreEventType, Request

# As in vLLM: no *_created series.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM builds them."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _Tracked:
    request: Request
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


class EngineMetrics:
    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig, model_name: str,
                 num_blocks: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self._label_values = (model_name, str(config.engine_index))
        r = self.registry
        token_buckets = _token_buckets(scheduler_config.max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.num_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.")
        self.request_success = counter("vllm:request_success", "Finished requests by reason.", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                      _LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                     _LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to finish.",
                                        _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt length.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Generated length.",
                                                   token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens scheduled per pass.",
                                          _token_buckets(max(scheduler_config.token_budget, 1)))
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "Requested max_tokens.", token_buckets)
        self.params_n = histogram("vllm:request_params_n", "Requested n (one per engine request).",
                                  (1, 2, 5, 10, 20))
        # Our own series.
        self.flags = Info("llm_cluster:engine_scheduler_flags", "Scheduler flags in effect on this engine.",
                          labels, registry=r)
        self.skipped_waiting = gauge("llm_cluster:num_requests_skipped_waiting",
                                     "Requests in skipped_waiting (blocked or declined this pass).")
        self.budget_used = counter("llm_cluster:scheduled_tokens", "Tokens scheduled, summed over passes.")
        self.budget_total = counter("llm_cluster:token_budget", "Token budget offered, summed over passes.")
        self.preemptions_by_policy = counter("llm_cluster:preemptions_by_victim_policy",
                                             "Preemptions by victim-selection policy.", ("policy",))
        self.num_blocks = gauge("llm_cluster:kv_cache_num_blocks", "KV blocks in this engine's pool.")
        lv = self._label_values
        self.flags.labels(*lv).info({k: str(v) for k, v in scheduler_config.__dict__.items()}
                                    | {"tensor_parallel_size": str(config.tensor_parallel_size),
                                       "block_size": str(config.block_size),
                                       "enable_prefix_caching": str(config.enable_prefix_caching)})
        self.num_blocks.labels(*lv).set(num_blocks)
        self._policy = scheduler_config.policy
        self._tracked: dict[str, _Tracked] = {}
        # Bound children once: labels() is a dict lookup plus a lock per call.
        self._c = {name: getattr(self, name).labels(*lv) for name in (
            "num_running", "num_waiting", "kv_usage", "prompt_tokens", "generation_tokens", "prefix_queries",
            "prefix_hits", "preemptions", "ttft", "itl", "e2e", "queue_time", "prefill_time", "decode_time",
            "inference_time", "request_prompt_tokens", "request_generation_tokens", "iteration_tokens",
            "params_max_tokens", "params_n", "skipped_waiting", "budget_used", "budget_total")}
        self._preempt_policy = self.preemptions_by_policy.labels(*lv, self._policy)

    def on_request_added(self, request: Request) -> None:
        self._tracked[request.request_id] = _Tracked(request, request.arrival_time)
        self._c["params_max_tokens"].observe(request.sampling_params.max_tokens)
        self._c["params_n"].observe(1)

    def on_step(self, outputs: dict[int, EngineCoreOutputs], stats: SchedulerStats | None) -> None:
        now = time.time()
        c = self._c
        tracked = self._tracked
        for eco in outputs.values():
            for out in eco.outputs:
                t = tracked.get(out.request_id)
                if t is None:
                    continue
                n = len(out.new_token_ids)
                if n:
                    c["generation_tokens"].inc(n)
                    if t.first_token is None:
                        t.first_token = now
                        c["ttft"].observe(now - t.arrival)
                        c["prompt_tokens"].inc(t.request.num_prompt_tokens)
                    elif t.last_token is not None:
                        c["itl"].observe(now - t.last_token)
                    t.last_token = now
                    t.num_generated += n
                if out.finish_reason is not None:
                    self._finish(t, str(out.finish_reason), now)
            if eco.finished_requests:
                for rid in eco.finished_requests:
                    tracked.pop(rid, None)  # aborted requests leave without a finish output
        if stats is not None:
            self._record_stats(stats)

    def _finish(self, t: _Tracked, reason: str, now: float) -> None:
        c = self._c
        self._tracked.pop(t.request.request_id, None)
        self.request_success.labels(*self._label_values, reason).inc()
        c["e2e"].observe(now - t.arrival)
        c["request_prompt_tokens"].observe(t.request.num_prompt_tokens)
        c["request_generation_tokens"].observe(t.num_generated)
        scheduled = next((ts for ev, ts in t.request.events if ev == EngineCoreEventType.SCHEDULED), None)
        if scheduled is not None:
            c["queue_time"].observe(max(0.0, scheduled - t.arrival))
            c["inference_time"].observe(max(0.0, now - scheduled))
            if t.first_token is not None:
                c["prefill_time"].observe(max(0.0, t.first_token - scheduled))
        if t.first_token is not None and t.last_token is not None:
            c["decode_time"].observe(t.last_token - t.first_token)

    def _record_stats(self, stats: SchedulerStats) -> None:
        c = self._c
        c["num_running"].set(stats.num_running_reqs)
        c["num_waiting"].set(stats.num_waiting_reqs + stats.num_skipped_waiting_reqs)
        c["skipped_waiting"].set(stats.num_skipped_waiting_reqs)
        c["kv_usage"].set(stats.kv_cache_usage)
        c["prefix_queries"].inc(stats.prefix_cache_stats.queries)
        c["prefix_hits"].inc(stats.prefix_cache_stats.hits)
        if stats.num_preemptions:
            c["preemptions"].inc(stats.num_preemptions)
            self._preempt_policy.inc(stats.num_preemptions)
        if stats.step_num_scheduled_tokens:
            c["iteration_tokens"].observe(stats.step_num_scheduled_tokens)
        c["budget_used"].inc(stats.num_scheduled_tokens)
        c["budget_total"].inc(stats.step_token_budget * stats.num_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
