"""Speculative decoding with an EAGLE or EAGLE-3 head (``--speculative-config '{"method": "eagle3",
"model": HEAD, ...}'``) end to end through the offline LLM, on tiny heads for a tiny Llama: the
greedy answers are transformers' own through chunked prefill, preemption and the prefix cache, with
drafts accepted; the head sleeps and wakes with its model; a head that does not fit, or no head,
is refused before the workers load."""

from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from tests.cluster.spec_decode_checks import check_greedy_answers_with_drafts, check_the_drafter_sleeps_and_wakes
from tests.cluster.test_architectures import PROMPTS
from tests.gpu_worker.utils import (
    hf_greedy,
    load_hf,
    save_near_bigram_target,
    save_tiny_eagle_head,
    save_tiny_model,
)
from tests.tiny_model import build_tokenizer


def _target_and_head(tmp_path, method: str, **head):
    # (Drafts mostly agreeing with the model: see save_tiny_eagle_head; EAGLE-3's built guess goes
    # through the target's bigram twice, so a target closer to one.)
    target = save_near_bigram_target(tmp_path / "target", near_bigram=0.02 if method == "eagle" else 0.005)
    build_tokenizer().save_pretrained(target)
    return target, save_tiny_eagle_head(tmp_path / method, target, method, near_bigram=0.02, **head)


@pytest.mark.parametrize(("method", "head"), [("eagle", {"pytorch_bin": True}), ("eagle3", {"draft_vocab_size": 200})])
def test_eagle_drafts_keep_the_greedy_answers_through_preemption_and_the_prefix_cache(tmp_path, method, head):
    target, head_dir = _target_and_head(tmp_path, method, **head)
    check_greedy_answers_with_drafts(target, {"method": method, "model": str(head_dir), "num_speculative_tokens": 3},
                                     num_gpu_blocks=22)


def test_the_eagle3_head_sleeps_and_wakes_with_its_model(tmp_path):
    """Level 2 discards the head's weights with the model's and reads them again from the head's
    checkpoint on waking: the same answers and the same drafts."""
    target, head_dir = _target_and_head(tmp_path, "eagle3", draft_vocab_size=200)
    # (Its own layer, fc, norm, head and id map: not the target's embedding, which it shares.)
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}
    check_the_drafter_sleeps_and_wakes(target, spec, 24, {"model", "lm_head", "d2t"}, root_at=0)


def test_a_head_that_does_not_fit_or_none_is_refused_before_the_workers_load(tmp_path):
    target, head_dir = _target_and_head(tmp_path, "eagle3", draft_vocab_size=200)
    with pytest.raises(ValueError, match="serve it with speculative method 'eagle3', not 'eagle'"):
        LLM(model=str(target), speculative_config={"method": "eagle", "model": str(head_dir),
                                                   "num_speculative_tokens": 2})
    # (A target two layers deep: the default layers 2, 1 and -1 are not all there.)
    shallow = save_tiny_model(tmp_path / "shallow")
    build_tokenizer().save_pretrained(shallow)
    with pytest.raises(ValueError, match=r"the target has 2 \(eagle_config.eagle_aux_hidden_state_layer_ids\)"):
        LLM(model=str(shallow), speculative_config={"method": "eagle3", "model": str(head_dir),
                                                           "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        LLM(model=str(target), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


def test_a_speculators_head_given_alone_implies_its_method_and_drafts(tmp_path):
    """vLLM's usage of a speculators-library head: the ``model`` alone, its method (eagle3) and its
    drafts a pass (the proposal's speculative_tokens) read from its config."""
    target, head_dir = _target_and_head(tmp_path, "eagle3", draft_vocab_size=200, speculators=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(target), dtype="float32", num_gpu_blocks=64, max_model_len=128,
              speculative_config={"model": str(head_dir)})
    try:
        spec = llm._engine.config.speculative_config
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert (spec.method, spec.num_speculative_tokens) == ("eagle3", 3)
    hf = load_hf(target)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p.prompt_token_ids, 16) for p in outputs]
    assert stats.spec_decode_num_accepted_tokens > 0
