"""Our decoder's logits against transformers' on the same random weights (fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_worker.config import ENCODER_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig
from gpu_worker.models import MODEL_REGISTRY, get_model_class
from gpu_worker.models.llama import MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from gpu_worker.quantized_checkpoint import weight_quantization
from tests.gpu_worker.utils import LLAMA3_ROPE, LONGROPE, load_hf, make_runner, prefill_logits, save_tiny_model

CASES = {
    "llama_untied": ("llama", {}),
    "llama3_rope_tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 50000.0, "tie_word_embeddings": True}),
    "llama_attention_bias": ("llama", {"attention_bias": True, "num_key_value_heads": 1}),
    "qwen2_bias": ("qwen2", {"num_key_value_heads": 4}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"head_dim": 8, "num_attention_heads": 4, "num_key_value_heads": 2}),
    # Qwen3's head_dim is its own (here 32, not hidden_size / heads = 16), with per-head q/k norms.
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3_tied_bias_mqa": ("qwen3", {"tie_word_embeddings": True, "attention_bias": True,
                                      "num_key_value_heads": 1}),
    # Phi-3's checkpoint stores q/k/v and gate/up fused: split at load.
    "phi3": ("phi3", {}),
    "phi3_mqa_tied": ("phi3", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    # Sliding windows far shorter than the 45-token prompt: every layer (Mistral v0.1, Phi-3), or
    # only the layers from max_window_layers on (Qwen2), the others attending fully.
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "ministral_windowed_and_full_layers": ("ministral", {}),
    "cwm": ("cwm", {}),
    # Persimmon: per-head q/k LayerNorms (and without them, tied), RoPE over half of each head, relu^2.
    "persimmon": ("persimmon", {}),
    # Hunyuan dense: q/k norms after RoPE, NTK RoPE by a fixed alpha; plain RoPE, one KV head.
    "hunyuan_dense": ("hunyuan_dense", {}),
    # Hunyuan MoE: the dense model's attention, 8 experts (2 a token) beside a shared MLP; plain RoPE, MQA.
    "hunyuan_moe": ("hunyuan_moe", {}),
    "hunyuan_moe_plain_rope_mqa": ("hunyuan_moe", {"num_key_value_heads": 1, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0}}),
    # DBRX: clamped fused q/k/v, bias-free LayerNorms, 8 experts (2 a token) renormalised; not, MQA.
    "dbrx": ("dbrx", {}),
    # VaultGemma: Gemma 2's attention and soft caps with two norms a layer; every layer windowed.
    "vaultgemma": ("vaultgemma", {}),
    "vaultgemma_every_layer_windowed": ("vaultgemma", {"layer_types": ["sliding_attention"] * 2}),
    "dbrx_unnormalised_mqa": ("dbrx", {"ffn_config": {"moe_normalize_expert_weights": None},
                                       "num_key_value_heads": 1}),
    "hunyuan_dense_plain_rope_mqa": ("hunyuan_dense", {"num_key_value_heads": 1, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0}}),
    "persimmon_no_qk_layernorm_tied": ("persimmon", {"qk_layernorm": False, "tie_word_embeddings": True}),
    # Jais 2: LayerNorms, an ungated relu^2 MLP, biases everywhere; and tied with one KV head.
    "jais2": ("jais2", {}),
    "jais2_mqa_tied": ("jais2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    # Solar Open: GLM-4.5's grouped sigmoid routing in every layer, q/k/v biases; and YaRN.
    "solar_open": ("solar_open", {}),
    "solar_open_yarn": ("solar_open", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                           "original_max_position_embeddings": 16}}),
    # Youtu-LLM: MLA (rotary values in pairs) with dense MLPs, tied; a plain query projection, rotary
    # values in halves, untied; YaRN's mscale in the softmax scale.
    # AFMoE: four norms a layer, the attention's output gated, windowed layers rotating and full ones
    # without positions, sigmoid routing through expert_bias times route_scale beside a shared expert,
    # mup's embedding scale; four layers, one KV head, tied, no mup; every layer routed, two shared.
    "afmoe": ("afmoe", {}),
    "afmoe_four_layers_mqa_tied": ("afmoe", {"num_hidden_layers": 4, "mup_enabled": False, "num_key_value_heads": 1,
                                             "tie_word_embeddings": True}),
    "afmoe_all_routed_two_shared": ("afmoe", {"num_shared_experts": 2, "num_dense_layers": 0, "route_scale": 1.0}),
    # Laguna: windowed and full layers of 4 and 2 query heads (the full ones rotating half of each head,
    # base 500,000), softplus gates per head, soft-capped sigmoid routing beside a shared expert; per-
    # channel gates, no cap, tied; every layer full with one KV head; YaRN on the full layers and half
    # of each head turning in the windowed ones too.
    "laguna": ("laguna", {}),
    "laguna_per_element_gate_uncapped_tied": ("laguna", {"gating": "per-element", "moe_router_logit_softcapping": 0.0,
                                                         "tie_word_embeddings": True}),
    "laguna_full_layers_mqa": ("laguna", {"layer_types": None, "num_attention_heads_per_layer": None,
                                          "num_key_value_heads": 1}),
    "laguna_yarn_partial_windowed": ("laguna", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                           "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}}),
    # Mellum: Qwen3-MoE's attention and experts where mlp_layer_types says sparse, a RoPE base per layer
    # kind; one KV head, tied, not renormalised; transformers' defaults (every layer full and routed).
    "mellum": ("mellum", {}),
    "mellum_mqa_tied_unnormalised": ("mellum", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                                "norm_topk_prob": False}),
    "mellum_defaults": ("mellum", {"mlp_layer_types": None, "layer_types": None}),
    # Hy3: Qwen3's attention, sigmoid routing through the correction bias times router_scaling_factor
    # beside a shared expert after a dense layer; one KV head, tied, every layer routed, two shared.
    "hy_v3": ("hy_v3", {}),
    "hy_v3_mqa_tied_all_routed": ("hy_v3", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                            "mlp_layer_types": ["sparse", "sparse"], "num_shared_experts": 2}),
    # (No shared experts stated: transformers still builds one, intermediate_size wide.)
    "hy_v3_no_shared_experts": ("hy_v3", {"num_shared_experts": 0}),
    # MiMo-V2-Flash: q/k heads of 24 (a third turning, a RoPE base per layer kind), values of 16 scaled,
    # windowed layers of twice the KV heads with sinks, grouped sigmoid routing without shared experts;
    # one KV head in the full layers, tied, unscaled values, no biases; YaRN on the full layers; its
    # default layer kinds over six layers.
    "mimo_v2_flash": ("mimo_v2_flash", {}),
    "mimo_v2_flash_mqa_tied_plain": ("mimo_v2_flash", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                                       "attention_value_scale": None, "attention_bias": False}),
    "mimo_v2_flash_yarn": ("mimo_v2_flash", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000000.0,
                           "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    "mimo_v2_flash_default_kinds": ("mimo_v2_flash", {"num_hidden_layers": 6, "layer_types": None,
                                                      "mlp_layer_types": None}),
    # (YaRN without a share of its own turns whole heads, as transformers' scaled RoPE reads it.)
    "mimo_v2_flash_yarn_whole_heads": ("mimo_v2_flash", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000000.0,
                           "original_max_position_embeddings": 16},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # GraniteSWA and GraniteMoeSWA: a sink per query head, windowed layers rotating (base 10,000) and a
    # full one without positions; a base of its own for the full layer, one KV head, tied; the defaults
    # (every fourth layer full, one base everywhere) over five layers.
    "granite_swa": ("granite_swa", {}),
    "granite_swa_two_bases_mqa_tied": ("granite_swa", {"layer_rope_theta": [500000.0] + [10000.0] * 3,
                                                       "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "granite_swa_defaults": ("granite_swa", {"layer_rope_theta": None, "layer_types": None, "num_hidden_layers": 5}),
    "granitemoe_swa": ("granitemoe_swa", {}),
    "granitemoe_swa_two_bases": ("granitemoe_swa", {"layer_rope_theta": [500000.0] + [10000.0] * 3}),
    # Cohere2-MoE: a dense prefix layer rotating, windowed layers rotating and a full one without
    # positions (RoPE in pairs), the softmax over the top-k logits, a shared expert averaged in,
    # LayerNorms; sigmoid weights unnormalised, the shared expert summed, RMSNorms; no shared expert,
    # two prefix layers, the second full and without positions (their pattern 2), one KV head, untied.
    "cohere2_moe": ("cohere2_moe", {}),
    "cohere2_moe_sigmoid_sum_rmsnorm": ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False,
                                                        "shared_expert_combination_strategy": "sum",
                                                        "rms_norm_eps": 1e-6}),
    "cohere2_moe_unshared_prefix_pattern_mqa": ("cohere2_moe", {"expert_selection_fn": "sigmoid",
                                                                "num_shared_experts": 0, "first_k_dense_replace": 2,
                                                                "prefix_dense_sliding_window_pattern": 2,
                                                                "num_key_value_heads": 1,
                                                                "tie_word_embeddings": False}),
    # GPT-Neo: global and local (8) layers in turn, unscaled scores, learned positions, tied; four
    # layers, untied, an MLP of its own width.
    "gpt_neo": ("gpt_neo", {}),
    "gpt_neo_four_layers_untied": ("gpt_neo", {"num_hidden_layers": 4, "tie_word_embeddings": False,
                                               "intermediate_size": 96}),
    # CodeGen: GPT-J's layers with q/k/v fused in four blocks of (q, v, k); and tied.
    "codegen": ("codegen", {}),
    "codegen_tied": ("codegen", {"tie_word_embeddings": True}),
    # OLMo Hybrid (saved with its released names: q/k/v convolutions apart, its own norm names): Gated
    # DeltaNet layers (2 key heads, 4 value heads, beta doubled) and an OLMo 2 attention layer with RoPE;
    # without positions (a null base), beta not doubled, tied; transformers' default heads and layer kinds.
    "olmo_hybrid": ("olmo_hybrid", {}),
    "olmo_hybrid_nope_unscaled_tied": ("olmo_hybrid", {"rope_parameters": {"rope_type": "default", "rope_theta": None},
                                                       "linear_allow_neg_eigval": False, "tie_word_embeddings": True}),
    "olmo_hybrid_defaults": ("olmo_hybrid", {"linear_num_key_heads": None, "linear_num_value_heads": None,
                                             "linear_key_head_dim": None, "linear_value_head_dim": None,
                                             "layer_types": None, "num_hidden_layers": 5}),
    # nanochat: weightless norms (over the embeddings too), relu^2 fc1/fc2, RoPE the other way round, q/k
    # normed after it, capped logits; uncapped, tied, one KV head; biased attention, a tight cap.
    "nanochat": ("nanochat", {}),
    "nanochat_uncapped_tied_mqa": ("nanochat", {"final_logit_softcapping": None, "tie_word_embeddings": True,
                                                "num_key_value_heads": 1}),
    "nanochat_biases_tight_cap": ("nanochat", {"final_logit_softcapping": 2.0, "attention_bias": True}),
    # Kolibri 1: GLM-4's four norms, EXAONE 4's attention (windowed layers rotate, full ones without
    # positions), experts chosen by logit plus the correction bias and weighted by sigmoid beside a shared
    # one; renormalised, the layer kinds the other way round, tied.
    "kolibri1": ("kolibri1", {}),
    "kolibri1_renormalised_full_first_tied": ("kolibri1", {"norm_topk_prob": True, "tie_word_embeddings": True,
                                                           "layer_types": ["full_attention", "sliding_attention"]}),
    # Flint: sinks in every layer, windowed layers rotating and full ones without positions, a dense first
    # layer then sigmoid-chosen experts beside a shared one; every layer routed, unnormalised, one KV head.
    "flint": ("flint", {}),
    "flint_all_routed_unnormalised_mqa": ("flint", {"layer_types": ["sliding_attention", "full_attention"],
                                                    "mlp_only_layers": [], "norm_topk_prob": False,
                                                    "num_key_value_heads": 1}),
    # LongCat-Flash: latent attention (queries and latent scaled) and a dense MLP in each half-layer, the
    # shortcut experts (8 routed, 4 zero) from the first half's MLP input added after the second; two layers
    # without zero experts, tied; more zero experts than routed ones, three a token.
    "longcat_flash": ("longcat_flash", {}),
    "longcat_flash_two_layers_no_zero_experts_tied": ("longcat_flash", {"num_hidden_layers": 4, "zero_expert_num": 0,
                                                                       "tie_word_embeddings": True}),
    "longcat_flash_more_zero_experts": ("longcat_flash", {"zero_expert_num": 12, "moe_topk": 3,
                                                          "routed_scaling_factor": 6.0}),
    # JetMoE: a mixture of attention heads (each token's two experts' query and output projections around
    # shared keys and values) and routed MLP experts, each with a bias; one KV head and three experts a token,
    # untied; four KV heads, one expert a token.
    "jetmoe": ("jetmoe", {}),
    "jetmoe_one_kv_head_three_experts_untied": ("jetmoe", {"num_key_value_heads": 1, "num_experts_per_tok": 3,
                                                           "tie_word_embeddings": False}),
    "jetmoe_four_kv_heads_one_expert": ("jetmoe", {"num_key_value_heads": 4, "num_experts_per_tok": 1}),
    # BitNet (unquantized): norms over the heads' outputs and over relu(gate)^2 * up; tied, one KV head.
    "bitnet": ("bitnet", {}),
    "bitnet_tied_mqa": ("bitnet", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    # Beam: gated attention (biases per head), windowed layers rotating and full ones without positions but
    # with queries scaled by position, four norms and depth-scaled residual adds, grouped sigmoid routing;
    # the kinds the other way round, every layer routed, unnormalised, uncapped, tied.
    "beam": ("beam", {}),
    "beam_windowed_without_positions": ("beam", {"rope_parameters": {"sliding_attention": None,
                                                                     "full_attention": None}}),
    "beam_full_first_all_routed_uncapped_tied": ("beam", {"layer_types": ["full_attention", "sliding_attention"],
                                                          "mlp_layer_types": ["sparse", "sparse"],
                                                          "norm_topk_prob": False, "final_logit_softcapping": None,
                                                          "tie_word_embeddings": True}),
    # A.X-K1: DeepSeek-V3 whose routed layers norm their MLP's output; rotary values in halves, tied,
    # every layer routed.
    "axk1": ("axk1", {}),
    "axk1_halves_tied_all_routed": ("axk1", {"rope_interleave": False, "tie_word_embeddings": True,
                                             "mlp_layer_types": ["sparse", "sparse"]}),
    "youtu": ("youtu", {}),
    "youtu_plain_query_halves_untied": ("youtu", {"q_lora_rank": None, "rope_interleave": False,
                                                  "tie_word_embeddings": False}),
    "youtu_yarn": ("youtu", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 64, "mscale_all_dim": 1.0,
                                                 "mscale": 1.0}}),
    # Ministral 3: YaRN over a pretrained 16 positions, the 45-token prompt's queries past them scaled
    # by Llama 4's attention temperature; with a window too.
    "ministral3": ("ministral3", {}),
    "ministral3_window_tied": ("ministral3", {"sliding_window": 8, "tie_word_embeddings": True}),
    "phi3_window": ("phi3", {"sliding_window": 7}),
    "qwen2_window_upper_layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    # LongRoPE (Phi-3/3.5-mini 128k): the 45-token prompt is past the pretrained 16, so the long
    # factors apply, with the attention factor from 256 / 16; Phi-4-mini rotates 3/4 of each head.
    "phi3_longrope": ("phi3", {"original_max_position_embeddings": 16, "rope_scaling": LONGROPE}),
    "phi4_mini_partial_longrope": ("phi3", {"original_max_position_embeddings": 16, "partial_rotary_factor": 0.75,
                                            "rope_scaling": {k: v[:6] if isinstance(v, list) else v
                                                             for k, v in LONGROPE.items()}}),
    "phi3_partial_rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    # Mixture of experts: 8 experts, 2 per token. Mixtral renormalises the two weights; Qwen2-MoE
    # does not, adds a gated shared expert, and keeps a dense MLP in the layers listed (or off its
    # sparse step); Qwen3-MoE renormalises, with its q/k norms.
    "mixtral": ("mixtral", {}),
    "mixtral_window_mqa": ("mixtral", {"sliding_window": 8, "num_key_value_heads": 1}),
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),
    "qwen2_moe_dense_layer": ("qwen2_moe", {"mlp_only_layers": [0]}),
    "qwen2_moe_sparse_step": ("qwen2_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 32}),
    "qwen3_moe_top1_tied": ("qwen3_moe", {"num_experts_per_tok": 1, "tie_word_embeddings": True}),
    # Their windows: Qwen3-MoE windows every layer; Qwen2-MoE the even layers below max_window_layers.
    "qwen3_moe_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}),
    "qwen2_moe_window": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2,
                                       "num_hidden_layers": 3}),
    # GPT-OSS: attention sinks, biases everywhere, windowed and full layers alternating, YaRN, routed
    # experts with biases and a clamped SwiGLU (its clamp at 7, and tight enough to bind), MQA.
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss_tight_clamp_mqa": ("gpt_oss", {"swiglu_limit": 0.3, "num_key_value_heads": 1, "num_hidden_layers": 3}),
    # GLM-4.5: sigmoid routing through the correction bias within the best group, the weights scaled,
    # an ungated shared expert, a dense first layer, half-head RoPE; with q/k norms (GLM-4.5 itself)
    # and without (GLM-4.5-Air), one group and no renormalising, MQA.
    "glm4_moe": ("glm4_moe", {"num_hidden_layers": 3}),
    "glm4_moe_qk_norm": ("glm4_moe", {"use_qk_norm": True}),
    "glm4_moe_one_group_mqa": ("glm4_moe", {"n_group": 1, "norm_topk_prob": False, "num_key_value_heads": 1,
                                            "partial_rotary_factor": 0.25}),
    # DeepSeek-V3 / V2: multi-head latent attention (absorbed: the cache holds the latent), rotary values
    # in pairs; V3's sigmoid routing within groups, V2's softmax (greedy, or within groups); YaRN
    # with mscale_all_dim (the softmax scale grows with it); MLA with biases.
    "deepseek_v3": ("deepseek_v3", {"num_hidden_layers": 3}),
    # DeepSeek-V3.2: each query past its sixth key attends to the six its indexer picks (every chunk of
    # the prompt's prefill, the later ones reading the indexer's keys from the cache).
    "deepseek_v32": ("deepseek_v32", {"num_hidden_layers": 3}),
    "deepseek_v32_yarn_four_wide_index_heads": ("deepseek_v32", {
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 11, "q_lora_rank": 48, "rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.7,
            "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}}),
    # GLM-5: its indexer rotating in pairs, the second and fourth layers sharing the first's and third's choice.
    "glm_moe_dsa": ("glm_moe_dsa", {"num_hidden_layers": 4}),
    "glm_moe_dsa_pattern_every_layer_indexing": ("glm_moe_dsa", {"num_hidden_layers": 3, "index_topk_pattern": "FFF",
                                                                  "index_topk": 9}),
    "deepseek_v3_yarn_not_interleaved": ("deepseek_v3", {"rope_interleave": False, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    "deepseek_v2_lite": ("deepseek_v2", {}),
    # MiniCPM5-MoE: gated attention without q/k norms, DeepSeek-V3's experts beside a shared one after a
    # dense first layer; MQA, two groups (one kept), not renormalised, the layers' kinds as listed.
    "minicpm5_moe": ("minicpm5_moe", {}),
    "minicpm5_moe_groups_mqa_listed_layers": ("minicpm5_moe", {
        "num_key_value_heads": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": False, "num_hidden_layers": 3,
        "mlp_layer_types": ["sparse", "dense", "sparse"]}),
    # GLM-4.7-Flash: DeepSeek-V3's MLA (rotary values in pairs) with GLM-4.5's experts after a dense first
    # layer; a plain query projection, RoPE in halves, two groups (one kept), the layers' kinds as listed.
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    "glm4_moe_lite_plain_query_halves_groups_listed": ("glm4_moe_lite", {
        "q_lora_rank": None, "rope_interleave": False, "n_group": 2, "topk_group": 1, "num_hidden_layers": 3,
        "mlp_layer_types": ["sparse", "dense", "sparse"]}),
    # MiniCPM3: MLA with rotary values in halves, dense MLPs, MiniCPM's scalings of the embeddings,
    # residual adds and logits; with a plain query projection, biases and an untied head; LongRoPE past
    # a pretrained 16 positions. (Null scalings: test_minicpm3s_null_scalings_scale_by_one.)
    "minicpm3": ("minicpm3", {}),
    "minicpm3_plain_query_bias_untied": ("minicpm3", {"q_lora_rank": None, "attention_bias": True,
                                                      "tie_word_embeddings": False}),
    "minicpm3_longrope": ("minicpm3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.8],
        "long_factor": [1.0, 2.5, 6.0, 12.0], "original_max_position_embeddings": 16}}),
    "deepseek_v2_groups_bias": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4,
                                                "topk_group": 1, "routed_scaling_factor": 16.0,
                                                "attention_bias": True, "q_lora_rank": 24}),
    # OLMoE: whole-projection q/k norms (their weight after the cast), routed experts not renormalised
    # (and renormalised), MQA.
    "olmoe": ("olmoe", {}),
    "olmoe_renormalised_mqa": ("olmoe", {"norm_topk_prob": True, "num_key_value_heads": 1}),
    # FlexOlmo: OLMo 2's post-norms and whole-projection q/k norms, OLMoE's experts.
    "flex_olmo": ("flex_olmo", {}),
    "flex_olmo_renormalised_mqa_tied": ("flex_olmo", {"norm_topk_prob": True, "num_key_value_heads": 1,
                                                      "tie_word_embeddings": True}),
    # SmolLM3's NoPE layers (every second one here); with a window on them.
    "smollm3": ("smollm3", {"num_hidden_layers": 3}),
    "smollm3_nope_window": ("smollm3", {"use_sliding_window": True, "sliding_window": 8, "tie_word_embeddings": False}),
    # Granite's embedding, residual and attention multipliers and logits scaling.
    "granite": ("granite", {}),
    "granite_bias_mqa": ("granite", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1}),
    # HyperCLOVA X: Granite's scalars (logits multiplied) with Peri-LN's norms after each sublayer; without
    # them; the default score scale (head_dim ** -0.5) with one KV head, tied.
    "hyperclovax": ("hyperclovax", {}),
    "hyperclovax_no_post_norm_biases": ("hyperclovax", {"use_post_norm": False, "attention_bias": True,
                                                        "mlp_bias": True}),
    "hyperclovax_default_scale_mqa_tied": ("hyperclovax", {"attention_multiplier": None, "num_key_value_heads": 1,
                                                           "tie_word_embeddings": True}),
    # MiniMax-M2: whole-projection q/k norms before a half-head RoPE, sigmoid routing through the
    # correction bias (renormalised); MQA with a quarter-head RoPE.
    "minimax_m2": ("minimax_m2", {}),
    "minimax_m2_mqa_quarter_rope": ("minimax_m2", {"num_key_value_heads": 1, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    # Granite MoE: the scalars, each layer's experts stored whole with the router beside them; tied,
    # MQA, one expert a token.
    "granitemoe": ("granitemoe", {}),
    "granitemoeshared": ("granitemoeshared", {}),
    # Granite 4.0-H: Mamba-2 layers beside attention without positions (routed experts and a shared
    # one); dense with RoPE and one group; the attention-only granite-4.0-micro layout.
    "granite_hybrid": ("granitemoehybrid", {}),
    "granite_hybrid_dense_rope": ("granitemoehybrid", {"num_local_experts": 0, "position_embedding_type": "rope",
                                                       "mamba_n_groups": 1, "layer_types": ["attention", "mamba",
                                                                                            "mamba", "attention"]}),
    "granite_hybrid_attention_only": ("granitemoehybrid", {"layer_types": ["attention"] * 4,
                                                           "position_embedding_type": "rope"}),
    # Nemotron-H: a block per layer (Mamba-2, relu^2 MLP, attention without positions); one group, MQA.
    # Bamba: Mamba-2 layers around attention that rotates half of each head (MQA, conv and proj
    # biases, one group; attention first and last).
    "bamba": ("bamba", {}),
    "bamba_mqa_biases_one_group": ("bamba", {"num_key_value_heads": 1, "mamba_proj_bias": True, "mamba_n_groups": 1,
                                             "attn_layer_indices": [0, 3], "attention_bias": True}),
    # Falcon-H1: attention and Mamba-2 side by side in every layer, muP multipliers folded into the
    # projections; with the gated norm (after the gate, and before it), biases everywhere, MQA.
    "falcon_h1": ("falcon_h1", {}),
    "falcon_h1_norm_after_gate_biases_mqa": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False,
                                                         "attention_bias": True, "mlp_bias": True,
                                                         "mamba_proj_bias": True, "projectors_bias": True,
                                                         "num_key_value_heads": 1}),
    "falcon_h1_norm_before_gate_tied": ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True,
                                                    "tie_word_embeddings": True, "mamba_n_groups": 1}),
    # LFM2: gated short convolutions around attention with q/k norms (tied, as released); with conv
    # biases, MQA, attention first; its intermediate width as given (no adjusting). LFM2-MoE.
    "lfm2": ("lfm2", {}),
    "lfm2_biases_mqa_unadjusted": ("lfm2", {"conv_bias": True, "num_key_value_heads": 1, "full_attn_idxs": [0, 2],
                                            "block_auto_adjust_ff_dim": False, "tie_word_embeddings": False}),
    "lfm2_moe": ("lfm2_moe", {}),
    # LFM3: convolutions, a full attention layer with proportional RoPE and a windowed one with plain RoPE,
    # per-head sigmoid gates, four norms a layer; without the gates and the extra norms, one KV head,
    # tied; transformers' default layer kinds over eight layers.
    "lfm3": ("lfm3", {}),
    "lfm3_plain_mqa_tied": ("lfm3", {"use_sandwich_norm": False, "use_attention_gate": False,
                                     "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "lfm3_default_kinds": ("lfm3", {"layer_types": None, "num_hidden_layers": 8}),
    "lfm2_moe_no_expert_bias_mqa": ("lfm2_moe", {"use_expert_bias": False, "norm_topk_prob": False,
                                                 "num_key_value_heads": 1}),
    "nemotron_h": ("nemotron_h", {}),
    "nemotron_h_one_group_mqa": ("nemotron_h", {"n_groups": 1, "num_key_value_heads": 1}),
    # Nemotron 3 Nano: routed relu^2 experts (sigmoid scores through the correction bias, in groups)
    # beside a shared one; and in a latent width.
    "nemotron_h_moe": ("nemotron_h_moe", {}),
    # Qwen3-Next: Gated DeltaNet layers beside gated attention; and a full layer every other one.
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_next_mqa": ("qwen3_next", {"num_key_value_heads": 1, "full_attention_interval": 2,
                                      "linear_num_key_heads": 4}),
    # Kimi-Linear: Kimi Delta Attention layers beside MLA without positions, DeepSeek-V3's experts; and
    # with a query bottleneck, MLA first and last, the second layer's MLP dense; its head tied in the
    # config (as transformers, not tied).
    "kimi_linear": ("kimi_linear", {}),
    "kimi_linear_query_bottleneck": ("kimi_linear", {
        "q_lora_rank": 16, "layer_types": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"], "tie_word_embeddings": True}),
    # MiniMax-Text-01 / M1: lightning attention beside GQA, residual scales per sublayer kind; and
    # transformers' default layers (full attention in the even ones), multi-query.
    "minimax": ("minimax", {}),
    "minimax_default_layers_mqa": ("minimax", {"layer_types": None, "num_key_value_heads": 1}),
    # Qwen3.5's language model: Qwen3-Next's layers, dense, its linear attention's projections apart.
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    # A pure Mamba-2 model (Mamba-Codestral): Mamba-2 blocks alone, no KV cache.
    "mamba2": ("mamba2", {}),
    # Mamba-1: every layer a selective-SSM mixer (per-channel states); tied, with biases, a wider state
    # and dt rank; Falcon-Mamba's weightless dt / B / C norms.
    "mamba": ("mamba", {}),
    "mamba_tied_biases": ("mamba", {"tie_word_embeddings": True, "use_bias": True, "state_size": 24,
                                    "time_step_rank": 8, "conv_kernel": 3}),
    "falcon_mamba": ("falcon_mamba", {}),
    # Jamba: Mamba-1 layers with weighted dt / B / C norms around attention without positions, experts in
    # every other layer; MQA, attention first, one expert a token, biases.
    "jamba": ("jamba", {}),
    "jamba_mqa_top1_biases": ("jamba", {"num_key_value_heads": 1, "attn_layer_offset": 0, "num_experts_per_tok": 1,
                                        "mamba_proj_bias": True, "mamba_dt_rank": 8}),
    "nemotron_h_moe_latent": ("nemotron_h_moe", {"moe_latent_size": 24}),
    # Cohere: attention beside the MLP, bias-free LayerNorms, RoPE in pairs, the logit scale; Command-R+'s
    # per-head q/k norms (with biases, one KV head); Cohere2: windowed rotating layers and a full one
    # without positions.
    "cohere": ("cohere", {}),
    "cohere_qk_norm_bias_mqa_untied": ("cohere", {"use_qk_norm": True, "attention_bias": True,
                                                  "num_key_value_heads": 1, "tie_word_embeddings": False}),
    "cohere2": ("cohere2", {}),
    # GLM-4 (0414): RoPE in pairs over half of each head, q/k/v biases, norms after attention and MLP;
    # the gate/up projection fused in the checkpoint.
    "glm4": ("glm4", {}),
    "glm4_mqa_tied_no_bias": ("glm4", {"num_key_value_heads": 1, "tie_word_embeddings": True,
                                       "attention_bias": False}),
    # Seed-OSS (o_proj's bias apart), Helium and ERNIE 4.5 (RoPE in pairs; ERNIE's biases), Arcee (an
    # ungated relu^2 MLP), EXAONE 4.0 (post-norms, per-head q/k norms, windowed rotating layers beside a
    # full one without positions; without a window, every layer full and rotating).
    "seed_oss": ("seed_oss", {}),
    "helium_mqa_tied": ("helium", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "ernie4_5": ("ernie4_5", {}),
    # ERNIE 4.5 MoE: routed experts through the correction bias beside a shared one; every other layer.
    "ernie4_5_moe": ("ernie4_5_moe", {}),
    "ernie4_5_moe_interval_untied": ("ernie4_5_moe", {"num_hidden_layers": 3, "moe_layer_interval": 2,
                                                      "tie_word_embeddings": False}),
    "arcee": ("arcee", {}),
    # StarCoder2 (LayerNorms, biases, an ungated gelu MLP, windows; without biases, untied) and StableLM
    # (LayerNorms, a quarter of each head rotating; StableLM 2 12B's parallel residual and per-head
    # q/k LayerNorms, one KV head).
    # Llama 4 (text): L2 q/k norms in the rotating layers, the no-position layers' query temperature,
    # experts weighted on their inputs beside a shared one; without norms or temperature, every layer
    # routed, two experts a token.
    "llama4": ("llama4", {}),
    "llama4_plain_every_layer_top2": ("llama4", {"use_qk_norm": False, "attn_temperature_tuning": False,
                                                 "interleave_moe_layer_step": 1, "num_experts_per_tok": 2}),
    "starcoder2": ("starcoder2", {}),
    "starcoder2_no_bias_untied": ("starcoder2", {"use_bias": False, "tie_word_embeddings": False}),
    "stablelm": ("stablelm", {}),
    "stablelm_2_12b_style_mqa": ("stablelm", {"use_parallel_residual": True, "qk_layernorm": True,
                                              "num_key_value_heads": 1}),
    # Nemotron (LayerNorm1P, half of each head rotating, relu^2; with biases, and without, tied), OLMo
    # (parameter-free LayerNorms; q, k and v clamped, and not), Phi (attention beside the MLP, 0.4 of
    # each head rotating, a biased head; per-head q/k LayerNorms and grouped KV heads, tied), GPT-NeoX
    # (side by side on two norms; in sequence, without attention biases, half of each head rotating).
    "nemotron": ("nemotron", {}),
    "nemotron_no_bias_tied": ("nemotron", {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True}),
    "olmo_clip_qkv": ("olmo", {}),
    "olmo_unclipped": ("olmo", {"clip_qkv": None}),
    "phi": ("phi", {}),
    "phi_qk_layernorm_gqa_tied": ("phi", {"qk_layernorm": True, "tie_word_embeddings": True}),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox_sequential_no_attention_bias": ("gpt_neox", {"use_parallel_residual": False, "attention_bias": False,
                                                           "rotary_pct": 0.5}),
    # GPT-2 (learned positions, Conv1D weights, fused c_attn; unscaled scores and its own MLP width),
    # GPTBigCode (multi-query; multi-head, each head's q, k and v together), GPT-J (attention beside the
    # MLP, RoPE in pairs over half of each head, a biased head; over whole heads, tied).
    "gpt2": ("gpt2", {}),
    "gpt2_unscaled_n_inner": ("gpt2", {"scale_attn_weights": False, "n_inner": 96}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "gpt_bigcode_multi_head": ("gpt_bigcode", {"multi_query": False}),
    "gptj": ("gptj", {}),
    "gptj_whole_heads_tied": ("gptj", {"rotary_dim": 16, "tie_word_embeddings": True}),
    # Falcon: falcon-7b (multi-query, one norm for attention beside the MLP), falcon-40b (KV heads in
    # groups, a norm each side), falcon-11B (grouped, one norm), attention then MLP with per-head q/k/v.
    "falcon_7b_style": ("falcon", {}),
    "falcon_40b_style": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "falcon_11b_style": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2,
                                    "num_ln_in_parallel_attn": 1}),
    "falcon_sequential_multi_head": ("falcon", {"parallel_attn": False, "multi_query": False, "bias": False}),
    # Phi-3.5-MoE: sparsemixer's two picks, LayerNorms, biases, a biased head, LongRoPE with its mscale;
    # plain RoPE, sparsemixer's released threshold.
    "phimoe": ("phimoe", {}),
    "phimoe_plain_rope": ("phimoe", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                     "router_jitter_noise": 0.01}),
    # Apertus: per-head q/k norms, an ungated xIELU MLP with each layer's learned scalars, llama3 RoPE.
    "apertus": ("apertus", {}),
    # ALiBi: BLOOM (a norm over the embeddings, per-head fused q/k/v; 6 heads, whose slopes are not a
    # power of two's, untied), MPT (clamped q/k/v, its own softmax scale; unclamped, 5 heads: transformers'
    # MPT takes alibi_bias_max 8 whatever its config says, as every released MPT has it, where MosaicML's
    # code and vLLM read it: served so, test_bloom_and_mpt_configs_as_released), falcon-rw (Falcon's
    # attention then MLP, biases scaled with the scores).
    "bloom": ("bloom", {}),
    "bloom_6_heads_untied": ("bloom", {"hidden_size": 96, "num_attention_heads": 6, "tie_word_embeddings": False}),
    "mpt": ("mpt", {}),
    "mpt_unclipped_5_heads": ("mpt", {"hidden_size": 80, "num_attention_heads": 5, "attn_config": {
        "clip_qkv": None, "softmax_scale": None}}),
    "falcon_rw": ("falcon_rw", {}),
    # OPT (learned positions from the table's third row, relu; without biases, untied).
    "opt": ("opt", {}),
    "opt_no_bias_untied": ("opt", {"enable_bias": False, "tie_word_embeddings": False}),
    # ModernBERT's decoder: normed embeddings, the first layer without an attention norm, windowed layers with
    # their own RoPE base, GeGLU, the head's dense + GELU + norm; four layers with every bias, untied, no
    # projection bias.
    "modernbert_decoder": ("modernbert_decoder", {}),
    "modernbert_decoder_biases_untied": ("modernbert_decoder", {"num_hidden_layers": 4, "tie_word_embeddings": False,
                                                                "decoder_bias": False, "norm_bias": True,
                                                                "attention_bias": True, "mlp_bias": True,
                                                                "classifier_bias": True}),
    # BioGPT: OPT's layers (GELU) over sqrt(hidden)-scaled token embeddings; unscaled, untied.
    "biogpt": ("biogpt", {}),
    "biogpt_unscaled_untied": ("biogpt", {"scale_embedding": False, "tie_word_embeddings": False}),
    # XGLM: the same with fairseq's sinusoidal positions; untied.
    "xglm": ("xglm", {}),
    "xglm_untied": ("xglm", {"tie_word_embeddings": False}),
    # GLM-4-9B (GlmForCausalLM): GLM-4's attention and fused MLP without the extra norms.
    "glm": ("glm", {}),
    # dots.llm1: grouped sigmoid routing through the correction bias, renormalised and scaled; ungrouped,
    # not renormalised, with a window of 8 on its second layer.
    "dots1": ("dots1", {}),
    "dots1_ungrouped_windowed": ("dots1", {"norm_topk_prob": False, "n_group": 1, "topk_group": 1,
                                           "sliding_window": 8, "max_window_layers": 1}),
    # Gemma 3n: AltUp's streams, LAuReL, per-layer inputs (ids past their table read row 0), windowed and
    # full layers, the last two attending over the first two's caches, sparse gates, widths by layer; two
    # streams with the second active, no scale on the correction, no sharing, one width, untied; MQA, a
    # tighter logit cap, sharper gates.
    "gemma3n": ("gemma3n", {}),
    "gemma3n_two_streams_second_active_unshared_untied": ("gemma3n", {
        "altup_num_inputs": 2, "altup_active_idx": 1, "altup_correct_scale": False, "num_kv_shared_layers": 0,
        "intermediate_size": 96, "tie_word_embeddings": False}),
    "gemma3n_mqa_capped_sharper_gates": ("gemma3n", {"num_key_value_heads": 1, "final_logit_softcapping": 5.0,
                                                     "activation_sparsity_pattern": [0.95, 0.3, 0.0, 0.0]}),
    # Gemma 4: windowed layers and full ones of their own heads (wider, one KV head whose values are the
    # keys' projection, proportional RoPE), KV sharing with double-wide MLPs, per-layer inputs, experts
    # beside each MLP, capped logits; then none of those extras (untied); then MQA everywhere, full heads
    # of 24 with half of them turning.
    "gemma4": ("gemma4", {}),
    "gemma4_plain": ("gemma4", {"enable_moe_block": False, "hidden_size_per_layer_input": 0,
                                "attention_k_eq_v": False, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
                                "final_logit_softcapping": None, "tie_word_embeddings": False}),
    "gemma4_mqa_half_rotary_full_heads": ("gemma4", {
        "num_key_value_heads": 1, "global_head_dim": 24, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000000.0}}}),
    "exaone4": ("exaone4", {}),
    "exaone4_no_window": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4}),
    # K-EXAONE: EXAONE 4.0's attention in pre-norm layers, DeepSeek-V3's experts beside a shared one after
    # a dense first layer; MQA with two shared experts' width and the layers' kinds as listed; windows on
    # every other layer, two groups (one kept), not renormalised.
    "exaone_moe": ("exaone_moe", {}),
    "exaone_moe_mqa_listed_layers_wide_shared": ("exaone_moe", {
        "num_key_value_heads": 1, "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"], "num_shared_experts": 2}),
    "exaone_moe_alternating_windows_groups": ("exaone_moe", {"sliding_window_pattern": 2, "n_group": 2,
                                                             "topk_group": 1, "norm_topk_prob": False}),
    # Zamba2: Mamba-2 layers, three of them running two shared blocks in turn with their own adapters
    # and RoPE; one block for every hybrid layer, no attention adapters, no RoPE, biases on the mixers'
    # and the MLP's projections.
    "zamba2": ("zamba2", {}),
    "zamba2_one_block_biases_no_rope": ("zamba2", {"num_mem_blocks": 1, "use_shared_attention_adapter": False,
                                                   "use_mem_rope": False, "add_bias_linear": True}),
    "granitemoe_tied_mqa_top1": ("granitemoe", {"tie_word_embeddings": True, "num_key_value_heads": 1,
                                               "num_experts_per_tok": 1}),
    # OLMo 2: post-norms, q/k norms over the whole projections (MQA: one KV head's).
    "olmo2": ("olmo2", {}),
    "olmo2_mqa_tied": ("olmo2", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    # OLMo 3: windowed layers with their plain RoPE beside a full layer with YaRN (its long-context
    # release's scaling) and another base.
    "olmo3": ("olmo3", {}),
    "olmo3_yarn_full_layers": ("olmo3", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                           "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # Gemma: (1 + w) norms, GeGLU, embeddings scaled by sqrt(hidden), a tied head.
    "gemma": ("gemma", {}),
    "gemma_mqa": ("gemma", {"num_key_value_heads": 1}),
    # Gemma 2: four norms a layer, windowed and full layers alternating (window 8), its scale from
    # query_pre_attn_scalar, soft caps at its defaults and at values small enough to bind everywhere.
    "gemma2": ("gemma2", {}),
    "gemma2_tight_caps": ("gemma2", {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0,
                                     "num_hidden_layers": 3}),
    "gemma2_no_caps": ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}),
    # Gemma 3: q/k head norms, a RoPE base for each kind of layer, linear scaling on the full ones.
    "gemma3": ("gemma3", {}),
    "gemma3_scaled_global_rope": ("gemma3", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}}),
    "gemma3_pattern3": ("gemma3", {"sliding_window_pattern": 3, "num_hidden_layers": 3,
                                   "num_key_value_heads": 1}),
    # Gemma 3 4B+: the language model of a vision-language checkpoint, served on text.
    "gemma3_vision_language": ("gemma3_vlm", {}),
}


# Cases whose transformers fp32 forward strays further from exact than ours: the reference is
# transformers in float64. (OLMo Hybrid's default head widths: its chunked gated delta rule in fp32 is
# 3.9e-4 off its own float64 logits on some CPUs, ours 4.9e-5.)
FLOAT64_REFERENCE = {"olmo_hybrid_defaults"}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    kind, overrides = CASES[case]
    path = save_tiny_model(tmp_path, kind, **overrides)
    hf = load_hf(path)
    runner = make_runner(path, num_blocks=16, block_size=4)
    prompt = [(7 * i + 3) % 256 for i in range(45)]  # 45 tokens: past original_max_position_embeddings
    ours = prefill_logits(runner, prompt, [5, 2, 9, 0, 11, 3, 7, 8, 1, 4, 6, 10])
    with torch.no_grad():
        if case in FLOAT64_REFERENCE:
            ref = hf.double()(torch.tensor([prompt])).logits[0].float()
        else:
            ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_applied(tmp_path):
    scaled = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "a", rope_scaling=LLAMA3_ROPE))
    plain = ModelConfig.from_pretrained(save_tiny_model(tmp_path / "b"))
    assert scaled.rope_scaling["rope_type"] == "llama3" and plain.rope_scaling is None
    from gpu_worker.layers.rotary import compute_inv_freq
    assert not torch.equal(compute_inv_freq(16, 10000.0, scaled.rope_scaling), compute_inv_freq(16, 10000.0, None))


def test_config_accepts_transformers4_layout():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
           "eos_token_id": 2, "torch_dtype": "bfloat16"}
    mc = ModelConfig.from_dict(cfg, {"eos_token_id": [2, 7]})
    assert mc.rope_theta == 500000.0 and mc.rope_scaling["rope_type"] == "llama3"
    assert mc.num_key_value_heads == 4 and mc.head_dim == 16
    assert mc.eos_token_ids == (2, 7)
    assert mc.dtype == torch.bfloat16


def test_config_rejects_unsupported():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
    with pytest.raises(ValueError, match="architecture"):
        ModelConfig.from_dict({**base, "architectures": ["DiffLlamaForCausalLM"]})
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**base, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="hidden_act must be 'silu' for a mixture-of-experts model"):
        ModelConfig.from_dict({**base, "architectures": ["MixtralForCausalLM"], "hidden_act": "gelu"})
    # A partial rotary is Phi-3's (Phi-4-mini); the Llama family's code rotates whole heads.
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be 1\.0 .* for LlamaForCausalLM"):
        ModelConfig.from_dict({**base, "partial_rotary_factor": 0.75})
    assert ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"],
                                  "partial_rotary_factor": 0.75}).rotary_dim == 12
    longrope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ModelConfig.from_dict({**base, "rope_scaling": longrope})
    # (Phi-3 reads a missing one as 4096, as transformers does; the top-level value wins.)
    assert ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"], "rope_scaling": longrope}
                                 ).long_rope_after == 4096
    assert ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 8,
                                  "rope_scaling": {**longrope, "original_max_position_embeddings": 99}}
                                 ).long_rope_after == 8
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 16,
                               "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}})
    # Phi-3's first 128k configs say "su" (or "yarn"): LongRoPE, as transformers reads them.
    su = ModelConfig.from_dict({**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 16,
                                "max_position_embeddings": 64, "rope_scaling": {**longrope, "type": "su"}})
    assert su.rope_scaling["rope_type"] == "longrope" and su.rope_scaling["original_max_position_embeddings"] == 16
    assert su.max_context_len == 64


def test_ernie4_5_moe_reads_stacked_experts_and_transformers_names_and_skips_mtp_layers(tmp_path):
    """Baidu's layout (each expert's projections, ``mlp.moe_statics``), as transformers saves it, and
    transformers' own (stacked experts, ``mlp.gate.moe_statics``) load alike; the checkpoint's
    multi-token-prediction tensors are not read."""
    path = save_tiny_model(tmp_path, "ernie4_5_moe")
    prompt = [(5 * i + 2) % 256 for i in range(30)]
    expected = prefill_logits(make_runner(path, num_blocks=16), prompt, list(range(8)))
    tensors = load_file(path / "model.safetensors")
    prefix = "model.layers.1.mlp."
    experts = range(8)
    tensors[prefix + "experts.gate_up_proj"] = torch.stack([torch.cat(
        (tensors.pop(f"{prefix}experts.{e}.gate_proj.weight"), tensors.pop(f"{prefix}experts.{e}.up_proj.weight")))
        for e in experts])
    tensors[prefix + "experts.down_proj"] = torch.stack([tensors.pop(f"{prefix}experts.{e}.down_proj.weight")
                                                         for e in experts])
    tensors[prefix + "gate.moe_statics.e_score_correction_bias"] = tensors.pop(
        prefix + "moe_statics.e_score_correction_bias")
    tensors["model.mtp_block.0.mlp.gate_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    torch.testing.assert_close(prefill_logits(make_runner(path, num_blocks=16), prompt, list(range(8))), expected)


def test_llama4s_released_checkpoint_is_served_on_text(tmp_path):
    """Llama4ForConditionalGeneration (as Llama 4 Scout and Maverick are released): its language model
    alone, the vision side neither built nor read; its rotating layers attend within their chunks (of
    8 tokens here: a 45-token prompt crosses five), the others to every key, at any length."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from tests.gpu_worker.utils import make_config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    source = Llama4ForConditionalGeneration(Llama4Config(text_config=make_config("llama4").to_dict(),
                                                         vision_config=vision, image_token_index=250)).eval()
    source.save_pretrained(tmp_path)
    runner = make_runner(tmp_path, num_blocks=16)
    config = runner.model.config
    assert (config.architecture, config.language_model_of) == ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
    from gpu_worker.attn_metadata import ChunkedWindow

    assert config.max_context_len == 256
    assert [layer.sliding_window for layer in runner.model.attention_layers()] == [ChunkedWindow(8), None] * 2
    assert not any("vision" in name for name, _ in runner.model.named_parameters())
    prompt = [(7 * i + 3) % 200 for i in range(45)]
    with torch.no_grad():
        expected = source(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, list(range(12))), expected, atol=1e-4, rtol=1e-4)


def test_llama4s_chunked_layers_are_read_as_transformers():
    """The chunked layers: layer_types' where given, else the rotating ones; a null attention_chunk_size
    leaves every layer attending fully (as transformers reads it), rotating or not."""
    from gpu_worker.attn_metadata import ChunkedWindow

    base = {"architectures": ["Llama4ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 256,
            "attention_chunk_size": 16}
    default = ModelConfig.from_dict(base)
    assert [default.layer_sliding_window(i) for i in range(4)] == [ChunkedWindow(16)] * 3 + [None]
    assert default.rope_layers == (True, True, True, False)
    listed = ModelConfig.from_dict({**base, "layer_types": ["full_attention", "chunked_attention"] * 2})
    assert [listed.layer_sliding_window(i) for i in range(4)] == [None, ChunkedWindow(16)] * 2
    unchunked = ModelConfig.from_dict({**base, "attention_chunk_size": None})
    assert [unchunked.layer_sliding_window(i) for i in range(4)] == [None] * 4
    assert unchunked.rope_layers == default.rope_layers


def test_exaone4s_layer_kinds_are_read_as_transformers_and_its_releases_state_them():
    """EXAONE 4.0: a window on the layers layer_types names, else every layer but each pattern-th
    (released as the string "LLLG"); the windowed layers rotate, the full ones do not; a null window
    leaves every layer full and rotating. Arcee's MLP is relu^2 only."""
    base = {"architectures": ["Exaone4ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 256}
    released = ModelConfig.from_dict({**base, "sliding_window": 16, "sliding_window_pattern": "LLLG"})
    assert released.sliding_window_layers == (True, True, True, False) * 2 and released.sliding_window == 16
    assert released.rope_layers == released.sliding_window_layers and released.qk_norm
    default = ModelConfig.from_dict(base)  # (transformers' 4096-token window, a pattern of 4)
    assert default.sliding_window == 4096 and default.sliding_window_layers == (True, True, True, False) * 2
    unwindowed = ModelConfig.from_dict({**base, "sliding_window": None})
    assert unwindowed.sliding_window is None and unwindowed.rope_layers == ()
    with pytest.raises(ValueError, match="hidden_act must be 'relu2' for ArceeForCausalLM"):
        ModelConfig.from_dict({**base, "architectures": ["ArceeForCausalLM"], "hidden_act": "silu"})


def test_registry_maps_architectures(tmp_path):
    assert set(MODEL_REGISTRY) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                   "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                   "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                                   "Gemma3ForCausalLM", "Ministral3ForCausalLM", "GptOssForCausalLM",
                                   "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
                                   "Olmo3ForCausalLM", "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM",
                                   "DeepseekV3ForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM",
                                   "MiniMaxM2ForCausalLM", "GraniteMoeSharedForCausalLM",
                                   "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "Mamba2ForCausalLM",
                                   "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                   "BambaForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
                                   "FalconH1ForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM",
                                   "JambaForCausalLM", "Zamba2ForCausalLM", "CohereForCausalLM",
                                   "Cohere2ForCausalLM", "Glm4ForCausalLM", "SeedOssForCausalLM",
                                   "HeliumForCausalLM", "Ernie4_5ForCausalLM", "ArceeForCausalLM",
                                   "Exaone4ForCausalLM", "Ernie4_5_MoeForCausalLM", "Starcoder2ForCausalLM",
                                   "StableLmForCausalLM", "Llama4ForCausalLM", "GlmForCausalLM",
                                   "NemotronForCausalLM", "OlmoForCausalLM", "PhiForCausalLM", "GPTNeoXForCausalLM",
                                   "Dots1ForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "GPTJForCausalLM",
                                   "OPTForCausalLM", "FalconForCausalLM", "ApertusForCausalLM", "PhimoeForCausalLM",
                                   "BloomForCausalLM", "MptForCausalLM", "MPTForCausalLM", "FlexOlmoForCausalLM",
                                   "MinistralForCausalLM", "CwmForCausalLM", "PersimmonForCausalLM",
                                   "HunYuanDenseV1ForCausalLM", "DbrxForCausalLM",
                                   "VaultGemmaForCausalLM", "HunYuanMoEV1ForCausalLM", "MiniCPM3ForCausalLM",
                                   "MiniCPM5MoeForCausalLM", "MiniCPMForCausalLM", "Glm4MoeLiteForCausalLM",
                                   "ExaoneMoeForCausalLM", "Gemma3nForCausalLM", "InternLM2ForCausalLM",
                                   "InternLM3ForCausalLM", "ExaoneForCausalLM", "Gemma4ForCausalLM",
                                   "Jais2ForCausalLM", "SolarOpenForCausalLM", "YoutuForCausalLM",
                                   "AfmoeForCausalLM", "LagunaForCausalLM", "MellumForCausalLM",
                                   "HYV3ForCausalLM", "MiMoV2FlashForCausalLM", "GraniteSWAForCausalLM",
                                   "GraniteMoeSWAForCausalLM", "Cohere2MoeForCausalLM", "Lfm3ForCausalLM",
                                   "GPTNeoForCausalLM", "CodeGenForCausalLM", "OlmoHybridForCausalLM",
                                   "HyperCLOVAXForCausalLM", "AXK1ForCausalLM", "NanoChatForCausalLM",
                                   "Kolibri1ForCausalLM", "FlintForCausalLM", "BeamForCausalLM",
                                   "BitNetForCausalLM", "JetMoeForCausalLM", "LongcatFlashForCausalLM",
                                   "BioGptForCausalLM", "XGLMForCausalLM", "ModernBertDecoderForCausalLM",
                                   "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "KimiLinearForCausalLM",
                                   "BailingHybridForCausalLM", "MiniMaxForCausalLM", "MiniMaxText01ForCausalLM",
                                   "MiniMaxM1ForCausalLM", "BertModel", "RobertaModel",
                                   "ModernBertModel", "NomicBertModel", "GteModel", "JinaEmbeddingsV3Model"}
    assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES) | set(ENCODER_ARCHITECTURES.values())
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert get_model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    assert get_model_class("MistralForCausalLM") is MistralForCausalLM
    with pytest.raises(ValueError):
        get_model_class("Nope")


def test_a_sliding_window_does_not_bound_the_context_length(tmp_path):
    """Sliding-window attention is implemented: Phi-3-4k and Mistral v0.1 serve their trained
    positions, and the window changes what the model computes past it."""
    path = save_tiny_model(tmp_path, "phi3", sliding_window=7, max_position_embeddings=64)
    config = ModelConfig.from_pretrained(path)
    assert config.sliding_window == 7 and config.max_context_len == 64
    assert [config.layer_sliding_window(i) for i in range(2)] == [7, 7]
    runner = make_runner(path, num_blocks=16)
    assert runner.max_model_len == 64 and runner.attention_windows == {7}
    unwindowed = make_runner(path, num_blocks=16)
    for layer in unwindowed.model.attention_layers():
        layer.sliding_window = None
    unwindowed.attention_windows = frozenset({None})
    prompt = [(5 * i + 1) % 256 for i in range(30)]
    windowed_logits = prefill_logits(runner, prompt, list(range(8)))
    full_logits = prefill_logits(unwindowed, prompt, list(range(8)))
    torch.testing.assert_close(windowed_logits[:7], full_logits[:7])  # inside the window: the same
    assert not torch.allclose(windowed_logits[7:], full_logits[7:], atol=1e-3)


def test_which_layers_use_the_window():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 256, "sliding_window": 16}
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                   "max_window_layers": 2})
    assert [qwen2.layer_sliding_window(i) for i in range(4)] == [None, None, 16, 16]
    # Qwen2 without use_sliding_window (every released checkpoint) attends fully everywhere.
    plain = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "max_window_layers": 2})
    assert plain.sliding_window is None and plain.layer_sliding_window(3) is None
    # transformers' layer_types, where a config lists them, decide.
    typed = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                                   "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert [typed.layer_sliding_window(i) for i in range(4)] == [16, None, 16, None]
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"]})
    assert [mistral.layer_sliding_window(i) for i in range(4)] == [16] * 4
    # Llama has no window, whatever a config carries.
    assert ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]}).layer_sliding_window(0) is None
    with pytest.raises(ValueError, match="layer_types lists 2 layers, the model has 4"):
        ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                               "layer_types": ["sliding_attention"] * 2})


def test_which_layers_route_through_experts():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 256, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    mixtral = ModelConfig.from_dict({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8})
    assert [mixtral.layer_is_moe(i) for i in range(4)] == [True] * 4
    # Mixtral's experts are intermediate_size wide and always renormalise their two weights.
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 128, True)
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8,
                                   "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                   "shared_expert_intermediate_size": 48})
    assert [qwen2.layer_is_moe(i) for i in range(4)] == [False, True, False, False]
    assert qwen2.shared_expert_intermediate_size == 48 and not qwen2.norm_topk_prob and qwen2.qkv_bias
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the hub's configs say num_experts.
    qwen3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 4,
                                   "norm_topk_prob": True})
    assert qwen3.num_experts == 4 and qwen3.norm_topk_prob and qwen3.qk_norm
    assert qwen3.shared_expert_intermediate_size == 0 and all(qwen3.layer_is_moe(i) for i in range(4))
    dense = ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "num_experts": 8})
    assert dense.num_experts == 0 and not dense.layer_is_moe(0)
    # Keys a config leaves out take transformers' defaults (Qwen3-MoE: 128 experts, 8 per token, 768 wide).
    sparse = {k: v for k, v in base.items() if k not in ("num_experts_per_tok", "moe_intermediate_size")}
    defaults = ModelConfig.from_dict({**sparse, "architectures": ["Qwen3MoeForCausalLM"]})
    assert (defaults.num_experts, defaults.num_experts_per_tok, defaults.moe_intermediate_size) == (128, 8, 768)
    qwen2_defaults = ModelConfig.from_dict({**sparse, "architectures": ["Qwen2MoeForCausalLM"]})
    assert (qwen2_defaults.num_experts, qwen2_defaults.shared_expert_intermediate_size) == (60, 5632)
    assert ModelConfig.from_dict({**sparse, "architectures": ["MixtralForCausalLM"], "num_experts": 4}).num_experts == 4


def test_which_moe_layers_use_the_window():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "vocab_size": 256, "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 4}
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2MoeForCausalLM"]})
    assert [qwen2.layer_sliding_window(i) for i in range(6)] == [16, None, 16, None, None, None]
    qwen3 = ModelConfig.from_dict({**base, "architectures": ["Qwen3MoeForCausalLM"],
                                   "layer_types": ["full_attention"] * 6})
    assert qwen3.uniform_sliding_window == 16
    mixtral = ModelConfig.from_dict({**base, "architectures": ["MixtralForCausalLM"]})
    assert mixtral.uniform_sliding_window == 16
    unsized = {k: v for k, v in base.items() if k != "sliding_window"}
    assert ModelConfig.from_dict({**unsized, "architectures": ["Qwen3MoeForCausalLM"]}).sliding_window == 4096


# Released Gemma configs, as they appear on the Hub (transformers 4.x layout), trimmed of keys we do not read.
GEMMA_2B = {"architectures": ["GemmaForCausalLM"], "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu",
            "hidden_size": 2048, "intermediate_size": 16384, "max_position_embeddings": 8192,
            "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "vocab_size": 256000}
GEMMA2_2B_IT = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": 50.0,
                "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
                "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
                "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
                "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
                "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
                "vocab_size": 256000}
GEMMA3_1B_IT = {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "eos_token_id": [1, 106],
                "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768,
                "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
                "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
                "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
                "torch_dtype": "bfloat16", "vocab_size": 262144}


def test_gemma_configs_read_as_transformers_reads_them():
    from transformers import Gemma2Config, Gemma3TextConfig

    gemma = ModelConfig.from_dict(GEMMA_2B)
    # "gelu" in Gemma's first configs is the tanh approximation; the head is tied unless a config says not.
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings
    assert gemma.attention_scale == 256 ** -0.5 and gemma.sliding_window is None
    assert gemma.attn_logit_softcapping is gemma.final_logit_softcapping is None

    gemma2 = ModelConfig.from_dict(GEMMA2_2B_IT)
    hf2 = Gemma2Config(**{k: v for k, v in GEMMA2_2B_IT.items() if k != "architectures"})
    assert [gemma2.layer_sliding_window(i) for i in range(26)] == [
        4096 if kind == "sliding_attention" else None for kind in hf2.layer_types]
    assert gemma2.layer_sliding_window(0) == 4096 and gemma2.layer_sliding_window(1) is None
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.attention_scale == 256 ** -0.5 and gemma2.eos_token_ids == (1, 107)
    assert gemma2.uniform_sliding_window is None  # hybrid: the KV cache keeps every key
    # Keys left out take transformers' defaults (the soft caps, query_pre_attn_scalar, the window).
    bare = ModelConfig.from_dict({k: v for k, v in GEMMA2_2B_IT.items()
                                  if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                                               "query_pre_attn_scalar", "sliding_window", "head_dim")})
    assert (bare.attn_logit_softcapping, bare.final_logit_softcapping, bare.sliding_window) == (50.0, 30.0, 4096)
    assert bare.head_dim == 256 and bare.attention_scale == 256 ** -0.5

    gemma3 = ModelConfig.from_dict(GEMMA3_1B_IT)
    hf3 = Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B_IT.items() if k != "architectures"})
    assert [gemma3.layer_sliding_window(i) for i in range(26)] == [
        512 if kind == "sliding_attention" else None for kind in hf3.layer_types]
    assert gemma3.layer_sliding_window(5) is None and gemma3.layer_sliding_window(6) == 512
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.rope_scaling) == (1e6, 1e4, None)
    assert gemma3.qk_norm and gemma3.attn_logit_softcapping is None
    # Gemma 3 4B+'s language model scales its global RoPE by 8; its max_position_embeddings already
    # is the scaled length (vLLM reads it so too).
    scaled = ModelConfig.from_dict({**GEMMA3_1B_IT, "max_position_embeddings": 131072,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_scaling["factor"] == 8.0 and scaled.max_context_len == 131072
    # transformers 5's layout: a RoPE per layer kind.
    new = ModelConfig.from_dict({**{k: v for k, v in GEMMA3_1B_IT.items()
                                    if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")},
                                 "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5e3},
                                                     "full_attention": {"rope_type": "default", "rope_theta": 2e6}}})
    assert (new.rope_theta, new.local_rope_theta) == (2e6, 5e3)


def test_gemma_configs_we_cannot_serve_are_refused():
    # (Bidirectional Gemma 3 is EmbeddingGemma, an encoder: see test_encoders; not Gemma 2 with soft caps.)
    embedding = ModelConfig.from_dict({**GEMMA3_1B_IT, "use_bidirectional_attention": True})
    assert embedding.encoder_only and embedding.embedding_only and embedding.sliding_window == 256
    with pytest.raises(ValueError, match="use_bidirectional_attention is served on Gemma 3 without attention soft"):
        ModelConfig.from_dict({**GEMMA3_1B_IT, "architectures": ["Gemma2ForCausalLM"],
                               "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="sliding-window layers must use plain RoPE"):
        ModelConfig.from_dict({**GEMMA3_1B_IT, "rope_parameters": {
            "sliding_attention": {"rope_type": "linear", "factor": 2.0}, "full_attention": {"rope_type": "default"}}})
    with pytest.raises(ValueError, match="rope_type must be 'default', 'linear' or 'llama3' for Gemma2ForCausalLM"):
        ModelConfig.from_dict({**GEMMA2_2B_IT, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 128,
                                                                 "long_factor": [1.0] * 128,
                                                                 "original_max_position_embeddings": 4096}})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        ModelConfig.from_dict({**GEMMA2_2B_IT, "hidden_activation": "relu"})


GEMMA3_4B_IT = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
                "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
                "mm_tokens_per_image": 256, "model_type": "gemma3",
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                "sliding_window": 1024},
                "torch_dtype": "bfloat16",
                "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                  "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                  "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def test_a_gemma3_vision_language_config_is_read_as_its_text_decoder():
    """Gemma 3 4B's config lists only what its text_config changes from transformers' defaults."""
    from transformers import Gemma3Config

    ours = ModelConfig.from_dict(GEMMA3_4B_IT)
    hf = Gemma3Config(**{k: v for k, v in GEMMA3_4B_IT.items() if k not in ("architectures", "model_type")}).text_config
    assert ours.architecture == "Gemma3ForCausalLM"
    assert (ours.hidden_size, ours.intermediate_size, ours.num_hidden_layers) == (2560, 10240, 34)
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim, ours.vocab_size) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.vocab_size)
    assert [ours.layer_sliding_window(i) for i in range(34)] == [
        1024 if kind == "sliding_attention" else None for kind in hf.layer_types]
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0} and ours.rope_theta == 1e6
    assert ours.local_rope_theta == 1e4 and ours.max_context_len == hf.max_position_embeddings == 131072
    assert ours.eos_token_ids == (1, 106) and ours.dtype == torch.bfloat16 and ours.tie_word_embeddings
    assert ours.attention_scale == hf.query_pre_attn_scalar ** -0.5
    # transformers ties the head by the top level's tie_word_embeddings (an untied fine-tune).
    untied = {**GEMMA3_4B_IT, "tie_word_embeddings": False}
    assert not ModelConfig.from_dict(untied).tie_word_embeddings
    assert not Gemma3Config(**{k: v for k, v in untied.items() if k not in ("architectures", "model_type")}
                            ).tie_word_embeddings
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        ModelConfig.from_dict({**GEMMA3_4B_IT, "architectures": ["PaliGemmaForConditionalGeneration"]})


def test_hf_overrides_update_a_sub_config_key_by_key(tmp_path):
    """--hf-overrides on a vision-language config: a text_config override sets its keys over the
    text_config's own (as vLLM updates a nested config); any other key (rope_scaling) is replaced whole."""
    import json

    from gpu_worker.config import with_overrides

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_IT))
    ours = ModelConfig.from_pretrained(tmp_path, {"text_config": {"num_hidden_layers": 4}})
    assert ours.num_hidden_layers == 4 and ours.hidden_size == 2560  # (its other text_config keys kept)
    # As vLLM: a top-level object (rope_scaling, quantization_config) is replaced whole; inside a
    # sub-config, objects take the override's keys too.
    assert with_overrides({"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "a_config": {"x": 1, "y": 2},
                           "quantization_config": {"bits": 4, "group_size": 128}},
                          {"rope_scaling": {"rope_type": "default"}, "a_config": {"y": 3},
                           "quantization_config": {"bits": 8}}) == {
        "rope_scaling": {"rope_type": "default"}, "a_config": {"x": 1, "y": 3}, "quantization_config": {"bits": 8}}
    assert with_overrides({"text_config": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "n": 1}},
                          {"text_config": {"rope_scaling": {"factor": 4.0}}}) == {
        "text_config": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "n": 1}}


def test_gemma3_language_model_loads_from_either_checkpoint_layout(tmp_path):
    """transformers 4.50 saved the language model as language_model.model.*, 4.52 on as
    model.language_model.* (and the vision tower under model.): both load, the vision tower skipped."""
    from gpu_worker.weights import iter_safetensors

    path = save_tiny_model(tmp_path, "gemma3_vlm")
    names = [name for name, _ in iter_safetensors(path)]
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("language_model.model.layers.") for n in names)

    def newer_layout():
        for name, tensor in iter_safetensors(path):
            name = name.replace("language_model.model.", "model.language_model.")
            yield ("model." + name if name.startswith(("vision_tower.", "multi_modal_projector.")) else name), tensor

    prompt = [(5 * i + 1) % 250 for i in range(20)]
    blocks = [3, 0, 4, 1, 2]
    runner = make_runner(path, num_blocks=8, block_size=4)
    newer = make_runner(path, num_blocks=8, block_size=4)
    newer.load_model(newer_layout())
    newer.initialize_kv_cache(8, 4)
    torch.testing.assert_close(prefill_logits(newer, prompt, blocks), prefill_logits(runner, prompt, blocks),
                               atol=0, rtol=0)


def test_gpt_oss_config_as_released():
    """gpt-oss-20b's config.json (its keys as released, transformers 4.55's names): experts, windows on
    the even layers, YaRN without truncation, biases; keys left out take GptOssConfig's defaults."""
    released = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4,
                "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
                "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
                "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
                "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
                "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
                "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
                "vocab_size": 201088, "eos_token_id": 200002}
    config = ModelConfig.from_dict(released, {"eos_token_id": [200002, 199999, 200012]})
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert config.moe_bias and config.moe_activation == "swigluoai" and config.swiglu_alpha == 1.702
    assert config.attention_sinks and config.qkv_bias and config.o_proj_bias and config.norm_topk_prob
    assert [config.layer_sliding_window(i) for i in range(4)] == [128, None, 128, None]
    assert config.rope_theta == 150000.0 and config.rope_scaling["truncate"] is False
    assert config.max_context_len == 131072 and config.eos_token_ids == (200002, 199999, 200012)
    # The fewest keys: transformers' defaults (128 experts, 4 each, YaRN over 4096, windows of 128).
    bare = ModelConfig.from_dict({"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
                                  "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 256,
                                  "experts_per_token": 2})
    assert (bare.num_experts, bare.num_experts_per_tok, bare.head_dim) == (128, 2, 64)
    assert bare.rope_scaling["original_max_position_embeddings"] == 4096
    assert [bare.layer_sliding_window(i) for i in range(3)] == [128, None, 128]


def test_glm4_moe_config_as_released():
    """GLM-4.5-Air's and GLM-4.5's config.json (transformers 4's names): RoPE over half of each head,
    q/k/v biases without o_proj's, dense MLPs below first_k_dense_replace, sigmoid routing scaled as
    released; keys left out take Glm4MoeConfig's defaults."""
    air = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
           "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
           "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
           "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
           "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8,
           "pad_token_id": 151329, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
           "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "use_qk_norm": False, "vocab_size": 151552}
    config = ModelConfig.from_dict(air)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 1408)
    assert config.shared_expert_intermediate_size == 1408 and not config.shared_expert_gated
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert [config.layer_is_moe(i) for i in range(3)] == [False, True, True]
    assert config.rotary_dim == 64 and config.head_dim == 128 and config.rope_theta == 1e6
    assert config.qkv_bias and not config.o_proj_bias and not config.qk_norm
    assert config.sliding_window is None and config.eos_token_ids == (151329, 151336, 151338)
    full = ModelConfig.from_dict({**air, "hidden_size": 5120, "num_hidden_layers": 92, "n_routed_experts": 160,
                                  "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "use_qk_norm": True,
                                  "intermediate_size": 12288, "moe_intermediate_size": 1536})
    assert full.qk_norm and full.routed_scaling_factor == 2.5
    assert [full.layer_is_moe(i) for i in range(4)] == [False, False, False, True]
    bare = ModelConfig.from_dict({"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "vocab_size": 256})
    assert (bare.num_experts, bare.num_experts_per_tok, bare.moe_intermediate_size) == (128, 8, 1408)
    assert (bare.rotary_dim, bare.rms_norm_eps, bare.intermediate_size) == (8, 1e-5, 10944)
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_dict({**air, "n_group": 3})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**air, "n_group": 8, "topk_group": 1, "num_experts_per_tok": 17})


def test_deepseek_prefill_in_tiles_as_on_cuda_equals_transformers(tmp_path, monkeypatch):
    """On CUDA, MLA's prefills take their scores in bounded tiles (no FlashAttention kernel takes its
    wide heads): the same path run here, with tiles of a few query rows, answers as transformers."""
    import gpu_worker.layers.attention as attention

    monkeypatch.setattr(attention, "_SCORES_PER_TILE", 4 * 45 * 3)  # (3 query rows of 4 heads a tile)
    path = save_tiny_model(tmp_path, "deepseek_v3")
    runner = make_runner(path, num_blocks=16, block_size=4)
    for layer in runner.model.attention_layers():
        layer.tiled_prefill_on = ("cpu",)
    prompt = [(7 * i + 3) % 256 for i in range(45)]
    with torch.no_grad():
        ref = load_hf(path)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, list(range(12))), ref, atol=1e-4, rtol=1e-4)


def test_deepseek_configs_as_released():
    """DeepSeek-V3's config.json (its FP8 block quantization, YaRN with mscale_all_dim, noaux_tc
    routing) and DeepSeek-V2-Lite's (a plain query projection, greedy softmax routing): MLA's cache
    is one latent row per token, the softmax scale is qk_head_dim ** -0.5 times mscale squared."""
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
          "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
          "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
          "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
          "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
          "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
          "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]},
          "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                  "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
          "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
          "vocab_size": 129280}
    config = ModelConfig.from_dict(v3)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (1, 576, 64)
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.v_head_dim) == (
        512, 1536, 128, 128)
    assert config.rope_interleave
    # (Read by from_pretrained: its FP8 blocks are dequantized at load.)
    assert weight_quantization(v3["quantization_config"]) == ("fp8", (128, 128))
    mscale = 0.1 * math.log(40) + 1.0
    assert config.attention_scale == pytest.approx(192 ** -0.5 * mscale * mscale)
    assert config.rope_scaling["rope_type"] == "yarn" and config.max_context_len == 163840
    assert (config.num_experts, config.num_experts_per_tok, config.moe_num_groups, config.moe_topk_groups) == (
        256, 8, 8, 4)
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.routed_scaling_factor == 2.5
    assert [config.layer_is_moe(i) for i in range(2, 5)] == [False, True, True]
    assert config.shared_expert_intermediate_size == 2048 and not config.shared_expert_gated
    with pytest.raises(ValueError, match="noaux_tc"):
        ModelConfig.from_dict({**v3, "topk_method": "greedy"})
    lite = {"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "bos_token_id": 100000,
            "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_size": 2048, "intermediate_size": 10944,
            "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
            "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
            "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
            "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_group": 1,
            "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400}
    config = ModelConfig.from_dict(lite)
    assert config.q_lora_rank == 0 and config.moe_scoring == "softmax" and not config.moe_correction_bias
    assert not config.norm_topk_prob and config.shared_expert_intermediate_size == 2 * 1408
    assert config.attention_scale == pytest.approx(192 ** -0.5 * (0.0707 * math.log(40) + 1.0) ** 2)
    assert [config.layer_is_moe(i) for i in range(2)] == [False, True]
    # Keys left out take transformers' defaults (V3: 8 groups, 4 kept; a 1536-value query bottleneck).
    bare = ModelConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "vocab_size": 256})
    assert (bare.moe_num_groups, bare.moe_topk_groups, bare.q_lora_rank, bare.num_experts) == (8, 4, 1536, 256)


@pytest.mark.parametrize("kind", ["glm4_moe", "minimax_m2", "hy_v3"])
def test_multi_token_prediction_layers_are_not_read_by_the_model(tmp_path, kind):
    """GLM-4.5's, MiniMax-M2's and Hy3's checkpoints hold their MTP modules as more layers
    (model.layers.{num_hidden_layers}...): skipped at load (the mtp drafter reads GLM's); the
    model's own layers answer as transformers' do."""
    path = save_tiny_model(tmp_path, kind)
    hf = load_hf(path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.startswith("model.layers.1.")]:
        tensors[name.replace("model.layers.1.", "model.layers.2.")] = tensors[name].clone()
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.2.shared_head.norm.weight"] = torch.ones(64)
    save_file(tensors, file, metadata={"format": "pt"})
    runner = make_runner(path, num_blocks=16, block_size=4)
    prompt = [(5 * i + 1) % 256 for i in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [3, 1, 4, 0, 2]), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["granitemoe", "minimax_m2", "mixtral", "olmoe", "flex_olmo", "hunyuan_moe", "hy_v3",
                                  "laguna", "afmoe", "mimo_v2_flash", "solar_open", "mellum", "cohere2_moe",
                                  "axk1", "kolibri1", "flint", "beam", "longcat_flash"])
def test_moe_checkpoints_in_transformers_own_layout_load_too(tmp_path, kind):
    """Saved with transformers 5's own names (save_original_format=False: stacked experts, its router
    and bias names) rather than the released ones: the same logits."""
    from transformers import AutoModelForCausalLM

    from tests.gpu_worker.utils import make_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config(kind), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
        for name, param in hf.named_parameters():  # (Laguna's and AFMoE's biases, AFMoE's and MiMo's zero routers)
            if name.endswith(("e_score_correction_bias", "expert_bias", "router.gate.weight", "mlp.gate.weight")):
                param.normal_(0.0, 0.3)
            if name.endswith(("mlp.post_mlp_layernorm.weight", "gate_bias")):  # (A.X-K1's; Beam's gate biases)
                param.normal_(1.0, 0.5)
    hf.save_pretrained(tmp_path, save_original_format=False)
    assert any(".experts.gate_up_proj" in name for name in load_file(tmp_path / "model.safetensors"))
    runner = make_runner(tmp_path, num_blocks=16, block_size=4)
    prompt = [(5 * i + 1) % 256 for i in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [3, 1, 4, 0, 2]), ref, atol=1e-4, rtol=1e-4)


def test_minimax_m2_config_as_released():
    """MiniMax-M2's config.json (its keys as released): RoPE over rotary_dim (64 of 128), sigmoid
    routing through the correction bias, 256 experts, 8 a token; keys left out take transformers'
    defaults; softmax routing or shared experts are refused."""
    released = {"architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62, "head_dim": 128,
                "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
                "max_position_embeddings": 196608, "model_type": "minimax_m2", "mtp_transformer_layers": 1,
                "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
                "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06,
                "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
                "tie_word_embeddings": False, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True,
                "vocab_size": 200064, "quantization_config": {
                    "activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}}
    config = ModelConfig.from_dict(released)
    assert (config.head_dim, config.rotary_dim, config.rope_theta) == (128, 64, 5000000.0)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 1536)
    assert config.moe_grouped_topk and config.moe_scoring == "sigmoid" and config.moe_correction_bias
    assert config.norm_topk_prob and (config.moe_num_groups, config.routed_scaling_factor) == (1, 1.0)
    assert config.layer_is_moe(0) and config.layer_is_moe(61) and config.max_context_len == 196608
    from gpu_worker.quantized_checkpoint import weight_quantization

    # (Its release's FP8 blocks: the format named float8_e4m3fn.)
    assert weight_quantization(released["quantization_config"]) == ("fp8", (128, 128))
    bare = ModelConfig.from_dict({"architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": 256})
    assert (bare.head_dim, bare.rotary_dim, bare.num_experts, bare.rms_norm_eps) == (128, 128, 256, 1e-6)
    assert bare.num_key_value_heads == 8
    for refused in ({"scoring_func": "softmax"}, {"shared_intermediate_size": 512}):
        with pytest.raises(ValueError, match="sigmoid routing"):
            ModelConfig.from_dict({**released, **refused})
    with pytest.raises(ValueError, match="linear-attention layers"):
        ModelConfig.from_dict({**released, "attn_type_list": [0, 1] * 31})


def test_olmoe_config_defaults():
    base = {"architectures": ["OlmoeForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
    config = ModelConfig.from_dict(base)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 8, 32)
    assert not config.norm_topk_prob and config.rms_norm_eps == 1e-5


def test_olmoe_clips_q_k_and_v_after_its_norms(tmp_path):
    """OLMoE's clip_qkv clamps the normed q and k (and v): the same logits as transformers."""
    path = save_tiny_model(tmp_path, "olmoe", clip_qkv=0.5)
    hf = load_hf(path)
    runner = make_runner(path, num_blocks=16, block_size=4)
    prompt = [(5 * i + 1) % 256 for i in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = prefill_logits(runner, prompt, [3, 1, 4, 0, 2])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    unclipped = prefill_logits(make_runner(save_tiny_model(tmp_path / "plain", "olmoe"), num_blocks=16, block_size=4),
                               prompt, [3, 1, 4, 0, 2])
    assert (unclipped - ours).abs().max() > 1e-2  # (the clamp binds at this width)


def test_classic_configs_as_released():
    """Pythia's, phi-2's, Minitron's, OLMo's, GLM-4-9B's and dots.llm1's configs as their checkpoints
    state them (transformers 4's key names), read as transformers reads them."""
    pythia = {"architectures": ["GPTNeoXForCausalLM"], "hidden_size": 512, "intermediate_size": 2048,
              "num_hidden_layers": 6, "num_attention_heads": 8, "vocab_size": 50304, "rotary_pct": 0.25,
              "rotary_emb_base": 10000, "layer_norm_eps": 1e-5, "use_parallel_residual": True,
              "hidden_act": "gelu", "max_position_embeddings": 2048, "tie_word_embeddings": False}
    config = ModelConfig.from_dict(pythia)
    assert (config.head_dim, config.rotary_dim, config.num_key_value_heads) == (64, 16, 8)
    assert config.qkv_bias and config.o_proj_bias and config.mlp_bias and config.hidden_act == "gelu"
    assert ModelConfig.from_dict({**pythia, "rotary_pct": 1.0, "rotary_emb_base": 50000}).rotary_dim == 64
    assert ModelConfig.from_dict({**pythia, "rotary_emb_base": 50000}).rope_theta == 50000.0
    assert not ModelConfig.from_dict({**pythia, "attention_bias": False}).qkv_bias
    assert ModelConfig.from_dict({**pythia, "hidden_act": "gelu_fast"}).hidden_act == "gelu_fast"
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        ModelConfig.from_dict({**pythia, "hidden_act": "silu"})
    phi2 = {"architectures": ["PhiForCausalLM"], "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 51200,
            "partial_rotary_factor": 0.4, "layer_norm_eps": 1e-5, "hidden_act": "gelu_new", "qk_layernorm": False,
            "rope_theta": 10000.0, "max_position_embeddings": 2048}
    config = ModelConfig.from_dict(phi2)
    assert (config.rotary_dim, config.rms_norm_eps, config.qk_norm) == (32, 1e-5, False)
    assert config.qkv_bias and config.o_proj_bias and config.mlp_bias
    assert ModelConfig.from_dict({**phi2, "qk_layernorm": True}).qk_norm
    minitron = {"architectures": ["NemotronForCausalLM"], "hidden_size": 4096, "intermediate_size": 16384,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 256000, "norm_eps": 1e-5, "partial_rotary_factor": 0.5, "hidden_act": "relu2",
                "rope_theta": 10000, "max_position_embeddings": 8192}
    config = ModelConfig.from_dict(minitron)
    assert (config.rotary_dim, config.hidden_act, config.qkv_bias, config.mlp_bias) == (64, "relu2", False, False)
    assert ModelConfig.from_dict({k: v for k, v in minitron.items() if k != "partial_rotary_factor"}).rotary_dim == 64
    olmo = {"architectures": ["OlmoForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 50304, "clip_qkv": 8.0}
    assert ModelConfig.from_dict(olmo).rms_norm_eps == 1e-5 and ModelConfig.from_dict(olmo).clip_qkv == 8.0
    # (transformers clamps OLMo's and OLMoE's alone: a stray clip_qkv elsewhere changes nothing.)
    assert ModelConfig.from_dict({**olmo, "architectures": ["Olmo2ForCausalLM"]}).clip_qkv is None
    glm = {"architectures": ["GlmForCausalLM"], "hidden_size": 4096, "intermediate_size": 13696,
           "num_hidden_layers": 40, "num_attention_heads": 32, "vocab_size": 151552}
    config = ModelConfig.from_dict(glm)
    assert (config.head_dim, config.rotary_dim, config.num_key_value_heads) == (128, 64, 2)
    assert config.qkv_bias and not config.o_proj_bias and config.eos_token_ids == (151329, 151336, 151338)
    dots = {"architectures": ["Dots1ForCausalLM"], "hidden_size": 4096, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "num_hidden_layers": 62, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 152064, "n_routed_experts": 128, "num_experts_per_tok": 6,
            "n_shared_experts": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "sliding_window": None, "max_window_layers": 62}
    config = ModelConfig.from_dict(dots)
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (128, 6, 2816)
    assert config.qk_norm and config.moe_scoring == "sigmoid" and config.moe_correction_bias
    assert config.moe_layers[:2] == (False, True) and config.sliding_window is None
    assert not ModelConfig.from_dict({**dots, "norm_topk_prob": None}).norm_topk_prob  # (transformers' default)
    windowed = ModelConfig.from_dict({**dots, "sliding_window": 4096, "max_window_layers": 60})
    assert windowed.sliding_window == 4096 and windowed.sliding_window_layers == (False,) * 60 + (True,) * 2
    assert ModelConfig.from_dict({**dots, "sliding_window": 4096}).sliding_window is None  # (no layer from 62)
    aliased = {**{k: v for k, v in dots.items() if k != "n_routed_experts"}, "num_local_experts": 64}
    assert ModelConfig.from_dict(aliased).num_experts == 64
    with pytest.raises(ValueError, match="must state n_shared_experts"):
        ModelConfig.from_dict({k: v for k, v in dots.items() if k != "n_shared_experts"})


def test_gpt_family_configs_as_released():
    """gpt2's, starcoder's and gpt-j-6b's configs (GPT-2's key names) read as transformers reads them."""
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "n_layer": 12, "n_head": 12, "n_ctx": 1024,
            "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    config = ModelConfig.from_dict(gpt2)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (768, 12, 12)
    assert (config.intermediate_size, config.num_key_value_heads, config.max_context_len) == (3072, 12, 1024)
    assert config.learned_positions and config.rope_layers == (False,) * 12 and config.tie_word_embeddings
    assert config.qkv_bias and config.o_proj_bias and config.mlp_bias and config.attention_scale == 64 ** -0.5
    assert ModelConfig.from_dict({**gpt2, "scale_attn_weights": False}).attention_scale == 1.0
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        ModelConfig.from_dict({**gpt2, "scale_attn_by_inverse_layer_idx": True})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        ModelConfig.from_dict({**gpt2, "activation_function": "quick_gelu"})
    starcoder = {"architectures": ["GPTBigCodeForCausalLM"], "n_embd": 6144, "n_layer": 40, "n_head": 48,
                 "n_inner": 24576, "n_positions": 8192, "vocab_size": 49152, "multi_query": True,
                 "activation_function": "gelu_pytorch_tanh"}
    config = ModelConfig.from_dict(starcoder)
    assert (config.num_key_value_heads, config.intermediate_size, config.head_dim) == (1, 24576, 128)
    assert ModelConfig.from_dict({**starcoder, "multi_query": False}).num_key_value_heads == 48
    gptj = {"architectures": ["GPTJForCausalLM"], "n_embd": 4096, "n_layer": 28, "n_head": 16, "rotary_dim": 64,
            "n_positions": 2048, "vocab_size": 50400, "activation_function": "gelu_new", "tie_word_embeddings": False}
    config = ModelConfig.from_dict(gptj)
    assert (config.head_dim, config.rotary_dim, config.intermediate_size) == (256, 64, 16384)
    assert not config.qkv_bias and not config.o_proj_bias and config.mlp_bias and not config.learned_positions
    assert ModelConfig.from_dict({**gptj, "n_embd": 88 * 16, "rotary_dim": 30}).rotary_dim == 30  # (not 29)
    with pytest.raises(ValueError, match="rotary_dim null"):
        ModelConfig.from_dict({**gptj, "rotary_dim": None})


def test_opt_configs_as_released():
    """opt-125m's config read as transformers reads it; opt-350m's layout refused by name."""
    opt = {"architectures": ["OPTForCausalLM"], "hidden_size": 768, "ffn_dim": 3072, "num_hidden_layers": 12,
           "num_attention_heads": 12, "vocab_size": 50272, "max_position_embeddings": 2048,
           "do_layer_norm_before": True, "word_embed_proj_dim": 768, "activation_function": "relu",
           "enable_bias": True, "_remove_final_layer_norm": False}
    config = ModelConfig.from_dict(opt)
    assert (config.intermediate_size, config.hidden_act, config.num_key_value_heads) == (3072, "relu", 12)
    assert config.learned_positions and config.position_offset == 2 and config.max_context_len == 2048
    assert config.qkv_bias and config.mlp_bias and config.tie_word_embeddings and config.rms_norm_eps == 1e-5
    with pytest.raises(ValueError, match="do_layer_norm_before"):
        ModelConfig.from_dict({**opt, "do_layer_norm_before": False})
    with pytest.raises(ValueError, match="word_embed_proj_dim"):
        ModelConfig.from_dict({**opt, "word_embed_proj_dim": 512})


def test_falcon_configs_as_released():
    """falcon-7b's and falcon-40b's configs read as transformers reads them; falcon-rw-1b's ALiBi, its
    slopes scaled as its scores are."""
    falcon7b = {"architectures": ["FalconForCausalLM"], "hidden_size": 4544, "num_hidden_layers": 32,
                "num_attention_heads": 71, "vocab_size": 65024, "multi_query": True, "parallel_attn": True,
                "bias": False, "alibi": False, "new_decoder_architecture": False, "layer_norm_epsilon": 1e-5}
    config = ModelConfig.from_dict(falcon7b)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (1, 64, 4 * 4544)
    assert not config.qkv_bias and config.tie_word_embeddings and config.hidden_act == "gelu"
    falcon40b = {**falcon7b, "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 128,
                 "num_kv_heads": 8, "new_decoder_architecture": True}
    assert ModelConfig.from_dict(falcon40b).num_key_value_heads == 8
    assert ModelConfig.from_dict({**falcon7b, "multi_query": False}).num_key_value_heads == 71
    assert config.alibi_bias_max is None and config.rope_layers == ()
    falcon_rw_1b = {**falcon7b, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
                    "vocab_size": 50304, "multi_query": False, "parallel_attn": False, "bias": True, "alibi": True}
    config = ModelConfig.from_dict(falcon_rw_1b)
    assert (config.alibi_bias_max, config.alibi_slope_scale) == (8.0, 64 ** -0.5)
    assert config.rope_layers == (False,) * 24 and config.num_key_value_heads == 32 and config.qkv_bias


def test_bloom_and_mpt_configs_as_released():
    """bloom-560m's and mpt-7b's configs (MosaicML's own, for its code) read as transformers reads
    them; what MPT's config may set that no release does, refused by name."""
    bloom = {"architectures": ["BloomForCausalLM"], "n_embed": 1024, "n_layer": 24, "n_head": 16,
             "vocab_size": 250880, "layer_norm_epsilon": 1e-5, "apply_residual_connection_post_layernorm": False,
             "pretraining_tp": 1, "slow_but_exact": False}
    config = ModelConfig.from_dict(bloom)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (1024, 24, 16)
    assert (config.intermediate_size, config.hidden_act, config.max_context_len) == (4096, "gelu_pytorch_tanh", 2048)
    assert config.embedding_norm and config.alibi_bias_max == 8.0 and config.alibi_slope_scale == 1.0
    assert config.qkv_bias and config.o_proj_bias and config.mlp_bias and config.tie_word_embeddings
    assert config.rope_layers == (False,) * 24
    bloom_176b = {**bloom, "n_embed": None, "hidden_size": 14336, "n_layer": 70, "n_head": 112}
    assert ModelConfig.from_dict(bloom_176b).head_dim == 128
    assert ModelConfig.from_dict({**bloom, "n_head": None, "num_attention_heads": 16}).num_attention_heads == 16
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        ModelConfig.from_dict({**bloom, "apply_residual_connection_post_layernorm": True})
    mpt7b = {"architectures": ["MPTForCausalLM"], "d_model": 4096, "n_heads": 32, "n_layers": 32,
             "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432, "no_bias": True, "logit_scale": None,
             "learned_pos_emb": True, "norm_type": "low_precision_layernorm",
             "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch", "attn_pdrop": 0,
                             "attn_type": "multihead_attention", "attn_uses_sequence_id": False, "clip_qkv": None,
                             "prefix_lm": False, "qk_ln": False, "softmax_scale": None}}
    config = ModelConfig.from_dict(mpt7b)
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (4096, 32, 32)
    assert (config.intermediate_size, config.hidden_act, config.max_context_len) == (16384, "gelu", 2048)
    assert config.alibi_bias_max == 8.0 and config.clip_qkv is None and config.attention_scale == 128 ** -0.5
    assert not (config.qkv_bias or config.o_proj_bias or config.mlp_bias) and config.tie_word_embeddings
    mpt30b = {**mpt7b, "d_model": 7168, "n_heads": 64, "n_layers": 48, "max_seq_len": 8192,
              "attn_config": {**mpt7b["attn_config"], "clip_qkv": 8, "attn_impl": "triton"}}
    assert ModelConfig.from_dict(mpt30b).clip_qkv == 8.0
    bias_max_16 = {**mpt7b, "attn_config": {**mpt7b["attn_config"], "alibi_bias_max": 16}}
    assert ModelConfig.from_dict(bias_max_16).alibi_bias_max == 16.0  # (MosaicML's code reads it)
    for key, value in (("alibi", False), ("prefix_lm", True), ("qk_ln", True), ("attn_type", "multiquery_attention")):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_dict({**mpt7b, "attn_config": {**mpt7b["attn_config"], key: value}})
    for key, value in (("no_bias", False), ("logit_scale", 0.5), ("ffn_config", {"ffn_type": "mptglu"}),
                       ("norm_type", "rmsnorm")):
        with pytest.raises(ValueError, match=key.replace("ffn_config", "ffn_type")):
            ModelConfig.from_dict({**mpt7b, key: value})
    for key, value in (("rope", True), ("sliding_window_size", 1024)):
        with pytest.raises(ValueError, match=key):
            ModelConfig.from_dict({**mpt7b, "attn_config": {**mpt7b["attn_config"], key: value}})
    assert ModelConfig.from_dict({**mpt7b, "attn_config": {**mpt7b["attn_config"], "clip_qkv": 0}}).clip_qkv is None
    # A config leaving no_bias and alibi out: MosaicML's code (MPTForCausalLM) defaults to biases and
    # learned positions (refused), transformers' (MptForCausalLM) to neither.
    trimmed = {k: v for k, v in mpt7b.items() if k != "no_bias"}
    trimmed["attn_config"] = {k: v for k, v in mpt7b["attn_config"].items() if k != "alibi"}
    with pytest.raises(ValueError, match="no_bias"):
        ModelConfig.from_dict(trimmed)
    with pytest.raises(ValueError, match="alibi"):
        ModelConfig.from_dict({**trimmed, "no_bias": True})
    assert ModelConfig.from_dict({**trimmed, "architectures": ["MptForCausalLM"]}).alibi_bias_max == 8.0


def test_flex_olmo_config_defaults_are_transformers():
    """A FlexOlmo config leaving its keys out reads transformers' FlexOlmoConfig defaults: 7 experts, 5 a
    token, not renormalised, RMSNorm epsilon 1e-6, RoPE base 500,000 over 4096 positions, untied."""
    from transformers import FlexOlmoConfig

    hf = FlexOlmoConfig()
    config = ModelConfig.from_dict({"architectures": ["FlexOlmoForCausalLM"]})
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (7, 5, False)
    assert (config.hidden_size, config.num_hidden_layers, config.moe_intermediate_size) == (
        hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size)
    assert config.rms_norm_eps == hf.rms_norm_eps == 1e-6 and config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.max_context_len == hf.max_position_embeddings and not config.tie_word_embeddings
    assert config.vocab_size == hf.vocab_size and all(config.layer_is_moe(i) for i in range(32))
    assert config.eos_token_ids == (hf.eos_token_id,)


def test_ministral_config_defaults_are_transformers():
    """A Ministral config leaving its keys out reads transformers' MinistralConfig defaults (Mistral's):
    a 4096-token window on every layer, 8 KV heads, 131,072 positions."""
    from transformers import MinistralConfig

    hf = MinistralConfig()
    config = ModelConfig.from_dict({"architectures": ["MinistralForCausalLM"]})
    assert [config.layer_sliding_window(i) for i in range(hf.num_hidden_layers)] == [hf.sliding_window] * 32
    assert (config.num_key_value_heads, config.max_context_len, config.rms_norm_eps) == (
        hf.num_key_value_heads, hf.max_position_embeddings, hf.rms_norm_eps)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size)


def test_cwm_config_defaults_are_transformers():
    """A Code World Model config leaving its keys out reads transformers' CwmConfig defaults: llama3 RoPE
    (base 1M, factor 16 from 8192), a window of 8192 on three layers of four (every fourth from the
    first full), its shapes and EOS ids."""
    from transformers import CwmConfig

    hf = CwmConfig()
    config = ModelConfig.from_dict({"architectures": ["CwmForCausalLM"]})
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 1e6
    assert {k: config.rope_scaling[k] for k in ("rope_type", "factor", "original_max_position_embeddings")} == {
        "rope_type": "llama3", "factor": 16.0, "original_max_position_embeddings": 8192}
    assert [config.layer_sliding_window(i) for i in range(8)] == [
        None if kind == "full_attention" else 8192 for kind in hf.layer_types[:8]] == [None, 8192, 8192, 8192] * 2
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.num_key_value_heads) == (
        hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.num_key_value_heads)
    assert config.eos_token_ids == tuple(hf.eos_token_id) and config.max_context_len == 131072


def test_persimmon_config_defaults_are_transformers():
    """A Persimmon config leaving its keys out reads transformers' PersimmonConfig defaults: q/k
    LayerNorms, half of each head rotating, relu^2, 16,384 positions, biases everywhere, untied."""
    from transformers import PersimmonConfig

    hf = PersimmonConfig()
    config = ModelConfig.from_dict({"architectures": ["PersimmonForCausalLM"]})
    assert config.qk_norm and config.rotary_dim == 32 and config.hidden_act == "relu2"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert config.num_key_value_heads == config.num_attention_heads == hf.num_attention_heads
    assert config.max_context_len == hf.max_position_embeddings and config.rms_norm_eps == hf.layer_norm_eps
    assert config.qkv_bias and config.o_proj_bias and config.mlp_bias and not config.tie_word_embeddings


def test_hunyuan_dense_config_as_released():
    """Hunyuan-7B-Instruct's config: NTK RoPE by alpha 1000 read as the larger base transformers
    computes, per-head q/k norms; cross-layer attention (use_cla) refused."""
    released = {"architectures": ["HunYuanDenseV1ForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 128167, "max_position_embeddings": 32768, "rope_theta": 10000.0, "use_qk_norm": True,
                "use_cla": False, "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                                                   "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"}}
    config = ModelConfig.from_dict(released)
    assert config.rope_scaling is None and config.rope_theta == pytest.approx(10000.0 * 1000.0 ** (128 / 126))
    assert config.qk_norm and config.head_dim == 128 and config.max_context_len == 32768
    with pytest.raises(ValueError, match="use_cla"):
        ModelConfig.from_dict({**released, "use_cla": True})


def test_hunyuan_moe_config_as_released():
    """Hunyuan-A13B-Instruct's config (per-layer lists of one value): 64 experts of 3072, 8 a token,
    renormalised, one shared MLP as wide; NTK RoPE by alpha; lists that differ between layers, and
    cross-layer attention, refused."""
    layers = 32
    released = {"architectures": ["HunYuanMoEV1ForCausalLM"], "hidden_size": 4096, "intermediate_size": 3072,
                "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "vocab_size": 128167, "max_position_embeddings": 32768, "num_experts": 64,
                "moe_topk": [8] * layers, "moe_intermediate_size": [3072] * layers,
                "num_shared_expert": [1] * layers, "use_mixed_mlp_moe": True, "use_cla": False, "use_qk_norm": True,
                "rope_theta": 10000.0, "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"}}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 8, 3072)
    assert config.shared_expert_intermediate_size == 3072 and not config.shared_expert_gated
    assert config.norm_topk_prob and all(config.layer_is_moe(i) for i in range(layers)) and config.qk_norm
    assert config.rope_theta == pytest.approx(10000.0 * 1000.0 ** (128 / 126)) and config.rope_scaling is None
    assert ModelConfig.from_dict({**released, "num_shared_expert": 2}).shared_expert_intermediate_size == 6144
    assert ModelConfig.from_dict({**released, "use_mixed_mlp_moe": False}).shared_expert_intermediate_size == 0
    assert config.moe_router_fp32  # (gate.wg in fp32, as transformers keeps it)
    with pytest.raises(ValueError, match="moe_topk differing between layers"):
        ModelConfig.from_dict({**released, "moe_topk": [8] * (layers - 1) + [4]})
    with pytest.raises(ValueError, match="use_cla"):
        ModelConfig.from_dict({**released, "use_cla": True})


def test_gemma3n_config_as_released():
    """gemma-3n-E2B-it's config (Gemma3nForConditionalGeneration, served on its text_config; its lists
    written out): 30 layers, four windowed (512) to one full, the last ten sharing the keys and
    values of layers 18 (windowed) and 19 (full); AltUp's 4 streams, LAuReL of 64, per-layer inputs of
    256 values from a 262,144-row table, the first ten gates cut at 0.95; unscaled scores, two RoPE
    bases, logits capped at 30, the head tied. A sharing kind without an earlier layer refused."""
    kinds = ["sliding_attention"] * 4 + ["full_attention"]
    text = {"model_type": "gemma3n_text", "hidden_size": 2048, "intermediate_size": [8192] * 30,
            "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "num_kv_shared_layers": 10, "layer_types": kinds * 6, "sliding_window": 512, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0, "vocab_size": 262400, "vocab_size_per_layer_input": 262144,
            "hidden_size_per_layer_input": 256, "altup_num_inputs": 4, "altup_active_idx": 0,
            "altup_correct_scale": True, "laurel_rank": 64, "final_logit_softcapping": 30.0,
            "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 20, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh"}
    released = {"architectures": ["Gemma3nForConditionalGeneration"], "text_config": text,
                "vision_config": {"model_type": "gemma3n_vision"}, "audio_config": {"model_type": "gemma3n_audio"}}
    config = ModelConfig.from_dict(released)
    g = config.gemma3n
    assert config.architecture == "Gemma3nForCausalLM" and config.vision is None and g is not None
    assert g.kv_sources == (None,) * 20 + (18, 18, 18, 18, 19) * 2
    assert config.sliding_window == 512 and config.sliding_window_layers == (True, True, True, True, False) * 6
    assert (g.altup_num_inputs, g.laurel_rank, g.hidden_size_per_layer_input, g.vocab_size_per_layer_input) == (
        4, 64, 256, 262144)
    assert g.activation_sparsity == (0.95,) * 10 + (0.0,) * 20 and g.intermediate_sizes == (8192,) * 30
    assert config.attention_scale == 1.0 and config.final_logit_softcapping == 30.0 and config.tie_word_embeddings
    assert (config.rope_theta, config.local_rope_theta, config.head_dim) == (1000000.0, 10000.0, 256)
    assert config.num_attention_layers == 20  # (the KV cache's: the sharing layers keep none)
    with pytest.raises(ValueError, match="no layer before 28"):
        ModelConfig.from_dict({**text, "architectures": ["Gemma3nForCausalLM"], "num_kv_shared_layers": 2,
                               "layer_types": ["sliding_attention"] * 28 + ["full_attention"] * 2})


def test_gemma4_config_as_released():
    """A Gemma 4 config as Google's releases state it (global_head_dim and num_global_key_value_heads,
    not transformers' per_layer_config; transformers' defaults otherwise, under
    Gemma4ForConditionalGeneration): five windowed layers of 256-wide heads to one full of 512-wide
    heads (its own KV heads, values the keys' projection), the last layer full; proportional RoPE over
    a quarter of the full heads; the KV cache's bytes each layer's own; experts where the config asks."""
    from gpu_worker.kv_cache import model_bytes_per_block

    text = {"model_type": "gemma4_text", "num_hidden_layers": 30, "global_head_dim": 512,
            "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 10,
            "hidden_size_per_layer_input": 256, "use_double_wide_mlp": True}
    config = ModelConfig.from_dict({"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
                                    "vision_config": {"model_type": "gemma4_vision"}})
    g = config.gemma4
    assert config.architecture == "Gemma4ForCausalLM" and config.vision is None and g is not None
    assert config.sliding_window_layers == ((True,) * 5 + (False,)) * 5
    assert g.head_dims[:6] == (256,) * 5 + (512,) and g.num_kv_heads[:6] == (4,) * 5 + (1,)
    assert g.k_eq_v[:6] == (False,) * 5 + (True,) and g.kv_sources[20:] == (19, 19, 19, 17) + (19,) * 5 + (17,)
    assert g.intermediate_sizes[19:21] == (9216, 18432) and g.hidden_size_per_layer_input == 256
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert (config.rope_theta, config.local_rope_theta, config.attention_scale) == (1000000.0, 10000.0, 1.0)
    assert config.num_attention_layers == 20 and g.num_experts == 0 and config.final_logit_softcapping is None
    geometry = [(g.num_kv_heads[i], g.head_dims[i]) for i in range(20)]
    assert config.attention_layer_geometry == tuple(geometry)
    assert model_bytes_per_block(config, 16, 1, torch.bfloat16) == sum(2 * 16 * h * d * 2 for h, d in geometry)
    moe = ModelConfig.from_dict({**text, "architectures": ["Gemma4ForCausalLM"], "enable_moe_block": True,
                                 "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704})
    assert (moe.gemma4.num_experts, moe.gemma4.top_k_experts, moe.gemma4.moe_intermediate_size) == (128, 8, 704)
    assert (moe.num_experts, moe.num_experts_per_tok) == (128, 8)  # (as expert parallelism's checks read them)
    # transformers' saved per_layer_config: its layers' keys zero-padded ("05"), read as numbers.
    saved = ModelConfig.from_dict({**text, "architectures": ["Gemma4ForCausalLM"], "per_layer_config": {
        f"{i:02d}": {"head_dim": 512, "num_key_value_heads": 1} for i in range(5, 30, 6)}})
    assert saved.gemma4.head_dims[:12] == ((256,) * 5 + (512,)) * 2 and saved.gemma4.num_kv_heads[5] == 1
    with pytest.raises(ValueError, match="hidden_activation must be gelu_pytorch_tanh"):
        ModelConfig.from_dict({**text, "architectures": ["Gemma4ForCausalLM"], "hidden_activation": "silu"})
    with pytest.raises(ValueError, match="top_k_experts"):
        ModelConfig.from_dict({**text, "architectures": ["Gemma4ForCausalLM"], "enable_moe_block": True,
                               "num_experts": 128})


@pytest.mark.parametrize("kind", ["gemma3n", "gemma4"])
def test_a_gemma_vision_and_audio_checkpoint_is_served_on_its_language_model(tmp_path, kind):
    """Gemma3nForConditionalGeneration's and Gemma4ForConditionalGeneration's files (the language model
    under model.language_model., towers beside it, a sharing layer's unused k/v projections kept as
    released): its towers and those projections are not read; the logits are the text model's."""
    import json

    from safetensors.torch import load_file, save_file

    path = save_tiny_model(tmp_path / "text", kind)
    text = json.loads((path / "config.json").read_text())
    tensors = {f"model.language_model.{name[len('model.'):]}": t
               for name, t in load_file(path / "model.safetensors").items()}
    tensors["model.vision_tower.timm_model.conv_stem.weight"] = torch.zeros(4, 3, 3, 3)
    tensors["model.audio_tower.subsample_conv_projection.weight"] = torch.zeros(4, 4)
    tensors["model.embed_vision.embedding.weight"] = torch.zeros(4, 64)
    tensors["model.language_model.layers.2.self_attn.k_proj.weight"] = torch.zeros(32, 64)  # (layer 2 shares 0's)
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    save_file(tensors, multimodal / "model.safetensors", metadata={"format": "pt"})
    (multimodal / "config.json").write_text(json.dumps({
        "architectures": [f"{kind.capitalize()}ForConditionalGeneration"], "model_type": kind, "text_config": text,
        "vision_config": {"model_type": f"{kind}_vision"}, "audio_config": {"model_type": f"{kind}_audio"}}))
    tokens = [(7 * i + 3) % 256 for i in range(21)]
    expected = prefill_logits(make_runner(path), tokens, list(range(6)))
    torch.testing.assert_close(prefill_logits(make_runner(multimodal), tokens, list(range(6))), expected)


def test_minicpm3s_null_scalings_scale_by_one(tmp_path):
    """A MiniCPM3 config whose scale_depth and dim_model_base are null (transformers saves the numbers
    it reads them as, so the file is written with nulls here): no residual or logits scaling, as
    transformers loads the same file."""
    import json

    path = save_tiny_model(tmp_path, "minicpm3", scale_depth=None, dim_model_base=None, num_hidden_layers=3)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "scale_depth": None, "dim_model_base": None}))
    ours = ModelConfig.from_pretrained(path)
    assert (ours.residual_multiplier, ours.logits_scaling) == (1.0, 1.0)
    tokens = [(5 * i + 2) % 256 for i in range(19)]
    expected = load_hf(path)(torch.tensor([tokens])).logits[0].detach()
    torch.testing.assert_close(prefill_logits(make_runner(path), tokens, list(range(5))), expected,
                               atol=1e-4, rtol=1e-4)


def test_minicpm3_config_as_released():
    """MiniCPM3-4B's config (its remote-code keys; LongRoPE's 16 factors a list each, here of ones):
    MLA of a 256-value latent, 64 + 32 query/key values a head, 64 value values (hidden / heads),
    queries through 768; the embeddings times 12, each residual add times 1.4 / sqrt(62), the logits
    over 2560 / 256; rotary values in halves."""
    released = {"architectures": ["MiniCPM3ForCausalLM"], "hidden_size": 2560, "num_hidden_layers": 62,
                "intermediate_size": 6400, "max_position_embeddings": 32768, "num_attention_heads": 40,
                "num_key_value_heads": 40, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "q_lora_rank": 768,
                "kv_lora_rank": 256, "rms_norm_eps": 1e-05, "vocab_size": 73448, "scale_emb": 12,
                "dim_model_base": 256, "scale_depth": 1.4, "eos_token_id": [2, 73440],
                "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 16, "short_factor": [1.0] * 16,
                                 "original_max_position_embeddings": 32768}}
    config = ModelConfig.from_dict(released)
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (256, 768, 64, 32, 64)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (1, 288, 32)
    assert config.attention_scale == pytest.approx(96 ** -0.5) and not config.rope_interleave
    assert config.embedding_multiplier == 12.0 and config.logits_scaling == 10.0
    assert config.residual_multiplier == pytest.approx(1.4 / 62 ** 0.5)
    assert config.rope_scaling["rope_type"] == "longrope" and config.max_context_len == 32768
    assert config.num_experts == 0 and config.tie_word_embeddings  # (transformers' default where unstated)
    # (DeepSeek's MLA keeps its own defaults and its rotary values in pairs.)
    deepseek = ModelConfig.from_dict({**released, "architectures": ["DeepseekV2ForCausalLM"], "rope_scaling": None,
                                      "v_head_dim": None})
    assert deepseek.rope_interleave and deepseek.v_head_dim == 128 and deepseek.embedding_multiplier == 1.0


def test_minicpm5_moe_config_as_released():
    """MiniCPM5-15B-A2.5B's config as transformers' MiniCPM5MoeConfig defaults describe it, under its
    older spelling and first_k_dense_replace: 160 experts of 512, 16 a token, renormalised, times 3.66,
    one shared expert, the first layer dense; 32 heads of 128 over 2 KV heads, RoPE base 5,000,000;
    mlp_layer_types read where given; the attention without its gate refused."""
    released = {"architectures": ["MiniCPM5MoEForCausalLM"], "first_k_dense_replace": 1}
    config = ModelConfig.from_dict(released)
    assert config.architecture == "MiniCPM5MoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (160, 16, 512)
    assert config.norm_topk_prob and config.routed_scaling_factor == pytest.approx(3.66)
    assert config.shared_expert_intermediate_size == 512 and not config.shared_expert_gated
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.moe_num_groups == 1
    assert [config.layer_is_moe(i) for i in range(3)] == [False, True, True] and config.num_hidden_layers == 28
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 2, 128)
    assert config.rope_theta == 5_000_000.0 and config.rope_scaling is None and not config.qk_norm
    assert config.max_context_len == 524288 and not config.tie_word_embeddings
    listed = ModelConfig.from_dict({**released, "num_hidden_layers": 3,
                                    "mlp_layer_types": ["sparse", "dense", "sparse"]})
    assert [listed.layer_is_moe(i) for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError, match="mlp_layer_types"):
        ModelConfig.from_dict({**released, "num_hidden_layers": 2, "mlp_layer_types": ["dense", "moe"]})
    with pytest.raises(ValueError, match="use_gated_attention"):
        ModelConfig.from_dict({**released, "use_gated_attention": False})
    # (Nulls read as transformers reads them: heads hidden / heads wide, as many KV heads as heads.)
    nulls = ModelConfig.from_dict({**released, "head_dim": None, "num_key_value_heads": None})
    assert (nulls.head_dim, nulls.num_key_value_heads) == (64, 32)


def test_glm4_moe_lite_config_as_released():
    """GLM-4.7-Flash's config as transformers' Glm4MoeLiteConfig defaults describe it (47 layers, the
    first dense, then 64 experts of 1536, 4 a token, renormalised, times 1.8, one group, a shared one;
    MLA of a 512-value latent, 192 + 64 query/key values a head, 256 value values, queries through
    768, rotary values in pairs), with its MTP layer: that layer routed as the others."""
    released = {"architectures": ["Glm4MoeLiteForCausalLM"], "num_nextn_predict_layers": 1,
                "rope_theta": 1000000.0}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 4, 1536)
    assert config.routed_scaling_factor == pytest.approx(1.8) and config.norm_topk_prob
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.moe_num_groups == 1
    assert config.shared_expert_intermediate_size == 1536 and config.num_hidden_layers == 47
    assert [config.layer_is_moe(i) for i in (0, 1, 46, 47)] == [False, True, True, True] and config.num_mtp_layers == 1
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (512, 768, 192, 64, 256)
    assert config.rope_interleave and config.attention_scale == pytest.approx(256 ** -0.5)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (1, 576, 64)
    assert config.max_context_len == 202752 and config.rope_theta == 1000000.0 and not config.tie_word_embeddings
    listed = ModelConfig.from_dict({**released, "num_hidden_layers": 3, "mlp_layer_types": ["dense"] * 2 + ["sparse"]})
    assert [listed.layer_is_moe(i) for i in range(4)] == [False, False, True, True]
    assert ModelConfig.from_dict({**released, "q_lora_rank": None}).q_lora_rank == 0


def test_exaone_moe_config_as_released():
    """K-EXAONE's config as transformers' ExaoneMoeConfig reads it (its keys num_experts and
    num_shared_experts): 64 experts of 1024 by default, 8 a token, renormalised, times 2.5, a shared
    one, the first layer dense; EXAONE 4.0's layer kinds ("LLLG": three windowed layers rotating, the
    fourth full without positions) and per-head q/k norms; its MTP layers (mtp.*) not counted; its
    released spelling ExaoneMoEForCausalLM read as transformers' ExaoneMoeForCausalLM."""
    released = {"architectures": ["ExaoneMoEForCausalLM"], "hidden_size": 6144, "num_hidden_layers": 48,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 153600,
                "num_experts": 128, "num_shared_experts": 1, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
                "sliding_window": 128, "sliding_window_pattern": "LLLG", "num_nextn_predict_layers": 1,
                "max_position_embeddings": 262144, "rope_theta": 1000000.0}
    config = ModelConfig.from_dict(released)
    assert config.architecture == "ExaoneMoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 2048)
    assert config.shared_expert_intermediate_size == 2048 and config.routed_scaling_factor == 2.5
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert [config.layer_is_moe(i) for i in (0, 1, 47)] == [False, True, True] and config.num_mtp_layers == 0
    assert config.sliding_window == 128 and config.sliding_window_layers[:4] == (True, True, True, False)
    assert config.rope_layers == config.sliding_window_layers and config.qk_norm
    assert ModelConfig.from_dict({**released, "num_experts": None}).num_experts == 64  # (transformers' default)


def test_jais2_config_as_released():
    """Jais-2-8B-Chat's config as transformers' Jais2Config describes it: LayerNorms (layer_norm_eps),
    relu^2 unless stated, biases on the attention's and the MLP's projections, 26 heads of 128."""
    released = {"architectures": ["Jais2ForCausalLM"], "layer_norm_eps": 1e-5, "num_key_value_heads": 26,
                "rope_theta": 1000000.0}
    config = ModelConfig.from_dict(released)
    assert config.num_hidden_layers == 32  # (LlamaConfig's default, where left out)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.head_dim) == \
        (3328, 26624, 26, 128)
    assert config.hidden_act == "relu2" and config.qkv_bias and config.o_proj_bias and config.mlp_bias
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 1000000.0 and config.eos_token_ids == (150024,)
    assert config.vocab_size == 150272 and config.max_context_len == 8192 and not config.tie_word_embeddings
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**released, "hidden_act": "swish"})


def test_hyperclovax_config_as_released():
    """HyperCLOVA X SEED's config as transformers' HyperCLOVAXConfig describes it (Granite's defaults):
    Peri-LN unless use_post_norm is false, scores scaled by head_dim ** -0.5 unless attention_multiplier
    says otherwise, logits multiplied by logits_scaling (held as its reciprocal); its own remote code's
    nulls read as 1.0."""
    released = {"architectures": ["HyperCLOVAXForCausalLM"], "embedding_multiplier": 10.0,
                "residual_multiplier": 0.25, "logits_scaling": 0.125, "attention_multiplier": None}
    config = ModelConfig.from_dict(released)
    assert config.sublayer_output_norm and config.attention_scale == pytest.approx(128 ** -0.5)
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) == (10.0, 0.25, 8.0)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == \
        (32000, 4096, 11008, 32)
    assert config.num_key_value_heads == 32 and config.rms_norm_eps == 1e-6 and config.eos_token_ids == (2,)
    stated = ModelConfig.from_dict({**released, "attention_multiplier": 0.0078125, "use_post_norm": False,
                                    "head_dim": 64})
    assert stated.attention_scale == 0.0078125 and not stated.sublayer_output_norm and stated.head_dim == 64
    nulls = ModelConfig.from_dict({**released, "embedding_multiplier": None, "residual_multiplier": None,
                                   "logits_scaling": None})
    assert (nulls.embedding_multiplier, nulls.residual_multiplier, nulls.logits_scaling) == (1.0, 1.0, 1.0)


def test_axk1_config_as_released():
    """A.X-K1's config as transformers' AXK1Config describes it: DeepSeek-V3's latent attention (ranks 1536
    and 512, heads of 128 + 64, values of 128, rotary values in pairs), the first layer dense, then 192
    experts of 2048 (8 a token from 4 of 8 groups, sigmoid through the correction bias, times 2.5) beside a
    shared one; legacy first_k_dense_replace read where mlp_layer_types is left out; no query LoRA refused."""
    released = {"architectures": ["AXK1ForCausalLM"]}
    config = ModelConfig.from_dict(released)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (1536, 512, 128, 64, 128) and config.rope_interleave
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (192, 8, 2048)
    assert (config.moe_num_groups, config.moe_topk_groups, config.routed_scaling_factor) == (8, 4, 2.5)
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert config.shared_expert_intermediate_size == 2048 and config.num_mtp_layers == 0
    assert [config.layer_is_moe(i) for i in (0, 1, 60)] == [False, True, True] and config.num_hidden_layers == 61
    assert (config.vocab_size, config.hidden_size, config.max_context_len) == (163840, 7168, 32768)
    assert config.eos_token_ids == (163691,) and config.rms_norm_eps == 1e-6
    legacy = ModelConfig.from_dict({**released, "num_hidden_layers": 4, "first_k_dense_replace": 2})
    assert [legacy.layer_is_moe(i) for i in range(4)] == [False, False, True, True]
    stated = ModelConfig.from_dict({**released, "num_hidden_layers": 3,
                                    "mlp_layer_types": ["sparse", "dense", "sparse"]})
    assert [stated.layer_is_moe(i) for i in range(3)] == [True, False, True]
    with pytest.raises(ValueError, match="query LoRA"):
        ModelConfig.from_dict({**released, "q_lora_rank": None})


def test_deepseek_v32_config_as_released():
    """DeepSeek-V3.2-Exp's config.json (its keys, the FP8 quantization's left out): DeepSeek-V3's latent
    attention and experts, an indexer of 64 heads of 128 values keeping 2048 keys, whose key widens the
    cache row to 512 + 64 + 128 values; a config that leaves the indexer's keys out takes transformers'
    defaults; a model without the query bottleneck the indexer reads is refused."""
    released = {"architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "bos_token_id": 0,
                "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
                "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "intermediate_size": 18432,
                "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v32",
                "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
                "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
                "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
                "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096, "type": "yarn"},
                "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
                "v_head_dim": 128,
                "vocab_size": 129280}
    config = ModelConfig.from_dict(released)
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (64, 128, 2048)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (1, 512 + 64 + 128, 64)
    assert (config.q_lora_rank, config.kv_lora_rank, config.v_head_dim) == (1536, 512, 128) and config.rope_interleave
    assert (config.num_experts, config.num_experts_per_tok, config.moe_num_groups, config.moe_topk_groups) == (
        256, 8, 8, 4)
    assert [config.layer_is_moe(i) for i in (2, 3, 60)] == [False, True, True] and config.num_mtp_layers == 1
    assert config.rope_scaling["rope_type"] == "yarn" and config.max_context_len == 163840
    bare = ModelConfig.from_dict({k: v for k, v in released.items() if not k.startswith("index_")})
    assert (bare.index_n_heads, bare.index_head_dim, bare.index_topk) == (64, 128, 2048)
    with pytest.raises(ValueError, match="query LoRA"):
        ModelConfig.from_dict({**released, "q_lora_rank": None})
    with pytest.raises(ValueError, match="index_head_dim"):
        ModelConfig.from_dict({**released, "index_head_dim": 32})


def test_glm_moe_dsa_config_as_released():
    """GLM-5's config as transformers' GlmMoeDsaConfig describes it: DeepSeek-V3.2's layers with heads of 192
    + 64 query/key values and 256 value values, a 2048-value query bottleneck, 256 experts in one group
    after three dense layers, an indexer of 32 heads of 128 values keeping 2048 keys, every layer indexing;
    shared layers from index_topk_freq / index_skip_topk_offset, an "F"/"S" pattern or indexer_types; a
    first shared layer refused."""
    released = {"architectures": ["GlmMoeDsaForCausalLM"]}
    config = ModelConfig.from_dict(released)
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.q_lora_rank,
            config.kv_lora_rank) == (192, 64, 256, 2048, 512) and config.rope_interleave
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (32, 128, 2048)
    assert config.head_dim == 512 + 64 + 128 and config.index_rope_interleave
    assert config.indexer_shared_layers == (False,) * 78
    assert (config.num_experts, config.num_experts_per_tok, config.moe_num_groups, config.routed_scaling_factor) == (
        256, 8, 1, 2.5)
    assert [config.layer_is_moe(i) for i in (2, 3)] == [False, True] and config.moe_scoring == "sigmoid"
    assert (config.vocab_size, config.hidden_size, config.max_context_len, config.rms_norm_eps) == (
        154880, 6144, 202752, 1e-5)
    small = {**released, "num_hidden_layers": 6}
    every_other = ModelConfig.from_dict({**small, "index_topk_freq": 2})
    assert every_other.indexer_shared_layers == (False, False, True, False, True, False)
    assert ModelConfig.from_dict({**small, "index_topk_pattern": "FSSFSF"}).indexer_shared_layers == (
        False, True, True, False, True, False)
    stated = ModelConfig.from_dict({**small, "indexer_types": ["full", "shared"] * 3})
    assert stated.indexer_shared_layers == (False, True) * 3
    with pytest.raises(ValueError, match="the first 'full'"):
        ModelConfig.from_dict({**small, "indexer_types": ["shared", "full"] * 3})
    # (transformers' config has no moe_layer_freq: every layer from first_k_dense_replace on is routed)
    assert [ModelConfig.from_dict({**small, "moe_layer_freq": 2}).layer_is_moe(i) for i in range(6)] == [
        False, False, False, True, True, True]


def test_logit_soft_caps_are_computed_in_fp32_for_a_bf16_model(tmp_path):
    """A bf16 model's capped logits (nanochat's here; Gemma's, Beam's alike) come back in fp32, cap *
    tanh(logit / cap) of the head's bf16 logits computed in fp32: bf16's tanh near the cap would round them
    to steps of (cap / 128) and more."""
    from gpu_worker.model_runner import ModelRunner

    path = save_tiny_model(tmp_path, "nanochat", final_logit_softcapping=2.0)
    runner = ModelRunner(ModelConfig.from_pretrained(path), device="cpu", dtype=torch.bfloat16)
    runner.load_model(path)
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        logits = runner.model.compute_logits(hidden)
        raw = runner.model.lm_head(hidden).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, 2.0 * torch.tanh(raw / 2.0), atol=1e-6, rtol=0)
    assert not torch.equal(logits, (2.0 * torch.tanh(raw.bfloat16() / 2.0)).float())


def test_nanochat_config_as_released():
    """nanochat's config as transformers' NanoChatConfig describes it: 12 layers of 768, 6 heads (as many KV
    heads unless stated), an ungated relu^2 MLP of 8192, weightless norms (one over the embeddings), the
    logits capped at 15 (a stated null: none), untied; another activation refused."""
    released = {"architectures": ["NanoChatForCausalLM"]}
    config = ModelConfig.from_dict(released)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == \
        (50304, 768, 8192, 12)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6, 6, 128)
    assert config.hidden_act == "relu2" and config.qk_norm and config.embedding_norm
    assert config.final_logit_softcapping == 15.0 and not config.tie_word_embeddings
    assert config.rms_norm_eps == 1e-6 and config.eos_token_ids == (1,) and config.rope_theta == 10000.0
    assert ModelConfig.from_dict({**released, "final_logit_softcapping": None}).final_logit_softcapping is None
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**released, "hidden_act": "swiglu"})


def test_kolibri1_config_as_released():
    """Kolibri-1's config as transformers' Kolibri1Config describes it: 50 layers of 2560, every fifth full
    (attending without positions) and the others windowed (513, rotating), 48 query heads of 128 over 4 KV
    heads with per-head q/k norms; 384 experts of 512 in every layer, 6 a token, chosen by logit plus the
    correction bias, weighted by sigmoid, not renormalised, beside a shared expert of 512. Windowed
    layers without a window are refused, as transformers refuses them."""
    released = {"architectures": ["Kolibri1ForCausalLM"]}
    config = ModelConfig.from_dict(released)
    assert config.num_hidden_layers == 50 and config.sliding_window == 513
    assert config.sliding_window_layers[:5] == (True, True, True, True, False)
    assert config.rope_layers == config.sliding_window_layers and config.qk_norm
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (48, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (384, 6, 512)
    assert all(config.layer_is_moe(i) for i in range(50)) and config.shared_expert_intermediate_size == 512
    assert config.moe_scoring == "sigmoid_logits" and config.moe_correction_bias and not config.norm_topk_prob
    assert not config.shared_expert_gated and config.routed_scaling_factor == 1.0
    assert (config.vocab_size, config.max_context_len, config.eos_token_ids) == (128000, 262144, ())
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_dict({**released, "sliding_window": None})


def test_longcat_flash_config_as_released():
    """LongCat-Flash-Chat's config (its keys as released): 28 layers, served as 56 half-layers of latent
    attention (ranks 1536 and 512, heads of 128 + 64, values of 128, RoPE in pairs, base 10,000,000) and a
    dense MLP of 12288; shortcut experts: 512 of 2048 and 256 zero experts, 12 a token, times 6, not
    renormalised. Its remote code's switches off, and another zero expert, are refused."""
    released = {"architectures": ["LongcatFlashForCausalLM"], "hidden_size": 6144, "num_layers": 28,
                "num_attention_heads": 64, "ffn_hidden_size": 12288, "expert_ffn_hidden_size": 2048, "moe_topk": 12,
                "n_routed_experts": 512, "zero_expert_num": 256, "zero_expert_type": "identity",
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "routed_scaling_factor": 6.0, "rope_theta": 10000000.0, "mla_scale_q_lora": True,
                "mla_scale_kv_lora": True, "max_position_embeddings": 131072, "vocab_size": 131072,
                "router_bias": False}
    config = ModelConfig.from_dict(released)
    assert config.num_hidden_layers == 56 and config.intermediate_size == 12288 and config.rope_interleave
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (512, 12, 2048)
    assert config.moe_zero_experts == 256 and config.routed_scaling_factor == 6.0 and not config.norm_topk_prob
    assert not any(config.layer_is_moe(i) for i in range(56)) and config.rope_theta == 10_000_000.0
    assert ModelConfig.from_dict({"architectures": ["LongcatFlashForCausalLM"]}).num_hidden_layers == 56
    for changed in ({"mla_scale_q_lora": False}, {"zero_expert_type": "zeros"}, {"qk_head_dim": 64},
                    {"router_bias": True}):  # (transformers' router never adds its bias)
        with pytest.raises(ValueError):
            ModelConfig.from_dict({**released, **changed})
    # (a null zero_expert_num: none; transformers' num_hidden_layers and intermediate_size aliases)
    aliased = {k: v for k, v in released.items() if k not in ("num_layers", "ffn_hidden_size")}
    aliased = ModelConfig.from_dict({**aliased, "zero_expert_num": None, "num_hidden_layers": 56,
                                     "intermediate_size": 4096})
    assert (aliased.moe_zero_experts, aliased.num_hidden_layers, aliased.intermediate_size) == (0, 56, 4096)


def test_longcat_flash_zero_experts_are_chosen_and_its_mtp_weights_not_read(tmp_path, monkeypatch):
    """The tiny model's routing does pick zero experts (so the logits tests exercise them); the MTP weights
    a released checkpoint carries (model.mtp.*) are not read; the latent norms' epsilon is 1e-6 whatever
    rms_norm_eps (1e-5 here) says, as transformers builds them."""
    import gpu_worker.models.longcat_flash as longcat

    path = save_tiny_model(tmp_path, "longcat_flash")
    hf = load_hf(path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.mtp.layers.0.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.mtp.norm.weight"] = torch.ones(64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    chosen: list[torch.Tensor] = []
    select = longcat.select_experts_grouped

    def recording(*args, **kwargs):
        weights, ids = select(*args, **kwargs)
        chosen.append(ids.clone())
        return weights, ids

    runner = make_runner(path)
    monkeypatch.setattr(longcat, "select_experts_grouped", recording)
    prompt = [(7 * i + 3) % 256 for i in range(21)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, list(range(6))), ref, atol=1e-4, rtol=1e-4)
    assert chosen and any((ids >= 8).any() for ids in chosen) and any((ids < 8).any() for ids in chosen)
    attention = runner.model.model.layers[0].self_attn
    assert attention.q_a_layernorm.eps == attention.kv_a_layernorm.eps == 1e-6 != runner.config.rms_norm_eps


def test_biogpt_and_xglm_configs_as_released():
    """biogpt's and xglm-564M's configs as transformers describes them: multi-head attention, biases
    everywhere, LayerNorms of 1e-5, GELU, token embeddings times sqrt(hidden) unless scale_embedding is
    off, positions from the table's third row (XGLM's sinusoidal, its padding row zero)."""
    bio = ModelConfig.from_dict({"architectures": ["BioGptForCausalLM"]})
    assert (bio.vocab_size, bio.hidden_size, bio.num_hidden_layers, bio.num_attention_heads) == (42384, 1024, 24, 16)
    assert bio.num_key_value_heads == 16 and bio.intermediate_size == 4096 and bio.hidden_act == "gelu"
    assert bio.qkv_bias and bio.o_proj_bias and bio.mlp_bias and bio.rms_norm_eps == 1e-5
    assert bio.learned_positions and not bio.sinusoidal_positions and bio.position_offset == 2
    assert bio.token_embedding_scale == 32.0 and bio.max_context_len == 1024 and bio.tie_word_embeddings
    assert ModelConfig.from_dict({"architectures": ["BioGptForCausalLM"], "scale_embedding": False}
                                 ).token_embedding_scale == 1.0
    xglm = ModelConfig.from_dict({"architectures": ["XGLMForCausalLM"], "d_model": 1024, "ffn_dim": 4096,
                                  "num_layers": 24, "attention_heads": 16, "vocab_size": 256008})
    assert (xglm.hidden_size, xglm.intermediate_size, xglm.num_hidden_layers, xglm.num_attention_heads) == \
        (1024, 4096, 24, 16)
    assert xglm.sinusoidal_positions and xglm.position_padding_row == 1 and xglm.token_embedding_scale == 32.0
    assert xglm.max_context_len == 2048 and xglm.eos_token_ids == (2,) and xglm.hidden_act == "gelu"


def test_modernbert_decoder_config_as_released():
    """The Ettin decoders' config as transformers' ModernBertDecoderConfig describes it: 22 layers of 768,
    12 heads (as many KV heads), every third layer from the first full (RoPE base 160,000) and the others
    windowed (64 keys: local_attention // 2; base 10,000), GeGLU of 1152, LayerNorms of 1e-5 without biases,
    tied; scaled RoPE refused."""
    released = {"architectures": ["ModernBertDecoderForCausalLM"]}
    config = ModelConfig.from_dict(released)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == \
        (50368, 768, 1152, 22)
    assert config.num_key_value_heads == 12 and config.head_dim == 64 and config.hidden_act == "gelu"
    assert config.sliding_window == 64 and config.sliding_window_layers[:4] == (False, True, True, False)
    assert (config.rope_theta, config.local_rope_theta) == (160_000.0, 10_000.0) and config.embedding_norm
    assert not config.norm_bias and config.rms_norm_eps == 1e-5 and config.tie_word_embeddings
    legacy = ModelConfig.from_dict({**released, "global_rope_theta": 80_000.0, "local_rope_theta": 5_000.0})
    assert (legacy.rope_theta, legacy.local_rope_theta) == (80_000.0, 5_000.0)
    with pytest.raises(ValueError, match="default RoPE"):
        ModelConfig.from_dict({**released, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert ModelConfig.from_dict({**released, "eos_token_id": None}).eos_token_ids == ()  # (a stated null: none)
    with pytest.raises(ValueError, match="local_attention"):
        ModelConfig.from_dict({**released, "local_attention": None})


def test_modernbert_decoder_without_its_head_loads(tmp_path):
    """Served for embeddings alone (--runner pooling; alike a pipeline stage before the last): the head's
    transform and projection a checkpoint carries are not read."""
    import dataclasses

    from gpu_worker.model_runner import ModelRunner

    path = save_tiny_model(tmp_path, "modernbert_decoder")
    config = dataclasses.replace(ModelConfig.from_pretrained(path), embedding_only=True)
    runner = ModelRunner(config, device="cpu", dtype=torch.float32)
    runner.load_model(path)
    assert runner.model.lm_head is None and runner.model.head_transform is None


def test_an_older_xglm_save_with_its_position_table_loads(tmp_path):
    """transformers 4's XGLM saved its sinusoidal table (``embed_positions.weights``) and fairseq's conversions a
    ``_float_tensor``: skipped (the table is computed), the logits transformers' own."""
    path = save_tiny_model(tmp_path, "xglm")
    hf = load_hf(path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_positions.weights"] = torch.zeros(258, 64)
    tensors["model.embed_positions._float_tensor"] = torch.zeros(1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    prompt = [(7 * i + 3) % 256 for i in range(21)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(make_runner(path), prompt, list(range(6))), ref, atol=1e-4, rtol=1e-4)


def test_xglms_positions_are_transformers_sinusoids():
    from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

    from gpu_worker.layers.embedding import SinusoidalPositionEmbedding

    for dim, pad in ((64, 1), (65, 5)):  # (a padding row a position reads: row 5 is position 3)
        theirs = XGLMSinusoidalPositionalEmbedding(100, dim, padding_idx=pad)
        ours = SinusoidalPositionEmbedding(100, dim, offset=2, padding_row=pad)
        positions = torch.arange(100)
        torch.testing.assert_close(ours(positions), theirs(positions[None]).squeeze(0), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.weight, theirs.weights, atol=1e-6, rtol=0)


def test_jetmoe_config_as_released():
    """JetMoE's config as transformers' JetMoeConfig describes it (jetmoe-8b states 24 layers): heads of
    kv_channels (128), 16 key heads and, for each of a token's 2 attention experts, as many query heads (32
    in all); 8 MLP experts of 5632, 2 a token, renormalised; tied."""
    released = {"architectures": ["JetMoeForCausalLM"], "num_hidden_layers": 24}
    config = ModelConfig.from_dict(released)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 16, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 5632)
    assert all(config.layer_is_moe(i) for i in range(24)) and config.norm_topk_prob
    assert (config.vocab_size, config.hidden_size, config.max_context_len) == (32000, 2048, 4096)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,) and config.hidden_act == "silu"
    wider = ModelConfig.from_dict({**released, "num_experts_per_tok": 3, "kv_channels": 64})
    assert (wider.num_attention_heads, wider.head_dim) == (48, 64)
    # jetmoe-8b's config as its remote code wrote it (read by model_type in transformers).
    remote = {"architectures": ["JetMoEForCausalLM"], "model_type": "jetmoe", "num_hidden_layers": 24,
              "num_attention_heads": 32, "num_key_value_heads": 16, "kv_channels": 128, "ffn_hidden_size": 5632,
              "moe_num_experts": 8, "moe_top_k": 2, "glu": True, "bias": True, "activation_function": "silu"}
    assert ModelConfig.from_dict(remote) == config
    three = ModelConfig.from_dict({**remote, "moe_top_k": 3, "num_attention_heads": 48, "ffn_hidden_size": 1024})
    assert (three.num_experts_per_tok, three.num_attention_heads, three.moe_intermediate_size) == (3, 48, 1024)
    for changed in ({"glu": False}, {"bias": False}, {"num_attention_heads": 16}, {"activation_function": "gelu"}):
        with pytest.raises(ValueError):
            ModelConfig.from_dict({**remote, **changed})


def test_bitnet_config_as_released():
    """bitnet-b1.58-2B-4T's config as transformers' BitNetConfig describes it: 30 layers of 2560, 20 query
    heads over 5 KV heads, a gated relu^2 MLP of 6912, RoPE base 500,000, 4096 positions as released;
    another activation than those served refused."""
    released = {"architectures": ["BitNetForCausalLM"], "max_position_embeddings": 4096,
                "tie_word_embeddings": True, "rope_theta": 500000.0}
    config = ModelConfig.from_dict(released)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == \
        (128256, 2560, 6912, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (20, 5, 128)
    assert config.hidden_act == "relu2" and config.rope_theta == 500000.0 and config.max_context_len == 4096
    assert config.tie_word_embeddings and config.eos_token_ids == (128001,) and config.rms_norm_eps == 1e-5
    assert ModelConfig.from_dict({"architectures": ["BitNetForCausalLM"]}).rope_theta == 500000.0
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict({**released, "hidden_act": "relu"})


def test_beam_config_as_released():
    """Beam-1.0's config as transformers' BeamConfig describes it: 52 layers, five windowed (512, rotating
    with base 10,000) of six and the last full (no positions); 48 query heads of 128 over 8 KV heads with
    per-head q/k norms; the first three MLPs dense (20480), then 256 experts of 2560, 8 a token from 4 of
    8 groups, sigmoid through the correction bias, renormalised, times 2.5, no shared expert; logits
    capped at 30. A RoPE on the full layers is refused."""
    released = {"architectures": ["BeamForCausalLM"]}
    config = ModelConfig.from_dict(released)
    full = [i for i in range(52) if not config.sliding_window_layers[i]]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 51] and config.sliding_window == 512
    assert config.rope_layers == config.sliding_window_layers and config.rope_theta == 10000.0 and config.qk_norm
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (48, 8, 128)
    assert [config.layer_is_moe(i) for i in (0, 2, 3, 51)] == [False, False, True, True]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 2560)
    assert (config.moe_num_groups, config.moe_topk_groups, config.routed_scaling_factor) == (8, 4, 2.5)
    assert config.moe_correction_bias and config.norm_topk_prob and config.shared_expert_intermediate_size == 0
    assert config.final_logit_softcapping == 30.0 and config.vocab_size == 151936 and config.max_context_len == 8192
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 8192}
    stated = ModelConfig.from_dict({**released, "rope_parameters": {"sliding_attention": yarn, "full_attention": None}})
    assert stated.rope_theta == 50000.0 and stated.rope_scaling["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="full_attention layers with a RoPE"):
        ModelConfig.from_dict({**released, "rope_parameters": {"sliding_attention": yarn, "full_attention": yarn}})
    with pytest.raises(ValueError, match="one entry per layer kind"):  # (transformers' model cannot be built)
        ModelConfig.from_dict({**released, "rope_parameters": yarn})
    unrotated = ModelConfig.from_dict({**released, "rope_parameters": {"sliding_attention": None,
                                                                       "full_attention": None}})
    assert not any(unrotated.rope_layers) and len(unrotated.rope_layers) == 52


def test_beams_query_scale_is_transformers_at_long_positions():
    """The full layers' query scale by position, far past the test prompts' lengths (where it is near 1):
    transformers' compute_attention_scaling, kept in fp32 (so a bf16 model's queries are scaled in fp32,
    as the bf16 logprob test of the engine runs them)."""
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    from gpu_worker.models.beam import BeamModel

    positions = torch.tensor([0, 1, 2047, 2048, 100_000, 1_000_000])
    ours = BeamModel.query_scale(None, positions, torch.bfloat16)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.flatten(), compute_attention_scaling(positions[None]).flatten(), rtol=0, atol=0)


def test_axk1_as_released_without_correction_biases_and_with_unused_dense_norms(tmp_path):
    """A.X-K1's released checkpoints store a post_mlp_layernorm in their dense layers too (unused) and no
    router correction bias (transformers routes with zeros): both read as transformers reads them."""
    path = save_tiny_model(tmp_path, "axk1")
    hf = load_hf(path)
    weights = load_file(str(path / "model.safetensors"))
    assert any(name.endswith("e_score_correction_bias") for name in weights)
    weights = {name: t for name, t in weights.items() if not name.endswith("e_score_correction_bias")}
    weights["model.layers.0.post_mlp_layernorm.weight"] = torch.full((64,), 3.0)  # (layer 0 is dense)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
        prompt = [(7 * i + 3) % 256 for i in range(21)]
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = prefill_logits(make_runner(path), prompt, list(range(6)))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_flint_config_as_released():
    """Flint's config as transformers' FlintConfig describes it: 49 layers, the first two, every fourth from
    the second and the last full (attending without positions), the others windowed (513, rotating); a
    sink per query head; the first two layers dense (6144), then 256 experts of 512, 6 a token by sigmoid,
    renormalised, beside an ungated shared expert of 1024."""
    released = {"architectures": ["FlintForCausalLM"]}
    config = ModelConfig.from_dict(released)
    full = [i for i in range(49) if not config.sliding_window_layers[i]]
    assert full == [0, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 48] and config.sliding_window == 513
    assert config.rope_layers == config.sliding_window_layers and config.attention_sinks and config.qk_norm
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert [config.layer_is_moe(i) for i in (0, 1, 2, 48)] == [False, False, True, True]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 6, 512)
    assert config.moe_scoring == "sigmoid" and not config.moe_correction_bias and config.norm_topk_prob
    assert config.shared_expert_intermediate_size == 1024 and not config.shared_expert_gated
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (150144, 2048, 6144)
    stepped = ModelConfig.from_dict({**released, "num_hidden_layers": 4, "mlp_only_layers": [],
                                     "decoder_sparse_step": 2, "layer_types": ["full_attention"] * 4})
    assert [stepped.layer_is_moe(i) for i in range(4)] == [False, True, False, True]


def test_solar_open_config_as_released():
    """Solar-Open-100B's config: 128 experts of 1280 in every layer (a first_k_dense_replace carried over
    is not read, as transformers' SolarOpenConfig has no such key), 8 a token, renormalised, one group,
    a shared expert; 64 heads of 128 over 8 KV heads, RoPE base 1,000,000 unless stated, YaRN; no
    intermediate_size (no dense MLP), no q/k norms, no MTP layers."""
    released = {"architectures": ["SolarOpenForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 48,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 196608,
                "n_routed_experts": 128, "n_shared_experts": 1, "moe_intermediate_size": 1280,
                "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                "routed_scaling_factor": 1.0, "max_position_embeddings": 131072, "first_k_dense_replace": 3,
                "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536}}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 1280)
    assert all(config.layer_is_moe(i) for i in range(48)) and config.num_mtp_layers == 0
    assert config.shared_expert_intermediate_size == 1280 and not config.shared_expert_gated
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 8, 128)
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling["rope_type"] == "yarn"
    assert not config.qk_norm and not config.qkv_bias and not config.o_proj_bias and config.rotary_dim == 128
    assert ModelConfig.from_dict({**released, "attention_bias": True}).qkv_bias
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**released, "partial_rotary_factor": 0.5})


def test_youtu_config_as_released():
    """Youtu-LLM-2B's config as transformers' YoutuConfig describes it: MLA of a 512-value latent, 128 + 64
    query/key values a head, 128 value values, queries through 1536, rotary values in pairs; dense MLPs
    of 6144, tied; a null q_lora_rank kept (a plain query projection)."""
    released = {"architectures": ["YoutuForCausalLM"], "rope_theta": 1600000.0}
    config = ModelConfig.from_dict(released)
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (512, 1536, 128, 64, 128)
    assert config.rope_interleave and config.attention_scale == pytest.approx(192 ** -0.5)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (1, 576, 64)
    assert config.num_experts == 0 and config.intermediate_size == 6144 and config.tie_word_embeddings
    assert config.max_context_len == 131072 and config.eos_token_ids == (128001,) and config.rms_norm_eps == 1e-6
    assert ModelConfig.from_dict({**released, "q_lora_rank": None}).q_lora_rank == 0


def test_afmoe_config_as_released():
    """Trinity-Mini's config as transformers' AfmoeConfig describes it: 32 layers, three windowed
    (1024 tokens, rotating) to one full (no positions), the first dense, then 64 experts of 1408, 6 a
    token, sigmoid scores through the correction bias, renormalised, times route_scale, beside two
    shared; per-head q/k norms; mup's embedding scale where enabled; the remote code's routing keys
    read where they agree with transformers, refused where they do not."""
    released = {"architectures": ["AfmoeForCausalLM"], "num_key_value_heads": 4, "route_scale": 2.826,
                "mup_enabled": True, "score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 6, 1408)
    assert config.shared_expert_intermediate_size == 2 * 1408 and not config.shared_expert_gated
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert config.routed_scaling_factor == pytest.approx(2.826) and config.moe_num_groups == 1
    assert [config.layer_is_moe(i) for i in (0, 1, 31)] == [False, True, True]
    assert config.sliding_window == 1024 and config.sliding_window_layers[:4] == (True, True, True, False)
    assert config.rope_layers == config.sliding_window_layers and config.qk_norm
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 4, 128)
    assert config.embedding_multiplier == pytest.approx(2048 ** 0.5) and config.max_context_len == 16384
    unwindowed = ModelConfig.from_dict({**released, "sliding_window": None, "mup_enabled": False})
    assert unwindowed.sliding_window is None and unwindowed.rope_layers[:4] == (True, True, True, False)
    assert unwindowed.embedding_multiplier == 1.0
    for key, value in (("score_func", "softmax"), ("route_norm", False), ("n_group", 4)):
        with pytest.raises(ValueError, match="sigmoid routing"):
            ModelConfig.from_dict({**released, key: value})


def test_laguna_config_as_released():
    """laguna-XS.2's config as transformers' LagunaConfig describes it (a windowed layer of 512 tokens
    among full ones here): 48 query heads of 128 over 8 KV heads, per-layer heads where listed; the full
    layers' RoPE base 500,000 over half of each head, the windowed layers' 10,000 over whole heads;
    the first layer dense, then 256 experts of 512, 8 a token, sigmoid scores through the correction
    bias, renormalised, times moe_routed_scaling_factor, beside a shared expert of 512; per-head q/k
    norms; the router's weights on its input, and a windowed layer without a window, refused."""
    released = {"architectures": ["LagunaForCausalLM"], "num_hidden_layers": 4, "moe_routed_scaling_factor": 2.5,
                "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"],
                "num_attention_heads_per_layer": [48, 64, 48, 48], "moe_router_logit_softcapping": 30.0}
    config = ModelConfig.from_dict(released)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (48, 8, 128)
    assert [config.layer_attention_heads(i) for i in range(4)] == [48, 64, 48, 48]
    assert config.rope_theta == 500000.0 and config.rotary_dim == 64 and config.rope_scaling is None
    assert config.local_rope_theta == 10000.0 and config.local_rotary_dim == 128
    assert config.sliding_window == 512 and config.sliding_window_layers == (False, True, False, False)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 512)
    assert [config.layer_is_moe(i) for i in range(4)] == [False, True, True, True] and config.norm_topk_prob
    assert config.shared_expert_intermediate_size == 512 and not config.shared_expert_gated
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.routed_scaling_factor == 2.5
    assert config.moe_router_logit_softcapping == 30.0 and config.qk_norm and config.max_context_len == 131072
    with pytest.raises(ValueError, match="moe_apply_router_weight_on_input"):
        ModelConfig.from_dict({**released, "moe_apply_router_weight_on_input": True})
    with pytest.raises(ValueError, match="need a sliding_window"):
        ModelConfig.from_dict({**released, "sliding_window": None})
    with pytest.raises(ValueError, match="num_attention_heads_per_layer"):
        ModelConfig.from_dict({**released, "num_attention_heads_per_layer": [48, 60, 48, 48]})


def test_mellum_config_as_released():
    """Mellum2-12B-A2.5B's config as transformers' MellumConfig describes it: 28 layers, all routed by
    default (64 experts of 896, 8 a token, the softmax's top k renormalised), 32 query heads of 128 over
    4 KV heads, per-head q/k norms, a RoPE base per layer kind (500,000 full, 10,000 windowed), whole
    heads turning (a share refused, as transformers' Mellum rotates whole heads); its MTP layer not
    counted."""
    released = {"architectures": ["MellumForCausalLM"], "num_mtp_layers": 1,
                "layer_types": ["sliding_attention", "full_attention"] * 14}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (64, 8, 896)
    assert all(config.layer_is_moe(i) for i in range(28)) and config.norm_topk_prob and not config.moe_grouped_topk
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert config.rope_theta == 500000.0 and config.local_rope_theta == 10000.0 and config.rotary_dim == 128
    assert config.sliding_window == 1024 and config.sliding_window_layers[:2] == (True, False) and config.qk_norm
    assert config.shared_expert_intermediate_size == 0 and config.num_mtp_layers == 0
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**released, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})


def test_hy_v3_config_as_released():
    """Hy3-preview's config as transformers' HYV3Config describes it: 80 layers, the first dense, then
    192 experts of 1536, 8 a token, sigmoid scores through the correction bias, renormalised, times
    2.826, beside a shared expert; 64 query heads of 128 over 8 KV heads with per-head q/k norms, RoPE
    base 11,158,840."""
    released = {"architectures": ["HYV3ForCausalLM"], "router_scaling_factor": 2.826}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (192, 8, 1536)
    assert [config.layer_is_moe(i) for i in (0, 1, 79)] == [False, True, True] and config.num_hidden_layers == 80
    assert config.shared_expert_intermediate_size == 1536 and not config.shared_expert_gated
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert config.routed_scaling_factor == pytest.approx(2.826) and config.moe_num_groups == 1
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 8, 128)
    assert config.qk_norm and config.rope_theta == 11_158_840.0 and config.max_context_len == 131072
    with pytest.raises(ValueError, match="mlp_layer_types"):
        ModelConfig.from_dict({**released, "num_hidden_layers": 2, "mlp_layer_types": ["dense", "moe"]})


def test_mimo_v2_flash_config_as_released():
    """MiMo-V2-Flash's config as transformers' MiMoV2FlashConfig describes it: 48 layers, the first and
    every sixth full (4 KV heads), the others windowed (sliding_window_size 128: a window of 129; 8 KV
    heads) with sinks; heads of 192 for queries and keys (64 values turning; base 5,000,000 full, 10,000
    windowed), values of 128 times 0.707; the first layer dense, then 256 experts of 2048, 8 a token by
    DeepSeek-V3's routing without shared experts; each layer's cache its own heads."""
    released = {"architectures": ["MiMoV2FlashForCausalLM"], "sliding_window_size": 128, "n_group": 1,
                "topk_group": 1, "routed_scaling_factor": None, "num_nextn_predict_layers": 1}
    config = ModelConfig.from_dict(released)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.v_head_dim) == \
        (64, 4, 192, 128)
    assert config.attention_value_scale == pytest.approx(0.707) and config.attention_scale == pytest.approx(192 ** -0.5)
    assert config.rotary_dim == 64 and config.local_rotary_dim == 64
    assert config.rope_theta == 5_000_000.0 and config.local_rope_theta == 10_000.0
    assert config.sliding_window == 129 and config.sliding_window_layers[:7] == (False, True, True, True, True,
                                                                                 False, True)
    assert config.attention_layer_geometry[:6] == ((4, 192),) + ((8, 192),) * 4 + ((4, 192),)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (256, 8, 2048)
    assert [config.layer_is_moe(i) for i in (0, 1, 47)] == [False, True, True] and config.num_mtp_layers == 0
    assert config.shared_expert_intermediate_size == 0 and config.routed_scaling_factor == 1.0
    assert config.moe_scoring == "sigmoid" and config.moe_correction_bias and config.norm_topk_prob
    assert not config.o_proj_bias and config.num_attention_layers == 48
    with pytest.raises(ValueError, match="need a sliding_window"):
        ModelConfig.from_dict({**released, "sliding_window_size": None, "sliding_window": None})
    # (A plain kind without a share turns 0.334 of each head whatever the top-level share; a scaled one
    # takes the top-level share, else whole heads.)
    shares = ModelConfig.from_dict({**released, "partial_rotary_factor": 0.5, "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536,
                           "rope_theta": 5_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}})
    assert shares.rotary_dim == 96 and shares.local_rotary_dim == 64


def test_granite_swa_configs_as_released():
    """GraniteSWA's and GraniteMoeSWA's configs as transformers reads them: every fourth layer from the
    first full, the others windowed (128); a sink per query head; layer_rope_theta one base per layer
    (0: no positions), served where each layer kind has one: the full layers' the model's, the windowed
    layers' their own plain RoPE; Granite's scalars; GraniteMoeSWA's experts as Granite MoE Shared's."""
    released = {"architectures": ["GraniteSWAForCausalLM"], "num_hidden_layers": 8, "attention_multiplier": 0.015625,
                "layer_rope_theta": [0, 10000, 10000, 10000, 0, 10000, 10000, 10000]}
    config = ModelConfig.from_dict(released)
    assert config.attention_sinks and config.sliding_window == 128 and config.attention_scale == 0.015625
    assert config.sliding_window_layers == (False, True, True, True) * 2
    assert config.rope_layers == config.sliding_window_layers and config.rope_theta == 10000.0
    assert config.local_rope_theta is None and config.tie_word_embeddings and config.eos_token_ids == (100257,)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (2560, 20, 4)
    two = ModelConfig.from_dict({**released, "layer_rope_theta": [500000, 10000, 10000, 10000] * 2})
    assert two.rope_theta == 500000.0 and two.local_rope_theta == 10000.0 and all(two.rope_layers)
    uniform = ModelConfig.from_dict({**released, "layer_rope_theta": None, "rope_theta": 50000.0})
    assert uniform.rope_theta == 50000.0 and all(uniform.rope_layers) and uniform.local_rope_theta is None
    with pytest.raises(ValueError, match="one RoPE base per layer kind"):
        ModelConfig.from_dict({**released, "layer_rope_theta": [0, 10000, 20000, 10000, 0, 10000, 10000, 10000]})
    with pytest.raises(ValueError, match="plain RoPE"):  # (YaRN on every base, in its older spelling)
        ModelConfig.from_dict({**released, "layer_rope_theta": [500000, 10000, 10000, 10000] * 2,
                               "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                "original_max_position_embeddings": 4096}})
    moe = ModelConfig.from_dict({**released, "architectures": ["GraniteMoeSWAForCausalLM"], "num_local_experts": 32,
                                 "num_experts_per_tok": 8, "intermediate_size": 512, "shared_intermediate_size": 1024})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (32, 8, 512)
    assert moe.shared_expert_intermediate_size == 1024 and moe.attention_sinks and moe.rope_layers[:2] == (False, True)


def test_cohere2_moe_config_as_released():
    """A Cohere2-MoE config as transformers' Cohere2MoeConfig reads it: first_k_dense_replace dense layers
    (prefix_dense_intermediate_size wide, rotating under a prefix pattern of 1), then windowed layers but
    every sliding_window_pattern-th (full, without positions); the experts intermediate_size wide, the
    softmax over the top k logits; shared experts; the logits times logit_scale; LayerNorms unless
    rms_norm_eps is set; a null window kept."""
    released = {"architectures": ["Cohere2MoeForCausalLM"], "num_hidden_layers": 6, "first_k_dense_replace": 2,
                "prefix_dense_intermediate_size": 4096, "intermediate_size": 1024, "num_experts": 64,
                "num_experts_per_tok": 4, "num_shared_experts": 1, "num_key_value_heads": 8}
    config = ModelConfig.from_dict(released)
    assert config.intermediate_size == 4096 and config.moe_intermediate_size == 1024
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (64, 4, 1024)
    assert [config.layer_is_moe(i) for i in range(6)] == [False, False, True, True, True, True]
    assert config.sliding_window == 4096 and config.sliding_window_layers == (False, False, True, True, True, False)
    assert config.rope_layers == (True, True, True, True, True, False) and config.norm_topk_prob
    assert config.logits_scaling == 16.0 and config.head_dim == 128 and config.raw["cohere_norm"] == "layer"
    assert config.rms_norm_eps == 1e-5 and config.tie_word_embeddings and not config.moe_grouped_topk
    rms = ModelConfig.from_dict({**released, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid",
                                 "norm_topk_prob": False, "prefix_dense_sliding_window_pattern": 2})
    assert rms.raw["cohere_norm"] == "rms" and rms.rms_norm_eps == 1e-6 and rms.moe_scoring == "sigmoid"
    assert not rms.norm_topk_prob and rms.rope_layers[:2] == (True, False)
    assert ModelConfig.from_dict({**released, "sliding_window": None}).sliding_window is None
    with pytest.raises(ValueError, match="expert_selection_fn"):
        ModelConfig.from_dict({**released, "expert_selection_fn": "topk"})


def test_lfm3_config_as_released():
    """LFM3-1.7B's config as transformers' Lfm3Config describes it: 24 layers, of every four a convolution
    (7 wide), a convolution, a full attention layer and a convolution, the first of each four after the
    first a windowed attention layer (256) instead; 16 query heads of 128 over 4 KV heads with per-head
    q/k norms; the full layers' proportional RoPE (half of each head's frequencies, base 1,000,000), the
    windowed layers' plain (10,000); the MLP 7680 wide as stated; tied."""
    config = ModelConfig.from_dict({"architectures": ["Lfm3ForCausalLM"], "norm_eps": 1e-5})
    kinds = config.raw["layer_types"]
    assert kinds[:9] == ["conv", "conv", "full_attention", "conv", "sliding_attention", "conv", "full_attention",
                         "conv", "sliding_attention"]
    assert config.mamba_layers[:4] == (True, True, False, True) and config.mamba.conv_kernel == 7
    assert config.sliding_window == 256 and config.sliding_window_layers[4] and not config.sliding_window_layers[2]
    assert config.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.5}
    assert config.rope_theta == 1_000_000.0 and config.local_rope_theta == 10_000.0 and config.rotary_dim == 128
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 4, 128)
    assert config.intermediate_size == 7680 and config.qk_norm and config.tie_word_embeddings
    assert config.num_attention_layers == 11 and config.eos_token_ids == (124_900,)
    # (Kinds without a base of their own take the config's rope_theta, without a share its share.)
    bare = ModelConfig.from_dict({"architectures": ["Lfm3ForCausalLM"], "rope_theta": 500_000.0, "rms_norm_eps": 1e-6,
                                  "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                                            "partial_rotary_factor": 1.0},
                                                      "full_attention": {"rope_type": "proportional"}},
                                  "partial_rotary_factor": 0.25})
    assert bare.rope_theta == bare.local_rope_theta == 500_000.0 and bare.rms_norm_eps == 1e-6
    assert bare.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    assert bare.rotary_dim == 128 and bare.local_rotary_dim == 0  # (the full layers' zero frequencies past it)
    with pytest.raises(ValueError, match="windowed layers turn whole heads"):
        ModelConfig.from_dict({"architectures": ["Lfm3ForCausalLM"], "partial_rotary_factor": 0.5,
                               "rope_parameters": {"sliding_attention": {"rope_type": "default"},
                                                   "full_attention": {"rope_type": "proportional"}}})


def test_gpt_neo_config_as_released():
    """EleutherAI/gpt-neo-125m's config (its keys as released): 12 layers, global and local (256) in
    turn from attention_types (or attention_layers where stated), 12 heads of 64, learned positions
    (2048), unscaled scores, q/k/v without biases beside a biased out_proj, gelu_new, tied; the layer
    kinds' count checked."""
    released = {"architectures": ["GPTNeoForCausalLM"], "activation_function": "gelu_new",
                "attention_types": [[["global", "local"], 6]], "hidden_size": 768, "intermediate_size": None,
                "layer_norm_epsilon": 1e-05, "max_position_embeddings": 2048, "num_heads": 12, "num_layers": 12,
                "vocab_size": 50257, "window_size": 256, "bos_token_id": 50256, "eos_token_id": 50256}
    config = ModelConfig.from_dict(released)
    assert (config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (12, 12, 64)
    assert config.intermediate_size == 3072 and config.hidden_act == "gelu_new" and config.rms_norm_eps == 1e-5
    assert config.sliding_window == 256 and config.sliding_window_layers == (False, True) * 6
    assert config.learned_positions and not any(config.rope_layers) and config.attention_scale == 1.0
    assert not config.qkv_bias and config.o_proj_bias and config.mlp_bias and config.tie_word_embeddings
    assert config.max_context_len == 2048 and config.eos_token_ids == (50256,)
    listed = ModelConfig.from_dict({**released, "attention_layers": ["local", "global"] * 6})
    assert listed.sliding_window_layers == (True, False) * 6
    with pytest.raises(ValueError, match="attention_layers"):
        ModelConfig.from_dict({**released, "attention_types": [[["global", "local"], 5]]})


def test_codegen_config_as_released():
    """Salesforce/codegen-350M-mono's config (its keys as released): 20 layers of 16 heads of 64, RoPE over
    32 values of each in GPT-J's pairs, attention beside the MLP on one LayerNorm, gelu_new, an untied
    head with a bias; a hidden width that does not split into the four q/k/v blocks refused."""
    released = {"architectures": ["CodeGenForCausalLM"], "activation_function": "gelu_new", "n_ctx": 2048,
                "n_embd": 1024, "n_head": 16, "n_layer": 20, "n_positions": 2048, "rotary_dim": 32,
                "vocab_size": 51200, "layer_norm_epsilon": 1e-05, "tie_word_embeddings": False,
                "bos_token_id": 1, "eos_token_id": 50256}
    config = ModelConfig.from_dict(released)
    assert (config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (20, 16, 64)
    assert config.rotary_dim == 32 and config.intermediate_size == 4096 and config.hidden_act == "gelu_new"
    assert not config.qkv_bias and config.mlp_bias and not config.tie_word_embeddings
    assert config.max_context_len == 2048 and config.eos_token_ids == (50256,)
    with pytest.raises(ValueError, match="4 q/k/v blocks"):
        ModelConfig.from_dict({**released, "n_embd": 1026, "n_head": 18})


def test_olmo_hybrid_config_as_released():
    """OLMo Hybrid's config as transformers' OlmoHybridConfig describes it: 32 layers, every fourth full
    attention (30 heads of 128), the others Gated DeltaNet (30 key and value heads, keys 96 wide, values
    192, beta doubled, a 4-tap convolution); its released null RoPE base read as attention without
    positions; layer kinds without both kinds refused."""
    released = {"architectures": ["OlmoHybridForCausalLM"], "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": None}}
    config = ModelConfig.from_dict(released)
    assert config.mamba_layers[:4] == (True, True, True, False) and config.num_attention_layers == 8
    m = config.mamba
    assert (m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_kernel) == (30, 30, 96, 192, 4)
    assert m.beta_scale == 2.0 and m.split_projections and not any(config.rope_layers)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (30, 30, 128)
    assert config.max_context_len == 65536 and config.rms_norm_eps == 1e-6 and config.eos_token_ids == (100257,)
    rotating = ModelConfig.from_dict({**released, "rope_parameters": None})  # (transformers' default base)
    assert not rotating.rope_layers and rotating.rope_theta == 10000.0
    # (OLMo-core's converter writes a null top-level rope_theta; an older config a base there.)
    assert not any(ModelConfig.from_dict({**released, "rope_parameters": None, "rope_theta": None}).rope_layers)
    assert ModelConfig.from_dict({**released, "rope_parameters": None, "rope_theta": 500000.0}).rope_theta == 500000.0
    small = ModelConfig.from_dict({**released, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2})
    assert (small.mamba.num_k_heads, small.mamba.head_k_dim, small.mamba.head_v_dim) == (4, 12, 24)
    assert small.mamba_layers == (True, False)  # (no fourth layer: the last made full)
    with pytest.raises(ValueError, match="both linear_attention and full_attention"):
        ModelConfig.from_dict({**released, "num_hidden_layers": 2, "layer_types": ["linear_attention"] * 2})


def test_olmo_hybrid_in_transformers_own_names_loads_too(tmp_path):
    """Saved with transformers' own names (one conv1d, input_layernorm) rather than the released ones
    (q_conv1d / k_conv1d / v_conv1d, attention_layer_norm): the same logits."""
    from transformers import AutoModelForCausalLM

    from tests.gpu_worker.utils import make_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config("olmo_hybrid"), dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, save_original_format=False)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.layers.0.linear_attn.conv1d.weight" in names and "model.layers.0.input_layernorm.weight" in names
    runner = make_runner(tmp_path, num_blocks=16, block_size=4)
    prompt = [(5 * i + 1) % 256 for i in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [3, 1, 4, 0, 2]), ref, atol=1e-4, rtol=1e-4)


def test_dbrx_config_as_released():
    """dbrx-instruct's config: 16 experts of 10,752, 4 a token, renormalised; 8 KV heads, q/k/v clamped
    to 8, RoPE base 500,000; another norm of the routing weights refused."""
    released = {"architectures": ["DbrxForCausalLM"], "d_model": 6144, "n_heads": 48, "n_layers": 40,
                "max_seq_len": 32768, "vocab_size": 100352,
                "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000, "attn_pdrop": 0},
                "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4,
                               "moe_normalize_expert_weights": 1, "ffn_act_fn": {"name": "silu"},
                               "moe_jitter_eps": 0.01, "moe_loss_weight": 0.05}}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (16, 4, 10752)
    assert config.norm_topk_prob and config.clip_qkv == 8.0 and config.rope_theta == 500000.0
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        6144, 48, 8, 128)
    assert config.max_context_len == 32768 and not config.tie_word_embeddings
    assert all(config.layer_is_moe(i) for i in range(40)) and not (config.qkv_bias or config.mlp_bias)
    with pytest.raises(ValueError, match="moe_normalize_expert_weights"):
        ModelConfig.from_dict({**released, "ffn_config": {**released["ffn_config"],
                                                          "moe_normalize_expert_weights": 2}})
    # Saved by transformers 5: its own default base beside attn_config's; the trained one is served.
    resaved = {**released, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert ModelConfig.from_dict(resaved).rope_theta == 500000.0


def test_apertus_config_defaults_and_its_fixed_xielu_scalars(tmp_path):
    """Apertus's RoPE defaults (llama3 over 8192 positions, base 12M) as transformers' ApertusConfig
    has them; xIELU's beta and eps are transformers' fixed values, a checkpoint stating others refused."""
    base = {"architectures": ["ApertusForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
    config = ModelConfig.from_dict(base)
    assert config.rope_theta == 12000000.0 and config.rope_scaling["rope_type"] == "llama3"
    assert config.qk_norm and config.hidden_act == "xielu" and config.max_position_embeddings == 65536
    path = save_tiny_model(tmp_path, "apertus")
    tensors = load_file(path / "model.safetensors")
    assert float(tensors["model.layers.1.mlp.act_fn.beta"]) == 0.5
    tensors["model.layers.1.mlp.act_fn.beta"] = torch.tensor(0.6)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.act_fn\.beta.*0\.5"):
        make_runner(path)


def test_phimoe_config_as_released():
    """Phi-3.5-MoE's config: 16 experts, 2 a token by sparsemixer, its LongRoPE's mscale as the
    attention factor; mscales apart, or another top k, refused."""
    released = {"architectures": ["PhimoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 6400,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32064,
                "num_local_experts": 16, "num_experts_per_tok": 2, "router_jitter_noise": 0.01,
                "attention_bias": True, "lm_head_bias": True, "max_position_embeddings": 131072,
                "sliding_window": 131072, "rope_theta": 10000.0,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [2.0] * 64,
                                 "short_mscale": 1.243, "long_mscale": 1.243,
                                 "original_max_position_embeddings": 4096}}
    config = ModelConfig.from_dict(released)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (16, 2, 6400)
    assert config.moe_scoring == "sparsemixer" and config.sparsemixer_jitter_eps == 0.01
    assert config.rope_scaling["attention_factor"] == 1.243 and config.long_rope_after == 4096
    assert config.qkv_bias and config.o_proj_bias
    apart = {**released["rope_scaling"], "long_mscale": 1.5}
    with pytest.raises(ValueError, match="short_mscale and long_mscale apart"):
        ModelConfig.from_dict({**released, "rope_scaling": apart})
    with pytest.raises(ValueError, match="2 experts"):
        ModelConfig.from_dict({**released, "num_experts_per_tok": 4})


@pytest.mark.parametrize("kind, prefix, saved_as", [
    ("opt", "model.", ("decoder.embed_positions.weight", "decoder.layers.0.fc1.weight")),
    ("bloom", "transformer.", ("word_embeddings_layernorm.weight", "h.0.self_attention.query_key_value.weight")),
])
def test_released_names_without_the_base_models_prefix_load(tmp_path, kind, prefix, saved_as):
    """facebook/opt-125m's checkpoint names its tensors ``decoder.*`` (no "model."), bigscience/bloom-560m's
    without "transformer."; neither has a head (tied)."""
    path = save_tiny_model(tmp_path, kind)
    hf = load_hf(path)
    saved = load_file(path / "model.safetensors")
    tensors = {name.removeprefix(prefix): tensor for name, tensor in saved.items() if name != "lm_head.weight"}
    assert all(name in tensors for name in saved_as)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    runner = make_runner(path, num_blocks=16, block_size=4)
    prompt = [(5 * i + 1) % 256 for i in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [3, 1, 4, 0, 2]), ref, atol=1e-4, rtol=1e-4)


def test_gpt2s_released_names_and_buffers_load(tmp_path):
    """openai-community/gpt2's checkpoint names its tensors without "transformer." and keeps each
    layer's causal-mask buffers (attn.bias, attn.masked_bias): read, the buffers left out."""
    path = save_tiny_model(tmp_path, "gpt2")
    hf = load_hf(path)
    saved = load_file(path / "model.safetensors")
    tensors = {name.removeprefix("transformer."): tensor for name, tensor in saved.items()}
    for layer in range(2):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256, dtype=torch.bool))
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    assert "wpe.weight" in tensors and "h.0.attn.c_attn.weight" in tensors
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    runner = make_runner(path, num_blocks=16, block_size=4)
    prompt = [(5 * i + 1) % 256 for i in range(20)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(runner, prompt, [3, 1, 4, 0, 2]), ref, atol=1e-4, rtol=1e-4)


def test_olmo3_with_longrope_is_refused():
    """LongRoPE picks its rows by a shifted position that OLMo 3's windowed layers' plain RoPE would not
    follow: refused rather than served wrong."""
    base = {"architectures": ["Olmo3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 256}
    assert ModelConfig.from_dict(base).local_rope_theta == 500000.0
    longrope = {"full_attention": {**LONGROPE, "rope_theta": 500000.0, "original_max_position_embeddings": 16},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_dict({**base, "rope_parameters": longrope})
