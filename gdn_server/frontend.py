"""A front-end worker process (`gdn-server --frontends N` starts N of them).

One Python process cannot both serve gRPC at the rate of many clients and feed the GPUs: the
event loop and the scheduler threads share one GIL (bench/NOTES.md). With `--frontends N`, N
workers share the public port (SO_REUSEPORT: the kernel spreads connections over them) in front
of one engine process per device (gdn_server.router has the picture). A worker terminates TLS,
checks tokens, parses and validates decode requests, and hands each to the engine of its
sessions as a frame on that engine's decode link (gdn_server.link); every other RPC (sessions,
commit, export/import, health, reflection) goes through to the router's gRPC server, untouched.
Where a session lives comes from the router once (`Locate`) and is cached: sessions never move
between engines.

The router starts workers with `python -m gdn_server.frontend`, their settings as JSON on
stdin; a worker prints `ready` once it serves, and exits when told (SIGTERM: finish in-flight
calls first) or when an engine goes away.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.child_process import JsonSettings, start_child
from gdn_server.busy_poll import LoopSpinner
from gdn_server.config import GIL_SWITCH_INTERVAL_S, ModelShape
from gdn_server.event_loop import run as run_loop
from gdn_server.protowire import decode_request_parsers
from gdn_server.errors import FailedPrecondition, GdnError, Unavailable
from gdn_server.metrics import MetricsInterceptor, ProcessCpu, RpcMetrics
from gdn_server.link import LENGTH, decode_reply, encode_ack, encode_cancel, encode_hello, encode_request
from gdn_server.link_ring import REPLY_RING_BYTES, REQUEST_RING_BYTES, RequestRing, make_shared
from gdn_server.security import (
    IDENTITY_METADATA, AuthInterceptor, RejectMalformed, SecurityConfig, current_identity, load_tokens,
    server_credentials,
)
from gdn_server.decode_rpcs import DecodeRpcs, encode_decode_reply
from gdn_server.tuning import freeze_startup_objects
from gdn_server.work import DecodeResult, DecodeWork

log = logging.getLogger("gdn_server.frontend")

GDN_SERVICE = gdn_pb2.DESCRIPTOR.services_by_name["GdnDecode"]
LOCAL_METHODS = ("Decode", "DecodeStream")  # served here; everything else goes to the router
LOCATE = "/gdn.internal.Router/Locate"  # JSON [session id, ...] -> JSON [engine or null, ...]
MAX_CACHED_ROUTES = 1 << 17  # session ids remembered; past this the cache starts over
# a link that had two requests out at once does not keep its loop polling for this long (well
# past a round trip under load, so busy clients' lulls are not spun through)
CROWDED_HOLD_S = 0.1


@dataclass(frozen=True)
class FrontendSettings(JsonSettings):
    """What a worker needs, sent as JSON: where to listen, where the router and engines are, the
    model shape."""

    index: int
    host: str
    port: int
    engine_address: str  # "unix:/path": the router's gRPC server (every RPC but decode steps)
    link_paths: list[str]  # each engine's decode link socket, in the router's engine order
    shape: dict  # ModelShape fields
    security: dict  # SecurityConfig fields
    max_message_bytes: int
    grace_s: float = 30.0
    log_level: str = "INFO"
    # where RPC metrics go (prometheus_client multiprocess mode; the router sets
    # PROMETHEUS_MULTIPROC_DIR to it for us); None: metrics are off
    metrics_dir: str | None = None
    event_loop: str = "auto"  # gdn_server.event_loop
    # after each request sent to an engine and each reply from one, while a link carries one
    # request at a time, the loop keeps polling this long instead of sleeping
    # (gdn_server.busy_poll; the server's --busy-poll-us); 0: off
    busy_poll_us: int = 0
    transport: str = "grpc"  # the public port's gRPC: "grpc" (grpc.aio) or "native" (gdn_server.frontend_native)


class EngineLinkClient:
    """The worker's end of the link: sends request frames, settles futures from reply frames.
    The payloads go through the connection's shared-memory rings where the platform has memfd
    (gdn_server.link_ring), else in the frames."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shape: ModelShape,
        rings: tuple[RequestRing, memoryview] | None = None, spinner: LoopSpinner | None = None,
    ) -> None:
        self._reader, self._writer, self._shape = reader, writer, shape
        # keeps the loop polling while a request is out and between a client's steps: at one
        # client the worker's loop otherwise sleeps twice a step, waiting for the engine's reply
        # and for the client's next request, and wakes cold each time
        self._spinner = spinner
        self._crowded_until = 0.0  # until then this link has had requests overlap: no polling
        self._request_ring, self._reply_ring = rings if rings is not None else (None, None)
        self._reply_read_to = self._reply_acked = 0  # how far this worker has read the reply ring, and said so
        # tag -> (the future or `done` callable its reply goes to, its request id)
        self._pending: dict[int, tuple[asyncio.Future | Callable[[Any], None], str]] = {}
        self._next_tag = 0
        self.closed = asyncio.Event()
        self._task = asyncio.ensure_future(self._read_replies())

    @classmethod
    async def connect(
        cls, path: str, shape: ModelShape, rings: bool = True, spinner: LoopSpinner | None = None,
    ) -> "EngineLinkClient":
        """Connects to the engine's link at `path` and says hello: with the rings' memory unless
        `rings` is False or the platform has no memfd. `spinner`: the loop's busy poller, touched
        after every request sent and reply read while the link carries one request at a time
        (None: the loop sleeps when idle)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, path)
            shared = make_shared(REQUEST_RING_BYTES + REPLY_RING_BYTES) if rings else None
            if shared is None:
                sock.sendall(encode_hello(0, 0))  # a few bytes into an empty socket: never blocks
                ring_views = None
            else:
                fd, memory = shared
                try:
                    socket.send_fds(sock, [encode_hello(REQUEST_RING_BYTES, REPLY_RING_BYTES)], [fd])
                finally:
                    os.close(fd)  # the engine has its own; the mapping stays
                view = memoryview(memory)
                ring_views = (RequestRing(view[:REQUEST_RING_BYTES]), view[REQUEST_RING_BYTES:])
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 20)
        except BaseException:
            sock.close()
            raise
        return cls(reader, writer, shape, ring_views, spinner)

    def submit(self, work: DecodeWork) -> asyncio.Future:
        """Sends one validated request; the future gets its DecodeResult or GdnError."""
        fut = asyncio.get_running_loop().create_future()
        tag = self._send(work, fut)
        fut.add_done_callback(lambda f: f.cancelled() and self._cancel(tag))
        return fut

    def submit_to(self, work: DecodeWork, done: Callable[[Any], None]) -> "LinkRequest":
        """Sends one validated request; `done` gets its DecodeResult or GdnError, called on this
        loop's thread as the reply is read. A DecodeStream's answers take this way: a future
        would hand the reply over one loop iteration later, through its done-callback (the
        worker's stage from reply read to stream writer went 4-7 us shorter without it on the
        CPU box, bench/NOTES.md). Cancel the returned handle when the caller gives up."""
        return LinkRequest(self, self._send(work, done))

    def _send(self, work: DecodeWork, answer: asyncio.Future | Callable[[Any], None]) -> int:
        """Writes the request's frames; `answer` (a future, or a callable) gets the reply. Returns
        the request's tag."""
        if self.closed.is_set():
            raise Unavailable("this front end lost its engine process; retry (the server is restarting)")
        tag = self._next_tag
        self._next_tag += 1
        self._pending[tag] = (answer, work.request_id)
        frames = encode_request(tag, work, self._request_ring)
        if self._reply_read_to != self._reply_acked:  # ahead of the request: the engine may reuse that much
            self._reply_acked = self._reply_read_to
            frames.insert(0, encode_ack(self._reply_acked))
        self._writer.writelines(frames)
        if self._spinner is not None:
            self._keep_polling(len(self._pending) > 1)
        return tag

    def _keep_polling(self, crowded: bool) -> None:
        """Touches the loop's spinner while this link carries one request at a time. A worker of
        several busy clients has work enough to stay awake, and a loop spinning in each of a
        round trip's gaps took cores from the rest (on the 2-core CPU box, 8 clients over 2
        workers: -15-21% steps/s, bench/NOTES.md): after two requests overlap, the link is
        left to sleep for CROWDED_HOLD_S."""
        now = time.monotonic()
        if crowded:
            self._crowded_until = now + CROWDED_HOLD_S
        elif now >= self._crowded_until:
            self._spinner.touch()

    def _cancel(self, tag: int) -> None:
        """The caller gave up: the engine drops the request if it has not reached the device (its
        reply, CANCELLED then, still comes: it frees the request's bytes in the ring)."""
        if self._pending.pop(tag, None) is not None and not self.closed.is_set():
            self._writer.write(encode_cancel(tag))

    async def _read_replies(self) -> None:
        try:
            while True:
                (size,) = LENGTH.unpack(await self._reader.readexactly(LENGTH.size))
                frame = await self._reader.readexactly(size)
                tag, result, read_to = decode_reply(frame, self._shape, self._reply_ring, copy=False)
                if read_to is not None:
                    self._reply_read_to = read_to
                if self._request_ring is not None:
                    self._request_ring.free(tag)
                answer, request_id = self._pending.pop(tag, (None, ""))
                if self._spinner is not None:
                    self._keep_polling(False)
                if answer is None:  # the caller gave up meanwhile
                    continue
                if not isinstance(result, GdnError):
                    # the reply's wire form, made here from the output where it lies (the ring is
                    # acked past it only with this worker's next request): its one copy
                    out = result.out
                    wire, at = encode_decode_reply(out, result.shape, result.positions, request_id)
                    result = DecodeResult(memoryview(wire)[at : at + len(out)], result.shape, result.positions,
                                          request_id, wire)
                _settle(answer, result)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except ValueError:  # a reply frame that does not read: the link is broken
            log.exception("bad reply frame from the engine; closing its link")
            self._writer.close()
        finally:
            self.closed.set()
            pending, self._pending = self._pending, {}
            for answer, _ in pending.values():
                _settle(answer, Unavailable("the engine process went away before answering; retry"))

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        self._task.cancel()


class LinkRequest:
    """A request sent with `EngineLinkClient.submit_to`: `cancel()` when its caller gives up (the
    engine drops it if it has not reached the device; `done` is then not called)."""

    __slots__ = ("_link", "_tag")

    def __init__(self, link: EngineLinkClient, tag: int) -> None:
        self._link, self._tag = link, tag

    def cancel(self) -> None:
        self._link._cancel(self._tag)


def _settle(answer: asyncio.Future | Callable[[Any], None], result: Any) -> None:
    """Gives a reply (a DecodeResult or an error) to a request's future or `done` callable."""
    if isinstance(answer, asyncio.Future):
        if answer.done():  # cancelled meanwhile
            return
        if isinstance(result, BaseException):
            answer.set_exception(result)
        else:
            answer.set_result(result)
    else:
        try:
            answer(result)
        except Exception:  # not the link's fault: the link stays up for the other requests
            log.exception("answering a decode request failed")


class SessionRoutes:
    """Which engine each session lives on: asked of the router once per session, then cached
    (an id never moves between engines; a closed one just answers NOT_FOUND from its engine)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._locate = channel.unary_unary(LOCATE)
        self._engine_of: dict[str, int] = {}

    def engine_now(self, session_ids: tuple[str, ...]) -> int | None:
        """The engine of a request whose sessions are all cached, else None (ask `engine_for`)."""
        engines = set()
        for sid in session_ids:
            engine = self._engine_of.get(sid)
            if engine is None:
                return None
            engines.add(engine)
        return _one_engine(engines)

    async def engine_for(self, session_ids: tuple[str, ...]) -> int:
        found = {sid: self._engine_of[sid] for sid in session_ids if sid in self._engine_of}
        unknown = [sid for sid in session_ids if sid not in found]
        if unknown:
            try:
                answer = json.loads(await self._locate(json.dumps(unknown).encode()))
            except grpc.aio.AioRpcError as e:
                raise Unavailable(f"this front end cannot reach the router: {e.details()}") from None
            if len(self._engine_of) + len(unknown) > MAX_CACHED_ROUTES:
                self._engine_of.clear()  # mostly closed sessions by now; the live ones are asked again
            for sid, engine in zip(unknown, answer):
                if engine is not None:
                    found[sid] = self._engine_of[sid] = engine
        # sessions nobody holds: any engine answers NOT_FOUND for them, in the engines' words
        return _one_engine(set(found.values())) if found else 0


def _one_engine(engines: set[int]) -> int:
    if len(engines) > 1:
        raise FailedPrecondition(
            "the sessions of one request live on different devices: send them in separate requests, or create "
            "them together (CreateSessionRequest.colocate_with)"
        )
    return next(iter(engines))


class FrontendDecodeRpcs(DecodeRpcs):
    """Decode and DecodeStream, validated here and run by the engine of their sessions."""

    # big bf16 requests go to the engine unchecked for NaN/Inf (link.FLAG_UNCHECKED): its staging
    # copy checks them as it copies, where a check here was a pass of its own over the bytes
    # (~0.9 ms of a B=256 step's round trip on the CPU box, bench/NOTES.md)
    defer_finite_check = True
    f32_as_bytes = True  # f16/f32 requests widened with numpy: a worker never loads torch

    def __init__(
        self, shape: ModelShape, links: list[EngineLinkClient], routes: SessionRoutes, metrics: RpcMetrics | None
    ) -> None:
        self.shape = shape
        self.links = links
        self.routes = routes
        self.metrics = metrics

    def _start_decode(self, request: gdn_pb2.DecodeRequest) -> asyncio.Future:
        work = self._validated(request)
        link = self._link_now(work)
        if link is not None:
            return link.submit(work)
        return asyncio.ensure_future(self._located(work))  # cancelling it cancels the submit inside

    def _submit_decode(
        self, request: gdn_pb2.DecodeRequest, done: Callable[[Any], None], cancelled: Callable[[], bool]
    ) -> LinkRequest | asyncio.Future:
        """A DecodeStream's request: its link calls `done` with the reply as it reads it (no
        future in between); a request whose engine is still to be asked goes the future's way."""
        work = self._validated(request)
        link = self._link_now(work)
        if link is not None:
            return link.submit_to(work, done)
        return self._answering(asyncio.ensure_future(self._located(work)), done)

    def _link_now(self, work: DecodeWork) -> EngineLinkClient | None:
        """The link to the engine of `work`'s sessions, if known without asking the router."""
        if len(self.links) == 1:
            return self.links[0]
        engine = self.routes.engine_now(work.session_ids)
        return None if engine is None else self.links[engine]

    async def _located(self, work: DecodeWork) -> DecodeResult:
        engine = await self.routes.engine_for(work.session_ids)
        return await self.links[engine].submit(work)


def _methods_of(*services) -> dict[str, tuple[bool, bool]]:
    """'/package.Service/Method' -> (client streaming, server streaming) for every method."""
    return {
        f"/{service.full_name}/{m.name}": (m.client_streaming, m.server_streaming)
        for service in services
        for m in service.methods
    }


def forwarded_methods() -> dict[str, tuple[bool, bool]]:
    """What a worker passes to the router: every method but LOCAL_METHODS, by path, with its kind."""
    proxied = _methods_of(
        GDN_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"],
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    )
    for name in LOCAL_METHODS:
        del proxied[f"/{GDN_SERVICE.full_name}/{name}"]
    return proxied


class EngineProxy(grpc.GenericRpcHandler):
    """Passes calls through to the router's gRPC server as raw bytes, with the caller's identity."""

    def __init__(self, channel: grpc.aio.Channel, methods: dict[str, tuple[bool, bool]]) -> None:
        self._handlers = {path: self._handler(channel, path, *kind) for path, kind in methods.items()}

    def service(self, handler_call_details):
        return self._handlers.get(handler_call_details.method)

    @staticmethod
    def _handler(channel: grpc.aio.Channel, path: str, client_streaming: bool, server_streaming: bool):
        call_options = forwarding_options
        if client_streaming:
            # The requests are written one by one (not handed over as an iterator): when the
            # engine ends the call early (a bad first chunk), the writes stop cleanly and the
            # engine's status is what our caller gets.
            stub = (channel.stream_stream if server_streaming else channel.stream_unary)(path)

            def start(requests, context):
                call = stub(**call_options(context))
                return call, asyncio.ensure_future(pump_requests(requests, call))
        else:
            stub = (channel.unary_stream if server_streaming else channel.unary_unary)(path)

            def start(request, context):
                return stub(request, **call_options(context)), None

        if server_streaming:

            async def stream_out(request_or_iterator, context):
                async for response in forwarded_stream(*start(request_or_iterator, context), context):
                    yield response

            factory = grpc.stream_stream_rpc_method_handler if client_streaming else grpc.unary_stream_rpc_method_handler
            return factory(stream_out)

        async def unary_out(request_or_iterator, context):
            return await forwarded_reply(*start(request_or_iterator, context), context)

        factory = grpc.stream_unary_rpc_method_handler if client_streaming else grpc.unary_unary_rpc_method_handler
        return factory(unary_out)


def forwarding_options(context) -> dict[str, Any]:
    """Call options that pass a call on: our caller's identity (as authenticated here, or as
    forwarded to us) and what is left of its deadline."""
    identity = current_identity()
    metadata = ((IDENTITY_METADATA, identity.encode()),) if identity is not None else ()
    return {"metadata": metadata, "timeout": context.time_remaining()}


async def forwarded_reply(call, pump: asyncio.Future | None, context):
    """The reply of a call we passed on (after `pump` has written our caller's request stream to
    it); its error status becomes our caller's."""
    try:
        if pump is not None:
            await pump
        return await call
    except grpc.aio.AioRpcError as e:
        await context.abort(e.code(), e.details())
    finally:
        call.cancel()  # a no-op once it ended; stops the far side if our caller left
        if pump is not None:
            pump.cancel()


async def forwarded_stream(call, pump: asyncio.Future | None, context):
    """The replies of a server-streaming call we passed on, as `forwarded_reply` does for one."""
    try:
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as e:
        await context.abort(e.code(), e.details())
    finally:
        call.cancel()
        if pump is not None:
            pump.cancel()


async def pump_requests(requests, call) -> None:
    """Writes our caller's request stream to the call we pass it on to, until either side ends."""
    try:
        async for request in requests:
            await call.write(request)
        await call.done_writing()
    except (grpc.RpcError, asyncio.InvalidStateError):  # the engine finished the call first
        pass


def _grpc_server(
    settings: FrontendSettings, limits: list, rpcs: FrontendDecodeRpcs, channel: grpc.aio.Channel,
    auth: AuthInterceptor | None, metrics: RpcMetrics | None,
) -> grpc.aio.Server:
    """The public port over grpc.aio (`--frontend-transport grpc`): Decode and DecodeStream here,
    every other RPC through EngineProxy, bound to host:port beside the other workers."""
    interceptors: list = []
    if metrics is not None:  # outermost: counts auth failures
        interceptors.append(MetricsInterceptor(metrics))
    if auth is not None:
        interceptors.append(auth)
    interceptors.append(RejectMalformed(decode_request_parsers()))  # big tensors' bytes go to the link uncopied
    # SO_REUSEPORT: every worker binds the same port; the router holds it reserved meanwhile
    server = grpc.aio.server(interceptors=interceptors, options=[*limits, ("grpc.so_reuseport", 1)])
    decode_handlers = {
        "Decode": grpc.unary_unary_rpc_method_handler(
            rpcs.Decode, request_deserializer=gdn_pb2.DecodeRequest.FromString,
            response_serializer=gdn_pb2.DecodeResponse.SerializeToString,
        ),
        "DecodeStream": grpc.stream_stream_rpc_method_handler(
            rpcs.DecodeStream, request_deserializer=gdn_pb2.DecodeRequest.FromString,
            response_serializer=gdn_pb2.DecodeResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(GDN_SERVICE.full_name, decode_handlers),
         EngineProxy(channel, forwarded_methods())]
    )
    address = f"{settings.host}:{settings.port}"
    credentials = server_credentials(SecurityConfig(**settings.security))
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound != settings.port:
        raise OSError(f"front end {settings.index} could not bind {address}")
    return server


ENGINE_LOST_EXIT = 3  # the router restarts a worker that exits; this code says why in its log


async def serve_frontend(settings: FrontendSettings) -> int:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # gRPC's poller thread and the event loop share the GIL
    shape = ModelShape(**settings.shape)
    security = SecurityConfig(**settings.security)
    limits = [("grpc.max_receive_message_length", settings.max_message_bytes),
              ("grpc.max_send_message_length", settings.max_message_bytes)]
    spinner = LoopSpinner.of(asyncio.get_running_loop(), settings.busy_poll_us / 1e6) if settings.busy_poll_us else None
    links = [await EngineLinkClient.connect(path, shape, spinner=spinner) for path in settings.link_paths]
    channel = grpc.aio.insecure_channel(settings.engine_address, options=limits)
    metrics = RpcMetrics(registry=None) if settings.metrics_dir else None  # written to the router's files
    tokens = load_tokens(security.auth_token_file) if security.auth_token_file else None
    auth = AuthInterceptor(tokens, security.mutual_tls) if tokens is not None or security.mutual_tls else None
    rpcs = FrontendDecodeRpcs(shape, links, SessionRoutes(channel), metrics)
    if settings.transport == "native":  # TLS was refused at start (frontend_native.check_transport)
        from gdn_server.frontend_native import NativeFrontend  # it passes calls on with pump_requests, below

        public = NativeFrontend(
            settings.host, settings.port, settings.max_message_bytes, rpcs, channel, forwarded_methods(), auth, metrics
        )
        public.start()
        stop_serving = public.stop
    else:
        server = _grpc_server(settings, limits, rpcs, channel, auth, metrics)
        await server.start()
        stop_serving = server.stop
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    freeze_startup_objects()  # see gdn_server/tuning.py
    print("ready", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the router reads one line; later output is logs
    engine_gone = [asyncio.ensure_future(link.closed.wait()) for link in links]
    told = asyncio.ensure_future(stop.wait())
    # this worker's CPU, in the router's /metrics (summed over workers)
    cpu_counter = asyncio.ensure_future(ProcessCpu("worker", None).count_forever()) if metrics is not None else None
    await asyncio.wait([*engine_gone, told], return_when=asyncio.FIRST_COMPLETED)
    engine_lost = not stop.is_set()
    if engine_lost:
        log.error("front end %d: an engine process went away; exiting", settings.index)
        await stop_serving(0)
    else:  # the router drains us first: in-flight calls finish while the engines still serve them
        await stop_serving(settings.grace_s)
    for waiter in (*engine_gone, told, cpu_counter):
        if waiter is not None:
            waiter.cancel()
    for link in links:
        await link.close()
    await channel.close()
    return ENGINE_LOST_EXIT if engine_lost else 0


def main() -> int:
    settings = start_child(FrontendSettings, "frontend[{index}]")
    try:
        return run_loop(serve_frontend(settings), settings.event_loop)
    except OSError as e:
        log.error("front end %d cannot serve: %s", settings.index, e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
