"""Prompts given as embeddings instead of token ids (vLLM's ``prompt_embeds``, ``--enable-prompt-embeds``).

A client sends a [num_tokens, hidden_size] tensor (the rows the model's embedding table would give,
or rows of its own making); the model runs those rows where it would have looked up prompt tokens,
and generates tokens after them as usual. On the wire the tensor is ``PromptEmbeds``: its dtype,
shape and raw bytes (msgpack carries bytes as they are), so torch is only needed where it is turned
back into a tensor. The engine stands placeholder token ids (0) in for the rows; the rows' digests
key their KV blocks (``block_digest``), so equal embeddings share prefix-cache blocks and different
ones never do, whatever the placeholders.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch

# The dtypes a client may send (vLLM's: float32, bfloat16, float16), by name.
DTYPE_NAMES = ("float32", "float16", "bfloat16")
_ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The most bytes of embeddings one request may carry: it must fit one frame of the request channel
# (engine_core.channel.MAX_FRAME_BYTES, 256 MiB), with room for the rest of the request.
MAX_PROMPT_EMBEDS_BYTES = 240 * 2**20


class PromptEmbeds(msgspec.Struct, array_like=True, frozen=True):
    """A prompt's embeddings: ``num_tokens`` rows of ``hidden_size`` values of ``dtype``, row-major."""

    dtype: str
    num_tokens: int
    hidden_size: int
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in _ITEM_SIZES:
            raise ValueError(f"prompt embeddings must be one of {', '.join(DTYPE_NAMES)}, not {self.dtype}")
        if self.num_tokens < 1 or self.hidden_size < 1:
            raise ValueError(f"prompt embeddings must have at least one row and one column, not "
                             f"[{self.num_tokens}, {self.hidden_size}]")
        if self.num_tokens * self.row_bytes > MAX_PROMPT_EMBEDS_BYTES:
            raise ValueError(f"prompt embeddings of [{self.num_tokens}, {self.hidden_size}] {self.dtype} are "
                             f"{self.num_tokens * self.row_bytes} bytes, larger than a request may carry "
                             f"({MAX_PROMPT_EMBEDS_BYTES}): send fewer rows, or float16/bfloat16")
        if len(self.data) != self.num_tokens * self.row_bytes:
            raise ValueError(f"prompt embeddings of [{self.num_tokens}, {self.hidden_size}] {self.dtype} are "
                             f"{self.num_tokens * self.row_bytes} bytes, not {len(self.data)}")

    @property
    def row_bytes(self) -> int:
        return self.hidden_size * _ITEM_SIZES[self.dtype]

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> PromptEmbeds:
        """From a [num_tokens, hidden_size] (or [1, num_tokens, hidden_size]) float tensor."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"prompt embeddings must be a tensor, not {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            # A sparse tensor's shape can promise far more than it carries: its dense size is checked
            # before it is made (a 2 KB request must not allocate gigabytes).
            dense_bytes = math.prod(tensor.shape) * tensor.element_size()
            if dense_bytes > MAX_PROMPT_EMBEDS_BYTES:
                raise ValueError(f"prompt embeddings of shape {list(tensor.shape)} are {dense_bytes} bytes dense, "
                                 f"more than the limit ({MAX_PROMPT_EMBEDS_BYTES})")
            with torch.sparse.check_sparse_tensor_invariants():
                tensor = tensor.to_dense()
        if tensor.dim() == 3 and tensor.shape[0] == 1:
            tensor = tensor.squeeze(0)
        if tensor.dim() != 2:
            raise ValueError(f"prompt embeddings must be [num_tokens, hidden_size], not {list(tensor.shape)}")
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in _ITEM_SIZES:
            raise ValueError(f"prompt embeddings must be one of {', '.join(DTYPE_NAMES)}, not {name}")
        if not torch.isfinite(tensor).all():
            raise ValueError("prompt embeddings must be finite (no NaN or infinity)")
        rows = tensor.detach().to("cpu").contiguous()
        data = rows.view(torch.uint8).numpy().tobytes() if rows.numel() else b""
        return cls(name, int(rows.shape[0]), int(rows.shape[1]), data)

    def to_tensor(self) -> torch.Tensor:
        """The rows as a CPU tensor of their own dtype (a copy: the bytes are read-only)."""
        from engine_core.multimodal import TensorData

        return TensorData(self.dtype, (self.num_tokens, self.hidden_size), self.data).to_tensor()

    def last(self, num_tokens: int) -> PromptEmbeds:
        """The last ``num_tokens`` rows (a prompt truncated to its end, as truncate_prompt_tokens does)."""
        if num_tokens >= self.num_tokens:
            return self
        return PromptEmbeds(self.dtype, num_tokens, self.hidden_size,
                            self.data[(self.num_tokens - num_tokens) * self.row_bytes:])

    def block_digest(self, index: int, block_size: int) -> bytes | None:
        """A digest of the rows of KV block ``index`` (None past the last row): what keys the block
        beside its placeholder token ids."""
        start = index * block_size
        if start >= self.num_tokens:
            return None
        end = min(start + block_size, self.num_tokens)
        h = hashlib.blake2b(self.dtype.encode(), digest_size=16)
        h.update(self.data[start * self.row_bytes:end * self.row_bytes])
        return h.digest()


def decode_prompt_embeds(encoded: str | bytes) -> PromptEmbeds:
    """A base64 string of a ``torch.save``-d tensor (what vLLM's clients send) -> PromptEmbeds.
    ValueError says what is wrong. Only tensors load (``weights_only``): no code runs."""
    import torch

    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"prompt_embeds must be base64 (of a torch.save-d tensor): {e}") from None
    try:
        # Sparse tensors' indices are checked as they load: torch leaves them unchecked by default, and
        # a crafted one (an index far past its shape) made to_dense() write out of bounds and crash
        # the process (vLLM's CVE-2025-62164, fixed the same way).
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # (whatever the unpickler met: a truncated file, a refused type, bad indices)
        raise ValueError(f"prompt_embeds is not a torch.save-d tensor: {e}") from None
    try:
        return PromptEmbeds.from_tensor(tensor)
    except ValueError:
        raise
    except Exception as e:  # (a malformed tensor torch itself refuses: the client's error, not ours)
        raise ValueError(f"prompt_embeds is not a valid tensor: {e}") from None


def encode_prompt_embeds(tensor: torch.Tensor) -> str:
    """A tensor as clients send it: base64 of its ``torch.save`` bytes (vLLM's tensor2base64)."""
    import torch

    buffer = io.BytesIO()
    torch.save(tensor.detach().to("cpu").contiguous(), buffer)
    return base64.b64encode(buffer.getvalue()).decode()
