"""LoRA on mixture-of-experts models' routed experts and routers (gpu_worker/lora/experts.py, the
manager's expert stacks): PEFT adapters served, checked against PEFT's own model."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.outputs import LoRARequest
from gpu_worker.config import ModelConfig
from tests.gpu_worker.test_lora import MAX_TOKENS, _drive, _runner, _worker
from tests.gpu_worker.utils import hf_greedy, load_hf, prefill_logits, save_tiny_model, two_tp_ranks
from tests.lora_adapters import peft_model, save_adapter

STACKS = ("experts.gate_up_proj", "experts.down_proj")


def _logits(runner, lora_id: int, ids: list[int], grouped_mm: bool | None = None,
            experts_lora: bool = True) -> torch.Tensor:
    """The runner's logits for ``ids`` under adapter ``lora_id`` (0: none); ``grouped_mm`` False: the
    experts' per-expert loop; ``experts_lora`` False: the experts computed without their deltas."""
    experts = runner.lora.experts
    deltas = {path: module.lora for path, module in experts.items()}
    for module in experts.values():
        module.grouped_mm = grouped_mm
        if not experts_lora:
            module.lora = None
    try:
        runner.lora.set_batch([lora_id], np.array([0, len(ids)]))
        return prefill_logits(runner, ids, list(range(-(-len(ids) // runner.block_size))))
    finally:
        for path, module in experts.items():
            module.grouped_mm, module.lora = None, deltas[path]


def _pefts_logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's logits for ``ids``, with its adapter and without."""
    with torch.no_grad():
        adapted = model(torch.tensor([ids])).logits[0]
        with model.disable_adapter():
            plain = model(torch.tensor([ids])).logits[0]
    return adapted, plain


# What PEFT (0.22 on) makes of Qwen2-MoE's linear layers and its routed experts' projections' names (it
# joins gate_proj and up_proj in the stacked gate_up_proj, with twice the rank and alpha).
QWEN2_MOE_ALL = dict(targets=("q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                              "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"),
                     parameters=(*STACKS, "mlp.gate.weight"),
                     # (And the router's rank and alpha of its own: PEFT matches them against the parameter's name.)
                     rank_pattern={r".*\.gate_up_proj": 16, r"mlp\.gate\.weight": 4},
                     alpha_pattern={r".*\.gate_up_proj": 32.0, r"mlp\.gate\.weight": 24.0})


@pytest.mark.parametrize(("kind", "adapter"), [
    # The router (gate.weight), the shared expert and its gate, the stacked experts with twice the rank
    # on gate_up (rank_pattern).
    pytest.param("qwen2_moe", QWEN2_MOE_ALL, id="qwen2_moe"),
    # PEFT's all-linear on transformers 5's Mixtral: the same, made by PEFT.
    pytest.param("mixtral", dict(targets="all-linear"), id="mixtral-all-linear"),
    # GPT-OSS's stacks [experts, in, out] with gate and up interleaved, and its router (ours: mlp.gate).
    pytest.param("gpt_oss", dict(targets=("q_proj",), parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                                  "mlp.router.weight")), id="gpt_oss"),
    # Llama 4's stacks [experts, in, out], which PEFT reads as [experts, out, in].
    pytest.param("llama4", dict(targets=(), parameters=STACKS), id="llama4"),
    # Nemotron-H's ungated experts (relu2: up_proj alone).
    pytest.param("nemotron_h_moe", dict(targets=(), parameters=("experts.up_proj", "experts.down_proj")),
                 id="nemotron_h_moe"),
    # DeepSeek-V3's fp32 router, choosing through its correction bias.
    pytest.param("deepseek_v3", dict(targets=(), parameters=(*STACKS, "mlp.gate.weight")), id="deepseek_v3"),
    # Granite MoE's (transformers 5 names them block_sparse_moe.experts, ours mlp.experts).
    pytest.param("granitemoe", dict(targets=(), parameters=STACKS), id="granitemoe"),
    # More families' experts, as loaded (and the hybrids' beside their recurrent layers).
    *(pytest.param(kind, dict(targets=("q_proj",) if kind != "minimax" else (), parameters=STACKS), id=kind)
      for kind in ("qwen3_moe", "olmoe", "deepseek_v2", "glm4_moe", "minimax_m2", "qwen3_next", "minimax", "lfm2_moe")),
    # Jamba's router (its checkpoint's feed_forward.router: our mlp.gate), as a 2-D parameter.
    pytest.param("jamba", dict(targets=("q_proj",), parameters=(*STACKS, "router.weight")), id="jamba"),
    # AFMoE's (mlp.router.gate: our mlp.gate), as a module.
    pytest.param("afmoe", dict(targets=("q_proj", "router.gate"), parameters=STACKS), id="afmoe"),
])
def test_adapters_on_routed_experts_give_pefts_logits(tmp_path, kind, adapter):
    """Served, the adapter gives PEFT's logits, in the grouped GEMM and the per-expert loop alike; the
    experts' deltas are part of it (without them the logits are not PEFT's), and the base model's
    rows stay the base model's."""
    base = save_tiny_model(tmp_path / "base", kind, vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=3, **adapter)
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    gate_up_a = next(t for n, t in tensors.items() if n.endswith(".experts.base_layer.lora_A.weight"))  # (nested)
    config = ModelConfig.from_pretrained(base)
    assert gate_up_a.shape[0] == config.num_experts * (16 if kind in ("qwen2_moe", "mixtral") else 8)
    runner = _runner(base, {1: LoRARequest("a", 1, str(tmp_path / "a"))})
    assert runner.lora.experts
    ids = [random.Random(7).randrange(251) for _ in range(13)]
    adapted, plain = _pefts_logits(peft_model(base, seed=3, **adapter), ids)
    assert (adapted - plain).abs().max() > 0.05  # (Granite's logits are scaled down)
    # (MiniMax's lightning attention in fp32 differs from transformers' by ~6e-5 without any adapter.)
    atol = 2e-4 if kind == "minimax" else 2e-5
    for grouped_mm in (None, False):
        torch.testing.assert_close(_logits(runner, 1, ids, grouped_mm), adapted, atol=atol, rtol=1e-5)
        torch.testing.assert_close(_logits(runner, 0, ids, grouped_mm), plain, atol=atol, rtol=1e-5)
    assert (_logits(runner, 1, ids, experts_lora=False) - adapted).abs().max() > 1e-2


def _as_one_module_per_expert(src: Path, dst: Path, names: dict[str, str], block: str) -> Path:
    """PEFT's adapter on stacked experts (rank r gate_up and down stacks) written as transformers 4's
    per-expert modules would have it: ``<layer>.<block>.experts.<e>.<gate|up|down name>``, A and B of
    expert e (gate and up sharing gate_up's A, each its half of B's rows)."""
    config = json.loads((src / "adapter_config.json").read_text())
    r = config["r"]
    weights = load_file(str(src / "adapter_model.safetensors"))
    out = {}
    for key, tensor in weights.items():
        if ".mlp.experts." not in key:
            out[key] = tensor
            continue
        if not key.endswith("lora_A.weight"):
            continue
        gate_up = ".experts.base_layer." in key
        prefix = key.split(".mlp.experts.")[0] + f".{block}.experts"
        a = tensor
        b = weights[key.replace("lora_A", "lora_B")]
        experts = a.shape[0] // r
        a = a.reshape(experts, r, -1)
        b = b.reshape(b.shape[0], r, experts).permute(2, 0, 1)
        for e in range(experts):
            parts = ({"gate": b[e][: b.shape[1] // 2], "up": b[e][b.shape[1] // 2:]} if gate_up else {"down": b[e]})
            for part, b_part in parts.items():
                out[f"{prefix}.{e}.{names[part]}.lora_A.weight"] = a[e].clone()
                out[f"{prefix}.{e}.{names[part]}.lora_B.weight"] = b_part.contiguous()
    dst.mkdir()
    save_file(out, str(dst / "adapter_model.safetensors"))
    config.pop("target_parameters")
    config["target_modules"] = sorted({*config["target_modules"], *names.values()})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(("kind", "names", "block"), [
    ("mixtral", {"gate": "w1", "up": "w3", "down": "w2"}, "block_sparse_moe"),
    ("qwen2_moe", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, "mlp"),
])
def test_an_adapter_of_one_module_per_expert_serves_as_its_stacked_form(tmp_path, kind, names, block):
    """Transformers 4's form of the same adapter (one module per expert, Mixtral's w1 / w3 / w2 under
    block_sparse_moe): PEFT's logits of the stacked form."""
    base = save_tiny_model(tmp_path / "base", kind, vocab_size=251)
    save_adapter(base, tmp_path / "stacked", seed=5, targets=("q_proj",), parameters=STACKS)
    per_expert = _as_one_module_per_expert(tmp_path / "stacked", tmp_path / "a", names, block)
    tensors = load_file(str(per_expert / "adapter_model.safetensors"))
    assert any(f".{block}.experts.7.{names['up']}." in k for k in tensors)
    runner = _runner(base, {1: LoRARequest("a", 1, str(per_expert))})
    ids = [random.Random(8).randrange(251) for _ in range(11)]
    adapted, _ = _pefts_logits(peft_model(base, seed=5, targets=("q_proj",), parameters=STACKS), ids)
    for grouped_mm in (None, False):
        torch.testing.assert_close(_logits(runner, 1, ids, grouped_mm), adapted, atol=2e-5, rtol=1e-5)


def _two_expert_adapters(root: Path) -> tuple[Path, dict[int, LoRARequest], dict[int, dict], list[list[int]]]:
    """A Qwen2-MoE, adapter 1 all-linear, adapter 2 on the experts alone (rank 4, rank-stabilised), and
    six prompts (request i runs under adapter i % 3, 0 none)."""
    base = save_tiny_model(root / "base", "qwen2_moe", vocab_size=251)
    settings = {1: dict(seed=1, **QWEN2_MOE_ALL),
                2: dict(seed=2, r=4, alpha=8.0, use_rslora=True, targets=(), parameters=STACKS)}
    for lora_id, kwargs in settings.items():
        save_adapter(base, root / str(lora_id), **kwargs)
    adapters = {i: LoRARequest(f"moe{i}", i, str(root / str(i))) for i in settings}
    rng = random.Random(3)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    return base, adapters, settings, prompts


def _pefts_tokens(base: Path, settings: dict[int, dict], prompts: list[list[int]]) -> dict[str, list[int]]:
    models = {0: load_hf(base), **{i: peft_model(base, **kwargs) for i, kwargs in settings.items()}}
    return {f"r{i}": hf_greedy(models[i % 3], p, MAX_TOKENS) for i, p in enumerate(prompts)}


@pytest.mark.parametrize(("budget", "rows_alone"), [(7, True), (64, True), (7, False), (64, None)])
def test_passes_mixing_expert_adapters_and_the_base_model_give_pefts_tokens(tmp_path, budget, rows_alone):
    """Two adapters on the experts and base-model requests in the same passes (chunked prefills beside
    decodes): each request's rows get only its own adapter's expert deltas, whether the grouped GEMMs
    take an adapter's rows alone or every row masked (CUDA's way), or the experts run one by one."""
    base, adapters, settings, prompts = _two_expert_adapters(tmp_path)
    expected = _pefts_tokens(base, settings, prompts)
    assert expected["r1"] != hf_greedy(load_hf(base), prompts[1], MAX_TOKENS)
    worker = _worker(base, adapters)
    for moe in worker._runner().lora.experts.values():
        if rows_alone is None:
            moe.grouped_mm = False
        else:
            moe.lora.rows_alone = rows_alone
    batches: list[set[int]] = []
    assert _drive(worker.execute_model, adapters, prompts, 2, budget, batches) == expected
    assert max(len(b) for b in batches) == 2


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_over_gloo_shards_expert_adapters_as_the_experts(tmp_path, tp_hosts, expert_parallel):
    """Two ranks splitting every expert's width (gate/up rows of B, down columns of A), or holding half
    the experts whole (--enable-expert-parallel): PEFT's tokens."""
    import ray

    base, adapters, settings, prompts = _two_expert_adapters(tmp_path)
    expected = _pefts_tokens(base, settings, prompts)
    with two_tp_ranks(base, tp_hosts, device="cpu", dtype="float32", max_model_len=128, num_cpus=1,
                      max_lora_rank=8, enable_expert_parallel=expert_parallel) as (ranks, execute):
        ray.get([w.initialize_cache.remote(60, 4) for w in ranks])
        for lora in adapters.values():
            assert ray.get([w.add_lora.remote(lora) for w in ranks]) == [True, True]
        assert _drive(execute, adapters, prompts, max_loras=2) == expected


def _edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        adapter_config = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**adapter_config, **config}))
    if tensors is not None:
        path = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(str(path))), str(path))
    return dst


def test_expert_adapters_the_model_cannot_serve_are_refused_by_name(tmp_path):
    base = save_tiny_model(tmp_path / "base", "qwen2_moe", vocab_size=251)
    good = save_adapter(base, tmp_path / "good", seed=1, targets=(), parameters=STACKS)
    worker = _worker(base, {})
    # Shaped for other experts: fewer of them, or another width.
    fewer = save_tiny_model(tmp_path / "fewer", "qwen2_moe", vocab_size=251, num_experts=4)
    with pytest.raises(ValueError, match=r"routed experts model\.layers\.0\.mlp\.experts do not fit the model"):
        worker.add_lora(LoRARequest("fewer", 2, str(save_adapter(fewer, tmp_path / "fewer_a", targets=(),
                                                                 parameters=STACKS))))
    wider = save_tiny_model(tmp_path / "wider", "qwen2_moe", vocab_size=251, moe_intermediate_size=48)
    with pytest.raises(ValueError, match="do not fit the model"):
        worker.add_lora(LoRARequest("wider", 3, str(save_adapter(wider, tmp_path / "wider_a", targets=(),
                                                                 parameters=STACKS))))
    # A config naming another set of stacked parameters than its tensors: an experts' bias read.
    with pytest.raises(ValueError, match=r"LoRA on the experts' bias .*gate_up_proj_bias"):
        worker.add_lora(LoRARequest("bias", 4, str(_edited(
            good, tmp_path / "bias", {"target_parameters": [*STACKS, "experts.gate_up_proj_bias"]}))))
    # Ranks above what --max-lora-rank allows (gate_up: twice it, standing for two projections).
    with pytest.raises(ValueError, match=r"not a rank 32 \(<= 16\) LoRA of stacked experts"):
        worker.add_lora(LoRARequest("rank", 5, str(_edited(
            good, tmp_path / "rank", {"rank_pattern": {"gate_up_proj": 32}}))))
    # A 2-D parameter other than a router's weight (PEFT's LoRA on q_proj.weight: served as the module's
    # it would be right, but not every such parameter is a linear layer's weight, [out, in]).
    q_weight = save_adapter(base, tmp_path / "q_weight", seed=1, targets=(), parameters=("self_attn.q_proj.weight",))
    with pytest.raises(ValueError, match=r"LoRA on the parameter .*self_attn\.q_proj\.weight \(target_parameters\)"):
        worker.add_lora(LoRARequest("q_weight", 7, str(q_weight)))
    # A rank_pattern its tensors do not follow.
    with pytest.raises(ValueError, match=r"rank_pattern gives .*q_proj rank 4, its lora_A has 8 rows"):
        worker.add_lora(LoRARequest("pattern", 8, str(_edited(
            save_adapter(base, tmp_path / "q", seed=1, targets=("q_proj",)), tmp_path / "pattern",
            {"rank_pattern": {"q_proj": 4}}))))
    # Both forms on the same experts: more rank columns than the memory kept for an adapter.
    def both_forms(tensors: dict) -> dict:
        extra = {}
        for expert in range(8):
            name = f"base_model.model.model.layers.0.mlp.experts.{expert}"
            for part, rows in (("gate_proj", 32), ("up_proj", 32)):
                extra[f"{name}.{part}.lora_A.weight"] = torch.zeros(8, 64)
                extra[f"{name}.{part}.lora_B.weight"] = torch.zeros(rows, 8)
        return {**tensors, **extra}
    with pytest.raises(ValueError, match=r"gate/up projections take rank 24, above what --max-lora-rank 8 allows"):
        worker.add_lora(LoRARequest("both", 9, str(_edited(good, tmp_path / "both", tensors=both_forms))))
    # One expert's projection the model has no expert for.
    def expert_99(tensors: dict) -> dict:
        return {**tensors, "base_model.model.model.layers.0.mlp.experts.99.gate_proj.lora_A.weight": torch.zeros(8, 64),
                "base_model.model.model.layers.0.mlp.experts.99.gate_proj.lora_B.weight": torch.zeros(32, 8)}
    with pytest.raises(ValueError, match="do not fit the model"):
        worker.add_lora(LoRARequest("e99", 6, str(_edited(good, tmp_path / "e99", tensors=expert_99))))
    assert worker.list_loras() == []
    assert worker.add_lora(LoRARequest("good", 1, str(good)))


@pytest.mark.parametrize(("kind", "adapter"), [
    ("llama", dict(targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))),
    ("qwen2_moe", {**QWEN2_MOE_ALL, "rank_pattern": {r".*\.gate_up_proj": 16}, "alpha_pattern": {}}),
])
def test_the_device_room_kept_for_adapters_is_what_full_rank_adapters_take(tmp_path, kind, adapter):
    """An adapter of rank max_lora_rank on everything adapters may train holds exactly the bound the
    KV cache's share leaves room for beside the profiled pass's one, --max-loras times over in all (on
    the CPU, where adapters are computed with in host memory, nothing is kept)."""
    base = save_tiny_model(tmp_path / "base", kind, vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=1, **adapter)
    request = LoRARequest("a", 1, str(tmp_path / "a"))
    runner = _runner(base, {1: request}, max_resident_loras=2)
    runner.lora.set_batch([1], np.array([0, 1]))  # (copied "in")
    held = runner.lora.adapters[1].layers
    assert {path.rsplit(".", 1)[-1] for path in held} >= ({"gate", "w13_weight", "w2_weight"} if kind != "llama"
                                                        else {"qkv_proj", "o_proj"})
    size = sum(t.numel() * t.element_size() for pair in held.values() for t in pair)
    assert runner.lora.adapter_bytes_bound() == size
    assert runner.lora.device_bytes_reserved() == (2 - 1) * size
    assert _runner(base, {1: request}).lora.device_bytes_reserved() == 0


def _merged_logits(base: Path, deltas: dict[tuple[int, int, str], torch.Tensor], ids: list[int]) -> torch.Tensor:
    """transformers' logits for ``ids`` with ``deltas`` ((layer, expert, "gate" / "up" / "down") -> the
    delta of that expert's projection, [out, in]) added to the stacked experts' weights."""
    model = load_hf(base)
    with torch.no_grad():
        for (layer, expert, part), delta in deltas.items():
            experts = model.model.layers[layer].mlp.experts
            width = experts.down_proj.shape[2]
            if part == "down":
                experts.down_proj[expert] += delta
            else:
                experts.gate_up_proj[expert, (0 if part == "gate" else width):][:width] += delta
        return model(torch.tensor([ids])).logits[0]


def test_a_full_rank_adapter_in_a_bf16_model_is_laid_out_as_the_profiled_one(tmp_path):
    """DeepSeek-V3 in bf16, its router in fp32: an adapter of rank max_lora_rank on its experts (gate/up
    stacked at twice it) and router holds tensors of the shapes and dtypes the memory profile's
    full-rank adapter holds."""
    base = save_tiny_model(tmp_path / "base", "deepseek_v3", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=1, targets=(), parameters=(*STACKS, "mlp.gate.weight"),
                 rank_pattern={r".*\.gate_up_proj": 16}, alpha_pattern={r".*\.gate_up_proj": 32.0})
    runner = _runner(base, {1: LoRARequest("a", 1, str(tmp_path / "a"))}, dtype=torch.bfloat16,
                     max_resident_loras=2)
    runner.lora.set_batch([1], np.array([0, 1]))  # (copied "in")
    held = runner.lora.adapters[1].layers
    profiled = runner.lora.full_rank_layers(torch.device("cpu"))
    assert {path.rsplit(".", 1)[-1] for path in held} == {"gate", "w13_weight", "w2_weight"}
    assert {held[path][0].dtype for path in held if path.endswith(".gate")} == {torch.float32}
    for path, pair in held.items():
        assert [(t.shape, t.dtype) for t in pair] == [(t.shape, t.dtype) for t in profiled[path]], path


@pytest.mark.parametrize(("kind", "names", "block"), [
    ("mixtral", {"gate": "w1", "up": "w3", "down": "w2"}, "block_sparse_moe"),
    ("qwen2_moe", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, "mlp"),
])
def test_one_module_per_expert_with_gate_and_up_trained_apart_gives_the_merged_weights_logits(
        tmp_path, kind, names, block):
    """Each expert's gate, up and down projections of ranks of their own (their A apart, some experts
    untrained): the logits of the base model with every delta merged into its stacked experts."""
    base = save_tiny_model(tmp_path / "base", kind, vocab_size=251)
    config = ModelConfig.from_pretrained(base)
    hidden, width = config.hidden_size, config.moe_intermediate_size
    gen = torch.Generator().manual_seed(4)
    tensors, deltas = {}, {}
    rank, alpha = 6, 9.0
    for layer in range(config.num_hidden_layers):
        for expert in range(0, config.num_experts, 2 if layer else 1):  # (layer 1: every other expert)
            for part, (inputs, outputs) in {"gate": (hidden, width), "up": (hidden, width),
                                            "down": (width, hidden)}.items():
                a = torch.randn(rank, inputs, generator=gen) * 0.3
                b = torch.randn(outputs, rank, generator=gen) * 0.3
                name = f"base_model.model.model.layers.{layer}.{block}.experts.{expert}.{names[part]}"
                tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
                deltas[(layer, expert, part)] = b @ a * (alpha / rank)
    (tmp_path / "a").mkdir()
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(names.values())}))
    runner = _runner(base, {1: LoRARequest("a", 1, str(tmp_path / "a"))})
    ids = [random.Random(9).randrange(251) for _ in range(12)]
    expected = _merged_logits(base, deltas, ids)
    assert (expected - _merged_logits(base, {}, ids)).abs().max() > 0.2
    for grouped_mm in (None, False):
        torch.testing.assert_close(_logits(runner, 1, ids, grouped_mm), expected, atol=2e-5, rtol=1e-5)


def test_expert_adapters_in_a_bf16_model_give_pefts_logits_to_bf16s_rounding(tmp_path):
    """In bf16 (the experts' stacks and the routers' deltas in the model's dtype): PEFT's fp32 logits,
    within bf16's rounding, far closer than the adapter moves them."""
    base = save_tiny_model(tmp_path / "base", "qwen2_moe", vocab_size=251)
    save_adapter(base, tmp_path / "a", seed=3, **QWEN2_MOE_ALL)
    runner = _runner(base, {1: LoRARequest("a", 1, str(tmp_path / "a"))}, dtype=torch.bfloat16)
    stacks = runner.lora.adapters[1].layers
    assert {t.dtype for pair in stacks.values() for t in pair} == {torch.bfloat16}
    ids = [random.Random(7).randrange(251) for _ in range(13)]
    adapted, plain = _pefts_logits(peft_model(base, seed=3, **QWEN2_MOE_ALL), ids)
    for grouped_mm in (None, False):
        error = (_logits(runner, 1, ids, grouped_mm).float() - adapted).abs().max()
        assert error < 0.1 * (adapted - plain).abs().max()
        # (The experts' deltas are far more than that rounding.)
        assert (_logits(runner, 1, ids, grouped_mm, experts_lora=False).float() - adapted).abs().max() > 5 * error


@pytest.mark.parametrize(("kind", "adapter"), [
    ("qwen2_moe", QWEN2_MOE_ALL),
    ("gpt_oss", dict(targets=("q_proj",), parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                                      "mlp.router.weight"))),
    ("nemotron_h_moe", dict(targets=(), parameters=("experts.up_proj", "experts.down_proj"))),
])
def test_the_memory_profile_runs_under_a_full_rank_adapter_and_sleep_keeps_adapters_loadable(tmp_path, kind, adapter):
    """Where adapters go to the device, the profiled pass runs every row under an adapter of
    max_lora_rank on every layer adapters may train (its peak holds one, and the deltas' temporaries);
    the pass after it runs under none. Asleep with the weights discarded, an adapter still loads (its
    shapes are read from the layers, not their emptied weights), and serves PEFT's tokens on waking."""
    base = save_tiny_model(tmp_path / "base", kind, vocab_size=251)
    runner = _runner(base, {}, max_resident_loras=2)
    lora = runner.lora
    profiled = []
    real_set_profile_batch = lora.set_profile_batch

    def set_profile_batch() -> None:
        real_set_profile_batch()
        profiled.append([set(adapter.layers) for adapter, rows in lora.batch.groups if rows is None])

    lora.set_profile_batch = set_profile_batch
    runner.profile_run(4)
    assert profiled == [[set(lora.layers) | {f"{p}.{w}" for p in lora.experts for w in ("w13_weight", "w2_weight")}]]
    assert lora.batch.groups == []
    assert _runner(base, {}).lora.device_bytes_reserved() == 0  # (the CPU: no device copies)

    save_adapter(base, tmp_path / "a", seed=2, **adapter)
    worker = _worker(base, {})
    worker.sleep(2)
    assert worker.add_lora(LoRARequest("a", 1, str(tmp_path / "a")))
    worker.wake_up(["weights", "kv_cache"])
    adapters = {1: LoRARequest("a", 1, str(tmp_path / "a"))}
    rng = random.Random(2)
    prompts = [[rng.randrange(251) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    models = {0: load_hf(base), 1: peft_model(base, seed=2, **adapter)}
    expected = {f"r{i}": hf_greedy(models[1 if i % 3 == 1 else 0], p, MAX_TOKENS) for i, p in enumerate(prompts)}
    assert _drive(worker.execute_model, adapters, prompts, max_loras=1) == expected
