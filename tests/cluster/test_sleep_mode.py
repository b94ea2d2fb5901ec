"""vLLM's sleep mode offline (LLM.sleep / wake_up): what the worker releases at each level, what
wake-up restores, and answers unchanged through it (adapters included)."""

from __future__ import annotations

import pytest

from cluster import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import save_adapter

PROMPTS = ["Hello world", "Paris is the capital of"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _answers(llm: LLM, lora: LoRARequest | None = None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=lora)]


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return LoRARequest("a", 1, str(save_adapter(tiny_model_dir, tmp_path_factory.mktemp("a"), seed=40)))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=256, enable_sleep_mode=True,
              enable_lora=True)
    yield llm
    llm.shutdown()


def test_level_1_releases_the_kv_cache_and_wakes_up_in_two_steps(llm, adapter):
    before, with_adapter = _answers(llm), _answers(llm, adapter)
    runner = llm._engine.executor.worker.runner
    layers = runner.model.attention_layers()
    llm.sleep(level=1)
    assert llm.is_sleeping() and runner.kv_caches == [] and all(layer.kv_cache is None for layer in layers)
    assert all(p.numel() > 0 for p in runner.model.parameters())  # (on the CPU the weights stay in place)
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and runner.kv_caches == []  # (the KV cache is still released)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert len(runner.kv_caches) == len(layers) and all(layer.kv_cache is not None for layer in layers)
    assert _answers(llm) == before and _answers(llm, adapter) == with_adapter


def test_level_2_discards_the_weights_and_reads_them_again(llm, adapter):
    before, with_adapter = _answers(llm), _answers(llm, adapter)
    runner = llm._engine.executor.worker.runner
    llm.sleep(level=2)
    assert all(p.numel() == 0 for p in runner.model.parameters())
    llm.wake_up()
    assert not llm.is_sleeping() and all(p.numel() > 0 for p in runner.model.parameters())
    # The adapter-wrapped projections got their weights back too.
    assert _answers(llm) == before and _answers(llm, adapter) == with_adapter


def test_sleeping_again_after_waking_in_part_releases_what_woke(llm):
    """sleep(2), wake_up(["weights"]), sleep(2): the weights go again (they stayed loaded, the
    engine saying it slept while they held their memory)."""
    before = _answers(llm)
    runner = llm._engine.executor.worker.runner
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    assert llm.is_sleeping() and all(p.numel() > 0 for p in runner.model.parameters())
    llm.sleep(level=2)
    assert all(p.numel() == 0 for p in runner.model.parameters())
    llm.wake_up()
    assert _answers(llm) == before


def test_the_prefix_cache_is_emptied_by_sleep(llm):
    pool = llm._engine.scheduler.kv_cache_manager.block_pool
    long_prompt = ["The quick brown fox jumps over the lazy dog. " * 4]
    before = llm.generate(long_prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert len(pool.cached_block_hash_to_block) > 0
    llm.sleep(level=1)
    assert len(pool.cached_block_hash_to_block) == 0
    llm.wake_up()
    # (A hit on a block of the released cache would attend to zeros: the answer would change.)
    assert llm.generate(long_prompt, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == before
    assert len(pool.cached_block_hash_to_block) > 0


def test_sleep_needs_the_flag_and_a_valid_level(tiny_model_dir, llm):
    plain = LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable-sleep-mode"):
            plain.sleep()
        assert not plain.is_sleeping()
    finally:
        plain.shutdown()
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["everything"])
    assert not llm.is_sleeping()


def test_a_draft_model_sleeps_and_wakes_with_its_target(tiny_model_dir):
    """Speculative decoding's draft model: its KV cache released with the target's (level 1), its
    weights discarded with them (level 2) and read again from its own checkpoint on waking, in two
    steps as the target's; the drafts it then proposes are accepted as before."""
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=256, enable_sleep_mode=True,
              speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                  "num_speculative_tokens": 3})
    try:
        before = _answers(llm)
        draft = llm._engine.executor.worker.runner.drafter.runner
        layers = draft.model.attention_layers()
        llm.sleep(level=1)
        assert draft.kv_caches == [] and all(layer.kv_cache is None for layer in layers)
        llm.sleep(level=2)
        assert all(p.numel() == 0 for p in draft.model.parameters())
        llm.wake_up(["weights"])
        assert all(p.numel() > 0 for p in draft.model.parameters()) and draft.kv_caches == []
        llm.wake_up(["kv_cache"])
        assert len(draft.kv_caches) == len(layers) and all(layer.kv_cache is not None for layer in layers)
        accepted = llm.get_stats()[0].spec_decode_num_accepted_tokens
        assert _answers(llm) == before
        # (The draft is the target itself: with its weights back, every draft is accepted again.)
        stats = llm.get_stats()[0]
        assert stats.spec_decode_num_accepted_tokens - accepted > 0
    finally:
        llm.shutdown()
