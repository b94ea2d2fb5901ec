"""Gemma 3n's own geometry (read by gpu_worker.config for Gemma3nForCausalLM): the parts of its
decoder no other family has, with transformers' Gemma3nTextConfig defaults for the keys a config
leaves out.

* AltUp: the hidden state is ``altup_num_inputs`` streams; each layer runs on the active one and
  corrects the others from its output.
* LAuReL: a low-rank (``laurel_rank``) residual beside each attention.
* Per-layer inputs: every layer also reads ``hidden_size_per_layer_input`` values per token, from an
  embedding table of ``vocab_size_per_layer_input`` rows and a projection of the token's embedding.
* KV sharing: the last ``num_kv_shared_layers`` layers compute no keys or values; each attends over
  those of the last earlier layer of its own kind (sliding-window or full), its cache included.
* Activation sparsity: the first layers' MLP gates keep only the values above a Gaussian quantile
  (``activation_sparsity_pattern``) of each token's gate row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Gemma3nConfig:
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    altup_num_inputs: int
    altup_active_idx: int
    altup_correct_scale: bool
    laurel_rank: int
    # Each layer's MLP width, and the Gaussian quantile its gate is cut at (0: none).
    intermediate_sizes: tuple[int, ...]
    activation_sparsity: tuple[float, ...]
    # Each layer's source of keys and values: None for its own, else the index of the layer whose
    # cache it attends over.
    kv_sources: tuple[int | None, ...]


GEMMA3N_TEXT_DEFAULTS = {"vocab_size": 262_400, "hidden_size": 2048, "intermediate_size": 16_384,
                         "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 2,
                         "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                         "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                         "sliding_window": 512, "final_logit_softcapping": 30.0}


def gemma3n_layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's kind as transformers reads it: ``layer_types``, else every fifth layer full."""
    layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' for each of the {layers} "
                         f"layers, got {kinds}")
    return kinds


def kv_sources(kinds: list[str], shared: int) -> tuple[int | None, ...]:
    """Each layer's source of keys and values under KV sharing (Gemma 3n's and Gemma 4's): None for
    its own; for each of the last ``shared`` layers, the last earlier layer of its kind."""
    layers = len(kinds)
    first_shared = layers - shared
    if not 0 <= shared < layers:
        raise ValueError(f"num_kv_shared_layers must be below num_hidden_layers ({layers}), got {shared}")
    sources: list[int | None] = [None] * layers
    unshared = kinds[:first_shared]
    for i in range(first_shared, layers):
        if kinds[i] not in unshared:
            raise ValueError(f"layer {i} shares the keys and values of the last earlier {kinds[i]} layer, and "
                             f"no layer before {first_shared} is one")
        sources[i] = first_shared - 1 - unshared[::-1].index(kinds[i])
    return tuple(sources)


def _per_layer(cfg: dict[str, Any], key: str, default: Any, layers: int) -> list[Any]:
    value = cfg.get(key, default)
    values = list(value) if isinstance(value, list | tuple) else [value] * layers
    if len(values) != layers:
        raise ValueError(f"{key} must give one value for each of the {layers} layers (or one for all), got {value}")
    return values


def gemma3n_config_from_dict(cfg: dict[str, Any]) -> Gemma3nConfig:
    """Gemma 3n's fields of a text config (its defaults applied: GEMMA3N_TEXT_DEFAULTS)."""
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma3nForCausalLM's hidden_activation must be gelu_pytorch_tanh (its released one), got "
                         f"{cfg['hidden_activation']!r}")
    kinds = gemma3n_layer_types(cfg)
    sparsity = cfg.get("activation_sparsity_pattern")
    if sparsity is None:  # (transformers' default: the first ten layers cut at 0.95, where there are more)
        sparse = 10 if layers > 10 else 0
        sparsity = [0.95] * sparse + [0.0] * (layers - sparse)
    sparsity = _per_layer({"activation_sparsity_pattern": sparsity}, "activation_sparsity_pattern", 0.0, layers)
    if any(not 0.0 <= float(s) < 1.0 for s in sparsity):
        raise ValueError(f"activation_sparsity_pattern values must lie in [0, 1), got {sparsity}")
    sources = kv_sources(kinds, int(cfg.get("num_kv_shared_layers", 15)))
    altup = int(cfg.get("altup_num_inputs", 4))
    active = int(cfg.get("altup_active_idx", 0))
    if altup < 2 or not 0 <= active < altup:
        raise ValueError(f"altup_num_inputs must be 2 or more and altup_active_idx one of them, got {altup} and "
                         f"{active}")
    return Gemma3nConfig(
        hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input", 256)),
        vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input", 262_144)),
        altup_num_inputs=altup, altup_active_idx=active,
        altup_correct_scale=bool(cfg.get("altup_correct_scale", True)),
        laurel_rank=int(cfg.get("laurel_rank", 64)),
        # (gpu_worker.config keeps them under layer_intermediate_sizes, its intermediate_size the widest)
        intermediate_sizes=tuple(int(n) for n in _per_layer(
            cfg, "layer_intermediate_sizes" if "layer_intermediate_sizes" in cfg else "intermediate_size", 16_384,
            layers)),
        activation_sparsity=tuple(float(s) for s in sparsity),
        kv_sources=sources)
