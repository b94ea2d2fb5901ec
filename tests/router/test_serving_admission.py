"""How OpenAIServing opens a request's choices in the engines: nothing stays open when one choice is
refused or the client leaves. The engine's side of the channel is played by the test."""

from __future__ import annotations

import asyncio

import pytest

from engine_core.channel import AbortRequests, Accepted, AddRequest
from router.engine_client import EngineClient
from router.protocol import CompletionRequest
from router.routing import RoundRobinPolicy
from router.serving import APIError, OpenAIServing, ServingSettings

from .tokenizer_factory import byte_level_tokenizer


class RecordingChannel:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)

    def added(self) -> list[str]:
        return [m.request.request_id for m in self.sent if isinstance(m, AddRequest)]

    def aborted(self) -> list[str]:
        return sorted(rid for m in self.sent if isinstance(m, AbortRequests) for rid in m.request_ids)


def _serving() -> tuple[OpenAIServing, EngineClient, RecordingChannel]:
    client = EngineClient([object()], client_index=1)
    channel = client._slots[0].channel = RecordingChannel()
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256), client,
                            byte_level_tokenizer(), RoundRobinPolicy())
    return serving, client, channel


def _request(n: int) -> CompletionRequest:
    return CompletionRequest(model="tiny", prompt="Paris", n=n, max_tokens=4, stream=True)


async def _until_added(channel: RecordingChannel, count: int) -> None:
    for _ in range(100):
        if len(channel.added()) >= count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"only {channel.added()} were sent")


async def _answer(client: EngineClient, channel: RecordingChannel, answers: list[Accepted | None]) -> None:
    """Play the engine: answer each AddRequest as it arrives (None: leave it waiting)."""
    for i, answer in enumerate(answers):
        await _until_added(channel, i + 1)
        if answer is None:
            return
        client._on_message(client._slots[0], Accepted(channel.added()[i], answer.error, answer.overloaded))


def test_a_request_whose_choices_are_all_admitted_releases_them_when_its_body_is_dropped():
    async def run():
        serving, client, channel = _serving()
        engine = asyncio.create_task(_answer(client, channel, [Accepted("")] * 3))
        body = await serving.completions(_request(3))
        await engine
        assert client.loads() == [3]
        await body.aclose()  # the client left before reading: every choice is aborted
        assert channel.aborted() == sorted(channel.added()) and client.loads() == [0]

    asyncio.run(run())


@pytest.mark.parametrize("refused", [0, 2])
def test_one_refused_choice_fails_the_request_and_aborts_the_admitted_ones(refused: int):
    async def run():
        serving, client, channel = _serving()
        answers = [Accepted("", "queue is full", overloaded=True) if i == refused else Accepted("") for i in range(3)]
        engine = asyncio.create_task(_answer(client, channel, answers[:refused + 1]))
        with pytest.raises(APIError) as raised:
            await serving.completions(_request(3))
        await engine
        assert raised.value.status == 429
        assert channel.added() == [f"{channel.added()[0][:-2]}-{i}" for i in range(refused + 1)]
        assert channel.aborted() == sorted(channel.added()[:refused])
        assert client.loads() == [0] and not client._queues

    asyncio.run(run())


def test_a_client_that_leaves_during_admission_leaves_nothing_open():
    async def run():
        serving, client, channel = _serving()
        opening = asyncio.create_task(serving.completions(_request(3)))
        await _answer(client, channel, [Accepted(""), None])  # the first admitted, the second in admission
        await asyncio.sleep(0.01)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        assert channel.aborted() == sorted(channel.added()) and len(channel.added()) == 2
        assert client.loads() == [0] and not client._queues and not client._slots[0].pending

    asyncio.run(run())
