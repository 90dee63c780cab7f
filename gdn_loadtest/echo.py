"""A plain grpc.aio bytes echo: the floor our service is measured against.

No proto: generic handlers with raw bytes. Service ``gdn.bench.Echo``, methods ``Unary`` (one
message in, one out) and ``Stream`` (bidi, one reply per request). A request is a 4-byte
little-endian reply size followed by any payload; the reply is that many bytes (the payload,
truncated or zero-padded). That lets the load tool reproduce a decode step's sizes exactly
(e.g. 16.5 KiB in, 8 KiB out) with the least work a Python gRPC service can do.

    python -m gdn_loadtest.echo --host 127.0.0.1 --port 0     # prints "listening on HOST:PORT"

The floor runs on asyncio's own loop and with gRPC's own defaults, as a plain gRPC service
would. gdn-server's entry point sets GRPC_EXPERIMENTS for its processes (gdn_server/config.py),
which their children inherit: whoever starts the floor gives it `echo_env()`, which keeps a
caller's GRPC_EXPERIMENTS from reaching it.
Its allocator and collector settings are gdn-server's (gdn_server.tuning).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import AsyncIterator, Iterator

import grpc
import grpc.aio

from gdn_server.tuning import tune_process

__all__ = ["UNARY", "STREAM", "echo_request", "echo_env", "echo_server", "serve", "main"]

SERVICE = "gdn.bench.Echo"
UNARY = f"/{SERVICE}/Unary"
STREAM = f"/{SERVICE}/Stream"
_HEADER = struct.Struct("<I")
_MAX_MESSAGE = 256 << 20


def echo_request(request_bytes: int, reply_bytes: int) -> bytes:
    """A request of ``request_bytes`` bytes asking for a ``reply_bytes``-byte reply."""
    body = max(0, request_bytes - _HEADER.size)
    return _HEADER.pack(reply_bytes) + bytes(range(256)) * (body // 256) + bytes(body % 256)


def echo_env() -> dict[str, str]:
    """The environment to start an echo floor process with: this process's, with gRPC's own
    defaults (GRPC_EXPERIMENTS empty)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_EXPERIMENTS": ""}


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
    tune_process()
    p = argparse.ArgumentParser(description="gRPC bytes echo server (the floor for gdn-loadtest --echo)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    asyncio.run(serve(args.host, args.port))


# -- the floor as a subprocess of the load tool ----------------------------------------------------

_LISTENING = re.compile(r"listening on (\S+):(\d+)\r?\n")  # a whole line: the output comes in chunks


def _drain(fd: int) -> None:
    """Reads a child's output to its end, so that a child which goes on writing (warnings, logs)
    never blocks on a full pipe."""
    while os.read(fd, 1 << 16):
        pass


@contextlib.contextmanager
def echo_server(timeout: float = 30.0) -> Iterator[str]:
    """Starts this module on 127.0.0.1, port 0, as a subprocess; yields its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gdn_loadtest.echo", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=echo_env(),
    )
    try:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        output = b""
        match = None
        while match is None:
            left = deadline - time.monotonic()
            # raw reads with a deadline: a floor that hangs silently must not hang the run
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"echo server did not start within {timeout:.0f} s:\n{output.decode(errors='replace')}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"echo server exited ({proc.wait()}) before listening:\n"
                                   f"{output.decode(errors='replace')}")
            output += chunk
            match = _LISTENING.search(output.decode(errors="replace"))
        threading.Thread(target=_drain, args=(fd,), daemon=True).start()
        yield f"{match.group(1)}:{match.group(2)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
