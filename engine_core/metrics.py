"""Prometheus metrics of one engine, with vLLM v1's names, types and labels (model_name, engine).

The only engine_core module that imports prometheus_client. The scheduler hands over a
``SchedulerStats`` per pass; request-level latencies come from the requests' own timestamps.
Each engine keeps its own registry, rendered by the engine actor, so whichever router replica
answers a scrape returns the same engine series.

Recording runs on the engine's per-pass path, so it is plain Python arithmetic on preallocated
counters and bucket arrays (no locks, no per-sample label lookups); a custom collector turns them
into metric families only when Prometheus scrapes. (A separate metrics thread was measured and was
slower: it contends for the GIL with the pass.)
"""

from __future__ import annotations

import dataclasses
import time
from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.outputs import EngineCoreOutputs, SchedulerStats
from engine_core.request import EngineCoreEventType, Request

# Passes a request's recent token times go back (the passes a stop string's abort may lag behind).
_RECENT_PASSES = 8

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
# vLLM's request_latency_buckets: whole-request and phase times (e2e, queue, prefill, decode, inference).
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
# How long KV blocks stay in the pool (--kv-cache-metrics): log-spaced from 1 ms to 30 min, as vLLM's.
_RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
                      120.0, 300.0, 600.0, 1200.0, 1800.0)
# Tokens per pass, as vLLM buckets vllm:iteration_tokens_total.
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len, as vLLM builds them."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class _Histogram:
    __slots__ = ("bounds", "counts", "doc", "name", "total")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n
        self.total += value * n

    def family(self, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        counts = list(self.counts)
        buckets, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), counts):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        fam = HistogramMetricFamily(self.name, self.doc, labels=labels)
        fam.add_metric(values, buckets, self.total)
        return fam


@dataclass
class _Tracked:
    request: Request
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0
    # The last few passes that gave it tokens: (its tokens before and after the pass, the pass's time), to go
    # back to the one its client stopped at (on_stopped_by_client).
    recent: deque[tuple[int, int, float]] = dataclasses.field(default_factory=lambda: deque(maxlen=_RECENT_PASSES))


class EngineMetrics:
    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig, model_name: str,
                 num_blocks: int, num_offload_blocks: int = 0, num_recurrent_state_slots: int = 0) -> None:
        self._labels = ["model_name", "engine"]
        self._values = [model_name, str(config.engine_index)]
        token_buckets = _token_buckets(scheduler_config.max_model_len)
        h = _Histogram
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_LATENCY_BUCKETS)
        self.queue_time = h("vllm:request_queue_time_seconds", "Time waiting before first scheduled.",
                            _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = h("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                              _REQUEST_LATENCY_BUCKETS)
        self.decode_time = h("vllm:request_decode_time_seconds", "First token to last token.",
                             _REQUEST_LATENCY_BUCKETS)
        self.inference_time = h("vllm:request_inference_time_seconds", "First scheduled to finish.",
                                _REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = h("vllm:request_time_per_output_token_seconds",
                                       "Mean time per output token after the first, per request.", _ITL_BUCKETS)
        self.request_prompt_tokens = h("vllm:request_prompt_tokens", "Prompt length.", token_buckets)
        self.request_generation_tokens = h("vllm:request_generation_tokens", "Generated length.", token_buckets)
        # Longest generation among a request's parallel samples: each engine request is one sample here.
        self.max_num_generation_tokens = h("vllm:request_max_num_generation_tokens",
                                           "Longest generation of a request's samples.", token_buckets)
        self.iteration_tokens = h("vllm:iteration_tokens_total", "Tokens scheduled per pass.",
                                  _ITERATION_TOKEN_BUCKETS)
        self.params_max_tokens = h("vllm:request_params_max_tokens", "Requested max_tokens.", token_buckets)
        self.params_n = h("vllm:request_params_n", "Requested n (once per request, on its first choice's engine).",
                          (1, 2, 5, 10, 20))
        self.prefill_kv_computed = h("vllm:request_prefill_kv_computed_tokens",
                                     "Prompt tokens a request's prefill computed (its prefix-cache hits excluded).",
                                     token_buckets)
        self._histograms = [self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
                            self.inference_time, self.time_per_output_token, self.request_prompt_tokens,
                            self.request_generation_tokens, self.max_num_generation_tokens, self.iteration_tokens,
                            self.params_max_tokens, self.params_n, self.prefill_kv_computed]
        # KV block residency (exported only with --kv-cache-metrics, as vLLM does): the sampled blocks
        # handed out again (evicted).
        self.residency: tuple[_Histogram, _Histogram, _Histogram] | None = None
        if config.kv_cache_metrics_sample is not None:
            self.residency = (
                h("vllm:kv_block_lifetime_seconds", "Sampled KV blocks: allocation to eviction.", _RESIDENCY_BUCKETS),
                h("vllm:kv_block_idle_before_evict_seconds", "Sampled KV blocks: last use to eviction.",
                  _RESIDENCY_BUCKETS),
                h("vllm:kv_block_reuse_gap_seconds", "Sampled KV blocks: time between prefix-cache reuses.",
                  _RESIDENCY_BUCKETS))
            self._histograms += list(self.residency)
        # Counters and gauges: plain numbers, read at scrape time.
        self.counters = dict.fromkeys(("prompt_tokens", "prompt_tokens_cached", "prompt_tokens_external",
                                       "generation_tokens", "prefix_queries", "prefix_hits", "preemptions",
                                       "budget_used", "budget_total"), 0.0)
        self.gauges = dict.fromkeys(("running", "waiting", "skipped_waiting", "kv_usage"), 0.0)
        self.gauges["num_blocks"] = float(num_blocks)
        self.request_success: dict[str, float] = defaultdict(float)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success[reason] = 0.0
        self.flags = {k: str(v) for k, v in scheduler_config.as_dict().items()} | {
            "tensor_parallel_size": str(config.tensor_parallel_size),
            "pipeline_parallel_size": str(config.pipeline_parallel_size), "block_size": str(config.block_size),
            "enable_prefix_caching": str(config.enable_prefix_caching), "kv_cache_dtype": config.kv_cache_dtype}
        # vLLM's cache_config_info: the KV cache's settings as labels (value 1).
        self.cache_config = {"block_size": str(config.block_size), "cache_dtype": config.kv_cache_dtype,
                             "enable_prefix_caching": str(config.enable_prefix_caching),
                             "num_gpu_blocks": str(num_blocks),
                             "gpu_memory_utilization": str(config.gpu_memory_utilization),
                             "mamba_cache_dtype": config.mamba_cache_dtype,
                             "mamba_ssm_cache_dtype": config.mamba_ssm_cache_dtype,
                             "mamba_cache_mode": config.mamba_cache_mode}
        self._policy = scheduler_config.policy
        spec = config.speculative_config
        if spec is not None:
            self.flags["speculative_config"] = (f"{spec.method} k={spec.num_speculative_tokens} "
                                                f"n={spec.prompt_lookup_min}..{spec.prompt_lookup_max}")
        # Speculative decoding counters (exported only when the engine drafts, as vLLM does).
        self.spec: dict[str, float] | None = (dict.fromkeys(("drafts", "draft_tokens", "accepted_tokens"), 0.0)
                                              if spec is not None else None)
        self.spec_accepted_per_pos = [0.0] * (spec.num_speculative_tokens if spec is not None else 0)
        # LoRA (exported only when the engine serves adapters): requests per adapter name, running
        # and waiting. Every loaded adapter has a series (0 when idle), and so does one seen in use.
        lora = config.lora_config
        self.max_loras = lora.max_loras if lora is not None else 0
        if lora is not None:
            self.flags["max_loras"] = str(lora.max_loras)
            self.flags["max_lora_rank"] = str(lora.max_lora_rank)
        self.lora_running: dict[str, int] = {}
        self.lora_waiting: dict[str, int] = {}
        self.lora_info_time = 0.0
        # vLLM's engine_sleep_state (exported only with --enable-sleep-mode, as vLLM does): the sleep
        # level (0: awake).
        self.sleep_level: int | None = 0 if config.enable_sleep_mode else None
        # KV offloading (exported only with --kv-offloading-size): the host tier's size in blocks,
        # the blocks it holds, and blocks stored to it and loaded from it.
        self.offload: dict[str, float] | None = (
            {"capacity": float(num_offload_blocks), "held": 0.0, "stored": 0.0, "loaded": 0.0,
             "external_queries": 0.0, "external_hits": 0.0}
            if num_offload_blocks else None)
        # Recurrent layers' states kept for the prefix cache (exported only under --mamba-cache-mode
        # align, for a model with such layers): the slots, and states kept, restored, evicted and not
        # kept; the states kept now are read at each scrape (kept_states_held: a prefix-cache reset,
        # sleep or worker restart empties them between passes).
        self.kept_states: dict[str, float] | None = (
            {"slots": float(num_recurrent_state_slots), "saved": 0.0, "restored": 0.0, "evicted": 0.0,
             "skipped": 0.0}
            if num_recurrent_state_slots else None)
        self.kept_states_held: Callable[[], int] = lambda: 0
        # Prefill/decode disaggregation (exported only with --kv-transfer-config): the engine's totals
        # since start (EngineCore.kv_transfer_totals), read at each scrape.
        self.kv_transfer: Callable[[], dict[str, int]] | None = None
        # Images (exported only for a vision-language model): EngineCore.encoder_cache_totals.
        self.encoder_cache: Callable[[], dict[str, float]] | None = None
        self._tracked: dict[str, _Tracked] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

    # -- recording (the engine thread, after each pass) --------------------------------------------


    def on_request_added(self, request: Request, num_choices: int = 1) -> None:
        """``num_choices``: its client request's n on its first choice, 0 on the others (a request's
        parameters are observed once, as vLLM's per parent request; max_tokens not for pooling)."""
        self._tracked[request.request_id] = _Tracked(request, request.arrival_time)
        if num_choices:
            self.params_n.observe(num_choices)
            if not request.sampling_params.embed:
                self.params_max_tokens.observe(request.sampling_params.max_tokens)

    def on_step(self, outputs: dict[int, EngineCoreOutputs], stats: SchedulerStats | None,
                now: float | None = None) -> None:
        now = time.time() if now is None else now
        tracked = self._tracked
        generated = 0
        # Requests decoding in consecutive passes share their previous token's timestamp, so their
        # inter-token latencies are equal: count them per timestamp, observe once per distinct one.
        itl_from: dict[float, int] = defaultdict(int)
        for eco in outputs.values():
            for out in eco.outputs:
                t = tracked.get(out.request_id)
                if t is None:
                    continue
                n = len(out.new_token_ids)
                if n:
                    generated += n
                    if t.first_token is None:
                        t.first_token = now
                        # (From the router's arrival, as vLLM's from its front end's; a router host
                        # whose clock runs ahead of this one's must not make it negative.)
                        self.ttft.observe(max(0.0, now - t.arrival))
                        self._prefilled(t.request)
                    elif t.last_token is not None:
                        itl_from[t.last_token] += 1
                    t.last_token = now
                    t.recent.append((t.num_generated, t.num_generated + n, now))
                    t.num_generated += n
                elif out.pooling_output is not None:  # an embedding request: its prompt was its work
                    # (Its output is its first: TTFT and prefill time as vLLM records them for pooling
                    # requests; its decode takes no time.)
                    if t.first_token is None:
                        t.first_token = t.last_token = now
                        self.ttft.observe(max(0.0, now - t.arrival))
                    self._prefilled(t.request)
                if out.finish_reason is not None:
                    self._finish(t, str(out.finish_reason), now)
            if eco.finished_requests:
                for rid in eco.finished_requests:
                    tracked.pop(rid, None)  # aborted requests leave without a finish output
        self.counters["generation_tokens"] += generated
        for last, count in itl_from.items():
            self.itl.observe(now - last, count)
        if stats is not None:
            self._record_stats(stats)

    def on_stopped_by_client(self, request_ids: list[str], num_kept_tokens: list[int] | None = None,
                             now: float | None = None) -> None:
        """Requests their client ended as finished (a stop string it matched on the text), about to
        be aborted here: counted as finished with reason stop, as vLLM's front end counts the stop
        strings it finds. With ``num_kept_tokens`` (each one's tokens up to its stop), as of the
        pass that gave the token it stopped at: the passes run before the abort came are not the
        request's latency, nor its tokens."""
        now = time.time() if now is None else now
        kept = dict(zip(request_ids, num_kept_tokens, strict=False)) if num_kept_tokens else {}
        for request_id in request_ids:
            t = self._tracked.get(request_id)
            if t is None:
                continue
            count = kept.get(request_id)
            if count is not None and 0 < count < t.num_generated:
                # (Only from a pass still remembered: an abort further behind is counted as it came.)
                at = next((ts for before, after, ts in t.recent if before < count <= after), None)
                if at is not None:
                    t.num_generated, t.last_token = count, at
            self._finish(t, "stop", t.last_token or now)

    def _prefilled(self, request: Request) -> None:
        """A request's prompt is in the KV cache: its tokens, those its prefix-cache hits supplied,
        and those its prefill computed."""
        cached = max(0, request.num_cached_tokens)
        self.counters["prompt_tokens"] += request.num_prompt_tokens
        self.counters["prompt_tokens_cached"] += cached
        self.counters["prompt_tokens_external"] += request.num_external_computed_tokens
        self.prefill_kv_computed.observe(request.num_prompt_tokens - cached)

    def _finish(self, t: _Tracked, reason: str, now: float) -> None:
        self._tracked.pop(t.request.request_id, None)
        self.request_success[reason] += 1
        self.e2e.observe(max(0.0, now - t.arrival))
        self.request_prompt_tokens.observe(t.request.num_prompt_tokens)
        self.request_generation_tokens.observe(t.num_generated)
        self.max_num_generation_tokens.observe(t.num_generated)
        events = t.request.events
        scheduled = next((ts for ev, ts in events if ev == EngineCoreEventType.SCHEDULED), None)
        if scheduled is not None:
            # As vLLM's: from its queueing in this engine's scheduler, on this engine's clock (not
            # the router's arrival: the way here and the pass it waited out are not queueing).
            queued = next((ts for ev, ts in events if ev == EngineCoreEventType.QUEUED), t.arrival)
            self.queue_time.observe(max(0.0, scheduled - queued))
            self.inference_time.observe(max(0.0, now - scheduled))
            if t.first_token is not None:
                self.prefill_time.observe(max(0.0, t.first_token - scheduled))
        if t.first_token is not None and t.last_token is not None:
            self.decode_time.observe(t.last_token - t.first_token)
            # As vLLM: the decode time over the tokens after the first (0 for a single token).
            self.time_per_output_token.observe((t.last_token - t.first_token) / (t.num_generated - 1)
                                               if t.num_generated > 1 else 0.0)

    def on_adapters_loaded(self, names: list[str]) -> None:
        """The adapters now loaded: each gets its series; an unloaded one with no requests loses them."""
        # (New dicts, swapped in whole: a scrape on another thread reads them meanwhile.)
        def keep(counts: dict[str, int]) -> dict[str, int]:
            return dict.fromkeys(names, 0) | {n: c for n, c in counts.items() if c or n in names}

        self.lora_running, self.lora_waiting = keep(self.lora_running), keep(self.lora_waiting)

    def _record_stats(self, stats: SchedulerStats) -> None:
        g, c = self.gauges, self.counters
        g["running"] = stats.num_running_reqs
        g["waiting"] = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        g["skipped_waiting"] = stats.num_skipped_waiting_reqs
        g["kv_usage"] = stats.kv_cache_usage
        c["prefix_queries"] += stats.prefix_cache_stats.queries
        c["prefix_hits"] += stats.prefix_cache_stats.hits
        c["preemptions"] += stats.num_preemptions
        if stats.step_num_scheduled_tokens:
            self.iteration_tokens.observe(stats.step_num_scheduled_tokens)
        c["budget_used"] += stats.num_scheduled_tokens
        c["budget_total"] += stats.step_token_budget * stats.num_steps
        if self.max_loras and stats.running_lora_adapters is not None:
            self.lora_running = dict.fromkeys(self.lora_running, 0) | stats.running_lora_adapters
            self.lora_waiting = dict.fromkeys(self.lora_waiting, 0) | (stats.waiting_lora_adapters or {})
            self.lora_info_time = time.time()
        if self.residency is not None and stats.kv_block_residency:
            lifetime, idle, reuse_gap = self.residency
            for lived, unused, gaps in stats.kv_block_residency:
                lifetime.observe(lived)
                idle.observe(unused)
                for gap in gaps:
                    reuse_gap.observe(gap)
        if self.offload is not None:
            self.offload["held"] = stats.kv_offload_num_blocks
            self.offload["stored"] += stats.kv_offload_stored_blocks
            self.offload["loaded"] += stats.kv_offload_loaded_blocks
            if stats.connector_prefix_cache_stats is not None:
                self.offload["external_queries"] += stats.connector_prefix_cache_stats.queries
                self.offload["external_hits"] += stats.connector_prefix_cache_stats.hits
        if self.kept_states is not None:
            kept = self.kept_states
            kept["saved"] += stats.recurrent_states_saved
            kept["restored"] += stats.recurrent_states_restored
            kept["evicted"] += stats.recurrent_states_evicted
            kept["skipped"] += stats.recurrent_states_skipped
        sd = stats.spec_decoding_stats
        if sd is not None and self.spec is not None:
            self.spec["drafts"] += sd.num_drafts
            self.spec["draft_tokens"] += sd.num_draft_tokens
            self.spec["accepted_tokens"] += sd.num_accepted_tokens
            for pos, n in enumerate(sd.num_accepted_tokens_per_pos[:len(self.spec_accepted_per_pos)]):
                self.spec_accepted_per_pos[pos] += n

    # -- exposition (scrape time) ------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        labels, values = self._labels, self._values
        g, c = self.gauges, self.counters

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", g["running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", g["waiting"])
        # (vLLM's split of it: waiting for room in the batch or the KV cache, and deferred: skipped
        # this pass for another reason, a LoRA slot or a grammar being compiled, say.)
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                      "Requests waiting to be scheduled, by why (the sum is "
                                      "vllm:num_requests_waiting).", labels=[*labels, "reason"])
        by_reason.add_metric([*values, "capacity"], g["waiting"] - g["skipped_waiting"])
        by_reason.add_metric([*values, "deferred"], g["skipped_waiting"])
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", g["kv_usage"])
        yield counter("vllm:prompt_tokens", "Prefill tokens processed.", c["prompt_tokens"])
        yield counter("vllm:prompt_tokens_cached", "Prompt tokens found in the prefix cache.",
                      c["prompt_tokens_cached"])
        # (vLLM's split: computed here, read from the local prefix cache, or copied in from KV
        # offloading's host tier, which vLLM's offloading connector counts as a transfer.)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                                        labels=[*labels, "source"])
        external = c["prompt_tokens_external"]
        for source, count in (("local_compute", c["prompt_tokens"] - c["prompt_tokens_cached"]),
                              ("local_cache_hit", c["prompt_tokens_cached"] - external),
                              ("external_kv_transfer", external)):
            by_source.add_metric([*values, source], count)
        yield by_source
        yield counter("vllm:generation_tokens", "Generated tokens.", c["generation_tokens"])
        yield counter("vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.", c["prefix_queries"])
        yield counter("vllm:prefix_cache_hits", "Tokens found in the prefix cache.", c["prefix_hits"])
        yield counter("vllm:num_preemptions", "Preemptions.", c["preemptions"])
        success = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                      labels=[*labels, "finished_reason"])
        for reason, count in list(self.request_success.items()):
            success.add_metric([*values, reason], count)
        yield success
        for hist in self._histograms:
            yield hist.family(labels, values)
        flags = InfoMetricFamily("llm_cluster:engine_scheduler_flags", "Scheduler flags in effect on this engine.",
                                 labels=labels)
        flags.add_metric(values, self.flags)
        yield flags
        cache_info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache's configuration.",
                                       labels=[*labels, *self.cache_config])
        cache_info.add_metric([*values, *self.cache_config.values()], 1.0)
        yield cache_info
        yield gauge("llm_cluster:num_requests_skipped_waiting",
                    "Requests in skipped_waiting (blocked or declined this pass).", g["skipped_waiting"])
        yield counter("llm_cluster:scheduled_tokens", "Tokens scheduled, summed over passes.", c["budget_used"])
        yield counter("llm_cluster:token_budget", "Token budget offered, summed over passes.", c["budget_total"])
        by_policy = CounterMetricFamily("llm_cluster:preemptions_by_victim_policy",
                                        "Preemptions by victim-selection policy.", labels=[*labels, "policy"])
        by_policy.add_metric([*values, self._policy], c["preemptions"])
        yield by_policy
        yield gauge("llm_cluster:kv_cache_num_blocks", "KV blocks in this engine's pool.", g["num_blocks"])
        if self.spec is not None:
            sp = self.spec
            yield counter("vllm:spec_decode_num_drafts", "Requests whose draft tokens a pass verified.", sp["drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", sp["draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", sp["accepted_tokens"])
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft (0: the first).",
                                          labels=[*labels, "position"])
            for pos, n in enumerate(self.spec_accepted_per_pos):
                per_pos.add_metric([*values, str(pos)], n)
            yield per_pos
        if self.offload is not None:
            off = self.offload
            yield gauge("llm_cluster:kv_offload_num_blocks", "Blocks KV offloading's host-memory tier has room for.",
                        off["capacity"])
            yield gauge("llm_cluster:kv_offload_blocks_held", "Prefix-cache blocks the host-memory tier holds now.",
                        off["held"])
            yield counter("llm_cluster:kv_offload_stored_blocks",
                          "Evicted prefix-cache blocks saved to the host-memory tier.", off["stored"])
            yield counter("llm_cluster:kv_offload_loaded_blocks",
                          "Blocks copied back from the host-memory tier instead of computed.", off["loaded"])
            # (vLLM's names: its offloading is a KV connector's, whose cache it calls external.)
            yield counter("vllm:external_prefix_cache_queries",
                          "Tokens looked up in KV offloading's host-memory tier.", off["external_queries"])
            yield counter("vllm:external_prefix_cache_hits",
                          "Tokens found in KV offloading's host-memory tier.", off["external_hits"])
        if self.kept_states is not None:
            kept = self.kept_states
            yield gauge("llm_cluster:recurrent_state_slots",
                        "Recurrent-layer states the prefix cache has room for (--mamba-prefix-cache-slots).",
                        kept["slots"])
            yield gauge("llm_cluster:recurrent_states_held", "Recurrent-layer states the prefix cache keeps now.",
                        self.kept_states_held())
            yield counter("llm_cluster:recurrent_states_saved",
                          "Recurrent-layer states copied into the prefix cache's slots.", kept["saved"])
            yield counter("llm_cluster:recurrent_states_restored",
                          "Requests whose recurrent layers started from a state the prefix cache kept.",
                          kept["restored"])
            yield counter("llm_cluster:recurrent_states_evicted",
                          "Kept recurrent-layer states whose slot a newer state took.", kept["evicted"])
            yield counter("llm_cluster:recurrent_states_skipped",
                          "Recurrent-layer states not kept: every slot was one its pass restored from or saved "
                          "into.", kept["skipped"])
        if self.kv_transfer is not None:
            kv = self.kv_transfer()
            yield counter("llm_cluster:kv_transfer_sent_blocks",
                          "KV blocks of prefills computed here that decode engines read.", kv["sent_blocks"])
            yield counter("llm_cluster:kv_transfer_received_blocks",
                          "KV blocks read from prefill engines instead of computed here.", kv["received_blocks"])
            yield counter("llm_cluster:kv_transfer_failed_reads",
                          "Reads of a prefill engine's KV blocks that failed (the prompt computed here, or the "
                          "request failed).", kv["failed_reads"])
            yield counter("llm_cluster:kv_transfer_declined",
                          "Prefills on other engines this engine's requests did not read (the prompt cached here, "
                          "or the request gone first): their engines were told to free the blocks.", kv["declined"])
            yield gauge("llm_cluster:kv_transfer_held_requests",
                        "Prefills computed here holding their KV blocks for decode engines to read.", kv["held"])
        if self.encoder_cache is not None:
            images = self.encoder_cache()
            yield counter("llm_cluster:mm_images_encoded", "Images the vision encoder encoded.", images["encoded"])
            yield counter("llm_cluster:mm_encoder_cache_hits",
                          "Images a prompt's chunk reached that were encoded already (the encoder cache: the same "
                          "image in another prompt, or in a conversation's next turn).", images["found"])
            yield gauge("llm_cluster:mm_encoder_cache_usage_perc",
                        "Share of the encoder cache's rows holding encoded images (1 = full).", images["usage"])
        if self.max_loras:
            yield from self._lora_families(labels, values)
        if self.sleep_level is not None:
            sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state: awake = 1 while awake; "
                                      "weights_offloaded = 1 asleep at level 1; discard_all = 1 at level 2.",
                                      labels=[*labels, "sleep_state"])
            level = self.sleep_level
            for state, value in (("awake", level == 0), ("weights_offloaded", level == 1), ("discard_all", level == 2)):
                sleep.add_metric([*values, state], float(value))
            yield sleep

    def _lora_families(self, labels: list[str], values: list[str]) -> Iterator[Metric]:
        def names(counts: dict[str, int]) -> str:
            return ",".join(sorted(name for name, n in counts.items() if n))

        # vLLM's info gauge: the adapters in use as label values, the time of the update as the value.
        info = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests.",
                                 labels=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([*values, str(self.max_loras), names(self.lora_running), names(self.lora_waiting)],
                        self.lora_info_time)
        yield info
        for state, counts in (("running", self.lora_running), ("waiting", self.lora_waiting)):
            fam = GaugeMetricFamily(f"llm_cluster:lora_num_requests_{state}",
                                    f"Requests {state}, per LoRA adapter.", labels=[*labels, "lora_name"])
            for name, n in sorted(counts.items()):
                fam.add_metric([*values, name], n)
            yield fam

    def render(self) -> bytes:
        return generate_latest(self.registry)
