"""The scheduler's own host cost per decode request, on any machine (CPU only, no gRPC).

    python bench/scheduler_round.py                          # table: us of CPU per request at 1, 8, 64 per round
    python bench/scheduler_round.py --per-round 64 --profile # cProfile of the rounds, top functions
    python bench/scheduler_round.py --json out.json

What runs is `Scheduler.submit_decode` and `Scheduler.run_round` (admission, positions, routing,
batching, the backend's submit, the answers with replies encoded as gdn-server encodes them),
on already validated requests (`DecodeWork.of_bf16`, as the native validation builds them:
qwen3-next, T=1, B=1, bf16, positions sent), sessions and layers cycled as many clients would
send them. The backend does CudaBackend's host work per launch (bench/engine_path.py's staging
ring: the staging plan, the fill) and no device work. CPU time is `time.thread_time()` of the
rounds; building the requests is outside it. Every answer is checked (position and request id).

This is the part of the event loop's work per step that bench/NOTES.md calls "the scheduler's
per-request Python": compare two versions of the scheduler with it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

from engine_path import HostStagingBackend  # noqa: E402  (this folder)
from gdn_server.backends.base import PendingStep  # noqa: E402
from gdn_server.config import PRESETS, SchedulerConfig  # noqa: E402
from gdn_server.scheduler import Scheduler  # noqa: E402
from gdn_server.decode_rpcs import encode_decode_reply  # noqa: E402
from gdn_server.sessions import SessionTable  # noqa: E402
from gdn_server.work import DecodeWork, StepBatch  # noqa: E402


class _Done(PendingStep):
    def __init__(self, out: torch.Tensor) -> None:
        self._out = out

    def result(self) -> torch.Tensor:
        return self._out

    def ready(self) -> bool:
        return True


class _HostOnly(HostStagingBackend):
    """bench/engine_path.py's backend (CudaBackend's host work per launch) with a "device" that is
    done at once and leaves the output buffer as it is."""

    def submit(self, batch: StepBatch) -> PendingStep:
        _, out = self._staging.stage(batch)
        return _Done(out)


def _inputs(shape, T: int) -> tuple[tuple[bytes, ...], tuple[tuple[int, ...], ...]]:
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    dims = ((1, T, H, K), (1, T, H, K), (1, T, HV, V), (1, T, HV), (1, T, HV))
    raw = tuple(torch.randn(d).to(torch.bfloat16).view(torch.int16).numpy().tobytes() for d in dims)
    return raw, dims


def measure(per_round: int, rounds: int, profile: bool) -> tuple[list[float], str]:
    shape = PRESETS["qwen3-next"]
    backend = _HostOnly(shape, max_sessions=per_round, max_rows=per_round)
    table = SessionTable(per_round, shape.num_layers)
    scheduler = Scheduler(backend, table, SchedulerConfig(max_batch_rows=max(per_round, 1)))
    scheduler.encode_reply = encode_decode_reply
    ids = [table.create().id for _ in range(per_round)]
    raw, dims = _inputs(shape, 1)
    answers: list = []
    done = answers.append
    per_request: list[float] = []
    previous: list = []
    prof = cProfile.Profile() if profile else None
    for r in range(rounds):
        layer = r % shape.num_layers
        position = r // shape.num_layers
        works = [
            DecodeWork.of_bf16(layer, (sid,), (position,), f"{r}.{i}", False, raw, dims, True)
            for i, sid in enumerate(ids)
        ]
        if prof is not None:
            prof.enable()
        t0 = time.thread_time()
        for w in works:
            scheduler.submit_decode(w, done)
        previous = scheduler.run_round(previous)
        spent = time.thread_time() - t0
        if prof is not None:
            prof.disable()
        if r:  # round 0 answers nothing (pipelined: its batch is answered by round 1)
            per_request.append(spent / per_round * 1e6)
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        answers.clear()
    scheduler.run_round(previous)
    for a in answers:  # the last round's answers: positions advanced by one at the last layer
        if isinstance(a, BaseException) or a.positions != ((rounds - 1) // shape.num_layers + 1,):
            raise AssertionError(f"unexpected answer {a!r}")
    text = ""
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        text = s.getvalue()
    return per_request, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-round", default="1,8,64", help="requests per round (comma-separated)")
    p.add_argument("--rounds", type=int, default=0, help="rounds per setting (default: ~20k requests)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    print(f"native module: {os.environ.get('GDN_NATIVE', '1') != '0'}", flush=True)
    rows = []
    for n in (int(x) for x in args.per_round.split(",")):
        rounds = args.rounds or max(200, 20_000 // n)
        samples, text = measure(n, rounds, args.profile)
        med = statistics.median(samples)
        rows.append({"per_round": n, "us_per_request": med, "min": min(samples), "max": max(samples)})
        if text:
            print(text)
    print("| requests per round | us CPU per request (median) | min - max | requests/s on one core |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['per_round']} | {r['us_per_request']:.1f} | {r['min']:.1f} - {r['max']:.1f} | "
              f"{1e6 / r['us_per_request']:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
