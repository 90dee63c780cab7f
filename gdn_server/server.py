"""Server wiring: settings -> one shard (backend, session table, scheduler) per device -> servicer
-> a grpc.aio server."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.backends import make_backends
from gdn_server.config import GIL_SWITCH_INTERVAL_S, ModelShape, SchedulerConfig
from gdn_server.engine_link import EngineLink
from gdn_server.frontend import FrontendSettings
from gdn_server.frontend_pool import FrontendPool, private_socket_dir, reserve_port
from gdn_server.lifecycle import evict_idle, idle_sessions
from gdn_server.metrics import Metrics, MetricsInterceptor
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.security import (
    AuthInterceptor, ForwardedIdentity, RejectMalformed, SecurityConfig, load_tokens, server_credentials,
)
from gdn_server.servicer import GdnDecodeServicer
from gdn_server.sessions import OwnerQuota, SessionTable
from gdn_server.snapshot import load_snapshot, save_snapshot
from gdn_server.weights import GateParams

log = logging.getLogger(__name__)

GDN_SERVICE = gdn_pb2.DESCRIPTOR.services_by_name["GdnDecode"].full_name  # "gdn.v1.GdnDecode"


@dataclass(frozen=True)
class ServerSettings:
    shape: ModelShape
    gates: GateParams
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "auto"
    devices: tuple[int, ...] | None = None  # CUDA devices to serve from (None: every visible one)
    max_sessions: int | None = None  # per device; None: the backend's default
    speculative_sessions: int | None = None  # sessions with open speculative steps at once (None: default)
    scheduler: SchedulerConfig = SchedulerConfig()
    scale: float | None = None
    grace_s: float = 30.0  # how long in-flight RPCs may take to finish on shutdown
    shutdown_delay_s: float = 0.0  # on SIGTERM: health NOT_SERVING, still serving, this long before draining
    security: SecurityConfig = SecurityConfig()
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: a free port
    state_dir: str | None = None  # sessions are saved here on shutdown and restored on start
    session_idle_timeout_s: float | None = None  # evict sessions unused this long (None: never)
    frontends: int = 0  # gRPC front-end worker processes in front of this one (0: serve gRPC here)


@dataclass
class GdnApp:
    """Everything one server process runs, in the order data flows through it."""

    settings: ServerSettings
    placement: Placement  # one shard (state pool, session table, scheduler) per device
    servicer: GdnDecodeServicer
    background: list[asyncio.Task] = field(default_factory=list)  # cancelled by stop_server
    metrics: Metrics | None = None
    auth: AuthInterceptor | None = None  # tokens and/or mutual TLS identities
    credentials: grpc.ServerCredentials | None = None  # TLS, else a plaintext port
    health: HealthServicer | None = None  # set by start_server
    # with --frontends: the workers, the decode link they use and the engine's private sockets
    frontends: FrontendPool | None = None
    link: EngineLink | None = None
    socket_dir: str | None = None
    reserved_port: socket.socket | None = None


def build_app(settings: ServerSettings) -> GdnApp:
    backends = make_backends(
        settings.device, settings.devices, settings.shape, settings.gates, settings.max_sessions, settings.scale,
        speculative_sessions=settings.speculative_sessions,
    )
    shards = []
    quota = OwnerQuota(settings.security.max_sessions_per_client)  # one count over every device
    for index, backend in backends:
        backend.warmup()  # compile kernels before `listening on`, not on the first request
        sessions = SessionTable(
            backend.max_sessions, settings.shape.num_layers, range(backend.home_rows, backend.pool_rows), quota
        )
        shards.append(Shard(index, backend, sessions, Scheduler(backend, sessions, settings.scheduler)))
    placement = Placement(shards)
    servicer = GdnDecodeServicer(settings.shape, placement, shards[0].backend.name)
    app = GdnApp(settings, placement, servicer)
    sec = settings.security
    if sec.auth_token_file or sec.mutual_tls:
        tokens = load_tokens(sec.auth_token_file) if sec.auth_token_file else None
        app.auth = AuthInterceptor(tokens, sec.mutual_tls)
    app.credentials = server_credentials(sec)
    if settings.frontends:
        app.socket_dir = private_socket_dir()  # the engine's sockets, and its workers' metrics files
    if settings.metrics_port is not None:
        app.metrics = Metrics(worker_metrics_dir=_worker_metrics_dir(app) if settings.frontends else None)
        app.metrics.attach(app)
        servicer.metrics = app.metrics.rpc
    return app


def _worker_metrics_dir(app: GdnApp) -> str:
    path = f"{app.socket_dir}/metrics"
    os.makedirs(path, exist_ok=True)
    return path


def max_message_bytes(shape: ModelShape, max_batch_rows: int) -> int:
    """Largest request we accept: max(max_batch_rows, 256) rows of float32 inputs at the largest T."""
    per_token = 4 * (2 * shape.num_q_heads * shape.head_dim_k + shape.num_v_heads * (shape.head_dim_v + 2))
    rows = max(max_batch_rows, 256)
    return min(per_token * shape.max_speculative_tokens * rows + (1 << 20), 2**31 - 1)


async def start_server(app: GdnApp) -> tuple[grpc.aio.Server, int]:
    """Starts serving; returns the server and the port it bound (useful with port 0).

    With `frontends` > 0 this process is the engine: its gRPC server listens on a private Unix
    socket, and the worker processes it starts serve the public port (gdn_server.frontend)."""
    settings = app.settings
    limit = max_message_bytes(settings.shape, settings.scheduler.max_batch_rows)
    interceptors = []
    if app.metrics is not None and app.metrics.rpc is not None:  # outermost: counts auth failures
        interceptors.append(MetricsInterceptor(app.metrics.rpc))
    if settings.frontends:
        interceptors.append(ForwardedIdentity())  # the workers authenticated the caller
    elif app.auth is not None:
        interceptors.append(app.auth)
    interceptors.append(RejectMalformed())  # innermost: only authenticated calls get parsed
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    gdn_pb2_grpc.add_GdnDecodeServicer_to_server(app.servicer, server)
    app.health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(app.health, server)
    for service in ("", GDN_SERVICE):
        await app.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (GDN_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    if settings.frontends:
        app.reserved_port, port = reserve_port(settings.host, settings.port)
        if app.socket_dir is None:
            app.socket_dir = private_socket_dir()
        engine_address = f"unix:{app.socket_dir}/engine.sock"
        if server.add_insecure_port(engine_address) == 0:
            raise OSError(f"could not bind {engine_address}")
    else:
        address = f"{settings.host}:{settings.port}"
        if app.credentials is not None:
            port = server.add_secure_port(address, app.credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind {settings.host}:{settings.port}")
    if settings.state_dir:  # before the first request: clients continue where they were
        load_snapshot(settings.state_dir, app.placement.shards, settings.gates)
    for shard in app.placement:
        shard.scheduler.start()
        if settings.session_idle_timeout_s:
            app.background.append(asyncio.create_task(_evict_idle_sessions(shard, settings.session_idle_timeout_s)))
    await server.start()
    if settings.frontends:
        await _start_frontends(app, engine_address, port, limit)
    if app.metrics is not None:
        app.metrics.serve(settings.host, settings.metrics_port or 0)
    for service in ("", GDN_SERVICE):
        await app.health.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def _start_frontends(app: GdnApp, engine_address: str, port: int, limit: int) -> None:
    settings = app.settings
    app.link = EngineLink(f"{app.socket_dir}/link.sock", settings.shape, app.placement)
    app.link.start()
    sec = settings.security

    def settings_for(index: int) -> FrontendSettings:
        return FrontendSettings(
            index=index, host=settings.host, port=port, engine_address=engine_address, link_path=app.link.path,
            shape=dataclasses.asdict(settings.shape), security=dataclasses.asdict(sec), max_message_bytes=limit,
            grace_s=settings.grace_s, log_level=logging.getLevelName(logging.getLogger("gdn_server").getEffectiveLevel()),
            metrics_dir=_worker_metrics_dir(app) if app.metrics is not None else None,
        )

    app.frontends = FrontendPool(settings.frontends, settings_for)
    await app.frontends.start()


async def _evict_idle_sessions(shard: Shard, timeout_s: float) -> None:
    """Every so often, evicts idle sessions as a scheduler control item (never during a step)."""
    interval = max(0.05, min(timeout_s / 4, 5.0))
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        if not idle_sessions(shard.sessions, timeout_s):  # a cheap look first: no barrier when none is idle
            continue
        fut = loop.create_future()
        shard.scheduler.submit_control(
            lambda: evict_idle(shard.sessions, shard.backend, timeout_s),
            lambda result: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result)),
        )
        await fut


async def stop_server(app: GdnApp, server: grpc.aio.Server) -> None:
    """Graceful: refuse new work, let in-flight RPCs finish, drain the queue, release the device."""
    if app.health is not None:
        await app.health.enter_graceful_shutdown()  # NOT_SERVING from now on
    shards = app.placement.shards
    if app.frontends is not None:  # first the workers: what they have in flight still runs here
        await app.frontends.stop(app.settings.grace_s)
    for shard in shards:
        shard.scheduler.stop_accepting()
    for task in app.background:
        task.cancel()
    await server.stop(app.settings.grace_s)
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(None, shard.scheduler.stop) for shard in shards))
    try:
        if app.settings.state_dir and any(shard.scheduler.running for shard in shards):
            log.error("a scheduler did not drain in time: no snapshot written (states may be mid-step)")
        elif app.settings.state_dir:  # every step has finished: the states are final
            await loop.run_in_executor(None, save_snapshot, app.settings.state_dir, shards, app.settings.gates)
    finally:
        for shard in shards:
            shard.backend.close()
        if app.metrics is not None:
            app.metrics.close()
        _release_engine_sockets(app)


def _release_engine_sockets(app: GdnApp) -> None:
    """Closes what --frontends opened in this process: the decode link, the port, the socket dir."""
    if app.link is not None:
        app.link.close()
    if app.reserved_port is not None:
        app.reserved_port.close()
    if app.socket_dir is not None:
        shutil.rmtree(app.socket_dir, ignore_errors=True)


async def serve(app: GdnApp) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # see config.py
    try:
        server, port = await start_server(app)
    except BaseException:
        if app.frontends is not None:
            await app.frontends.stop(0)
        _release_engine_sockets(app)
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = app.settings.host
    if app.metrics is not None and app.metrics.port is not None:
        print(f"metrics on http://{host}:{app.metrics.port}/metrics", flush=True)
    if app.frontends is not None:
        log.info("%d front-end worker processes serve gRPC (pids %s)", app.frontends.count, app.frontends.pids)
    print(f"listening on {host}:{port}", flush=True)
    for shard in app.placement:
        log.info(
            "device %d (%s): backend %s, %d sessions x %d layers, pool %.1f MiB",
            shard.index, shard.backend.device_name, shard.backend.name, shard.sessions.capacity,
            app.settings.shape.num_layers, shard.backend.pool_bytes / 2**20,
        )
    await stop.wait()
    delay = app.settings.shutdown_delay_s
    if delay > 0:  # let load balancers see NOT_SERVING while requests are still served
        log.info("SIGTERM: health NOT_SERVING, draining in %.1f s (signal again to drain now)", delay)
        await app.health.enter_graceful_shutdown()
        stop.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    log.info("shutting down")
    await stop_server(app, server)
