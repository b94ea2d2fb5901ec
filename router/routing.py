"""Routing policies: which engine gets a request.

Every policy sees the same ``RoutingContext`` (the prompt's tokens, the session header, each
engine's in-flight count as this router knows it, and which engines are healthy) and returns an
engine index among the healthy ones.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine_core.core.block_pool import ALL_BLOCKS_CLEARED, BLOCKS_REMOVED, BLOCKS_STORED, TIER_REMOVED, TIER_STORED
from engine_core.core.kv_cache_utils import extend_block_hashes
from engine_core.multimodal import MultiModalFeature
from engine_core.prompt_embeds import PromptEmbeds

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "session")


class NoHealthyEngineError(RuntimeError):
    pass


@dataclass
class RoutingContext:
    prompt_token_ids: list[int]
    loads: list[int]
    healthy: list[bool]
    session_id: str | None = None
    # (id, name) of the LoRA adapter the request runs under: its KV, and so its prefixes, are its own.
    lora_key: tuple[int, str] | None = None
    # The request's cache_salt: its blocks' hashes are salted in the engine, so here too.
    cache_salt: str | None = None
    # A prompt given as embeddings: their digests key its blocks, as in the engine.
    prompt_embeds: PromptEmbeds | None = None
    # A prompt's images: their identifiers key the blocks they reach into, as in the engine.
    mm_features: list[MultiModalFeature] | None = None
    # Per engine, the LoRA adapters in use there, by lora_key (what the engine reports, and this
    # router's own requests in flight; LoRA affinity, see LeastLoadedPolicy; None: not known).
    active_adapters: list[dict[tuple[int, str], int]] | None = None

    def healthy_indices(self) -> list[int]:
        indices = [i for i, ok in enumerate(self.healthy) if ok]
        if not indices:
            raise NoHealthyEngineError("no healthy engine")
        return indices


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, ctx: RoutingContext) -> int: ...


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, ctx: RoutingContext) -> int:
        n = len(ctx.healthy)
        for _ in range(n):
            i = self._next % n
            self._next += 1
            if ctx.healthy[i]:
                return i
        raise NoHealthyEngineError("no healthy engine")


class LeastLoadedPolicy(RoutingPolicy):
    """Power of two choices: sample two healthy engines, take the one with fewer requests in flight.

    LoRA affinity (with ``max_loras``, the engines' adapter slots per batch): an engine's batch
    mixes at most ``max_loras`` adapters and holds a request of one more back until one drains, so a
    request under an adapter goes only to engines already running it or with an adapter slot free;
    of those, to the least loaded one running it unless that is ``lora_load_margin`` requests above
    the least loaded of them (then the choice is among them all, by load). Load alone decides when
    no engine can take it without holding it back, or when those that can are ``load_margin``
    requests above the least loaded engine (a free adapter slot is not worth an unbounded queue).
    (The LoRA affinity scorer of the Gateway API inference extension, llm-d's scheduler, ranks
    engines the same way.) An adapter is known by its id and name: requests under an earlier load of
    a reloaded adapter are another adapter to the engines.
    """

    name = "least_loaded"
    # How many requests more an engine running the adapter may have than one with a free slot and
    # still be preferred (leaving that slot to another adapter).
    lora_load_margin = 1

    def __init__(self, seed: int | None = None, max_loras: int = 0, load_margin: int = 8) -> None:
        self._rng = random.Random(seed)
        self.max_loras = max_loras
        self.load_margin = load_margin

    def choose(self, ctx: RoutingContext) -> int:
        candidates = ctx.healthy_indices()
        if len(candidates) == 1:
            return candidates[0]
        if self.max_loras and ctx.lora_key is not None and ctx.active_adapters is not None:
            candidates = self.lora_candidates(ctx, candidates)
            if len(candidates) == 1:
                return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if ctx.loads[a] <= ctx.loads[b] else b

    def lora_candidates(self, ctx: RoutingContext, healthy: list[int]) -> list[int]:
        """The engines a request under an adapter may go to (see the class's description)."""
        active, key = ctx.active_adapters, ctx.lora_key
        assert active is not None and key is not None
        fits = [i for i in healthy if key in active[i] or len(active[i]) < self.max_loras]
        least = min(ctx.loads[i] for i in healthy)
        if not fits or min(ctx.loads[i] for i in fits) - least > self.load_margin:
            return healthy
        running = [i for i in fits if key in active[i]]
        if running:
            best = min(running, key=lambda i: ctx.loads[i])
            if ctx.loads[best] - min(ctx.loads[i] for i in fits) <= self.lora_load_margin:
                return [best]
        return fits


class PrefixAwarePolicy(RoutingPolicy):
    """Send a prompt to the engine whose prefix cache holds the longest run of its blocks.

    Each engine reports what its prefix cache holds (KV cache events over the request channel: a
    snapshot when the router connects, then every block stored, evicted or cleared), so every router
    replica knows what every engine caches, whichever replica sent the requests that filled it, and
    forgets a prefix once the engine evicts it. The chained block hashes are the engine's own (same
    hash, block size and LoRA key). Prompts this replica has just sent count too until their blocks
    are reported (``pending_ttl_s``), so a burst sharing a prefix goes to one engine before the first
    prefill ends; from an engine that reports no events, they are all the policy knows (a bounded LRU).
    A request's ``cache_salt`` keys its first block as the engines key it, so salted prompts match
    only blocks cached under the same salt.

    Ties go to the less loaded of the matching engines and misses to the least-loaded policy (power
    of two choices, with its LoRA affinity); a match on an engine loaded more than ``load_margin``
    requests above the least loaded one goes to that least loaded engine instead (a cache hit is not
    worth an unbounded queue).
    """

    name = "prefix_aware"

    def __init__(self, num_engines: int, block_size: int = 16, load_margin: int = 8,
                 max_blocks_per_engine: int = 200_000, seed: int | None = None,
                 pending_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 long_rope_after: int | None = None, max_loras: int = 0) -> None:
        self.block_size = block_size
        # LongRoPE models: the engines key a prompt longer than this apart; so do we, to match them.
        self.long_rope_after = long_rope_after
        self.load_margin = load_margin
        self.max_blocks_per_engine = max_blocks_per_engine
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock
        # Blocks this replica routed to each engine (hash -> when), not yet reported cached.
        self._known: list[OrderedDict[bytes, float]] = [OrderedDict() for _ in range(num_engines)]
        # What each engine reports its prefix cache holds; None until it reports (no events from it).
        self._cached: list[set[bytes] | None] = [None] * num_engines
        # What each engine's KV offloading tier holds (host memory: copied back instead of computed).
        self._tiered: list[set[bytes]] = [set() for _ in range(num_engines)]
        self._fallback = LeastLoadedPolicy(seed, max_loras=max_loras, load_margin=load_margin)

    def match_lengths(self, block_hashes: list[bytes], include_sent: bool = True) -> list[int]:
        """Per engine, the leading blocks it holds: those in its KV cache (or just sent there, unless
        not ``include_sent``), then those its host tier holds after them, as the engine looks them up."""
        lengths = []
        oldest_pending = self._clock() - self.pending_ttl_s
        for known, cached, tiered in zip(self._known, self._cached, self._tiered, strict=True):
            n = 0
            for h in block_hashes:
                if cached is not None and h in cached:
                    n += 1
                    continue
                if not include_sent:
                    break
                sent = known.get(h)
                if sent is None or (cached is not None and sent < oldest_pending):
                    break
                n += 1
            if tiered:
                for h in block_hashes[n:]:
                    if h not in tiered:
                        break
                    n += 1
            lengths.append(n)
        return lengths

    def apply_kv_events(self, engine: int, events: list[tuple[int, list[bytes]]]) -> None:
        """One engine's KV cache events, in order (engine_core.core.block_pool's kinds)."""
        cached = self._cached[engine]
        if cached is None:
            cached = self._cached[engine] = set()
        known = self._known[engine]
        for kind, hashes in events:
            if kind == BLOCKS_STORED:
                cached.update(hashes)
                for h in hashes:
                    known.pop(h, None)
            elif kind == BLOCKS_REMOVED:
                cached.difference_update(hashes)
                for h in hashes:
                    known.pop(h, None)
            elif kind == ALL_BLOCKS_CLEARED:
                cached.clear()
                known.clear()
                self._tiered[engine].clear()
            elif kind == TIER_STORED:
                self._tiered[engine].update(hashes)
            elif kind == TIER_REMOVED:
                self._tiered[engine].difference_update(hashes)

    def num_cached_blocks(self) -> list[int | None]:
        """Blocks each engine reports cached (None: it reports nothing)."""
        return [None if cached is None else len(cached) for cached in self._cached]

    def _block_hashes(self, ctx: RoutingContext) -> list[bytes]:
        block_hashes: list[bytes] = []
        num_tokens = len(ctx.prompt_token_ids)
        extend_block_hashes(block_hashes, ctx.prompt_token_ids, num_tokens // self.block_size, self.block_size,
                            cache_salt=ctx.cache_salt, lora_key=ctx.lora_key,
                            long_rope=self.long_rope_after is not None and num_tokens > self.long_rope_after,
                            prompt_embeds=ctx.prompt_embeds, mm_features=ctx.mm_features)
        return block_hashes

    def cached_tokens(self, ctx: RoutingContext, engine: int) -> int:
        """The prompt's leading tokens that ``engine`` reports it holds (prompts just sent there, and
        this one among them, not counted: their blocks may never be computed there)."""
        return self.match_lengths(self._block_hashes(ctx), include_sent=False)[engine] * self.block_size

    def choose(self, ctx: RoutingContext) -> int:
        healthy = ctx.healthy_indices()
        block_hashes = self._block_hashes(ctx)
        lengths = self.match_lengths(block_hashes)
        least = min(healthy, key=lambda i: ctx.loads[i])
        best = max(healthy, key=lambda i: (lengths[i], -ctx.loads[i]))
        if lengths[best] == 0:
            best = self._fallback.choose(ctx)
        elif ctx.loads[best] - ctx.loads[least] > self.load_margin:
            # (Under an adapter: the least loaded of the engines its slots allow, as LoRA affinity sees them.)
            if ctx.lora_key is not None and self._fallback.max_loras and ctx.active_adapters is not None:
                least = min(self._fallback.lora_candidates(ctx, healthy), key=lambda i: ctx.loads[i])
            best = least
        self._remember(best, block_hashes)
        return best

    def _remember(self, engine: int, block_hashes: list[bytes]) -> None:
        known, cached, now = self._known[engine], self._cached[engine], self._clock()
        for h in block_hashes:
            if cached is not None and h in cached:
                continue
            known[h] = now
            known.move_to_end(h)
        while len(known) > self.max_blocks_per_engine:
            known.popitem(last=False)

    def forget_engine(self, engine: int) -> None:
        """An engine came back after being unhealthy. What this replica routed there is forgotten.
        What an engine reports stays: a real restart clears it through the engine's own events (its
        cache reset, or the snapshot of a new channel), while a health flap leaves the cache intact."""
        self._known[engine].clear()


class SessionAffinityPolicy(RoutingPolicy):
    """Consistent hashing of the ``x-session-id`` header over the healthy engines.

    A session keeps its engine while that engine is healthy; when engines come or go only the
    sessions of the affected engine move. Requests without a session id go to the least loaded.
    """

    name = "session"
    _VNODES = 64

    def __init__(self, num_engines: int, seed: int | None = None) -> None:
        ring = []
        for engine in range(num_engines):
            for v in range(self._VNODES):
                ring.append((self._hash(f"engine-{engine}#{v}"), engine))
        ring.sort()
        self._ring_keys = [k for k, _ in ring]
        self._ring_engines = [e for _, e in ring]
        self._fallback = LeastLoadedPolicy(seed)

    @staticmethod
    def _hash(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")

    def choose(self, ctx: RoutingContext) -> int:
        if not ctx.session_id:
            return self._fallback.choose(ctx)
        ctx.healthy_indices()
        start = bisect.bisect(self._ring_keys, self._hash(ctx.session_id))
        n = len(self._ring_keys)
        for step in range(n):
            engine = self._ring_engines[(start + step) % n]
            if ctx.healthy[engine]:
                return engine
        raise NoHealthyEngineError("no healthy engine")


def create_routing_policy(name: str, num_engines: int, block_size: int = 16, load_margin: int = 8,
                          seed: int | None = None, long_rope_after: int | None = None,
                          max_loras: int = 0) -> RoutingPolicy:
    """``max_loras``: the engines' LoRA adapters per batch (0: LoRA off), for LoRA affinity
    (least_loaded, and prefix_aware where no engine holds a prompt's prefix)."""
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy(seed, max_loras=max_loras, load_margin=load_margin)
    if name == "prefix_aware":
        return PrefixAwarePolicy(num_engines, block_size=block_size, load_margin=load_margin, seed=seed,
                                 long_rope_after=long_rope_after, max_loras=max_loras)
    if name == "session":
        return SessionAffinityPolicy(num_engines, seed=seed)
    raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, got {name!r}")
