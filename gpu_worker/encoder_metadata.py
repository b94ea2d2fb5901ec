"""Per-pass metadata of an encoder (bidirectional attention within each prompt, no KV cache).

The pass's prompts lie one after another in the flat batch, each whole and from position 0. How
they are attended depends on the device:
* on the CPU, one prompt after another where it lies (a 4-D attention call each): gathering them
  into padded batches costs more than the calls it saves there;
* on CUDA, in padded batches: prompts of similar length (sorted, so that padding adds at most a
  quarter to a batch's tokens) gathered into one [batch, heads, length, head_dim] call, padded keys
  masked out, so that one kernel launch serves many short prompts.
The spans, gather indexes and masks (padding, sliding windows) are built once a pass and shared by
every layer.
"""

from __future__ import annotations

import itertools
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
            near = band_mask(self.length, window, self.gather_rows.device)
            self.windowed_masks[window] = near if self.key_mask is None else self.key_mask & near
        return self.windowed_masks[window]


def band_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool: True where |i - j| <= window."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril_(window).triu_(-window)


@dataclass
class EncoderMetadata:
    # Each prompt's (first row, end row), attended one after another (the CPU's way); empty when the
    # pass is attended in padded batches.
    spans: list[tuple[int, int]]
    # The padded batches covering every prompt (CUDA's way); empty otherwise.
    batches: list[PaddedBatch]
    device: torch.device
    # A prompt's sliding-window mask by (length, window), built once a pass.
    window_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def window_mask(self, length: int, window: int | None) -> torch.Tensor | None:
        """The mask of one prompt of ``length`` tokens under a bidirectional ``window`` (None when
        it sees every key)."""
        if window is None or length <= window + 1:
            return None
        if (length, window) not in self.window_masks:
            self.window_masks[(length, window)] = band_mask(length, window, self.device)
        return self.window_masks[(length, window)]

    @classmethod
    def build(cls, query_start_loc: np.ndarray, device: torch.device, padded: bool | None = None) -> EncoderMetadata:
        """``query_start_loc``: [num_reqs + 1], prompt i is rows query_start_loc[i] .. [i + 1] - 1.
        ``padded``: attend in padded batches (None: on CUDA, not on the CPU)."""
        lengths = np.diff(query_start_loc)
        if padded is None:
            padded = device.type == "cuda"
        if len(lengths) == 1 or not padded:
            bounds = query_start_loc.tolist()
            return cls(list(itertools.pairwise(bounds)), [], device)
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
        return cls([], batches, device)


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
