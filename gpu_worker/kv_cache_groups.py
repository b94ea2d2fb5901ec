"""The hybrid KV cache manager's layout: a model's attention layers in KV cache groups (vLLM's).

A model mixing full-attention layers and windowed ones (Gemma 2/3, GPT-OSS, Cohere2; Llama 4's chunked
layers) need not keep a windowed layer's keys behind the window. Its layers are put in groups of
``group_size`` layers of one kind each (full attention first); group g's layer j keeps its cache in the
j-th of ``group_size`` shared (K, V) tensors of ``num_blocks`` pages, so one block id is a page of each
shared tensor, and each group holds its own blocks of a request out of one pool. A windowed group's
blocks behind the window go back to the pool as the request advances (engine_core/core/
kv_cache_manager.py), so a long request holds the full groups' blocks for every token and a window's
worth of each windowed group's. ``group_size`` is the smaller kind's layer count, or the larger's when
they are within a quarter of each other (vLLM's rule; a last group of fewer layers leaves pages of the
others' tensors unused in its blocks).

A drafter with a KV cache of its own (a draft model, an EAGLE head, an MTP layer) keeps it in tensors
of its own, on group 0's block ids: its layers read every key they attend to from the full-attention
group's blocks, which a request holds from its first token (its windowed layers, a draft Gemma's say,
read the window's keys there too). A windowed group's blocks leave their drafter pages unused, so a
drafter whose pages outweigh what the groups save keeps one group (drafter_outweighs_groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.config import EngineConfig
from engine_core.core.kv_cache_utils import AttentionWindow, blocks_held_bound
from gpu_worker.attn_metadata import ChunkedWindow, Window
from gpu_worker.config import ModelConfig
from gpu_worker.kv_cache import model_bytes_per_block


@dataclass(frozen=True)
class KVCacheGrouping:
    # Each group's window (None: full attention; group 0 is full).
    windows: tuple[Window | None, ...]
    # Each group's layers, as indexes into the model's attention layers, in order.
    layers: tuple[tuple[int, ...], ...]
    # The shared tensors (a group's layer j keeps its cache in tensor j).
    group_size: int

    @property
    def engine_windows(self) -> tuple[AttentionWindow | None, ...]:
        """The groups' windows as the engine's KV cache manager takes them (CacheConfig.kv_cache_groups)."""
        return tuple(None if w is None else AttentionWindow(w.size, chunked=True) if isinstance(w, ChunkedWindow)
                     else AttentionWindow(w) for w in self.windows)


def group_attention_layers(layer_windows: Sequence[Window | None]) -> KVCacheGrouping | None:
    """The groups of attention layers whose windows are ``layer_windows`` (None: full attention), or None
    when one group would do: every layer of one kind, or none attending fully (a model windowed in every
    layer releases its blocks with one group), or more than one window besides full attention."""
    kinds = set(layer_windows)
    if len(kinds) != 2 or None not in kinds:
        return None
    full = [i for i, w in enumerate(layer_windows) if w is None]
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    smaller, larger = sorted((len(full), len(windowed)))
    group_size = larger if larger < smaller * 1.25 else smaller
    window = layer_windows[windowed[0]]
    windows: list[Window | None] = []
    layers: list[tuple[int, ...]] = []
    for kind, indexes in ((None, full), (window, windowed)):
        for start in range(0, len(indexes), group_size):
            windows.append(kind)
            layers.append(tuple(indexes[start:start + group_size]))
    return KVCacheGrouping(tuple(windows), tuple(layers), group_size)


def hybrid_kv_cache_grouping(model_config: ModelConfig, config: EngineConfig) -> tuple[KVCacheGrouping | None, str]:
    """The grouping an engine of ``config`` serves ``model_config`` with (None: every layer keeps every
    block, as before), and, where the model mixes windows but keeps one group, why."""
    if any(model_config.mamba_layers) or model_config.encoder_only:
        return None, ""
    grouping = group_attention_layers([model_config.layer_sliding_window(i)
                                       for i in range(model_config.num_hidden_layers)])
    if grouping is None:
        return None, ""
    reason = ("--disable-hybrid-kv-cache-manager" if config.disable_hybrid_kv_cache_manager
              else "KV offloading (its tier copies every layer's blocks alike)" if config.kv_offloading_size
              else "--kv-transfer-config (disaggregation moves every layer's blocks alike)"
              if config.kv_transfer_config is not None
              else "pipeline parallelism" if config.pipeline_parallel_size > 1
              else "KV-shared layers (Gemma 3n's, Gemma 4's)"
              if model_config.gemma3n is not None or model_config.gemma4 is not None
              else "layers whose KV caches differ in shape" if len(set(model_config.attention_layer_geometry)) > 1
              else "")
    return (None, reason) if reason else (grouping, "")


def drafter_outweighs_groups(grouping: KVCacheGrouping, model_config: ModelConfig, drafter: ModelConfig,
                             drafter_layers: int | None, max_model_len: int, block_size: int, num_lookahead_tokens: int,
                             tp_size: int) -> str:
    """Why ``grouping`` should give way to one group beside a drafter keeping ``drafter``'s KV cache (of
    ``drafter_layers`` layers; None: all that attend) on every block id, or "" where it should not: a
    request of ``max_model_len`` tokens, decoding, holds more memory over the groups (a block in each,
    each block the groups' pages and the drafter's) than one group's blocks would hold (each every
    layer's page and the drafter's). A one-layer EAGLE head or a small draft model keeps the groups; a
    draft model the size of the target beside a model of many short groups does not."""
    dtype = torch.bfloat16  # (a ratio of two caches of one KV dtype)
    grouped = model_bytes_per_block(model_config, block_size, tp_size, dtype, grouping.group_size)
    single = model_bytes_per_block(model_config, block_size, tp_size, dtype)
    beside = model_bytes_per_block(drafter, block_size, tp_size, dtype, drafter_layers)
    num_blocks = -(-max_model_len // block_size)
    held = blocks_held_bound(max_model_len, grouping.engine_windows, 1 + num_lookahead_tokens, block_size)
    ratio = (grouped + beside) * held / ((single + beside) * num_blocks)
    if ratio <= 1:
        return ""
    return (f"a drafter with a KV cache of its own, whose pages sit beside every block of every group: a "
            f"{max_model_len}-token request would hold {ratio:.2f}x the memory it holds in one group")
