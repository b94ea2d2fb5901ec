"""GGUF files of the Llama-like families with their own names and keys (Cohere's command-r and cohere2,
GLM-4's glm4, seed_oss, exaone4, ERNIE 4.5's ernie4_5 and ernie4_5-moe, Arcee's arcee, nemotron, olmo,
dots1), converted back to checkpoints that give the source model's logits, in transformers and in our
runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_worker.gguf_loader import ensure_converted

from .tiny_llama_like_gguf import LLAMA_LIKE_KINDS, tiny_llama_like, write_tiny_llama_like_gguf
from .utils import make_runner, prefill_logits

PROMPT = [1, 120, 118, 263, 13, 107, 108, 261, 117, 104, 2, 13, 40, 41, 42, 43, 44, 45, 46, 47]

CASES = {
    # Command-R+ (q/k norms of each head's own weights), Command-R7B (windows of 8 on three layers of
    # four, no pattern in the file), GLM-4 (its fused gate/up, its rotary half), Seed-OSS (o_proj's
    # bias apart), EXAONE 4.0 (its per-layer window list; without a window), ERNIE 4.5 (biases
    # everywhere) and its MoE (stacked experts, shared ones, the correction bias), Arcee (permuted
    # q/k rows, an ungated relu^2 MLP).
    "cohere_qk_norm": ("cohere", {"use_qk_norm": True}),
    "cohere2": ("cohere2", {}),
    "glm4": ("glm4", {}),
    "seed_oss": ("seed_oss", {}),
    "exaone4": ("exaone4", {}),
    "exaone4_no_window": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4}),
    "ernie4_5": ("ernie4_5", {}),
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "arcee": ("arcee", {}),
    # Nemotron (its norms stored as 1 + w, biases everywhere), OLMo (permuted q/k rows, no norm tensors,
    # clip_qkv as clamp_kqv), dots.llm1 (stacked experts in groups, shared ones, the correction bias).
    "nemotron": ("nemotron", {}),
    "olmo": ("olmo", {}),
    "dots1": ("dots1", {}),
}


def assert_converts_to(source, path: Path, tmp_path: Path, norm_atol: float = 0.0) -> None:
    """The file ``path`` (written from ``source``) converts to a checkpoint of ``source``'s weights
    (norm weights within ``norm_atol``), its logits in transformers and in our runner, its tokenizer."""
    model_dir = ensure_converted(path, tmp_path / "cache")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(source).__name__]
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    assert type(loaded) is type(source)
    for name, param in source.state_dict().items():
        atol = norm_atol if name.endswith("norm.weight") else 0.0
        torch.testing.assert_close(loaded.state_dict()[name], param, rtol=0, atol=atol, msg=name)
    source.config._attn_implementation = "eager"
    with torch.no_grad():
        expected = source(torch.tensor([PROMPT])).logits[0]
        torch.testing.assert_close(loaded(torch.tensor([PROMPT])).logits[0], expected, rtol=0, atol=1e-5)
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT, [3, 1, 0, 5, 7])
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(tokenizer.encode("the cat in there")) == "the cat in there"


def assert_quantized_file_gives_its_weights(source, path: Path, tmp_path: Path, names: tuple[str, ...]) -> None:
    """A quantized file ``path`` of ``source``: the weights ``names`` within Q8_0's rounding of the
    source's (not equal), and our runner gives exactly what the file's dequantized weights give in
    transformers."""
    model_dir = ensure_converted(path, tmp_path / "cache")
    loaded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for name in names:
        weight, original = loaded.state_dict()[name], source.state_dict()[name]
        torch.testing.assert_close(weight, original, rtol=0, atol=0.01 * float(original.abs().max()))
        assert not torch.equal(weight, original)
    with torch.no_grad():
        logits = loaded(torch.tensor([PROMPT])).logits[0]
    ours = prefill_logits(make_runner(model_dir, num_blocks=8, block_size=4), PROMPT, [3, 1, 0, 5, 7])
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_files_convert_to_the_source_model(tmp_path: Path, case: str) -> None:
    kind, overrides = CASES[case]
    source = tiny_llama_like(kind, seed=5, **overrides)
    path = write_tiny_llama_like_gguf(tmp_path / f"tiny-{case}.gguf", source, kind)
    # (Nemotron's norms went through 1 + w and back: fp32's rounding of the sum.)
    assert_converts_to(source, path, tmp_path, norm_atol=1e-6 if kind == "nemotron" else 0.0)


def test_a_quantized_glm4_file_gives_its_dequantized_weights(tmp_path: Path) -> None:
    """A Q8_0 GLM-4 file (its fused gate/up quantized whole)."""
    source = tiny_llama_like("glm4", seed=6)
    path = write_tiny_llama_like_gguf(tmp_path / "tiny-glm4.Q8_0.gguf", source, "glm4", GGMLQuantizationType.Q8_0)
    assert_quantized_file_gives_its_weights(source, path, tmp_path, ("model.layers.1.mlp.gate_up_proj.weight",
                                                                     "model.layers.1.self_attn.q_proj.weight"))


def test_every_family_is_covered():
    assert {kind for kind, _ in CASES.values()} == set(LLAMA_LIKE_KINDS)
