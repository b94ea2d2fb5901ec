"""State-space language models' GGUF files back to Hugging Face checkpoints: Mamba (selective SSM,
"Mamba-1": ``mamba``, state-spaces' mamba-130m ... 2.8b, TII's Falcon-Mamba-7B) and pure Mamba-2
(``mamba2``: Mamba-Codestral-7B, whose tensors gpu_worker.gguf_mamba2 undoes). Used by
gpu_worker.gguf_loader.

llama.cpp's MambaModel converter writes A_log as A = -exp(A_log) ([channels, state], ``ssm_a``, no
suffix), the convolution's [channels, 1, taps] weight squeezed, x_proj as ``ssm_x``, dt_proj (weight
and bias) as ``ssm_dt``; the geometry as ssm.* keys (dt's rank as ssm.time_step_rank) and Falcon-Mamba's
RMS norms of dt, B and C as ssm.dt_b_c_rms. Both converters' head count and context length are
placeholders (0 and 2^20): the converted config has no max_position_embeddings, as a Mamba checkpoint's
has none.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_worker.gguf_mamba2 import HybridNames, mamba2_geometry

MAMBA1_ARCHITECTURES = {"mamba": ("MambaForCausalLM", "mamba")}
MAMBA2_ARCHITECTURES = {"mamba2": ("Mamba2ForCausalLM", "mamba2")}
FALCON_MAMBA = ("FalconMambaForCausalLM", "falcon_mamba")


def mamba1_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensor_names: set[str]
                  ) -> dict[str, Any]:
    """The Mamba keys of a converted config.json (transformers' MambaConfig / FalconMambaConfig names)."""
    hidden, inner = int(config["hidden_size"]), int(meta[f"{arch}.ssm.inner_size"])
    extra: dict[str, Any] = {
        "intermediate_size": inner, "expand": max(1, inner // hidden),
        "state_size": int(meta[f"{arch}.ssm.state_size"]), "conv_kernel": int(meta[f"{arch}.ssm.conv_kernel"]),
        "time_step_rank": int(meta[f"{arch}.ssm.time_step_rank"]),
        "use_conv_bias": any(name.endswith(".ssm_conv1d.bias") for name in tensor_names),
        "use_bias": any(name.endswith(".ssm_in.bias") for name in tensor_names),
        "layer_norm_epsilon": config["rms_norm_eps"],
    }
    if bool(meta.get(f"{arch}.ssm.dt_b_c_rms", False)):
        extra["architectures"], extra["model_type"] = [FALCON_MAMBA[0]], FALCON_MAMBA[1]
    return extra


def mamba2_lm_config(meta: dict[str, Any], arch: str, config: dict[str, Any], tensor_names: set[str]
                     ) -> dict[str, Any]:
    """A pure Mamba-2 model's keys (transformers' Mamba2Config names)."""
    mamba = mamba2_geometry(meta, arch, tensor_names)
    return {"num_heads": mamba["num_heads"], "head_dim": mamba["head_dim"], "n_groups": mamba["num_groups"],
            "state_size": mamba["state_size"], "conv_kernel": mamba["conv_kernel"],
            "expand": max(1, mamba["inner_size"] // int(config["hidden_size"])), "use_conv_bias": mamba["conv_bias"],
            "use_bias": mamba["proj_bias"], "layer_norm_epsilon": config["rms_norm_eps"]}


def undo_mamba1(part: str, kind: str, array: np.ndarray) -> tuple[str, np.ndarray] | None:
    """A Mamba-1 tensor reshaped back (named within the mixer), or None for one kept as it is."""
    if part == "ssm_a":  # (A = -exp(A_log), [channels, state])
        return "A_log", np.log(-array).astype(np.float32)
    if part == "ssm_d":
        return "D", array.reshape(-1)
    if part == "ssm_conv1d" and kind == "weight":
        return "conv1d.weight", array[:, None, :]
    return None


MAMBA1_NAMES = HybridNames(
    top_level={"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"},
    layers="backbone.layers", mixer="mixer",
    block={"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_x": "mixer.x_proj", "ssm_dt": "mixer.dt_proj",
           "ssm_out": "mixer.out_proj", "ssm_conv1d": "mixer.conv1d"},
    family="Mamba", undo=undo_mamba1)
# (a pure Mamba-2 model's: the same layout, Mamba-2's tensors)
MAMBA2_LM_NAMES = HybridNames(MAMBA1_NAMES.top_level, "backbone.layers", "mixer", {"attn_norm": "norm"}, "Mamba-2")
