"""BERT-family encoders: BERT (all-MiniLM, bge-*-en, e5, gte, ms-marco cross-encoders), RoBERTa
and XLM-RoBERTa (bge-m3, multilingual-e5, bge-reranker).

An encoder differs from our decoders in four ways, all handled here or by the engine:
* every token attends to every token of its prompt (no causal mask), so a prompt runs whole in one
  pass and its keys are never needed again: attention keeps no KV cache (``EncoderAttention``),
  and the engine turns chunked prefill and prefix caching off for it;
* positions are learned absolute embeddings (RoBERTa's numbered from ``padding_idx + 1``), added
  with a token-type (segment) embedding: type 1 marks the second text of a pair (BERT cross-encoders);
* each layer norms after its residual add (post-norm LayerNorm), with an exact-gelu MLP;
* a sequence classifier reads the [CLS] token: BERT through its pooler (dense + tanh) and a
  linear classifier, RoBERTa through its classification head (dense + tanh + out_proj).

Module names follow transformers', so checkpoints load by name (the ``bert.`` / ``roberta.``
prefix of a classifier's encoder is taken off; masked-LM heads and unused poolers are skipped).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.config import ENCODER_ACTIVATIONS, ModelConfig
from gpu_worker.encoder_metadata import EncoderMetadata
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.encoder_attention import EncoderAttention
from gpu_worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from gpu_worker.layers.weight_utils import WeightLike


def _replicated_linear(in_features: int, out_features: int) -> nn.Linear:
    """A head's linear layer: whole on every TP rank, in fp32 whatever the model's dtype (as vLLM
    runs pooling heads)."""
    layer = nn.Linear(in_features, out_features, dtype=torch.float32)
    layer.requires_grad_(False)
    return layer


def encoder_layer_norm(config: ModelConfig) -> nn.LayerNorm:
    """A BERT-style LayerNorm (with bias) at the config's epsilon, frozen."""
    norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    norm.requires_grad_(False)
    return norm


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_attention_heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads
        self.q_size = self.qkv_proj.q_size
        self.head_dim = config.head_dim
        self.attn = EncoderAttention(self.num_heads, self.num_heads, self.head_dim, config.head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        qkv = self.qkv_proj.forward(hidden).view(hidden.shape[0], 3 * self.num_heads, self.head_dim)
        q, k, v = qkv.split(self.num_heads, dim=1)
        return self.attn.forward(q, k, v, meta)


class BertResidualOutput(nn.Module):
    """A projection back to the hidden size, added to the sublayer's input and normed (post-norm):
    transformers' BertSelfOutput (after attention) and BertOutput (after the MLP)."""

    def __init__(self, config: ModelConfig, input_size: int) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, bias=True)
        self.LayerNorm = encoder_layer_norm(config)

    def forward(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm.forward(self.dense.forward(attended).add_(residual))


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config, config.hidden_size)

    def forward(self, hidden: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        return self.output.forward(self.self.forward(hidden, meta), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.approximate = ENCODER_ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense.forward(hidden), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        hidden = self.attention.forward(hidden, meta)
        return self.output.forward(self.intermediate.forward(hidden), hidden)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings + config.position_offset,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(1, config.type_vocab_size), config.hidden_size)
        self.LayerNorm = encoder_layer_norm(config)
        self.position_offset = config.position_offset
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embeddings.forward(input_ids)
        if token_type_ids is None:  # every token of type 0
            hidden += self.token_type_embeddings.weight[0]
        else:
            hidden += self.token_type_embeddings.forward(token_type_ids)
        hidden += self.position_embeddings.forward(positions + self.position_offset if self.position_offset
                                                   else positions)
        return self.LayerNorm.forward(hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """BERT's pooler: dense + tanh over the [CLS] token's final hidden state (its classifiers read it)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = _replicated_linear(config.hidden_size, config.hidden_size)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense.forward(cls_hidden))


class BertEncoderModel(nn.Module):
    def __init__(self, config: ModelConfig, with_pooler: bool) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embeddings.forward(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer.forward(hidden, meta)
        return hidden


class RobertaClassificationHead(nn.Module):
    """RoBERTa's classifier over the [CLS] (<s>) token: dense + tanh, then out_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = _replicated_linear(config.hidden_size, config.hidden_size)
        self.out_proj = _replicated_linear(config.hidden_size, len(config.labels))

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj.forward(torch.tanh(self.dense.forward(cls_hidden)))


class BertModel(nn.Module):
    """A BERT encoder served for embeddings, or (with labels) as BertForSequenceClassification."""

    # transformers' names for q/k/v, fused here: (our parameter, shard).
    packed_modules_mapping = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}
    # What prefixes the encoder's tensors in a classifier checkpoint (base_model_prefix).
    base_model_prefix = "bert"
    # The encoder: embeddings, layers, and (for a sequence classifier that reads one) the pooler.
    encoder_class: type[nn.Module] = BertEncoderModel
    # Whether its sequence classifier reads the pooler (dense + tanh over [CLS]) before the
    # classifier: BERT's does; RoBERTa's classification head replaces it.
    pooled_classifier = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # No LM head: an encoder embeds or classifies.
        self.lm_head = None
        classifier = bool(config.labels)
        # (A token classifier classifies every final state: no pooler.)
        self.model = self.encoder_class(config, with_pooler=classifier and self.pooled_classifier
                                        and not config.token_classifier)
        self.classifier = self._classifier_head(config) if classifier else None
        # BGE-M3's per-token heads (fp32, whole on every TP rank): a lexical weight per token, and a
        # ColBERT vector per token.
        self.sparse_linear = self.colbert_linear = None
        width = config.hidden_size
        if config.m3_heads:
            self.sparse_linear = nn.Linear(width, 1, dtype=torch.float32).requires_grad_(False)
            self.colbert_linear = nn.Linear(width, width, dtype=torch.float32).requires_grad_(False)
        elif config.colbert_dim:  # (ColBERT's projection: no bias)
            self.colbert_linear = nn.Linear(width, config.colbert_dim, bias=False,
                                            dtype=torch.float32).requires_grad_(False)

    def _classifier_head(self, config: ModelConfig) -> nn.Module:
        return _replicated_linear(config.hidden_size, len(config.labels))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.forward(input_ids, positions, meta, token_type_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise RuntimeError("an encoder model is served for embeddings or classes only: it has no LM head")

    def classify(self, pooled: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        """Class logits of pooled ([CLS]) final hidden states [n, hidden] -> [n, classes] (a token
        classifier's: of each token's final state). ``per_token`` (vLLM's token_classify on a
        sequence classifier): the classifier alone on each token, without BERT's pooler."""
        if self.classifier is None:
            raise RuntimeError("this model has no classification head")
        pooled = pooled.to(self.classifier.weight.dtype)
        pooler = None if per_token else self.model.pooler
        return self.classifier.forward(pooled if pooler is None else pooler.forward(pooled))

    def token_head(self, task: str, rows: torch.Tensor) -> torch.Tensor:
        """The rows of vLLM's ``task`` from final hidden states [n, hidden], by the model's own
        per-token head: token_classify, BGE-M3's sparse_linear(h) [n, 1] (a lexical weight once the
        router's relu applies); token_embed, a ColBERT vector colbert_linear(h) [n, dim] (BGE-M3's
        or ColBERT's; normalised afterwards, as the request asks)."""
        head = self.sparse_linear if task == "token_classify" else self.colbert_linear
        if head is None:
            raise RuntimeError(f"this model has no {task} head")
        return head.forward(rows.float())

    def extra_checkpoint_tensors(self, model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors kept beside the checkpoint: BGE-M3's sparse and ColBERT heads, saved by
        FlagEmbedding as sparse_linear.pt and colbert_linear.pt (state dicts of one Linear each)."""
        if not self.config.m3_heads:
            return
        for head in ("sparse_linear", "colbert_linear"):
            path = Path(model_dir) / f"{head}.pt"
            if not path.exists():
                raise ValueError(f"{model_dir}: BgeM3EmbeddingModel reads its {head} head from {path.name}, which "
                                 "is missing")
            for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
                yield f"{head}.{name}", tensor

    def attention_layers(self) -> list[nn.Module]:
        """Layers reading the paged KV cache: none (an encoder attends within the pass)."""
        return []

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """transformers' checkpoint names as ours: the encoder's prefix taken off (the loader puts it
        under ``model.``), old LayerNorm gamma/beta names renamed, and what is not served skipped:
        buffers, masked-LM heads, and a pooler nothing here reads."""
        prefix = f"{self.base_model_prefix}."
        for name, tensor in weights:
            name = name.removeprefix(prefix)
            if name.endswith(("embeddings.position_ids", "embeddings.token_type_ids")):
                continue
            if name.startswith(("cls.", "lm_head.")) or (name.startswith("pooler.") and self.model.pooler is None):
                continue
            if self.config.colbert_dim and name == "linear.weight":  # (ColBERT's projection)
                name = "colbert_linear.weight"
            if name.endswith(".gamma") or name.endswith(".beta"):
                name = name.rsplit(".", 1)[0] + (".weight" if name.endswith(".gamma") else ".bias")
            yield name, tensor


class RobertaModel(BertModel):
    """RoBERTa and XLM-RoBERTa: BERT's encoder with positions numbered from padding_idx + 1
    (ModelConfig.position_offset), and a classification head of its own."""

    base_model_prefix = "roberta"
    pooled_classifier = False

    def _classifier_head(self, config: ModelConfig) -> nn.Module:
        # (A token classifier's is one linear layer, as BERT's.)
        return super()._classifier_head(config) if config.token_classifier else RobertaClassificationHead(config)

    def classify(self, pooled: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        if self.config.token_classifier:
            return super().classify(pooled)
        if self.classifier is None:
            raise RuntimeError("this model has no classification head")
        return self.classifier.forward(pooled.to(self.classifier.dense.weight.dtype))
