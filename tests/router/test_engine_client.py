"""RequestStream: batched reads, finish truncation, the timeout marker, and release on close."""

from __future__ import annotations

import asyncio

import pytest

from engine_core.channel import AbortRequests, Accepted, Draining, Serving
from engine_core.outputs import EngineCoreOutput, EngineCoreRequest
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams
from router.engine_client import (
    EngineClient,
    EngineUnavailableError,
    OutputQueue,
    RequestRefusedByEngineError,
    RequestStream,
    RequestTimeoutError,
)


def _client_with_request(rid: str) -> tuple[EngineClient, OutputQueue]:
    # One engine slot with no channel: nothing here needs a real engine.
    client = EngineClient([object()], client_index=1)
    slot = client._slots[0]
    queue = OutputQueue()
    client._queues[rid] = queue
    slot.requests.add(rid)
    slot.in_flight += 1
    return client, queue


def test_a_batch_is_everything_queued_up_to_the_finish():
    async def run():
        client, queue = _client_with_request("r")
        stream = RequestStream(client, 0, "r", queue, None)
        queue.put_nowait(EngineCoreOutput("r", [1]))
        assert [o.new_token_ids for o in await stream.next_batch()] == [[1]]
        for out in (EngineCoreOutput("r", [2]), EngineCoreOutput("r", [3]),
                    EngineCoreOutput("r", [4], FinishReason.LENGTH), EngineCoreOutput("r", [99])):
            queue.put_nowait(out)
        batch = await stream.next_batch()
        assert [o.new_token_ids for o in batch] == [[2], [3], [4]] and stream.finished
        assert await stream.next_batch() == []
        await stream.close()
        assert client.loads() == [0] and "r" not in client._queues

    asyncio.run(run())


def test_the_timeout_marker_ends_the_stream_and_close_releases_it():
    async def run():
        client, queue = _client_with_request("t")
        stream = RequestStream(client, 0, "t", queue, timeout_s=0.05)
        queue.put_nowait(EngineCoreOutput("t", [7]))
        assert len(await stream.next_batch()) == 1
        with pytest.raises(RequestTimeoutError):
            await stream.next_batch()
        assert client.loads() == [1]
        await stream.close()  # not finished: aborts (no channel here) and forgets it
        assert client.loads() == [0] and stream.finished

    asyncio.run(run())


def test_the_timer_is_cancelled_when_the_request_finishes_first():
    async def run():
        client, queue = _client_with_request("f")
        stream = RequestStream(client, 0, "f", queue, timeout_s=0.05)
        queue.put_nowait(EngineCoreOutput("f", [1], FinishReason.STOP))
        assert (await stream.next_batch())[0].finish_reason == FinishReason.STOP
        await stream.close()
        await asyncio.sleep(0.1)
        assert queue.empty()  # no late timeout marker

    asyncio.run(run())


def test_a_caller_that_leaves_while_the_engine_admits_aborts_the_request():
    class RecordingChannel:
        def __init__(self):
            self.sent = []

        def send(self, message):
            self.sent.append(message)

    async def run():
        client = EngineClient([object()], client_index=1)
        channel = client._slots[0].channel = RecordingChannel()
        request = EngineCoreRequest(request_id="left", prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                                    client_index=1)
        task = asyncio.create_task(client.add_request(0, request))
        await asyncio.sleep(0.05)  # sent; the engine's Accepted has not come back
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [type(m).__name__ for m in channel.sent] == ["AddRequest", "AbortRequests"]
        assert channel.sent[1].request_ids == ["left"]
        assert client.loads() == [0] and not client._slots[0].pending

    asyncio.run(run())


class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def _admitted(client: EngineClient, rid: str):
    """Open a request on engine 0 and answer its admission; returns the stream."""
    async def run():
        opening = asyncio.create_task(client.open(0, EngineCoreRequest(
            request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(), client_index=1)))
        await asyncio.sleep(0)
        client._on_message(client._slots[0], Accepted(rid))
        return await opening
    return run()


def test_a_failed_health_probe_over_a_live_channel_stops_routing_but_fails_nothing():
    async def run():
        client = EngineClient([object()], client_index=1)
        slot = client._slots[0]
        channel = slot.channel = _Channel()
        stream = await _admitted(client, "live")
        client._mark_unhealthy(slot, TimeoutError("health probe took too long"))
        assert client.healthy() == [False]
        assert stream._queue.empty()  # the engine still runs it and reports its own failures
        await stream.close()  # the client left: the abort goes out although the engine is marked unhealthy
        assert isinstance(channel.sent[-1], AbortRequests) and channel.sent[-1].request_ids == ["live"]
        slot.channel = None  # the channel is gone: now requests there can never finish
        await _admitted_without_channel_fails(client)
        if slot.prober is not None:
            slot.prober.cancel()

    async def _admitted_without_channel_fails(client):
        slot = client._slots[0]
        queue = client._queues["orphan"] = OutputQueue()
        slot.requests.add("orphan")
        client._mark_unhealthy(slot, ConnectionError("channel closed"))
        [out] = await queue.take_all()
        assert out.finish_reason == FinishReason.ERROR

    asyncio.run(run())


def test_health_needs_an_open_channel():
    async def run():
        class Handle:
            class check_health:
                @staticmethod
                async def remote():
                    return True

        client = EngineClient([Handle()], client_index=1)
        client._slots[0].healthy = False
        assert await client.refresh_health() == [False]  # the actor answers, but requests would fail
        client._slots[0].channel = _Channel()
        assert await client.refresh_health() == [True]

    asyncio.run(run())


def test_an_engine_that_refuses_requests_is_taken_out_of_routing():
    async def run():
        client = EngineClient([object()], client_index=1)
        slot = client._slots[0]
        slot.channel = _Channel()
        opening = asyncio.create_task(client.add_request(0, EngineCoreRequest(
            request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(), client_index=1)))
        await asyncio.sleep(0)
        client._on_message(slot, Accepted("r", "engine 0 is unhealthy: workers restarting"))
        with pytest.raises(EngineUnavailableError):
            await opening
        assert client.healthy() == [False] and client.loads() == [0]
        slot.prober.cancel()

    asyncio.run(run())


def test_a_request_the_engine_cannot_serve_is_refused_and_the_engine_stays_in_routing():
    """Refused for what it asks (e.g. more logprobs than the engine's --max-logprobs), not because the
    engine is down: the caller learns why (a 400 in the router), and the engine keeps its traffic."""
    async def run():
        client = EngineClient([object()], client_index=1)
        slot = client._slots[0]
        slot.channel = _Channel()
        opening = asyncio.create_task(client.add_request(0, EngineCoreRequest(
            request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(logprobs=30), client_index=1)))
        await asyncio.sleep(0)
        client._on_message(slot, Accepted("r", "Requested sample logprobs of 30, which is greater than max "
                                               "allowed: 20", refused=True))
        with pytest.raises(RequestRefusedByEngineError, match="greater than max allowed"):
            await opening
        assert client.healthy() == [True] and client.loads() == [0] and not slot.pending

    asyncio.run(run())


def test_the_request_timeout_covers_the_wait_for_admission():
    async def run():
        client = EngineClient([object()], client_index=1)
        channel = client._slots[0].channel = _Channel()
        with pytest.raises(RequestTimeoutError):
            await client.open(0, EngineCoreRequest(request_id="stuck", prompt_token_ids=[1],
                                                   sampling_params=SamplingParams(), client_index=1), timeout_s=0.05)
        assert [type(m).__name__ for m in channel.sent] == ["AddRequest", "AbortRequests"]
        assert client.loads() == [0] and not client._slots[0].pending

    asyncio.run(run())


def test_a_draining_engine_is_out_of_routing_and_an_empty_slot_too():
    """Engine autoscaling: a slot no engine runs in is out of routing, and so is an engine that said
    it is being scaled away; it still answers, serves what it has, and still takes a request routed
    to it before the router heard of the drain (a later choice of an n > 1 request)."""
    async def run():
        client = EngineClient([object(), None], client_index=1)
        assert client.healthy() == [True, False] and client.present() == [0] and client.answering() == [0]
        slot = client._slots[0]
        slot.channel = _Channel()
        client._on_message(slot, Draining())
        assert client.healthy() == [False, False] and client.answering() == [0]
        stream = await _admitted(client, "routed-before")
        assert client.loads() == [1, 0]
        await stream.close()
        client._on_message(slot, Serving())  # (the drain called off: the load came back)
        assert client.healthy() == [True, False]

    asyncio.run(run())


def test_an_engine_whose_name_is_gone_leaves_its_slot_empty():
    """Once a drained engine is stopped, the router forgets its handle (calls to every engine skip the
    slot) and keeps looking by name for the next engine started there."""
    async def run():
        looked_up = []

        def resolve(index: int):
            looked_up.append(index)
            return None

        client = EngineClient([object()], client_index=1, resolve_handle=resolve)
        slot = client._slots[0]
        slot.draining = True
        waiting = asyncio.create_task(client._wait_for_engine(slot))
        async with asyncio.timeout(10):
            while slot.handle is not None:
                await asyncio.sleep(0.05)
        assert looked_up[0] == 0 and slot.handle is None and not slot.draining and client.present() == []
        client._closed = True
        waiting.cancel()

    asyncio.run(run())


def test_an_engine_ray_reports_dead_fails_its_requests_although_its_channel_looks_open():
    """A vanished host sends no FIN: the socket stays open. When Ray says the actor died (a health
    probe's answer), the channel is cut, so the requests there end with an error, not a hang."""
    ray_exceptions = pytest.importorskip("ray.exceptions")

    class Handle:
        class check_health:
            @staticmethod
            async def remote():
                raise ray_exceptions.ActorDiedError()

    class OpenLooking(_Channel):
        def __init__(self):
            super().__init__()
            self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def wait_closed(self):
            await self.gone

        def abort(self):
            if not self.gone.done():
                self.gone.set_exception(ConnectionError("aborted"))

        def close(self):
            self.abort()

    async def run():
        client = EngineClient([Handle()], client_index=1)
        channel = client._slots[0].channel = OpenLooking()
        client._slots[0].connected.set()
        client.start()  # (the pump waits on the channel)
        stream = await _admitted(client, "stuck")
        await asyncio.sleep(0.01)
        assert stream._queue.empty()
        assert await client.refresh_health() == [False]
        async with asyncio.timeout(5):
            [out] = await stream.next_batch()
        assert out.finish_reason == FinishReason.ERROR and channel.gone.done()
        assert client.loads() == [1]  # (released when its reader closes the stream, as always)
        await stream.close()
        assert client.loads() == [0]
        await client.close()

    asyncio.run(run())


def test_a_burst_of_health_requests_makes_one_round_of_probes_and_takes_no_engine_out():
    """/health needs no key: 100 at once must not become 100 probes per engine (an engine answers
    them one at a time, and the slow answers marked it unhealthy). Callers during a round share the
    next; with max_age_s a round that just ended answers."""
    probes = []

    class Handle:
        class check_health:
            @staticmethod
            async def remote():
                probes.append(1)
                await asyncio.sleep(0.05)
                return True

    async def run():
        client = EngineClient([Handle(), Handle()], client_index=1)
        for slot in client._slots:
            slot.channel = _Channel()
        answers = await asyncio.gather(*(client.refresh_health(max_age_s=1.0) for _ in range(100)))
        # (Two rounds: the first caller's, then one for all who came while it ran.)
        assert answers == [[True, True]] * 100 and len(probes) == 4
        assert await client.refresh_health(max_age_s=1.0) == [True, True] and len(probes) == 4  # (fresh enough)
        assert await client.refresh_health() == [True, True] and len(probes) == 6  # (no age allowed: a new round)

    asyncio.run(run())
