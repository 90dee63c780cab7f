"""The server's own overhead, on any machine: a backend that does a GPU step's host work (CudaBackend's
staging code, gdn_server/backends/staging.py) and then waits 60 us without the GIL (as a GPU step
would), behind the real servicer and scheduler.

    python bench/frontend.py --clients 1,32          # starts the server, runs gdn-loadtest on it
    python bench/frontend.py --serve --port 50079     # only the server (for py-spy and friends)

What it measures is everything but the kernel: gRPC, validation, scheduling, staging-sized
copies, answering. bench/NOTES.md compares versions of the front end with it. (One process only:
with --frontends the engines are separate processes that build their own backends; for their
per-request cost see bench/engine_path.py.)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gdn_server  # noqa: E402,F401,I001  (before torch: it sets OpenMP's passive waits, as in gdn-server)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_path import HostStagingRing  # noqa: E402  (same folder: the engine benchmark's staging ring)
from listening import start_listening  # noqa: E402  (same folder)
from gdn_server.backends.base import NonFiniteInputs, PendingStep, check_unchecked_inputs
from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.event_loop import EVENT_LOOPS
from gdn_server.event_loop import run as run_loop
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.server import GdnApp, ServerSettings, serve
from gdn_server.decode_rpcs import encode_decode_reply
from gdn_server.servicer import GdnDecodeServicer
from gdn_server.sessions import SessionTable
from gdn_server.tuning import tune_gc, tune_malloc
from gdn_server.weights import random_gate_params
from gdn_server.validation import nonfinite_input
from gdn_server.work import StepBatch

GPU_WAIT_S = 60e-6


class _Waiting(PendingStep):
    def __init__(self, out: torch.Tensor) -> None:
        self._out = out
        self._ready = time.monotonic() + GPU_WAIT_S

    def result(self) -> torch.Tensor:
        left = self._ready - time.monotonic()
        if left > 0:
            time.sleep(left)  # releases the GIL, like waiting on a CUDA event
        return self._out

    def ready(self) -> bool:
        return time.monotonic() >= self._ready


class HostOnlyBackend(CpuBackend):
    """CudaBackend's host work per launch (the same staging code: a memcpy per request and input
    into a reused buffer from a ring, the index writes), no math, then a GIL-free wait like a GPU
    step's. The output is the staging set's output buffer, as CudaBackend returns its pinned one
    (the D2H copy itself is the device's work: all zeros here). Session operations are the CPU
    backend's (its state pool is allocated but only touched by them)."""

    name = "host-only"
    asynchronous = True  # the "device" wait happens in result(), as CudaBackend's does

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._staging = HostStagingRing(self.shape)

    def submit(self, batch: StepBatch) -> PendingStep:
        _, out = self._staging.stage(batch)
        # as CudaBackend does: the native fill checked unchecked inputs as it copied them
        found = self._staging.found
        if found is None:
            check_unchecked_inputs(batch)
        elif found:
            raise NonFiniteInputs({index: nonfinite_input(name) for index, name in found.items()})
        return _Waiting(out)


def run_server(
    port: int, sessions: int, runs_on: str = "auto", max_batch_rows: int | None = None, event_loop: str = "auto",
    batch_fill: float = SchedulerConfig.batch_fill, batch_fill_max_us: int = SchedulerConfig.batch_fill_max_us,
    batch_fill_min_rows: int = SchedulerConfig.batch_fill_min_rows,
) -> None:
    tune_malloc()  # as gdn-server's entry points do
    tune_gc()
    shape = ModelShape(num_layers=4, num_q_heads=16, num_v_heads=32)
    gates = random_gate_params(shape, 0)
    backend = HostOnlyBackend(shape, gates, sessions, speculative_sessions=0)
    table = SessionTable(sessions, shape.num_layers)
    rows = {} if max_batch_rows is None else {"max_batch_rows": max_batch_rows}
    scheduler = Scheduler(backend, table, SchedulerConfig(
        runs_on=runs_on, batch_fill=batch_fill, batch_fill_max_us=batch_fill_max_us,
        batch_fill_min_rows=batch_fill_min_rows, **rows))
    scheduler.encode_reply = encode_decode_reply  # replies encoded from the output buffer, as gdn-server's are
    placement = Placement([Shard(0, backend, table, scheduler)])
    settings = ServerSettings(shape=shape, gates=gates, port=port, device="cpu")
    app = GdnApp(settings, placement, GdnDecodeServicer(shape, placement, backend.name))
    run_loop(serve(app), event_loop)  # the loop gdn-server would run on (uvloop where installed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help="run only the server")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--runs-on", default="auto", choices=("auto", "loop", "thread"),
                   help="where the scheduler runs (SchedulerConfig.runs_on; auto = the event loop here)")
    p.add_argument("--max-batch-rows", type=int, default=None,
                   help="the scheduler's --max-batch-rows (1: batching off, as bench/serve.py's part b)")
    p.add_argument("--batch-fill", type=float, default=SchedulerConfig.batch_fill,
                   help="the scheduler's --batch-fill")
    p.add_argument("--batch-fill-max-us", type=int, default=SchedulerConfig.batch_fill_max_us,
                   help="the scheduler's --batch-fill-max-us")
    p.add_argument("--batch-fill-min-rows", type=int, default=SchedulerConfig.batch_fill_min_rows,
                   help="the scheduler's --batch-fill-min-rows")
    p.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                   help="the server's loop, as gdn-server's --event-loop (auto: uvloop where installed)")
    p.add_argument("--clients", default="1,32")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--load", default="", help="more gdn-loadtest flags, e.g. '--batch 256 --mode unary --echo'")
    args = p.parse_args()
    if args.serve:
        run_server(args.port, sessions=600, runs_on=args.runs_on, max_batch_rows=args.max_batch_rows,
                   event_loop=args.event_loop, batch_fill=args.batch_fill,
                   batch_fill_max_us=args.batch_fill_max_us, batch_fill_min_rows=args.batch_fill_min_rows)
        return
    server = [sys.executable, __file__, "--serve", "--port", "0", "--runs-on", args.runs_on,
              "--event-loop", args.event_loop, "--batch-fill", str(args.batch_fill),
              "--batch-fill-max-us", str(args.batch_fill_max_us), "--batch-fill-min-rows", str(args.batch_fill_min_rows)]
    if args.max_batch_rows is not None:
        server += ["--max-batch-rows", str(args.max_batch_rows)]
    proc, target = start_listening(server)
    try:
        subprocess.run([sys.executable, "-m", "gdn_client.loadtest", "--target", target, "--clients", args.clients,
                        "--duration", str(args.duration), "--no-progress", *args.load.split()], check=True, timeout=600)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
