"""Gemma 4's own geometry (read by gpu_worker.config for Gemma4ForCausalLM), with transformers'
Gemma4TextConfig defaults for the keys a config leaves out.

Its full-attention layers differ from its windowed ones: heads of ``global_head_dim`` values (512),
``num_global_key_value_heads`` KV heads where ``attention_k_eq_v`` (their values then the keys'
projection, before the key's norm and RoPE), and "proportional" RoPE (a quarter of the head's
frequencies turning). Beside them: per-layer inputs (as Gemma 3n's, without AltUp), KV sharing (the
last ``num_kv_shared_layers`` layers attend over the caches of the last earlier layer of their kind,
with MLPs twice as wide under ``use_double_wide_mlp``), a routed-experts block beside each layer's MLP
(``enable_moe_block``), and a learnt scalar on each layer's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpu_worker.gemma3n_config import kv_sources


@dataclass(frozen=True)
class Gemma4Config:
    # Each layer's attention: heads' width, KV heads, whether its values are its keys' projection,
    # and its source of keys and values (None: its own; else the layer whose cache it reads).
    head_dims: tuple[int, ...]
    num_kv_heads: tuple[int, ...]
    k_eq_v: tuple[bool, ...]
    kv_sources: tuple[int | None, ...]
    # Each layer's MLP width (a KV-sharing layer's doubled under use_double_wide_mlp).
    intermediate_sizes: tuple[int, ...]
    # Per-layer inputs (0: none).
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    # The experts' block beside every layer's MLP (0 experts: none).
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers keeping a KV cache (their own keys and values)."""
        return tuple(i for i, source in enumerate(self.kv_sources) if source is None)


GEMMA4_TEXT_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "sliding_window": 512,
                        "final_logit_softcapping": None}
# transformers' rope parameters of each layer kind where a config gives none.
GEMMA4_ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}}


def gemma4_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's kind as transformers reads it: ``layer_types`` (its last layer forced full), else
    five windowed layers to one full."""
    layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    kinds = list(kinds)
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of the {layers} "
                         f"layers, got {kinds}")
    kinds[-1] = "full_attention"
    return kinds


def gemma4_config_from_dict(cfg: dict[str, Any]) -> Gemma4Config:
    """Gemma 4's fields of a text config (its defaults applied: GEMMA4_TEXT_DEFAULTS)."""
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("Gemma4ForCausalLM with use_bidirectional_attention 'all' (an encoder) is not served")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma4ForCausalLM's hidden_activation must be gelu_pytorch_tanh (its released one), got "
                         f"{cfg['hidden_activation']!r}")
    kinds = gemma4_layer_types(cfg)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    head_dim, kv_heads = int(cfg["head_dim"]), int(cfg["num_key_value_heads"])
    full = [kind == "full_attention" for kind in kinds]
    # Each layer's heads: a saved config's per_layer_config (by layer), else a released one's
    # global_head_dim (512) and num_global_key_value_heads (under attention_k_eq_v) on the full layers,
    # as transformers derives them.
    overrides = cfg.get("per_layer_config")
    if not isinstance(overrides, dict):
        global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
        full_override = {"head_dim": int(cfg.get("global_head_dim") or 512),
                         **({} if global_kv is None else {"num_key_value_heads": int(global_kv)})}
        overrides = {i: full_override for i, f in enumerate(full) if f}
    # (transformers writes its keys as zero-padded strings, "05", and reads them as ints.)
    overrides = {int(index): override for index, override in overrides.items()}
    for index, override in overrides.items():
        if not set(override) <= {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"Gemma 4's per_layer_config may set head_dim and num_key_value_heads, got {override} "
                             f"for layer {index}")
    layer = [dict(overrides.get(i) or {}) for i in range(len(kinds))]
    sources = kv_sources(kinds, int(cfg.get("num_kv_shared_layers") or 0))
    width = int(cfg["intermediate_size"])
    double = bool(cfg.get("use_double_wide_mlp"))
    experts = int(cfg.get("num_experts") or 0) if cfg.get("enable_moe_block") else 0
    if experts and not (cfg.get("top_k_experts") and cfg.get("moe_intermediate_size")):
        raise ValueError("a Gemma 4 config with enable_moe_block must state top_k_experts and moe_intermediate_size")
    return Gemma4Config(
        head_dims=tuple(int(o.get("head_dim", head_dim)) for o in layer),
        num_kv_heads=tuple(int(o.get("num_key_value_heads", kv_heads)) for o in layer),
        k_eq_v=tuple(f and k_eq_v for f in full),
        kv_sources=sources,
        intermediate_sizes=tuple(width * (2 if double and source is not None else 1) for source in sources),
        hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input", 256) or 0),
        vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input") or 262_144),
        num_experts=experts, top_k_experts=int(cfg.get("top_k_experts") or 0) if experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0) if experts else 0)
