"""Server wiring: settings -> one shard (backend, session table, scheduler) per device -> servicer
-> a grpc.aio server.

This is the whole server without --frontends. With --frontends N the same pieces make each
device's engine process (gdn_server.engine), and gdn_server.router wires the processes together.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.backends import make_backends
from gdn_server.busy_poll import LoopSpinner
from gdn_server.config import GIL_SWITCH_INTERVAL_S, ModelShape, SchedulerConfig
from gdn_server.event_loop import running_loop_name
from gdn_server.protowire import decode_request_parsers
from gdn_server.lifecycle import evict_idle, idle_sessions
from gdn_server.metrics import EngineMetrics, Metrics, MetricsInterceptor
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.security import AuthInterceptor, RejectMalformed, SecurityConfig, load_tokens, server_credentials
from gdn_server.decode_rpcs import encode_decode_reply
from gdn_server.servicer import GdnDecodeServicer
from gdn_server.sessions import OwnerQuota, SessionTable
from gdn_server.snapshot import device_snapshot_dirs, load_snapshots, save_snapshot
from gdn_server.tuning import freeze_startup_objects
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
    frontends: int = 0  # gRPC worker processes in front of one engine process per device (gdn_server.router)
    event_loop: str = "auto"  # every process's asyncio loop (gdn_server.event_loop)
    # how --frontends workers serve gRPC: "grpc" (grpc.aio) or "native" (gdn_server.frontend_native)
    frontend_transport: str = "grpc"


@dataclass
class GdnApp:
    """Everything one server process runs, in the order data flows through it."""

    settings: ServerSettings
    placement: Placement  # one shard (state pool, session table, scheduler) per device
    servicer: GdnDecodeServicer
    background: list[asyncio.Task] = field(default_factory=list)  # cancelled by stop_server
    metrics: Metrics | None = None  # the /metrics endpoint of a one-process server
    engine_metrics: EngineMetrics | None = None  # launch/queue/session families (also in an engine process)
    auth: AuthInterceptor | None = None  # tokens and/or mutual TLS identities
    credentials: grpc.ServerCredentials | None = None  # TLS, else a plaintext port
    health: HealthServicer | None = None  # set by start_server


def build_app(settings: ServerSettings, replies_here: bool = True) -> GdnApp:
    """The server's parts. `replies_here`: this process's servicer answers decode steps (an
    engine's go back over its link instead), so its schedulers encode the replies."""
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
        scheduler = Scheduler(backend, sessions, settings.scheduler)
        if replies_here:
            scheduler.encode_reply = encode_decode_reply
        else:  # an engine: decode steps come over the link, and its loop may wait for the device
            scheduler.loop_serves_rpcs = False
        shards.append(Shard(index, backend, sessions, scheduler))
    placement = Placement(shards)
    servicer = GdnDecodeServicer(settings.shape, placement, shards[0].backend.name)
    app = GdnApp(settings, placement, servicer)
    sec = settings.security
    if sec.auth_token_file or sec.mutual_tls:
        tokens = load_tokens(sec.auth_token_file) if sec.auth_token_file else None
        app.auth = AuthInterceptor(tokens, sec.mutual_tls)
    app.credentials = server_credentials(sec)
    if settings.metrics_port is not None:
        app.metrics = Metrics()
        app.engine_metrics = app.metrics.engine
        app.engine_metrics.attach(placement)
        servicer.metrics = app.metrics.rpc
    return app


def max_message_bytes(shape: ModelShape, max_batch_rows: int) -> int:
    """Largest request we accept: max(max_batch_rows, 256) rows of float32 inputs at the largest T."""
    per_token = 4 * (2 * shape.num_q_heads * shape.head_dim_k + shape.num_v_heads * (shape.head_dim_v + 2))
    rows = max(max_batch_rows, 256)
    return min(per_token * shape.max_speculative_tokens * rows + (1 << 20), 2**31 - 1)


def grpc_server(app: GdnApp, interceptors: list, extra_options: tuple = ()) -> grpc.aio.Server:
    """A grpc.aio server with the GdnDecode servicer, health (its status is the caller's to set,
    `set_serving`) and reflection; no port yet."""
    limit = max_message_bytes(app.settings.shape, app.settings.scheduler.max_batch_rows)
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit), *extra_options],
    )
    gdn_pb2_grpc.add_GdnDecodeServicer_to_server(app.servicer, server)
    app.health = add_health_and_reflection(server)
    return server


def add_health_and_reflection(server: grpc.aio.Server) -> HealthServicer:
    """grpc.health.v1 and reflection for GdnDecode and Health. Set the health status with
    `set_serving` before the server starts (grpc's servicer answers SERVING for "" until told)."""
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (GDN_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return health


async def set_serving(health: HealthServicer, serving: bool) -> None:
    """Both the whole server ("") and gdn.v1.GdnDecode."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", GDN_SERVICE):
        await health.set(service, status)


def start_shards(app: GdnApp, snapshot_dirs: list[str]) -> None:
    """Restores the snapshots in `snapshot_dirs` (before the first request: clients continue
    where they were), then starts each device's scheduler and idle eviction."""
    settings = app.settings
    if snapshot_dirs:
        load_snapshots(snapshot_dirs, app.placement.shards, settings.gates)
    loop = asyncio.get_running_loop()
    for shard in app.placement:
        start_scheduler(shard, loop)
        if settings.session_idle_timeout_s:
            app.background.append(asyncio.create_task(_evict_idle_sessions(shard, settings.session_idle_timeout_s)))


def start_scheduler(shard: Shard, loop: asyncio.AbstractEventLoop) -> None:
    """On the event loop, or on a thread of its own (SchedulerConfig.runs_on; see scheduler.py)."""
    runs_on = shard.scheduler.config.runs_on
    if runs_on == "auto":
        runs_on = "loop" if shard.backend.asynchronous else "thread"
    if runs_on == "loop":
        shard.scheduler.start_on(loop)
        busy_poll_us = shard.scheduler.config.busy_poll_us
        if busy_poll_us:
            shard.scheduler.after_answers.append(LoopSpinner.of(loop, busy_poll_us / 1e6).touch)
    else:
        shard.scheduler.start()
    if runs_on == "loop":
        log.debug("device %d: scheduler runs on the event loop (%s)", shard.index,
                  "answers in the launching round" if shard.scheduler.answers_inline() else "pipelined")
    else:
        log.debug("device %d: scheduler runs on a thread", shard.index)


async def start_server(app: GdnApp) -> tuple[grpc.aio.Server, int]:
    """Starts serving on the public port; returns the server and the port it bound (useful with port 0)."""
    settings = app.settings
    interceptors = []
    if app.metrics is not None and app.metrics.rpc is not None:  # outermost: counts auth failures
        interceptors.append(MetricsInterceptor(app.metrics.rpc))
    if app.auth is not None:
        interceptors.append(app.auth)
    # innermost: only authenticated calls get parsed (decode steps by our parser: big tensors uncopied)
    interceptors.append(RejectMalformed(decode_request_parsers()))
    server = grpc_server(app, interceptors, (("grpc.so_reuseport", 0),))
    await set_serving(app.health, False)
    address = f"{settings.host}:{settings.port}"
    if app.credentials is not None:
        port = server.add_secure_port(address, app.credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {settings.host}:{settings.port}")
    if settings.state_dir:  # its own snapshot, and those a server with --frontends left per device
        start_shards(app, [settings.state_dir, *map(str, device_snapshot_dirs(settings.state_dir).values())])
    else:
        start_shards(app, [])
    await server.start()
    if app.metrics is not None:
        app.metrics.serve(settings.host, settings.metrics_port or 0)
    await set_serving(app.health, True)
    return server, port


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
    try:
        await drain_shards(app, server)
        if app.settings.state_dir:
            await save_shards(app, app.settings.state_dir)
    finally:
        close_shards(app)


async def drain_shards(app: GdnApp, server: grpc.aio.Server) -> None:
    """Refuses new work, lets in-flight RPCs finish (grace), then runs every queued step."""
    shards = app.placement.shards
    for shard in shards:
        shard.scheduler.stop_accepting()
    for task in app.background:
        task.cancel()
    await server.stop(app.settings.grace_s)
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(None, shard.scheduler.stop) for shard in shards))


async def save_shards(app: GdnApp, state_dir: str) -> None:
    """Writes every session to `state_dir`, once every step has finished (the states are final)."""
    shards = app.placement.shards
    if any(shard.scheduler.running for shard in shards):
        log.error("a scheduler did not drain in time: no snapshot written (states may be mid-step)")
        return
    await asyncio.get_running_loop().run_in_executor(None, save_snapshot, state_dir, shards, app.settings.gates)


def close_shards(app: GdnApp) -> None:
    for shard in app.placement.shards:
        shard.backend.close()
    if app.metrics is not None:
        app.metrics.close()


async def serve(app: GdnApp) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # see config.py
    server, port = await start_server(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = app.settings.host
    if app.metrics is not None and app.metrics.cpu is not None:
        app.background.append(asyncio.create_task(app.metrics.cpu.count_forever()))
    if app.metrics is not None and app.metrics.port is not None:
        print(f"metrics on http://{host}:{app.metrics.port}/metrics", flush=True)
    freeze_startup_objects()  # see gdn_server/tuning.py
    print(f"listening on {host}:{port}", flush=True)
    log.info("event loop: %s", running_loop_name())
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
