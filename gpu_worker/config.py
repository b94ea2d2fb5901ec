"""The model facts the worker needs, read from an HF ``config.json`` (plus ``generation_config.json``).

Parsed from a plain dict rather than a ``transformers`` config object so that a converter (GGUF ->
HF-named tensors + HF config dict) can hand us its dict directly. Both the transformers 4.x layout
(``rope_theta`` + ``rope_scaling``) and the 5.x layout (``rope_parameters``) are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine_core.tokenizer_files import read_image_processor_config, read_video_processor_config
from engine_core.tokenizer_loader import load_tokenizer
from gpu_worker.attn_metadata import ChunkedWindow
from gpu_worker.gemma3n_config import (
    GEMMA3N_TEXT_DEFAULTS,
    Gemma3nConfig,
    gemma3n_config_from_dict,
    gemma3n_layer_types,
)
from gpu_worker.gemma4_config import (
    GEMMA4_ROPE_DEFAULTS,
    GEMMA4_TEXT_DEFAULTS,
    Gemma4Config,
    gemma4_config_from_dict,
    gemma4_layer_types,
)
from gpu_worker.layers.rotary import yarn_mscale
from gpu_worker.mamba_config import (
    GatedDeltaNetConfig,
    KimiDeltaAttentionConfig,
    LightningAttentionConfig,
    Mamba1Config,
    Mamba2Config,
    ShortConvConfig,
)
from gpu_worker.quantized_checkpoint import weight_quantization
from gpu_worker.vision_config import (
    GEMMA3_VL_ARCHITECTURES,
    IDEFICS3_ARCHITECTURES,
    INTERNVL_ARCHITECTURES,
    INTERNVL_TEXT_DECODERS,
    LLAVA_ARCHITECTURES,
    PIXTRAL_ARCHITECTURES,
    PIXTRAL_TOKEN_IDS,
    QWEN3_VL_ARCHITECTURES,
    QWEN3_VL_MOE_TEXT_DEFAULTS,
    QWEN_VL_ARCHITECTURES,
    Gemma3VisionConfig,
    Idefics3VisionConfig,
    InternVLVisionConfig,
    PixtralVisionConfig,
    Qwen3VisionConfig,
    QwenVisionConfig,
    VisionConfig,
    gemma3_vision_config_from_dict,
    idefics3_vision_config_from_dict,
    internvl_text_architecture,
    internvl_vision_config_from_dict,
    is_pixtral,
    mrope_section,
    native_vision_config,
    pixtral_vision_config_from_dict,
    qwen3_vision_config_from_dict,
    qwen_vision_config_from_dict,
    qwen_vl_text_config,
    text_architecture,
    vision_config_from_dict,
    with_full_text_config,
)

if TYPE_CHECKING:
    from gpu_worker.eagle_config import EagleHead

logger = logging.getLogger(__name__)

# Architectures whose decoder is the Llama block; the flags below are what tells them apart.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                           "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Ministral3ForCausalLM",
                           "GptOssForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
                           "Olmo3ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "OlmoeForCausalLM", "GraniteMoeForCausalLM", "MiniMaxM2ForCausalLM",
                           "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
                           "Mamba2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                           "BambaForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "FalconH1ForCausalLM",
                           "MambaForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM", "Zamba2ForCausalLM",
                           "CohereForCausalLM", "Cohere2ForCausalLM", "Glm4ForCausalLM", "SeedOssForCausalLM",
                           "HeliumForCausalLM", "Ernie4_5ForCausalLM", "ArceeForCausalLM", "Exaone4ForCausalLM",
                           "Ernie4_5_MoeForCausalLM", "Starcoder2ForCausalLM", "StableLmForCausalLM",
                           "Llama4ForCausalLM", "GlmForCausalLM", "NemotronForCausalLM", "OlmoForCausalLM",
                           "PhiForCausalLM", "GPTNeoXForCausalLM", "Dots1ForCausalLM", "GPT2LMHeadModel",
                           "GPTBigCodeForCausalLM", "GPTJForCausalLM", "OPTForCausalLM", "FalconForCausalLM",
                           "ApertusForCausalLM", "PhimoeForCausalLM", "BloomForCausalLM", "MptForCausalLM",
                           "MPTForCausalLM", "FlexOlmoForCausalLM", "MinistralForCausalLM", "CwmForCausalLM",
                           "PersimmonForCausalLM", "HunYuanDenseV1ForCausalLM", "DbrxForCausalLM",
                           "VaultGemmaForCausalLM", "HunYuanMoEV1ForCausalLM", "MiniCPM3ForCausalLM",
                           "MiniCPM5MoeForCausalLM", "MiniCPMForCausalLM",
                           "Glm4MoeLiteForCausalLM", "ExaoneMoeForCausalLM", "Gemma3nForCausalLM",
                           "InternLM2ForCausalLM", "InternLM3ForCausalLM", "ExaoneForCausalLM",
                           "Gemma4ForCausalLM", "Jais2ForCausalLM", "SolarOpenForCausalLM",
                           "YoutuForCausalLM", "AfmoeForCausalLM", "LagunaForCausalLM", "MellumForCausalLM",
                           "HYV3ForCausalLM", "MiMoV2FlashForCausalLM", "GraniteSWAForCausalLM",
                           "GraniteMoeSWAForCausalLM", "Cohere2MoeForCausalLM", "Lfm3ForCausalLM",
                           "GPTNeoForCausalLM", "CodeGenForCausalLM", "OlmoHybridForCausalLM",
                           "HyperCLOVAXForCausalLM", "AXK1ForCausalLM", "NanoChatForCausalLM",
                           "Kolibri1ForCausalLM", "FlintForCausalLM", "BeamForCausalLM", "BitNetForCausalLM",
                           "JetMoeForCausalLM", "LongcatFlashForCausalLM", "BioGptForCausalLM", "XGLMForCausalLM",
                           "ModernBertDecoderForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                           "KimiLinearForCausalLM", "MiniMaxForCausalLM", "MiniMaxText01ForCausalLM",
                           "MiniMaxM1ForCausalLM", "BailingHybridForCausalLM")
# MiniMax-Text-01 and MiniMax-M1: transformers' MiniMaxForCausalLM, and the released remote code's names.
MINIMAX_ARCHITECTURES = ("MiniMaxForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM")
# Cohere's Command models (Command-R / R+, Aya; Command-R7B, Command-A): attention beside the MLP.
COHERE_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM")
# Language models of Mamba (selective SSM, "Mamba-1") layers alone: state-spaces' Mamba, TII's Falcon-Mamba.
MAMBA1_LM_ARCHITECTURES = ("MambaForCausalLM", "FalconMambaForCausalLM")
# Vision-language checkpoints served on text alone, always (their vision side is not served here):
# Qwen3.5's, as its language model.
TEXT_ONLY_DECODER_OF = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM",
                        "Gemma3nForConditionalGeneration": "Gemma3nForCausalLM",
                        "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
                        "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
# Liquid AI's LFM2 (dense) and LFM2-MoE: gated short convolutions beside attention with q/k norms.
LFM2_ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM")
# Qwen3-Next's family: Gated DeltaNet layers beside gated attention (Qwen3.5's projections apart).
QWEN3_NEXT_FAMILY = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# IBM Granite's routed-expert models: Granite 3.x MoE, with a shared expert, and Granite 4.0 (its
# hybrid: Mamba-2 layers beside attention ones, or attention alone, routed experts or a dense MLP).
GRANITE_MOE_ARCHITECTURES = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM",
                             "GraniteMoeSWAForCausalLM")
# IBM's Granite with windowed layers, a sink per query head and a RoPE base per layer (GraniteSWA), and
# its MoE (GraniteMoeSWA: Granite MoE Shared's experts).
GRANITE_SWA_ARCHITECTURES = ("GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM")
# Multi-head latent attention (MLA): DeepSeek-V2 / V3 (and Kimi K2, DeepSeek-R1: V3's architecture), and
# DeepSeek-V3.2 (V3's layers whose attention reads the keys its indexer picks: DeepSeek Sparse Attention).
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
# DeepSeek Sparse Attention's architectures (DeepSeek-V3.2's, and GLM-5's: GlmMoeDsaForCausalLM), and
# transformers' defaults of their indexer: (index_n_heads, index_head_dim, index_topk).
_DSA_DEFAULTS = {"DeepseekV32ForCausalLM": (64, 128, 2048), "GlmMoeDsaForCausalLM": (32, 128, 2048)}
# MLA's models: DeepSeek's, MiniCPM3 (MLA with RoPE in halves, dense MLPs, muP-style scalings) and
# GLM-4.7-Flash (Glm4MoeLiteForCausalLM: DeepSeek-V3's attention with GLM-4.5's experts).
MLA_ARCHITECTURES = (*DEEPSEEK_ARCHITECTURES, "MiniCPM3ForCausalLM", "Glm4MoeLiteForCausalLM", "YoutuForCausalLM",
                     "AXK1ForCausalLM", "LongcatFlashForCausalLM", "GlmMoeDsaForCausalLM", "KimiLinearForCausalLM",
                     "BailingHybridForCausalLM")
# transformers' defaults of each: (qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, q_lora_rank,
# v_head_dim; None: hidden_size / num_attention_heads).
_MLA_DEFAULTS = {"DeepseekV2ForCausalLM": (128, 64, 512, 1536, 128), "DeepseekV3ForCausalLM": (128, 64, 512, 1536, 128),
                 "DeepseekV32ForCausalLM": (128, 64, 512, 1536, 128),
                 "MiniCPM3ForCausalLM": (64, 32, 256, 768, None), "Glm4MoeLiteForCausalLM": (192, 64, 512, 768, 256),
                 "YoutuForCausalLM": (128, 64, 512, 1536, 128), "AXK1ForCausalLM": (128, 64, 512, 1536, 128),
                 "LongcatFlashForCausalLM": (128, 64, 512, 1536, 128),
                 "GlmMoeDsaForCausalLM": (192, 64, 512, 2048, 256),
                 "KimiLinearForCausalLM": (128, 64, 512, None, 128),
                 "BailingHybridForCausalLM": (128, 64, 512, None, 128)}
# transformers' GptOssConfig defaults for the keys a GPT-OSS config may leave out (gpt-oss-20b's and
# -120b's configs state them, but for swiglu_alpha; the experts' are _moe_from_dict's).
GPT_OSS_DEFAULTS = {"head_dim": 64, "sliding_window": 128, "attention_bias": True, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 131072, "rope_theta": 150000.0}
# transformers' Glm4MoeConfig defaults for the keys a GLM-4.5 config may leave out (the released
# configs state them; the experts' are _moe_from_dict's, the partial rotary's from_dict's).
GLM4_MOE_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "intermediate_size": 10944}
# GLM-4's dense models: GLM-4-9B (GlmForCausalLM) and the 0414 releases (Glm4ForCausalLM, norms after
# each sublayer too).
GLM_DENSE_ARCHITECTURES = ("GlmForCausalLM", "Glm4ForCausalLM")
_GLM_DEFAULTS = {"rms_norm_eps": 1.5625e-07, "max_position_embeddings": 131072, "intermediate_size": 13696,
                 "head_dim": 128, "num_key_value_heads": 2, "attention_bias": True,
                 "eos_token_id": [151329, 151336, 151338]}
# Tencent's Hunyuan models, dense and mixture-of-experts: transformers' HunYuanDenseV1Config's and
# HunYuanMoEV1Config's defaults (the same).
HUNYUAN_ARCHITECTURES = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")
_HUNYUAN_DEFAULTS = {"vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}
# transformers' MiniCPM3Config defaults for keys a config may leave out (a null in a config is kept:
# q_lora_rank's means a plain query projection, scale_depth's and dim_model_base's no scaling).
MINICPM3_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "tie_word_embeddings": True,
                     "intermediate_size": 6400}
# transformers' Glm4MoeLiteConfig defaults (GLM-4.7-Flash's), a null in a config kept (q_lora_rank's:
# a plain query projection); its experts' and latent attention's are _moe_from_dict's and _mla_fields'.
GLM4_MOE_LITE_DEFAULTS = {"vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
                          "num_hidden_layers": 47, "num_attention_heads": 20, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 202752}
# LG's EXAONE: 4.0 (dense, norms after each sublayer) and K-EXAONE (ExaoneMoeForCausalLM: norms before
# each, DeepSeek-V3's experts), the same attention (per-head q/k norms, windowed layers with RoPE,
# full ones without positions where there are windowed ones).
EXAONE_ARCHITECTURES = ("Exaone4ForCausalLM", "ExaoneMoeForCausalLM")
# transformers' MiniCPM5MoeConfig defaults for keys a config leaves out (a null kept: a null head_dim
# is hidden_size / heads, a null num_key_value_heads as many as the heads, as transformers reads them).
MINICPM5_MOE_DEFAULTS = {"vocab_size": 130560, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 28,
                         "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                         "max_position_embeddings": 524288, "rms_norm_eps": 1e-6}
# transformers' YoutuConfig defaults (Youtu-LLM-2B's; a null q_lora_rank kept: a plain query projection).
YOUTU_DEFAULTS = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 32,
                  "num_attention_heads": 16, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": True, "eos_token_id": 128001}
# transformers' AXK1Config defaults (A.X-K1's; a null q_lora_rank kept, to be refused).
AXK1_DEFAULTS = {"vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                 "num_attention_heads": 64, "num_key_value_heads": 64, "max_position_embeddings": 32768,
                 "rms_norm_eps": 1e-6, "bos_token_id": 163691, "eos_token_id": 163691}
# transformers' GlmMoeDsaConfig defaults (GLM-5's; its experts' are _moe_from_dict's, its latent
# attention's _mla_fields', its indexer's _dsa_fields').
GLM_MOE_DSA_DEFAULTS = {"vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "num_hidden_layers": 78,
                        "num_attention_heads": 64, "num_key_value_heads": 64, "max_position_embeddings": 202752,
                        "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1}
# transformers' NanoChatConfig defaults (a null kept: a null final_logit_softcapping is no cap).
NANOCHAT_DEFAULTS = {"vocab_size": 50304, "hidden_size": 768, "intermediate_size": 8192, "num_hidden_layers": 12,
                     "num_attention_heads": 6, "max_position_embeddings": 2048, "hidden_act": "relu2",
                     "rms_norm_eps": 1e-6, "final_logit_softcapping": 15.0, "bos_token_id": 0, "eos_token_id": 1}
# transformers' Kolibri1Config and FlintConfig defaults (a null kept: a null sliding_window is no window,
# refused where layer_types has windowed layers); their experts' are _moe_from_dict's.
KOLIBRI1_DEFAULTS = {"vocab_size": 128000, "hidden_size": 2560, "intermediate_size": 0, "num_hidden_layers": 50,
                     "num_attention_heads": 48, "num_key_value_heads": 4, "head_dim": 128,
                     "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "sliding_window": 513}
FLINT_DEFAULTS = {"vocab_size": 150144, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 49,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                  "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "sliding_window": 513}
# transformers' BeamConfig defaults (a null kept: a null final_logit_softcapping is no cap).
BEAM_DEFAULTS = {"vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 20480, "num_hidden_layers": 52,
                 "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-6, "sliding_window": 512, "final_logit_softcapping": 30.0}
# transformers' AfmoeConfig defaults (Trinity-Mini's; a null kept: a null sliding_window is no window,
# a null head_dim hidden_size / heads); its experts' are _moe_from_dict's.
AFMOE_DEFAULTS = {"vocab_size": 200192, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 32,
                  "num_attention_heads": 16, "head_dim": 128, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
                  "sliding_window": 1024, "global_attn_every_n_layers": 4}
# poolside's Laguna and JetBrains' Mellum: per-layer-type RoPE (its own base, and for Laguna its own
# share of each head, for the full and the windowed layers), per-layer MLP kinds (mlp_layer_types).
LAGUNA_ARCHITECTURES = ("LagunaForCausalLM", "MellumForCausalLM")
# transformers' LagunaConfig and MellumConfig defaults (a null kept: a null sliding_window is no window).
LAGUNA_DEFAULTS = {"vocab_size": 100352, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40,
                   "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 512}
MELLUM_DEFAULTS = {"vocab_size": 98304, "hidden_size": 2304, "intermediate_size": 7168, "num_hidden_layers": 28,
                   "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                   "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 1024}
# transformers' MiMoV2FlashConfig defaults (MiMo-V2-Flash's; a null kept), its RoPE's per layer kind.
MIMO_V2_FLASH_DEFAULTS = {"vocab_size": 152576, "hidden_size": 4096, "intermediate_size": 16384,
                          "num_hidden_layers": 48, "num_attention_heads": 64, "num_key_value_heads": 4,
                          "head_dim": 192, "v_head_dim": 128, "max_position_embeddings": 131072,
                          "rms_norm_eps": 1e-5, "sliding_window": 129, "attention_value_scale": 0.707}
# transformers' GraniteSWAConfig and GraniteMoeSWAConfig defaults (a null kept: a null sliding_window
# is no window, a null num_key_value_heads as many as the heads).
GRANITE_SWA_DEFAULTS = {
    "GraniteSWAForCausalLM": {"vocab_size": 100352, "hidden_size": 2560, "intermediate_size": 8192,
                              "num_hidden_layers": 24, "num_attention_heads": 20, "num_key_value_heads": 4,
                              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                              "sliding_window": 128, "eos_token_id": 100257},
    "GraniteMoeSWAForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                                 "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                                 "rms_norm_eps": 1e-6, "sliding_window": 128, "eos_token_id": 2}}
# The families whose defaults fill only the keys a config leaves out (a null it states is read as
# transformers reads it).
NULL_KEEPING_DEFAULTS = {"MiniCPM3ForCausalLM": MINICPM3_DEFAULTS, "Glm4MoeLiteForCausalLM": GLM4_MOE_LITE_DEFAULTS,
                         "MiniCPM5MoeForCausalLM": MINICPM5_MOE_DEFAULTS, "YoutuForCausalLM": YOUTU_DEFAULTS,
                         "AfmoeForCausalLM": AFMOE_DEFAULTS, "LagunaForCausalLM": LAGUNA_DEFAULTS,
                         "MellumForCausalLM": MELLUM_DEFAULTS, "MiMoV2FlashForCausalLM": MIMO_V2_FLASH_DEFAULTS,
                         "AXK1ForCausalLM": AXK1_DEFAULTS, "NanoChatForCausalLM": NANOCHAT_DEFAULTS,
                         "Kolibri1ForCausalLM": KOLIBRI1_DEFAULTS, "FlintForCausalLM": FLINT_DEFAULTS,
                         "BeamForCausalLM": BEAM_DEFAULTS, "GlmMoeDsaForCausalLM": GLM_MOE_DSA_DEFAULTS,
                         **GRANITE_SWA_DEFAULTS}
# Another spelling of an architecture's name in released configs, read as transformers reads it.
ARCHITECTURE_SPELLINGS = {"MiniCPM5MoEForCausalLM": "MiniCPM5MoeForCausalLM",
                          "ExaoneMoEForCausalLM": "ExaoneMoeForCausalLM",
                          # (jetmoe-8b's remote code's name; transformers reads it by its model_type)
                          "JetMoEForCausalLM": "JetMoeForCausalLM",
                          # (Ling 3's released name; transformers reads it by its model_type, bailing_hybrid)
                          "BailingMoeV3ForCausalLM": "BailingHybridForCausalLM"}
# transformers' defaults for the keys a config of these Llama-like families may leave out.
LLAMA_LIKE_DEFAULTS = {
    "GlmForCausalLM": _GLM_DEFAULTS,
    "Glm4ForCausalLM": _GLM_DEFAULTS,
    "SeedOssForCausalLM": {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 524288,
                           "num_key_value_heads": 8, "attention_bias": True},
    "HeliumForCausalLM": {"head_dim": 128, "rms_norm_eps": 1e-8, "max_position_embeddings": 4096},
    "Ernie4_5ForCausalLM": {"head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                            "num_key_value_heads": 2, "tie_word_embeddings": True},
    "Ernie4_5_MoeForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "num_key_value_heads": 4,
                                "tie_word_embeddings": True, "intermediate_size": 12288},
    "ArceeForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "hidden_act": "relu2"},
    "Exaone4ForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    "ExaoneMoeForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "vocab_size": 102400,
                             "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
                             "num_attention_heads": 32},
    "Starcoder2ForCausalLM": {"max_position_embeddings": 4096, "hidden_act": "gelu_pytorch_tanh",
                              "tie_word_embeddings": True, "use_bias": True, "num_key_value_heads": 2},
    "StableLmForCausalLM": {"max_position_embeddings": 4096, "partial_rotary_factor": 0.25},
    "NemotronForCausalLM": {"max_position_embeddings": 4096, "hidden_act": "relu2", "partial_rotary_factor": 0.5},
    "SolarOpenForCausalLM": {"vocab_size": 196608, "hidden_size": 4096, "num_hidden_layers": 48,
                             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5},
    "HYV3ForCausalLM": {"vocab_size": 120832, "hidden_size": 4096, "intermediate_size": 13312, "num_hidden_layers": 80,
                        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5},
    "JetMoeForCausalLM": {"vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 12,
                          "num_key_value_heads": 16, "kv_channels": 128, "max_position_embeddings": 4096,
                          "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2},
    "BitNetForCausalLM": {"vocab_size": 128256, "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 30,
                          "num_attention_heads": 20, "num_key_value_heads": 5, "max_position_embeddings": 2048,
                          "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001},
    "HyperCLOVAXForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                               "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2},
    "Jais2ForCausalLM": {"vocab_size": 150272, "hidden_size": 3328, "intermediate_size": 26624, "num_hidden_layers": 32,
                         "num_attention_heads": 26, "max_position_embeddings": 8192, "hidden_act": "relu2",
                         "attention_bias": True, "mlp_bias": True, "eos_token_id": 150024},
    "OlmoForCausalLM": {"max_position_embeddings": 2048},
    "PersimmonForCausalLM": {"vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384,
                             "num_hidden_layers": 36, "num_attention_heads": 64, "max_position_embeddings": 16384,
                             "hidden_act": "relu2", "partial_rotary_factor": 0.5, "qk_layernorm": True},
    "HunYuanDenseV1ForCausalLM": _HUNYUAN_DEFAULTS,
    "HunYuanMoEV1ForCausalLM": _HUNYUAN_DEFAULTS,
    "MinistralForCausalLM": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "CwmForCausalLM": {"vocab_size": 128256, "hidden_size": 6144, "intermediate_size": 21504,
                       "num_hidden_layers": 64, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "sliding_window": 8192,
                       "eos_token_id": [128001, 128008, 128009]},
    "FlexOlmoForCausalLM": {"vocab_size": 100352, "hidden_size": 4096, "intermediate_size": 11008,
                            "num_hidden_layers": 32, "num_attention_heads": 32, "rms_norm_eps": 1e-6,
                            "max_position_embeddings": 4096, "eos_token_id": 100257, "pad_token_id": 100277},
    "ApertusForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 65536, "hidden_act": "xielu"},
    "Dots1ForCausalLM": {"num_key_value_heads": 32},
    "PhimoeForCausalLM": {"vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400, "num_hidden_layers": 32,
                          "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 131072},
    "PhiForCausalLM": {"max_position_embeddings": 2048, "hidden_act": "gelu_new", "partial_rotary_factor": 0.5},
    "GPTNeoXForCausalLM": {"max_position_embeddings": 2048, "hidden_act": "gelu", "attention_bias": True,
                           "use_parallel_residual": True},
    "Llama4ForCausalLM": {"vocab_size": 202048, "hidden_size": 5120, "num_hidden_layers": 48,
                          "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 131072, "rope_theta": 500000.0},
}

# transformers' MiniMaxM2Config defaults for the keys a MiniMax-M2 config may leave out (the experts'
# are _moe_from_dict's).
MINIMAX_M2_DEFAULTS = {"head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 196608,
                       "intermediate_size": 1536, "rope_theta": 5000000.0, "num_key_value_heads": 8}
# transformers' CwmConfig RoPE, for a config that states none.
CWM_ROPE_DEFAULTS = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0, "high_freq_factor": 4.0,
                     "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
APERTUS_ROPE_DEFAULTS = {"rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0,
                         "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
GPT_OSS_ROPE_DEFAULTS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}
# Those whose heads may rotate only their first values (partial_rotary_factor).
PARTIAL_ROTARY_ARCHITECTURES = ("LagunaForCausalLM", "MiMoV2FlashForCausalLM", "Phi3ForCausalLM", "Glm4MoeForCausalLM",
                                "MiniMaxM2ForCausalLM", *MINIMAX_ARCHITECTURES,
                                "Qwen3NextForCausalLM",
                                "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "BambaForCausalLM", "Glm4ForCausalLM",
                                "StableLmForCausalLM", "GlmForCausalLM", "NemotronForCausalLM", "PhiForCausalLM",
                                "GPTNeoXForCausalLM", "GPTJForCausalLM", "PersimmonForCausalLM", "CodeGenForCausalLM")
# The GPT family's configs (GPT-2's key names: n_embd, n_layer, ...): GPT-2, GPTBigCode, GPT-J.
GPT_ARCHITECTURES = ("GPT2LMHeadModel", "GPTBigCodeForCausalLM", "GPTJForCausalLM", "CodeGenForCausalLM")
# Those of learned position embeddings instead of RoPE.
LEARNED_POSITION_ARCHITECTURES = ("GPT2LMHeadModel", "GPTBigCodeForCausalLM", "OPTForCausalLM", "GPTNeoForCausalLM")
# MosaicML's MPT, under transformers' name and its own checkpoints' (MosaicML's code).
MPT_ARCHITECTURES = ("MptForCausalLM", "MPTForCausalLM")
# Families of LayerNorms (with their epsilon under layer_norm_eps, norm_epsilon or norm_eps).
LAYER_NORM_ARCHITECTURES = ("CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM", "StableLmForCausalLM",
                            "NemotronForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM", "PersimmonForCausalLM",
                            "Jais2ForCausalLM")
# Those whose MLP is ungated (one projection in, one out), and the activations served there (the
# tanh forms of gelu under three names: gelu_new, gelu_fast, gelu_pytorch_tanh).
UNGATED_MLP_ARCHITECTURES = ("Starcoder2ForCausalLM", "NemotronForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM",
                             *GPT_ARCHITECTURES, "OPTForCausalLM", "FalconForCausalLM", "ApertusForCausalLM",
                             "BloomForCausalLM", *MPT_ARCHITECTURES, "PersimmonForCausalLM", "Jais2ForCausalLM",
                             "GPTNeoForCausalLM", "NanoChatForCausalLM", "BioGptForCausalLM", "XGLMForCausalLM")
UNGATED_ACTIVATIONS = ("relu", "relu2", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "xielu")
# transformers' Qwen3NextConfig defaults for the keys a Qwen3-Next config may leave out.
QWEN3_NEXT_DEFAULTS = {"head_dim": 256, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
                       "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                       "linear_num_value_heads": 32}
GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "VaultGemmaForCausalLM",
                       "Gemma3nForCausalLM", "Gemma4ForCausalLM")
# Gemma 2 / 3 / 3n / 4: Gemma 2's attention (windowed and full layers; their own attention scale).
GEMMA_WINDOWED_ARCHITECTURES = ("Gemma2ForCausalLM", "VaultGemmaForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM",
                                "Gemma4ForCausalLM")
# Gemma 2's configs: Gemma 2's and VaultGemma's (Gemma 2 without the norms after each sublayer).
GEMMA2_ARCHITECTURES = ("Gemma2ForCausalLM", "VaultGemmaForCausalLM")
OLMO_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM")
# Vision-language checkpoints whose language model we serve on text (ModelConfig reads their
# text_config; the decoder's loader skips the vision tower).
TEXT_DECODER_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Embedding checkpoints saved from transformers' bare decoder (no LM head; tensors named without the
# "model." prefix): e5-mistral (MistralModel), bge-multilingual-gemma2 (Gemma2Model), gte-Qwen2 and
# Qwen3-Embedding exports. They are served as embedding models only.
EMBEDDING_DECODER_OF = {
    "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM", "Phi3Model": "Phi3ForCausalLM", "GemmaModel": "GemmaForCausalLM",
    "Gemma2Model": "Gemma2ForCausalLM", "Gemma3TextModel": "Gemma3ForCausalLM",
    # EuroBERT: the Llama block attending both ways (an encoder), for embeddings.
    "EuroBertModel": "LlamaForCausalLM"}
# Decoder-block checkpoints that attend both ways whatever their config says (run as encoders).
BIDIRECTIONAL_DECODERS = ("EuroBertModel",)
# Sequence classifiers (cross-encoder rerankers, reward models, classifiers): the decoder, and a
# ``score`` head over the last token's final hidden state. Served without an LM head.
CLASSIFIER_DECODER_OF = {
    "LlamaForSequenceClassification": "LlamaForCausalLM", "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM", "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "GemmaForSequenceClassification": "GemmaForCausalLM", "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Phi3ForSequenceClassification": "Phi3ForCausalLM"}
# Token classifiers on a decoder (transformers' *ForTokenClassification): a ``score`` head (with a
# bias) over every prompt token's final hidden state.
TOKEN_CLASSIFIER_DECODER_OF = {
    "LlamaForTokenClassification": "LlamaForCausalLM", "MistralForTokenClassification": "MistralForCausalLM",
    "Qwen2ForTokenClassification": "Qwen2ForCausalLM", "Qwen3ForTokenClassification": "Qwen3ForCausalLM",
    "GemmaForTokenClassification": "GemmaForCausalLM", "Gemma2ForTokenClassification": "Gemma2ForCausalLM",
    "Phi3ForTokenClassification": "Phi3ForCausalLM"}
# Reward models (Qwen2.5-Math-RM's custom code, and Qwen2.5-Math-PRM's): the decoder and an MLP
# ``score`` head (Linear, ReLU, Linear, with biases) over every prompt token. The outcome reward
# model scores each token with one reward (ALL pooling); the process reward model gives two
# classes' probabilities at each step separator (STEP pooling at its "<extra_0>" token).
REWARD_DECODER_OF = {"Qwen2ForRewardModel": "Qwen2ForCausalLM", "Qwen2ForProcessRewardModel": "Qwen2ForCausalLM"}
# The reward models' (number of outputs, default pooling, step separator token). Their outputs pass
# through the classifier activation as vLLM's token_classify applies it: a sigmoid over one output
# (the outcome reward model's; a request's use_activation false gives the raw reward), a softmax
# over two.
_REWARD_HEADS = {"Qwen2ForRewardModel": (1, "ALL", None), "Qwen2ForProcessRewardModel": (2, "STEP", "<extra_0>")}
# Encoder-only checkpoints (BERT, RoBERTa, XLM-RoBERTa): bidirectional attention over the whole
# prompt, learned absolute positions, post-norm layers. The bare encoders (all-MiniLM, bge, e5, gte,
# bge-m3, multilingual-e5) are served for embeddings; their sequence classifiers (ms-marco
# cross-encoders, bge-reranker) as classifiers, over the [CLS] token. Value: our model class.
ENCODER_ARCHITECTURES = {
    "BertModel": "BertModel", "RobertaModel": "RobertaModel", "XLMRobertaModel": "RobertaModel",
    "BertForSequenceClassification": "BertModel", "RobertaForSequenceClassification": "RobertaModel",
    "XLMRobertaForSequenceClassification": "RobertaModel",
    # ModernBERT (gte-modernbert, modernbert-embed, gte-reranker-modernbert): RoPE, pre-norm layers,
    # GeGLU, and a bidirectional sliding window in two layers of three.
    "ModernBertModel": "ModernBertModel", "ModernBertForSequenceClassification": "ModernBertModel",
    # Rotary-position encoders with gated MLPs: NomicBERT (nomic-embed-text-v1 / v1.5) and GTE
    # (gte-multilingual-base; "NewModel" is the name its own code gives it).
    "NomicBertModel": "NomicBertModel", "GteModel": "GteModel", "NewModel": "GteModel",
    # Their classifiers (gte-multilingual-reranker-base: a cross-encoder over its first token).
    "NomicBertForSequenceClassification": "NomicBertModel", "GteForSequenceClassification": "GteModel",
    "NewForSequenceClassification": "GteModel", "NomicBertForTokenClassification": "NomicBertModel",
    "GteForTokenClassification": "GteModel", "NewForTokenClassification": "GteModel",
    # Jina embeddings v3 (transformers' port; its own code's checkpoint is an XLMRobertaModel whose
    # position_embedding_type is "rotary"): rotary positions, post-norm layers, a plain gelu MLP.
    "JinaEmbeddingsV3Model": "JinaEmbeddingsV3Model",
    # ColBERT (colbertv2.0, answerai-colbert-small): BERT and a projection of every token (``linear``)
    # to its late-interaction vectors, scored by MaxSim (vLLM's HF_ColBERT).
    "HF_ColBERT": "BertModel",
    # ColBERT on ModernBERT (GTE-ModernColBERT, PyLate checkpoints: the projection is their
    # sentence-transformers Dense module), asked for through --hf-overrides, as vLLM's.
    "ColBERTModernBertModel": "ModernBertModel",
    # BGE-M3 with its sparse and ColBERT heads (vLLM's BgeM3EmbeddingModel, asked for through
    # --hf-overrides '{"architectures": ["BgeM3EmbeddingModel"]}').
    "BgeM3EmbeddingModel": "RobertaModel",
    # Token classifiers (NER and other taggers): class logits for every prompt token.
    "BertForTokenClassification": "BertModel", "RobertaForTokenClassification": "RobertaModel",
    "XLMRobertaForTokenClassification": "RobertaModel", "ModernBertForTokenClassification": "ModernBertModel"}
# transformers' Gemma3TextConfig defaults: Gemma 3 4B+'s text_config lists only what differs from them.
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "eos_token_id": 1}
# transformers' Ministral3Config defaults for its rope parameters (a config.json that gives none).
MINISTRAL3_ROPE_DEFAULTS: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16_384,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")
# The MLP activations we compute (transformers' ACT2FN names): SwiGLU's silu, GeGLU's tanh-approximated
# or exact gelu.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# An encoder's feed-forward activation (transformers' names): exact gelu (BERT's), or its tanh form.
ENCODER_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[key]


# vLLM's _FLOAT16_NOT_SUPPORTED_MODELS (gemma2, gemma3, gemma3_text), and VaultGemma (Gemma 2's layers:
# our addition): their activations overflow float16's range, so "auto" never picks it for them and
# --dtype float16 is refused.
FLOAT16_UNSUPPORTED_ARCHITECTURES = GEMMA_WINDOWED_ARCHITECTURES


def check_dtype_supported(dtype: torch.dtype, config: ModelConfig) -> None:
    """Refuse a dtype the model cannot run in (vLLM's _check_valid_dtype)."""
    if dtype == torch.float16 and config.architecture in FLOAT16_UNSUPPORTED_ARCHITECTURES:
        model_type = config.raw.get("model_type") or config.architecture
        raise ValueError(f"The model type {model_type!r} does not support float16. Reason: Numerical instability. "
                         "Please use bfloat16 or float32 instead.")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_dict(arch: str, cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict with a ``rope_type`` key, or None for plain RoPE): the RoPE of the
    full-attention layers, where a config gives one per layer type (Gemma 3)."""
    default_theta = {"Gemma3ForCausalLM": 1_000_000.0, "Gemma3nForCausalLM": 1_000_000.0,
                     "SmolLM3ForCausalLM": 2_000_000.0,
                     "Olmo3ForCausalLM": 500_000.0, "CohereForCausalLM": 500_000.0, "HeliumForCausalLM": 100_000.0,
                     "Ernie4_5ForCausalLM": 500_000.0, "Ernie4_5_MoeForCausalLM": 500_000.0,
                     "FlexOlmoForCausalLM": 500_000.0, "CwmForCausalLM": 1_000_000.0,
                     "MiniCPM5MoeForCausalLM": 5_000_000.0, "SolarOpenForCausalLM": 1_000_000.0,
                     "HYV3ForCausalLM": 11_158_840.0, "BitNetForCausalLM": 500_000.0,
                     "LongcatFlashForCausalLM": 10_000_000.0}.get(arch, 10000.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", default_theta))
        scaling = dict(cfg.get("rope_scaling") or {})
    # Old checkpoints spell the key "type".
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    # Phi-3's early configs call LongRoPE "su" (or "yarn"), as transformers reads them.
    if rope_type == "su" or (rope_type == "yarn" and arch == "Phi3ForCausalLM"):
        rope_type = "longrope"
    if arch in HUNYUAN_ARCHITECTURES and rope_type == "dynamic" and scaling.get("alpha"):
        # HunYuan's NTK by a fixed alpha: a larger base, base * alpha ** (d / (d - 2)), whatever the length.
        dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        theta, rope_type, scaling = theta * float(scaling["alpha"]) ** (dim / (dim - 2)), "default", {}
    scaling["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "longrope" and ("short_mscale" in scaling or "long_mscale" in scaling):
        # Phi-3.5-MoE's: cos and sin scaled by short_mscale or long_mscale as the context passes the
        # pretrained length; served where both are one value (as released), as the attention factor.
        mscales = {float(scaling.pop(key)) for key in ("short_mscale", "long_mscale") if key in scaling}
        if len(mscales) != 1:
            raise ValueError(f"longrope with short_mscale and long_mscale apart ({sorted(mscales)}) is not served")
        scaling["attention_factor"] = mscales.pop()
    if rope_type == "longrope":
        # Phi-3's 128k models: the pretrained length (above which the long factors apply) sits at
        # the config's top level (read first, as transformers does; Phi-3's default is 4096); the
        # default attention factor uses max_position_embeddings over it.
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        if not original and arch == "Phi3ForCausalLM":
            original = 4096
        if not original:
            raise ValueError("a longrope config needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(original)
        scaling.setdefault("max_position_embeddings", int(cfg.get("max_position_embeddings", 2048)))
        for key in ("short_factor", "long_factor"):
            if not isinstance(scaling.get(key), list):
                raise ValueError(f"a longrope config needs {key} (a list of per-frequency factors)")
    if rope_type == "yarn":
        scaling.update(_yarn_lengths(cfg, scaling))
    return theta, (None if rope_type == "default" else scaling)


def _yarn_lengths(cfg: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """YaRN's pretrained length (top level first, as transformers reads it) and factor (when unset:
    max_position_embeddings over that length, transformers' rule). The length is required (YaRN
    checkpoints state it) rather than guessed from max_position_embeddings."""
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_type 'yarn' needs original_max_position_embeddings (the pretrained length it "
                         "extends) in its rope scaling")
    factor = scaling.get("factor") or int(cfg.get("max_position_embeddings", 2048)) / int(original)
    if float(factor) < 1.0:
        raise ValueError(f"rope_type 'yarn' needs a factor >= 1, got {factor}")
    return {"original_max_position_embeddings": int(original), "factor": float(factor)}


def _two_way(cfg: dict[str, Any], tokens: list[str]) -> bool:
    """Whether classifier_from_token builds one output from two tokens (vLLM's from_2_way_softmax,
    the default for two, and what is_original_qwen3_reranker asks) or a class per token
    (no_post_processing)."""
    method = cfg.get("method") or ("from_2_way_softmax" if len(tokens) == 2 else "no_post_processing")
    if method not in ("from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"classifier_from_token method must be from_2_way_softmax or no_post_processing, "
                         f"got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"from_2_way_softmax needs two tokens (false, true), got {tokens!r}")
    return method == "from_2_way_softmax"


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A sequence classifier's class names, by index: its id2label, else num_labels unnamed ones
    (transformers' LABEL_i), 2 when neither is given. A causal LM served as a classifier (vLLM's
    ``classifier_from_token``, through --hf-overrides) has a class per token named, or one output
    for two tokens: the second's logit minus the first's (Qwen3-Reranker's "yes" over "no")."""
    tokens = cfg.get("classifier_from_token")
    if tokens is not None:
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"classifier_from_token must be a non-empty list of tokens, got {tokens!r}")
        return ("LABEL_0",) if _two_way(cfg, tokens) else tuple(tokens)
    id2label = cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        by_index = {int(i): str(name) for i, name in id2label.items()}
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"id2label must name the classes 0..n-1, got {sorted(by_index)}")
        return tuple(by_index[i] for i in range(len(by_index)))
    return tuple(f"LABEL_{i}" for i in range(int(cfg.get("num_labels") or 2)))


def _token_ids(model_dir: Path, tokens: list[str]) -> tuple[int, ...]:
    """The ids of ``tokens`` in the model's vocabulary (each must be one token of it)."""
    tokenizer = load_tokenizer(model_dir)
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's vocabulary")
        ids.append(int(token_id))
    return tuple(ids)


def with_overrides(cfg: dict[str, Any], overrides: dict[str, Any], nested: bool = False) -> dict[str, Any]:
    """``cfg`` with ``overrides`` set over it, as vLLM applies --hf-overrides: a sub-config (a
    ``*_config`` key holding an object, such as a vision-language model's ``text_config``; not
    ``quantization_config``, a plain dict there) takes the override's keys over its own, and inside
    it an object value too (``text_config.rope_scaling``); any other key is replaced whole."""
    merged = dict(cfg)
    for key, value in overrides.items():
        sub_config = key.endswith("_config") and key != "quantization_config"
        if (nested or sub_config) and isinstance(value, dict) and isinstance(cfg.get(key), dict):
            merged[key] = with_overrides(cfg[key], value, nested=True)
        else:
            merged[key] = value
    return merged


def _colbert_width(cfg: dict[str, Any]) -> Any:
    """A ColBERT config's vectors' width, where it gives one (colbert_dim, dim or projection_dim)."""
    return cfg.get("colbert_dim") or cfg.get("dim") or cfg.get("projection_dim")


# Where a vision-language checkpoint keeps its language model's head (transformers 4's and 5's layouts).
VISION_LANGUAGE_HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
VISION_LANGUAGE_EMBEDDINGS = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
                              "model.language_model.embed_tokens.weight")


def _stores_its_own_head(model_dir: Path) -> bool:
    """Whether a vision-language checkpoint stores a head that is not its embedding (their first rows
    compared, as transformers compares them before it ties); False with no weights to read."""
    from safetensors import safe_open

    from gpu_worker.weights import safetensors_files

    try:
        files = safetensors_files(model_dir)
    except FileNotFoundError:
        return False
    found: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for kind, names in (("head", VISION_LANGUAGE_HEADS), ("embedding", VISION_LANGUAGE_EMBEDDINGS)):
                name = next((n for n in names if n in f.keys()), None)  # noqa: SIM118 - not iterable
                if name is not None and kind not in found:
                    found[kind] = f.get_slice(name)[:8]
    if "head" not in found:
        return False
    return "embedding" not in found or not torch.equal(found["head"], found["embedding"])


def _checkpoint_rows(model_dir: Path, names: tuple[str, ...]) -> int | None:
    """The rows of the first of ``names`` in the checkpoint's safetensors (None where none is)."""
    from safetensors import safe_open

    from gpu_worker.weights import safetensors_files

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                if name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    return int(f.get_slice(name).get_shape()[0])
    return None


def _token_id_if_any(model_dir: Path, token: str) -> int | None:
    """The id of ``token`` in the model's vocabulary, None where it is not one token of it."""
    return _token_ids_if_any(model_dir, [token]).get(token)


def _token_ids_if_any(model_dir: Path, tokens: list[str]) -> dict[str, int]:
    """The ids of those of ``tokens`` that are one token of the model's vocabulary."""
    tokenizer = load_tokenizer(model_dir)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tokens}
    return {token: int(i) for token, i in ids.items() if i is not None and i != tokenizer.unk_token_id}


def _decoder_head(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A decoder classifier's ModelConfig fields: its labels, head, default pooling (and, for a
    reward model, its activation and step separator)."""
    if arch in CLASSIFIER_DECODER_OF:
        return {"labels": _labels(cfg)}
    if arch in TOKEN_CLASSIFIER_DECODER_OF:
        return {"labels": _labels(cfg), "token_classifier": True, "default_pooling_type": "ALL",
                "score_head": "linear_bias" if cfg.get("token_classification_bias", True) else "linear"}
    num_labels, pooling, step_tag = _REWARD_HEADS[arch]
    # (Its custom code fixes the number of outputs, whatever num_labels / id2label say.)
    id2label = cfg.get("id2label")
    named = isinstance(id2label, dict) and len(id2label) == num_labels
    return {"labels": _labels({"id2label": id2label} if named else {"num_labels": num_labels}),
            "token_classifier": True, "default_pooling_type": pooling, "score_head": "relu_mlp",
            "step_tag_token": step_tag}


def _classifier_activation(problem_type: str | None, num_labels: int) -> str:
    """/classify's: by problem_type, as transformers' loss reads it (a softmax over one logit would
    always be 1: one output takes a sigmoid, as vLLM's classify pooler does)."""
    if problem_type == "regression":
        return "none"
    if problem_type not in (None, "single_label_classification", "multi_label_classification"):
        raise ValueError(f"problem_type must be regression, single_label_classification or "
                         f"multi_label_classification, got {problem_type!r}")
    return "softmax" if problem_type != "multi_label_classification" and num_labels >= 2 else "sigmoid"


# sentence-transformers CrossEncoder activations (torch.nn class names) -> ours (router.classification).
_CROSS_ENCODER_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "none", "Tanh": "tanh", "ReLU": "relu"}


def _cross_encoder_activation(cfg: dict[str, Any]) -> str:
    """/score's for a cross-encoder, as vLLM picks it: the sentence-transformers activation the
    config names (Sigmoid, Identity, Tanh or ReLU), a sigmoid otherwise."""
    named = ((cfg.get("sentence_transformers") or {}).get("activation_fn")
             or cfg.get("sbert_ce_default_activation_function"))
    if named is None:
        return "sigmoid"
    ours = _CROSS_ENCODER_ACTIVATIONS.get(str(named).rsplit(".", 1)[-1])
    if ours is None:
        raise ValueError(f"the cross-encoder activation {named!r} is not served "
                         f"({', '.join(_CROSS_ENCODER_ACTIVATIONS)} are)")
    return ours


def _encoder_activation(arch: str, cfg: dict[str, Any], key: str, default: str = "gelu") -> str:
    act = cfg.get(key) or default
    if act not in ENCODER_ACTIVATIONS:
        raise ValueError(f"{key} must be one of {tuple(ENCODER_ACTIVATIONS)} for {arch}, got {act!r}")
    return act


def _bert_fields(ours: str, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """BERT's and RoBERTa's own ModelConfig fields, as BertConfig / RobertaConfig read them."""
    position_type = cfg.get("position_embedding_type") or "absolute"
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type must be 'absolute' for {arch}, got {position_type!r}")
    # RoBERTa numbers positions from padding_idx + 1: its table's first rows are never read.
    pad = cfg.get("pad_token_id")
    offset = (1 if pad is None else int(pad)) + 1 if ours == "RobertaModel" else 0
    positions = int(cfg.get("max_position_embeddings", 512)) - offset
    if positions < 1:
        raise ValueError(f"max_position_embeddings ({cfg.get('max_position_embeddings')}) leaves no position "
                         f"after {arch}'s offset of {offset}")
    return dict(rope_theta=0.0, max_position_embeddings=positions, qkv_bias=True, o_proj_bias=True, mlp_bias=True,
                sliding_window=None, hidden_act=_encoder_activation(arch, cfg, "hidden_act"),
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                type_vocab_size=int(cfg.get("type_vocab_size", 2)), position_offset=offset, default_pooling_type="CLS")


# NomicBERT's own config names (its remote code's) -> transformers'.
_NOMIC_KEYS = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_inner": "intermediate_size",
               "n_layer": "num_hidden_layers", "layer_norm_epsilon": "layer_norm_eps"}


def _rope_bert_config(ours: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A NomicBERT / GTE config in transformers' names: NomicBERT's own code's keys (n_embd, ...)
    renamed, and the variants that code allows but we do not compute refused."""
    if ours == "NomicBertModel" and "n_embd" in cfg:
        # (Its rotary_scaling_factor, a dynamic NTK above max_trained_positions, never applies: the
        # context is capped there, as vLLM caps it.)
        unsupported = {"rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False,
                       "causal": False, "use_rms_norm": False, "rotary_emb_scale_base": None}
        for key, served in unsupported.items():
            if cfg.get(key, served) != served:
                raise ValueError(f"NomicBertModel with {key}={cfg[key]!r} is not served (only {served!r})")
        if str(cfg.get("activation_function", "swiglu")) not in ("swiglu", "silu"):
            raise ValueError(f"NomicBertModel's activation_function must be swiglu, got {cfg['activation_function']!r}")
        if cfg.get("n_inner") is None:
            raise ValueError("NomicBertModel's config must give n_inner (its MLP's width)")
        # (GPT2Config's layer_norm_epsilon default, which its own config class inherits.)
        cfg = {"layer_norm_epsilon": 1e-5, **cfg}
        cfg = {**cfg, **{ours_key: cfg[key] for key, ours_key in _NOMIC_KEYS.items() if key in cfg},
               "hidden_act": "silu"}
    return cfg


def _rope_bert_fields(ours: str, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """NomicBERT's and GTE's own ModelConfig fields: RoPE's base (and GTE's fixed NTK scaling), the
    trained context, the biases and the gated MLP's activation, from transformers' config or from
    their own code's."""
    nomic = ours == "NomicBertModel"
    own_gte = arch.startswith("New")
    if own_gte and (cfg.get("logn_attention_scale") or cfg.get("layer_norm_type", "layer_norm") != "layer_norm"):
        raise ValueError("NewModel with logn_attention_scale or another layer_norm_type is not served")
    # (GTE's own NewConfig defaults: RoPE base 10000 over 2048 positions.)
    default_theta = 1000.0 if nomic else 10_000.0 if own_gte else 160_000.0
    ntk = dict(cfg.get("rope_scaling") or {}) if own_gte else {}
    if ntk:  # GTE's own fixed NTK scaling (gte-multilingual-base: base 20000, factor 8)
        if ntk.get("type", ntk.get("rope_type")) != "ntk" or ntk.get("mixed_b") is not None:
            raise ValueError(f"{arch} with rope_scaling {cfg['rope_scaling']!r} is not served (its fixed NTK "
                             "scaling is)")
        cfg = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    theta, scaling = _rope_from_dict("", {"rope_theta": cfg.get("rotary_emb_base", default_theta), **cfg})
    if scaling is not None:
        raise ValueError(f"{arch}: only default RoPE is served, got {scaling['rope_type']!r}")
    # NomicBERT's own configs give the trained context apart from the (extrapolated) table size.
    positions = int(cfg.get("max_trained_positions") or cfg.get("max_position_embeddings")
                    or (2048 if nomic or own_gte else 8192))
    if nomic:  # (its own code: biases on q/k/v/out and fc11/fc12 and fc2 as its flags say; transformers': none)
        own_code = "n_embd" in cfg
        qkv_bias = bool(cfg.get("qkv_proj_bias", True)) if own_code else False
        gate_up_bias = bool(cfg.get("mlp_fc1_bias", True)) if own_code else False
        down_bias = bool(cfg.get("mlp_fc2_bias", True)) if own_code else False
    else:  # GTE: biases on q/k/v/o and on down, none on up/gate
        qkv_bias, gate_up_bias, down_bias = True, False, True
    act = str(cfg.get("hidden_act") or ("silu" if nomic else "gelu"))
    act = {"gelu_new": "gelu_pytorch_tanh"}.get(act, act)  # (the same tanh approximation)
    if act not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"hidden_act must be silu, gelu, gelu_new or gelu_pytorch_tanh for {arch}, got {act!r}")
    return dict(rope_theta=theta, max_position_embeddings=positions, qkv_bias=qkv_bias, o_proj_bias=qkv_bias,
                mlp_bias=gate_up_bias, down_proj_bias=down_bias, sliding_window=None, hidden_act=act,
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                type_vocab_size=int(cfg.get("type_vocab_size", 2 if nomic else 1)), position_offset=0,
                default_pooling_type="CLS",
                rope_scaling={"rope_type": "ntk", "factor": float(ntk["factor"])} if ntk else None)


JINA_DEFAULT_TASK = "text-matching"


def _jina_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Jina embeddings v3's ModelConfig fields, from transformers' config or its own code's
    (XLMRobertaFlashConfig): RoPE's base, the context, and the task adaptation merged at load.

    Its own checkpoints hold a LoRA adaptation per task beside the base weights. As vLLM, the
    text-matching one is merged by default; ``lora_task`` (set with --hf-overrides) chooses another
    of ``lora_adaptations``, or null for the base weights."""
    theta, scaling = _rope_from_dict("", {"rope_theta": cfg.get("rotary_emb_base", 20_000.0), **cfg})
    if scaling is not None:
        raise ValueError(f"{arch}: only default RoPE is served, got {scaling['rope_type']!r}")
    if cfg.get("rotary_emb_interleaved") or cfg.get("rotary_emb_fraction", 1.0) != 1.0:
        raise ValueError(f"{arch} with interleaved or partial rotary embeddings is not served")
    act = str(cfg.get("hidden_act", "gelu"))
    if act not in ENCODER_ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {', '.join(ENCODER_ACTIVATIONS)} for {arch}, got {act!r}")
    task_lora = None
    tasks = cfg.get("lora_adaptations") if arch == "XLMRobertaModel" else None
    if cfg.get("lora_task") is not None and not tasks:
        raise ValueError(f"lora_task chooses among the task adaptations (lora_adaptations) of Jina's own "
                         f"checkpoints; this {arch} checkpoint holds none: its weights are served as they are")
    if tasks:
        task = cfg.get("lora_task", JINA_DEFAULT_TASK if JINA_DEFAULT_TASK in tasks else tasks[-1])
        if task is not None:
            if task not in tasks:
                raise ValueError(f"lora_task must be one of {', '.join(map(repr, tasks))} (or null for the base "
                                 f"weights), got {task!r}")
            task_lora = (tasks.index(task), float(cfg.get("lora_alpha", 1)) / int(cfg.get("lora_rank", 4)))
    return dict(rope_theta=theta, max_position_embeddings=int(cfg.get("max_position_embeddings", 8194)),
                qkv_bias=True, o_proj_bias=True, mlp_bias=True, sliding_window=None, hidden_act=act,
                layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
                type_vocab_size=int(cfg.get("type_vocab_size", 1)), position_offset=0, default_pooling_type="MEAN",
                gated_mlp=False, task_lora=task_lora)


def _modernbert_kinds_and_bases(arch: str, cfg: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
    """ModernBERT's (encoder's and decoder's) layer kinds (every global_attn_every_n_layers-th layer from
    the first full, where layer_types is absent) and each kind's RoPE base (rope_parameters' per kind, else
    its 4.x keys global_rope_theta / local_rope_theta, else 160,000 / 10,000); default RoPE only."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        every = int(cfg.get("global_attn_every_n_layers", 3))
        kinds = ["sliding_attention" if i % every else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {num_layers}")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    thetas: dict[str, float] = {}
    for kind, key, default in (("full_attention", "global_rope_theta", 160_000.0),
                               ("sliding_attention", "local_rope_theta", 10_000.0)):
        kind_params = params.get(kind) or {}
        if kind_params.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
            raise ValueError(f"{arch}: only default RoPE is served, got {kind_params or cfg.get('rope_scaling')}")
        theta = kind_params.get("rope_theta", cfg.get(key, default))
        # (A null local_rope_theta meant the global one in transformers 4.x's ModernBERT.)
        thetas[kind] = float(thetas.get("full_attention", default) if theta is None else theta)
    return kinds, thetas


def _modernbert_fields(arch: str, cfg: dict[str, Any], classifier: bool) -> dict[str, Any]:
    """ModernBERT's own ModelConfig fields, as ModernBertConfig reads them (its 4.x keys, or 5.x's
    layer_types and per-kind rope_parameters): global RoPE on the full-attention layers, local RoPE
    and a bidirectional window of local_attention // 2 tokens each side on the others."""
    kinds, thetas = _modernbert_kinds_and_bases(arch, cfg)
    pooling = str(cfg.get("classifier_pooling", "cls")).upper()
    if pooling not in ("CLS", "MEAN"):
        raise ValueError(f"classifier_pooling must be 'cls' or 'mean' for {arch}, "
                         f"got {cfg.get('classifier_pooling')!r}")
    _encoder_activation(arch, cfg, "classifier_activation")
    return dict(rope_theta=thetas["full_attention"], local_rope_theta=thetas["sliding_attention"],
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                qkv_bias=bool(cfg.get("attention_bias", False)), o_proj_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)), sliding_window=int(cfg.get("local_attention", 128)) // 2,
                sliding_window_layers=tuple(kind == "sliding_attention" for kind in kinds),
                hidden_act=_encoder_activation(arch, cfg, "hidden_activation"),
                layer_norm_eps=float(cfg.get("norm_eps", 1e-5)), norm_bias=bool(cfg.get("norm_bias", False)),
                type_vocab_size=0, default_pooling_type=pooling if classifier else "CLS")


def _text_config(cfg: dict[str, Any], decoder: str) -> dict[str, Any]:
    """A vision-language config's language model, as a ``decoder`` config: its text_config, with the
    top level's EOS ids, dtype and head tying where it states them (transformers ties the head by
    the top level's tie_word_embeddings)."""
    text = dict(cfg.get("text_config") or {})
    for key in ("eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    text["architectures"] = [decoder]
    return text


def _processor_kwargs(kwargs: dict[str, Any], vision: Any, architecture: str) -> dict[str, int]:
    """--mm-processor-kwargs as the settings they make over the processor config's: Qwen2-VL's
    (min_pixels, max_pixels), given so or as transformers' ``size`` (shortest_edge, longest_edge; the
    explicit keys win, as in transformers); InternVL's (min_patches, max_patches); Idefics3's
    (tile_resize: its ``size``'s longest_edge, the side an image is resized to before its tiles are
    cut). Other keys, or any for a model whose processor decides nothing here, are refused."""
    if isinstance(vision, InternVLVisionConfig):
        served: tuple[str, ...] = ("min_patches", "max_patches")
    elif isinstance(vision, Idefics3VisionConfig):
        if not kwargs:
            return {}
        size = kwargs.get("size")
        if set(kwargs) - {"size"} or not isinstance(size, dict) or set(size) != {"longest_edge"} \
                or isinstance(size["longest_edge"], bool) or not isinstance(size["longest_edge"], int) \
                or size["longest_edge"] < 1:
            raise ValueError(f"mm_processor_kwargs {sorted(kwargs)} cannot be served for {architecture}: only "
                             "size {'longest_edge': N} (N >= 1, the side an image is resized to before its tiles "
                             "are cut)")
        return {"tile_resize": size["longest_edge"]}
    elif isinstance(vision, QwenVisionConfig | Qwen3VisionConfig):
        served = ("min_pixels", "max_pixels", "size")
    else:
        served = ()
    unserved = sorted(set(kwargs) - set(served))
    size = kwargs.get("size", {})
    if not isinstance(size, dict) or set(size) - {"shortest_edge", "longest_edge"}:
        unserved.append(f"size {size!r} (only shortest_edge and longest_edge)")
    if unserved:
        raise ValueError(f"mm_processor_kwargs {unserved} cannot be served for {architecture}: "
                         + (f"only {list(served)}" if served else "it sets nothing of this model's"))
    out = {key: int(kwargs[key]) for key in ("min_patches", "max_patches") if key in kwargs}
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = kwargs.get(key, size.get(edge))
        if value is not None:
            out[key] = int(value)
    return out


def _activation(arch: str, cfg: dict[str, Any]) -> str:
    """The MLP's activation, read where transformers reads it for the architecture."""
    if arch in GEMMA_WINDOWED_ARCHITECTURES:
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    elif arch == "GemmaForCausalLM":
        # Gemma's first configs say "gelu", which always meant the tanh approximation (transformers
        # converts it); hidden_activation, where set, names it.
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if act == "gelu" else act
    elif arch == "BitNetForCausalLM":  # (its MLP: relu(gate)^2 * up)
        act = cfg.get("hidden_act") or "relu2"
        if act not in (*SUPPORTED_ACTIVATIONS, "relu2"):
            raise ValueError(f"hidden_act must be one of {(*SUPPORTED_ACTIVATIONS, 'relu2')} for {arch}, got {act!r}")
        return act
    elif arch in ("NemotronHForCausalLM", "ArceeForCausalLM"):  # (their MLPs: relu(x)^2, ungated)
        key = "mlp_hidden_act" if arch == "NemotronHForCausalLM" else "hidden_act"
        act = cfg.get(key) or "relu2"
        if act != "relu2":
            raise ValueError(f"{key} must be 'relu2' for {arch}, got {act!r}")
        return act
    elif arch in UNGATED_MLP_ARCHITECTURES:
        act = cfg.get("hidden_act") or "gelu"
        if act not in UNGATED_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {UNGATED_ACTIVATIONS} for {arch}, got {act!r}")
        return act
    else:
        act = cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got {act!r}")
    return act


def _llama_4_scaling(arch: str, cfg: dict[str, Any]) -> tuple[float, int] | None:
    """Ministral 3's query scale by position (Llama 4's attention temperature), as transformers'
    Ministral3Attention reads it from the rope parameters: (llama_4_scaling_beta, the pretrained
    length original_max_position_embeddings); None where the config gives no beta."""
    if arch != "Ministral3ForCausalLM":
        return None
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else cfg.get("rope_scaling")
    beta = (params or {}).get("llama_4_scaling_beta")
    if beta is None:
        return None
    length = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"llama_4_scaling_beta needs the pretrained length (original_max_position_embeddings) in "
                         f"the rope parameters, got {length!r}")
    return float(beta), length


def _gemma_from_dict(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Gemma 2/3/3n fields (attention scale, soft caps, Gemma 3's and 3n's local RoPE),
    with transformers' defaults for the keys a config leaves out; Gemma 3n's own (gemma3n_config)."""
    if arch not in GEMMA_WINDOWED_ARCHITECTURES:
        return {}
    if arch == "Gemma4ForCausalLM":  # (its scores unscaled: its q/k norms set their size)
        gemma4 = gemma4_config_from_dict(cfg)
        return dict(query_pre_attn_scalar=1.0, attn_logit_softcapping=None,
                    final_logit_softcapping=(None if cfg.get("final_logit_softcapping") is None
                                             else float(cfg["final_logit_softcapping"])),
                    local_rope_theta=_local_rope_theta(arch, cfg, 10000.0), gemma4=gemma4,
                    # (its experts, as the engine's checks read them: expert parallelism's split)
                    num_experts=gemma4.num_experts, num_experts_per_tok=gemma4.top_k_experts,
                    moe_intermediate_size=gemma4.moe_intermediate_size,
                    attention_layer_geometry=tuple((gemma4.num_kv_heads[i], gemma4.head_dims[i])
                                                   for i in gemma4.cache_layers))
    if arch == "Gemma3nForCausalLM":  # (its scores unscaled: its q/k norms set their size)
        return dict(query_pre_attn_scalar=1.0, attn_logit_softcapping=None,
                    final_logit_softcapping=(None if cfg.get("final_logit_softcapping") is None
                                             else float(cfg["final_logit_softcapping"])),
                    local_rope_theta=_local_rope_theta(arch, cfg, float(cfg.get("rope_local_base_freq") or 10000.0)),
                    gemma3n=gemma3n_config_from_dict(cfg))
    if cfg.get("use_bidirectional_attention") and (arch != "Gemma3ForCausalLM" or cfg.get("attn_logit_softcapping")):
        why = "Gemma 2" if arch in GEMMA2_ARCHITECTURES else "attention soft caps"
        raise ValueError(f"use_bidirectional_attention is served on Gemma 3 without attention soft caps "
                         f"(EmbeddingGemma), not with {why}")
    gemma2 = arch in GEMMA2_ARCHITECTURES

    def optional(key: str, default: float | None) -> float | None:
        value = cfg.get(key, default)
        return None if value is None else float(value)

    fields = dict(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                  attn_logit_softcapping=optional("attn_logit_softcapping", 50.0 if gemma2 else None),
                  final_logit_softcapping=optional("final_logit_softcapping", 30.0 if gemma2 else None))
    if not gemma2:
        # Gemma 3's sliding-window layers rotate with plain RoPE of their own base.
        fields["local_rope_theta"] = _local_rope_theta(arch, cfg, float(cfg.get("rope_local_base_freq") or 10000.0))
    return fields


def _gemma_window_layers(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """transformers' default layer types for Gemma 2 (every other layer windowed, from the first)
    and Gemma 3 (all but every ``sliding_window_pattern``-th layer)."""
    if arch in GEMMA2_ARCHITECTURES:
        return tuple(i % 2 == 0 for i in range(num_layers))
    pattern = int(cfg.get("sliding_window_pattern") or 6)
    return tuple((i + 1) % pattern != 0 for i in range(num_layers))


def _smollm3_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """SmolLM3's NoPE layers: ``no_rope_layers`` (1: the layer rotates), else every
    ``no_rope_layer_interval``-th layer (4 by default) without RoPE, as transformers reads them."""
    if arch != "SmolLM3ForCausalLM":
        return {}
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise ValueError(f"no_rope_layers lists {len(flags)} layers, the model has {num_layers}")
    return {"rope_layers": tuple(bool(flag) for flag in flags[:num_layers])}


def _local_rope_theta(arch: str, cfg: dict[str, Any], default: float) -> float:
    """The sliding-window layers' own RoPE base where a config gives one per layer type (Gemma 3, OLMo
    3): plain RoPE, its base from ``rope_parameters["sliding_attention"]``, else ``default``."""
    params = cfg.get("rope_parameters")
    local = dict((params.get("sliding_attention") if isinstance(params, dict) else None) or {})
    local_type = local.get("rope_type") or local.get("type") or "default"
    if local_type != "default":
        raise ValueError(f"{arch}'s sliding-window layers must use plain RoPE, got rope_type {local_type!r}")
    return float(local.get("rope_theta") or default)


def _olmo3_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's windowed layers rotate with plain RoPE (its full layers take any scaling: YaRN)."""
    if arch != "Olmo3ForCausalLM":
        return {}
    return {"local_rope_theta": _local_rope_theta(arch, cfg, float(cfg.get("rope_theta") or 500_000.0))}


def _modernbert_decoder_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """ModernBERT's decoder: its windowed layers' own RoPE base, its LayerNorms' biases, its embeddings'
    norm."""
    if arch != "ModernBertDecoderForCausalLM":
        return {}
    return {"local_rope_theta": cfg["modernbert_local_rope_theta"], "norm_bias": bool(cfg.get("norm_bias", False)),
            "layer_norm_eps": float(cfg["norm_eps"]), "embedding_norm": True}  # (the head's norm: layer_norm_eps)


def _final_logit_cap_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """nanochat's and Beam's logits' soft cap (null: none), and nanochat's weightless norm over the
    embeddings (Gemma's cap: _gemma_from_dict)."""
    if arch not in ("NanoChatForCausalLM", "BeamForCausalLM"):
        return {}
    cap = cfg.get("final_logit_softcapping")
    return {"embedding_norm": arch == "NanoChatForCausalLM",
            "final_logit_softcapping": None if cap is None else float(cap)}


def _beam_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Beam's layer kinds and RoPE as transformers' BeamConfig reads them: five windowed layers of six and
    the last full where layer_types is absent, the first three MLPs dense where mlp_layer_types is; the
    windowed layers' rope parameters the model's (base 10,000 unless stated; null: they attend without
    positions too, ``beam_windowed_rotate`` false), the full layers' null (a RoPE of their own is
    refused, as is one dict for all layers, which transformers' model cannot build either)."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
        kinds[-1] = "full_attention"
    mlp_kinds = cfg.get("mlp_layer_types")
    if not isinstance(mlp_kinds, list):
        dense = min(3, num_layers)
        mlp_kinds = ["dense"] * dense + ["sparse"] * (num_layers - dense)
    if len(mlp_kinds) != num_layers or not set(mlp_kinds) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} layers, "
                         f"got {mlp_kinds}")
    if "sliding_attention" in kinds and not cfg.get("sliding_window"):
        raise ValueError("BeamForCausalLM's sliding_attention layers need a sliding_window")
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": None}
    if not set(params) <= {"sliding_attention", "full_attention"} or "sliding_attention" not in params:
        raise ValueError(f"BeamForCausalLM's rope_parameters give one entry per layer kind (sliding_attention, "
                         f"full_attention), got {sorted(params)}")
    if params.get("full_attention") is not None:
        raise ValueError("BeamForCausalLM's full_attention layers with a RoPE of their own are not served (its "
                         "full layers attend without positions)")
    local = params["sliding_attention"]
    return {**cfg, "layer_types": kinds, "mlp_layer_types": mlp_kinds, "beam_windowed_rotate": local is not None,
            "rope_parameters": dict(local or {"rope_type": "default", "rope_theta": 10000.0})}


def _granite_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's four scalars (transformers' defaults: 1.0 each), Granite MoE's too; HyperCLOVA X's
    (null: 1.0; its scores scaled by head_dim ** -0.5 unless stated, its logits multiplied by
    logits_scaling, and each sublayer's output normed under use_post_norm)."""
    if arch == "HyperCLOVAXForCausalLM":
        def scalar(key: str) -> float:
            value = cfg.get(key)
            return 1.0 if value is None else float(value)
        scale = cfg.get("attention_multiplier")
        return {"embedding_multiplier": scalar("embedding_multiplier"),
                "residual_multiplier": scalar("residual_multiplier"),
                "attention_multiplier": None if scale is None else float(scale),
                "logits_scaling": 1.0 / scalar("logits_scaling"),
                "sublayer_output_norm": cfg.get("use_post_norm") is not False}
    if arch not in ("GraniteForCausalLM", "GraniteSWAForCausalLM", *GRANITE_MOE_ARCHITECTURES):
        return {}
    return {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0))}


def _time_step_limit(value: Any) -> tuple[float, float]:
    """A Mamba config's time_step_limit: two numbers (transformers writes infinity as
    {"__float__": "Infinity"}); (0, inf) when absent."""
    if value is None:
        return (0.0, float("inf"))
    bounds = [float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value]
    if len(bounds) != 2 or bounds[0] > bounds[1]:
        raise ValueError(f"time_step_limit must be [low, high], got {value!r}")
    return bounds[0], bounds[1]


# Nemotron-H's hybrid_override_pattern: a character per layer.
NEMOTRON_H_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# transformers 5's layers_block_type names -> ours.
_NEMOTRON_H_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
                     "attention": "attention", "mlp": "mlp", "moe": "moe"}


def _nemotron_h_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """NVIDIA Nemotron-H's config.json (Nemotron-H 8B / 47B, Nemotron Nano 9B / 12B v2) in the keys
    ModelConfig reads: one block per layer (hybrid_override_pattern as released, layers_block_type as
    transformers 5 saves it), each a Mamba-2 mixer, attention without positions, or an ungated
    relu^2 MLP, behind its own norm."""
    pattern = cfg.get("layers_block_type") or cfg.get("layer_types")
    if pattern is None:
        released = cfg.get("hybrid_override_pattern")
        if not isinstance(released, str) or set(released) - set(NEMOTRON_H_BLOCKS):
            raise ValueError(f"hybrid_override_pattern must be a string of {''.join(NEMOTRON_H_BLOCKS)}, "
                             f"got {released!r}")
        kinds = [NEMOTRON_H_BLOCKS[c] for c in released]
    else:
        unknown = sorted({k for k in pattern if k not in _NEMOTRON_H_KINDS})
        if unknown:
            raise ValueError(f"layers_block_type: Nemotron-H's layers are {sorted(_NEMOTRON_H_KINDS)}, got {unknown}")
        kinds = [_NEMOTRON_H_KINDS[k] for k in pattern]
    if cfg.get("num_hidden_layers") not in (None, len(kinds)):
        # (transformers warns and builds the pattern's layers: so does this.)
        logger.warning("Nemotron-H: hybrid_override_pattern has %d layers, num_hidden_layers says %s; the "
                       "pattern's are served", len(kinds), cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads") or 32)
    # (The Mamba keys' other names, as transformers' NemotronHConfig takes them.)
    aliases = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
               "mamba_chunk_size": "chunk_size", "mamba_conv_bias": "use_conv_bias",
               "mamba_dt_limit": "time_step_limit"}
    cfg = {**cfg, **{ours: cfg[theirs] for theirs, ours in aliases.items() if theirs in cfg}}
    return {**cfg, "num_hidden_layers": len(kinds), "block_types": kinds,
            "head_dim": int(cfg.get("head_dim") or cfg.get("attention_head_dim") or 128),
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or 8), "num_attention_heads": heads,
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5),
            "intermediate_size": int(cfg.get("intermediate_size") or 21504)}


def _mamba2_from_dict(cfg: dict[str, Any], hidden: int, keys: dict[str, str], defaults: dict[str, Any]
                      ) -> Mamba2Config:
    """A Mamba-2 mixer's geometry from a config's ``keys`` (ours -> its names), ``defaults`` for
    those it leaves out; head width "auto" (or none) from expand x hidden over the heads."""
    def read(ours: str) -> Any:
        value = cfg.get(keys[ours])
        return defaults[ours] if value is None else value

    heads, groups = int(read("num_heads")), int(read("num_groups"))
    width = int(read("expand")) * hidden
    head_dim = read("head_dim")
    head_dim = width // heads if head_dim == "auto" else int(head_dim)
    if heads % groups:
        raise ValueError(f"Mamba-2 geometry: {heads} heads in {groups} groups (the groups must divide the heads)")
    return Mamba2Config(num_heads=heads, head_dim=head_dim, num_groups=groups, state_size=int(read("state_size")),
                        conv_kernel=int(read("conv_kernel")), chunk_size=int(read("chunk_size")),
                        conv_bias=bool(read("conv_bias")), proj_bias=bool(read("proj_bias")),
                        time_step_limit=_time_step_limit(cfg.get("time_step_limit")))


def _mamba2_lm_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A pure Mamba-2 language model's config.json (Mamba2ForCausalLM: Mamba-Codestral-7B) as
    Nemotron-H's of Mamba-2 blocks alone; its attention fields are placeholders nothing reads."""
    layers = int(cfg.get("num_hidden_layers") or 64)
    return {**cfg, "num_hidden_layers": layers, "block_types": ["mamba"] * layers, "num_attention_heads": 1,
            "num_key_value_heads": 1, "intermediate_size": 0,
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5)}


def _mamba1_from_dict(cfg: dict[str, Any], keys: dict[str, str], defaults: dict[str, Any], dt_bc_norm: str | None,
                      norm_eps: float, width: int | None = None) -> Mamba1Config:
    """A Mamba-1 mixer's geometry from a config's ``keys`` (ours -> its names), ``defaults`` for those
    it leaves out; its channels ``width``, else expand x hidden; dt's rank "auto" is ceil(hidden /
    16), as transformers reads it."""
    def read(ours: str) -> Any:
        value = cfg.get(keys[ours])
        return defaults[ours] if value is None else value

    hidden = int(cfg["hidden_size"])
    rank = read("dt_rank")
    return Mamba1Config(intermediate_size=width or int(read("expand")) * hidden, state_size=int(read("state_size")),
                        conv_kernel=int(read("conv_kernel")), dt_rank=-(-hidden // 16) if rank == "auto" else int(rank),
                        conv_bias=bool(read("conv_bias")), proj_bias=bool(read("proj_bias")), dt_bc_norm=dt_bc_norm,
                        norm_eps=norm_eps)


def _jamba_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """AI21's Jamba: Mamba-1 mixers (dt, B and C RMS-normed with weights) in place of self-attention
    in all but every attn_layer_period-th layer (from attn_layer_offset), whose attention has no
    positions; transformers' JambaConfig defaults."""
    if arch != "JambaForCausalLM":
        return {}
    period, offset = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    mamba = _mamba1_from_dict(cfg, {"expand": "mamba_expand", "state_size": "mamba_d_state",
                                    "conv_kernel": "mamba_d_conv", "dt_rank": "mamba_dt_rank",
                                    "conv_bias": "mamba_conv_bias", "proj_bias": "mamba_proj_bias"},
                              {"expand": 2, "state_size": 16, "conv_kernel": 4, "dt_rank": "auto", "conv_bias": True,
                               "proj_bias": False}, "weighted", float(cfg.get("rms_norm_eps", 1e-6)))
    return {"mamba": mamba, "mamba_layers": tuple(i % period != offset for i in range(num_layers)),
            "rope_layers": (False,) * num_layers}


def _mamba1_lm_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Mamba or Falcon-Mamba language model's config.json as Nemotron-H's of Mamba blocks alone (the
    same checkpoint names: backbone.embeddings, backbone.layers.N.{norm, mixer}, backbone.norm_f);
    its attention fields are placeholders nothing reads. Both tie their embeddings unless told not to.
    A config's intermediate_size, where it states one, is the mixers' width (transformers lets it
    override expand x hidden: Falcon-Mamba-7B's expand of 16 with intermediate_size 8192)."""
    layers = int(cfg.get("num_hidden_layers") or 32)
    return {"tie_word_embeddings": True, **cfg, "num_hidden_layers": layers, "block_types": ["mamba"] * layers,
            "num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 0,
            "mamba_intermediate_size": cfg.get("intermediate_size"),
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5)}


def _mamba1_lm_geometry(arch: str, cfg: dict[str, Any]) -> Mamba1Config:
    """A Mamba or Falcon-Mamba language model's mixers (Falcon-Mamba's dt, B and C RMS-normed
    without weights), transformers' MambaConfig defaults for the keys a config leaves out."""
    return _mamba1_from_dict(cfg, {"expand": "expand", "state_size": "state_size", "conv_kernel": "conv_kernel",
                                   "dt_rank": "time_step_rank", "conv_bias": "use_conv_bias", "proj_bias": "use_bias"},
                             {"expand": 2, "state_size": 16, "conv_kernel": 4, "dt_rank": "auto", "conv_bias": True,
                              "proj_bias": False},
                             "weightless" if arch == "FalconMambaForCausalLM" else None,
                             float(cfg.get("mixer_rms_eps") or 1e-6), width=cfg.get("mamba_intermediate_size"))


def _nemotron_h_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Nemotron-H's (and a pure Mamba-2 model's) block kinds and Mamba-2 geometry, transformers'
    NemotronHConfig (Mamba2Config) defaults for the keys a config leaves out."""
    if arch in MAMBA1_LM_ARCHITECTURES:
        kinds = tuple(cfg["block_types"])
        return {"block_types": kinds, "mamba_layers": (True,) * len(kinds), "mamba": _mamba1_lm_geometry(arch, cfg),
                "rope_layers": (False,) * len(kinds)}
    if arch not in ("NemotronHForCausalLM", "Mamba2ForCausalLM"):
        return {}
    kinds = tuple(cfg["block_types"])
    if arch == "Mamba2ForCausalLM":
        keys = {"num_heads": "num_heads", "head_dim": "head_dim", "state_size": "state_size"}
        defaults = {"num_heads": 128, "head_dim": 64, "chunk_size": 256}
    else:
        keys = {"num_heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state_size": "ssm_state_size"}
        defaults = {"num_heads": 128, "head_dim": 64, "chunk_size": 128}
    mamba = _mamba2_from_dict(cfg, int(cfg["hidden_size"]), {
        **keys, "num_groups": "n_groups", "conv_kernel": "conv_kernel", "chunk_size": "chunk_size", "expand": "expand",
        "conv_bias": "use_conv_bias", "proj_bias": "use_bias"}, {
        **defaults, "num_groups": 8, "state_size": 128, "conv_kernel": 4, "expand": 2, "conv_bias": True,
        "proj_bias": False})
    return {"block_types": kinds, "mamba_layers": tuple(kind == "mamba" for kind in kinds), "mamba": mamba,
            "rope_layers": (False,) * len(kinds)}


def _linear_attention_layers(kinds: Any, num_layers: int, named_by: str = "layer_types") -> tuple[bool, ...]:
    """Per layer whether it is a linear-attention (recurrent) one, from transformers' layer kinds: a
    list naming each of the num_layers layers "linear_attention" or "full_attention" (Qwen3-Next's,
    OLMo Hybrid's, Kimi-Linear's, Ling 3's, MiniMax's)."""
    if not isinstance(kinds, list) or len(kinds) != num_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"{named_by} must name each of the {num_layers} layers 'linear_attention' or "
                         f"'full_attention', got {kinds!r}")
    return tuple(kind == "linear_attention" for kind in kinds)


def _qwen3_next_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's (and Qwen3.5's) layer kinds (layer_types, else every full_attention_interval-th
    layer full, as transformers reads it) and its Gated DeltaNet geometry."""
    if arch not in (*QWEN3_NEXT_FAMILY, "OlmoHybridForCausalLM"):
        return {}
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    recurrent = _linear_attention_layers(kinds, num_layers)
    k_heads, v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if v_heads % k_heads:
        raise ValueError(f"linear_num_value_heads ({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})")
    return {"mamba": GatedDeltaNetConfig(num_k_heads=k_heads, num_v_heads=v_heads,
                                         head_k_dim=int(cfg["linear_key_head_dim"]),
                                         head_v_dim=int(cfg["linear_value_head_dim"]),
                                         conv_kernel=int(cfg["linear_conv_kernel_dim"]),
                                         split_projections=arch != "Qwen3NextForCausalLM",
                                         beta_scale=2.0 if cfg.get("linear_allow_neg_eigval") else 1.0),
            "mamba_layers": recurrent,
            # (Qwen3-Next's and Qwen3.5's multi-token-prediction layers, under mtp.*: the mtp drafter's)
            **({"num_mtp_layers": int(cfg.get("mtp_num_hidden_layers") or 0)} if arch in QWEN3_NEXT_FAMILY else {}),
            # (OLMo Hybrid's attention without positions where its RoPE base is null)
            **({"rope_layers": (False,) * num_layers} if cfg.get("olmo_hybrid_nope") else {})}


def _olmo_hybrid_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMo Hybrid's config as transformers' OlmoHybridConfig reads it: its defaults for the keys a config
    leaves out; where layer_types is absent, every fourth layer full attention (the last where there is
    none), the others linear attention; the linear attention's heads as many as the attention's, keys
    0.75 x hidden_size / heads wide, values twice that; a null RoPE base (the released checkpoints')
    read as attention without positions (``olmo_hybrid_nope``)."""
    cfg = {"vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 30, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "eos_token_id": 100257,
           "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True,
           **{k: v for k, v in cfg.items() if v is not None or k in ("rope_parameters", "rope_theta")}}
    num_layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    if not isinstance(cfg.get("layer_types"), list):
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
        cfg["layer_types"] = kinds
    if "linear_attention" not in cfg["layer_types"] or "full_attention" not in cfg["layer_types"]:
        raise ValueError("OlmoHybridForCausalLM needs both linear_attention and full_attention layers, as "
                         "transformers does")
    k_heads = int(cfg.get("linear_num_key_heads") or heads)
    key_dim = int(cfg.get("linear_key_head_dim") or int(0.75 * int(cfg["hidden_size"]) / k_heads))
    # (The base: rope_parameters', else the top-level rope_theta, else transformers' 10,000; stated null
    # in either place, no positions.)
    params = cfg.get("rope_parameters")
    theta = params["rope_theta"] if isinstance(params, dict) and "rope_theta" in params \
        else cfg.get("rope_theta", 10000.0)
    nope = theta is None
    if nope:
        cfg = {**{k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")},
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # (unread: no layer rotates)
    elif not isinstance(params, dict):  # (the older keys, rope_theta and rope_scaling, read as they stand)
        cfg = {k: v for k, v in cfg.items() if k != "rope_parameters" and (k != "rope_theta" or v is not None)}
    return {**cfg, "olmo_hybrid_nope": nope, "linear_num_key_heads": k_heads,
            "linear_num_value_heads": int(cfg.get("linear_num_value_heads") or heads), "linear_key_head_dim": key_dim,
            "linear_value_head_dim": int(cfg.get("linear_value_head_dim") or 2 * key_dim)}


# transformers' KimiLinearConfig defaults (Kimi-Linear-48B-A3B's geometry), in DeepSeek-V3's key names.
KIMI_LINEAR_DEFAULTS = {"vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27,
                        "num_attention_heads": 32, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
                        "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                        "q_lora_rank": None}
# Kimi-Linear's released key -> DeepSeek-V3's (transformers' KimiLinearConfig attribute_map, reversed).
_KIMI_LINEAR_KEYS = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
                     "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
                     "num_expert_group": "n_group", "model_max_length": "max_position_embeddings"}


def _kimi_linear_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi-Linear's config (as released: its experts' own key names, the linear attention's geometry
    and layers in linear_attn_config, 1-indexed; or as transformers' KimiLinearConfig saves it:
    layer_types, linear_num_heads, ...) in DeepSeek-V3's terms and ours: the layer kinds as
    layer_types (by default every fourth from layer 4 full attention, as transformers'), the
    linear attention's geometry as linear_num_heads / linear_head_dim / linear_conv_kernel_dim.
    Its MLA rotates nothing (mla_use_nope): its RoPE keys are not read. What the released models do
    not have and transformers does not build is refused: RoPE in the MLA, an output gate on it,
    another router activation than the sigmoid, KDA's full-rank gate or gate lower bound."""
    linear = cfg.get("linear_attn_config") or {}
    if cfg.get("mla_use_nope") is False:
        raise ValueError("KimiLinearForCausalLM with RoPE in its MLA (mla_use_nope false) is not served")
    if cfg.get("mla_use_output_gate"):
        raise ValueError("KimiLinearForCausalLM with an output gate on its MLA (mla_use_output_gate) is not served")
    if (cfg.get("moe_router_activation_func") or "sigmoid") != "sigmoid":
        raise ValueError("KimiLinearForCausalLM is served with sigmoid routing (moe_router_activation_func), got "
                         f"{cfg['moe_router_activation_func']!r}")
    if linear.get("use_full_rank_gate") or linear.get("gate_lower_bound") is not None:
        raise ValueError("Kimi Delta Attention with a full-rank gate or a gate lower bound (linear_attn_config's "
                         "use_full_rank_gate, gate_lower_bound) is not served")
    renamed = {_KIMI_LINEAR_KEYS.get(k, k): v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}
    # (transformers' Kimi-Linear never ties its head, whatever tie_word_embeddings says.)
    cfg = {**KIMI_LINEAR_DEFAULTS, **renamed, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}  # (unread: nothing rotates)
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        if "full_attn_layers" in linear and "kda_layers" in linear:
            kinds = [None] * num_layers
            base = int(linear.get("kda_layer_index_base", 1))  # (as released: from 1)
            for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
                for number in linear[key]:
                    if not base <= int(number) < num_layers + base:
                        raise ValueError(f"linear_attn_config's {key} numbers layers from {base} to "
                                         f"{num_layers + base - 1}, got {number}")
                    kinds[int(number) - base] = kind
        else:
            kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return {**cfg, "layer_types": kinds,
            "linear_num_heads": int(linear.get("num_heads") or cfg.get("linear_num_heads") or 32),
            "linear_head_dim": int(linear.get("head_dim") or cfg.get("linear_head_dim") or 128),
            "linear_conv_kernel_dim": int(linear.get("short_conv_kernel_size") or cfg.get("linear_conv_kernel_dim")
                                          or 4)}


def _kimi_linear_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Kimi-Linear's layer kinds (KDA where layer_types says linear_attention, MLA where it says
    full_attention), its KDA geometry, and no layer rotating."""
    if arch != "KimiLinearForCausalLM":
        return {}
    recurrent = _linear_attention_layers(cfg["layer_types"], num_layers,
                                         "layer_types (or linear_attn_config's kda_layers and full_attn_layers)")
    return {"mamba": KimiDeltaAttentionConfig(num_heads=int(cfg["linear_num_heads"]),
                                              head_dim=int(cfg["linear_head_dim"]),
                                              conv_kernel=int(cfg["linear_conv_kernel_dim"])),
            "mamba_layers": recurrent,
            "rope_layers": (False,) * num_layers}


# transformers' MiniMaxConfig defaults.
MINIMAX_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 131072, "tie_word_embeddings": False, "num_local_experts": 8,
                    "num_experts_per_tok": 2}
# The residual scales' keys: transformers', then the released remote code's.
_MINIMAX_SCALES = (("linear_attn_alpha_factor", "layernorm_linear_attention_alpha"),
                   ("linear_attn_beta_factor", "layernorm_linear_attention_beta"),
                   ("full_attn_alpha_factor", "layernorm_full_attention_alpha"),
                   ("full_attn_beta_factor", "layernorm_full_attention_beta"),
                   ("mlp_alpha_factor", "layernorm_mlp_alpha"), ("mlp_beta_factor", "layernorm_mlp_beta"))


def _minimax_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-Text-01's and M1's config in one form: transformers' (MiniMaxForCausalLM: layer_types,
    full_attn_alpha_factor ...) or the released remote code's (MiniMaxText01ForCausalLM /
    MiniMaxM1ForCausalLM: attn_type_list, 0 for lightning and 1 for softmax attention, layernorm_*_alpha
    ...), transformers' defaults where a key is absent (its layer kinds: full attention in the even
    layers). The RoPE turns the first rotary_dim values of each head (64 of 128 as released: the
    remote code's and vLLM's reading), or partial_rotary_factor's share; transformers 5.25's MiniMax
    turns whole heads whatever its config says, as its MiniMax-M2 did before it mapped rotary_dim
    (transformers#48241), and is followed only where a config states neither.
    Refused, as transformers has neither: postnorm false (the residual taken before each norm; the
    remote code's default where a config leaves it out), shared experts (shared_intermediate_size); and a
    sliding window, which no release has."""
    heads = cfg.get("num_attention_heads") or MINIMAX_DEFAULTS["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else MINIMAX_DEFAULTS["num_key_value_heads"]
    cfg = {**MINIMAX_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None},
           "num_key_value_heads": kv_heads or heads}  # (stated null: as many as the heads, as transformers reads it)
    if cfg.get("postnorm", arch == "MiniMaxForCausalLM") is not True:
        raise ValueError(f"{arch} with postnorm false or unstated (the residual before each norm) is not served: "
                         "the released models state it true, and transformers' take it after")
    if cfg.get("sliding_window"):
        raise ValueError(f"{arch} with a sliding_window is not served")
    shared = cfg.get("shared_intermediate_size") or 0
    if (max(shared) if isinstance(shared, list) else shared) > 0:
        raise ValueError(f"{arch} with shared experts (shared_intermediate_size) is not served")
    num_layers = int(cfg["num_hidden_layers"])
    if not isinstance(cfg.get("layer_types"), list):
        kinds = cfg.get("attn_type_list")
        if isinstance(kinds, list) and set(kinds) - {0, 1}:
            raise ValueError(f"attn_type_list must give 0 (lightning) or 1 (softmax attention) for each layer, "
                             f"got {kinds}")
        cfg["layer_types"] = (["linear_attention" if kind == 0 else "full_attention" for kind in kinds]
                              if isinstance(kinds, list) else
                              ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(num_layers)])
    for ours, released in _MINIMAX_SCALES:
        cfg[ours] = float(cfg.get(ours, cfg.get(released, 1.0)))
    params = cfg.get("rope_parameters")
    stated = cfg.get("partial_rotary_factor") is not None or (isinstance(params, dict)
                                                               and params.get("partial_rotary_factor") is not None)
    if cfg.get("rotary_dim") and not stated:
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        cfg["partial_rotary_factor"] = int(cfg["rotary_dim"]) / head_dim
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is None:  # (transformers' MiniMaxConfig default_theta)
        cfg["rope_parameters"] = {**params, "rope_theta": cfg.get("rope_theta") or 1000000.0}
    elif not isinstance(params, dict) and cfg.get("rope_theta") is None:
        cfg["rope_theta"] = 1000000.0
    return cfg


def _minimax_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """MiniMax's layer kinds (lightning attention where layer_types says linear_attention), its
    lightning attention's geometry (the attention's heads) and its residual scales."""
    if arch not in MINIMAX_ARCHITECTURES:
        return {}
    recurrent = _linear_attention_layers(cfg["layer_types"], num_layers, "layer_types (or attn_type_list)")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return {"mamba": LightningAttentionConfig(num_heads=heads, head_dim=head_dim), "mamba_layers": recurrent,
            "minimax_residual_scales": tuple(float(cfg[ours]) for ours, _ in _MINIMAX_SCALES)}


# transformers' BailingHybridConfig defaults (Ling-3.0-Flash's geometry), in DeepSeek-V3's key names.
BAILING_HYBRID_DEFAULTS = {"vocab_size": 157184, "hidden_size": 2560, "intermediate_size": 6144,
                           "num_hidden_layers": 42, "num_attention_heads": 32, "rms_norm_eps": 1e-6,
                           "max_position_embeddings": 262144, "tie_word_embeddings": False, "n_group": 8,
                           "topk_group": 4, "norm_topk_prob": True, "q_lora_rank": None, "head_dim": 128,
                           "short_conv_kernel_size": 4, "layer_group_size": 6, "kda_safe_gate": True,
                           "kda_lower_bound": -5.0, "first_k_dense_replace": 2}
# Its released keys -> DeepSeek-V3's (transformers' BailingHybridConfig attribute_map, reversed).
_BAILING_HYBRID_KEYS = {**_KIMI_LINEAR_KEYS, "num_nextn_predict_layers": "num_mtp_layers",
                        "expert_swiglu_limit_list": "swiglu_limits",
                        "share_expert_swiglu_limit_list": "shared_swiglu_limits"}


def _bailing_hybrid_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """inclusionAI's Ling 3 (BailingHybridForCausalLM: Ling-3.0-Flash) as transformers' BailingHybridConfig
    reads it, in DeepSeek-V3's terms and ours: its experts' own key names, KDA in every layer but each
    layer_group_size-th (MLA; layer_types where given), its KDA heads the attention's count of
    linear_head_dim (else head_dim) values, transformers' defaults where a key is absent. Refused, as
    transformers builds neither: another MLA gate than one per head, low-rank KDA gates (no_kda_lora
    false), a shared expert of its own width. (use_qk_norm, true in its configs, is Ling 2's GQA's and
    not read, as transformers does not: its MLA and KDA layers have no q/k norms.)"""
    if cfg.get("gated_attention_proj_granularity_type", "head_wise") != "head_wise" or cfg.get("no_kda_lora") is False:
        raise ValueError("BailingHybridForCausalLM is served with head-wise MLA gates and full-rank KDA gates "
                         "(gated_attention_proj_granularity_type head_wise, no_kda_lora as transformers builds them)")
    renamed = {_BAILING_HYBRID_KEYS.get(k, k): v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}
    cfg = {**BAILING_HYBRID_DEFAULTS, **renamed}
    shared = cfg.get("moe_shared_expert_intermediate_size")
    if shared is not None and int(shared) != int(cfg.get("moe_intermediate_size") or 768) * int(
            cfg.get("n_shared_experts") or 1):
        raise ValueError("BailingHybridForCausalLM's shared experts are moe_intermediate_size x num_shared_experts "
                         f"wide (as transformers builds them), not moe_shared_expert_intermediate_size ({shared})")
    if not isinstance(cfg.get("rope_parameters"), dict) and cfg.get("rope_theta") is None:
        cfg["rope_theta"] = 6000000.0
    num_layers = int(cfg["num_hidden_layers"])
    if not isinstance(cfg.get("layer_types"), list):
        every = int(cfg["layer_group_size"])
        cfg["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                              for i in range(num_layers)]
    for key in ("swiglu_limits", "shared_swiglu_limits"):
        limits = cfg.get(key) or [0] * num_layers
        if len(limits) != num_layers:
            raise ValueError(f"{key} must give one limit per decoder layer ({num_layers}), got {len(limits)}")
        cfg[key] = [float(limit) for limit in limits]
    return cfg


def _bailing_hybrid_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Ling 3's layer kinds, its KDA geometry (full-rank gates, the safe gate's lower bound), the MLA's
    head gates and the experts' SwiGLU clips per layer."""
    if arch != "BailingHybridForCausalLM":
        return {}
    recurrent = _linear_attention_layers(cfg["layer_types"], num_layers)
    head_dim = int(cfg.get("linear_head_dim") or cfg["head_dim"])
    return {"mamba": KimiDeltaAttentionConfig(
                num_heads=int(cfg["num_attention_heads"]), head_dim=head_dim,
                conv_kernel=int(cfg["short_conv_kernel_size"]), full_rank_gates=True,
                gate_lower_bound=float(cfg["kda_lower_bound"]) if cfg["kda_safe_gate"] else None),
            "mamba_layers": recurrent, "mla_head_gate": True, "swiglu_limits": tuple(cfg["swiglu_limits"]),
            "shared_swiglu_limits": tuple(cfg["shared_swiglu_limits"])}


def _bamba_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bamba's config in Granite 4.0's terms (Granite 4.0-H grew out of it: the same Mamba-2 keys and
    layers): its attention layers (attn_layer_indices) as layer_types, RoPE over the first
    attn_rotary_emb values of each head (half of it where the key is absent: transformers fixes
    partial_rotary_factor at 0.5), and transformers' BambaConfig defaults."""
    cfg = {"rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "num_hidden_layers": 32,
           "num_key_value_heads": 8, **{k: v for k, v in cfg.items() if v is not None}}
    attention = {int(i) for i in cfg.get("attn_layer_indices") or ()}
    kinds = ["attention" if i in attention else "mamba" for i in range(int(cfg["num_hidden_layers"]))]
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    partial = int(cfg["attn_rotary_emb"]) / head_dim if cfg.get("attn_rotary_emb") else 0.5
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None
    return {**cfg, "layer_types": kinds, "partial_rotary_factor": partial,
            **({"rope_parameters": {**rope, "partial_rotary_factor": partial}} if rope else {})}


def _lfm2_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM2's config in the Llama family's terms, as transformers' Lfm2Config / Lfm2MoeConfig read it:
    norm_eps, tie_embedding and block_ff_dim under their usual names, the layer kinds from
    full_attn_idxs where layer_types is absent, and the dense model's MLP width adjusted as
    block_auto_adjust_ff_dim says (2/3 of it, times block_ffn_dim_multiplier, rounded up to
    block_multiple_of: LFM2-1.2B's 12288 is 8192)."""
    if arch == "Lfm3ForCausalLM":
        return _lfm3_config(cfg)
    multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)  # (null: no multiplier, no rounding)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    num_layers = int(cfg.get("num_hidden_layers", 32))
    if not isinstance(cfg.get("layer_types"), list):
        attention = set(cfg.get("full_attn_idxs", range(num_layers)))
        cfg["layer_types"] = ["full_attention" if i in attention else "conv" for i in range(num_layers)]
    width = int(cfg.get("block_ff_dim", cfg.get("intermediate_size", 12288 if arch == "Lfm2ForCausalLM" else 7168)))
    if arch == "Lfm2ForCausalLM" and cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if multiplier is not None:
            multiple = int(cfg.get("block_multiple_of", 256))
            width = multiple * -(-int(float(multiplier) * width) // multiple)
    return {"max_position_embeddings": 128_000, "num_key_value_heads": 8, "rope_theta": 1_000_000.0, **cfg,
            "num_hidden_layers": num_layers, "intermediate_size": width,
            "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
            "tie_word_embeddings": bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)))}


def _lfm3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LFM3's config as transformers' Lfm3Config reads it: its defaults for the keys a config leaves out
    (the MLP intermediate_size wide as stated, no adjustment), norm_eps as the norms' epsilon; where
    layer_types is absent, of every four layers from the first a convolution, a convolution, a full
    attention layer and a convolution, the fourth of each four after the first a windowed attention layer
    instead; RoPE per layer kind (the full layers' proportional over half of each head's frequencies,
    base 1,000,000; the windowed layers' plain, 10,000)."""
    cfg = {"vocab_size": 128_000, "hidden_size": 2048, "intermediate_size": 7680, "num_hidden_layers": 24,
           "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 128_000,
           "conv_L_cache": 7, "sliding_window": 256, "eos_token_id": 124_900,
           **{k: v for k, v in cfg.items() if v is not None}}
    num_layers = int(cfg["num_hidden_layers"])
    if not isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0
                              else "conv" for i in range(num_layers)]
    if not isinstance(cfg.get("rope_parameters"), dict) or not cfg["rope_parameters"]:
        cfg["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                  "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                                     "partial_rotary_factor": 0.5}}
    # (A kind without its own base takes the config's rope_theta, else 1,000,000; without its own share,
    # the config's partial_rotary_factor where stated, as transformers fills them in.)
    top = {"rope_theta": float(cfg.get("rope_theta") or 1_000_000.0),
           **({"partial_rotary_factor": cfg["partial_rotary_factor"]} if "partial_rotary_factor" in cfg else {})}
    cfg["rope_parameters"] = {kind: {**top, **value} if isinstance(value, dict) else value
                              for kind, value in cfg["rope_parameters"].items()}
    cfg.pop("partial_rotary_factor", None)  # (the kinds' own now: the full layers' proportional RoPE reads it)
    local = cfg["rope_parameters"].get("sliding_attention")
    if isinstance(local, dict) and float(local.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("Lfm3ForCausalLM's windowed layers turn whole heads (transformers' plain RoPE there cannot "
                         f"turn a share), got partial_rotary_factor {local['partial_rotary_factor']}")
    missing = sorted({kind for kind in cfg["layer_types"] if kind != "conv"
                      and not isinstance(cfg["rope_parameters"].get(kind), dict)})
    if missing:
        raise ValueError(f"Lfm3ForCausalLM's rope_parameters must give one dict per attention kind, got none for "
                         f"{missing}")
    return {**cfg, "rms_norm_eps": float(cfg.get("norm_eps", cfg.get("rms_norm_eps", 1e-5))),
            "tie_word_embeddings": bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)))}


def _lfm2_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """LFM2's short-convolution layers (layer_types "conv") and their geometry; LFM3's windowed
    attention layers' plain RoPE."""
    if arch not in LFM2_ARCHITECTURES:
        return {}
    kinds = cfg["layer_types"]
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {num_layers}")
    lfm3 = arch == "Lfm3ForCausalLM"
    served = ("conv", "full_attention", "sliding_attention") if lfm3 else ("conv", "full_attention")
    unknown = sorted({k for k in kinds if k not in served})
    if unknown:
        raise ValueError(f"layer_types: {'LFM3' if lfm3 else 'LFM2'}'s layers are {' or '.join(map(repr, served))}, "
                         f"got {unknown}")
    fields: dict[str, Any] = {}
    if lfm3 and "sliding_attention" in kinds:
        fields["local_rope_theta"] = _local_rope_theta(arch, cfg, 10_000.0)
    if "conv" not in kinds:
        return fields
    conv = ShortConvConfig(int(cfg["hidden_size"]), int(cfg.get("conv_L_cache", 3)), bool(cfg.get("conv_bias", False)))
    return dict(**fields, mamba=conv, mamba_layers=tuple(kind == "conv" for kind in kinds))


def _falcon_h1_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Falcon-H1's config with transformers' FalconH1Config defaults for the keys it may leave out, and
    its Mamba-2 heads' width resolved: mamba_d_ssm channels (expand x hidden where null; the heads'
    mamba_n_heads x mamba_d_head where the key is absent and they are given, else transformers'
    1024) over mamba_n_heads where mamba_d_head is "auto"."""
    cfg = {"rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "num_key_value_heads": 8,
           **{k: v for k, v in cfg.items() if v is not None or k == "mamba_d_ssm"}}
    hidden, heads = int(cfg["hidden_size"]), int(cfg.get("mamba_n_heads", 128))
    if "mamba_d_ssm" in cfg:
        width = int(cfg["mamba_d_ssm"]) if cfg["mamba_d_ssm"] is not None else int(cfg.get("mamba_expand", 2)) * hidden
    else:
        width = 1024 if cfg.get("mamba_d_head", "auto") == "auto" else heads * int(cfg["mamba_d_head"])
    if cfg.get("mamba_d_head", "auto") == "auto":
        cfg["mamba_d_head"] = width // heads
    if heads * int(cfg["mamba_d_head"]) != width:
        raise ValueError(f"Falcon-H1's Mamba-2 geometry: mamba_n_heads ({heads}) x mamba_d_head "
                         f"({cfg['mamba_d_head']}) must be mamba_d_ssm ({width})")
    return cfg


def _falcon_h1_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Falcon-H1's Mamba-2 mixer (beside attention in every layer; its optional gated norm and
    out_proj's own bias, projectors_bias) and its embedding and LM-head multipliers (the others, by
    which its projections' outputs are scaled, are folded into their weights as the checkpoint is
    read: FalconH1ForCausalLM)."""
    if arch != "FalconH1ForCausalLM":
        return {}
    mamba = _mamba2_from_dict(cfg, int(cfg["hidden_size"]), {
        "num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "num_groups": "mamba_n_groups",
        "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
        "expand": "mamba_expand", "conv_bias": "mamba_conv_bias", "proj_bias": "mamba_proj_bias"}, {
        "num_heads": 128, "head_dim": "auto", "num_groups": 1, "state_size": 256, "conv_kernel": 4,
        "chunk_size": 256, "expand": 2, "conv_bias": True, "proj_bias": False})
    mamba = dataclasses.replace(mamba, gated_norm=bool(cfg.get("mamba_rms_norm", False)),
                                norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
                                out_proj_bias=bool(cfg.get("projectors_bias", False)))
    return {"mamba": mamba, "mamba_layers": (True,) * num_layers, "parallel_hybrid": True,
            "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "logits_scaling": 1.0 / float(cfg.get("lm_head_multiplier", 1.0))}


def _llama4_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's config as transformers' Llama4TextConfig reads it: the experts' width (its
    intermediate_size, 8192 by default) kept as moe_intermediate_size, the dense layers' MLP
    (intermediate_size_mlp, 16384) as intermediate_size; the layers that rotate (no_rope_layers: 1
    where a layer rotates; by default all but every no_rope_layer_interval-th) and those of routed
    experts (moe_layers; by default every interleave_moe_layer_step-th from its last)."""
    chunk = cfg.get("attention_chunk_size", 8192)  # (null: no chunks, every layer attends fully)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    layers = int(cfg.get("num_hidden_layers") or 48)
    interval, step = int(cfg.get("no_rope_layer_interval") or 4), int(cfg.get("interleave_moe_layer_step") or 1)
    rotating = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    moe_layers = cfg.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, layers, step))
    if len(rotating) != layers:
        raise ValueError(f"no_rope_layers lists {len(rotating)} layers, the model has {layers}")
    # The chunked layers: layer_types' "chunked_attention" ones where it is given, else the rotating ones.
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = ["chunked_attention" if rotate and chunk else "full_attention" for rotate in rotating]
    if len(kinds) != layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {layers}")
    return {**cfg, "num_hidden_layers": layers, "no_rope_layers": list(rotating), "moe_layers": list(moe_layers),
            "attention_chunk_size": int(chunk or 0), "layer_types": list(kinds),
            "moe_intermediate_size": int(cfg.get("intermediate_size") or 8192),
            "intermediate_size": int(cfg.get("intermediate_size_mlp") or 16384)}


def _llama4_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's rotating layers, its no-position layers' query temperature (attn_scale, floor_scale)
    and its chunked attention's chunk (attention_chunk_size: the longest context served)."""
    if arch != "Llama4ForCausalLM":
        return {}
    chunk = int(cfg["attention_chunk_size"])  # (0: none)
    return {"rope_layers": tuple(bool(r) for r in cfg["no_rope_layers"]),
            "llama4_temperature": ((float(cfg.get("attn_scale", 0.1)), int(cfg.get("floor_scale", 8192)))
                                   if cfg.get("attn_temperature_tuning", True) else None),
            "attention_chunk_size": chunk or None,
            "chunked_attention_layers": tuple(kind == "chunked_attention" for kind in cfg["layer_types"])}


def _afmoe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """AFMoE's layer kinds as transformers' AfmoeConfig reads them: where layer_types is absent, every
    global_attn_every_n_layers-th layer full, the others windowed. Its released remote code's routing
    keys, where a config carries them, must say what transformers runs (sigmoid scores, renormalised,
    one group)."""
    if cfg.get("score_func", "sigmoid") != "sigmoid" or cfg.get("route_norm", True) is False \
            or int(cfg.get("n_group") or 1) != 1:
        raise ValueError("AfmoeForCausalLM is served with sigmoid routing (score_func), renormalised (route_norm) "
                         f"in one group (n_group), got {cfg.get('score_func')!r}, {cfg.get('route_norm')!r}, "
                         f"{cfg.get('n_group')!r}")
    if isinstance(cfg.get("layer_types"), list):
        return cfg
    every = int(cfg.get("global_attn_every_n_layers") or 4)
    return {**cfg, "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention"
                                   for i in range(int(cfg["num_hidden_layers"]))]}


def _afmoe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """AFMoE's windowed layers rotate (the full ones attend without positions: ModelConfig.rope_layers),
    with a window where sliding_window is set; under mup_enabled the embeddings times sqrt(hidden_size)."""
    if arch != "AfmoeForCausalLM":
        return {}
    return {"rope_layers": tuple(kind == "sliding_attention" for kind in cfg["layer_types"]),
            "embedding_multiplier": float(cfg["hidden_size"]) ** 0.5 if cfg.get("mup_enabled") else 1.0}


def _laguna_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Laguna's and Mellum's layer kinds and RoPE as transformers' LagunaConfig / MellumConfig read them:
    every layer full where layer_types is absent; mlp_layer_types "dense" or "sparse" (Laguna: the
    first dense, the others sparse; Mellum: all sparse); rope_parameters one dict per layer kind (the
    full layers' RoPE base 500,000 and, for Laguna, half of each head; the windowed layers' base
    10,000, whole heads), the full layers' share read as the model's partial_rotary_factor."""
    num_layers = int(cfg["num_hidden_layers"])
    laguna = arch == "LagunaForCausalLM"
    kinds = cfg["layer_types"] if isinstance(cfg.get("layer_types"), list) else ["full_attention"] * num_layers
    mlp_kinds = cfg.get("mlp_layer_types")
    if not isinstance(mlp_kinds, list):
        mlp_kinds = (["dense"] if laguna else ["sparse"]) + ["sparse"] * (num_layers - 1)
    if len(mlp_kinds) != num_layers or not set(mlp_kinds) <= {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} layers, "
                         f"got {mlp_kinds}")
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        params = {"full_attention": {"rope_type": "default", "rope_theta": 500000.0,
                                     **({"partial_rotary_factor": 0.5} if laguna else {})},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    missing = sorted({kind for kind in kinds if not isinstance(params.get(kind), dict)})
    if missing:
        raise ValueError(f"{arch}'s rope_parameters must give one dict per layer kind, got none for {missing}")
    if "sliding_attention" in kinds and not cfg.get("sliding_window"):
        # (transformers' own cache cannot be built for such layers either)
        raise ValueError(f"{arch}'s sliding_attention layers need a sliding_window")
    full = params.get("full_attention") or {}
    return {**cfg, "layer_types": kinds, "mlp_layer_types": mlp_kinds, "rope_parameters": params,
            "partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0))}


def _granite_swa_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """GraniteSWA's layer kinds and RoPE as transformers' GraniteSWAConfig reads them: every fourth layer
    from the first full, the others windowed, where layer_types is absent; layer_rope_theta a base per
    layer (0: no positions), the global base in every layer where absent. Served where each layer kind
    has one base: the full layers' is the model's, the windowed layers' their own plain RoPE (under a
    window; a scaled RoPE there is refused)."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg["layer_types"] if isinstance(cfg.get("layer_types"), list) else [
        "full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    base = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    thetas = [float(t) for t in cfg.get("layer_rope_theta") or [base] * num_layers]
    if len(thetas) != num_layers or len(kinds) != num_layers:
        raise ValueError(f"layer_rope_theta and layer_types must give one entry for each of the {num_layers} layers")
    by_kind = {kind: {t for t, k in zip(thetas, kinds, strict=True) if k == kind} for kind in set(kinds)}
    if any(len(bases) > 1 for bases in by_kind.values()):
        raise ValueError(f"{arch} is served with one RoPE base per layer kind (layer_rope_theta), got {by_kind}")
    full = next(iter(by_kind.get("full_attention", {0.0})))
    local = next(iter(by_kind.get("sliding_attention", {0.0})))
    theta = full or local or base
    two_bases = bool(full and local and full != local)
    legacy = cfg.get("rope_scaling") or {}
    scaled = (params.get("rope_type") or params.get("type") or legacy.get("rope_type") or legacy.get("type")
              or "default") != "default"
    if two_bases and (not cfg.get("sliding_window") or scaled):
        raise ValueError(f"{arch}'s windowed layers' own RoPE base needs a sliding_window and plain RoPE")
    rope = {**params, "rope_theta": theta} if params else None
    return {**cfg, "layer_types": kinds, "layer_rope_theta": thetas, "rope_theta": theta,
            **({"rope_parameters": rope} if rope else {}),
            "local_rope_theta": local if two_bases else None}


def _granite_swa_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """GraniteSWA's layers without positions (a base of 0), its windowed layers' own base (its sinks:
    ModelConfig.attention_sinks)."""
    if arch not in GRANITE_SWA_ARCHITECTURES:
        return {}
    return {"rope_layers": tuple(bool(t) for t in cfg["layer_rope_theta"]),
            **({"local_rope_theta": cfg["local_rope_theta"]} if cfg.get("local_rope_theta") else {})}


def _mimo_v2_flash_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiMo-V2-Flash's keys as transformers' MiMoV2FlashConfig reads them: the layer kinds (the first
    and every sixth layer full, the others windowed), the MLP kinds (the first dense), the RoPE per
    layer kind (a third of each head turning, 0.334, unless a kind says otherwise; the full layers'
    share read as the model's partial_rotary_factor), sliding_window_size + 1 as the window where given,
    a null routed_scaling_factor as 1."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        kinds = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    mlp_kinds = cfg.get("mlp_layer_types")
    if not isinstance(mlp_kinds, list):
        mlp_kinds = ["dense"] + ["sparse"] * (num_layers - 1)
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or not params:
        params = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    missing = sorted({kind for kind in kinds if not isinstance(params.get(kind), dict)})
    if missing:
        raise ValueError(f"MiMoV2FlashForCausalLM's rope_parameters must give one dict per layer kind, got none "
                         f"for {missing}")
    # (A kind's share: its own, else 0.334 for plain RoPE, and for a scaled one the config's top-level
    # share where stated, else whole heads, as transformers' default and scaled RoPE functions read it.)
    def share(value: dict[str, Any]) -> float:
        if (value.get("rope_type") or value.get("type") or "default") == "default":
            return float(value.get("partial_rotary_factor", 0.334))
        top = cfg.get("partial_rotary_factor")
        return float(value.get("partial_rotary_factor", 1.0 if top is None else top))

    params = {kind: {**value, "partial_rotary_factor": share(value)} for kind, value in params.items()}
    window = cfg.get("sliding_window")
    if cfg.get("sliding_window_size") is not None:
        window = int(cfg["sliding_window_size"]) + 1
    if "sliding_attention" in kinds and not window:
        raise ValueError("MiMoV2FlashForCausalLM's sliding_attention layers need a sliding_window")
    return {**cfg, "layer_types": kinds, "mlp_layer_types": mlp_kinds, "rope_parameters": params,
            "sliding_window": window, "partial_rotary_factor": float(params["full_attention"]["partial_rotary_factor"]),
            "routed_scaling_factor": 1.0 if cfg.get("routed_scaling_factor") is None else cfg["routed_scaling_factor"]}


def _mimo_v2_flash_fields(arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """MiMo-V2-Flash's values (v_head_dim wide, scaled), its windowed layers' RoPE and their caches of
    twice the KV heads."""
    if arch != "MiMoV2FlashForCausalLM":
        return {}
    local = cfg["rope_parameters"].get("sliding_attention") or {"partial_rotary_factor": 0.334}
    rotary = int(head_dim * float(local["partial_rotary_factor"]) + 1e-6)
    v_dim = int(cfg.get("v_head_dim") or head_dim)
    if not 0 < rotary <= head_dim or rotary % 2 or not 0 < v_dim <= head_dim:
        raise ValueError(f"MiMoV2FlashForCausalLM needs an even rotary width for its windowed layers and v_head_dim "
                         f"({v_dim}) no wider than head_dim ({head_dim}), got {local['partial_rotary_factor']}")
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    scale = cfg.get("attention_value_scale")
    return {"local_rope_theta": _local_rope_theta(arch, cfg, 10000.0), "local_rotary_dim": rotary,
            "v_head_dim": v_dim, "attention_value_scale": 1.0 if scale is None else float(scale),
            "attention_layer_geometry": tuple((kv_heads * (2 if kind == "sliding_attention" else 1), head_dim)
                                              for kind in cfg["layer_types"])}


def _laguna_fields(arch: str, cfg: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Laguna's and Mellum's windowed layers' plain RoPE (its base, and Laguna's share of each head;
    Mellum's rotates whole heads), Laguna's per-layer query heads and its router's soft cap."""
    if arch not in LAGUNA_ARCHITECTURES:
        return {}
    local = cfg["rope_parameters"].get("sliding_attention") or {}
    share = float(local.get("partial_rotary_factor", 1.0))
    rotary = int(head_dim * share + 1e-6)
    if (arch == "MellumForCausalLM" and share != 1.0) or not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(f"the windowed layers' partial_rotary_factor must give an even rotary width for {arch} "
                         f"(whole heads for Mellum), got {share}")
    fields: dict[str, Any] = {"local_rope_theta": _local_rope_theta(arch, cfg, 10000.0), "local_rotary_dim": rotary}
    if arch == "LagunaForCausalLM":
        heads = cfg.get("num_attention_heads_per_layer")
        if isinstance(heads, list):
            kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
            if len(heads) != int(cfg["num_hidden_layers"]) or any(int(h) % kv_heads for h in heads):
                raise ValueError(f"num_attention_heads_per_layer must give, for each layer, a multiple of "
                                 f"num_key_value_heads ({kv_heads}), got {heads}")
            fields["layer_num_attention_heads"] = tuple(int(h) for h in heads)
        fields["moe_router_logit_softcapping"] = float(cfg.get("moe_router_logit_softcapping") or 0.0)
    return fields


def _exaone4_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0's layer kinds as transformers' Exaone4Config reads them: a window of sliding_window
    (4096 where the key is absent; none where it is null) on the layers layer_types names, else on
    all but every sliding_window_pattern-th (4; as released a string, "LLLG": L windowed, G full);
    without a window every layer attends fully. Its windowed layers rotate and its full ones attend
    without positions where it has a window (ModelConfig.rope_layers), every layer rotates without."""
    window = cfg.get("sliding_window", 4096)
    layers = int(cfg.get("num_hidden_layers") or 32)
    kinds = cfg.get("layer_types")
    if not window:
        kinds = ["full_attention"] * layers
    elif not isinstance(kinds, list):
        pattern = cfg.get("sliding_window_pattern", 4)
        if isinstance(pattern, str):
            kinds = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                     for i in range(layers)]
        else:
            kinds = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    return {**cfg, "sliding_window": window or None, "layer_types": kinds}


def _exaone4_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0's, K-EXAONE's and Kolibri 1's windowed layers rotate and their full ones attend without
    positions, where the model has a window; Flint's alike, whatever the window; Beam's alike, unless
    its windowed layers' rope parameters are null (then none rotates)."""
    if arch == "BeamForCausalLM":
        return {"rope_layers": tuple(kind == "sliding_attention" and cfg["beam_windowed_rotate"]
                                     for kind in cfg["layer_types"])}
    if arch == "FlintForCausalLM" or (arch in (*EXAONE_ARCHITECTURES, "Kolibri1ForCausalLM")
                                      and cfg.get("sliding_window")):
        return {"rope_layers": tuple(kind == "sliding_attention" for kind in cfg["layer_types"])}
    return {}


def _kolibri1_flint_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Kolibri 1's and Flint's layer kinds as transformers' configs default them (Kolibri: every fifth
    layer full; Flint: the first two, every fourth from the second and the last full); windowed layers
    without a window refused, as transformers refuses them (Kolibri) or cannot build their cache."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if not isinstance(kinds, list):
        full = ((lambda i: (i + 1) % 5 == 0) if arch == "Kolibri1ForCausalLM"
                else (lambda i: i < 2 or i % 4 == 1 or i == num_layers - 1))
        kinds = ["full_attention" if full(i) else "sliding_attention" for i in range(num_layers)]
    if "sliding_attention" in kinds and not cfg.get("sliding_window"):
        raise ValueError(f"{arch}'s sliding_attention layers need a positive sliding_window")
    return {**cfg, "layer_types": kinds}


def _cohere_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A Cohere config as transformers' CohereConfig / Cohere2Config read it: their defaults for the keys
    a config leaves out, layer_norm_eps as the norms' epsilon; Cohere2's heads hidden / heads wide
    whatever the file says, and its layer kinds from sliding_window_pattern (three windowed layers of
    four by default) where layer_types is absent."""
    cfg = {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528, "num_hidden_layers": 40,
           "num_attention_heads": 64, "max_position_embeddings": 8192, "tie_word_embeddings": True,
           "logit_scale": 0.0625, **({"sliding_window": 4096} if arch == "Cohere2ForCausalLM" else {}),
           **{k: v for k, v in cfg.items() if v is not None}}
    if arch == "Cohere2ForCausalLM":
        cfg["head_dim"] = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
        if not isinstance(cfg.get("layer_types"), list):
            pattern = int(cfg.get("sliding_window_pattern") or 4)
            cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(int(cfg["num_hidden_layers"]))]
    return cfg


def _cohere2_moe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Cohere2-MoE config as transformers' Cohere2MoeConfig reads it: its defaults for the keys a config
    leaves out (a null sliding_window kept: no window); where layer_types is absent, the first
    first_k_dense_replace layers windowed but every prefix_dense_sliding_window_pattern-th, the others
    but every sliding_window_pattern-th; mlp_layer_types dense for those first layers; the dense MLPs
    prefix_dense_intermediate_size wide (intermediate_size where unset), the experts intermediate_size;
    RMSNorms where rms_norm_eps is set (``cohere_norm``), else LayerNorms of layer_norm_eps."""
    window = cfg.get("sliding_window", 4096)
    cfg = {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528, "num_hidden_layers": 40,
           "num_attention_heads": 64, "head_dim": 128, "max_position_embeddings": 8192, "tie_word_embeddings": True,
           "logit_scale": 0.0625, "layer_norm_eps": 1e-5, "num_experts": 8, "num_experts_per_tok": 2,
           **{k: v for k, v in cfg.items() if v is not None}, "sliding_window": window}
    num_layers, first = int(cfg["num_hidden_layers"]), int(cfg.get("first_k_dense_replace") or 0)
    if not isinstance(cfg.get("layer_types"), list):
        prefix = int(cfg.get("prefix_dense_sliding_window_pattern") or 1)
        pattern = int(cfg.get("sliding_window_pattern") or 4)
        cfg["layer_types"] = ([("sliding_attention" if (i + 1) % prefix else "full_attention") for i in range(first)]
                              + [("sliding_attention" if (i + 1) % pattern else "full_attention")
                                 for i in range(num_layers - first)])
    if not isinstance(cfg.get("mlp_layer_types"), list):
        cfg["mlp_layer_types"] = ["dense" if i < first else "sparse" for i in range(num_layers)]
    rms = cfg.get("rms_norm_eps") is not None
    return {**cfg, "moe_intermediate_size": int(cfg["intermediate_size"]),
            "intermediate_size": int(cfg.get("prefix_dense_intermediate_size") or cfg["intermediate_size"]),
            "cohere_norm": "rms" if rms else "layer",
            "rms_norm_eps": float(cfg["rms_norm_eps" if rms else "layer_norm_eps"])}


def _cohere_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Cohere's logit scale (as the logits' divisor), and Cohere2's RoPE only in its windowed layers."""
    if arch == "Cohere2MoeForCausalLM":  # (its windowed layers rotate, and under a prefix pattern of 1 its dense ones)
        forced = int(cfg.get("prefix_dense_sliding_window_pattern") or 1) == 1
        windowed = bool(cfg.get("sliding_window"))
        return {"logits_scaling": 1.0 / float(cfg["logit_scale"]),
                "rope_layers": tuple((kind == "sliding_attention" and windowed) or (mlp == "dense" and forced)
                                     for kind, mlp in zip(cfg["layer_types"], cfg["mlp_layer_types"], strict=True))}
    if arch not in COHERE_ARCHITECTURES:
        return {}
    fields: dict[str, Any] = {"logits_scaling": 1.0 / float(cfg["logit_scale"])}
    if arch == "Cohere2ForCausalLM":
        fields["rope_layers"] = tuple(kind == "sliding_attention" for kind in cfg["layer_types"])
    return fields


def _gpt_neox_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX config's RoPE under the names the other families use, as transformers' GPTNeoXConfig
    reads them: rotary_pct (a quarter of each head by default) and rotary_emb_base, where no
    rope_parameters state them."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}

    def first(*values: Any) -> Any:
        return next(value for value in values if value is not None)

    return {**cfg, "partial_rotary_factor": first(params.get("partial_rotary_factor"), cfg.get("rotary_pct"), 0.25),
            "rope_theta": first(params.get("rope_theta"), cfg.get("rotary_emb_base"), 10000.0),
            "num_key_value_heads": cfg.get("num_attention_heads")}


# GPT-2's names of the config keys (GPT-2, GPTBigCode and GPT-J configs) -> the other families'.
_GPT_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_positions": "max_position_embeddings", "n_inner": "intermediate_size",
             "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"}
# transformers' defaults for the keys a config of the GPT family may leave out.
_GPT_DEFAULTS = {
    "GPT2LMHeadModel": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                        "activation_function": "gelu_new", "tie_word_embeddings": True},
    "GPTBigCodeForCausalLM": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                              "activation_function": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "CodeGenForCausalLM": {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                           "rotary_dim": 64, "activation_function": "gelu_new", "tie_word_embeddings": False},
    "GPTJForCausalLM": {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16,
                        "rotary_dim": 64, "activation_function": "gelu_new", "tie_word_embeddings": False},
}


def _gpt_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A GPT-2, GPTBigCode or GPT-J config in the other families' key names, as transformers reads it:
    its defaults, an MLP 4 x n_embd wide where n_inner is unset, biases on every projection (GPT-J's
    attention has none), GPTBigCode's one KV head under multi_query, GPT-J's rotary_dim as a share of
    each head (a null one refused: transformers would rotate over the hidden width)."""
    if arch in ("GPTJForCausalLM", "CodeGenForCausalLM") and "rotary_dim" in cfg and cfg["rotary_dim"] is None:
        raise ValueError(f"{arch} with rotary_dim null (RoPE over the whole hidden width, as transformers "
                         "reads it) is not served")
    cfg = {**_GPT_DEFAULTS[arch], "layer_norm_epsilon": 1e-5, **{k: v for k, v in cfg.items() if v is not None}}
    cfg = {**cfg, **{ours: cfg[theirs] for theirs, ours in _GPT_KEYS.items() if theirs in cfg}}
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    cfg.setdefault("intermediate_size", 4 * hidden)
    if arch == "CodeGenForCausalLM" and int(cfg["n_embd"]) % 4:
        raise ValueError(f"CodeGenForCausalLM's hidden width ({cfg['n_embd']}) must split into its 4 q/k/v blocks")
    if arch in ("GPTJForCausalLM", "CodeGenForCausalLM"):  # (CodeGen: GPT-J's layers)
        return {**cfg, "partial_rotary_factor": int(cfg["rotary_dim"]) / (hidden // heads),
                "attention_bias": False, "mlp_bias": True, "num_key_value_heads": heads}
    if cfg.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError(f"scale_attn_by_inverse_layer_idx (scores scaled down by each layer's number) is not "
                         f"served for {arch}")
    multi_query = arch == "GPTBigCodeForCausalLM" and bool(cfg.get("multi_query", True))
    return {**cfg, "attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1 if multi_query else heads}


def _longcat_flash_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """LongCat-Flash's keys as ours: transformers' LongcatFlashConfig defaults for what a config leaves out;
    its num_layers layers served as twice as many half-layers (an attention and a dense MLP of
    ffn_hidden_size each); its query and key heads as wide as qk_nope_head_dim + qk_rope_head_dim."""
    zero_experts = cfg.get("zero_expert_num", 256)  # (a null: none, as transformers' model reads it)
    if cfg.get("num_layers") is None and cfg.get("num_hidden_layers") is not None:  # (transformers' alias)
        cfg = {**cfg, "num_layers": int(cfg["num_hidden_layers"]) // 2}
    if cfg.get("ffn_hidden_size") is None and cfg.get("intermediate_size") is not None:
        cfg = {**cfg, "ffn_hidden_size": cfg["intermediate_size"]}
    cfg = {"vocab_size": 131072, "hidden_size": 6144, "num_layers": 28, "num_attention_heads": 64,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "ffn_hidden_size": 12288,
           "bos_token_id": 1, "eos_token_id": 2, **{k: v for k, v in cfg.items() if v is not None},
           "zero_expert_num": zero_experts or 0}
    if cfg.get("router_bias"):  # (transformers' router builds the bias and never adds it)
        raise ValueError("LongcatFlashForCausalLM with router_bias is not served (transformers' router ignores it)")
    nope, rope = int(cfg.get("qk_nope_head_dim") or 128), int(cfg.get("qk_rope_head_dim") or 64)
    for key in ("mla_scale_q_lora", "mla_scale_kv_lora"):  # (its remote code's switches: transformers always scales)
        if cfg.get(key) is False:
            raise ValueError(f"LongcatFlashForCausalLM with {key} false is not served (transformers always scales)")
    if cfg.get("zero_expert_type", "identity") != "identity":
        raise ValueError(f"LongcatFlashForCausalLM's zero experts are served as identities, not "
                         f"{cfg['zero_expert_type']!r}")
    if cfg.get("qk_head_dim") is not None and int(cfg["qk_head_dim"]) != nope + rope:
        raise ValueError(f"LongcatFlashForCausalLM's qk_head_dim ({cfg['qk_head_dim']}) must be qk_nope_head_dim + "
                         f"qk_rope_head_dim ({nope + rope})")
    return {**cfg, "num_hidden_layers": 2 * int(cfg["num_layers"]), "intermediate_size": int(cfg["ffn_hidden_size"]),
            "rope_interleave": True}


def _jetmoe_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """JetMoE's keys as ours, from transformers' JetMoeConfig names or, as jetmoe-8b's remote code wrote them,
    moe_num_experts, moe_top_k and ffn_hidden_size: heads of kv_channels, each token's query heads
    num_key_value_heads for each of its num_experts_per_tok attention experts (a stated num_attention_heads
    must say so), the experts' activation activation_function (silu: FusedMoE's); its remote code's glu
    and bias switches off are refused (transformers' model has both)."""
    aliases = {"num_local_experts": "moe_num_experts", "num_experts_per_tok": "moe_top_k",
               "intermediate_size": "ffn_hidden_size"}
    cfg = {**cfg, **{ours: cfg[theirs] for ours, theirs in aliases.items()
                     if cfg.get(ours) is None and cfg.get(theirs) is not None}}
    cfg.setdefault("intermediate_size", 5632)
    for switch in ("glu", "bias"):
        if cfg.get(switch) is False:
            raise ValueError(f"JetMoeForCausalLM with {switch} false is not served (transformers' model has them)")
    kv_heads, top_k = int(cfg["num_key_value_heads"]), int(cfg.get("num_experts_per_tok") or 2)
    if cfg.get("num_attention_heads") is not None and int(cfg["num_attention_heads"]) != kv_heads * top_k:
        raise ValueError(f"JetMoeForCausalLM's num_attention_heads ({cfg['num_attention_heads']}) must be "
                         f"num_key_value_heads x num_experts_per_tok ({kv_heads * top_k})")
    act = cfg.get("activation_function") or "silu"
    if act != "silu":
        raise ValueError(f"JetMoeForCausalLM's experts are served with activation_function 'silu', not {act!r}")
    return {**cfg, "head_dim": int(cfg["kv_channels"]), "num_attention_heads": kv_heads * top_k, "hidden_act": act}


def _gpt_neo_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A GPT-Neo config in the other families' key names, as transformers' GPTNeoConfig reads it: its
    defaults, the layer kinds from attention_layers (or attention_types expanded: [kinds, repeats]
    pairs; "local" layers windowed by window_size), an MLP 4 x hidden_size wide where unset, q/k/v
    without biases beside a biased out_proj and MLP."""
    cfg = {"vocab_size": 50257, "max_position_embeddings": 2048, "hidden_size": 2048, "num_layers": 24,
           "num_heads": 16, "window_size": 256, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
           "tie_word_embeddings": True, "eos_token_id": 50256, **{k: v for k, v in cfg.items() if v is not None}}
    kinds = cfg.get("attention_layers")
    if not isinstance(kinds, list):
        kinds = [kind for kinds_, repeats in cfg.get("attention_types") or [[["global", "local"], 12]]
                 for _ in range(int(repeats)) for kind in kinds_]
    num_layers, hidden, heads = int(cfg["num_layers"]), int(cfg["hidden_size"]), int(cfg["num_heads"])
    if len(kinds) != num_layers or not set(kinds) <= {"global", "local"}:
        raise ValueError(f"GPT-Neo's attention_layers must name 'global' or 'local' for each of its {num_layers} "
                         f"layers, got {kinds}")
    return {**cfg, "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden),
            "hidden_act": cfg["activation_function"],
            "rms_norm_eps": float(cfg["layer_norm_epsilon"]), "sliding_window": int(cfg["window_size"]),
            "layer_types": ["sliding_attention" if kind == "local" else "full_attention" for kind in kinds],
            "attention_bias": False, "mlp_bias": True}


# transformers' OPTConfig defaults for the keys a config may leave out.
_OPT_DEFAULTS = {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
                 "max_position_embeddings": 2048, "num_attention_heads": 12, "activation_function": "relu",
                 "enable_bias": True, "tie_word_embeddings": True}


def _modernbert_decoder_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """ModernBERT's decoder config in the other families' key names, with transformers'
    ModernBertDecoderConfig defaults: multi-head attention, its layer kinds (every third layer from the
    first full, where layer_types is absent) and their windows (local_attention // 2), a GeGLU MLP of
    hidden_activation, LayerNorms of norm_eps (biases by norm_bias); the head's activation exact or tanh
    GELU; default RoPE only (global base 160,000 on the full layers, local 10,000 on the others)."""
    # (A key a config states, null included, wins: a null eos_token_id is none.)
    cfg = {"vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152, "num_hidden_layers": 22,
           "num_attention_heads": 12, "max_position_embeddings": 8192, "norm_eps": 1e-5, "local_attention": 128,
           "hidden_activation": "gelu", "tie_word_embeddings": True, "pad_token_id": 50283, "bos_token_id": 50281,
           "eos_token_id": 50282, **cfg}
    if not cfg["local_attention"]:  # (transformers' window would be -1, its mask then wrong)
        raise ValueError("ModernBertDecoderForCausalLM needs a local_attention window for its windowed layers")
    kinds, thetas = _modernbert_kinds_and_bases("ModernBertDecoderForCausalLM", cfg)
    if cfg.get("classifier_activation", "gelu") not in ("gelu", "gelu_pytorch_tanh"):
        raise ValueError(f"ModernBertDecoderForCausalLM's head activation must be 'gelu' or 'gelu_pytorch_tanh', "
                         f"got {cfg['classifier_activation']!r}")
    window = cfg["local_attention"]
    return {**cfg, "num_key_value_heads": int(cfg["num_attention_heads"]), "hidden_act": cfg["hidden_activation"],
            "rms_norm_eps": float(cfg["norm_eps"]), "layer_types": kinds,
            "sliding_window": int(window) // 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": thetas["full_attention"]},
            "modernbert_local_rope_theta": thetas["sliding_attention"]}


def _biogpt_xglm_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """BioGPT's and XGLM's configs in the other families' key names, with transformers' defaults for what a
    config leaves out: OPT's layer (LayerNorms of epsilon 1e-5 before attention and an ungated MLP, biases
    everywhere) over multi-head attention; XGLM's names d_model, ffn_dim, attention_heads, num_layers."""
    if arch == "XGLMForCausalLM":
        aliases = {"d_model": "hidden_size", "num_layers": "num_hidden_layers",
                   "attention_heads": "num_attention_heads"}
        cfg = {**cfg, **{theirs: cfg[ours] for theirs, ours in aliases.items()  # (transformers' attribute map)
                         if cfg.get(theirs) is None and cfg.get(ours) is not None}}
        cfg = {"vocab_size": 256008, "max_position_embeddings": 2048, "d_model": 1024, "ffn_dim": 4096,
               "num_layers": 24, "attention_heads": 16, "activation_function": "gelu", "scale_embedding": True,
               "tie_word_embeddings": True, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
               **{k: v for k, v in cfg.items() if v is not None}}
        cfg = {**cfg, "hidden_size": cfg["d_model"], "intermediate_size": cfg["ffn_dim"],
               "num_hidden_layers": cfg["num_layers"], "num_attention_heads": cfg["attention_heads"],
               "hidden_act": cfg["activation_function"]}
    else:
        cfg = {"vocab_size": 42384, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
               "intermediate_size": 4096, "hidden_act": "gelu", "max_position_embeddings": 1024,
               "scale_embedding": True, "tie_word_embeddings": True, "pad_token_id": 1, "bos_token_id": 0,
               "eos_token_id": 2, **{k: v for k, v in cfg.items() if v is not None}}
    return {**cfg, "num_key_value_heads": int(cfg["num_attention_heads"]), "attention_bias": True, "mlp_bias": True,
            "rms_norm_eps": 1e-5}


def _opt_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """An OPT config in the other families' key names (ffn_dim, activation_function, enable_bias), as
    transformers reads it; opt-350m's layout (norms after each sublayer, embeddings projected in and
    out) refused."""
    cfg = {**_OPT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    refused = {"do_layer_norm_before": (True, "norms after each sublayer (opt-350m's)"),
               "_remove_final_layer_norm": (False, "no final norm"),
               "layer_norm_elementwise_affine": (True, "LayerNorms without weights"),
               "word_embed_proj_dim": (cfg["hidden_size"], "embeddings projected in and out (opt-350m's)")}
    for key, (served, what) in refused.items():
        if cfg.get(key, served) != served:
            raise ValueError(f"OPTForCausalLM with {key}={cfg[key]!r} ({what}) is not served")
    heads, bias = int(cfg["num_attention_heads"]), bool(cfg["enable_bias"])
    return {**cfg, "intermediate_size": cfg["ffn_dim"], "hidden_act": cfg["activation_function"],
            "attention_bias": bias, "mlp_bias": bias, "num_key_value_heads": heads, "rms_norm_eps": 1e-5}


# transformers' FalconConfig defaults for the keys a config may leave out.
_FALCON_DEFAULTS = {"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
                    "layer_norm_epsilon": 1e-5, "multi_query": True, "parallel_attn": True, "bias": False,
                    "max_position_embeddings": 2048, "activation": "gelu", "tie_word_embeddings": True}


def _falcon_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Falcon config in the other families' key names, as transformers' FalconConfig reads it: its
    KV heads (num_kv_heads under new_decoder_architecture or without multi_query, else one), its MLP
    (ffn_hidden_size, 4 x hidden where unset; activation), its biases (bias); ALiBi (falcon-rw's) is
    _alibi_fields'."""
    cfg = {**_FALCON_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    if "n_embed" in cfg:
        cfg["hidden_size"] = cfg["n_embed"]
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    kv = int(cfg.get("num_kv_heads") or heads)
    kv = kv if cfg.get("new_decoder_architecture") or not cfg["multi_query"] else 1
    return {**cfg, "num_key_value_heads": kv, "intermediate_size": int(cfg.get("ffn_hidden_size") or 4 * hidden),
            "hidden_act": cfg["activation"], "attention_bias": bool(cfg["bias"]), "mlp_bias": bool(cfg["bias"]),
            "rms_norm_eps": float(cfg["layer_norm_epsilon"])}


# transformers' BloomConfig defaults for the keys a config may leave out, and its names of ours.
_BLOOM_DEFAULTS = {"vocab_size": 250880, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                   "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
_BLOOM_KEYS = {"n_embed": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads"}


def _bloom_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A BLOOM config in the other families' key names, as transformers' BloomConfig reads it (n_layer,
    n_head, n_embed): an MLP 4 x hidden wide of tanh gelu, biases everywhere, 2048 positions (its
    training length) unless seq_length says; the residual taken after the norm
    (apply_residual_connection_post_layernorm, which no released BLOOM sets) refused."""
    given = {k: v for k, v in cfg.items() if v is not None}
    cfg = {**_BLOOM_DEFAULTS, **given,
           **{ours: given[theirs] for theirs, ours in _BLOOM_KEYS.items() if theirs in given}}
    if cfg.get("apply_residual_connection_post_layernorm"):
        raise ValueError("BloomForCausalLM with apply_residual_connection_post_layernorm (the residual taken after "
                         "each norm) is not served")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return {**cfg, "num_key_value_heads": heads, "intermediate_size": 4 * hidden, "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": True, "mlp_bias": True, "rms_norm_eps": float(cfg["layer_norm_epsilon"]),
            "max_position_embeddings": int(cfg.get("seq_length") or 2048)}


# transformers' MptConfig and MptAttentionConfig defaults for the keys a config may leave out; MosaicML's
# own code (the MPTForCausalLM checkpoints') defaults to learned positions and biases instead.
_MPT_DEFAULTS = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "expansion_ratio": 4, "max_seq_len": 2048,
                 "vocab_size": 50368, "layer_norm_epsilon": 1e-5, "no_bias": True, "tie_word_embeddings": True}
_MPT_ATTENTION_DEFAULTS = {"attn_type": "multihead_attention", "clip_qkv": None, "softmax_scale": None,
                           "prefix_lm": False, "qk_ln": False, "alibi": True, "alibi_bias_max": 8}
_MOSAICML_DEFAULTS = {"no_bias": False}
_MOSAICML_ATTENTION_DEFAULTS = {"alibi": False}


def _mpt_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """An MPT config in the other families' key names, as transformers' MptConfig reads it (d_model,
    n_heads, n_layers, max_seq_len; attn_config's clip_qkv, softmax_scale and alibi_bias_max), an
    ungated exact-gelu MLP expansion_ratio x d_model wide; a config of MosaicML's own code
    (MPTForCausalLM) takes that code's defaults where it leaves a key out. What no released MPT sets
    and transformers does not run is refused: biases (no_bias false), learned positions in place of
    ALiBi, a prefix LM, q/k LayerNorms, multi-query or grouped attention, a logit scale, RoPE, a
    sliding window, another MLP (ffn_type) or norm (norm_type)."""
    mosaicml = arch == "MPTForCausalLM"
    given = {k: v for k, v in cfg.items() if v is not None}
    cfg = {**_MPT_DEFAULTS, **(_MOSAICML_DEFAULTS if mosaicml else {}), **given}
    attn = {**_MPT_ATTENTION_DEFAULTS, **(_MOSAICML_ATTENTION_DEFAULTS if mosaicml else {}),
            **{k: v for k, v in (cfg.get("attn_config") or {}).items() if v is not None}}
    refused = {"no_bias": (cfg["no_bias"], True, "biases on its projections and norms"),
               "alibi": (attn["alibi"], True, "learned positions in place of ALiBi"),
               "prefix_lm": (attn["prefix_lm"], False, "a prefix LM"),
               "qk_ln": (attn["qk_ln"], False, "LayerNorms over queries and keys"),
               "attn_type": (attn["attn_type"], "multihead_attention", "multi-query or grouped attention"),
               "rope": (bool(attn.get("rope")), False, "RoPE"),
               "sliding_window_size": (attn.get("sliding_window_size", -1), -1, "a sliding window"),
               "logit_scale": (cfg.get("logit_scale"), None, "scaled logits"),
               "ffn_type": ((cfg.get("ffn_config") or {}).get("ffn_type", "mptmlp"), "mptmlp", "another MLP")}
    for key, (value, served, what) in refused.items():
        if value != served:
            raise ValueError(f"MPTForCausalLM with {key}={value!r} ({what}) is not served")
    if cfg.get("norm_type", "low_precision_layernorm") not in ("low_precision_layernorm", "layernorm"):
        raise ValueError(f"MPTForCausalLM with norm_type={cfg['norm_type']!r} (a norm other than LayerNorm) "
                         f"is not served")
    hidden, heads = int(cfg["d_model"]), int(cfg["n_heads"])
    return {**cfg, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "num_hidden_layers": int(cfg["n_layers"]), "intermediate_size": int(cfg["expansion_ratio"]) * hidden,
            "max_position_embeddings": int(cfg["max_seq_len"]), "hidden_act": "gelu", "attention_bias": False,
            "mlp_bias": False, "rms_norm_eps": float(cfg["layer_norm_epsilon"]),
            # (a clip of 0 clamps nothing: MosaicML's code and transformers test it for truth)
            "clip_qkv": attn["clip_qkv"] or None, "softmax_scale": attn["softmax_scale"],
            "alibi_bias_max": float(attn["alibi_bias_max"])}


# transformers' DbrxConfig, DbrxAttentionConfig and DbrxFFNConfig defaults for the keys a config may
# leave out.
_DBRX_DEFAULTS = {"d_model": 2048, "n_heads": 16, "n_layers": 24, "max_seq_len": 2048, "vocab_size": 32000,
                  "tie_word_embeddings": False}
_DBRX_ATTENTION_DEFAULTS = {"clip_qkv": None, "kv_n_heads": 1, "rope_theta": 10000.0}
_DBRX_FFN_DEFAULTS = {"ffn_hidden_size": 3584, "moe_num_experts": 4, "moe_top_k": 1,
                      "moe_normalize_expert_weights": 1.0}


def _dbrx_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A DBRX config in the other families' key names, as transformers' DbrxConfig reads it (d_model,
    n_heads, n_layers, max_seq_len; attn_config's kv_n_heads, clip_qkv and rope_theta; ffn_config's
    experts, their width, top k and activation); its router weights normalised by their L1 norm (as
    released) or not at all, another p-norm refused."""
    cfg = {**_DBRX_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    attn = {**_DBRX_ATTENTION_DEFAULTS, **{k: v for k, v in (cfg.get("attn_config") or {}).items() if v is not None}}
    ffn = {**_DBRX_FFN_DEFAULTS, **(cfg.get("ffn_config") or {})}
    norm = ffn["moe_normalize_expert_weights"]
    if norm not in (None, 1, 1.0):
        raise ValueError(f"DbrxForCausalLM with moe_normalize_expert_weights={norm!r} (its routing weights over "
                         f"their L{norm} norm) is not served: 1 (or none) is")
    hidden = int(cfg["d_model"])
    # The base is attn_config's (the trained one, as vLLM reads it): a config transformers 5 saved also
    # carries a rope_parameters of its own default base, 10,000, which its DBRX runs with.
    rope = {"rope_type": "default", "rope_theta": float(attn["rope_theta"])}
    return {**cfg, "hidden_size": hidden, "num_attention_heads": int(cfg["n_heads"]),
            "num_key_value_heads": int(attn["kv_n_heads"]), "num_hidden_layers": int(cfg["n_layers"]),
            "max_position_embeddings": int(cfg["max_seq_len"]), "rope_parameters": rope, "rope_scaling": None,
            "rope_theta": rope["rope_theta"],
            "clip_qkv": attn["clip_qkv"], "intermediate_size": int(ffn["ffn_hidden_size"]),
            "num_local_experts": int(ffn["moe_num_experts"]), "num_experts_per_tok": int(ffn["moe_top_k"]),
            "norm_topk_prob": norm is not None, "rms_norm_eps": 1e-5,
            "hidden_act": (ffn.get("ffn_act_fn") or {}).get("name", "silu")}


def _alibi_fields(arch: str, cfg: dict[str, Any], head_dim: int, num_layers: int) -> dict[str, Any]:
    """BLOOM's, MPT's and falcon-rw's ALiBi in place of RoPE: the slopes' alibi_bias_max (8 but where
    MPT's config says) and their scale (Falcon adds its biases before scaling the scores, so its slopes
    are scaled with them); MPT's softmax_scale; BLOOM's LayerNorm over the embeddings."""
    if arch == "BloomForCausalLM":
        return {"alibi_bias_max": 8.0, "rope_layers": (False,) * num_layers, "embedding_norm": True}
    if arch in MPT_ARCHITECTURES:
        scale = cfg.get("softmax_scale")
        return {"alibi_bias_max": cfg["alibi_bias_max"], "rope_layers": (False,) * num_layers,
                **({} if scale is None else {"attention_multiplier": float(scale)})}
    if arch == "FalconForCausalLM" and cfg.get("alibi"):
        return {"alibi_bias_max": 8.0, "alibi_slope_scale": head_dim ** -0.5, "rope_layers": (False,) * num_layers}
    return {}


def _learned_positions_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """GPT-2's, GPTBigCode's, OPT's and BioGPT's learned positions in place of RoPE (OPT's and BioGPT's
    table from its third row), XGLM's sinusoidal ones (alike), and GPT-2's unscaled scores where
    scale_attn_weights is off; BioGPT's and XGLM's token embeddings scaled by sqrt(hidden) under
    scale_embedding."""
    if arch in ("BioGptForCausalLM", "XGLMForCausalLM"):
        pad = cfg.get("pad_token_id")
        return {"learned_positions": True, "rope_layers": (False,) * num_layers, "position_offset": 2,
                "sinusoidal_positions": arch == "XGLMForCausalLM",
                "position_padding_row": None if arch != "XGLMForCausalLM" or pad is None else int(pad),
                "token_embedding_scale": math.sqrt(int(cfg["hidden_size"])) if cfg.get("scale_embedding", True)
                else 1.0}
    if arch not in LEARNED_POSITION_ARCHITECTURES:
        return {}
    return {"learned_positions": True, "rope_layers": (False,) * num_layers,
            "position_offset": 2 if arch == "OPTForCausalLM" else 0,
            # (GPT-Neo never scales its scores)
            **({} if cfg.get("scale_attn_weights", True) and arch != "GPTNeoForCausalLM"
               else {"attention_multiplier": 1.0})}


def _zamba2_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Zyphra's Zamba2 config as transformers' Zamba2Config reads it: its defaults for the keys a
    config leaves out, and what it derives whatever the file says: the shared blocks' attention over
    2 x hidden_size (heads of 2 x hidden / heads values), the MLP's width (4 x hidden where null),
    16,384 positions under use_long_context. Its attention is multi-head: the per-use adapters of q,
    k and v are each as wide as all the heads."""
    cfg = {"vocab_size": 32000, "max_position_embeddings": 4096, "num_hidden_layers": 54, "hidden_act": "gelu",
           "hidden_size": 2560, "num_attention_heads": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
           **{k: v for k, v in cfg.items() if v is not None}}
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads", heads)) != heads:
        raise ValueError(f"Zamba2's shared attention is multi-head: num_key_value_heads "
                         f"({cfg['num_key_value_heads']}) must be num_attention_heads ({heads})")
    if (2 * hidden) % heads:
        raise ValueError(f"Zamba2's attention over 2 x hidden_size ({2 * hidden}) must split into "
                         f"num_attention_heads ({heads}) heads")
    kinds = cfg.get("layers_block_type")
    if kinds is None:  # (transformers' default: Zamba2-2.7B's 54 layers)
        kinds = ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3 \
            + ["hybrid"] + ["mamba"] * 2
    # (use_long_context: transformers 5 and vLLM lengthen the positions alone; Zyphra's own code also
    # raised the RoPE base, which neither does.)
    return {**cfg, "num_hidden_layers": len(kinds), "layers_block_type": list(kinds), "num_key_value_heads": heads,
            "head_dim": 2 * hidden // heads, "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden),
            "mlp_bias": bool(cfg.get("add_bias_linear", False)),
            **({"max_position_embeddings": 16384} if cfg.get("use_long_context") else {})}


def _zamba2_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Zamba2's layers: every one a Mamba-2 mixer, the "hybrid" ones (layers_block_type) running a
    shared attention-and-MLP block first, each with a KV cache of its own; the mixers' geometry
    (head width expand x hidden over n_mamba_heads; the convolution's bias always, as transformers'
    and Zyphra's mixers have it whatever use_conv_bias says), the attention's scale
    (head_dim / 2) ** -0.5, and RoPE only under use_mem_rope."""
    if arch != "Zamba2ForCausalLM":
        return {}
    kinds = cfg["layers_block_type"]
    unknown = sorted({k for k in kinds if k not in ("mamba", "linear_attention", "hybrid")})
    if unknown:
        raise ValueError(f"layers_block_type: Zamba2's layers are 'mamba' or 'hybrid', got {unknown}")
    mamba = _mamba2_from_dict(cfg, int(cfg["hidden_size"]), {
        "num_heads": "n_mamba_heads", "head_dim": "mamba_headdim", "num_groups": "mamba_ngroups",
        "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "chunk_size": "chunk_size",
        "expand": "mamba_expand", "conv_bias": "use_conv_bias", "proj_bias": "add_bias_linear"}, {
        "num_heads": 8, "head_dim": "auto", "num_groups": 1, "state_size": 64, "conv_kernel": 4, "chunk_size": 256,
        "expand": 2, "conv_bias": True, "proj_bias": False})
    # (transformers derives the head width whatever the file says, as here.)
    width = int(float(cfg.get("mamba_expand") or 2) * int(cfg["hidden_size"]))
    mamba = dataclasses.replace(mamba, head_dim=width // mamba.num_heads, conv_bias=True)
    if mamba.intermediate_size != width:
        raise ValueError(f"Zamba2's Mamba-2 geometry: n_mamba_heads ({mamba.num_heads}) must divide "
                         f"mamba_expand x hidden_size ({width})")
    num_layers = len(kinds)
    return {"mamba": mamba, "mamba_layers": (True,) * num_layers,
            "shared_attention_layers": tuple(i for i, kind in enumerate(kinds) if kind == "hybrid"),
            "rope_layers": (bool(cfg.get("use_mem_rope", False)),) * num_layers,
            "attention_multiplier": (int(cfg["head_dim"]) / 2) ** -0.5}


def _granite_hybrid_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Granite 4.0's (and Bamba's) layer kinds (layer_types: "mamba" / "attention" as released,
    transformers 5's "linear_attention" / "full_attention"; all Mamba when absent, as transformers
    reads it), its Mamba-2 geometry, and its attention without positions unless
    position_embedding_type is "rope" (Granite 4.0-H's is "nope"; Bamba's always rotates)."""
    if arch not in ("GraniteMoeHybridForCausalLM", "BambaForCausalLM"):
        return {}
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} layers, the model has {num_layers}")
    mamba_kinds, attention_kinds = ("mamba", "linear_attention"), ("attention", "full_attention")
    unknown = sorted({k for k in kinds if k not in mamba_kinds + attention_kinds})
    if unknown:
        raise ValueError(f"layer_types: Granite 4.0's layers are 'mamba' or 'attention', got {unknown}")
    fields: dict[str, Any] = {}
    mamba_layers = tuple(kind in mamba_kinds for kind in kinds)
    if any(mamba_layers):
        hidden = int(cfg["hidden_size"])
        mamba = _mamba2_from_dict(cfg, hidden, {
            "num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "num_groups": "mamba_n_groups",
            "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv", "chunk_size": "mamba_chunk_size",
            "expand": "mamba_expand", "conv_bias": "mamba_conv_bias", "proj_bias": "mamba_proj_bias"}, {
            "num_heads": 128, "head_dim": "auto", "num_groups": 1, "state_size": 256, "conv_kernel": 4,
            "chunk_size": 256, "expand": 2, "conv_bias": True, "proj_bias": False})
        width = int(cfg.get("mamba_expand") or 2) * hidden
        if mamba.intermediate_size != width:
            raise ValueError(f"Mamba-2 geometry: mamba_n_heads ({mamba.num_heads}) x mamba_d_head ({mamba.head_dim}) "
                             f"must be mamba_expand x hidden_size ({width})")
        fields["mamba"] = mamba
        fields["mamba_layers"] = mamba_layers
    if arch == "GraniteMoeHybridForCausalLM" and cfg.get("position_embedding_type") != "rope":
        fields["rope_layers"] = (False,) * num_layers
    return fields


def _mla_fields(arch: str, cfg: dict[str, Any], scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2 / V3's, MiniCPM3's): its ranks and head widths, and
    the softmax scale (qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared under
    YaRN, as transformers' yarn_apply_mscale and vLLM fold it). The attention runs over the latent
    (see gpu_worker.models.deepseek): one KV "head" of kv_lora_rank + qk_rope_head_dim values (and
    DeepSeek Sparse Attention's indexer key after them: _dsa_fields).
    MiniCPM3's defaults are transformers' MiniCPM3Config's (its value heads hidden_size / heads wide
    where unset), its rotary values in halves as Llama's."""
    if arch not in MLA_ARCHITECTURES:
        return {}
    nope_default, rope_default, kv_lora_default, q_lora_default, v_default = _MLA_DEFAULTS[arch]
    nope = int(cfg.get("qk_nope_head_dim") or nope_default)
    rope = int(cfg.get("qk_rope_head_dim") or rope_default)
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {rope}")
    scale = (nope + rope) ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    # (DeepSeek-V2-Lite's config says null: a plain query projection)
    q_lora = cfg.get("q_lora_rank", q_lora_default)
    if arch in ("AXK1ForCausalLM", *_DSA_DEFAULTS) and not q_lora:
        # (transformers' AXK1Attention always builds q_a_proj; DSA's indexer reads its queries from it)
        raise ValueError(f"{arch} always has a query LoRA: q_lora_rank must be set")
    v_dim = cfg.get("v_head_dim") or v_default or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return dict(**_dsa_fields(arch, cfg, rope), kv_lora_rank=int(cfg.get("kv_lora_rank") or kv_lora_default),
                q_lora_rank=int(q_lora) if q_lora else 0, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                v_head_dim=int(v_dim),
                # (transformers' DeepSeek-V3.2 rotates its attention's values in pairs whatever the key says)
                # (Kimi-Linear's MLA rotates nothing: its rotary rows are read as they stand.)
                # (transformers' Ling 3 rotates in pairs whatever the key says, as its DeepSeek-V3.2 does.)
                rope_interleave=arch not in ("MiniCPM3ForCausalLM", "KimiLinearForCausalLM")
                and (arch in (*_DSA_DEFAULTS, "BailingHybridForCausalLM") or bool(cfg.get("rope_interleave", True))),
                attention_multiplier=scale)


def _dsa_fields(arch: str, cfg: dict[str, Any], rope: int) -> dict[str, Any]:
    """DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5): index_n_heads heads of index_head_dim
    values (the first qk_rope_head_dim rotated: GLM-5's in pairs) score every earlier key; each query
    attends to the index_topk best. GLM-5's layers may share a choice (transformers' indexer_types:
    "shared" layers reuse the last "full" layer's; from index_topk_pattern, or every index_topk_freq-th
    layer from index_skip_topk_offset on running its own). Not DSA: none."""
    if arch not in _DSA_DEFAULTS:
        return {}
    heads_default, dim_default, topk_default = _DSA_DEFAULTS[arch]
    heads = int(cfg.get("index_n_heads") or heads_default)
    dim = int(cfg.get("index_head_dim") or dim_default)
    topk = int(cfg.get("index_topk") or topk_default)
    if dim < rope or heads < 1 or topk < 1:
        raise ValueError(f"the indexer needs index_head_dim ({dim}) at least qk_rope_head_dim ({rope}), "
                         f"index_n_heads ({heads}) and index_topk ({topk}) at least 1")
    fields: dict[str, Any] = dict(index_n_heads=heads, index_head_dim=dim, index_topk=topk)
    if arch == "GlmMoeDsaForCausalLM":
        num_layers = int(cfg["num_hidden_layers"])
        kinds = cfg.get("indexer_types")
        pattern = cfg.get("index_topk_pattern")
        if kinds is None and pattern is not None:
            kinds = ([{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str)
                     else list(pattern))
        if kinds is None:
            every = max(int(cfg.get("index_topk_freq") or 1), 1)
            offset = int(cfg.get("index_skip_topk_offset", 2) or 0)
            kinds = ["full" if max(i - offset + 1, 0) % every == 0 else "shared" for i in range(num_layers)]
        if len(kinds) != num_layers or not set(kinds) <= {"full", "shared"} or kinds[0] != "full":
            raise ValueError(f"indexer_types must name 'full' or 'shared' for each of the {num_layers} layers, "
                             f"the first 'full' (a shared layer reuses an earlier layer's choice), got {kinds}")
        fields.update(index_rope_interleave=True, indexer_shared_layers=tuple(k == "shared" for k in kinds))
    return fields


def _dynamic_ntk_within_pretrained_length(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A config whose RoPE is dynamic NTK (InternLM's): plain RoPE within max_position_embeddings, where
    the dynamic base is the plain one (it grows only past it, as transformers and InternLM's code
    compute it); served so, the config's length the served one (logged)."""
    key = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
    scaling = cfg.get(key) or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "dynamic":
        return cfg
    logger.info("%s's dynamic NTK RoPE is served as plain RoPE, which it is within max_position_embeddings (%s)",
                arch, cfg.get("max_position_embeddings"))
    plain = {k: v for k, v in scaling.items() if k in ("rope_theta",)} if key == "rope_parameters" else None
    return {**cfg, key: plain}


def _internlm_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """InternLM2's and InternLM3's config keys as ours: their remote code's defaults (InternLM2: a bias
    on wqkv and wo unless ``bias`` is false; InternLM3: q/k/v biases by ``qkv_bias``, the output
    projection's by ``bias``), RMSNorm epsilon 1e-6, untied."""
    cfg = {"vocab_size": 103168, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
           "tie_word_embeddings": False, **{k: v for k, v in cfg.items() if v is not None}}
    if arch == "InternLM2ForCausalLM":
        cfg = {**cfg, "attention_bias": bool(cfg.get("bias", True)), "attention_out_bias": bool(cfg.get("bias", True))}
    else:
        cfg = {**cfg, "attention_bias": bool(cfg.get("qkv_bias", False)),
               "attention_out_bias": bool(cfg.get("bias", False))}
    return _dynamic_ntk_within_pretrained_length(arch, cfg)


def _exaone_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 3.x's config keys as ours (num_layers, layer_norm_epsilon, activation_function), with its
    remote code's defaults: an MLP four times the width where intermediate_size is unset, epsilon 1e-6,
    tied embeddings."""
    cfg = {k: v for k, v in cfg.items() if v is not None}
    hidden = int(cfg.get("hidden_size", 2048))
    return {"vocab_size": 102400, "hidden_size": hidden, "num_attention_heads": 32, "max_position_embeddings": 2048,
            "tie_word_embeddings": True, **cfg,
            "num_hidden_layers": int(cfg.get("num_layers", cfg.get("num_hidden_layers", 32))),
            "rms_norm_eps": float(cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-6))),
            "hidden_act": cfg.get("activation_function", cfg.get("hidden_act", "silu")),
            "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden)}


def _minicpm_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniCPM's (MiniCPM-1B / 2B, MiniCPM-MoE-8x2B, MiniCPM4: its remote code's) config, with that
    code's defaults (tied embeddings, RMSNorm epsilon 1e-6). Heads of hidden_size / heads values
    (a kv_channels of another width refused, as is a config turning its scalings off with use_mup);
    MiniCPM4's sparse_config (InfLLM v2 attention past dense_len keys) is not followed: every
    context attends densely, as vLLM serves it (logged)."""
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    if cfg.get("kv_channels") and int(cfg["kv_channels"]) != hidden // heads:
        raise ValueError(f"MiniCPMForCausalLM with kv_channels {cfg['kv_channels']} (heads of another width than "
                         f"hidden_size / num_attention_heads = {hidden // heads}) is not served")
    if cfg.get("use_mup") is False:
        raise ValueError("MiniCPMForCausalLM with use_mup false (its scalings off) is not served")
    if isinstance(cfg.get("sparse_config"), dict):
        logger.warning("MiniCPM's sparse_config is not followed: contexts past its dense_len (%s) attend to every "
                       "key here, where MiniCPM's own code attends sparsely (InfLLM v2), as vLLM serves it",
                       cfg["sparse_config"].get("dense_len"))
    return {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, **{k: v for k, v in cfg.items() if v is not None},
            "head_dim": hidden // heads}


def _minicpm_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniCPM's muP-style scalings, as Granite's multipliers: the embeddings times scale_emb, each
    sublayer's output times scale_depth / sqrt(num_hidden_layers) before its residual add, the final
    hidden states over hidden_size / dim_model_base (transformers' MiniCPM3Config defaults: 12, 1.4 and
    256, a null scale_depth or dim_model_base scaling by one; MiniCPM's own configuration's: 1 each)."""
    if arch not in ("MiniCPM3ForCausalLM", "MiniCPMForCausalLM"):
        return {}
    layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    v3 = arch == "MiniCPM3ForCausalLM"
    depth = cfg.get("scale_depth", 1.4 if v3 else 1.0)
    base = cfg.get("dim_model_base", 256 if v3 else 1)
    return {"embedding_multiplier": float(cfg.get("scale_emb", 12 if v3 else 1)),
            "residual_multiplier": 1.0 if depth is None else float(depth) / math.sqrt(layers),
            "logits_scaling": 1.0 if base is None else hidden / float(base)}


def _hunyuan_moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan MoE's experts (Hunyuan-A13B): num_experts, moe_topk, moe_intermediate_size and
    num_shared_expert, each one value or one per layer (served where every layer's is the same), the
    experts intermediate_size wide where moe_intermediate_size is unset (as transformers builds them),
    the top k renormalised, a shared MLP of num_shared_expert x intermediate_size beside them unless
    use_mixed_mlp_moe is off (as vLLM reads them; transformers' has one of intermediate_size always); the
    router in fp32, as transformers keeps it."""

    def uniform(key: str, default: Any) -> int:
        value = cfg.get(key)
        values = set(value) if isinstance(value, list) else {default if value is None else value}
        if len(values) != 1:
            raise ValueError(f"HunYuanMoEV1ForCausalLM with {key} differing between layers ({value}) is not served")
        return int(values.pop())

    width = int(cfg["intermediate_size"])
    shared = uniform("num_shared_expert", 1) * width if cfg.get("use_mixed_mlp_moe", True) else 0
    return dict(num_experts=uniform("num_experts", 1), num_experts_per_tok=uniform("moe_topk", 1),
                moe_intermediate_size=uniform("moe_intermediate_size", width), norm_topk_prob=True,
                shared_expert_intermediate_size=shared, shared_expert_gated=False, moe_router_fp32=True)


def _grouped_sigmoid_experts(cfg: dict[str, Any], num_experts: int, groups: int, kept: int, top_k: int, width: int,
                             scaling: float, kinds: list[str]) -> dict[str, Any]:
    """DeepSeek-V3's routing without shared experts (MiMo-V2-Flash's, Beam's): sigmoid scores through the
    correction bias within the ``kept`` best of ``groups`` groups, renormalised under norm_topk_prob (on by
    default), times ``scaling``, in the layers ``kinds`` calls sparse."""
    if num_experts % groups or not 0 < kept <= groups:
        raise ValueError(f"n_group ({groups}) must divide the {num_experts} experts, and topk_group ({kept}) be "
                         f"between 1 and n_group")
    return dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), moe_grouped_topk=True, moe_scoring="sigmoid",
                moe_correction_bias=True, moe_num_groups=groups, moe_topk_groups=kept, routed_scaling_factor=scaling,
                moe_layers=tuple(kind == "sparse" for kind in kinds))


def _moe_from_dict(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields for an MoE architecture (none for a dense one)."""
    # A key a config leaves out takes transformers' default for the architecture, as HF reads it.
    def read(key: str, default: int, *aliases: str) -> int:
        for name in (key, *aliases):
            if cfg.get(name) is not None:
                return int(cfg[name])
        return default

    if arch == "MiniCPMForCausalLM":
        # MiniCPM-MoE-8x2B: Mixtral's experts (intermediate_size wide, w1 / w3 / w2) in every layer, the
        # softmax's top k renormalised; none where num_experts is 0 or unset (MiniCPM's dense models).
        if not cfg.get("num_experts"):
            return {}
        return dict(num_experts=read("num_experts", 0), num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if arch == "LongcatFlashForCausalLM":
        # LongCat-Flash's shortcut experts (in each even half-layer, beside its dense MLP: ModelConfig's
        # moe_layers say none replaces a dense MLP): the softmax over n_routed_experts + zero_expert_num,
        # the top k through the correction bias, times routed_scaling_factor, not renormalised.
        return dict(num_experts=read("n_routed_experts", 512, "num_local_experts"),
                    num_experts_per_tok=read("moe_topk", 12, "num_experts_per_tok"),
                    moe_intermediate_size=read("expert_ffn_hidden_size", 2048, "moe_intermediate_size"),
                    moe_zero_experts=read("zero_expert_num", 256), norm_topk_prob=False,
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 6.0),
                    moe_layers=(False,) * num_layers)
    if arch == "JetMoeForCausalLM":
        # JetMoE's: routed experts of intermediate_size in every layer (and as many attention experts), the
        # softmax over the top k logits (the renormalised top k of the softmax).
        return dict(num_experts=read("num_local_experts", 8), num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if arch in ("MixtralForCausalLM", *MINIMAX_ARCHITECTURES):
        # Every layer routed; the experts' width is intermediate_size; weights always renormalised.
        return dict(num_experts=read("num_local_experts", 8, "num_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if arch == "GptOssForCausalLM":
        # Every layer routed, as Mixtral's (the softmax over the top k logits is the renormalised top k
        # of the softmax); a bias on the router and on each expert's projections, a clamped SwiGLU.
        return dict(num_experts=read("num_local_experts", 128, "num_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 4, "experts_per_token"),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True, moe_bias=True,
                    moe_activation="swigluoai", swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
                    swiglu_limit=float(cfg.get("swiglu_limit") or 7.0))
    if arch in ("Glm4MoeForCausalLM", *DEEPSEEK_ARCHITECTURES, "Dots1ForCausalLM", "MiniCPM5MoeForCausalLM",
                "Glm4MoeLiteForCausalLM", "ExaoneMoeForCausalLM", "SolarOpenForCausalLM", "AXK1ForCausalLM",
                "GlmMoeDsaForCausalLM", "KimiLinearForCausalLM", "BailingHybridForCausalLM"):
        # Routed experts from layer first_k_dense_replace on (dense MLPs of intermediate_size below;
        # DeepSeek's every moe_layer_freq-th layer; MiniCPM5-MoE's and GLM-4.7-Flash's where
        # mlp_layer_types says "sparse"), beside n_shared_experts shared ones. GLM-4.5 and 4.7-Flash,
        # DeepSeek-V3 (topk_method noaux_tc), dots.llm1, MiniCPM5-MoE, K-EXAONE (its keys
        # num_experts and num_shared_experts) and Solar Open (experts in every layer, whatever
        # first_k_dense_replace a config carries): sigmoid scores chosen through the correction
        # bias; DeepSeek-V2: the softmax, within the best groups under group_limited_greedy. (Their
        # routers in fp32: SparseMoeBlock's grouped top k.)
        v2 = arch == "DeepseekV2ForCausalLM"
        if arch == "Dots1ForCausalLM":  # (transformers' Dots1Config leaves these unset: a config states them)
            aliases = {"n_routed_experts": "num_local_experts"}
            unset = [key for key in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts")
                     if cfg.get(key) is None and cfg.get(aliases.get(key, key)) is None]
            if unset:
                raise ValueError(f"a Dots1ForCausalLM config must state {', '.join(unset)}")
        defaults = {"Glm4MoeForCausalLM": (128, 1408, 8, 1, 1.0), "DeepseekV2ForCausalLM": (64, 1407, 6, 0, 1.0),
                    "DeepseekV3ForCausalLM": (256, 2048, 8, 3, 2.5), "DeepseekV32ForCausalLM": (256, 2048, 8, 3, 2.5),
                    "GlmMoeDsaForCausalLM": (256, 2048, 8, 3, 2.5),
                    "Dots1ForCausalLM": (0, 1408, 0, 0, 1.0),
                    "MiniCPM5MoeForCausalLM": (160, 512, 16, 1, 3.66),
                    "Glm4MoeLiteForCausalLM": (64, 1536, 4, 1, 1.8),
                    "ExaoneMoeForCausalLM": (64, 1024, 8, 1, 2.5),
                    "SolarOpenForCausalLM": (128, 1280, 8, 0, 1.0),
                    "AXK1ForCausalLM": (192, 2048, 8, 1, 2.5),
                    "KimiLinearForCausalLM": (256, 1024, 8, 1, 2.446),
                    "BailingHybridForCausalLM": (512, 768, 8, 2, 2.5)}[arch]
        num_experts = read("n_routed_experts", defaults[0], "num_local_experts", "num_experts")
        width = read("moe_intermediate_size", defaults[1])
        # (transformers' defaults: DeepSeek-V3's and A.X-K1's 8 groups, 4 kept)
        grouped = 8 if arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "AXK1ForCausalLM",
                                "BailingHybridForCausalLM") else 1
        groups, kept = read("n_group", grouped) or 1, read("topk_group", grouped // 2 or 1) or 1
        if v2 and cfg.get("topk_method", "greedy") == "greedy":
            groups = kept = 1
        elif not v2 and arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "Dots1ForCausalLM") \
                and cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ValueError(f"topk_method must be 'noaux_tc' for {arch}, got {cfg.get('topk_method')!r}")
        if num_experts % groups or not 0 < kept <= groups:
            raise ValueError(f"n_group ({groups}) must divide n_routed_experts ({num_experts}), and topk_group "
                             f"({kept}) be between 1 and n_group")
        top_k = read("num_experts_per_tok", defaults[2])
        if (num_experts // groups < 2 and groups > 1) or top_k > kept * (num_experts // groups):
            raise ValueError(f"num_experts_per_tok ({top_k}) must fit in topk_group ({kept}) groups of "
                             f"{num_experts // groups} experts, each of two or more")
        first_moe, every = read("first_k_dense_replace", defaults[3]), read("moe_layer_freq", 1) or 1
        if arch in _DSA_DEFAULTS:  # (transformers' DeepSeek-V3.2 and GLM-5 configs have no moe_layer_freq)
            every = 1
        if arch == "SolarOpenForCausalLM":  # (transformers' SolarOpenConfig has neither key)
            first_moe, every = 0, 1
        # (Its multi-token-prediction layers follow the decoder's, numbered on: speculative decoding's
        # mtp drafter builds the first, routed as the layer of its number would be.)
        # (K-EXAONE's are apart, under mtp.*, and not read; MiniCPM5-MoE has none.)
        # (A.X-K1's transformers config has no MTP key: any layers after the decoder's are not read.)
        no_mtp = v2 or arch in ("ExaoneMoeForCausalLM", "MiniCPM5MoeForCausalLM", "SolarOpenForCausalLM",
                                "AXK1ForCausalLM", "KimiLinearForCausalLM", "BailingHybridForCausalLM")
        num_mtp = 0 if no_mtp else int(cfg.get("num_nextn_predict_layers") or 0)
        moe_layers = tuple(i >= first_moe and i % every == 0 for i in range(num_layers + num_mtp))
        if arch in ("MiniCPM5MoeForCausalLM", "Glm4MoeLiteForCausalLM", "ExaoneMoeForCausalLM", "AXK1ForCausalLM",
                    "KimiLinearForCausalLM", "BailingHybridForCausalLM", *_DSA_DEFAULTS) \
                and isinstance(cfg.get("mlp_layer_types"), list):
            kinds = cfg["mlp_layer_types"]
            if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
                raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} "
                                 f"layers, got {kinds}")
            moe_layers = tuple(kind == "sparse" for kind in kinds) + (True,) * num_mtp  # (MTP layers routed)
        return dict(num_mtp_layers=num_mtp, num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=width,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", not v2 and arch != "Dots1ForCausalLM")),
                    shared_expert_intermediate_size=width * read("n_shared_experts", 2 if v2 else 1,
                                                                 "num_shared_experts"),
                    shared_expert_gated=False, moe_grouped_topk=True, moe_scoring="softmax" if v2 else "sigmoid",
                    moe_correction_bias=not v2, moe_num_groups=groups, moe_topk_groups=kept,
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", defaults[4])),
                    moe_layers=moe_layers)
    if arch == "AfmoeForCausalLM":
        # AFMoE's: routed experts from layer num_dense_layers on, chosen by sigmoid scores through the
        # correction bias (expert_bias), no groups, renormalised, times route_scale; beside
        # num_shared_experts ungated shared ones (one MLP that many experts wide).
        width = read("moe_intermediate_size", 1408)
        num_experts = read("num_experts", 64, "num_local_experts")
        return dict(num_experts=num_experts, num_experts_per_tok=read("num_experts_per_tok", 6),
                    moe_intermediate_size=width, norm_topk_prob=True,
                    shared_expert_intermediate_size=width * read("num_shared_experts", 2), shared_expert_gated=False,
                    moe_grouped_topk=True, moe_scoring="sigmoid", moe_correction_bias=True,
                    routed_scaling_factor=float(cfg.get("route_scale") or 1.0),
                    moe_layers=tuple(num_experts > 0 and i >= read("num_dense_layers", 1) for i in range(num_layers)))
    if arch == "Cohere2MoeForCausalLM":
        # Cohere2-MoE's: routed experts where mlp_layer_types says sparse, the top k by logit weighted by
        # the softmax over them (expert_selection_fn "softmax") or by their sigmoids, renormalised under
        # norm_topk_prob ("sigmoid"); beside num_shared_experts shared experts as wide as the routed ones.
        kinds, selection = cfg["mlp_layer_types"], cfg.get("expert_selection_fn", "softmax")
        if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} "
                             f"layers, got {kinds}")
        if selection not in ("softmax", "sigmoid") \
                or cfg.get("shared_expert_combination_strategy", "average") not in ("sum", "average"):
            raise ValueError("Cohere2MoeForCausalLM's expert_selection_fn must be 'softmax' or 'sigmoid' and its "
                             "shared_expert_combination_strategy 'sum' or 'average', got "
                             f"{selection!r}, {cfg.get('shared_expert_combination_strategy')!r}")
        width = int(cfg["moe_intermediate_size"])
        sigmoid = selection == "sigmoid"
        return dict(num_experts=read("num_experts", 8), num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=width,
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if sigmoid else True,
                    shared_expert_intermediate_size=width * read("num_shared_experts", 0), shared_expert_gated=False,
                    moe_grouped_topk=sigmoid, moe_scoring="sigmoid" if sigmoid else "softmax",
                    moe_layers=tuple(kind == "sparse" for kind in kinds))
    if arch == "MiMoV2FlashForCausalLM":
        # MiMo-V2-Flash's: DeepSeek-V3's routing (sigmoid scores through the correction bias, within the
        # topk_group best of n_group groups, renormalised under norm_topk_prob, times
        # routed_scaling_factor) where mlp_layer_types says sparse; no shared experts.
        kinds = cfg["mlp_layer_types"]
        if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} "
                             f"layers, got {kinds}")
        return _grouped_sigmoid_experts(cfg, read("n_routed_experts", 256, "num_local_experts"), read("n_group", 1),
                                        read("topk_group", 1), read("num_experts_per_tok", 8),
                                        read("moe_intermediate_size", 2048), float(cfg["routed_scaling_factor"]),
                                        kinds)
    if arch == "HYV3ForCausalLM":
        # Hy3's: routed experts where mlp_layer_types says sparse (by default all but the first layer),
        # chosen by sigmoid scores through the correction bias, no groups, renormalised, times
        # router_scaling_factor, beside num_shared_experts ungated shared ones.
        kinds = cfg.get("mlp_layer_types")
        if not isinstance(kinds, list):
            kinds = ["dense"] * min(1, num_layers) + ["sparse"] * max(num_layers - 1, 0)
        if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} "
                             f"layers, got {kinds}")
        width = read("moe_intermediate_size", 1536)
        # (No shared experts: transformers' HYV3MLP still builds one, intermediate_size wide.)
        shared = width * read("num_shared_experts", 1) or int(cfg["intermediate_size"])
        return dict(num_experts=read("num_experts", 192, "num_local_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 8), moe_intermediate_size=width,
                    norm_topk_prob=True, shared_expert_intermediate_size=shared,
                    shared_expert_gated=False, moe_grouped_topk=True, moe_scoring="sigmoid", moe_correction_bias=True,
                    routed_scaling_factor=float(cfg.get("router_scaling_factor") or 2.826),
                    moe_layers=tuple(kind == "sparse" for kind in kinds))
    if arch in LAGUNA_ARCHITECTURES:
        # Laguna's: routed experts where mlp_layer_types says sparse, chosen by sigmoid scores (of
        # logits soft-capped where moe_router_logit_softcapping is set) through the correction bias,
        # no groups, renormalised, times moe_routed_scaling_factor, beside an ungated shared expert of
        # shared_expert_intermediate_size. Mellum's: Qwen3-MoE's, the softmax's top k (renormalised
        # under norm_topk_prob), no shared expert.
        moe_layers = tuple(kind == "sparse" for kind in cfg["mlp_layer_types"])
        if arch == "MellumForCausalLM":
            return dict(num_experts=read("num_local_experts", 64, "num_experts"),
                        num_experts_per_tok=read("num_experts_per_tok", 8),
                        moe_intermediate_size=read("moe_intermediate_size", 896),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), moe_layers=moe_layers)
        if cfg.get("moe_apply_router_weight_on_input"):
            raise ValueError("LagunaForCausalLM with moe_apply_router_weight_on_input is not served, as "
                             "transformers refuses it")
        return dict(num_experts=read("num_experts", 256, "num_local_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 8),
                    moe_intermediate_size=read("moe_intermediate_size", 512), norm_topk_prob=True,
                    shared_expert_intermediate_size=read("shared_expert_intermediate_size", 512),
                    shared_expert_gated=False, moe_grouped_topk=True, moe_scoring="sigmoid", moe_correction_bias=True,
                    routed_scaling_factor=float(cfg.get("moe_routed_scaling_factor") or 1.0), moe_layers=moe_layers)
    if arch == "Llama4ForCausalLM":
        # Llama 4's: routed experts (moe_intermediate_size wide) in the moe_layers, the top k by logit
        # weighted by their sigmoid (on the experts' inputs: Llama4MoE), beside a shared expert as wide.
        width, moe_layers = int(cfg["moe_intermediate_size"]), {int(i) for i in cfg["moe_layers"]}
        return dict(num_experts=read("num_local_experts", 16), num_experts_per_tok=read("num_experts_per_tok", 1),
                    moe_intermediate_size=width, shared_expert_intermediate_size=width, shared_expert_gated=False,
                    norm_topk_prob=False, moe_layers=tuple(i in moe_layers for i in range(num_layers)))
    if arch == "Ernie4_5_MoeForCausalLM":
        # ERNIE 4.5's: routed experts in every moe_layer_interval-th layer (counting from 1) from
        # moe_layer_start_index to moe_layer_end_index (-1: the last), chosen by the softmax's scores
        # through the correction bias (moe_statics) in an fp32 router and renormalised, beside
        # moe_num_shared_experts ungated shared experts (one MLP that many experts wide).
        width, every = read("moe_intermediate_size", 1536), read("moe_layer_interval", 1) or 1
        start, end = read("moe_layer_start_index", 1), read("moe_layer_end_index", -1)
        end = num_layers - 1 if end == -1 else end
        return dict(num_experts=read("moe_num_experts", 64, "num_experts"),
                    num_experts_per_tok=read("moe_k", 6, "num_experts_per_tok"), moe_intermediate_size=width,
                    norm_topk_prob=True, shared_expert_intermediate_size=width * read("moe_num_shared_experts", 2),
                    shared_expert_gated=False, moe_grouped_topk=True, moe_scoring="softmax", moe_correction_bias=True,
                    moe_layers=tuple((i + 1) % every == 0 and start <= i <= end for i in range(num_layers)))
    if arch == "JambaForCausalLM":
        # Routed experts (intermediate_size wide) in every expert_layer_period-th layer from
        # expert_layer_offset, a dense MLP in the others; the softmax's top k, not renormalised.
        num_experts, period = read("num_experts", 16), read("expert_layer_period", 2)
        offset = read("expert_layer_offset", 1)
        if num_experts <= 1:
            return {}
        return dict(num_experts=num_experts, num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=int(cfg.get("intermediate_size", 14336)), norm_topk_prob=False,
                    moe_layers=tuple(i % period == offset for i in range(num_layers)))
    if arch == "Lfm2MoeForCausalLM":
        # LFM2-8B-A1B: routed experts from layer num_dense_layers on, chosen by sigmoid scores through
        # the correction bias (expert_bias, where use_expert_bias), no groups; the top k renormalised,
        # times routed_scaling_factor.
        num_experts = read("num_experts", 32, "num_local_experts")
        return dict(num_experts=num_experts, num_experts_per_tok=read("num_experts_per_tok", 4),
                    moe_intermediate_size=read("moe_intermediate_size", 1792),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), moe_grouped_topk=True,
                    moe_scoring="sigmoid", moe_correction_bias=bool(cfg.get("use_expert_bias", True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                    moe_layers=tuple(num_experts > 0 and i >= read("num_dense_layers", 2) for i in range(num_layers)))
    if arch == "PhimoeForCausalLM":
        # Every layer routed (block_sparse_moe), the experts intermediate_size wide; sparsemixer's two
        # picks (its top k is two), with router_jitter_noise as its threshold.
        if read("num_experts_per_tok", 2) != 2:
            raise ValueError(f"PhimoeForCausalLM routes each token to 2 experts (sparsemixer), got "
                             f"num_experts_per_tok={cfg['num_experts_per_tok']}")
        return dict(num_experts=read("num_local_experts", 16, "num_experts"), num_experts_per_tok=2,
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=False,
                    moe_scoring="sparsemixer",
                    sparsemixer_jitter_eps=float(cfg.get("router_jitter_noise", 0.01) or 0.0))
    if arch == "HunYuanMoEV1ForCausalLM":
        return _hunyuan_moe_fields(cfg)
    if arch == "DbrxForCausalLM":  # (_dbrx_config's: every layer routed, the experts ffn_hidden_size wide)
        return dict(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=bool(cfg["norm_topk_prob"]))
    if arch in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        # Every layer routed; the experts' width is intermediate_size; not renormalised by default.
        flex = arch == "FlexOlmoForCausalLM"  # (transformers' FlexOlmoConfig: 7 experts, 5 a token)
        return dict(num_experts=read("num_experts", 7 if flex else 64, "num_local_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 5 if flex else 8),
                    moe_intermediate_size=int(cfg.get("intermediate_size", 2048)),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if arch == "MiniMaxM2ForCausalLM":
        # Sigmoid scores through a correction bias (use_routing_bias), the top k's renormalised, no
        # groups, no scaling; every layer routed, the experts' width intermediate_size.
        if 0 in (cfg.get("attn_type_list") or ()):  # (MiniMax-Text-01's and M1's linear-attention layers)
            raise ValueError("MiniMax linear-attention layers (attn_type_list 0) are not served")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("shared_intermediate_size"):
            raise ValueError("MiniMax-M2 is served with sigmoid routing (scoring_func) and no shared experts, got "
                             f"{cfg.get('scoring_func')!r} and {cfg.get('shared_intermediate_size')!r}")
        return dict(num_experts=read("num_local_experts", 256), num_experts_per_tok=read("num_experts_per_tok", 8),
                    moe_intermediate_size=int(cfg.get("intermediate_size") or 1536), norm_topk_prob=True,
                    moe_grouped_topk=True, moe_scoring="sigmoid",
                    moe_correction_bias=bool(cfg.get("use_routing_bias", True)))
    if arch == "NemotronHForCausalLM":
        # Nemotron 3 Nano's "E" blocks: ungated relu^2 experts chosen by sigmoid scores through a
        # correction bias within groups (DeepSeek-V3's routing, an fp32 router), beside an ungated
        # shared expert; moe_latent_size: the experts work in a narrower latent (projected in and out).
        kinds = cfg["block_types"]
        if "moe" not in kinds:
            return {}
        return dict(num_experts=read("n_routed_experts", 8, "num_local_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=read("moe_intermediate_size", 7688),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), moe_grouped_topk=True, moe_scoring="sigmoid",
                    moe_correction_bias=True, moe_num_groups=read("n_group", 1), moe_topk_groups=read("topk_group", 1),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
                    shared_expert_intermediate_size=read("moe_shared_expert_intermediate_size", 7688),
                    shared_expert_gated=False, moe_activation="relu2",
                    moe_latent_size=read("moe_latent_size", 0), moe_layers=tuple(kind == "moe" for kind in kinds))
    if arch in GRANITE_MOE_ARCHITECTURES:
        # Every layer routed, the experts' width intermediate_size; the softmax over the top k logits
        # (transformers' GraniteMoeTopKRouter): the top k's softmax weights renormalised. Granite MoE
        # Shared and 4.0 add an ungated shared expert of shared_intermediate_size beside them; a Granite
        # 4.0 without experts has that MLP alone (from_dict makes it the dense MLP).
        num_experts = read("num_local_experts", 8)
        shared = 0 if arch == "GraniteMoeForCausalLM" else read(
            "shared_intermediate_size", 1024 if arch == "GraniteMoeHybridForCausalLM" else 0)
        if not num_experts:
            return {}
        return dict(num_experts=num_experts, num_experts_per_tok=read("num_experts_per_tok", 2),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    shared_expert_intermediate_size=shared, shared_expert_gated=False)
    if arch == "BeamForCausalLM":
        # Beam's: routed experts where mlp_layer_types says sparse, chosen by DeepSeek-V3's grouped
        # sigmoid routing through the correction bias (8 groups, 4 kept by default), renormalised, times
        # routed_scaling_factor; no shared experts.
        return _grouped_sigmoid_experts(cfg, read("num_experts", 256, "num_local_experts"), read("n_group", 8) or 1,
                                        read("topk_group", 4) or 1, read("num_experts_per_tok", 8),
                                        read("moe_intermediate_size", 2560),
                                        float(cfg.get("routed_scaling_factor") or 2.5), cfg["mlp_layer_types"])
    if arch == "Kolibri1ForCausalLM":
        # Kolibri 1's: routed experts in every layer, chosen by the router's logits plus the correction
        # bias (no groups), weighted by their sigmoids, renormalised under norm_topk_prob (off by
        # default); beside an ungated shared expert of shared_expert_intermediate_size.
        return dict(num_experts=read("num_experts", 384, "num_local_experts"),
                    num_experts_per_tok=read("num_experts_per_tok", 6),
                    moe_intermediate_size=read("moe_intermediate_size", 512),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_expert_intermediate_size=read("shared_expert_intermediate_size", 512),
                    shared_expert_gated=False, moe_grouped_topk=True, moe_scoring="sigmoid_logits",
                    moe_correction_bias=True, moe_layers=(True,) * num_layers)
    if arch == "FlintForCausalLM":
        # Flint's: Qwen-MoE's layer rule (dense in mlp_only_layers, by default the first two, and off
        # decoder_sparse_step), experts chosen by their sigmoid scores (no bias, no groups), renormalised
        # under norm_topk_prob (on by default), beside an ungated shared expert.
        num_experts = read("num_experts", 256, "num_local_experts")
        step = read("decoder_sparse_step", 1) or 1
        dense = set(cfg["mlp_only_layers"] if isinstance(cfg.get("mlp_only_layers"), list) else (0, 1))
        return dict(num_experts=num_experts, num_experts_per_tok=read("num_experts_per_tok", 6),
                    moe_intermediate_size=read("moe_intermediate_size", 512),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    shared_expert_intermediate_size=read("shared_expert_intermediate_size", 1024),
                    shared_expert_gated=False, moe_grouped_topk=True, moe_scoring="sigmoid",
                    moe_layers=tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                                     for i in range(num_layers)))
    if arch == "Qwen2MoeForCausalLM":
        defaults = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408}
        shared = read("shared_expert_intermediate_size", 5632)
    elif arch == "Qwen3MoeForCausalLM":
        defaults = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
        shared = 0
    elif arch == "Qwen3NextForCausalLM":
        defaults = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512}
        shared = read("shared_expert_intermediate_size", 512)
    elif arch == "Qwen3_5MoeForCausalLM":  # (every layer routed; its router always renormalises)
        defaults = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512}
        shared = read("shared_expert_intermediate_size", 512)
        cfg = {**cfg, "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}
    else:
        return {}
    num_experts = read("num_experts", defaults["num_experts"], "num_local_experts")
    step = read("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return dict(num_experts=num_experts,
                num_experts_per_tok=read("num_experts_per_tok", defaults["num_experts_per_tok"]),
                moe_intermediate_size=read("moe_intermediate_size", defaults["moe_intermediate_size"]),
                # (transformers' Qwen3-Next renormalises unless told not to; Qwen2/3-MoE's default is off.)
                norm_topk_prob=bool(cfg.get("norm_topk_prob", arch in ("Qwen3NextForCausalLM",
                                                                      "Qwen3_5MoeForCausalLM"))),
                shared_expert_intermediate_size=shared, moe_layers=layers)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Bias on the q/k/v projections (Qwen2 always, Llama with attention_bias).
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # RMSNorm of each query and key head before RoPE (Qwen3's q_norm/k_norm).
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    dtype: torch.dtype | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # A vision-language model's image side (LLaVA: CLIP tower and projector); None for text models.
    vision: (VisionConfig | QwenVisionConfig | Qwen3VisionConfig | Gemma3VisionConfig | PixtralVisionConfig
             | InternVLVisionConfig | Idefics3VisionConfig | None) = None
    # A vision-language checkpoint's architecture whose language model alone is served (its vision
    # side's tensors skipped: ModelConfig.from_pretrained's language_model_only); None otherwise.
    language_model_of: str | None = None
    # Per layer, whether it attends through the sliding window (empty: every layer does, when there
    # is one). Qwen2/Qwen3 window only their layers from max_window_layers on.
    sliding_window_layers: tuple[bool, ...] = ()
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); num_experts 0 for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Renormalise the top-k routing weights to sum to one (Mixtral always; Qwen's norm_topk_prob).
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert, gated per token by a sigmoid (0: none); GLM-4.5's shared experts,
    # ungated (shared_expert_gated False).
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    # DeepSeek's routing (GLM-4.5, DeepSeek-V2 / V3: gpu_worker.layers.fused_moe.select_experts_grouped),
    # with an fp32 router as transformers keeps it: scores by moe_scoring, "softmax" over all experts
    # or "sigmoid" per expert, chosen (through a correction bias where moe_correction_bias: the
    # router's e_score_correction_bias) within the moe_topk_groups best of moe_num_groups groups, the
    # weights times routed_scaling_factor. Otherwise the softmax's top k (Mixtral, Qwen, GPT-OSS).
    moe_grouped_topk: bool = False
    # ("sparsemixer": Phi-3.5-MoE's two picks, each a softmax over the experts within 2 x
    # sparsemixer_jitter_eps (relative) of its logit; "sigmoid_logits": Kolibri's, chosen by the logits
    # plus the correction bias, weighted by their sigmoids.)
    moe_scoring: str = "softmax"
    sparsemixer_jitter_eps: float = 0.0
    moe_correction_bias: bool = False
    # LongCat-Flash's "zero experts": that many more router choices, each returning its input.
    moe_zero_experts: int = 0
    # The router in fp32 whatever the model's dtype (Hunyuan MoE's gate.wg, as transformers keeps it;
    # the grouped routers' always are).
    moe_router_fp32: bool = False
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # GLM-4.5's and DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers), held in the
    # checkpoint after the decoder's (Qwen3-Next's and Qwen3.5's, mtp_num_hidden_layers, under mtp.*):
    # speculative decoding's mtp drafter (gpu_worker.hidden_state_drafter).
    num_mtp_layers: int = 0
    # Speculative decoding's EAGLE / EAGLE-3 draft head (gpu_worker.eagle_config): its own settings,
    # where this config is such a head's; None for every served model.
    eagle: EagleHead | None = None
    # GPT-OSS: a bias on the router and on every expert's projections, and the experts' clamped SwiGLU
    # ("swigluoai", gpu_worker.layers.fused_moe.swiglu_oai) with its gain and clamp.
    moe_bias: bool = False
    moe_activation: str = "silu"
    # Nemotron-H's experts' latent width (moe_latent_size; 0: none): they take and give rows of this
    # width, projected from and back to hidden_size around them.
    moe_latent_size: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # GPT-OSS: a learnt attention sink per query head (one more logit in each head's softmax).
    attention_sinks: bool = False
    # The recurrent mixers (Granite 4.0-H's and Nemotron-H's Mamba-2, Qwen3-Next's Gated DeltaNet,
    # LFM2's short convolution):
    # their geometry, and per layer whether it is one (in place of self-attention; empty: none is).
    mamba: (Mamba2Config | Mamba1Config | GatedDeltaNetConfig | KimiDeltaAttentionConfig | LightningAttentionConfig
            | ShortConvConfig | None) = None
    # Gemma 3n's AltUp streams, LAuReL, per-layer inputs, KV sharing and sparse gates (gemma3n_config).
    gemma3n: Gemma3nConfig | None = None
    # Gemma 4's layers of their own heads, KV sharing, per-layer inputs and experts (gemma4_config).
    gemma4: Gemma4Config | None = None
    # (num_key_value_heads, head_dim) of each layer keeping a KV cache, where they differ between
    # layers (Gemma 4's full layers); empty: every layer's are num_key_value_heads and head_dim.
    attention_layer_geometry: tuple[tuple[int, int], ...] = ()
    mamba_layers: tuple[bool, ...] = ()
    # MiniMax-Text-01's and M1's residual stream of normed values, each sublayer's input (normed) times
    # alpha plus its output times beta: (linear attention's alpha, beta, full attention's, the MLP's).
    minimax_residual_scales: tuple[float, ...] = ()
    # Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side on the same input (their
    # outputs summed), so every layer keeps KV as well as a recurrent state.
    parallel_hybrid: bool = False
    # Llama 4: (attn_scale, floor_scale) of its no-position layers' query temperature; its rotating
    # layers' attention chunk (each query sees the keys of its chunk: layer_sliding_window).
    llama4_temperature: tuple[float, int] | None = None
    attention_chunk_size: int | None = None
    chunked_attention_layers: tuple[bool, ...] = ()
    # Zamba2: the layers that run a shared attention-and-MLP block before their Mamba-2 mixer (each
    # use of a block keeps a KV cache of its own); empty for other models.
    shared_attention_layers: tuple[int, ...] = ()
    # Nemotron-H: each layer one block behind its own norm, "mamba", "attention" or "mlp" (empty: the
    # Llama family's attention-then-MLP layers).
    block_types: tuple[str, ...] = ()
    # Per layer, whether it rotates its queries and keys (empty: every layer does). SmolLM3 leaves
    # every fourth layer without positions (NoPE).
    rope_layers: tuple[bool, ...] = ()
    # GPT-2, GPTBigCode, OPT: a learned table of a row per position (max_position_embeddings of them,
    # after position_offset unread ones) added to the token embeddings, in place of RoPE (BioGPT's too;
    # XGLM's table, in the same place, fixed sinusoids: sinusoidal_positions).
    learned_positions: bool = False
    # XGLM: the positions' table is fairseq's fixed sinusoids (not read), its row position_padding_row zero.
    sinusoidal_positions: bool = False
    position_padding_row: int | None = None
    # BioGPT, XGLM: the token embeddings (not prompt embeddings given) times this, before positions are added.
    token_embedding_scale: float = 1.0
    # OLMo, OLMoE, MPT: q, k (after any norms) and v clamped to [-clip_qkv, clip_qkv] (None: not clamped).
    clip_qkv: float | None = None
    # BLOOM, MPT, falcon-rw: ALiBi's linear biases by distance in place of RoPE, the slopes of
    # layers.attention.alibi_slopes for this bias_max (None: no ALiBi) times alibi_slope_scale.
    alibi_bias_max: float | None = None
    alibi_slope_scale: float = 1.0
    # BLOOM: a LayerNorm over the embeddings, before the first layer.
    embedding_norm: bool = False
    # Granite: the embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before its residual add, the scores scaled by attention_multiplier (instead
    # of head_dim ** -0.5), the logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # HyperCLOVA X's Peri-LN: each sublayer's output normed before its residual add.
    sublayer_output_norm: bool = False
    # DeepSeek-V2 / V3's multi-head latent attention (kv_lora_rank 0: none). The keys and values of
    # every head come from one latent of kv_lora_rank values (normed) plus qk_rope_head_dim rotated
    # values shared by all heads; queries from a q_lora_rank bottleneck (0: a plain projection). The
    # cache holds the latent: head_dim is kv_lora_rank + qk_rope_head_dim (+ index_head_dim under DSA,
    # below), one KV head, rotary_dim qk_rope_head_dim, attention_multiplier the softmax scale.
    # rope_interleave: the checkpoint's rotary values are in pairs (reordered into halves at load).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Ling 3's MLA: each head's output times sigmoid of its own projection of the layer's input (g_proj).
    mla_head_gate: bool = False
    # Per layer, the routed experts' and the shared experts' SwiGLU clip (Ling 3's: min(silu(gate), l) x
    # clamp(up, -l, l); 0: none); empty: none anywhere.
    swiglu_limits: tuple[float, ...] = ()
    shared_swiglu_limits: tuple[float, ...] = ()
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; index_topk 0: none): an indexer of index_n_heads heads of
    # index_head_dim values scores each earlier key for each query, which attends to the index_topk
    # best (all of them while it sees no more). The cache row holds the indexer's key after the
    # latent's: head_dim is kv_lora_rank + qk_rope_head_dim + index_head_dim.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # GLM-5: the indexer's rotary values are in pairs in the checkpoint (reordered into halves at load),
    # and per layer whether it reuses the last indexing layer's choice (no indexer of its own).
    index_rope_interleave: bool = False
    indexer_shared_layers: tuple[bool, ...] = ()
    # Per layer, whether its MLP is the routed experts (empty: every layer's is, in an MoE model).
    # Qwen-MoE keeps dense MLPs in mlp_only_layers and off its decoder_sparse_step.
    moe_layers: tuple[bool, ...] = ()
    # RoPE's width within each head (head_dim unless partial_rotary_factor < 1: Phi-4-mini); 0: head_dim.
    rotary_dim: int = 0
    # Qwen2-VL's M-RoPE: how many of the rotary frequencies follow a token's time, height and width
    # position (an image's patches differ in the last two; text's three are equal). None: plain RoPE.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: the axes take the frequencies in turn (t h w t h w ...), not in sections.
    mrope_interleaved: bool = False
    # Not a checkpoint fact: how the workers place the experts (--enable-expert-parallel). True: each
    # TP rank holds num_experts / tp whole experts; False: a slice of every expert's width.
    expert_parallel: bool = False
    # The MLP's activation (SUPPORTED_ACTIVATIONS): SwiGLU for most, GeGLU for Gemma.
    hidden_act: str = "silu"
    # Gemma 2/3 scale attention scores by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 2's soft caps: cap * tanh(x / cap) on attention scores and on the final logits (the latter
    # also nanochat's and Beam's; computed in fp32, the logits returned so).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the sliding-window layers' RoPE base (plain RoPE; the others use rope_theta and
    # rope_scaling). None: every layer rotates alike. Laguna's also turn their own share of each head
    # (local_rotary_dim; 0: rotary_dim's).
    local_rope_theta: float | None = None
    local_rotary_dim: int = 0
    # Laguna: each layer's query heads (empty: num_attention_heads in every layer; the KV heads are
    # num_key_value_heads in every layer), and its router's soft cap on the logits (0: none).
    layer_num_attention_heads: tuple[int, ...] = ()
    # MiMo-V2-Flash: its values times this before attention (their width is v_head_dim, above).
    attention_value_scale: float = 1.0
    moe_router_logit_softcapping: float = 0.0
    # Ministral 3 (Llama 4's attention temperature): (beta, length): each query is scaled by
    # 1 + beta * log(1 + floor(position / length)) after RoPE. None: queries are not scaled.
    llama_4_scaling: tuple[float, int] | None = None
    # No LM head: the model embeds and does not generate (a bare-decoder checkpoint, or --runner pooling).
    embedding_only: bool = False
    # A sequence classifier's class names (its ``score`` head has one output per class); () otherwise.
    labels: tuple[str, ...] = ()
    # A causal LM served as a classifier (classifier_from_token): the vocabulary rows its head is made
    # of (two: one output, the second row minus the first); () for a checkpoint with its own head.
    classifier_token_ids: tuple[int, ...] = ()
    # What turns its logits into probabilities, from its problem_type as transformers' loss reads it:
    # "softmax" (single-label), "sigmoid" (multi-label, or one output), "none" (regression).
    classifier_activation: str = "softmax"
    # What turns a one-output classifier's logit into a /score score (cross-encoders).
    cross_encoder_activation: str = "sigmoid"
    # An encoder (BERT family): every token attends to every other token of its prompt, so a prompt
    # runs whole in one pass, keeps no KV cache, and never generates.
    encoder_only: bool = False
    # An encoder's LayerNorm epsilon, its token-type (segment) vocabulary (2 for BERT's sentence
    # pairs; 0 or 1: every token is of type 0), and the row of its position table that position 0
    # reads (RoBERTa's: padding_idx + 1; a decoder's learned positions too: OPT's 2).
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0
    # A token classifier (*ForTokenClassification: NER; reward models): its head classifies every
    # prompt token's final state (ALL or STEP pooling), not one pooled state.
    token_classifier: bool = False
    # Whether an encoder's LayerNorms have a bias (ModernBERT's do not, by default).
    norm_bias: bool = True
    # How its embeddings (and class logits) pool the prompt unless its sentence-transformers files or
    # --pooler-config say otherwise: LAST for decoders (EmbeddingGemma's too), CLS for BERT-family
    # encoders (ModernBERT's classifiers: their classifier_pooling), ALL for token classifiers and
    # outcome reward models, STEP for process reward models.
    default_pooling_type: str = "LAST"
    # A decoder classifier's ``score`` head: "linear" (sequence classifiers: no bias), "linear_bias"
    # (token classifiers), "relu_mlp" (reward models: Linear, ReLU, Linear, with biases).
    score_head: str = "linear"
    # STEP pooling's default step separator (a process reward model's "<extra_0>"), as text; its id
    # once from_pretrained has read the tokenizer (None where the vocabulary lacks it).
    step_tag_token: str | None = None
    step_tag_id: int | None = None
    # NomicBERT / GTE: whether the MLP's down projection has a bias (None: as mlp_bias says).
    down_proj_bias: bool | None = None
    # A rotary encoder's MLP: gated (NomicBERT, GTE: act(gate) * up, then down) or plain (Jina v3:
    # fc1, gelu, fc2).
    gated_mlp: bool = True
    # A quantized checkpoint's method ("fp8", "compressed-tensors") and quantization_config,
    # dequantized at load (gpu_worker.quantized_checkpoint); for "fp8", the block each
    # weight_scale_inv covers ((0, 0): the whole weight).
    quantization: str | None = None
    quantization_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    fp8_weight_block: tuple[int, int] | None = None
    # Jina v3's own checkpoints carry one LoRA adaptation per task (lora_adaptations): the one whose
    # weights are merged into the model's at load, (its index, alpha / rank); None: the base weights.
    task_lora: tuple[int, float] | None = None
    # BGE-M3's heads beside its dense [CLS] embedding (read from sparse_linear.pt and colbert_linear.pt):
    # each token's lexical weight (token_classify) and ColBERT vector (token_embed).
    m3_heads: bool = False
    # ColBERT's projection of every token's final state (hidden -> colbert_dim, no bias): its
    # token_embed vectors, the only output it serves; None otherwise.
    colbert_dim: int | None = None
    # A late-interaction (ColBERT) model: it serves each token's vector (token_embed), and scores a
    # pair by MaxSim.
    late_interaction: bool = False

    @property
    def head_tasks(self) -> tuple[str, ...]:
        """The pooling tasks its own per-token head modules answer (BertModel.token_head): BGE-M3's
        sparse and ColBERT heads, HF_ColBERT's projection."""
        if self.m3_heads:
            return ("token_embed", "token_classify")
        return ("token_embed",) if self.colbert_dim else ()

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...]:
        """The embedding lengths a Matryoshka-trained model was trained at (its config's
        matryoshka_dimensions, as vLLM reads them; () when it lists none)."""
        return tuple(int(d) for d in self.raw.get("matryoshka_dimensions") or ())

    @property
    def matryoshka(self) -> bool:
        """Whether its embeddings may be cut short (vLLM's is_matryoshka)."""
        return bool(self.raw.get("is_matryoshka")) or bool(self.matryoshka_dimensions)

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_attention_heads(self, layer: int) -> int:
        """Decoder layer ``layer``'s query heads."""
        return self.layer_num_attention_heads[layer] if self.layer_num_attention_heads else self.num_attention_heads

    def layer_is_mamba(self, layer: int) -> bool:
        return bool(self.mamba_layers) and self.mamba_layers[layer]

    @property
    def num_attention_layers(self) -> int:
        """The layers that keep a KV cache (a Mamba-2 layer keeps a state per request instead, unless
        it runs beside attention: Falcon-H1's; Gemma 3n's KV-sharing layers read another layer's)."""
        sharing = self.gemma3n or self.gemma4  # (KV sharing: the layers reading another's keep none)
        if sharing is not None:
            return sum(source is None for source in sharing.kv_sources)
        if self.parallel_hybrid:
            return self.num_hidden_layers
        if self.shared_attention_layers:
            return len(self.shared_attention_layers)
        if self.block_types:
            return self.block_types.count("attention")
        return self.num_hidden_layers - sum(self.mamba_layers)

    def layer_is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def uniform_sliding_window(self) -> int | None:
        """The sliding window when every layer attends through it (None when any attends fully)."""
        if self.sliding_window is None or not all(self.sliding_window_layers or (True,)):
            return None
        return self.sliding_window

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE: the pretrained length, past which a sequence uses the long rotary factors."""
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "longrope":
            return int(self.rope_scaling["original_max_position_embeddings"])
        return None

    def layer_sliding_window(self, layer: int) -> int | ChunkedWindow | None:
        """The sliding window of decoder layer ``layer`` (None: full causal attention); Llama 4's
        rotating layers attend within chunks (ChunkedWindow)."""
        if self.attention_chunk_size and self.chunked_attention_layers[layer]:
            return ChunkedWindow(self.attention_chunk_size)
        if self.sliding_window is None or (self.sliding_window_layers and not self.sliding_window_layers[layer]):
            return None
        return self.sliding_window

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model serves: linear RoPE scaling stretches the trained positions
        by its factor, YaRN the pretrained length by its factor (as vLLM derives them; llama3
        configs already state their extended length). A sliding window does not bound it: those
        layers attend to the window's keys at any length, nor do Llama 4's chunks."""
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "yarn":
            return int(self.rope_scaling["original_max_position_embeddings"] * float(self.rope_scaling["factor"]))
        length = self.max_position_embeddings
        # (Gemma 3's max_position_embeddings already is its scaled length, as vLLM reads it.)
        if (self.rope_scaling and self.rope_scaling.get("rope_type") == "linear"
                and self.architecture != "Gemma3ForCausalLM"):
            length = int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        return length

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config has no 'architectures' entry: cannot pick a model class")
        arch = ARCHITECTURE_SPELLINGS.get(archs[0], archs[0])
        if arch in ENCODER_ARCHITECTURES:
            return cls._encoder(arch, cfg)
        if cfg.get("classifier_from_token") is not None and arch not in CLASSIFIER_DECODER_OF:
            raise ValueError(f"classifier_from_token needs a sequence-classification architecture (set "
                             f'"architectures" too, e.g. ["Qwen3ForSequenceClassification"]), got {arch!r}')
        text_only_of = arch if arch in TEXT_ONLY_DECODER_OF else None
        if text_only_of is not None:  # (served as its language model: no vision config is built)
            cfg = _text_config(cfg, TEXT_ONLY_DECODER_OF[arch])
            arch = TEXT_ONLY_DECODER_OF[arch]
        headed = {**CLASSIFIER_DECODER_OF, **TOKEN_CLASSIFIER_DECODER_OF, **REWARD_DECODER_OF}
        embedding_only = arch in EMBEDDING_DECODER_OF or arch in headed
        always_bidirectional = arch in BIDIRECTIONAL_DECODERS
        head = _decoder_head(arch, cfg) if arch in headed else {}
        labels = head.pop("labels", ())
        vision = None
        if arch in TEXT_DECODER_OF:
            if arch in GEMMA3_VL_ARCHITECTURES and not embedding_only:  # (its images, too)
                text_width = int({**GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}["hidden_size"])
                vision = gemma3_vision_config_from_dict(cfg, text_width)
            cfg = _text_config(cfg, TEXT_DECODER_OF[arch])
            arch = TEXT_DECODER_OF[arch]
        elif is_pixtral(cfg) and not embedding_only:  # (Pixtral-12B, Mistral 3: before LLaVA's)
            arch = text_architecture(cfg)
            cfg = with_full_text_config(cfg)
            text = cfg["text_config"]
            vision = pixtral_vision_config_from_dict(cfg, int(text["hidden_size"]),
                                                     float(text.get("rms_norm_eps") or 1e-5))
            cfg = _text_config(cfg, arch)
        elif arch in INTERNVL_ARCHITECTURES and not embedding_only:
            arch = internvl_text_architecture(cfg)
            text = {"model_type": "qwen2", **(cfg.get("text_config") or {})}  # (InternVLConfig's default)
            cfg = with_full_text_config({**cfg, "text_config": text}, INTERNVL_TEXT_DECODERS)
            vision = internvl_vision_config_from_dict(cfg, int(cfg["text_config"]["hidden_size"]))
            cfg = _text_config(cfg, arch)
        elif arch in IDEFICS3_ARCHITECTURES and not embedding_only:  # (SmolVLM: a Llama decoder)
            # (Idefics3Config's default: its own Llama config where none is given, transformers' otherwise)
            text = cfg.get("text_config") or {"rms_norm_eps": 1e-5, "pad_token_id": 128002}
            text = {"model_type": "llama", **text}
            cfg = with_full_text_config({**cfg, "text_config": text}, {"llama": "LlamaForCausalLM"})
            vision = idefics3_vision_config_from_dict(cfg, int(cfg["text_config"]["hidden_size"]))
            cfg, arch = _text_config(cfg, "LlamaForCausalLM"), "LlamaForCausalLM"
        elif arch in LLAVA_ARCHITECTURES and not embedding_only:
            vision = vision_config_from_dict(cfg)
            arch = text_architecture(cfg)
            cfg = _text_config(with_full_text_config(cfg), arch)
        elif arch in QWEN_VL_ARCHITECTURES and not embedding_only:
            vision = qwen_vision_config_from_dict(cfg)
            cfg, arch = qwen_vl_text_config(cfg), "Qwen2ForCausalLM"
        elif arch in QWEN3_VL_ARCHITECTURES and not embedding_only:
            vision = qwen3_vision_config_from_dict(cfg)
            if arch == "Qwen3VLMoeForConditionalGeneration":  # (routed experts in its Qwen3-MoE decoder)
                cfg, arch = qwen_vl_text_config(cfg, "Qwen3MoeForCausalLM"), "Qwen3MoeForCausalLM"
                if cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
                    cfg = {**cfg, "num_experts": cfg["num_local_experts"]}  # (transformers 5 saves this name)
                cfg = {**QWEN3_VL_MOE_TEXT_DEFAULTS, **cfg, "norm_topk_prob": True}
            else:
                cfg, arch = qwen_vl_text_config(cfg, "Qwen3ForCausalLM"), "Qwen3ForCausalLM"
            if mrope_section(cfg) is None:  # (transformers' default split)
                cfg = {**cfg, "rope_parameters": {**(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}),
                                                  "mrope_section": [24, 20, 20]}}
        elif embedding_only:
            arch = {**EMBEDDING_DECODER_OF, **headed}[arch]
        elif arch not in SUPPORTED_ARCHITECTURES:
            known = (SUPPORTED_ARCHITECTURES + tuple(TEXT_DECODER_OF) + LLAVA_ARCHITECTURES + QWEN_VL_ARCHITECTURES
                     + QWEN3_VL_ARCHITECTURES + PIXTRAL_ARCHITECTURES + INTERNVL_ARCHITECTURES + IDEFICS3_ARCHITECTURES
                     + tuple(EMBEDDING_DECODER_OF) + tuple(headed) + tuple(ENCODER_ARCHITECTURES))
            raise ValueError(f"architecture must be one of {known}, got {arch!r}")
        if arch == "Gemma3ForCausalLM":
            cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}
        if arch == "Gemma4ForCausalLM":
            cfg = {**GEMMA4_TEXT_DEFAULTS, **cfg}
            cfg = {**cfg, "layer_types": gemma4_layer_types(cfg),
                   "rope_parameters": {**GEMMA4_ROPE_DEFAULTS, **(cfg.get("rope_parameters") or {})}}
        if arch == "Gemma3nForCausalLM":  # (its MLP widths a list, one a layer: ModelConfig's the widest)
            cfg = {**GEMMA3N_TEXT_DEFAULTS, **cfg}
            widths = gemma3n_config_from_dict(cfg).intermediate_sizes
            cfg = {**cfg, "layer_types": gemma3n_layer_types(cfg), "intermediate_size": max(widths),
                   "layer_intermediate_sizes": list(widths)}
        if arch == "NemotronHForCausalLM":
            cfg = _nemotron_h_config(cfg)
        if arch == "Mamba2ForCausalLM":
            cfg = _mamba2_lm_config(cfg)
        if arch in MAMBA1_LM_ARCHITECTURES:
            cfg = _mamba1_lm_config(cfg)
        if arch == "BambaForCausalLM":
            cfg = _bamba_config(cfg)
        if arch in LFM2_ARCHITECTURES:
            cfg = _lfm2_config(arch, cfg)
        if arch == "FalconH1ForCausalLM":
            cfg = _falcon_h1_config(cfg)
        if arch == "Zamba2ForCausalLM":
            cfg = _zamba2_config(cfg)
        if arch in COHERE_ARCHITECTURES:
            cfg = _cohere_config(arch, cfg)
        if arch == "Cohere2MoeForCausalLM":
            cfg = _cohere2_moe_config(cfg)
        if arch == "JambaForCausalLM":  # (transformers' JambaConfig defaults)
            cfg = {"max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "num_key_value_heads": 8,
                   **{k: v for k, v in cfg.items() if v is not None}}
        if arch in QWEN3_NEXT_FAMILY:
            cfg = {**QWEN3_NEXT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        if arch in ("Qwen3_5MoeForCausalLM", "SolarOpenForCausalLM") \
                and cfg.get("intermediate_size") is None:  # (no dense MLP: unread)
            cfg = {**cfg, "intermediate_size": int(cfg.get("moe_intermediate_size") or 512)}
        if arch in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
            # (Its M-RoPE, over text alone, is plain RoPE: a text token's three positions are equal.)
            for key in ("rope_parameters", "rope_scaling"):
                if isinstance(cfg.get(key), dict):
                    cfg = {**cfg, key: {k: v for k, v in cfg[key].items() if k not in ("mrope_section",
                                                                                      "mrope_interleaved")}}
        if arch == "Glm4MoeForCausalLM":
            cfg = {**GLM4_MOE_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        if arch == "Llama4ForCausalLM":  # (before the defaults: its two MLP widths)
            cfg = _llama4_config(cfg)
        if arch in EXAONE_ARCHITECTURES:  # (before the defaults: a null sliding_window means none)
            cfg = _exaone4_config(cfg)
        if arch == "GPTNeoXForCausalLM":
            cfg = _gpt_neox_config(cfg)
        if arch in GPT_ARCHITECTURES:
            cfg = _gpt_config(arch, cfg)
        if arch == "OPTForCausalLM":
            cfg = _opt_config(cfg)
        if arch in ("BioGptForCausalLM", "XGLMForCausalLM"):
            cfg = _biogpt_xglm_config(arch, cfg)
        if arch == "ModernBertDecoderForCausalLM":
            cfg = _modernbert_decoder_config(cfg)
        if arch == "GPTNeoForCausalLM":
            cfg = _gpt_neo_config(cfg)
        if arch == "FalconForCausalLM":
            cfg = _falcon_config(cfg)
        if arch == "BloomForCausalLM":
            cfg = _bloom_config(cfg)
        if arch in MPT_ARCHITECTURES:
            cfg = _mpt_config(arch, cfg)
        if arch == "DbrxForCausalLM":
            cfg = _dbrx_config(cfg)
        if arch in NULL_KEEPING_DEFAULTS:  # (a key a config states, null included, wins)
            cfg = {**NULL_KEEPING_DEFAULTS[arch], **cfg}
        if arch == "AfmoeForCausalLM":
            cfg = _afmoe_config(cfg)
        if arch in LAGUNA_ARCHITECTURES:
            cfg = _laguna_config(arch, cfg)
        if arch == "MiMoV2FlashForCausalLM":
            cfg = _mimo_v2_flash_config(cfg)
        if arch in GRANITE_SWA_ARCHITECTURES:
            cfg = _granite_swa_config(arch, cfg)
        if arch == "OlmoHybridForCausalLM":
            cfg = _olmo_hybrid_config(cfg)
        if arch == "KimiLinearForCausalLM":
            cfg = _kimi_linear_config(cfg)
        if arch in MINIMAX_ARCHITECTURES:
            cfg = _minimax_config(arch, cfg)
        if arch == "BailingHybridForCausalLM":
            cfg = _bailing_hybrid_config(cfg)
        if arch in ("Kolibri1ForCausalLM", "FlintForCausalLM"):
            cfg = _kolibri1_flint_config(arch, cfg)
        if arch == "BeamForCausalLM":
            cfg = _beam_config(cfg)
        if arch == "MiniCPMForCausalLM":
            cfg = _minicpm_config(cfg)
        if arch in ("InternLM2ForCausalLM", "InternLM3ForCausalLM"):
            cfg = _internlm_config(arch, cfg)
        if arch == "ExaoneForCausalLM":
            cfg = _exaone_config(cfg)
        if arch in LLAMA_LIKE_DEFAULTS:
            cfg = {**LLAMA_LIKE_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None}}
        if arch == "JetMoeForCausalLM":
            cfg = _jetmoe_config(cfg)
        if arch == "LongcatFlashForCausalLM":
            cfg = _longcat_flash_config(cfg)
        if arch == "ApertusForCausalLM" and not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            cfg = {**cfg, "rope_parameters": dict(APERTUS_ROPE_DEFAULTS)}  # (transformers' ApertusConfig's)
        if arch == "CwmForCausalLM":  # (transformers' CwmConfig: llama3 RoPE, every fourth layer from 0 full)
            if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
                cfg = {**cfg, "rope_parameters": dict(CWM_ROPE_DEFAULTS)}
            if not isinstance(cfg.get("layer_types"), list):
                cfg = {**cfg, "layer_types": ["sliding_attention" if i % 4 else "full_attention"
                                              for i in range(int(cfg["num_hidden_layers"]))]}
        if arch in LAYER_NORM_ARCHITECTURES:  # (LayerNorms' epsilon)
            cfg["rms_norm_eps"] = float(cfg.get("norm_epsilon", cfg.get("layer_norm_eps", cfg.get("norm_eps"))) or 1e-5)
        if arch == "OlmoForCausalLM":  # (its parameter-free LayerNorms' epsilon, fixed)
            cfg["rms_norm_eps"] = 1e-5
        # (Biases on every projection of Phi's, GPT-NeoX's and Persimmon's MLPs, and of Phi's and
        # Persimmon's attention; Persimmon's attention is multi-head.)
        if arch in ("PhiForCausalLM", "GPTNeoXForCausalLM", "PersimmonForCausalLM"):
            cfg = {**cfg, "mlp_bias": True,
                   **({"attention_bias": True} if arch in ("PhiForCausalLM", "PersimmonForCausalLM") else {})}
        if arch == "PersimmonForCausalLM":
            cfg = {**cfg, "num_key_value_heads": cfg["num_attention_heads"]}
        if arch in HUNYUAN_ARCHITECTURES and cfg.get("use_cla"):
            raise ValueError(f"{arch} with use_cla (keys and values shared across layers) is not "
                             "served")
        if arch == "MiniCPM5MoeForCausalLM" and cfg.get("use_gated_attention") is False:
            raise ValueError("MiniCPM5MoeForCausalLM without its gated attention (use_gated_attention false) is "
                             "not served, as transformers refuses it")
        if arch == "MiniMaxM2ForCausalLM":
            cfg = {**MINIMAX_M2_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
        if arch == "GptOssForCausalLM":
            cfg = {**GPT_OSS_DEFAULTS, **cfg}
            if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
                cfg["rope_scaling"] = dict(GPT_OSS_ROPE_DEFAULTS)
            if not isinstance(cfg.get("layer_types"), list):  # (transformers' default: the even layers windowed)
                cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(int(cfg["num_hidden_layers"]))]
        if arch == "Ministral3ForCausalLM" and not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
            # (transformers' Ministral3Config defaults: YaRN over 16,384 positions, Llama 4's scale)
            positions = int(cfg.get("max_position_embeddings") or 262_144)
            cfg = {**cfg, "max_position_embeddings": positions,
                   "rope_parameters": {**MINISTRAL3_ROPE_DEFAULTS, "max_position_embeddings": positions}}
        act = _activation(arch, cfg)
        gemma = arch in GEMMA_ARCHITECTURES
        # EmbeddingGemma: Gemma 3 run as an encoder (every token attends to every other), for embeddings only.
        bidirectional = always_bidirectional or (bool(cfg.get("use_bidirectional_attention"))
                                                 and arch == "Gemma3ForCausalLM")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        hidden = int(cfg["hidden_size"])
        # (transformers' Gemma configs default head_dim to 256, whatever hidden_size / heads is.)
        head_dim = int(cfg.get("head_dim") or (256 if gemma else hidden // num_heads))
        # Qwen2-VL's M-RoPE: plain RoPE whose frequencies are split among three position axes.
        sections = mrope_section(cfg)
        if sections is not None:
            if not isinstance(vision, QwenVisionConfig | Qwen3VisionConfig):
                raise ValueError(f"M-RoPE (mrope_section) is served for Qwen2-VL and Qwen3-VL models, not {arch}")
            # (Its rope_type, or the older "type", says "mrope" or nothing for plain RoPE; any other
            # is the frequencies' scaling, YaRN's for Qwen2.5-VL's long context.)
            for key in ("rope_parameters", "rope_scaling"):
                if isinstance(cfg.get(key), dict):
                    rope = {k: v for k, v in cfg[key].items()
                            if k not in ("mrope_section", "mrope_interleaved", "type")}
                    kind = cfg[key].get("rope_type") or cfg[key].get("type")
                    rope["rope_type"] = "default" if kind in (None, "mrope") else kind
                    cfg = {**cfg, key: rope}
        theta, scaling = _rope_from_dict(arch, cfg)
        mla = _mla_fields(arch, cfg, scaling)
        if mla:  # (the cache's view: one latent "head" of kv_lora_rank + qk_rope_head_dim values, and
            # under DSA the indexer's key beside them)
            num_kv_heads = 1
            head_dim = mla["kv_lora_rank"] + mla["qk_rope_head_dim"] + mla.get("index_head_dim", 0)
            cfg = {k: v for k, v in cfg.items() if k != "partial_rotary_factor"}
        if arch == "Olmo3ForCausalLM" and scaling and scaling["rope_type"] == "longrope":
            # (LongRoPE picks rows by a shifted position, which its windowed layers' plain RoPE would not follow)
            raise ValueError("rope_type 'longrope' is not served for OLMo 3's full-attention layers")
        if gemma and scaling and scaling["rope_type"] not in ("linear", "llama3") \
                and not (arch == "Gemma4ForCausalLM" and scaling["rope_type"] == "proportional"):
            raise ValueError(f"rope_type must be 'default', 'linear' or 'llama3' for {arch}, "
                             f"got {scaling['rope_type']!r}")
        params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        if mla:  # (MLA rotates its qk_rope_head_dim values whatever a share of a head says: Ling 3 states 0.5)
            partial = 1.0
        if arch == "MiniMaxM2ForCausalLM" and "partial_rotary_factor" not in params \
                and cfg.get("partial_rotary_factor") is None and cfg.get("rotary_dim"):
            partial = int(cfg["rotary_dim"]) / head_dim  # (as released: rotary_dim, 64 of 128)
        # (The share times the width, in whole values: a share read from a width, GPT-J's rotary_dim,
        # gives that width back whatever the float's rounding.)
        rotary_dim = mla["qk_rope_head_dim"] if mla else int(head_dim * partial + 1e-6)
        if arch in ("Glm4MoeForCausalLM", *GLM_DENSE_ARCHITECTURES) and "partial_rotary_factor" not in params \
                and cfg.get("partial_rotary_factor") is None:
            partial, rotary_dim = 0.5, head_dim // 2  # (transformers' default for GLM-4 and 4.5: half of each head)
        # Phi-4-mini rotates 3/4 of each head, GLM-4.5 half (the first values of each, in halves as
        # Llama's); the Llama-family code of the others rotates whole heads.
        if partial != 1.0 and (arch not in PARTIAL_ROTARY_ARCHITECTURES or not 0 < rotary_dim <= head_dim
                               or rotary_dim % 2):
            raise ValueError(f"partial_rotary_factor must be 1.0 (RoPE over whole heads) for {arch}, or give an "
                             f"even rotary width for {' or '.join(PARTIAL_ROTARY_ARCHITECTURES)}, got {partial}")
        if arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
            # (transformers reads a missing sliding_window as 4096.)
            sliding = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        elif arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            # (transformers reads a missing sliding_window as 4096.)
            sliding = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window") else None
        elif arch == "GptOssForCausalLM":
            qkv_bias = o_bias = bool(cfg["attention_bias"])
            sliding = cfg.get("sliding_window")
        elif arch == "Dots1ForCausalLM":
            # (transformers' Dots1Config: a window of sliding_window (4096 where absent) on the layers from
            # max_window_layers (62) on, where layer_types does not name them)
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window", 4096)
            kinds = cfg.get("layer_types")
            if sliding and not isinstance(kinds, list):
                first = int(cfg.get("max_window_layers", 62))
                kinds = ["sliding_attention" if i >= first else "full_attention"
                         for i in range(int(cfg["num_hidden_layers"]))]
                cfg = {**cfg, "layer_types": kinds}
            if not isinstance(kinds, list) or "sliding_attention" not in kinds:
                sliding = None
        elif arch in ("Glm4MoeForCausalLM", *GLM_DENSE_ARCHITECTURES, "HeliumForCausalLM", "SolarOpenForCausalLM"):
            # (attention_bias: q, k and v's; o_proj has none)
            qkv_bias, o_bias, sliding = bool(cfg.get("attention_bias", False)), False, None
        elif arch in GEMMA_WINDOWED_ARCHITECTURES:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
            sliding = cfg.get("sliding_window", 4096)
            if bidirectional and sliding:
                # EmbeddingGemma's windowed layers: |i - j| < sliding_window // 2 + 1, as transformers reads it.
                sliding = int(sliding) // 2
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", cfg.get("use_bias", False)))  # (ERNIE: use_bias)
            if arch in ("SeedOssForCausalLM", "InternLM2ForCausalLM", "InternLM3ForCausalLM"):  # (o_proj's own)
                o_bias = bool(cfg.get("attention_out_bias", False))
            if arch == "MiMoV2FlashForCausalLM":  # (q, k and v's alone)
                o_bias = False
            if arch == "GPTNeoForCausalLM":  # (out_proj's alone)
                o_bias = True
            if arch == "StableLmForCausalLM":  # (q, k and v's alone)
                qkv_bias, o_bias = bool(cfg.get("use_qkv_bias", False)), False
            # Mistral v0.1 (4096) and Phi-3 (2047 in the 4k models) window every layer.
            sliding = (cfg.get("sliding_window") if arch in ("MistralForCausalLM", "Ministral3ForCausalLM",
                                                             "MinistralForCausalLM", "CwmForCausalLM",
                                                             "MixtralForCausalLM", "Phi3ForCausalLM",
                                                             "PhimoeForCausalLM",
                                                             "Cohere2ForCausalLM", *EXAONE_ARCHITECTURES,
                                                             "AfmoeForCausalLM", *LAGUNA_ARCHITECTURES,
                                                             "MiMoV2FlashForCausalLM", *GRANITE_SWA_ARCHITECTURES,
                                                             "Cohere2MoeForCausalLM", "Lfm3ForCausalLM",
                                                             "GPTNeoForCausalLM", "Kolibri1ForCausalLM",
                                                             "FlintForCausalLM", "BeamForCausalLM",
                                                             "ModernBertDecoderForCausalLM",
                                                             "Starcoder2ForCausalLM") else None)
            if arch == "SmolLM3ForCausalLM" and cfg.get("use_sliding_window"):
                sliding = cfg.get("sliding_window")
            if arch == "Olmo3ForCausalLM":  # (transformers' default window, on three layers of four)
                sliding = cfg.get("sliding_window", 4096)
                if sliding and not isinstance(cfg.get("layer_types"), list):
                    cfg = {**cfg, "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                                  for i in range(int(cfg["num_hidden_layers"]))]}
        num_layers = int(cfg["num_hidden_layers"])
        if arch == "SmolLM3ForCausalLM" and sliding and not isinstance(cfg.get("layer_types"), list):
            # (transformers' default: the NoPE layers windowed)
            rotates = _smollm3_fields(arch, cfg, num_layers)["rope_layers"]
            cfg = {**cfg, "layer_types": ["full_attention" if r else "sliding_attention" for r in rotates]}
        window_layers: tuple[bool, ...] = ()
        gemma_kinds = arch in GEMMA_WINDOWED_ARCHITECTURES
        if (sliding or gemma_kinds) and isinstance(cfg.get("layer_types"), list) and arch != "Qwen3MoeForCausalLM":
            # (Qwen3-MoE windows every layer when it windows at all, whatever a config lists. Gemma's
            # layer kinds are kept without a window too: Gemma 3's also choose each layer's RoPE.)
            window_layers = tuple(kind == "sliding_attention" for kind in cfg["layer_types"])
            if len(window_layers) != num_layers:
                raise ValueError(f"layer_types lists {len(window_layers)} layers, the model has {num_layers}")
        elif gemma_kinds:
            window_layers = _gemma_window_layers(arch, cfg, num_layers)
        elif sliding and arch == "Qwen2MoeForCausalLM":
            # transformers' rule for Qwen2-MoE: every other layer (the even ones) below max_window_layers.
            last = int(cfg.get("max_window_layers", 28))
            window_layers = tuple(i % 2 == 0 and i < last for i in range(num_layers))
        elif sliding and arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            # transformers' rule: the layers from max_window_layers (28 by default) on use the window.
            first = int(cfg.get("max_window_layers", 28))
            window_layers = tuple(i >= first for i in range(num_layers))
        moe = _moe_from_dict(arch, cfg, num_layers)
        hybrid = _granite_hybrid_fields(arch, cfg, num_layers)
        if arch == "GraniteMoeHybridForCausalLM" and not moe:  # (no experts: the shared MLP is the MLP)
            cfg = {**cfg, "intermediate_size": int(cfg.get("shared_intermediate_size") or 1024)}
        if moe and act != "silu" and arch != "NemotronHForCausalLM":
            raise ValueError(f"hidden_act must be 'silu' for a mixture-of-experts model, got {act!r}")
        # generation_config.json is where Llama-3-style checkpoints list their extra EOS ids.
        eos = _eos_ids((generation_config or {}).get("eos_token_id")) or _eos_ids(cfg.get("eos_token_id"))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if arch in OLMO_ARCHITECTURES else 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            # (Gemma and SmolLM3 tie them unless their config says otherwise, as transformers reads it.)
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma or arch == "SmolLM3ForCausalLM")),
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", cfg.get("use_bias", False))),  # (ERNIE 4.5's use_bias covers its MLP too)
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM",
                             "Gemma4ForCausalLM",
                             "Dots1ForCausalLM",
                             *HUNYUAN_ARCHITECTURES)
            or (arch == "Glm4MoeForCausalLM" and bool(cfg.get("use_qk_norm", False)))
            or arch in (*LFM2_ARCHITECTURES, *EXAONE_ARCHITECTURES, "ApertusForCausalLM", "AfmoeForCausalLM",
                        *LAGUNA_ARCHITECTURES, "HYV3ForCausalLM", "NanoChatForCausalLM", "Kolibri1ForCausalLM",
                        "FlintForCausalLM", "BeamForCausalLM")
            or (arch in ("PhiForCausalLM", "PersimmonForCausalLM") and bool(cfg.get("qk_layernorm"))),
            eos_token_ids=eos,
            sliding_window=int(sliding) if sliding else None,
            dtype=parse_dtype(dtype_name) if isinstance(dtype_name, str) else None,
            raw=dict(cfg),
            vision=vision,
            sliding_window_layers=window_layers,
            rotary_dim=rotary_dim,
            mrope_section=sections,
            mrope_interleaved=isinstance(vision, Qwen3VisionConfig),
            hidden_act=act,
            embedding_only=embedding_only or bidirectional,
            encoder_only=bidirectional,
            labels=labels,
            classifier_activation=head.pop("classifier_activation", None)
            or _classifier_activation(cfg.get("problem_type"), len(labels)),
            cross_encoder_activation=_cross_encoder_activation(cfg) if labels else "sigmoid",
            **head,
            **moe,
            **_gemma_from_dict(arch, cfg),
            llama_4_scaling=_llama_4_scaling(arch, cfg),
            attention_sinks=arch in ("GptOssForCausalLM", *GRANITE_SWA_ARCHITECTURES, "FlintForCausalLM"),
            **_smollm3_fields(arch, cfg, num_layers),
            **_olmo3_fields(arch, cfg),
            **_granite_fields(arch, cfg),
            **_final_logit_cap_fields(arch, cfg),
            **_modernbert_decoder_fields(arch, cfg),
            **_minicpm_fields(arch, cfg),
            **hybrid,
            **_nemotron_h_fields(arch, cfg),
            **_qwen3_next_fields(arch, cfg, num_layers),
            **_kimi_linear_fields(arch, cfg, num_layers),
            **_minimax_fields(arch, cfg, num_layers),
            **_bailing_hybrid_fields(arch, cfg, num_layers),
            **_lfm2_fields(arch, cfg, num_layers),
            **_falcon_h1_fields(arch, cfg, num_layers),
            **_jamba_fields(arch, cfg, num_layers),
            **_zamba2_fields(arch, cfg),
            **_cohere_fields(arch, cfg),  # (Cohere2-MoE's too)
            **_exaone4_fields(arch, cfg),
            **_afmoe_fields(arch, cfg),
            **_laguna_fields(arch, cfg, head_dim),
            **_mimo_v2_flash_fields(arch, cfg, head_dim),
            **_granite_swa_fields(arch, cfg),
            **_llama4_fields(arch, cfg),
            **_learned_positions_fields(arch, cfg, num_layers),
            **_alibi_fields(arch, cfg, head_dim, num_layers),
            clip_qkv=(float(cfg["clip_qkv"]) if arch in ("OlmoForCausalLM", "OlmoeForCausalLM", "DbrxForCausalLM",
                                                          *MPT_ARCHITECTURES)
                      and cfg.get("clip_qkv") is not None else None),
            **mla,
            # (An encoder's every token has seen the whole prompt: its mean, unless its files say.)
            **({"default_pooling_type": "MEAN"} if always_bidirectional else {}),
            **({"language_model_of": text_only_of} if text_only_of else {}),
        )

    @classmethod
    def _encoder(cls, arch: str, cfg: dict[str, Any]) -> ModelConfig:
        """A BERT-family encoder's config, as transformers' BertConfig / RobertaConfig / ModernBertConfig read it."""
        ours = ENCODER_ARCHITECTURES[arch]
        if arch == "XLMRobertaModel" and cfg.get("position_embedding_type") == "rotary":
            ours = "JinaEmbeddingsV3Model"  # (Jina v3's own code's checkpoint)
        if ours in ("NomicBertModel", "GteModel"):
            cfg = _rope_bert_config(ours, cfg)
        if cfg.get("classifier_from_token") is not None:
            raise ValueError(f"classifier_from_token is for causal LMs; {arch} has its own classifier head")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError(f"{arch} configured as a decoder (is_decoder / add_cross_attention) is not served: "
                             "only the encoder is")
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % num_heads:
            raise ValueError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({num_heads})")
        token_classifier = arch.endswith("ForTokenClassification")
        labels = _labels(cfg) if arch.endswith("ForSequenceClassification") or token_classifier else ()
        family = (_modernbert_fields(arch, cfg, bool(labels)) if ours == "ModernBertModel"
                  else _rope_bert_fields(ours, arch, cfg) if ours in ("NomicBertModel", "GteModel")
                  else _jina_fields(arch, cfg) if ours == "JinaEmbeddingsV3Model"
                  else _bert_fields(ours, arch, cfg))
        colbert_dim = None
        if arch == "HF_ColBERT":  # (its width: colbert_dim, dim or projection_dim, as vLLM reads it)
            colbert_dim = _colbert_width(cfg)
            if not isinstance(colbert_dim, int) or colbert_dim < 1:
                raise ValueError("HF_ColBERT's config must give its vectors' width (colbert_dim, dim or "
                                 "projection_dim)")
        late_interaction = bool(colbert_dim) or arch == "ColBERTModernBertModel"
        if token_classifier or late_interaction:  # (a head on every token's final state)
            family["default_pooling_type"] = "ALL"
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
        return cls(
            architecture=ours, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads, num_key_value_heads=num_heads, head_dim=hidden // num_heads,
            rms_norm_eps=0.0, rope_scaling=family.pop("rope_scaling", None), tie_word_embeddings=False, qk_norm=False,
            eos_token_ids=(),
            dtype=parse_dtype(dtype_name) if isinstance(dtype_name, str) else None, raw=dict(cfg),
            embedding_only=True, labels=labels,
            classifier_activation=_classifier_activation(cfg.get("problem_type"), len(labels)),
            cross_encoder_activation=_cross_encoder_activation(cfg) if labels else "sigmoid",
            encoder_only=True, token_classifier=token_classifier, m3_heads=arch == "BgeM3EmbeddingModel",
            colbert_dim=colbert_dim, late_interaction=late_interaction, **family)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_overrides: dict[str, Any] | None = None,
                        tokenizer_dir: str | Path | None = None,
                        mm_processor_kwargs: dict[str, Any] | None = None,
                        language_model_only: bool = False, pipeline_stages: bool = False,
                        videos_refused: bool = False) -> ModelConfig:
        """``hf_overrides`` (vLLM's --hf-overrides): keys set over config.json's, e.g. to serve a
        causal LM as a classifier (below); a sub-config's keys (``text_config``, ...) are set over
        its own, as vLLM updates a nested config. ``tokenizer_dir`` (--tokenizer): where the tokens
        a config names by text (a step tag, a classifier's tokens) are looked up; else the model's.
        ``mm_processor_kwargs`` (--mm-processor-kwargs): settings over preprocessor_config.json's, for
        what the image processor decides here (Qwen2-VL's pixel range). ``language_model_only``: a
        vision-language checkpoint's language model alone, without its vision side (vLLM's text-only
        mode; a model that takes videos keeps its tower for them unless ``videos_refused``).
        ``pipeline_stages``: the model is to be split into pipeline stages, where a Gemma 3
        checkpoint serves its language model alone (its tower is not split into stages; other
        vision-language models are refused there)."""
        model_dir = Path(model_dir)
        vocabulary = Path(tokenizer_dir).expanduser() if tokenizer_dir else model_dir
        cfg = with_overrides(json.loads((model_dir / "config.json").read_text()), hf_overrides or {})
        if (cfg.get("architectures") or [None])[0] == "HF_ColBERT" and not _colbert_width(cfg):
            # (colbertv2.0 and answerai-colbert keep it in their artifact metadata: vLLM reads the projection.)
            cfg = {**cfg, "dim": _checkpoint_rows(model_dir, ("linear.weight", "bert.linear.weight"))}
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
        config = cls.from_dict(cfg, gen)
        tie_given = "tie_word_embeddings" in (hf_overrides or {})
        if config.vision is not None and config.tie_word_embeddings and not tie_given \
                and _stores_its_own_head(model_dir):
            # A vision-language checkpoint that stores a head of its own is not tied, whatever its
            # config says (transformers 5 writes Mistral3Config's default, tied, at the top level of a
            # checkpoint it re-saves, and keeps such a head, as vLLM reads the text config's flag).
            config = dataclasses.replace(config, tie_word_embeddings=False)
        image_processor = read_image_processor_config(model_dir) if config.vision is not None else None
        native = isinstance(config.vision, QwenVisionConfig | Qwen3VisionConfig)
        overrides = _processor_kwargs(mm_processor_kwargs or {}, config.vision, cfg["architectures"][0])
        pixel_range = {k: v for k, v in overrides.items() if k.endswith("_pixels")}
        # (Qwen2-VL and Qwen3-VL take videos too: the tower stays for them unless they are refused as well.)
        keeps_tower_for_videos = native and not videos_refused
        if config.vision is not None and ((language_model_only and not keeps_tower_for_videos) or (
                pipeline_stages and isinstance(config.vision, Gemma3VisionConfig))):
            config = dataclasses.replace(config, vision=None, language_model_of=cfg["architectures"][0])
            native = False
        if isinstance(config.vision, PixtralVisionConfig):
            # (Pixtral: the tokenizer's row-break and end tokens; the processor's longest side.)
            processor = image_processor or {}
            size = processor.get("size") if isinstance(processor.get("size"), dict) else {}
            token_ids = _token_ids_if_any(vocabulary, list(PIXTRAL_TOKEN_IDS))
            missing = [name for name in PIXTRAL_TOKEN_IDS if name not in token_ids]
            if missing:
                raise ValueError(f"the tokenizer has no {' or '.join(missing)} token: Pixtral's images need them")
            config = dataclasses.replace(config, vision=dataclasses.replace(
                config.vision, longest_edge=int(size.get("longest_edge") or config.vision.longest_edge),
                image_break_token_id=token_ids["[IMG_BREAK]"], image_end_token_id=token_ids["[IMG_END]"]))
        if isinstance(config.vision, Idefics3VisionConfig) and overrides:
            # (Idefics3: the side images are resized to before the router cuts their tiles.)
            config = dataclasses.replace(config, vision=dataclasses.replace(
                config.vision, tile_resize=overrides["tile_resize"]))
        if isinstance(config.vision, InternVLVisionConfig):
            # (InternVL: the processor's tiling, min_patches..max_patches tiles an image.)
            tiling = {**(image_processor or {}), **overrides}
            config = dataclasses.replace(config, vision=dataclasses.replace(
                config.vision, min_tiles=int(tiling.get("min_patches", config.vision.min_tiles)),
                max_tiles=int(tiling.get("max_patches", config.vision.max_tiles))))
        video_processor = read_video_processor_config(model_dir) if native else None
        if native and (image_processor is not None or pixel_range or video_processor is not None):
            # (Qwen2-VL, Qwen3-VL: the processor's pixel range decides an image's token count; the video
            # processor's, a video frame's.)
            config = dataclasses.replace(config, vision=native_vision_config(
                cfg, {**(image_processor or {}), **pixel_range}, video_processor))
        # (Older llm-compressor releases name it compression_config, as vLLM also reads it.)
        quantization = cfg.get("quantization_config") or cfg.get("compression_config")
        method, block = weight_quantization(quantization)  # (others: refused here)
        if method == "bitnet":  # (its converted layers' names: BitNet's and Llama's)
            from gpu_worker.bitnet_checkpoint import check_bitnet_model

            check_bitnet_model(config.architecture, 1, lora=False)
        if method is not None:
            config = dataclasses.replace(config, quantization=method, fp8_weight_block=block,
                                         quantization_config=dict(quantization))
        if config.step_tag_token is not None:
            config = dataclasses.replace(config, step_tag_id=_token_id_if_any(vocabulary, config.step_tag_token))
        if config.labels and cfg.get("classifier_from_token"):
            config = dataclasses.replace(config, classifier_token_ids=_token_ids(vocabulary,
                                                                                 cfg["classifier_from_token"]))
        return config
