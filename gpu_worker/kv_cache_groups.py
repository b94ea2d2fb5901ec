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
read the window's keys there too). A windowed group's blocks leave their drafter pages unused.

KV offloading's host tier keeps a block of any group in one of its slots (a page of each shared tensor;
the scheduler keys a windowed group's blocks by (group, hash)), so the workers copy between the shared
tensors and the tier's own, the same for every group; a prefill/decode transfer reads and writes the
shared tensors' pages of each block alike.

Where the groups would hold a max-length request in more memory than one group (groups_cost_more: every
request within the window and a short last group, a drafter's pages beside every block, pipeline stages
holding the two kinds of layers apart), the engine keeps one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.config import EngineConfig
from engine_core.core.kv_cache_utils import AttentionWindow, blocks_held_bound
from gpu_worker import distributed
from gpu_worker.attn_metadata import ChunkedWindow, Window
from gpu_worker.config import ModelConfig
from gpu_worker.kv_cache import model_bytes_per_block


@dataclass(frozen=True)
class KVCacheGrouping:
    # Each group's window (None: full attention; group 0 is full).
    windows: tuple[Window | None, ...]
    # Each group's layers, as indexes into the model's attention layers, in order (a pipeline stage's
    # own grouping: into its stage's layers, a group without any there empty).
    layers: tuple[tuple[int, ...], ...]
    # The shared tensors (a group's layer j keeps its cache in tensor j), on each pipeline stage.
    group_size: int

    @property
    def engine_windows(self) -> tuple[AttentionWindow | None, ...]:
        """The groups' windows as the engine's KV cache manager takes them (CacheConfig.kv_cache_groups)."""
        return tuple(None if w is None else AttentionWindow(w.size, chunked=True) if isinstance(w, ChunkedWindow)
                     else AttentionWindow(w) for w in self.windows)

    def for_stage(self, start: int, end: int) -> KVCacheGrouping:
        """The grouping as the pipeline stage holding attention layers [start, end) keeps it: every group
        (the engine's blocks are the same on every stage), each with its layers there, counted from start."""
        return KVCacheGrouping(self.windows, tuple(tuple(i - start for i in group if start <= i < end)
                                                   for group in self.layers), self.group_size)

    def layer_windows(self) -> list[Window | None] | None:
        """Each layer's window, layer by layer (None where the groups do not hold each of their layers once)."""
        held = sorted(i for group in self.layers for i in group)
        if held != list(range(len(held))):
            return None
        windows: list[Window | None] = [None] * len(held)
        for window, group in zip(self.windows, self.layers, strict=True):
            for i in group:
                windows[i] = window
        return windows


def group_attention_layers(layer_windows: Sequence[Window | None],
                           stages: Sequence[tuple[int, int]] = ()) -> KVCacheGrouping | None:
    """The groups of attention layers whose windows are ``layer_windows`` (None: full attention), or None
    when one group would do: every layer of one kind, or none attending fully (a model windowed in every
    layer releases its blocks with one group), or more than one window besides full attention.

    ``stages``: the pipeline stages' layer ranges [start, end), where there are several. A block id is a
    page of each of every stage's shared tensors, so each group takes its share of ``group_size`` from
    each stage alike (its layers there in order), and a stage keeps that share's tensors: a group's
    layers all on one stage would leave the other stages' pages of its blocks unused."""
    kinds = set(layer_windows)
    if len(kinds) != 2 or None not in kinds:
        return None
    full = [i for i, w in enumerate(layer_windows) if w is None]
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    smaller, larger = sorted((len(full), len(windowed)))
    group_size = larger if larger < smaller * 1.25 else smaller
    window = layer_windows[windowed[0]]
    ranges = list(stages) if len(stages) > 1 else [(0, len(layer_windows))]
    share = -(-group_size // len(ranges))  # (each stage's tensors)
    windows: list[Window | None] = []
    layers: list[tuple[int, ...]] = []
    for kind, indexes in ((None, full), (window, windowed)):
        per_stage = [[i for i in indexes if start <= i < end] for start, end in ranges]
        for k in range(max(-(-len(held) // share) for held in per_stage)):
            windows.append(kind)
            layers.append(tuple(i for held in per_stage for i in held[k * share:(k + 1) * share]))
    return KVCacheGrouping(tuple(windows), tuple(layers), share)


def pipeline_stages(num_layers: int, pp_size: int, partition: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """Each pipeline stage's layer range (none for one stage)."""
    if pp_size <= 1:
        return []
    return [distributed.pp_layer_range(num_layers, rank, pp_size, partition) for rank in range(pp_size)]


def hybrid_kv_cache_grouping(model_config: ModelConfig, config: EngineConfig) -> tuple[KVCacheGrouping | None, str]:
    """The grouping an engine of ``config`` serves ``model_config`` with (None: every layer keeps every
    block, as before), and, where the model mixes windows but keeps one group, why."""
    if any(model_config.mamba_layers) or model_config.encoder_only:
        return None, ""
    windows = [model_config.layer_sliding_window(i) for i in range(model_config.num_hidden_layers)]
    if group_attention_layers(windows) is None:
        return None, ""
    # (Stages the model cannot have are refused with the engine's other pipeline checks.)
    try:
        stages = pipeline_stages(len(windows), config.pipeline_parallel_size, config.pp_layer_partition)
    except ValueError:
        return None, ""
    grouping = group_attention_layers(windows, stages)
    reason = ("--disable-hybrid-kv-cache-manager" if config.disable_hybrid_kv_cache_manager
              else "KV-shared layers (Gemma 3n's, Gemma 4's)"
              if model_config.gemma3n is not None or model_config.gemma4 is not None
              else "layers whose KV caches differ in shape" if len(set(model_config.attention_layer_geometry)) > 1
              else "")
    return (None, reason) if reason else (grouping, "")


def groups_cost_more(grouping: KVCacheGrouping, model_config: ModelConfig, max_model_len: int, block_size: int,
                     decode_pass_tokens: int, tp_size: int, stage_layers: int | None = None,
                     drafter: tuple[ModelConfig, int | None] | None = None) -> str:
    """Why ``grouping`` should give way to one group, or "" where it should not: a request of
    ``max_model_len`` tokens, decoding (``decode_pass_tokens`` slots a pass: its token, the drafts it
    verifies and the lookahead slots of the next), holds more memory on a worker over the groups (a
    block in each, each block a page of the worker's shared tensors) than one group's blocks (each a
    page of every layer the worker holds: under pipeline parallelism ``stage_layers``, the largest
    stage's, which sets how many blocks the engine gets) would hold. A ``drafter`` (its config, and its
    layers where not all it has) keeping a KV cache of its own on every block id adds its pages to both.
    Where every request fits in the window (no windowed block is ever released) and a last group is
    short or a drafter's pages sit beside every block, or where pipeline stages hold the two kinds of
    layers apart, the groups can cost more. (Judged at max_model_len, the groups' best case: a shorter
    request holds a block in every group for each of its positions.)"""
    dtype = torch.bfloat16  # (a ratio of caches of one KV dtype)
    grouped = model_bytes_per_block(model_config, block_size, tp_size, dtype, grouping.group_size)
    single = model_bytes_per_block(model_config, block_size, tp_size, dtype, stage_layers)
    beside = 0 if drafter is None else model_bytes_per_block(drafter[0], block_size, tp_size, dtype, drafter[1])
    num_blocks = -(-max_model_len // block_size)
    held = blocks_held_bound(max_model_len, grouping.engine_windows, decode_pass_tokens, block_size)
    ratio = (grouped + beside) * held / ((single + beside) * num_blocks)
    if ratio <= 1:
        return ""
    return (f"over its {len(grouping.windows)} KV cache groups a {max_model_len}-token request would hold "
            f"{ratio:.2f}x the memory it holds in one group"
            + (" (a drafter's KV cache sits beside every block of every group)" if drafter is not None else ""))
