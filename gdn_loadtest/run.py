"""One load run: against a gdn server (`run_load`) or against the echo floor with the message
sizes a gdn run measured (`run_echo`), its clients in this process or spread over several."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc

from gdn_client import GdnError, ModelInfo, Stats
from gdn_loadtest.config import Agreement, LoadConfig, RunResult
from gdn_loadtest.drive import drive, run_result
from gdn_loadtest.processes import spread
from gdn_loadtest.shm import gdn_worker
from gdn_loadtest.workers import EchoWorker, server_view

__all__ = ["check_capacity", "run_load", "run_echo"]


def _check_free_sessions(info: ModelInfo, target: str, clients: int, batch: int) -> None:
    """RESOURCE_EXHAUSTED unless the server has a session free for each of `clients` x `batch`."""
    free = info.max_sessions - info.sessions_in_use
    if clients * batch > free:
        raise GdnError(
            f"{clients} clients x {batch} sessions (--batch) need {clients * batch} sessions at once; the server at "
            f"{target} has {free} free ({info.max_sessions} in all, {info.sessions_in_use} in use): start it with "
            f"a larger --max-sessions or run fewer clients", grpc.StatusCode.RESOURCE_EXHAUSTED,
        )


async def check_capacity(target: str, clients: int, batch: int, timeout: float) -> None:
    """Before any run: the server has a session free for each of `clients` x `batch` (the largest
    run of a list), or GdnError RESOURCE_EXHAUSTED saying how many it has."""
    info, _ = await server_view(target, timeout)
    _check_free_sessions(info, target, clients, batch)


async def run_load(cfg: LoadConfig, processes: int = 1) -> RunResult:
    """One load run against a gdn server (one clients value), its clients in `processes` processes.
    With cfg.verify a wrong output raises VerificationError."""
    info, _ = await server_view(cfg.target, cfg.timeout)
    _check_free_sessions(info, cfg.target, cfg.clients, cfg.batch)  # other clients may have come meanwhile
    before: Stats | None = None

    async def snapshot() -> None:
        nonlocal before
        _, before = await server_view(cfg.target, cfg.timeout)

    label = f"gdn {cfg.mode} x{cfg.clients}"
    if processes > 1:
        measured, sizes = await spread(cfg, "gdn", processes, {}, label, snapshot)
        assert sizes is not None
        layers, request_bytes, reply_bytes = sizes
        _, after = await server_view(cfg.target, cfg.timeout)
    else:
        workers = [gdn_worker(cfg, info, i) for i in range(cfg.clients)]
        try:
            measured = await drive(workers, cfg, label, snapshot)
            _, after = await server_view(cfg.target, cfg.timeout)
        finally:
            await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        if cfg.verify:
            measured = dataclasses.replace(measured, agreement=Agreement.merge(
                w.verifier.agreement() for w in workers if w.verifier is not None))
        w0 = workers[0]
        layers, request_bytes, reply_bytes = w0.layers, w0.request_bytes, w0.reply_bytes
    delta = after.since(before) if before is not None else after
    server: dict[str, Any] = {
        "backend": after.backend, "launches": delta.launches, "rows_launched": delta.rows_launched,
        "requests": delta.requests, "batches": delta.batches, "mean_rows_per_launch": delta.mean_rows_per_launch,
        "device_seconds": delta.device_seconds, "queue_wait_seconds": delta.queue_wait_seconds,
    }
    return run_result("gdn", cfg, layers, measured, request_bytes, reply_bytes, server)


async def run_echo(cfg: LoadConfig, address: str, request_bytes: int, reply_bytes: int, layers: int,
                   processes: int = 1) -> RunResult:
    """The same load against the echo server at `address`, its clients in `processes` processes."""
    label = f"echo {cfg.mode} x{cfg.clients}"
    cfg = dataclasses.replace(cfg, target=address)
    if processes > 1:
        sizes = {"request_bytes": request_bytes, "reply_bytes": reply_bytes}
        measured, _ = await spread(cfg, "echo", processes, sizes, label)
    else:
        workers = [EchoWorker(cfg, address, request_bytes, reply_bytes) for _ in range(cfg.clients)]
        try:
            measured = await drive(workers, cfg, label)
        finally:
            await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    return run_result("echo", cfg, layers, measured, request_bytes, reply_bytes)
