"""The batch custom logits processors see: indices kept from step to step, and every change told."""

from __future__ import annotations

import random

import pytest
import torch

from engine_core.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorContext,
    MoveDirectionality,
    process_dict_updates,
)
from engine_core.sampling_params import SamplingParams
from gpu_worker.logits_processor_batch import LogitsProcessorBatch, sync_output_ids
from gpu_worker.request_state import RequestState
from gpu_worker.sampler import Sampler, SamplingMetadata
from tests.logits_processors import OnlyTheBestProcessor, TargetTokenProcessor

CONTEXT = LogitsProcessorContext(model="m", vocab_size=8, max_num_seqs=16, max_num_batched_tokens=64,
                                 max_model_len=32)
CPU = torch.device("cpu")


def _state(req_id: str, prompt: list[int], tag: str | None = None, **params) -> RequestState:
    return RequestState(req_id=req_id, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                        sampling_params=SamplingParams(extra_args=None if tag is None else {"tag": tag}, **params),
                        num_blocks=0, table_row=-1, num_computed_tokens=len(prompt), generator=None,
                        min_tokens_stop_ids=())


class Recorder(LogitsProcessor):
    """Keeps {index: tag} from the batch updates, in the order given (or, ``legacy``, in older vLLM's:
    added, removed, moved), and checks the updates' own promises."""

    legacy = False

    def __init__(self, context, device, is_pin_memory) -> None:
        self.tags: dict[int, str] = {}
        self.outputs: dict[int, object] = {}
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.updates.append(batch_update)
        if batch_update is None:
            return
        assert list(batch_update.removed) == sorted(batch_update.removed, reverse=True)
        added = {index for index, *_ in batch_update.added}
        assert not added & set(batch_update.removed), "an index an added request took is not also removed"
        for _, _, direction in batch_update.moved:
            assert direction is MoveDirectionality.UNIDIRECTIONAL

        def tag(params, _prompt, output_ids):
            return (params.extra_args or {}).get("tag")

        if self.legacy:
            for index, params, prompt, out in batch_update.added:
                if (t := tag(params, prompt, out)) is not None:
                    self.tags[index] = t
                else:
                    self.tags.pop(index, None)
            for index in batch_update.removed:
                self.tags.pop(index, None)
            for a, b, _ in batch_update.moved:
                if a in self.tags:
                    self.tags[b] = self.tags.pop(a)
                else:
                    self.tags.pop(b, None)
        else:
            process_dict_updates(self.tags, batch_update, tag)
        process_dict_updates(self.outputs, batch_update, lambda _p, _prompt, out: out)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class LegacyRecorder(Recorder):
    legacy = True


@pytest.mark.parametrize("seed", range(6))
def test_random_comings_and_goings_keep_every_processors_view_of_the_batch_true(seed):
    rng = random.Random(seed)
    batch = LogitsProcessorBatch([Recorder, LegacyRecorder], CONTEXT, CPU)
    pool: dict[str, RequestState] = {}
    for step in range(300):
        # Requests arrive, finish, pause or come back as new states (resumed after preemption).
        live = [s for s in pool.values() if rng.random() < 0.8]
        for state in list(live):
            if rng.random() < 0.05:
                fresh = _state(state.req_id, state.token_ids[:state.num_prompt_tokens],
                               (state.sampling_params.extra_args or {}).get("tag"))
                pool[state.req_id] = fresh
                live[live.index(state)] = fresh
        for _ in range(rng.randrange(0, 4)):
            req_id = f"r{step}-{_}"
            pool[req_id] = _state(req_id, [1, 2, 3], None if rng.random() < 0.3 else req_id)
            live.append(pool[req_id])
        for req_id in [r for r in pool if rng.random() < 0.05]:
            del pool[req_id]
        live = [s for s in live if pool.get(s.req_id) is s]
        rng.shuffle(live)  # (the runner's own order: decodes first, by adapter)
        order = batch.arrange(live)
        assert sorted(order) == list(range(len(live)))
        assert batch.batch_size == len(live)
        at_index = [live[j] for j in order]
        truth = {i: s.sampling_params.extra_args["tag"] for i, s in enumerate(at_index) if s.sampling_params.extra_args}
        for recorder in batch.processors:
            assert recorder.tags == truth
            update = recorder.updates[-1]
            assert update is None or update.batch_size == len(live)
        # The output lists follow their requests: at each step they hold every token sampled so far.
        for i, s in enumerate(at_index):
            outputs = batch.processors[0].outputs[i]
            assert type(outputs) is list and outputs == s.token_ids[s.num_prompt_tokens:]
            s.token_ids.append(step)


def test_a_request_keeps_its_index_and_newcomers_fill_the_gaps_lowest_first():
    batch = LogitsProcessorBatch([Recorder], CONTEXT, CPU)
    a, b, c, d, e = (_state(x, [1], x) for x in "abcde")
    assert batch.arrange([c, a, b]) == [0, 1, 2]  # (first seen: in the runner's order)
    recorder = batch.processors[0]
    assert [i for i, *_ in recorder.updates[-1].added] == [0, 1, 2]
    assert batch.arrange([b, c, a]) == [1, 2, 0]  # same indices, whatever the runner's order
    assert recorder.updates[-1] is None
    # a (index 1) leaves, d takes index 1, e is appended at 3.
    assert batch.arrange([d, b, c, e]) == [2, 0, 1, 3]
    update = recorder.updates[-1]
    assert (update.removed, [i for i, *_ in update.added], update.moved) == ([], [1, 3], [])
    # c (0) and d (1) leave: the last ones move down into the gaps, e (3) into 0, then b (2) into 1.
    assert batch.arrange([e, b]) == [0, 1]
    update = recorder.updates[-1]
    assert (update.batch_size, list(update.removed), update.added) == (2, [1, 0], [])
    assert update.moved == [(3, 0, MoveDirectionality.UNIDIRECTIONAL), (2, 1, MoveDirectionality.UNIDIRECTIONAL)]
    assert recorder.tags == {0: "e", 1: "b"}


def test_only_the_sampling_rank_holds_processors_but_every_rank_orders_alike():
    a, b, c = (_state(x, [1], x) for x in "abc")
    rank0 = LogitsProcessorBatch([Recorder], CONTEXT, CPU)
    rank1 = LogitsProcessorBatch([Recorder], CONTEXT, CPU, holds_processors=False)
    assert rank1.processors == []
    for states in ([a, b, c], [c, a], [b, c]):
        assert rank0.arrange(states) == rank1.arrange(states)


def test_the_output_list_follows_the_requests_tokens():
    state = _state("x", [7, 8, 9])
    outputs: list[int] = []
    sync_output_ids(state, outputs)
    assert outputs == []
    state.token_ids += [4, 5]
    sync_output_ids(state, outputs)
    state.token_ids.append(6)
    sync_output_ids(state, outputs)
    assert outputs == [4, 5, 6]
    # The scheduler's tokens are authoritative: a rewritten tail is copied again.
    state.token_ids[-1] = 1
    sync_output_ids(state, outputs)
    assert outputs == [4, 5, 1]
    del state.token_ids[-2:]
    sync_output_ids(state, outputs)
    assert outputs == [4]


def _metadata(temperatures: list[float], batch: LogitsProcessorBatch) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.tensor(temperatures), all_greedy=all(t == 0 for t in temperatures),
                            all_random=all(t > 0 for t in temperatures), logits_processors=batch)


def test_the_sampler_runs_processors_where_vllm_does():
    batch = LogitsProcessorBatch([TargetTokenProcessor, OnlyTheBestProcessor], CONTEXT, CPU)
    target = _state("t", [1], temperature=0.0)
    target.sampling_params.extra_args = {"target_token": 5}
    best = _state("b", [1], temperature=1.0)
    best.sampling_params.extra_args = {"only_the_best": True}
    plain = _state("p", [1], temperature=0.0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.5, 0.4, 0.0, 0.0, 0.3],
                           [0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    order = batch.arrange([target, best, plain])
    assert order == [0, 1, 2]
    before = OnlyTheBestProcessor.applied
    for _ in range(20):  # (a random row that only keeps its best logit always samples it)
        out = Sampler()(logits.clone(), _metadata([0.0, 1.0, 0.0], batch))
        assert out.sampled_token_ids.tolist() == [5, 3, 2]
    assert OnlyTheBestProcessor.applied == before + 20
    # An all-greedy batch never reaches the argmax-invariant processors.
    batch.arrange([target, plain])
    out = Sampler()(logits[[0, 2]].clone(), _metadata([0.0, 0.0], batch))
    assert out.sampled_token_ids.tolist() == [5, 2]
    assert OnlyTheBestProcessor.applied == before + 20
