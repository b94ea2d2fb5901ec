"""Mamba (selective SSM, "Mamba-1") language models' GGUF files (``mamba``: state-spaces' mamba-130m ...
2.8b, TII's Falcon-Mamba-7B) back to Hugging Face checkpoints. Used by gpu_worker.gguf_loader.

llama.cpp's MambaModel converter writes A_log as A = -exp(A_log) ([channels, state], ``ssm_a``, no
suffix), the convolution's [channels, 1, taps] weight squeezed, x_proj as ``ssm_x``, dt_proj (weight
and bias) as ``ssm_dt``; the geometry as ssm.* keys (dt's rank as ssm.time_step_rank) and Falcon-Mamba's
RMS norms of dt, B and C as ssm.dt_b_c_rms. Its head count and context length are placeholders (0 and
2^20): the converted config has no max_position_embeddings, as a Mamba checkpoint's has none.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_worker.gguf_mamba2 import HybridNames

MAMBA1_ARCHITECTURES = {"mamba": ("MambaForCausalLM", "mamba")}
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
