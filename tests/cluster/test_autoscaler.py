"""Engine autoscaling: the scaling rule, the configuration, and a cluster that grows under load and
drains back when idle, through the real router and Ray Serve."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from cluster.autoscaler import EngineScaler
from cluster.config import ClusterConfig, EngineAutoscaling, EngineSpec, ScaledModel


def _policy(**fields) -> EngineAutoscaling:
    """(Each round's reading alone, unless a test sets a look-back window.)"""
    return EngineAutoscaling(**({"min_engines": 1, "max_engines": 4, "target_ongoing_requests": 4,
                                 "upscale_delay_s": 2, "downscale_delay_s": 10, "look_back_period_s": 0} | fields))


def test_the_load_decided_on_is_aggregated_over_the_look_back_window():
    from cluster.autoscaler import EngineScaler

    scaler = EngineScaler(_policy(look_back_period_s=10))
    assert scaler.aggregate(0, now=0) == 0
    assert scaler.aggregate(12, now=5) == 6  # (a window not yet full: what it holds)
    assert scaler.aggregate(12, now=10) == 8
    assert scaler.aggregate(12, now=10.5) == 12  # the reading at 0 has left the window
    assert scaler.wanted(scaler.aggregate(0, now=11)) == 3  # one idle round: 9 on average still wants 3 engines
    for function, expected in (("max", 12), ("min", 0)):
        scaler = EngineScaler(_policy(look_back_period_s=10, aggregation_function=function))
        for now, ongoing in ((0, 0), (1, 12), (2, 4)):
            value = scaler.aggregate(ongoing, now)
        assert value == expected
    scaler = EngineScaler(_policy())  # look_back_period_s 0: the round's reading alone
    assert [scaler.aggregate(ongoing, now=0) for ongoing in (9, 0)] == [9, 0]


def _one_model(policy: EngineAutoscaling, **kwargs):
    """An autoscaler (no Ray: tests call its rounds) of one model in slots 0..max_engines - 1."""
    from cluster.autoscaler import EngineAutoscaler

    slots = range(policy.max_engines)
    return EngineAutoscaler(dict.fromkeys(slots), "ns", [ScaledModel("m", tuple(slots), policy)], **kwargs)


def test_the_engines_wanted_follow_the_ongoing_requests_within_bounds():
    scaler = EngineScaler(_policy())
    assert [scaler.wanted(n) for n in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 4]
    assert EngineScaler(_policy(min_engines=2)).wanted(0) == 2


def test_a_change_waits_for_its_delay_and_scales_down_one_engine_at_a_time():
    scaler = EngineScaler(_policy())
    assert scaler.decide(1, 12, now=0.0) == 1  # (3 wanted, but only just)
    assert scaler.decide(1, 12, now=1.0) == 1
    assert scaler.decide(1, 12, now=2.0) == 3  # wanted for upscale_delay_s: all at once
    # A burst that ends before the delay changes nothing.
    assert scaler.decide(3, 30, now=3.0) == 3
    assert scaler.decide(3, 12, now=4.0) == 3
    assert scaler.decide(3, 0, now=5.0) == 3
    assert scaler.decide(3, 0, now=14.0) == 3
    assert scaler.decide(3, 0, now=15.0) == 2  # fewer wanted for downscale_delay_s: one engine less
    assert scaler.decide(2, 0, now=16.0) == 2  # (and the delay starts again)
    assert scaler.decide(2, 0, now=25.0) == 2
    assert scaler.decide(2, 0, now=26.0) == 1
    # An interruption restarts the wait.
    assert scaler.decide(1, 9, now=27.0) == 1
    assert scaler.decide(1, 0, now=28.0) == 1
    assert scaler.decide(1, 9, now=29.0) == 1
    assert scaler.decide(1, 9, now=30.0) == 1
    assert scaler.decide(1, 9, now=31.0) == 3


def test_the_configuration_starts_min_engines_in_max_engines_slots():
    config = ClusterConfig(model="m", engine_autoscaling={"min_engines": 2, "max_engines": 3},
                           engines=[EngineSpec(), EngineSpec(), EngineSpec(max_num_seqs=4)])
    assert config.num_engines == 2
    assert [e.engine_index for e in config.engine_configs()] == [0, 1]
    slots = config.engine_slot_configs()
    assert [e.engine_index for e in slots] == [0, 1, 2] and slots[2].scheduler.max_num_seqs == 4
    assert config.model_engines() == [(None, [0, 1, 2])]  # (the routers watch every slot)
    with pytest.raises(ValueError, match="between engine_autoscaling's min_engines"):
        ClusterConfig(model="m", num_engines=4, engine_autoscaling={"min_engines": 1, "max_engines": 3})
    with pytest.raises(ValueError, match=r"max_engines .* is below min_engines"):
        EngineAutoscaling(min_engines=3, max_engines=2)
    with pytest.raises(ValueError, match="max_model_len must be the same on every engine"):
        ClusterConfig(model="m", engine_autoscaling={"max_engines": 2},
                      engines=[EngineSpec(), EngineSpec(max_model_len=64)])
    with pytest.raises(ValueError, match="max_engines is 2"):
        ClusterConfig(model="m", engine_autoscaling={"max_engines": 2}, engines=[EngineSpec()] * 3)


def test_each_model_autoscales_in_slots_of_its_own():
    """The first model on two fixed engines; the second autoscaled (slots 2..4, one starting; the
    third slot with flags of its own); the third fixed after them; then the first autoscaled too."""
    config = ClusterConfig(model="m", num_engines=2, models=[
        {"model": "n", "served_model_name": "nn", "defaults": {"max_num_seqs": 8},
         "engine_autoscaling": {"max_engines": 3, "target_ongoing_requests": 2},
         "engines": [{}, {}, {"max_num_batched_tokens": 256}]},
        {"model": "o", "num_engines": 2}])
    assert [indexes for _, indexes in config.model_engines()] == [[0, 1], [2, 3, 4], [5, 6]]
    assert [e.engine_index for e in config.engine_configs()] == [0, 1, 2, 5, 6]
    slots = config.engine_slot_configs()
    assert [(e.model, e.scheduler.max_num_seqs) for e in slots[2:5]] == [("n", 8)] * 3
    assert slots[4].scheduler.max_num_batched_tokens == 256
    [scaled] = config.scaled_models()
    assert (scaled.name, scaled.indexes, scaled.policy.target_ongoing_requests) == ("nn", (2, 3, 4), 2)
    both = ClusterConfig(model="m", engine_autoscaling={"max_engines": 2}, models=[
        {"model": "n", "num_engines": 2, "engine_autoscaling": {"min_engines": 1, "max_engines": 3}}])
    assert [(m.name, m.indexes) for m in both.scaled_models()] == [("m", (0, 1)), ("n", (2, 3, 4))]
    assert [e.engine_index for e in both.engine_configs()] == [0, 2, 3]
    with pytest.raises(ValueError, match=r"models\[n\]\.num_engines \(4\) must be between"):
        ClusterConfig(model="m", models=[{"model": "n", "num_engines": 4, "engine_autoscaling": {"max_engines": 3}}])
    with pytest.raises(ValueError, match=r"models\[n\]\.with engine_autoscaling, max_model_len must be the same"):
        ClusterConfig(model="m", models=[{"model": "n", "engine_autoscaling": {"max_engines": 2},
                                          "engines": [{}, {"max_model_len": 64}]}])


def test_the_cli_flag_makes_the_same_configuration():
    from cluster.cli import build_parser, cluster_config_from_args

    args = build_parser().parse_args(["serve", "--model", "m", "--engine-autoscaling",
                                      '{"min_engines": 2, "max_engines": 5, "target_ongoing_requests": 3}'])
    config = cluster_config_from_args(args)
    assert config.num_engines == 2 and config.engine_autoscaling == EngineAutoscaling(
        min_engines=2, max_engines=5, target_ongoing_requests=3)
    assert cluster_config_from_args(build_parser().parse_args(["serve", "--model", "m"])).engine_autoscaling is None


def test_an_extra_models_file_autoscales_its_model(tmp_path):
    from cluster.cli import build_parser, cluster_config_from_args

    extra = tmp_path / "extra-models.yaml"
    extra.write_text("- model: n\n  served_model_name: nn\n"
                     "  engine_autoscaling: {min_engines: 1, max_engines: 3, target_ongoing_requests: 32}\n")
    config = cluster_config_from_args(build_parser().parse_args(
        ["serve", "--model", "m", "--num-engines", "2", "--extra-models", str(extra)]))
    [scaled] = config.scaled_models()
    assert (scaled.name, scaled.indexes, scaled.policy.target_ongoing_requests) == ("nn", (2, 3, 4), 32)
    assert [e.engine_index for e in config.engine_configs()] == [0, 1, 2]


def _stopping(engines: dict, stopped: list[str]):
    """stop_named_engine for fake engines: records the name, and the engine is gone."""
    def stop(name: str, namespace: str, graceful: bool = True) -> None:
        stopped.append(name)
        engines.pop(int(name.rsplit("-", 1)[1]), None)

    return stop


class _Call:
    def __init__(self, fn):
        self.fn = fn

    async def remote(self, *args):
        return self.fn(*args)


class _FakeEngine:
    """An engine actor as the autoscaler calls it."""

    def __init__(self, ongoing: int = 0, paused: bool = False, drained: bool = False):
        self.ongoing, self.paused, self.drained = ongoing, paused, drained
        self.refused = 0  # (requests turned away, its queue full, since start)
        self.get_stats = _Call(lambda: SimpleNamespace(num_unfinished_requests=self.ongoing,
                                                       num_requests_refused_full=self.refused))
        self.undrain = _Call(lambda: setattr(self, "drained", False))
        self.is_paused = _Call(lambda: self.paused)
        self.drain_status = _Call(lambda: (self.drained, self.ongoing, 10.0))
        self.drain = _Call(lambda: (setattr(self, "drained", True), self.drain_status.fn())[1])
        self.sleeping = False
        self.sleep_level = _Call(lambda: self.sleeping[0] if self.sleeping else 0)
        self.sleep = _Call(lambda level, mode: setattr(self, "sleeping", (level, mode)))
        self.pause_generation = _Call(lambda mode, clear_cache: setattr(self, "paused", mode))


def test_a_round_starts_the_lowest_empty_slot_holds_while_paused_and_drains_the_highest(monkeypatch):
    """EngineAutoscaler's rounds against fake engines (no Ray): what it starts, drains and stops."""
    import cluster.autoscaler as autoscaler_module
    from cluster.autoscaler import EngineAutoscaler

    engines: dict[int, _FakeEngine] = {0: _FakeEngine(ongoing=9, paused=True)}
    started: list[int] = []
    loaded: asyncio.Event | None = None
    stopped: list[str] = []

    async def fake_start(self, index):
        started.append(index)
        try:
            await loaded.wait()
            if index not in self._called_off:
                engines[index] = _FakeEngine()
        finally:
            self._starting.pop(index, None)
            self._called_off.discard(index)

    monkeypatch.setattr(EngineAutoscaler, "_actor", lambda self, i: engines.get(i))
    monkeypatch.setattr(EngineAutoscaler, "_start", fake_start)
    monkeypatch.setattr(autoscaler_module, "stop_named_engine", _stopping(engines, stopped))

    async def run():
        nonlocal loaded
        loaded = asyncio.Event()
        clock = [0.0]
        scaler = _one_model(_policy(max_engines=3, upscale_delay_s=0, downscale_delay_s=0), clock=lambda: clock[0])
        await scaler._tick()  # 9 ongoing wants 3, but engine 0 is paused: nothing changes under the operator
        assert started == [] and (await scaler.status())[0].wanted == 3
        engines[0].paused = False
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [1, 2] and (await scaler.status())[0].starting == [1, 2]
        engines[0].ongoing = 0
        # Fewer wanted while engines are still starting (waiting for resources, or loading): their starts
        # are called off, and engine 0, the only one serving, stays. Their slots are busy until they end.
        await scaler._tick()
        await asyncio.gather(*scaler._calling_off)  # (in the background: the rounds go on meanwhile)
        assert not engines[0].drained and stopped == ["llm-cluster-engine-1", "llm-cluster-engine-2"]
        [status] = await scaler.status()
        assert (status.running, status.starting) == ([0], [])
        engines[0].ongoing = 9
        await scaler._tick()
        assert started == [1, 2]  # (not started again while the called-off starts run)
        loaded.set()
        await asyncio.sleep(0)
        assert sorted(engines) == [0] and not scaler._starting
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [1, 2, 1, 2] and sorted(engines) == [0, 1, 2]
        engines[0].ongoing = 0
        stopped.clear()
        await scaler._tick()  # 1 wanted: one engine at a time, the highest slot first, drained before it stops
        assert engines[2].drained and not engines[1].drained and stopped == []
        [status] = await scaler.status()
        assert (status.running, status.draining) == ([0, 1], [2])
        await scaler._tick()  # engine 2 holds nothing: stopped; engine 1 is next
        assert stopped == ["llm-cluster-engine-2"] and engines[1].drained
        await scaler._tick()
        await scaler._tick()
        assert stopped == ["llm-cluster-engine-2", "llm-cluster-engine-1"] and sorted(engines) == [0]
        [status] = await scaler.status()
        assert (status.running, status.draining, status.starting) == ([0], [], [])

    asyncio.run(run())


def test_each_models_engines_scale_with_that_models_load_alone(monkeypatch):
    """Model a in slots 0-1, model b in slots 2-4: a's load starts an engine of a's; b's idle engine
    stays alone; then b's load starts b's while a, idle, drains its own highest engine."""
    from cluster.autoscaler import EngineAutoscaler

    engines: dict[int, _FakeEngine] = {0: _FakeEngine(ongoing=6), 2: _FakeEngine(ongoing=1)}
    started, _ = _fake_cluster(monkeypatch, engines)

    async def run():
        policy = _policy(upscale_delay_s=0, downscale_delay_s=0, drain_grace_s=0)
        models = [ScaledModel("a", (0, 1), policy.model_copy(update={"max_engines": 2})),
                  ScaledModel("b", (2, 3, 4), policy.model_copy(update={"max_engines": 3}))]
        scaler = EngineAutoscaler(dict.fromkeys(range(5)), "ns", models)
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [1]  # a: 6 ongoing wants 2 engines; b: 1 ongoing wants its 1
        engines[0].ongoing, engines[2].ongoing = 0, 9
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [1, 3, 4] and engines[1].drained and not engines[0].drained
        a, b = await scaler.status()
        assert (a.model, a.running, a.draining, a.ongoing_requests) == ("a", [0], [1], 0)
        assert (b.model, b.wanted, b.ongoing_requests) == ("b", 3, 9)
        await scaler._tick()  # a's drained engine held nothing: stopped; b's three serve
        a, b = await scaler.status()
        assert sorted(engines) == [0, 2, 3, 4] and (a.running, a.draining) == ([0], [])
        assert b.running == [2, 3, 4]

    asyncio.run(run())


def test_an_engine_started_while_an_operator_paused_or_slept_the_others_joins_them(monkeypatch):
    from cluster.autoscaler import EngineAutoscaler

    # (Engine 0 is gone, engine 1 is starting too and not held yet, engine 2 answers first.)
    engines = {1: _FakeEngine(), 2: _FakeEngine(paused=True)}
    monkeypatch.setattr(EngineAutoscaler, "_actor", lambda self, i: engines.get(i))

    async def run():
        scaler = _one_model(_policy(max_engines=4))
        scaler._starting[1] = asyncio.create_task(asyncio.sleep(0))
        new = _FakeEngine()
        await scaler._join_operator_hold(3, new)
        # (Paused keeping what routers sent it meanwhile: they run on /resume.)
        assert new.paused == "keep" and not new.sleeping
        engines[2].sleeping = (2, "abort")
        new = _FakeEngine()
        await scaler._join_operator_hold(3, new)
        assert new.sleeping == (2, "wait")  # (the others' level; requests it was sent finish first)
        engines[2].sleeping = engines[2].paused = False
        new = _FakeEngine()
        await scaler._join_operator_hold(3, new)
        assert not new.paused and not new.sleeping

    asyncio.run(run())


def test_a_new_autoscaler_finishes_the_drain_an_earlier_one_began(monkeypatch):
    """After a redeploy (or a restart), an engine left draining is not counted as serving: the new
    autoscaler stops it once idle."""
    import cluster.autoscaler as autoscaler_module
    from cluster.autoscaler import EngineAutoscaler

    engines = {0: _FakeEngine(ongoing=0), 1: _FakeEngine(ongoing=0, drained=True)}
    stopped: list[str] = []
    monkeypatch.setattr(EngineAutoscaler, "_actor", lambda self, i: engines.get(i))
    monkeypatch.setattr(autoscaler_module, "stop_named_engine",
                        lambda name, namespace, *_: (stopped.append(name), engines.pop(int(name.rsplit("-", 1)[1]))))

    async def run():
        scaler = _one_model(_policy(max_engines=2, min_engines=1, downscale_delay_s=0))
        await scaler._tick()
        assert stopped == ["llm-cluster-engine-1"] and sorted(engines) == [0]
        assert (await scaler.status())[0].running == [0]

    asyncio.run(run())


def test_an_engine_that_does_not_answer_holds_up_only_its_own_model(monkeypatch):
    """Model a's engine 0 was left draining by an earlier autoscaler; model b's engine 2 is being
    restarted by Ray (its calls fail): a's drain is finished and b is asked again next round."""
    import cluster.autoscaler as autoscaler_module
    from cluster.autoscaler import EngineAutoscaler

    def restarting():
        raise RuntimeError("the actor is restarting")

    broken = _FakeEngine()
    broken.drain_status = broken.get_stats = _Call(restarting)
    engines = {0: _FakeEngine(ongoing=0, drained=True), 1: _FakeEngine(), 2: broken}
    stopped: list[str] = []
    monkeypatch.setattr(EngineAutoscaler, "_actor", lambda self, i: engines.get(i))
    monkeypatch.setattr(autoscaler_module, "stop_named_engine",
                        lambda name, namespace, *_: (stopped.append(name), engines.pop(int(name.rsplit("-", 1)[1]))))

    async def run():
        policy = _policy(max_engines=2, downscale_delay_s=0, drain_grace_s=0)
        scaler = EngineAutoscaler(dict.fromkeys(range(4)), "ns", [ScaledModel("a", (0, 1), policy),
                                                                 ScaledModel("b", (2, 3), policy)])
        await scaler._tick()
        assert stopped == ["llm-cluster-engine-0"] and not scaler._adopted
        a, b = await scaler.status()
        assert a.running == [1] and b.running == []  # (b's round did not happen)
        engines[2] = _FakeEngine(ongoing=1)  # restarted: it answers
        await scaler._tick()
        a, b = await scaler.status()
        assert scaler._adopted and b.running == [2] and b.ongoing_requests == 1

    asyncio.run(run())


def _fake_cluster(monkeypatch, engines: dict[int, _FakeEngine]) -> tuple[list[int], list[str]]:
    """The autoscaler's engines are ``engines`` (by slot); starts load at once. Returns (started, stopped)."""
    import cluster.autoscaler as autoscaler_module
    from cluster.autoscaler import EngineAutoscaler

    started: list[int] = []
    stopped: list[str] = []

    async def fake_start(self, index):
        started.append(index)
        engines[index] = _FakeEngine()
        self._starting.pop(index, None)

    monkeypatch.setattr(EngineAutoscaler, "_actor", lambda self, i: engines.get(i))
    monkeypatch.setattr(EngineAutoscaler, "_start", fake_start)
    monkeypatch.setattr(autoscaler_module, "stop_named_engine", _stopping(engines, stopped))
    return started, stopped


def test_an_engine_that_does_not_answer_is_left_out_and_the_others_load_decides(monkeypatch):
    """Engine 0 is stuck (a long pass, or Ray restarting it): its model still scales on engine 1's
    load, into the empty slots (not into 0's)."""
    def restarting():
        raise RuntimeError("the actor is restarting")

    silent = _FakeEngine()
    silent.get_stats = silent.sleep_level = _Call(restarting)
    engines = {0: silent, 1: _FakeEngine(ongoing=20)}
    started, stopped = _fake_cluster(monkeypatch, engines)

    async def run():
        scaler = _one_model(_policy(max_engines=4, upscale_delay_s=0))
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [2, 3] and stopped == []  # (20 ongoing want 4 engines; 1 answers)
        [status] = await scaler.status()
        assert status.not_answering == [0] and status.ongoing_requests == 20

    asyncio.run(run())


def test_an_engine_busy_asleep_or_waking_holds_its_models_scaling(monkeypatch):
    """An engine whose busy loop is taken by a sleep or a wake-up (or a long pass) does not answer
    for its load, but its actor does: it is alive, an operator may be at work, and nothing starts
    in its stead."""
    def busy():
        raise TimeoutError("the busy loop is waking the weights up")

    engines = {0: _FakeEngine(), 1: _FakeEngine()}
    for engine in engines.values():
        engine.get_stats = _Call(busy)
        engine.sleeping = (2, "wait")
    started, stopped = _fake_cluster(monkeypatch, engines)

    async def run():
        scaler = _one_model(_policy(max_engines=4, min_engines=1, upscale_delay_s=0, downscale_delay_s=0))
        for _ in range(3):
            await scaler._tick()
            await asyncio.sleep(0)
        assert started == [] and stopped == []
        assert (await scaler.status())[0].not_answering == [0, 1]

    asyncio.run(run())


def test_requests_refused_as_queues_fill_want_another_engine(monkeypatch):
    """Engines at their --max-waiting-requests turn requests away (429s) while they report only the
    requests they hold, under target: refusals since the last round want one engine more."""
    engines = {0: _FakeEngine(ongoing=6), 1: _FakeEngine(ongoing=6)}
    engines[0].refused = 40  # (refused long ago: seen the first time, it sets the count)
    started, stopped = _fake_cluster(monkeypatch, engines)

    async def run():
        clock = [0.0]
        scaler = _one_model(_policy(max_engines=4, target_ongoing_requests=16, upscale_delay_s=0,
                                    downscale_delay_s=100), clock=lambda: clock[0])
        await scaler._tick()
        assert started == [] and (await scaler.status())[0].wanted == 1
        engines[1].refused = 3
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [2] and (await scaler.status())[0].wanted == 3
        clock[0] = 10.0  # no refusal for longer than the upscale delay: the requests decide again
        await scaler._tick()
        assert started == [2] and stopped == [] and (await scaler.status())[0].wanted == 1
        engines[1].refused = 0  # (Ray restarted it: its count starts again) ...
        await scaler._tick()
        assert (await scaler.status())[0].wanted == 1
        engines[1].refused = 2  # ... and its refusals after that are new ones
        await scaler._tick()
        await asyncio.sleep(0)
        assert started == [2, 3]

    asyncio.run(run())


def test_scaling_up_calls_off_a_drain_before_starting_an_engine(monkeypatch):
    """Engine 1 drains one long request when the load comes back: it serves again (loaded, warm),
    rather than staying out of routing while a new engine loads, or nothing starting at all when
    its slot is the last."""
    engines = {0: _FakeEngine(ongoing=3), 1: _FakeEngine(ongoing=1)}
    started, stopped = _fake_cluster(monkeypatch, engines)

    async def run():
        scaler = _one_model(_policy(max_engines=2, upscale_delay_s=0, downscale_delay_s=0))
        await scaler._tick()
        assert engines[1].drained and (await scaler.status())[0].draining == [1]
        engines[0].ongoing = 64
        await scaler._tick()
        assert not engines[1].drained and started == [] and stopped == []
        await scaler._tick()
        [status] = await scaler.status()
        assert (status.running, status.draining, status.wanted) == ([0, 1], [], 2)

    asyncio.run(run())


def test_a_start_called_off_while_its_engine_loads_is_killed_and_the_slot_starts_again_later(monkeypatch):
    """The autoscaler's own _start (Ray faked): an engine called off while it loads its model is
    killed at once (a graceful shutdown would wait for the load), the slot is free afterwards and a
    later start there serves; calling off a start that has ended leaves its engine alone."""
    import cluster.autoscaler as autoscaler_module
    from cluster.autoscaler import EngineAutoscaler

    gates: dict[int, asyncio.Event] = {}
    created: set[int] = set()
    killed: set[int] = set()
    stops: list[tuple[int, bool]] = []

    class Describe:
        def __init__(self, index: int) -> None:
            self.index = index

        async def remote(self):
            await gates[self.index].wait()
            if self.index in killed:
                raise RuntimeError("the actor died")

    def start_engine(config, namespace, detached):
        created.add(config)
        return SimpleNamespace(actor=SimpleNamespace(describe=Describe(config)))

    def stop_named_engine(name, namespace, graceful=True):
        index = int(name.rsplit("-", 1)[1])
        stops.append((index, graceful))
        if index in created:
            created.discard(index)
            killed.add(index)
            gates[index].set()

    monkeypatch.setattr(autoscaler_module, "start_engine", start_engine)
    monkeypatch.setattr(autoscaler_module, "stop_named_engine", stop_named_engine)
    monkeypatch.setattr(EngineAutoscaler, "_actor", lambda self, i: None)

    async def started(scaler, index: int) -> asyncio.Task:
        gates[index] = asyncio.Event()
        scaler._starting[index] = task = asyncio.create_task(scaler._start(index))
        async with asyncio.timeout(10):
            while index not in created:
                await asyncio.sleep(0.01)
        return task

    async def run():
        scaler = EngineAutoscaler({0: 0, 1: 1}, "ns", [ScaledModel("m", (0, 1), _policy(max_engines=2))])
        loading = await started(scaler, 1)
        scaler._call_off_start(1)
        await asyncio.gather(*scaler._calling_off)
        await asyncio.wait_for(loading, 10)
        assert (1, False) in stops and 1 in killed
        assert not scaler._starting and not scaler._called_off and not scaler._started
        killed.clear()
        stops.clear()
        serving = await started(scaler, 1)
        gates[1].set()  # (loaded)
        await asyncio.wait_for(serving, 10)
        assert 1 in scaler._started and stops == [(1, True)]  # (only the leftover-group cleanup before it)
        scaler._call_off_start(1)  # (its start has ended: the engine serves and stays)
        assert not scaler._calling_off and stops == [(1, True)] and 1 not in killed

    asyncio.run(run())


@pytest.mark.slow
def test_a_start_waiting_for_resources_is_called_off_with_its_placement_group(ray_cluster, tiny_model_dir):
    """On a real Ray: an engine whose bundles no node can hold waits to be placed (an autoscaling
    cluster may add a node); the load going away calls the start off: the wait ends, and no
    placement group is left reserving what arrives later."""
    from cluster.autoscaler import EngineAutoscaler
    from cluster.launcher import engine_actor_name, engine_placement_group_name, named_actor, placement_groups_named

    config = ClusterConfig(model=str(tiny_model_dir), namespace="called-off",
                           defaults=EngineSpec(resources={"accelerator_not_here": 1}),
                           engine_autoscaling=EngineAutoscaling(max_engines=2))
    slots = {c.engine_index: c for c in config.engine_slot_configs()}
    group = engine_placement_group_name(engine_actor_name(1), "called-off")

    async def run():
        scaler = EngineAutoscaler(slots, "called-off", config.scaled_models())
        scaler._starting[1] = task = asyncio.create_task(scaler._start(1))
        async with asyncio.timeout(30):
            while not await asyncio.to_thread(placement_groups_named, group):
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        assert not task.done()  # (waiting to be placed)
        scaler._call_off_start(1)
        async with asyncio.timeout(30):
            await asyncio.gather(*scaler._calling_off)
            await task
        assert not scaler._starting and not scaler._called_off and not scaler._started

    asyncio.run(run())
    assert placement_groups_named(group) == [] and named_actor(engine_actor_name(1), "called-off") is None


@contextlib.contextmanager
def _requests_in_a_loop(url: str, body: dict, streams: int) -> Iterator[list[int]]:
    """``streams`` threads posting ``body`` one request after another until the block ends; yields
    the status codes, all of them in once it has."""
    codes: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                codes.append(http.post(url, json=body).status_code)

    threads = [threading.Thread(target=load) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        yield codes
    finally:
        stop.set()
        for t in threads:
            t.join()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scaled", ["first", "second"])
def test_an_engine_starts_under_load_serves_and_is_drained_away_when_idle(ray_cluster, tiny_model_dir, scaled):
    """The first model autoscaled (slots 0-1), or a second model (slots 1-2) beside a first on one
    fixed engine."""
    from cluster.autoscaler import AUTOSCALER_NAME
    from cluster.launcher import engine_actor_name, named_actor
    from tests.serve_cluster import serve_cluster

    defaults = EngineSpec(num_gpu_blocks=64, max_model_len=256, max_num_seqs=2)
    scaling = {"min_engines": 1, "max_engines": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
               "downscale_delay_s": 2, "drain_grace_s": 1, "interval_s": 0.2}
    if scaled == "first":
        config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", defaults=defaults,
                               engine_autoscaling=scaling)
        name, first, extra = "tiny", 0, 1
    else:
        config = ClusterConfig(model=str(tiny_model_dir), served_model_name="tiny", defaults=defaults, models=[
            {"model": str(tiny_model_dir), "served_model_name": "tiny-b", "engine_autoscaling": scaling}])
        name, first, extra = "tiny-b", 1, 2
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    with serve_cluster(config) as served:
        autoscaler = named_actor(AUTOSCALER_NAME, config.namespace)
        assert named_actor(engine_actor_name(extra), config.namespace) is None
        with _requests_in_a_loop(f"{served.base}/v1/completions", body, streams=4) as codes:
            # Four streams against a target of one each: an extra engine starts, and the router sends it work.
            deadline = time.monotonic() + 180
            second = None
            while time.monotonic() < deadline:
                second = named_actor(engine_actor_name(extra), config.namespace)
                if second is not None:
                    try:
                        if ray_cluster.get(second.get_stats.remote(), timeout=10).num_requests_added > 0:
                            break
                    except Exception:  # (still loading its model)
                        pass
                time.sleep(0.5)
            else:
                raise AssertionError(f"no extra engine served: {ray_cluster.get(autoscaler.status.remote())}")
        assert codes and set(codes) == {200}, codes
        # Idle: after downscale_delay_s the extra engine is drained and stopped; the first one stays and
        # every request meanwhile succeeds.
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=60) as http:
            while named_actor(engine_actor_name(extra), config.namespace) is not None:
                assert time.monotonic() < deadline, ray_cluster.get(autoscaler.status.remote())
                assert http.post(f"{served.base}/v1/completions", json=body | {"max_tokens": 2}).status_code == 200
                time.sleep(0.5)
            assert http.get(f"{served.base}/health").status_code == 200
            answer = http.post(f"{served.base}/v1/completions", json=body | {"max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        # (Its status is as of its last round: the one that stopped the extra engine may still be finishing.)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            [status] = ray_cluster.get(autoscaler.status.remote())
            if (status.running, status.draining, status.starting) == ([first], [], []):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the autoscaler does not settle on engine {first} alone: {status}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_autoscaler_goes_on_after_ray_restarts_it(ray_cluster, tiny_model_dir):
    """A failed autoscaler is restarted by Ray and scales by itself again (nothing calls it): here
    it keeps min_engines running, starting engine 0 again after its own restart took it down."""
    from cluster.autoscaler import AUTOSCALER_NAME, start_autoscaler, stop_autoscaler
    from cluster.launcher import engine_actor_name, named_actor

    config = ClusterConfig(model=str(tiny_model_dir), namespace="autoscaler-restart-test",
                           defaults=EngineSpec(num_gpu_blocks=16, max_model_len=64, num_cpus_per_worker=0.5),
                           engine_autoscaling={"min_engines": 1, "max_engines": 2, "interval_s": 0.2})

    def engine_serves(deadline_s: float, other_than=None) -> bool:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            engine = named_actor(engine_actor_name(0), config.namespace)
            try:
                [status] = ray_cluster.get(named_actor(AUTOSCALER_NAME, config.namespace).status.remote(),
                                           timeout=30)
            except ray_cluster.exceptions.RayError:  # (being restarted)
                status = None
            if (engine is not None and status is not None and status.running == [0]
                    and (other_than is None or engine._actor_id != other_than._actor_id)):
                return True
            time.sleep(0.3)
        return False

    autoscaler = start_autoscaler(config.engine_slot_configs(), config.namespace, config.scaled_models())
    try:
        assert engine_serves(120)  # (no engine was started beside it: min_engines brings one)
        first = named_actor(engine_actor_name(0), config.namespace)
        ray_cluster.kill(autoscaler, no_restart=False)  # (as a crash: Ray restarts it)
        # (The engine it had started died with it, fate-shared: a new one serves.)
        assert engine_serves(120, other_than=first)
    finally:
        stop_autoscaler(config.namespace, stop_engines=True)
    assert named_actor(AUTOSCALER_NAME, config.namespace) is None


def test_router_autoscaling_becomes_serves_autoscaling_config():
    from cluster.app import router_deployment
    from cluster.cli import build_parser, cluster_config_from_args

    args = build_parser().parse_args(["serve", "--model", "m", "--router-autoscaling",
                                      '{"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 64}'])
    config = cluster_config_from_args(args)
    deployment = router_deployment(config)._bound_deployment._deployment_config
    scaling = deployment.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 3, 64)
    assert scaling.initial_replicas is None  # (Serve starts min_replicas)
    assert deployment.graceful_shutdown_timeout_s == 600  # (a replica scaled away finishes its streams)
    started_with_two = ClusterConfig(model="m", num_router_replicas=2, router_autoscaling={"max_replicas": 3})
    started = router_deployment(started_with_two)._bound_deployment._deployment_config
    assert started.autoscaling_config.initial_replicas == 2
    fixed = router_deployment(ClusterConfig(model="m", num_router_replicas=2))._bound_deployment._deployment_config
    assert fixed.autoscaling_config is None and fixed.num_replicas == 2
    with pytest.raises(ValueError, match="between router_autoscaling's min_replicas"):
        ClusterConfig(model="m", num_router_replicas=5, router_autoscaling={"max_replicas": 3})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ClusterConfig(model="m", router_autoscaling={"min_replicas": 0, "max_replicas": 3})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_adds_a_router_replica_under_load(ray_cluster, tiny_model_dir):
    """Through the real Serve autoscaler: streams above the target add a second router replica, which
    connects to the engines and answers (every request meanwhile answers 200)."""
    from ray import serve

    from tests.serve_cluster import serve_cluster

    config = ClusterConfig(
        model=str(tiny_model_dir), served_model_name="tiny",
        defaults=EngineSpec(num_gpu_blocks=64, max_model_len=256, max_num_seqs=8),
        router_autoscaling={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                            "upscale_delay_s": 0, "downscale_delay_s": 600})
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True, "temperature": 0}

    def running_replicas() -> int:
        app = serve.status().applications["llm-cluster"]
        return app.deployments["OpenAIRouter"].replica_states.get("RUNNING", 0)

    with serve_cluster(config) as served:
        assert running_replicas() == 1
        def replicas_that_routed() -> set[str]:  # (one scrape shows every replica's series)
            with httpx.Client(timeout=60) as http:
                text = http.get(f"{served.base}/metrics").text
            return {match.group(1) for match in re.finditer(
                r'^llm_cluster:router_requests_routed_total\{[^}]*replica="([^"]+)"[^}]*\} ([0-9.e+]+)$', text, re.M)
                if float(match.group(2)) > 0}

        with _requests_in_a_loop(f"{served.base}/v1/completions", body, streams=4) as codes:
            deadline = time.monotonic() + 180
            while running_replicas() < 2:
                assert time.monotonic() < deadline, serve.status()
                time.sleep(0.5)
            # The new replica connects to the engines and routes requests too.
            while len(replicas_that_routed()) < 2:
                assert time.monotonic() < deadline, replicas_that_routed()
                time.sleep(0.5)
        assert codes and set(codes) == {200}, codes
