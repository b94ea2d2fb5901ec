"""GGUF files of the classic families whose checkpoints name their tensors otherwise than Llama's (Phi's
phi2, GPT-NeoX's gptneox, GPT-2's gpt2, GPTBigCode's starcoder, Falcon's falcon, BLOOM's bloom, MPT's
mpt), converted back to
checkpoints that give the source model's logits, in transformers and in our runner."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from .test_gguf_llama_like import assert_converts_to, assert_quantized_file_gives_its_weights
from .tiny_classic_gguf import CLASSIC_KINDS, tiny_classic, write_tiny_classic_gguf

CASES = {
    # Phi (a biased head; untied), GPT-NeoX (its fused q/k/v reordered back per head; in sequence,
    # without attention biases), GPT-2 (learned positions, Conv1D weights), GPTBigCode (one KV head).
    "phi": ("phi", {}),
    "phi_first_layout_fused_qkv": ("phi", {"fused_qkv": True}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox_sequential_no_attention_bias": ("gpt_neox", {"use_parallel_residual": False, "attention_bias": False}),
    "gpt2": ("gpt2", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    # Falcon: falcon-7b's layout (multi-query, one norm), falcon-40b's (KV heads in groups, two norms),
    # falcon-11B's (grouped, one norm).
    "falcon_7b_style": ("falcon", {}),
    "falcon_40b_style": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_11b_style": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2,
                                    "num_ln_in_parallel_attn": 1}),
    # BLOOM (its per-head query_key_value; its head written as a copy of the embedding: tied again; a
    # head of its own, untied), MPT (clamped q/k/v; unclamped).
    "bloom": ("bloom", {}),
    "bloom_untied": ("bloom", {"tie_word_embeddings": False}),
    "mpt": ("mpt", {}),
    "mpt_unclamped": ("mpt", {"attn_config": {"softmax_scale": None, "clip_qkv": None}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_files_convert_to_the_source_model(tmp_path: Path, case: str) -> None:
    kind, overrides = CASES[case][0], dict(CASES[case][1])
    fused_qkv = overrides.pop("fused_qkv", False)
    source = tiny_classic(kind, seed=5, **overrides)
    assert_converts_to(source, write_tiny_classic_gguf(tmp_path / f"tiny-{case}.gguf", source, kind,
                                                       fused_qkv=fused_qkv), tmp_path)


def test_a_quantized_gpt2_file_gives_its_dequantized_weights(tmp_path: Path) -> None:
    """A Q8_0 GPT-2 file (its Conv1D weights quantized in llama.cpp's layout, transposed back)."""
    source = tiny_classic("gpt2", seed=6)
    path = write_tiny_classic_gguf(tmp_path / "tiny-gpt2.Q8_0.gguf", source, "gpt2", GGMLQuantizationType.Q8_0)
    assert_quantized_file_gives_its_weights(source, path, tmp_path, ("transformer.h.1.attn.c_attn.weight",
                                                                     "transformer.h.1.mlp.c_proj.weight"))


def test_a_bloom_files_copied_head_is_read_as_tied(tmp_path: Path) -> None:
    """llama.cpp writes BLOOM's tied head as a copy of the embedding: read as tied (one tensor, not
    two), its context, n_embed where the config had no seq_length, read as BLOOM's 2048."""
    import json

    from gpu_worker.gguf_loader import ensure_converted

    for tie in (True, False):
        source = tiny_classic("bloom", seed=5, tie_word_embeddings=tie)
        model_dir = ensure_converted(write_tiny_classic_gguf(tmp_path / f"bloom-{tie}.gguf", source, "bloom"),
                                     tmp_path / f"cache-{tie}")
        config = json.loads((model_dir / "config.json").read_text())
        assert config["tie_word_embeddings"] is tie and config["seq_length"] == 2048


def test_every_family_is_covered():
    assert {kind for kind, _ in CASES.values()} == set(CLASSIC_KINDS)
