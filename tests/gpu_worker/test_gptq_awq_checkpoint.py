"""GPTQ and AWQ checkpoints, served dequantized: a tiny model's projections quantized into groups and
packed as AutoGPTQ / GPTQModel (act-order too, 4 and 8 bits, both zero-point formats) and AutoAWQ's
GEMM layout write them, packed here by the compressed-tensors library's own int32 packer (the lowest
bits first, along the dimension each format packs), answer as transformers' model of the dequantized
weights does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.config import ModelConfig
from gpu_worker.gptq_awq_checkpoint import awq_weight, gptq_weight
from tests.gpu_worker.test_quantized_checkpoints import _greedy_as_the_reference
from tests.gpu_worker.utils import save_tiny_model

GROUP = 16
# AutoAWQ's packing: nibble i of each int32 holds column AWQ_PACK_ORDER[i] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(unsigned: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``unsigned`` values packed into int32s along ``dim`` by compressed-tensors' packer (which takes
    them signed, offset by half the range)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = (unsigned.to(torch.int32) - (1 << (bits - 1))).to(torch.int8)
    return pack_to_int32(signed, bits, packed_dim=dim)


def _v1_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero points packed as the original GPTQ format stores them, as GPTQModel writes it: one
    subtracted from each whole int32's every value (a zero of 0 borrows from the next)."""
    ones = sum(1 << shift for shift in range(0, 32, bits))
    packed = (_pack(zeros, bits, 1).to(torch.int64) - ones) & 0xFFFFFFFF
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _quantized(weight: torch.Tensor, bits: int, groups: torch.Tensor):
    """``weight`` [out, in] as (q [in, out], zeros [groups, out], fp16 scales [groups, out], and the
    dense weight they stand for [out, in]), each input row's group given by ``groups``."""
    top = (1 << bits) - 1
    w = weight.t()  # [in, out]
    count = int(groups.max()) + 1
    low = torch.stack([w[groups == g].min(dim=0).values for g in range(count)])
    high = torch.stack([w[groups == g].max(dim=0).values for g in range(count)])
    scales = ((high - low) / top).clamp(min=1e-6).half()
    zeros = torch.round(-low / scales.float()).clamp(0, top).to(torch.int32)
    q = torch.clamp(torch.round(w / scales.float()[groups]) + zeros[groups], 0, top).to(torch.int32)
    dense = ((q - zeros[groups]).float() * scales.float()[groups]).t().contiguous()
    return q, zeros, scales, dense


def _save(path, method: str, bits: int = 4, act_order: bool = False, v2: bool = False,
          zero_biases: bool = False) -> torch.nn.Module:
    """Rewrite a saved tiny model's projections as a ``method`` checkpoint (``zero_biases``: each with an
    all-zero fp16 bias, as old AutoGPTQ / optimum wrote them); transformers' model of the dequantized
    weights."""
    from transformers import AutoModelForCausalLM

    dense_dir = shutil.copytree(path, path.parent / f"{path.name}-dense")
    state, out, dense_state = load_file(str(path / "model.safetensors")), {}, {}
    generator = torch.Generator().manual_seed(5)
    for name, weight in state.items():
        if not name.endswith("_proj.weight"):
            out[name] = dense_state[name] = weight
            continue
        module, rows = name.removesuffix(".weight"), weight.shape[1]
        groups = torch.arange(rows) // GROUP
        if act_order:  # (act-order: the rows' groups follow their importance, not their order)
            groups = groups[torch.randperm(rows, generator=generator)]
        q, zeros, scales, dense = _quantized(weight, bits, groups)
        dense_state[name] = dense
        if method == "awq":
            order = torch.arange(q.shape[1]).view(-1, 8)[:, list(AWQ_PACK_ORDER)].reshape(-1)
            out[f"{module}.qweight"] = _pack(q[:, order], 4, dim=1)
            out[f"{module}.qzeros"] = _pack(zeros[:, order], 4, dim=1)
        else:
            out[f"{module}.qweight"] = _pack(q, bits, dim=0)
            out[f"{module}.qzeros"] = _pack(zeros, bits, dim=1) if v2 else _v1_zeros(zeros, bits)
            out[f"{module}.g_idx"] = groups.to(torch.int32)
            if zero_biases:
                out[f"{module}.bias"] = torch.zeros(weight.shape[0], dtype=torch.float16)
        out[f"{module}.scales"] = scales
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in dense_state.items()}, str(dense_dir / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order, "sym": False,
         "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    (path / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize(("method", "bits", "act_order", "v2"), [
    ("gptq", 4, False, False), ("gptq", 4, True, False), ("gptq", 8, True, False), ("gptq", 4, False, True),
    ("awq", 4, False, False)])
def test_a_gptq_or_awq_checkpoint_answers_as_its_dequantized_weights(tmp_path, method, bits, act_order, v2):
    """(The original GPTQ format's zero points of 0 borrow from their neighbours: read back with the
    carry. Its layers carry all-zero biases, which a Llama has no parameter for.)"""
    path = save_tiny_model(tmp_path / method, vocab_size=251)
    reference = _save(path, method, bits, act_order, v2, zero_biases=method == "gptq" and not v2)
    assert ModelConfig.from_pretrained(path).quantization == method
    _greedy_as_the_reference(path, reference)


def test_the_unpacking_of_each_layout():
    """Element by element: GPTQ's rows packed along the input (2, 4 and 8 bits; zeros stored less one),
    AWQ's interleaved columns."""
    generator = torch.Generator().manual_seed(0)
    for bits in (2, 4, 8):
        top = (1 << bits) - 1
        q = torch.randint(0, top + 1, (32, 16), generator=generator)
        zeros = torch.randint(0, top + 1, (2, 16), generator=generator)
        zeros[0, :3] = 0  # (borrowing from the next value in the original format)
        scales = torch.rand(2, 16, generator=generator).half()
        groups = torch.arange(32) // 16
        want = ((q - zeros[groups]).float() * scales.float()[groups]).t()
        got = gptq_weight(_pack(q, bits, 0), _v1_zeros(zeros, bits), scales, None, bits, 16)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    q = torch.randint(0, 16, (32, 16), generator=generator)
    zeros = torch.randint(0, 16, (2, 16), generator=generator)
    order = torch.arange(16).view(-1, 8)[:, list(AWQ_PACK_ORDER)].reshape(-1)
    got = awq_weight(_pack(q[:, order], 4, 1), _pack(zeros[:, order], 4, 1), scales, 16)
    torch.testing.assert_close(got, ((q - zeros[groups]).float() * scales.float()[groups]).t(), rtol=0, atol=0)


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout are served"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "GEMM layout are served"),
    ({"quant_method": "gptq", "bits": 3}, "2, 4 or 8 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "gptq or gptq_v2 format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size must be positive or -1"),
    ({"quant_method": "awq", "bits": 4, "backend": "llm-awq"}, "GEMM layout are served"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "not marlin"),
    ({"quant_method": "gptq", "bits": 4, "format": "marlin"}, "not 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "packed in int32"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down_proj": {"bits": 8}, r"-:.*o_proj": {}}},
     "per-module overrides")])
def test_variants_not_served_are_refused_by_name(tmp_path, quantization, message):
    path = save_tiny_model(tmp_path / "q", vocab_size=251)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(path)
