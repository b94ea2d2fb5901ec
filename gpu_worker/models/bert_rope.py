"""BERT-style encoders with rotary positions: transformers' NomicBertModel (nomic-embed-text-v1 /
v1.5, nomic-bert-2048) and GteModel (gte-multilingual-base, gte-*-v1.5), with their sequence
classifiers (gte-multilingual-reranker-base) and token classifiers, and JinaEmbeddingsV3Model
(jina-embeddings-v3).

Like BERT (bidirectional attention within each prompt, no KV cache: see models.bert), with:
* no position table: rotary positions (RoPE, rotate-half) on the queries and keys;
* post-norm layers: x = norm(x + attn(x)), then x = norm(x + mlp(x));
* a gated MLP, act(gate(x)) * up(x) then down (NomicBERT: SiLU, no biases; GTE: GELU, a bias on
  down only), or Jina v3's plain one (fc1, gelu, fc2, with biases);
* embeddings = LayerNorm(word + token type) (GTE checkpoints with type_vocab_size 0 have no type table).
Parameter names follow transformers' (``layers.N.self_attn.q_proj``, ``mlp.gate_proj``,
``post_attention_layernorm``, ...). The checkpoints their own code saved are read too: NomicBERT's
(``emb_ln``, ``encoder.layers.N.attn.Wqkv``, ``mlp.fc11`` / ``fc12`` / ``fc2``, ``norm1`` / ``norm2``)
and GTE's ``NewModel`` (``encoder.layer.N.attention.qkv_proj``, ``mlp.up_gate_proj``, ``attn_ln`` /
``mlp_ln``), their fused projections split into the shards the loader places per TP rank; and Jina
v3's (``roberta.`` prefix, ``mixer.Wqkv``, ``mixer.out_proj``), whose task adaptations are LoRA
parametrizations of every weight: the chosen task's is merged into the weights at load.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.config import ENCODER_ACTIVATIONS, ModelConfig
from gpu_worker.encoder_metadata import EncoderMetadata
from gpu_worker.layers.activation import gated_activation
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.encoder_attention import EncoderAttention
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike, materialize
from gpu_worker.models.bert import BertModel, BertPooler, encoder_layer_norm
from gpu_worker.models.renamed_checkpoint import rename_parts


class RopeBertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_attention_heads, bias=config.qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.head_dim = config.head_dim
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=config.o_proj_bias)
        self.attn = EncoderAttention(self.num_heads, self.num_heads, self.head_dim, config.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                meta: EncoderMetadata) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden).view(hidden.shape[0], 3 * self.num_heads, self.head_dim)
        RotaryEmbedding.rotate_(qkv[:, : 2 * self.num_heads], *rope)  # (q and k are adjacent)
        q, k, v = qkv.split(self.num_heads, dim=1)
        return self.o_proj.forward(self.attn.forward(q, k, v, meta))


class RopeBertMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.act = gated_activation(config.hidden_act)
        down_bias = config.mlp_bias if config.down_proj_bias is None else config.down_proj_bias
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=down_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(hidden)))


class PlainMLP(nn.Module):
    """Jina v3's MLP (transformers' CLIPMLP): fc1, gelu, fc2, with biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.approximate = ENCODER_ACTIVATIONS[config.hidden_act]
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2.forward(F.gelu(self.fc1.forward(hidden), approximate=self.approximate))


class RopeBertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = RopeBertAttention(config)
        self.post_attention_layernorm = encoder_layer_norm(config)
        self.mlp = RopeBertMLP(config) if config.gated_mlp else PlainMLP(config)
        self.post_mlp_layernorm = encoder_layer_norm(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                meta: EncoderMetadata) -> torch.Tensor:
        hidden = self.post_attention_layernorm.forward(hidden + self.self_attn.forward(rope, hidden, meta))
        return self.post_mlp_layernorm.forward(hidden + self.mlp.forward(hidden))


class RopeBertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = (nn.Embedding(config.type_vocab_size, config.hidden_size)
                                      if config.type_vocab_size else None)
        self.LayerNorm = encoder_layer_norm(config)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings.forward(input_ids)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:  # every token of type 0
                hidden += self.token_type_embeddings.weight[0]
            else:
                hidden += self.token_type_embeddings.forward(token_type_ids)
        return self.LayerNorm.forward(hidden)


class RopeBertEncoder(nn.Module):
    def __init__(self, config: ModelConfig, with_pooler: bool = False) -> None:
        super().__init__()
        self.embeddings = RopeBertEmbeddings(config)
        self.layers = nn.ModuleList(RopeBertLayer(config) for _ in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_context_len, config.rope_theta,
                                          config.rope_scaling)
        # (A sequence classifier's pooler: dense + tanh over the first token, as BERT's.)
        self.pooler = BertPooler(config) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings.forward(input_ids, token_type_ids)
        rope = self.rotary_emb.cos_sin(positions)
        for layer in self.layers:
            hidden = layer.forward(rope, hidden, meta)
        return hidden


class RopeBertModel(BertModel):
    """NomicBertModel / GteModel served for embeddings, and their *ForSequenceClassification
    (pooler and classifier, as BERT's) and *ForTokenClassification."""

    encoder_class = RopeBertEncoder
    # transformers' names for q/k/v and gate/up, fused here: (our parameter, shard).
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    # (Set below, once _RENAMES is defined.)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Checkpoint names as ours: transformers' as they are; NomicBERT's and GTE's own code's
        renamed, their fused q/k/v and up/gate split into shards; buffers, poolers and masked-LM
        heads skipped."""
        hidden, size = self.config.hidden_size, self.config.intermediate_size
        for name, tensor in weights:
            # (NomicBERT's own classifiers keep the encoder under "bert.".)
            name = name.removeprefix("new.").removeprefix("nomic_bert.").removeprefix("gte.").removeprefix("bert.")
            if (name.endswith(("inv_freq", "position_ids", "token_type_ids"))
                    or name.startswith(("cls.", "lm_head.", "mlm_head."))
                    or (name.startswith("pooler.") and self.model.pooler is None)):
                continue
            name = rename_parts(name, self.checkpoint_renames)
            if ".self_attn.Wqkv." in name:
                for part, start in (("q_proj", 0), ("k_proj", hidden), ("v_proj", 2 * hidden)):
                    yield name.replace(".Wqkv.", f".{part}."), tensor.narrow(0, start, hidden)
            elif ".mlp.up_gate_proj." in name:  # (GTE: up first, then gate)
                yield name.replace(".up_gate_proj.", ".up_proj."), tensor.narrow(0, 0, size)
                yield name.replace(".up_gate_proj.", ".gate_proj."), tensor.narrow(0, size, size)
            else:
                yield name, tensor


# The names NomicBERT's and GTE's own code give their tensors -> transformers' (applied in order).
_RENAMES = (("encoder.layers.", "layers."), ("encoder.layer.", "layers."), ("emb_ln.", "embeddings.LayerNorm."),
            (".attn.Wqkv.", ".self_attn.Wqkv."), (".attention.qkv_proj.", ".self_attn.Wqkv."),
            (".attn.out_proj.", ".self_attn.o_proj."), (".attention.o_proj.", ".self_attn.o_proj."),
            (".mlp.fc11.", ".mlp.up_proj."), (".mlp.fc12.", ".mlp.gate_proj."), (".mlp.fc2.", ".mlp.down_proj."),
            (".norm1.", ".post_attention_layernorm."), (".norm2.", ".post_mlp_layernorm."),
            (".attn_ln.", ".post_attention_layernorm."), (".mlp_ln.", ".post_mlp_layernorm."))


class JinaEmbeddingsV3Model(RopeBertModel):
    """jina-embeddings-v3: transformers' JinaEmbeddingsV3Model, and the checkpoint Jina's own code
    saved, with its task adaptation (ModelConfig.task_lora) merged into the weights."""

    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (set below: its fc1 / fc2 stay)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        return super().checkpoint_tensors(self._merged_task(
            (name.removeprefix("roberta.").replace(".mixer.", ".attn."), tensor) for name, tensor in weights))

    def _merged_task(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """Each LoRA-parametrized weight (``X.parametrizations.weight.original`` with its
        ``.0.lora_A`` / ``.0.lora_B``, one adaptation per task along their first dimension) as
        ``X.weight``: the original plus the chosen task's B @ A times alpha / rank (A @ B for an
        embedding, whose factors Jina's code stores the other way round), or the original alone."""
        parts: dict[str, dict[str, WeightLike]] = {}
        for name, tensor in weights:
            module, marker, part = name.partition(".parametrizations.weight.")
            if not marker:
                yield name, tensor
                continue
            held = parts.setdefault(module, {})
            held[part] = tensor
            if len(held) == 3:
                yield f"{module}.weight", self._merge(module, parts.pop(module))
        if parts:
            raise ValueError(f"incomplete LoRA parametrizations in the checkpoint: {sorted(parts)}")

    def _merge(self, module: str, held: dict[str, WeightLike]) -> torch.Tensor:
        if set(held) != {"original", "0.lora_A", "0.lora_B"}:
            raise ValueError(f"{module}: unexpected parametrization tensors {sorted(held)}")
        original = materialize(held["original"])
        if self.config.task_lora is None:
            return original
        task, scaling = self.config.task_lora
        a, b = (materialize(held[k])[task].float() for k in ("0.lora_A", "0.lora_B"))
        delta = a @ b if module.endswith("embeddings") else b @ a
        return (original.float() + delta.view(original.shape) * scaling).to(original.dtype)


RopeBertModel.checkpoint_renames = _RENAMES
JinaEmbeddingsV3Model.checkpoint_renames = tuple((old, new) for old, new in _RENAMES if ".mlp." not in old)
