"""Engine autoscaling: more engines while requests pile up, fewer once they are idle, each
autoscaled model apart from the others.

An autoscaled model's engines live in ``max_engines`` *slots* (engine indexes reserved for it);
router replicas watch every slot of their model by name and route to the engines that run in them
(cluster/config.py ``EngineAutoscaling``, ``ScaledModel``; router/engine_client.py finds an engine
that appears in an empty slot).

``EngineScaler`` decides, as Ray Serve sizes a deployment: the engines wanted are the model's ongoing
requests (running and waiting, summed over its engines, averaged over the last ``look_back_period_s``
or aggregated as ``aggregation_function`` says) over ``target_ongoing_requests``, rounded
up and held to [min_engines, max_engines]; a change waits until it has been wanted for
``upscale_delay_s`` (``downscale_delay_s``) without a break, so a burst does not start an engine
and a lull does not stop one. Up, every engine wanted starts at once; down, one engine at a time.

A model whose engines turned requests away since the last round (queues full: 429s) wants one
engine more than it runs, whatever its requests count.

``EngineAutoscaler`` (a Ray actor, one per application, for every autoscaled model) acts: it starts
an engine in the model's lowest empty slot, and scales down by *draining* its highest one: the
engine tells every router to send it nothing new, serves what it holds, and is stopped once it has
held no request for ``drain_grace_s`` (a request a router sent before hearing of the drain still
runs). Scaling up calls a drain off before it starts an engine (the drained engine is loaded and
warm); scaling down calls off starts still waiting for resources or loading before it drains an
engine that serves. An engine that does not answer is left out of the count and its load unknown:
the others' load decides. Nothing scales while an engine is paused or asleep (an operator is at work: /pause,
/sleep); an engine that finishes loading meanwhile joins them. While Ray restarts a failed engine
its model does not scale; an engine gone for good leaves its slot empty, to be filled again as the
load wants.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import EngineAutoscaling, ScaledModel
from cluster.launcher import engine_actor_name, named_actor, start_engine, stop_named_engine
from engine_core.config import EngineConfig
from engine_core.engine_actor import wait_until_name_released
from engine_core.log_setup import configure_actor_logging, logging_runtime_env

logger = logging.getLogger(__name__)

AUTOSCALER_NAME = "llm-cluster-engine-autoscaler"

# How long an engine may take to answer one of the autoscaler's calls: one that does not (say, being
# restarted by Ray) must not stall the rounds, which also finish drains and start engines.
CALL_TIMEOUT_S = 10.0

# The handles of the autoscalers this process owns (not detached), by namespace: Ray destroys an
# actor that is not detached once no handle to it is left, so the process that starts one holds it.
_owned: dict[str, Any] = {}


class EngineScaler:
    """The engine count to move to, from the ongoing requests, with Serve's delays (time is
    ``now`` as given: tests pass their own)."""

    def __init__(self, policy: EngineAutoscaling) -> None:
        self.policy = policy
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._readings: collections.deque[tuple[float, float]] = collections.deque()

    def aggregate(self, ongoing: float, now: float) -> float:
        """The ongoing requests to decide on: this round's reading with those of the last
        ``look_back_period_s``, aggregated by ``aggregation_function`` (as Serve aggregates its
        replicas' reports). A window not yet full aggregates what it holds."""
        window = self.policy.look_back_period_s
        while self._readings and (window == 0 or self._readings[0][0] < now - window):
            self._readings.popleft()
        self._readings.append((now, ongoing))
        values = [value for _, value in self._readings]
        match self.policy.aggregation_function:
            case "max":
                return max(values)
            case "min":
                return min(values)
            case _:
                return sum(values) / len(values)

    def wanted(self, ongoing: float) -> int:
        p = self.policy
        return min(p.max_engines, max(p.min_engines, math.ceil(ongoing / p.target_ongoing_requests)))

    def decide(self, running: int, ongoing: float, now: float, wanted: int | None = None) -> int:
        """``running`` engines (not draining) hold ``ongoing`` requests: the count to have now
        (``wanted``: the count the load asks for, when more than the requests tell: see _scale)."""
        wanted = self.wanted(ongoing) if wanted is None else wanted
        if wanted > running:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since >= self.policy.upscale_delay_s:
                self._up_since = None
                return wanted
        elif wanted < running:
            self._up_since = None
            self._down_since = now if self._down_since is None else self._down_since
            if now - self._down_since >= self.policy.downscale_delay_s:
                self._down_since = None
                return running - 1
        else:
            self._up_since = self._down_since = None
        return running


@dataclass
class ScalingStatus:
    """What the autoscaler sees and does for one model (``EngineAutoscaler.status``)."""

    model: str
    running: list[int]
    starting: list[int]
    draining: list[int]
    ongoing_requests: int
    wanted: int
    # Engines that did not answer this round (being restarted by Ray, or stuck): not counted.
    not_answering: list[int] = field(default_factory=list)


class EngineAutoscaler:
    """Ray actor (``ray.remote(EngineAutoscaler)``): scales the engines of each of ``models`` in
    ``namespace``, ``slots`` giving every slot's configuration by engine index. ``detached``:
    engines it starts outlive the process that started the application (a Serve config's);
    otherwise they belong to this actor, which belongs to that process (the CLI's)."""

    def __init__(self, slots: dict[int, EngineConfig], namespace: str, models: list[ScaledModel],
                 detached: bool = False, clock: Callable[[], float] = time.monotonic,
                 run_rounds: bool = False) -> None:
        """``run_rounds``: start the rounds now (as an actor, whose constructor runs in its event loop;
        so a copy Ray restarts after a failure goes on scaling by itself). Tests call ``_tick``."""
        configure_actor_logging()
        self.slots = slots
        self.namespace = namespace
        self.models = models
        self.detached = detached
        self.scalers = [EngineScaler(m.policy) for m in models]
        # Each slot's model's policy (its drain grace).
        self._policy_of = {i: m.policy for m in models for i in m.indexes}
        self._interval_s = min(m.policy.interval_s for m in models)
        self._clock = clock
        self._starting: dict[int, asyncio.Task[None]] = {}
        self._draining: set[int] = set()
        self._status = [ScalingStatus(m.name, [], [], [], 0, m.policy.min_engines) for m in models]
        # Per model, the engines that did not answer last round (logged when that changes); per engine,
        # the requests it had refused as of last round (its queue full).
        self._silent: list[list[int]] = [[] for _ in models]
        self._refused: dict[int, int] = {}
        # Starts called off while they wait for resources or load (their slots stay busy until they end),
        # and the background stops doing it.
        self._called_off: set[int] = set()
        self._calling_off: set[asyncio.Task[None]] = set()
        # Per model, when its engines last turned a request away (queue full).
        self._last_refusal: dict[int, float] = {}
        self._loop_task: asyncio.Task[None] | None = None
        # Whether the first round has taken over engines an earlier autoscaler left draining.
        self._adopted = False
        # Engine handles this actor started (kept so non-detached engines stay owned and alive).
        self._started: dict[int, Any] = {}
        if run_rounds:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def status(self) -> list[ScalingStatus]:
        """Per autoscaled model, in ``models``' order, as the last round left things."""
        return self._status

    async def shutdown(self, stop_started: bool = False) -> None:
        """Stop scaling; with ``stop_started``, also stop (cleanly) the engines this autoscaler
        started. Otherwise they stay: whoever stops the application stops them, or a redeploy keeps
        them."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in self._starting.values():
            task.cancel()
        if stop_started:
            for index in sorted(self._started):
                await asyncio.to_thread(stop_named_engine, engine_actor_name(index), self.namespace)
            self._started.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("engine autoscaler: a round failed")
            await asyncio.sleep(self._interval_s)

    def _actor(self, index: int) -> Any | None:
        return named_actor(engine_actor_name(index), self.namespace)

    async def _tick(self) -> None:
        actors = {i: await asyncio.to_thread(self._actor, i) for m in self.models for i in m.indexes}
        if not self._adopted:  # (a redeploy's new autoscaler finishes the drains the old one began)
            found = [i for i, a in actors.items() if a is not None]
            states = await _ask((actors[i].drain_status.remote() for i in found), return_exceptions=True)
            answered = [(i, state) for i, state in zip(found, states, strict=True) if not isinstance(state, Exception)]
            self._draining |= {i for i, (draining, _, _) in answered if draining}
            # (An engine that does not answer yet is asked again next round; the other models scale meanwhile.)
            self._adopted = len(answered) == len(found)
        for index in await self._finish_drains(actors):
            actors[index] = None
        for k, model in enumerate(self.models):
            try:
                await self._scale(k, model, {i: actors[i] for i in model.indexes})
            except Exception as e:  # (an engine restarting, or stopped under us: next round)
                logger.info("engine autoscaler: %s's engines did not all answer (%r); trying again", model.name, e)

    async def _scale(self, k: int, model: ScaledModel, actors: dict[int, Any]) -> None:
        """One model's round: its engines' load read, then as its scaler says: a drain called off or an
        engine started; or a start called off or an engine drained."""
        busy = self._draining | set(self._starting)
        present = [i for i, a in actors.items() if a is not None and i not in busy]
        answers = await _ask((_load_of(actors[i]) for i in present), return_exceptions=True)
        # An engine that does not answer (being restarted by Ray, or stuck in a long pass) is not
        # counted as serving: the others' load decides, and more engines start in empty slots if they
        # are short, which is when capacity just dropped. Its slot is not empty: nothing starts there.
        serving = [i for i, answer in zip(present, answers, strict=True) if not isinstance(answer, BaseException)]
        silent = sorted(set(present) - set(serving))
        # One whose actor still answers (sleep_level does not wait for its busy loop) is alive and
        # busy: asleep or waking (an operator at work), loading an adapter, or in a long pass. Nothing
        # changes under it, as under a pause.
        alive = await _ask((actors[i].sleep_level.remote() for i in silent), return_exceptions=True)
        busy_alive = [i for i, answer in zip(silent, alive, strict=True) if not isinstance(answer, BaseException)]
        if silent != self._silent[k]:
            if silent:
                logger.info("engine autoscaler: %s: engine(s) %s do not answer (busy: %s); %s", model.name, silent,
                            busy_alive, "holding" if busy_alive else "scaling on the others' load")
            self._silent[k] = silent
        loads = {i: answer for i, answer in zip(present, answers, strict=True) if i in serving}
        ongoing = sum(unfinished for unfinished, _, _ in loads.values())
        # Requests an engine turned away since the last round because its queue was full (429s): load
        # the engines cannot hold, however few requests they report. (An engine seen the first time,
        # or restarted, sets its count.)
        now = self._clock()
        for i, (_, refused, _) in loads.items():
            before = self._refused.get(i)
            # (Fewer than before: a new engine in the slot, or Ray restarted it: all its refusals are new.)
            if before is not None and (refused > before or (refused < before and refused > 0)):
                self._last_refusal[k] = now
            self._refused[i] = refused
        # (Held for the upscale delay: a burst of 429s wants the engine as long as a load would.)
        last = self._last_refusal.get(k)
        refusing = last is not None and now - last <= model.policy.upscale_delay_s + model.policy.interval_s
        starting = [i for i in self._starting if i in actors and i not in self._called_off]
        draining = sorted(i for i in self._draining if actors.get(i) is not None)
        running = len(serving) + len(starting)
        scaler = self.scalers[k]
        wanted = scaler.wanted(scaler.aggregate(ongoing, now))
        if refusing:
            wanted = max(wanted, min(model.policy.max_engines, running + 1))
        if busy_alive or any(held for _, _, held in loads.values()):  # paused or asleep: nothing changes
            target = running
        else:
            target = scaler.decide(running, ongoing, now, wanted)
        if target > running:
            # A draining engine is loaded and warm: called back before any new one starts.
            for index in draining[:target - running]:
                logger.info("engine autoscaler: %s: %d requests ongoing on %d engines; engine %d stops draining",
                            model.name, ongoing, running, index)
                [answer] = await _ask([actors[index].undrain.remote()], return_exceptions=True)
                if isinstance(answer, BaseException):  # (it does not answer: engines start in empty slots)
                    logger.info("engine autoscaler: draining engine %d does not answer (%r)", index, answer)
                    continue
                self._draining.discard(index)
                running += 1
            empty = [i for i, a in actors.items() if a is None and i not in self._starting]
            for index in empty[:target - running]:
                logger.info("engine autoscaler: %s: %d requests ongoing on %d engines; starting engine %d",
                            model.name, ongoing, running, index)
                self._starting[index] = asyncio.create_task(self._start(index))
        elif target < running and starting:
            # Engines still waiting for resources or loading serve nothing: called off (those beyond
            # what is wanted, the highest slots first) before any engine that serves is drained.
            for index in sorted(starting)[max(0, wanted - len(serving)):]:
                logger.info("engine autoscaler: %s: %d requests ongoing; engine %d is no longer wanted: its start "
                            "is called off", model.name, ongoing, index)
                self._call_off_start(index)
        elif target < running and serving:
            index = max(serving)
            logger.info("engine autoscaler: %s: %d requests ongoing on %d engines; draining engine %d", model.name,
                        ongoing, running, index)
            await _ask([actors[index].drain.remote()])
            self._draining.add(index)
        # (As this round leaves things.)
        self._status[k] = ScalingStatus(model.name, [i for i in serving if i not in self._draining],
                                        sorted(i for i in self._starting if i in actors and i not in self._called_off),
                                        sorted(i for i in self._draining if i in actors), ongoing, wanted, silent)

    def _call_off_start(self, index: int) -> None:
        """Stop an engine's start, in the background (the rounds go on): its placement group removed
        (a wait for resources ends there) and its actor, if created, killed (it serves nothing yet);
        ``_start`` stops one created after this too. The slot stays busy until that start has ended.
        A start that has ended meanwhile (its engine serves) is left alone."""
        if index not in self._starting or index in self._called_off:
            return
        self._called_off.add(index)
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(stop_named_engine, engine_actor_name(index), self.namespace, False))
        self._calling_off.add(task)
        task.add_done_callback(self._calling_off.discard)

    async def _start(self, index: int) -> None:
        try:
            # (A leftover placement group of an engine that died in this slot is freed first.)
            await asyncio.to_thread(stop_named_engine, engine_actor_name(index), self.namespace)
            handle = await asyncio.to_thread(start_engine, self.slots[index], self.namespace, self.detached)
            self._started[index] = handle
            if index not in self._called_off:
                await handle.actor.describe.remote()  # (ready: its model loaded and its KV pool sized)
            if index in self._called_off:  # (while it was placed or loaded: it goes, as its start)
                raise _StartCalledOff
            try:
                await self._join_operator_hold(index, handle.actor)
            except Exception:  # (a loaded engine is kept: the operator's next /pause or /sleep reaches it)
                logger.exception("engine autoscaler: engine %d could not join the others' pause or sleep", index)
            logger.info("engine autoscaler: engine %d is serving", index)
        except Exception:
            if index in self._called_off:
                logger.info("engine autoscaler: engine %d's start is called off", index)
            else:
                logger.exception("engine autoscaler: engine %d did not start", index)
            self._started.pop(index, None)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(stop_named_engine, engine_actor_name(index), self.namespace,
                                        index not in self._called_off)
        finally:
            self._starting.pop(index, None)
            self._called_off.discard(index)

    async def _join_operator_hold(self, index: int, actor: Any) -> None:
        """An operator's /pause or /sleep may have come while this engine loaded (routers reach only
        the engines they know of): it joins the state of the first other engine that answers (a sleep
        at that engine's level)."""
        for other_index in self.slots:
            if other_index == index or other_index in self._draining or other_index in self._starting:
                continue
            other = await asyncio.to_thread(self._actor, other_index)
            if other is None:
                continue
            try:
                [level, paused] = await _ask([other.sleep_level.remote(), other.is_paused.remote()])
            except Exception:
                continue
            # (Requests routers sent it meanwhile are kept, as /pause's mode "keep", or finished before
            # it sleeps: routers may have found it before it joined.)
            if level:
                logger.info("engine autoscaler: engine %d sleeps (level %d); engine %d goes to sleep too",
                            other_index, level, index)
                await actor.sleep.remote(level, "wait")
            elif paused:
                logger.info("engine autoscaler: engine %d is paused; engine %d is paused too", other_index, index)
                await actor.pause_generation.remote("keep", False)
            return

    async def _finish_drains(self, actors: dict[int, Any]) -> list[int]:
        """Stop the draining engines that are idle; returns their indexes."""
        stopped = []
        for index in sorted(self._draining):
            actor = actors.get(index)
            if actor is None:
                self._draining.discard(index)
                continue
            try:
                # (Said again each round: an engine Ray restarted meanwhile forgot it.)
                [(_, unfinished, quiet_s)] = await _ask([actor.drain.remote()])
            except Exception as e:
                logger.info("engine autoscaler: draining engine %d does not answer (%r)", index, e)
                continue
            if unfinished == 0 and quiet_s >= self._policy_of[index].drain_grace_s:
                logger.info("engine autoscaler: engine %d is drained; stopping it", index)
                await asyncio.to_thread(stop_named_engine, engine_actor_name(index), self.namespace)
                self._started.pop(index, None)
                self._draining.discard(index)
                self._refused.pop(index, None)
                stopped.append(index)
        return stopped


class _StartCalledOff(Exception):
    """An engine's start was called off (the load went away while it was placed or loaded)."""


async def _load_of(actor: Any) -> tuple[int, int, bool]:
    """An engine's (unfinished requests, requests refused since start as its queue was full, paused
    or asleep)."""
    stats, held = await _ask([actor.get_stats.remote(), actor.is_paused.remote()])
    return stats.num_unfinished_requests, getattr(stats, "num_requests_refused_full", 0), held


async def _ask(calls: Any, return_exceptions: bool = False) -> list[Any]:
    """Await Ray calls together, each within CALL_TIMEOUT_S (``return_exceptions``: a call that fails
    answers its exception instead of raising)."""
    return await asyncio.gather(*(asyncio.wait_for(call, CALL_TIMEOUT_S) for call in calls),
                                return_exceptions=return_exceptions)


def start_autoscaler(slots: list[EngineConfig], namespace: str, models: list[ScaledModel],
                     detached: bool = False) -> Any:
    """Start (replacing any earlier one) the application's autoscaler actor, for ``models`` (each
    autoscaled model with its slots); ``slots``: every engine's configuration."""
    import ray

    stop_autoscaler(namespace)
    # (Restarted by Ray after a failure: it takes over engines left draining, and frees a leftover
    # placement group before starting an engine in its slot. Non-detached engines it started die
    # with it, as Ray fate-shares them with their owner, and are started again as the load wants.)
    options: dict[str, Any] = {"name": AUTOSCALER_NAME, "namespace": namespace, "num_cpus": 0, "max_restarts": -1}
    if detached:
        options["lifetime"] = "detached"
    if runtime_env := logging_runtime_env():  # (the engines it starts read the log settings here)
        options["runtime_env"] = runtime_env
    by_index = {config.engine_index: config for config in slots}
    actor = ray.remote(EngineAutoscaler).options(**options).remote(by_index, namespace, models, detached,
                                                                   run_rounds=True)
    ray.get(actor.status.remote())  # (constructed: its rounds run)
    if not detached:
        _owned[namespace] = actor
    return actor


def stop_autoscaler(namespace: str, stop_engines: bool = False) -> bool:
    """Stop the application's autoscaler, if one runs; with ``stop_engines`` it first stops the
    engines it started (the process that owns them is going away), else they stay."""
    import ray

    actor = named_actor(AUTOSCALER_NAME, namespace)
    if actor is None:
        _owned.pop(namespace, None)
        return False
    with contextlib.suppress(Exception):
        ray.get(actor.shutdown.remote(stop_engines), timeout=120 if stop_engines else 10)
    _owned.pop(namespace, None)  # (held until it has shut down: the last handle would end it at once)
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
    if not wait_until_name_released(AUTOSCALER_NAME, namespace):
        logger.warning("the autoscaler of namespace %s is still registered after being killed", namespace)
    return True
