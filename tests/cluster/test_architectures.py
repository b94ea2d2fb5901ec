"""Every decoder family the engines load, end to end through the offline LLM on this machine's
device (CUDA when it has one, else the CPU), against transformers on the CPU.

fp32: greedy tokens equal to transformers' through chunked prefill, preemption and the prefix cache.
bf16: each prompt token's log-probability within bf16's precision of transformers' fp32 one (the
kernels differ by device, so tokens may not).
"""

from __future__ import annotations

import pytest
import torch

from cluster import SamplingParams
from tests.cluster.test_spec_decode import NGRAM, run
from tests.gpu_worker.utils import HYBRID_GROUPS, hf_greedy, load_hf, save_tiny_model
from tests.tiny_model import build_tokenizer

KINDS = ["llama", "qwen2", "qwen3", "phi3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma3",
         "gpt_oss", "smollm3", "granite", "olmo2", "olmo3", "glm4_moe",
         "deepseek_v3", "deepseek_v2", "olmoe", "granitemoe", "minimax_m2", "cohere", "cohere2", "glm4", "seed_oss",
         "helium", "ernie4_5", "ernie4_5_moe", "arcee", "exaone4", "starcoder2", "stablelm", "nemotron", "olmo",
         "phi", "gpt_neox", "glm", "dots1", "gpt2", "gpt_bigcode", "gptj", "opt", "falcon", "apertus", "phimoe",
         "llama4", "bloom", "mpt", "falcon_rw", "flex_olmo", "ministral", "cwm",
         "persimmon", "hunyuan_dense", "dbrx", "vaultgemma",
         "hunyuan_moe", "minicpm3", "minicpm5_moe", "glm4_moe_lite", "exaone_moe", "gemma3n", "gemma4",
         "jais2", "solar_open", "youtu", "afmoe", "laguna", "mellum", "hy_v3",
         "mimo_v2_flash", "granite_swa", "granitemoe_swa", "cohere2_moe", "gpt_neo", "codegen",
         "hyperclovax", "axk1", "nanochat", "kolibri1", "flint", "beam", "bitnet",
         "jetmoe", "longcat_flash", "biogpt", "xglm", "modernbert_decoder", "deepseek_v32",
         "glm_moe_dsa"]
# (Mistral's window of 8 keys is crossed by most prompts; Gemma 3 alternates windowed and full layers.)
OVERRIDES = {"mistral": {"sliding_window": 8}, "cohere": {"use_qk_norm": True},
             "stablelm": {"use_parallel_residual": True, "qk_layernorm": True},
             # (OLMo Hybrid's doubled write strength makes the tiny model's bf16 touchy: transformers' own bf16
             # is 0.63 nats off its fp32 at worst with the usual weights, 0.20 with these)
             "olmo_hybrid": {"initializer_range": 0.1},
             # (with the usual weights the tiny DeepSeek-V3.2 never repeats its prompts' n-grams: no draft accepted)
             "deepseek_v32": {"initializer_range": 0.1}}
# Token-id prompts (the tiny models' vocabulary is 256): two share a 12-token prefix (three blocks).
_PREFIX = [(7 * i + 3) % 256 for i in range(12)]
PROMPTS = [_PREFIX + [5, 9], _PREFIX + [40, 41, 42], [(11 * i + 5) % 256 for i in range(45)], [17, 18],
           [(3 * i + 1) % 256 for i in range(23)], [200] * 9]


def _model(tmp_path, kind: str):
    path = save_tiny_model(tmp_path / kind, kind, **OVERRIDES.get(kind, {}))
    build_tokenizer().save_pretrained(path)
    return path


def _num_windowed_groups(path) -> int:
    """The windowed KV cache groups of the hybrid KV cache manager for this model (0: one group)."""
    from engine_core.config import EngineConfig
    from gpu_worker.config import ModelConfig
    from gpu_worker.kv_cache_groups import hybrid_kv_cache_grouping

    grouping, _ = hybrid_kv_cache_grouping(ModelConfig.from_pretrained(path), EngineConfig(model=str(path)))
    return 0 if grouping is None else sum(w is not None for w in grouping.windows)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_transformers_through_chunks_preemption_and_the_prefix_cache(tmp_path, kind):
    path = _model(tmp_path, kind)
    # 40 blocks of 4 tokens hold about four of the eight requests: the others wait or are preempted
    # (Mistral's and StarCoder2's requests keep only their window's blocks: 12 blocks; under the hybrid
    # KV cache manager each windowed group holds up to 7 blocks of a request beside the full layers').
    num_blocks = 12 if kind in ("mistral", "starcoder2") else 40 + 7 * _num_windowed_groups(path)
    outputs, stats = run(path, PROMPTS + PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         dtype="float32", block_size=4, num_gpu_blocks=num_blocks,
                         max_num_batched_tokens=16, max_num_seqs=8, max_model_len=128)
    hf = load_hf(path)
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 12) for prompt in PROMPTS + PROMPTS[:2]]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.prefix_cache_hits > 0 and stats.num_free_blocks == stats.num_blocks


def test_a_packed_bitnet_checkpoint_through_the_engine(tmp_path):
    """BitNet b1.58 as released (packed ternary weights, 8-bit inputs per token): transformers' greedy tokens
    through chunked prefill, preemption and the prefix cache."""
    from tests.gpu_worker.test_bitnet import save_packed

    path = save_packed(tmp_path / "bitnet", "bitnet")
    build_tokenizer().save_pretrained(path)
    outputs, stats = run(path, PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                         dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16, max_num_seqs=8,
                         max_model_len=128)
    with torch.compiler.set_stance("force_eager"):  # (transformers' BitLinear is torch.compile'd)
        hf = load_hf(path)
        with torch.no_grad():
            expected = [hf_greedy(hf, prompt, 10) for prompt in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.prefix_cache_hits > 0 and stats.num_free_blocks == stats.num_blocks


def test_gemma4s_caches_of_two_geometries_go_to_the_host_tier_and_back(tmp_path):
    """Gemma 4's KV cache keeps each layer's own geometry (its full layers' heads wider and fewer): a
    prompt whose blocks other prompts pushed out of the device cache finds them in the host tier
    (blocks of both kinds stored and loaded back), and the greedy tokens stay transformers'."""
    from cluster import LLM

    path = _model(tmp_path, "gemma4")
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks=16, max_model_len=64,
              kv_offloading_size=0.001)
    cached, loaded = _pushed_out_and_back(llm, path)
    assert cached >= 32 and loaded >= 8


def _pushed_out_and_back(llm, path) -> tuple[int, int]:
    """A 45-token prompt answered, pushed out of the device cache by three others, answered again (then
    ``llm`` shut down): both answers greedy transformers'; the second's cached tokens, and the host tier's
    blocks loaded for it."""
    first = [(11 * i + 5) % 256 for i in range(45)]
    others = [[(13 * i + j) % 256 for i in range(45)] for j in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        before = llm.generate([first], params, use_tqdm=False)
        llm.generate(others, params, use_tqdm=False)  # (their blocks push the first prompt's out)
        loaded_before = llm.get_stats()[0].kv_offload_loaded_blocks
        again = llm.generate([first], params, use_tqdm=False)
        loaded = llm.get_stats()[0].kv_offload_loaded_blocks - loaded_before
    finally:
        llm.shutdown()
    with torch.no_grad():
        expected = hf_greedy(load_hf(path), first, 6)
    assert again[0].outputs[0].token_ids == before[0].outputs[0].token_ids == expected
    return again[0].num_cached_tokens, loaded


@pytest.mark.parametrize("kind", list(HYBRID_GROUPS))
def test_the_hybrid_kv_cache_groups_go_to_the_host_tier_and_back(tmp_path, kind):
    """Under the hybrid KV cache manager, windows of 8 keys, blocks of 4: a prompt whose blocks other
    prompts pushed out finds them in the host tier, the full group's every block and each windowed group's
    blocks of its window (the token at 44 sees keys 37..44: blocks 9 and 10), and the greedy tokens stay
    transformers'. The tier's slots are pages of the groups' shared tensors."""
    from cluster import LLM

    overrides, num_windowed = HYBRID_GROUPS[kind]
    path = save_tiny_model(tmp_path / kind, kind, **overrides)
    build_tokenizer().save_pretrained(path)
    assert _num_windowed_groups(path) == num_windowed
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks=64, max_model_len=64,
              kv_offloading_size=0.001)
    runner = llm._engine.executor.worker.runner
    groups, tensors = len(llm._engine.scheduler.kv_cache_manager.groups), runner.kv_cache_grouping.group_size
    tiers = (len(runner.block_caches), len(runner.offload_caches))
    cached, loaded = _pushed_out_and_back(llm, path)
    assert groups == num_windowed and tiers == (tensors, tensors) and tensors == 4 // (num_windowed + 1)
    assert cached == 44 and loaded == 11 + num_windowed * 2


@pytest.mark.parametrize("kind", ["gemma3n", "gemma4", "deepseek_v32", "glm_moe_dsa"])
def test_layers_reading_the_cache_their_own_way_verify_ngram_drafts_as_transformers_answers(tmp_path, kind):
    """Gemma 3n's and Gemma 4's KV-sharing layers attend over their sources' caches, and DeepSeek-V3.2's
    queries past index_topk keys over the keys their indexer picks, with several query rows a request (the
    drafts being verified): the greedy tokens stay transformers', drafts accepted."""
    path = _model(tmp_path, kind)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outputs, stats = run(path, PROMPTS + PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16, max_num_seqs=8,
                         max_model_len=128, speculative_config=spec)
    hf = load_hf(path)
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 12) for prompt in PROMPTS + PROMPTS[:2]]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize(("kind", "flags", "refusal"), [
    ("gemma3n", {"enable_prompt_embeds": True}, "per-layer inputs of the prompt's token ids"),
    ("gemma4", {"enable_prompt_embeds": True}, "per-layer inputs of the prompt's token ids"),
    ("gemma4", {"kv_transfer_config": {"kv_role": "kv_both"}}, "KV caches differ in shape"),
])
def test_gemma3n_and_gemma4_refuse_what_their_layers_cannot_follow(tmp_path, kind, flags, refusal):
    """Prompt embeddings (their per-layer inputs are read by token id), and for Gemma 4 prefill/decode
    disaggregation (its full layers' caches are of another shape than the windowed layers')."""
    with pytest.raises(ValueError, match=refusal):
        run(_model(tmp_path, kind), [[1, 2]], SamplingParams(max_tokens=1), dtype="float32", num_gpu_blocks=16,
            max_model_len=64, **flags)


RECURRENT_KINDS = ["granitemoehybrid", "bamba", "nemotron_h", "nemotron_h_moe", "mamba2", "qwen3_next", "qwen3_5",
                   "qwen3_5_moe", "lfm2", "lfm2_moe", "lfm3", "falcon_h1", "mamba", "olmo_hybrid", "kimi_linear",
                   "minimax", "bailing_hybrid", "falcon_mamba", "jamba", "zamba2"]


@pytest.mark.parametrize("kind", RECURRENT_KINDS)
def test_mamba_hybrids_recompute_what_a_prefix_cache_would_skip_and_verify_drafts(tmp_path, kind):
    """Granite 4.0-H, Bamba and Nemotron-H (Mamba-2 layers beside attention), a pure Mamba-2 model, and
    Qwen3-Next and Qwen3.5 (Gated DeltaNet layers beside attention), LFM2 (short convolutions),
    Falcon-H1 (attention and Mamba-2 side by side in every layer), Mamba and Falcon-Mamba (Mamba-1
    layers alone), Jamba (Mamba-1 layers beside attention), Zamba2 (Mamba-2 layers, some running a
    shared attention block first), Kimi-Linear and Ling 3 (Kimi Delta Attention beside MLA), MiniMax
    (lightning attention beside GQA): the
    engine turns prefix caching off, since a hit would skip tokens whose recurrent state it does not
    keep; greedy tokens equal transformers' through chunked prefill and preemption (a model without
    attention keeps no KV, yet its blocks still bound what runs at once), the repeated prompts computed
    again. With n-gram speculative decoding: a pass verifying drafts keeps each request's state before
    each draft, and one rejecting some puts the request back to the state after those it accepted, so
    every token's log-probability is still transformers' (from the prompt and the tokens before it)."""
    path = _model(tmp_path, kind)
    prompts = PROMPTS + PROMPTS[:2]
    outputs, stats = run(path, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0),
                         dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16, max_num_seqs=8,
                         max_model_len=128, speculative_config=NGRAM)
    hf = load_hf(path)
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 12) for prompt in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    _assert_logprobs_are_transformers(hf, prompts, outputs)
    assert stats.num_preemptions > 0, "the KV pool was meant to force preemption"
    assert stats.prefix_cache_hits == 0 and stats.num_free_blocks == stats.num_blocks
    # (Some drafts rejected, their states put back; acceptance is the random model's, often none.)
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@torch.no_grad()
def _assert_logprobs_are_transformers(hf, prompts: list[list[int]], outputs) -> None:
    """Each sampled token's logprob (logprobs=0) within 1e-3 of transformers' fp32 one, from the
    prompt and the tokens before it."""
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        sample = out.outputs[0]
        scores = torch.log_softmax(hf(torch.tensor([prompt + sample.token_ids])).logits[0].float(), -1)
        for i, (token, row) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
            worst = max(worst, abs(row[token].logprob - scores[len(prompt) - 1 + i, token].item()))
    assert worst < 1e-3, f"a token's logprob is {worst:.2e} off transformers'"


@pytest.mark.parametrize("kind", RECURRENT_KINDS)
def test_recurrent_models_start_prompts_from_the_states_the_prefix_cache_keeps(tmp_path, kind):
    """--mamba-cache-mode align, every family with recurrent layers: states are kept at block boundaries
    inside prefill chunks and at their ends, so a prompt seen again starts after its last full block,
    and a conversation's next turn after its answer's last full block (the state a decode left there),
    each restored into the request's row; greedy tokens equal transformers' throughout, through
    chunked prefill and preemption too (a preempted request resumes from its own kept states)."""
    from cluster import LLM

    path = _model(tmp_path, kind)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16,
              max_num_seqs=8, max_model_len=128, mamba_cache_mode="align", mamba_prefix_cache_slots=64)
    try:
        batch = llm.generate(PROMPTS + PROMPTS[:2], params, use_tqdm=False)
        preemptions = llm.get_stats()[0].num_preemptions
        again = llm.generate([PROMPTS[4]], params, use_tqdm=False)[0]
        answer = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
        turn = PROMPTS[2] + answer + [9, 8, 7]
        next_turn = llm.generate([turn], params, use_tqdm=False)[0]
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    hf = load_hf(path)
    with torch.no_grad():
        expected = [hf_greedy(hf, prompt, 12) for prompt in PROMPTS + PROMPTS[:2]]
        expected_turn = hf_greedy(hf, turn, 12)
    assert [o.outputs[0].token_ids for o in batch] == expected
    assert preemptions > 0, "the KV pool was meant to force preemption"
    # 23 tokens: 20 kept (its last full block); 45 + 11 computed answer tokens = 56 of the 60-token turn.
    assert again.num_cached_tokens == 20 and again.outputs[0].token_ids == expected[4]
    assert answer == expected[2]
    assert next_turn.num_cached_tokens == 56 and next_turn.outputs[0].token_ids == expected_turn
    assert stats.prefix_cache_hits >= 76 and stats.num_free_blocks == stats.num_blocks
    # (The repeat and the next turn each started from a kept state; nothing evicted from 64 slots.)
    assert stats.num_recurrent_state_slots == 64 and stats.recurrent_states_restored >= 2
    assert stats.recurrent_states_saved == stats.recurrent_states_held > 0 and stats.recurrent_states_evicted == 0


@pytest.mark.parametrize("kind", ["granitemoehybrid", "qwen3_next"])
def test_drafts_verified_beside_the_states_the_prefix_cache_keeps(tmp_path, kind):
    """--mamba-cache-mode align with n-gram speculative decoding (Mamba-2 and Gated DeltaNet layers):
    states are kept only at boundaries a pass's certain tokens reach (a state after a draft the pass
    may reject is no prefix's), so a prompt seen again still starts after its last full block, and a
    conversation's next turn from a state its answer's decodes kept; every token and logprob stays
    transformers'."""
    from cluster import LLM

    path = _model(tmp_path, kind)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16,
              max_num_seqs=8, max_model_len=128, mamba_cache_mode="align", mamba_prefix_cache_slots=64,
              speculative_config=NGRAM)
    try:
        batch = llm.generate(PROMPTS, params, use_tqdm=False)
        again = llm.generate([PROMPTS[4]], params, use_tqdm=False)[0]
        turn = PROMPTS[2] + batch[2].outputs[0].token_ids + [9, 8, 7]
        next_turn = llm.generate([turn], params, use_tqdm=False)[0]
        stats = llm.get_stats()[0]
    finally:
        llm.shutdown()
    hf = load_hf(path)
    prompts, outputs = [*PROMPTS, PROMPTS[4], turn], [*batch, again, next_turn]
    with torch.no_grad():
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, prompt, 12) for prompt in prompts]
    _assert_logprobs_are_transformers(hf, prompts, outputs)
    assert again.num_cached_tokens == 20
    # (45 prompt tokens and 11 computed answer tokens: a state at most at 56, kept by a decode past the prompt)
    assert 44 < next_turn.num_cached_tokens <= 56
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # (some rejected)
    assert stats.recurrent_states_restored >= 2 and stats.num_free_blocks == stats.num_blocks


def test_a_draft_model_of_attention_layers_proposes_for_a_hybrid(tmp_path):
    """A draft model (a tiny Llama of the same vocabulary) for Granite 4.0-H: it repeats the target's
    passes over its own KV cache while the target keeps its states before each draft; the answers
    are transformers'."""
    path = _model(tmp_path, "granitemoehybrid")
    draft = _model(tmp_path, "llama")
    outputs, stats = run(path, PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                         dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=16, max_num_seqs=8,
                         max_model_len=128, speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    hf = load_hf(path)
    with torch.no_grad():
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, prompt, 12) for prompt in PROMPTS]
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens


def test_a_hybrid_serves_adapters_and_keeps_each_adapters_recurrent_states_apart(tmp_path):
    """Granite 4.0-H with --enable-lora and --mamba-cache-mode align: a prompt under an adapter on its
    attention and Mamba-2 projections, again under it (from the state the first kept), then under the
    base model (its blocks hash apart from the adapter's: computed whole); each answer PEFT's or
    transformers' own."""
    from cluster import LLM, LoRARequest
    from tests.lora_adapters import peft_model, save_adapter

    path = _model(tmp_path, "granitemoehybrid")
    targets = ("q_proj", "o_proj", "in_proj", "out_proj")
    adapter = LoRARequest("a", 1, str(save_adapter(path, tmp_path / "a", seed=3, targets=targets)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_gpu_blocks=40, max_model_len=128,
              max_num_batched_tokens=16, mamba_cache_mode="align", enable_lora=True, max_lora_rank=8)
    try:
        adapted, again = (llm.generate([PROMPTS[4]], params, use_tqdm=False, lora_request=adapter)[0]
                          for _ in range(2))
        plain = llm.generate([PROMPTS[4]], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    with torch.no_grad():
        expected_adapted = hf_greedy(peft_model(path, seed=3, targets=targets), PROMPTS[4], 8)
        expected_plain = hf_greedy(load_hf(path), PROMPTS[4], 8)
    assert expected_adapted != expected_plain
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == expected_adapted
    assert adapted.num_cached_tokens == 0 and again.num_cached_tokens == 20  # (23 tokens: its last full block)
    assert plain.num_cached_tokens == 0 and plain.outputs[0].token_ids == expected_plain


@pytest.mark.parametrize("flags, refusal", [
    ({"kv_offloading_size": 0.01}, "KV offloading"),
    ({"kv_transfer_config": {"kv_role": "kv_both"}}, "prefill/decode disaggregation"),
])
def test_granite_4_hybrid_refuses_what_its_states_cannot_follow(tmp_path, flags, refusal):
    path = _model(tmp_path, "granitemoehybrid")
    with pytest.raises(ValueError, match=f"has Mamba-2 layers: {refusal}"):
        run(path, [[1, 2]], SamplingParams(max_tokens=1), dtype="float32", num_gpu_blocks=16, max_model_len=64,
            **flags)


@pytest.mark.parametrize("kind", [*KINDS, "granitemoehybrid", "bamba", "nemotron_h", "nemotron_h_moe", "qwen3_next",
                                  "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "lfm3", "falcon_h1", "falcon_mamba",
                                  "jamba", "olmo_hybrid", "kimi_linear", "minimax", "bailing_hybrid",
                                  "zamba2"])
def test_bf16_logprobs_are_transformers_fp32_ones_within_bf16_precision(tmp_path, kind):
    """Each prompt token's log-probability (prefill) and each greedy token's (decode)."""
    path = _model(tmp_path, kind)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outputs, _ = run(path, PROMPTS, params, dtype="bfloat16", num_gpu_blocks=32, max_num_batched_tokens=16,
                     max_model_len=128)
    hf = load_hf(path)
    moe = "moe" in kind or kind in ("mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2", "minimax_m2", "qwen3_next",
                                    "jamba", "llama4", "dots1", "phimoe", "dbrx", "glm4_moe_lite", "gemma4",
                                    "solar_open", "afmoe", "laguna", "mellum", "hy_v3", "axk1", "kolibri1", "flint",
                                    "beam", "jetmoe", "longcat_flash", "mimo_v2_flash", "granitemoe_swa", "cohere2_moe",
                                    "deepseek_v32", "glm_moe_dsa", "kimi_linear", "minimax", "bailing_hybrid")
    hf_bf16 = load_hf(path).to(torch.bfloat16) if moe else None
    errors, hf_bf16_errors = [], []
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        sample = out.outputs[0]
        ids = prompt + sample.token_ids
        with torch.no_grad():
            reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            if hf_bf16 is not None:
                theirs = torch.log_softmax(hf_bf16(torch.tensor([ids])).logits[0].float(), dim=-1)
                hf_bf16_errors += [abs(theirs[i, t] - reference[i, t]).item() for i, t in enumerate(ids[1:])]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        rows = out.prompt_logprobs[1:] + sample.logprobs  # row i scores token i + 1, predicted at position i
        assert len(rows) == len(ids) - 1
        errors += [abs(row[ids[i + 1]].logprob - reference[i, ids[i + 1]].item()) for i, row in enumerate(rows)]
    mean, worst = sum(errors) / len(errors), max(errors)
    # bf16 keeps 8 significant bits: a few parts in a thousand per value, summed over the layers
    # (a wrong rotation, norm or mask costs whole nats). An MoE router's top-k can flip on a rounding,
    # so only its mean is bounded, and by what transformers' own bf16 costs where that is more (which
    # tokens flip is chance: over seeds, ours and transformers' bf16 errors swap places).
    bound = 0.06 if not moe else max(0.06, 2 * sum(hf_bf16_errors) / len(hf_bf16_errors))
    assert mean < bound, f"mean logprob error {mean:.3f} (bound {bound:.3f})"
    assert worst < 0.25 or moe, f"worst logprob error {worst:.3f}"


@pytest.mark.parametrize("kind, flags", [("granitemoehybrid", {"mamba_ssm_cache_dtype": "bfloat16"}),
                                         ("qwen3_5", {"mamba_cache_dtype": "bfloat16"}),
                                         ("lfm2", {"mamba_cache_dtype": "float16"})])
def test_recurrent_states_stored_in_half_precision_cost_only_its_rounding(tmp_path, kind, flags):
    """An fp32 model whose recurrent states are kept in bf16 or fp16 (--mamba-ssm-cache-dtype,
    --mamba-cache-dtype) between prefill chunks and decodes: each prompt token's log-probability, and
    each generated one's while the greedy tokens agree, within that rounding of the fp32 states'
    (bf16's bounds), and not exactly theirs (the states were rounded)."""
    path = _model(tmp_path, kind)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    engine = dict(dtype="float32", num_gpu_blocks=32, max_num_batched_tokens=8, max_model_len=128)
    (full, _), (rounded, _) = run(path, PROMPTS, params, **engine), run(path, PROMPTS, params, **engine, **flags)
    errors = []
    for exact, out in zip(full, rounded, strict=True):
        agreed = 0  # (the generated tokens while both runs chose the same: the same context to score)
        while agreed < 4 and out.outputs[0].token_ids[agreed] == exact.outputs[0].token_ids[agreed]:
            agreed += 1
        theirs = exact.prompt_logprobs[1:] + exact.outputs[0].logprobs[:agreed + 1]
        ours = out.prompt_logprobs[1:] + out.outputs[0].logprobs[:agreed + 1]
        ids = exact.prompt_token_ids + exact.outputs[0].token_ids
        errors += [abs(row[ids[i + 1]].logprob - reference[ids[i + 1]].logprob)
                   for i, (row, reference) in enumerate(zip(ours, theirs, strict=True)) if ids[i + 1] in row]
    mean, worst = sum(errors) / len(errors), max(errors)
    assert mean < 0.06 and worst < 0.25, f"logprob change: mean {mean:.4f}, worst {worst:.4f}"
    assert worst > 0, "the states were meant to be rounded"


def test_without_a_block_count_the_kv_cache_fills_the_memory_share_it_is_given(tiny_model_dir):
    """CUDA: what a profiled full-size pass leaves of --gpu-memory-utilization; the CPU: the byte budget."""
    # The tiny Llama: K and V, 2 layers, 2 KV heads of 16 values, 16 tokens, fp32.
    per_block = 2 * 2 * 2 * 16 * 16 * 4
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        budget = 0.05 * total
        # Out of the share first: what is used already (this process's CUDA context, other
        # processes), then the weights and a full pass's activations (well under 256 MiB here).
        least = budget - (total - free) - (256 << 20)
        flags = {"gpu_memory_utilization": 0.05}
    else:
        budget = least = 8 << 20
        flags = {"kv_cache_memory_bytes": budget}
    [out], stats = run(tiny_model_dir, [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       dtype="float32", max_model_len=128, **flags)
    assert len(out.outputs[0].token_ids) == 4
    assert least <= stats.num_blocks * per_block <= budget
