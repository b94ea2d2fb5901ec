"""Qwen2-VL's M-RoPE positions: each prompt token's (time, height, width) rotary positions.

Text tokens count on as usual, the three positions equal. An image's placeholders take the start
position plus their (frame, row, column) in the image's grid of merged patches, and the text after
it goes on from one past the largest of those. A video's frames are its temporal patches (Qwen2.5-VL
times them: ImageGeometry.time_positions). A prompt's positions past its end (outputs, drafts)
are then the plain position plus ``delta``, the three equal again, so only the tokens of a prompt
with images need the table (transformers' get_rope_index, for images).
"""

from __future__ import annotations

import numpy as np

from engine_core.multimodal import ImageGeometry, MultiModalFeature


def mrope_positions(num_prompt_tokens: int, features: list[MultiModalFeature], geometry: ImageGeometry
                    ) -> tuple[np.ndarray, int]:
    """([3, num_prompt_tokens] positions, delta): ``delta`` is what a position past the prompt adds."""
    positions = np.empty((3, num_prompt_tokens), dtype=np.int64)
    cursor = next_position = 0
    merge = geometry.merge_size
    for feature in features:
        text = feature.offset - cursor
        positions[:, cursor:feature.offset] = next_position + np.arange(text)
        next_position += text
        assert feature.image_size is not None
        frames, rows, columns = geometry.grid_of(feature)
        rows, columns = rows // merge, columns // merge
        if frames * rows * columns != feature.length:
            raise ValueError(f"a {feature.modality} of {feature.length} tokens at {feature.offset} is not its grid's "
                             f"{frames}x{rows}x{columns}")
        grid = np.indices((frames, rows, columns)).reshape(3, -1)
        # (A video's temporal patches by time under Qwen2.5-VL: their time positions.)
        grid[0] = np.asarray(geometry.time_positions(frames, feature.second_per_grid))[grid[0]]
        positions[:, feature.offset:feature.end] = next_position + grid
        # (The text after it goes on from one past its largest position, as vLLM's and the original
        # Qwen2-VL code count: for a video, its last time position may be that.)
        next_position += geometry.positions_spanned(feature)
        cursor = feature.end
    positions[:, cursor:] = next_position + np.arange(num_prompt_tokens - cursor)
    next_position += num_prompt_tokens - cursor
    return positions, next_position - num_prompt_tokens


def pass_positions(positions: np.ndarray, tables: list[tuple[int, int, int, np.ndarray | None, int]]
                   ) -> np.ndarray:
    """A pass's rotary positions under M-RoPE, from its plain ``positions`` ([tokens]): for each
    request with images, (first row in the pass, chunk start, chunk end, its prompt's table, delta).
    [tokens] when no chunk covers a prompt with images (every token's three positions are equal),
    else [3, tokens]."""
    shifted = positions
    covered = []
    for row, start, end, table, delta in tables:
        prompt_len = table.shape[1] if table is not None else 0
        if end > prompt_len and delta:
            if shifted is positions:
                shifted = positions.copy()
            shifted[row + max(prompt_len - start, 0):row + end - start] += delta
        if table is not None and start < prompt_len:
            covered.append((row, table[:, start:min(end, prompt_len)]))
    if not covered:
        return shifted
    out = np.tile(shifted, (3, 1))
    for row, rows in covered:
        out[:, row:row + rows.shape[1]] = rows
    return out
