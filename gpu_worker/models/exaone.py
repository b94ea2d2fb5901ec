"""LG's EXAONE 3.0 / 3.5 and EXAONE Deep (ExaoneForCausalLM), read without their remote code: the
Llama block (llama3 RoPE in 3.5) under GPT-2-like names: ``transformer.wte``, ``transformer.h.N``
with ``ln_1`` / ``ln_2`` (RMSNorms), ``attn.attention.{q,k,v,out}_proj``, ``mlp.c_fc_0`` (gate),
``c_fc_1`` (up), ``c_proj`` (down), and ``transformer.ln_f``."""

from __future__ import annotations

from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint


class ExaoneForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    renames = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
               ("transformer.ln_f.", "model.norm."), (".ln_1.", ".input_layernorm."),
               (".ln_2.", ".post_attention_layernorm."), (".attn.attention.out_proj.", ".self_attn.o_proj."),
               (".attn.attention.", ".self_attn."), (".mlp.c_fc_0.", ".mlp.gate_proj."),
               (".mlp.c_fc_1.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))
