"""EngineCoreActor: one Ray actor per engine, running the EngineCore busy loop in its own thread.

Actor methods never step the engine themselves: they put commands on an input queue that the busy
loop drains between passes (so no method blocks a pass for long, and a pass never sees a half-applied
command). Outputs are fanned out by client_index into per-client buffers, which routers receive
pushed over the request channel (engine_core.channel) and other callers long-poll with ``get_output``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine_core.channel import ChannelAddress, ChannelServer
from engine_core.config import EngineConfig
from engine_core.cpu_priority import engine_niceness, lower_cpu_priority
from engine_core.engine_core import EngineCore, RequestRefusedError
from engine_core.executor import ExecutorFactory, ModelInfo, engine_uses_gpu
from engine_core.kv_transfer import PendingLoad
from engine_core.log_setup import configure_actor_logging
from engine_core.lora import LoRANotLoadedError
from engine_core.metrics import EngineMetrics
from engine_core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats, LoRARequest
from engine_core.request import FinishReason
from engine_core.sched.scheduler import PAUSE_MODES, PauseState
from engine_core.sleep_mode import check_sleep, wake_up_tags
from engine_core.stats_logger import EngineStatsLogger, stats_interval
from engine_core.tokenizer_files import read_tokenizer_files

logger = logging.getLogger(__name__)


# How long a pass that could do nothing waits for input before trying again.
_IDLE_PASS_WAIT_S = 0.005


@dataclass(frozen=True)
class EngineDescription:
    model_info: ModelInfo
    scheduler_config: dict[str, Any]
    block_size: int
    num_blocks: int
    engine_index: int
    enable_sleep_mode: bool = False
    enable_prompt_embeds: bool = False
    # Different LoRA adapters one batch mixes at most (0: LoRA is off).
    max_loras: int = 0
    # Prefill/decode disaggregation: kv_producer, kv_consumer or kv_both (None: off).
    kv_role: str | None = None


class _ClientBuffer:
    __slots__ = ("event", "items", "num_event_hashes")

    def __init__(self) -> None:
        self.items: list[EngineCoreOutputs] = []
        self.event = asyncio.Event()
        # Block hashes in the KV cache events waiting in ``items`` (bounded: see _publish).
        self.num_event_hashes = 0


class EngineCoreService:
    """The busy loop and its plumbing, independent of Ray (the actor below is a thin shell)."""

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory, compute_niceness: int = 0) -> None:
        # When admit() last took a request (an engine being drained stops once none came for a while).
        self.last_admitted = time.monotonic()
        # Requests admit() refused because the waiting queue was full (HTTP 429s), since start: the
        # autoscaler reads them as load beyond what the engines hold.
        self.num_refused_full = 0
        self.config = config
        self._executor_factory = executor_factory
        self._compute_niceness = compute_niceness
        self.engine = EngineCore(config, executor_factory(config))
        # Called when the workers could not be brought back after a failed step (a GPU whose CUDA
        # context an illegal access poisoned, say: no restart in this process can serve again).
        self.on_unrecoverable: Callable[[], None] | None = None
        # (The engine's own config: an encoder's turns prefix caching off.)
        self.metrics = EngineMetrics(self.engine.config, self.engine.scheduler_config,
                                     self.engine.model_info.served_model_name, self.engine.num_blocks,
                                     self.engine.num_offload_blocks,
                                     self.engine.num_recurrent_state_slots) if config.log_stats else None
        if self.metrics is not None and self.engine.kv_connector is not None:
            self.metrics.kv_transfer = self.engine.kv_transfer_totals
        if self.metrics is not None:
            self.metrics.kept_states_held = lambda: self.engine.num_recurrent_states_held
        if self.metrics is not None and self.engine.model_info.image_token_id is not None:
            self.metrics.encoder_cache = self.engine.encoder_cache_totals
        self._on_adapters_changed()
        self._inputs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._buffers: dict[int, _ClientBuffer] = {}
        # Clients gone for good (forget_client): nothing is buffered for them.
        self._gone: set[int] = set()
        # Clients that receive the KV cache events (busy-loop thread only), and how many unread hashes
        # one may have before its unread changes are replaced by a snapshot.
        self._kv_subscribers: set[int] = set()
        # The LoRA adapters last sent to the clients (EngineCoreOutputs.lora_adapters), and the
        # scheduler's version of them then.
        self._lora_adapters_sent: frozenset[tuple[int, str]] = frozenset()
        self._lora_adapters_version = 0
        self._max_buffered_event_hashes = max(4 * self.engine.num_blocks, 65536)
        self._buffers_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: str | None = None
        self._stopped = False
        # While a "wait" pause drains the requests in flight, new ones wait here (busy-loop thread only),
        # and each resume starts a new epoch, so a drain that a resume overtook does not pause after it.
        self._held_requests: list[EngineCoreRequest] | None = None
        self._pause_epoch = 0
        # Sleeps and wake-ups under way (their calls run on Ray's threads of the actor).
        self._sleep_calls = 0
        self._sleep_calls_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run_busy_loop, name=f"engine-{config.engine_index}-busy-loop",
                                        daemon=True)
        self._thread.start()
        # vLLM's periodic stats line (off with the metrics: --disable-log-stats).
        self._stats_stopped = threading.Event()
        if self.metrics is not None and config.log_stats_line:
            stats = EngineStatsLogger(self.metrics, config.engine_index, time.monotonic())
            threading.Thread(target=stats.run, args=(self._stats_stopped, stats_interval(), time.monotonic),
                             name=f"engine-{config.engine_index}-stats-log", daemon=True).start()

    # -- called from the actor's event loop -------------------------------------------------------

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def submit(self, command: Callable[[], None]) -> None:
        self._inputs.put(command)

    def add_request(self, request: EngineCoreRequest) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine {self.config.engine_index} is unhealthy: {self._error}")
        self.submit(lambda: self._add_request(request))

    def admit(self, request: EngineCoreRequest) -> None:
        """add_request behind the waiting-queue cap: OverflowError when the queue is full."""
        # Refused here, before it is queued: the caller learns why (an adapter this engine lacks, or
        # what the model cannot serve: generation asked of an embedding model, ...).
        self.engine.check_lora(request)
        self.engine.check_servable(request)
        waiting_cap = self.config.max_waiting_requests
        if waiting_cap and self.num_waiting() >= waiting_cap:
            self.num_refused_full += 1
            raise OverflowError(f"engine {self.config.engine_index}: queue is full ({waiting_cap} waiting requests)")
        self.add_request(request)
        self.last_admitted = time.monotonic()

    def subscribe_kv_events(self, client_index: int) -> None:
        """Send this client the prefix cache's contents, then every change (a prefix-aware router)."""
        def subscribe() -> None:
            if self._kv_subscribers:
                self._publish({})  # events so far go to the earlier subscribers, not after the snapshot
            snapshot = self.engine.record_kv_events()
            self._kv_subscribers.add(client_index)
            self._publish({client_index: EngineCoreOutputs(engine_index=self.config.engine_index,
                                                           timestamp=time.time(), kv_events=snapshot)},
                          take_events=False)

        self.submit(subscribe)

    def unsubscribe_kv_events(self, client_index: int) -> None:
        def unsubscribe() -> None:
            self._kv_subscribers.discard(client_index)
            if not self._kv_subscribers:  # nobody listens: stop recording (the next subscriber gets a snapshot)
                self.engine.stop_kv_events()

        self.submit(unsubscribe)

    def abort_requests(self, request_ids: list[str], tell_clients: bool = False, stopped: bool = False,
                       num_kept_tokens: list[int] | None = None) -> None:
        """``stopped``: the client ended them as finished (a stop string matched on its side): the
        metrics count them so, where an abort is not counted, as of the ``num_kept_tokens`` output
        tokens each kept."""
        ids = list(request_ids)
        self.submit(lambda: self._abort_requests(ids, tell_clients, stopped, num_kept_tokens))

    def _abort_requests(self, request_ids: list[str], tell_clients: bool = False, stopped: bool = False,
                        num_kept_tokens: list[int] | None = None) -> None:
        if stopped and self.metrics is not None:
            self.metrics.on_stopped_by_client(request_ids, num_kept_tokens)
        if self._held_requests:
            gone = set(request_ids)
            dropped = [r for r in self._held_requests if r.request_id in gone]
            self._held_requests = [r for r in self._held_requests if r.request_id not in gone]
            for request in dropped:  # (never read: the producer frees what it holds for them)
                self.engine.decline_remote_kv(request.kv_transfer_params)
            if tell_clients:  # (held during a pause, they never reached the scheduler to be finished there)
                for request in dropped:
                    self._tell_finished(request, FinishReason.ABORT)
        self.engine.abort_requests(request_ids, tell_clients)

    def _tell_finished(self, request: EngineCoreRequest, reason: FinishReason, message: str | None = None) -> None:
        """A request the scheduler never took ends: its client gets its final output now."""
        self._publish({request.client_index: EngineCoreOutputs(
            [EngineCoreOutput(request.request_id, [], reason, message)],
            engine_index=self.config.engine_index, timestamp=time.time())})

    def _add_request(self, request: EngineCoreRequest) -> None:
        if self._held_requests is not None:
            self._held_requests.append(request)
            return
        try:
            added = self.engine.add_request(request)
        except (LoRANotLoadedError, RequestRefusedError) as e:
            # (Its adapter was unloaded after admit() checked it, or what the model cannot serve
            # reached it without admit(): the client learns it from an error output, not by waiting.)
            self.engine.decline_remote_kv(request.kv_transfer_params)
            self._tell_finished(request, FinishReason.ERROR, str(e))
            return
        except Exception as e:
            self.engine.decline_remote_kv(request.kv_transfer_params)
            # Anything else (a request id already live here, say): the client was told it was
            # admitted, so it must hear the end too, or it waits for outputs that never come.
            logger.exception("engine %d: could not add request %s", self.config.engine_index, request.request_id)
            self._tell_finished(request, FinishReason.ERROR, f"the engine could not add the request: {e}")
            return
        if added is not None and self.metrics is not None:
            self.metrics.on_request_added(added, request.num_choices)

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> bool:
        """vLLM's pause for weight updates (blocking). No request is admitted until resume; those in flight:

        - "abort": are aborted at once, each client told (finish reason "abort");
        - "wait": run to their end first, queued ones included (this returns once none is left;
          requests arriving meanwhile are held, then queued);
        - "keep": stay where they are, frozen (nothing is scheduled), and go on after resume.

        ``clear_cache`` then empties the prefix cache (not with "keep": its requests hold their
        blocks). Returns whether the cache was cleared."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        engine = self.engine
        if mode == "keep":
            self.call_in_loop(lambda: engine.pause(PauseState.PAUSED_ALL))
            return False
        if mode == "abort":
            self.call_in_loop(lambda: engine.pause(PauseState.PAUSED_NEW))
            self.call_in_loop(engine.abort_all_requests)
        elif not self._drain_then_pause():
            return False  # a resume came first: not paused, nothing cleared
        return bool(clear_cache and self.call_in_loop(engine.reset_prefix_cache))

    def _drain_then_pause(self) -> bool:
        """Mode "wait": the engine keeps running every request it holds (queued ones and preempted
        ones included, as vLLM drains what its front end accepted) while new ones are held back;
        once none is left, it pauses and takes the held ones into its (paused) queue. False when a
        resume overtook the drain."""
        engine = self.engine

        def hold() -> int:
            if self._held_requests is None:
                self._held_requests = []
            if engine.scheduler.pause_state == PauseState.PAUSED_ALL and not engine.is_sleeping():
                # Frozen by a "keep" pause: a wait lets them run to their end (else they would run on
                # after this pause, holding KV blocks the cache reset and a sleep need).
                engine.pause(PauseState.PAUSED_NEW)
            return self._pause_epoch

        epoch = self.call_in_loop(hold)
        while self.call_in_loop(lambda: self._pause_epoch == epoch and engine.num_drainable_requests() > 0):
            time.sleep(0.02)

        def pause_and_release() -> bool:
            if self._pause_epoch != epoch:
                return False
            engine.pause(PauseState.PAUSED_NEW)
            self._release_held_requests()
            return True

        return self.call_in_loop(pause_and_release)

    def _release_held_requests(self) -> None:
        held, self._held_requests = self._held_requests or [], None
        for request in held:
            self._add_request(request)

    @property
    def pause_epoch(self) -> int:
        """Counts resumes: a drain that began before a resume must not pause after it."""
        return self._pause_epoch

    def is_paused(self) -> bool:
        """Paused, or draining for a "wait" pause (new requests are held already), as vLLM answers
        from the moment the pause is asked."""
        return self.call_in_loop(lambda: self.engine.is_paused() or self._held_requests is not None)

    def resume_generation(self) -> bool:
        """Resume; False (still paused) while the engine sleeps: wake_up resumes it."""
        def resume() -> bool:
            if self.engine.is_sleeping():
                return False
            self._pause_epoch += 1
            self.engine.resume()
            self._release_held_requests()
            return True

        return self.call_in_loop(resume)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode: pause (``mode`` "abort" or "wait", as pause_generation: no request may
        keep KV blocks through it), empty the prefix cache, then release the workers' KV cache and
        weights (level 1: moved to host memory; 2: discarded). Requests arriving meanwhile wait.
        Asleep already: nothing is paused again (a deeper level releases more)."""
        check_sleep(level, mode)
        engine = self.engine
        engine.check_sleep(level)  # (refused before anything is paused)
        with self._sleep_call():
            self._sleep(level, mode)

    def _sleep(self, level: int, mode: str) -> None:
        engine = self.engine
        if not self.call_in_loop(engine.is_sleeping) and not self.pause_generation(mode, clear_cache=True):
            raise RuntimeError(f"engine {self.config.engine_index} could not be emptied to sleep: a resume came "
                               "first, or a request still holds KV blocks (a streaming session waiting for input "
                               "holds its own: sleep with mode=abort)")
        try:
            self.call_in_loop(lambda: engine.sleep(level), timeout=None)
        finally:
            self._report_sleep_state()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Restore what ``tags`` name (None: everything). The wake-up that leaves nothing asleep
        resumes generation (a pause of the operator's own, with nothing asleep, stays). Returns
        whether the engine still sleeps."""
        tags = wake_up_tags(tags)
        with self._sleep_call():
            return self._wake_up(tags)

    @contextlib.contextmanager
    def _sleep_call(self) -> Iterator[None]:
        """Marks a sleep or wake-up under way (health checks then leave the workers alone)."""
        with self._sleep_calls_lock:
            self._sleep_calls += 1
        try:
            yield
        finally:
            with self._sleep_calls_lock:
                self._sleep_calls -= 1

    def _wake_up(self, tags: list[str]) -> bool:
        engine = self.engine

        def wake() -> tuple[bool, bool]:
            was = engine.is_sleeping()
            engine.wake_up(tags)
            return was, engine.is_sleeping()

        try:
            was, still = self.call_in_loop(wake, timeout=None)
        finally:
            self._report_sleep_state()
        if was and not still:
            self.resume_generation()
        return still

    def _report_sleep_state(self) -> None:
        if self.metrics is not None and self.metrics.sleep_level is not None:
            self.metrics.sleep_level = self.engine.sleep_level  # (0 once nothing sleeps)

    def add_lora(self, lora: LoRARequest, replacing: int | None = None) -> bool:
        """Load an adapter between passes (ValueError for one the model cannot serve)."""
        return self._change_adapters(lambda: self.engine.add_lora(lora, replacing), timeout=300.0)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._change_adapters(lambda: self.engine.remove_lora(lora_int_id))

    def retire_lora(self, lora_int_id: int) -> bool:
        return self._change_adapters(lambda: self.engine.retire_lora(lora_int_id))

    def _change_adapters(self, change: Callable[[], bool], timeout: float = 30.0) -> bool:
        def run() -> bool:
            try:
                return change()
            finally:
                self._on_adapters_changed()

        return self.call_in_loop(run, timeout=timeout)

    def _on_adapters_changed(self) -> None:
        if self.metrics is not None and self.config.lora_config is not None:
            self.metrics.on_adapters_loaded([lora.lora_name for lora in self.engine.list_loras()])

    async def get_output(self, client_index: int, timeout: float) -> EngineCoreOutputs:
        """Everything buffered for this client, merged; waits up to ``timeout`` for something."""
        buffer = self._buffer(client_index)
        if not buffer.items:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(buffer.event.wait(), timeout)
        return _merge(self._take(buffer), self.config.engine_index)

    async def next_outputs(self, client_index: int) -> EngineCoreOutputs:
        """Wait until this client has outputs, then take them all, merged (the channel's pusher)."""
        buffer = self._buffer(client_index)
        while True:
            await buffer.event.wait()
            items = self._take(buffer)
            if items:
                return _merge(items, self.config.engine_index)

    def _take(self, buffer: _ClientBuffer) -> list[EngineCoreOutputs]:
        with self._buffers_lock:
            items, buffer.items = buffer.items, []
            buffer.num_event_hashes = 0
            buffer.event.clear()
        return items

    def forget_client(self, client_index: int) -> None:
        """Drop a client's output buffer: it is gone for good (the request channel's call, once its
        connection closed and no new one came). Its requests were aborted when it closed; outputs
        for it from now on (a late event, say) are dropped too, until it connects again."""
        with self._buffers_lock:
            self._buffers.pop(client_index, None)
            self._gone.add(client_index)

    def client_connected(self, client_index: int) -> None:
        """A client's request channel opened (again): outputs for it are kept, and with LoRA on it is
        told the adapters in use now (then of each change)."""
        with self._buffers_lock:
            self._gone.discard(client_index)
        if self.config.lora_config is not None:
            self.submit(lambda: self._publish({client_index: EngineCoreOutputs(
                engine_index=self.config.engine_index, timestamp=time.time(),
                lora_adapters=sorted(self._lora_adapters_sent))}, take_events=False))

    def _buffer(self, client_index: int) -> _ClientBuffer:
        with self._buffers_lock:
            return self._buffer_locked(client_index)

    def _buffer_locked(self, client_index: int) -> _ClientBuffer:
        """A client's buffer, made on first use; the caller holds the buffers lock."""
        buffer = self._buffers.get(client_index)
        if buffer is None:
            buffer = self._buffers[client_index] = _ClientBuffer()
        return buffer

    # -- the busy loop (its own thread) -----------------------------------------------------------

    def _run_busy_loop(self) -> None:
        # Niceness is per thread on Linux and inherited by the threads a thread starts: lowered here,
        # it covers the passes and the OpenMP pool this thread's forwards start (libgomp keeps one pool
        # per thread that opens parallel regions), while the event loop serving the request channel
        # and actor calls keeps the process's priority.
        if self._compute_niceness:
            lower_cpu_priority(self._compute_niceness)
        engine = self.engine
        while not self._stopped:
            # An idle engine blocks here instead of spinning; one whose last pass could do nothing
            # (paused, or waiting requests that cannot be admitted yet) waits briefly for input.
            if not engine.has_work():
                self._drain_inputs(block=True)
            elif engine.last_step_idle:
                self._drain_inputs(block=True, timeout=_IDLE_PASS_WAIT_S)
            else:
                self._drain_inputs(block=False)
            if self._stopped:
                break
            if not engine.has_work():
                # (An idle engine's held prefills still expire and its declines still go out; a
                # working one's are seen to in each pass.)
                engine.kv_housekeeping()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a worker died or the model raised: fail in-flight requests
                logger.exception("engine %d: step failed", self.config.engine_index)
                self._on_step_failure(e)
                continue
            self._publish(outputs)

    def _drain_inputs(self, block: bool, timeout: float = 0.5) -> None:
        try:
            command = self._inputs.get(timeout=timeout) if block else self._inputs.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is None:
                self._stopped = True
                return
            try:
                command()
            except Exception:
                # A bad request (e.g. a duplicate id) must not take the engine down.
                logger.exception("engine %d: command failed", self.config.engine_index)
            try:
                command = self._inputs.get_nowait()
            except queue.Empty:
                if self._kv_subscribers:
                    self._publish({})  # changes a command made (a prefix cache reset) go out now
                return

    def _publish(self, outputs: dict[int, EngineCoreOutputs], take_events: bool = True) -> None:
        if take_events and self._kv_subscribers:
            events = self.engine.take_kv_events()
            if events:  # every subscriber gets every change, whichever client's requests caused it
                for client_index in self._kv_subscribers:
                    outputs.setdefault(client_index, EngineCoreOutputs(
                        engine_index=self.config.engine_index, timestamp=time.time())).kv_events = events
        if (self.config.lora_config is not None and take_events
                and self.engine.lora_adapters_version() != self._lora_adapters_version):
            self._lora_adapters_version = self.engine.lora_adapters_version()
            adapters = self.engine.active_lora_adapters()
            if adapters != self._lora_adapters_sent:  # every client hears of it
                self._lora_adapters_sent = adapters
                with self._buffers_lock:
                    clients = [c for c in self._buffers if c not in self._gone]
                for client_index in clients:
                    outputs.setdefault(client_index, EngineCoreOutputs(
                        engine_index=self.config.engine_index, timestamp=time.time())).lora_adapters = sorted(adapters)
        if not outputs:
            return  # (a drain after commands that changed nothing)
        stats = None
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                stats = eco.scheduler_stats
                # Stats describe the engine (EngineCore keeps them): not routed to whichever client got them.
                eco.scheduler_stats = None
        if self.metrics is not None:
            self.metrics.on_step(outputs, stats)
        loop = self._loop
        for client_index, eco in outputs.items():
            if not eco.outputs and not eco.finished_requests and not eco.kv_events and eco.lora_adapters is None:
                continue
            with self._buffers_lock:
                if client_index in self._gone:
                    continue
                buffer = self._buffer_locked(client_index)
                buffer.items.append(eco)
                if eco.kv_events:
                    buffer.num_event_hashes += sum(len(hashes) for _, hashes in eco.kv_events)
                    if buffer.num_event_hashes > self._max_buffered_event_hashes:
                        self._compact_events(buffer)
            if loop is not None:
                loop.call_soon_threadsafe(buffer.event.set)

    def _compact_events(self, buffer: _ClientBuffer) -> None:
        """A subscriber that stopped reading (stalled, or gone without closing its socket): its unread
        changes are replaced by one snapshot of the cache, which says the same in at most a pool's
        worth of hashes. Busy-loop thread, under the buffers lock."""
        for item in buffer.items:
            item.kv_events = None
        snapshot = self.engine.kv_snapshot()
        buffer.items.append(EngineCoreOutputs(engine_index=self.config.engine_index, timestamp=time.time(),
                                              kv_events=snapshot))
        buffer.num_event_hashes = sum(len(hashes) for _, hashes in snapshot)

    def _on_step_failure(self, error: Exception) -> None:
        message = f"engine {self.config.engine_index} failed: {type(error).__name__}: {error}"
        # (The failed pass's frames hold its tensors and the old workers: let the restart free them.)
        _clear_frames(error)
        self._error = message
        self._publish(self.engine.fail_all_requests(message))
        self._restart_executor()
        self._publish({})  # the restart cleared the prefix cache: subscribers hear it now, not at the next pass

    def _restart_executor(self) -> None:
        """Bring the workers back; the engine is healthy again once they serve."""
        try:
            self.engine.executor.restart()
            # The new workers' caches are empty: the same pool size (the scheduler's block ids), and
            # nothing the prefix cache remembers is valid any more (every block is free by now).
            self.engine.executor.initialize_cache(self.engine.num_blocks)
            if not self.engine.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be reset after the restart")
            self.engine.sleep_again()  # (asleep: the new workers release what the old ones had)
            self._error = None
            logger.info("engine %d: workers restarted", self.config.engine_index)
        except Exception as e:
            logger.error("engine %d: restart failed: %s", self.config.engine_index, e)
            self._error = f"{self._error}; restart failed: {e}"
            if self.on_unrecoverable is not None:
                self.on_unrecoverable()

    # -- control ----------------------------------------------------------------------------------

    def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(self._error)
        if not self._thread.is_alive():
            raise RuntimeError(f"engine {self.config.engine_index}: busy loop is not running")
        if self._sleep_calls:
            # Workers busy sleeping or waking (a checkpoint read again can take minutes) answer no
            # ping until done: the engine is not unhealthy for that (vLLM's /health stays 200).
            return
        self.engine.executor.check_health()

    def is_healthy(self) -> bool:
        try:
            self.check_health()
        except Exception:
            return False
        return True

    def call_in_loop(self, fn: Callable[[], Any], timeout: float | None = 30.0) -> Any:
        """Run ``fn`` on the busy-loop thread between passes and wait for its result (``timeout``
        None: as long as it takes, e.g. reading a checkpoint again)."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def command() -> None:
            try:
                box["value"] = fn()
            except Exception as e:
                box["error"] = e
            finally:
                done.set()

        self.submit(command)
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not run the command in time")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def num_waiting(self) -> int:
        scheduler = self.engine.scheduler
        return len(scheduler.waiting) + len(scheduler.skipped_waiting) + self._inputs.qsize()

    def stats(self) -> EngineStats:
        stats = self.engine.stats(healthy=self.is_healthy())
        stats.num_requests_refused_full = self.num_refused_full
        return stats

    def shutdown(self) -> None:
        self._stats_stopped.set()
        self._inputs.put(None)
        self._thread.join(timeout=10)
        self.engine.shutdown()


def _merge(items: list[EngineCoreOutputs], engine_index: int) -> EngineCoreOutputs:
    if len(items) == 1:
        return items[0]
    merged = EngineCoreOutputs(engine_index=engine_index, timestamp=time.time())
    finished: set[str] = set()
    events: list[tuple[int, list[bytes]]] = []
    for eco in items:
        merged.outputs.extend(eco.outputs)
        if eco.finished_requests:
            finished |= eco.finished_requests
        if eco.kv_events:
            events.extend(eco.kv_events)
        if eco.lora_adapters is not None:  # (the latest says it all)
            merged.lora_adapters = eco.lora_adapters
        merged.timestamp = eco.timestamp or merged.timestamp
    merged.finished_requests = finished or None
    merged.kv_events = events or None
    return merged


ENGINE_HOST_ENV = "LLM_CLUSTER_ENGINE_HOST"


def engine_host() -> str:
    """The address an engine's request channel listens on: its Ray node's, unless configured."""
    configured = os.environ.get(ENGINE_HOST_ENV)
    if configured:
        return configured
    import ray

    return ray.util.get_node_ip_address()


def _log_release_failure(future: concurrent.futures.Future[Any]) -> None:
    error = future.exception()
    if error is not None:  # (the producer frees the blocks at its abort_request_timeout)
        logger.info("could not tell a prefill engine to free blocks: %s", error)


def _nothing() -> None:
    """A command that only wakes the busy loop."""


def named_actor(name: str, namespace: str) -> Any | None:
    """The actor of that name in that namespace (an engine, the autoscaler); None when there is none."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def wait_until_name_released(name: str, namespace: str, timeout_s: float = 15.0) -> bool:
    """Wait until no live actor holds ``name`` (``ray.kill`` returns before Ray has released the
    name, and an actor started under it meanwhile would be refused); False if it is still held."""
    deadline = time.monotonic() + timeout_s
    while named_actor(name, namespace) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def pause_record_key(namespace: str, name: str) -> str:
    """Where the engine actor ``name`` records that it is paused, in Ray's key-value store (which
    outlives the actor): a restarted actor reads it and comes back paused; a new one starts clear."""
    return f"llm-cluster/paused/{namespace}/{name}"


# The pause record of an engine that sleeps: this, then its level.
SLEEP_RECORD = "sleep:"


def _own_pause_record_key() -> str | None:
    import ray

    context = ray.get_runtime_context()
    name = context.get_actor_name()
    return pause_record_key(context.namespace, name) if name else None


def _clear_frames(error: BaseException) -> None:
    """Drop the locals of the frames ``error`` (and the exceptions it chains) passed through."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]


def _exit_for_a_restart() -> None:
    """The busy loop's call: the error outputs it just published go out first (the event loop's
    pushers send them meanwhile), then the process ends."""
    logger.error("the workers cannot be restarted in this process: exiting so that Ray restarts the engine")
    time.sleep(1.0)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class EngineCoreActor:
    """Ray actor shell around EngineCoreService (create with ``ray.remote(EngineCoreActor)``)."""

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory) -> None:
        from ray.experimental import internal_kv

        configure_actor_logging()
        self.service = EngineCoreService(config, executor_factory,
                                         compute_niceness=engine_niceness(config.engine_niceness,
                                                                          engine_uses_gpu(config)))
        # Workers that cannot be restarted in this process: the process ends, and Ray restarts the
        # actor (a new process: a fresh CUDA context, the model loaded again) while restarts remain.
        self.service.on_unrecoverable = _exit_for_a_restart
        self._channel: ChannelServer | None = None
        # When cluster.autoscaler began draining this engine (None: it is not being drained).
        self._drain_started: float | None = None
        self._connect_kv_transfer()
        self._kv = internal_kv
        self._pause_key = _own_pause_record_key()
        # Pause and resume, with their record, one at a time: a resume racing a pause cannot leave
        # a record saying paused on a running engine.
        self._pause_lock = asyncio.Lock()
        record = internal_kv._internal_kv_get(self._pause_key) if self._pause_key is not None else None
        if record:
            # Paused (/pause) when this actor died: it comes back paused. It holds no request, so
            # "keep" (nothing scheduled) is what every mode leaves. Asleep (/sleep): it sleeps again.
            level = record.decode().removeprefix(SLEEP_RECORD) if record.startswith(SLEEP_RECORD.encode()) else ""
            if level:
                logger.info("engine %d: restarted while asleep; sleeping again until /wake_up", config.engine_index)
                self.service.sleep(int(level))
            else:
                logger.info("engine %d: restarted while paused; staying paused until /resume", config.engine_index)
                self.service.pause_generation("keep", clear_cache=False)

    def _bind(self) -> None:
        if self.service._loop is None:
            self.service.bind_loop(asyncio.get_running_loop())

    async def ready(self) -> ModelInfo:
        self._bind()
        return self.service.engine.model_info

    async def describe(self) -> EngineDescription:
        engine = self.service.engine
        return EngineDescription(model_info=engine.model_info, scheduler_config=engine.scheduler_config.as_dict(),
                                 block_size=self.service.config.block_size, num_blocks=engine.num_blocks,
                                 engine_index=self.service.config.engine_index,
                                 enable_sleep_mode=self.service.config.enable_sleep_mode,
                                 enable_prompt_embeds=self.service.config.enable_prompt_embeds,
                                 max_loras=lora.max_loras if (lora := self.service.config.lora_config) else 0,
                                 kv_role=transfer.kv_role if (transfer := self.service.config.kv_transfer_config)
                                 else None)

    async def engine_config(self) -> EngineConfig:
        """The configuration this engine was started with (a redeploy compares it with the wanted one)."""
        return self.service.config

    async def get_tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer files of the engine's model dir, so a router on another node can load them."""
        info = self.service.engine.model_info
        return read_tokenizer_files(info.model_dir, info.tokenizer_dir)

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._bind()
        self.service.admit(request)

    async def abort_requests(self, request_ids: list[str], tell_clients: bool = False) -> None:
        """``tell_clients``: the requests' own clients get their final outputs (an abort asked for
        by another client: a background response cancelled through another router replica)."""
        self.service.abort_requests(request_ids, tell_clients)

    async def channel_address(self) -> ChannelAddress:
        """Where routers open this engine's request channel (engine_core.channel)."""
        self._bind()
        if self._channel is None:
            self._channel = ChannelServer(self.service)
        return await self._channel.start(engine_host())

    async def get_output(self, client_index: int, timeout: float = 1.0) -> EngineCoreOutputs:
        self._bind()
        return await self.service.get_output(client_index, timeout)

    async def drain(self) -> tuple[bool, int, float]:
        """Being scaled away (cluster.autoscaler): every router client, and any that connects later,
        is told to send no new request; requests already sent, or on their way, still run. (Asked
        again, it changes nothing: the autoscaler repeats it each round, for an engine Ray restarted.)
        Returns ``drain_status()``."""
        self._bind()
        if self._channel is None:
            self._channel = ChannelServer(self.service)
        if self._drain_started is None:
            self._drain_started = time.monotonic()
        self._channel.announce_draining()
        return await self.drain_status()

    async def undrain(self) -> None:
        """Wanted again (cluster.autoscaler: the load came back while this engine drained): every
        router client, and any that connects later, may send it requests again."""
        self._bind()
        self._drain_started = None
        if self._channel is not None:
            self._channel.announce_serving()

    async def drain_status(self) -> tuple[bool, int, float]:
        """(draining, unfinished requests, seconds since the drain began or a request was last
        admitted, whichever is later): a drained engine stops once it is idle and routers have had
        time to hear of the drain."""
        stats = await self.get_stats()
        since = max(self.service.last_admitted, self._drain_started or 0.0)
        # (Prefills holding KV for a decode engine to read count: stopping would fail those reads.)
        return (self._drain_started is not None, stats.num_unfinished_requests + stats.kv_transfer_held_requests,
                time.monotonic() - since)

    async def pause(self, mode: int = PauseState.PAUSED_NEW) -> None:
        await asyncio.to_thread(self.service.call_in_loop, lambda: self.service.engine.pause(PauseState(mode)))

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> bool:
        if mode == "wait":
            # The drain can take as long as the longest request: it runs outside the lock, so a
            # /resume (which overtakes it: see _drain_then_pause), a /pause?mode=abort or a /sleep
            # is not held up until it ends; only the record of the outcome takes the lock.
            cleared = await asyncio.to_thread(self.service.pause_generation, mode, clear_cache)
            async with self._pause_lock:
                await self._record_paused(mode)
            return cleared
        async with self._pause_lock:
            cleared = await asyncio.to_thread(self.service.pause_generation, mode, clear_cache)
            await self._record_paused(mode)
            return cleared

    async def _record_paused(self, mode: str) -> None:
        """Record a pause that holds (under the pause lock). A sleeping engine keeps its sleep's
        record: an actor restarted from it must sleep again, not come back paused and awake."""
        if not self.service.engine.is_sleeping() and await self.is_paused():
            await self._record_pause(mode)

    async def is_paused(self) -> bool:
        return await asyncio.to_thread(self.service.is_paused)

    async def resume(self) -> bool:
        """False while the engine sleeps (it stays paused until wake_up)."""
        async with self._pause_lock:
            if not await asyncio.to_thread(self.service.resume_generation):
                return False
            await self._record_pause(None)
            return True

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        epoch = None
        if mode == "wait" and not self.service.engine.is_sleeping():
            epoch = self.service.pause_epoch
            # The drain can take as long as the longest request: outside the lock, as a "wait" pause's
            # (pause_generation), so a /pause?mode=abort cuts it short and a /resume overtakes it
            # (then the sleep is refused, as a resume that came first refuses it).
            check_sleep(level, mode)
            self.service.engine.check_sleep(level)
            emptied = await asyncio.to_thread(self.service.pause_generation, "wait", True)
            if not emptied and not await self.is_paused():
                raise RuntimeError(f"engine {self.service.config.engine_index} could not be emptied to sleep: a "
                                   "resume came first")
            # (Not emptied while paused: what holds KV blocks is said by the sleep below.)
        async with self._pause_lock:
            if epoch is not None and self.service.pause_epoch != epoch:  # (a resume between the drain and here)
                raise RuntimeError(f"engine {self.service.config.engine_index} could not be emptied to sleep: a "
                                   "resume came first")
            try:
                await asyncio.to_thread(self.service.sleep, level, mode)
            finally:
                if self.service.engine.is_sleeping():  # (a restarted actor sleeps again)
                    await self._record_pause(f"{SLEEP_RECORD}{self.service.engine.sleep_level}")
                elif await self.is_paused():
                    await self._record_pause(mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Whether it still sleeps (some of what it released was not named)."""
        async with self._pause_lock:
            asleep = await asyncio.to_thread(self.service.wake_up, tags)
            if not asleep and not await self.is_paused():
                await self._record_pause(None)
            return asleep

    async def is_sleeping(self) -> bool:
        # (Read as it stands: a long sleep or wake-up on the busy loop must not hold this answer.)
        return self.service.engine.is_sleeping()

    async def sleep_level(self) -> int:
        """The level this engine sleeps at (0: awake), read as is_sleeping is."""
        engine = self.service.engine
        return engine.sleep_level if engine.is_sleeping() else 0

    async def _record_pause(self, mode: str | None) -> None:
        """Record (or, with None, clear) the pause in Ray's key-value store, off the event loop. A
        store that fails only costs the record: the pause itself stands, and is logged."""
        if self._pause_key is None:
            return
        key = self._pause_key
        try:
            if mode is None:
                await asyncio.to_thread(self._kv._internal_kv_del, key)
            else:
                await asyncio.to_thread(self._kv._internal_kv_put, key, mode.encode(), True)
        except Exception as e:
            logger.warning("engine %d: could not record the pause state (%s); a restart will not restore it",
                           self.service.config.engine_index, e)

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.to_thread(self.service.call_in_loop, self.service.engine.reset_prefix_cache)

    # -- prefill/decode disaggregation (engine_core.kv_transfer) ---------------------------------------

    def _connect_kv_transfer(self) -> None:
        """With --kv-transfer-config: name this engine in the parameters its prefills hand out
        (consumers find it by them), and read other engines' blocks through their actors. Every
        engine can tell a producer it will not read blocks held for it (one without the config that
        got a producer's parameters too). Lookups and calls run on a few threads of their own (a name
        lookup waits for Ray's control store: not on the busy loop); none start until needed."""
        import ray

        context = ray.get_runtime_context()
        engine = self.service.engine
        handles: dict[tuple[str, str], Any] = {}
        # (Name lookups wait for Ray's control store; releases each have a lookup and a call: their
        # own threads, so neither holds up the busy loop nor the other. A read itself runs as an
        # actor call whose future completes when the data is here, holding no thread.)
        lookups = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-lookup")
        releases = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-release")

        def producer(params: dict[str, Any]) -> tuple[tuple[str, str], Any]:
            key = (str(params.get("remote_engine_id") or ""), str(params.get("remote_namespace") or context.namespace))
            handle = handles.get(key)
            if handle is None:
                handle = handles[key] = ray.get_actor(key[0], namespace=key[1])
            return key, handle

        def fetch(load: PendingLoad) -> concurrent.futures.Future[Any]:
            result: concurrent.futures.Future[Any] = concurrent.futures.Future()

            def looked_up(lookup: concurrent.futures.Future[Any]) -> None:
                try:
                    key, handle = lookup.result()
                    # (The windowed groups' blocks only where there are some: a producer of an earlier
                    # version reads the rest.)
                    groups = (load.remote_group_block_ids,) if load.remote_group_block_ids else ()
                    read = handle.read_kv_blocks.remote(
                        load.params.get("remote_request_id"), str(load.params.get("remote_nonce") or ""),
                        load.remote_block_ids, load.first_block, load.digest, load.num_tokens, *groups).future()
                except Exception as e:
                    result.set_exception(e)
                    return

                def done(answer: concurrent.futures.Future[Any]) -> None:
                    try:
                        result.set_result(answer.result())
                    except Exception as e:
                        if isinstance(e, ray.exceptions.RayActorError):
                            handles.pop(key, None)  # (restarted under its name, or gone: looked up again)
                        result.set_exception(e)

                read.add_done_callback(done)

            lookups.submit(producer, load.params).add_done_callback(looked_up)
            return result

        def release(params: dict[str, Any]) -> None:
            _, handle = producer(params)
            handle.release_kv_blocks.remote(params.get("remote_request_id"), str(params.get("remote_nonce") or ""))

        engine.kv_releaser = lambda params: releases.submit(release, params).add_done_callback(_log_release_failure)
        if engine.kv_connector is None:
            return
        engine.kv_connector.engine_id.update(remote_engine_id=context.get_actor_name() or "",
                                             remote_namespace=context.namespace, remote_host=engine_host())
        engine.kv_fetcher = fetch
        # (A read done wakes the busy loop, which may be waiting for input with nothing else to do.)
        engine.on_kv_load_done = lambda: self.service.submit(_nothing)

    async def read_kv_blocks(self, request_id: str, nonce: str, block_ids: list[int], first_block: int, digest: str,
                             num_tokens: int, group_block_ids: list[int] | None = None) -> list[Any]:
        """A decode engine reads the KV blocks a prefill finished here holds for it, between passes
        (``EngineCore.read_held_kv``)."""
        service = self.service
        return await asyncio.to_thread(
            service.call_in_loop,
            lambda: service.engine.read_held_kv(request_id, nonce, block_ids, first_block, digest, num_tokens,
                                                group_block_ids or []), 120.0)

    async def release_kv_blocks(self, request_id: str, nonce: str) -> None:
        """A reader of a prefill held here will not read it (its request computed the prompt itself,
        or ended first): the blocks go back once no reader is left."""
        self.service.submit(lambda: self.service.engine.release_held_kv(request_id, nonce))

    async def add_lora(self, lora: LoRARequest, replacing: int | None = None) -> bool:
        """Load an adapter on this engine's workers (between passes); ValueError if it cannot be
        served. ``replacing``: the id of the adapter of that name it reloads in place (then
        ``retire_lora`` that one)."""
        return await asyncio.to_thread(self.service.add_lora, lora, replacing)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await asyncio.to_thread(self.service.remove_lora, lora_int_id)

    async def retire_lora(self, lora_int_id: int) -> bool:
        """Take no new requests under an adapter an in-place reload replaced; unload it once its
        requests finish."""
        return await asyncio.to_thread(self.service.retire_lora, lora_int_id)

    async def list_loras(self) -> list[LoRARequest]:
        # Read as it stands (a copy taken in one step): no need to wait for the running pass.
        return self.service.engine.list_loras()

    async def lora_users(self, lora_int_id: int) -> int:
        return self.service.engine.lora_users(lora_int_id)

    async def get_stats(self) -> EngineStats:
        return await asyncio.to_thread(self.service.call_in_loop, self.service.stats)

    async def get_metrics_text(self) -> bytes:
        return self.service.metrics.render() if self.service.metrics is not None else b""

    async def thread_niceness(self) -> dict[str, int]:
        """The niceness of the busy loop (compute) and of the event loop serving the request channel."""
        return {"busy_loop": os.getpriority(os.PRIO_PROCESS, self.service._thread.native_id),
                "event_loop": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}

    async def check_health(self) -> bool:
        # Off the event loop: a Ray executor's check waits for its workers, which may be mid-step,
        # and the event loop serves the request channel.
        await asyncio.to_thread(self.service.check_health)
        return True

    async def shutdown(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        await asyncio.to_thread(self.service.shutdown)
