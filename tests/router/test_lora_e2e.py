"""LoRA through the whole stack: adapters named as the model by the openai client, loaded at start
and at runtime, routed, cached and counted; the answers checked against PEFT's own model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from cluster.config import ClusterConfig, EngineSpec
from tests.lora_adapters import peft_model, save_adapter
from tests.serve_cluster import serve_cluster

pytestmark = pytest.mark.slow

PROMPT = "Paris is the capital of France. Berlin is"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": save_adapter(tiny_model_dir, root / "a", seed=11),
            "b": save_adapter(tiny_model_dir, root / "b", seed=12, r=4, targets=("q_proj", "v_proj")),
            "bad": save_adapter(tiny_model_dir, root / "bad", seed=13, r=32)}


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model_dir, adapters):
    config = ClusterConfig(
        model=str(tiny_model_dir), served_model_name="tiny", num_engines=2, routing_policy="prefix_aware",
        defaults=EngineSpec(num_gpu_blocks=96, max_model_len=256, block_size=4),
        enable_lora=True, lora_modules=[f"a={adapters['a']}"], max_loras=2, max_lora_rank=16,
        allow_runtime_lora_updating=True)
    # A second router app over the same engines: its replica learns of runtime loads from the engines.
    # A third routes round robin, so a test can send a request to each engine in turn.
    with serve_cluster(config, {"other": config,
                                "rr": config.model_copy(update={"routing_policy": "round_robin"})}) as served:
        yield served


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0, timeout=60)


def _peft_greedy_text(model_dir, adapter_kwargs: dict | None, prompt: str, max_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(prompt)
    if adapter_kwargs is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        model = peft_model(model_dir, **adapter_kwargs)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             eos_token_id=None, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def _greedy(client, model: str, prompt: str = PROMPT, max_tokens: int = 10):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_models_lists_the_adapter_with_its_base(cluster, adapters):
    data = httpx.get(f"{cluster.base}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("a", "tiny")]
    assert data[1]["root"] == str(adapters["a"])


def test_the_adapter_answers_as_peft_and_the_base_model_as_before(client, tiny_model_dir):
    lora = _greedy(client, "a")
    base = _greedy(client, "tiny")
    assert lora.model == "a" and base.model == "tiny"
    assert lora.choices[0].text == _peft_greedy_text(tiny_model_dir, {"seed": 11}, PROMPT, 10)
    assert base.choices[0].text == _peft_greedy_text(tiny_model_dir, None, PROMPT, 10)
    assert lora.choices[0].text != base.choices[0].text


def test_streamed_chat_under_the_adapter(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="a", messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="a", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert {c.model for c in chunks} == {"a"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages, max_tokens=2)


def test_kv_blocks_are_shared_within_an_adapter_never_across(cluster, client):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3

    def hits() -> int:
        return sum(s.prefix_cache_hits for s in cluster.stats())

    _greedy(client, "a", prompt, 2)
    first = hits()
    _greedy(client, "tiny", prompt, 2)  # the same tokens under the base model: nothing to reuse
    assert hits() == first
    _greedy(client, "a", prompt, 2)  # routed back to the engine holding the adapter's blocks
    assert hits() >= first + 16


def test_runtime_loading_unloading_and_refusals(cluster, client, adapters, tiny_model_dir):
    base, other = cluster.base, f"{cluster.base}/other"
    r = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])})
    assert r.status_code == 200, r.text
    # The other app's replica never saw the load: it finds "b" on the engines.
    r = httpx.post(f"{other}/v1/completions", timeout=60, json={
        "model": "b", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["model"] == "b"
    assert r.json()["choices"][0]["text"] == _peft_greedy_text(
        tiny_model_dir, {"seed": 12, "r": 4, "targets": ("q_proj", "v_proj")}, PROMPT, 10)
    assert [m["id"] for m in httpx.get(f"{other}/v1/models").json()["data"]] == ["tiny", "a", "b"]

    again = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["b"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(adapters["bad"])})
    assert bad.status_code == 400 and "above --max-lora-rank 16" in bad.json()["error"]["message"]
    missing = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert missing.status_code == 404 and "No adapter found at /nonexistent" in missing.json()["error"]["message"]
    assert "bad" not in [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]

    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
    # The other replica still had "b" cached: the engine refuses it, and the client gets a 404.
    r = httpx.post(f"{other}/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert [s.healthy for s in cluster.stats()] == [True, True]  # a refused adapter is not an engine fault


def test_metrics_count_requests_per_adapter(cluster, client):
    _greedy(client, "a", max_tokens=2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = httpx.get(f"{cluster.base}/metrics").text
        if 'llm_cluster:lora_num_requests_running{engine="' in text:
            break
        time.sleep(0.2)
    assert "vllm:lora_requests_info{" in text and 'max_lora="2"' in text
    running = [line for line in text.splitlines()
               if line.startswith("llm_cluster:lora_num_requests_running{") and 'lora_name="a"' in line]
    assert running and all(line.endswith(" 0.0") for line in running)  # seen, now finished


def _engine_loras(cluster) -> list[dict[str, int]]:
    import ray

    return [{lora.lora_name: lora.lora_int_id for lora in ray.get(e.actor.list_loras.remote())}
            for e in cluster.engines]


def _load(base: str, name: str, path) -> httpx.Response:
    return httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60)


def test_an_adapter_in_use_is_not_unloaded_from_any_engine(cluster, adapters):
    import ray

    from engine_core.sched.scheduler import PauseState

    base = cluster.base
    assert _load(base, "busy", adapters["b"]).status_code == 200
    # Engines that schedule nothing keep the request unfinished for as long as the test needs.
    ray.get([e.actor.pause.remote(int(PauseState.PAUSED_ALL)) for e in cluster.engines])
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{base}/v1/completions", timeout=60,
                              json={"model": "busy", "prompt": PROMPT, "max_tokens": 4})
        try:
            deadline = time.monotonic() + 20
            while sum(s.num_unfinished_requests for s in cluster.stats()) == 0:
                assert time.monotonic() < deadline, "the request never reached an engine"
                time.sleep(0.05)
            r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "busy"})
            assert r.status_code == 400 and "in use by 1 requests" in r.json()["error"]["message"]
            assert all("busy" in loras for loras in _engine_loras(cluster))  # on every engine still
        finally:
            ray.get([e.actor.resume.remote() for e in cluster.engines])
        assert pending.result().status_code == 200
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "busy"}).status_code == 200
    assert not any("busy" in loras for loras in _engine_loras(cluster))


def test_a_reload_gets_a_new_id_so_old_kv_is_never_reused(cluster, adapters):
    base = cluster.base
    assert _load(base, "again", adapters["b"]).status_code == 200
    first = _engine_loras(cluster)[0]["again"]
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200
    assert _load(base, "again", adapters["b"]).status_code == 200
    second = _engine_loras(cluster)
    assert second[0]["again"] == second[1]["again"] != first
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "again"}).status_code == 200


def test_an_in_place_reload_serves_new_weights_while_running_requests_finish_with_theirs(cluster, adapters,
                                                                                         tiny_model_dir):
    """load_inplace, as a trainer publishing new weights under one name uses it: a request running
    under the earlier load (held by paused engines) finishes with the earlier weights; the next
    requests get the new ones, through the replica that reloaded it and through another that still
    knew the earlier load (the engines refuse it, and that replica looks the name up again)."""
    import ray

    from engine_core.sched.scheduler import PauseState

    base, other = cluster.base, f"{cluster.base}/other"
    body = {"model": "hot", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    old_text = _peft_greedy_text(tiny_model_dir, {"seed": 11}, PROMPT, 10)
    new_text = _peft_greedy_text(tiny_model_dir, {"seed": 12, "r": 4, "targets": ("q_proj", "v_proj")}, PROMPT, 10)
    assert _load(base, "hot", adapters["a"]).status_code == 200
    assert httpx.post(f"{other}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == old_text
    ray.get([e.actor.pause.remote(int(PauseState.PAUSED_ALL)) for e in cluster.engines])
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
        try:
            deadline = time.monotonic() + 20
            while sum(s.num_unfinished_requests for s in cluster.stats()) == 0:
                assert time.monotonic() < deadline, "the request never reached an engine"
                time.sleep(0.05)
            r = httpx.post(f"{base}/v1/load_lora_adapter", timeout=60, json={
                "lora_name": "hot", "lora_path": str(adapters["b"]), "load_inplace": True})
            assert r.status_code == 200, r.text
        finally:
            ray.get([e.actor.resume.remote() for e in cluster.engines])
        assert pending.result().json()["choices"][0]["text"] == old_text
    for url in (other, base):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == new_text
    ids = [loras["hot"] for loras in _engine_loras(cluster)]
    assert len(set(ids)) == 1
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "hot"}).status_code == 200


def test_an_engine_that_lost_a_runtime_adapter_gets_it_back(cluster, adapters):
    """A restarted engine actor comes back with the --lora-modules adapters only: the router loads
    a runtime one there again when a request needs it."""
    import ray

    base, rr = cluster.base, f"{cluster.base}/rr"
    assert _load(base, "kept", adapters["b"]).status_code == 200
    lost = _engine_loras(cluster)[0]["kept"]
    assert ray.get(cluster.engines[0].actor.remove_lora.remote(lost))  # as a restart would
    codes = [httpx.post(f"{rr}/v1/completions", timeout=60, json={
        "model": "kept", "prompt": PROMPT, "max_tokens": 2}).status_code for _ in range(2)]
    assert codes == [200, 200]  # one of them went to engine 0
    assert [loras.get("kept") for loras in _engine_loras(cluster)] == [lost, lost]
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "kept"}).status_code == 200
