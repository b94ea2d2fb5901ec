"""Per-pass metadata of an encoder (bidirectional attention within each prompt, no KV cache).

The pass's prompts lie one after another in the flat batch, each whole and from position 0. They
are attended in padded batches: prompts of similar length (sorted, so that padding adds at most a
quarter to a batch's tokens) are gathered into one [batch, heads, length, head_dim] call, padded
keys masked out, so that one fused attention kernel serves many short prompts at once. The gather
indexes, padding masks and sliding-window masks are built once a pass, on the host, and shared by
every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# A batch grows while its padded size stays within this factor of its real tokens.
_MAX_PADDING = 1.25


@dataclass
class PaddedBatch:
    """Prompts attended as one padded [batch, length] call."""

    batch: int
    length: int
    # [batch * length] flat row of each padded slot (padding slots repeat a real row; their keys are masked).
    gather_rows: torch.Tensor
    # The real slots: their positions among the padded ones, and the flat rows they are written back to.
    real_slots: torch.Tensor
    real_rows: torch.Tensor
    # [batch, 1, 1, length] bool (True = a real key), None without padding.
    key_mask: torch.Tensor | None
    # Masks with a sliding window folded in, by window: built on first use in a pass.
    windowed_masks: dict[int, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """The attention mask (True = attend) for a layer with this bidirectional ``window`` (query i
        sees key j where |i - j| <= window; None: every key of its prompt)."""
        if window is None or self.length <= window + 1:
            return self.key_mask
        if window not in self.windowed_masks:
            offsets = torch.arange(self.length, device=self.gather_rows.device)
            near = (offsets[None, :] - offsets[:, None]).abs_() <= window
            self.windowed_masks[window] = near if self.key_mask is None else self.key_mask & near
        return self.windowed_masks[window]


@dataclass
class EncoderMetadata:
    # The padded batches covering every prompt; empty when the pass is one prompt (attended in place).
    batches: list[PaddedBatch]

    @classmethod
    def build(cls, query_start_loc: np.ndarray, device: torch.device) -> EncoderMetadata:
        """``query_start_loc``: [num_reqs + 1], prompt i is rows query_start_loc[i] .. [i + 1] - 1."""
        lengths = np.diff(query_start_loc)
        if len(lengths) == 1:
            return cls([])
        batches = []
        order = np.argsort(lengths, kind="stable")
        group: list[int] = []
        tokens = 0
        for index in order.tolist():
            length = int(lengths[index])
            if group and (len(group) + 1) * length > _MAX_PADDING * (tokens + length):
                batches.append(_padded_batch(group, query_start_loc, lengths, device))
                group, tokens = [], 0
            group.append(index)
            tokens += length
        batches.append(_padded_batch(group, query_start_loc, lengths, device))
        return cls(batches)


def _padded_batch(prompts: list[int], query_start_loc: np.ndarray, lengths: np.ndarray,
                  device: torch.device) -> PaddedBatch:
    """The padded batch of these prompts (indexes into the pass, shortest first)."""
    sizes = lengths[prompts]
    length = int(sizes.max())
    slots = np.arange(length)[None, :]
    real = slots < sizes[:, None]  # [batch, length]
    # A padding slot reads its prompt's first row (a real one), masked out as a key.
    rows = query_start_loc[prompts][:, None] + np.where(real, slots, 0)
    flat_real = real.reshape(-1)
    key_mask = None
    if not real.all():
        key_mask = torch.from_numpy(real).to(device).view(len(prompts), 1, 1, length)
    return PaddedBatch(
        batch=len(prompts), length=length,
        gather_rows=torch.from_numpy(rows.reshape(-1)).to(device),
        real_slots=torch.from_numpy(np.flatnonzero(flat_real)).to(device),
        real_rows=torch.from_numpy(rows.reshape(-1)[flat_real]).to(device),
        key_mask=key_mask)
