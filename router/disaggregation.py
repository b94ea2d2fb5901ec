"""Prefill/decode disaggregation in the router (vLLM's disaggregated-serving proxy, llm-d's P/D).

A model whose engines include prefill engines (``kv_role`` kv_producer) and decode engines
(kv_consumer), or either beside kv_both engines, serves each generation request in two legs:

1. the prompt goes to a prefill engine (the routing policy's choice among them: prefix-aware
   routing finds the one caching it) as a request for one token with ``do_remote_decode``; the
   engine computes the prompt and holds its KV blocks, answering with the parameters naming them;
2. the request goes to a decode engine (the routing policy's choice among those) with those
   parameters: it reads the blocks, computes the last prompt token and decodes from there.

Long prompts no longer stall the decode engines' batches (each engine's passes are all prefill or
all decode work), and each pool can be sized and tuned for its phase. A prefill that fails or is
refused leaves the decode engine to compute the prompt itself; so does a request that would gain
nothing (one token wanted, prompt logprobs asked for, prompt embeddings, a client's own transfer
parameters). The choices of one prompt (n > 1) share one prefill, each reading its blocks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from engine_core.outputs import EngineCoreRequest
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from router.engine_client import EngineClient

logger = logging.getLogger(__name__)

_PRODUCER_ROLES = ("kv_producer", "kv_both")
_CONSUMER_ROLES = ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class EngineRoles:
    """Which of a model's engines compute prompts for others, and which decode them."""

    prefill: tuple[bool, ...]
    decode: tuple[bool, ...]

    @classmethod
    def from_kv_roles(cls, roles: Sequence[str | None]) -> EngineRoles | None:
        """None unless the engines split the work: a pure producer or consumer among them, and
        engines for both legs (kv_both engines alone each serve their requests whole)."""
        prefill = tuple(role in _PRODUCER_ROLES for role in roles)
        decode = tuple(role in _CONSUMER_ROLES for role in roles)
        split = any(role in ("kv_producer", "kv_consumer") for role in roles)
        return cls(prefill, decode) if split and any(prefill) and any(decode) else None

    def decode_candidates(self, healthy: list[bool]) -> list[bool]:
        """Where a request may be decoded: the healthy decode engines; all healthy engines when none
        is (a prefill engine is a whole engine: it serves requests alone rather than none)."""
        decode = [ok and role for ok, role in zip(healthy, self.decode, strict=True)]
        return decode if any(decode) else healthy

    def prefill_candidates(self, healthy: list[bool]) -> list[bool]:
        return [ok and role for ok, role in zip(healthy, self.prefill, strict=True)]

    def prefill_or_any(self, healthy: list[bool]) -> list[bool]:
        """Where a client's own prefill leg (do_remote_decode) goes: a healthy prefill engine, or any."""
        prefill = self.prefill_candidates(healthy)
        return prefill if any(prefill) else healthy


def needs_remote_prefill(request: EngineCoreRequest) -> bool:
    """Whether a request is worth computing elsewhere: a generation of more than one token whose
    prompt (more than one token) the decode engine need not see computed (no prompt logprobs)."""
    params = request.sampling_params
    return (request.kv_transfer_params is None and not params.embed and params.max_tokens > 1
            and params.prompt_logprobs is None and len(request.prompt_token_ids) > 1 and not request.resumable
            and request.prompt_embeds is None and not request.mm_features)


def prefill_request(request: EngineCoreRequest, num_readers: int = 1) -> EngineCoreRequest:
    """The prefill leg: the prompt, one token (always ending at its length limit, so the engine
    holds the blocks), under its own id; the decode engine samples the answer's first token. The
    blocks stay until ``num_readers`` decode requests (the choices of one prompt) read or decline them."""
    params: SamplingParams = dataclasses.replace(
        request.sampling_params, max_tokens=1, min_tokens=0, ignore_eos=True, stop_token_ids=[], logprobs=None,
        prompt_logprobs=None, structured_output=None, structured_output_after=None, structured_output_may_open=None,
        structured_output_then=None)
    return msgspec.structs.replace(request, request_id=f"{request.request_id}-prefill", sampling_params=params,
                                   num_choices=0,
                                   kv_transfer_params={"do_remote_decode": True, "num_readers": num_readers})


async def run_prefill(client: EngineClient, engine: int, request: EngineCoreRequest, timeout_s: float | None,
                      num_readers: int = 1) -> dict[str, Any] | None:
    """Run ``request``'s prefill leg on ``engine``: the parameters naming its KV blocks, or None when
    it did not come to that (refused, failed, timed out: the decode engine computes the prompt)."""
    leg = prefill_request(request, num_readers)
    try:
        stream = await client.open(engine, leg, timeout_s)
    except Exception as e:
        logger.info("request %s: prefill engine %d did not take the prompt (%s); decoding it whole",
                    request.request_id, engine, e)
        return None
    try:
        last = None
        while not stream.finished:
            batch = await stream.next_batch()
            if batch:
                last = batch[-1]
        if last is None or last.finish_reason != FinishReason.LENGTH or not last.kv_transfer_params:
            reason = "no output" if last is None else f"{last.finish_reason}: {last.stop_reason}"
            logger.info("request %s: the prefill on engine %d handed no KV on (%s); decoding it whole",
                        request.request_id, engine, reason)
            return None
        return last.kv_transfer_params
    except Exception as e:
        logger.info("request %s: the prefill on engine %d failed (%s); decoding it whole", request.request_id,
                    engine, e)
        return None
    finally:
        await stream.close()
