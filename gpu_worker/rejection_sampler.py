"""Verifying draft tokens (speculative decoding) against the target model, in one pass.

A request with drafts d_1..d_k has k + 1 rows of logits: row j (0-based) is the target model's
distribution p_j for the token after d_j (row 0: after the last known token). Draft j + 1 is
accepted with probability p_j(d_{j+1}) / q(d_{j+1}); an n-gram draft is deterministic (q = 1 on
it), so that is p_j(d_{j+1}). At the first rejection the token is drawn from the residual
max(p_j - q, 0), i.e. p_j without d_{j+1}, renormalised, and the rest of the draft is dropped;
when every draft is accepted, a bonus token is drawn from p_k. Each output token is then
distributed exactly as the target model's own sampling would give it (Leviathan et al., 2023;
vLLM's rejection sampler). Greedy rows use a one-hot p on the argmax, which makes this "accept
while the draft equals the argmax, then take the argmax". Each p_j is the target's distribution
after that row's own masks: a structured-output request's row j is masked with its grammar as of
the position after d_j (the engine sends a bitmask row per position), so drafts are accepted, and
the recovered or bonus token drawn, among the tokens the grammar allows there.

``rejection_sample_with_logits`` also returns each row's processed logits (the constrained logits,
then temperature, min-p, top-k and top-p unless every row is greedy: what p_j is the softmax of), so
that --logprobs-mode processed_* reports the distribution each output token came from, as vLLM's
rejection sampler does.
"""

from __future__ import annotations

import torch

from gpu_worker.sampler import Sampler, SamplingMetadata, grammar_masked, random_sample


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]]) -> list[list[int]]:
    """``logits`` [sum(len(d) + 1), vocab]: each request's rows in order, ``md`` row-aligned with
    them (a request's settings repeated on each of its rows). Returns each request's tokens:
    its accepted drafts, then one token drawn by the target model."""
    return _rejection_sample(logits, md, drafts, keep_processed=False)[0]


def rejection_sample_with_logits(logits: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]]
                                 ) -> tuple[list[list[int]], torch.Tensor]:
    """``rejection_sample``'s tokens, and the processed logits of every row (row-aligned with
    ``logits``): those its target distribution is the softmax of."""
    tokens, processed = _rejection_sample(logits, md, drafts, keep_processed=True)
    assert processed is not None
    return tokens, processed


def _rejection_sample(logits: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]], keep_processed: bool
                      ) -> tuple[list[list[int]], torch.Tensor | None]:
    logits = Sampler.constrain(grammar_masked(logits.float(), md), md)
    if md.all_greedy:
        return _greedy(logits.argmax(dim=-1).tolist(), drafts), logits if keep_processed else None
    processed = Sampler.processed_logits(logits, md)
    probs = Sampler.target_probs(logits, processed, md)
    del logits
    if not keep_processed:
        processed = None  # (freed before the drafts are checked)
    return _sample_drafts(probs, md, drafts), processed


def _sample_drafts(probs: torch.Tensor, md: SamplingMetadata, drafts: list[list[int]]) -> list[list[int]]:
    """Accept or reject each draft against its row of the target distribution ``probs``."""
    device = probs.device
    # Rows followed by a draft token, and that token.
    draft_rows: list[int] = []
    draft_tokens: list[int] = []
    first_row = 0
    for draft in drafts:
        draft_rows.extend(range(first_row, first_row + len(draft)))
        draft_tokens.extend(draft)
        first_row += len(draft) + 1
    if first_row != probs.shape[0]:
        raise ValueError(f"{probs.shape[0]} rows of logits for drafts needing {first_row}")

    accepted: list[bool] = []
    residual = probs
    if draft_rows:
        rows = torch.tensor(draft_rows, device=device)
        tokens = torch.tensor(draft_tokens, device=device)
        p_draft = probs[rows, tokens]
        uniform = torch.rand(len(draft_rows), device=device)
        for i, row in enumerate(draft_rows):  # seeded requests draw from their own generator
            gen = md.generators.get(row) if md.generators else None
            if gen is not None:
                uniform[i] = torch.rand(1, device=device, generator=gen)[0]
        # u < p: always for p = 1 (a greedy row's argmax), never for p = 0.
        accepted = (uniform < p_draft).tolist()
        residual = probs.index_put((rows, tokens), torch.zeros((), device=device, dtype=probs.dtype))
        # A row whose draft held all the mass cannot be rejected; keep it drawable anyway.
        empty = residual.sum(dim=1) <= 0
        if bool(empty.any()):
            residual = torch.where(empty.unsqueeze(1), probs, residual)
    drawn = random_sample(residual, md.generators).tolist()

    out: list[list[int]] = []
    row = 0
    index = 0  # into draft_rows / accepted
    for draft in drafts:
        tokens_out: list[int] = []
        for token in draft:
            if not accepted[index]:
                break
            tokens_out.append(token)
            index += 1
            row += 1
        else:
            out.append([*tokens_out, drawn[row]])  # every draft accepted: the bonus token from p_k
            row += 1
            continue
        out.append([*tokens_out, drawn[row]])  # the first rejection: a token from the residual
        skipped = len(draft) - len(tokens_out)
        index += skipped
        row += skipped + 1
    return out


def _greedy(argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Every row greedy: keep drafts while they equal the argmax, then the argmax itself."""
    out: list[list[int]] = []
    row = 0
    for draft in drafts:
        tokens: list[int] = []
        for token in draft:
            if argmax[row + len(tokens)] != token:
                break
            tokens.append(token)
        tokens.append(argmax[row + len(tokens)])
        out.append(tokens)
        row += len(draft) + 1
    return out
