"""RequestStream: batched reads, finish truncation, the timeout marker, and release on close."""

from __future__ import annotations

import asyncio

import pytest

from engine_core.outputs import EngineCoreOutput, EngineCoreRequest
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams
from router.engine_client import EngineClient, OutputQueue, RequestStream, RequestTimeoutError


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
