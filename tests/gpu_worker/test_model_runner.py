"""ModelRunner end to end: the engine's Scheduler drives it, HF generate is the reference."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from gpu_worker.config import ModelConfig
from tests.gpu_worker.utils import (
    LONGROPE,
    greedy_request,
    hf_greedy,
    load_hf,
    make_runner,
    make_scheduler,
    prefill_logits,
    run_to_completion,
    save_tiny_model,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf(model_dir)


def prompts(seed: int, n: int, lo: int = 3, hi: int = 30, prefix: list[int] | None = None) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"s{seed}-r{i}": (prefix or []) + [rng.randrange(256) for _ in range(rng.randrange(lo, hi))]
            for i in range(n)}


def runner_for(model_dir, decode_in_place: bool, **kwargs):
    """decode_in_place: the CPU kernel reading the paged cache; otherwise gather + SDPA (the CUDA path)."""
    runner = make_runner(model_dir, **kwargs)
    assert runner.decode_in_place, "the CPU decode kernel should be in use on a fp32 CPU runner"
    runner.decode_in_place = decode_in_place
    return runner


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize(("budget", "threshold"), [(7, 0), (13, 5), (64, 0)])
def test_greedy_matches_hf_with_chunked_prefill(model_dir, hf_model, budget, threshold, decode_in_place):
    runner = runner_for(model_dir, decode_in_place, num_blocks=64, block_size=4)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold)
    ps = prompts(budget, 4)
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 8))
    mixed_steps = []

    def on_step(step, so):
        n = so.num_scheduled_tokens
        if any(v == 1 for v in n.values()) and any(v > 1 for v in n.values()):
            mixed_steps.append(step)

    got = run_to_completion(sched, runner.execute_model, on_step=on_step)
    if budget < 64:
        assert mixed_steps, "expected steps mixing decodes with prefill chunks"
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf_model, p, 8), rid


def test_the_gather_path_takes_attention_outputs_laid_out_as_cuda_kernels_give_them(model_dir, hf_model,
                                                                                   monkeypatch):
    """CUDA's fused SDPA kernels write their output as [batch, rows, heads, head_dim] and hand it back
    transposed to [batch, heads, rows, head_dim]: the same values, not contiguous. Decodes (alone and
    beside prefill chunks) must flatten it by value, as here where the CPU's SDPA is made to answer
    so."""
    real = torch.nn.functional.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        return real(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_layout)
    # (A 13-token budget: steps of decodes alone, and of decodes beside prefill chunks.)
    test_greedy_matches_hf_with_chunked_prefill(model_dir, hf_model, 13, 0, decode_in_place=False)


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize(("kind", "overrides"), [
    ("qwen3", {"head_dim": 32}),
    ("mixtral", {}),
    ("qwen2_moe", {"mlp_only_layers": [1]}),
    ("qwen3_moe", {"head_dim": 32}),
    ("gemma", {}),
    ("gemma2", {"attn_logit_softcapping": 1.5}),
    ("gemma3", {"num_hidden_layers": 3}),
    ("gpt_oss", {"num_hidden_layers": 3}),
    ("glm4_moe", {"num_hidden_layers": 3, "use_qk_norm": True}),
    ("deepseek_v3", {"num_hidden_layers": 3}),
    ("deepseek_v2", {}),
    ("minicpm3", {}),
    ("minicpm5_moe", {}),
    ("glm4_moe_lite", {}),
    ("exaone_moe", {}),
    ("gemma3n", {}),
    ("gemma4", {}),
    ("solar_open", {}),
    ("youtu", {}),
    ("afmoe", {"num_hidden_layers": 4}),
    ("laguna", {}),
    ("mellum", {}),
    ("mimo_v2_flash", {}),
    ("kolibri1", {}),
    ("flint", {}),
    ("nanochat", {}),
    ("beam", {}),
    ("jetmoe", {}),
    ("longcat_flash", {"num_hidden_layers": 4}),
    ("modernbert_decoder", {}),
    ("deepseek_v32", {}),
    ("glm_moe_dsa", {"num_hidden_layers": 3}),
], ids=["qwen3", "mixtral", "qwen2_moe_shared_expert_dense_layer", "qwen3_moe", "gemma", "gemma2_capped",
        "gemma3", "gpt_oss", "glm4_moe", "deepseek_v3", "deepseek_v2", "minicpm3", "minicpm5_moe", "glm4_moe_lite",
        "exaone_moe", "gemma3n", "gemma4", "solar_open", "youtu", "afmoe", "laguna",
        "mellum", "mimo_v2_flash", "kolibri1", "flint", "nanochat", "beam", "jetmoe", "longcat_flash",
        "modernbert_decoder", "deepseek_v32", "glm_moe_dsa"])
def test_other_architectures_greedy_match_hf(tmp_path, kind, overrides, decode_in_place):
    """Qwen3's per-head q/k norms and own head_dim (32 here; hidden / heads is 16), routed experts,
    and Gemma's (soft caps binding in every attention call, windowed layers beside full ones, Gemma
    3's two RoPEs), GPT-OSS's (sinks on every attention path, biased experts), through chunked
    prefill and decode on both attention paths: every step mixes the tokens of several requests, so
    each expert's group holds rows of different requests, in varying numbers."""
    _greedy_through_chunks_as_transformers(save_tiny_model(tmp_path, kind, **overrides), decode_in_place)


def _greedy_through_chunks_as_transformers(path, decode_in_place: bool) -> None:
    """Five prompts through chunked prefill (chunks of 5) and decode, several requests a step: the greedy
    tokens are transformers'."""
    hf = load_hf(path)
    runner = runner_for(path, decode_in_place, num_blocks=64, block_size=4)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=13, long_prefill_token_threshold=5)
    ps = prompts(7, 5)
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 10))
    got = run_to_completion(sched, runner.execute_model)
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf, p, 10), rid


def _hf_cached_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' model run step by step over its own KV cache (its rotary picks LongRoPE's
    factors from each step's sequence length). Its ``generate`` for Phi-3 also drops the cache and
    recomputes the whole sequence once it outgrows the pretrained length; we (like vLLM) keep it."""
    import torch

    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for step in range(max_new_tokens - 1):
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True,
                     position_ids=torch.tensor([[len(prompt) + step]]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("variant", ["plain", "drafts", "preemption"])
def test_longrope_switches_to_the_long_factors_as_transformers_does(tmp_path, variant):
    """Phi-3 128k's LongRoPE, pretrained length 24: a prompt longer than that uses the long factors
    for all its chunks (transformers sees the whole prompt at once); a shorter one uses the short
    factors until its sequence outgrows 24 while decoding, then the long ones, the keys already
    cached staying as they were computed. Both kinds share the batches; each request follows its own
    length (vLLM switches a whole batch once any of its sequences is long). The choice is per
    token: n-gram drafts that cross 24, and recomputing after a preemption past it (from a pool too
    small for every request, the prefix cache on), rotate each token as its own decode step did."""
    from engine_core.config import SpeculativeConfig
    from engine_core.spec_decode import NgramProposer

    path = save_tiny_model(tmp_path, "phi3", original_max_position_embeddings=24, rope_scaling=LONGROPE)
    hf = load_hf(path)
    num_blocks = 20 if variant == "preemption" else 96
    spec = 3 if variant == "drafts" else 0
    runner = make_runner(path, num_blocks=num_blocks, block_size=4, num_spec_tokens=spec)
    assert (runner.rope_short_offset, runner.rope_original_len) == (256, 24)
    # (Without the prefix cache a preempted request recomputes all it had, across the threshold.)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=13,
                           long_prefill_token_threshold=5, num_spec_tokens=spec,
                           prefix_caching=variant != "preemption")
    # Repeating prompts, so that n-grams find drafts.
    ps = {**{k: v * 2 for k, v in prompts(3, 3, lo=7, hi=11).items()}, **prompts(4, 2, lo=30, hi=40)}
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 12))
    seen = {"drafts": 0, "preempted": 0}

    def on_step(_: int, so) -> None:
        seen["drafts"] += len(so.scheduled_spec_decode_tokens)
        seen["preempted"] += len(so.preempted_req_ids)

    drafter = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2),
                            max_model_len=sched.max_model_len) if spec else None
    got = run_to_completion(sched, runner.execute_model, on_step=on_step, drafter=drafter)
    assert seen["drafts"] if variant == "drafts" else True
    assert seen["preempted"] if variant == "preemption" else True
    for rid, p in ps.items():
        assert got[rid] == _hf_cached_greedy(hf, p, 12), rid
        if len(p) > 24:  # long from the start: transformers' generate agrees too
            assert got[rid] == hf_greedy(hf, p, 12), rid


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize(("kind", "overrides"), [
    ("mistral", {"sliding_window": 6}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    ("llama4", {"attention_chunk_size": 6}),
], ids=["mistral_every_layer", "qwen2_upper_layer", "llama4_chunked_attention"])
def test_sliding_window_greedy_matches_hf(tmp_path, kind, overrides, decode_in_place):
    """Sequences run far past the window, through chunked prefill (chunks starting past it), decodes
    beside prefills, a preemption and a prefix-cache hit, on both attention paths. Where every layer
    is windowed (Mistral), the scheduler releases the blocks behind each request's window as it goes,
    and other requests reuse them while the runner's tables still list them. Llama 4's chunked
    attention (chunks of 6 keys, across block edges) in its rotating layers, beside full layers."""
    path = save_tiny_model(tmp_path, kind, **overrides)
    config = ModelConfig.from_pretrained(path)
    hf = load_hf(path)
    num_blocks = 24 if config.uniform_sliding_window is None else 10
    runner = runner_for(path, decode_in_place, num_blocks=num_blocks, block_size=4)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=13,
                           long_prefill_token_threshold=5, sliding_window=config.uniform_sliding_window)
    ps = prompts(11, 4, lo=10, hi=30, prefix=[9, 8, 7, 6, 5, 4, 3, 2])
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 12))
    seen = {"preempted": 0, "hits": 0, "held": 0, "positions": 0}
    kv = sched.kv_cache_manager

    def on_step(step, so):
        seen["preempted"] += len(so.preempted_req_ids)
        seen["hits"] += sum(1 for r in so.scheduled_new_reqs if r.num_computed_tokens)
        seen["held"] = max([seen["held"], *(kv.get_num_held_blocks(r.request_id) for r in sched.running)])
        seen["positions"] = max([seen["positions"], *(kv.get_num_blocks(r.request_id) for r in sched.running)])

    got = run_to_completion(sched, runner.execute_model, on_step=on_step)
    assert seen["preempted"] and seen["hits"]
    if config.uniform_sliding_window is not None:
        # A request holds at most its window's keys plus a pass's tokens, in blocks (here 5 + 5 keys
        # span at most 4 blocks), though its sequence spans many more.
        assert seen["held"] <= 4 < seen["positions"]
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf, p, 12), rid


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize(("kind", "overrides"), [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    ("gemma2", {"sliding_window": 5}),
    ("gpt_oss", {"sliding_window": 5}),
    ("llama4", {"attention_chunk_size": 6}),
], ids=["qwen2_upper_layer", "gemma2_alternating", "gpt_oss_sinks", "llama4_chunked_attention"])
def test_hybrid_kv_cache_groups_greedy_matches_hf(tmp_path, kind, overrides, decode_in_place):
    """The hybrid KV cache manager: the full-attention and windowed layers keep their caches in KV cache
    groups over shared tensors (a block id a page of each), each group its own blocks of a request,
    the windowed group's released behind the window. The same run as above (chunked prefill past the
    window, decodes beside prefills, preemptions, prefix hits) gives transformers' tokens, and a
    request's windowed blocks stay within the window's bound while its full ones grow with it."""
    path = save_tiny_model(tmp_path, kind, **overrides)
    hf = load_hf(path)
    from gpu_worker.kv_cache_groups import group_attention_layers

    config = ModelConfig.from_pretrained(path)
    runner = runner_for(path, decode_in_place, num_blocks=24, block_size=4, kv_cache_grouping=group_attention_layers(
        [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)]))
    grouping = runner.kv_cache_grouping
    assert grouping is not None and grouping.windows[0] is None and grouping.windows[-1] is not None
    # (Layers of different groups share a tensor: the cache is group_size tensors, not one a layer.)
    assert len({layer.kv_cache[0].data_ptr() for layer in runner.model.attention_layers()}) == grouping.group_size
    runner.profile_run(4)  # (the memory profile's pass builds each group's metadata too, on throwaway caches)
    assert len({layer.kv_cache[0].data_ptr() for layer in runner.model.attention_layers()}) == grouping.group_size
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=13, long_prefill_token_threshold=5,
                           kv_cache_groups=grouping.engine_windows)
    ps = prompts(11, 4, lo=10, hi=30, prefix=[9, 8, 7, 6, 5, 4, 3, 2])
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 12))
    seen = {"preempted": 0, "hits": 0, "windowed": 0, "positions": 0}
    kv = sched.kv_cache_manager
    windowed = kv.groups[-1]

    def on_step(step, so):
        seen["preempted"] += len(so.preempted_req_ids)
        seen["hits"] += sum(1 for r in so.scheduled_new_reqs if r.num_computed_tokens)
        for r in sched.running:
            held = len(windowed.req_to_blocks[r.request_id]) - windowed.num_released_block.get(r.request_id, 0)
            seen["windowed"] = max(seen["windowed"], held)
            seen["positions"] = max(seen["positions"], kv.get_num_blocks(r.request_id))
        kv.block_pool.check_integrity()

    got = run_to_completion(sched, runner.execute_model, on_step=on_step)
    assert seen["preempted"] and seen["hits"]
    # A window of 5 (or a chunk of 6) keys and a pass's 5 tokens span at most 4 blocks of 4.
    assert seen["windowed"] <= 4 < seen["positions"]
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf, p, 12), rid
    assert kv.block_pool.get_num_free_blocks() == 24


def test_the_rotary_tables_hold_the_positions_served(tmp_path):
    """A max_model_len below the model's context: the rotary tables are cut to it, the logits the same."""
    from gpu_worker.model_runner import ModelRunner

    path = save_tiny_model(tmp_path, "llama", max_position_embeddings=256)
    full = make_runner(path, num_blocks=16)
    short = ModelRunner(ModelConfig.from_pretrained(path), device="cpu", dtype=torch.float32, max_model_len=48)
    short.load_model(path)
    short.initialize_kv_cache(16, 4)
    assert full.model.model.rotary_emb.cos_cache.shape[0] == 256
    assert short.model.model.rotary_emb.cos_cache.shape[0] == 48
    prompt = [(5 * i + 1) % 256 for i in range(40)]
    torch.testing.assert_close(prefill_logits(short, prompt, list(range(10))),
                               prefill_logits(full, prompt, list(range(10))))


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_preemption_and_resume_match_hf(model_dir, hf_model, decode_in_place):
    runner = runner_for(model_dir, decode_in_place, num_blocks=16, block_size=4)
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    ps = prompts(1, 4, lo=8, hi=16)
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 10))
    seen = {"preempted": 0, "resumed": 0}

    def on_step(step, so):
        seen["preempted"] += len(so.preempted_req_ids)
        seen["resumed"] += sum(so.scheduled_cached_reqs.resumed_from_preemption)

    got = run_to_completion(sched, runner.execute_model, on_step=on_step)
    assert seen["preempted"] and seen["resumed"]
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf_model, p, 10), rid


def test_prefix_sharing_including_same_step_hits(model_dir, hf_model):
    runner = make_runner(model_dir, num_blocks=64, block_size=4)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=128)
    prefix = [random.Random(5).randrange(256) for _ in range(13)]
    ps = prompts(2, 3, lo=2, hi=9, prefix=prefix)
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 6))
    same_step_hits = []

    def on_step(step, so):
        if step == 0:
            same_step_hits.extend(n.num_computed_tokens for n in so.scheduled_new_reqs[1:])

    got = run_to_completion(sched, runner.execute_model, on_step=on_step)
    # Later requests hit blocks the first request fills in that very step.
    assert same_step_hits and all(n >= 12 for n in same_step_hits)
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf_model, p, 6), rid
    # A later request hits blocks cached by finished ones.
    late = prefix + [9, 8, 7]
    sched.add_request(greedy_request("late", late, 4))
    hits = []
    got = run_to_completion(sched, runner.execute_model,
                            on_step=lambda s, so: hits.extend(n.num_computed_tokens for n in so.scheduled_new_reqs))
    assert hits[0] == 12 and got["late"] == hf_greedy(hf_model, late, 4)


def _so(new=(), cached: CachedRequestData | None = None, num: dict | None = None,
        finished=(), preempted=()) -> SchedulerOutput:
    num = num or {}
    return SchedulerOutput(list(new), cached or CachedRequestData(), num, sum(num.values()), set(finished),
                           set(preempted))


def test_hand_built_chunks_mid_prefill_and_resume(model_dir, hf_model):
    runner = make_runner(model_dir, num_blocks=32, block_size=4)
    prompt = [(13 * i + 1) % 256 for i in range(15)]
    ref = hf_greedy(hf_model, prompt, 3)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    # Chunks of 5, 3 and 7 tokens: the first two end mid-prompt and sample nothing.
    out = runner.execute_model(_so([NewRequestData("a", prompt, greedy, [3, 9], 0)], num={"a": 5}))
    assert out.req_ids == ["a"] and out.sampled_token_ids == [[]] and out.req_id_to_index == {"a": 0}
    out = runner.execute_model(_so(cached=CachedRequestData(["a"], [False], [prompt[5:8]], [None], [5], [0]),
                                   num={"a": 3}))
    assert out.sampled_token_ids == [[]]
    out = runner.execute_model(_so(cached=CachedRequestData(["a"], [False], [prompt[8:]], [[14, 2]], [8], [0]),
                                   num={"a": 7}))
    assert out.sampled_token_ids == [[ref[0]]]
    out = runner.execute_model(_so(cached=CachedRequestData(["a"], [False], [[ref[0]]], [None], [15], [0]),
                                   num={"a": 1}))
    assert out.sampled_token_ids == [[ref[1]]]
    # Preempted: state dropped (sampling params kept aside), then resumed with everything resent
    # into a fresh block table, from a 4-token prefix "hit" on block 3.
    runner.execute_model(_so(preempted={"a"}))
    assert "a" not in runner.requests.states
    tokens = prompt + ref[:2]
    resumed = CachedRequestData(["a"], [True], [tokens], [[3, 20, 21, 22, 23]], [4], [2])
    out = runner.execute_model(_so(cached=resumed, num={"a": len(tokens) - 4}))
    assert out.sampled_token_ids == [[ref[2]]]
    assert runner.requests["a"].output_token_ids == ref[:3]
    runner.execute_model(_so(finished={"a"}))
    assert not runner.requests.states


def test_continued_session_replaces_state_and_keeps_its_cache(model_dir, hf_model):
    """A streaming session's next chunk arrives as NewRequestData for a live id: the prompt now holds
    the earlier outputs, and the blocks already computed are reused."""
    runner = make_runner(model_dir, num_blocks=32, block_size=4)
    prompt = [(5 * i + 2) % 256 for i in range(9)]
    first = hf_greedy(hf_model, prompt, 2)
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    out = runner.execute_model(_so([NewRequestData("s", prompt, greedy, [0, 1, 2], 0)], num={"s": 9}))
    assert out.sampled_token_ids == [[first[0]]]
    out = runner.execute_model(_so(cached=CachedRequestData(["s"], [False], [[first[0]]], [None], [9], [1]),
                                   num={"s": 1}))
    assert out.sampled_token_ids == [[first[1]]]
    # The session stops after 2 tokens; its next input continues from everything so far. The
    # last output was sampled but never fed, so the cache holds 10 tokens.
    continued = prompt + first + [17, 18, 19]
    new = NewRequestData("s", continued, greedy, [0, 1, 2, 3], 10)
    out = runner.execute_model(_so([new], num={"s": len(continued) - 10}))
    assert out.sampled_token_ids == [hf_greedy(hf_model, continued, 1)]


def test_profile_run_leaves_the_cache_bound(model_dir):
    runner = make_runner(model_dir, num_blocks=8, block_size=4, max_num_batched_tokens=40, max_model_len=16,
                         max_num_seqs=3)
    caches = [layer.kv_cache for layer in runner.model.attention_layers()]
    runner.profile_run(4)
    assert all(layer.kv_cache is cache for layer, cache in zip(runner.model.attention_layers(), caches, strict=True))


def test_empty_step_and_unknown_request(model_dir):
    runner = make_runner(model_dir)
    out = runner.execute_model(SchedulerOutput.make_empty())
    assert out.req_ids == [] and out.sampled_token_ids == []
    with pytest.raises(KeyError, match="ghost"):
        runner.execute_model(_so(cached=CachedRequestData(["ghost"], [False], [[1]], [None], [3], [0]),
                                 num={"ghost": 1}))


def test_seeded_sampling_is_independent_of_the_batch(model_dir):
    def run(batch_extra: int) -> list[int]:
        runner = make_runner(model_dir, num_blocks=64, block_size=4)
        sched = make_scheduler(num_blocks=64, block_size=4)
        sched.add_request(Request("seeded", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=1.0, seed=1234,
                                                                               top_k=20, top_p=0.9)))
        for i in range(batch_extra):
            sched.add_request(Request(f"x{i}", [i + 1] * (3 + i), SamplingParams(max_tokens=5, temperature=1.0)))
        return run_to_completion(sched, runner.execute_model)["seeded"]

    alone = run(0)
    assert alone == run(3)
    assert len(set(alone)) > 1


def test_logprobs_and_min_tokens_through_the_runner(tmp_path, hf_model, model_dir):
    prompt = [11, 22, 33, 44, 55]
    first = hf_greedy(hf_model, prompt, 1)[0]
    # A model whose EOS is exactly the token greedy decoding picks first.
    path = save_tiny_model(tmp_path, "llama", eos_token_id=first)
    runner = make_runner(path)
    sched = make_scheduler()
    sched.add_request(Request("eos", prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=3),
                              eos_token_id=first))
    sched.add_request(Request("min", prompt, SamplingParams(max_tokens=4, min_tokens=2, temperature=0.0),
                              eos_token_id=first))
    logprobs = {}

    def execute(so):
        out = runner.execute_model(so)
        for rid, lp in zip(out.req_ids, out.logprobs or [None] * len(out.req_ids), strict=True):
            if lp is not None:
                logprobs.setdefault(rid, []).append(lp)
        return out

    got = run_to_completion(sched, execute)
    assert got["eos"] == [first]  # stops on EOS at once
    assert first not in got["min"][:2] and len(got["min"]) >= 2
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    [entry] = logprobs["eos"]
    assert entry.sampled_logprobs[0] == pytest.approx(ref[first].item(), abs=1e-4)
    top_ids = [t for t, _ in entry.top_logprobs[0]]
    assert top_ids == ref.topk(3).indices.tolist()
    assert "min" not in logprobs


def test_penalties_use_remembered_outputs(model_dir, hf_model):
    params = dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runner = make_runner(model_dir)
    sched = make_scheduler()
    sched.add_request(Request("p", prompt, SamplingParams(max_tokens=6, ignore_eos=True, **params)))
    got = run_to_completion(sched, runner.execute_model)["p"]
    seq, outs = list(prompt), []
    for _ in range(6):
        with torch.no_grad():
            logits = hf_model(torch.tensor([seq])).logits[0, -1].clone()
        for t in set(seq):
            logits[t] = logits[t] / 1.3 if logits[t] > 0 else logits[t] * 1.3
        for t in set(outs):
            logits[t] -= 0.7 * outs.count(t) + 0.4
        tok = int(logits.argmax())
        seq.append(tok)
        outs.append(tok)
    assert got == outs
    assert got != hf_greedy(hf_model, prompt, 6)  # the penalties did change the picks


@pytest.mark.parametrize("budget", [5, 64])
def test_prompt_logprobs_match_hf_across_chunks_and_skip_the_prefix_cache(model_dir, hf_model, budget):
    runner = make_runner(model_dir)
    sched = make_scheduler(max_num_batched_tokens=budget)
    prompt = [7, 3, 99, 42, 5, 17, 250, 8, 64, 1, 33, 2, 90]
    # The same prompt first without prompt logprobs, so its blocks are in the prefix cache.
    sched.add_request(greedy_request("warm", prompt, 2))
    run_to_completion(sched, runner.execute_model)
    sched.add_request(greedy_request("plp", prompt, 3, prompt_logprobs=2))
    sched.add_request(greedy_request("none", prompt[:5], 3))
    sent: dict[str, list] = {}
    outputs: dict[str, list] = {}

    def execute(so):
        out = runner.execute_model(so)
        for rid, entry in (out.prompt_logprobs or {}).items():
            sent.setdefault(rid, []).append(entry)
        return out

    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        for eco in sched.update_from_output(so, execute(so)).values():
            for o in eco.outputs:
                outputs.setdefault(o.request_id, []).append(o)
    assert list(sent) == ["plp"] and len(sent["plp"]) == 1  # once, when the prefill is complete
    [entry] = sent["plp"]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert len(entry.sampled_logprobs) == len(prompt) - 1
    for p in range(len(prompt) - 1):  # position p scores token p + 1
        assert entry.sampled_logprobs[p] == pytest.approx(ref[p, prompt[p + 1]].item(), abs=1e-4)
        assert [t for t, _ in entry.top_logprobs[p]] == ref[p].topk(2).indices.tolist()
    # The engine output carries them with the request's first token, and only there.
    first, *rest = outputs["plp"]
    assert first.new_token_ids and first.new_prompt_logprobs == entry
    assert all(o.new_prompt_logprobs is None for o in rest)
    assert first.num_cached_tokens == 0  # the cached prefix was not used


def test_prompt_logprobs_survive_preemption_and_are_sent_once(model_dir, hf_model):
    runner = make_runner(model_dir, num_blocks=16, block_size=4)
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    ps = prompts(1, 4, lo=8, hi=16)
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 10, prompt_logprobs=0))
    seen = {"preempted": 0, "resumed": 0}
    sent: dict[str, list] = {}

    def on_step(step, so):
        seen["preempted"] += len(so.preempted_req_ids)
        seen["resumed"] += sum(so.scheduled_cached_reqs.resumed_from_preemption)

    def execute(so):
        out = runner.execute_model(so)
        for rid, entry in (out.prompt_logprobs or {}).items():
            sent.setdefault(rid, []).append(entry)
        return out

    got = run_to_completion(sched, execute, on_step=on_step)
    assert seen["preempted"] and seen["resumed"]
    for rid, p in ps.items():
        assert got[rid] == hf_greedy(hf_model, p, 10), rid
        [entry] = sent[rid]
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0].log_softmax(-1)
        expected = [ref[i, p[i + 1]].item() for i in range(len(p) - 1)]
        assert entry.sampled_logprobs == pytest.approx(expected, abs=1e-4), rid


def test_linear_rope_scaling_serves_the_stretched_context_as_hf_computes_it(tmp_path):
    # 32 trained positions stretched 4x: the model serves 128, and matches HF beyond position 32.
    path = save_tiny_model(tmp_path, "llama", max_position_embeddings=32,
                           rope_scaling={"rope_type": "linear", "factor": 4.0})
    runner = make_runner(path, num_blocks=64, block_size=4)
    assert runner.max_model_len == 128
    hf_model = load_hf(path)
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=128)
    prompt = [random.Random(9).randrange(256) for _ in range(60)]
    sched.add_request(greedy_request("long", prompt, 12))
    got = run_to_completion(sched, runner.execute_model)
    assert got["long"] == hf_greedy(hf_model, prompt, 12)


def test_a_bad_word_is_banned_once_the_output_ends_with_its_beginning():
    from gpu_worker.model_runner import bad_word_completions

    prompt = [7, 8]
    words = [[5], [8, 9], [1, 2, 3]]
    # A one-token word is always banned; [8, 9] is not, though the prompt ends with 8 (only the output counts).
    assert bad_word_completions(words, prompt, 0) == [5]
    assert bad_word_completions(words, [*prompt, 8], 1) == [5, 9]
    assert bad_word_completions(words, [*prompt, 1, 2], 2) == [5, 3]
    assert bad_word_completions(words, [*prompt, 2], 1) == [5]


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_deepseek_sparse_attention_in_tiles_of_one_query(tmp_path, monkeypatch, decode_in_place):
    """DeepSeek Sparse Attention's queries past index_topk keys, one query a tile (the decodes' rows each
    reading their own blocks, a prefill chunk's rows the chunk's; GLM-5's, so that a layer sharing its
    choice reads each tile's rows), the rows the dense pass leaves to them made NaN there: the greedy
    tokens stay transformers'."""
    import gpu_worker.models.deepseek_v32 as deepseek_v32
    from gpu_worker.layers.attention import PagedAttention

    monkeypatch.setattr(deepseek_v32, "_VALUES_PER_TILE", 1)
    dense_forward = PagedAttention.forward

    def nan_where_not_attended(self, q, k, v, meta):
        """The dense pass's output with NaN in the rows it was not asked to answer (left to the sparse path)."""
        out = dense_forward(self, q, k, v, meta).view(q.shape[0], -1)
        answered = torch.zeros(q.shape[0], dtype=torch.bool)
        answered[: meta.num_decodes] = True
        for span in meta.prefills:
            answered[span.token_start: span.token_end] = True
        return out.masked_fill(~answered[:, None], float("nan"))

    monkeypatch.setattr(PagedAttention, "forward", nan_where_not_attended)
    _greedy_through_chunks_as_transformers(save_tiny_model(tmp_path, "glm_moe_dsa", index_topk=4,
                                                           num_hidden_layers=3), decode_in_place)


@pytest.mark.parametrize("decode_in_place", [True, False], ids=["kernel", "gather"])
def test_deepseek_sparse_attention_beside_short_decodes(tmp_path, decode_in_place):
    """A short request decoding within index_topk keys beside a long prompt's later chunks, every query of
    which is past them (the step's dense pass answering the decodes alone): transformers' greedy tokens."""
    path = save_tiny_model(tmp_path, "glm_moe_dsa", num_hidden_layers=3)
    hf = load_hf(path)
    runner = runner_for(path, decode_in_place, num_blocks=64, block_size=4)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=13)
    ps = {"short": [17, 18], "long": [(5 * i + 3) % 256 for i in range(40)]}
    for rid, p in ps.items():
        sched.add_request(greedy_request(rid, p, 3))
    got = run_to_completion(sched, runner.execute_model)
    assert got == {rid: hf_greedy(hf, p, 3) for rid, p in ps.items()}
