"""Several load processes for one run (gdn-loadtest --processes P).

One Python load process costs ~40-60 us of CPU per step (gRPC's stream write and read, asyncio):
near 64 clients it, not the server, can be what a run measures. With P processes the parent
splits the clients over P children (`python -m gdn_loadtest.processes`). Each child reads its
spec line on stdin, opens and warms up its clients, prints "ready" and waits; the parent takes
the server's stats once every child is ready and sends "go" to all, so their measured windows
coincide. Children print "progress <steps>" as they run and one "result <json>" line at the end
(or "error <json>"); the parent sums their steps over the longest child's time and pools their
latencies (steps' and Commits').
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

import grpc
import numpy as np

from gdn_client import GdnError
from gdn_loadtest.config import Agreement, LoadConfig
from gdn_loadtest.drive import ClientTally, Measured, drive, host_cpu_ticks, host_cpu_usage
from gdn_loadtest.progress import REFRESH_S, ProgressBar
from gdn_loadtest.verify import VerificationError
from gdn_loadtest.shm import gdn_worker
from gdn_loadtest.workers import EchoWorker, server_view

__all__ = ["LineProgress", "child_main", "shares", "spread"]

_READY_TIMEOUT_S = 180.0  # a child imports torch and grpc, opens its sessions, warms up


def shares(total: int, parts: int) -> list[int]:
    """`total` split into at most `parts` near-equal positive shares."""
    return [n for n in (total // parts + (i < total % parts) for i in range(parts)) if n]


async def spread(
    cfg: LoadConfig, kind: str, processes: int, extra: dict[str, Any], label: str,
    before_measure: Callable[[], Awaitable[None]] | None = None, child_command: Sequence[str] | None = None,
) -> tuple[Measured, list[int] | None]:
    """Runs `cfg`'s clients in child processes; returns what they measured together (a tally per
    child, the longest child's elapsed time, the host's CPU use from "go" to the last result, the
    CPU seconds of every load process: this one's from "go" to the last result, the children's
    over their runs) and for gdn steps [layers, request bytes, reply bytes]. `child_command`:
    what starts a child (default: this module; a benchmark with clients of its own kind gives
    its own, speaking the same protocol through `child_main`)."""
    parts = min(processes, cfg.clients, cfg.clients if cfg.requests is None else max(1, cfg.requests))
    clients = shares(cfg.clients, parts)
    requests = None if cfg.requests is None else shares(cfg.requests, parts) or [0]
    children: list[asyncio.subprocess.Process] = []
    try:
        first = 0
        for i, n in enumerate(clients):
            part = dataclasses.replace(cfg, clients=n, progress=False,
                                       requests=None if requests is None else requests[i])
            spec = {"kind": kind, "config": dataclasses.asdict(part), "first_index": first, **extra}
            first += n
            child = await asyncio.create_subprocess_exec(
                *(child_command or (sys.executable, "-m", "gdn_loadtest.processes")),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 30,
            )
            assert child.stdin is not None
            child.stdin.write(json.dumps(spec).encode() + b"\n")
            children.append(child)
        for index, child in enumerate(children):
            await _expect(child, index, "ready", _READY_TIMEOUT_S)
        if before_measure is not None:
            await before_measure()
        ticks, cpu0 = host_cpu_ticks(), time.process_time()
        for child in children:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
        started = time.perf_counter()
        bar = ProgressBar(cfg, label)
        steps = [0] * len(children)

        async def tick() -> None:
            while True:
                bar.show(sum(steps), time.perf_counter() - started)
                await asyncio.sleep(REFRESH_S)

        ticker = asyncio.ensure_future(tick())
        try:
            results = await asyncio.gather(*(_child_result(c, i, cfg, steps) for i, c in enumerate(children)))
        finally:
            ticker.cancel()
            bar.close()
        host, own_cpu_s = host_cpu_usage(ticks, host_cpu_ticks()), time.process_time() - cpu0
    finally:
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()
    tallies = []
    for r in results:
        # a child_command's child that commits nothing may leave commit_latencies out
        tallies.append(ClientTally(_decode(r["latencies"]), r["errors"], r["error_samples"],
                                   _decode(r.get("commit_latencies", ""))))
    cpu_s = own_cpu_s + sum(r["cpu_s"] for r in results)
    agreement = Agreement.merge(Agreement(**r["agreement"]) if r.get("agreement") else None for r in results)
    return Measured(tallies, max(r["elapsed"] for r in results), host, cpu_s, agreement), results[0]["sizes"]


async def _child_line(child: asyncio.subprocess.Process, index: int, timeout: float) -> tuple[str, str]:
    """The next protocol line of a child as (word, rest); a child that ends or stalls is an error."""
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), timeout)
    except asyncio.TimeoutError:
        raise GdnError(f"load process {index} said nothing for {timeout:.0f} s",
                       grpc.StatusCode.DEADLINE_EXCEEDED) from None
    if not line:
        code = await child.wait()
        raise GdnError(f"load process {index} exited ({code}) before its result", grpc.StatusCode.UNKNOWN)
    word, _, rest = line.decode().strip().partition(" ")
    if word == "error":  # the child's own error, passed on as it is
        err = json.loads(rest)
        if err.get("verification"):
            raise VerificationError(f"load process {index}: {err['message']}")
        raise GdnError(f"load process {index}: {err['message']}", grpc.StatusCode[err["code"]])
    return word, rest


async def _expect(child: asyncio.subprocess.Process, index: int, word: str, timeout: float) -> None:
    got, _ = await _child_line(child, index, timeout)
    if got != word:
        raise GdnError(f"load process {index}: expected {word!r}, got {got!r}")


async def _child_result(child: asyncio.subprocess.Process, index: int, cfg: LoadConfig, steps: list[int]) -> dict:
    """Reads a child's progress into steps[index] until its result; waits for it to exit."""
    while True:
        # a child reports a few times a second; a stalled step ends in at most cfg.timeout
        word, rest = await _child_line(child, index, cfg.timeout + 30.0)
        if word == "progress":
            steps[index] = int(rest)
        elif word == "result":
            await child.wait()
            return json.loads(rest)
        else:
            raise GdnError(f"load process {index}: unexpected line {word!r}")


class LineProgress:
    """A child's progress sink: its step count on stdout, for the parent's bar."""

    def show(self, steps: int, elapsed: float) -> None:
        print(f"progress {steps}", flush=True)

    def close(self) -> None:
        pass


async def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One child's share of a spread run."""
    cfg = LoadConfig(**spec["config"])
    first = spec["first_index"]
    if spec["kind"] == "gdn":
        info, _ = await server_view(cfg.target, cfg.timeout)
        workers: list[Any] = [gdn_worker(cfg, info, first + i) for i in range(cfg.clients)]
    else:
        workers = [EchoWorker(cfg, cfg.target, spec["request_bytes"], spec["reply_bytes"])
                   for _ in range(cfg.clients)]
    loop = asyncio.get_running_loop()

    async def wait_for_go() -> None:
        print("ready", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            raise GdnError("the parent load process went away", grpc.StatusCode.CANCELLED)

    try:
        measured = await drive(workers, cfg, spec["kind"], wait_for_go, progress=LineProgress())
    finally:
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    w0 = workers[0]
    agreement = Agreement.merge(w.verifier.agreement() for w in workers if spec["kind"] == "gdn" and w.verifier is not None)
    return {
        "elapsed": measured.elapsed_s, "cpu_s": measured.cpu_s,
        "latencies": _encode(x for t in measured.tallies for x in t.latencies),
        "commit_latencies": _encode(x for t in measured.tallies for x in t.commit_latencies),
        "errors": sum(t.errors for t in measured.tallies),
        "error_samples": [m for t in measured.tallies for m in t.error_samples][:5],
        # what a gdn step measured (its sizes are the echo's inputs; the echo's own are known)
        "sizes": [w0.layers, w0.request_bytes, w0.reply_bytes] if spec["kind"] == "gdn" else None,
        "agreement": None if agreement is None else dataclasses.asdict(agreement),
    }


def _encode(seconds: Iterable[float]) -> str:
    """Samples (seconds) for the result line: float64 bytes in base64, exact and shorter than JSON's numbers."""
    return base64.b64encode(np.fromiter(seconds, dtype=np.float64).tobytes()).decode()


def _decode(text: str) -> list[float]:
    return np.frombuffer(base64.b64decode(text), dtype=np.float64).tolist()


def child_main(child: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] = _child) -> int:
    """A load process: one spec line on stdin, protocol lines on stdout (`child` runs the spec:
    this module's clients by default)."""
    spec = json.loads(sys.stdin.readline())
    try:
        result = asyncio.run(child(spec))
    except GdnError as err:
        print("error " + json.dumps({"message": str(err.message), "code": err.code.name}), flush=True)
        return 1
    except VerificationError as err:
        print("error " + json.dumps({"message": str(err), "verification": True}), flush=True)
        return 1
    print("result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    from gdn_server.tuning import tune_process

    tune_process()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(child_main())
