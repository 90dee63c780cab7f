"""A front-end worker's public port over the native transport (`--frontend-transport native`).

HTTP/2 and gRPC's framing run in C (gdn_server/_native_h2.c, over libnghttp2); this module does
what grpc.aio's server and the worker's interceptors do around each call, on the worker's loop:

- DecodeStream and Decode are served here, through the same `FrontendDecodeRpcs` as the grpc
  transport's (validation, the session's engine, the link): replies in request order, a bad
  request answered in-band on a stream, at most MAX_STREAM_IN_FLIGHT requests of a stream in
  flight (past that the stream gets no more flow-control window until replies go out);
- every other RPC (sessions, commit, export/import, health, reflection) goes to the router's
  gRPC server as raw bytes, as the method's own kind of call, with the caller's identity and
  deadline, as `EngineProxy` does for the grpc transport; an unknown method is UNIMPLEMENTED;
- tokens are checked on each call's opening headers (health needs none), `grpc-timeout` is kept,
  and the RPC families of gdn_server.metrics are counted as `MetricsInterceptor` counts them.

Why: per streamed message grpc.aio cost ~190-240 us of CPU on the CPU box, this transport with
Python answering each message ~50-70 (bench/NOTES.md). TLS is not offered: the worker refuses to
start with it (`check_transport`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from typing import Any

import grpc

from gdn_client._h2_native import TransportLoop, native_transport_problem
from gdn_server.errors import STATUS_CODES, GdnError
from gdn_server.frontend import pump_requests
from gdn_server.metrics import SERVICE_PREFIX, RpcMetrics
from gdn_server.native import module as native
from gdn_server.protowire import parse_decode_request
from gdn_server.security import (
    HEALTH_PREFIX, IDENTITY_METADATA, AuthInterceptor, SecurityConfig, bind_identity, unbind_identity,
)
from gdn_server.decode_rpcs import MAX_STREAM_IN_FLIGHT, decode_response_wire, error_response

log = logging.getLogger("gdn_server.frontend")

TRANSPORTS = ("grpc", "native")
DECODE_STREAM = SERVICE_PREFIX + "DecodeStream"
DECODE = SERVICE_PREFIX + "Decode"
# a passed-on call's messages waiting for the router past this stop the client's window on it
MAX_FORWARD_QUEUED = 16
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_UNAUTHENTICATED = "missing or invalid `authorization: Bearer <token>` metadata"


def check_transport(transport: str, security: SecurityConfig) -> str | None:
    """Why `transport` cannot serve with these settings, or None when it can."""
    if transport not in TRANSPORTS:
        return f"--frontend-transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}"
    if transport == "grpc":
        return None
    if security.tls:
        return "--frontend-transport native serves no TLS: leave out --tls-cert/--tls-key, or use --frontend-transport grpc"
    problem = native_transport_problem()  # loads libnghttp2: say it is missing before any process starts
    return None if problem is None else f"--frontend-transport native: {problem}"


def parse_timeout(value: str | None) -> float | None:
    """Seconds of a `grpc-timeout` header ("100m", "5S", ...); None when absent or unreadable."""
    if not value or len(value) < 2 or value[-1] not in _TIMEOUT_UNITS or not value[:-1].isdigit():
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


def listening_socket(host: str, port: int) -> socket.socket:
    """A nonblocking SO_REUSEPORT socket listening on host:port, beside the router's reservation
    of the same address (gdn_server.frontend_pool.reserve_port) and the other workers."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class NativeFrontend:
    """Serves a worker's public port over an `H2Transport`; `start()`, then `stop(grace)`."""

    def __init__(
        self, host: str, port: int, max_message_bytes: int, rpcs: Any, channel: grpc.aio.Channel,
        forwarded: dict[str, tuple[bool, bool]], auth: AuthInterceptor | None, metrics: RpcMetrics | None,
    ) -> None:
        self.transport = native.H2Transport(max_message_bytes)
        self.rpcs = rpcs  # FrontendDecodeRpcs
        self.channel = channel  # to the router's gRPC server
        self.forwarded = forwarded  # path -> (client streaming, server streaming) of what goes to the router
        self.auth = auth
        self.metrics = metrics
        self.calls: dict[int, _Call] = {}
        self._loop = asyncio.get_running_loop()
        self._pump = TransportLoop(self.transport, self._loop, self._handle)
        # what the calls answered is written once this loop pass is over
        self.flush_soon = self._pump.flush_soon
        self._idle: asyncio.Event | None = None  # set when the last call ends, while stopping
        self.transport.add_listener(listening_socket(host, port).detach())

    def start(self) -> None:
        self._pump.start()

    async def stop(self, grace_s: float) -> None:
        """Stops taking connections and calls, lets open calls end for up to `grace_s`, then drops
        the rest (their link requests are cancelled)."""
        self._handle(self.transport.stop_listening())
        if self.calls and grace_s > 0:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except asyncio.TimeoutError:
                pass
        self._pump.stop()
        self._handle(self.transport.close())
        for call in list(self.calls.values()):  # none should be left; no call outlives the transport
            call.gone(grpc.StatusCode.CANCELLED)

    def _handle(self, events: list[tuple]) -> None:
        calls = self.calls
        for event in events:
            try:
                kind, handle = event[0], event[1]
                if kind == _MESSAGE:
                    call = calls.get(handle)
                    if call is not None:
                        call.message(event[2])
                elif kind == _OPEN:
                    self._open(handle, event[2], event[3], event[4])
                elif kind == _HALF_CLOSE:
                    call = calls.get(handle)
                    if call is not None:
                        call.half_close()
                elif kind == _GONE:
                    call = calls.get(handle)
                    if call is not None:
                        call.gone(STATUS_CODES[event[2]])
            except Exception:  # one call's bug must not stop the others or the port: that call ends
                log.exception("serving an event of the native transport failed")
                call = calls.get(event[1])
                if call is not None:
                    call.finish(grpc.StatusCode.INTERNAL, "the server failed on this call")
                else:
                    self.transport.finish(event[1], grpc.StatusCode.INTERNAL.value[0], "the server failed on this call")

    def _open(self, handle: int, path: str | None, authorization: str | None, timeout: str | None) -> None:
        path = path or ""
        if path not in self.forwarded and path not in (DECODE, DECODE_STREAM):  # as grpc answers it
            self.transport.finish(handle, grpc.StatusCode.UNIMPLEMENTED.value[0], "Method not found!")
            return
        identity = None
        if self.auth is not None and not path.startswith(HEALTH_PREFIX):
            identity = self.auth.identity_for((("authorization", authorization),) if authorization else ())
            if identity is None:
                self._count(path, grpc.StatusCode.UNAUTHENTICATED, 0.0)
                self.transport.finish(handle, grpc.StatusCode.UNAUTHENTICATED.value[0], _UNAUTHENTICATED)
                return
        seconds = parse_timeout(timeout)
        if path == DECODE_STREAM:
            call: _Call = _DecodeStream(self, handle, identity)
        elif path == DECODE:
            call = _UnaryDecode(self, handle, identity)
        else:
            call = _Forwarded(self, handle, path, self.forwarded[path], identity, seconds)
        self.calls[handle] = call
        if seconds is not None and not isinstance(call, _Forwarded):  # the router keeps a passed-on call's
            call.deadline = self._loop.call_later(seconds, call.expire)

    def ended(self, call: "_Call", code: grpc.StatusCode) -> None:
        """Bookkeeping of a call that is over: its metrics, its place in `calls`."""
        if self.calls.pop(call.handle, None) is None:
            return
        if call.deadline is not None:
            call.deadline.cancel()
        self._count(call.path, code, time.perf_counter() - call.started)
        if self._idle is not None and not self.calls:
            self._idle.set()

    def _count(self, path: str, code: grpc.StatusCode, seconds: float) -> None:
        if self.metrics is not None and path.startswith(SERVICE_PREFIX):
            name = path[len(SERVICE_PREFIX):]
            self.metrics.rpcs.labels(name, code.name).inc()
            self.metrics.rpc_seconds.labels(name).observe(seconds)


class _Call:
    """One call on the transport: its events in, its end out."""

    path = ""

    def __init__(self, frontend: NativeFrontend, handle: int, identity: str | None) -> None:
        self.frontend = frontend
        self.handle = handle
        self.identity = identity
        self.started = time.perf_counter()
        self.deadline: asyncio.TimerHandle | None = None
        self.over = False

    def message(self, data: bytes) -> None:
        raise NotImplementedError

    def half_close(self) -> None:
        raise NotImplementedError

    def gone(self, code: grpc.StatusCode) -> None:
        """The client left (or the transport ended the call): nothing more is sent."""
        self.over = True
        self.frontend.ended(self, code)

    def expire(self) -> None:
        self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def finish(self, code: grpc.StatusCode, message: str | None = None) -> None:
        """Ends the call with `code` after the messages sent so far."""
        if self.over:
            return
        self.over = True
        self.frontend.transport.finish(self.handle, code.value[0], message)
        self.frontend.flush_soon()
        self.frontend.ended(self, code)


_PENDING = object()


class _Slot:
    """One request of a decode call: called with its DecodeResult or error (the link's `done`)."""

    __slots__ = ("call", "request_id", "result", "future")

    def __init__(self, call: "_DecodeStream", request_id: str) -> None:
        self.call = call
        self.request_id = request_id
        self.result: Any = _PENDING
        self.future: Any = None  # what _submit_decode returned: cancelled if the call ends first

    def __call__(self, result: Any) -> None:
        if self.result is _PENDING:
            self.result = result
            self.call.answered(self)


class _DecodeStream(_Call):
    """A DecodeStream: each message validated and sent to its engine at once, replies in order."""

    path = DECODE_STREAM
    method = "DecodeStream"

    def __init__(self, frontend: NativeFrontend, handle: int, identity: str | None) -> None:
        super().__init__(frontend, handle, identity)
        self.slots: collections.deque[_Slot] = collections.deque()
        self.backlog: collections.deque[bytes] = collections.deque()  # read while MAX_STREAM_IN_FLIGHT were out
        self.half_closed = False
        self.paused = False
        self.received = 0  # messages taken
        self.draining = False  # answered() is running

    def is_closed(self) -> bool:
        return self.over

    def message(self, data: bytes) -> None:
        if self.over:
            return
        self.received += 1
        if len(self.slots) >= MAX_STREAM_IN_FLIGHT:
            self.backlog.append(data)
            if not self.paused:
                self.paused = True
                self.frontend.transport.pause(self.handle, True)
            return
        self._submit(data)

    def _submit(self, data: bytes) -> None:
        try:
            request = parse_decode_request(data)
        except Exception as e:  # as RejectMalformed ends a grpc call
            self.finish(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {e}")
            return
        slot = _Slot(self, request.request_id)
        self.slots.append(slot)
        token = bind_identity(self.identity) if self.identity is not None else None
        try:
            slot.future = self.frontend.rpcs._submit_decode(request, slot, self.is_closed)
        except GdnError as e:
            slot(e)
        finally:
            if token is not None:
                unbind_identity(token)

    def answered(self, slot: _Slot) -> None:
        """Sends the replies that are ready, oldest first, and takes backlogged requests as room
        frees up. Not re-entered: a request refused at once (by validation) while this runs is
        answered by the running pass, so a backlog of bad requests is a loop, not a recursion."""
        slots = self.slots
        if self.draining or self.over or not slots or slots[0] is not slot:
            return
        self.draining = True
        transport, handle, rpcs = self.frontend.transport, self.handle, self.frontend.rpcs
        try:
            while slots and slots[0].result is not _PENDING:
                head = slots.popleft()
                result = head.result
                if isinstance(result, GdnError):
                    rpcs._count(self.method, result.code)
                    if not self._error_reply(result, head.request_id):
                        return
                elif isinstance(result, BaseException):
                    log.error("a decode request failed", exc_info=result)
                    self.finish(grpc.StatusCode.INTERNAL, f"the server failed: {result!r}")
                    return
                else:
                    rpcs._count(self.method, grpc.StatusCode.OK)
                    transport.send(handle, result.wire if result.wire is not None else decode_response_wire(result))
                backlog = self.backlog
                while backlog and len(slots) < MAX_STREAM_IN_FLIGHT and not self.over:
                    self._submit(backlog.popleft())
                if self.over:
                    return
        finally:
            self.draining = False
        self.frontend.flush_soon()
        if self.paused and not self.backlog:
            self.paused = False
            transport.pause(handle, False)
        self._maybe_done()

    def _error_reply(self, error: GdnError, request_id: str) -> bool:
        """A stream answers a bad request in-band and goes on; True while the call goes on."""
        self.frontend.transport.send(self.handle, error_response(request_id, error).SerializeToString())
        return True

    def half_close(self) -> None:
        self.half_closed = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.half_closed and not self.slots and not self.backlog and not self.over:
            self.finish(grpc.StatusCode.OK)

    def _cancel_pending(self) -> None:
        for slot in self.slots:
            if slot.future is not None:
                slot.future.cancel()
        self.slots.clear()
        self.backlog.clear()

    def gone(self, code: grpc.StatusCode) -> None:
        super().gone(code)
        self._cancel_pending()

    def finish(self, code: grpc.StatusCode, message: str | None = None) -> None:
        super().finish(code, message)
        self._cancel_pending()


class _UnaryDecode(_DecodeStream):
    """Decode: one request, its reply, or its error as the call's status."""

    path = DECODE
    method = "Decode"

    def message(self, data: bytes) -> None:
        if self.received:
            self.finish(grpc.StatusCode.UNIMPLEMENTED, "Decode takes one request message")
            return
        super().message(data)

    def _error_reply(self, error: GdnError, request_id: str) -> bool:
        self.finish(error.code, error.message)
        return False

    def half_close(self) -> None:
        if not self.received:
            self.finish(grpc.StatusCode.UNIMPLEMENTED, "Decode takes one request message, none came")
            return
        super().half_close()


class _Forwarded(_Call):
    """A call passed on to the router's gRPC server, as the method's own kind of call (a unary
    request is sent once it is whole): messages both ways as raw bytes, its status back as this
    call's."""

    def __init__(
        self, frontend: NativeFrontend, handle: int, path: str, kind: tuple[bool, bool], identity: str | None,
        timeout: float | None,
    ) -> None:
        super().__init__(frontend, handle, identity)
        self.path = path
        self.client_streaming, self.server_streaming = kind
        self.requests: list[bytes] = []  # a unary request, until the client's half-close
        self.queue: asyncio.Queue[bytes | None] | None = None
        self.paused = False
        metadata = ((IDENTITY_METADATA, identity.encode()),) if identity is not None else ()
        self.options = {"metadata": metadata, "timeout": timeout}
        self.task: asyncio.Future | None = None
        if self.client_streaming:
            self.queue = asyncio.Queue()
            self._start()

    def _start(self) -> None:
        channel, path = self.frontend.channel, self.path
        # raw bytes both ways: no (de)serializers
        if self.client_streaming:
            stub = channel.stream_stream(path) if self.server_streaming else channel.stream_unary(path)
            call = stub(**self.options)
        else:
            stub = channel.unary_stream(path) if self.server_streaming else channel.unary_unary(path)
            call = stub(self.requests[0], **self.options)
        self.task = asyncio.ensure_future(self._run(call))

    def message(self, data: bytes) -> None:
        if self.queue is None:
            self.requests.append(data)
            return
        self.queue.put_nowait(data)
        if self.queue.qsize() >= MAX_FORWARD_QUEUED and not self.paused:
            self.paused = True
            self.frontend.transport.pause(self.handle, True)

    def half_close(self) -> None:
        if self.queue is not None:
            self.queue.put_nowait(None)
        elif len(self.requests) == 1:
            self._start()
        else:
            self.finish(grpc.StatusCode.UNIMPLEMENTED, f"{self.path} takes one request message, got {len(self.requests)}")

    def gone(self, code: grpc.StatusCode) -> None:
        super().gone(code)
        if self.task is not None:
            self.task.cancel()

    async def _requests(self):
        """The client's messages as they come, until its half-close; its window reopens once the
        router has taken most of what waited."""
        while True:
            data = await self.queue.get()
            if self.paused and self.queue.qsize() < MAX_FORWARD_QUEUED // 4:
                self.paused = False
                self.frontend.transport.pause(self.handle, False)
            if data is None:
                return
            yield data

    async def _run(self, call) -> None:
        # written one by one, as EngineProxy's: when the router ends the call early the writes
        # stop and its status is what the client gets
        pump = asyncio.ensure_future(pump_requests(self._requests(), call)) if self.client_streaming else None
        transport, handle = self.frontend.transport, self.handle
        try:
            if self.server_streaming:
                async for reply in call:
                    transport.send(handle, reply)
                    self.frontend.flush_soon()
            else:
                transport.send(handle, await call)
            code, details = await call.code(), await call.details()
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
        except asyncio.CancelledError:  # our client left
            call.cancel()
            return
        finally:
            if pump is not None:
                pump.cancel()
        self.finish(code, details or None)


_OPEN, _MESSAGE, _HALF_CLOSE, _GONE = (
    (native.H2_OPEN, native.H2_MESSAGE, native.H2_HALF_CLOSE, native.H2_GONE)
    if native is not None and hasattr(native, "H2Transport") else (1, 2, 3, 4)
)
