"""Shanghai AI Lab's InternLM2 / 2.5 (InternLM2ForCausalLM) and InternLM3 (InternLM3ForCausalLM), read
without their remote code: the Llama block under other names.

* InternLM2: ``tok_embeddings``, ``attention.wqkv`` (q, k and v fused, grouped by KV head: each group's
  queries, then its key, then its value; split at load), ``attention.wo``, ``feed_forward.w1 / w3 /
  w2`` (gate, up, down), ``attention_norm`` and ``ffn_norm``, the head ``output``; ``bias`` puts a bias
  on wqkv and wo.
* InternLM3: Llama's own names, q/k/v biases by ``qkv_bias`` and the output projection's by ``bias``.

Their dynamic NTK RoPE is plain RoPE within max_position_embeddings (it changes the base only past
it): served so (gpu_worker.config)."""

from __future__ import annotations

import torch

from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint, grouped_qkv


class InternLM2ForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    renames = (("model.tok_embeddings.", "model.embed_tokens."), (".attention.wqkv.", ".self_attn.wqkv."),
               (".attention.wo.", ".self_attn.o_proj."), (".feed_forward.w1.", ".mlp.gate_proj."),
               (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
               (".attention_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
               ("output.weight", "lm_head.weight"))
    fused = ".self_attn.wqkv."

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        config = self.config
        return grouped_qkv(fused, config.num_attention_heads, config.num_key_value_heads, config.head_dim)


class InternLM3ForCausalLM(LlamaForCausalLM):
    """InternLM3 (InternLM3-8B-Instruct): Llama's names; its biases are ModelConfig's."""
