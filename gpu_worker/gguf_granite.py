"""IBM Granite's GGUF files back to Hugging Face checkpoints: ``granite`` (Granite 3.x dense, and
Granite 4.0 models without Mamba layers: granite-4.0-micro), ``granitemoe`` (Granite 3.x MoE, with or
without a shared expert) and ``granitehybrid`` (Granite 4.0-H: Mamba-2 layers beside attention without
positions, routed experts beside a shared MLP or the shared MLP alone). Used by gpu_worker.gguf_loader.

What llama.cpp's converter changed, and is undone here:
  * Granite's four multipliers as attention.scale, embedding_scale, residual_scale and logit_scale;
  * the experts' merged gate-and-up tensor (``block_sparse_moe.input_linear``: [experts, 2 x width,
    hidden]) split into ffn_gate_exps and ffn_up_exps, and the shared MLP's (``shared_mlp.input_linear``)
    into ffn_gate_shexp / ffn_up_shexp (ffn_gate / ffn_up where there are no experts): merged again;
  * the Mamba-2 layers' tensors reshaped and renamed (gpu_worker.gguf_mamba2);
  * the layer kinds, as per-layer KV head counts (0 in a Mamba layer); RoPE marked off by
    rope.scaling.finetuned = false (and a context length of 2^20) in a hybrid without positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from gpu_worker.gguf_mamba2 import HybridNames, mamba2_geometry, per_layer, rename_hybrid_tensor

# GGUF general.architecture -> HF (architecture, model_type); granitemoe with a shared expert is
# GraniteMoeShared (GRANITE_MOE_SHARED).
GRANITE_ARCHITECTURES = {
    "granite": ("GraniteForCausalLM", "granite"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
}
GRANITE_MOE_SHARED = ("GraniteMoeSharedForCausalLM", "granitemoeshared")
GRANITE_MODEL_TYPES = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid")

# llama.cpp's block names -> the released checkpoints' (the plain ones: gpu_worker.gguf_loader's).
_GRANITE_BLOCK_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_down_exps": "block_sparse_moe.output_linear",
    "ffn_down_shexp": "shared_mlp.output_linear",
}
# Halves merged again into one tensor: (gate part, up part) -> the merged tensor's name.
_MERGED = {("ffn_gate_exps", "ffn_up_exps"): "block_sparse_moe.input_linear",
           ("ffn_gate_shexp", "ffn_up_shexp"): "shared_mlp.input_linear"}
# Granite 4.0-H without experts: its shared MLP, under the dense names.
_DENSE_SHARED_MLP = {("ffn_gate", "ffn_up"): "shared_mlp.input_linear"}


def granite_config(meta: dict[str, Any], arch: str, config: dict[str, Any], kv_heads: Any, experts: int,
                   tensors: list[Any]) -> dict[str, Any]:
    """The Granite keys of a converted config.json: the multipliers (transformers' 1.0 where a file
    leaves one out); the experts (intermediate_size wide) and shared expert; a hybrid's layer kinds,
    Mamba-2 geometry and positions. A dense file's MLP width is its ffn_gate's rows (granite-4.0-micro,
    written as "granite" from a hybrid's config, may state another feed_forward_length)."""
    tensor_names = {t.name for t in tensors}
    gate = next((t for t in tensors if t.name.endswith(".ffn_gate.weight")), None)
    extra: dict[str, Any] = {
        "attention_multiplier": float(meta.get(f"{arch}.attention.scale", 1.0)),
        "embedding_multiplier": float(meta.get(f"{arch}.embedding_scale", 1.0)),
        "residual_multiplier": float(meta.get(f"{arch}.residual_scale", 1.0)),
        "logits_scaling": float(meta.get(f"{arch}.logit_scale", 1.0)),
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
    }
    shared = any(name.endswith(".ffn_up_shexp.weight") for name in tensor_names)
    if experts:
        extra.update(num_local_experts=experts,
                     num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]))
    if shared or arch == "granitehybrid":
        width = meta.get(f"{arch}.expert_shared_feed_forward_length")
        if width is None:
            raise ValueError(f"GGUF {arch} file: its shared MLP's width ({arch}.expert_shared_feed_forward_length) "
                             "is missing")
        extra["shared_intermediate_size"] = int(width)
    if arch == "granite" and gate is not None:  # ([hidden, width] as GGUF lists a matrix's dimensions)
        extra["intermediate_size"] = int(gate.shape[1])
    if arch == "granitemoe" and shared:
        extra["architectures"], extra["model_type"] = [GRANITE_MOE_SHARED[0]], GRANITE_MOE_SHARED[1]
    if arch == "granitehybrid":
        extra.update(_hybrid_config(meta, arch, config, kv_heads, experts, tensor_names))
    return extra


def _hybrid_config(meta: dict[str, Any], arch: str, config: dict[str, Any], kv_heads: Any, experts: int,
                   tensor_names: set[str]) -> dict[str, Any]:
    kv = per_layer(kv_heads, int(config["num_hidden_layers"]), f"{arch}.attention.head_count_kv")
    # (rope.scaling.finetuned switches Granite's RoPE; llama.cpp reads it as true when absent)
    rope = bool(meta.get(f"{arch}.rope.scaling.finetuned", True))
    if rope and 0 in kv:
        raise ValueError("GGUF Bamba files (granitehybrid with RoPE) are not converted; serve the model's Hugging "
                         "Face checkpoint directory instead")
    hidden, mamba = int(config["hidden_size"]), mamba2_geometry(meta, arch, tensor_names)
    if mamba["inner_size"] % hidden:
        raise ValueError(f"GGUF {arch} file: ssm.inner_size {mamba['inner_size']} is not a whole multiple of the "
                         f"hidden size ({hidden})")
    return {
        "layer_types": ["attention" if k else "mamba" for k in kv],
        "position_embedding_type": "rope" if rope else "nope",
        "mamba_n_heads": mamba["num_heads"], "mamba_d_head": mamba["head_dim"],
        "mamba_expand": mamba["inner_size"] // hidden, "mamba_n_groups": mamba["num_groups"],
        "mamba_d_state": mamba["state_size"], "mamba_d_conv": mamba["conv_kernel"],
        "mamba_conv_bias": mamba["conv_bias"], "mamba_proj_bias": mamba["proj_bias"], "num_local_experts": experts,
    }


class GraniteTensors:
    """Renames a Granite file's tensors (already dequantised, q/k rows un-permuted) to the released
    checkpoints' names, undoing the converter's reshapes, and merges the halves it split: feed each
    tensor to ``convert``; ``finish`` says if a half never met its other."""

    def __init__(self, config: dict[str, Any], llama_top_level: dict[str, str], llama_block: dict[str, str]) -> None:
        """``llama_top_level``, ``llama_block``: gguf_loader's names of the tensors Granite shares with Llama."""
        self.dense_hybrid = config["model_type"] == "granitemoehybrid" and not config.get("num_local_experts")
        self.pairs = {**_MERGED, **(_DENSE_SHARED_MLP if self.dense_hybrid else {})}
        block = {**llama_block, **_GRANITE_BLOCK_NAMES,
                 **({"ffn_down": "shared_mlp.output_linear"} if self.dense_hybrid else {})}
        self.names = HybridNames(llama_top_level, "model.layers", "mamba", block, "Granite")
        self.pending: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def convert(self, name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
        parts = name.split(".")
        if parts[0] == "blk" and (pair := self._pair_of(parts[2])) is not None:
            merged = self._merge(parts[1], parts[2], pair, array)
            if merged is not None:
                yield merged
            return
        yield from rename_hybrid_tensor(name, array, self.names)

    def _pair_of(self, part: str) -> tuple[str, str] | None:
        """The (gate, up) pair ``part`` is a half of (None: not a split tensor)."""
        return next((pair for pair in self.pairs if part in pair), None)

    def _merge(self, layer: str, part: str, pair: tuple[str, str], array: np.ndarray) -> tuple[str, np.ndarray] | None:
        """The merged tensor once both halves of ``pair`` are in (None: the other is still to come)."""
        name = self.pairs[pair]
        halves = self.pending.setdefault((layer, name), {})
        halves[part] = array
        if len(halves) < 2:
            return None
        del self.pending[(layer, name)]
        # (gate rows then up rows: along the rows of a projection, axis -2 of the stacked experts)
        return f"model.layers.{layer}.{name}.weight", np.concatenate([halves[pair[0]], halves[pair[1]]], axis=-2)

    def finish(self) -> None:
        if self.pending:
            (layer, name), halves = next(iter(self.pending.items()))
            raise ValueError(f"GGUF Granite file: layer {layer}'s {name} has only {', '.join(halves)}")
