"""Idefics3's (SmolVLM's) images in chat prompts, the router's side.

Its processor resizes an image so that its longest side is ``size["longest_edge"]`` pixels, then up
to whole ``max_image_size`` tiles, cuts it into those tiles (row by row) and adds the whole image
shrunk to one tile; in the prompt, each tile is ``<fake_token_around_image><row_R_col_C>`` and its run
of ``<image>`` tokens, each row of tiles ends with a newline, and the whole image comes last as
``<fake_token_around_image><global-img>``, its run, ``<fake_token_around_image>`` (an image small
enough for one tile is that last part alone). Each tile is an encoder input of its own (a
fixed-size image to the engine: ``ImageGeometry.tile_prompts``), so the text between them is plain
prompt text, tokenized piece by piece (each piece sits between special tokens, so it tokenizes as in
the whole text).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_core.multimodal import ImageGeometry
    from router.multimodal import ProcessedImage

# transformers' Idefics3 image processor's bound on a resized image's longest side.
MAX_RESIZED_SIDE = 4096


def tile_grid(height: int, width: int, longest_edge: int, tile: int, resize: bool = True,
              split: bool = True) -> tuple[int, int]:
    """The (rows, columns) of tiles transformers' Idefics3ImageProcessor cuts an image of ``height`` x
    ``width`` into ((0, 0): the whole image alone): its longest side resized to ``longest_edge`` (the
    other kept in proportion, made even; at most MAX_RESIZED_SIDE), then each side up to whole tiles
    (the short one from the long one's aspect, as its resize_for_vision_encoder rounds)."""
    if resize:
        aspect = width / height
        if width >= height:
            width = longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = longest_edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > MAX_RESIZED_SIDE:
            width, height = MAX_RESIZED_SIDE, int(MAX_RESIZED_SIDE / aspect)
        elif height > width and height > MAX_RESIZED_SIDE:
            height, width = MAX_RESIZED_SIDE, int(MAX_RESIZED_SIDE * aspect)
        height, width = max(height, 1), max(width, 1)
    if not split:
        return 0, 0
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    if height > tile or width > tile:
        return (height - tile) // tile + 1, (width - tile) // tile + 1
    return 0, 0


@dataclass(frozen=True)
class TiledImage:
    """An image as Idefics3 takes it: its tiles (each an encoder input, in the processor's order: rows
    of columns, then the whole image), its (rows, columns) of tiles, and its own (height, width)."""

    tiles: tuple[ProcessedImage, ...]
    grid: tuple[int, int]
    image_size: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return sum(tile.num_tokens for tile in self.tiles)

    @property
    def size_bytes(self) -> int:
        return sum(tile.size_bytes for tile in self.tiles)


@dataclass(frozen=True)
class TiledImageTokens:
    """Idefics3's image text: an image's tokens for its grid of tiles, and where each tile's run of
    ``tokens_per_tile`` image tokens starts in them; and its grid by its size (the processor's
    settings: ``longest_edge``, the ``tile`` side, whether it resizes and splits)."""

    tokenizer: Any
    image_token_id: int
    tokens_per_tile: int
    longest_edge: int
    tile: int
    resize: bool = True
    split: bool = True
    _pieces: dict[str, list[int]] = field(default_factory=dict, compare=False)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        return tile_grid(height, width, self.longest_edge, self.tile, self.resize, self.split)

    def _ids(self, text: str) -> list[int]:
        if text not in self._pieces:
            self._pieces[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._pieces[text]

    def run(self, grid: tuple[int, int]) -> tuple[list[int], list[int]]:
        rows, columns = grid
        fake, tiles = self._ids("<fake_token_around_image>"), [self.image_token_id] * self.tokens_per_tile
        ids: list[int] = []
        starts = []
        for row in range(1, rows + 1):
            for column in range(1, columns + 1):
                ids += fake + self._ids(f"<row_{row}_col_{column}>")
                starts.append(len(ids))
                ids += tiles
            ids += self._ids("\n" if row < rows else "\n\n")
        ids += fake + self._ids("<global-img>")
        starts.append(len(ids))
        return ids + tiles + fake, starts


def tiled_image_tokens(tokenizer: Any, image_processor: Any, image_token_id: int | None,
                       geometry: ImageGeometry | None) -> TiledImageTokens | None:
    """Idefics3's image text for this tokenizer and image processor (its ``size``, ``max_image_size``,
    ``do_resize`` and ``do_image_splitting``), for a model whose images are so (``geometry.tile_prompts``;
    None for others, and without an image processor); ValueError where its tiles are not the model's."""
    if geometry is None or not geometry.tile_prompts or image_processor is None or image_token_id is None:
        return None
    tile, tokens_per_tile = geometry.image_size, geometry.base_tokens

    def side(value: Any) -> int:
        return int(value["longest_edge"] if isinstance(value, dict) else value.longest_edge)

    if side(image_processor.max_image_size) != tile:
        raise ValueError(f"the image processor's max_image_size {side(image_processor.max_image_size)} is not the "
                         f"vision tower's tile side {tile}: its preprocessor_config.json does not match its "
                         "config.json")
    # (--mm-processor-kwargs' size over the processor config's: MultiModalProcessor sets it on the processor)
    longest_edge = geometry.tile_resize or side(image_processor.size)
    return TiledImageTokens(tokenizer, image_token_id, tokens_per_tile, longest_edge, tile,
                            bool(image_processor.do_resize), bool(image_processor.do_image_splitting))
