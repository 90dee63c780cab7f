"""Every call's way in: who is calling, whether the server takes the call, its request read within
bounds, and its domain errors turned into statuses. One grpc.aio interceptor, `CallGate`, does it
for every method, so that nothing of this lives in the handlers.

A call goes through, in order:
1. **Token** (`--auth-token-file`): a call without a valid `authorization: Bearer <token>` ends
   with UNAUTHENTICATED at once, before any of its message is read, so it holds nothing that an
   authenticated client needs (grpc.health.v1 needs no token).
2. **Admission** (`Admission`): a call counts against its client (the token's identity, the client
   certificate's subject under mutual TLS, else the connection's peer) and against the server.
   A client at `--max-calls-per-client` is refused with RESOURCE_EXHAUSTED. A server at
   `--max-calls` makes room for a client that holds fewer calls than the client holding the most,
   by ending that client's newest call with RESOURCE_EXHAUSTED; it refuses a client that holds the
   most itself. Health calls are never counted: health reports the server's own state.
3. **The message**: every handler reads its own requests (grpc.aio would otherwise read a unary
   request before any code of ours runs). A unary request must arrive whole within
   `--message-timeout-s` of the call's start, else DEADLINE_EXCEEDED; bytes that do not parse
   are INVALID_ARGUMENT, not grpc's UNKNOWN with a traceback per message.
4. **Errors**: a `GdnError` escaping a handler becomes its status here, and only here.

Streams (DecodeStream, ImportState) may idle between messages; what one can park of an unfinished
message is bounded by the calls its client may hold (bench/DECISIONS.md, "admission").
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from gdn_server.errors import DeadlineExceeded, GdnError, InvalidArgument, ResourceExhausted, Unauthenticated
from gdn_server.security import bind_identity, client_key, peer_subject

HEALTH_PREFIX = "/grpc.health.v1.Health/"
SERVICE_PREFIX = "/gdn.v1.GdnDecode/"


class Ticket:
    """One admitted call: whose it is, and the task to end if the server needs its place."""

    __slots__ = ("key", "task", "preempted")

    def __init__(self, key: str, task: asyncio.Task | None) -> None:
        self.key = key
        self.task = task
        self.preempted = False


@dataclass
class Admission:
    """The calls held at once, per client and in all (see the module docstring, step 2)."""

    max_calls: int
    max_calls_per_client: int
    held: dict[str, list[Ticket]] = field(default_factory=dict)
    total: int = 0

    def admit(self, key: str, task: asyncio.Task | None) -> Ticket:
        """A ticket for a new call of client `key`; ResourceExhausted when it may not have one.
        Where the server is full and another client holds more calls than `key`, that client's
        newest call is ended (its ticket marked preempted, its task cancelled) to make room."""
        mine = self.held.get(key)
        count = len(mine) if mine else 0
        if count >= self.max_calls_per_client:
            raise ResourceExhausted(
                f"this client holds {count} calls, the most one client may hold (--max-calls-per-client)"
            )
        if self.total >= self.max_calls:
            top_key, top = max(self.held.items(), key=lambda kv: len(kv[1]))
            if len(top) <= count + 1:
                raise ResourceExhausted(
                    f"the server holds {self.total} calls, its limit (--max-calls), and this client holds "
                    f"as many as any: retry after one of its calls ends"
                )
            self._preempt(top_key, top)
        ticket = Ticket(key, task)
        if mine is None:
            self.held[key] = [ticket]
        else:
            mine.append(ticket)
        self.total += 1
        return ticket

    def _preempt(self, key: str, tickets: list[Ticket]) -> None:
        victim = tickets[-1]
        self.release(victim)
        victim.preempted = True
        if victim.task is not None:
            victim.task.cancel()

    def release(self, ticket: Ticket) -> None:
        """Gives a ticket's place back (once; a preempted ticket was given back already)."""
        tickets = self.held.get(ticket.key)
        if tickets is None or ticket.preempted:
            return
        try:
            tickets.remove(ticket)
        except ValueError:
            return
        self.total -= 1
        if not tickets:
            del self.held[ticket.key]


class _Malformed:
    """Stands in for a request message whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _checked(message: Any) -> Any:
    if type(message) is _Malformed:
        raise InvalidArgument(f"malformed request message: {message.error}")
    return message


class _Requests:
    """A streaming call's requests, read with `context.read()` (one reader per call, as grpc.aio
    requires), each checked for bytes that did not parse."""

    __slots__ = ("_context",)

    def __init__(self, context: Any) -> None:
        self._context = context

    def __aiter__(self) -> "_Requests":
        return self

    async def __anext__(self) -> Any:
        message = await self._context.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return _checked(message)


RpcObserver = Callable[[str, grpc.StatusCode, float], None]  # (method, final code, seconds)


class CallGate(grpc.aio.ServerInterceptor):
    """Tokens, admission, bounded request reading and error statuses for every call (see the
    module docstring). `observe_rpc`, when set, hears every gdn.v1.GdnDecode call's method, final
    status and duration (the metrics)."""

    def __init__(self, admission: Admission, message_timeout_s: float, tokens: dict[str, str] | None = None,
                 mutual_tls: bool = False, observe_rpc: RpcObserver | None = None) -> None:
        self.admission = admission
        self.message_timeout_s = message_timeout_s
        self._tokens = None if tokens is None else [(t.encode(), name) for t, name in tokens.items()]
        self._mutual_tls = mutual_tls
        self.observe_rpc = observe_rpc

    def identity_for(self, metadata) -> str | None:
        """The identity of a valid `authorization: Bearer <token>` entry, else None."""
        for key, value in metadata or ():
            if key != "authorization":
                continue
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, presented = value.strip().partition(" ")
            if scheme.lower() != "bearer":
                continue
            candidate = presented.strip().encode()
            found = None
            for token, name in self._tokens or ():  # compare with every token: no early exit
                if hmac.compare_digest(candidate, token):
                    found = name
            if found is not None:
                return found
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return self._gated(handler, method, counted=False, token_identity=None)
        token_identity = None
        if self._tokens is not None:
            token_identity = self.identity_for(handler_call_details.invocation_metadata)
            if token_identity is None:
                return self._refused(handler, method, Unauthenticated(
                    "missing or invalid `authorization: Bearer <token>` metadata"))
        return self._gated(handler, method, counted=True, token_identity=token_identity)

    def _observe(self, method: str, code: grpc.StatusCode, started: float) -> None:
        if self.observe_rpc is not None and method.startswith(SERVICE_PREFIX):
            self.observe_rpc(method[len(SERVICE_PREFIX):], code, time.perf_counter() - started)

    def _refused(self, handler: grpc.RpcMethodHandler, method: str, error: GdnError) -> grpc.RpcMethodHandler:
        """A handler that reads nothing and ends the call with `error` at once. Its requests are
        streamed whatever the method's kind, so grpc.aio posts no read for them."""

        async def refuse(requests, context):
            self._observe(method, error.code, time.perf_counter())
            await context.abort(error.code, error.message)

        factory = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler
        return factory(refuse, request_deserializer=None, response_serializer=handler.response_serializer)

    def _gated(self, handler: grpc.RpcMethodHandler, method: str, counted: bool,
               token_identity: str | None) -> grpc.RpcMethodHandler:
        if handler.request_streaming and handler.response_streaming:
            behavior = handler.stream_stream
        elif handler.request_streaming:
            behavior = handler.stream_unary
        elif handler.response_streaming:
            behavior = handler.unary_stream
        else:
            behavior = handler.unary_unary
        unary_request = not handler.request_streaming
        parse = handler.request_deserializer
        admission = self.admission
        timeout = self.message_timeout_s
        mutual_tls = self._mutual_tls

        def deserialize(data: bytes) -> Any:
            if parse is None:
                return data
            try:
                return parse(data)
            except Exception as e:  # DecodeError, or whatever a generated parser raises
                return _Malformed(e)

        async def enter(context) -> tuple[Ticket | None, Any]:
            """Admits the call and binds its identity; returns its ticket and what the behaviour
            reads (the one request of a unary call, else the stream of requests)."""
            identity = token_identity
            if identity is None and mutual_tls:
                identity = peer_subject(context)
            bind_identity(identity)
            ticket = None
            if counted:
                ticket = admission.admit(client_key(identity, context), asyncio.current_task())
            if not unary_request:
                return ticket, _Requests(context)
            try:
                async with asyncio.timeout(timeout):  # a timer on this task: no task per call, as wait_for makes
                    message = await context.read()
            except TimeoutError:
                raise DeadlineExceeded(
                    f"no whole request message within {timeout:g} s of the call's start (--message-timeout-s)"
                ) from None
            if message is grpc.aio.EOF:
                raise InvalidArgument("the call ended without its request message")
            return ticket, _checked(message)

        async def leave(context, ticket: Ticket | None, error: BaseException | None, started: float) -> None:
            """Releases the call's place and turns what ended it into its status."""
            if ticket is not None:
                admission.release(ticket)
            if isinstance(error, asyncio.CancelledError) and ticket is not None and ticket.preempted:
                error = ResourceExhausted(
                    "the server is at its call limit (--max-calls) and this client holds the most calls: "
                    "this, its newest, was ended to admit another client"
                )
            code = _final_code(context, error)
            self._observe(method, code, started)
            if isinstance(error, GdnError):
                await context.abort(error.code, error.message)

        @contextlib.asynccontextmanager
        async def admitted(context):
            """The call admitted, its identity bound and its request read, for the behaviour's run."""
            started = time.perf_counter()
            ticket = error = None
            try:
                ticket, request = await enter(context)
                yield request
            except BaseException as e:
                error = e
                raise
            finally:
                await leave(context, ticket, error, started)

        serializer = handler.response_serializer
        if not handler.response_streaming:

            async def unary_response(requests, context):
                async with admitted(context) as request:
                    result = behavior(request, context)
                    return await result if inspect.isawaitable(result) else result

            return grpc.stream_unary_rpc_method_handler(
                unary_response, request_deserializer=deserialize, response_serializer=serializer)

        if inspect.iscoroutinefunction(behavior):  # reader/writer API: replies go out with context.write

            async def writer(requests, context):
                async with admitted(context) as request:
                    await behavior(request, context)

            return grpc.stream_stream_rpc_method_handler(
                writer, request_deserializer=deserialize, response_serializer=serializer)

        async def generator(requests, context):  # an async generator of replies
            async with admitted(context) as request:
                async with contextlib.aclosing(behavior(request, context)) as replies:
                    async for reply in replies:
                        yield reply

        return grpc.stream_stream_rpc_method_handler(
            generator, request_deserializer=deserialize, response_serializer=serializer)


def _final_code(context, error: BaseException | None) -> grpc.StatusCode:
    """The status a call ends with: a domain error's, what the call set on its context, else OK or
    the exception's."""
    if isinstance(error, GdnError):
        return error.code
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # some grpc versions keep the raw integer
        for c in grpc.StatusCode:
            if c.value[0] == code:
                return c
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN
