"""ModernBERT (gte-modernbert, modernbert-embed, gte-reranker-modernbert, ModernBERT classifiers).

An encoder like BERT (bidirectional attention within each prompt, no KV cache: see models.bert),
built like a modern decoder:
* pre-norm layers (the first layer's attention takes the embeddings' norm as its input norm), a
  final norm, LayerNorms without biases by default, no biases in the projections by default;
* rotary positions: RoPE at ``global_rope_theta`` in the full-attention layers (every third) and
  at ``local_rope_theta`` in the others, which attend through a bidirectional window of
  ``local_attention // 2`` tokens each side;
* a GeGLU MLP (``Wi`` holds the input and the gate, in that order);
* a sequence classifier pools (CLS or mean, ``classifier_pooling``), then runs its head
  (dense + activation + norm) and its classifier.
Module names follow transformers'; the fused ``Wqkv`` and ``Wi`` are split into shards for
tensor parallelism as the checkpoint is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.config import ENCODER_ACTIVATIONS, ModelConfig
from gpu_worker.encoder_metadata import EncoderMetadata
from gpu_worker.layers.activation import GeluAndMul
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.encoder_attention import EncoderAttention
from gpu_worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike


def _norm(config: ModelConfig) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)
    norm.requires_grad_(False)
    return norm


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.Wqkv = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                      config.num_attention_heads, bias=config.qkv_bias)
        self.num_heads = self.Wqkv.num_heads
        self.head_dim = config.head_dim
        self.Wo = RowParallelLinear(config.hidden_size, config.hidden_size, bias=config.o_proj_bias)
        self.window = config.layer_sliding_window(layer)
        self.attn = EncoderAttention(self.num_heads, self.num_heads, self.head_dim, config.head_dim ** -0.5,
                                     self.window)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                meta: EncoderMetadata) -> torch.Tensor:
        qkv = self.Wqkv.forward(hidden).view(hidden.shape[0], 3 * self.num_heads, self.head_dim)
        # q and k are adjacent: rotated in place as one tensor of heads.
        RotaryEmbedding.rotate_(qkv[:, : 2 * self.num_heads], *rope)
        q, k, v = qkv.split(self.num_heads, dim=1)
        return self.Wo.forward(self.attn.forward(q, k, v, meta))


class ModernBertMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.Wi = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=config.mlp_bias)
        self.act = GeluAndMul(ENCODER_ACTIVATIONS[config.hidden_act])
        self.Wo = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.Wo.forward(self.act.forward(self.Wi.forward(hidden)))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        # (The first layer's input is the embeddings' output, already normed.)
        self.attn_norm = _norm(config) if layer else None
        self.attn = ModernBertAttention(config, layer)
        self.mlp_norm = _norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                meta: EncoderMetadata) -> torch.Tensor:
        normed = hidden if self.attn_norm is None else self.attn_norm.forward(hidden)
        hidden = hidden + self.attn.forward(rope, normed, meta)
        return hidden + self.mlp.forward(self.mlp_norm.forward(hidden))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.norm = _norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm.forward(self.tok_embeddings.forward(input_ids))


class ModernBertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)
        # Global RoPE for the full-attention layers, local RoPE for the windowed ones.
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_context_len, config.rope_theta)
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, config.max_context_len, config.local_rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        hidden = self.embeddings.forward(input_ids)
        global_rope = self.rotary_emb.cos_sin(positions)
        local_rope = self.local_rotary_emb.cos_sin(positions)
        for layer in self.layers:
            hidden = layer.forward(global_rope if layer.attn.window is None else local_rope, hidden, meta)
        return self.final_norm.forward(hidden)


class ModernBertPredictionHead(nn.Module):
    """The classifier's head over the pooled state (the decoder's over each row before its vocabulary
    projection): dense, activation, norm; in fp32 (a classifier's, as vLLM runs them) or the model's dtype."""

    def __init__(self, config: ModelConfig, fp32: bool = True) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size,
                               bias=bool(config.raw.get("classifier_bias", False)))
        self.approximate = ENCODER_ACTIVATIONS[config.raw.get("classifier_activation") or "gelu"]
        self.norm = _norm(config)
        self.requires_grad_(False)
        if fp32:
            self.float()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.norm.forward(F.gelu(self.dense.forward(pooled), approximate=self.approximate))


class ModernBertModel(nn.Module):
    """A ModernBERT encoder served for embeddings, or (with labels) as ModernBertForSequenceClassification."""

    # The checkpoint's fused projections, split into shards as read (checkpoint_tensors): (ours, shard).
    packed_modules_mapping = {"Wq": ("Wqkv", "q"), "Wk": ("Wqkv", "k"), "Wv": ("Wqkv", "v"),
                              "Wi_input": ("Wi", 0), "Wi_gate": ("Wi", 1)}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head = None
        self.model = ModernBertEncoder(config)
        self.head = ModernBertPredictionHead(config) if config.labels else None
        self.classifier = None
        if config.labels:
            self.classifier = nn.Linear(config.hidden_size, len(config.labels), dtype=torch.float32)
            self.classifier.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        return self.model.forward(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError("an encoder model is served for embeddings or classes only: it has no LM head")

    def classify(self, pooled: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """Class logits of pooled final hidden states [n, hidden] -> [n, classes] (``per_token``:
        of each token's)."""
        if self.classifier is None or self.head is None:
            raise RuntimeError("this model has no classification head")
        pooled = pooled.to(self.classifier.weight.dtype)
        # (vLLM's token_classify on a sequence classifier: the classifier alone on each token, as
        # for BERT; a token classifier's own head stays, as transformers runs it.)
        if per_token and not self.config.token_classifier:
            return self.classifier.forward(pooled)
        return self.classifier.forward(self.head.forward(pooled))

    def attention_layers(self) -> list[nn.Module]:
        """Layers reading the paged KV cache: none (an encoder attends within the pass)."""
        return []

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """The fused Wqkv and Wi split into the shards the loader places per rank; a masked-LM head
        (ModernBertForMaskedLM's head and decoder) and, on an embedding model, a classifier's are skipped."""
        hidden, size = self.config.hidden_size, self.config.intermediate_size
        for name, tensor in weights:
            if name.startswith(("decoder.", "model.decoder.")) or (
                    self.head is None and name.startswith(("head.", "classifier."))):
                continue
            if ".attn.Wqkv." in name:
                for part, start in (("Wq", 0), ("Wk", hidden), ("Wv", 2 * hidden)):
                    yield name.replace(".Wqkv.", f".{part}."), tensor.narrow(0, start, hidden)
            elif ".mlp.Wi." in name:
                yield name.replace(".Wi.", ".Wi_input."), tensor.narrow(0, 0, size)
                yield name.replace(".Wi.", ".Wi_gate."), tensor.narrow(0, size, size)
            else:
                yield name, tensor
