"""Speculative decoding with the model's own MTP layer (``--speculative-config '{"method": "mtp",
...}'``) end to end through the offline LLM, on tiny GLM-4.5 and DeepSeek-V3 checkpoints holding
one: the greedy answers are transformers' own through chunked prefill, preemption and the prefix
cache, with drafts accepted; the layer sleeps and wakes with its model; a model without one is
refused before its workers load."""

from __future__ import annotations

import pytest

from cluster import LLM
from tests.cluster.spec_decode_checks import check_greedy_answers_with_drafts, check_the_drafter_sleeps_and_wakes
from tests.gpu_worker.utils import save_tiny_model_with_mtp, save_tiny_qwen3_next_with_mtp
from tests.tiny_model import build_tokenizer

MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _model(tmp_path, kind: str):
    # (Drafts mostly agreeing with the model: see save_tiny_model_with_mtp.)
    path = save_tiny_model_with_mtp(tmp_path / kind, kind, near_bigram=0.02)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3", "deepseek_v32"])
def test_mtp_drafts_keep_the_greedy_answers_through_preemption_and_the_prefix_cache(tmp_path, kind):
    check_greedy_answers_with_drafts(_model(tmp_path, kind), MTP, num_gpu_blocks=24)


def test_qwen3_next_drafts_with_its_mtp_layer_beside_the_states_its_prefix_cache_keeps(tmp_path):
    """Qwen3-Next's MTP layer (vLLM's method name qwen3_next_mtp), read from its own names, over a
    target with Gated DeltaNet layers under --mamba-cache-mode align: the repeated prompts start from
    kept states, rejected drafts put the recurrent states back, and the answers are transformers'."""
    path = save_tiny_qwen3_next_with_mtp(tmp_path / "qwen3_next", near_bigram=0.02)
    build_tokenizer().save_pretrained(path)
    check_greedy_answers_with_drafts(path, {"method": "qwen3_next_mtp", "num_speculative_tokens": 2},
                                     num_gpu_blocks=24, mamba_cache_mode="align")


def test_the_mtp_layer_sleeps_and_wakes_with_its_model(tmp_path):
    """Level 2 discards its weights with the model's (not the embedding and head it shares: those
    are the model's) and wakes them read again from the checkpoint: the same answers and drafts."""
    # (Its layer only: model.layers.2.)
    check_the_drafter_sleeps_and_wakes(_model(tmp_path, "glm4_moe"), MTP, 10, {"2"}, root_at=2)


def test_a_model_without_an_mtp_layer_is_refused_before_its_workers_load(tiny_model_dir):
    with pytest.raises(ValueError, match="LlamaForCausalLM has none"):
        LLM(model=str(tiny_model_dir), speculative_config=MTP)
