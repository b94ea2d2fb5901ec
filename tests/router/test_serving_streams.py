"""Streamed choices through OpenAIServing's event paths, with engine outputs queued by hand."""

from __future__ import annotations

import asyncio

from engine_core.outputs import EngineCoreOutput
from engine_core.request import FinishReason
from router.engine_client import EngineClient, OutputQueue, RequestStream
from router.protocol import CompletionRequest
from router.routing import RoundRobinPolicy
from router.serving import OpenAIServing, ServingSettings

from .tokenizer_factory import byte_level_tokenizer


def _serving_with_streams(num_choices: int) -> tuple[OpenAIServing, list[RequestStream]]:
    client = EngineClient([object()], client_index=1)  # no channel: the outputs are queued by the test
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256), client,
                            byte_level_tokenizer(), RoundRobinPolicy())
    streams = []
    for i in range(num_choices):
        rid = f"r-{i}"
        queue = client._queues[rid] = OutputQueue()
        client._slots[0].requests.add(rid)
        client._slots[0].in_flight += 1
        streams.append(RequestStream(client, 0, rid, queue, None))
    return serving, streams


def test_merged_choices_carry_the_finish_of_their_own_chunk():
    # Each choice's task runs ahead of the merged stream's reader, so a choice is finished before its
    # earlier chunks are sent: each chunk must carry the finish reason it had when its outputs
    # arrived, not the choice's state at sending time.
    async def run():
        serving, streams = _serving_with_streams(2)
        ids = byte_level_tokenizer().encode("Paris is the capital")

        async def engine_steps():  # one output per choice per step; each choice's task takes it at once
            for i, token in enumerate(ids):
                finish = FinishReason.LENGTH if i == len(ids) - 1 else None
                for stream in streams:
                    stream._queue.put_nowait(EngineCoreOutput(stream.request_id, [token], finish))
                for _ in range(3):
                    await asyncio.sleep(0)

        choices = serving._new_choices(2, [], CompletionRequest(model="tiny", prompt="x"))
        steps = asyncio.create_task(engine_steps())
        seen = []
        async for event in serving._choice_events(streams, choices):
            seen.append((event, event.choice.finish_reason))
            await asyncio.sleep(0.01)  # a slow reader: the choices' tasks run ahead of it
        await steps
        for choice in choices:
            own = [(event, state) for event, state in seen if event.choice is choice]
            assert [event.finish_reason for event, _ in own] == [None] * (len(own) - 1) + ["length"]
            assert "".join(event.text for event, _ in own) == "Paris is the capital"
            # The race is real here: earlier chunks were sent after their choice had finished.
            assert any(state == "length" for _, state in own[:-1])
        assert serving.client.loads() == [0]

    asyncio.run(run())
