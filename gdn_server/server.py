"""Server wiring: settings -> one shard (backend, session table, scheduler) per device -> servicer
-> a grpc.aio server with health, reflection, interceptors and the resource limits.

`serve` runs one server process until SIGTERM or SIGINT. Several processes on one host come from
gdn_server.supervisor, each of them exactly this.
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

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.backends import make_backends
from gdn_server.calls import Admission, CallGate
from gdn_server.config import GIL_SWITCH_INTERVAL_S, ModelShape, SchedulerConfig
from gdn_server.limits import SPECULATIVE_TIMEOUT_S, Limits, SharedMemoryLimits, max_message_bytes
from gdn_server.lifecycle import evict_idle, idle_sessions, release_stale_speculation, stale_speculation
from gdn_server.metrics import Metrics
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.security import SecurityConfig, load_tokens, server_credentials
from gdn_server.servicer import GdnDecodeServicer
from gdn_server.sessions import OwnerQuota, ProcessHomes, SessionTable
from gdn_server.shared_memory import DeviceAccess, SharedMemoryRegistry
from gdn_server.snapshot import load_snapshot, save_snapshot
from gdn_server.tuning import freeze_startup_objects
from gdn_server.weights import GateParams

log = logging.getLogger(__name__)

GDN_SERVICE = gdn_pb2.DESCRIPTOR.services_by_name["GdnDecode"].full_name  # "gdn.v1.GdnDecode"
# how often the server checks that every scheduler and device still works (health's truth), and
# how long queued work may wait for a round before the scheduler counts as gone: far beyond any
# launch (a CPU launch of hundreds of rows takes seconds), so only a scheduler that stopped trips it
LIVENESS_INTERVAL_S = 0.5
STALLED_SCHEDULER_S = 30.0


@dataclass(frozen=True)
class ServerSettings:
    shape: ModelShape
    gates: GateParams
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "auto"
    devices: tuple[int, ...] | None = None  # CUDA devices to serve from (None: every visible one)
    max_sessions: int | None = None  # per device; None: the backend's default
    scheduler: SchedulerConfig = SchedulerConfig()
    limits: Limits = Limits()
    scale: float | None = None
    grace_s: float = 30.0  # how long in-flight RPCs may take to finish on shutdown
    shutdown_delay_s: float = 0.0  # on SIGTERM: health NOT_SERVING, still serving, this long before draining
    security: SecurityConfig = SecurityConfig()
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: a free port
    state_dir: str | None = None  # sessions are saved here on shutdown and restored on start
    session_idle_timeout_s: float | None = None  # evict sessions unused this long (None: never)
    speculative_timeout_s: float = SPECULATIVE_TIMEOUT_S  # drop open drafts of sessions unused this long
    processes: int = 1  # server processes per device on this host (gdn_server.supervisor)
    process_index: int = 0  # this process's place among `process_ports`
    process_ports: tuple[int, ...] = ()  # every process's port, where there are several
    shared_memory: SharedMemoryLimits | None = None  # --allow-shared-memory (None: off)


@dataclass
class GdnApp:
    """Everything one server process runs, in the order data flows through it."""

    settings: ServerSettings
    placement: Placement  # one shard (state pool, session table, scheduler) per device
    servicer: GdnDecodeServicer
    background: list[asyncio.Task] = field(default_factory=list)  # cancelled by stop_server
    metrics: Metrics | None = None
    gate: CallGate | None = None  # tokens, admission, request reading, error statuses (set by build_app)
    credentials: grpc.ServerCredentials | None = None  # TLS, else a plaintext port
    health: HealthServicer | None = None  # set by start_server
    failure: str | None = None  # why the server stopped serving on its own (a dead scheduler or device)
    failed: asyncio.Event = field(default_factory=asyncio.Event)


def build_app(settings: ServerSettings) -> GdnApp:
    """The server's parts, with every device's kernels compiled."""
    backends = make_backends(
        settings.device, settings.devices, settings.shape, settings.gates, settings.max_sessions, settings.scale,
        memory_share=1 / settings.processes,
    )
    homes = ProcessHomes(settings.process_index, settings.process_ports) if settings.process_ports else None
    shards = []
    quota = OwnerQuota(settings.security.max_sessions_per_client)  # one count over every device
    for index, backend in backends:
        backend.warmup()  # compile kernels before `listening on`, not on the first request
        sessions = SessionTable(backend.max_sessions, settings.shape.num_layers, quota, homes=homes)
        shards.append(Shard(index, backend, sessions, Scheduler(backend, sessions, settings.scheduler)))
    placement = Placement(shards)
    servicer = GdnDecodeServicer(settings.shape, placement, shards[0].backend.name, homes)
    if settings.shared_memory is not None:
        on_gpu = shards[0].backend.name.startswith("cuda")
        if on_gpu:
            from gdn_server.kernels import compile_segment_kernels

            compile_segment_kernels()  # the check and copy of referenced tensors
        access = DeviceAccess([shard.backend.device for shard in shards]) if on_gpu else None
        servicer.shared_memory = SharedMemoryRegistry(settings.shared_memory, access)
    app = GdnApp(settings, placement, servicer)
    sec = settings.security
    tokens = load_tokens(sec.auth_token_file) if sec.auth_token_file else None
    limits = settings.limits
    app.gate = CallGate(Admission(limits.max_calls, limits.max_calls_per_client), limits.message_timeout_s,
                        tokens, sec.mutual_tls)
    app.credentials = server_credentials(sec)
    if settings.metrics_port is not None:
        app.metrics = Metrics()
        app.metrics.attach(placement)
        servicer.metrics = app.metrics
        app.gate.observe_rpc = app.metrics.observe_rpc
    return app


def grpc_server(app: GdnApp) -> grpc.aio.Server:
    """A grpc.aio server with the GdnDecode servicer, health and reflection, bounded by
    `settings.limits`; no port yet."""
    settings = app.settings
    limits = settings.limits
    size = max_message_bytes(settings.shape, settings.scheduler.max_batch_rows)
    server = grpc.aio.server(
        # calls are admitted by the gate (gdn_server.calls), after their token is checked: grpc's own
        # maximum_concurrent_rpcs would count tokenless calls too, and lock everyone out
        interceptors=[app.gate],
        options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            ("grpc.max_concurrent_streams", limits.max_streams_per_connection),
            # calls that arrived but wait for the event loop to take them: grpc refuses streams
            # (REFUSED_STREAM) beyond its default of 3000, below what the gate admits in a burst
            ("grpc.server.max_pending_requests", limits.max_calls),
            ("grpc.server.max_pending_requests_hard_limit", limits.max_calls),
            ("grpc.max_allowed_incoming_connections", limits.max_connections),
            ("grpc.max_connection_idle_ms", int(limits.idle_connection_timeout_s * 1000)),
            # one port, one process: a second server on the same port is an error, not a share
            ("grpc.so_reuseport", 0),
        ],
    )
    app.servicer.add_to_server(server)
    app.health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(app.health, server)
    reflection.enable_server_reflection(
        (GDN_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return server


async def set_serving(health: HealthServicer, serving: bool) -> None:
    """Both the whole server ("") and gdn.v1.GdnDecode."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", GDN_SERVICE):
        await health.set(service, status)


async def start_server(app: GdnApp) -> tuple[grpc.aio.Server, int]:
    """Starts serving on the public port; returns the server and the port it bound (useful with port 0)."""
    settings = app.settings
    server = grpc_server(app)
    await set_serving(app.health, False)
    address = f"{settings.host}:{settings.port}"
    if app.credentials is not None:
        port = server.add_secure_port(address, app.credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {settings.host}:{settings.port}")
    if settings.state_dir:  # clients continue where they were: restored before the first request
        load_snapshot(settings.state_dir, app.placement.shards, settings.gates)
    loop = asyncio.get_running_loop()
    for shard in app.placement:
        shard.scheduler.start(loop)
    app.background.append(asyncio.create_task(_housekeeping(app)))
    app.background.append(asyncio.create_task(_watch_liveness(app)))
    if app.servicer.shared_memory is not None:
        app.background.append(asyncio.create_task(_unmap_idle_regions(app.servicer.shared_memory)))
    await server.start()
    if app.metrics is not None:
        app.metrics.serve(settings.host, settings.metrics_port or 0)
    await set_serving(app.health, True)
    return server, port


async def _housekeeping(app: GdnApp) -> None:
    """Every so often: evicts idle sessions (--session-idle-timeout-s) and drops the drafts of
    sessions that left them open (--speculative-timeout-s), each as a scheduler control item."""
    settings = app.settings
    timeouts = [t for t in (settings.session_idle_timeout_s, settings.speculative_timeout_s) if t]
    interval = max(0.05, min(min(timeouts) / 4, 5.0))
    while True:
        await asyncio.sleep(interval)
        for shard in app.placement:
            idle = settings.session_idle_timeout_s
            if idle and idle_sessions(shard.sessions, idle):  # a cheap look first: no barrier when none is
                await shard.scheduler.control(lambda shard=shard: evict_idle(shard.sessions, shard.backend, idle))
            stale = settings.speculative_timeout_s
            if stale_speculation(shard.sessions, stale):
                await shard.scheduler.control(lambda shard=shard: release_stale_speculation(shard.sessions, stale))


async def _unmap_idle_regions(regions: SharedMemoryRegistry) -> None:
    """Unmaps the shared-memory regions no request has used for --shared-memory-idle-s."""
    interval = min(regions.limits.idle_s / 4, 5.0)
    while True:
        await asyncio.sleep(interval)
        regions.sweep()


def _liveness_problem(app: GdnApp) -> str | None:
    for shard in app.placement:
        stalled = shard.scheduler.stalled_s()
        if stalled > STALLED_SCHEDULER_S:
            return f"the scheduler of device {shard.index} has run no round for {stalled:.0f} s with work queued"
        if shard.scheduler.device_error is not None:
            return f"device {shard.index} is unusable: {shard.scheduler.device_error}"
    return None


async def _watch_liveness(app: GdnApp) -> None:
    """Health tells the truth: once a scheduler or a device is gone, the server reports
    NOT_SERVING and stops (exit status 1), so a supervisor or an orchestrator restarts it."""
    while True:
        await asyncio.sleep(LIVENESS_INTERVAL_S)
        problem = _liveness_problem(app)
        if problem is not None:
            log.error("%s: health is NOT_SERVING and the server stops", problem)
            app.failure = problem
            await set_serving(app.health, False)
            app.failed.set()
            return


async def stop_server(app: GdnApp, server: grpc.aio.Server) -> bool:
    """Graceful: refuse new work, let in-flight RPCs finish, drain the queue, save the sessions
    (--state-dir), release the device. Returns whether every session was saved."""
    if app.health is not None:
        await app.health.enter_graceful_shutdown()  # NOT_SERVING from now on
    try:
        for shard in app.placement:
            shard.scheduler.stop_accepting()
        for task in app.background:
            task.cancel()
        await server.stop(app.settings.grace_s)
        loop = asyncio.get_running_loop()
        shards = app.placement.shards
        grace = app.settings.grace_s
        await asyncio.gather(*(loop.run_in_executor(None, shard.scheduler.stop, grace) for shard in shards))
        if not app.settings.state_dir:
            return True
        if any(shard.scheduler.running for shard in shards):
            log.error("a scheduler did not drain in time: no snapshot written (states may be mid-step)")
            return False
        return await loop.run_in_executor(None, save_snapshot, app.settings.state_dir, shards, app.settings.gates)
    finally:
        if app.servicer.shared_memory is not None:
            app.servicer.shared_memory.close()
        for shard in app.placement.shards:
            shard.backend.close()
        if app.metrics is not None:
            app.metrics.close()


async def serve(app: GdnApp) -> int:
    """Runs until SIGTERM or SIGINT (or a failure of its own), then stops gracefully. Returns the
    process's exit status: 0 after a clean stop, 1 when sessions were lost or the server failed."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # see config.py
    server, port = await start_server(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = app.settings.host
    if app.metrics is not None and app.metrics.port is not None:
        print(f"metrics on http://{host}:{app.metrics.port}/metrics", flush=True)
    freeze_startup_objects()  # see gdn_server/tuning.py
    print(f"listening on {host}:{port}", flush=True)
    for shard in app.placement:
        log.info(
            "device %d (%s): backend %s, %d sessions x %d layers, pool %.1f MiB",
            shard.index, shard.backend.device_name, shard.backend.name, shard.sessions.capacity,
            app.settings.shape.num_layers, shard.backend.pool_bytes / 2**20,
        )
    failed = asyncio.ensure_future(app.failed.wait())
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait((failed, signalled), return_when=asyncio.FIRST_COMPLETED)
    delay = app.settings.shutdown_delay_s
    if delay > 0 and app.failure is None:  # let load balancers see NOT_SERVING while requests are still served
        log.info("SIGTERM: health NOT_SERVING, draining in %.1f s (signal again to drain now)", delay)
        await app.health.enter_graceful_shutdown()
        stop.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    failed.cancel()
    signalled.cancel()
    log.info("shutting down")
    saved = await stop_server(app, server)
    return 0 if saved and app.failure is None else 1
