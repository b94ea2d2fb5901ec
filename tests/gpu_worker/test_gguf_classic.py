"""GGUF files of the classic families whose checkpoints name their tensors otherwise than Llama's (Phi's
phi2, GPT-NeoX's gptneox, GPT-2's gpt2, GPTBigCode's starcoder), converted back to checkpoints that
give the source model's logits, in transformers and in our runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_worker.gguf_loader import ensure_converted

from .test_gguf_llama_like import PROMPT
from .tiny_classic_gguf import CLASSIC_KINDS, tiny_classic, write_tiny_classic_gguf
from .utils import make_runner, prefill_logits

CASES = {
    # Phi (a biased head; untied), GPT-NeoX (its fused q/k/v reordered back per head; in sequence,
    # without attention biases), GPT-2 (learned positions, Conv1D weights), GPTBigCode (one KV head).
    "phi": ("phi", {}),
    "phi_first_layout_fused_qkv": ("phi", {"fused_qkv": True}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox_sequential_no_attention_bias": ("gpt_neox", {"use_parallel_residual": False, "attention_bias": False}),
    "gpt2": ("gpt2", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_files_convert_to_the_source_model(tmp_path: Path, case: str) -> None:
    kind, overrides = CASES[case][0], dict(CASES[case][1])
    fused_qkv = overrides.pop("fused_qkv", False)
    source = tiny_classic(kind, seed=5, **overrides)
    path = write_tiny_classic_gguf(tmp_path / f"tiny-{case}.gguf", source, kind, fused_qkv=fused_qkv)
    model_dir = ensure_converted(path, tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(source).__name__]
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    assert type(loaded) is type(source)
    for name, param in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param, rtol=0, atol=0, msg=name)
    source.config._attn_implementation = "eager"
    with torch.no_grad():
        expected = source(torch.tensor([PROMPT])).logits[0]
        torch.testing.assert_close(loaded(torch.tensor([PROMPT])).logits[0], expected, rtol=0, atol=1e-5)
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT, [3, 1, 0, 5, 7])
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(tokenizer.encode("the cat in there")) == "the cat in there"


def test_a_quantized_gpt2_file_gives_its_dequantized_weights(tmp_path: Path) -> None:
    """A Q8_0 GPT-2 file (its Conv1D weights quantized in llama.cpp's layout): weights within Q8_0's
    rounding of the source's, and our runner gives what the file's dequantized weights give in
    transformers."""
    source = tiny_classic("gpt2", seed=6)
    model_dir = ensure_converted(write_tiny_classic_gguf(tmp_path / "tiny-gpt2.Q8_0.gguf", source, "gpt2",
                                                         GGMLQuantizationType.Q8_0), tmp_path / "cache")
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for name in ("transformer.h.1.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"):
        weight, original = loaded.state_dict()[name], source.state_dict()[name]
        torch.testing.assert_close(weight, original, rtol=0, atol=0.01 * float(original.abs().max()))
        assert not torch.equal(weight, original)
    with torch.no_grad():
        logits = loaded(torch.tensor([PROMPT])).logits[0]
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT, [3, 1, 0, 5, 7])
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)


def test_every_family_is_covered():
    assert {kind for kind, _ in CASES.values()} == set(CLASSIC_KINDS)
