"""Google's Gemma 3n language model (Gemma3nForCausalLM; gemma-3n-E2B / E4B and their -it releases,
shipped as Gemma3nForConditionalGeneration and served on text: their vision and audio towers are not
read), as transformers' Gemma3nTextModel computes it (gpu_worker.gemma3n_config names the parts):

* the hidden state is ``altup_num_inputs`` streams (AltUp): the embeddings, and their projections
  scaled to the embeddings' RMS; each layer predicts every stream from all of them, runs on the
  active one, and corrects the others by its output; the streams are projected back, scaled alike
  and averaged before the final norm;
* a layer: attention (q/k/v normed per head, v without a scale; scores unscaled; sliding-window and
  full layers, each kind with its RoPE base) beside LAuReL's low-rank residual, Gemma's norms around
  the attention and the MLP, then the layer's per-layer input (an embedding row of its own and a
  projection of the token's embedding) gated in and added to the other streams;
* the last ``num_kv_shared_layers`` layers compute no keys or values: each attends over the paged
  cache of the last earlier layer of its kind (its PagedAttention, called with that layer's keys and
  values of the pass), so they hold no cache of their own, as vLLM shares them;
* the first layers' MLP gates keep only what lies above a Gaussian quantile of each token's gate row
  (its mean and deviation over the whole row: summed over tensor-parallel ranks);
* final logits soft-capped (30), the head tied to the embedding.

Norms scale by w (not Gemma's 1 + w), in fp32. Pipeline parallelism is refused (the streams and the
shared caches cross stages), and so are prompt embeddings (the per-layer inputs are read by token id).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker import distributed
from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.gemma3n_config import Gemma3nConfig
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike, copy_into, materialize
from gpu_worker.models.gemma import GemmaForCausalLM
from gpu_worker.models.llama import LlamaMLP, PipelineStage

# The towers of Gemma3nForConditionalGeneration checkpoints, not served; its language model's prefix.
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_LANGUAGE_MODEL_PREFIX = "model.language_model."


class Gemma3nRMSNorm(RMSNorm):
    """Gemma 3n's RMSNorm: statistics and the scale by w in fp32, then the cast (``with_scale``
    False: no weight, v's norm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__(hidden_size, eps)
        if with_scale:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.float32), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            del self.weight
            self.weight = None  # type: ignore[assignment]

    def weight_loader(self, param: nn.Parameter, loaded: WeightLike, shard_id: int | str | None = None) -> None:
        copy_into(param, materialize(loaded).float())

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        assert residual is None  # (no fused residual add here)
        return self._norm(x)


def _scaled_to(x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``x`` rescaled so each row's RMS is ``magnitude``'s (its own clamped below at 1e-5, as transformers)."""
    own = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
    return x * magnitude / own


class Gemma3nAltUp(nn.Module):
    def __init__(self, config: ModelConfig, g: Gemma3nConfig) -> None:
        super().__init__()
        n, hidden = g.altup_num_inputs, config.hidden_size
        self.n, self.active = n, g.altup_active_idx
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.correction_coefs = nn.Linear(n, n, bias=False).requires_grad_(False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False).requires_grad_(False)
        self.modality_router = nn.Linear(hidden, n, bias=False).requires_grad_(False)
        self.router_norm = Gemma3nRMSNorm(hidden, config.rms_norm_eps)
        self.router_input_scale = hidden ** -1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm.forward(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """[n, tokens, hidden] -> each stream predicted from all of them, by the active one's route."""
        coefs = self.prediction_coefs(self.modalities(streams[self.active]))  # [tokens, n * n]
        coefs = coefs.reshape(-1, self.n, self.n).transpose(1, 2)
        predictions = torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1)  # [n, tokens, hidden]
        return (predictions + streams).contiguous().type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        innovation = activated - predictions[self.active]
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # [tokens, n]
        return (innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions).contiguous().type_as(activated)


class Gemma3nLaurel(nn.Module):
    """LAuReL: x + norm(right(left(x))), of rank laurel_rank."""

    def __init__(self, config: ModelConfig, g: Gemma3nConfig) -> None:
        super().__init__()
        self.linear_left = nn.Linear(config.hidden_size, g.laurel_rank, bias=False).requires_grad_(False)
        self.linear_right = nn.Linear(g.laurel_rank, config.hidden_size, bias=False).requires_grad_(False)
        self.post_laurel_norm = Gemma3nRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm.forward(self.linear_right(self.linear_left(x)))


class Gemma3nMLP(LlamaMLP):
    """Llama's gated MLP (tanh-gelu, ``width`` wide), its gate cut where ``sparsity`` is set."""

    def __init__(self, config: ModelConfig, width: int, sparsity: float) -> None:
        super().__init__(config, width)
        self.width = width
        # The gate's cut: mean + std * the standard normal's quantile at the sparsity (None: no cut).
        self.quantile = (None if sparsity == 0.0
                         else float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(sparsity))))

    def _cut(self, gate: torch.Tensor) -> torch.Tensor:
        """relu(gate - (mean + std * quantile)) over each token's whole gate row: as transformers
        computes it (in the gate's dtype) on one rank; from the slices' sums (fp32) across ranks."""
        assert self.quantile is not None
        if distributed.get_tp_world_size() == 1:
            mean = gate.mean(-1, keepdim=True)
            cutoff = mean + gate.std(-1, keepdim=True, unbiased=False) * torch.tensor(self.quantile, dtype=gate.dtype)
            return F.relu(gate - cutoff)
        stats = torch.stack((gate.float().sum(-1), gate.float().pow(2).sum(-1)))
        stats = distributed.all_reduce(stats) / self.width
        mean, var = stats[0], (stats[1] - stats[0] ** 2).clamp(min=0.0)
        cutoff = (mean + var.sqrt() * self.quantile).unsqueeze(-1).to(gate.dtype)
        return F.relu(gate - cutoff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantile is None:
            return super().forward(x)
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.gelu(self._cut(gate), approximate="tanh") * up)


# The keys and values (and attention, with its cache) of the layers computing their own in a pass, by
# layer: what the layers sharing them read.
Shared = dict[int, tuple[torch.Tensor, torch.Tensor, PagedAttention]]


class KVSharingAttention(nn.Module):
    """Gemma 3n's and Gemma 4's attention: q/k/v normed per head (v without a scale), RoPE on q and k;
    a layer whose ``source`` is another computes queries alone and attends over that layer's keys,
    values and cache (its PagedAttention), keeping none of its own. ``head_dim`` and ``num_kv_heads``
    are the layer's own (Gemma 4's full layers' differ)."""

    def __init__(self, config: ModelConfig, layer: int, head_dim: int, num_kv_heads: int,
                 source: int | None) -> None:
        super().__init__()
        hd = self.head_dim = head_dim
        self.source = source
        if self.source is None:
            self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                              num_kv_heads, bias=config.qkv_bias)
            self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.k_norm = Gemma3nRMSNorm(hd, config.rms_norm_eps)
            self.v_norm = Gemma3nRMSNorm(hd, config.rms_norm_eps, with_scale=False)
            self.attn: PagedAttention | None = PagedAttention(self.num_heads, self.num_kv_heads, hd,
                                                              config.attention_scale,
                                                              config.layer_sliding_window(layer))
        else:  # (queries only: the keys and values are the source layer's, through its attention)
            self.q_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * hd,
                                               bias=config.qkv_bias)
            self.num_heads = self.q_proj.output_size_per_partition // hd
            self.attn = None
        self.q_norm = Gemma3nRMSNorm(hd, config.rms_norm_eps)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, bias=config.qkv_bias)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, meta: AttentionMetadata, shared: Shared,
                layer: int) -> torch.Tensor:
        tokens, hd = hidden.shape[0], self.head_dim
        if self.source is None:
            q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
            q, k, v = self.qkv_proj.forward(hidden).split([q_size, kv_size, kv_size], dim=-1)
            k = RotaryEmbedding.rotate_(self.k_norm.forward(k.reshape(tokens, self.num_kv_heads, hd)), rope[0], rope[1])
            v = self.v_norm.forward(v.reshape(tokens, self.num_kv_heads, hd))
            attn = self.attn
            assert attn is not None
            shared[layer] = (k, v, attn)
        else:
            q = self.q_proj.forward(hidden)
            k, v, attn = shared[self.source]
        q = RotaryEmbedding.rotate_(self.q_norm.forward(q.reshape(tokens, self.num_heads, hd)), rope[0], rope[1])
        # (A sharing layer writes its source's keys and values to the slots they already fill: the same
        # values, so the cache is as the source left it.)
        return self.o_proj.forward(attn.forward(q, k, v, meta))


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, g: Gemma3nConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer = layer
        self.active = g.altup_active_idx
        self.correct_scale = g.altup_correct_scale
        self.local_rope = bool(config.sliding_window_layers) and config.sliding_window_layers[layer]
        self.self_attn = KVSharingAttention(config, layer, config.head_dim, config.num_key_value_heads,
                                            g.kv_sources[layer])
        self.mlp = Gemma3nMLP(config, g.intermediate_sizes[layer], g.activation_sparsity[layer])
        self.input_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma3nRMSNorm(hidden, eps)
        self.altup = Gemma3nAltUp(config, g)
        self.laurel = Gemma3nLaurel(config, g)
        self.per_layer_input_gate = nn.Linear(hidden, g.hidden_size_per_layer_input, bias=False).requires_grad_(False)
        self.per_layer_projection = nn.Linear(g.hidden_size_per_layer_input, hidden, bias=False).requires_grad_(False)
        self.post_per_layer_input_norm = Gemma3nRMSNorm(hidden, eps)

    def forward(self, rope: tuple[torch.Tensor, ...], streams: torch.Tensor, per_layer_input: torch.Tensor,
                meta: AttentionMetadata, shared: Shared) -> torch.Tensor:
        predictions = self.altup.predict(streams)
        active = predictions[self.active]
        normed = self.input_layernorm.forward(active)
        laurel = self.laurel.forward(normed)
        attn = self.post_attention_layernorm.forward(self.self_attn.forward(rope, normed, meta, shared, self.layer))
        attn_laurel = (active + attn + laurel) / math.sqrt(2)
        ffw = self.post_feedforward_layernorm.forward(self.mlp.forward(self.pre_feedforward_layernorm.forward(
            attn_laurel)))
        corrected = self.altup.correct(predictions, attn_laurel + ffw)
        first = corrected[self.active]
        if self.correct_scale:
            first = (first.type_as(self.altup.correct_output_scale) * self.altup.correct_output_scale).type_as(first)
        first = F.gelu(self.per_layer_input_gate(first), approximate="tanh") * per_layer_input
        first = self.post_per_layer_input_norm.forward(self.per_layer_projection(first))
        corrected[1:] += first
        return corrected


class PerLayerInputsModel(nn.Module):
    """The embedding and the per-layer inputs of Gemma 3n's and Gemma 4's decoders (``per_layer``: each
    layer's width of them, 0 for none): the table of num_layers x per_layer values per token id (ids
    past its vocab_size read row 0, as Gemma 3n's do), scaled by sqrt(per_layer); the projection of
    the token's embedding, normed. ``dtype_scalars``: their scalars rounded to the model's dtype first
    (Gemma 3n's, as buffers), else as Python floats (Gemma 4's)."""

    def __init__(self, config: ModelConfig, family: str, per_layer: int, per_layer_vocab: int,
                 dtype_scalars: bool, full_head_dim: int) -> None:
        super().__init__()
        if distributed.get_pp_world_size() > 1:
            raise ValueError(f"{family} is not served under pipeline parallelism (its shared KV caches cross the "
                             "stages)")
        self.stage = PipelineStage(config)
        hidden = config.hidden_size
        self.num_layers, self.per_layer, self.per_layer_vocab = config.num_hidden_layers, per_layer, per_layer_vocab
        self.dtype_scalars = dtype_scalars
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.register_buffer("embed_scale", torch.tensor(hidden ** 0.5), persistent=False)
        self.embed_tokens_per_layer = self.per_layer_model_projection = self.per_layer_projection_norm = None
        if per_layer:
            self.embed_tokens_per_layer = VocabParallelEmbedding(per_layer_vocab, self.num_layers * per_layer)
            self.register_buffer("per_layer_embed_scale", torch.tensor(per_layer ** 0.5), persistent=False)
            self.per_layer_model_projection = nn.Linear(hidden, self.num_layers * per_layer,
                                                        bias=False).requires_grad_(False)
            self.per_layer_projection_norm = Gemma3nRMSNorm(per_layer, config.rms_norm_eps)
        # The full layers' RoPE (rope_theta and its scaling, over their heads) and the windowed layers'
        # (plain, of their own base).
        self.rotary_emb = RotaryEmbedding(full_head_dim, config.max_context_len, config.rope_theta,
                                          config.rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(config.head_dim, config.max_context_len,
                                                config.local_rope_theta or 10000.0)
        self.norm = Gemma3nRMSNorm(hidden, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens.forward(input_ids) * self.embed_scale.to(self.embed_tokens.weight.dtype)

    def _scalar(self, value: float, dtype: torch.dtype) -> torch.Tensor | float:
        return torch.tensor(value, dtype=dtype) if self.dtype_scalars else value

    def per_layer_inputs(self, input_ids: torch.Tensor | None, embeds: torch.Tensor) -> torch.Tensor | None:
        """[tokens, layers, per_layer] (None without them): the normed projection of the embeddings,
        plus their per-layer rows by token id, times 1 / sqrt(2). Rows given as embeddings have no ids
        to read them by: refused (the engine refuses prompt embeddings for these models)."""
        if self.per_layer_model_projection is None or self.per_layer_projection_norm is None:
            return None
        if input_ids is None:
            raise ValueError("this model's per-layer inputs are read by token id: rows given as embeddings are not "
                             "served")
        projection = self.per_layer_model_projection(embeds) * self._scalar(embeds.shape[-1] ** -0.5, embeds.dtype)
        projection = self.per_layer_projection_norm.forward(projection.reshape(-1, self.num_layers, self.per_layer))
        if self.embed_tokens_per_layer is None:
            return projection
        ids = torch.where(input_ids < self.per_layer_vocab, input_ids, torch.zeros_like(input_ids))
        rows = self.embed_tokens_per_layer.forward(ids) * self.per_layer_embed_scale.to(embeds.dtype)
        return (projection + rows.reshape(-1, self.num_layers, self.per_layer)) * self._scalar(2.0 ** -0.5,
                                                                                                embeds.dtype)


class Gemma3nModel(PerLayerInputsModel):
    def __init__(self, config: ModelConfig) -> None:
        g = config.gemma3n
        assert g is not None
        super().__init__(config, "Gemma3nForCausalLM", g.hidden_size_per_layer_input, g.vocab_size_per_layer_input,
                         dtype_scalars=True, full_head_dim=config.head_dim)
        self.g = g
        hidden = config.hidden_size
        self.altup_projections = nn.ModuleList(nn.Linear(hidden, hidden, bias=False).requires_grad_(False)
                                               for _ in range(1, g.altup_num_inputs))
        self.altup_unembed_projections = nn.ModuleList(nn.Linear(hidden, hidden, bias=False).requires_grad_(False)
                                                       for _ in range(1, g.altup_num_inputs))
        self.layers = nn.ModuleList(Gemma3nDecoderLayer(config, i, g) for i in range(self.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        assert intermediate is None  # (one pipeline stage)
        embeds = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer_inputs = self.per_layer_inputs(None if inputs_embeds is not None else input_ids, embeds)
        assert per_layer_inputs is not None
        magnitude = torch.mean(embeds ** 2, dim=-1, keepdim=True) ** 0.5
        streams = torch.stack([embeds, *(_scaled_to(proj(embeds), magnitude) for proj in self.altup_projections)])
        rope = self.rotary_emb.cos_sin(positions)
        local = self.local_rotary_emb.cos_sin(positions)
        shared: Shared = {}
        for i, layer in enumerate(self.layers):
            streams = layer.forward(local if layer.local_rope else rope, streams, per_layer_inputs[:, i], meta,
                                    shared)
        magnitude = torch.mean(streams[0] ** 2, dim=-1, keepdim=True) ** 0.5
        unembedded = [streams[0], *(_scaled_to(proj(streams[i + 1]), magnitude)
                                    for i, proj in enumerate(self.altup_unembed_projections))]
        return self.norm.forward(torch.stack(unembedded).mean(dim=0))


def language_model_tensors(weights: Iterable[tuple[str, WeightLike]],
                           kv_sources: tuple[int | None, ...]) -> Iterator[tuple[str, WeightLike]]:
    """A Gemma 3n or Gemma 4 checkpoint's language model as ours: read under the vision-language
    checkpoint's prefix, the towers skipped, and the sharing layers' own key and value projections
    and norms (never computed, as in transformers) not read (their q_proj is a projection of that
    name, not a shard of a fused one)."""
    sharing = {f"model.layers.{i}.self_attn." for i, source in enumerate(kv_sources) if source is not None}
    for name, tensor in weights:
        if name.startswith(_TOWER_PREFIXES):
            continue
        if name.startswith(_LANGUAGE_MODEL_PREFIX):
            name = "model." + name[len(_LANGUAGE_MODEL_PREFIX):]
        prefix = name[: name.find(".self_attn.") + len(".self_attn.")] if ".self_attn." in name else ""
        if prefix in sharing and name[len(prefix):].split(".", 1)[0] in ("k_proj", "v_proj", "k_norm", "v_norm"):
            continue
        yield name, tensor


class Gemma3nForCausalLM(GemmaForCausalLM):
    """Gemma 3n's language model (see the module's docstring); a Gemma3nForConditionalGeneration
    checkpoint's language model is read under its prefix, its towers skipped."""

    model_class = Gemma3nModel  # type: ignore[assignment]
    # (LoRA adapters of the vision-language checkpoint: its language model's modules under their prefix,
    # the towers' left out.)
    _LANGUAGE_MODEL_PREFIXES = ((_LANGUAGE_MODEL_PREFIX, "model."),)
    _VISION_PREFIXES = _TOWER_PREFIXES
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        assert self.config.gemma3n is not None
        return language_model_tensors(weights, self.config.gemma3n.kv_sources)

    def attention_layers(self) -> list[PagedAttention]:
        """The layers holding a cache: those computing their own keys and values."""
        return [layer.self_attn.attn for layer in self.model.layers if layer.self_attn.attn is not None]
