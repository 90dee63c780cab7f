"""An engine process (`gdn-server --frontends N` starts one per device).

One Python process cannot feed two GPUs: their scheduler threads share its GIL (bench/NOTES.md,
"Front-end workers"). So with --frontends every device gets a process of its own that owns its
state pool, session table and scheduler, exactly as a one-process server owns them
(gdn_server.server builds both). It serves two private Unix sockets in the server's 0700
directory:

- its gRPC server: the GdnDecode RPCs the router (gdn_server.router) passes on for the sessions
  on this device, with the identity the workers authenticated (ForwardedIdentity), plus the
  internal `gdn.internal.Engine/ListSessions`;
- its decode link (gdn_server.engine_link): decode steps from the front-end workers as frames.

The router starts it with `python -m gdn_server.engine`, its settings as JSON on stdin; it prints
`ready` once it serves. On SIGTERM, or when the router process is gone, it drains (in-flight
calls and queued steps finish), writes its snapshot (device-<N>/ under --state-dir) and exits.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

import grpc

from gdn_server.child_process import JsonSettings, start_child
from gdn_server.config import GIL_SWITCH_INTERVAL_S, ModelShape, SchedulerConfig
from gdn_server.engine_link import EngineLink
from gdn_server.event_loop import run as run_loop
from gdn_server.metrics import GAUGE_REFRESH_S, EngineMetrics, ProcessCpu
from gdn_server.security import ForwardedIdentity, RejectMalformed
from gdn_server.snapshot import SnapshotError
from gdn_server.server import (
    GdnApp, ServerSettings, build_app, close_shards, drain_shards, grpc_server, save_shards, set_serving, start_shards,
)
from gdn_server.tuning import freeze_startup_objects
from gdn_server.weights import load_gate_params

log = logging.getLogger("gdn_server.engine")

ENGINE_SERVICE = "gdn.internal.Engine"
LIST_SESSIONS = f"/{ENGINE_SERVICE}/ListSessions"  # b"" -> JSON [[session id, owner or null], ...]
PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class EngineSettings(JsonSettings):
    """What an engine process needs, sent as JSON by the router."""

    device_index: int  # the CUDA ordinal it serves (or the CPU shard's number)
    device: str  # "cuda" or "cpu"
    shape: dict  # ModelShape fields
    gates_path: str  # safetensors with the server's A_log/dt_bias (written by the router)
    grpc_path: str  # its gRPC server's Unix socket
    link_path: str  # its decode link's Unix socket
    scheduler: dict  # SchedulerConfig fields
    max_sessions: int | None = None
    speculative_sessions: int | None = None
    scale: float | None = None
    grace_s: float = 30.0
    session_idle_timeout_s: float | None = None
    save_dir: str | None = None  # where its sessions go on shutdown (None: nowhere)
    load_dirs: list[str] = field(default_factory=list)  # snapshots to restore on start
    metrics_dir: str | None = None  # prometheus multiprocess files (None: metrics off)
    log_level: str = "INFO"
    event_loop: str = "auto"  # gdn_server.event_loop


def list_sessions_handler(app: GdnApp) -> grpc.GenericRpcHandler:
    """`gdn.internal.Engine/ListSessions`: every live session here and its owner (raw JSON bytes),
    so the router can tell which engine holds a session after a restore."""

    async def list_sessions(request: bytes, context) -> bytes:
        pairs = [[s.id, s.owner] for shard in app.placement for s in shard.sessions.sessions()]
        return json.dumps(pairs).encode()

    return grpc.method_handlers_generic_handler(
        ENGINE_SERVICE, {"ListSessions": grpc.unary_unary_rpc_method_handler(list_sessions)}
    )


async def serve_engine(settings: EngineSettings) -> None:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # see config.py
    shape = ModelShape(**settings.shape)
    if settings.device == "cuda":  # pinned buffers and events would otherwise open a context on GPU 0 too
        import torch

        torch.cuda.set_device(settings.device_index)
    gates = load_gate_params(settings.gates_path, shape.num_v_heads)
    app = build_app(ServerSettings(
        shape=shape, gates=gates, device=settings.device, devices=(settings.device_index,),
        max_sessions=settings.max_sessions, speculative_sessions=settings.speculative_sessions,
        scheduler=SchedulerConfig(**settings.scheduler), scale=settings.scale, grace_s=settings.grace_s,
        session_idle_timeout_s=settings.session_idle_timeout_s,
    ), replies_here=False)  # replies go back to the workers as link frames
    refreshers: list[asyncio.Task] = []
    if settings.metrics_dir:  # PROMETHEUS_MULTIPROC_DIR is set for us: the families go to files
        app.engine_metrics = EngineMetrics(registry=None)
        app.engine_metrics.attach(app.placement)
        refreshers = [asyncio.create_task(_refresh_gauges(app.engine_metrics)),
                      asyncio.create_task(ProcessCpu("engine", None).count_forever())]
    # the router authenticated nothing itself: the identity comes from the worker that did
    server = grpc_server(app, [ForwardedIdentity(), RejectMalformed()])
    server.add_generic_rpc_handlers([list_sessions_handler(app)])
    if server.add_insecure_port(f"unix:{settings.grpc_path}") == 0:
        raise OSError(f"could not bind unix:{settings.grpc_path}")
    start_shards(app, settings.load_dirs)
    await server.start()
    link = EngineLink(settings.link_path, shape, app.placement)
    link.start(asyncio.get_running_loop())
    await set_serving(app.health, True)
    for shard in app.placement:
        log.info(
            "device %d (%s): backend %s, %d sessions x %d layers, pool %.1f MiB",
            shard.index, shard.backend.device_name, shard.backend.name, shard.sessions.capacity,
            shape.num_layers, shard.backend.pool_bytes / 2**20,
        )
    freeze_startup_objects()  # see gdn_server/tuning.py
    print("ready", flush=True)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the router reads one line; later output is logs

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    watcher = asyncio.create_task(_stop_when_orphaned(stop))
    await stop.wait()
    watcher.cancel()
    for task in refreshers:
        task.cancel()
    await app.health.enter_graceful_shutdown()
    try:
        await drain_shards(app, server)  # the workers were stopped first: nothing new arrives
        link.close()
        if settings.save_dir:
            await save_shards(app, settings.save_dir)
    finally:
        close_shards(app)


async def _refresh_gauges(metrics: EngineMetrics) -> None:
    while True:
        await asyncio.sleep(GAUGE_REFRESH_S)
        metrics.refresh()


async def _stop_when_orphaned(stop: asyncio.Event) -> None:
    """Sets `stop` once the router process is gone: drain and save rather than lose the sessions."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the router process went away; draining and saving this engine's sessions")
    stop.set()


def main() -> int:
    settings = start_child(EngineSettings, "engine[{device_index}]")
    try:
        run_loop(serve_engine(settings), settings.event_loop)
    except SnapshotError as e:  # (a RuntimeError) the sessions could not be written or read
        log.error("%s", e)
        return 1
    except (OSError, RuntimeError, ValueError) as e:
        log.error("engine for device %d cannot serve: %s", settings.device_index, e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
