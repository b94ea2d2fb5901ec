"""Batched token sampling: one set of tensor ops over all requests of a step.

Order, per row, as vLLM's sampler: the grammar's mask (structured output), allowed_token_ids,
banned tokens (bad words, and stop ids under min_tokens), logit_bias, the custom logits processors
that may change the argmax, penalties (these shape greedy picks too), then, for random rows only,
temperature, min-p, the argmax-invariant custom processors, top-k and top-p, and a draw.

The logprobs returned follow the engine's --logprobs-mode, as vLLM's: ``raw_logprobs`` (the default)
are log_softmax of the model's logits, ``raw_logits`` those logits themselves, both taken before
anything above but the grammar; ``processed_logprobs`` / ``processed_logits`` are taken from the
logits the token is drawn from: after the masks, biases and penalties and, unless every row is
greedy, temperature (1 on greedy rows), min-p, the argmax-invariant processors and top-k/top-p (the
tokens they drop at -inf). A structured-output row's are over the tokens its grammar allows, as
vLLM's model runner masks the logits with the grammar before its sampler sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_core.config import LOGPROBS_MODES

if TYPE_CHECKING:
    from gpu_worker.logits_processor_batch import LogitsProcessorBatch

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling settings (row i = the i-th request sampled this step)."""

    # 0 marks a greedy row.
    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    # None when no row uses the setting; disabled rows hold top_k=0 (-> vocab size), top_p=1, min_p=0.
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # Row -> generator, for requests with a seed.
    generators: dict[int, torch.Generator] | None = None
    # Penalties (None when no row uses any): [N] each, plus the token ids they look at.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [N, L] padded with vocab_size (an id that is counted into a discarded column).
    output_token_ids: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    # Rows limited to their allowed_token_ids: (rows [k], [k, vocab] True where a token is allowed).
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # Rows limited by their grammar (structured output): (rows [k], [k, words] int32 bitmask).
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids) pairs to forbid: stop/EOS tokens of requests still short of min_tokens, and
    # the tokens that would complete a bad word.
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, biases) added to the logits (logit_bias).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Largest top-N any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None = None
    # The rows that want logprobs, when not all do (their sampled tokens' ranks are computed).
    logprob_rows: torch.Tensor | None = None
    # The custom logits processors (--logits-processors), when the engine runs any: the rows are
    # then in their batch's index order.
    logits_processors: LogitsProcessorBatch | None = None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    # [N] logprob of each sampled token, and [N, max_num_logprobs] best alternatives (ids, logprobs).
    sampled_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # [N] rank of each sampled token in the model's distribution (1 = the most likely).
    sampled_ranks: torch.Tensor | None = None


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, words] int32 (bit t % 32 of word t // 32 = token t, xgrammar's layout) -> [k, vocab] bool."""
    # Byte by byte (little-endian words: byte t // 8 holds token t at bit t % 8), so the unpacked
    # intermediate is one byte per token, not four.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((as_bytes.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab_size:  # (logits wider than the grammar's vocabulary: the rest is not allowed)
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed[:, :vocab_size]


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] ids padded with ``vocab_size`` -> [N, vocab_size] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    vocab_size = logits.shape[1]
    output_counts = token_counts(md.output_token_ids, vocab_size)
    if md.repetition_penalties is not None:
        # HF semantics: any token of prompt or output; positive logits shrink, negative grow.
        seen = (token_counts(md.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
        penalty = md.repetition_penalties.unsqueeze(1)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    # OpenAI semantics: over generated tokens only.
    if md.frequency_penalties is not None:
        logits = logits - md.frequency_penalties.unsqueeze(1) * output_counts
    if md.presence_penalties is not None:
        logits = logits - md.presence_penalties.unsqueeze(1) * (output_counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """One ascending sort serves both filters; rows with top_k=0 / top_p=1 are left alone."""
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        kth = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, _NEG_INF)
    if top_p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the best token always survives
        logits_sort.masked_fill_(drop, _NEG_INF)
    return logits.scatter(1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws a token with probability p; seeded rows draw E from
    their own generator, so their tokens do not depend on what else is in the batch."""
    noise = torch.empty_like(probs)
    if generators and len(generators) == probs.shape[0]:
        for row, gen in generators.items():
            noise[row].exponential_(generator=gen)
    else:
        noise.exponential_()
        for row, gen in (generators or {}).items():
            noise[row].exponential_(generator=gen)
    return probs.div_(noise).argmax(dim=-1)


def token_logprobs(values: torch.Tensor, token_ids: torch.Tensor, k: int,
                   rank_rows: torch.Tensor | None = None) -> SamplerOutput:
    """Row i's token ``token_ids[i]``: its value in ``values`` (logprobs, or logits in a logits
    mode), its rank (only in ``rank_rows`` when given: ranks cost a pass over the vocabulary; other
    rows keep 0) and the row's ``k`` best tokens."""
    lp = values.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    k = min(k, values.shape[-1])  # (a request may ask for the whole vocabulary)
    top_lp, top_ids = values.topk(k, dim=-1) if k else (None, None)
    # (As vLLM counts a rank: the tokens at least as likely, the token itself included, so a token
    # tied with another ranks after both.)
    if rank_rows is None:
        ranks = (values >= lp.unsqueeze(1)).sum(dim=1)
    else:
        ranks = torch.zeros_like(token_ids)
        ranks[rank_rows] = (values[rank_rows] >= lp[rank_rows].unsqueeze(1)).sum(dim=1)
    return SamplerOutput(token_ids, lp, top_ids, top_lp, ranks)


def grammar_masked(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits with each structured-output row's grammar applied (the tokens it forbids at -inf)."""
    if md.grammar_bitmask is None:
        return logits
    rows, bitmask = md.grammar_bitmask
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, _NEG_INF))


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    @property
    def processed_mode(self) -> bool:
        """Whether the logprobs come from the processed logits (those the tokens are drawn from)."""
        return self.logprobs_mode.startswith("processed")

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        mode = self.logprobs_mode
        wants_logprobs = md.max_num_logprobs is not None
        logits = grammar_masked(logits.float(), md)
        values = None
        if wants_logprobs and mode == "raw_logprobs":
            values = logits.log_softmax(dim=-1)
        elif wants_logprobs and mode == "raw_logits":
            # (A custom processor may change the logits in place: then they are copied first.)
            values = logits.clone() if md.logits_processors is not None else logits
        logits = self.constrain(logits, md)
        sampled, processed = self.sample(logits, md, keep_processed=wants_logprobs and self.processed_mode)
        if not wants_logprobs:
            return SamplerOutput(sampled)
        if values is None:  # (the processed modes)
            values = processed if mode == "processed_logits" else processed.log_softmax(dim=-1)
        return token_logprobs(values, sampled, md.max_num_logprobs, md.logprob_rows)

    @staticmethod
    def constrain(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The masks, biases and penalties after the grammar's (``grammar_masked``, applied first):
        what shapes greedy and random rows alike."""
        if md.allowed_token_ids is not None:
            rows, allowed = md.allowed_token_ids
            logits = logits.index_put((rows,), logits[rows].masked_fill(~allowed, _NEG_INF))
        if md.banned_tokens is not None:
            rows, cols = md.banned_tokens
            logits = logits.index_put((rows, cols), torch.tensor(_NEG_INF, device=logits.device))
        if md.logit_bias is not None:
            rows, cols, biases = md.logit_bias
            logits = logits.index_put((rows, cols), biases, accumulate=True)
        if md.logits_processors is not None:
            logits = md.logits_processors.apply_non_argmax_invariant(logits)
        if md.output_token_ids is not None:
            logits = apply_penalties(logits, md)
        return logits

    @staticmethod
    def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Constrained logits as random rows draw from them: temperature (greedy rows divided by 1),
        min-p, the argmax-invariant custom processors, then top-k and top-p (dropped tokens at -inf).
        An all-greedy batch draws nothing: its processed logits are the constrained ones (vLLM's)."""
        if md.all_greedy:
            return logits
        temperature = md.temperature
        if not md.all_random:
            # Greedy rows take argmax elsewhere; any positive value keeps the division finite.
            temperature = torch.where(temperature > 0, temperature, 1.0)
        logits = logits / temperature.unsqueeze(1)
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        if md.logits_processors is not None:
            logits = md.logits_processors.apply_argmax_invariant(logits)
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        return logits

    @staticmethod
    def target_probs(logits: torch.Tensor, processed: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution each row draws from, given its constrained and processed logits: one-hot
        on the (constrained) argmax for greedy rows, the softmax of the processed ones for random rows."""
        greedy = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            return torch.zeros_like(logits).scatter_(1, greedy.unsqueeze(1), 1.0)
        probs = processed.softmax(dim=-1)
        if greedy is not None:
            one_hot = torch.zeros_like(probs).scatter_(1, greedy.unsqueeze(1), 1.0)
            probs = torch.where((md.temperature > 0).unsqueeze(1), probs, one_hot)
        return probs

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata, keep_processed: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's token from constrained ``logits``, and (with ``keep_processed``) the processed
        logits it was drawn from (``processed_logits``), computed once for both."""
        if md.all_greedy:
            return logits.argmax(dim=-1), logits if keep_processed else None
        greedy = None if md.all_random else logits.argmax(dim=-1)
        processed = Sampler.processed_logits(logits, md)
        probs = processed.softmax(dim=-1)
        if not keep_processed:
            processed = None  # (freed before the draw)
        sampled = random_sample(probs, md.generators)
        if greedy is not None:
            sampled = torch.where(md.temperature > 0, sampled, greedy)
        return sampled, processed
