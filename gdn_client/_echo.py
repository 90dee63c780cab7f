"""A plain grpc.aio bytes echo: the floor our service is measured against.

No proto: generic handlers with raw bytes. Service ``gdn.bench.Echo``, methods ``Unary`` (one
message in, one out) and ``Stream`` (bidi, one reply per request). A request is a 4-byte
little-endian reply size followed by any payload; the reply is that many bytes (the payload,
truncated or zero-padded). That lets the load tool reproduce a decode step's sizes exactly
(e.g. 16.5 KiB in, 8 KiB out) with the least work a Python gRPC service can do.

    python -m gdn_client._echo --host 127.0.0.1 --port 0     # prints "listening on HOST:PORT"

`bench/echo_server.py` runs the same thing from a checkout.

The floor runs on asyncio's own loop, as a plain gRPC service would. `--uvloop` (or
GDN_ECHO_UVLOOP=1 in the environment, which reaches the echo that gdn-loadtest --echo starts)
runs it on uvloop instead: the floor a service on uvloop would have, to tell how much of
gdn-server's gain from uvloop (`--event-loop`) any service would get.

Likewise its gRPC runs with gRPC's own defaults, although gdn-server sets GRPC_EXPERIMENTS for
its processes (gdn_server/__init__.py: the older I/O path for accepted connections). Whoever
starts the floor gives it `echo_env()`, which keeps the caller's GRPC_EXPERIMENTS (one set by
importing gdn_server, say) from reaching it; GDN_ECHO_GRPC_EXPERIMENTS=-event_engine_listener
gives the floor gdn-server's transport instead.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import struct
from typing import AsyncIterator

import grpc
import grpc.aio

from gdn_client._gc import tune_gc
from gdn_client._malloc import tune_malloc

__all__ = ["UNARY", "STREAM", "echo_request", "echo_env", "serve", "main"]

SERVICE = "gdn.bench.Echo"
UNARY = f"/{SERVICE}/Unary"
STREAM = f"/{SERVICE}/Stream"
_HEADER = struct.Struct("<I")
_MAX_MESSAGE = 256 << 20

logger = logging.getLogger("gdn_client.echo")


def echo_request(request_bytes: int, reply_bytes: int) -> bytes:
    """A request of ``request_bytes`` bytes asking for a ``reply_bytes``-byte reply."""
    body = max(0, request_bytes - _HEADER.size)
    return _HEADER.pack(reply_bytes) + bytes(range(256)) * (body // 256) + bytes(body % 256)


def echo_env() -> dict[str, str]:
    """The environment to start an echo floor process with: this process's, with gRPC's own
    defaults (GRPC_EXPERIMENTS empty) unless GDN_ECHO_GRPC_EXPERIMENTS names the floor's."""
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "GRPC_EXPERIMENTS": os.environ.get("GDN_ECHO_GRPC_EXPERIMENTS", "")}


def _reply(request: bytes) -> bytes:
    (size,) = _HEADER.unpack_from(request)
    payload = request[_HEADER.size:_HEADER.size + size]
    return payload if len(payload) == size else payload + bytes(size - len(payload))


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return _reply(request)


async def _stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield _reply(request)


async def serve(host: str = "127.0.0.1", port: int = 0) -> None:
    """Runs the echo server until SIGTERM/SIGINT; prints ``listening on HOST:PORT`` once ready."""
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
    )
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "Stream": grpc.stream_stream_rpc_method_handler(_stream),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on {host}:{bound}", flush=True)  # the contract with whoever started us
    await stop.wait()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    tune_malloc(logger)  # the server's allocator settings (gdn_server.tuning): a like-for-like floor
    tune_gc(logger)  # and its garbage collector's
    p = argparse.ArgumentParser(description="gRPC bytes echo server (the floor for gdn-loadtest --echo)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--uvloop", action="store_true", default=os.environ.get("GDN_ECHO_UVLOOP") == "1",
                   help="run on uvloop instead of asyncio's loop (also GDN_ECHO_UVLOOP=1)")
    args = p.parse_args(argv)
    if args.uvloop:
        import uvloop  # only for this reference point: not a dependency of the client library

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
