"""The prefix cache's recurrent states (vLLM's ``--mamba-cache-mode align``), for models with
recurrent layers (Mamba, Mamba-2, Gated DeltaNet, Kimi Delta Attention, lightning attention, short
convolutions).

A KV block holds its own tokens' keys and values, so a prefix hit can start a prompt after any run
of cached blocks. A recurrent layer's state instead sums up every token before it, and a request's
state row only ever holds its latest position. So a hit is only usable where the state at its end
was kept: this module keeps such states, each under the hash of the block whose end it stands at
(the hash chains the whole prefix: its tokens, salt, adapter, images), in one of a fixed number of
slots the workers hold beside the live state rows (least recently used slots are reused first).

Chunks are not cut for it (vLLM's align mode cuts them to end on block boundaries, at the cost of a
pass more for a prompt's tail): the workers' mixers split a request's chunk where a state is to be
kept and copy it out there, inside the same forward. Each pass, the scheduler asks for a request's
states at the block boundaries its chunk crosses that are worth keeping: the end of the blocks a prompt
found in the KV cache past the last state kept (a shared prefix's: the next prompt sharing it starts
there; vLLM's Marconi admission), the last boundary before the prompt's last token (where a repeat of
the prompt can start, its last token always computed) and the last boundary the chunk reaches (where
the request goes on from: its next chunk's, or its next turn's, start). A new request whose cached
blocks run past a kept state starts at the last one (its hit is cut back to it), its row restored from
the slot.

This module only decides (no torch): a pass's copies reach the workers as two maps in its
SchedulerOutput, ``recurrent_state_restores`` (req_id -> slot, copied into the request's row
before the forward) and ``recurrent_state_saves`` (req_id -> [(position, slot)]: the state after the
request's first ``position`` tokens, which lie in this pass's chunk, copied into the slot). A slot a
pass restores from or saves into is never taken by another of the same pass's saves; the workers run
passes in order, so a state saved in one pass is there for the next pass's restores.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine_core.core.kv_cache_utils import BlockHash


@dataclass
class RecurrentStateStats:
    """Counters since the previous take (exported as llm_cluster:recurrent_states_*)."""

    saved: int = 0  # states copied into a slot
    restored: int = 0  # requests that started from a kept state
    evicted: int = 0  # kept states whose slot a newer one took
    skipped: int = 0  # states not kept: every slot was one this pass restores from or saves into


class RecurrentStateCache:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the recurrent-state cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # Hash of the block a state stands at the end of -> its slot, least recently used first.
        self._slot_of: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # This pass's copies, and the slots its restores pin.
        self._restores: dict[str, int] = {}
        self._saves: dict[str, list[tuple[int, int]]] = {}
        self._pinned: set[int] = set()
        self.stats = RecurrentStateStats()

    def __len__(self) -> int:
        return len(self._slot_of)

    def longest_hit(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> int:
        """The longest run of the first ``num_blocks`` blocks (those the KV cache holds) at whose end
        a state is kept: how many blocks a prompt may skip (0: none)."""
        slot_of = self._slot_of
        for n in range(num_blocks, 0, -1):
            if block_hashes[n - 1] in slot_of:
                return n
        return 0

    def plan_restore(self, request_id: str, block_hash: BlockHash) -> None:
        """The request starts after the block ``block_hash`` (longest_hit found it): its row is
        restored from that block's state before this pass's forward."""
        slot = self._slot_of[block_hash]
        self._slot_of.move_to_end(block_hash)
        self._restores[request_id] = slot
        self._pinned.add(slot)
        self.stats.restored += 1

    def plan_save(self, request_id: str, block_hash: BlockHash, position: int,
                  supersedes: BlockHash | None = None) -> None:
        """The request's state after its first ``position`` tokens (this pass computes them) stands at
        the end of the block ``block_hash``: kept there, unless a state for that prefix is kept already
        (it would be the same one), or every slot is pinned by this pass's restores and saves.
        ``supersedes``: the state the request kept last, which this longer one makes the first to reuse
        (a conversation's next turn starts from its answer's last state, a prompt seen again from its
        last; one from part-way through is seldom asked for: shared prefixes get their own, at their
        end)."""
        if supersedes is not None and supersedes in self._slot_of:
            self._slot_of.move_to_end(supersedes, last=False)
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._pinned), None)
            if victim is None:
                self.stats.skipped += 1
                return
            slot = self._slot_of.pop(victim)
            self.stats.evicted += 1
        self._slot_of[block_hash] = slot
        self._saves.setdefault(request_id, []).append((position, slot))
        self._pinned.add(slot)
        self.stats.saved += 1

    def take_copies(self) -> tuple[dict[str, int], dict[str, list[tuple[int, int]]]]:
        """This pass's copies for the workers (restores, saves); the next pass starts afresh."""
        restores, saves = self._restores, self._saves
        self._restores, self._saves, self._pinned = {}, {}, set()
        return restores, saves

    def take_stats(self) -> RecurrentStateStats:
        stats, self.stats = self.stats, RecurrentStateStats()
        return stats

    def reset(self) -> None:
        """Forget every kept state (the prefix cache was reset); this pass's copies are dropped too."""
        self._slot_of.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._restores, self._saves, self._pinned = {}, {}, set()
