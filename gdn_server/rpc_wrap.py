"""Wrapping a grpc.aio method handler so that code runs around every call of it.

Server interceptors in grpc.aio see only the method name and metadata, not the call's context,
its status code or its end. `wrap_handler` rebuilds a handler whose behaviour runs inside an async
context manager made per call from the call's context: auth checks in `__aenter__` (which may
abort), accounting in `__aexit__`. It keeps the handler's kind and (de)serializers, and works for
coroutine handlers, async-generator handlers and the reader/writer streaming API.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Any, AsyncContextManager, Callable

import grpc

Around = Callable[[Any], AsyncContextManager[Any]]  # (servicer context) -> async context manager
# (request message, servicer context) -> message; a plain call, not a coroutine: it runs per message
MapRequest = Callable[[Any, Any], Any]


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
            async with around(context):
                result = behavior(await prepare(request_or_iterator, context), context)
                if inspect.isawaitable(result):
                    result = await result
                return result

    elif inspect.iscoroutinefunction(behavior):  # reader/writer API: writes with context.write

        async def wrapped(request_or_iterator, context):
            async with around(context):
                await behavior(await prepare(request_or_iterator, context), context)

    else:  # an async generator of responses

        async def wrapped(request_or_iterator, context):
            async with around(context):
                request_or_iterator = await prepare(request_or_iterator, context)
                async with contextlib.aclosing(behavior(request_or_iterator, context)) as responses:
                    async for response in responses:
                        yield response

    return factory(
        wrapped,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
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
