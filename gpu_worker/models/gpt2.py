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

GPT-J: attention and MLP side by side on one LayerNorm (as Phi's), RoPE over the first rotary_dim
values of each head in GPT-J's pairs (reordered into halves at load, as the other paired families'),
q, k, v and out projections without biases, an MLP with them (``fc_in``, ``fc_out``), an LM head
with a bias.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import LayerNorm
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.classic import GPTNeoXForCausalLM, Starcoder2MLP, rename_parts
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP
from gpu_worker.models.paired_rope import PairedRopeForCausalLM

# The GPT checkpoints' top-level modules -> ours (after an optional "transformer." prefix).
_TOP_LEVEL = (("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."), ("ln_f.", "model.norm."),
              ("h.", "model.layers."))
# (The causal-mask buffers older checkpoints saved.)
_MASKS = (".attn.bias", ".attn.masked_bias")


def gpt_name(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A GPT checkpoint's tensor name as ours: the top-level modules, then the layers' parts."""
    name = name.removeprefix("transformer.")
    for theirs, ours in _TOP_LEVEL:
        if name.startswith(theirs):
            name = ours + name[len(theirs):]
            break
    return rename_parts(name, renames)


class GPT2DecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = Starcoder2MLP  # (c_fc, c_proj)


class GPT2Model(LlamaModel):
    layer_class = GPT2DecoderLayer


class GPT2LMHeadModel(LlamaForCausalLM):
    model_class = GPT2Model
    _RENAMES = ((".ln_1.", ".input_layernorm."), (".ln_2.", ".post_attention_layernorm."),
                (".attn.c_proj.", ".self_attn.o_proj."), (".attn.c_attn.", ".self_attn.c_attn."))
    _FUSED = re.compile(r"(.+\.self_attn\.)c_attn\.(weight|bias)")
    # Conv1D modules, their weights stored [in, out].
    transposed = (".self_attn.c_attn.weight", ".self_attn.o_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """The checkpoint's names as ours, Conv1D weights transposed, ``c_attn`` split into q, k and v."""
        for name, tensor in weights:
            if name.endswith(_MASKS):
                continue
            name = gpt_name(name, self._RENAMES)
            if name.endswith(self.transposed):
                tensor = materialize(tensor).t()
            match = self._FUSED.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), self.fused_qkv_parts(materialize(tensor)),
                                  strict=True):
                yield f"{match.group(1)}{part}.{match.group(2)}", rows

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows of ``c_attn`` (a weight, a bias or a LoRA B) as q's, k's and v's: in that order."""
        config = self.config
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return tuple(fused.split([q, kv, kv]))

    def lora_module_name(self, module: str) -> str:
        """An adapter's module as ours (``attn.c_attn``: our fused qkv_proj, ``attn.c_proj``: o_proj)."""
        return gpt_name(f"{module}.", self._RENAMES).replace(".self_attn.c_attn.", ".self_attn.qkv_proj.")[:-1]

    def lora_b_rows(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """An adapter's B on ``c_attn``, its rows in our qkv_proj's order (q's, k's, v's)."""
        return torch.cat(self.fused_qkv_parts(b)) if module.endswith(".self_attn.qkv_proj") else b


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    transposed = ()  # (Linear modules)

    def fused_qkv_parts(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Multi-query: q's rows, then the KV head's k and v; else each head's q, k and v together."""
        if self.config.num_key_value_heads == 1:
            return super().fused_qkv_parts(fused)
        return GPTNeoXForCausalLM.per_head_qkv(fused, self.config.num_attention_heads, self.config.head_dim)


class GPTJMLP(UngatedMLP):
    in_name, out_name = "fc_in", "fc_out"


class GPTJDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = GPTJMLP

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.post_attention_layernorm = None  # (one norm a layer)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parallel_forward(rope, hidden, residual, meta)


class GPTJModel(LlamaModel):
    layer_class = GPTJDecoderLayer


class GPTJForCausalLM(PairedRopeForCausalLM):
    model_class = GPTJModel
    lm_head_bias = True
    _RENAMES = ((".ln_1.", ".input_layernorm."), (".attn.out_proj.", ".self_attn.o_proj."), (".attn.", ".self_attn."))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        named = ((gpt_name(name, self._RENAMES), tensor) for name, tensor in weights if not name.endswith(_MASKS))
        return super().checkpoint_tensors(named)

    def lora_module_name(self, module: str) -> str:
        """An adapter's module as ours (``attn.out_proj``: o_proj)."""
        return gpt_name(f"{module}.", self._RENAMES)[:-1]
