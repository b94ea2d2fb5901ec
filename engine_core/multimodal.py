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
    """One image of a prompt: its encoder input, where its placeholders sit, and its digest."""

    modality: str
    # Digest of the processed input (``feature_identifier``): keys the encoder cache and the KV blocks.
    identifier: str
    # The prompt position of the first placeholder token, and how many there are (the encoder's rows).
    offset: int
    length: int
    pixel_values: TensorData
    # The image's own (height, width) in pixels, where its token count depends on it (LLaVA-NeXT).
    image_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"a {self.modality} needs at least one placeholder from a position >= 0, not "
                             f"{self.length} from {self.offset}")

    @property
    def end(self) -> int:
        return self.offset + self.length


def feature_identifier(modality: str, pixel_values: TensorData, extra: str = "") -> str:
    """The digest that names an encoder input: equal inputs (and ``extra``, e.g. the model) share it."""
    h = hashlib.blake2b(f"{modality}|{pixel_values.dtype}|{pixel_values.shape}|{extra}".encode(), digest_size=16)
    h.update(pixel_values.data)
    return h.hexdigest()


def check_features(features: list[MultiModalFeature], prompt_token_ids: list[int], placeholder_id: int) -> None:
    """ValueError unless the features are in prompt order, do not overlap, and each covers only
    placeholder tokens of the prompt."""
    end = 0
    for f in features:
        if f.offset < end:
            raise ValueError(f"{f.modality} placeholders from position {f.offset} overlap the previous ones")
        if f.end > len(prompt_token_ids):
            raise ValueError(f"{f.modality} placeholders reach position {f.end}, past the prompt's "
                             f"{len(prompt_token_ids)} tokens")
        if any(t != placeholder_id for t in prompt_token_ids[f.offset:f.end]):
            raise ValueError(f"{f.modality} placeholders at {f.offset}..{f.end} are not all the model's "
                             f"placeholder token {placeholder_id}")
        end = f.end


class ImageGeometry(msgspec.Struct, array_like=True, frozen=True):
    """How many tokens (and encoder tiles) an image is for a model: LLaVA's fixed count, or
    LLaVA-NeXT's "anyres" count, which depends on the image's size. The router (placeholders) and
    the engine (checks, the encoder budget) count with the same rules."""

    # The vision tower's input side (pixels) and patch side; its channels.
    image_size: int
    patch_size: int
    num_channels: int = 3
    # The class token's features are kept too ("full" select strategy): one more token.
    keeps_class_token: bool = False
    # LLaVA-NeXT: the (height, width) resolutions an image is resized and padded to before it is cut
    # into image_size tiles (beside a whole-image tile); empty for LLaVA's single tile.
    grid_pinpoints: tuple[tuple[int, int], ...] = ()

    @property
    def tiles_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def base_tokens(self) -> int:
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
        """The encoder's input tiles of one image: 1, or the pinpoint's grid plus the whole image."""
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
        if not self.grid_pinpoints:
            return self.base_tokens
        rows, columns = self.grid_features(height, width)
        return self.base_tokens + rows * columns + rows

    @property
    def max_tokens(self) -> int:
        """The most tokens one image may take (an image of a pinpoint's shape loses no padding)."""
        if not self.grid_pinpoints:
            return self.base_tokens
        return max(self.num_tokens(h, w) for h, w in self.grid_pinpoints)

    def input_shape(self, height: int, width: int) -> tuple[int, ...]:
        """The processed image's pixel values: (channels, side, side), or (tiles, channels, side, side)."""
        side = (self.num_channels, self.image_size, self.image_size)
        return side if not self.grid_pinpoints else (self.num_tiles(height, width), *side)
