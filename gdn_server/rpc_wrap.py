"""Wrapping a grpc.aio method handler so that code runs around every call of it.

Server interceptors in grpc.aio see only the method name and metadata, not the call's context,
its status code or its end. `wrap_handler` rebuilds a handler whose behaviour runs inside an async
context manager made per call from the call's context: auth checks in `__aenter__` (which may
abort), accounting in `__aexit__`. It keeps the handler's kind and (de)serializers, and works for
coroutine handlers, async-generator handlers and the reader/writer streaming API.

A wrapped handler also takes responses that are already serialized (`Serialized`): its response
serializer passes their bytes through. A behaviour learns that it may answer so from
`serialized_responses_ok()`, true inside any call of a wrapped handler; it lets the decode RPCs
write a multi-MiB reply with one copy of the output instead of the three that filling a protobuf
message and serializing it cost (gdn_server.decode_rpcs.decode_response_wire).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
from typing import Any, AsyncContextManager, Callable

import grpc

Around = Callable[[Any], AsyncContextManager[Any]]  # (servicer context) -> async context manager
# (request message, servicer context) -> message; a plain call, not a coroutine: it runs per message
MapRequest = Callable[[Any, Any], Any]


class Serialized:
    """A response message already in its wire form; a wrapped handler sends the bytes as they are."""

    __slots__ = ("wire",)

    def __init__(self, wire: bytes) -> None:
        self.wire = wire


# True in the context of a call of a wrapped handler. Each grpc.aio call runs in a task of its own,
# so setting it in one call's behaviour never leaks into another's.
_SERIALIZED_OK: contextvars.ContextVar[bool] = contextvars.ContextVar("gdn_serialized_ok", default=False)


def serialized_responses_ok() -> bool:
    """Whether the running call's handler sends `Serialized` responses as they are (a handler not
    built by `wrap_handler` would hand them to the message's own serializer, which refuses them)."""
    return _SERIALIZED_OK.get()


def _passing_serialized(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    if serialize is None or getattr(serialize, "passes_serialized", False):
        return serialize  # None: grpc sends bytes as they are anyway; or an inner wrap did it already

    def serializer(response: Any) -> bytes:
        if type(response) is Serialized:
            return response.wire
        return serialize(response)

    serializer.passes_serialized = True  # type: ignore[attr-defined]
    return serializer


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    around: Around,
    map_request: MapRequest | None = None,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """`around(context)` wraps each call; `map_request` sees each request message before the
    behaviour does (it may abort); `request_deserializer` replaces the handler's."""
    if handler.request_streaming and handler.response_streaming:
        behavior, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    streaming_requests = handler.request_streaming

    async def prepare(request_or_iterator, context):
        if map_request is None:
            return request_or_iterator
        if streaming_requests:
            return _MappedRequests(request_or_iterator, context, map_request)
        return map_request(request_or_iterator, context)

    if not handler.response_streaming:

        async def wrapped(request_or_iterator, context):
            _SERIALIZED_OK.set(True)  # this call's own context (its task's); see serialized_responses_ok
            async with around(context):
                result = behavior(await prepare(request_or_iterator, context), context)
                if inspect.isawaitable(result):
                    result = await result
                return result

    elif inspect.iscoroutinefunction(behavior):  # reader/writer API: writes with context.write

        async def wrapped(request_or_iterator, context):
            # grpc.aio's context.write serializes with the handler's response serializer (grpcio >= 1.84,
            # our floor): the one built below, which passes Serialized through
            _SERIALIZED_OK.set(True)
            async with around(context):
                await behavior(await prepare(request_or_iterator, context), context)

    else:  # an async generator of responses

        async def wrapped(request_or_iterator, context):
            _SERIALIZED_OK.set(True)
            async with around(context):
                request_or_iterator = await prepare(request_or_iterator, context)
                async with contextlib.aclosing(behavior(request_or_iterator, context)) as responses:
                    async for response in responses:
                        yield response

    return factory(
        wrapped,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=_passing_serialized(handler.response_serializer),
    )


class _MappedRequests:
    """A streaming call's requests, each through `map_request`, read with `context.read()`.

    Not an async generator over grpc's own request iterator (itself an async generator over
    `context.read()`): that stacked two generator resumptions on every message of every stream.
    The behaviour must read only through this object (grpc.aio forbids mixing `context.read()` with
    iterating the request iterator); a second wrapping adds its map to this one's instead of
    stacking another reader."""

    __slots__ = ("_context", "_maps")

    def __init__(self, requests: Any, context: Any, map_request: MapRequest) -> None:
        inner = requests._maps if type(requests) is _MappedRequests else ()
        self._context = context
        self._maps = (*inner, map_request)

    def __aiter__(self) -> "_MappedRequests":
        return self

    async def __anext__(self) -> Any:
        context = self._context
        message = await context.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        for map_request in self._maps:
            message = map_request(message, context)
        return message


def final_code(context, error: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with: what it set on its context, else OK or the exception's."""
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
