"""Server wiring: settings -> backend, session table, scheduler, servicer -> a grpc.aio server."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc

from gdn_client.proto.gdn.v1 import gdn_pb2_grpc
from gdn_server.backends import Backend, make_backend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.scheduler import Scheduler
from gdn_server.servicer import GdnDecodeServicer
from gdn_server.sessions import SessionTable
from gdn_server.weights import GateParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    shape: ModelShape
    gates: GateParams
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "auto"
    max_sessions: int | None = None  # None: the backend's default
    scheduler: SchedulerConfig = SchedulerConfig()
    scale: float | None = None
    grace_s: float = 30.0  # how long in-flight RPCs may take to finish on shutdown


@dataclass
class GdnApp:
    """Everything one server process runs, in the order data flows through it."""

    settings: ServerSettings
    backend: Backend
    sessions: SessionTable
    scheduler: Scheduler
    servicer: GdnDecodeServicer


def build_app(settings: ServerSettings) -> GdnApp:
    backend = make_backend(settings.device, settings.shape, settings.gates, settings.max_sessions, settings.scale)
    sessions = SessionTable(backend.max_sessions, settings.shape.num_layers)
    scheduler = Scheduler(backend, sessions, settings.scheduler)
    servicer = GdnDecodeServicer(settings.shape, sessions, scheduler, backend.name)
    return GdnApp(settings, backend, sessions, scheduler, servicer)


def max_message_bytes(shape: ModelShape, max_batch_rows: int) -> int:
    """Largest request we accept: max(max_batch_rows, 256) rows of float32 inputs at the largest T."""
    per_token = 4 * (2 * shape.num_q_heads * shape.head_dim_k + shape.num_v_heads * (shape.head_dim_v + 2))
    rows = max(max_batch_rows, 256)
    return min(per_token * shape.max_tokens_per_step * rows + (1 << 20), 2**31 - 1)


async def start_server(app: GdnApp) -> tuple[grpc.aio.Server, int]:
    """Starts serving; returns the server and the port it bound (useful with port 0)."""
    limit = max_message_bytes(app.settings.shape, app.settings.scheduler.max_batch_rows)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    gdn_pb2_grpc.add_GdnDecodeServicer_to_server(app.servicer, server)
    port = server.add_insecure_port(f"{app.settings.host}:{app.settings.port}")
    if port == 0:
        raise OSError(f"could not bind {app.settings.host}:{app.settings.port}")
    app.scheduler.start()
    await server.start()
    return server, port


async def stop_server(app: GdnApp, server: grpc.aio.Server) -> None:
    """Graceful: refuse new work, let in-flight RPCs finish, drain the queue, release the device."""
    app.scheduler.stop_accepting()
    await server.stop(app.settings.grace_s)
    await asyncio.get_running_loop().run_in_executor(None, app.scheduler.stop)
    app.backend.close()


async def serve(app: GdnApp) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    server, port = await start_server(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = app.settings.host
    print(f"listening on {host}:{port}", flush=True)
    log.info(
        "backend %s, %d sessions x %d layers, pool %.1f MiB",
        app.backend.name, app.sessions.capacity, app.settings.shape.num_layers, app.backend.pool_bytes / 2**20,
    )
    await stop.wait()
    log.info("shutting down")
    await stop_server(app, server)
