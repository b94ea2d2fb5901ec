"""The request channel: a direct TCP stream between a router replica and an engine.

Ray actor calls carry the control plane (health, stats, pause, metrics). The data plane, requests in
and outputs out, goes over one TCP connection per (router replica, engine): length-prefixed msgspec
frames, no per-request actor call. An engine pushes a client's outputs as soon as a step produces
them; whatever piles up while the socket is busy goes out merged in the next frame.

The engine actor opens the channel on the address of its Ray node (or ``LLM_CLUSTER_ENGINE_HOST``),
on a free port, and hands out the address with a random token through an actor call, so only
callers that can reach the actor (Ray's own authentication) can use the channel.

Frames: a 4-byte big-endian length, then a msgpack-encoded message (tagged msgspec structs).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from engine_core.engine_core import RequestRefusedError
from engine_core.lora import LoRANotLoadedError
from engine_core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from engine_core.request import FinishReason

if TYPE_CHECKING:
    from engine_core.engine_actor import EngineCoreService

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024

# A peer whose host went away (powered off, partitioned) sends no FIN or RST: TCP keepalive probes
# an idle channel after this many seconds, every KEEPALIVE_INTERVAL_S, and gives up after
# KEEPALIVE_PROBES unanswered ones; data left unacknowledged as long also ends the connection. So
# both sides learn of it in about 25 s (the router fails the requests there, the engine aborts them).
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3


def enable_keepalive(sock: socket.socket | None) -> None:
    """Detect a vanished peer on this channel socket (Linux options where the platform has them)."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                            ("TCP_USER_TIMEOUT", 1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES))):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


# -- messages, client -> engine ------------------------------------------------------------------

class Hello(msgspec.Struct, tag="hello"):
    client_index: int
    token: str
    # Send this client the prefix cache's contents and then its changes (KV cache events).
    kv_events: bool = False


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    # The client ended them itself, as finished: a stop string it matched on the text (the engine
    # counts them as finished with reason stop, as vLLM's front end does; a plain abort is not).
    stopped: bool = False
    # With stopped: each one's output tokens the client kept (up to the stop), where the engine may
    # have generated a pass or two more before the abort came ([]: not known).
    num_kept_tokens: list[int] = []


# -- messages, engine -> client ------------------------------------------------------------------

class Accepted(msgspec.Struct, tag="accepted"):
    """The answer to one AddRequest: error is None when the engine took the request."""

    request_id: str
    error: str | None = None
    # True when refused because the engine's waiting queue is full (HTTP 429, not 503).
    overloaded: bool = False
    # True when refused because the request names a LoRA adapter the engine does not hold (HTTP 404).
    unknown_model: bool = False
    # True when refused for what it asks, which this engine's model or flags cannot serve (HTTP 400):
    # the engine itself is fine.
    refused: bool = False


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: EngineCoreOutputs


class Draining(msgspec.Struct, tag="draining"):
    """The engine is being scaled away: send it no new request (it still serves those it has, and
    any that were on their way)."""


class Serving(msgspec.Struct, tag="serving"):
    """A drain was called off (the load came back): the engine takes new requests again."""


ClientMessage = Hello | AddRequest | AbortRequests
EngineMessage = Accepted | Outputs | Draining | Serving


class ChannelAddress(msgspec.Struct, frozen=True):
    host: str
    port: int
    token: str


_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_engine_decoder = msgspec.msgpack.Decoder(EngineMessage)


class FrameTooLargeError(ValueError):
    """A message larger than one frame may be: the other end would drop the whole channel for it."""


def encode_frame(message: ClientMessage | EngineMessage) -> bytes:
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameTooLargeError(f"the request is {len(payload)} bytes encoded, more than one request may be "
                                 f"({MAX_FRAME_BYTES} bytes)")
    return _LENGTH.pack(len(payload)) + payload


def output_frames(outputs: EngineCoreOutputs, on_failed: Callable[[list[str]], None] | None = None,
                  split: bool = True) -> list[bytes]:
    """The frames carrying ``outputs``: one, unless it would be larger than a frame may be (requests
    asking for thousands of logprobs per token, from many steps merged while the socket drained).
    Then its outputs are split, in order, over several frames, the finished ids and cache events with
    the last. A single output too large for any frame (which admission should have prevented) is
    replaced by an error finishing its request, which ``on_failed`` is told of (to abort it in the
    engine), so the channel and the other requests live on."""
    payload = _encoder.encode(Outputs(outputs))
    if len(payload) <= MAX_FRAME_BYTES or not split:
        return [_LENGTH.pack(len(payload)) + payload]
    if len(outputs.outputs) <= 1:
        failed = [EngineCoreOutput(o.request_id, [], FinishReason.ERROR,
                                   f"its output ({len(payload)} bytes, its logprobs mostly) is larger than one answer "
                                   f"may be ({MAX_FRAME_BYTES} bytes): ask for fewer logprobs")
                  for o in outputs.outputs]
        logger.warning("an output of %d bytes exceeds the frame limit: its request fails", len(payload))
        if failed and on_failed is not None:
            on_failed([o.request_id for o in failed])
        # (Once, without splitting again: what is left is small, unless nothing here could be cut.)
        return output_frames(msgspec.structs.replace(outputs, outputs=failed), split=False)
    half = len(outputs.outputs) // 2
    first = EngineCoreOutputs(outputs=outputs.outputs[:half], engine_index=outputs.engine_index,
                              timestamp=outputs.timestamp)
    rest = msgspec.structs.replace(outputs, outputs=outputs.outputs[half:])
    return output_frames(first, on_failed) + output_frames(rest, on_failed)


async def read_payload(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {length} bytes is larger than allowed")
    return await reader.readexactly(length)


def decode_engine_message(payload: bytes) -> EngineMessage:
    return _engine_decoder.decode(payload)


class ChannelServer:
    """The engine's end: one connection per router client, served on the actor's event loop."""

    def __init__(self, service: EngineCoreService) -> None:
        self._service = service
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._address: ChannelAddress | None = None
        self._pushers: dict[int, asyncio.Task[None]] = {}
        # Each connected client's socket (announcements such as Draining go to all of them).
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self.draining = False
        # A client whose connection closed and has not reconnected within this many seconds is gone
        # for good (a router replica scaled away, say): its output buffer is dropped.
        self.forget_client_after_s = 30.0
        self._forget_timers: dict[int, asyncio.TimerHandle] = {}

    def announce_draining(self) -> None:
        """Tell every client, now and any that connects later, to send no new request (once)."""
        if self.draining:
            return
        self.draining = True
        for writer in list(self._writers.values()):
            with contextlib.suppress(Exception):
                writer.write(encode_frame(Draining()))

    def announce_serving(self) -> None:
        """Call off announce_draining: every client may send requests again (once)."""
        if not self.draining:
            return
        self.draining = False
        for writer in list(self._writers.values()):
            with contextlib.suppress(Exception):
                writer.write(encode_frame(Serving()))

    async def start(self, host: str) -> ChannelAddress:
        if self._address is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self._address = ChannelAddress(host, port, self._token)
        return self._address

    async def close(self) -> None:
        for timer in self._forget_timers.values():
            timer.cancel()
        for task in self._pushers.values():
            task.cancel()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pusher: asyncio.Task[None] | None = None
        client_index = -1
        # Requests admitted over this connection and not yet finished: aborted if it drops.
        unfinished: set[str] = set()
        enable_keepalive(writer.get_extra_info("socket"))
        try:
            hello = _client_decoder.decode(await read_payload(reader))
            if not isinstance(hello, Hello) or not secrets.compare_digest(hello.token, self._token):
                logger.warning("engine channel: refused a connection without the right token")
                return
            client_index = hello.client_index
            if (timer := self._forget_timers.pop(client_index, None)) is not None:
                timer.cancel()  # (back in time: it is not forgotten)
            self._service.client_connected(client_index)
            previous = self._pushers.pop(client_index, None)
            if previous is not None:  # the same client reconnected: the old stream is dead
                previous.cancel()
            pusher = self._pushers[client_index] = asyncio.create_task(self._push(client_index, writer, unfinished))
            self._writers[client_index] = writer
            if self.draining:
                writer.write(encode_frame(Draining()))
            if hello.kv_events:
                self._service.subscribe_kv_events(client_index)
            while True:
                message = _client_decoder.decode(await read_payload(reader))
                if isinstance(message, AddRequest):
                    accepted = self._accept(message.request)
                    if accepted.error is None:
                        unfinished.add(accepted.request_id)
                    writer.write(encode_frame(accepted))
                elif isinstance(message, AbortRequests):
                    unfinished.difference_update(message.request_ids)
                    self._service.abort_requests(message.request_ids, stopped=message.stopped,
                                                 num_kept_tokens=message.num_kept_tokens)
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass  # the router went away (or spoke nonsense)
        finally:
            if pusher is not None:
                pusher.cancel()
                if self._pushers.get(client_index) is pusher:
                    del self._pushers[client_index]
                    self._writers.pop(client_index, None)
                    self._service.unsubscribe_kv_events(client_index)
                    self._forget_timers[client_index] = asyncio.get_running_loop().call_later(
                        self.forget_client_after_s, self._forget_if_gone, client_index)
            if unfinished:
                # Nobody reads these any more (the router fails them on its side): free their blocks.
                self._service.abort_requests(list(unfinished))
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _forget_if_gone(self, client_index: int) -> None:
        self._forget_timers.pop(client_index, None)
        if client_index not in self._pushers:  # (not reconnected meanwhile)
            self._service.forget_client(client_index)

    def _accept(self, request: EngineCoreRequest) -> Accepted:
        try:
            self._service.admit(request)
        except OverflowError as e:
            return Accepted(request.request_id, str(e), overloaded=True)
        except LoRANotLoadedError as e:
            return Accepted(request.request_id, str(e), unknown_model=True)
        except RequestRefusedError as e:
            return Accepted(request.request_id, str(e), refused=True)
        except Exception as e:
            return Accepted(request.request_id, f"{type(e).__name__}: {e}")
        return Accepted(request.request_id)

    async def _push(self, client_index: int, writer: asyncio.StreamWriter, unfinished: set[str]) -> None:
        service = self._service

        def failed(request_ids: list[str]) -> None:  # (their client was told they failed)
            unfinished.difference_update(request_ids)
            service.abort_requests(request_ids)

        try:
            while True:
                outputs = await service.next_outputs(client_index)
                for output in outputs.outputs:
                    if output.finish_reason is not None:
                        unfinished.discard(output.request_id)
                for frame in output_frames(outputs, on_failed=failed):
                    writer.write(frame)
                # While the socket drains, the next steps' outputs pile up and leave as one frame.
                await writer.drain()
        except ConnectionError:
            pass  # the reader side sees the same and closes the connection


class _FrameReader(asyncio.Protocol):
    """Parses frames straight out of ``data_received`` and hands each decoded message to a callback:
    no StreamReader, no coroutine wake-up per frame (the router reads one frame per engine step)."""

    def __init__(self, on_message: Callable[[EngineMessage], None]) -> None:
        self._on_message = on_message
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        offset, size = 0, len(buffer)
        try:
            with memoryview(buffer) as view:
                while size - offset >= _LENGTH.size:
                    (length,) = _LENGTH.unpack_from(view, offset)
                    if length > MAX_FRAME_BYTES:
                        raise ConnectionError(f"frame of {length} bytes is larger than allowed")
                    end = offset + _LENGTH.size + length
                    if end > size:
                        break
                    message = _engine_decoder.decode(view[offset + _LENGTH.size:end])
                    offset = end
                    self._on_message(message)
        except Exception as e:  # a broken frame, or the handler failed: this channel is done
            if not isinstance(e, ConnectionError | msgspec.DecodeError):
                logger.exception("engine channel: handling a message failed")
            self._fail(e)
            return
        del buffer[:offset]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("the engine closed the request channel"))

    def _fail(self, error: Exception) -> None:
        if not self.closed.done():
            self.closed.set_exception(error if isinstance(error, ConnectionError) else ConnectionError(str(error)))
            self.closed.exception()  # retrieved here: nobody may be waiting on it
        if self.transport is not None:
            self.transport.close()


class ChannelConnection:
    """The router's end of one engine's channel. With ``on_message``, every message is handed to it
    as soon as its frame is complete; without, messages queue for ``receive()``."""

    def __init__(self, transport: asyncio.Transport, protocol: _FrameReader,
                 inbox: collections.deque[EngineMessage] | None) -> None:
        self._transport = transport
        self._protocol = protocol
        self._inbox = inbox
        self._arrived = asyncio.Event()

    @classmethod
    async def open(cls, address: ChannelAddress, client_index: int, timeout_s: float = 10.0,
                   on_message: Callable[[EngineMessage], None] | None = None,
                   kv_events: bool = False) -> ChannelConnection:
        inbox: collections.deque[EngineMessage] | None = None
        connection: ChannelConnection | None = None
        if on_message is None:
            inbox = collections.deque()

            def on_message(message: EngineMessage) -> None:
                inbox.append(message)  # type: ignore[union-attr]
                if connection is not None:
                    connection._arrived.set()

        loop = asyncio.get_running_loop()
        # asyncio and uvloop set TCP_NODELAY on TCP sockets themselves: each frame leaves at once.
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(lambda: _FrameReader(on_message), address.host, address.port), timeout_s)
        enable_keepalive(transport.get_extra_info("socket"))
        connection = cls(transport, protocol, inbox)  # type: ignore[arg-type]
        connection.send(Hello(client_index, address.token, kv_events))
        return connection

    def send(self, message: ClientMessage) -> None:
        if self._transport.is_closing():
            raise ConnectionError("the engine channel is closed")
        self._transport.write(encode_frame(message))

    async def wait_closed(self) -> None:
        """Returns when the channel is gone, raising ConnectionError with the reason."""
        await asyncio.shield(self._protocol.closed)

    async def receive(self) -> EngineMessage:
        """The next message (only without ``on_message``); ConnectionError once closed and drained."""
        assert self._inbox is not None, "messages go to on_message"
        while not self._inbox:
            if self._protocol.closed.done():
                await self._protocol.closed
            self._arrived.clear()
            waiter = asyncio.ensure_future(self._arrived.wait())
            await asyncio.wait([waiter, self._protocol.closed], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        return self._inbox.popleft()

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        """Close at once, dropping unsent frames (the engine is known to be gone: a close would wait
        to flush them to a peer that never reads)."""
        self._transport.abort()
