"""Checkpoints with fp8 linear weights (transformers' FineGrainedFP8, quant_method "fp8"): served
dequantized, they answer as transformers' own loading of the same file does."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import Scheduler
from gpu_worker.config import ModelConfig
from gpu_worker.fp8_checkpoint import dequantize, dequantized
from tests.gpu_worker.utils import hf_greedy, make_runner, run_to_completion, save_tiny_model

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _quantized(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in fp8 with one float32 scale per ``block`` (scale = the block's largest |value|
    over fp8's largest), the way fp8 checkpoints are made."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = torch.empty(grid)
    values = torch.empty_like(weight)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scales[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
            values[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = part / scales[i, j]
    return values.to(torch.float8_e4m3fn), scales


def _save_fp8(path, block: tuple[int, int] = (16, 16)) -> None:
    """Rewrite a saved model's attention and MLP projections as fp8 with their weight_scale_inv,
    and say so in its config, as an fp8 release does (embeddings, norms and the head unquantized)."""
    state = load_file(str(path / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            out[name], out[name + "_scale_inv"] = _quantized(tensor, block)
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config))


def test_an_fp8_checkpoint_answers_as_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "fp8", vocab_size=251)
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _save_fp8(path)
    assert ModelConfig.from_pretrained(path).fp8_weight_block == (16, 16)
    # transformers dequantizes an fp8 checkpoint when it loads it on a CPU.
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    q_proj = reference.model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.float32 and not torch.equal(q_proj, original.model.layers[0].self_attn.q_proj.weight)
    runner = make_runner(path, num_blocks=64, block_size=4)
    torch.testing.assert_close(runner.model.model.layers[0].self_attn.qkv_proj.weight[:64], q_proj)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(251) for _ in range(rng.randrange(3, 20))] for i in range(4)}
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128),
                          CacheConfig(block_size=4, num_blocks=64), log_stats=False)
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert run_to_completion(scheduler, runner.execute_model) == {
        rid: hf_greedy(reference, prompt, 8) for rid, prompt in prompts.items()}


def test_partial_blocks_and_whole_weight_scales_dequantize_element_by_element():
    torch.manual_seed(0)
    weight = torch.randn(40, 70)
    for block in ((16, 32), (40, 70), (7, 9)):
        values, scales = _quantized(weight, block)
        expected = torch.empty_like(weight)
        for r in range(40):
            for c in range(70):
                expected[r, c] = values[r, c].float() * scales[r // block[0], c // block[1]]
        torch.testing.assert_close(dequantize(values, scales, block), expected)
    values = (weight / 0.5).to(torch.float8_e4m3fn)
    torch.testing.assert_close(dequantize(values, torch.tensor(0.5), (0, 0)), values.float() * 0.5)
    with pytest.raises(ValueError, match="needs a 3 x 3 grid of scales"):
        dequantize(values, torch.ones(2, 3), (16, 32))
    # A scale may come before its weight; activation scales are dropped; a weight alone is refused.
    pairs = [("a.weight_scale_inv", torch.tensor(0.5)), ("a.weight", values), ("a.input_scale", torch.tensor(1.0)),
             ("norm.weight", weight)]
    assert [name for name, _ in dequantized(pairs, (0, 0))] == ["a.weight", "norm.weight"]
    with pytest.raises(ValueError, match="weights without their weight_scale_inv"):
        list(dequantized([("a.weight", values)], (0, 0)))


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' are not served"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' are not served"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers")])
def test_other_quantizations_are_refused_by_name(tmp_path, quantization, message):
    path = save_tiny_model(tmp_path / "q", vocab_size=251)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(path)
