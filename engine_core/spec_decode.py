"""Draft tokens for speculative decoding: the n-gram (prompt lookup) and suffix drafters, on token
ids only, and the rules every drafter follows (a draft model's drafts come from the workers: see
gpu_worker/draft_model.py).

After each pass the engine asks the drafter for every running request that is decoding: if the
context's last n tokens (the longest n up to ``prompt_lookup_max``, at least ``prompt_lookup_min``)
occurred earlier in the context, the tokens that followed their earliest occurrence are the draft.
The next pass computes the draft with the request's last token, and the worker keeps the drafts
the target model agrees with (see gpu_worker/rejection_sampler.py). No torch here: this runs on
the engine's thread beside the scheduler, so drafting is the same whatever the tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from engine_core.config import SpeculativeConfig
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams
from engine_core.suffix_decoding import SuffixCache


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether the request's next-token distribution can be checked at several positions in one
    pass. A seeded random request's cannot: how many draws it takes from its generator would depend
    on how many drafts fit each pass, i.e. on the load, and its answer must not; it decodes one
    token per pass. (A grammar's requests are drafted for, as in vLLM: the engine cuts a draft at
    the first token the grammar refuses, and masks each row with the grammar as of its position,
    engine_core/structured_output.py. Penalties and bad words depend on the tokens before each
    position too: the workers apply them to each row as of its position,
    gpu_worker/request_state.py ``RequestStateAtDraft``. min_tokens is checked per request in
    ``draft_room``.)"""
    return params.seed is None or params.temperature == 0.0


def draft_room(params: SamplingParams, num_output_tokens: int, num_tokens: int, k: int, max_model_len: int) -> int:
    """How many draft tokens a decoding request may get now (0: none): none while it is short of
    min_tokens or cannot be drafted for (``drafts_allowed``), and none past its end: max_tokens
    (the next pass's own token counts), or the context length."""
    if num_output_tokens < params.min_tokens or not drafts_allowed(params):
        return 0
    return max(0, min(k, params.max_tokens - num_output_tokens - 1, max_model_len - num_tokens))


def model_drafts(requests: Iterable[Request], proposed: dict[str, list[int]] | None, k: int, max_model_len: int
                 ) -> dict[str, list[int]]:
    """A draft model's proposals (from the workers) for the requests still decoding, each cut to its room."""
    drafts: dict[str, list[int]] = {}
    if not proposed:
        return drafts
    for request in requests:
        draft = proposed.get(request.request_id)
        decoding = request.status == RequestStatus.RUNNING and request.num_computed_tokens == request.num_tokens - 1
        if not draft or not decoding:
            continue
        room = draft_room(request.sampling_params, request.num_output_tokens, request.num_tokens, k, max_model_len)
        if room > 0:
            drafts[request.request_id] = draft[:room]
    return drafts


def ngram_draft(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest suffix of
    ``token_ids`` (between ``min_n`` and ``max_n`` tokens long) that occurred before, as vLLM's
    n-gram drafter picks them. One pass over the context finds where its last token occurred;
    longer matches are then checked at those positions only."""
    total = token_ids.shape[0]
    if total < min_n + 1:
        return []
    # Occurrences of the suffix end at these positions (never at the suffix's own end).
    ends = np.flatnonzero(token_ids[:total - 1] == token_ids[total - 1])
    length = 1
    while ends.size and length < max_n and length < total - 1:
        ends_ok = ends[ends >= length]
        longer = ends_ok[token_ids[ends_ok - length] == token_ids[total - 1 - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    if not ends.size or length < min_n:
        return []
    start = int(ends[0]) + 1
    return token_ids[start:start + k].tolist()


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len
        # Each drafting request's tokens as an array, extended by the new tokens each pass rather
        # than converted whole (kept while the request drafts pass after pass).
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def _tokens(self, request: Request, arrays: dict[str, tuple[np.ndarray, int]]) -> np.ndarray:
        tokens = request.all_token_ids
        n = len(tokens)
        buf, filled = self._arrays.get(request.request_id, (None, 0))
        if buf is None or filled > n or buf.shape[0] < n:
            if buf is None or filled > n:
                filled = 0
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if filled:
                grown[:filled] = buf[:filled]
            buf = grown
        if filled < n:
            buf[filled:n] = tokens[filled:]
        arrays[request.request_id] = (buf, n)
        return buf[:n]

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Drafts for the requests that are decoding (their last token is the only one not computed)."""
        drafts: dict[str, list[int]] = {}
        arrays: dict[str, tuple[np.ndarray, int]] = {}
        for request in requests:
            if request.status != RequestStatus.RUNNING or request.num_computed_tokens != request.num_tokens - 1:
                continue  # mid-prefill, or preempted
            room = draft_room(request.sampling_params, request.num_output_tokens, request.num_tokens, self.k,
                              self.max_model_len)
            if room <= 0:
                continue
            tokens = self._tokens(request, arrays)
            if request.prompt_embeds is not None:  # (its prompt ids are placeholders: nothing to match)
                tokens = tokens[request.num_prompt_tokens:]
            draft = ngram_draft(tokens, self.min_n, self.max_n, room)
            if draft:
                drafts[request.request_id] = draft
        self._arrays = arrays  # (requests that did not draft this pass are forgotten)
        return drafts


class SuffixProposer:
    """Suffix decoding's drafts (engine_core/suffix_decoding.py), proposed here as the n-gram
    drafter's are: each request's tree holds its prompt and output (fed each pass what it added,
    through preemption), the cache holds the answers of the requests before it."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.num_speculative_tokens is not None
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.depth = config.suffix_decoding_max_tree_depth
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.cache = SuffixCache(self.depth, config.suffix_decoding_max_cached_requests)
        # Each request in the cache: the request, its prompt's length and the output tokens fed.
        self._fed: dict[str, tuple[Request, int, int]] = {}

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Drafts for the requests that are decoding. A request that finished is fed its last
        tokens and leaves the cache (its answer stays for the others); one preempted stays."""
        drafts: dict[str, list[int]] = {}
        for request in requests:
            if request.status != RequestStatus.RUNNING or request.num_computed_tokens != request.num_tokens - 1:
                continue  # (mid-prefill)
            self._feed(request)
            room = draft_room(request.sampling_params, request.num_output_tokens, request.num_tokens, self.k,
                              self.max_model_len)
            if room <= 0:
                continue
            tokens = request.all_token_ids
            start = max(request.num_prompt_tokens if request.prompt_embeds is not None else 0,
                        len(tokens) - self.depth)
            draft = self.cache.speculate(request.request_id, tokens[start:], room, self.factor, self.min_prob)
            if draft:
                drafts[request.request_id] = draft
        for req_id, (request, _, _) in list(self._fed.items()):
            if request.is_finished():
                self._feed(request)
                self._leave(req_id)
        return drafts

    def _feed(self, request: Request) -> None:
        """Bring the request's tree up to its tokens (started anew for a new request of a known id,
        where its prompt changed, or where its output was cut back)."""
        req_id = request.request_id
        known, prompt_len, fed = self._fed.get(req_id, (None, -1, 0))
        num_outputs = request.num_tokens - request.num_prompt_tokens
        if known is not request or prompt_len != request.num_prompt_tokens or num_outputs < fed:
            if known is not None:
                self._leave(req_id)
            # (A prompt given as embeddings has placeholder ids: nothing to match in it.)
            prompt = [] if request.prompt_embeds is not None else request.all_token_ids[:request.num_prompt_tokens]
            self.cache.start(req_id, prompt, request.all_token_ids[request.num_prompt_tokens:])
        elif num_outputs > fed:
            self.cache.add(req_id, request.all_token_ids[request.num_prompt_tokens + fed:])
        self._fed[req_id] = (request, request.num_prompt_tokens, num_outputs)

    def _leave(self, req_id: str) -> None:
        del self._fed[req_id]
        self.cache.stop(req_id)
