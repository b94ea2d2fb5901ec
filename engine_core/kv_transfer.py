"""Prefill/decode disaggregation: a prompt's KV cache computed on one engine, decoded on another.

The protocol is vLLM's KV connector protocol (as its NixlConnector speaks it), so a proxy written
for vLLM's disaggregated serving (llm-d's sidecar, vLLM's toy proxy) drives these engines as they are:

1. The prefill engine (``kv_role`` kv_producer or kv_both) gets the request with ``max_tokens`` 1 and
   ``kv_transfer_params: {"do_remote_decode": true}``. It computes the prompt and, when the request
   ends at its length limit, keeps the prompt's KV blocks and answers with the parameters that name
   them: ``{"do_remote_prefill": true, "remote_engine_id", "remote_request_id", "remote_block_ids",
   ...}``.
2. The decode engine (kv_consumer or kv_both) gets the request with those parameters. At admission
   its scheduler looks up its own prefix cache, allocates blocks for the rest of the prompt but its
   last token, and parks the request as WAITING_FOR_REMOTE_KVS while the engine reads the producer's
   blocks into them. Then the request runs as if those tokens had been computed here: its next pass
   computes the last prompt token and samples the first output token from it.
3. The producer frees the blocks once they were read, or when nobody read them in
   ``abort_request_timeout`` seconds (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by default).
   A decode engine gives up on a read that has not answered in ``load_timeout`` seconds (a producer
   alive but stuck: 120 s by default) and treats it as failed.

The KV data moves through Ray: the decode engine calls the producer engine actor, whose workers
gather the blocks into host tensors that Ray carries between the nodes (``RayKVConnector``). A read
that fails (the producer gone, its blocks expired) makes the decode engine compute the prompt itself
(vLLM's ``kv_load_failure_policy`` "recompute"), or fail the request ("fail").

Under the hybrid KV cache manager (a model mixing windowed and full-attention layers) the parameters
also name each windowed KV cache group's blocks (``remote_group_block_ids``, null where released), and
the decode engine reads, beside the full group's blocks, each windowed group's blocks of the window of
the token it computes first; both engines must keep the same groups (else it computes the prompt).

This module holds the configuration and the scheduler's half (what to load, what to hold); the
engine core moves the data (engine_core.engine_core) and the workers read and write the blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engine_core.request import RequestStatus

if TYPE_CHECKING:
    from engine_core.request import Request

logger = logging.getLogger(__name__)

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
# The connector built here, and vLLM's names taken for it: a config written for vLLM's disaggregated
# serving starts these engines unchanged (the protocol is the same; the data moves through Ray).
CONNECTOR = "RayKVConnector"
CONNECTOR_ALIASES = ("NixlConnector", "P2pNcclConnector")
# vLLM's connectors that keep KV in host memory or storage: KV offloading here (--kv-offloading-size).
HOST_MEMORY_CONNECTORS = ("OffloadingConnector", "LMCacheConnectorV1", "SharedStorageConnector")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0
DEFAULT_LOAD_TIMEOUT_S = 120.0
_EXTRA_KEYS = ("abort_request_timeout", "load_timeout")
# vLLM's kv-transfer-config keys that change nothing here (they tune vLLM's own transports).
_NEUTRAL_KEYS = frozenset({"engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size",
                           "kv_ip", "kv_port", "kv_connector_module_path"})


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's --kv-transfer-config, as far as it applies here."""

    kv_role: KVRole = "kv_both"
    kv_connector: str = CONNECTOR
    # What a decode engine does when it cannot read the producer's blocks: compute the prompt itself
    # ("recompute") or fail the request ("fail").
    kv_load_failure_policy: str = "recompute"
    # How long a producer keeps a finished prefill's blocks for its decode engine to read.
    abort_request_timeout_s: float = DEFAULT_ABORT_REQUEST_TIMEOUT_S
    # How long a decode engine waits for a producer to answer a read before it counts as failed.
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, "
                             f"got {self.kv_role!r}")
        if self.kv_connector != CONNECTOR and self.kv_connector not in CONNECTOR_ALIASES:
            raise ValueError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not built here; "
                             f"{CONNECTOR} moves KV blocks between engines through Ray "
                             f"({', '.join(CONNECTOR_ALIASES)} are taken as it)")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config: kv_load_failure_policy must be one of "
                             f"{', '.join(LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        for key, value in (("abort_request_timeout", self.abort_request_timeout_s),
                           ("load_timeout", self.load_timeout_s)):
            if isinstance(value, bool) or not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"kv_transfer_config: kv_connector_extra_config.{key} must be a number of "
                                 f"seconds > 0, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | str | None) -> KVTransferConfig | None:
        """vLLM's JSON form: {"kv_connector": "NixlConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"abort_request_timeout": 480,
        "load_timeout": 120}}."""
        if data is None:
            return None
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_config: expected an object, got {data!r}")
        data = dict(data)
        connector = data.get("kv_connector") or CONNECTOR
        if connector in HOST_MEMORY_CONNECTORS:
            raise ValueError(f"kv_transfer_config: {connector} is not built here; for KV blocks kept in host memory "
                             "pass --kv-offloading-size GIB")
        if "kv_role" not in data:
            raise ValueError("kv_transfer_config: kv_role is required (kv_producer, kv_consumer or kv_both)")
        extra = data.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra, dict):
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config must be an object, got {extra!r}")
        unknown = set(extra) - set(_EXTRA_KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config {sorted(unknown)} is not taken here "
                             f"(only {', '.join(_EXTRA_KEYS)})")
        for key in _NEUTRAL_KEYS & set(data):
            logger.info("kv_transfer_config: %s changes nothing here (KV blocks move through Ray)", key)
            data.pop(key)
        unknown = set(data) - {"kv_role", "kv_connector", "kv_load_failure_policy"}
        if unknown:
            raise ValueError(f"kv_transfer_config: {sorted(unknown)} not taken (kv_connector, kv_role, "
                             "kv_load_failure_policy, kv_connector_extra_config)")
        return cls(kv_role=data["kv_role"], kv_connector=connector,
                   kv_load_failure_policy=data.get("kv_load_failure_policy") or "recompute",
                   abort_request_timeout_s=extra.get("abort_request_timeout", DEFAULT_ABORT_REQUEST_TIMEOUT_S),
                   load_timeout_s=extra.get("load_timeout", DEFAULT_LOAD_TIMEOUT_S))

    def as_dict(self) -> dict[str, Any]:
        return {"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                "kv_load_failure_policy": self.kv_load_failure_policy,
                "kv_connector_extra_config": {"abort_request_timeout": self.abort_request_timeout_s,
                                              "load_timeout": self.load_timeout_s}}


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and bool(params.get("do_remote_decode"))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params) and bool(params.get("do_remote_prefill"))


def _prefill_key(params: dict[str, Any]) -> tuple[str, str, str]:
    return (str(params.get("remote_namespace")), str(params.get("remote_engine_id")),
            str(params.get("remote_request_id")))


def kv_digest(token_ids: list[int], lora_name: str | None) -> str:
    """What a KV read is checked against on both sides: the tokens whose KV it carries, under the
    adapter they were computed with (the decode engine must not take another prompt's KV into its
    prefix cache under its own prompt's hashes, whatever parameters a client sends)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((lora_name, list(token_ids))).encode())
    return digest.hexdigest()


def _is_block_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass
class PendingLoad:
    """Blocks a decode engine reads from a producer before the request can run."""

    request_id: str
    # This engine's blocks to fill, and the producer's that hold the same tokens (as many).
    block_ids: list[int]
    remote_block_ids: list[int]
    # The producer's parameters (remote_engine_id, remote_request_id, ...).
    params: dict[str, Any]
    # kv_digest of the prompt's tokens the blocks hold, up to the last full or partial block read.
    digest: str = ""
    num_tokens: int = 0
    # Where block_ids start among the prompt's blocks (the producer hands out that slice of its own).
    first_block: int = 0
    # Under the hybrid KV cache manager, the windowed groups' blocks of the window of the first token
    # computed here (after the local hit), every group's one after another, and the producer's at the
    # same positions (-1 where it holds none). A block id is a page of each shared KV tensor, whichever
    # group holds it, so they travel as group 0's do.
    group_block_ids: list[int] = field(default_factory=list)
    remote_group_block_ids: list[int] = field(default_factory=list)


@dataclass
class _Held:
    request: Request
    block_ids: list[int]
    deadline: float
    # Readers still to come (one per choice of the request the prefill was for): each reads or
    # gives up once; the blocks go back when none is left.
    readers: int = 1
    # A random value the parameters carry: reads and releases must name it (a request id alone, which
    # a client sees, must not let it read or free another client's prefill).
    nonce: str = ""
    # The windowed KV cache groups' blocks it holds (the hybrid KV cache manager's).
    group_block_ids: frozenset[int] = frozenset()


class KVConnector:
    """The scheduler's half of the connector: which blocks a consumer loads, which a producer holds."""

    def __init__(self, config: KVTransferConfig, block_size: int, engine_id: dict[str, Any],
                 clock: Callable[[], float] = time.monotonic,
                 group_window_starts: Callable[[int], list[int]] | None = None) -> None:
        self.config = config
        self.block_size = block_size
        # Under the hybrid KV cache manager: each windowed group's first block the token at a position
        # attends to (the KV cache manager's); both engines of a transfer must keep the same groups.
        self.group_window_starts = group_window_starts
        self.num_kv_cache_groups = 1 + (len(group_window_starts(0)) if group_window_starts is not None else 0)
        # What a consumer needs to find this engine (its actor name and namespace, tp_size, ...).
        self.engine_id = dict(engine_id)
        self._clock = clock
        self._pending: list[PendingLoad] = []
        self._held: dict[str, _Held] = {}
        # Producers' parameters this engine will not read (the prompt computed here after all, the
        # request gone first): each producer is told, so it frees the blocks at once.
        self._declined: list[dict[str, Any]] = []
        # The request reading each producer's prefill into this engine (the choices of one prompt share
        # one prefill: the others wait for its blocks to be cached here, then take them as a prefix hit).
        self._readers: dict[tuple[str, str, str], Request] = {}

    # -- consumer ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local_computed_tokens: int) -> int:
        """Prompt tokens after the local prefix hit that the request's producer computed and this
        engine reads instead (0: none; the request computes its prompt here). The last prompt token
        is always computed here: its logits give the first output token."""
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0
        assert params is not None
        count = request.num_prompt_tokens - 1 - num_local_computed_tokens
        remote = params.get("remote_block_ids")
        if not self.config.is_consumer or count <= 0 or request.prompt_embeds is not None or request.mm_features:
            self.decline(request)  # (not a consumer; its own cache holds the prompt; embeddings, images: computed here)
            return 0
        if not isinstance(remote, list) or len(remote) < -(-(request.num_prompt_tokens - 1) // self.block_size):
            logger.warning("request %s: the producer's parameters name fewer blocks than its prompt has; "
                           "computing the prompt here", request.request_id)
            self.decline(request)
            return 0
        groups = params.get("remote_group_block_ids") or []
        if not isinstance(groups, list) or len(groups) + 1 != self.num_kv_cache_groups:
            logger.warning("request %s: the producer keeps %d KV cache groups, this engine %d (the same model and "
                           "--disable-hybrid-kv-cache-manager on both); computing the prompt here", request.request_id,
                           len(groups) + 1 if isinstance(groups, list) else 0, self.num_kv_cache_groups)
            self.decline(request)
            return 0
        # Every block to read named, each windowed group's within the window of the token computed here.
        first = num_local_computed_tokens // self.block_size
        end = -(-(request.num_prompt_tokens - 1) // self.block_size)
        wanted = [remote[first:end]]
        if groups:
            assert self.group_window_starts is not None
            for start, ids in zip(self.group_window_starts(request.num_prompt_tokens - 1), groups, strict=True):
                start = max(start, first)
                wanted.append(ids[start:end] if isinstance(ids, list) and len(ids) >= end else [None])
        if not all(_is_block_id(b) for ids in wanted for b in ids):
            logger.warning("request %s: the producer's parameters do not name every block of the prompt it holds "
                           "(released behind a window, or other windows than this engine's); computing the "
                           "prompt here", request.request_id)
            self.decline(request)
            return 0
        return count

    def waits_for_sibling(self, request: Request) -> bool:
        """Whether another request is reading the same prefill into this engine (another choice of its
        prompt), not yet admitted to run: this one waits (no lookup, no blocks) until it runs, and then
        finds the prompt in the prefix cache instead of reading it again."""
        params = request.kv_transfer_params
        if not self.config.is_consumer or not wants_remote_prefill(params):
            return False
        assert params is not None
        first = self._readers.get(_prefill_key(params))
        if first is None or first is request:
            return False
        if first.status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING):
            return True
        del self._readers[_prefill_key(params)]  # (it runs, or ended: the wait is over)
        return False

    def _note_reader(self, request: Request, params: dict[str, Any]) -> None:
        waiting = (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING)
        # (Readers that run or ended by now are forgotten: at most the prefills being read here stay.)
        self._readers = {key: first for key, first in self._readers.items() if first.status in waiting}
        self._readers.setdefault(_prefill_key(params), request)

    def decline(self, request: Request) -> None:
        """The request will not read the blocks its parameters name (computed here, or gone): its
        producer is told to free them."""
        if self.decline_params(request.kv_transfer_params):  # (a prefill's own do_remote_decode stays)
            request.kv_transfer_params = None

    def decline_params(self, params: dict[str, Any] | None) -> bool:
        """Tell the producer these parameters name that they will not be read (a request dropped
        before the scheduler saw it); False when they name no remote prefill."""
        if not wants_remote_prefill(params):
            return False
        assert params is not None
        self._declined.append(params)
        return True

    def take_declined(self) -> list[dict[str, Any]]:
        declined, self._declined = self._declined, []
        return declined

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local_computed_tokens: int,
                                 num_external_tokens: int, group_blocks: list[tuple[int, list[int]]] = ()) -> None:
        """The request got its blocks: the ones after its local hit are read from the producer, and of each
        windowed KV cache group's (``group_blocks``: the first position the first token computed here
        attends to, and the request's block ids from there) those after the local hit."""
        params = request.kv_transfer_params
        assert params is not None
        if isinstance(params.get("num_readers"), int) and params["num_readers"] > 1:
            self._note_reader(request, params)
        first = num_local_computed_tokens // self.block_size
        num_tokens = num_local_computed_tokens + num_external_tokens
        end = -(-num_tokens // self.block_size)
        lora = request.lora_request
        local_groups: list[int] = []
        remote_groups: list[int] = []
        for (start, ids), remote in zip(group_blocks, params.get("remote_group_block_ids") or [], strict=True):
            positions = range(max(start, first), end)
            local_groups += [ids[p - start] for p in positions]
            remote_groups += [int(remote[p]) for p in positions]  # (checked in get_num_new_matched_tokens)
        self._pending.append(PendingLoad(
            request.request_id, block_ids[first:end], [int(b) for b in params["remote_block_ids"][first:end]],
            dict(params), kv_digest(request.all_token_ids[:num_tokens], lora.lora_name if lora else None),
            num_tokens, first, local_groups, remote_groups))
        # Read once: a preemption later computes the prompt here (the producer has let the blocks go).
        request.kv_transfer_params = None

    def take_pending_loads(self) -> list[PendingLoad]:
        pending, self._pending = self._pending, []
        return pending

    # -- producer ---------------------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int],
                         group_block_ids: list[list[int | None]] = ()) -> dict[str, Any] | None:
        """A request ends. A prefill for a remote decode that ran to its length limit keeps its blocks
        (returns the parameters that name them: the caller must not free them; under the hybrid KV
        cache manager each windowed group's too, None where released); None otherwise. A decode
        request that never read its producer's blocks tells the producer to free them."""
        params = request.kv_transfer_params
        if wants_remote_prefill(params):  # (a decode request that ends before it read: gone first)
            self.decline(request)
            return None
        if (not self.config.is_producer or not wants_remote_decode(params)
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids):
            return None
        assert params is not None
        readers = params.get("num_readers", 1)
        nonce = secrets.token_hex(8)
        self._held[request.request_id] = _Held(
            request, list(block_ids), self._clock() + self.config.abort_request_timeout_s,
            readers if isinstance(readers, int) and readers >= 1 else 1, nonce,
            frozenset(b for ids in group_block_ids for b in ids if b is not None))
        held = self._held[request.request_id]
        return {**self.engine_id, "do_remote_prefill": True, "do_remote_decode": False,
                "remote_request_id": request.request_id, "remote_block_ids": list(block_ids), "remote_nonce": nonce,
                "num_readers": held.readers,
                **({"remote_group_block_ids": [list(ids) for ids in group_block_ids]} if group_block_ids else {})}

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def held_blocks(self, request_id: str, nonce: str, block_ids: list[int], first_block: int, digest: str,
                    num_tokens: int, group_block_ids: list[int] = ()) -> bool:
        """Whether ``block_ids`` are the held request's blocks from ``first_block`` on (and
        ``group_block_ids`` among its windowed groups' blocks), for a reader holding its nonce whose
        prompt's first ``num_tokens`` tokens have this ``digest`` (False: not held here, or another
        nonce); ValueError when the reader's prompt or blocks are others."""
        held = self._held.get(request_id)
        if held is None or held.nonce != nonce:
            return False
        lora = held.request.lora_request
        if (num_tokens > held.request.num_prompt_tokens
                or kv_digest(held.request.all_token_ids[:num_tokens], lora.lora_name if lora else None) != digest):
            raise ValueError(f"request {request_id!r} computed another prompt (or under another adapter) than "
                             "the reader's")
        if first_block < 0 or held.block_ids[first_block:first_block + len(block_ids)] != block_ids:
            raise ValueError(f"the blocks asked for are not request {request_id!r}'s from its block {first_block} on")
        if not held.group_block_ids.issuperset(group_block_ids):
            raise ValueError(f"the windowed KV cache groups' blocks asked for are not all request {request_id!r}'s")
        return True

    def release(self, request_id: str, nonce: str) -> Request | None:
        """One reader (holding the nonce) is done with a held request's blocks (read them, or gave
        up): the request, when it was the last, whose blocks go back now; None otherwise."""
        held = self._held.get(request_id)
        if held is None or held.nonce != nonce:
            return None
        held.readers -= 1
        if held.readers > 0:
            return None
        del self._held[request_id]
        return held.request

    def expired(self) -> list[Request]:
        """Held requests nobody read in time: their blocks go back to the pool."""
        if not self._held:
            return []
        now = self._clock()
        gone = [request_id for request_id, held in self._held.items() if held.deadline <= now]
        for request_id in gone:
            logger.warning("request %s: no decode engine read its KV blocks within %.0f s; freeing them",
                           request_id, self.config.abort_request_timeout_s)
        return [self._held.pop(request_id).request for request_id in gone]

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

    def release_all(self) -> list[Request]:
        held = [h.request for h in self._held.values()]
        self._held.clear()
        return held
