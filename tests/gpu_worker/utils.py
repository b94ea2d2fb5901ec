"""Tiny random-weight HF checkpoints and helpers shared by the gpu_worker tests."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from transformers import (
    AfmoeConfig,
    ApertusConfig,
    ArceeConfig,
    AutoModelForCausalLM,
    AXK1Config,
    BambaConfig,
    BeamConfig,
    BioGptConfig,
    BitNetConfig,
    BloomConfig,
    CodeGenConfig,
    Cohere2Config,
    Cohere2MoeConfig,
    CohereConfig,
    CwmConfig,
    DbrxConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV32Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    Ernie4_5Config,
    Exaone4Config,
    ExaoneMoeConfig,
    FalconConfig,
    FalconH1Config,
    FalconMambaConfig,
    FlexOlmoConfig,
    FlintConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GemmaConfig,
    Glm4Config,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GlmConfig,
    GlmMoeDsaConfig,
    GPT2Config,
    GPTBigCodeConfig,
    GPTJConfig,
    GPTNeoConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    GraniteMoeHybridConfig,
    GraniteMoeSharedConfig,
    GraniteMoeSWAConfig,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HunYuanMoEV1Config,
    HyperCLOVAXConfig,
    HYV3Config,
    Jais2Config,
    JambaConfig,
    JetMoeConfig,
    Kolibri1Config,
    LagunaConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    Lfm3Config,
    LlamaConfig,
    LongcatFlashConfig,
    Mamba2Config,
    MambaConfig,
    MellumConfig,
    MiMoV2FlashConfig,
    MiniCPM3Config,
    MiniCPM5MoeConfig,
    MiniMaxM2Config,
    Ministral3Config,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    ModernBertDecoderConfig,
    MptConfig,
    NanoChatConfig,
    NemotronConfig,
    NemotronHConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoConfig,
    OlmoeConfig,
    OlmoHybridConfig,
    OPTConfig,
    PersimmonConfig,
    Phi3Config,
    PhiConfig,
    PhimoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SeedOssConfig,
    SmolLM3Config,
    SolarOpenConfig,
    StableLmConfig,
    Starcoder2Config,
    VaultGemmaConfig,
    XGLMConfig,
    YoutuConfig,
    Zamba2Config,
)

from engine_core.config import CacheConfig, SchedulerConfig
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams
from engine_core.sched.scheduler import Scheduler
from gpu_worker.attn_metadata import compute_slot_mapping
from gpu_worker.config import ModelConfig
from gpu_worker.model_runner import ModelRunner

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
              # Wider than HF's default init so logits are peaked: greedy ties would make
              # token-exact comparisons flaky.
              initializer_range=0.2)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# Phi-3's LongRoPE for 16-dim heads: a factor per frequency pair, short ones near 1, long ones larger.
# Ministral 3's rope parameters for a tiny model: YaRN over a pretrained length of 16, and Llama 4's
# attention temperature past it, with a beta five times the released one (0.1) so that it shows.
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16,
                   "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                   "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}
# GPT-OSS's YaRN (transformers' default betas, truncate off) from a pretrained length of 16 to 256.
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}


def make_config(kind: str = "llama", **overrides):
    kw = dict(_SMALL)
    kw.update(overrides)
    if kind == "llama":
        return LlamaConfig(**kw)
    if kind == "qwen2":
        return Qwen2Config(**kw)
    if kind == "qwen3":
        return Qwen3Config(**kw)
    if kind == "phi3":
        return Phi3Config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "mistral":
        kw.setdefault("sliding_window", None)
        return MistralConfig(**kw)
    # Ministral (transformers' own class): Mistral with a window of 8 on the layers layer_types names
    # (the first of two here). (Its head_dim stated: transformers' Ministral takes a missing one as None.)
    if kind == "ministral":
        return MinistralConfig(**{"head_dim": 16, "sliding_window": 8,
                                  "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
                                  "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Code World Model: llama3 RoPE (its default: factor 16 from 8192 positions), a window of 8 on three
    # layers of four (four layers: the first full).
    if kind == "cwm":
        return CwmConfig(**{"sliding_window": 8, "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1,
                            "eos_token_id": 2, **kw, "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    # Hunyuan dense: per-head q/k RMSNorms after RoPE, NTK RoPE by a fixed alpha (a base of 10,000
    # stretched by 1000 ** (16 / 14)).
    if kind == "hunyuan_dense":
        return HunYuanDenseV1Config(**{"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0,
                                                                           "factor": 1.0, "rope_theta": 10000.0},
                                       "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # DBRX: bias-free LayerNorms, q/k/v fused in Wqkv (2 KV heads) and clamped to [-0.6, 0.6] (about their
    # spread here), RoPE base 500,000, 8 experts of 32, 2 a token, renormalised.
    if kind == "dbrx":
        return DbrxConfig(**{"d_model": kw["hidden_size"], "n_heads": kw["num_attention_heads"],
                             "n_layers": kw["num_hidden_layers"], "max_seq_len": kw["max_position_embeddings"],
                             "vocab_size": kw["vocab_size"], "initializer_range": kw["initializer_range"],
                             "attn_config": {"kv_n_heads": kw["num_key_value_heads"], "clip_qkv": 0.6,
                                             "rope_theta": 500000.0},
                             # (transformers 5's DBRX reads its base here, not attn_config's)
                             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
                                            **kw.get("ffn_config", {})},
                             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})  # (DBRX is never tied)
    # VaultGemma: Gemma 2's attention (soft caps, a window of 8 on every other layer) with two norms a
    # layer.
    if kind == "vaultgemma":
        return VaultGemmaConfig(**{"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "pad_token_id": 0,
                                   "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Hunyuan MoE: the dense model's attention, 8 experts of 32 (2 a token, renormalised) beside a
    # shared MLP as wide.
    if kind == "hunyuan_moe":
        return HunYuanMoEV1Config(**{"head_dim": 16, "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0,
                                                                         "factor": 1.0, "rope_theta": 10000.0},
                                     "num_experts": 8, "moe_topk": 2, "intermediate_size": 32, "pad_token_id": 0,
                                     "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Jais 2: LayerNorms, an ungated relu^2 MLP, biases on every projection.
    if kind == "jais2":
        return Jais2Config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "ministral3":
        return Ministral3Config(**{"rope_parameters": MINISTRAL3_ROPE, "head_dim": 16, "sliding_window": None,
                                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Mixture of experts: 8 experts, 2 per token, narrower than the dense MLP where the model allows.
    if kind == "mixtral":
        kw.setdefault("sliding_window", None)
        return MixtralConfig(**{"num_local_experts": 8, "num_experts_per_tok": 2, **kw})
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 48, **kw})
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "norm_topk_prob": True, **kw})
    # SmolLM3: every second layer without RoPE here (its default is every fourth); tied embeddings.
    if kind == "smollm3":
        return SmolLM3Config(**{"no_rope_layer_interval": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                **kw})
    # OLMo 2: norms after each sublayer, q/k normed over their whole projections.
    if kind == "olmo2":
        return Olmo2Config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # OLMo 3: OLMo 2's layers, windows of 8 on three layers of four (plain RoPE there): four layers give
    # it a full one.
    if kind == "olmo3":
        return Olmo3Config(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 8,
                              **kw, "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    # OLMoE: OLMo 2's whole-projection q/k norms in Llama's layers, 8 experts, 2 per token.
    if kind == "olmoe":
        return OlmoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "pad_token_id": 0,
                              "bos_token_id": 1, "eos_token_id": 2, **kw})
    # FlexOlmo: OLMo 2's layers (post-norms, whole-projection q/k norms), 8 experts, 2 per token.
    if kind == "flex_olmo":
        return FlexOlmoConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Granite: its four scalars away from 1 (Granite 3.x's own values are of these orders).
    if kind == "granite":
        return GraniteConfig(**{"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                "attention_multiplier": 0.0625, "logits_scaling": 8.0, **kw})
    # HyperCLOVA X: Granite's scalars away from 1 (its logits multiplied), Peri-LN's norm after each
    # sublayer, 8-dim heads (not hidden / heads).
    if kind == "hyperclovax":
        return HyperCLOVAXConfig(**{"embedding_multiplier": 3.0, "residual_multiplier": 0.4,
                                    "attention_multiplier": 0.2, "logits_scaling": 0.5, "head_dim": 8,
                                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # MiniMax-M2: whole-projection q/k norms, RoPE over half of each 16-dim head, 8 experts chosen by
    # sigmoid scores through the correction bias, 2 per token.
    if kind == "minimax_m2":
        return MiniMaxM2Config(**{"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5}, **kw, "intermediate_size": 32})
    # Granite MoE: Granite's scalars, 8 experts of width 32 in every layer, 2 per token.
    if kind == "granitemoe":
        return GraniteMoeConfig(**{"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                   "attention_multiplier": 0.0625, "logits_scaling": 8.0, "num_local_experts": 8,
                                   "num_experts_per_tok": 2, **kw, "intermediate_size": 32})
    # Granite MoE Shared: Granite MoE with a shared expert beside the routed ones.
    if kind == "granitemoeshared":
        return GraniteMoeSharedConfig(**{"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                         "attention_multiplier": 0.0625, "logits_scaling": 8.0,
                                         "num_local_experts": 8, "num_experts_per_tok": 2,
                                         "shared_intermediate_size": 48, **kw, "intermediate_size": 32})
    # Granite 4.0-H: Mamba-2 layers (8 heads of 16 in 2 groups, states of 16, chunks of 8 tokens so a
    # prompt spans several) around an attention layer without positions, 4 routed experts and a
    # shared one (num_local_experts 0: the shared MLP alone).
    if kind == "granitemoehybrid":
        kinds = kw.pop("layer_types", ["mamba", "attention", "mamba", "mamba"])
        return GraniteMoeHybridConfig(**{
            "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.25,
            "logits_scaling": 3.0, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 48,
            "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 8,
            "position_embedding_type": "nope", **kw, "intermediate_size": 32, "layer_types": kinds,
            "num_hidden_layers": len(kinds)})
    # Bamba: Granite 4.0-H's Mamba-2 layers (8 heads of 16 in 2 groups, states of 16, chunks of 8)
    # around an attention layer whose RoPE turns half of each head; a dense MLP in every layer.
    if kind == "bamba":
        kw.pop("num_hidden_layers")
        return BambaConfig(**{"num_hidden_layers": 4, "attn_layer_indices": [1], "mamba_n_heads": 8,
                              "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 8, "pad_token_id": 0,
                              "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Falcon-H1: attention (16-dim heads) and a Mamba-2 mixer (8 heads of 8 in 2 groups, states of 16,
    # chunks of 8: mamba_d_ssm 64) side by side in every layer, with muP multipliers away from 1 on
    # every projection (of the orders Falcon-H1-0.5B's are), no gated norm (as released).
    if kind == "falcon_h1":
        kw.pop("num_hidden_layers")
        return FalconH1Config(**{"num_hidden_layers": 3, "head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 8,
                                 "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 8,
                                 "mamba_rms_norm": False, "embedding_multiplier": 5.6, "lm_head_multiplier": 0.04,
                                 "attention_in_multiplier": 1.5, "attention_out_multiplier": 0.9,
                                 "key_multiplier": 0.4, "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.24,
                                 "mlp_multipliers": [0.9, 0.6], "ssm_multipliers": [0.4, 0.3, 0.5, 0.2, 1.3],
                                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # LFM2: short convolutions (3 taps) around one attention layer with q/k norms, the MLP's width
    # adjusted as LFM2's (2/3 of block_ff_dim 192, rounded up to 32: 128). LFM2-MoE: 8 experts (2 a
    # token, sigmoid scores through expert_bias, scaled by 2.5) after one dense layer.
    if kind == "lfm2":
        kw.pop("num_hidden_layers")
        return Lfm2Config(**{"num_hidden_layers": 4, "full_attn_idxs": [1], "block_ff_dim": 192,
                             "block_multiple_of": 32, "norm_eps": 1e-5, **kw})
    if kind == "lfm2_moe":
        kw.pop("num_hidden_layers")
        return Lfm2MoeConfig(**{"num_hidden_layers": 4, "layer_types": ["conv", "conv", "full_attention", "conv"],
                                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "num_dense_layers": 1, "routed_scaling_factor": 2.5, **kw})
    # Qwen3-Next: three Gated DeltaNet layers (2 key heads of 16, each for 2 value heads of 16) to one
    # gated attention (16-dim heads, RoPE over a quarter of each), 8 experts (2 a token) beside a gated
    # shared expert, the first layer's MLP dense. (Weights drawn half as wide as the others': at 0.2 its
    # activations grow large enough through the delta rule and the experts that fp32's rounding, ours
    # and transformers' in different orders, parts their logits by ~5e-4.)
    if kind == "qwen3_next":
        kw.pop("num_hidden_layers")
        return Qwen3NextConfig(**{"num_hidden_layers": 4, "head_dim": 16, "initializer_range": 0.1,
                                  "linear_num_key_heads": 2,
                                  "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                  "shared_expert_intermediate_size": 48, "mlp_only_layers": [0],
                                  **{k: v for k, v in kw.items() if k != "initializer_range"}})
    # Qwen3.5's language model (dense): Qwen3-Next's shapes with its projections apart and a dense MLP.
    if kind == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        kw.pop("num_hidden_layers")
        return Qwen3_5TextConfig(**{"num_hidden_layers": 4, "head_dim": 16, "initializer_range": 0.1,
                                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                    "linear_value_head_dim": 16,
                                    **{k: v for k, v in kw.items() if k != "initializer_range"}})
    # Qwen3.5's MoE language model: 8 experts (2 a token) beside a gated shared expert in every layer.
    if kind == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        kw.pop("num_hidden_layers")
        return Qwen3_5MoeTextConfig(**{"num_hidden_layers": 4, "head_dim": 16, "initializer_range": 0.1,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 48,
                                       **{k: v for k, v in kw.items() if k not in ("initializer_range",
                                                                                  "intermediate_size")}})
    # A pure Mamba-2 model (Mamba-Codestral's architecture): 8 heads of 16 in 2 groups, states of 16.
    if kind == "mamba2":
        return Mamba2Config(**{"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16, "chunk_size": 8,
                               "vocab_size": kw["vocab_size"], "hidden_size": kw["hidden_size"], "num_hidden_layers": 3,
                               "initializer_range": 0.2, "tie_word_embeddings": False, **overrides})
    # Jamba: Mamba-1 layers (128 channels, states of 16) but every fourth from the second, which attends
    # without positions; 8 experts (2 a token, not renormalised) in every other layer.
    if kind == "jamba":
        kw.pop("num_hidden_layers")
        return JambaConfig(**{"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 1,
                              "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 8,
                              "num_experts_per_tok": 2, "mamba_d_state": 16,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Seed-OSS: q/k/v biases, o_proj's own (attention_out_bias). Helium and ERNIE 4.5: RoPE in pairs
    # (ERNIE's biases everywhere under use_bias). Arcee: an ungated relu^2 MLP. EXAONE 4.0: norms after
    # each sublayer, per-head q/k norms, three windowed (8 tokens) rotating layers to one full layer
    # without positions.
    if kind == "seed_oss":
        return SeedOssConfig(**{"head_dim": 16, "attention_out_bias": True, "pad_token_id": 0, "bos_token_id": 1,
                                "eos_token_id": 2, **kw})
    if kind == "helium":
        return HeliumConfig(**{"head_dim": 16, "attention_bias": True, "pad_token_id": 0, "bos_token_id": 1,
                               "eos_token_id": 2, **kw})
    if kind == "ernie4_5":
        return Ernie4_5Config(**{"head_dim": 16, "use_bias": True, "pad_token_id": 0, "bos_token_id": 1,
                                 "eos_token_id": 2, **kw})
    # ERNIE 4.5 MoE: 8 experts (2 a token, chosen through the correction bias) beside a shared one
    # from the second layer on.
    if kind == "ernie4_5_moe":
        return Ernie4_5_MoeConfig(**{"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32,
                                     "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "pad_token_id": 0,
                                     "bos_token_id": 1, "eos_token_id": 2, **kw})
    # StarCoder2: LayerNorms, biases everywhere, an ungated gelu MLP, windows of 8. StableLM: LayerNorms,
    # RoPE over a quarter of each 16-dim head, q/k/v biases; StableLM 2 12B's parallel residual and
    # per-head q/k LayerNorms where asked.
    if kind == "starcoder2":
        return Starcoder2Config(**{"sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "stablelm":
        return StableLmConfig(**{"use_qkv_bias": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                 **kw})
    # Nemotron: LayerNorms scaling by 1 + w, RoPE over half of each head, an ungated relu^2 MLP, biases on
    # all of it. OLMo: parameter-free LayerNorms, q, k and v clamped to [-0.5, 0.5] (about their spread
    # here). Phi: attention beside the MLP on one LayerNorm, RoPE over 0.4 of each 16-dim head, a biased
    # head; per-head q/k LayerNorms where qk_layernorm. GPT-NeoX: attention and MLP side by side on norms
    # of their own, RoPE over a quarter of each 16-dim head, q/k/v fused per head.
    if kind == "nemotron":
        return NemotronConfig(**{"attention_bias": True, "mlp_bias": True, "pad_token_id": 0, "bos_token_id": 1,
                                 "eos_token_id": 2, **kw})
    if kind == "olmo":
        return OlmoConfig(**{"clip_qkv": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "phi":
        return PhiConfig(**{"partial_rotary_factor": 0.4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                            **kw})
    # Persimmon: GPT-NeoX's fused q/k/v in Llama's sequence, per-head q/k LayerNorms, RoPE over half of
    # each 16-dim head, relu^2, biases.
    if kind == "persimmon":
        kw.pop("num_key_value_heads")
        return PersimmonConfig(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "gpt_neox":
        kw.pop("num_key_value_heads")
        return GPTNeoXConfig(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # GPT-2: learned positions, Conv1D projections (q, k, v fused in c_attn), an MLP 4 x 64 wide unless
    # asked. GPTBigCode: multi-query attention (one KV head) unless multi_query is off. GPT-J: attention
    # beside the MLP on one LayerNorm, RoPE in pairs over the first 8 values of each 16-dim head.
    _gpt = {"bos_token_id": 1, "eos_token_id": 2,
            **{k: v for k, v in kw.items() if k not in ("intermediate_size", "num_key_value_heads")}}
    if kind == "gpt2":
        return GPT2Config(**_gpt)
    if kind == "gpt_bigcode":
        return GPTBigCodeConfig(**_gpt)
    # GPT-Neo: global and local (a window of 8) layers in turn, unscaled scores, learned positions.
    if kind == "gpt_neo":
        return GPTNeoConfig(**{"vocab_size": kw["vocab_size"], "max_position_embeddings": kw["max_position_embeddings"],
                               "hidden_size": kw["hidden_size"], "num_layers": kw["num_hidden_layers"],
                               "num_heads": kw["num_attention_heads"], "window_size": 8,
                               "attention_types": [[["global", "local"], kw["num_hidden_layers"] // 2]],
                               "initializer_range": kw["initializer_range"], "bos_token_id": 1, "eos_token_id": 2,
                               **{k: v for k, v in overrides.items() if k not in _SMALL}})
    # CodeGen: GPT-J's layers, q/k/v fused in four blocks of (q, v, k); 8 heads of 8 (two a block), RoPE
    # over 4 values of each.
    if kind == "codegen":
        return CodeGenConfig(**{"rotary_dim": 4, **_gpt, "num_attention_heads": 8})
    if kind == "gptj":
        return GPTJConfig(**{"rotary_dim": 8, **_gpt})
    # Falcon: falcon-7b's layout (multi-query, attention beside the MLP on one LayerNorm) unless asked
    # (new_decoder_architecture: 2 KV heads, a norm for each side; or attention then MLP, per-head q/k/v).
    if kind == "falcon":
        return FalconConfig(**{"ffn_hidden_size": kw["intermediate_size"], "bias": True, **_gpt})
    # Phi-3.5-MoE: 8 experts, 2 a token by sparsemixer (a wide threshold, 0.3, so that its masks bind),
    # LayerNorms, q/k/v/o biases, a biased head, LongRoPE with its mscale from a pretrained length of 16.
    # (Its short and long factors alike: transformers' Phimoe rotates with the short ones at any length,
    # where Microsoft's code and vLLM take the long ones past the pretrained length, as served here.)
    if kind == "phimoe":
        factors = LONGROPE["long_factor"]
        return PhimoeConfig(**{"num_local_experts": 8, "router_jitter_noise": 0.3, "attention_bias": True,
                               "lm_head_bias": True,
                               "rope_parameters": {"rope_type": "longrope", "short_factor": factors,
                                                   "long_factor": factors, "short_mscale": 1.2, "long_mscale": 1.2,
                                                   "original_max_position_embeddings": 16, "rope_theta": 10000.0},
                               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # ALiBi in place of RoPE, 4 heads of 16 values. BLOOM: a LayerNorm over the embeddings, q/k/v fused
    # per head, biases everywhere, a 4 x 64 tanh-gelu MLP. MPT: no biases (LayerNorms without them too),
    # q/k/v fused in Wqkv, clamped to [-0.6, 0.6] (about their spread here), a softmax scale of its own,
    # a 4 x 64 gelu MLP. falcon-rw: Falcon's attention-then-MLP layout (per-head q/k/v) with ALiBi.
    if kind == "bloom":
        return BloomConfig(**{"n_layer": kw["num_hidden_layers"], "n_head": kw["num_attention_heads"],
                              "pad_token_id": 0, **{k: v for k, v in _gpt.items()
                                                    if k not in ("num_hidden_layers", "num_attention_heads",
                                                                 "max_position_embeddings")}})
    if kind == "falcon_rw":
        return make_config("falcon", **{"alibi": True, "multi_query": False, "parallel_attn": False, **overrides})
    if kind == "mpt":
        return MptConfig(**{"d_model": kw["hidden_size"], "n_heads": kw["num_attention_heads"],
                            "n_layers": kw["num_hidden_layers"], "max_seq_len": kw["max_position_embeddings"],
                            "vocab_size": kw["vocab_size"], "initializer_range": kw["initializer_range"],
                            "attn_config": {"clip_qkv": 0.6, "softmax_scale": 0.3, **kw.get("attn_config", {})},
                            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    # OPT: learned positions from the table's third row, LayerNorms, biases, an ungated relu MLP.
    if kind == "opt":
        return OPTConfig(**{"ffn_dim": kw["intermediate_size"], "init_std": kw["initializer_range"], "pad_token_id": 0,
                            **{k: v for k, v in _gpt.items() if k != "initializer_range"}})
    # dots.llm1: Qwen3's attention (per-head q/k norms), a dense first layer, then 8 experts (2 a token,
    # sigmoid scores through the correction bias, in 4 groups of which 2 are kept) beside 2 shared ones.
    if kind == "dots1":
        return Dots1Config(**{"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "sliding_window": None,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "glm":
        return GlmConfig(**{"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Llama 4 (text): rotating layers (L2 q/k norms, attending within chunks of 8 tokens) but every
    # second, whose queries take the temperature past a floor_scale of 8 positions; 4 experts (1 a
    # token, its weight on the input) beside a shared one in every second layer, a dense MLP twice as
    # wide in the others.
    if kind == "llama4":
        from transformers import Llama4TextConfig

        return Llama4TextConfig(**{"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
                                   "interleave_moe_layer_step": 2, "no_rope_layer_interval": 2,
                                   "intermediate_size_mlp": 256, "attention_chunk_size": 8, "floor_scale": 8,
                                   "attn_scale": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                   **kw, "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    # Apertus: per-head q/k norms, an ungated xIELU MLP (its learned scalars drawn apart in
    # save_tiny_model), llama3 RoPE.
    if kind == "apertus":
        return ApertusConfig(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32", **kw})
    if kind == "arcee":
        return ArceeConfig(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # K-EXAONE: EXAONE 4.0's attention (a window of 8 on three layers of four, the full one without
    # positions) in pre-norm layers, 8 experts of 32 (2 a token, renormalised, times 2.5) beside a shared
    # one, the first layer dense.
    if kind == "exaone_moe":
        return ExaoneMoeConfig(**{"sliding_window": 8, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                  **kw, "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    if kind == "exaone4":
        return Exaone4Config(**{"sliding_window": 8, "sliding_window_pattern": 4, "pad_token_id": 0,
                                "bos_token_id": 1, "eos_token_id": 2, **kw,
                                "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    # GLM-4 (0414, dense): q/k/v biases, RoPE in pairs over half of each 16-dim head, a norm after the
    # attention and after the MLP too.
    if kind == "glm4":
        return Glm4Config(**{"head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Cohere (Command-R): attention beside the MLP after one bias-free LayerNorm, RoPE in pairs, the
    # logits scaled by 0.25; Command-R+'s per-head q/k norms where use_qk_norm. Cohere2 (Command-R7B):
    # three windowed (8 tokens), rotating layers to one full layer without positions.
    if kind == "cohere":
        return CohereConfig(**{"logit_scale": 0.25, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    if kind == "cohere2":
        return Cohere2Config(**{"logit_scale": 0.25, "sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1,
                                "eos_token_id": 2, **kw, "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    # Zamba2: Mamba-2 layers (8 heads of 16 in 2 groups, states of 16, chunks of 8), three of them
    # hybrid, taking two shared blocks in turn (0, 1, 0), each use with adapters of rank 8 on q, k, v
    # and the MLP; RoPE in the shared attention (multi-head: 4 heads of 32 over 2 x hidden). (Weights
    # drawn half as wide as the others': at 0.2 each layer multiplies fp32's rounding differences,
    # ours and transformers', about fourfold, parting their logits by ~1e-3 after five layers.)
    if kind == "zamba2":
        kw.pop("num_hidden_layers")
        return Zamba2Config(**{"num_hidden_layers": 5, "initializer_range": 0.1,
                               "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
                               "n_mamba_heads": 8, "mamba_ngroups": 2, "mamba_d_state": 16, "chunk_size": 8,
                               "num_mem_blocks": 2, "use_shared_attention_adapter": True, "adapter_rank": 8,
                               "use_mem_rope": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                               **{k: v for k, v in kw.items() if k != "initializer_range"},
                               "num_key_value_heads": kw.get("num_attention_heads", 4)})
    # Mamba (Mamba-1) and Falcon-Mamba language models: 128 channels, states of 16, dt's rank 4 (64 / 16).
    if kind in ("mamba", "falcon_mamba"):
        config_class = MambaConfig if kind == "mamba" else FalconMambaConfig
        return config_class(**{"state_size": 16, "vocab_size": kw["vocab_size"], "hidden_size": kw["hidden_size"],
                               "num_hidden_layers": 3, "initializer_range": 0.2, "tie_word_embeddings": False,
                               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **overrides})
    # Nemotron-H: Mamba-2, MLP and attention blocks (8 heads of 16 in 2 groups, states of 16, chunks of
    # 8); Nemotron 3 Nano's routed relu^2 experts (8, 2 a token, in 2 groups of which 1 is kept, scaled
    # by 2.5) beside a shared one, in its "E" blocks.
    if kind in ("nemotron_h", "nemotron_h_moe"):
        kw.pop("num_hidden_layers")
        moe = {"hybrid_override_pattern": "ME*M-E", "n_routed_experts": 8, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "n_group": 2,
               "topk_group": 1, "routed_scaling_factor": 2.5} if kind == "nemotron_h_moe" else {}
        return NemotronHConfig(**{"hybrid_override_pattern": "M-*M-M", "head_dim": 16, "mamba_num_heads": 8,
                                  "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 8,
                                  "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **moe, **kw})
    # GPT-OSS: 8 experts, 2 per token, the even layers windowed (8 tokens), YaRN past 16 positions.
    if kind == "gpt_oss":
        return GptOssConfig(**{"num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                               "intermediate_size": 32, "rope_parameters": {**GPT_OSS_ROPE, "rope_theta": 150000.0},
                               **kw})
    # GLM-4.5: 8 experts in 2 groups (1 kept), 2 per token, a shared expert, the first layer dense,
    # RoPE over half of each 16-dim head, q/k/v biases, the weights scaled by 2.5 as GLM-4.5's are.
    if kind == "glm4_moe":
        return Glm4MoeConfig(**{"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "head_dim": 16,
                                "attention_bias": True, "routed_scaling_factor": 2.5, "pad_token_id": 0,
                                "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Solar Open: GLM-4.5's experts (8 in 2 groups, 1 kept, 2 a token, a shared one, scaled by 2.5) in
    # every layer, q/k/v biases.
    if kind == "solar_open":
        return SolarOpenConfig(**{"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                  "n_group": 2, "topk_group": 1, "head_dim": 16, "attention_bias": True,
                                  "routed_scaling_factor": 2.5, "pad_token_id": 0, "bos_token_id": 1,
                                  "eos_token_id": 2, **kw})
    # DeepSeek-V3: MLA (a 32-value latent, 16 + 8 query/key values a head, 16 value values, queries
    # through a 32-value bottleneck; rotary values in pairs), then GLM-4.5's experts: 8 in 2 groups
    # (1 kept), 2 per token, a shared expert, the first layer dense, the weights scaled by 2.5.
    if kind == "deepseek_v3":
        return DeepseekV3Config(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                   "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                                   "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                   "num_key_value_heads": kw["num_attention_heads"]})  # (MLA: as many)
    # Kimi-Linear: Kimi Delta Attention (4 heads of 16, 4 taps) in three layers of four, the second MLA
    # without positions (as deepseek_v3's but no query bottleneck), then 8 experts (2 a token, sigmoid
    # scores through the correction bias, scaled by 2.446) beside a shared one, the first layer dense.
    if kind == "kimi_linear":
        from transformers import KimiLinearConfig

        kw.pop("num_hidden_layers")
        return KimiLinearConfig(**{"num_hidden_layers": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                   "qk_rope_head_dim": 8, "v_head_dim": 16, "num_local_experts": 8,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                   "linear_num_heads": 4, "linear_head_dim": 16,
                                   "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                   "linear_attention"],
                                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                   "num_key_value_heads": kw["num_attention_heads"]})
    # Ling 3: kimi_linear's layers with full-rank KDA gates (the safe gate at -5), MLA rotating in pairs
    # with a gate per head, 8 experts in 2 groups (1 kept, 2 a token) clipped at per-layer limits beside a
    # clipped shared one (limits these weights' activations cross), the first layer dense.
    if kind == "bailing_hybrid":
        from transformers.models.bailing_hybrid.configuration_bailing_hybrid import BailingHybridConfig

        kw.pop("num_hidden_layers")
        return BailingHybridConfig(**{"num_hidden_layers": 4, "head_dim": 16, "kv_lora_rank": 32,
                                      "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                      "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                      "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                                      "num_mtp_layers": 0,
                                      "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                      "linear_attention"],
                                      "expert_swiglu_limit_list": [0, 0.02, 0, 0.01],
                                      "share_expert_swiglu_limit_list": [0, 0.015, 0.02, 0],
                                      "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                      "num_key_value_heads": kw["num_attention_heads"]})
    # MiniMax (-Text-01, -M1): lightning attention in three layers of four, GQA with RoPE in the second,
    # 4 experts (2 a token) in every layer; residual scales of their own per sublayer kind.
    if kind == "minimax":
        from transformers import MiniMaxConfig

        kw.pop("num_hidden_layers")
        return MiniMaxConfig(**{"num_hidden_layers": 4, "head_dim": 16, "num_local_experts": 4,
                                "num_experts_per_tok": 2,
                                "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                                "linear_attention"],
                                "linear_attn_alpha_factor": 0.7, "linear_attn_beta_factor": 1.2,
                                "full_attn_alpha_factor": 1.5, "full_attn_beta_factor": 0.9, "mlp_alpha_factor": 1.3,
                                "mlp_beta_factor": 1.1, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # DeepSeek-V3.2: deepseek_v3's layers whose attention is DSA: an indexer of 16 heads of 16 values (8
    # rotated) picks the 6 best keys a query past its sixth token attends to. (No padding token: its zero
    # embedding would score every key 0 for a query of it, a tie any two top-k implementations break apart.)
    if kind == "deepseek_v32":
        return DeepseekV32Config(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                                    "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                                    "index_n_heads": 16, "index_head_dim": 16, "index_topk": 6,
                                    "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                    "num_key_value_heads": kw["num_attention_heads"]})  # (MLA: as many)
    # GLM-5: deepseek_v32's layers (experts in one group) whose indexer rotates in pairs, every other layer
    # from the second sharing the previous layer's choice of 6 keys.
    if kind == "glm_moe_dsa":
        return GlmMoeDsaConfig(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                  "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
                                  "index_n_heads": 16, "index_head_dim": 16, "index_topk": 6, "index_topk_freq": 2,
                                  "index_skip_topk_offset": 1, "pad_token_id": None, "bos_token_id": 1,
                                  "eos_token_id": 2, **kw, "num_key_value_heads": kw["num_attention_heads"]})
    # nanochat: weightless norms (one over the embeddings too), relu^2 fc1/fc2, RoPE turning the other way,
    # q/k normed after it, logits capped at 15 (the logits here reach beyond it).
    if kind == "nanochat":
        return NanoChatConfig(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Kolibri 1: GLM-4's four norms, EXAONE 4's attention (a window of 8 on the first layer, which rotates;
    # the second full, without positions), 8 experts of 32 in every layer (2 a token, chosen by logit plus
    # the correction bias, weighted by sigmoid) beside a shared one.
    if kind == "kolibri1":
        return Kolibri1Config(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 48, "head_dim": 16, "sliding_window": 8,
                                 "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0,
                                 "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Flint: Qwen3-MoE's attention with a sink per query head, a window of 8 on the second layer (which
    # rotates; the first full, without positions), the first layer dense, then 8 experts of 32 (2 a token
    # by sigmoid, renormalised) beside a shared one.
    if kind == "flint":
        return FlintConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 48, "head_dim": 16, "sliding_window": 8,
                              "layer_types": ["full_attention", "sliding_attention"], "mlp_only_layers": [0],
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # ModernBERT's decoder: normed embeddings, LayerNorms, a window of 8 (local_attention 16) on two layers of
    # three with their own RoPE base, GeGLU, the head's dense + GELU + norm before the tied projection.
    if kind == "modernbert_decoder":
        return ModernBertDecoderConfig(**{"num_hidden_layers": 3, "local_attention": 16, **{
            k: v for k, v in kw.items() if k != "num_key_value_heads"}, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2})
    # BioGPT: OPT's layers (GELU) over sqrt(hidden)-scaled token embeddings and learned positions from row 2.
    if kind == "biogpt":
        return BioGptConfig(**{k: v for k, v in kw.items() if k != "num_key_value_heads"},
                            **{"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2})
    # XGLM: the same with fairseq's sinusoidal positions (the padding row, 1, zero), in its own key names.
    if kind == "xglm":
        return XGLMConfig(vocab_size=kw["vocab_size"], d_model=kw["hidden_size"], ffn_dim=kw["intermediate_size"],
                          num_layers=kw["num_hidden_layers"], attention_heads=kw["num_attention_heads"],
                          max_position_embeddings=kw["max_position_embeddings"],
                          init_std=kw["initializer_range"], **{k: kw[k] for k in ("tie_word_embeddings",)
                                                               if k in kw},
                          pad_token_id=1, bos_token_id=0, eos_token_id=2)
    # LongCat-Flash: one layer (two half-layers of latent attention and a dense MLP) with shortcut experts:
    # 8 routed of 32 and 4 zero experts, 2 a token, the softmax through the correction bias, times 2.
    if kind == "longcat_flash":
        return LongcatFlashConfig(**{"q_lora_rank": 48, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                     "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                                     "zero_expert_num": 4, "moe_topk": 2, "expert_ffn_hidden_size": 32,
                                     "ffn_hidden_size": kw["intermediate_size"], "routed_scaling_factor": 2.0,
                                     **{k: v for k, v in kw.items() if k != "intermediate_size"},
                                     "num_key_value_heads": kw["num_attention_heads"], "pad_token_id": 0,
                                     "bos_token_id": 1, "eos_token_id": 2})
    # JetMoE: 8 attention experts of 2 query heads (the KV heads' number) of 16 and 8 MLP experts of 32, 2 a
    # token each.
    if kind == "jetmoe":
        return JetMoeConfig(**{"num_local_experts": 8, "num_experts_per_tok": 2, "kv_channels": 16,
                               "intermediate_size": 32, **{k: v for k, v in kw.items() if k != "num_attention_heads"},
                               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    # BitNet: Llama's block with a norm over the heads' outputs before o_proj and one over relu(gate)^2 * up
    # before down_proj.
    if kind == "bitnet":
        return BitNetConfig(**{"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Beam: gated attention with per-head biases, a window of 8 on the first layer (rotating), the second
    # full (no positions, queries scaled by position); depth-scaled residual adds; the first layer dense,
    # then 8 experts of 32 in 2 groups (1 kept), 2 a token, times 2.5; logits capped at 30.
    if kind == "beam":
        return BeamConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                             "topk_group": 1, "head_dim": 16, "sliding_window": 8,
                             "layer_types": ["sliding_attention", "full_attention"],
                             "mlp_layer_types": ["dense", "sparse"], "pad_token_id": 0, "bos_token_id": 1,
                             "eos_token_id": 2, **kw})
    # A.X-K1: deepseek_v3's layers (8 experts in 2 groups, 1 kept) whose routed layers norm their MLP's output.
    if kind == "axk1":
        return AXK1Config(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                             "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1,
                             "mlp_layer_types": ["dense", "sparse"], "pad_token_id": 0, "bos_token_id": 1,
                             "eos_token_id": 2, **kw, "num_key_value_heads": kw["num_attention_heads"]})
    # GLM-4.7-Flash: DeepSeek-V3's MLA (as deepseek_v3's, rotary values in pairs) with GLM-4.5's experts:
    # 8 in one group, 2 a token, renormalised, times 1.8, a shared one, the first layer dense.
    if kind == "glm4_moe_lite":
        return Glm4MoeLiteConfig(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "pad_token_id": 0,
                                    "bos_token_id": 1, "eos_token_id": 2, **kw,
                                    "num_key_value_heads": kw["num_attention_heads"]})
    # MiniCPM3: MLA (a 32-value latent, 16 + 8 query/key values a head, 16 value values, queries through a
    # 32-value bottleneck; rotary values in halves), dense MLPs, MiniCPM's scalings (scale_emb 12,
    # scale_depth 1.4 over two layers, logits over 64 / 16).
    # AFMoE (Trinity): four norms a layer, gated attention output, q/k norms; windowed layers (a window
    # of 8) rotate, the full one (every second here) attends without positions; one dense layer, then 8
    # experts of 32 (2 a token, sigmoid through expert_bias, times 2.5) beside a shared one; mup's
    # embedding scale.
    if kind == "afmoe":
        return AfmoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "num_shared_experts": 1, "num_dense_layers": 1, "route_scale": 2.5, "sliding_window": 8,
                              "global_attn_every_n_layers": 2, "head_dim": 16, "mup_enabled": True,
                              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Laguna: 4 layers, windowed (8) and full in turn, 4 then 2 query heads over 2 KV heads, the full layers
    # rotating half of each head with base 500,000; softplus output gates per head; the first layer
    # dense, then 8 experts of 32 (2 a token, sigmoid through the correction bias, soft-capped logits,
    # times 2.5) beside a shared one.
    if kind == "laguna":
        layers = max(4, kw["num_hidden_layers"])
        return LagunaConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 32, "moe_routed_scaling_factor": 2.5,
                               "moe_router_logit_softcapping": 3.0, "sliding_window": 8, "head_dim": 16,
                               "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
                               "num_attention_heads_per_layer": [4, 2] * (layers // 2),
                               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                               "num_hidden_layers": layers})
    # Mellum: Qwen3-MoE's attention and experts (8 of 32, 2 a token) where mlp_layer_types says sparse
    # (the second layer), windowed (8) and full layers with a RoPE base each.
    if kind == "mellum":
        return MellumConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "sliding_window": 8, "head_dim": 16, "mlp_layer_types": ["dense", "sparse"],
                               "layer_types": ["sliding_attention", "full_attention"],
                               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # Hy3: Qwen3's attention, one dense layer, then 8 experts of 32 (2 a token, sigmoid through the
    # correction bias, times 2.826) beside a shared one.
    if kind == "hy_v3":
        return HYV3Config(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
                             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw})
    # MiMo-V2-Flash: 4 layers, the first and fourth full, the others windowed (8) with twice the KV heads
    # and sinks; q/k heads of 24 (8 turning), values of 16 scaled by 0.707; the first layer dense, then 8
    # experts of 32 in 2 groups (1 kept), 2 a token, times 2.5.
    if kind == "mimo_v2_flash":
        layers = max(4, kw["num_hidden_layers"])
        return MiMoV2FlashConfig(**{"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "head_dim": 24,
                                    "v_head_dim": 16, "sliding_window": 8, "attention_bias": True,
                                    "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                                    "full_attention"][:layers] + ["sliding_attention"] * (layers - 4),
                                    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                    "num_hidden_layers": layers})
    # GraniteSWA: Granite's scalars, 4 layers, the first full without positions (base 0), the others
    # windowed (8) rotating with base 10,000; a sink per query head in every layer. GraniteMoeSWA: the
    # same attention with Granite MoE Shared's experts (8 of 32, 2 a token) beside a shared one.
    if kind in ("granite_swa", "granitemoe_swa"):
        layers = max(4, kw["num_hidden_layers"])
        swa = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
               "logits_scaling": 1.0, "sliding_window": 8, "layer_rope_theta": [0.0] + [10000.0] * (layers - 1),
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw, "num_hidden_layers": layers}
        if kind == "granite_swa":
            return GraniteSWAConfig(**swa)
        return GraniteMoeSWAConfig(**{"num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 48,
                                      **swa, "intermediate_size": 32})
    # Cohere2-MoE: 4 layers, the first dense (rotating: prefix pattern 1), then windowed (8), windowed,
    # full (no positions); 8 experts of 32 (2 a token, the softmax over their logits) beside a shared one,
    # averaged; LayerNorms.
    if kind == "cohere2_moe":
        layers = max(4, kw["num_hidden_layers"])
        return Cohere2MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
                                   "sliding_window": 8, "sliding_window_pattern": 3, "first_k_dense_replace": 1,
                                   "prefix_dense_intermediate_size": 96, "head_dim": 16, "logit_scale": 0.5,
                                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                   "num_hidden_layers": layers, "intermediate_size": 32})
    # LFM3: 4 layers: a convolution (8 wide), a full attention layer (proportional RoPE over half of each
    # 16-wide head's frequencies), a convolution, a windowed one (8; plain RoPE); a sigmoid gate per head,
    # four norms a layer.
    if kind == "lfm3":
        layers = max(4, kw["num_hidden_layers"])
        return Lfm3Config(**{"head_dim": 16, "sliding_window": 8, "conv_L_cache": 3, "tie_word_embeddings": False,
                             "layer_types": ["conv", "full_attention", "conv", "sliding_attention"]
                             + ["conv"] * (layers - 4),
                             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                             "num_hidden_layers": layers})
    # OLMo Hybrid: 4 layers, three Gated DeltaNet (2 key heads of 12, 4 value heads of 16, beta doubled)
    # and a full attention layer (OLMo 2's norms after each sublayer, whole-projection q/k norms, RoPE).
    if kind == "olmo_hybrid":
        return OlmoHybridConfig(**{"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 12,
                                   "linear_value_head_dim": 16, "rope_parameters": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0},
                                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                   "num_hidden_layers": max(4, kw["num_hidden_layers"])})
    # Youtu-LLM: DeepSeek-V3's latent attention (rotary values in pairs) with dense MLPs, tied.
    if kind == "youtu":
        return YoutuConfig(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                              "v_head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                              "num_key_value_heads": kw["num_attention_heads"]})
    if kind == "minicpm3":
        return MiniCPM3Config(**{"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                 "v_head_dim": 16, "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 16,
                                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                 "num_key_value_heads": kw["num_attention_heads"]})
    # MiniCPM5-MoE: gated attention (each head's queries then its output gate), 8 experts of 32 chosen by
    # sigmoid scores through the correction bias (2 a token, renormalised, times 3.66) beside a shared
    # one, the first layer dense.
    if kind == "minicpm5_moe":
        return MiniCPM5MoeConfig(**{"head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 1,
                                    "eos_token_id": 2, **kw})
    # DeepSeek-V2(-Lite): MLA with a plain query projection, softmax routing over 8 experts (2 per
    # token, not renormalised), two shared experts.
    if kind == "deepseek_v2":
        return DeepseekV2Config(**{"q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                   "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 2,
                                   "first_k_dense_replace": 1, "pad_token_id": 0, "bos_token_id": 1,
                                   "eos_token_id": 2, **kw, "num_key_value_heads": kw["num_attention_heads"]})
    # Gemma: 16-dim heads (its default is 256), windows short enough for a 45-token prompt to cross.
    if kind == "gemma":
        return GemmaConfig(**{"head_dim": 16, **kw})
    if kind == "gemma2":
        return Gemma2Config(**{"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, **kw})
    if kind == "gemma3":
        return Gemma3TextConfig(**{"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                   "sliding_window_pattern": 2, **kw})
    # Gemma 3n: AltUp's 4 streams, LAuReL of rank 8, per-layer inputs of 8 values (a table of 128 rows: the
    # ids past it read row 0), windowed (8) and full layers alternating, the last two sharing the first
    # two's keys and values, sparse gates in two layers, MLP widths by layer.
    if kind == "gemma3n":
        return Gemma3nTextConfig(**{"head_dim": 16, "sliding_window": 8, "hidden_size_per_layer_input": 8,
                                    "vocab_size_per_layer_input": 128, "laurel_rank": 8, "num_kv_shared_layers": 2,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "activation_sparsity_pattern": [0.6, 0.0, 0.6, 0.0],
                                    "intermediate_size": [128, 96, 64, 128], "pad_token_id": 0, "bos_token_id": 1,
                                    "eos_token_id": 2, **kw, "num_hidden_layers": 4})
    # Gemma 4: windowed layers of 16-wide heads, full ones of 32-wide heads (one KV head, its values the
    # keys' projection; proportional RoPE over a quarter of each), a window of 8, the last two layers
    # sharing the first two's caches with MLPs twice as wide, per-layer inputs of 8 values, 8 experts
    # of 32 (2 a token) beside each MLP, logits capped at 30.
    if kind == "gemma4":
        return Gemma4TextConfig(**{"head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
                                   "attention_k_eq_v": True, "sliding_window": 8, "num_kv_shared_layers": 2,
                                   "layer_types": ["sliding_attention", "full_attention"] * 2,
                                   "use_double_wide_mlp": True, "hidden_size_per_layer_input": 8,
                                   "vocab_size_per_layer_input": 256, "enable_moe_block": True, "num_experts": 8,
                                   "top_k_experts": 2, "moe_intermediate_size": 32, "final_logit_softcapping": 30.0,
                                   "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **kw,
                                   "num_hidden_layers": 4})
    if kind == "gemma3_vlm":
        # Gemma 3 4B+: the text decoder under a vision-language model, with a one-layer vision tower.
        text = make_config("gemma3", **overrides).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                            image_token_index=kw["vocab_size"] - 1, boi_token_index=kw["vocab_size"] - 3,
                            eoi_token_index=kw["vocab_size"] - 2, initializer_range=0.2)
    raise ValueError(kind)


# Tiny models whose layers keep KV cache groups (save_tiny_model's kind: its overrides, its windowed
# groups): Cohere2's three windowed layers and one full (a group a layer), Gemma 2's alternating ones over
# four layers (a group of two full and one of two windowed layers, each group's layers sharing two tensors).
HYBRID_GROUPS = {"cohere2": ({}, 3), "gemma2": ({"num_hidden_layers": 4}, 1)}


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random-weight HF model saved as safetensors; returns its directory."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF initialises biases to zero, which would hide a bias we forget to load.
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            # Qwen3's per-head norms start at 1, which would hide one applied to the wrong heads.
            if name.endswith(("q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight",
                              "query_layernorm.weight", "key_layernorm.weight")) \
                    or "_layernorm.norms." in name:  # (StableLM's: one norm a head)
                param.normal_(1.0, 0.5)
            # Apertus's xIELU scalars (softplus-ed): drawn apart, so each layer's own are read.
            if name.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):
                param.normal_(0.0, 0.5)
            # GPT-OSS's attention sinks: logits of the order of the scores', so each takes a visible share.
            if name.endswith("self_attn.sinks"):
                param.normal_(0.0, 1.0)
            # MiMo-V2-Flash's router starts at zero.
            if kind == "mimo_v2_flash" and name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
            # Gemma's norms store w for a scale of 1 + w, and start at 0: random ones show a norm
            # skipped or scaled by w alone.
            if kind.startswith("gemma") and name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
            # Gemma 3n's AltUp output scale starts at 0, which would hide its per-layer inputs; Gemma 4's
            # router scales start at 1.
            if name.endswith(("altup.correct_output_scale", "router.scale", "router.per_expert_scale")):
                param.normal_(1.0, 0.5)
            # Mamba-2's per-head scalars and its gated norm start at fixed values (A = -1..-heads, D
            # and dt's bias 1, norm 1): drawn apart so each head's are read as its own.
            if name.endswith(("mamba.A_log", "mamba.D", "mamba.dt_bias", "mamba.conv1d.bias", "mixer.A_log",
                              "mixer.dt_proj.bias", "mamba.dt_proj.bias", "dt_layernorm.weight",
                              "b_layernorm.weight", "c_layernorm.weight",
                              "mixer.D", "mixer.dt_bias", "mixer.conv1d.bias", "linear_attn.dt_bias",
                              "linear_attn.norm.weight", "linear_attn.o_norm.weight")):
                param.normal_(0.0, 0.5)
            # Qwen3-Next's and Qwen3.5's (1 + w) norms start at 0.
            if kind in ("qwen3_next", "qwen3_5", "qwen3_5_moe") and name.endswith(("layernorm.weight", "q_norm.weight",
                                                                    "k_norm.weight", "model.norm.weight")):
                param.normal_(0.0, 0.5)
            # (Nemotron's LayerNorm1P weights start at 0 for a scale of 1: drawn apart, so a scale of w
            # alone or a norm skipped shows; Phi's and GPT-NeoX's, to tell their norms apart.)
            if kind == "longcat_flash" and "layernorm" in name:  # (its norms .0 / .1 told apart)
                param.normal_(1.0, 0.5)
            if kind == "modernbert_decoder" and name.endswith(("decoder.bias", "dense.bias")):
                param.normal_(0.0, 0.5)
            if kind in ("nemotron", "phi", "gpt_neox", "biogpt", "xglm", "modernbert_decoder") and name.endswith((
                    "layernorm.weight", "norm.weight", "layer_norm.weight")):
                param.normal_(0.0 if kind == "nemotron" else 1.0, 0.3 if kind == "nemotron" else 0.5)
            # Laguna's correction bias is a parameter (the others' a buffer, below), zero at first.
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.3)
            # AFMoE's router starts at zero (every expert tied), its expert_bias too; its (and LFM3's, OLMo
            # Hybrid's) norms at one: drawn apart, so a norm misplaced, swapped or skipped shows.
            if (kind == "afmoe" and name.endswith(("router.gate.weight", "expert_bias", "norm.weight"))) \
                    or (kind in ("lfm3", "hyperclovax") and name.endswith("norm.weight")) \
                    or (kind == "axk1" and name.endswith("post_mlp_layernorm.weight")) \
                    or (kind == "bitnet" and name.endswith("sub_norm.weight")) \
                    or (kind == "jetmoe" and name.endswith(("experts.bias", "mlp.bias", "layernorm.weight"))) \
                    or (kind in ("kolibri1", "flint", "beam") and name.endswith(("norm.weight", "sinks", "gate_bias"))):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
            if kind == "bailing_hybrid" and name.endswith(("forget_gate.dt_bias", "self_attn.o_norm.weight")):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
            if kind == "minimax" and name.endswith("norm.weight"):
                param.normal_(1.0, 0.5)
            if kind == "kimi_linear" and name.endswith(("forget_gate.dt_bias", "self_attn.o_norm.weight")):
                param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.5)
            if kind == "olmo_hybrid" and name.endswith("layernorm.weight"):  # (its delta rule is touchy: less wide)
                param.uniform_(0.75, 1.25)
            if name.endswith(("mamba.norm.weight", "mixer.norm.weight")) or (kind == "nemotron_h"
                                                                             and name.endswith("norm.weight")):
                param.uniform_(0.5, 1.5)
        # GLM-4.5's and DeepSeek-V3's router correction bias (a buffer, zero at first): of the scores'
        # order, so that it moves the choice.
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.normal_(0.0, 0.3)
            if name.endswith("layer_scalar"):  # (Gemma 4's, at 1: it would hide one not read)
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def make_runner(path: Path, num_blocks: int = 64, block_size: int = 4, device: str = "cpu",
                **kwargs) -> ModelRunner:
    runner = ModelRunner(ModelConfig.from_pretrained(path), device=device, dtype=torch.float32, **kwargs)
    runner.load_model(path)
    runner.initialize_kv_cache(num_blocks, block_size)
    return runner


def prefill_logits(runner: ModelRunner, token_ids: list[int], block_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, run as a single prefill through the paged cache."""
    n = len(token_ids)
    bs = runner.block_size
    table = np.array([block_ids], dtype=np.int64)
    positions = np.arange(n)
    req_index = np.zeros(n, dtype=np.int64)
    slots = compute_slot_mapping(table, req_index, positions, bs)
    meta = runner.attention_metadata(table, np.array([len(block_ids)]), np.array([0, n]), np.array([0]), 0, slots,
                                     bs, decode_in_place=False)
    if runner.mamba_mixers:  # (Mamba-2 layers: the prompt's state in row 0, from zero)
        meta.mamba = runner.mamba_step(np.array([0]), np.array([0]), np.array([0, n]))
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids, device=runner.device), torch.from_numpy(positions), meta)
        return runner.model.compute_logits(hidden)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 16, max_model_len: int = 256, prefix_caching: bool = True,
                   long_prefill_token_threshold: int = 0, num_spec_tokens: int = 0,
                   sliding_window: int | None = None, kv_cache_groups: tuple = ()) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len,
                                     long_prefill_token_threshold=long_prefill_token_threshold),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                                 sliding_window=sliding_window, kv_cache_groups=kv_cache_groups),
                     log_stats=False, num_spec_tokens=num_spec_tokens)


def greedy_request(req_id: str, prompt: list[int], max_tokens: int, **params) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=None)


def run_to_completion(scheduler: Scheduler, execute, max_steps: int = 500,
                      on_step=None, drafter=None, on_output=None) -> dict[str, list[int]]:
    """Drive schedule -> execute -> update until every request finishes; tokens per request id.
    With a ``drafter`` (engine_core.spec_decode.NgramProposer), drafts are proposed after each pass,
    as the engine does; ``on_output`` sees every EngineCoreOutput."""
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        so = scheduler.schedule()
        if on_step is not None:
            on_step(step, so)
        out = execute(so)
        for eco in scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if on_output is not None:
                    on_output(o)
        if drafter is not None:
            scheduler.update_draft_token_ids(drafter.propose(scheduler.running))
    raise AssertionError("requests did not finish")


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_same_parameters(mine: torch.nn.Module, other: torch.nn.Module) -> None:
    """The two modules hold the same parameters, name for name, bit for bit (one checkpoint layout
    loaded against another)."""
    for (name, ours), (other_name, theirs) in zip(mine.named_parameters(), other.named_parameters(), strict=True):
        assert name == other_name
        torch.testing.assert_close(theirs, ours, atol=0, rtol=0)


def save_tiny_model_with_mtp(path: Path, kind: str, seed: int = 0, near_bigram: float | None = None,
                             **overrides) -> Path:
    """A random-weight GLM-4.5, GLM-4.7-Flash or DeepSeek-V3 checkpoint holding one multi-token-prediction layer
    after its decoder's (``model.layers.{num_hidden_layers}``), as the released ones do: transformers
    has no MTP layer, so it is built as one more decoder layer, with the MTP's norms and projection
    beside it, and copies of the embedding and head. ``near_bigram``: every layer's output
    projections (the target's and the MTP's) scaled by it and the MTP's projection close to passing
    the next token's embedding on, so that the model's next token follows mostly from its last and
    the MTP layer's guess of the token after mostly agrees with the model's (drafts get accepted)."""
    import json

    from safetensors.torch import load_file, save_file

    layers = overrides.pop("num_hidden_layers", _SMALL["num_hidden_layers"])
    save_tiny_model(path, kind, seed, num_hidden_layers=layers + 1, **overrides)
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    for key in ("mlp_layer_types", "layer_types"):  # (GLM-4.7-Flash's, DeepSeek-V3.2's: the decoder's layers alone)
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    width = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    prefix = f"model.layers.{layers}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = 1.0 + 0.3 * torch.randn(width, generator=generator)
    tensors[f"{prefix}eh_proj.weight"] = torch.randn(width, 2 * width, generator=generator) * (2 * width) ** -0.5
    if near_bigram is not None:
        for name in tensors:
            if name.startswith("model.layers.") and ("o_proj" in name or "down_proj" in name):
                tensors[name] = tensors[name] * near_bigram
        tensors[f"{prefix}enorm.weight"] = torch.ones(width)
        tensors[f"{prefix}shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        tensors[f"{prefix}eh_proj.weight"] = torch.cat(
            (torch.eye(width), torch.zeros(width, width)), dim=1) + near_bigram * tensors[f"{prefix}eh_proj.weight"]
    tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{prefix}shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def save_tiny_qwen3_next_with_mtp(path: Path, kind: str = "qwen3_next", seed: int = 0,
                                  near_bigram: float | None = None) -> Path:
    """A random-weight Qwen3-Next (or Qwen3.5, dense or MoE) checkpoint of three layers (Gated DeltaNet,
    gated attention, Gated DeltaNet; every MLP routed where the kind routes any) holding one
    multi-token-prediction layer apart, under ``mtp.``, as the released ones do: a fourth (full
    attention) layer's tensors as ``mtp.layers.0``, Gemma-style ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden`` and ``norm``, and ``fc``. ``near_bigram``: as save_tiny_model_with_mtp's
    (every output projection scaled by it, the linear attention's ``out_proj`` too, and ``fc`` close to
    passing the next token's embedding on), so that drafts get accepted."""
    import json

    from safetensors.torch import load_file, save_file

    kinds = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    save_tiny_model(path, kind, seed, layer_types=kinds, **({} if kind == "qwen3_5" else {"mlp_only_layers": []}))
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=3, layer_types=kinds[:3], mtp_num_hidden_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        tensors[name.replace("model.layers.3.", "mtp.layers.0.")] = tensor
    width = config["hidden_size"]
    generator = torch.Generator().manual_seed(seed + 1)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # (each scales by 1 + w)
        tensors[f"mtp.{norm}.weight"] = 0.3 * torch.randn(width, generator=generator)
    tensors["mtp.fc.weight"] = torch.randn(width, 2 * width, generator=generator) * (2 * width) ** -0.5
    if near_bigram is not None:
        for name in tensors:
            if name.startswith(("model.layers.", "mtp.layers.")) and name.endswith(
                    ("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                tensors[name] = tensors[name] * near_bigram
        tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(width)
        # (The final norm's scales uneven, the target's and the MTP layer's alike: whether the layer's
        # output goes on normed or not then matters to the next draft.)
        tensors["model.norm.weight"] = 0.3 * torch.randn(width, generator=generator)
        tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
        # (The hidden state's half not near zero: the hidden state the layer is given matters to its drafts.)
        tensors["mtp.fc.weight"] = torch.cat((torch.eye(width), torch.zeros(width, width)), dim=1) \
            + torch.cat((torch.full((width, width), near_bigram), torch.full((width, width), 0.3)), dim=1) \
            * tensors["mtp.fc.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def save_near_bigram_target(path: Path, seed: int = 0, near_bigram: float = 0.02, kind: str = "llama",
                            **overrides) -> Path:
    """A tiny Llama (or model of another ``kind``; eight layers by default) whose every layer's output
    projections are scaled by ``near_bigram``: each layer's input stays close to the token's
    embedding, so the model's next token follows mostly from its last (``bigram_successors``), and a
    head guessing from that agrees."""
    from safetensors.torch import load_file, save_file

    save_tiny_model(path, kind, seed, **{"num_hidden_layers": 8, **overrides})
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.startswith("model.layers.") and ("o_proj" in name or "down_proj" in name):
            tensors[name] = tensors[name] * near_bigram
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _rms_normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def bigram_successors(target: dict[str, torch.Tensor], eps: float) -> torch.Tensor:
    """Each token's successor in a near-bigram target's limit: its head on its normed embedding."""
    normed = _rms_normed(target["model.embed_tokens.weight"], eps) * target["model.norm.weight"]
    return (normed @ target["lm_head.weight"].T).argmax(-1)


def save_tiny_eagle_head(path: Path, target: Path, method: str, seed: int = 0, near_bigram: float | None = None,
                         draft_vocab_size: int | None = None, fc_bias: bool = True, pytorch_bin: bool = False,
                         config_overrides: dict | None = None, speculators: bool = False,
                         name_prefix: str = "") -> Path:
    """A random-weight EAGLE (``method`` eagle: ``fc.*`` and ``layers.0.*`` without an input norm,
    as the EAGLE authors save them, ``fc_bias`` or not) or EAGLE-3 head (``midlayer.*`` with a
    query/key/value input twice the width, ``hidden_norm``, ``fc`` from three hidden states,
    ``norm``, its own ``lm_head`` over ``draft_vocab_size`` tokens with ``d2t`` / ``t2d``) for the
    tiny Llama at ``target``; both carry a copy of the target's embedding, as released heads do.
    ``pytorch_bin``: saved as pytorch_model.bin. ``speculators``: an EAGLE-3 head as the speculators
    library saves it (``layers.0.*``; its config a ``transformer_layer_config`` beside the head's
    settings, with norm_before_residual). ``name_prefix``: before every tensor's name (some heads are
    saved under ``model.``). ``near_bigram`` (with save_near_bigram_target's
    target): the head's layer outputs scaled by it, and its fc passing on what predicts the target's
    next token (EAGLE: the next token's embedding, through the target's head; EAGLE-3: the token's
    own feature, through a head whose rows pick the successor's successor), so drafts mostly agree."""
    import json

    from safetensors.torch import load_file, save_file

    tcfg = json.loads((target / "config.json").read_text())
    tensors = load_file(target / "model.safetensors")
    width, vocab, eps = tcfg["hidden_size"], tcfg["vocab_size"], tcfg["rms_norm_eps"]
    heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or width // heads
    inter = tcfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed + 7)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    scale = 1.0 if near_bigram is None else near_bigram
    layer = {"self_attn.k_proj.weight": rand(kv_heads * head_dim, width),
             "self_attn.v_proj.weight": rand(kv_heads * head_dim, width),
             "self_attn.o_proj.weight": rand(width, heads * head_dim) * scale,
             "mlp.gate_proj.weight": rand(inter, width), "mlp.up_proj.weight": rand(inter, width),
             "mlp.down_proj.weight": rand(width, inter) * scale,
             "self_attn.q_proj.weight": rand(heads * head_dim, width),
             "post_attention_layernorm.weight": 1.0 + 0.3 * torch.randn(width, generator=g)}
    head: dict[str, torch.Tensor] = {"embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
    config = {**tcfg, "num_hidden_layers": 1, "model_type": "llama"}
    if method == "eagle":
        head.update({f"layers.0.{name}": t for name, t in layer.items()})
        head["fc.weight"] = rand(width, 2 * width)
        if near_bigram is not None:  # (the next token's embedding, under the target's final norm weight)
            head["fc.weight"] = torch.cat((torch.diag(tensors["model.norm.weight"]), torch.zeros(width, width)), 1) \
                + near_bigram * head["fc.weight"]
        if fc_bias:
            head["fc.bias"] = 0.1 * scale * torch.randn(width, generator=g)
        config["architectures"] = ["LlamaForCausalLM"]
    else:
        for name in ("q_proj", "k_proj", "v_proj"):
            layer[f"self_attn.{name}.weight"] = rand(layer[f"self_attn.{name}.weight"].shape[0], 2 * width)
        layer["input_layernorm.weight"] = 1.0 + 0.3 * torch.randn(width, generator=g)
        layer["hidden_norm.weight"] = 1.0 + 0.3 * torch.randn(width, generator=g)
        head.update({f"{'layers.0' if speculators else 'midlayer'}.{name}": t for name, t in layer.items()})
        draft_vocab = draft_vocab_size or vocab
        head["fc.weight"] = rand(width, 3 * width)
        head["norm.weight"] = 1.0 + 0.3 * torch.randn(width, generator=g)
        lm_head = rand(vocab, width)
        chosen = torch.randperm(vocab, generator=g)[:draft_vocab]
        if near_bigram is not None:
            # The third hidden state passed on (the token's feature), normed plainly; each row of the
            # head the mean normed embedding of the tokens whose successor's successor it is.
            head["fc.weight"] = torch.cat((torch.zeros(width, 2 * width), torch.eye(width)), 1) \
                + near_bigram * head["fc.weight"]
            head["norm.weight"] = torch.ones(width)
            after = bigram_successors(tensors, eps)
            twice = after[after]
            normed = _rms_normed(tensors["model.embed_tokens.weight"], eps)
            sums = torch.zeros(vocab, width).index_add_(0, twice, normed)
            counts = torch.bincount(twice, minlength=vocab)
            hit = counts > 0
            lm_head[hit] = sums[hit] / counts[hit, None]
            order = torch.randperm(vocab, generator=g)
            chosen = torch.cat((hit.nonzero()[:, 0], order[~hit[order]]))[:draft_vocab]
        chosen = chosen.sort().values
        head["lm_head.weight"] = lm_head[chosen].contiguous()
        head["d2t"] = chosen - torch.arange(draft_vocab)
        head["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, chosen, True)
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
        if speculators:
            config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                      "transformer_layer_config": {**config, "architectures": ["LlamaForCausalLM"]},
                      "draft_vocab_size": draft_vocab, "norm_before_residual": True,
                      "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}],
                                             "verifier": {"name_or_path": str(target)}}}
    config.update(config_overrides or {})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    head = {f"{name_prefix}{name}": tensor for name, tensor in head.items()}
    if pytorch_bin:
        torch.save(head, path / "pytorch_model.bin")
    else:
        save_file(head, path / "model.safetensors", metadata={"format": "pt"})
    return path


class WorkerHost:
    """A process (a Ray actor) that holds one tensor-parallel rank's Worker at a time: the two-rank tests
    start their ranks in a pair of these kept for a test module, rather than in new actors each (a
    process and its imports cost about 2 s a case)."""

    def __init__(self) -> None:
        self.worker: Any = None

    def start(self, rank: int, world_size: int, path: str, port: int, kwargs: dict[str, Any]) -> None:
        from gpu_worker.worker import Worker

        self.worker = Worker(rank, world_size, path, **kwargs)
        self.worker.init_distributed("127.0.0.1", port)
        self.worker.load_model()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self.worker, *args, **kwargs)

    def stop(self) -> None:
        import gc

        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        gc.collect()


class _RemoteMethod:
    def __init__(self, remote: Any) -> None:
        self.remote = remote


class HostedRank:
    """A rank started in a WorkerHost, called as a Worker actor is: ``rank.method.remote(...)``, and
    ``rank.__ray_call__.remote(fn)`` (fn given the Worker)."""

    def __init__(self, host: Any) -> None:
        self._host = host

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("_") and name != "__ray_call__":  # (no Worker method; copy / pickle probe these)
            raise AttributeError(name)
        host = self._host
        if name == "__ray_call__":
            return _RemoteMethod(host.apply.remote)
        return _RemoteMethod(lambda *args, **kwargs: host.call.remote(name, *args, **kwargs))


class WorkerHosts:
    """A test module's pair of WorkerHosts, started at first use (in the session's Ray cluster, one CPU
    each) and killed at the module's end, or after a case that failed with ranks in them (a rank left
    inside a collective would hold its process)."""

    def __init__(self) -> None:
        self.hosts: list[Any] = []

    def pair(self) -> list[Any]:
        import ray

        if not self.hosts:
            host = ray.remote(num_cpus=1)(WorkerHost)
            self.hosts = [host.remote() for _ in range(2)]
        return self.hosts

    def close(self) -> None:
        import ray

        for host in self.hosts:
            ray.kill(host)
        self.hosts = []


@contextmanager
def two_tp_ranks(path: Path, hosts: WorkerHosts | None = None, **worker_kwargs):
    """Two Worker ranks of one tensor-parallel group over gloo, their models loaded: yields (the ranks,
    execute: a pass on both, rank 0's answer). Their caches are the caller's to size. With ``hosts``
    (the module's WorkerHosts) the ranks start in its kept processes and stop after; otherwise in
    new Worker actors (a local Ray cluster of 2 CPUs unless one runs already: the session's ray_cluster
    fixture keeps one), shut down after (and, in a cluster that outlives them, killed, freeing its
    CPUs)."""
    import ray

    from gpu_worker.worker import Worker
    from tests.ports import free_port

    started_here = not ray.is_initialized()
    assert not (started_here and hosts is not None), "kept hosts live in the session's Ray cluster"
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ranks: list[Any] = []
    pair: list[Any] = []
    ok = False
    try:
        port = free_port()
        if hosts is not None:
            pair = hosts.pair()
            ray.get([host.start.remote(rank, 2, str(path), port, worker_kwargs) for rank, host in enumerate(pair)])
            ranks = [HostedRank(host) for host in pair]
        else:
            remote_worker = ray.remote(num_cpus=1)(Worker)
            ranks = [remote_worker.remote(rank, 2, str(path), **worker_kwargs) for rank in range(2)]
            ray.get([w.init_distributed.remote("127.0.0.1", port) for w in ranks])
            ray.get([w.load_model.remote() for w in ranks])

        def execute(so):
            outs = ray.get([w.execute_model.remote(so) for w in ranks])
            assert outs[1] is None  # only rank 0 answers
            return outs[0]

        yield ranks, execute
        if hosts is not None:
            # (A rank left inside a collective would not stop: then the pair is killed, below.)
            ray.get([host.stop.remote() for host in pair], timeout=60)
        else:
            ray.get([w.shutdown.remote() for w in ranks])
        ok = True
    finally:
        if started_here:
            ray.shutdown()
        elif hosts is not None:
            if not ok:
                hosts.close()
        else:
            for rank in ranks:
                ray.kill(rank)


class MixerPassMetadata:
    """A pass's metadata as the recurrent mixers read it (``meta.mamba``)."""

    def __init__(self, mamba) -> None:
        self.mamba = mamba


def run_mixer_pass(mixer: torch.nn.Module, pieces: list[tuple[int, torch.Tensor]],
                   kept_within: dict[int, list[tuple[int, int]]] | None = None) -> list[torch.Tensor]:
    """One pass of a recurrent mixer (Mamba, Mamba-2, Gated DeltaNet, short convolution) over ``pieces``
    (state row, its tokens' inputs), in that order in the flat batch: each piece's outputs.
    ``kept_within``: piece index -> states kept part-way through it (mamba_step_metadata's)."""
    from gpu_worker.layers.mamba import mamba_step_metadata

    lens = [p.shape[0] for _, p in pieces]
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    rows = np.array([row for row, _ in pieces], dtype=np.int64)
    out = mixer.forward((), torch.cat([p for _, p in pieces]),
                        MixerPassMetadata(mamba_step_metadata(rows, qsl, torch.device("cpu"), kept_within)))
    return [out[qsl[i]:qsl[i + 1]] for i in range(len(pieces))]


# Two sequences of 13 and 11 tokens in pieces over five passes, sequence 0 in state row 3 (5 + 1 + 2 +
# 1 + 4 tokens), sequence 1 in row 2 (6 + 1 + 1 + 3): prefill chunks longer and shorter than a
# convolution's window, single tokens batched as decodes. Each piece: (row, first token, end token).
MIXER_PIECES_PLAN = [[(3, 0, 5), (2, 0, 6)], [(3, 5, 6), (2, 6, 7)], [(2, 7, 8), (3, 6, 8)], [(3, 8, 9), (2, 8, 11)],
                     [(3, 9, 13)]]


# The delta-rule mixers' plan: sequences of 12 and 9 tokens, sequence 0 in row 3 (5 + 1 + 2 + 4),
# sequence 1 in row 2 (1 + 6 + 1 + 1): a first token alone batched as a decode beside a prefill.
DELTA_RULE_PIECES_PLAN = [[(2, 0, 1), (3, 0, 5)], [(3, 5, 6), (2, 1, 7)], [(2, 7, 8), (3, 6, 8)],
                          [(2, 8, 9), (3, 8, 12)]]


def check_chunk_scan_is_the_recurrence(chunk_scan, inputs: tuple[torch.Tensor, ...], chunk_size: int) -> None:
    """A delta rule's chunked scan (q, k, v, decay, beta, state, chunk_size -> outputs, final state) over
    ``inputs`` from their state: every output and the final state are delta_rule_step's, token by token."""
    from gpu_worker.layers.gated_delta_net import delta_rule_step

    q, k, v, decay, beta, state = inputs
    out, final = chunk_scan(q, k, v, decay, beta, state, chunk_size)
    s, outs = state[None].clone(), []
    for t in range(q.shape[0]):
        o, s = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], s)
        outs.append(o[0])
    torch.testing.assert_close(out, torch.stack(outs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, s[0], atol=1e-5, rtol=1e-5)


def check_random_delta_rule_mixer_carries_state(mixer: torch.nn.Module, width: int) -> None:
    """A delta-rule mixer (Gated DeltaNet, Kimi Delta Attention) with random parameters (matrices at
    0.3, vectors at 0.5) over DELTA_RULE_PIECES_PLAN: each piece's outputs are the whole run's."""
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.dim() > 1 else 0.5))
    check_mixer_carries_state(mixer, [torch.randn(12, width), torch.randn(9, width)], DELTA_RULE_PIECES_PLAN)


def check_mixer_carries_state(mixer: torch.nn.Module, seqs: list[torch.Tensor],
                              plan: list[list[tuple[int, int, int]]] = MIXER_PIECES_PLAN) -> None:
    """``seqs`` (two sequences of mixer inputs) run whole, one prefill each, then in pieces over the
    passes of ``plan`` in other rows (sequence 0 in row 3, sequence 1 in row 2), on fresh states of
    four rows: each piece's outputs are the whole run's at its positions. The whole run again, keeping
    its states part-way (the prefix cache's, after tokens 5 and 8 of sequence 0 and 7 of sequence 1,
    where both plans end a pass): the same outputs, with the states stored in fp32 or bf16 (a chunk's
    pieces carry the fp32 state from one to the next); each state kept is the one the pieces leave there."""
    from gpu_worker.layers.mamba import MambaState

    def fresh(rows: int, dtype: torch.dtype = torch.float32) -> MambaState:
        return MambaState.allocate(mixer.config, rows, dtype, torch.device("cpu"), dtype)

    kept_at = {0: {5: 0, 8: 1}, 1: {7: 2}}  # sequence -> {position: kept slot}
    mixer.state = fresh(4)
    whole = run_mixer_pass(mixer, [(0, seqs[0]), (1, seqs[1])])
    for dtype in (torch.bfloat16, torch.float32):
        mixer.state = fresh(4, dtype)
        mixer.state.kept = fresh(3, dtype)
        split = run_mixer_pass(mixer, [(0, seqs[0]), (1, seqs[1])], {i: sorted(kept_at[i].items()) for i in (0, 1)})
        for i in (0, 1):
            torch.testing.assert_close(split[i], whole[i], atol=1e-5, rtol=1e-5)
    kept = mixer.state.kept
    mixer.state = fresh(4)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for step in plan:
        step = sorted(step, key=lambda piece: piece[2] - piece[1] != 1)  # (decodes first, as the runner orders them)
        outs = run_mixer_pass(mixer, [(row, seqs[3 - row][a:b]) for row, a, b in step])
        for (row, _, end), out in zip(step, outs, strict=True):
            got[3 - row].append(out)
            if end in kept_at[3 - row]:
                slot = kept_at[3 - row].pop(end)
                torch.testing.assert_close(kept.conv[slot], mixer.state.conv[row], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(kept.ssm[slot], mixer.state.ssm[row], atol=1e-5, rtol=1e-5)
    assert kept_at == {0: {}, 1: {}}
    for i in (0, 1):
        torch.testing.assert_close(torch.cat(got[i]), whole[i], atol=1e-5, rtol=1e-5)
