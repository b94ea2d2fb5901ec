"""Metrics through one scrape target into a real Prometheus, and every dashboard query answered."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig, EngineSpec
from tests.e2e.prometheus import assert_query_has_data, query_with_data, require_prometheus, scraping, target_health
from tests.lora_adapters import save_adapter
from tests.serve_cluster import serve_cluster

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "llm-cluster.json"

# The core queries of vLLM's own example Grafana dashboard (examples/online_serving/prometheus_grafana).
VLLM_DASHBOARD_QUERIES = [
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket[1m])))',
    'rate(vllm:e2e_request_latency_seconds_sum[1m]) / rate(vllm:e2e_request_latency_seconds_count[1m])',
    'rate(vllm:prompt_tokens_total[1m])',
    'rate(vllm:generation_tokens_total[1m])',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket[1m])))',
    'vllm:num_requests_running',
    'vllm:num_requests_waiting',
    'sum by(reason) (vllm:num_requests_waiting_by_reason)',
    # (vLLM's HTTP series, its instrumentator's: the error ratio and request latency of its overview.)
    # (The 5xx ratio's numerator has no series on a server that answered no 5xx: the 2xx share here.)
    'sum(rate(http_requests_total{status="2xx"}[1m])) / sum(rate(http_requests_total[1m]))',
    'histogram_quantile(0.99, sum by(le) (rate(http_request_duration_seconds_bucket[1m])))',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))',
    'vllm:kv_cache_usage_perc',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket[1m]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket[1m]))',
    'sum by(finished_reason) (increase(vllm:request_success_total[1m]))',
    'rate(vllm:request_queue_time_seconds_sum[1m])',
    'rate(vllm:request_prefill_time_seconds_sum[1m])',
    'rate(vllm:request_decode_time_seconds_sum[1m])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:request_inference_time_seconds_bucket[1m])))',
    'sum by(le) (increase(vllm:request_params_max_tokens_bucket[1m]))',
    'sum by(le) (increase(vllm:request_params_n_bucket[1m]))',
    'sum by(le) (increase(vllm:iteration_tokens_total_bucket[1m]))',
    'rate(vllm:num_preemptions_total[1m])',
    'rate(vllm:prefix_cache_hits_total[1m]) / rate(vllm:prefix_cache_queries_total[1m])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:request_time_per_output_token_seconds_bucket[1m])))',
    'sum by(le) (increase(vllm:request_max_num_generation_tokens_bucket[1m]))',
]


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# The series of panels other models feed, answered in their own files: the image panels' (a
# vision-language model's, test_observability_images.py), the recurrent layers' kept states' (a hybrid
# model's, test_observability_recurrent.py).
MODEL_SERIES = {"images": ("llm_cluster:mm_", "vllm:mm_cache_"), "recurrent": ("llm_cluster:recurrent_state",)}


def dashboard_queries(model: str | None = None) -> list[str]:
    """The dashboard's queries as Grafana sends them: those of the panels MODEL_SERIES[``model``]
    feed, or (None) the others'."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs = [e for e in exprs
             if next((m for m, names in MODEL_SERIES.items() if any(name in e for name in names)), None) == model]
    # What Grafana substitutes before sending a query.
    return [e.replace("$__rate_interval", "1m").replace("$model_name", ".*") for e in exprs]


@pytest.fixture(scope="module")
def observed(ray_cluster, tiny_model_dir, tmp_path_factory):
    require_prometheus()
    adapter = save_adapter(tiny_model_dir, tmp_path_factory.mktemp("sql"))
    config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", num_engines=2,
                           num_router_replicas=2, routing_policy="round_robin",
                           # Every KV block followed (--kv-cache-metrics), so the residency panel has data;
                           # evicted blocks kept in host memory (KV offloading), so its panel has data too.
                           # Prefill/decode disaggregation, so its panels have data: engine 0 computes
                           # prompts for others and decodes (kv_both), engine 1 only decodes (kv_consumer).
                           # The router sends the prompts of requests decoded on engine 1 to engine 0 first;
                           # a client also drives the two legs itself below.
                           defaults=EngineSpec(num_gpu_blocks=64, max_model_len=256, kv_cache_metrics=True,
                                               kv_cache_metrics_sample=1.0, kv_offloading_size=0.01,
                                               kv_transfer_config={"kv_role": "kv_both"}),
                           # Engine 1 drafts (n-gram speculative decoding), so its panels have data.
                           engines=[EngineSpec(), EngineSpec(speculative_config=SPEC,
                                                             kv_transfer_config={"kv_role": "kv_consumer"})],
                           # Half the requests run under a LoRA adapter, so its panel has data.
                           enable_lora=True, lora_modules=[f"sql={adapter}"])
    with serve_cluster(config) as served:
        for _ in range(4):  # warm both replicas' metrics path (the hub actor starts on first use)
            httpx.get(f"{served.base}/metrics", timeout=60)
        with scraping(served.base) as prom:
            shared = "The quick brown fox jumps over the lazy dog. " * 3
            body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            # Two waves with scrapes in between, so every rate() window sees counters move; a quarter
            # of the requests streamed (the router's first-chunk delay).
            for wave in range(2):
                with ThreadPoolExecutor(8) as pool:
                    codes = list(pool.map(lambda i: httpx.post(
                        f"{served.base}/v1/completions", timeout=60,
                        json=body | {"prompt": shared + str(i), "model": ("tiny", "sql")[i % 2],
                                     "stream": i % 4 == 0}).status_code,
                        range(16 * wave, 16 * wave + 16)))
                assert set(codes) == {200}
                time.sleep(5)
            # Then more distinct tokens than each engine's 64 blocks hold, so cached blocks (the shared
            # prefix's, reused many times, among them) are evicted and report their residency.
            with ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(lambda i: httpx.post(
                    f"{served.base}/v1/completions", timeout=60,
                    json=body | {"prompt": f"Request {i}: " + "lorem ipsum dolor sit amet " * 5}).status_code,
                    range(32)))
            assert set(codes) == {200}
            # Documents of several blocks, then more than the engines' caches hold, then the documents
            # again (twice each: some come back to the engine that computed them), so evicted blocks
            # are loaded back from KV offloading's host tier.
            documents = [f"Document {d}: " + " ".join(f"w{d}x{j}" for j in range(16)) for d in range(40)]

            def send(prompts: list[str]) -> None:
                with ThreadPoolExecutor(8) as pool:
                    sent = list(pool.map(lambda p: httpx.post(f"{served.base}/v1/completions", timeout=60,
                                                              json=body | {"prompt": p, "max_tokens": 2}).status_code,
                                         prompts))
                assert set(sent) == {200}

            send(documents[:8])
            send(documents[8:])
            send(documents[:8] * 2)
            # Prefill/decode legs driven by the client (vLLM's proxy protocol): the prefill leg goes to the
            # prefill engine, the decode leg reads the prompt's KV from it.
            for leg in range(2):
                prompt = f"Disaggregated {leg}: " + "the prompt's KV moves between engines " * 3
                prefill = httpx.post(f"{served.base}/v1/completions", timeout=60, json=body | {
                    "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
                assert prefill["kv_transfer_params"]["do_remote_prefill"]
                decode = httpx.post(f"{served.base}/v1/completions", timeout=60, json=body | {
                    "prompt": prompt, "kv_transfer_params": prefill["kv_transfer_params"]})
                assert decode.status_code == 200
            time.sleep(5)
            yield served, prom


def test_one_scrape_target_has_every_engine_and_router_series(observed):
    served, prom = observed
    assert target_health(prom) == [("up", "")]
    text = httpx.get(f"{served.base}/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    engines = {s.labels.get("engine") for s in families["vllm:num_requests_running"].samples}
    assert engines == {"0", "1"}
    assert "llm_cluster:router_requests_routed" in families
    flags = families["llm_cluster:engine_scheduler_flags_info"].samples
    assert {s.labels["engine"] for s in flags} == {"0", "1"} and all(s.labels["model_name"] == "tiny" for s in flags)
    assert all(s.labels["model_name"] == "tiny" for s in families["vllm:num_requests_running"].samples)
    # Speculative decoding series come from the engine that drafts, and only from it.
    drafted = families["vllm:spec_decode_num_draft_tokens"].samples
    accepted = families["vllm:spec_decode_num_accepted_tokens"].samples
    assert [s.labels["engine"] for s in drafted] == ["1"] and drafted[0].value > 0
    assert 0 <= accepted[0].value <= drafted[0].value
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert sorted(s.labels["position"] for s in per_pos) == ["0", "1", "2"]
    assert sum(s.value for s in per_pos) == accepted[0].value
    # Prefill/decode legs, the router's and the client's: blocks sent by the prefill engine only, as
    # many read; the router handed prompts on (its counter is per replica: summed).
    sent = {s.labels["engine"]: s.value for s in families["llm_cluster:kv_transfer_sent_blocks"].samples
            if s.name.endswith("_total")}
    received = sum(s.value for s in families["llm_cluster:kv_transfer_received_blocks"].samples
                   if s.name.endswith("_total"))
    assert sent["1"] == 0 and sum(sent.values()) == received > 0
    prefills = [s for s in families["llm_cluster:router_remote_prefills"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in prefills if s.labels["outcome"] == "handed_on") > 0
    assert sum(s.value for s in families["llm_cluster:kv_transfer_held_requests"].samples) == 0


def test_engine_series_are_the_same_whichever_replica_answers(observed):
    served, _ = observed

    def engine_counters() -> dict:
        text = httpx.get(f"{served.base}/metrics", timeout=60).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("vllm:generation_tokens_total", "vllm:request_success_total")}

    # Idle cluster: several scrapes (spread over both replicas) must agree exactly.
    samples = [engine_counters() for _ in range(6)]
    assert all(s == samples[0] for s in samples) and samples[0]


@pytest.mark.parametrize("expr", dashboard_queries())
def test_every_dashboard_query_returns_data(observed, expr):
    assert_query_has_data(observed[1], expr)


def test_the_engines_panel_counts_the_engines_serving(observed):
    """The panel engine autoscaling is watched on: one series per model, the engines that answer."""
    _, prom = observed
    [expr] = [e for e in dashboard_queries() if e.startswith("count by (model_name)")]
    [series] = query_with_data(prom, expr)
    assert series["metric"] == {"model_name": "tiny"} and float(series["value"][1]) == 2


@pytest.mark.parametrize("expr", VLLM_DASHBOARD_QUERIES)
def test_vllm_example_dashboard_queries_return_data(observed, expr):
    _, prom = observed
    assert query_with_data(prom, expr), f"no data for {expr}"


def test_streamed_answers_are_the_same_from_the_drafting_and_the_plain_engine(observed):
    """Greedy streams through the whole stack (HAProxy, a router replica, an engine): the engine
    that drafts (n-gram, several tokens per pass) answers exactly as the one that does not."""
    import openai

    served, _ = observed

    def drafts() -> float:
        text = httpx.get(f"{served.base}/metrics", timeout=60).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:spec_decode_num_drafts_total")

    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0, timeout=60)
    before = drafts()
    texts = []
    # Round robin in each of the two replicas: six requests reach both engines.
    for _ in range(6):
        stream = client.completions.create(model="tiny", prompt="one two three one two three one two", max_tokens=24,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    assert drafts() > before, "the drafting engine answered none of them"
    assert len(set(texts)) == 1 and texts[0]
