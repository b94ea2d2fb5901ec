"""Checks shared by the end-to-end tests of the drafters that run in the workers (the MTP layer,
EAGLE heads), through the offline LLM."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster import LLM, SamplingParams
from tests.cluster.test_architectures import PROMPTS
from tests.cluster.test_spec_decode import run
from tests.gpu_worker.utils import hf_greedy, load_hf


def check_greedy_answers_with_drafts(path: Path, spec: dict, num_gpu_blocks: int, **flags) -> None:
    """Greedy answers drafted for under ``spec`` are transformers' own, through chunked prefill,
    preemption (a pool of ``num_gpu_blocks`` blocks of 4) and prefix-cache hits, with drafts both
    accepted and rejected, and every block free at the end (``flags``: the engine's others)."""
    prompts = PROMPTS + PROMPTS[:2]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, stats = run(path, prompts, params, dtype="float32", block_size=4, num_gpu_blocks=num_gpu_blocks,
                         max_num_batched_tokens=16, max_num_seqs=8, max_model_len=80, speculative_config=spec,
                         **flags)
    hf = load_hf(path)
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 12) for prompt in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.prefix_cache_hits > 0 and stats.num_free_blocks == stats.num_blocks
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def check_the_drafter_sleeps_and_wakes(path: Path, spec: dict, max_tokens: int, parameter_roots: set[str],
                                       root_at: int) -> None:
    """Sleep level 2 discards the drafter's weights (whose names' part ``root_at`` are
    ``parameter_roots``: its own, not the target's it shares) and its cache, and waking reads them
    again: the same answers and the same drafts, some accepted."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks=64, max_model_len=128, enable_sleep_mode=True,
              speculative_config=spec)
    try:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats = llm.get_stats()[0]
        drafter = llm._engine.executor.worker.runner.drafter.runner
        assert {name.split(".")[root_at] for name, _ in drafter.model.named_parameters()} == parameter_roots
        llm.sleep(level=2)
        assert drafter.kv_caches == [] and all(p.numel() == 0 for p in drafter.model.parameters())
        llm.wake_up()
        assert all(p.numel() > 0 for p in drafter.model.parameters()) and len(drafter.kv_caches) == 1
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        again = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert after == before
    assert stats.spec_decode_num_accepted_tokens > 0
    assert (again.spec_decode_num_draft_tokens - stats.spec_decode_num_draft_tokens,
            again.spec_decode_num_accepted_tokens - stats.spec_decode_num_accepted_tokens) == (
        stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
