"""Prefill/decode disaggregation through the whole stack: one prefill engine, two decode engines,
the openai client; answers checked against transformers, and the engines' counters showing the KV
blocks handed from the prefill engine to the decode engines."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.config import ClusterConfig, EngineSpec, prefill_decode_overrides
from tests.serve_cluster import serve_cluster

pytestmark = pytest.mark.slow

PROMPT = "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of"
# (Another prompt for the client-driven legs: no decode engine holds any of it in its prefix cache.)
OTHER_PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on in the warm sun"


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model_dir):
    config = ClusterConfig(
        model=str(tiny_model_dir), served_model_name="tiny", num_engines=3, routing_policy="prefix_aware",
        defaults=EngineSpec(num_gpu_blocks=96, max_model_len=256, block_size=4),
        engines=prefill_decode_overrides(1, 3, {"kv_connector": "NixlConnector"}, []))
    # A second router over the same engines that knows nothing of their roles, routing round robin:
    # a client drives the two legs itself through it, as vLLM's disaggregation proxy does.
    plain = config.model_copy(update={"routing_policy": "round_robin", "engines": []})
    # A third with the roles and a prefill threshold no prompt here reaches (llm-d's selective P/D).
    selective = config.model_copy(update={"pd_prefill_threshold": 10_000})
    with serve_cluster(config, {"plain": plain, "selective": selective}) as served:
        yield served


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy_text(model_dir, prompt: str, max_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
    return tokenizer.decode(out[0, ids.shape[1]:])


def _tokens(model_dir, prompt: str) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir).encode(prompt)


def _counters(cluster) -> list[tuple[int, int, int]]:
    return [(s.kv_transfer_sent_blocks, s.kv_transfer_received_blocks, s.num_requests_added)
            for s in cluster.stats()]


def test_prompts_are_computed_on_the_prefill_engine_and_decoded_on_the_others(cluster, client, tiny_model_dir):
    expected = _greedy_text(tiny_model_dir, PROMPT, 12)
    before = _counters(cluster)
    answers = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [a.choices[0].text for a in answers] == [expected] * 2
    # Streamed chat too: the chunks add up to what the same conversation answers whole.
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole
    after = _counters(cluster)
    sent = after[0][0] - before[0][0]
    received = [after[i][1] - before[i][1] for i in (1, 2)]
    # Engine 0 computed the prompts and handed their blocks on; the decode engines read them. (A repeat
    # whose decode engine has reported caching the prompt by then is computed there, not on engine 0.)
    assert 2 <= after[0][2] - before[0][2] <= 4 and sent == sum(received) and sent > 0
    assert after[0][1] == before[0][1] and after[1][0] == after[2][0] == 0
    assert sum(after[i][2] - before[i][2] for i in (1, 2)) == 4
    assert all(s.kv_transfer_held_requests == 0 for s in cluster.stats())
    metrics = httpx.get(f"{cluster.base}/metrics", timeout=10).text
    handed = [line for line in metrics.splitlines()
              if line.startswith("llm_cluster:router_remote_prefills_total") and 'outcome="handed_on"' in line]
    assert handed and float(handed[0].rsplit(" ", 1)[1]) >= 2


def test_requests_that_gain_nothing_are_served_whole_by_a_decode_engine(cluster, client, tiny_model_dir):
    before = _counters(cluster)
    one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0.0)
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.0,
                                       extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    assert scored.choices[0].text == _greedy_text(tiny_model_dir, PROMPT, 3)
    assert one.choices[0].finish_reason == "length"
    after = _counters(cluster)
    assert after[0] == before[0]  # (the prefill engine saw neither)
    assert sum(after[i][2] - before[i][2] for i in (1, 2)) == 2


def test_a_client_can_drive_both_legs_itself_with_kv_transfer_params(cluster, tiny_model_dir):
    # Through the router that knows no roles, round robin from engine 0: the prefill leg reaches the
    # prefill engine, the decode leg the next engine (a decode engine).
    base = f"{cluster.base}/plain/v1"
    before = _counters(cluster)
    prefill = httpx.post(f"{base}/completions", timeout=60, json={
        "model": "tiny", "prompt": OTHER_PROMPT, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"] and params["remote_engine_id"]
    decode = httpx.post(f"{base}/completions", timeout=60, json={
        "model": "tiny", "prompt": OTHER_PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
        "kv_transfer_params": params}).json()
    assert decode["choices"][0]["text"] == _greedy_text(tiny_model_dir, OTHER_PROMPT, 8)
    assert "kv_transfer_params" not in decode
    after = _counters(cluster)
    # (The blocks holding every prompt token but the last, which the decode engine computes itself.)
    read = after[1][1] - before[1][1]
    assert after[0][0] - before[0][0] == read and len(params["remote_block_ids"]) - 1 <= read > 0


def test_the_choices_of_one_prompt_share_one_prefill(cluster, client, tiny_model_dir):
    prompt = "One prompt, several choices: " + PROMPT
    before = _counters(cluster)
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, n=3, seed=7,
                                       extra_body={"ignore_eos": True})
    assert len(answer.choices) == 3 and answer.usage.completion_tokens == 18
    assert all(c.finish_reason == "length" for c in answer.choices)
    after = _counters(cluster)
    # One prefill on engine 0 for the three choices, read once: the choices go to one decode engine,
    # where the first reads the blocks and the others find them in its prefix cache (at most the last,
    # partial block read again).
    assert after[0][2] - before[0][2] == 1
    sent = after[0][0] - before[0][0]
    assert sent > 0 and sum(after[i][1] - before[i][1] for i in (1, 2)) == sent
    blocks = -(-len(_tokens(tiny_model_dir, prompt)) // 4)
    assert sent <= blocks + 2
    assert all(s.kv_transfer_held_requests == 0 for s in cluster.stats())


def test_a_clients_prefill_leg_goes_to_a_prefill_engine_where_roles_are_split(cluster, tiny_model_dir):
    prompt = "A client's own legs, through the router that knows the roles: " + OTHER_PROMPT
    before = _counters(cluster)
    prefill = httpx.post(f"{cluster.base}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"]
    decode = httpx.post(f"{cluster.base}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True,
        "kv_transfer_params": params}).json()
    assert decode["choices"][0]["text"] == _greedy_text(tiny_model_dir, prompt, 5)
    after = _counters(cluster)
    assert after[0][2] - before[0][2] == 1  # (only the client's prefill leg: its decode leg ran no other)
    assert after[0][0] - before[0][0] == sum(after[i][1] - before[i][1] for i in (1, 2)) > 0


def test_prompts_below_the_prefill_threshold_are_computed_where_they_are_decoded(cluster, tiny_model_dir):
    prompt = "Selective disaggregation: " + PROMPT + " and of Spain"
    before = _counters(cluster)
    answer = httpx.post(f"{cluster.base}/selective/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}).json()
    assert answer["choices"][0]["text"] == _greedy_text(tiny_model_dir, prompt, 6)
    after = _counters(cluster)
    assert after[0] == before[0] and sum(after[i][2] - before[i][2] for i in (1, 2)) == 1
