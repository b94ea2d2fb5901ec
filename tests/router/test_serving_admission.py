"""How OpenAIServing opens a request's choices in the engines: nothing stays open when one choice is
refused or the client leaves. The engine's side of the channel is played by the test."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from engine_core.channel import AbortRequests, Accepted, AddRequest, Outputs
from engine_core.outputs import EngineCoreOutput, EngineCoreOutputs
from engine_core.sampling_params import SamplingParams
from router.engine_client import EngineClient
from router.protocol import CompletionRequest
from router.routing import RoundRobinPolicy, RoutingContext, RoutingPolicy
from router.serving import APIError, OpenAIServing, ServingSettings, _Job, stream_error_event

from .tokenizer_factory import byte_level_tokenizer


class RecordingChannel:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)

    def close(self) -> None:
        pass

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
        engine = asyncio.create_task(_answer(client, channel, answers))
        with pytest.raises(APIError) as raised:
            await serving.completions(_request(3))
        await engine
        assert raised.value.status == 429
        # (The choices go out together: the ones admitted besides the refused one are aborted.)
        ids = [f"{channel.added()[0][:-2]}-{i}" for i in range(3)]
        assert channel.added() == ids
        assert channel.aborted() == sorted(ids[:refused] + ids[refused + 1:])
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
        # (All three went out together: one admitted, two in admission; each is aborted.)
        assert channel.aborted() == sorted(channel.added()) and len(channel.added()) == 3
        assert client.loads() == [0] and not client._queues and not client._slots[0].pending

    asyncio.run(run())


class FirstHealthy(RoutingPolicy):
    """Engine 0 whenever it may be chosen (a test that needs to know where each choice goes)."""

    name = "first_healthy"

    def choose(self, ctx: RoutingContext) -> int:
        return ctx.healthy_indices()[0]


def _two_engines(**settings) -> tuple[OpenAIServing, EngineClient, list[RecordingChannel]]:
    client = EngineClient([object(), object()], client_index=1)
    channels = [RecordingChannel(), RecordingChannel()]
    for slot, channel in zip(client._slots, channels, strict=True):
        slot.channel = channel
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256, **settings), client,
                            byte_level_tokenizer(), FirstHealthy())
    return serving, client, channels


async def _answer_engines(client: EngineClient, channels: list[RecordingChannel],
                          answer: Callable[[int, str], Accepted], count: int, delay_s: float = 0.0) -> None:
    """Play both engines: answer each of the first ``count`` AddRequests as it arrives."""
    answered: set[tuple[int, str]] = set()
    for _ in range(2000):
        for engine, channel in enumerate(channels):
            for rid in channel.added():
                if (engine, rid) not in answered:
                    answered.add((engine, rid))
                    if delay_s:
                        await asyncio.sleep(delay_s)
                    client._on_message(client._slots[engine], answer(engine, rid))
        if len(answered) >= count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"only {answered} were sent")


def _full(engine: int, overloaded: bool = True) -> Callable[[int, str], Accepted]:
    """Engine ``engine`` refuses every request (-2: both do), as full (or as not serving for now)."""
    def answer(at: int, rid: str) -> Accepted:
        if at == engine or engine == -2:
            return Accepted(rid, "queue is full" if overloaded else "workers restarting", overloaded=overloaded)
        return Accepted(rid)
    return answer


@pytest.mark.parametrize("overloaded", [True, False])
def test_a_request_an_engine_refuses_goes_to_another(overloaded: bool):
    async def run():
        serving, client, channels = _two_engines()
        engine = asyncio.create_task(_answer_engines(client, channels, _full(0, overloaded), count=2))
        body = await serving.completions(_request(1))
        await engine
        assert len(channels[0].added()) == 1 and channels[1].added() == channels[0].added()
        assert client.loads() == [0, 1] and client.healthy() == [overloaded, True]
        await body.aclose()
        assert channels[1].aborted() == channels[1].added() and client.loads() == [0, 0]

    asyncio.run(run())


def test_the_choices_left_of_a_refused_request_move_and_the_admitted_ones_stay():
    async def run():
        serving, client, channels = _two_engines()
        full_after_one = {"admitted": 0}

        def answer(engine: int, rid: str) -> Accepted:
            if engine == 0 and full_after_one["admitted"] >= 1:
                return Accepted(rid, "queue is full", overloaded=True)
            full_after_one["admitted"] += engine == 0
            return Accepted(rid)

        # (the choices go out together: engine 0 takes choice 0 and is full at choices 1 and 2)
        engine = asyncio.create_task(_answer_engines(client, channels, answer, count=5))
        body = await serving.completions(_request(3))
        await engine
        first = channels[0].added()[0]
        assert channels[0].added() == [first, first[:-1] + "1", first[:-1] + "2"]
        assert channels[1].added() == [first[:-1] + "1", first[:-1] + "2"]
        assert not channels[0].aborted() and client.loads() == [1, 2]
        await body.aclose()
        assert client.loads() == [0, 0]

    asyncio.run(run())


@pytest.mark.parametrize(("other", "status"), [("full", 429), ("down", 429)])
def test_a_request_is_moved_once_and_refused_when_no_engine_takes_it(other: str, status: int):
    async def run():
        serving, client, channels = _two_engines()
        if other == "down":  # nowhere else to go: the first refusal is the answer
            client._slots[1].healthy = False
        engine = asyncio.create_task(_answer_engines(client, channels, _full(-2), count=1 if other == "down" else 2))
        with pytest.raises(APIError) as raised:
            await serving.completions(_request(1))
        await engine
        assert raised.value.status == status
        assert len(channels[0].added()) == 1 and len(channels[1].added()) == (0 if other == "down" else 1)
        assert client.loads() == [0, 0] and not client._queues

    asyncio.run(run())


def test_every_choice_runs_to_one_deadline_however_long_admission_takes():
    async def run():
        serving, client, channels = _two_engines(request_timeout_s=30.0)
        jobs = [_Job(0, f"r-{i}", [1, 2, 3], SamplingParams(max_tokens=4)) for i in range(3)]
        engine = asyncio.create_task(_answer_engines(client, channels, _full(-1), count=3, delay_s=0.1))
        start = asyncio.get_running_loop().time()
        streams = await serving._open_all(jobs, priority=0)
        await engine
        ends = [stream._timer.when() for stream in streams]
        assert asyncio.get_running_loop().time() - start >= 0.25  # (admission took its time)
        assert max(ends) - min(ends) < 0.05 and all(end < start + 30.1 for end in ends)
        for stream in streams:
            await stream.close()

    asyncio.run(run())


def test_an_unexpected_error_in_one_of_several_streamed_choices_ends_the_stream_with_an_error_event():
    async def run():
        serving, client, channels = _two_engines()
        engine = asyncio.create_task(_answer_engines(client, channels, _full(-1), count=2))
        body = await serving.completions(_request(2))
        await engine

        def broken(choice, output):
            raise RuntimeError("detokenizer broke")

        serving._apply_output = broken
        rid = channels[0].added()[0]
        client._on_message(client._slots[0], Outputs(EngineCoreOutputs([EngineCoreOutput(rid, [65])])))
        with pytest.raises(Exception) as raised:
            async for _ in body:
                pass
        event = stream_error_event(raised.value)
        assert '"code": 500' in event and "detokenizer broke" in event and event.endswith("data: [DONE]\n\n")
        assert client.loads() == [0, 0] and sorted(channels[0].aborted() + channels[1].aborted()) == sorted(
            channels[0].added() + channels[1].added())

    asyncio.run(run())


def test_long_texts_are_tokenized_off_the_event_loop_with_a_tokenizer_of_their_own():
    """tokenizer_work: short text on the loop, long text in the replica's tokenizer thread (the
    loop keeps serving meanwhile, short text included), and that thread tokenizes with a copy of
    the tokenizer: no tokenizer is used by two threads at once."""
    import threading
    import time as clock

    from router.serving import TOKENIZE_INLINE_CHARS

    serving, _, _ = _serving()
    loop_thread, loop_tokenizer = threading.get_ident(), serving.tokenizer
    users: dict[int, set[int]] = {}  # tokenizer -> the threads that used it

    def work(seconds: float) -> tuple[int, list[int]]:
        users.setdefault(id(serving.tokenizer), set()).add(threading.get_ident())
        clock.sleep(seconds)
        return threading.get_ident(), serving.tokenizer.encode("Paris", add_special_tokens=False)

    async def run():
        paris = loop_tokenizer.encode("Paris", add_special_tokens=False)
        assert await serving.tokenizer_work(10, work, 0.0) == (loop_thread, paris)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        long = asyncio.create_task(serving.tokenizer_work(TOKENIZE_INLINE_CHARS + 1, work, 0.3))
        await asyncio.sleep(0.05)
        short_meanwhile = await serving.tokenizer_work(10, work, 0.0)
        assert not long.done()  # (the short text did not wait for it)
        long_thread, long_ids = await long
        assert long_thread != loop_thread and short_meanwhile[0] == loop_thread
        assert long_ids == short_meanwhile[1]  # (the copy tokenizes as the tokenizer does)
        assert ticks >= 10  # (the loop went on while the long text was tokenized)
        ticking.cancel()
        assert sorted(len(threads) for threads in users.values()) == [1, 1]
        assert serving.tokenizer is loop_tokenizer

    asyncio.run(run())


def test_with_a_tokenizer_that_does_not_copy_short_text_waits_for_the_tokenizer_thread():
    """The one tokenizer is then shared by both threads, one at a time."""
    import threading
    import time as clock

    from router.serving import TOKENIZE_INLINE_CHARS

    class Uncopyable(type(byte_level_tokenizer())):
        def __deepcopy__(self, memo):
            raise TypeError("no copies")

    tokenizer = byte_level_tokenizer()
    tokenizer.__class__ = Uncopyable
    serving = OpenAIServing(ServingSettings(served_model_name="tiny", max_model_len=256),
                            EngineClient([object()], client_index=1), tokenizer, RoundRobinPolicy())
    loop_thread = threading.get_ident()
    busy: list[int] = []  # threads inside the tokenizer work now

    def work(seconds: float) -> int:
        assert serving.tokenizer is tokenizer
        busy.append(threading.get_ident())
        assert len(busy) == 1, "two threads tokenizing at once"
        clock.sleep(seconds)
        busy.pop()
        return threading.get_ident()

    async def run():
        assert await serving.tokenizer_work(10, work, 0.0) == loop_thread
        long = asyncio.create_task(serving.tokenizer_work(TOKENIZE_INLINE_CHARS + 1, work, 0.3))
        await asyncio.sleep(0.05)
        short_meanwhile = await serving.tokenizer_work(10, work, 0.0)
        assert await long != loop_thread and short_meanwhile != loop_thread
        assert await serving.tokenizer_work(10, work, 0.0) == loop_thread  # (the thread is idle again)

    asyncio.run(run())


def test_a_request_whose_channel_broke_after_it_was_sent_is_not_moved():
    """The engine may have taken it (and send its outputs on reconnecting, under the same id): it is
    a 503, not a second copy on another engine that could receive the first one's tokens."""
    async def run():
        serving, client, channels = _two_engines()

        async def break_after_send():
            await _until_added(channels[0], 1)
            client._drop_channel(client._slots[0])

        breaking = asyncio.create_task(break_after_send())
        with pytest.raises(APIError) as raised:
            async with asyncio.timeout(10):  # (moved, it would wait for engine 1, which answers nothing)
                await serving.completions(_request(1))
        await breaking
        assert raised.value.status == 503 and channels[1].added() == []
        assert client.loads() == [0, 0] and not client._queues

    asyncio.run(run())


def test_a_requests_engine_requests_go_out_in_windows_not_one_round_trip_at_a_time():
    """Up to OPEN_AT_ONCE of a request's engine requests (its choices, prompts, inputs) are sent
    before any admission is awaited; the streams still come back in the choices' order."""
    from router.serving import OPEN_AT_ONCE

    async def run():
        serving, client, channel = _serving()
        n = OPEN_AT_ONCE + 4
        opening = asyncio.create_task(serving.completions(CompletionRequest(model="tiny", prompt="Paris", n=n,
                                                                           max_tokens=4, stream=True)))
        await _until_added(channel, OPEN_AT_ONCE)
        await asyncio.sleep(0.01)
        assert len(channel.added()) == OPEN_AT_ONCE  # (the first window, none answered yet)
        for rid in reversed(channel.added()):  # (admitted in the reverse order)
            client._on_message(client._slots[0], Accepted(rid))
        await _until_added(channel, n)
        for rid in channel.added()[OPEN_AT_ONCE:]:
            client._on_message(client._slots[0], Accepted(rid))
        body = await opening
        assert [stream.request_id for stream in body._streams] == channel.added()
        assert client.loads() == [n]
        await body.aclose()
        assert client.loads() == [0]

    asyncio.run(run())
