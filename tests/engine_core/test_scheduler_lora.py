"""LoRA slot accounting in the scheduler: at most max_loras different adapters per pass."""

from __future__ import annotations

from engine_core.outputs import LoRARequest
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams

from .utils import create_scheduler, fake_model_output, step

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def _request(rid: str, lora: LoRARequest | None, prompt_len: int = 6, max_tokens: int = 3) -> Request:
    return Request(rid, [hash(rid) % 500 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0, lora_request=lora)


def _adapters(sched, so) -> set[int]:
    return {sched.requests[r].lora_request.lora_int_id for r in so.num_scheduled_tokens
            if sched.requests[r].lora_request is not None}


def test_a_third_adapter_waits_while_base_model_requests_go_ahead():
    sched = create_scheduler(max_loras=2, block_size=4)
    for rid, lora in (("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A)):
        sched.add_request(_request(rid, lora))
    first = True
    for _ in range(50):
        so = sched.schedule()
        assert len(_adapters(sched, so)) <= 2
        if first:
            # The third adapter is skipped, not a stop: the base-model request behind it goes in. A
            # later request of an adapter in the batch does not jump ahead of it.
            assert set(so.num_scheduled_tokens) == {"a1", "b1", "base"}
            assert sorted(r.request_id for r in sched.skipped_waiting) == ["a2", "c1"]
            first = False
        if "c1" in so.num_scheduled_tokens:
            # c went in once a1 and b1 had left the batch, before a2.
            assert not {"a1", "b1"} & set(sched.requests) and "a2" in sched.requests
        sched.update_from_output(so, fake_model_output(sched, so))
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()


def test_a_running_request_of_an_extra_adapter_sits_out_the_pass():
    """Running requests can hold more adapters than max_loras (one admitted while the others were
    not scheduled); the running loop keeps each pass within the cap."""
    sched = create_scheduler(max_loras=1, block_size=4, max_num_batched_tokens=6)
    sched.add_request(_request("a1", A, prompt_len=6, max_tokens=4))
    so, _ = step(sched)  # a1's whole prompt takes the budget
    sched.add_request(_request("b1", B, prompt_len=4, max_tokens=4))
    # Force the situation the admission check alone cannot rule out: both adapters running.
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"a1"} and _adapters(sched, so) == {1}
    sched.update_from_output(so, fake_model_output(sched, so))
    b1 = sched.requests["b1"]
    sched.skipped_waiting.remove_requests({b1})
    sched.running.append(b1)
    b1.status = sched.running[0].status
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"a1"}  # b1 sits out while a1 runs
    sched.update_from_output(so, fake_model_output(sched, so))


def test_without_lora_config_adapters_are_not_limited():
    sched = create_scheduler(block_size=4)
    for rid, lora in (("a1", A), ("b1", B), ("c1", C)):
        sched.add_request(_request(rid, lora))
    assert len(_adapters(sched, sched.schedule())) == 3


def test_stats_count_requests_per_adapter():
    sched = create_scheduler(max_loras=1, block_size=4)
    for rid, lora in (("a1", A), ("a2", A), ("b1", B), ("base", None)):
        sched.add_request(_request(rid, lora))
    sched.schedule()
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"a": 2}
    assert stats.waiting_lora_adapters == {"b": 1}


def test_an_adapter_held_back_by_the_cap_is_not_starved_by_another_adapters_traffic():
    """max_loras=1, one new request of adapter a every pass, one request of b: b gets its slot as
    soon as the a requests in the batch finish (vLLM would keep admitting a, and b would wait for
    as long as a has traffic)."""
    sched = create_scheduler(max_loras=1, block_size=4)
    sched.add_request(_request("a0", A, max_tokens=4))
    sched.add_request(_request("b0", B, max_tokens=4))
    admitted_at = None
    for i in range(40):
        sched.add_request(_request(f"a{i + 1}", A, max_tokens=4))
        so = sched.schedule()
        assert len(_adapters(sched, so)) <= 1
        if "b0" in so.num_scheduled_tokens and admitted_at is None:
            admitted_at = i
        sched.update_from_output(so, fake_model_output(sched, so))
    assert admitted_at == 4  # a0's prefill and its 3 decodes, then b0
    # and a's requests get their turn again once b0 is done.
    assert sum(1 for r in sched.requests.values() if r.lora_request == A) < 40


def test_the_scheduler_counts_live_requests_per_adapter_and_versions_the_set():
    """What the engine reports to routers (LoRA affinity): the adapters of the live requests, with
    a version that moves only when that set changes."""
    from engine_core.request import RequestStatus

    sched = create_scheduler(max_loras=2, block_size=4)
    version = sched.lora_adapters_version
    for rid, lora in (("a1", A), ("a2", A), ("base", None)):
        sched.add_request(_request(rid, lora))
    assert sched.lora_request_counts == {A.cache_key: 2} and sched.lora_adapters_version == version + 1
    sched.add_request(_request("b1", B))
    assert set(sched.lora_request_counts) == {A.cache_key, B.cache_key} and sched.lora_adapters_version == version + 2
    sched.finish_requests("a1", RequestStatus.FINISHED_ABORTED)
    assert sched.lora_request_counts[A.cache_key] == 1 and sched.lora_adapters_version == version + 2
    sched.finish_requests(["a2", "b1", "base"], RequestStatus.FINISHED_ABORTED)
    assert sched.lora_request_counts == {} and sched.lora_adapters_version == version + 4


def test_merged_outputs_keep_the_latest_adapter_report():
    """Outputs a client had not read yet are sent as one: the adapters the engine last reported
    survive the merge (it reports only changes)."""
    from engine_core.engine_actor import _merge
    from engine_core.outputs import EngineCoreOutputs

    merged = _merge([EngineCoreOutputs(lora_adapters=[A.cache_key]), EngineCoreOutputs(),
                     EngineCoreOutputs(lora_adapters=[]), EngineCoreOutputs()], engine_index=0)
    assert merged.lora_adapters == []
    assert _merge([EngineCoreOutputs(lora_adapters=[B.cache_key]), EngineCoreOutputs()], 0).lora_adapters == [
        B.cache_key]
