"""Prompts given as embeddings (--enable-prompt-embeds) on real engines, against transformers'
``inputs_embeds``: chunked prefill, preemption, the prefix cache, tensor parallelism, refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from engine_core.config import EngineConfig, SpeculativeConfig
from engine_core.engine_core import RequestRefusedError


def _table(model_dir) -> torch.Tensor:
    return load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]


def _embeddings(model_dir, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Rows that are no token's: the table's rows of random tokens, moved off them by noise."""
    table = _table(model_dir)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, table.shape[0], (n,), generator=gen)
        out.append(table[ids] + 0.5 * table.std() * torch.randn(n, table.shape[1], generator=gen))
    return out


def hf_greedy_from_embeddings(model_dir, embeddings: list[torch.Tensor], max_tokens: int,
                              repetition_penalty: float = 1.0) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for rows in embeddings:
        g = model.generate(inputs_embeds=rows[None], attention_mask=torch.ones(1, len(rows), dtype=torch.long),
                           max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                           repetition_penalty=repetition_penalty, pad_token_id=0)
        outs.append(g[0].tolist())  # (with inputs_embeds alone, generate returns the new tokens only)
    return outs


def test_generating_from_embeddings_equals_transformers_through_chunks_and_preemption(tiny_model_dir):
    max_tokens = 16
    embeddings = _embeddings(tiny_model_dir, [5, 23, 40, 17])
    # A 16-token budget chunks the prefills; 10 blocks of 16 for four growing requests preempt.
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=10, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=128, enable_prompt_embeds=True)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        text = "The quick brown fox jumps over the lazy dog."
        outputs = llm.generate([{"prompt_embeds": e} for e in embeddings[:2]] + [text]
                               + [{"prompt_embeds": e} for e in embeddings[2:]], params, use_tqdm=False)
        penalised = llm.generate([{"prompt_embeds": embeddings[1]}],
                                 SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                repetition_penalty=1.5), use_tqdm=False)
        stats = llm.get_stats()[0]
        # Prompts given as embeddings only: whichever request is preempted, it resumes from its rows.
        again = llm.generate([{"prompt_embeds": e} for e in embeddings], params, use_tqdm=False)
        preempted_again = llm.get_stats()[0].num_preemptions > stats.num_preemptions
    finally:
        llm.shutdown()
    from_embeddings = [o.outputs[0].token_ids for i, o in enumerate(outputs) if i != 2]
    assert from_embeddings == hf_greedy_from_embeddings(tiny_model_dir, embeddings, max_tokens)
    assert outputs[0].prompt_token_ids is None and outputs[0].prompt is None
    assert outputs[2].prompt == text and outputs[2].prompt_token_ids  # (a text prompt beside them is as ever)
    assert stats.num_preemptions > 0 and preempted_again, "the KV pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in again] == from_embeddings
    # Penalties count no placeholder as a prompt token: only the generated ones (as transformers' inputs_embeds).
    assert penalised[0].outputs[0].token_ids == hf_greedy_from_embeddings(tiny_model_dir, embeddings[1:2], max_tokens,
                                                                          repetition_penalty=1.5)[0]


def test_transformers_input_embeddings_answer_as_the_tokens_do_on_a_model_that_scales_them(tmp_path):
    """vLLM's recipe: the rows are ``model.get_input_embeddings()(ids)``, which on Gemma are the
    table's rows times sqrt(hidden_size); the engine runs them as they are (n=2 samples too)."""
    from tests.tiny_model import build_tiny_gemma2

    path = build_tiny_gemma2(tmp_path / "gemma2")
    ids = [[5, 17, 33, 90, 4, 8, 100, 200, 12, 13], list(range(40, 75))]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        rows = [hf.get_input_embeddings()(torch.tensor(p)) for p in ids]
    assert not torch.allclose(rows[0], _table(path)[ids[0]])  # (scaled: not the table's own rows)
    llm = LLM(model=str(path), num_gpu_blocks=32, max_num_batched_tokens=16, max_model_len=128,
              enable_prompt_embeds=True)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        from_ids = llm.generate(ids, params, use_tqdm=False)
        from_rows = llm.generate([{"prompt_embeds": r} for r in rows], params, use_tqdm=False)
    finally:
        llm.shutdown()
    answers = [[c.token_ids for c in o.outputs] for o in from_rows]
    assert answers == [[c.token_ids for c in o.outputs] for o in from_ids]
    assert all(len(a) == 1 for a in answers)
    assert [a[0] for a in answers] == hf_greedy_from_embeddings(path, rows, 10)


def test_ngram_drafts_come_from_the_generated_tokens_not_the_placeholders(tiny_model_dir):
    embeddings = _embeddings(tiny_model_dir, [24, 7], seed=3)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    assert (_greedy(tiny_model_dir, embeddings, 24, speculative_config=spec)
            == hf_greedy_from_embeddings(tiny_model_dir, embeddings, 24))


def _greedy(model_dir, embeddings: list[torch.Tensor], max_tokens: int, **engine) -> list[list[int]]:
    """Greedy answers to prompts given as embeddings, from an LLM started with ``engine``'s flags."""
    llm = LLM(model=str(model_dir), num_gpu_blocks=32, max_model_len=128, enable_prompt_embeds=True, **engine)
    try:
        outputs = llm.generate([{"prompt_embeds": e} for e in embeddings],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def test_equal_embeddings_share_prefix_blocks_and_placeholders_share_none(tiny_model_dir):
    rows = _embeddings(tiny_model_dir, [40])[0]
    other = rows.clone()
    other[20:] += 1.0  # (the same first block of 16 rows, then different)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=64, max_model_len=128, enable_prompt_embeds=True)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        first = llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0]
        again = llm.generate({"prompt_embeds": rows.clone()}, params, use_tqdm=False)[0]
        partly = llm.generate({"prompt_embeds": other}, params, use_tqdm=False)[0]
        zeros = llm.generate([[0] * 40], params, use_tqdm=False)[0]  # (the placeholders as a token prompt)
    finally:
        llm.shutdown()
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert partly.num_cached_tokens == 16
    assert zeros.num_cached_tokens == 0


def test_embeddings_on_two_tensor_parallel_ranks(ray_cluster, tiny_model_dir):
    embeddings = _embeddings(tiny_model_dir, [9, 30], seed=1)
    assert (_greedy(tiny_model_dir, embeddings, 12, tensor_parallel_size=2, max_num_batched_tokens=16)
            == hf_greedy_from_embeddings(tiny_model_dir, embeddings, 12))


def test_what_a_prompt_given_as_embeddings_cannot_do_is_refused(tiny_model_dir, tmp_path):
    rows = _embeddings(tiny_model_dir, [6])[0]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=64)
    try:
        with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
            llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)
    finally:
        llm.shutdown()
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=64, enable_prompt_embeds=True)
    try:
        with pytest.raises(ValueError, match="hidden size 64, not 32"):
            llm.generate({"prompt_embeds": rows[:, :32]}, params, use_tqdm=False)
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.generate({"prompt_embeds": torch.zeros(70, 64)}, params, use_tqdm=False)
        with pytest.raises(RequestRefusedError, match="prompt logprobs"):
            llm.generate({"prompt_embeds": rows}, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
        with pytest.raises(ValueError, match=r"only LLM\.generate"):
            llm.beam_search([{"prompt_embeds": rows}], _beam_params())
        # The engine goes on serving after refusals.
        assert len(llm.generate({"prompt_embeds": rows}, params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        EngineConfig(model="m", enable_prompt_embeds=True,
                     speculative_config=SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=2))
    from tests.tiny_model import build_tiny_bert

    with pytest.raises(ValueError, match="generating decoder models"):
        LLM(model=str(build_tiny_bert(tmp_path / "bert")), enable_prompt_embeds=True)


def test_prompt_embeddings_beyond_float16_are_refused_by_a_float16_model(tiny_model_dir):
    """A float16 model would run rows beyond float16's range as infinities: such a prompt is refused
    (float16 rows, and float32 rows within the range, run)."""
    rows = _embeddings(tiny_model_dir, [6])[0]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks=16, max_model_len=64, enable_prompt_embeds=True,
              dtype="float16")
    try:
        big = rows.clone()
        big[2, 5] = 1e5
        with pytest.raises(RequestRefusedError, match="runs in float16, whose largest value is 65504"):
            llm.generate({"prompt_embeds": big}, params, use_tqdm=False)
        for fine in (rows, rows.to(torch.float16)):
            assert len(llm.generate({"prompt_embeds": fine}, params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def _beam_params():
    from cluster import BeamSearchParams

    return BeamSearchParams(beam_width=2, max_tokens=2)
