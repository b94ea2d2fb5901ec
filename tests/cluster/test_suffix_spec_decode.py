"""Suffix decoding (``--speculative-config '{"method": "suffix"}'``) end to end on a real engine
with the tiny model: greedy answers are transformers' own through chunked prefill and preemption,
with drafts accepted; a request asked again drafts its answer from the first one's; the settings
are checked."""

from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from engine_core.config import SpeculativeConfig
from tests.cluster.test_llm import PROMPTS, hf_greedy

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


def test_suffix_drafts_keep_the_greedy_answers_through_chunked_prefill_and_preemption(tiny_model_dir):
    """And the cache keeps each answer once, whole (its last pass's tokens too, and through
    preemption), and no request's own tree once all are done."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=128, speculative_config=SUFFIX)
    try:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()[0]
        cache = llm._engine.drafter.cache
        kept = sorted(tuple(tokens) for tree in cache.generations for tokens in tree.seqs.values())
        local = dict(cache.local)
    finally:
        llm.shutdown()
    answers = [o.outputs[0].token_ids for o in outputs]
    assert answers == hf_greedy(tiny_model_dir, PROMPTS, 24)
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.num_free_blocks == stats.num_blocks
    assert kept == sorted(tuple(answer) for answer in answers) and local == {}


def test_a_request_asked_again_drafts_from_the_first_answer(tiny_model_dir):
    """The global tree keeps the first answer: asked again, the same request's drafts are mostly
    that answer's continuation (and only its own tree can help the first time)."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=128, speculative_config=SUFFIX)
    try:
        first = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        before = llm.get_stats()[0]
        again = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        after = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert again == first
    passes = (before.num_steps, after.num_steps - before.num_steps)
    accepted = (before.spec_decode_num_accepted_tokens,
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)
    assert accepted[1] > accepted[0] and passes[1] < passes[0], (accepted, passes)
    assert passes[1] <= 40 // 2, passes


def test_the_suffix_settings_are_checked():
    spec = SpeculativeConfig.from_dict({"method": "suffix"})
    assert (spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 32}
                                       ).num_speculative_tokens == 32
    for field, value in (("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_cached_requests", -2),
                         ("suffix_decoding_max_spec_factor", 0), ("suffix_decoding_min_token_prob", 1.5)):
        with pytest.raises(ValueError, match=f"speculative_config.{field}"):
            SpeculativeConfig.from_dict({"method": "suffix", field: value})
    with pytest.raises(ValueError, match=r"suffix_decoding_max_tree_depth must be unset with method ngram"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "suffix_decoding_max_tree_depth": 8})
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.from_dict({"method": "suffix", "model": "/m"})
