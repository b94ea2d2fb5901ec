"""Speculative decoding with the model's own MTP layer (``--speculative-config '{"method": "mtp",
...}'``) end to end through the offline LLM, on tiny GLM-4.5 and DeepSeek-V3 checkpoints holding
one: the greedy answers are transformers' own through chunked prefill, preemption and the prefix
cache, with drafts accepted; the layer sleeps and wakes with its model; a model without one is
refused before its workers load."""

from __future__ import annotations

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.cluster.test_architectures import PROMPTS
from tests.cluster.test_spec_decode import run
from tests.gpu_worker.utils import hf_greedy, load_hf, save_tiny_model_with_mtp
from tests.tiny_model import build_tokenizer

MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _model(tmp_path, kind: str):
    # (Drafts mostly agreeing with the model: see save_tiny_model_with_mtp.)
    path = save_tiny_model_with_mtp(tmp_path / kind, kind, near_bigram=0.02)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_mtp_drafts_keep_the_greedy_answers_through_preemption_and_the_prefix_cache(tmp_path, kind):
    path = _model(tmp_path, kind)
    prompts = PROMPTS + PROMPTS[:2]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, stats = run(path, prompts, params, dtype="float32", block_size=4, num_gpu_blocks=24,
                         max_num_batched_tokens=16, max_num_seqs=8, max_model_len=80, speculative_config=MTP)
    hf = load_hf(path)
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 12) for prompt in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.prefix_cache_hits > 0 and stats.num_free_blocks == stats.num_blocks
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_the_mtp_layer_sleeps_and_wakes_with_its_model(tmp_path):
    """Level 2 discards its weights with the model's (not the embedding and head it shares: those
    are the model's) and wakes them read again from the checkpoint: the same answers and drafts."""
    path = _model(tmp_path, "glm4_moe")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks=64, max_model_len=128, enable_sleep_mode=True,
              speculative_config=MTP)
    try:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        stats = llm.get_stats()[0]
        drafter = llm._engine.executor.worker.runner.drafter.runner
        assert {name.split(".")[2] for name, _ in drafter.model.named_parameters()} == {"2"}  # (its layer only)
        llm.sleep(level=2)
        assert drafter.kv_caches == [] and all(p.numel() == 0 for p in drafter.model.parameters())
        llm.wake_up()
        assert all(p.numel() > 0 for p in drafter.model.parameters()) and len(drafter.kv_caches) == 1
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        again = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert after == before
    assert (again.spec_decode_num_draft_tokens - stats.spec_decode_num_draft_tokens,
            again.spec_decode_num_accepted_tokens - stats.spec_decode_num_accepted_tokens) == (
        stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)


def test_a_model_without_an_mtp_layer_is_refused_before_its_workers_load(tiny_model_dir):
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        LLM(model=str(tiny_model_dir), speculative_config=MTP)
