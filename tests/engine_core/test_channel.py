"""The engine's request channel on a real engine actor (Ray local cluster, tiny model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.config import ClusterConfig, EngineSpec
from cluster.launcher import start_engines, stop_engines
from engine_core.channel import (
    AbortRequests,
    Accepted,
    AddRequest,
    ChannelAddress,
    ChannelConnection,
    Draining,
    Outputs,
    Serving,
    decode_engine_message,
    encode_frame,
)
from engine_core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, LogprobsEntry
from engine_core.request import FinishReason
from engine_core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CLIENT = 7


def _request(rid: str, max_tokens: int, client: int = CLIENT) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(3, 30)), client_index=client,
                             sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_model_dir):
    config = ClusterConfig(model=str(tiny_model_dir),
                           defaults=EngineSpec(num_gpu_blocks=64, max_num_seqs=2, max_waiting_requests=2))
    [handle] = start_engines(config.engine_configs(), config.namespace)
    yield handle
    stop_engines([handle])


def _address(engine) -> ChannelAddress:
    import ray

    return ray.get(engine.actor.channel_address.remote())


def _idle_stats(engine, timeout_s: float = 20.0):
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = ray.get(engine.actor.get_stats.remote())
        if stats.num_unfinished_requests == 0 and stats.num_free_blocks == stats.num_blocks:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine did not go idle: {stats}")


async def _collect(conn: ChannelConnection, request_ids: set[str], timeout_s: float = 30.0):
    """Read until every request finished: (tokens per request, acceptances)."""
    tokens: dict[str, list[int]] = {}
    accepted: dict[str, Accepted] = {}
    finished: set[str] = set()
    async with asyncio.timeout(timeout_s):
        while finished != request_ids:
            message = await conn.receive()
            if isinstance(message, Accepted):
                accepted[message.request_id] = message
            else:
                for out in message.outputs.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        finished.add(out.request_id)
    return tokens, accepted


def test_frames_round_trip():
    frame = encode_frame(Accepted("r1", "queue is full", overloaded=True))
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert decode_engine_message(frame[4:]) == Accepted("r1", "queue is full", overloaded=True)
    outputs = EngineCoreOutputs(engine_index=1, outputs=[
        EngineCoreOutput("r1", [5, 6], FinishReason.STOP, "###",
                         LogprobsEntry([-0.5, -1.0], [[(5, -0.5)], [(6, -1.0), (2, -2.0)]]), 4)])
    decoded = decode_engine_message(encode_frame(Outputs(outputs))[4:])
    assert isinstance(decoded, Outputs) and decoded.outputs.outputs == outputs.outputs


def test_both_ends_of_a_channel_probe_for_a_vanished_peer(monkeypatch):
    """TCP keepalive and a user timeout on the engine's and the router's socket: a host that goes
    away without a FIN (powered off, partitioned) ends the channel in about 25 s on both sides."""
    import socket

    from engine_core import channel as channel_module

    seen: list[tuple[int, int, int, int]] = []
    real = channel_module.enable_keepalive

    def recording(sock):
        real(sock)
        seen.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)))

    monkeypatch.setattr(channel_module, "enable_keepalive", recording)

    async def run():
        server = channel_module.ChannelServer(None)  # (a wrong token: it never reaches the service)
        address = await server.start("127.0.0.1")
        connection = await ChannelConnection.open(ChannelAddress(address.host, address.port, "wrong"), CLIENT)
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(5):
                await connection.wait_closed()
        await server.close()

    asyncio.run(run())
    assert seen == [(1, 10, 3, 25_000)] * 2  # the router's end, then the engine's


def test_outputs_too_large_for_one_frame_are_split_in_order(monkeypatch):
    """Requests asking for thousands of logprobs per token, merged over steps: the outputs go out over
    several frames, in order, the finished ids and cache events with the last; an output too large
    for any frame fails its own request only."""
    import engine_core.channel as channel

    def output(rid: str, width: int) -> EngineCoreOutput:
        return EngineCoreOutput(rid, [5], None, None, LogprobsEntry([-0.5], [[(t, -1.0) for t in range(width)]]))

    outputs = EngineCoreOutputs(outputs=[output(f"r{i}", 100) for i in range(6)], finished_requests={"r0"},
                                engine_index=3, kv_events=[(1, [b"h"])])
    whole = channel.output_frames(outputs)
    assert len(whole) == 1 and decode_engine_message(whole[0][4:]).outputs == outputs
    monkeypatch.setattr(channel, "MAX_FRAME_BYTES", len(whole[0]) // 3)
    parts = [decode_engine_message(frame[4:]).outputs for frame in channel.output_frames(outputs)]
    assert len(parts) > 1 and all(len(f) - 4 <= len(whole[0]) // 3 for f in channel.output_frames(outputs))
    assert [o for part in parts for o in part.outputs] == outputs.outputs
    assert [p.finished_requests for p in parts] == [None] * (len(parts) - 1) + [{"r0"}]
    assert [p.kv_events for p in parts][-1] == [(1, [b"h"])] and {p.engine_index for p in parts} == {3}
    # One output alone beyond the limit: its request fails, the others go out.
    huge = EngineCoreOutputs(outputs=[output("a", 10), output("big", 2000), output("b", 10)], engine_index=3)
    failed: list[str] = []
    sent = [o for frame in channel.output_frames(huge, on_failed=failed.extend)
            for o in decode_engine_message(frame[4:]).outputs.outputs]
    assert failed == ["big"]  # (the engine is told to abort it)
    assert [o.request_id for o in sent] == ["a", "big", "b"]
    assert sent[0] == huge.outputs[0] and sent[2] == huge.outputs[2]
    assert sent[1].finish_reason == FinishReason.ERROR and "ask for fewer logprobs" in sent[1].stop_reason


def test_requests_in_outputs_pushed_out(engine):
    address = _address(engine)
    assert address.host == "127.0.0.1" and address.port > 0 and len(address.token) == 32

    async def run():
        conn = await ChannelConnection.open(address, CLIENT)
        try:
            for rid in ("a", "b"):
                conn.send(AddRequest(_request(rid, 12)))
            return await _collect(conn, {"a", "b"})
        finally:
            conn.close()

    tokens, accepted = asyncio.run(run())
    assert accepted == {"a": Accepted("a"), "b": Accepted("b")}
    assert len(tokens["a"]) == len(tokens["b"]) == 12 and tokens["a"] == tokens["b"]  # greedy, same prompt
    _idle_stats(engine)


def test_a_request_the_engine_cannot_serve_is_refused_as_such(engine):
    """More logprobs than the engine's max_logprobs (20 by default): refused, flagged as the request's
    fault (the router's 400), with the resolved count for -1 as vLLM reports it."""
    address = _address(engine)

    async def run():
        conn = await ChannelConnection.open(address, CLIENT)
        try:
            for rid, params in (("many", SamplingParams(max_tokens=2, logprobs=21)),
                                ("all", SamplingParams(max_tokens=2, prompt_logprobs=-1))):
                conn.send(AddRequest(EngineCoreRequest(request_id=rid, prompt_token_ids=[3, 4], client_index=CLIENT,
                                                       sampling_params=params)))
            answers = {}
            async with asyncio.timeout(30):
                while len(answers) < 2:
                    message = await conn.receive()
                    if isinstance(message, Accepted):
                        answers[message.request_id] = message
            return answers
        finally:
            conn.close()

    answers = asyncio.run(run())
    assert all(a.refused and not a.overloaded for a in answers.values())
    assert "sample logprobs of 21, which is greater than max allowed: 20" in answers["many"].error
    assert "prompt logprobs of 384, which is greater than max allowed: 20" in answers["all"].error  # (the vocab)
    _idle_stats(engine)


def test_a_full_queue_is_refused_as_overloaded_and_abort_frees_blocks(engine):
    import ray

    address = _address(engine)
    refused_before = ray.get(engine.actor.get_stats.remote()).num_requests_refused_full

    async def run():
        conn = await ChannelConnection.open(address, CLIENT)
        try:
            ids = [f"q{i}" for i in range(8)]
            for rid in ids:
                conn.send(AddRequest(_request(rid, 5000 if rid in ("q0", "q1") else 3)))
            answers: dict[str, Accepted] = {}
            async with asyncio.timeout(30):
                while len(answers) < len(ids):
                    message = await conn.receive()
                    if isinstance(message, Accepted):
                        answers[message.request_id] = message
            # Two run (max_num_seqs=2) and two may wait; the rest find the queue full.
            refused = [a for a in answers.values() if a.error is not None]
            assert refused and all(a.overloaded and "queue is full" in a.error for a in refused)
            # (Counted: the autoscaler reads them as load beyond what the engines hold.)
            stats = ray.get(engine.actor.get_stats.remote())
            assert stats.num_requests_refused_full - refused_before == len(refused)
            conn.send(AbortRequests([rid for rid, a in answers.items() if a.error is None]))
            await asyncio.sleep(0.5)
        finally:
            conn.close()

    asyncio.run(run())
    stats = _idle_stats(engine)
    assert stats.num_free_blocks == stats.num_blocks


def test_a_drain_is_told_to_every_client_and_calling_it_off_too(engine):
    """cluster.autoscaler drains an engine it scales away, and calls the drain off when the load
    comes back before it stopped: connected clients hear both, a client connecting meanwhile hears
    the drain at once, and one connecting after hears nothing."""
    import ray

    address = _address(engine)

    async def next_message(conn: ChannelConnection):
        async with asyncio.timeout(10):
            return await conn.receive()

    async def run():
        early = await ChannelConnection.open(address, CLIENT)
        late = None
        try:
            draining, unfinished, _ = await engine.actor.drain.remote()
            assert draining and unfinished == 0
            assert isinstance(await next_message(early), Draining)
            late = await ChannelConnection.open(address, CLIENT + 1)
            assert isinstance(await next_message(late), Draining)
            await engine.actor.undrain.remote()
            assert isinstance(await next_message(early), Serving) and isinstance(await next_message(late), Serving)
            assert not (await engine.actor.drain_status.remote())[0]
            late.close()
            late = await ChannelConnection.open(address, CLIENT + 1)
            late.send(AddRequest(_request("after", 3, client=CLIENT + 1)))
            tokens, accepted = await _collect(late, {"after"})
            assert accepted["after"].error is None and len(tokens["after"]) == 3  # (no Draining before it)
        finally:
            early.close()
            if late is not None:
                late.close()

    asyncio.run(run())
    assert not ray.get(engine.actor.drain_status.remote())[0]


def test_a_wrong_token_is_refused_and_a_reconnect_takes_over_the_client(engine):
    address = _address(engine)

    async def run():
        bad = await ChannelConnection.open(ChannelAddress(address.host, address.port, "0" * 32), CLIENT)
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            async with asyncio.timeout(10):
                await bad.receive()
        bad.close()
        first = await ChannelConnection.open(address, CLIENT)
        await asyncio.sleep(0.2)
        # The same client reconnects (a router whose socket died): outputs now go to the new one.
        second = await ChannelConnection.open(address, CLIENT)
        try:
            second.send(AddRequest(_request("c", 6)))
            tokens, accepted = await _collect(second, {"c"})
            assert accepted["c"].error is None and len(tokens["c"]) == 6
        finally:
            first.close()
            second.close()

    asyncio.run(run())
    _idle_stats(engine)


def test_a_dropped_connection_aborts_its_unfinished_requests(engine):
    import ray

    address = _address(engine)

    async def run():
        conn = await ChannelConnection.open(address, CLIENT)
        conn.send(AddRequest(_request("orphan", 5000)))
        conn.send(AddRequest(_request("done", 2)))
        await _collect(conn, {"done"})
        stats = ray.get(engine.actor.get_stats.remote())
        assert stats.num_unfinished_requests == 1
        max_model_len = stats.scheduler_config["max_model_len"]
        conn.close()  # the router dies without aborting "orphan"
        return stats.num_steps, max_model_len

    steps_at_close, max_model_len = asyncio.run(run())
    stats = _idle_stats(engine)
    assert stats.num_free_blocks == stats.num_blocks
    # Left alone, "orphan" would have decoded until max_model_len: one step per token.
    assert stats.num_steps - steps_at_close < max_model_len // 2


def test_a_client_gone_for_good_leaves_no_output_buffer_behind(engine):
    """A router replica scaled away: once its connection has been closed for forget_client_after_s
    (no reconnect), the engine drops its output buffer; a client that reconnects in time keeps it."""
    import ray

    def buffered_clients(actor) -> set[int]:
        return set(actor.service._buffers)

    address = _address(engine)  # (the channel opens on the first ask)
    ray.get(engine.actor.__ray_call__.remote(lambda actor: setattr(actor._channel, "forget_client_after_s", 0.5)))

    async def serve_and_close(client: int, rid: str) -> None:
        conn = await ChannelConnection.open(address, client)
        conn.send(AddRequest(_request(rid, 2, client)))
        await _collect(conn, {rid})
        conn.close()

    try:
        asyncio.run(serve_and_close(61, "gone"))
        assert 61 in ray.get(engine.actor.__ray_call__.remote(buffered_clients))  # (within the grace)
        deadline = time.monotonic() + 10
        while 61 in ray.get(engine.actor.__ray_call__.remote(buffered_clients)):
            assert time.monotonic() < deadline, "the closed client's buffer is still there"
            time.sleep(0.1)

        def publish_late_output(actor) -> None:  # (an event for it after it was forgotten, say)
            actor.service._publish({61: EngineCoreOutputs(outputs=[EngineCoreOutput("late", [1])])}, take_events=False)

        ray.get(engine.actor.__ray_call__.remote(publish_late_output))
        assert 61 not in ray.get(engine.actor.__ray_call__.remote(buffered_clients))  # (not made again)

        async def reconnect_in_time() -> None:
            await serve_and_close(62, "back-1")
            conn = await ChannelConnection.open(address, 62)  # back before the grace ends
            await asyncio.sleep(1.0)
            assert 62 in ray.get(engine.actor.__ray_call__.remote(buffered_clients))
            conn.close()

        asyncio.run(reconnect_in_time())
    finally:
        ray.get(engine.actor.__ray_call__.remote(lambda actor: setattr(actor._channel, "forget_client_after_s", 30.0)))
