"""Per-step attention metadata: built once on the host per step, shared by every layer.

The flat batch holds decode tokens first (one per decode request), then each prefill chunk's
tokens. Decodes are attended as one padded batch; each prefill chunk gets its own call (its
query length differs), so there is one Python iteration per prefill request, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PrefillSpan:
    token_start: int
    token_end: int
    # The request's blocks that hold positions [0, seq_len).
    block_ids: torch.Tensor
    seq_len: int
    # [query_len, seq_len] bool (True = attend) when the chunk starts after position 0; None means
    # plain causal attention over exactly the chunk.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    # Flat cache slot of every new token (block_id * block_size + offset in block).
    slot_mapping: torch.Tensor
    num_decodes: int
    # [num_decodes, max_blocks] block ids (padded with block 0, masked out) and the keys' extent.
    decode_block_table: torch.Tensor | None
    decode_max_seq_len: int
    # [num_decodes, 1, 1, decode_max_seq_len] bool, None when every decode has the same length.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    # [num_decodes] int64 key counts, set when decodes read the paged cache in place (the CPU
    # kernel); decode_mask is then not built.
    decode_seq_lens: torch.Tensor | None = None


def compute_slot_mapping(block_table: np.ndarray, req_index: np.ndarray, positions: np.ndarray,
                         block_size: int) -> np.ndarray:
    """Cache slot of each token: its request's block for ``position // block_size``, plus the offset."""
    return block_table[req_index, positions // block_size] * block_size + positions % block_size


def build_attention_metadata(block_table: np.ndarray, num_blocks_per_req: np.ndarray,
                             query_start_loc: np.ndarray, num_computed: np.ndarray, num_decodes: int,
                             slot_mapping: np.ndarray, block_size: int,
                             device: torch.device, decode_in_place: bool = False) -> AttentionMetadata:
    """Arguments are per request (decodes first) except ``query_start_loc`` ([num_reqs + 1]) and
    ``slot_mapping`` (per token). ``decode_in_place`` selects the kernel that reads the paged cache
    where it lies (per-request lengths instead of a padding mask)."""
    query_lens = np.diff(query_start_loc)
    seq_lens = num_computed + query_lens
    slots = torch.from_numpy(slot_mapping).to(device, non_blocking=True)

    decode_table = decode_mask = decode_lens = None
    decode_max = 0
    if num_decodes:
        dec_lens = seq_lens[:num_decodes]
        decode_max = int(dec_lens.max())
        max_blocks = -(-decode_max // block_size)
        decode_table = torch.from_numpy(np.ascontiguousarray(block_table[:num_decodes, :max_blocks])).to(device)
        if decode_in_place:
            decode_lens = torch.from_numpy(np.ascontiguousarray(dec_lens, dtype=np.int64)).to(device)
        elif int(dec_lens.min()) != decode_max:
            mask = np.arange(decode_max)[None, :] < dec_lens[:, None]
            decode_mask = torch.from_numpy(mask).to(device).view(num_decodes, 1, 1, decode_max)

    prefills = []
    for i in range(num_decodes, len(query_lens)):
        start, qlen, seq_len = int(num_computed[i]), int(query_lens[i]), int(seq_lens[i])
        nb = int(num_blocks_per_req[i])
        needed = -(-seq_len // block_size)
        if needed > nb:
            raise ValueError(f"request needs {needed} KV blocks for {seq_len} tokens but has {nb}")
        mask = None
        if start:
            # Query i of a chunk starting at position p sees keys 0..p+i.
            mask = torch.from_numpy(np.arange(seq_len)[None, :] <= (start + np.arange(qlen))[:, None]).to(device)
        prefills.append(PrefillSpan(
            token_start=int(query_start_loc[i]), token_end=int(query_start_loc[i + 1]),
            block_ids=torch.from_numpy(np.ascontiguousarray(block_table[i, :needed])).to(device),
            seq_len=seq_len, mask=mask))
    return AttentionMetadata(slots, num_decodes, decode_table, decode_max, decode_mask, prefills, decode_lens)
