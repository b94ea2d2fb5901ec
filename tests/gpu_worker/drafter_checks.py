"""Checks shared by the tests of the drafters that run in the workers (the MTP layer, EAGLE heads):
every draft against a reference's, and two tensor-parallel ranks against one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_core.spec_decode import model_drafts
from gpu_worker.model_runner import ModelRunner
from gpu_worker.worker import Worker
from tests.gpu_worker.utils import greedy_request, hf_greedy, make_scheduler, run_to_completion, two_tp_ranks


def check_every_draft(runner: ModelRunner, reference, k: int, num_blocks: int = 96, block_size: int = 4,
                      budget: int = 24, max_tokens: int = 16, some_accepted: bool = True) -> None:
    """Four greedy requests (prompts of 5, 30, 11 and 1 tokens: chunked prefill under ``budget``)
    drafted for ``k`` tokens a pass: every draft is ``reference.drafts(sequence so far, n)``, the
    answers are ``reference.target``'s (transformers) greedy ones, and drafts were rejected, and
    accepted (unless not ``some_accepted``: a drafter of random weights). A runner with KV cache
    groups gets a scheduler of its groups."""
    grouping = runner.kv_cache_grouping
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                               num_spec_tokens=k, prefix_caching=False,
                               kv_cache_groups=grouping.engine_windows if grouping is not None else ())
    scheduler.num_lookahead_tokens = k
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 30, 11, 1)]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(greedy_request(f"r{i}", prompt, max_tokens))
    checked = accepted = rejected = 0
    outputs: dict[str, list[int]] = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        out = runner.execute_model(so)
        for eco in scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        for req_id, drafted in so.scheduled_spec_decode_tokens.items():
            kept = len(out.sampled_token_ids[out.req_id_to_index[req_id]]) - 1
            accepted, rejected = accepted + kept, rejected + len(drafted) - kept
        for req_id, draft in (out.draft_token_ids or {}).items():
            sequence = list(scheduler.requests[req_id].all_token_ids)
            assert draft == reference.drafts(sequence, len(draft)), (req_id, len(sequence))
            checked += 1
        scheduler.update_draft_token_ids(model_drafts(scheduler.running, out.draft_token_ids, k, 256))
    else:
        raise AssertionError("requests did not finish")
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [hf_greedy(reference.target, p, max_tokens)
                                                               for p in prompts]
    assert checked > 10 and (accepted > 0 or not some_accepted) and rejected > 0, (checked, accepted, rejected)


def drive(execute: Callable, prompts: dict[str, list[int]], num_blocks: int, k: int
          ) -> tuple[dict[str, list[int]], list[dict]]:
    """Greedy answers with the workers' drafts: (answers, each pass's proposed drafts)."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, num_spec_tokens=k)
    scheduler.num_lookahead_tokens = k
    for req_id, prompt in prompts.items():
        scheduler.add_request(greedy_request(req_id, prompt, 10))
    answers: dict[str, list[int]] = {}
    proposed: list[dict] = []
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        out = execute(so)
        for eco in scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                answers.setdefault(o.request_id, []).extend(o.new_token_ids)
        proposed.append(out.draft_token_ids or {})
        scheduler.update_draft_token_ids(model_drafts(scheduler.running, out.draft_token_ids, k, 256))
    return answers, proposed


def check_two_ranks_draft_as_one(path: Path, prompts: dict[str, list[int]], k: int, kwargs: dict,
                                 drafting: dict, layers_per_block: tuple[int, int], hosts: Any = None) -> None:
    """The drafter (``drafting``: Worker arguments) over two tensor-parallel Ray workers gives the
    same drafts, pass for pass, and answers as over one, and those are the plain greedy ones; one
    rank's block holds ``layers_per_block`` = (the model's and the drafter's layers, the model's)
    layers of the same geometry."""
    import ray

    plain = Worker(0, 1, str(path), **kwargs)
    plain.load_model()
    plain.initialize_cache(48, 4)
    tp1 = Worker(0, 1, str(path), num_spec_tokens=k, **drafting, **kwargs)
    tp1.load_model()
    together, alone = layers_per_block
    assert tp1.bytes_per_block(4) == plain.bytes_per_block(4) * together // alone
    tp1.initialize_cache(48, 4)
    answers, proposed = drive(tp1.execute_model, prompts, 48, k)
    scheduler = make_scheduler(num_blocks=48, block_size=4, max_num_batched_tokens=16)
    for req_id, prompt in prompts.items():
        scheduler.add_request(greedy_request(req_id, prompt, 10))
    assert answers == run_to_completion(scheduler, plain.execute_model)
    assert any(proposed)

    with two_tp_ranks(path, hosts, num_spec_tokens=k, **drafting, **kwargs) as (ranks, execute):
        ray.get([w.initialize_cache.remote(48, 4) for w in ranks])
        assert drive(execute, prompts, 48, k) == (answers, proposed)
