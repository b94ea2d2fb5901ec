"""The scheduler's account of the workers' encoder cache (vLLM's ``EncoderCacheManager``).

The workers keep each encoded image's rows (its ``length`` embeddings) by identifier. This is how
many rows that cache may hold (``cache_size``) and which requests still need each entry. An entry
no running request needs stays cached, "freeable", so a later prompt with the same image skips the
encoder; it is evicted (oldest first) only when a new image needs the room, and the identifiers
evicted since the last pass are told to the workers (``get_freed_mm_hashes``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_core.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        # Rows not taken by any entry, and rows taken or freeable (what eviction could make free).
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # identifier -> ids of the requests that need it (empty: freeable, kept until evicted).
        self.cached: dict[str, set[str]] = {}
        # Unreferenced entries, oldest first: identifier -> its rows.
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Whether the image is cached already; if so, ``request`` now holds it (a freeable entry
        is taken back from the freeable list)."""
        identifier = request.mm_features[input_id].identifier
        holders = self.cached.get(identifier)
        if holders is None:
            return False
        if not holders:
            self.num_freeable_slots -= self.freeable.pop(identifier)
        holders.add(request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        """Whether the image fits this pass's encoder budget, and the cache beside the
        ``num_embeds_to_schedule`` rows already planned this pass (evicting freeable entries,
        oldest first, to make room when that is enough)."""
        num_embeds = request.mm_features[input_id].length
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            self._evict_oldest()
        return True

    def _evict_oldest(self) -> None:
        """Drop the oldest entry no request holds; the workers are told with the next pass."""
        identifier, rows = self.freeable.popitem(last=False)
        del self.cached[identifier]
        self.freed.append(identifier)
        self.num_free_slots += rows

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve the image's rows for ``request`` (the workers encode it in this pass)."""
        feature = request.mm_features[input_id]
        self.cached.setdefault(feature.identifier, set()).add(request.request_id)
        self.num_free_slots -= feature.length
        self.num_freeable_slots -= feature.length

    def get_cached_input_ids(self, request: Request) -> set[int]:
        return {i for i, f in enumerate(request.mm_features or ()) if f.identifier in self.cached}

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """``request`` no longer needs the image (its rows are in the KV cache, or it left); the
        entry becomes freeable when nobody does."""
        feature = request.mm_features[input_id]
        holders = self.cached.get(feature.identifier)
        if not holders:
            return
        holders.discard(request.request_id)
        if not holders:
            self.freeable[feature.identifier] = feature.length
            self.num_freeable_slots += feature.length

    def free(self, request: Request) -> None:
        """Drop every hold of ``request`` (finished, aborted or preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def evict_freeable(self) -> None:
        """Evict every entry no request holds (a prefix-cache reset: new weights may follow)."""
        while self.freeable:
            self._evict_oldest()

    def reset(self) -> None:
        """Forget every entry (the workers drop theirs: sleep); holds of waiting requests go too
        (their images are encoded again when their chunks reach them)."""
        self.cached.clear()
        self.freeable.clear()
        self.freed.clear()
        self.num_free_slots = self.num_freeable_slots = self.cache_size

    def get_freed_mm_hashes(self) -> list[str]:
        """The entries evicted since the last call: the workers drop their rows."""
        freed, self.freed = self.freed, []
        return freed

    def forget(self, identifier: str, rows: int) -> None:
        """Undo this pass's ``allocate`` of an image that will not be encoded after all (the request
        that was to encode it was preempted in the same pass): nothing may find it cached."""
        holders = self.cached.pop(identifier, None)
        if holders is None:
            return
        if holders:  # (a held entry's rows count in neither the free nor the freeable slots)
            self.num_freeable_slots += rows
        else:
            self.freeable.pop(identifier)
        self.num_free_slots += rows
