"""EngineMetrics against vLLM's exposition: names, bucket boundaries and per-request values."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.metrics import EngineMetrics
from engine_core.outputs import EngineCoreOutput, EngineCoreOutputs
from engine_core.request import EngineCoreEventType, FinishReason, Request
from engine_core.sampling_params import SamplingParams

# vllm/v1/metrics/loggers.py: request_latency_buckets, and the iteration-tokens buckets.
VLLM_REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def _families(metrics: EngineMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def _bounds(family) -> list[float]:
    return sorted({float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")} - {float("inf")})


def _sum(family) -> float:
    return next(s.value for s in family.samples if s.name.endswith("_sum"))


def test_one_request_through_the_metrics_as_vllm_reports_it():
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=100.0)
    request.record_event(EngineCoreEventType.QUEUED, 100.2)  # (the way from the router took 0.2 s)
    request.record_event(EngineCoreEventType.SCHEDULED, 100.5)
    metrics.on_request_added(request)
    times = [101.0, 101.2, 101.4, 101.6]  # first token at 101.0, then one every 0.2 s
    for i, now in enumerate(times):
        finish = FinishReason.LENGTH if i == len(times) - 1 else None
        metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("r", [7], finish)])}, None, now=now)
    families = _families(metrics)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert _bounds(families[f"vllm:{name}"]) == VLLM_REQUEST_LATENCY, name
    assert _bounds(families["vllm:iteration_tokens_total"]) == VLLM_ITERATION_TOKENS
    assert abs(_sum(families["vllm:e2e_request_latency_seconds"]) - 1.6) < 1e-9
    assert abs(_sum(families["vllm:request_queue_time_seconds"]) - 0.3) < 1e-9  # queued to scheduled
    assert abs(_sum(families["vllm:time_to_first_token_seconds"]) - 1.0) < 1e-9  # from the router's arrival
    # Mean time per output token after the first: 0.6 s of decode over 3 tokens.
    assert abs(_sum(families["vllm:request_time_per_output_token_seconds"]) - 0.2) < 1e-9
    assert _sum(families["vllm:request_max_num_generation_tokens"]) == 4
    assert _sum(families["vllm:request_generation_tokens"]) == 4


def test_cache_config_info_carries_the_kv_cache_settings_as_vllm_does():
    config = EngineConfig(served_model_name="m", engine_index=1, block_size=32, kv_cache_dtype="fp8",
                          enable_prefix_caching=False, mamba_ssm_cache_dtype="bfloat16", mamba_cache_mode="align")
    families = _families(EngineMetrics(config, SchedulerConfig(), "m", num_blocks=640))
    [sample] = families["vllm:cache_config_info"].samples
    assert sample.name == "vllm:cache_config_info" and sample.value == 1.0
    assert sample.labels == {"model_name": "m", "engine": "1", "block_size": "32", "cache_dtype": "fp8",
                             "enable_prefix_caching": "False", "num_gpu_blocks": "640",
                             "gpu_memory_utilization": "0.9", "mamba_cache_dtype": "auto",
                             "mamba_ssm_cache_dtype": "bfloat16", "mamba_cache_mode": "align"}


def test_engine_sleep_state_only_with_sleep_mode_as_vllm_exports_it():
    plain = _families(EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=8))
    assert "vllm:engine_sleep_state" not in plain
    metrics = EngineMetrics(EngineConfig(served_model_name="m", enable_sleep_mode=True), SchedulerConfig(), "m",
                            num_blocks=8)
    for level, state in ((0, "awake"), (1, "weights_offloaded"), (2, "discard_all")):
        metrics.sleep_level = level
        samples = _families(metrics)["vllm:engine_sleep_state"].samples
        assert {s.labels["sleep_state"]: s.value for s in samples} == {
            name: float(name == state) for name in ("awake", "weights_offloaded", "discard_all")}


def test_kv_offloading_series_only_with_a_host_tier():
    from engine_core.outputs import PrefixCacheStats, SchedulerStats

    plain = _families(EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=8))
    assert not any(name.startswith(("llm_cluster:kv_offload", "vllm:external_prefix")) for name in plain)
    metrics = EngineMetrics(EngineConfig(served_model_name="m", kv_offloading_size=1.0), SchedulerConfig(), "m",
                            num_blocks=8, num_offload_blocks=100)
    for stored, loaded, held, queries, hits in ((5, 0, 5, 64, 0), (3, 2, 8, 48, 32)):
        metrics.on_step({}, SchedulerStats(kv_offload_stored_blocks=stored, kv_offload_loaded_blocks=loaded,
                                           kv_offload_num_blocks=held, connector_prefix_cache_stats=PrefixCacheStats(
                                               requests=1, queries=queries, hits=hits)))
    families = _families(metrics)

    def value(name: str) -> float:
        return families[name].samples[0].value

    assert value("llm_cluster:kv_offload_num_blocks") == 100 and value("llm_cluster:kv_offload_blocks_held") == 8
    assert value("llm_cluster:kv_offload_stored_blocks") == 8 and value("llm_cluster:kv_offload_loaded_blocks") == 2
    # (vLLM's names for its connector's cache, its offloading's.)
    assert value("vllm:external_prefix_cache_queries") == 112 and value("vllm:external_prefix_cache_hits") == 32


def test_kept_recurrent_state_series_only_with_slots():
    from engine_core.outputs import SchedulerStats

    plain = _families(EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=8))
    assert not any(name.startswith("llm_cluster:recurrent_state") for name in plain)
    metrics = EngineMetrics(EngineConfig(served_model_name="m", mamba_cache_mode="align"), SchedulerConfig(), "m",
                            num_blocks=8, num_recurrent_state_slots=6)
    for saved, restored, evicted, skipped in ((4, 0, 0, 0), (3, 2, 1, 1)):
        metrics.on_step({}, SchedulerStats(recurrent_states_saved=saved, recurrent_states_restored=restored,
                                           recurrent_states_evicted=evicted, recurrent_states_skipped=skipped))
    metrics.kept_states_held = lambda: 6  # (read at the scrape: the engine's cache as it is then)
    families = _families(metrics)
    assert {name: families[name].samples[0].value for name in families if name.startswith("llm_cluster:recurrent")} \
        == {"llm_cluster:recurrent_state_slots": 6, "llm_cluster:recurrent_states_held": 6,
            "llm_cluster:recurrent_states_saved": 7, "llm_cluster:recurrent_states_restored": 2,
            "llm_cluster:recurrent_states_evicted": 1, "llm_cluster:recurrent_states_skipped": 1}


def test_an_embedding_request_counts_its_prompt_and_no_generation():
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    request = Request("e", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1, embed=True), arrival_time=100.0)
    metrics.on_request_added(request)
    metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("e", [], FinishReason.STOP,
                                                                    pooling_output=[0.6, 0.8])])}, None, now=100.3)
    families = _families(metrics)
    assert next(s.value for s in families["vllm:prompt_tokens"].samples) == 5
    assert next(s.value for s in families["vllm:generation_tokens"].samples) == 0
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert success["stop"] == 1
    # Its output is its first token's time, as vLLM records a pooling request's (the panels of an
    # embedding deployment are not empty); decoding took no time.
    ttft = families["vllm:time_to_first_token_seconds"]
    assert next(s.value for s in ttft.samples if s.name.endswith("_count")) == 1
    assert abs(next(s.value for s in ttft.samples if s.name.endswith("_sum")) - 0.3) < 1e-9
    decode = families["vllm:request_decode_time_seconds"]
    assert next(s.value for s in decode.samples if s.name.endswith("_sum")) == 0.0


def test_prompt_tokens_split_by_where_their_kv_came_from_as_vllm_reports_it():
    """vllm:prompt_tokens_by_source: local_compute + local_cache_hit (+ external_kv_transfer, 0
    here) = vllm:prompt_tokens; vllm:prompt_tokens_cached the hits; and per request the tokens its
    prefill computed. (A whole prompt found cached still computes its last token, counted here as
    computed; vLLM counts that one as a hit too, so its sources can add up to one more.)"""
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    for rid, prompt_len, cached in (("a", 20, 0), ("b", 20, 16), ("c", 9, 8)):
        request = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=1), arrival_time=100.0)
        request.num_cached_tokens = cached  # (as the scheduler sets it when it first schedules the request)
        metrics.on_request_added(request)
        metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [7], FinishReason.LENGTH)])}, None,
                        now=101.0)
    families = _families(metrics)
    by_source = {s.labels["source"]: s.value for s in families["vllm:prompt_tokens_by_source"].samples}
    assert by_source == {"local_compute": 25, "local_cache_hit": 24, "external_kv_transfer": 0}
    assert next(s.value for s in families["vllm:prompt_tokens"].samples) == 49 == sum(by_source.values())
    assert next(s.value for s in families["vllm:prompt_tokens_cached"].samples) == 24
    computed = families["vllm:request_prefill_kv_computed_tokens"]
    assert _sum(computed) == 25 and next(s.value for s in computed.samples if s.name.endswith("_count")) == 3
    # A prompt whose blocks KV offloading's host tier supplied: those count as transferred.
    request = Request("d", list(range(40)), SamplingParams(max_tokens=1), arrival_time=100.0)
    request.num_cached_tokens, request.num_external_computed_tokens = 32, 16
    metrics.on_request_added(request)
    metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("d", [7], FinishReason.LENGTH)])}, None,
                    now=101.0)
    by_source = {s.labels["source"]: s.value for s in _families(metrics)["vllm:prompt_tokens_by_source"].samples}
    assert by_source == {"local_compute": 33, "local_cache_hit": 40, "external_kv_transfer": 16}


def test_a_router_clock_ahead_of_the_engines_gives_no_negative_latency():
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), arrival_time=105.0)  # (the router's clock)
    request.record_event(EngineCoreEventType.QUEUED, 100.0)
    request.record_event(EngineCoreEventType.SCHEDULED, 100.1)
    metrics.on_request_added(request)
    metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("r", [7], FinishReason.LENGTH)])}, None,
                    now=100.3)
    families = _families(metrics)
    assert _sum(families["vllm:time_to_first_token_seconds"]) == 0.0
    assert _sum(families["vllm:e2e_request_latency_seconds"]) == 0.0
    assert abs(_sum(families["vllm:request_queue_time_seconds"]) - 0.1) < 1e-9


def _success(families: dict, reason: str) -> float:
    return next(s.value for s in families["vllm:request_success"].samples
                if s.name.endswith("_total") and s.labels["finished_reason"] == reason)


def test_a_request_its_client_stopped_on_a_stop_string_counts_as_finished_and_an_abort_does_not():
    """The router matches stop strings and aborts the engine request: vLLM's front end counts such
    a request as finished with reason stop (latency histograms included); a client that left is
    not counted."""
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    for rid in ("stopped", "left"):
        request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=40), arrival_time=100.0)
        request.record_event(EngineCoreEventType.QUEUED, 100.0)
        request.record_event(EngineCoreEventType.SCHEDULED, 100.1)
        metrics.on_request_added(request)
    for now in (101.0, 101.5):
        metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("stopped", [7]),
                                                       EngineCoreOutput("left", [7])])}, None, now=now)
    metrics.on_stopped_by_client(["stopped"], now=102.0)
    metrics.on_step({0: EngineCoreOutputs(finished_requests={"stopped", "left"})}, None, now=102.0)
    families = _families(metrics)
    assert _success(families, "stop") == 1 and _success(families, "abort") == 0
    assert abs(_sum(families["vllm:e2e_request_latency_seconds"]) - 1.5) < 1e-9  # (to its last token)
    assert _sum(families["vllm:request_generation_tokens"]) == 2


def test_waiting_requests_split_by_vllms_reasons():
    """vllm:num_requests_waiting_by_reason: capacity (no room in the batch or KV cache) and deferred
    (skipped this pass), adding up to vllm:num_requests_waiting."""
    from engine_core.outputs import SchedulerStats

    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    metrics.on_step({}, SchedulerStats(num_waiting_reqs=5, num_skipped_waiting_reqs=2), now=100.0)
    families = _families(metrics)
    by_reason = {s.labels["reason"]: s.value for s in families["vllm:num_requests_waiting_by_reason"].samples}
    assert by_reason == {"capacity": 5, "deferred": 2}
    assert families["vllm:num_requests_waiting"].samples[0].value == 7


def test_a_stop_string_request_counts_as_of_the_token_its_client_stopped_at():
    """The engine generated two more passes before the router's abort came: the request's latency
    and tokens are those of the pass that gave the stop's token, as vLLM's front end records them."""
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    request = Request("s", [1, 2, 3], SamplingParams(max_tokens=40), arrival_time=100.0)
    request.record_event(EngineCoreEventType.QUEUED, 100.0)
    request.record_event(EngineCoreEventType.SCHEDULED, 100.1)
    metrics.on_request_added(request)
    for now in (101.0, 101.5, 102.0, 102.5):
        metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("s", [7])])}, None, now=now)
    metrics.on_stopped_by_client(["s"], [2], now=103.0)  # (it kept two tokens: the stop was in the second)
    families = _families(metrics)
    assert _success(families, "stop") == 1
    assert abs(_sum(families["vllm:e2e_request_latency_seconds"]) - 1.5) < 1e-9
    assert abs(_sum(families["vllm:request_decode_time_seconds"]) - 0.5) < 1e-9
    assert _sum(families["vllm:request_generation_tokens"]) == 2


def test_a_requests_parameters_are_observed_once_for_all_its_choices():
    """vllm:request_params_n and _max_tokens once per client request (its first choice carries its
    n, the others 0), as vLLM observes them per parent request; max_tokens not for pooling."""
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    for i in range(3):
        metrics.on_request_added(Request(f"c-{i}", [1, 2], SamplingParams(max_tokens=9), arrival_time=100.0),
                                 3 if i == 0 else 0)
    metrics.on_request_added(Request("solo", [1, 2], SamplingParams(max_tokens=4), arrival_time=100.0))
    metrics.on_request_added(Request("e", [1, 2], SamplingParams(max_tokens=1, embed=True), arrival_time=100.0))
    families = _families(metrics)

    def observed(name: str) -> tuple[float, float]:
        samples = families[name].samples
        return (next(s.value for s in samples if s.name.endswith("_count")),
                next(s.value for s in samples if s.name.endswith("_sum")))

    assert observed("vllm:request_params_n") == (3, 3 + 1 + 1)
    assert observed("vllm:request_params_max_tokens") == (2, 9 + 4)


def test_a_stop_string_abort_further_behind_than_remembered_is_counted_as_it_came():
    metrics = EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=64)
    metrics.on_request_added(Request("s", [1, 2, 3], SamplingParams(max_tokens=40), arrival_time=100.0))
    for i in range(12):  # (more passes than the few remembered)
        metrics.on_step({0: EngineCoreOutputs(outputs=[EngineCoreOutput("s", [7])])}, None, now=101.0 + i)
    metrics.on_stopped_by_client(["s"], [1], now=120.0)
    families = _families(metrics)
    assert abs(_sum(families["vllm:e2e_request_latency_seconds"]) - 12.0) < 1e-9  # (its last token's time)
    assert _sum(families["vllm:request_generation_tokens"]) == 12
