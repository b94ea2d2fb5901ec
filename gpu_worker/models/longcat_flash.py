"""Meituan's LongCat-Flash (LongcatFlashForCausalLM: LongCat-Flash-Chat, -Thinking).

Each of its num_layers layers holds two sublayer pairs, each a latent attention (DeepSeek-V3's MLA with
a query LoRA, RoPE in pairs) and a dense MLP, pre-normed, and a "shortcut" mixture of experts read from
the first pair's normed MLP input and added to the second pair's output. Served as 2 x num_layers
half-layers (one attention, one KV cache and one dense MLP each): an even half-layer computes the
shortcut, the odd one after it adds it.

* The latent attention scales the queries by sqrt(hidden / q_lora_rank) and the normed latent (the keys'
  unrotated part and, through kv_b_proj, the values) by sqrt(hidden / kv_lora_rank): folded into the
  weights of q_b_proj and kv_a_layernorm as they are read.
* The shortcut's router scores n_routed_experts + zero_expert_num experts by a softmax (fp32), picks the
  top k through a correction bias and weighs them by their scores times routed_scaling_factor, not
  renormalised; a "zero expert" returns its input (the token times its weight), the others are routed
  experts.

The multi-token-prediction weights (``model.mtp.*``) are not read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.fused_moe import FusedMoE, select_experts_grouped
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from gpu_worker.models.llama import LlamaModel


class ShortcutMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_routed, self.num_zero = config.num_experts, config.moe_zero_experts
        total = self.num_routed + self.num_zero
        self.top_k, self.scaling = config.num_experts_per_tok, config.routed_scaling_factor
        self.classifier = nn.Linear(config.hidden_size, total, bias=False,
                                    dtype=torch.float32).requires_grad_(False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(total, dtype=torch.float32), requires_grad=False)
        self.experts = FusedMoE(self.num_routed, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                expert_parallel=config.expert_parallel)
        self.tp_size = self.experts.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.classifier.weight)
        weights, ids = select_experts_grouped(logits, self.top_k, False, self.e_score_correction_bias,
                                              scaling_factor=self.scaling, scoring="softmax")
        identity = None
        if self.num_zero:
            zero = ids >= self.num_routed
            identity = (weights * zero).sum(dim=-1, keepdim=True)
            # (a zero expert's slot runs a routed expert at weight 0, as transformers maps it)
            ids = torch.where(zero, (ids - self.num_routed) * self.num_routed // self.num_zero, ids)
            weights = weights.masked_fill(zero, 0.0)
        out = self.experts.forward(x, weights, ids)
        if self.tp_size > 1:
            distributed.all_reduce(out)
        return out if identity is None else out + (x * identity).to(out.dtype)


class LongcatFlashHalfLayer(DeepseekDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        # (the even half-layer's shortcut experts; the odd one reads its output through _partner)
        self.moe = ShortcutMoE(config) if layer % 2 == 0 else None
        self.shortcut: torch.Tensor | None = None
        self._partner: tuple[LongcatFlashHalfLayer, ...] = ()

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self._attention(rope, hidden, residual, meta)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        out = self.mlp.forward(hidden)
        if self.moe is not None:
            self.shortcut = self.moe.forward(hidden)
        elif self._partner:
            partner = self._partner[0]
            out, partner.shortcut = out + partner.shortcut, None
        return out, residual


class LongcatFlashModel(LlamaModel):
    layer_class = LongcatFlashHalfLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for i in range(1, len(self.layers), 2):  # (not a submodule: a tuple holds the even half-layer)
            self.layers[i]._partner = (self.layers[i - 1],)


_SUBLAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlps|input_layernorm|post_attention_layernorm)\.([01])\.")
_SHORTCUT = re.compile(r"^model\.layers\.(\d+)\.mlp\.(router\.)?")


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):
    model_class = LongcatFlashModel

    def reads_checkpoint_tensor(self, name: str) -> bool:
        return not name.startswith("model.mtp.")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        config = self.config
        q_scale = math.sqrt(config.hidden_size / config.q_lora_rank)
        kv_scale = math.sqrt(config.hidden_size / config.kv_lora_rank)

        def ours(weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
            for name, tensor in weights:
                if (match := _SUBLAYER.match(name)) is not None:
                    layer, part, sub = int(match[1]), match[2], int(match[3])
                    part = "mlp" if part == "mlps" else part
                    name = f"model.layers.{2 * layer + sub}.{part}.{name[match.end():]}"
                elif (match := _SHORTCUT.match(name)) is not None:
                    name = f"model.layers.{2 * int(match[1])}.moe.{name[match.end():]}"
                if name.endswith(".self_attn.q_b_proj.weight"):
                    tensor = materialize(tensor).mul(q_scale)
                elif name.endswith(".self_attn.kv_a_layernorm.weight"):
                    tensor = materialize(tensor).mul(kv_scale)
                yield name, tensor

        return super().checkpoint_tensors(ours(weights))
