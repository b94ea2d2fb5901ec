"""Decoders of the classic transformer's LayerNorms (with biases): BigCode's StarCoder2
(Starcoder2ForCausalLM: starcoder2-3b / 7b / 15b), Stability's StableLM (StableLmForCausalLM:
stablelm-2-1_6b, stablelm-2-12b, stablelm-3b-4e1t, stablelm-zephyr), NVIDIA's Nemotron
(NemotronForCausalLM: Minitron-4B / 8B, Mistral-NeMo-Minitron-8B, Nemotron-4-340B), Microsoft's Phi
(PhiForCausalLM: phi-1, phi-1_5, phi-2) and EleutherAI's GPT-NeoX (GPTNeoXForCausalLM: the Pythia
suite, gpt-neox-20b, dolly-v2, RedPajama-INCITE).

StarCoder2: LayerNorms, biases on every projection (use_bias), an ungated gelu MLP (``c_fc``,
``c_proj``), RoPE over whole heads, optionally a sliding window in every layer.

StableLM: LayerNorms, RoPE over the first quarter of each head (partial_rotary_factor), q/k/v biases
(use_qkv_bias), a SwiGLU MLP; StableLM 2 12B runs attention and MLP side by side on one normed input
(use_parallel_residual) and norms each query and key head with weights of its own (qk_layernorm:
its checkpoint's ``q_layernorm.norms.{head}``, stacked into one tensor per layer at load).

Nemotron: LayerNorms scaling by (1 + w) (LayerNorm1P), RoPE over the first half of each head, an
ungated relu^2 MLP (up_proj, down_proj), biases under attention_bias (all four projections) and
mlp_bias.

Phi: one LayerNorm a layer before attention and MLP side by side (fc1, fc2: gelu_new), biases on
every projection and on the LM head, RoPE over part of each head (0.4 in phi-2), optionally a
LayerNorm over each query and key head (qk_layernorm); its ``dense`` (o_proj) and ``final_layernorm``
read under our names.

GPT-NeoX: two LayerNorms a layer, attention and MLP side by side from the same input, each on its
own norm (use_parallel_residual; in sequence otherwise), q/k/v fused per head in one
``query_key_value`` (each head's q, k and v rows together: split at load), RoPE over a quarter of
each head, biases everywhere, an ungated gelu MLP (dense_h_to_4h, dense_4h_to_h); its names
(``gpt_neox.embed_in``, ``attention``, ``final_layer_norm``, ``embed_out``) read as ours.

Persimmon (PersimmonForCausalLM: Adept's persimmon-8b-base / -chat): GPT-NeoX's per-head fused
``query_key_value`` and MLP names in Llama's sequence (attention, then MLP), a LayerNorm over each
query and key head (qk_layernorm, as Phi's), RoPE over half of each head, an ungated relu^2 MLP,
biases everywhere, an untied head; its ``dense`` (o_proj), ``q_layernorm`` / ``k_layernorm`` and
``final_layernorm`` read as ours.

Jais 2 (Jais2ForCausalLM: inceptionai's Jais-2-8B-Chat): Llama's attention and layers with LayerNorms
(weights and biases), Nemotron's ungated relu^2 MLP (up_proj, down_proj), biases on all four attention
projections (attention_bias) and on the MLP's (mlp_bias), RoPE over whole heads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.layernorm import LayerNorm, LayerNorm1P, RMSNorm
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.cohere import HeadLayerNorm
from gpu_worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, UngatedMLP
from gpu_worker.models.renamed_checkpoint import RenamedCheckpoint


class Starcoder2MLP(UngatedMLP):
    in_name, out_name = "c_fc", "c_proj"


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = Starcoder2MLP


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_class = Starcoder2Model


class StableLmAttention(LlamaAttention):
    """Llama's attention (its q/k norm path) with StableLM's per-head LayerNorms where qk_layernorm."""

    def __init__(self, config: ModelConfig, layer: int = 0, norm_class: type[RMSNorm] = RMSNorm) -> None:
        super().__init__(config, layer, norm_class)
        if config.raw.get("qk_layernorm"):
            qkv, eps = self.qkv_proj, config.rms_norm_eps
            self.q_norm = HeadLayerNorm(self.num_heads, self.head_dim, eps, qkv.tp_rank * self.num_heads)
            self.k_norm = HeadLayerNorm(self.num_kv_heads, self.head_dim, eps, qkv._kv_head_start())


class StableLmDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    attention_class = StableLmAttention

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.parallel = bool(config.raw.get("use_parallel_residual"))
        if self.parallel:
            self.post_attention_layernorm = None  # (one norm a layer)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.parallel:
            return self.parallel_forward(rope, hidden, residual, meta)
        return super().forward(rope, hidden, residual, meta)


class StableLmModel(LlamaModel):
    layer_class = StableLmDecoderLayer


class StableLmForCausalLM(LlamaForCausalLM):
    model_class = StableLmModel
    _HEAD_NORM = re.compile(r"(.+\.self_attn\.)(q|k)_layernorm\.norms\.(\d+)\.weight")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Each layer's per-head q / k norms (one LayerNorm a head in the checkpoint) stacked into the
        [heads, head_dim] weights of our per-head norm, once all of a layer's heads are read."""
        heads = {"q": self.config.num_attention_heads, "k": self.config.num_key_value_heads}
        pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            match = self._HEAD_NORM.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            prefix, part, head = match.group(1), match.group(2), int(match.group(3))
            norms = pending.setdefault((prefix, part), {})
            norms[head] = materialize(tensor)
            if len(norms) == heads[part]:
                yield f"{prefix}{part}_norm.weight", torch.stack([norms[h] for h in range(heads[part])])
                del pending[(prefix, part)]
        if pending:
            raise ValueError(f"checkpoint lacks some heads' q/k norms: {sorted(pending)}")


class NemotronDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm1P
    mlp_class = UngatedMLP


class NemotronModel(LlamaModel):
    layer_class = NemotronDecoderLayer


class NemotronForCausalLM(LlamaForCausalLM):
    model_class = NemotronModel


class Jais2DecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = UngatedMLP


class Jais2Model(LlamaModel):
    layer_class = Jais2DecoderLayer


class Jais2ForCausalLM(LlamaForCausalLM):
    model_class = Jais2Model


class PhiMLP(UngatedMLP):
    in_name, out_name = "fc1", "fc2"


class PhiDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = PhiMLP

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.post_attention_layernorm = None  # (one norm a layer)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parallel_forward(rope, hidden, residual, meta)


class PhiModel(LlamaModel):
    layer_class = PhiDecoderLayer


class PhiForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = PhiModel
    lm_head_bias = True
    renames = ((".self_attn.dense.", ".self_attn.o_proj."), ("model.final_layernorm.", "model.norm."),
               (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."))


class GPTNeoXMLP(UngatedMLP):
    in_name, out_name = "dense_h_to_4h", "dense_4h_to_h"


class GPTNeoXDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = GPTNeoXMLP

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.parallel = bool(config.raw.get("use_parallel_residual", True))

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.parallel:  # (each side on a norm of its own)
            return self.parallel_forward(rope, hidden, residual, meta)
        return super().forward(rope, hidden, residual, meta)


class GPTNeoXModel(LlamaModel):
    layer_class = GPTNeoXDecoderLayer


class GPTNeoXForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    """GPT-NeoX's names as ours (``embed_out``, its head, is transformers' ``lm_head``), and each layer's
    fused ``query_key_value`` ([heads, (q, k, v), head_dim] rows) split into q, k and v."""

    model_class = GPTNeoXModel
    renames = (("gpt_neox.", "model."), ("embed_out.", "lm_head."), ("model.embed_in.", "model.embed_tokens."),
               ("model.final_layer_norm.", "model.norm."), (".attention.dense.", ".self_attn.o_proj."),
               (".attention.", ".self_attn."))
    skipped = (".attention.bias", ".attention.masked_bias")
    fused = ".self_attn.query_key_value."


class PersimmonDecoderLayer(LlamaDecoderLayer):
    norm_class = LayerNorm
    mlp_class = GPTNeoXMLP


class PersimmonModel(LlamaModel):
    layer_class = PersimmonDecoderLayer


class PersimmonForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    model_class = PersimmonModel
    renames = ((".self_attn.dense.", ".self_attn.o_proj."), ("model.final_layernorm.", "model.norm."),
               (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."))
    fused = ".self_attn.query_key_value."
