"""The measured loop every run goes through: workers step until the budget is spent.

A worker has open(), prepare() -> request bytes (not timed), send(request) -> reply bytes
(timed), check(reply) (not timed; raises GdnError for an error reply), exchange() (all three),
close(), and commit_s: the round trip of the Commits the last send() made to settle a
speculative pass, in seconds (None when it made none). `drive` opens and warms every worker up
with one step, then runs them all until the budget (a number of steps, or a deadline) is spent,
and returns what it measured.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Sequence

import grpc
import numpy as np

from gdn_client import GdnError
from gdn_loadtest.config import Agreement, LoadConfig, RunResult
from gdn_loadtest.progress import REFRESH_S, ProgressBar, ProgressSink

__all__ = ["ClientTally", "Measured", "drive", "gather_or_cancel", "host_cpu_ticks", "host_cpu_usage",
           "run_result"]


class Budget:
    """Shared stop condition: a step count or a deadline."""

    def __init__(self, requests: int | None, duration: float | None) -> None:
        self.left = requests
        self.duration = duration
        self.deadline = float("inf")

    def start(self) -> None:
        if self.duration is not None:
            self.deadline = time.perf_counter() + self.duration

    def take(self) -> bool:
        if time.perf_counter() >= self.deadline:
            return False
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclass
class ClientTally:
    latencies: list[float] = field(default_factory=list)  # seconds, one per step that succeeded
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    # seconds, one per speculative pass whose closing step succeeded: its Commits' round trip
    commit_latencies: list[float] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(msg)

    @property
    def steps(self) -> int:
        """Steps done, failed ones included."""
        return len(self.latencies) + self.errors


@dataclass
class Measured:
    tallies: list[ClientTally]
    elapsed_s: float
    host_cpu: dict[str, float] | None  # the whole host's CPU over the run (host_cpu_usage)
    cpu_s: float  # CPU seconds of the load's own processes over the run
    agreement: Agreement | None = None  # with --verify: how close the checked outputs came


def host_cpu_ticks() -> list[int] | None:
    """The host's CPU time counters (/proc/stat's first line), or None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    return [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal


def host_cpu_usage(before: list[int] | None, after: list[int] | None) -> dict[str, float] | None:
    """How busy the whole host was between two `host_cpu_ticks()`: cores in use (of `cores`) and
    the share of time the hypervisor gave to others (steal). A run whose host is near all cores
    busy, or steals much, measures the host, not the server: the figure that tells them apart."""
    if before is None or after is None:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (b - a for a, b in zip(before, after))
    total = user + nice + system + idle + iowait + irq + softirq + steal
    if total <= 0:
        return None
    cores = os.cpu_count() or 1
    busy = user + nice + system + irq + softirq
    return {"cores": cores, "busy_cores": cores * busy / total, "steal_pct": 100.0 * steal / total}


async def gather_or_cancel(coros: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Runs `coros` together; the first to fail cancels the others (and is raised once they
    have ended), so no client keeps stepping after the run has failed."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def drive(
    workers: Sequence[Any], cfg: LoadConfig, label: str, before_measure: Callable[[], Awaitable[None]] | None = None,
    progress: ProgressSink | None = None,
) -> Measured:
    """Opens and warms every worker up with one step, then runs the budget. `progress` (default:
    a ProgressBar) is shown the step count a few times a second."""
    await gather_or_cancel([w.open() for w in workers])
    await gather_or_cancel([w.exchange() for w in workers])  # warm-up: connections, first launch
    if before_measure is not None:
        await before_measure()
    budget = Budget(cfg.requests, cfg.duration)
    tallies = [ClientTally() for _ in workers]

    async def loop(worker: Any, tally: ClientTally) -> None:
        lat, commit_lat = tally.latencies, tally.commit_latencies
        while budget.take():
            request = worker.prepare()
            try:
                t0 = time.perf_counter()
                reply = await worker.send(request)
                t1 = time.perf_counter()
                commit_s = worker.commit_s
                worker.check(reply)
            except GdnError as err:
                tally.error(str(err))
                if err.code == grpc.StatusCode.UNAVAILABLE:
                    return  # the connection is gone; stop this client
                continue
            lat.append(t1 - t0)
            if commit_s is not None:  # counted with its step, so both describe the same steps
                commit_lat.append(commit_s)

    if progress is None:
        progress = ProgressBar(cfg, label)
    budget.start()
    ticks = host_cpu_ticks()
    t0, cpu0 = time.perf_counter(), time.process_time()

    async def tick() -> None:
        while True:
            progress.show(sum(t.steps for t in tallies), time.perf_counter() - t0)
            await asyncio.sleep(REFRESH_S)

    ticker = asyncio.ensure_future(tick())
    try:
        await gather_or_cancel([loop(w, t) for w, t in zip(workers, tallies)])
    finally:
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        ticker.cancel()
        progress.show(sum(t.steps for t in tallies), elapsed)
        progress.close()
    return Measured(tallies, elapsed, host_cpu_usage(ticks, host_cpu_ticks()), cpu_s)


def run_result(kind: str, cfg: LoadConfig, layers: int, measured: Measured, request_bytes: int, reply_bytes: int,
               server: dict[str, Any] | None = None) -> RunResult:
    """A run's figures from what `drive` (or the load processes together) measured."""
    tallies, elapsed = measured.tallies, measured.elapsed_s
    lat_ms = np.array([x for t in tallies for x in t.latencies], dtype=np.float64) * 1e3
    commit_ms = np.array([x for t in tallies for x in t.commit_latencies], dtype=np.float64) * 1e3
    steps = int(lat_ms.size)
    pct = _percentiles(lat_ms) if steps else {}
    rate = steps / elapsed if elapsed > 0 else 0.0
    return RunResult(
        kind=kind, mode=cfg.mode, clients=cfg.clients, batch=cfg.batch, tokens=cfg.tokens,
        layers_per_token=layers, steps=steps, errors=sum(t.errors for t in tallies), elapsed_s=elapsed,
        steps_per_s=rate, token_layers_per_s=rate * cfg.batch * cfg.tokens, latency_ms=pct,
        commit_ms=_percentiles(commit_ms) if commit_ms.size else None,
        request_bytes=request_bytes, reply_bytes=reply_bytes, server=server,
        error_samples=[s for t in tallies for s in t.error_samples][:5], latencies_ms=lat_ms.tolist(),
        host_cpu=measured.host_cpu, shared_connection=cfg.shared_connection,
        load_cores=measured.cpu_s / elapsed if elapsed > 0 else None,
        verified=cfg.verify and kind == "gdn", agreement=measured.agreement,
        speculative=cfg.speculative and kind == "gdn",
    )


def _percentiles(ms: np.ndarray) -> dict[str, float]:
    """p50/p90/p99/mean/max of a non-empty array of milliseconds."""
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(ms.mean()), "max": float(ms.max())}
