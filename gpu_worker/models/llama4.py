"""Meta's Llama 4 (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E and their instruct models), served on
text: Llama4ForCausalLM, and Llama4ForConditionalGeneration's language model (its vision side is not
served).

* Three layers of four rotate their queries and keys (no_rope_layers) and then L2-norm them (use_qk_norm:
  an RMSNorm without weights); the fourth attends without positions, its queries scaled by
  1 + attn_scale * log(floor((position + 1) / floor_scale) + 1) (attn_temperature_tuning).
* The rotating layers (layer_types' "chunked_attention" ones) attend within chunks of
  attention_chunk_size tokens (8192): the query at position p sees the keys from p - p mod 8192
  (gpu_worker.attn_metadata.ChunkedWindow); the others attend to every key.
* Routed experts in every interleave_moe_layer_step-th layer (moe_layers): the top-k experts by router
  logit, each weighted by the sigmoid of its logit, which scales the token's input to the expert;
  beside a shared expert every token goes through; the other layers' MLP is intermediate_size_mlp wide.
* RoPE turns pairs of neighbouring values (PairedRopeForCausalLM reorders q's and k's rows into halves);
  the checkpoint's experts are stacked [experts, in, out] (``feed_forward.experts.gate_up_proj``,
  ``down_proj``), transposed as they are read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.fused_moe import FusedMoE
from gpu_worker.layers.rotary import RotaryEmbedding, llama_4_query_scale
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel
from gpu_worker.models.paired_rope import PairedRopeForCausalLM
from gpu_worker.models.renamed_checkpoint import rename_first


def l2_norm(heads: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's values over their root mean square (no weights), in fp32, cast back."""
    return F.rms_norm(heads.float(), heads.shape[-1:], eps=eps).to(heads.dtype)


class Llama4Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer: int = 0, norm_class=None) -> None:
        super().__init__(config, layer)
        self.qk_l2_norm = bool(config.raw.get("use_qk_norm", True)) and self.rotates
        self.eps = config.rms_norm_eps

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``rope``: (cos, sin), and (attn_temperature_tuning) each token's query scale for the layers
        without positions."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.rotates:
            RotaryEmbedding.rotate_(qk, rope[0], rope[1])
            if self.qk_l2_norm:
                qk = l2_norm(qk, self.eps)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        if not self.rotates and len(rope) > 2:
            q = q * rope[2]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj.forward(self.attn.forward(q, k, v, meta))


class Llama4MoE(nn.Module):
    """The router's top-k experts, each given the token scaled by the sigmoid of its logit, plus the
    shared expert; one all-reduce sums every rank's partial outputs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False).requires_grad_(False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, expert_parallel=config.expert_parallel,
                                weights_on_inputs=True)
        self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size, reduce_results=False)
        self.tp_size = self.experts.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, ids = torch.topk(self.gate.forward(x), self.experts.top_k, dim=-1)
        out = self.experts.forward(x, torch.sigmoid(logits.float()), ids)
        out += self.shared_expert.forward(x)
        if self.tp_size > 1:
            distributed.all_reduce(out)
        return out


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention
    moe_class = Llama4MoE


class Llama4Model(LlamaModel):
    layer_class = Llama4DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.temperature = config.llama4_temperature

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """1 + attn_scale * log(floor((position + 1) / floor_scale) + 1): Ministral 3's form, one
        position on (the no-position layers apply it)."""
        return None if self.temperature is None else llama_4_query_scale(positions + 1, *self.temperature, dtype)


class Llama4ForCausalLM(PairedRopeForCausalLM):
    model_class = Llama4Model
    _RENAMED = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))
    # The checkpoint's stacked experts are [experts, in, out], which PEFT reads as [experts, out, in]:
    # an adapter's lora_A on them is on their outputs' side, its lora_B on their inputs' (LoRAManager).
    lora_stacked_experts_in_out = True

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(self._renamed(weights))

    def lora_module_name(self, module: str) -> str:
        """A LoRA adapter's module name (the checkpoint's) as ours."""
        return self._renamed_name(f"{module}.")[:-1]

    def _renamed_name(self, name: str) -> str:
        return rename_first(name, self._RENAMED)

    def _renamed(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        for name, tensor in weights:
            name = self._renamed_name(name)
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) \
                    and not name.startswith(self.pp_missing_prefixes):
                tensor = materialize(tensor).transpose(1, 2)  # ([experts, in, out] -> [experts, out, in])
            yield name, tensor
