"""Worker: cache sizing, in-process TP=1, and TP=2 over gloo (two Ray actors) against TP=1."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.config import SpeculativeConfig
from engine_core.sched.output import SchedulerOutput
from engine_core.sched.scheduler import Scheduler
from engine_core.spec_decode import NgramProposer
from gpu_worker.config import ModelConfig
from gpu_worker.kv_cache import kv_cache_bytes_per_block, model_bytes_per_block
from gpu_worker.worker import Worker
from tests.gpu_worker.utils import (
    greedy_request,
    make_scheduler,
    run_to_completion,
    save_tiny_model,
    two_tp_ranks,
)


def test_bytes_per_block_formula(tmp_path):
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    cfg = ModelConfig.from_pretrained(save_tiny_model(tmp_path, num_key_value_heads=2))
    # 2 layers, 2 KV heads of 16 dims; with TP=4 each rank still keeps one (replicated) head.
    assert model_bytes_per_block(cfg, 4, 1, torch.float32) == 2 * 2 * 4 * 2 * 16 * 4
    assert model_bytes_per_block(cfg, 4, 4, torch.float32) == 2 * 2 * 4 * 1 * 16 * 4


def test_worker_tp1_lifecycle(tmp_path):
    path = save_tiny_model(tmp_path)
    worker = Worker(0, 1, str(path), device="cpu", dtype="auto", max_model_len=128, num_cpus=1)
    assert worker.device == torch.device("cpu") and worker.dtype == torch.float32
    worker.init_distributed()  # TP=1: no process group
    assert not torch.distributed.is_initialized()
    worker.load_model()
    per_block = worker.bytes_per_block(4)
    assert worker.determine_num_blocks(4, kv_cache_memory_bytes=per_block * 10 + 5) == 10
    assert worker.determine_num_blocks(4, num_blocks=7) == 7
    with pytest.raises(ValueError):
        worker.determine_num_blocks(4)
    worker.initialize_cache(10, 4)
    sched = make_scheduler(num_blocks=10, block_size=4)
    sched.add_request(greedy_request("a", [1, 2, 3, 4, 5], 3))
    got = run_to_completion(sched, worker.execute_model)
    assert len(got["a"]) == 3
    assert worker.execute_model(SchedulerOutput.make_empty()).req_ids == []


def test_worker_from_config_dict_and_weight_factory(tmp_path):
    import json

    from gpu_worker.weights import iter_safetensors

    path = save_tiny_model(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    worker = Worker(0, 1, cfg, device="cpu", dtype="float32", weights=lambda: iter_safetensors(path))
    worker.load_model()
    worker.initialize_cache(8, 4)
    with pytest.raises(ValueError, match="weights"):
        Worker(0, 1, cfg)


def _drive(workers_execute, prompts: dict[str, list[int]], num_blocks: int, spec: bool = False,
           drafted: list[int] | None = None) -> dict[str, list[int]]:
    """Greedy answers; with ``spec``, n-gram drafts verified in the same passes (the number of
    passes that carried drafts goes to ``drafted``)."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16,
                           num_spec_tokens=3 if spec else 0)
    for rid, p in prompts.items():
        sched.add_request(greedy_request(rid, p, 8))
    drafter = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2),
                            max_model_len=sched.max_model_len) if spec else None

    def count(_: int, so: SchedulerOutput) -> None:
        if drafted is not None and so.scheduled_spec_decode_tokens:
            drafted.append(len(so.scheduled_spec_decode_tokens))

    return run_to_completion(sched, workers_execute, on_step=count, drafter=drafter)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "overrides", "expert_parallel"), [
    ("llama", {}, False),
    ("qwen2_moe", {"mlp_only_layers": [0]}, False),
    ("qwen2_moe", {"mlp_only_layers": [0]}, True),
    ("gemma2", {"attn_logit_softcapping": 1.5}, False),
    ("gpt_oss", {}, False),
    ("gpt_oss", {}, True),
    ("olmo2", {}, False),
    ("glm4_moe", {"use_qk_norm": True}, False),
    ("glm4_moe", {}, True),
    ("deepseek_v3", {}, False),
    ("deepseek_v2", {"q_lora_rank": 24}, True),
    ("olmoe", {}, True),
    ("granitemoe", {}, True),
    ("minimax_m2", {}, False),
    ("cohere", {"use_qk_norm": True, "initializer_range": 0.3}, False),
    ("glm4", {}, False),
    ("exaone4", {}, False),
    ("ernie4_5_moe", {"moe_num_shared_experts": 2}, True),
    ("stablelm", {"use_parallel_residual": True, "qk_layernorm": True}, False),
    ("llama4", {"num_local_experts": 8}, True),
    ("gpt_neox", {}, False),
    ("phi", {"qk_layernorm": True}, False),
    ("dots1", {}, True),
    ("gpt_bigcode", {}, False),
    ("gptj", {}, False),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, False),
    ("bloom", {}, False),
    ("flex_olmo", {}, True),
    ("dbrx", {"initializer_range": 0.3}, False),
    ("hunyuan_moe", {}, True),
    ("minicpm3", {}, False),
    ("minicpm5_moe", {}, True),
    ("glm4_moe_lite", {}, True),
    ("exaone_moe", {}, True),
    ("gemma3n", {}, False),
    ("gemma4", {}, True),
    ("jais2", {}, False),
    ("solar_open", {}, True),
    ("youtu", {}, False),
    ("afmoe", {}, True),
    ("laguna", {}, True),
    ("mellum", {}, False),
    ("hy_v3", {}, True),
    ("mimo_v2_flash", {}, True),
    ("granite_swa", {}, False),
    ("granitemoe_swa", {}, True),
    ("cohere2_moe", {}, True),
    ("gpt_neo", {}, False),
    ("codegen", {}, False),
    ("hyperclovax", {}, False),
    ("axk1", {}, True),
    ("nanochat", {}, False),
    ("kolibri1", {}, True),
    ("flint", {}, True),
    ("beam", {}, True),
    ("jetmoe", {"initializer_range": 0.3}, False),
    ("jetmoe", {"initializer_range": 0.3, "num_key_value_heads": 2}, True),
    ("longcat_flash", {"initializer_range": 0.1}, True),
    ("biogpt", {}, False),
    ("xglm", {}, False),
    ("modernbert_decoder", {}, False),
    ("deepseek_v32", {}, True),
    ("glm_moe_dsa", {"num_hidden_layers": 3}, True),
], ids=["llama", "qwen2_moe", "qwen2_moe_expert_parallel", "gemma2", "gpt_oss", "gpt_oss_expert_parallel", "olmo2",
        "glm4_moe", "glm4_moe_expert_parallel", "deepseek_v3", "deepseek_v2_expert_parallel", "olmoe_expert_parallel",
        "granitemoe_expert_parallel", "minimax_m2", "cohere_qk_norm", "glm4", "exaone4",
        "ernie4_5_moe_expert_parallel", "stablelm_2_12b_style", "llama4_expert_parallel",
        "gpt_neox", "phi_qk_layernorm", "dots1_expert_parallel",
        "gpt_bigcode_multi_query", "gptj", "falcon_40b_style", "bloom",
        "flex_olmo_expert_parallel", "dbrx", "hunyuan_moe_expert_parallel", "minicpm3",
        "minicpm5_moe_expert_parallel", "glm4_moe_lite_expert_parallel",
        "exaone_moe_expert_parallel", "gemma3n",
        "gemma4_expert_parallel", "jais2", "solar_open_expert_parallel", "youtu",
        "afmoe_expert_parallel", "laguna_expert_parallel", "mellum",
        "hy_v3_expert_parallel", "mimo_v2_flash_expert_parallel", "granite_swa",
        "granitemoe_swa_expert_parallel", "cohere2_moe_expert_parallel",
        "gpt_neo", "codegen", "hyperclovax", "axk1_expert_parallel", "nanochat",
        "kolibri1_expert_parallel", "flint_expert_parallel", "beam_expert_parallel",
        "jetmoe", "jetmoe_expert_parallel", "longcat_flash_expert_parallel",
        "biogpt", "xglm", "modernbert_decoder", "deepseek_v32_expert_parallel",
        "glm_moe_dsa_expert_parallel"])
def test_tp2_over_gloo_equals_tp1(tmp_path, kind, overrides, expert_parallel, tp_hosts):
    """Qwen2-MoE: each rank holds half of every expert (or, with expert parallelism, half of the
    experts whole) and half of the shared expert; one all-reduce per layer sums their outputs.
    GPT-OSS: each rank its query heads' sinks, its slice (or its experts') of the experts' gate/up
    bias, and the down bias once (rank 0 under a width split, each expert's rank under expert
    parallelism). OLMo 2: the q/k norms over the whole projections, from each rank's heads (the one KV
    head replicated on both). GLM-4.5: the fp32 router and its correction bias replicated, the
    ungated shared expert split by width. DeepSeek: each rank its heads' query, latent-to-key/value
    and output rows, the latent's projection and the cache's one row per token on both. Command-R+:
    each rank its query heads' norm weights, the one KV head's on both. GPT-NeoX: each rank its heads'
    rows of the per-head fused query_key_value; Falcon-40B: its KV groups' rows of the grouped one;
    GPTBigCode: the learned positions on both ranks, the one KV head of c_attn replicated. BLOOM: each
    rank the ALiBi slopes of its own query heads, the embeddings' norm on both. FlexOlmo: OLMo 2's
    whole-projection q/k norms across the ranks' heads, half of the experts whole on each. DBRX: each
    rank its query heads' rows of the fused Wqkv, the one KV head's on both, half of every expert's
    width (its stacked w1, v1, w2 cut per expert). Hunyuan MoE: each rank its heads' q/k norms (after
    RoPE), half of the experts whole, the shared MLP split by width. (Cohere's and DBRX's
    weights drawn wider, 0.3: with the default the tiny models' greedy answers repeat nothing for n-gram
    drafts to find.)
    ERNIE 4.5 MoE: half of the experts whole on each rank, the fp32 router and its correction bias on
    both, the two shared experts (one MLP twice as wide) split by width. Llama 4: half of the experts
    whole on each rank, each weighted on its input, the shared expert split by width."""
    ray = pytest.importorskip("ray")
    # One KV head for two ranks (replicated), an odd vocab (padded shards) and tied embeddings.
    path = save_tiny_model(tmp_path, kind, **{"num_key_value_heads": 1, "vocab_size": 251, "tie_word_embeddings": True,
                                              **overrides})
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(251) for _ in range(rng.randrange(3, 20))] for i in range(4)}
    kwargs = dict(device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                  enable_expert_parallel=expert_parallel)

    tp1 = Worker(0, 1, str(path), **kwargs)
    tp1.load_model()
    tp1.initialize_cache(40, 4)
    expected = _drive(tp1.execute_model, prompts, 40)

    with two_tp_ranks(path, tp_hosts, **kwargs) as (ranks, execute):
        # The single KV head is replicated, so a rank's block is as large as a TP=1 block (GPT-NeoX's,
        # GPT-J's, this Falcon's, BLOOM's and GPT-Neo's KV heads are more, split between the ranks: half as large;
        # MiMo-V2-Flash's windowed layers have two, split, beside its full layers' one, replicated: a rank's
        # block is 4 of a TP=1 block's 6 head-rows).
        num_blocks = ray.get([w.determine_num_blocks.remote(4, None, 40 * tp1.bytes_per_block(4) + 1)
                              for w in ranks])
        halved = kind in ("gpt_neox", "gptj", "falcon", "bloom", "gpt_neo", "codegen", "biogpt", "xglm",
                          "modernbert_decoder") \
            or overrides.get("num_key_value_heads", 1) > 1  # (JetMoE's two key heads split: each rank one)
        assert num_blocks == ([80, 80] if halved else [60, 60] if kind == "mimo_v2_flash" else [40, 40])
        ray.get([w.initialize_cache.remote(40, 4) for w in ranks])
        if expert_parallel:
            def first_expert(worker):
                layer = worker.runner.model.model.layers[1]  # (Gemma 4's experts beside its MLP)
                if getattr(worker.runner.model.model.layers[0], "moe", None) is not None:
                    return worker.runner.model.model.layers[0].moe.experts.first_expert  # (LongCat-Flash's)
                experts = layer.experts if getattr(layer, "experts", None) is not None else layer.mlp.experts
                return experts.first_expert

            assert ray.get([w.__ray_call__.remote(first_expert) for w in ranks]) == [0, 4]

        assert _drive(execute, prompts, 40) == expected
        # Speculative decoding: rank 1 never sees which drafts rank 0 kept, only the next pass's diffs.
        drafted: list[int] = []
        assert _drive(execute, prompts, 40, spec=True, drafted=drafted) == expected
        assert drafted, "no pass carried drafts"


@pytest.mark.parametrize("spec", [False, True])
def test_a_preempted_request_recomputes_its_outputs_in_chunks_without_sampling_early(tmp_path, spec):
    """After preemption a request re-prefills prompt and outputs; with a small budget the chunks
    start past the prompt. Only the chunk that reaches its last token may sample."""
    path = save_tiny_model(tmp_path)
    worker = Worker(0, 1, str(path), device="cpu", dtype="float32", max_model_len=128, num_cpus=1)
    worker.load_model()
    worker.initialize_cache(64, 4)
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(100) for _ in range(3)] for i in range(3)}

    def answers(num_blocks: int, chunks_past_prompt: list[int]) -> dict[str, list[int]]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=6,
                               num_spec_tokens=3 if spec else 0)
        for rid, p in prompts.items():
            sched.add_request(greedy_request(rid, p, 30))
        drafter = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1),
                                max_model_len=128) if spec else None

        def watch(_: int, so: SchedulerOutput) -> None:
            for rid, start in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens,
                                  strict=True):
                request = sched.requests[rid]
                if start >= request.num_prompt_tokens and start + so.num_scheduled_tokens[rid] < request.num_tokens:
                    chunks_past_prompt.append(start)

        return run_to_completion(sched, worker.execute_model, on_step=watch, drafter=drafter)

    expected = answers(64, [])
    chunks: list[int] = []
    assert answers(14, chunks) == expected
    assert chunks, "no recompute chunk started past a prompt: the pool was meant to force preemption"


@pytest.mark.parametrize("seed", range(4))
def test_greedy_answers_do_not_depend_on_budget_pool_or_drafting(tmp_path, seed):
    """Random workloads under small token budgets (chunked prefill), small KV pools (preemption,
    recompute past the prompt) and random draft settings: the same greedy tokens as one roomy,
    plain run."""
    path = save_tiny_model(tmp_path)
    worker = Worker(0, 1, str(path), device="cpu", dtype="float32", max_model_len=128, num_cpus=1)
    worker.load_model()
    worker.initialize_cache(128, 4)
    rng = random.Random(seed)
    # Small alphabets make the n-gram drafter find matches; some requests stop on a token id.
    requests = [(f"r{i}", [rng.randrange(12) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 40),
                 [rng.randrange(12)] if rng.random() < 0.3 else []) for i in range(8)]

    def answers(num_blocks: int, budget: int, k: int) -> tuple[dict[str, list[int]], Scheduler]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, num_spec_tokens=k)
        for rid, prompt, max_tokens, stop_ids in requests:
            sched.add_request(greedy_request(rid, prompt, max_tokens, stop_token_ids=stop_ids))
        drafter = (NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=rng.randrange(1, 3),
                                                   prompt_lookup_max=3), max_model_len=128) if k else None)
        return run_to_completion(sched, worker.execute_model, max_steps=2000, drafter=drafter), sched

    expected, _ = answers(128, 256, 0)
    for _ in range(3):
        got, sched = answers(rng.randrange(18, 40), rng.randrange(4, 24), rng.randrange(0, 5))
        assert got == expected
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sched.cache_config.num_blocks


def test_expert_parallelism_over_a_size_that_does_not_divide_the_experts_is_refused_before_workers_start(
        tmp_path, caplog):
    import logging

    from engine_core.config import EngineConfig, SchedulerConfig
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tiny_moe

    path = build_tiny_moe(tmp_path)  # 8 experts
    model_len = SchedulerConfig(max_model_len=None)  # (the model's own 1024)
    with pytest.raises(ValueError, match=r"8 experts cannot be split evenly over tensor_parallel_size=3"):
        create_executor(EngineConfig(model=str(path), tensor_parallel_size=3, enable_expert_parallel=True,
                                     device="cpu", scheduler=model_len))
    # On one rank the flag changes nothing, and says so.
    with caplog.at_level(logging.INFO, logger="gpu_worker.executor"):
        create_executor(EngineConfig(model=str(path), enable_expert_parallel=True, device="cpu",
                                     num_gpu_blocks=64, scheduler=model_len)).shutdown()
    assert "--enable-expert-parallel has no effect (tensor_parallel_size is 1)" in caplog.text


def test_auto_dtype_keeps_the_checkpoints_except_float32_on_a_gpu():
    """vLLM's rule on CUDA: a float32 checkpoint runs in bfloat16 (float16 for an embedding model),
    others in their own dtype; on the CPU, float32 (exact, and fast kernels)."""
    import dataclasses

    from gpu_worker import worker

    resolve_dtype = getattr(worker.resolve_dtype, "__wrapped__", worker.resolve_dtype)  # (conftest's, on a GPU)
    from tests.gpu_worker.utils import make_config

    config = ModelConfig.from_dict({**make_config("llama").to_dict(), "architectures": ["LlamaForCausalLM"]})
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for checkpoint, generating, pooling in ((torch.float32, torch.bfloat16, torch.float16),
                                            (None, torch.bfloat16, torch.float16),
                                            (torch.float16, torch.float16, torch.float16),
                                            (torch.bfloat16, torch.bfloat16, torch.bfloat16)):
        model = dataclasses.replace(config, dtype=checkpoint)
        assert resolve_dtype("auto", model, cuda) == generating
        assert resolve_dtype("auto", model, cuda, pooling=True) == pooling
        assert resolve_dtype("auto", model, cpu) == torch.float32
    assert resolve_dtype("float16", dataclasses.replace(config, dtype=torch.float32), cuda) == torch.float16
