"""BitNet b1.58 checkpoints (quant_method "bitnet"): packed ternary weights with their scales, and master
weights rounded to ternary as they are read; every converted layer's input rounded per token to 8 bits.
Checked against transformers' own BitLinear / AutoBitLinear on the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.bitnet_checkpoint import check_bitnet, check_bitnet_model, ternary_weight, unpack_ternary
from gpu_worker.config import ModelConfig
from gpu_worker.layers.linear import fake_quantize_per_token
from tests.gpu_worker.utils import (
    greedy_request,
    hf_greedy,
    make_runner,
    make_scheduler,
    prefill_logits,
    run_to_completion,
    save_tiny_model,
)

_CONVERTED = tuple(f".self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f".mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
PROMPT = [(7 * i + 3) % 256 for i in range(21)]


@pytest.fixture(autouse=True)
def _eager_transformers():
    """transformers' BitNet layers are torch.compile'd; run them eagerly here (the same arithmetic, no
    compiler needed)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _with_quantization(path: Path, quantization: dict) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


def _pack(ternary: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.bitnet import pack_weights

    return pack_weights(ternary.to(torch.int8).clone())


def save_packed(path: Path, kind: str, linear_class: str = "bitlinear", packed: bool = True) -> Path:
    """A tiny model whose converted projections are stored as released: four ternary values a byte (or, not
    ``packed``, the ternary values as they are), each beside a weight_scale: dividing the output under
    "bitlinear" (Falcon3's: 1 / mean |W| of the master weight), multiplying it under "autobitlinear"
    (bitnet-b1.58-2B-4T's: mean |W|)."""
    save_tiny_model(path, kind)
    weights = load_file(str(path / "model.safetensors"))
    stored = {}
    for name, tensor in weights.items():
        if name.endswith(_CONVERTED):
            scale = tensor.abs().mean().clamp(min=1e-5)
            ternary = (tensor / scale).round().clamp(-1, 1)
            stored[name] = _pack(ternary) if packed else ternary
            stored[name + "_scale"] = (scale if linear_class == "autobitlinear" else 1.0 / scale).reshape(1)
        else:
            stored[name] = tensor
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    _with_quantization(path, {"quant_method": "bitnet", "linear_class": linear_class, "quantization_mode": "offline",
                              "modules_to_not_convert": ["lm_head"]})
    return path


def assert_close_but_rounding_flips(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Each position's logits within 2e-4 of transformers', but for at most one position in ten: rounding
    an input to 8 bits is a step function, and where a value lands within the two computations' last-bit
    differences of a step (x * 127 / max|x| near k + 0.5), one of them rounds the other way, which moves
    that position's logits by about one step's worth (a few hundredths here) and nothing else."""
    off = (ours - theirs).abs().amax(dim=-1) > 2e-4
    assert off.sum() <= max(1, len(off) // 10), off.nonzero().flatten().tolist()
    torch.testing.assert_close(ours[~off], theirs[~off], atol=2e-4, rtol=2e-4)


def _hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0]


def test_unpacking_reverses_transformers_packing():
    torch.manual_seed(0)
    ternary = torch.randint(-1, 2, (12, 5)).to(torch.float32)
    assert torch.equal(unpack_ternary(_pack(ternary)), ternary)


def test_per_token_rounding_is_transformers_act_quant():
    from transformers.integrations.bitnet import ActQuant, WeightQuant

    torch.manual_seed(1)
    x = torch.randn(6, 40) * 3
    torch.testing.assert_close(fake_quantize_per_token(x), ActQuant.forward(None, x), atol=0, rtol=0)
    w = torch.randn(16, 8)
    torch.testing.assert_close(ternary_weight(w), WeightQuant.forward(None, w), atol=0, rtol=0)
    rounded = fake_quantize_per_token(x)
    assert all(row.unique().numel() <= 256 for row in rounded) and not torch.equal(rounded, x)


@pytest.mark.parametrize(("kind", "linear_class", "packed"), [
    ("bitnet", "autobitlinear", True), ("bitnet", "autobitlinear", False), ("bitnet", "bitlinear", True),
    ("llama", "bitlinear", True)], ids=["bitnet_2b4t_style", "bitnet_unpacked", "bitnet_bitlinear",
                                        "llama_falcon3_style"])
def test_packed_checkpoints_give_transformers_bitlinear_logits(tmp_path, kind, linear_class, packed):
    """Ternary weights (packed or not) and their scales, every converted layer's input rounded per token: the
    logits transformers' AutoBitLinear (bitnet-b1.58-2B-4T as released: the scale multiplies) or BitLinear
    (Falcon3's: it divides) layers give, on BitNet's own model and on Llama's."""
    path = save_packed(tmp_path, kind, linear_class, packed)
    config = ModelConfig.from_pretrained(path)
    assert config.quantization == "bitnet"
    runner = make_runner(path)
    ours = prefill_logits(runner, PROMPT, list(range(6)))
    assert_close_but_rounding_flips(ours, _hf_logits(path))
    marked = {name for name, module in runner.model.named_modules() if getattr(module, "quantize_input", False)}
    assert marked == {f"model.layers.{i}.{part}" for i in range(2) for part in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}  # (not the head)


def test_master_weights_are_rounded_to_ternary_as_read(tmp_path):
    """autobitlinear / online: the master weights rounded to ternary per tensor as they are read, the inputs
    per token: transformers' AutoBitLinear's logits; not the unquantized model's."""
    path = save_tiny_model(tmp_path, "bitnet")
    plain = prefill_logits(make_runner(path), PROMPT, list(range(6)))
    _with_quantization(path, {"quant_method": "bitnet", "linear_class": "autobitlinear",
                              "quantization_mode": "online"})
    ours = prefill_logits(make_runner(path), PROMPT, list(range(6)))
    assert_close_but_rounding_flips(ours, _hf_logits(path))
    assert (ours - plain).abs().amax(dim=-1).min() > 1e-2  # (every position moved by the quantization)


def test_packed_checkpoint_greedy_tokens_through_the_engine(tmp_path):
    """Chunked prefill and decode over the paged cache, several requests a step: transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    path = save_packed(tmp_path, "bitnet")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    runner = make_runner(path)
    scheduler = make_scheduler(max_num_batched_tokens=13, long_prefill_token_threshold=5)
    prompts = {f"r{i}": [(11 * i + 5 * j + 1) % 256 for j in range(6 + 3 * i)] for i in range(4)}
    for rid, prompt in prompts.items():
        scheduler.add_request(greedy_request(rid, prompt, 8))
    got = run_to_completion(scheduler, runner.execute_model)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(hf, prompt, 8), rid


@pytest.mark.parametrize(("changes", "message"), [
    ({"quantization_mode": "later"}, "quantization_mode"),
    ({"use_rms_norm": True}, "use_rms_norm"),
    ({"modules_to_not_convert": ["lm_head", "model.layers.0.mlp.down_proj"]}, "lm_head alone"),
    ({"modules_to_not_convert": []}, "lm_head alone"),  # (transformers would convert the head too)
    ({"linear_class": "other"}, "linear_class"),
])
def test_variants_not_served_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        check_bitnet({"quant_method": "bitnet", **changes})


def test_tensor_parallelism_lora_and_other_families_are_refused(tmp_path):
    with pytest.raises(ValueError, match="one tensor-parallel rank"):
        check_bitnet_model("BitNetForCausalLM", 2, lora=False)
    with pytest.raises(ValueError, match="LoRA"):
        check_bitnet_model("LlamaForCausalLM", 1, lora=True)
    path = save_tiny_model(tmp_path, "qwen2")
    _with_quantization(path, {"quant_method": "bitnet"})
    with pytest.raises(ValueError, match="not Qwen2ForCausalLM"):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize(("options", "refusal"), [
    ({"tensor_parallel_size": 2}, "one tensor-parallel rank"),
    ({"enable_lora": True, "kind": "jetmoe"}, "not served for JetMoeForCausalLM"),
    ({"enable_lora": True, "kind": "kimi_linear"}, "not served for KimiLinearForCausalLM .*delta-attention"),
    ({"enable_lora": True}, "LoRA adapters are not served on bitnet"),
    ({"tensor_parallel_size": 2, "unquantized": True}, "BitNetForCausalLM is served on one tensor-parallel rank"),
])
def test_an_engine_refuses_before_its_workers_start(tmp_path, options, refusal):
    """What an engine refuses before its workers start: a BitNet checkpoint on two tensor-parallel ranks or
    with LoRA, unquantized BitNet on two ranks, LoRA on a family whose adapters it cannot place (JetMoE,
    Kimi-Linear)."""
    from engine_core.config import EngineConfig, LoRAConfig, SchedulerConfig
    from gpu_worker.executor import create_executor
    from tests.tiny_model import build_tokenizer

    kind = options.pop("kind", None)
    path = (save_tiny_model(tmp_path, kind or "bitnet") if kind or options.pop("unquantized", False)
            else save_packed(tmp_path, "bitnet"))
    build_tokenizer().save_pretrained(path)
    lora = {"lora_config": LoRAConfig()} if options.pop("enable_lora", False) else {}
    with pytest.raises(ValueError, match=refusal):
        create_executor(EngineConfig(model=str(path), device="cpu", num_gpu_blocks=16,
                                     scheduler=SchedulerConfig(max_model_len=64), **options, **lora))
