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
