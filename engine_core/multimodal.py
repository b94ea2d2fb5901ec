"""Images in prompts (vLLM's multimodal inputs), as they cross from router to engine to workers.

The router turns each image of a prompt into the vision encoder's input (``pixel_values``, the
model's own image processor's output) and stands ``length`` copies of the model's image token in
for it in the prompt, from position ``offset``. The workers run the encoder on ``pixel_values``
once (cached by ``identifier`` while any request still needs the rows) and write its ``length``
output rows over the placeholders' embeddings. ``identifier`` is a digest of the processed input,
so the same image in two prompts is encoded once, and the prompt's KV blocks that an image reaches
into are keyed by it (equal placeholder ids, different images: different blocks).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import numpy as np
    import torch

_ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


class TensorData(msgspec.Struct, array_like=True, frozen=True):
    """A dense float array on the wire: dtype name, shape and raw bytes (row-major, native order)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in _ITEM_SIZES:
            raise ValueError(f"tensor dtype must be one of {', '.join(_ITEM_SIZES)}, not {self.dtype}")
        if len(self.data) != math.prod(self.shape) * _ITEM_SIZES[self.dtype]:
            raise ValueError(f"a {self.dtype} tensor of shape {list(self.shape)} is "
                             f"{math.prod(self.shape) * _ITEM_SIZES[self.dtype]} bytes, not {len(self.data)}")

    @classmethod
    def from_array(cls, array: np.ndarray | torch.Tensor) -> TensorData:
        import torch

        tensor = torch.as_tensor(array).detach().to("cpu").contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _ITEM_SIZES:
            tensor, name = tensor.float(), "float32"
        return cls(name, tuple(int(d) for d in tensor.shape), tensor.view(torch.uint8).numpy().tobytes())

    def to_tensor(self) -> torch.Tensor:
        """A CPU tensor of the data's own dtype (a copy: the bytes are read-only)."""
        import torch

        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


class MultiModalFeature(msgspec.Struct, array_like=True, frozen=True):
    """One image (or video) of a prompt: its encoder input, where its placeholders sit, and its digest."""

    modality: str
    # Digest of the processed input (``feature_identifier``): keys the encoder cache and the KV blocks.
    identifier: str
    # The prompt position of the first placeholder token, and how many there are (the encoder's rows).
    offset: int
    length: int
    pixel_values: TensorData
    # The image's own (height, width) in pixels, where its token count depends on it (LLaVA-NeXT); a
    # video's frames'.
    image_size: tuple[int, int] | None = None
    # A video (modality "video": Qwen2-VL, Qwen2.5-VL): its frames as sampled, and the seconds one
    # temporal patch of them spans (Qwen2.5-VL's second_per_grid_ts); 0 for an image. (Qwen3-VL: one
    # feature per temporal patch of a video, its frames' size as resized: ImageGeometry.video_frame_pairs.)
    num_frames: int = 0
    second_per_grid: float = 0.0

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"a {self.modality} needs at least one placeholder from a position >= 0, not "
                             f"{self.length} from {self.offset}")

    @property
    def end(self) -> int:
        return self.offset + self.length


def with_article(noun: str) -> str:
    """"an image", "a video"."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def feature_identifier(modality: str, pixel_values: TensorData, extra: str = "") -> str:
    """The digest that names an encoder input: equal inputs (and ``extra``, e.g. the model) share it."""
    h = hashlib.blake2b(f"{modality}|{pixel_values.dtype}|{pixel_values.shape}|{extra}".encode(), digest_size=16)
    h.update(pixel_values.data)
    return h.hexdigest()


def check_features(features: list[MultiModalFeature], prompt_token_ids: list[int], placeholder_id: int,
                   geometry: ImageGeometry | None = None, video_token_id: int | None = None) -> None:
    """ValueError unless the features are in prompt order, do not overlap, and each covers only
    placeholder tokens of the prompt (Pixtral's: its rows of them, each with its break or end token;
    a video's: ``video_token_id``)."""
    end = 0
    for f in features:
        if f.offset < end:
            raise ValueError(f"{f.modality} placeholders from position {f.offset} overlap the previous ones")
        if f.end > len(prompt_token_ids):
            raise ValueError(f"{f.modality} placeholders reach position {f.end}, past the prompt's "
                             f"{len(prompt_token_ids)} tokens")
        token = placeholder_id
        if f.modality == "video":
            if video_token_id is None or f.num_frames < 1:
                raise ValueError("a video needs a model that takes videos, and its frames")
            token = video_token_id
        if geometry is not None and geometry.pixtral:
            expected = geometry.placeholder_ids(token, *(f.image_size or (0, 0)))
            if prompt_token_ids[f.offset:f.end] != expected:
                raise ValueError(f"{f.modality} placeholders at {f.offset}..{f.end} are not the model's rows of "
                                 f"placeholder tokens {token}, each ended by its break token "
                                 f"{geometry.row_break_token_id}, the last by its end token "
                                 f"{geometry.image_end_token_id}")
        elif any(t != token for t in prompt_token_ids[f.offset:f.end]):
            raise ValueError(f"{f.modality} placeholders at {f.offset}..{f.end} are not all the model's "
                             f"placeholder token {token}")
        end = f.end


class ImageGeometry(msgspec.Struct, array_like=True, frozen=True):
    """How many tokens (and encoder tiles) an image is for a model: LLaVA's fixed count, LLaVA-NeXT's
    "anyres" count, Qwen2-VL's native-resolution count, Pixtral's rows or InternVL's tiles, the last
    four depending on the image's size. The router (placeholders) and the engine (checks, the encoder
    budget) count with the same rules."""

    # The vision tower's input side (pixels) and patch side; its channels.
    image_size: int
    patch_size: int
    num_channels: int = 3
    # The class token's features are kept too ("full" select strategy): one more token.
    keeps_class_token: bool = False
    # LLaVA-NeXT: the (height, width) resolutions an image is resized and padded to before it is cut
    # into image_size tiles (beside a whole-image tile); empty for LLaVA's single tile.
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # Qwen2-VL ("native resolution"): an image is resized to multiples of patch_size * merge_size
    # pixels within [min_pixels, max_pixels], keeping its aspect, and cut into patch_size patches
    # (each as temporal_patch_size frames); merge_size x merge_size patches make one token. 0: not so.
    merge_size: int = 0
    temporal_patch_size: int = 2
    min_pixels: int = 0
    max_pixels: int = 0
    # Gemma 3: the tower's patches average-pooled to this many tokens (0: one token per patch).
    pooled_tokens: int = 0
    # Gemma 3: an image's tokens attend to each other both ways, so an image's placeholders are
    # computed in one pass (what is left of them after a prefix-cache hit, too).
    bidirectional: bool = False
    # Pixtral (Pixtral-12B, Mistral 3): an image keeping its aspect is shrunk to fit a longest side of
    # this many pixels, each side then rounded up to whole tokens of spatial_merge x spatial_merge
    # patches (0: not so). Its placeholders are rows of image tokens, each row followed by
    # row_break_token_id, the last by image_end_token_id (those two read the embedding table).
    longest_edge: int = 0
    spatial_merge: int = 1
    row_break_token_id: int = -1
    image_end_token_id: int = -1
    # InternVL: an image resized to the grid of min_tiles..max_tiles image_size tiles whose aspect is
    # closest to its own, cut into them, and a thumbnail of it beside more than one; each tile
    # pooled_tokens tokens (0: not so).
    min_tiles: int = 1
    max_tiles: int = 0
    # Videos (Qwen2-VL, Qwen2.5-VL): each frame resized as an image is, within [video_min_pixels,
    # video_max_pixels] (0: the model takes no videos); temporal_patch_size frames make one temporal
    # patch (the last frame repeated to fill the last). A temporal patch's M-RoPE time position is
    # floor(its index * second_per_grid * tokens_per_second) (Qwen2.5-VL; 0: its index, Qwen2-VL's).
    video_min_pixels: int = 0
    video_max_pixels: int = 0
    tokens_per_second: float = 0.0
    # Qwen3-VL: the video pixel range bounds all of a video's frames together (its frames are resized
    # by their count: ``video_frame_size``), and a video reaches the engine as its temporal patches,
    # each a feature of the resized frames' (height, width) (the prompt writes each patch's time as
    # text before it, so its placeholders are runs apart, and its M-RoPE positions are an image's).
    video_frame_pairs: bool = False
    # Idefics3 (SmolVLM): each encoder input is one tile of an image (image_size square, pooled_tokens
    # tokens), the router cutting the image into tiles and writing their rows and columns in the prompt
    # between them (the engine sees fixed-size images).
    tile_prompts: bool = False
    # (and the side an image is resized to before its tiles are cut, where --mm-processor-kwargs sets
    # it over the processor's; 0: the processor's)
    tile_resize: int = 0
    # How a video's frames are sampled (its video processor config's fps, min_frames, max_frames;
    # transformers' Qwen defaults: 2 a second, 4 to 768).
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768

    @property
    def takes_videos(self) -> bool:
        return self.video_max_pixels > 0

    @property
    def native(self) -> bool:
        return self.merge_size > 0

    @property
    def pixtral(self) -> bool:
        return self.longest_edge > 0

    @property
    def tiled(self) -> bool:
        return self.max_tiles > 0

    @property
    def counts_by_size(self) -> bool:
        """Whether an image's token count depends on its (height, width)."""
        return self.native or self.pixtral or bool(self.grid_pinpoints) or self.max_tiles > 1

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """InternVL: the (columns, rows) of tiles an image is cut into: of the grids of min_tiles..max_tiles
        tiles (fewest tiles first), the one whose aspect is closest to the image's; at a tie the one with
        more tiles while the image's area is over half theirs (transformers' get_optimal_tiled_canvas)."""
        grids = sorted(((columns, rows) for columns in range(1, self.max_tiles + 1)
                        for rows in range(1, self.max_tiles + 1)
                        if self.min_tiles <= columns * rows <= self.max_tiles), key=lambda g: g[0] * g[1])
        aspect, area = width / height, width * height
        best, best_diff = (1, 1), float("inf")
        for columns, rows in grids:
            diff = abs(aspect - columns / rows)
            if diff < best_diff:
                best, best_diff = (columns, rows), diff
            elif diff == best_diff and area > 0.5 * self.image_size ** 2 * columns * rows:
                best = (columns, rows)
        return best

    def token_grid(self, height: int, width: int) -> tuple[int, int]:
        """Pixtral: an image's (rows, columns) of tokens, as PixtralImageProcessor resizes it (shrunk,
        never enlarged, to fit longest_edge; each side rounded up to a whole token)."""
        ratio = max(height, width) / self.longest_edge
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        if min(height, width) < 1:
            raise ValueError(f"an image shrunk to fit {self.longest_edge} pixels must keep a pixel on each side, "
                             f"not {width}x{height}")
        side = self.patch_size * self.spatial_merge
        return -(-height // side), -(-width // side)

    def placeholder_ids(self, image_token_id: int, height: int, width: int) -> list[int]:
        """The prompt tokens that stand for an image of ``height`` x ``width``: its count of image
        tokens, or Pixtral's rows of them, each ended by its row-break token, the last by its end token."""
        if not self.pixtral:
            return [image_token_id] * self.num_tokens(height, width)
        rows, columns = self.token_grid(height, width)
        ids = ([image_token_id] * columns + [self.row_break_token_id]) * rows
        ids[-1] = self.image_end_token_id
        return ids

    def resized(self, height: int, width: int, video: bool = False) -> tuple[int, int]:
        """Qwen2-VL: the (height, width) an image (a video's frame) is resized to (transformers'
        smart_resize, in the image's or the video's pixel range)."""
        factor = self.patch_size * self.merge_size
        min_pixels, max_pixels = ((self.video_min_pixels, self.video_max_pixels) if video
                                  else (self.min_pixels, self.max_pixels))
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"an image's sides may differ at most 200x, not {width}x{height}")
        new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
        if new_height * new_width > max_pixels:
            beta = math.sqrt(height * width / max_pixels)
            new_height = max(factor, math.floor(height / beta / factor) * factor)
            new_width = max(factor, math.floor(width / beta / factor) * factor)
        elif new_height * new_width < min_pixels:
            beta = math.sqrt(min_pixels / (height * width))
            new_height = math.ceil(height * beta / factor) * factor
            new_width = math.ceil(width * beta / factor) * factor
        return new_height, new_width

    def patch_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """Qwen2-VL: an image's (frames, rows, columns) of patches (transformers' image_grid_thw)."""
        new_height, new_width = self.resized(height, width)
        return 1, new_height // self.patch_size, new_width // self.patch_size

    def video_frame_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) a video's ``num_frames`` frames of ``height`` x ``width`` are resized to:
        each as an image in the video pixel range (Qwen2-VL); Qwen3-VL's (``video_frame_pairs``): all
        its frames' pixels together within that range (transformers' Qwen3VLVideoProcessor smart_resize;
        a video of one frame as its repeated pair), and no pair of frames more tokens than the largest
        image (what a pass may encode: fewer pixels a frame where the range allows more)."""
        if not self.video_frame_pairs:
            return self.resized(height, width, video=True)
        factor, pair = self.patch_size * self.merge_size, self.temporal_patch_size
        num_frames = max(num_frames, pair)
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"a video's frames' sides may differ at most 200x, not {width}x{height}")
        new_height, new_width = round(height / factor) * factor, round(width / factor) * factor
        frames = round(num_frames / pair) * pair
        if frames * new_height * new_width > self.video_max_pixels:
            beta = math.sqrt(num_frames * height * width / self.video_max_pixels)
            new_height = max(factor, math.floor(height / beta / factor) * factor)
            new_width = max(factor, math.floor(width / beta / factor) * factor)
        elif frames * new_height * new_width < self.video_min_pixels:
            beta = math.sqrt(self.video_min_pixels / (num_frames * height * width))
            new_height = math.ceil(height * beta / factor) * factor
            new_width = math.ceil(width * beta / factor) * factor
        budget = self.max_tokens * factor ** 2  # (a frame's pixels at most the largest image's tokens)
        if new_height * new_width > budget:
            beta = math.sqrt(height * width / budget)
            new_height = max(factor, math.floor(height / beta / factor) * factor)
            new_width = max(factor, math.floor(width / beta / factor) * factor)
        return new_height, new_width

    def video_patch_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """A video's (temporal patches, rows, columns) of patches (transformers' video_grid_thw); for
        Qwen3-VL's features (``video_frame_pairs``), one temporal patch's, its frames' resized size given."""
        if not self.takes_videos:
            raise ValueError("the model takes no videos")
        if num_frames < 1:
            raise ValueError(f"a video needs at least one frame, not {num_frames}")
        if self.video_frame_pairs:
            factor = self.patch_size * self.merge_size
            if num_frames > self.temporal_patch_size:
                raise ValueError(f"this model takes a video as its temporal patches, each of at most "
                                 f"{self.temporal_patch_size} frames, not {num_frames}")
            if height % factor or width % factor or min(height, width) < factor:
                raise ValueError(f"a temporal patch's frames are given at their resized size, whole multiples of "
                                 f"{factor} pixels, not {width}x{height}")
            new_height, new_width = height, width
        else:
            new_height, new_width = self.resized(height, width, video=True)
        return -(-num_frames // self.temporal_patch_size), new_height // self.patch_size, new_width // self.patch_size

    def grid_of(self, feature: MultiModalFeature) -> tuple[int, int, int]:
        """Qwen2-VL: an image's or a video's (temporal patches, rows, columns) of patches."""
        size = feature.image_size or (1, 1)
        if feature.modality == "video":
            return self.video_patch_grid(feature.num_frames, *size)
        return self.patch_grid(*size)

    def video_num_tokens(self, num_frames: int, height: int, width: int) -> int:
        """A video's placeholders (and encoder rows): its temporal patches' merged patches."""
        frames, rows, columns = self.video_patch_grid(num_frames, height, width)
        return frames * rows * columns // self.merge_size ** 2

    def tokens_of(self, feature: MultiModalFeature) -> int:
        """An image's or a video's placeholders (and encoder rows)."""
        if feature.modality != "video":
            return self.num_tokens(*(feature.image_size or (1, 1)))
        return self.video_num_tokens(feature.num_frames, *(feature.image_size or (1, 1)))

    def input_shape_of(self, feature: MultiModalFeature) -> tuple[int, ...]:
        """An image's or a video's pixel values as the encoder takes them."""
        if feature.modality != "video":
            return self.input_shape(*(feature.image_size or (1, 1)))
        frames, rows, columns = self.grid_of(feature)
        return frames * rows * columns, self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    def time_positions(self, temporal_patches: int, second_per_grid: float) -> list[int]:
        """A video's temporal patches' M-RoPE time positions (Qwen2.5-VL: by the seconds they start
        at, index x second_per_grid x tokens_per_second in float32 and truncated, as transformers
        computes them; Qwen2-VL, and an image: their indexes)."""
        if not self.tokens_per_second or not second_per_grid:
            return list(range(temporal_patches))
        import numpy as np

        interval = np.float32(np.float32(second_per_grid) * np.float32(self.tokens_per_second))
        return (np.arange(temporal_patches, dtype=np.float32) * interval).astype(np.int64).tolist()

    def positions_spanned(self, feature: MultiModalFeature) -> int:
        """Qwen2-VL's M-RoPE: the positions an image or a video spans (the text after it counts on
        from there, as vLLM counts): one past its last time position, or its merged rows or
        columns, whichever is most."""
        frames, rows, columns = self.grid_of(feature)
        return max(self.time_positions(frames, feature.second_per_grid)[-1] + 1, rows // self.merge_size,
                   columns // self.merge_size)

    @property
    def min_tokens(self) -> int:
        """The fewest tokens an image may take."""
        # (Qwen2-VL: a large thin image may shrink below min_pixels, to one merged patch; Pixtral: a
        # token and the end token; InternVL: its fewest tiles, with a thumbnail beside more than one.)
        if self.tiled:
            return self.base_tokens * (self.min_tiles + (self.min_tiles > 1))
        return 1 if self.native else 2 if self.pixtral else self.base_tokens

    @property
    def tiles_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def base_tokens(self) -> int:
        if self.pooled_tokens:
            return self.pooled_tokens
        return self.tiles_side ** 2 + (1 if self.keeps_class_token else 0)

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The pinpoint an image of ``height`` x ``width`` is resized into: the one keeping the most
        of its pixels, then wasting the fewest (LLaVA-NeXT's select_best_resolution)."""
        best, best_effective, best_wasted = self.grid_pinpoints[0], -1, float("inf")
        for pin_height, pin_width in self.grid_pinpoints:
            scale = min(pin_width / width, pin_height / height)
            effective = min(int(width * scale) * int(height * scale), width * height)
            wasted = pin_width * pin_height - effective
            if effective > best_effective or (effective == best_effective and wasted < best_wasted):
                best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
        return best

    def num_tiles(self, height: int, width: int) -> int:
        """The encoder's input tiles of one image: 1, or the pinpoint's grid plus the whole image
        (InternVL: its grid's tiles, and the thumbnail beside more than one)."""
        if self.max_tiles > 1:
            columns, rows = self.tile_grid(height, width)
            return columns * rows + (columns * rows > 1)
        if not self.grid_pinpoints:
            return 1
        pin_height, pin_width = self.best_resolution(height, width)
        return -(-pin_height // self.image_size) * -(-pin_width // self.image_size) + 1

    def grid_features(self, height: int, width: int) -> tuple[int, int]:
        """LLaVA-NeXT: the (rows, columns) of the grid tiles' features left once the padding that
        fitted the image into its pinpoint is cut off (each row then ends with a newline token)."""
        pin_height, pin_width = self.best_resolution(height, width)
        rows = self.tiles_side * (pin_height // self.image_size)
        columns = self.tiles_side * (pin_width // self.image_size)
        if width / height > columns / rows:
            padding = (rows - int(round(height * (columns / width), 7))) // 2
            rows -= 2 * padding
        else:
            padding = (columns - int(round(width * (rows / height), 7))) // 2
            columns -= 2 * padding
        return rows, columns

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholders (and encoder rows) of an image of ``height`` x ``width`` pixels."""
        if self.native:
            _, rows, columns = self.patch_grid(height, width)
            return rows * columns // self.merge_size ** 2
        if self.pixtral:
            rows, columns = self.token_grid(height, width)
            return rows * (columns + 1)
        if self.tiled:
            return self.base_tokens * self.num_tiles(height, width)
        if not self.grid_pinpoints:
            return self.base_tokens
        rows, columns = self.grid_features(height, width)
        return self.base_tokens + rows * columns + rows

    @property
    def max_tokens(self) -> int:
        """The most tokens one image may take (an image of a pinpoint's shape loses no padding; for
        Qwen2-VL, a bound: see below)."""
        if self.native:
            # Shrunk to max_pixels, an image takes at most max_pixels / factor^2 tokens, unless its
            # short side is rounded up to one merged patch: then the thinnest images, 200:1, take the
            # most. Scaled up to min_pixels, its sides a x b (in merged patches, a * b = M) are each
            # rounded up: ceil(a) * ceil(b) is at most (k + 1) * ceil(M / k) for a in (k, k + 1], and
            # at most ceil(sqrt(200 M)) for a <= 1 (a side is at most 200 times the other).
            factor = self.patch_size * self.merge_size
            thin = ((100 * factor, 20000 * factor), (1, 200))
            shrunk = max(self.max_pixels // factor ** 2,
                         *(self.num_tokens(*size) for pair in thin for size in (pair, pair[::-1])))
            m = self.min_pixels / factor ** 2
            widest = math.ceil(math.sqrt(200 * m))
            scaled_up = max(widest, *((k + 1) * math.ceil(m / k) for k in range(1, widest + 1)))
            return max(shrunk, scaled_up)
        if self.pixtral:  # (a square at longest_edge: the most rows and columns)
            return self.num_tokens(self.longest_edge, self.longest_edge)
        if self.tiled:  # (the grid of max_tiles, and the thumbnail)
            return self.base_tokens * (self.max_tiles + (self.max_tiles > 1))
        if not self.grid_pinpoints:
            return self.base_tokens
        return max(self.num_tokens(h, w) for h, w in self.grid_pinpoints)

    @property
    def largest_image(self) -> tuple[int, int]:
        """Qwen2-VL, Pixtral, InternVL: the (height, width) of an image that is the most patches the encoder may
        take at once (what a memory profile runs)."""
        if self.pixtral:
            return self.longest_edge, self.longest_edge
        if self.tiled:  # (an image of max_tiles tiles side by side: cut into as many)
            return self.image_size, self.image_size * self.max_tiles
        factor = self.patch_size * self.merge_size
        most = max(1, self.max_pixels // factor ** 2)
        sides = ((rows, max(1, min(200 * rows, most // rows))) for rows in range(1, min(most, 200) + 1))
        return max(((r * factor, c * factor) for r, c in sides), key=lambda hw: self.num_tokens(*hw))

    def input_shape(self, height: int, width: int) -> tuple[int, ...]:
        """The processed image's pixel values: (channels, side, side), (tiles, channels, side, side),
        or Qwen2-VL's (patches, channels x frames x patch_size x patch_size); Pixtral's (channels,
        height, width) as resized."""
        if self.pixtral:
            rows, columns = self.token_grid(height, width)
            side = self.patch_size * self.spatial_merge
            return self.num_channels, rows * side, columns * side
        if self.native:
            _, rows, columns = self.patch_grid(height, width)
            return rows * columns, self.num_channels * self.temporal_patch_size * self.patch_size ** 2
        side = (self.num_channels, self.image_size, self.image_size)
        return (self.num_tiles(height, width), *side) if self.grid_pinpoints or self.tiled else side
