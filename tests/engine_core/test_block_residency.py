"""--kv-cache-metrics: sampled KV blocks followed from allocation to eviction from the prefix cache,
through the real pool and KV cache manager, on a clock the test moves."""

from __future__ import annotations

import random

import pytest

from engine_core.config import EngineConfig, SchedulerConfig
from engine_core.core.block_residency import BlockResidency
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.metrics import EngineMetrics
from engine_core.outputs import SchedulerStats
from engine_core.request import Request
from engine_core.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _manager(clock: Clock, sample: float = 1.0, rng: random.Random | None = None,
             num_blocks: int = 3) -> KVCacheManager:
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=4)
    mgr.block_pool.residency = BlockResidency(sample, clock, rng)
    return mgr


def _run(mgr: KVCacheManager, rid: str, tokens: list[int]) -> None:
    request = Request(rid, tokens, SamplingParams())
    hits, n = mgr.get_computed_blocks(request)
    assert mgr.allocate_slots(request, len(tokens) - n, n, hits) is not None
    mgr.free(request)


def test_an_evicted_block_reports_its_lifetime_idle_time_and_reuse_gaps():
    clock = Clock()
    mgr = _manager(clock, num_blocks=12)
    shared = list(range(8))
    _run(mgr, "a", [*shared, 90])  # t=100: three blocks allocated, the first two cached
    for i, at in enumerate((101.0, 103.0, 106.0)):  # the first block hit at 101, 103 and 106
        clock.now = at
        _run(mgr, f"r{i}", [*shared[:4], 100 + i, 101, 102, 103, 104])  # each caches a second block
    assert mgr.block_pool.residency.drain() == []  # (no block handed out twice yet)
    clock.now = 110.0
    _run(mgr, "e", list(range(200, 248)))  # the whole pool for new tokens: every cached block evicted
    events = sorted(mgr.block_pool.residency.drain())
    # The shared first block: born at 100, last used at 106, reused at 101, 103 and 106.
    assert (10.0, 4.0, [2.0, 3.0]) in events
    # Every other block, never reused, as vLLM counts them: cached or not (a's last block and each
    # later prompt's two new blocks, born at 100, 101, 103 and 106), each reports its residency
    # when it is handed out again.
    assert sorted(e for e in events if not e[2]) == [
        (4.0, 4.0, []), (4.0, 4.0, []), (7.0, 7.0, []), (7.0, 7.0, []), (9.0, 9.0, []), (9.0, 9.0, []),
        (10.0, 10.0, []), (10.0, 10.0, [])]


def test_only_the_sampled_share_of_blocks_is_followed_and_a_reset_forgets_them():
    clock = Clock()
    mgr = _manager(clock, sample=0.3, rng=random.Random(7))
    followed = 0
    for i in range(200):
        _run(mgr, f"r{i}", [i * 10 + k for k in range(8)] + [5])
        followed += len(mgr.block_pool.residency.drain())
    assert 0.2 * 3 * 199 < followed < 0.4 * 3 * 199  # (about 30% of the three blocks a request takes)
    assert mgr.reset_prefix_cache()
    assert not mgr.block_pool.residency._followed
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        BlockResidency(0.0)


def test_the_engine_exports_the_residency_histograms_only_when_asked():
    from tests.engine_core.test_metrics import _families, _sum

    plain = _families(EngineMetrics(EngineConfig(served_model_name="m"), SchedulerConfig(), "m", num_blocks=8))
    assert "vllm:kv_block_lifetime_seconds" not in plain
    metrics = EngineMetrics(EngineConfig(served_model_name="m", kv_cache_metrics_sample=0.5), SchedulerConfig(),
                            "m", num_blocks=8)
    metrics.on_step({}, SchedulerStats(kv_block_residency=[(10.0, 4.0, [2.0, 3.0]), (1.0, 1.0, [])]))
    families = _families(metrics)
    assert _sum(families["vllm:kv_block_lifetime_seconds"]) == 11.0
    assert _sum(families["vllm:kv_block_idle_before_evict_seconds"]) == 5.0
    reuse = families["vllm:kv_block_reuse_gap_seconds"]
    assert _sum(reuse) == 5.0 and next(s.value for s in reuse.samples if s.name.endswith("_count")) == 2


def test_the_scheduler_follows_blocks_when_asked_and_hands_the_events_over_with_its_stats():
    from engine_core.config import CacheConfig
    from engine_core.sched.scheduler import Scheduler

    def scheduler(sample: float | None, log_stats: bool = True) -> Scheduler:
        return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
                         CacheConfig(block_size=4, num_blocks=3, kv_cache_metrics_sample=sample), log_stats=log_stats)

    assert scheduler(None).kv_cache_manager.block_pool.residency is None
    assert scheduler(1.0, log_stats=False).kv_cache_manager.block_pool.residency is None  # (nobody drains it)
    sched = scheduler(1.0)
    for rid in ("a", "b"):  # b's three blocks are a's, handed out again
        _run(sched.kv_cache_manager, rid, [ord(rid)] * 12)
    stats = sched.make_stats()
    assert len(stats.kv_block_residency) == 3 and sched.make_stats().kv_block_residency is None
