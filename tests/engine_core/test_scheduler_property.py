"""Property test: random workloads through schedule / update_from_output with a fake model."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.core.block_pool import BLOCKS_REMOVED, BLOCKS_STORED
from engine_core.outputs import LoRARequest
from engine_core.request import Request, RequestStatus
from engine_core.sampling_params import SamplingParams

from .utils import create_scheduler, fake_model_output


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_prompt = 40
    max_tokens_cap = 12
    # Every request must fit the pool on its own, or it could never run.
    min_blocks = -(-(max_prompt + max_tokens_cap) // block_size)
    config = {
        "block_size": block_size,
        "num_blocks": draw(st.integers(min_blocks, min_blocks * 2)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(st.integers(8, 96)),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.booleans()),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 5, 16])),
        "enable_chunked_prefill": True,
    }
    if draw(st.booleans()):
        config["max_num_partial_prefills"] = draw(st.integers(2, 3))
        config["max_long_partial_prefills"] = draw(st.integers(1, config["max_num_partial_prefills"]))
    if draw(st.booleans()):  # LoRA: requests of several adapters (and of the base model), a per-pass cap
        config["max_loras"] = draw(st.integers(1, 2))
    prefixes = [draw(st.lists(st.integers(0, 50), min_size=1, max_size=24)) for _ in range(3)]
    requests = []
    for _ in range(draw(st.integers(1, 20))):
        prefix = draw(st.sampled_from([[], *prefixes]))
        body = draw(st.lists(st.integers(0, 50), min_size=1, max_size=max_prompt - len(prefix)))
        requests.append({
            "arrival_step": draw(st.integers(0, 10)),
            "prompt": prefix + body,
            "max_tokens": draw(st.integers(1, max_tokens_cap)),
            "priority": draw(st.integers(0, 3)),
            "abort_step": draw(st.one_of(st.none(), st.integers(0, 30))),
            "lora": draw(st.sampled_from([0, 1, 2, 3])) if "max_loras" in config else 0,
        })
    return config, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    config, specs = workload
    sched = create_scheduler(max_model_len=1000, **config)
    pool = sched.kv_cache_manager.block_pool
    # The KV cache events, applied in order to a set, must give exactly the hashes the pool caches.
    pool.record_kv_events()
    reported: set[bytes] = set()
    requests: list[Request] = []
    aborted: set[str] = set()
    step_no = 0
    while step_no < 2000:
        for i, spec in enumerate(specs):
            if spec["arrival_step"] == step_no:
                lora = LoRARequest(f"lora{spec['lora']}", spec["lora"], "/adapters") if spec["lora"] else None
                req = Request(f"r{i}", spec["prompt"], SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True),
                              eos_token_id=0, priority=spec["priority"], arrival_time=float(step_no) + i * 1e-3,
                              lora_request=lora)
                requests.append(req)
                sched.add_request(req)
            if spec["abort_step"] == step_no and f"r{i}" in sched.requests:
                sched.finish_requests(f"r{i}", RequestStatus.FINISHED_ABORTED)
                aborted.add(f"r{i}")
        if step_no > 10 and not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.max_num_scheduled_tokens
        assert len(sched.running) <= config["max_num_seqs"]
        adapters = {sched.requests[r].lora_key for r in so.num_scheduled_tokens} - {None}
        assert len(adapters) <= config.get("max_loras", 3)
        cached = so.scheduled_cached_reqs
        for j, req_id in enumerate(cached.req_ids):
            if not cached.resumed_from_preemption[j]:
                assert len(cached.new_token_ids[j]) == so.num_scheduled_tokens[req_id]
        for req in sched.running:
            # Every running request holds slots for every token it has computed.
            blocks = sched.kv_cache_manager.get_num_blocks(req.request_id)
            assert blocks * config["block_size"] >= req.num_computed_tokens
        sched.kv_cache_manager.block_pool.check_integrity()
        sched.update_from_output(so, fake_model_output(sched, so, token_id=3))
        sched.kv_cache_manager.block_pool.check_integrity()
        for kind, hashes in pool.take_kv_events():
            if kind == BLOCKS_STORED:
                assert not reported & set(hashes)
                reported.update(hashes)
            elif kind == BLOCKS_REMOVED:
                assert set(hashes) <= reported
                reported.difference_update(hashes)
            else:
                reported.clear()
        assert reported == set(pool.cached_block_hash_to_block)
        live = sched.requests.values()
        queued = list(sched.running) + list(sched.waiting) + list(sched.skipped_waiting)
        assert len(queued) == len(set(map(id, queued))) == len(live)
        step_no += 1
    assert not sched.has_unfinished_requests(), "workload did not drain"
    for req in requests:
        if req.request_id in aborted and req.status == RequestStatus.FINISHED_ABORTED:
            continue
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert req.num_output_tokens == req.max_tokens
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not sched.kv_cache_manager.req_to_blocks
