"""Per-step attention metadata: built once on the host per step, shared by every layer.

The flat batch holds decode tokens first (one per decode request), then each prefill chunk's
tokens. Decodes are attended as one padded batch; each prefill chunk gets its own call (its
query length differs), so there is one Python iteration per prefill request, never per token.

Sliding-window attention (Mistral v0.1, Phi-3, Qwen2's upper layers): the query at position p sees
the keys in (p - window, p], as transformers' sliding-window mask and vLLM's kernels define it. Its
layers get their own metadata (``AttentionMetadata.for_window``), which reads only the blocks that
hold a window's keys, so attention costs O(window) per token however long the sequence grows.

Chunked (local) attention (Llama 4's rotating layers, ``ChunkedWindow``): the query at position p sees
the keys of its chunk, [p - p mod size, p]; its layers get their own metadata as a window's do.

Gemma 3's images: the tokens of one image also see each other's later tokens (``bidirectional``
position ranges per request), within the window where there is one, as transformers' mask for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class ChunkedWindow:
    """Chunked attention's "window": the query at position p sees the keys from p - p mod ``size`` to p."""

    size: int


Window = int | ChunkedWindow


def first_key(window: Window, positions: np.ndarray) -> np.ndarray:
    """The first key a query at each of ``positions`` sees under ``window``: a sliding window's
    p - window + 1 (from 0), or the start of its chunk."""
    if isinstance(window, ChunkedWindow):
        return positions // window.size * window.size
    return np.maximum(positions - window + 1, 0)


@dataclass
class PrefillSpan:
    token_start: int
    token_end: int
    # The request's blocks that hold the keys attended, from block key_offset // block_size on.
    block_ids: torch.Tensor
    # Keys gathered from the start of block_ids[0] (positions key_offset .. key_offset + num_keys - 1).
    num_keys: int
    # [query_len, num_keys] bool (True = attend) when the chunk starts after position 0 or a window
    # cuts it; None means plain causal attention over exactly the chunk.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    # Flat cache slot of every new token (block_id * block_size + offset in block).
    slot_mapping: torch.Tensor
    # The decode rows, the first tokens of the pass (one per decoding request; a request verifying
    # drafts may have several, each attending as a decode of its own position).
    num_decodes: int
    # [num_decodes, max_blocks] block ids (padded with block 0, masked out) and the keys' extent.
    decode_block_table: torch.Tensor | None
    decode_max_seq_len: int
    # [num_decodes, 1, 1, decode_max_seq_len] bool, None when every decode reads all of its keys.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    # [num_decodes] int64 key counts, set when decodes read the paged cache in place (the CPU
    # kernel); decode_mask is then not built.
    decode_seq_lens: torch.Tensor | None = None
    # In place, under a sliding window: [num_decodes] int64 position of each request's first key.
    decode_key_starts: torch.Tensor | None = None
    # The sliding window (or chunked attention) this metadata attends with (None: full causal attention).
    window: Window | None = None
    # The same step's metadata for the model's sliding-window layers, when its other layers attend fully.
    windowed: AttentionMetadata | None = None
    # The recurrent layers (Mamba-2, Mamba, Gated DeltaNet, short convolutions): where each request's
    # tokens lie and its state row (gpu_worker.layers.mamba.MambaStepMetadata); None without them.
    mamba: Any = None
    # Under the hybrid KV cache manager (gpu_worker/kv_cache_groups.py): each KV cache group's metadata,
    # this one first (group 0's), by group; a layer attends with its own group's (its blocks and slots).
    groups: list[AttentionMetadata | None] | None = None

    def for_window(self, window: Window | None) -> AttentionMetadata:
        """The metadata a layer with this sliding window (None: full attention) attends with."""
        if window == self.window:
            return self
        if self.windowed is not None and self.windowed.window == window:
            return self.windowed
        raise ValueError(f"this step's attention metadata was built for window {self.window}, "
                         f"not for a layer with window {window}")


def compute_slot_mapping(block_table: np.ndarray, req_index: np.ndarray, positions: np.ndarray,
                         block_size: int) -> np.ndarray:
    """Cache slot of each token: its request's block for ``position // block_size``, plus the offset."""
    return block_table[req_index, positions // block_size] * block_size + positions % block_size


def build_attention_metadata(block_table: np.ndarray, num_blocks_per_req: np.ndarray,
                             query_start_loc: np.ndarray, num_computed: np.ndarray, num_decodes: int,
                             slot_mapping: np.ndarray | torch.Tensor, block_size: int,
                             device: torch.device, decode_in_place: bool = False,
                             window: Window | None = None,
                             bidirectional: dict[int, list[tuple[int, int]]] | None = None,
                             like: AttentionMetadata | None = None) -> AttentionMetadata:
    """Arguments are per request (decodes first) except ``query_start_loc`` ([num_reqs + 1]) and
    ``slot_mapping`` (per token). The first ``num_decodes`` requests attend as decodes, each of their
    query tokens a row of its own that sees its request's keys up to its position (one token each,
    or a few: a pass verifying drafts). ``decode_in_place`` selects the kernel that reads the paged cache
    where it lies (per-request lengths instead of a padding mask). ``window``: the sliding window
    or chunked attention (None: full causal attention). ``bidirectional``: by request index, position
    ranges [a, b) whose
    tokens see each other both ways (Gemma 3's images; prefill chunks only). ``like``: this pass's metadata
    for the same window over another block table (the hybrid KV cache manager's groups): its masks and
    key counts, which depend on positions alone, are taken rather than built again."""
    query_lens = np.diff(query_start_loc)
    seq_lens = num_computed + query_lens
    if isinstance(slot_mapping, torch.Tensor):
        slots = slot_mapping
    else:
        slots = torch.from_numpy(slot_mapping).to(device, non_blocking=True)
    # The first key each request's first query token sees (None without a window: key 0).
    key_lo = None if window is None else first_key(window, num_computed)

    decode_table = decode_mask = decode_lens = decode_starts = None
    decode_max = num_rows = 0
    if num_decodes:
        dec_lens = seq_lens[:num_decodes]
        dec_lo = None if key_lo is None else key_lo[:num_decodes]
        dec_table = block_table[:num_decodes]
        num_rows = int(query_start_loc[num_decodes] - query_start_loc[0])
        if (query_lens[:num_decodes] != 1).any():  # (requests of several rows: row j sees keys up to its position)
            row_request = np.repeat(np.arange(num_decodes), query_lens[:num_decodes])
            within = np.arange(num_rows) - (query_start_loc[row_request] - query_start_loc[0])
            dec_lens = num_computed[row_request] + within + 1
            dec_lo = None if window is None else first_key(window, dec_lens - 1)
            dec_table = block_table[row_request]
        if decode_in_place:
            # The kernel skips the blocks before each request's first key itself.
            decode_max = int(dec_lens.max())
            max_blocks = -(-decode_max // block_size)
            decode_table = torch.from_numpy(np.ascontiguousarray(dec_table[:, :max_blocks])).to(device)
            if like is not None:
                decode_lens, decode_starts = like.decode_seq_lens, like.decode_key_starts
            else:
                decode_lens = torch.from_numpy(np.ascontiguousarray(dec_lens, dtype=np.int64)).to(device)
                if dec_lo is not None:
                    decode_starts = torch.from_numpy(np.ascontiguousarray(dec_lo, dtype=np.int64)).to(device)
        elif dec_lo is None or not dec_lo.any():
            decode_max = int(dec_lens.max())
            max_blocks = -(-decode_max // block_size)
            decode_table = torch.from_numpy(np.ascontiguousarray(dec_table[:, :max_blocks])).to(device)
            if like is not None:
                decode_mask = like.decode_mask
            elif int(dec_lens.min()) != decode_max:
                mask = np.arange(decode_max)[None, :] < dec_lens[:, None]
                decode_mask = torch.from_numpy(mask).to(device).view(num_rows, 1, 1, decode_max)
        else:
            # Each row starts at the block holding its first key: a window's blocks, not the whole sequence.
            first_block = dec_lo // block_size
            offset = first_block * block_size
            decode_max = int((dec_lens - offset).max())
            max_blocks = -(-decode_max // block_size)
            cols = np.minimum(first_block[:, None] + np.arange(max_blocks)[None, :], block_table.shape[1] - 1)
            decode_table = torch.from_numpy(dec_table[np.arange(num_rows)[:, None], cols]).to(device)
            if like is not None:
                decode_mask = like.decode_mask
            else:
                keys = np.arange(decode_max)[None, :] + offset[:, None]
                mask = (keys >= dec_lo[:, None]) & (keys < dec_lens[:, None])
                decode_mask = torch.from_numpy(mask).to(device).view(num_rows, 1, 1, decode_max)

    prefills = []
    for i in range(num_decodes, len(query_lens)):
        start, qlen, seq_len = int(num_computed[i]), int(query_lens[i]), int(seq_lens[i])
        nb = int(num_blocks_per_req[i])
        needed = -(-seq_len // block_size)
        if needed > nb:
            raise ValueError(f"request {i} needs {needed} KV blocks for {seq_len} tokens but has {nb}")
        first_block = 0 if key_lo is None else int(key_lo[i]) // block_size
        offset = first_block * block_size
        mask = None
        blocks = (bidirectional or {}).get(i)
        if like is not None:
            mask = like.prefills[i - num_decodes].mask
        elif start or (window is not None and int(first_key(window, np.array(start + qlen - 1)))) or blocks:
            # Query j of a chunk starting at position p sees keys up to p + j (and, under a window,
            # from its first key: p + j - window + 1, or its attention chunk's start).
            keys = np.arange(offset, seq_len)[None, :]
            pos = (start + np.arange(qlen))[:, None]
            visible = keys <= pos
            for a, b in blocks or ():  # (an image's tokens: each other's, later ones too)
                visible |= (keys >= a) & (keys < b) & (pos >= a) & (pos < b)
            if window is not None:
                visible &= keys >= first_key(window, pos)
            mask = torch.from_numpy(visible).to(device)
        prefills.append(PrefillSpan(
            token_start=int(query_start_loc[i]), token_end=int(query_start_loc[i + 1]),
            block_ids=torch.from_numpy(np.ascontiguousarray(block_table[i, first_block:needed])).to(device),
            num_keys=seq_len - offset, mask=mask))
    return AttentionMetadata(slots, num_rows, decode_table, decode_max, decode_mask, prefills, decode_lens,
                             decode_starts, window)
