"""The offline LLM API on real engines: tiny random models, and SmolLM2 once."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster import LLM, SamplingParams

PROMPTS = [
    "Hello",
    "Paris is the capital of",
    "def main():\n    return 42\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "東京は日本の首都です。",
    "Berlin is the capital of Germany. Paris is",
    "naïve café 😀",
    "user assistant system What is the capital of France? " * 2,
]


def hf_greedy(model_dir, prompts, max_tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        g = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def test_greedy_generate_equals_transformers_with_chunked_prefill_and_preemption(tiny_model_dir):
    max_tokens = 24
    # 16-token budget forces chunked prefill; 12 blocks of 16 for 8 growing requests forces preemption.
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=12, max_num_batched_tokens=16, max_num_seqs=8,
              max_model_len=128)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_model_dir, PROMPTS, max_tokens)
    assert [o.prompt for o in outputs] == PROMPTS  # deterministic order
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.max_step_num_scheduled_tokens <= 16
    assert stats.num_free_blocks == stats.num_blocks
    for o in outputs:
        m = o.metrics
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_generate_accepts_token_ids_and_per_prompt_params(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                                  SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)],
                            use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
        assert outs[0].prompt_token_ids == [5, 6, 7] and outs[0].prompt is None
        seeded = [llm.generate("Hello", SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
        assert seeded[0] == seeded[1]
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    finally:
        llm.shutdown()


def test_chat_uses_the_chat_template(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64)
    try:
        out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.prompt.startswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert 1 <= len(out.outputs[0].token_ids) <= 4


def test_bad_scheduler_flag_names_the_flag_and_engine(tiny_model_dir):
    with pytest.raises(ValueError, match="engine 1: max_num_seqs"):
        LLM(model=str(tiny_model_dir), num_engines=2, engine_overrides=[{}, {"max_num_seqs": 0}])
    with pytest.raises(ValueError, match="engine 0: engine_niceness"):
        LLM(model=str(tiny_model_dir), num_engines=2, engine_overrides=[{"engine_niceness": 20}, {}])


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_dir):
    llm = LLM(model="SmolLM2-135M-Instruct", num_gpu_blocks=256, max_model_len=2048)
    try:
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert "Paris" in out.outputs[0].text
