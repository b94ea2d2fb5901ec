"""TII's Falcon (FalconForCausalLM: falcon-7b, falcon-40b, falcon-180B, falcon-11B and their instruct
models): LayerNorms, RoPE over whole heads, an ungated gelu MLP (dense_h_to_4h, dense_4h_to_h),
biases under ``bias``, the head tied to the embedding. Three layouts:

* falcon-7b: attention and MLP side by side on one LayerNorm (parallel_attn), multi-query attention
  (one KV head: ``query_key_value`` holds the queries' rows, then the key's, then the value's);
* falcon-40b / 180B (new_decoder_architecture): attention and MLP side by side, each on its own
  LayerNorm (``ln_attn``, ``ln_mlp``; one, ``input_layernorm``, under num_ln_in_parallel_attn 1:
  falcon-11B), num_kv_heads KV heads, ``query_key_value`` grouped by KV head (each group's queries,
  then its key and its value);
* neither: attention then MLP, each after its own norm, ``query_key_value`` interleaved per head (each
  head's q, k and v rows together) without multi_query.

The fused ``query_key_value`` is split into q, k and v at load (a LoRA adapter's B alike). The ALiBi
models (falcon-rw-1b / 7b: attention then MLP, no RoPE) attend with ALiBi's biases, their slopes scaled
with the scores (ModelConfig.alibi_slope_scale) as Falcon adds them before the scale.
"""

from __future__ import annotations

import torch

from gpu_worker.config import ModelConfig
from gpu_worker.models.classic import GPTNeoXDecoderLayer
from gpu_worker.models.llama import LlamaForCausalLM, LlamaModel
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint, grouped_qkv


class FalconDecoderLayer(GPTNeoXDecoderLayer):
    """GPT-NeoX's layer (its two norms side by side, or in sequence), with falcon-7b's one norm for
    both sublayers where the config has a single norm in parallel."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        raw = config.raw
        new = bool(raw.get("new_decoder_architecture"))
        self.parallel = new or bool(raw.get("parallel_attn", True))
        if self.parallel and not (new and int(raw.get("num_ln_in_parallel_attn") or 2) == 2):
            self.post_attention_layernorm = None  # (one norm for both sides)


class FalconModel(LlamaModel):
    layer_class = FalconDecoderLayer


class FalconForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = FalconModel
    renames = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
               ("transformer.h.", "model.layers."), (".ln_attn.", ".input_layernorm."),
               (".ln_mlp.", ".post_attention_layernorm."), (".self_attention.dense.", ".self_attn.o_proj."),
               (".self_attention.query_key_value.", ".self_attn.query_key_value."))
    fused = ".self_attn.query_key_value."

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of query_key_value (a weight, a bias or a LoRA B) as q's, k's and v's, from the layout
        the config names."""
        config = self.config
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        if config.raw.get("new_decoder_architecture"):  # ([kv heads, (its queries, k, v), head_dim] rows)
            return grouped_qkv(fused, heads, kv_heads, head_dim)
        if kv_heads == 1:  # (multi-query: the queries' rows, the key's, the value's)
            return tuple(fused.split([heads * head_dim, head_dim, head_dim]))
        return super().fused_qkv_parts(fused)  # (each head's q, k and v together)
