"""The GPT family's checkpoints (``transformer.wte``, ``transformer.h.{i}``, ``transformer.ln_f``):
OpenAI's GPT-2 (GPT2LMHeadModel: gpt2, gpt2-medium / large / xl, distilgpt2), BigCode's GPTBigCode
(GPTBigCodeForCausalLM: StarCoder, StarCoderBase, SantaCoder, WizardCoder, OctoCoder) and
EleutherAI's GPT-J (GPTJForCausalLM: gpt-j-6b and its fine-tunes).

GPT-2: a learned position embedding added to the tokens' (no RoPE: ModelConfig.learned_positions),
LayerNorms before attention and MLP, biases everywhere, an ungated gelu MLP (``c_fc``, ``c_proj``),
the head tied to the embedding. Its projections are Conv1D modules, whose weights are stored as
[in, out]: transposed at load; q, k and v are fused in ``c_attn`` (q's rows, then k's, then v's).

GPTBigCode: GPT-2's layers as Linear modules, with multi-query attention (one KV head: ``c_attn``
holds q's rows, then the head's k and v) unless multi_query is off, where ``c_attn`` holds each
head's q, k and v together (as GPT-NeoX's query_key_value).

GPT-Neo (GPTNeoForCausalLM: gpt-neo-125m / 1.3B / 2.7B): GPT-2's layers with q, k and v apart and
without biases (``attn.attention.{q,k,v}_proj``; out_proj biased), Linear MLP projections, scores not
scaled by head_dim ** -0.5, and every other layer (``attention_layers`` "local") attending through a
window of ``window_size`` tokens.

CodeGen (CodeGenForCausalLM: Salesforce's codegen-350M / 2B / 6B / 16B, mono, multi and nl): GPT-J's
layers with q, k and v fused in ``qkv_proj`` in four blocks (the model-parallel layout it was trained
in), each holding its quarter of the heads' q rows, then v's, then k's: split at load.

GPT-J: attention and MLP side by side on one LayerNorm (as Phi's), RoPE over the first rotary_dim
values of each head in GPT-J's pairs (reordered into halves at load, as the other paired families'),
q, k, v and out projections without biases, an MLP with them (``fc_in``, ``fc_out``), an LM head
with a bias.
"""

from __future__ import annotations

import torch

from gpu_worker.layers.layernorm import LayerNorm
from gpu_worker.models.classic import PhiDecoderLayer, Starcoder2MLP
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP
from gpu_worker.models.paired_rope import PairedRopeForCausalLM
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint, per_head_qkv, rename_parts

# The GPT checkpoints' top-level modules -> ours (after an optional "transformer." prefix).
_TOP_LEVEL = (("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."), ("ln_f.", "model.norm."),
              ("h.", "model.layers."))
# (The causal-mask buffers older checkpoints saved.)
_MASKS = (".attn.bias", ".attn.masked_bias")


class GPTCheckpoint(RenamedCheckpoint):
    """The GPT family's names: ``transformer.`` (or nothing, as openai-community/gpt2 saved them) before
    its top-level modules (``top_level``: theirs, ours), then the layers' parts."""

    skipped = _MASKS
    top_level = _TOP_LEVEL

    def ours(self, name: str) -> str:
        name = name.removeprefix("transformer.")
        for theirs, ours in self.top_level:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        return rename_parts(name, self.renames)


class GPT2DecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = Starcoder2MLP  # (c_fc, c_proj)


class GPT2Model(LlamaModel):
    layer_class = GPT2DecoderLayer


class GPT2LMHeadModel(GPTCheckpoint, LlamaForCausalLM):
    model_class = GPT2Model
    renames = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
               (".attn.c_proj.", ".self_attn.o_proj."), (".attn.c_attn.", ".self_attn.c_attn."))
    fused = ".self_attn.c_attn."
    # Conv1D modules, their weights stored [in, out].
    transposed = (".self_attn.c_attn.weight", ".self_attn.o_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of ``c_attn``: q's, then k's, then v's."""
        config = self.config
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return tuple(fused.split([q, kv, kv]))


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    transposed = ()  # (Linear modules)

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Multi-query: q's rows, then the KV head's k and v; else each head's q, k and v together."""
        if self.config.num_key_value_heads == 1:
            return super().fused_qkv_parts(fused)
        return per_head_qkv(fused, self.config.num_attention_heads, self.config.head_dim)


class GPTNeoForCausalLM(GPTCheckpoint, LlamaForCausalLM):
    model_class = GPT2Model
    renames = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
               (".attn.attention.out_proj.", ".self_attn.o_proj."), (".attn.attention.", ".self_attn."))
    skipped = (*_MASKS, ".attn.attention.bias", ".attn.attention.masked_bias")


class GPTJMLP(UngatedMLP):
    in_name, out_name = "fc_in", "fc_out"


class GPTJDecoderLayer(PhiDecoderLayer):
    """Phi's layer (attention beside the MLP on one LayerNorm) with GPT-J's MLP names."""

    mlp_class = GPTJMLP


class GPTJModel(LlamaModel):
    layer_class = GPTJDecoderLayer


class GPTJForCausalLM(GPTCheckpoint, PairedRopeForCausalLM):
    model_class = GPTJModel
    lm_head_bias = True
    renames = ((".ln_1.", ".input_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."))


class CodeGenForCausalLM(GPTJForCausalLM):
    fused = ".self_attn.qkv_proj."
    skipped = (*_MASKS, ".attn.causal_mask")
    # (The four model-parallel blocks of qkv_proj it was trained with.)
    blocks = 4

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of [4 blocks, (q, v, k), hidden / 4] as q's, k's and v's."""
        width = self.config.num_attention_heads * self.config.head_dim
        per_block = fused.view(self.blocks, 3, width // self.blocks, *fused.shape[1:])
        q, v, k = (per_block[:, i].reshape(width, *fused.shape[1:]) for i in range(3))
        return q, k, v

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B: on the fused qkv_proj, its rows split as the weight's and the q and k rows'
        rotary parts from GPT-J's pairs into halves, as the weight's were loaded."""
        if module.endswith(".self_attn.qkv_proj"):
            q, k, v = self.fused_qkv_parts(b)
            return torch.cat((self.rotary_rows(q), self.rotary_rows(k), v))
        return super().lora_b_rows(module, b)
