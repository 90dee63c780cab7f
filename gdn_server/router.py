"""`gdn-server --frontends N`: worker processes in front of one engine process per device.

    clients --gRPC--> N front-end workers (public port, SO_REUSEPORT)
                        | decode steps: frames on the decode link of the session's engine
                        | every other RPC: gRPC to the router, on a private Unix socket
                        v
                      router (this process: no device) --gRPC--> engine of the session's device
                      engine 0 (device 0), engine 1 (device 1), ...: pools, sessions, schedulers

Each engine (gdn_server.engine) is a one-process server's core for one device, so two GPUs get
two GILs. The router is the one place that sees the whole server: it places new sessions on the
engine with the most free slots (or next to `colocate_with`), keeps the directory of which
engine holds which session, enforces --max-sessions-per-client over all of them, sums
GetModelInfo and GetStats, serves health and reflection, /metrics (the sums of the workers' and
engines' files) and the workers' `Locate` look-ups. It also starts, watches and stops the other
processes: workers are restarted when they die; an engine that dies takes its device's sessions
with it, so the server stops (the others drain and save) and exits non-zero for the supervisor
to restart it.

A session stays on its engine for life (its state is there); an id never moves between engines
(imports and forks get new ids), so a worker may cache where a session lives.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1._async import HealthServicer
from prometheus_client.multiprocess import mark_process_dead
from safetensors.torch import save_file

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.backends import resolve_device
from gdn_server.config import GIL_SWITCH_INTERVAL_S
from gdn_server.engine import LIST_SESSIONS, EngineSettings
from gdn_server.event_loop import running_loop_name
from gdn_server.frontend import (
    FrontendSettings, forwarded_reply, forwarded_stream, forwarding_options, pump_requests,
)
from gdn_server.frontend_pool import FrontendPool, private_socket_dir, reserve_port, spawn_ready
from gdn_server.metrics import Metrics
from gdn_server.security import ForwardedIdentity, RejectMalformed, current_identity
from gdn_server.server import ServerSettings, add_health_and_reflection, max_message_bytes, set_serving
from gdn_server.snapshot import device_snapshot_dir, device_snapshot_dirs
from gdn_server.tuning import freeze_startup_objects

log = logging.getLogger("gdn_server.router")

ROUTER_SERVICE = "gdn.internal.Router"
LOCATE = f"/{ROUTER_SERVICE}/Locate"  # JSON [session id, ...] -> JSON [engine position or null, ...]
ENGINE_STOP_EXTRA_S = 120.0  # on top of the grace period: the engine's snapshot write
DIRECTORY_REFRESH_S = 30.0  # with --session-idle-timeout-s: how often evictions are picked up
LIMIT_REFRESH_MIN_S = 1.0  # a client at its limit rebuilds the directory at most this often
MAX_GONE_IDS = 65536  # evicted ids still routed to their engine (for its NOT_FOUND reason), oldest forgotten


@dataclass
class Engine:
    """One engine process as the router sees it."""

    position: int  # index into the router's engine list (what Locate answers)
    device_index: int
    grpc_path: str
    link_path: str
    proc: asyncio.subprocess.Process | None = None
    channel: grpc.aio.Channel | None = None
    stub: gdn_pb2_grpc.GdnDecodeStub | None = None


def device_indices(settings: ServerSettings) -> tuple[str, tuple[int, ...]]:
    """(backend kind, the devices to start an engine for); ValueError when they do not exist."""
    device = resolve_device(settings.device)
    if device == "cpu":
        indices = settings.devices or (0,)
    else:
        count = torch.cuda.device_count()
        indices = settings.devices if settings.devices is not None else tuple(range(count))
        if not indices or any(not 0 <= i < count for i in indices):
            raise ValueError(f"--devices {list(indices)}: this host has CUDA devices 0..{count - 1}")
    if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
        raise ValueError(f"--devices {list(indices)}: each device once, numbers >= 0")
    return device, tuple(indices)


def _save_gates(settings: ServerSettings, path: str) -> None:
    """The gate parameters, for the engines to load (bit-exact float32, the --weights format)."""
    g = settings.gates
    tensors = {}
    for layer in range(g.num_layers):
        tensors[f"layers.{layer}.A_log"] = g.A_log[layer].contiguous()
        tensors[f"layers.{layer}.dt_bias"] = g.dt_bias[layer].contiguous()
    save_file(tensors, path)


class Directory:
    """Which engine holds which session, and who owns it (for the per-client limit).

    Engines evict idle sessions without telling the router, so the directory is rebuilt from
    their lists now and then (`RouterServicer.refresh_directory`); sessions added or dropped
    while a rebuild waits for those lists are carried over, so a rebuild never loses a session
    created meanwhile nor revives one closed meanwhile."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[int, str | None]] = {}
        # sessions a rebuild found gone (evicted): still routed to their engine, which says why
        self._gone: OrderedDict[str, int] = OrderedDict()
        self._rebuilds = 0  # rebuilds waiting for their lists
        self._added: dict[str, tuple[int, str | None]] = {}  # since the oldest waiting rebuild began
        self._dropped: set[str] = set()

    def add(self, session_id: str, position: int, owner: str | None) -> None:
        self._where[session_id] = (position, owner)
        if self._rebuilds:
            self._added[session_id] = (position, owner)
            self._dropped.discard(session_id)

    def drop(self, session_id: str) -> None:
        self._where.pop(session_id, None)
        if self._rebuilds:
            self._added.pop(session_id, None)
            self._dropped.add(session_id)

    def position_of(self, session_id: str) -> int | None:
        """The engine that holds the session, or held it until it was evicted; None if unknown."""
        found = self._where.get(session_id)
        return self._gone.get(session_id) if found is None else found[0]

    def owned_by(self, owner: str | None) -> int:
        return sum(1 for _, who in self._where.values() if who == owner)

    def __len__(self) -> int:
        return len(self._where)

    def begin_rebuild(self) -> None:
        self._rebuilds += 1

    def finish_rebuild(self, listed: dict[str, tuple[int, str | None]]) -> None:
        """`listed`: what the engines hold, as listed after the matching `begin_rebuild`."""
        entries = {sid: where for sid, where in listed.items() if sid not in self._dropped}
        entries.update(self._added)
        for sid, (position, _) in self._where.items():
            if sid not in entries:
                self._gone[sid] = position
        while len(self._gone) > MAX_GONE_IDS:
            self._gone.popitem(last=False)
        self._where = entries
        self._rebuilds -= 1
        if not self._rebuilds:
            self._added, self._dropped = {}, set()

    def abandon_rebuild(self) -> None:
        self._rebuilds -= 1
        if not self._rebuilds:
            self._added, self._dropped = {}, set()


class RouterServicer(gdn_pb2_grpc.GdnDecodeServicer):
    """GdnDecode for the workers: every RPC but decode steps, passed to the right engine."""

    def __init__(self, engines: list[Engine], max_sessions_per_client: int | None) -> None:
        self.engines = engines
        self.directory = Directory()
        self.limit = max_sessions_per_client
        self._quota_lock = asyncio.Lock()  # a client's check and create happen as one
        self._refreshed = 0.0  # monotonic time of the last directory rebuild

    # -- helpers ----------------------------------------------------------------------------
    async def refresh_directory(self) -> None:
        """Rebuilds the directory from the engines: at start (after their restores), when a client
        hits its limit, and every DIRECTORY_REFRESH_S with idle eviction on (evicted sessions
        would otherwise stay listed, counting against their owner's limit)."""
        self.directory.begin_rebuild()
        try:
            lists = await asyncio.gather(*(e.channel.unary_unary(LIST_SESSIONS)(b"") for e in self.engines))
        except BaseException:
            self.directory.abandon_rebuild()
            raise
        entries = {}
        for engine, raw in zip(self.engines, lists):
            for sid, owner in json.loads(raw):
                entries[sid] = (engine.position, owner)
        self.directory.finish_rebuild(entries)
        self._refreshed = time.monotonic()

    async def _engine_of(self, session_id: str, context) -> Engine:
        position = self.directory.position_of(session_id)
        if position is None:  # the engines' own wording for an id nobody holds
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown or closed session {session_id!r}")
        return self.engines[position]

    async def _call(self, method, request, context):
        return await forwarded_reply(method(request, **forwarding_options(context)), None, context)

    async def _most_free(self, context) -> Engine:
        infos = await asyncio.gather(*(self._call(e.stub.GetModelInfo, gdn_pb2.GetModelInfoRequest(), context)
                                       for e in self.engines))
        free = [info.max_sessions - info.sessions_in_use for info in infos]
        return self.engines[max(range(len(free)), key=lambda i: (free[i], -i))]

    @contextlib.asynccontextmanager
    async def _new_session_for(self, owner: str | None, context):
        """Held around anything that gives `owner` a session: --max-sessions-per-client."""
        if self.limit is None:
            yield
            return
        async with self._quota_lock:
            stale = time.monotonic() - self._refreshed > LIMIT_REFRESH_MIN_S  # a client at its limit
            if self.directory.owned_by(owner) >= self.limit and stale:  # may retry in a loop: not each time
                await self.refresh_directory()  # some may have been evicted meanwhile
            held = self.directory.owned_by(owner)
            if held >= self.limit:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this client already holds {held} sessions, the most one client may hold",
                )
            yield

    # -- RPCs -------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        infos = await asyncio.gather(*(self._call(e.stub.GetModelInfo, request, context) for e in self.engines))
        merged = gdn_pb2.ModelInfo()
        merged.CopyFrom(infos[0])
        merged.max_sessions = sum(i.max_sessions for i in infos)
        merged.sessions_in_use = sum(i.sessions_in_use for i in infos)
        del merged.devices[:]
        merged.devices.extend(sorted((d for i in infos for d in i.devices), key=lambda d: d.index))
        return merged

    async def GetStats(self, request, context):
        every = await asyncio.gather(*(self._call(e.stub.GetStats, request, context) for e in self.engines))
        total = gdn_pb2.Stats(backend=every[0].backend)
        for field in ("launches", "rows_launched", "requests", "batches", "sessions_in_use", "max_sessions",
                      "device_seconds", "queue_wait_seconds"):
            setattr(total, field, sum(getattr(st, field) for st in every))
        total.mean_rows_per_launch = total.rows_launched / total.launches if total.launches else 0.0
        return total

    async def CreateSession(self, request, context):
        owner = current_identity()
        async with self._new_session_for(owner, context):
            if request.colocate_with:
                engine = await self._engine_of(request.colocate_with, context)
            else:
                engine = await self._most_free(context)
            reply = await self._call(engine.stub.CreateSession, request, context)
            self.directory.add(reply.session_id, engine.position, owner)
        return reply

    async def ForkSession(self, request, context):
        owner = current_identity()
        engine = await self._engine_of(request.session_id, context)
        async with self._new_session_for(owner, context):
            reply = await self._call(engine.stub.ForkSession, request, context)
            self.directory.add(reply.session_id, engine.position, owner)
        return reply

    async def CloseSession(self, request, context):
        engine = await self._engine_of(request.session_id, context)
        try:
            reply = await engine.stub.CloseSession(request, **forwarding_options(context))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self.directory.drop(request.session_id)
            await context.abort(e.code(), e.details())
        self.directory.drop(request.session_id)
        return reply

    async def Commit(self, request, context):
        engine = await self._engine_of(request.session_id, context)
        return await self._call(engine.stub.Commit, request, context)

    async def Decode(self, request, context):
        # the workers send decode steps over the link; this serves a caller of the private socket
        if not request.session_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_ids is empty")
        engine = await self._engine_of(request.session_ids[0], context)
        return await self._call(engine.stub.Decode, request, context)

    async def DecodeStream(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "decode streams are served by the front-end workers")
        yield  # pragma: no cover (an async generator, as the method is server-streaming)

    async def ExportState(self, request, context):
        engine = await self._engine_of(request.session_id, context)
        call = engine.stub.ExportState(request, **forwarding_options(context))
        async for chunk in forwarded_stream(call, None, context):
            yield chunk

    async def ImportState(self, request_iterator, context):
        owner = current_identity()
        async with self._new_session_for(owner, context):
            engine = await self._most_free(context)
            call = engine.stub.ImportState(**forwarding_options(context))
            pump = asyncio.ensure_future(pump_requests(request_iterator, call))
            reply = await forwarded_reply(call, pump, context)
            self.directory.add(reply.session_id, engine.position, owner)
        return reply

    # -- for the workers --------------------------------------------------------------------
    def locate_handler(self) -> grpc.GenericRpcHandler:
        async def locate(request: bytes, context) -> bytes:
            ids = json.loads(request)
            return json.dumps([self.directory.position_of(sid) for sid in ids]).encode()

        return grpc.method_handlers_generic_handler(
            ROUTER_SERVICE, {"Locate": grpc.unary_unary_rpc_method_handler(locate)}
        )


class EnginePool:
    """The engine processes: started together, watched, stopped last."""

    def __init__(self, engines: list[Engine], settings_for) -> None:
        self.engines = engines
        self._settings_for = settings_for
        self.died = asyncio.Event()  # an engine exited on its own
        self._watchers: list[asyncio.Task] = []
        self._stopping = False
        self.metrics_dir: str | None = None

    async def start(self, limit: int) -> None:
        procs = await asyncio.gather(
            *(spawn_ready("gdn_server.engine", self._settings_for(e).to_json(), f"engine {e.device_index}",
                          self._env()) for e in self.engines),
            return_exceptions=True,
        )
        for engine, proc in zip(self.engines, procs):
            if isinstance(proc, asyncio.subprocess.Process):
                engine.proc = proc
        failed = [p for p in procs if isinstance(p, BaseException)]
        if failed:
            await self.stop(0)
            raise failed[0]
        options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        for engine in self.engines:
            engine.channel = grpc.aio.insecure_channel(f"unix:{engine.grpc_path}", options=options)
            engine.stub = gdn_pb2_grpc.GdnDecodeStub(engine.channel)
        self._watchers = [asyncio.create_task(self._watch(e)) for e in self.engines]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.metrics_dir:  # read by prometheus_client when the engine imports it
            env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        return env

    async def _watch(self, engine: Engine) -> None:
        code = await engine.proc.wait()
        if self._stopping:
            return
        if code == 0:  # told to stop by someone else (e.g. SIGTERM to the whole group): it drained and saved
            log.warning("the engine of device %d stopped; stopping the server", engine.device_index)
        else:
            log.error("the engine of device %d exited with code %s: its sessions are lost; stopping the server",
                      engine.device_index, code)
        self.died.set()

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every engine: each drains, writes its snapshot and exits."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        running = [e.proc for e in self.engines if e.proc is not None and e.proc.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in running:
            try:
                await asyncio.wait_for(proc.wait(), grace_s + ENGINE_STOP_EXTRA_S)
            except asyncio.TimeoutError:
                log.error("engine (pid %d) did not stop in time; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for engine in self.engines:
            if engine.proc is not None and self.metrics_dir:
                mark_process_dead(engine.proc.pid, self.metrics_dir)  # its gauges leave the sums
            if engine.channel is not None:
                await engine.channel.close()


async def serve_router(settings: ServerSettings) -> int:
    """Runs the whole --frontends server until SIGTERM/SIGINT; returns the exit code."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    device, indices = device_indices(settings)
    socket_dir = private_socket_dir()
    reserved = None
    engines = [Engine(pos, idx, f"{socket_dir}/engine-{idx}.sock", f"{socket_dir}/link-{idx}.sock")
               for pos, idx in enumerate(indices)]
    gates_path = f"{socket_dir}/gates.safetensors"
    metrics_dir = None
    if settings.metrics_port is not None:
        metrics_dir = f"{socket_dir}/metrics"
        os.makedirs(metrics_dir)
    limit = max_message_bytes(settings.shape, settings.scheduler.max_batch_rows)
    engine_pool = EnginePool(engines, lambda e: _engine_settings(settings, device, e, indices, gates_path, metrics_dir))
    engine_pool.metrics_dir = metrics_dir
    workers: FrontendPool | None = None
    refresher: asyncio.Task | None = None
    server: grpc.aio.Server | None = None
    metrics: Metrics | None = None
    try:
        reserved, port = reserve_port(settings.host, settings.port)
        _save_gates(settings, gates_path)
        await engine_pool.start(limit)
        servicer = RouterServicer(engines, settings.security.max_sessions_per_client)
        await servicer.refresh_directory()  # the sessions the engines restored
        if settings.session_idle_timeout_s:
            refresher = asyncio.create_task(_refresh_every(servicer, min(DIRECTORY_REFRESH_S, settings.session_idle_timeout_s)))
        server, health = _router_server(servicer, f"unix:{socket_dir}/router.sock", limit)
        await set_serving(health, False)
        await server.start()
        sec = settings.security

        def worker_settings(index: int) -> FrontendSettings:
            return FrontendSettings(
                index=index, host=settings.host, port=port, engine_address=f"unix:{socket_dir}/router.sock",
                link_paths=[e.link_path for e in engines], shape=dataclasses.asdict(settings.shape),
                security=dataclasses.asdict(sec), max_message_bytes=limit, grace_s=settings.grace_s,
                log_level=logging.getLevelName(logging.getLogger("gdn_server").getEffectiveLevel()),
                metrics_dir=metrics_dir, event_loop=settings.event_loop,
                # whatever the engines' device: a worker polls only while it serves one request
                # at a time (frontend.EngineLinkClient), which on the CPU box cut one client's
                # p50 by ~27% and left 8 and 32 clients even (bench/NOTES.md)
                busy_poll_us=settings.scheduler.busy_poll_us,
                transport=settings.frontend_transport,
            )

        workers = FrontendPool(settings.frontends, worker_settings)
        await workers.start()
        if metrics_dir is not None:
            metrics = Metrics(files_dir=metrics_dir)
            metrics.serve(settings.host, settings.metrics_port or 0)
            print(f"metrics on http://{settings.host}:{metrics.port}/metrics", flush=True)
        await set_serving(health, True)
        log.info("%d front-end workers (pids %s), engines for devices %s (pids %s)", workers.count, workers.pids,
                 list(indices), [e.proc.pid for e in engines])
        freeze_startup_objects()  # see gdn_server/tuning.py
        print(f"listening on {settings.host}:{port}", flush=True)
        # every process of the server runs this loop (as a one-process server says it)
        log.info("event loop: %s; front-end transport: %s", running_loop_name(), settings.frontend_transport)
        code = await _run_until_stopped(settings, health, engine_pool)
    except BaseException:
        code = None
        raise
    finally:
        # workers first (their in-flight calls still reach the engines), then the engines
        # (each drains and saves), then this process's own sockets
        if refresher is not None:
            refresher.cancel()
        if server is not None:
            await health.enter_graceful_shutdown()
        if workers is not None:
            await workers.stop(settings.grace_s if code is not None else 0)
        await engine_pool.stop(settings.grace_s)
        if server is not None:
            await server.stop(0)
        if metrics is not None:
            metrics.close()
        if reserved is not None:
            reserved.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
    return code


async def _refresh_every(servicer: RouterServicer, seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds)
        try:
            await servicer.refresh_directory()
        except grpc.aio.AioRpcError as e:  # an engine is busy stopping; the next round will do
            log.warning("could not refresh the session directory: %s", e.details())


def _engine_settings(settings: ServerSettings, device: str, engine: Engine, indices: tuple[int, ...],
                     gates_path: str, metrics_dir: str | None) -> EngineSettings:
    save_dir, load_dirs = None, []
    if settings.state_dir:
        save_dir = str(device_snapshot_dir(settings.state_dir, engine.device_index))
        load_dirs = [save_dir]
        if engine.position == 0:  # a one-process server's snapshot, and those of devices not served now
            orphans = [str(p) for i, p in device_snapshot_dirs(settings.state_dir).items() if i not in indices]
            load_dirs = [settings.state_dir, *orphans, save_dir]
    return EngineSettings(
        device_index=engine.device_index, device=device, shape=dataclasses.asdict(settings.shape),
        gates_path=gates_path, grpc_path=engine.grpc_path, link_path=engine.link_path,
        scheduler=dataclasses.asdict(settings.scheduler), max_sessions=settings.max_sessions,
        speculative_sessions=settings.speculative_sessions, scale=settings.scale, grace_s=settings.grace_s,
        session_idle_timeout_s=settings.session_idle_timeout_s, save_dir=save_dir, load_dirs=load_dirs,
        metrics_dir=metrics_dir,
        log_level=logging.getLevelName(logging.getLogger("gdn_server").getEffectiveLevel()),
        event_loop=settings.event_loop,
    )


def _router_server(servicer: RouterServicer, address: str, limit: int) -> tuple[grpc.aio.Server, HealthServicer]:
    server = grpc.aio.server(
        interceptors=[ForwardedIdentity(), RejectMalformed()],
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
    )
    gdn_pb2_grpc.add_GdnDecodeServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([servicer.locate_handler()])
    health = add_health_and_reflection(server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"could not bind {address}")
    return server, health


async def _run_until_stopped(settings: ServerSettings, health: HealthServicer, engines: EnginePool) -> int:
    """Waits for SIGTERM/SIGINT (0) or an engine's death (1); honours --shutdown-delay-s."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    signalled = asyncio.ensure_future(stop.wait())
    died = asyncio.ensure_future(engines.died.wait())
    await asyncio.wait([signalled, died], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    died.cancel()
    if engines.died.is_set():
        return 1
    delay = settings.shutdown_delay_s
    if delay > 0:  # let load balancers see NOT_SERVING while requests are still served
        log.info("SIGTERM: health NOT_SERVING, draining in %.1f s (signal again to drain now)", delay)
        await health.enter_graceful_shutdown()
        stop.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    log.info("shutting down")
    return 0
