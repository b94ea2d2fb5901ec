import time

import pytest

from engine_core.request import FinishReason, Request, RequestStatus, StreamingUpdate
from engine_core.sampling_params import SamplingParams
from engine_core.sched.utils import check_stop


def test_status_enum_is_in_seed_order():
    assert [s.name for s in RequestStatus] == [
        "WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS",
        "WAITING_FOR_STREAMING_REQ", "RUNNING", "PREEMPTED", "FINISHED_STOPPED",
        "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"]
    assert [r.name for r in FinishReason] == ["STOP", "LENGTH", "ABORT", "ERROR"]


def test_structured_output_request_starts_waiting_for_its_grammar():
    req = Request("a", [1, 2], SamplingParams(structured_output={"regex": "[0-9]+"}))
    assert req.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert Request("b", [1], SamplingParams()).status == RequestStatus.WAITING


def test_token_views_and_counts():
    before = time.time()
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    assert before <= req.arrival_time <= time.time()
    req.append_output_token_ids(9)
    assert req.all_token_ids == [1, 2, 3, 9] and req.output_token_ids == [9]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (4, 3, 1)
    assert req.num_computed_tokens == 0 and req.num_preemptions == 0 and req.streaming_queue is None
    assert not req.is_finished() and req.get_finished_reason() is None


@pytest.mark.parametrize(("status", "reason"), [
    (RequestStatus.FINISHED_STOPPED, FinishReason.STOP), (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
    (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT), (RequestStatus.FINISHED_ERROR, FinishReason.ERROR)])
def test_finished_reason_follows_status(status, reason):
    req = Request("a", [1], SamplingParams())
    req.status = status
    assert req.is_finished() and req.get_finished_reason() == reason


def test_streaming_update_from_non_resumable_request_is_none():
    assert StreamingUpdate.from_request(Request("a", [1], SamplingParams())) is None
    update = StreamingUpdate.from_request(Request("a", [5, 6], SamplingParams(max_tokens=3), resumable=True))
    assert update is not None and update.prompt_token_ids == [5, 6] and update.sampling_params.max_tokens == 3


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": -2}, "logprobs"), ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids")])
def test_bad_sampling_params_raise_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_engine_sampling_params_keep_seed_minus_one_and_refuse_an_infinite_repetition_penalty():
    # (-1 means "no seed" at the APIs' edge only: here it may be choice 1's seed of a request seeded -2.)
    assert SamplingParams(seed=-1).seed == -1
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=float("inf"))


def test_stop_token_ids_are_kept_once_each_and_checked_as_a_set():
    params = SamplingParams(stop_token_ids=[9, 4, 9, *range(100, 5000)])
    assert params.stop_token_ids[:3] == [9, 4, 100] and len(params.stop_token_ids) == 2 + 4900
    assert params.stop_token_set == frozenset(params.stop_token_ids)
    request = Request("r", [1, 2], SamplingParams(stop_token_ids=[*range(100, 5000), 42], max_tokens=8), eos_token_id=0)
    request.append_output_token_ids(42)
    assert check_stop(request, 100) and request.stop_reason == 42
