"""Zyphra's Zamba2 (Zamba2-1.2B / 2.7B / 7B and their instruct models): a stack of Mamba-2 layers,
some of which ("hybrid", ModelConfig.shared_attention_layers) first run a transformer block shared
across the model: num_mem_blocks blocks taken in turn by the hybrid layers, each use with its own
low-rank adapters and KV cache.

A hybrid layer's shared block takes the layer's input concatenated with the token embeddings
(2 x hidden wide), norms it, attends (multi-head, scores scaled by (head_dim / 2) ** -0.5, RoPE
only under use_mem_rope), norms again and runs a GeGLU MLP, with no residual adds of its own; q, k,
v (under use_shared_attention_adapter) and the MLP's gate/up projection each gain B(A x), the
use's adapter. The block's output, through the layer's own ``linear``, is added to the layer's
input before the Mamba-2 mixer's norm; the mixer's residual is the layer's input alone.

Checkpoint names as transformers' (``model.layers.N.mamba`` / ``model.layers.N.mamba_decoder``,
``model.layers.N.shared_transformer``, ``model.final_layernorm``). A block's weights may be stored
under every hybrid layer that uses it, or only under the first (transformers ties the others):
either way they load once into ``model.blocks`` (ours), and each use's adapters
(``..._adapter_list.{use}``) into its own hybrid layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from gpu_worker.attn_metadata import AttentionMetadata
from gpu_worker.config import ModelConfig
from gpu_worker.layers.activation import gated_activation
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.embedding import VocabParallelEmbedding
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gpu_worker.layers.mamba import MambaMixer2
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.weight_utils import WeightLike, gate_and_up, materialize
from gpu_worker.models.llama import PipelineStage
from gpu_worker.models.single_stage import SingleStageCausalLM

# The gated norm of Zamba2's mixers (transformers fixes it; vLLM reads rms_norm_eps, 1e-5 as released).
MIXER_NORM_EPS = 1e-5


class Zamba2Adapter(nn.Module):
    """One use's low-rank addition to a shared projection, B(A x): A whole on every rank, B split by
    output rows as the projection it adds to: ``b`` as q's, k's or v's heads, or (``gate_up``) as
    the MLP's gate and up halves (``b_gate_up``, loaded from the checkpoint's B in two shards)."""

    def __init__(self, input_size: int, rank: int, output_size: int, gate_up: bool = False) -> None:
        super().__init__()
        self.a = ColumnParallelLinear(input_size, rank, tp_rank=0, tp_size=1)
        self.b = None if gate_up else ColumnParallelLinear(rank, output_size)
        self.b_gate_up = MergedColumnParallelLinear(rank, [output_size] * 2) if gate_up else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b if self.b is not None else self.b_gate_up).forward(self.a.forward(x))


class Zamba2SharedAttention(nn.Module):
    """A shared block's projections: q, k, v from 2 x hidden (fused, split by heads) and o_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(2 * config.hidden_size, config.head_dim, heads, heads)
        self.o_proj = RowParallelLinear(heads * config.head_dim, config.hidden_size)


class Zamba2SharedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [width] * 2, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=config.mlp_bias)


class Zamba2SharedBlock(nn.Module):
    """The weights one shared transformer block holds (its uses hold their adapters and caches)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(2 * config.hidden_size, config.rms_norm_eps)
        self.self_attn = Zamba2SharedAttention(config)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = Zamba2SharedMLP(config)


class Zamba2MambaLayer(nn.Module):
    """A Mamba-2 layer: its input (plus, in a hybrid layer, the shared block's output) normed and
    mixed, the mixer's output added to the input."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = MambaMixer2(config.hidden_size, config.mamba, MIXER_NORM_EPS)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, injected: torch.Tensor | None = None
                ) -> torch.Tensor:
        normed = self.input_layernorm.forward(hidden if injected is None else hidden + injected)
        return hidden + self.mamba.forward((), normed, meta)


class Zamba2HybridLayer(nn.Module):
    """A hybrid layer: one use of a shared block (``block``, held by the model, not registered here),
    with this use's adapters, KV cache (``attn``) and output ``linear``, before its Mamba-2 layer."""

    def __init__(self, config: ModelConfig, block: Zamba2SharedBlock) -> None:
        super().__init__()
        self._block = (block,)  # (a tuple: the model registers the block, once)
        qkv = block.self_attn.qkv_proj
        self.num_heads, self.head_dim = qkv.num_heads, config.head_dim
        self.attn = PagedAttention(qkv.num_heads, qkv.num_kv_heads, config.head_dim, config.attention_scale)
        rank, width, hidden = int(config.raw.get("adapter_rank", 128)), 2 * config.hidden_size, config.hidden_size
        heads_width = config.num_attention_heads * config.head_dim
        with_attention_adapters = bool(config.raw.get("use_shared_attention_adapter", False))
        self.q_adapter = Zamba2Adapter(width, rank, heads_width) if with_attention_adapters else None
        self.k_adapter = Zamba2Adapter(width, rank, heads_width) if with_attention_adapters else None
        self.v_adapter = Zamba2Adapter(width, rank, heads_width) if with_attention_adapters else None
        self.gate_up_adapter = Zamba2Adapter(hidden, rank, config.intermediate_size, gate_up=True)
        self.act = gated_activation(config.hidden_act)
        self.rotates = bool(config.rope_layers) and config.rope_layers[0]
        self.linear = ColumnParallelLinear(hidden, hidden, tp_rank=0, tp_size=1)
        self.mamba_decoder = Zamba2MambaLayer(config)

    def forward(self, rope: tuple[torch.Tensor, ...], hidden: torch.Tensor, embeddings: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        block = self._block[0]
        num_tokens = hidden.shape[0]
        x = block.input_layernorm.forward(torch.cat((hidden, embeddings), dim=-1))
        qkv = block.self_attn.qkv_proj.forward(x)
        if self.q_adapter is not None:
            qkv = qkv + torch.cat((self.q_adapter.forward(x), self.k_adapter.forward(x), self.v_adapter.forward(x)),
                                  dim=-1)
        size = self.num_heads * self.head_dim
        qk = qkv[:, : 2 * size].view(num_tokens, 2 * self.num_heads, self.head_dim)
        if self.rotates:
            RotaryEmbedding.rotate_(qk, rope[0], rope[1])
        v = qkv[:, 2 * size:].view(num_tokens, self.num_heads, self.head_dim)
        attended = block.self_attn.o_proj.forward(self.attn.forward(qk[:, : self.num_heads],
                                                                    qk[:, self.num_heads:], v, meta))
        h = block.pre_ff_layernorm.forward(attended)
        mlp = block.feed_forward
        gate_up = mlp.gate_up_proj.forward(h) + self.gate_up_adapter.forward(h)
        out = self.linear.forward(mlp.down_proj.forward(self.act.forward(gate_up)))
        return self.mamba_decoder.forward(hidden, meta, out)


class Zamba2Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.stage = PipelineStage(config)  # (one stage: a model with Mamba-2 layers is not split)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # (A block no hybrid layer would take is not built: transformers builds none, checkpoints hold none.)
        num_blocks = min(int(config.raw.get("num_mem_blocks", 1)), len(config.shared_attention_layers))
        self.blocks = nn.ModuleList(Zamba2SharedBlock(config) for _ in range(num_blocks))
        # The hybrid layers take the blocks in turn: the use-th hybrid layer runs block use % num_blocks.
        uses = {layer: use for use, layer in enumerate(config.shared_attention_layers)}
        self.layers = nn.ModuleList(Zamba2HybridLayer(config, self.blocks[uses[i] % num_blocks]) if i in uses
                                    else Zamba2MambaLayer(config) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = (RotaryEmbedding(config.head_dim, config.max_context_len, config.rope_theta,
                                           config.rope_scaling) if any(config.rope_layers) else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        embeddings = self.embed_tokens.forward(input_ids) if inputs_embeds is None else inputs_embeds
        rope = () if self.rotary_emb is None else self.rotary_emb.cos_sin(positions)
        hidden = embeddings
        for layer in self.layers:
            if isinstance(layer, Zamba2HybridLayer):
                hidden = layer.forward(rope, hidden, embeddings, meta)
            else:
                hidden = layer.forward(hidden, meta)
        return self.final_layernorm.forward(hidden)


class Zamba2ForCausalLM(SingleStageCausalLM):
    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                              "b_gate": ("b_gate_up", 0), "b_up": ("b_gate_up", 1)}
    # The checkpoint's shared-block tensors (under a hybrid layer; "model." left out by a bare decoder's
    # save) and its per-use adapters.
    _SHARED = re.compile(r"(?:model\.)?layers\.(\d+)\.shared_transformer\.(.+)")
    _ADAPTER = re.compile(r"(self_attn\.linear_([qkv])_adapter_list|feed_forward\.gate_up_proj_adapter_list)"
                          r"\.(\d+)\.([01])\.weight")

    model_class = Zamba2Model

    def checkpoint_tensors(self, weights: Iterable[tuple[str, WeightLike]]) -> Iterator[tuple[str, WeightLike]]:
        """The checkpoint's shared-block tensors into ``model.blocks``, its adapters into their hybrid
        layers, gate/up stacks into their two halves. A tensor stored again under another layer's copy
        of its block (a block's weights, or a use's adapter) must equal the first copy: a checkpoint
        whose copies differ (transformers saves Zamba2 so when its embeddings are untied, and then
        runs each hybrid layer with a block of its own) is refused, not served with one of them."""
        hybrid = self.config.shared_attention_layers
        use_of = {layer: use for use, layer in enumerate(hybrid)}
        num_blocks = len(self.model.blocks)
        first_copy: dict[str, tuple[int, WeightLike]] = {}
        for name, tensor in weights:
            shared = self._SHARED.fullmatch(name)
            if shared is None:
                yield name, tensor
                continue
            layer, rest = int(shared.group(1)), shared.group(2)
            if layer not in use_of:
                raise ValueError(f"checkpoint tensor {name!r}: layer {layer} is not a hybrid layer of this Zamba2 "
                                 f"config (layers_block_type)")
            adapter = self._ADAPTER.fullmatch(rest)
            if adapter is not None:  # (the adapter of use N, whichever layer's copy of the block holds it)
                use = int(adapter.group(3))
                if use >= len(hybrid) or use % num_blocks != use_of[layer] % num_blocks:
                    raise ValueError(f"checkpoint tensor {name!r}: no use {use} of layer {layer}'s shared block "
                                     f"among the config's {len(hybrid)} hybrid layers")
                part = f"{adapter.group(2)}_adapter" if adapter.group(2) else "gate_up_adapter"
                target = f"model.layers.{hybrid[use]}.{part}"
            else:
                target = f"model.blocks.{use_of[layer] % num_blocks}.{rest}"
            key = target if adapter is None else f"{target}.{adapter.group(4)}"
            first = first_copy.setdefault(key, (layer, tensor))
            if first[1] is not tensor:
                if not torch.equal(materialize(first[1]), materialize(tensor)):
                    raise ValueError(f"this Zamba2 checkpoint stores different weights for a shared block under "
                                     f"layers {first[0]} and {layer} ({rest}): its hybrid layers do not share "
                                     f"their blocks (transformers saves them so when tie_word_embeddings is false); "
                                     f"not served")
                continue  # (loaded from the first copy)
            if adapter is not None and adapter.group(4) == "0":
                yield f"{target}.a.weight", tensor
            elif adapter is not None and adapter.group(2):
                yield f"{target}.b.weight", tensor
            elif adapter is not None:  # (gate rows, then up rows: each rank takes its share of both)
                yield from gate_and_up(f"{target}.b.weight", tensor, ".b.", ".b_gate.", ".b_up.")
            elif rest.startswith("feed_forward.gate_up_proj."):
                yield from gate_and_up(target, tensor)
            else:
                yield target, tensor

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.attn for layer in self.model.layers if isinstance(layer, Zamba2HybridLayer)]

    def mamba_layers(self) -> list[MambaMixer2]:
        return [layer.mamba_decoder.mamba if isinstance(layer, Zamba2HybridLayer) else layer.mamba
                for layer in self.model.layers]
