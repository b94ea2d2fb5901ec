"""Quantized checkpoints: fp8 linear weights (transformers' FineGrainedFP8, quant_method "fp8") and
llm-compressor's compressed-tensors (fp8, int8, packed int4); served dequantized, they answer as
transformers' own dequantizing load of the same files does."""

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
from gpu_worker.fp8_checkpoint import dequantized
from gpu_worker.layers.weight_utils import materialize
from gpu_worker.quantized_checkpoint import ScaledWeight, dequantize
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


def _greedy_as_the_reference(path, reference, runner=None) -> None:
    """The served model's q_proj (Llama's) and greedy answers equal the reference model's."""
    if runner is None:
        runner = make_runner(path, num_blocks=64, block_size=4)
        torch.testing.assert_close(runner.model.model.layers[0].self_attn.qkv_proj.weight[:64],
                                   reference.model.layers[0].self_attn.q_proj.weight)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(251) for _ in range(rng.randrange(3, 20))] for i in range(4)}
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=128),
                          CacheConfig(block_size=4, num_blocks=64), log_stats=False)
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
    assert run_to_completion(scheduler, runner.execute_model) == {
        rid: hf_greedy(reference, prompt, 8) for rid, prompt in prompts.items()}


def test_an_fp8_checkpoint_answers_as_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "fp8", vocab_size=251)
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _save_fp8(path)
    config = ModelConfig.from_pretrained(path)
    assert (config.quantization, config.fp8_weight_block) == ("fp8", (16, 16))
    # transformers dequantizes an fp8 checkpoint when it loads it on a CPU.
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    q_proj = reference.model.layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.float32 and not torch.equal(q_proj, original.model.layers[0].self_attn.q_proj.weight)
    _greedy_as_the_reference(path, reference)


def test_deepseek_v32s_fp8_release_dequantizes_its_indexer_too(tmp_path):
    """DeepSeek-V3.2's release quantizes the indexer's query and key projections with the rest (its head
    weights not): they dequantize as read, and the greedy answers are transformers' on the dequantized
    weights."""
    import shutil

    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "fp8", "deepseek_v32", vocab_size=251, num_hidden_layers=3)
    state, fp8, plain = load_file(str(path / "model.safetensors")), {}, {}
    for name, tensor in state.items():
        if name.endswith(("_proj.weight", ".indexer.wq_b.weight", ".indexer.wk.weight")) \
                and not name.endswith("weights_proj.weight"):
            values, scales = _quantized(tensor, (16, 16))
            fp8[name], fp8[name + "_scale_inv"] = values, scales
            plain[name] = materialize(ScaledWeight(values, scales, (16, 16)))
        else:
            fp8[name] = plain[name] = tensor
    shutil.copytree(path, tmp_path / "dequantized")
    save_file(plain, str(tmp_path / "dequantized" / "model.safetensors"))
    save_file(fp8, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).eval()
    runner = make_runner(path, num_blocks=64, block_size=4)
    ours, theirs = runner.model.model.layers[1].self_attn.indexer, reference.model.layers[1].self_attn.indexer
    assert not torch.equal(theirs.wk.weight, state["model.layers.1.self_attn.indexer.wk.weight"])
    torch.testing.assert_close(ours.wk.weight, theirs.wk.weight)
    torch.testing.assert_close(ours.wq_b.weight, theirs.wq_b.weight)
    _greedy_as_the_reference(path, reference, runner)


def _save_compressed(path, preset: str) -> None:
    """Rewrite a saved model's projections as llm-compressor writes ``preset`` (its scheme, with
    int4 groups of 32 for these narrow layers): scales from each channel's or group's largest
    |value|, compressed by the compressed-tensors library's own compressor; its quantization_config
    in the config."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    if args.group_size:
        args.group_size = 32
    scheme.format = infer_module_format(torch.nn.Linear, scheme)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    largest = FP8_MAX if args.type == "float" else 2 ** (args.num_bits - 1) - 1
    state, out = load_file(str(path / "model.safetensors")), {}
    for name, weight in state.items():
        if not name.endswith("_proj.weight"):
            out[name] = weight
            continue
        rows = weight.reshape(weight.shape[0], -1, args.group_size) if args.group_size else weight.unsqueeze(1)
        scale = rows.abs().amax(dim=2) / largest  # (one per channel, or per group of a channel)
        module = name.removesuffix(".weight")
        out |= {f"{module}.{k}": v for k, v in compressor.compress({"weight": weight, "weight_scale": scale},
                                                                     scheme).items()}
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, quant_method="compressed-tensors", format=scheme.format.value,
        ignore=["lm_head"], quantization_status="compressed").model_dump(mode="json")
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W8A8", "W4A16"])
def test_a_compressed_tensors_checkpoint_answers_as_transformers_loads_it(tmp_path, preset):
    """llm-compressor's fp8 (channel scales), int8 (channel) and packed int4 (groups) layers."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path = save_tiny_model(tmp_path / preset, vocab_size=251)
    _save_compressed(path, preset)
    assert ModelConfig.from_pretrained(path).quantization == "compressed-tensors"
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    _greedy_as_the_reference(path, reference)


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
        # A tensor-parallel rank reads its rows (or columns) only: the same values.
        lazy = ScaledWeight(values, scales, block)
        torch.testing.assert_close(lazy.narrow(0, 13, 20), expected[13:33])
        torch.testing.assert_close(lazy.narrow(1, 35, 35), expected[:, 35:])
    # Stacked experts, each with its own grid, read an expert (or a slice of every one) at a time.
    stacked = torch.randn(3, 32, 48)
    parts = [_quantized(expert, (16, 16)) for expert in stacked]
    lazy = ScaledWeight(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), (16, 16))
    for e, (values, scales) in enumerate(parts):
        torch.testing.assert_close(lazy.narrow(0, e, 1)[0], dequantize(values, scales, (16, 16)))
        torch.testing.assert_close(lazy.narrow(1, 8, 16)[e], dequantize(values, scales, (16, 16))[8:24])
    values = (weight / 0.5).to(torch.float8_e4m3fn)
    torch.testing.assert_close(dequantize(values, torch.tensor(0.5), (0, 0)), values.float() * 0.5)
    with pytest.raises(ValueError, match="needs a 3 x 3 grid of scales"):
        dequantize(values, torch.ones(2, 3), (16, 32))


def test_scales_pair_with_their_weights_whatever_their_name_and_order():
    """weight_scale_inv (block-wise) or weight_scale (a per-tensor export's), before or after the
    weight (another file); activation and KV-cache scales dropped; an fp8 weight alone refused."""
    weight = torch.randn(8, 8)
    values = (weight / 0.5).to(torch.float8_e4m3fn)
    pairs = [("a.weight_scale_inv", torch.tensor(0.5)), ("a.weight", values), ("a.input_scale", torch.tensor(1.0)),
             ("b.weight", values), ("attn.k_scale", torch.tensor(1.0)), ("b.weight_scale", torch.tensor([0.25])),
             ("norm.weight", weight)]
    out = dict(dequantized(pairs, (0, 0)))
    assert list(out) == ["a.weight", "b.weight", "norm.weight"]
    torch.testing.assert_close(materialize(out["a.weight"]), values.float() * 0.5)
    torch.testing.assert_close(materialize(out["b.weight"]), values.float() * 0.25)
    with pytest.raises(ValueError, match="weights without their scale"):
        list(dequantized([("a.weight", values)], (0, 0)))


def test_an_fp8_tensor_without_a_quantization_config_is_refused(tmp_path):
    """(Its values alone, cast to the model's dtype, would be silently wrong.)"""
    path = save_tiny_model(tmp_path / "fp8", vocab_size=251)
    _save_fp8(path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="values without their scale"):
        make_runner(path, num_blocks=64, block_size=4)


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' are not served"),
    ({"quant_method": "hqq", "nbits": 4}, "quant_method 'hqq' are not served"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers")])
def test_other_quantizations_are_refused_by_name(tmp_path, quantization, message):
    path = save_tiny_model(tmp_path / "q", vocab_size=251)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W8A8", "FP8_BLOCK", "FP8", "W4A16"])
def test_plain_scaled_layers_are_read_per_slice_as_the_library_decompresses_them(preset):
    """fp8 / int8 values with per-channel, per-tensor or block scales are read a slice at a time
    (each TP rank its shard), equal to the library's own decompression; packed int4 goes through
    the library whole."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    from gpu_worker.compressed_tensors_checkpoint import decompressed

    scheme = preset_name_to_scheme(preset, ["Linear"])
    args = scheme.weights
    if args.group_size:
        args.group_size = 32
    if args.block_structure:
        args.block_structure = [16, 32]
    scheme.format = infer_module_format(torch.nn.Linear, scheme)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    torch.manual_seed(2)
    weight = torch.randn(48, 64)
    largest = FP8_MAX if args.type == "float" else 2 ** (args.num_bits - 1) - 1
    if args.strategy == "block":
        scale = weight.reshape(3, 16, 2, 32).abs().amax(dim=(1, 3)) / largest
    elif args.strategy == "tensor":
        scale = weight.abs().amax().reshape(1) / largest
    else:
        rows = weight.reshape(48, -1, args.group_size) if args.group_size else weight.unsqueeze(1)
        scale = rows.abs().amax(dim=2) / largest
    stored = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
    reference = compressor.decompress(dict(stored), scheme)["weight"].float()
    config = QuantizationConfig(config_groups={"group_0": scheme}, quant_method="compressed-tensors",
                                quantization_status="compressed").model_dump(mode="json")
    [(name, out)] = list(decompressed([(f"layer.{k}", v) for k, v in stored.items()], config))
    assert name == "layer.weight" and isinstance(out, ScaledWeight) == (preset != "W4A16")
    torch.testing.assert_close(materialize(out), reference)
    if isinstance(out, ScaledWeight):
        torch.testing.assert_close(out.narrow(0, 16, 16), reference[16:32])
        torch.testing.assert_close(out.narrow(1, 32, 32), reference[:, 32:])


def test_compressed_tensors_groups_are_chosen_and_refused_as_the_library_would():
    """A layer a group names (exactly, or by regex) takes that group over one for every Linear;
    ignored layers none; variants not served are refused by name; the old compression_config key
    is read too."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    from gpu_worker.compressed_tensors_checkpoint import _Schemes
    from gpu_worker.quantized_checkpoint import weight_quantization

    def config(**groups) -> dict:
        return QuantizationConfig(config_groups=groups, quant_method="compressed-tensors", ignore=["lm_head"],
                                  quantization_status="compressed").model_dump(mode="json")

    mixed = config(group_0=preset_name_to_scheme("W4A16", ["Linear"]),
                   group_1=preset_name_to_scheme("FP8_DYNAMIC", ["re:.*down_proj$"]),
                   group_2=preset_name_to_scheme("W8A8", ["model.layers.0.mlp.up_proj"]))
    schemes = _Schemes(mixed)
    kind = {module: schemes.for_module(module)[0].weights.num_bits if schemes.for_module(module) else None
            for module in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj",
                           "model.layers.0.mlp.up_proj", "lm_head")}
    assert kind == {"model.layers.0.self_attn.q_proj": 4, "model.layers.3.mlp.down_proj": 8,
                    "model.layers.0.mlp.up_proj": 8, "lm_head": None}
    assert schemes.for_module("model.layers.3.mlp.down_proj")[0].weights.type == "float"
    assert weight_quantization(mixed)[0] == "compressed-tensors"
    ordered = preset_name_to_scheme("W4A16", ["Linear"])
    ordered.weights.actorder = "group"
    for bad, message in ((config(group_0=ordered), "actorder"),
                         ({**mixed, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity"),
                         ({**mixed, "transform_config": {"config_groups": {}}}, "rotations")):
        with pytest.raises(ValueError, match=message):
            weight_quantization(bad)


def test_an_old_compression_config_key_is_read(tmp_path):
    path = save_tiny_model(tmp_path / "old", vocab_size=251)
    _save_compressed(path, "W8A8")
    config = json.loads((path / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(path).quantization == "compressed-tensors"
    make_runner(path, num_blocks=16, block_size=4)  # (its int8 weights decompressed, not refused)


def test_per_expert_and_per_row_scales_broadcast_over_their_slices():
    torch.manual_seed(1)
    stacked = torch.randn(4, 8, 4).to(torch.float8_e4m3fn)  # (as many experts as columns, on purpose)
    per_expert = torch.tensor([0.5, 1.0, 2.0, 4.0])
    lazy = ScaledWeight(stacked, per_expert, (0, 0))
    for e in range(4):
        torch.testing.assert_close(lazy.narrow(0, e, 1)[0], stacked[e].float() * per_expert[e])
    rows = torch.randn(8, 6).to(torch.float8_e4m3fn)
    per_row = torch.rand(8, 1) + 0.5
    lazy = ScaledWeight(rows, per_row, (0, 0))
    torch.testing.assert_close(lazy.narrow(0, 2, 4), rows[2:6].float() * per_row[2:6])
    torch.testing.assert_close(lazy.narrow(1, 3, 3), rows[:, 3:].float() * per_row)
    with pytest.raises(ValueError, match="cannot take scales"):
        ScaledWeight(rows, torch.ones(3), (0, 0))
