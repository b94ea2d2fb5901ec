"""MXFP4 checkpoints (gpt-oss as released), served dequantized: a tiny GPT-OSS whose experts are stored
as random FP4 codes and E8M0 exponents answers as transformers answers when it loads that same
checkpoint (on a CPU transformers dequantizes MXFP4 itself)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.config import ModelConfig
from gpu_worker.mxfp4_checkpoint import FP4_E2M1_VALUES, dequantized, mxfp4_weight
from tests.gpu_worker.test_quantized_checkpoints import _greedy_as_the_reference
from tests.gpu_worker.utils import save_tiny_model


def _random_mxfp4(shape_out_in: tuple[int, int, int], generator: torch.Generator):
    """(blocks [E, out, in / 32, 16], scales [E, out, in / 32]) of random codes, exponents 2^-7..2^-4."""
    experts, out, inputs = shape_out_in
    blocks = torch.randint(0, 256, (experts, out, inputs // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(127 - 7, 127 - 3, (experts, out, inputs // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_dequantization_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 10, 96), torch.Generator().manual_seed(1))
    scales[0, 0, 0], scales[1, 2, 1] = 127 + 20, 127 - 30  # (far from one: exact in bfloat16 too)
    ours = mxfp4_weight(blocks, scales)
    assert ours.dtype == torch.bfloat16 and ours.shape == (3, 10, 96)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours.float(), theirs.transpose(1, 2))


def test_each_byte_holds_two_values_low_nibble_first():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x2F  # low nibble 0xF (-6.0), high nibble 0x2 (1.0)
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)  # 2^1
    row = mxfp4_weight(blocks, scales)[0, 0]
    assert row[:2].tolist() == [2 * FP4_E2M1_VALUES[0xF], 2 * FP4_E2M1_VALUES[0x2]] == [-12.0, 2.0]
    assert not row[2:].any()


def test_incomplete_or_malformed_tensors_are_refused():
    blocks, scales = _random_mxfp4((1, 2, 32), torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="incomplete"):
        list(dequantized([("model.layers.0.mlp.experts.down_proj_blocks", blocks)]))
    with pytest.raises(ValueError, match="must match"):
        mxfp4_weight(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_weight(blocks.to(torch.int32), scales)


def _save_mxfp4(path):
    """Rewrite a saved tiny GPT-OSS's experts as MXFP4 (random codes), as the released checkpoints store
    them: ``<name>_blocks`` and ``<name>_scales``, the rest unquantized."""
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    stored = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, out = tensor.shape
            stored[f"{name}_blocks"], stored[f"{name}_scales"] = _random_mxfp4((experts, out, inputs), generator)
        else:
            stored[name] = tensor
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def test_an_mxfp4_gpt_oss_answers_as_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "mxfp4", "gpt_oss", vocab_size=251)
    _save_mxfp4(path)
    assert ModelConfig.from_pretrained(path).quantization == "mxfp4"
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    experts = reference.model.layers[0].mlp.experts.gate_up_proj
    assert experts.dtype == torch.float32 and bool(experts.abs().max() > 0)  # (dequantized by transformers)
    _greedy_as_the_reference(path, reference)


def test_other_block_sizes_are_refused(tmp_path):
    path = save_tiny_model(tmp_path / "m", "gpt_oss", vocab_size=251)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "block_size": 16}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="32-value blocks"):
        ModelConfig.from_pretrained(path)
    shutil.rmtree(path)
