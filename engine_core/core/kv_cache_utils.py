"""KV cache building blocks: the block record, the O(1) LRU free queue, and chained block hashes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_core.multimodal import MultiModalFeature
    from engine_core.prompt_embeds import PromptEmbeds

BlockHash = bytes

# Parent hash of a request's first block. A constant, so hashes are stable across processes and
# restarts (unlike Python's hash(), which is salted per process for str/bytes).
NONE_HASH: BlockHash = hashlib.blake2b(b"llm-cluster/kv-root", digest_size=16).digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int],
                      extra_keys: tuple[object, ...] | None = None) -> BlockHash:
    """Hash of one full block, chained on its parent so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def first_block_keys(cache_salt: str | None = None, lora_key: tuple[int, str] | None = None,
                     long_rope: bool = False) -> tuple[object, ...] | None:
    """The extra keys of a request's first block: its cache salt and its LoRA adapter (id, name).
    KV computed under one adapter is wrong for every other one, so an adapter keys its own prefixes.
    ``long_rope``: a LongRoPE model computes a prompt longer than its pretrained length with other
    rotary factors than a shorter one, so the two never share blocks."""
    keys: tuple[object, ...] = ()
    if cache_salt:  # (tagged: a salt must never equal another key, such as the "longrope" marker)
        keys += (("salt", cache_salt),)
    if lora_key is not None:
        keys += (("lora", *lora_key),)
    if long_rope:
        keys += ("longrope",)
    return keys or None


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int,
                        block_size: int, cache_salt: str | None = None,
                        lora_key: tuple[int, str] | None = None, long_rope: bool = False,
                        prompt_embeds: PromptEmbeds | None = None,
                        mm_features: list[MultiModalFeature] | None = None) -> None:
    """Grow ``block_hashes`` in place to cover the first ``num_blocks`` full blocks of ``token_ids``.
    ``prompt_embeds``: the prompt's embedding rows, whose digest keys each block they reach into
    (their token ids are placeholders); ``mm_features``: its images, whose identifiers key each block
    their placeholders reach into (vLLM's multimodal extra keys)."""
    start = len(block_hashes)
    parent = block_hashes[-1] if block_hashes else NONE_HASH
    for i in range(start, num_blocks):
        # The salt and the adapter key the first block only: later blocks inherit them through the chain.
        extra = first_block_keys(cache_salt, lora_key, long_rope) if i == 0 else None
        if prompt_embeds is not None:
            digest = prompt_embeds.block_digest(i, block_size)
            if digest is not None:
                extra = (*(extra or ()), ("embeds", digest))
        if mm_features:
            first, end = i * block_size, (i + 1) * block_size
            images = tuple(("mm", f.identifier) for f in mm_features if f.offset < end and f.end > first)
            if images:
                extra = (*(extra or ()), *images)
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        block_hashes.append(parent)


@dataclass(frozen=True)
class AttentionWindow:
    """The keys a KV cache group's layers attend to: the query at position p sees those from
    p - size + 1 on (a sliding window), or, ``chunked``, those of its chunk, from p - p % size
    (Llama 4's local layers)."""

    size: int
    chunked: bool = False

    def first_key(self, position: int) -> int:
        """The first key the query at ``position`` sees."""
        return position // self.size * self.size if self.chunked else max(position - self.size + 1, 0)

    def max_blocks_held(self, pass_tokens: int, block_size: int) -> int:
        """The most blocks a request holds under this window, with those behind it released: the keys
        before its next token's (size - 1 at most), one pass's tokens, and a block where they
        straddle block edges (vLLM's bound)."""
        return -(-(self.size - 1 + pass_tokens) // block_size) + 1


def blocks_held_bound(num_tokens: int, windows: Sequence[AttentionWindow | None], pass_tokens: int,
                      block_size: int) -> int:
    """The blocks a request of ``num_tokens`` tokens can hold at once over KV cache groups whose
    layers attend within ``windows`` (None: full attention, every block kept)."""
    num_blocks = -(-num_tokens // block_size)
    return sum(num_blocks if w is None else min(num_blocks, w.max_blocks_held(pass_tokens, block_size))
               for w in windows)


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "in_hit_window", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache.
        self.block_hash: BlockHash | None = None
        # A windowed KV cache group's cached block within the window a later prompt's hit would need (KV
        # offloading's tier saves such blocks alone of a windowed group's); cleared with its hash.
        self.in_hit_window = False
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (least recently freed at the front).

    Removing a block from the middle (a prefix hit on a free cached block) is O(1), which a
    deque cannot do.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev_b, next_b = block.prev_free, block.next_free
        if prev_b is None or next_b is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev_b.next_free = next_b
        next_b.prev_free = prev_b
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free
