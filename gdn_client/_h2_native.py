"""gdn-loadtest's native clients (`--client-transport native`): gRPC calls over the HTTP/2
transport in C that the server's workers use (gdn_server._native.H2Transport, over libnghttp2),
driven by the running asyncio loop.

Why: on the H200 host a load process's grpc.aio client took ~160-170 us of CPU per step at 64
clients, twice a native worker's whole share, and load and server share the host's cores there
(bench/NOTES.md). A load generator that costs less measures more of the server. The calls are
real gRPC over HTTP/2 (any gRPC server answers them); only what gdn-loadtest needs is here:
messages as bytes both ways, a call's status at its end, no metadata, deadlines or compression.

    channel = NativeChannel.current()          # one per loop (per load process)
    connection = channel.connect("127.0.0.1:50051")
    call = connection.stream("/gdn.v1.GdnDecode/DecodeStream")
    await call.write(request_bytes)
    reply = await call.read()                  # bytes, or grpc.aio.EOF once the call ended well
"""
from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable

import grpc
import grpc.aio

from gdn_client._errors import GdnError, error_from_code

_MAX_MESSAGE = 256 << 20
_channels: dict[asyncio.AbstractEventLoop, "NativeChannel"] = {}


def native_transport_problem() -> str | None:
    """Why native clients cannot run here (no native module, no libnghttp2), or None."""
    try:
        from gdn_server.native import module as native
    except ImportError:
        return "the gdn_server package is not installed"
    if native is None or not hasattr(native, "H2Transport"):
        return "gdn_server._native is not built"
    try:
        native.H2Transport(1)
    except OSError as e:
        return str(e)
    return None


class TransportLoop:
    """Drives an H2Transport on an asyncio loop, for the server's workers and for these clients
    alike: `poll()` when its epoll fd is readable, and one `flush()` per loop pass for what the
    calls sent meanwhile (one write per connection for many messages). Each batch of events
    goes to `handle`."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop, handle: Callable[[list], None]) -> None:
        self.transport, self._loop, self._handle = transport, loop, handle
        self._flush_due = False

    def start(self) -> None:
        self._loop.add_reader(self.transport.fileno(), self._on_ready)

    def stop(self) -> None:
        self._loop.remove_reader(self.transport.fileno())

    def flush_soon(self) -> None:
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        self._handle(self.transport.flush())

    def _on_ready(self) -> None:
        self._handle(self.transport.poll())
        self._handle(self.transport.flush())


class NativeChannel:
    """One loop's client connections, all on one H2Transport (one epoll fd the loop watches)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        from gdn_server.native import module as native

        self.transport = native.H2Transport(_MAX_MESSAGE)
        self._message, self._closed = native.H2_MESSAGE, native.H2_CLOSED
        self._loop = loop
        self.calls: dict[int, NativeCall] = {}
        self._shared: dict[str, NativeConnection] = {}
        self._pump = TransportLoop(self.transport, loop, self._handle)
        self.flush_soon = self._pump.flush_soon
        self._pump.start()

    @classmethod
    def current(cls) -> "NativeChannel":
        """The running loop's channel (made on first use)."""
        loop = asyncio.get_running_loop()
        for ended in [other for other in _channels if other.is_closed()]:  # e.g. an earlier asyncio.run's
            _channels.pop(ended).transport.close()
        channel = _channels.get(loop)
        if channel is None:
            problem = native_transport_problem()
            if problem is not None:
                raise GdnError(f"--client-transport native: {problem}", grpc.StatusCode.FAILED_PRECONDITION)
            channel = _channels[loop] = cls(loop)
        return channel

    def connect(self, target: str, shared: bool = False) -> "NativeConnection":
        """A connection to `target` ("host:port"); `shared`: the one this channel already has."""
        if shared and target in self._shared:
            return self._shared[target]
        host, _, port = target.rpartition(":")
        try:
            conn_id = self.transport.connect(host.strip("[]"), int(port))
        except OSError as e:
            raise GdnError(f"cannot connect to {target}: {e}", grpc.StatusCode.UNAVAILABLE) from None
        connection = NativeConnection(self, conn_id, target)
        if shared:
            self._shared[target] = connection
        return connection

    def _handle(self, events: list[tuple]) -> None:
        for event in events:
            call = self.calls.get(event[1])
            if call is None:
                continue
            if event[0] == self._message:
                call.replied(event[2])
            elif event[0] == self._closed:
                del self.calls[event[1]]
                call.ended(event[2], event[3])

    def close(self) -> None:
        """Drops every connection; calls still open end UNAVAILABLE."""
        if _channels.get(self._loop) is self:
            del _channels[self._loop]
        self._pump.stop()
        self._handle(self.transport.close())


class NativeConnection:
    """One HTTP/2 connection of a NativeChannel: calls on it."""

    def __init__(self, channel: NativeChannel, conn_id: int, target: str) -> None:
        self.channel, self.conn_id, self.target = channel, conn_id, target

    def close(self) -> None:
        """Closes the connection (a shared one stays open for the others)."""
        if self.channel._shared.get(self.target) is self:
            return
        self.channel._handle(self.channel.transport.disconnect(self.conn_id))

    def stream(self, path: str) -> "NativeCall":
        """A call whose requests go with `write` and replies come with `read` (any method kind)."""
        channel = self.channel
        try:
            handle = channel.transport.request(self.conn_id, path, self.target)
        except ConnectionError as e:
            raise GdnError(str(e), grpc.StatusCode.UNAVAILABLE) from None
        call = channel.calls[handle] = NativeCall(channel, handle)
        return call

    def unary(self, path: str) -> Any:
        """An async callable: request bytes -> reply bytes, one call each (grpc.aio's
        unary_unary with bytes in and out, without its deadline)."""

        async def call(request: bytes, timeout: float | None = None) -> bytes:
            c = self.stream(path)
            await c.write(request)
            await c.done_writing()
            reply = await c.read()
            if reply is grpc.aio.EOF:
                raise GdnError(f"{path} answered no message", grpc.StatusCode.INTERNAL)
            return reply

        return call


class NativeCall:
    """A call over the native transport, with the part of grpc.aio's stream-stream API that
    gdn-loadtest uses: `write`, `read`, `done_writing`."""

    __slots__ = ("channel", "handle", "replies", "waiter", "status", "message")

    def __init__(self, channel: NativeChannel, handle: int) -> None:
        self.channel = channel
        self.handle = handle
        self.replies: collections.deque[bytes] = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.status: int | None = None  # the call's grpc-status once it ended
        self.message = ""

    async def write(self, data: bytes) -> None:
        if not self.channel.transport.send(self.handle, data):
            raise GdnError("the call has ended", grpc.StatusCode.UNAVAILABLE)
        self.channel.flush_soon()

    async def done_writing(self) -> None:
        self.channel.transport.half_close(self.handle)
        self.channel.flush_soon()

    async def read(self) -> Any:
        """The next reply's bytes; grpc.aio.EOF once the call ended with OK; raises GdnError
        with the call's status when it ended otherwise."""
        if not self.replies and self.status is None:
            self.waiter = self.channel._loop.create_future()
            await self.waiter
        if self.replies:
            return self.replies.popleft()
        if self.status:
            raise error_from_code(self.status, self.message)
        return grpc.aio.EOF

    def replied(self, data: bytes) -> None:
        self.replies.append(data)
        self._wake()

    def ended(self, status: int, message: str) -> None:
        self.status, self.message = status, message
        self._wake()

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
