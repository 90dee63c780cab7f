"""gdn_server.rpc_wrap on a real grpc.aio server (loopback): a streaming handler on the
reader/writer API, wrapped twice as two interceptors would wrap it."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import grpc.aio

from gdn_server.rpc_wrap import wrap_handler

_SERVICE, _METHOD = "test.Wrap", "Stream"


async def _reader_writer(requests, context) -> None:
    """Answers each request with context.write."""
    async for message in requests:
        await context.write(message)


async def _call(handler: grpc.RpcMethodHandler, requests: list[bytes]) -> list[bytes]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {_METHOD: handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(f"/{_SERVICE}/{_METHOD}")(iter(requests), timeout=30)
            return [reply async for reply in call]
    finally:
        await server.stop(None)


def test_two_wrappings_map_each_request_outer_first_and_keep_the_serializer():
    seen: list[str] = []

    def around(name):
        @contextlib.asynccontextmanager
        async def enter(context):
            seen.append(f"enter {name}")
            yield
            seen.append(f"exit {name}")

        return enter

    handler = grpc.stream_stream_rpc_method_handler(
        _reader_writer, request_deserializer=bytes, response_serializer=lambda m: b"serialized:" + m
    )
    inner = wrap_handler(handler, around("inner"), map_request=lambda m, ctx: m + b"+inner")
    outer = wrap_handler(inner, around("outer"), map_request=lambda m, ctx: m + b"+outer")

    replies = asyncio.run(_call(outer, [b"a", b"b"]))

    # both maps ran, the outer wrapping's first; the replies went through the handler's serializer
    assert replies == [b"serialized:a+outer+inner", b"serialized:b+outer+inner"]
    assert seen == ["enter outer", "enter inner", "exit inner", "exit outer"]
