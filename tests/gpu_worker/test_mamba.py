"""Mamba-2 layers (Granite 4.0-H): the chunked scan against the recurrence, a mixer carrying each
request's state across passes, and a hybrid model served through the scheduler (chunked prefills,
batched decodes, rows reused, preemption) against transformers' generation."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.config import ModelConfig
from gpu_worker.layers.mamba import MambaMixer2, ssd_chunk_scan, ssd_step
from gpu_worker.mamba_config import Mamba2Config
from gpu_worker.worker import Worker
from tests.gpu_worker.utils import (
    check_mixer_carries_state,
    greedy_request,
    hf_greedy,
    load_hf,
    make_runner,
    make_scheduler,
    run_to_completion,
    save_tiny_model,
    two_tp_ranks,
)


def _scan_inputs(length: int, heads: int = 4, head_dim: int = 3, state: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(length, heads, head_dim, generator=g)
    dt = torch.rand(length, heads, generator=g) + 0.05
    a = -torch.rand(heads, generator=g) * 2
    b = torch.randn(length, heads, state, generator=g)
    c = torch.randn(length, heads, state, generator=g)
    h0 = torch.randn(heads, head_dim, state, generator=g)
    return x, dt, a, b, c, h0


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_the_chunked_scan_is_the_recurrence(chunk_size):
    """21 tokens from a nonzero state, in chunks that divide them or not: every output and the final
    state are those of the token-by-token recurrence."""
    x, dt, a, b, c, h0 = _scan_inputs(21)
    y, state = ssd_chunk_scan(x, dt, a, b, c, h0, chunk_size)
    h, ys = h0[None], []
    for t in range(21):
        out, h = ssd_step(x[t:t + 1], dt[t:t + 1], a, b[t:t + 1], c[t:t + 1], h)
        ys.append(out[0])
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, h[0], atol=1e-5, rtol=1e-5)


def _random_mixer(config: Mamba2Config, hidden: int = 24) -> MambaMixer2:
    torch.manual_seed(1)
    mixer = MambaMixer2(hidden, config, 1e-6)
    with torch.no_grad():
        for name, param in mixer.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() > 1 else 0.5))
            if name == "norm.weight":
                param.uniform_(0.5, 1.5)
    return mixer


@pytest.mark.parametrize("groups", [1, 2])
def test_a_mixer_carries_each_requests_state_across_passes(groups):
    """Two sequences run whole (one prefill each) and run in pieces over five passes, side by side in
    other rows: prefill chunks longer and shorter than the convolution's window, single tokens
    batched as decodes. Each piece's outputs are the whole run's at its positions."""
    config = Mamba2Config(num_heads=4, head_dim=6, num_groups=groups, state_size=5, conv_kernel=4, chunk_size=4)
    mixer = _random_mixer(config)
    torch.manual_seed(2)
    seqs = [torch.randn(13, 24), torch.randn(11, 24)]
    check_mixer_carries_state(mixer, seqs)


def test_a_ranks_share_of_the_heads_and_groups():
    """Heads split over the ranks; groups too where they divide, else the one group on every rank."""
    config = Mamba2Config(num_heads=8, head_dim=4, num_groups=2, state_size=5, conv_kernel=4, chunk_size=4)
    assert config.per_rank(2) == Mamba2Config(4, 4, 1, 5, 4, 4) and config.per_rank(1) is config
    single = Mamba2Config(num_heads=8, head_dim=4, num_groups=1, state_size=5, conv_kernel=4, chunk_size=4)
    assert single.per_rank(4) == Mamba2Config(2, 4, 1, 5, 4, 4)
    with pytest.raises(ValueError, match="8 heads cannot be split evenly over tensor_parallel_size=3"):
        config.per_rank(3)
    with pytest.raises(ValueError, match="2 groups cannot be split evenly over tensor_parallel_size=4"):
        config.per_rank(4)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("granite_hybrid"), "granitemoehybrid")


def _prompts(count: int, vocab: int = 256) -> dict[str, list[int]]:
    # Lengths 1 (a first pass shaped as a decode), 5, 11, ... 29: chunked by a 12-token budget.
    return {f"r{i}": [(7 * j + 3 * i + 1) % vocab for j in range(1 if i == 0 else 6 * i - 1)] for i in range(count)}


def test_a_hybrid_model_generates_as_transformers_does(hybrid_model):
    """Six requests through the scheduler, two at a time (rows reused by the later ones, whose state
    must start from zero), prompts chunked by a 12-token budget beside batched decodes."""
    runner = make_runner(hybrid_model, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=12)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
                           prefix_caching=False)
    prompts = _prompts(6)
    for rid, prompt in prompts.items():
        sched.add_request(greedy_request(rid, prompt, 8))
    chunked = []
    got = run_to_completion(sched, runner.execute_model,
                            on_step=lambda step, so: chunked.extend(n for n in so.num_scheduled_tokens.values()
                                                                    if n > 1))
    assert chunked and max(chunked) <= 12 and runner.mamba_states[0].ssm.shape[0] == 2
    hf = load_hf(hybrid_model)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf, prompt, 8), rid


def test_a_preempted_request_recomputes_its_state(hybrid_model):
    """A KV cache too small for every request at once: the scheduler preempts, and a resumed request
    starts its state again from zero (its row may be another's by then)."""
    runner = make_runner(hybrid_model, num_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                           prefix_caching=False)
    prompts = {f"p{i}": [(11 * j + 5 * i + 2) % 256 for j in range(9 + i)] for i in range(4)}
    for rid, prompt in prompts.items():
        sched.add_request(greedy_request(rid, prompt, 12))
    preempted: list[str] = []
    got = run_to_completion(sched, runner.execute_model,
                            on_step=lambda step, so: preempted.extend(so.preempted_req_ids))
    assert preempted
    hf = load_hf(hybrid_model)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf, prompt, 12), rid


def test_the_states_kept_inside_and_at_the_ends_of_chunks_are_the_states_after_those_tokens(hybrid_model):
    """--mamba-cache-mode align through a runner: a 23-token prompt in chunks of 16 and 7 (blocks of 4)
    keeps its states at 16 (the first chunk's end, copied after the forward) and at 20 (inside the second
    chunk: the last boundary before its last token), and a 10-token prompt beside it in the second pass
    at 8 (inside its chunk of 9). Each kept slot holds, in every recurrent layer, the states a runner
    computing only those tokens leaves in its row."""
    from engine_core.config import CacheConfig, SchedulerConfig
    from engine_core.sched.scheduler import Scheduler

    runner = make_runner(hybrid_model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                         num_recurrent_state_slots=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128),
                      CacheConfig(block_size=4, num_blocks=64, num_recurrent_state_slots=8), log_stats=False)
    prompts = {"a": [(7 * j + 1) % 256 for j in range(23)], "b": [(5 * j + 3) % 256 for j in range(10)]}
    for rid, prompt in prompts.items():
        sched.add_request(greedy_request(rid, prompt, 1))
    kept: dict[int, tuple[str, int]] = {}  # slot -> (request, tokens before the state)
    run_to_completion(sched, runner.execute_model, on_step=lambda step, so: kept.update(
        {slot: (rid, position) for rid, saves in so.recurrent_state_saves.items() for position, slot in saves}))
    assert sorted(kept.values()) == [("a", 16), ("a", 20), ("b", 8)]
    reference = make_runner(hybrid_model, num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=32)
    ref_sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=1,
                               prefix_caching=False)
    for slot, (rid, position) in kept.items():
        ref_sched.add_request(greedy_request(f"{rid}{position}", prompts[rid][:position], 1))
        so = ref_sched.schedule()
        out = reference.execute_model(so)
        row = reference.requests[f"{rid}{position}"].table_row
        for live, saved in zip(reference.mamba_states, runner.kept_states, strict=True):
            torch.testing.assert_close(saved.ssm[slot], live.ssm[row], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(saved.conv[slot], live.conv[row], atol=1e-5, rtol=1e-5)
        ref_sched.update_from_output(so, out)


def test_released_granite_4_configs_are_read():
    """Granite 4.0-H's config.json keys as released: "mamba" / "attention" layer types, NoPE, the
    Mamba-2 geometry (auto head width), no time_step_limit; transformers 5's saved infinity."""
    base = {"architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
            "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 8, "mamba_d_head": "auto",
            "mamba_n_groups": 1, "mamba_d_state": 16, "position_embedding_type": "nope",
            "num_local_experts": 0, "shared_intermediate_size": 96}
    config = ModelConfig.from_dict(base)
    assert config.mamba_layers == (True, False, True) and config.num_attention_layers == 1
    assert config.mamba == Mamba2Config(num_heads=8, head_dim=16, num_groups=1, state_size=16, conv_kernel=4,
                                        chunk_size=256)
    assert config.rope_layers == (False,) * 3 and config.num_experts == 0 and config.intermediate_size == 96
    saved = ModelConfig.from_dict({**base, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                                   "position_embedding_type": "rope", "num_local_experts": 4,
                                   "time_step_limit": [0.001, {"__float__": "Infinity"}]})
    assert saved.mamba_layers == (True, False, True) and saved.rope_layers == ()
    assert saved.mamba.time_step_limit == (0.001, float("inf"))
    assert saved.num_experts == 4 and saved.shared_expert_intermediate_size == 96 and saved.intermediate_size == 32
    with pytest.raises(ValueError, match="'mamba' or 'attention'"):
        ModelConfig.from_dict({**base, "layer_types": ["mamba", "sliding_attention", "mamba"]})
    with pytest.raises(ValueError, match="layer_types lists 3 layers, the model has 4"):
        ModelConfig.from_dict({**base, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match="Mamba-2 geometry"):
        ModelConfig.from_dict({**base, "mamba_d_head": 8})


def test_released_nemotron_h_configs_are_read():
    """Nemotron-H's config.json as released: its hybrid_override_pattern (M: Mamba-2, *: attention,
    -: MLP, E: routed experts), attention_head_dim, the Mamba-2 keys, Nemotron 3's experts."""
    base = {"architectures": ["NemotronHForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_attention_heads": 4, "num_key_value_heads": 2, "attention_head_dim": 16, "vocab_size": 256,
            "hybrid_override_pattern": "M-M*-", "num_hidden_layers": 5, "mamba_num_heads": 8, "mamba_head_dim": 16,
            "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True,
            "use_bias": False, "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "time_step_limit": [0.0, 1e9]}
    config = ModelConfig.from_dict(base)
    assert config.block_types == ("mamba", "mlp", "mamba", "attention", "mlp") and config.num_attention_layers == 1
    assert config.mamba_layers == (True, False, True, False, False) and config.head_dim == 16
    assert config.mamba == Mamba2Config(num_heads=8, head_dim=16, num_groups=2, state_size=16, conv_kernel=4,
                                        chunk_size=128, time_step_limit=(0.0, 1e9))
    assert config.hidden_act == "relu2" and config.rms_norm_eps == 1e-5
    nano3 = ModelConfig.from_dict({**base, "hybrid_override_pattern": "M-ME-", "n_routed_experts": 16,
                                   "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                                   "moe_shared_expert_intermediate_size": 64, "n_group": 1, "topk_group": 1,
                                   "routed_scaling_factor": 2.5, "moe_latent_size": None})
    assert nano3.block_types == ("mamba", "mlp", "mamba", "moe", "mlp") and nano3.moe_layers[3]
    assert (nano3.num_experts, nano3.num_experts_per_tok, nano3.moe_intermediate_size) == (16, 4, 32)
    assert nano3.shared_expert_intermediate_size == 64 and not nano3.shared_expert_gated
    assert nano3.moe_activation == "relu2" and nano3.moe_scoring == "sigmoid" and nano3.moe_correction_bias
    assert nano3.routed_scaling_factor == 2.5 and nano3.moe_latent_size == 0 and nano3.norm_topk_prob
    # (transformers warns of a num_hidden_layers the pattern contradicts and builds the pattern's layers;
    # it takes the Mamba keys' other names too.)
    aliased = ModelConfig.from_dict({**base, "num_hidden_layers": 6, "mamba_n_groups": 4, "mamba_chunk_size": 64})
    assert aliased.num_hidden_layers == 5 and (aliased.mamba.num_groups, aliased.mamba.chunk_size) == (4, 64)
    with pytest.raises(ValueError, match="hybrid_override_pattern must be a string"):
        ModelConfig.from_dict({**base, "hybrid_override_pattern": "M-X"})


def test_a_released_mamba2_config_is_read():
    """Mamba-Codestral-7B's config.json keys: Mamba-2 blocks alone, its mixer geometry, no KV."""
    config = ModelConfig.from_dict({
        "architectures": ["Mamba2ForCausalLM"], "hidden_size": 4096, "num_heads": 128, "head_dim": 64, "n_groups": 8,
        "state_size": 128, "expand": 2, "conv_kernel": 4, "chunk_size": 256, "num_hidden_layers": 64,
        "vocab_size": 32768, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "use_bias": False,
        "use_conv_bias": True, "residual_in_fp32": True})
    assert config.block_types == ("mamba",) * 64 and config.num_attention_layers == 0
    assert config.mamba == Mamba2Config(num_heads=128, head_dim=64, num_groups=8, state_size=128, conv_kernel=4,
                                        chunk_size=256)
    assert config.rms_norm_eps == 1e-5 and not config.tie_word_embeddings


def test_the_cache_budget_counts_attention_layers_and_leaves_room_for_the_states(hybrid_model):
    """KV blocks hold the attention layer's keys and values alone; the Mamba-2 states of max_num_seqs
    requests come out of the budget first."""
    worker = Worker(0, 1, str(hybrid_model), device="cpu", dtype="auto", max_model_len=128, num_cpus=1,
                    max_num_seqs=3)
    worker.init_distributed()
    worker.load_model()
    config = worker.model_config
    assert worker.bytes_per_block(4) == 2 * 1 * 4 * config.num_key_value_heads * config.head_dim * 4
    # Per request and Mamba layer: conv [64 + 2 * 2 * 16 channels, 3], ssm [8, 16, 16] in fp32.
    per_request = (128 + 64) * 3 * 4 + 8 * 16 * 16 * 4
    assert worker.mamba_state_bytes() == 3 * 3 * per_request
    budget = worker.mamba_state_bytes() + worker.bytes_per_block(4) * 10 + 5
    assert worker.determine_num_blocks(4, kv_cache_memory_bytes=budget) == 10
    worker.initialize_cache(10, 4)
    assert [tuple(s.ssm.shape) for s in worker.runner.mamba_states] == [(3, 8, 16, 16)] * 3


@pytest.mark.parametrize("drafts", [0, 2])
def test_the_states_the_prefix_cache_keeps_come_out_of_the_budget_too(hybrid_model, drafts):
    """--mamba-cache-mode align: the kept states (slots) sit beside the live rows, each one request's
    states, and the KV blocks get what both leave; with speculative decoding, ``drafts`` more slots a
    request (its states before each draft) after them."""
    worker = Worker(0, 1, str(hybrid_model), device="cpu", dtype="auto", max_model_len=128, num_cpus=1,
                    max_num_seqs=3, num_recurrent_state_slots=5, num_spec_tokens=drafts)
    worker.init_distributed()
    worker.load_model()
    per_request = (128 + 64) * 3 * 4 + 8 * 16 * 16 * 4
    assert worker.mamba_state_bytes() == 3 * (3 * (1 + drafts) + 5) * per_request
    budget = worker.mamba_state_bytes() + worker.bytes_per_block(4) * 10 + 5
    assert worker.determine_num_blocks(4, kv_cache_memory_bytes=budget) == 10
    worker.initialize_cache(10, 4)
    slots = 5 + 3 * drafts
    assert [tuple(s.ssm.shape) for s in worker.runner.kept_states] == [(slots, 8, 16, 16)] * 3
    assert [tuple(s.conv.shape) for s in worker.runner.kept_states] == [(slots, 128 + 64, 3)] * 3
    held = "3 requests" + (" \\(and 2 after drafts each\\)" if drafts else "")
    with pytest.raises(ValueError, match=f"states of {held} and 5 kept for the prefix cache .* "
                                         "--mamba-prefix-cache-slots" + (" / the speculative config's "
                                                                         "num_speculative_tokens" if drafts else "")):
        worker.determine_num_blocks(4, kv_cache_memory_bytes=worker.mamba_state_bytes() - 1)


@pytest.mark.parametrize("flags, conv_dtype, ssm_dtype", [
    ({"mamba_ssm_cache_dtype": "bfloat16"}, torch.float32, torch.bfloat16),
    ({"mamba_cache_dtype": "float16"}, torch.float16, torch.float16),
    ({"mamba_cache_dtype": "bfloat16", "mamba_ssm_cache_dtype": "float32"}, torch.bfloat16, torch.float32),
])
def test_the_states_are_stored_and_counted_in_the_dtypes_asked_for(hybrid_model, flags, conv_dtype, ssm_dtype):
    """--mamba-cache-dtype sets the conv and SSM states' storage, --mamba-ssm-cache-dtype the SSM
    state's alone; the budget counts them at those sizes."""
    worker = Worker(0, 1, str(hybrid_model), device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                    max_num_seqs=3, **flags)
    worker.init_distributed()
    worker.load_model()
    per_request = (128 + 64) * 3 * conv_dtype.itemsize + 8 * 16 * 16 * ssm_dtype.itemsize
    assert worker.mamba_state_bytes() == 3 * 3 * per_request
    worker.initialize_cache(10, 4)
    assert {(s.conv.dtype, s.ssm.dtype) for s in worker.runner.mamba_states} == {(conv_dtype, ssm_dtype)}
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be one of auto, float32, float16, bfloat16"):
        Worker(0, 1, str(hybrid_model), device="cpu", mamba_ssm_cache_dtype="fp8")


def test_a_streaming_sessions_next_turn_continues_its_state(hybrid_model):
    """A resumable session keeps its blocks between turns, and its Mamba state with them (the next
    turn starts where the computed tokens end, in the row it had): the second turn's tokens are
    transformers' greedy continuation of everything so far. Another request comes and goes in
    between, taking and freeing a row."""
    from engine_core.request import Request
    from engine_core.sampling_params import SamplingParams

    runner = make_runner(hybrid_model, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                           prefix_caching=False)

    def turn(req_id: str, prompt: list[int], max_tokens: int, resumable: bool) -> Request:
        return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       eos_token_id=None, resumable=resumable)

    def run_until_done(req_ids: set[str]) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for _ in range(200):
            so = sched.schedule()
            for eco in sched.update_from_output(so, runner.execute_model(so)).values():
                for out in eco.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    req_ids.discard(out.request_id) if out.finish_reason is not None else None
            if not req_ids:
                return tokens
        raise AssertionError(f"turns did not finish: {req_ids} {tokens}")

    first = [(5 * j + 2) % 256 for j in range(13)]
    sched.add_request(turn("s", first, 4, True))
    sched.add_request(turn("other", [9, 8, 7], 2, False))
    out = run_until_done({"s", "other"})
    assert runner.requests["s"].num_computed_tokens == len(first) + 3  # (its last token not yet computed)
    sched.add_request(turn("later", [4, 4, 4, 4, 4], 6, False))  # (a row of its own, beside the waiting session)
    second = [17, 23, 29, 31, 37]
    sched.add_request(turn("s", second, 5, True))
    out2 = run_until_done({"s", "later"})
    hf = load_hf(hybrid_model)
    assert out["s"] == hf_greedy(hf, first, 4)
    assert out2["s"] == hf_greedy(hf, first + out["s"] + second, 5)


@pytest.mark.parametrize("parallel, refusal", [
    ({"tensor_parallel_size": 3}, "has Mamba-2 layers: Mamba-2's 8 heads cannot be split evenly"),
    ({"pipeline_parallel_size": 2}, "does not split NemotronHForCausalLM's layers"),
])
def test_parallel_engines_are_refused_before_workers_start(tmp_path, parallel, refusal):
    """Heads that do not divide the ranks; stages of Nemotron-H's own decoder stack (the Llama-stack
    hybrids split: tests/gpu_worker/test_pipeline_parallel.py)."""
    from engine_core.config import EngineConfig, SchedulerConfig
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_granite_hybrid, build_tokenizer

    model = build_tiny_granite_hybrid(tmp_path / "granite")
    if "pipeline_parallel_size" in parallel:
        model = save_tiny_model(tmp_path / "nemotron_h", "nemotron_h")
        build_tokenizer().save_pretrained(model)
    with pytest.raises(ValueError, match=refusal):
        create_executor(EngineConfig(model=str(model), device="cpu", num_gpu_blocks=16,
                                     scheduler=SchedulerConfig(max_model_len=64), **parallel))


@pytest.mark.slow
@pytest.mark.parametrize("kind, groups", [("granitemoehybrid", 2), ("granitemoehybrid", 1), ("nemotron_h_moe", 2),
                                         ("qwen3_next", 0), ("qwen3_5", 0), ("lfm2_moe", 0), ("falcon_h1", 2),
                                         ("jamba", 0), ("zamba2", 2), ("lfm3", 0), ("olmo_hybrid", 0),
                                         ("kimi_linear", 0), ("minimax", 0), ("bailing_hybrid", 0)],
                         ids=["groups_split", "one_group_replicated", "nemotron_h_moe", "qwen3_next", "qwen3_5",
                              "lfm2_moe", "falcon_h1", "jamba", "zamba2", "lfm3", "olmo_hybrid", "kimi_linear",
                              "minimax", "bailing_hybrid"])
def test_tp2_over_gloo_equals_tp1(tmp_path, kind, groups, tp_hosts):
    """Two ranks, each with half of the Mamba-2 heads (their in_proj rows, convolution channels, A, D,
    dt bias, norm channels and out_proj columns) and either its half of the groups of B and C or the
    one group whole (the gated norm's sum of squares then all-reduced): the same greedy answers as
    one rank, over chunked prefills and batched decodes. Qwen3-Next: each rank one of the two key heads
    of its Gated DeltaNet layers with their value heads, half of the gated attention's heads (query and
    gate rows together), the one KV head on both; Qwen3.5 the same from its projections apart. LFM2-MoE:
    each rank half of every short convolution's channels (B, C and x rows of in_proj, the
    convolution's, out_proj's columns) and of the experts' widths. Falcon-H1: both halves of every layer
    split, their muP multipliers folded before the split. Jamba: each rank half of every Mamba-1
    mixer's channels (x_proj's all-reduce gives both the whole dt, B and C). Zamba2: the shared blocks'
    heads and MLP width split, each use's adapters' B by the same rows (A whole on both). LFM3: LFM2's
    convolutions split, each rank its query heads' output gates. OLMo Hybrid: each rank one of the two
    key heads with its value heads (its joined q/k/v rows and convolution channels cut as Qwen3.5's),
    the attention layer's whole-projection q/k norms across the ranks' heads. Kimi-Linear: each rank two
    of the four KDA heads (their q, k, v, decay, write-strength and gate rows, convolution channels, A
    and dt bias; the low-rank projections whole), half of the MLA's heads over the one latent row.
    MiniMax: each rank two of the four lightning heads (their q/k/v and gate rows, decay rates and norm
    weights), the norm's sum of squares across the ranks' heads. Ling 3: Kimi-Linear's split with its
    whole-projection gates' rows, the MLA's head gates split with its heads, the clipped experts'
    widths."""
    import random

    ray = pytest.importorskip("ray")

    groups_key = {"granitemoehybrid": "mamba_n_groups", "nemotron_h_moe": "n_groups", "falcon_h1": "mamba_n_groups",
                  "zamba2": "mamba_ngroups"}.get(kind)
    path = save_tiny_model(tmp_path, kind, num_key_value_heads=1, vocab_size=251, tie_word_embeddings=True,
                           **({groups_key: groups} if groups_key else {}))
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(251) for _ in range(rng.randrange(3, 20))] for i in range(4)}
    kwargs = dict(device="cpu", dtype="float32", max_model_len=128, num_cpus=1, max_num_seqs=4)

    def drive(execute) -> dict[str, list[int]]:
        sched = make_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                               prefix_caching=False)
        for rid, prompt in prompts.items():
            sched.add_request(greedy_request(rid, prompt, 8))
        return run_to_completion(sched, execute)

    tp1 = Worker(0, 1, str(path), **kwargs)
    tp1.load_model()
    tp1.initialize_cache(40, 4)
    expected = drive(tp1.execute_model)

    with two_tp_ranks(path, tp_hosts, **kwargs) as (ranks, execute):
        # A rank's states are half of one rank's (with one group, B and C's channels are not halved).
        state_bytes = ray.get([w.mamba_state_bytes.remote() for w in ranks])
        assert state_bytes[0] == state_bytes[1] < tp1.mamba_state_bytes()
        # (A rank's blocks: the one KV head replicated, or Zamba2's heads halved.)
        budget = state_bytes[0] + 40 * ray.get(ranks[0].bytes_per_block.remote(4)) + 1
        assert ray.get([w.determine_num_blocks.remote(4, None, budget) for w in ranks]) == [40, 40]
        ray.get([w.initialize_cache.remote(40, 4) for w in ranks])
        assert drive(execute) == expected


def test_a_model_of_mamba_layers_alone(tmp_path):
    """Granite 4.0-H with no attention layer (transformers' default layer_types): no KV cache at all,
    its blocks only count tokens for the scheduler, and it generates as transformers does."""
    path = save_tiny_model(tmp_path, "granitemoehybrid", layer_types=["mamba"] * 3)
    worker = Worker(0, 1, str(path), device="cpu", dtype="auto", max_model_len=128, num_cpus=1, max_num_seqs=2)
    worker.init_distributed()
    worker.load_model()
    assert worker.model_config.num_attention_layers == 0 and worker.bytes_per_block(4) == 0
    # Blocks of no bytes, as many as max_num_seqs requests of max_model_len tokens hold; the budget
    # must still hold the states.
    num_blocks = worker.determine_num_blocks(4, kv_cache_memory_bytes=1 << 20)
    assert num_blocks == 2 * 128 // 4
    with pytest.raises(ValueError, match="the recurrent states of 2 requests"):
        worker.determine_num_blocks(4, kv_cache_memory_bytes=worker.mamba_state_bytes() - 1)
    worker.initialize_cache(num_blocks, 4)
    assert worker.runner.kv_caches == [] and len(worker.runner.mamba_states) == 3
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
                           prefix_caching=False)
    prompts = _prompts(3)
    for rid, prompt in prompts.items():
        sched.add_request(greedy_request(rid, prompt, 6))
    got = run_to_completion(sched, worker.execute_model)
    hf = load_hf(path)
    for rid, prompt in prompts.items():
        # (transformers' generate cannot cache a model without attention layers: its whole forward, again.)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(hf(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert got[rid] == ids[len(prompt):], rid


def test_sleep_releases_the_states_and_waking_up_starts_them_afresh(hybrid_model):
    """vLLM's sleep mode: the Mamba-2 states go with the KV cache (level 2: the weights too); woken
    up, the runner generates as before."""
    from gpu_worker.weights import iter_checkpoint

    runner = make_runner(hybrid_model, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=12)
    prompts = _prompts(3)

    def generate() -> dict[str, list[int]]:
        sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
                               prefix_caching=False)
        for rid, prompt in prompts.items():
            sched.add_request(greedy_request(f"{rid}-{len(runner.requests)}", prompt, 6))
        return {rid.split("-")[0]: tokens for rid, tokens in run_to_completion(sched, runner.execute_model).items()}

    before = generate()
    runner.sleep(2)
    assert runner.mamba_states == [] and all(mixer.state is None for mixer in runner.mamba_mixers)
    runner.wake_up(["weights", "kv_cache"], lambda: iter_checkpoint(hybrid_model))
    assert [tuple(s.ssm.shape) for s in runner.mamba_states] == [(2, 8, 16, 16)] * 3
    assert generate() == before


@pytest.mark.parametrize("kind", ["granitemoehybrid", "qwen3_next", "mamba2"])
def test_the_memory_profile_runs_a_prefill_and_a_decode_batch_on_throwaway_states(tmp_path, kind):
    """profile_run (what the KV budget is measured by on CUDA) passes a full prefill and then
    max_num_seqs decodes through the recurrent layers, on states of its own: the runner's are left
    as they were."""
    path = save_tiny_model(tmp_path, kind)
    runner = make_runner(path, num_blocks=16, block_size=4, max_num_seqs=5, max_num_batched_tokens=24)
    states = [(s.conv, s.ssm) for s in runner.mamba_states]
    mixers = runner.mamba_mixers
    seen: list[int] = []
    original = mixers[0].forward

    def counting(rope, hidden, meta):  # (the model calls its layers' forward directly: no hooks fire)
        seen.append(0 if meta.mamba.decode_tokens is None else len(meta.mamba.decode_tokens))
        return original(rope, hidden, meta)

    mixers[0].forward = counting
    runner.profile_run(4)
    assert seen == [0, 5]  # the prefill, then five decodes
    assert all(m.state is s and s.conv is conv and s.ssm is ssm
               for m, s, (conv, ssm) in zip(mixers, runner.mamba_states, states, strict=True))


def test_more_held_requests_than_state_rows_grow_the_states(hybrid_model):
    """A runner sized for 2 requests fed 4 at once (a scheduler allowed more): the states grow to the
    rows the requests hold, and each still generates as transformers does."""
    runner = make_runner(hybrid_model, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=48)
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=48, max_num_seqs=4,
                           prefix_caching=False)
    prompts = _prompts(4)
    for rid, prompt in prompts.items():
        sched.add_request(greedy_request(rid, prompt, 5))
    got = run_to_completion(sched, runner.execute_model)
    assert [s.ssm.shape[0] for s in runner.mamba_states] == [4] * 3
    hf = load_hf(hybrid_model)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf, prompt, 5), rid


# Falcon-H1-0.5B's config.json as released (the keys this reader takes).
FALCON_H1_0_5B = {"architectures": ["FalconH1ForCausalLM"], "attention_bias": False, "attention_in_multiplier": 1.0,
                  "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.656854249492381, "head_dim": 64,
                  "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048,
                  "key_multiplier": 0.39062499999999994, "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 128,
                  "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 64, "mamba_d_ssm": 1536,
                  "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 24,
                  "mamba_norm_before_gate": False, "mamba_proj_bias": False, "mamba_rms_norm": False,
                  "max_position_embeddings": 16384, "mlp_bias": False,
                  "mlp_multipliers": [0.8838834764831844, 0.5859375], "model_type": "falcon_h1",
                  "num_attention_heads": 8, "num_hidden_layers": 36, "num_key_value_heads": 2,
                  "projectors_bias": False, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 100000000000.0,
                  "ssm_in_multiplier": 1.25,
                  "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                  "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "vocab_size": 32784}


def test_a_released_falcon_h1_config_is_read():
    """Falcon-H1-0.5B: every layer attends (8 heads of 64, 2 KV heads) and runs a Mamba-2 mixer (24 heads
    of 64: mamba_d_ssm 1536, not 2 x hidden) without its gated norm; the embedding and LM-head
    multipliers; KV blocks count all 36 layers. Without mamba_d_ssm, the heads' width stands."""
    config = ModelConfig.from_dict(FALCON_H1_0_5B)
    assert config.mamba == Mamba2Config(num_heads=24, head_dim=64, num_groups=1, state_size=128, conv_kernel=4,
                                        chunk_size=128, gated_norm=False, norm_before_gate=False,
                                        out_proj_bias=False)
    assert config.parallel_hybrid and config.num_attention_layers == 36 and sum(config.mamba_layers) == 36
    assert config.head_dim == 64 and config.num_key_value_heads == 2 and config.rope_theta == 1e11
    assert config.embedding_multiplier == FALCON_H1_0_5B["embedding_multiplier"]
    assert config.logits_scaling == 1 / 0.0390625 and config.max_context_len == 16384
    without = {k: v for k, v in FALCON_H1_0_5B.items() if k != "mamba_d_ssm"}
    assert ModelConfig.from_dict(without).mamba.intermediate_size == 1536
    with pytest.raises(ValueError, match=r"mamba_n_heads \(24\) x mamba_d_head \(64\) must be mamba_d_ssm \(2048\)"):
        ModelConfig.from_dict({**FALCON_H1_0_5B, "mamba_d_ssm": 2048})


def test_a_chunk_whose_state_is_kept_part_way_is_scanned_in_pieces_that_end_there():
    """States kept 4 and 9 tokens into a 12-token chunk (the prefix cache's, inside the chunk): three
    pieces of its row, the first two naming their kept slots; a decode's row stays batched; a position
    named twice (a prefix-cache slot and a verified draft's) is one piece kept in both. A position
    outside the chunk, at its end or out of order is refused (the end is copied after the forward)."""
    import numpy as np

    from gpu_worker.layers.mamba import mamba_step_metadata

    qsl = np.array([0, 1, 13])  # a decode, then a chunk of twelve tokens
    step = mamba_step_metadata(np.array([5, 2]), qsl, torch.device("cpu"), {1: [(4, 7), (9, 3)]})
    assert step.prefills == [(1, 5, 2), (5, 10, 2), (10, 13, 2)] and step.kept_after == {0: (7,), 1: (3,)}
    assert step.decode_rows.tolist() == [5]
    assert mamba_step_metadata(np.array([5, 2]), qsl, torch.device("cpu")).kept_after == {}
    twice = mamba_step_metadata(np.array([5, 2]), qsl, torch.device("cpu"), {1: [(4, 7), (4, 0), (9, 3)]})
    assert twice.prefills == step.prefills and twice.kept_after == {0: (7, 0), 1: (3,)}
    for kept in ([(0, 1)], [(12, 1)], [(9, 1), (4, 2)], [(0, 1), (0, 2)]):
        with pytest.raises(ValueError, match="must lie inside the chunk, ascending"):
            mamba_step_metadata(np.array([5, 2]), qsl, torch.device("cpu"), {1: kept})


def test_requests_verifying_drafts_are_taken_token_by_token_beside_each_other():
    """Two requests verifying drafts (4 and 2 tokens) beside a decode and a prefill chunk: step j is
    the j-th token of each that has one, as a decode batch, with the states kept after it (a
    position named twice: both slots); the decode and the chunk go as before. A kept position at
    the start, at the end or out of order is refused."""
    import numpy as np

    from gpu_worker.layers.mamba import mamba_step_metadata

    qsl = np.array([0, 1, 5, 10, 12])  # a decode, a verifying request, a prefill chunk, a verifying request
    rows = np.array([7, 2, 4, 9])
    kept = {1: [(1, 20), (1, 5), (2, 21), (3, 22)], 3: [(1, 30)], 2: [(2, 40)]}
    step = mamba_step_metadata(rows, qsl, torch.device("cpu"), kept, token_by_token={1, 3})
    assert step.decode_rows.tolist() == [7] and step.prefills == [(5, 7, 4), (7, 10, 4)]
    assert step.kept_after == {0: (40,)}
    got = [(s.tokens.tolist(), s.rows.tolist(), None if s.kept_rows is None else s.kept_rows.tolist(),
            None if s.kept_slots is None else s.kept_slots.tolist()) for s in step.token_steps]
    assert got == [([1, 10], [2, 9], [2, 2, 9], [20, 5, 30]), ([2, 11], [2, 9], [2], [21]), ([3], [2], [2], [22]),
                   ([4], [2], None, None)]
    for bad in ([(0, 1)], [(4, 1)], [(2, 1), (1, 2)]):
        with pytest.raises(ValueError, match="must lie inside the chunk, ascending"):
            mamba_step_metadata(rows, qsl, torch.device("cpu"), {1: bad}, token_by_token={1, 3})


def test_consecutive_decode_rows_are_updated_where_they_lie():
    """Decodes in consecutive ascending rows (beside a prefill) give a span whose states the step
    updates in place, no copy stored back; other orders copy their rows out and back."""
    import numpy as np

    from gpu_worker.layers.mamba import MambaState, mamba_step_metadata

    qsl = np.array([0, 1, 2, 3, 8])  # three decodes, then a prefill of five tokens
    spanned = mamba_step_metadata(np.array([4, 5, 6, 1]), qsl, torch.device("cpu"))
    assert spanned.decode_row_span == (4, 7) and spanned.prefills == [(3, 8, 1)]
    for rows in ([5, 4, 6, 1], [4, 6, 7, 1]):
        assert mamba_step_metadata(np.array(rows), qsl, torch.device("cpu")).decode_row_span is None
    state = MambaState(torch.zeros(8, 0), torch.arange(8.0).view(8, 1).repeat(1, 2))
    view = state.gather_ssm(spanned.decode_rows, spanned.decode_row_span)
    view.mul_(10)  # (a step's in-place update)
    state.scatter_ssm(spanned.decode_rows, view)
    assert state.ssm[:, 0].tolist() == [0, 1, 2, 3, 40, 50, 60, 7]
    copied = state.gather_ssm(torch.tensor([6, 4]))
    copied.add_(1)
    assert state.ssm[6, 0] == 60  # (a copy: nothing changes until it is stored)
    state.scatter_ssm(torch.tensor([6, 4]), copied)
    assert state.ssm[:, 0].tolist() == [0, 1, 2, 3, 41, 50, 61, 7]
    half = MambaState(torch.zeros(8, 0), torch.zeros(8, 2, dtype=torch.bfloat16))
    assert half.gather_ssm(spanned.decode_rows, spanned.decode_row_span).dtype == torch.float32  # (a copy)


def test_a_pass_rejecting_drafts_puts_the_recurrent_states_back_to_after_the_accepted_ones(hybrid_model):
    """Speculative decoding on recurrent layers through a runner: two requests (one prompt in chunks
    beside the other's verifying passes), scripted drafts of three of which the first 0, 1, 2 or 3 are
    the greedy tokens and the rest wrong. At the start of every pass each request's states, in every
    recurrent layer, are those a runner computing only the tokens the scheduler kept leaves; its tokens
    are transformers'. So too in a second runner fed the same passes whose logits are not its own (a TP
    rank other than 0, which learns what was accepted from the next pass's scheduled tokens alone)."""
    import itertools

    prompts = {"a": [(7 * j + 1) % 256 for j in range(17)], "b": [(5 * j + 3) % 256 for j in range(6)]}
    max_tokens, k = 14, 3
    hf = load_hf(hybrid_model)
    truth = {rid: hf_greedy(hf, prompt, max_tokens + k) for rid, prompt in prompts.items()}
    runner, follower, sched = _drafting_runners(hybrid_model, k)
    checked = _check_states_at_each_pass(runner, follower, hybrid_model)
    for rid, prompt in prompts.items():
        sched.add_request(greedy_request(rid, prompt, max_tokens))
    accepting = itertools.cycle([2, 0, 3, 1, 0])
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    kept_of_rejecting: set[int] = set()  # the drafts accepted by passes that rejected some

    def script(request) -> list[int]:
        done, right = len(tokens[request.request_id]), next(accepting)
        ahead = truth[request.request_id][done:done + k]
        return ahead[:right] + [(t + 1) % 256 for t in ahead[right:]]

    for so, out in _drive(sched, runner, follower, tokens, script):
        for rid, drafted in so.scheduled_spec_decode_tokens.items():
            sampled = out.sampled_token_ids[out.req_id_to_index[rid]]
            if len(sampled) - 1 < len(drafted):
                kept_of_rejecting.add(len(sampled) - 1)
    assert tokens == {rid: truth[rid][:max_tokens] for rid in prompts}
    assert kept_of_rejecting == {0, 1, 2} and len(checked) > 20


def test_a_stop_among_accepted_drafts_puts_a_sessions_states_back_before_its_next_turn(hybrid_model):
    """A resumable session whose verifying pass accepts every draft, one of them its stop token: the
    scheduler keeps the tokens up to the stop (the accepted drafts after it are dropped), and the next
    turn starts from the state after them, on the verifying runner and on one that never sees logits;
    the next turn's tokens are transformers' continuation of the whole conversation."""
    from engine_core.request import Request
    from engine_core.sampling_params import SamplingParams

    first, second, k = [(5 * j + 2) % 256 for j in range(9)], [17, 23, 29], 3
    hf = load_hf(hybrid_model)
    truth = hf_greedy(hf, first, 6)
    assert truth[2] not in truth[:2], "the stop token was meant to end the turn at its third token"
    runner, follower, sched = _drafting_runners(hybrid_model, k)
    checked = _check_states_at_each_pass(runner, follower, hybrid_model)
    tokens: dict[str, list[int]] = {"s": []}
    sched.add_request(Request("s", first, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[truth[2]]),
                              eos_token_id=None, resumable=True))
    drafted = list(_drive(sched, runner, follower, tokens, lambda request: truth[1:1 + k]))
    assert tokens["s"] == truth[:3] and any(so.scheduled_spec_decode_tokens for so, _ in drafted)
    sched.add_request(Request("s", second, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              eos_token_id=None, resumable=True))
    tokens["s"] = []
    list(_drive(sched, runner, follower, tokens, lambda request: []))
    assert tokens["s"] == hf_greedy(hf, first + truth[:3] + second, 4)
    assert ("s", len(first) + 2) in checked  # (the next turn started from the state after its first two tokens)


def _drafting_runners(path, k: int):
    """A runner verifying drafts, a second fed the same passes whose logits are not its own (a TP rank
    other than 0), and their scheduler (blocks of 4, a 12-token budget, two requests at a time)."""
    runner = make_runner(path, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=12,
                         num_spec_tokens=k)
    follower = make_runner(path, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=12,
                           num_spec_tokens=k)
    follower.model.compute_logits = lambda hidden: None
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
                           prefix_caching=False, num_spec_tokens=k)
    return runner, follower, sched


def _drive(sched, runner, follower, tokens: dict[str, list[int]], script):
    """Passes until every request of ``tokens`` finished (its turn: a resumable session waits for its
    next), both runners fed each; after each, every running request gets the drafts
    ``script(request)`` names. Yields (scheduler output, the verifying runner's output)."""
    waiting = set(tokens)
    for _ in range(60):
        if not waiting:
            return
        so = sched.schedule()
        out = runner.execute_model(so)
        follower.execute_model(so)
        for eco in sched.update_from_output(so, out).values():
            for o in eco.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    waiting.discard(o.request_id)
        yield so, out
        sched.update_draft_token_ids({request.request_id: script(request) for request in sched.running})
    raise AssertionError("requests did not finish")


def _check_states_at_each_pass(runner, follower, path) -> list[tuple[str, int]]:
    """At the start of each pass of ``runner`` and ``follower`` (after any rollback, before the
    forward), every request going on from a state holds in every recurrent layer the states a runner
    computing only its tokens so far leaves. Returns the (request, tokens) checked, filled as passes run."""
    reference = make_runner(path, num_blocks=64, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    checked: list[tuple[str, int]] = []
    for run in (runner, follower):
        def step(rows, starts, query_start_loc, kept_within=None, token_by_token=(), run=run,
                 original=run.mamba_step):
            held = {state.table_row: state for state in run.requests.states.values()}
            for row, start in zip(rows.tolist(), starts.tolist(), strict=True):
                if not start:
                    continue
                state = held[row]
                ref_id = f"{state.req_id}@{start}#{len(checked)}"
                reference.execute_model(_prefill_only(reference, ref_id, state.token_ids[:start]))
                ref_row = reference.requests[ref_id].table_row
                for live, ref in zip(run.mamba_states, reference.mamba_states, strict=True):
                    torch.testing.assert_close(live.ssm[row], ref.ssm[ref_row], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(live.conv[row], ref.conv[ref_row], atol=1e-5, rtol=1e-5)
                checked.append((state.req_id, start))
            return original(rows, starts, query_start_loc, kept_within, token_by_token)

        run.mamba_step = step
    return checked


def _prefill_only(runner, req_id: str, token_ids: list[int]):
    """A scheduler output computing ``token_ids`` as a new request's whole prompt in ``runner`` (its
    states then cover exactly those tokens)."""
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1,
                           prefix_caching=False)
    sched.add_request(greedy_request(req_id, token_ids, 1))
    return sched.schedule()
