"""Where the microseconds of one serving step go on the GPU, without gRPC (issue 4 profile).

Times, for qwen3-next shapes and B rows of bf16 requests: the bare kernel launch (host time),
CudaBackend.submit (staging memcpys + H2D + launch + D2H, host time), result() (the wait), and
an empty event record + synchronize (the floor of any wait). Median of many calls.

    python bench/backend_step.py --out bench/results
    python bench/backend_step.py --pieces 256      # one request of 256 sessions: each host call of submit
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from gdn_server.backends.cuda import CudaBackend
from gdn_server.config import PRESETS
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork, StepBatch


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--pieces", type=int, default=0, help="time each host call of submit for one request of this many sessions")
    p.add_argument("--variants", action="store_true",
                   help="submit's host time from cold caches: padded graph launches or direct ones, the fill on one thread or the pool")
    args = p.parse_args()
    if args.pieces:
        _pieces(args.pieces, args.calls)
        return
    if args.variants:
        _variants(args.rows, args.calls, Path(args.out))
        return
    shape = PRESETS["qwen3-next"]
    backend = CudaBackend(shape, random_gate_params(shape, 0), max_sessions=512, device="cuda:0")
    backend.warmup()
    H, HV, K = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k
    results = []
    event = torch.cuda.Event()
    sync_us = _median_us(lambda: (event.record(backend.stream), event.synchronize()), args.calls)

    def enter_stream() -> None:
        with torch.cuda.stream(backend.stream):
            pass

    reused = torch.cuda.StreamContext(backend.stream)

    def enter_reused() -> None:
        with reused:
            pass

    # what `submit` pays around its launch calls: entering and leaving the backend's stream
    print(json.dumps({"stream_context_us": _median_us(enter_stream, args.calls),
                      "reused_stream_context_us": _median_us(enter_reused, args.calls),
                      "event_record_us": _median_us(lambda: event.record(backend.stream), args.calls)}), flush=True)
    for B in (int(b) for b in args.rows.split(",")):
        batch = StepBatch(1)
        for r in range(B):  # one request per row, as B clients would send them
            x = {n: torch.randn(1, 1, *s).bfloat16() for n, s in
                 (("q", (H, K)), ("k", (H, K)), ("v", (HV, K)), ("a", (HV,)), ("b", (HV,)))}
            raw = tuple(x[n].view(torch.int16).numpy().tobytes() for n in "qkvab")
            batch.add(DecodeWork(r % shape.num_layers, (str(r),), positions=None, bf16_bytes=raw, **x), [r * shape.num_layers + r % shape.num_layers])
        for _ in range(20):
            backend.submit(batch).result()
        submit_times, wait_times, total_times = [], [], []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            pending = backend.submit(batch)
            t1 = time.perf_counter()
            pending.result()
            t2 = time.perf_counter()
            submit_times.append(t1 - t0)
            wait_times.append(t2 - t1)
            total_times.append(t2 - t0)
        row = {"rows": B, "submit_us": 1e6 * statistics.median(submit_times), "wait_us": 1e6 * statistics.median(wait_times),
               "total_us": 1e6 * statistics.median(total_times), "event_sync_floor_us": sync_us}
        results.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backend_step.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}, indent=1))
    print("| rows | submit (host) us | wait us | total us |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['submit_us']:.1f} | {r['wait_us']:.1f} | {r['total_us']:.1f} |")


def _variants(rows: str, calls: int, out: Path) -> None:
    """CudaBackend.submit's host time for B one-row requests, each launch's requests fresh and the
    CPU caches flushed before it (as in the server, where a launch's requests arrived a
    millisecond or more earlier among much else), for each way of running the launch: padded to
    its graph bucket or launched directly (GRAPH_BUCKETS), the fill on the event loop's thread or
    the copy pool (FILL_THREADED_BYTES). The variants take turns launch by launch."""
    import numpy as np

    from gdn_server.backends import staging

    shape = PRESETS["qwen3-next"]
    backend = CudaBackend(shape, random_gate_params(shape, 0), max_sessions=512, device="cuda:0")
    backend.warmup()
    bucket_max = backend._bucket_max
    H, HV, K = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k
    per_row = {"q": H * K * 2, "k": H * K * 2, "v": HV * K * 2, "a": HV * 2, "b": HV * 2}
    dims = {"q": (1, 1, H, K), "k": (1, 1, H, K), "v": (1, 1, HV, K), "a": (1, 1, HV), "b": (1, 1, HV)}
    flush = np.zeros(64 << 20, dtype=np.uint8)  # more than the host's L2 and its share of L3
    rng = np.random.default_rng(0)
    variants = {"direct, one thread": (0, 1 << 62), "graph, one thread": (bucket_max, 1 << 62),
                "direct, pool": (0, staging.FILL_THREADED_BYTES), "graph, pool": (bucket_max, staging.FILL_THREADED_BYTES)}
    saved = staging.FILL_THREADED_BYTES
    results = []
    for B in (int(b) for b in rows.split(",")):
        times: dict[str, list[float]] = {v: [] for v in variants}
        for call in range(calls + 5):
            for name, (bucket, threaded_from) in variants.items():
                batch = StepBatch(1)
                for r in range(B):  # fresh bf16 bytes per request (finite values: small integers' bf16 patterns)
                    raw = tuple(rng.integers(0x3C00, 0x3F80, size=per_row[n] // 2, dtype=np.uint16).tobytes() for n in "qkvab")
                    batch.add(DecodeWork.of_bf16(r % shape.num_layers, (str(r),), None, "", False, raw,
                                                 tuple(dims[n] for n in "qkvab"), True),
                              [r * shape.num_layers + r % shape.num_layers])
                flush += 1  # evicts the requests and the staging buffers from the caches
                backend._bucket_max, staging.FILL_THREADED_BYTES = bucket, threaded_from
                t0 = time.perf_counter()
                pending = backend.submit(batch)
                t1 = time.perf_counter()
                pending.result_bytes()
                if call >= 5:
                    times[name].append(t1 - t0)
        backend._bucket_max, staging.FILL_THREADED_BYTES = bucket_max, saved
        row = {"rows": B, **{name: 1e6 * statistics.median(t) for name, t in times.items()}}
        results.append(row)
        print(json.dumps(row), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backend_variants.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                            "results": results}, indent=1))
    print("| rows | " + " | ".join(f"{v} (us)" for v in variants) + " |\n|---|" + "---|" * len(variants))
    for r in results:
        print(f"| {r['rows']} | " + " | ".join(f"{r[v]:.1f}" for v in variants) + " |")


def _pieces(B: int, calls: int) -> None:
    """Host time of each step of CudaBackend.submit for one bf16 request of B sessions, as a big
    unary request (issue 4 (c)) reaches it: fill, the deferred NaN/Inf check, the H2D copy call,
    the kernel launch, the D2H copy call, the event record."""
    from gdn_server.backends import cuda

    shape = PRESETS["qwen3-next"]
    backend = CudaBackend(shape, random_gate_params(shape, 0), max_sessions=512, device="cuda:0")
    backend.warmup()
    H, HV, K = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k
    x = {n: torch.randn(B, 1, *s).bfloat16() for n, s in
         (("q", (H, K)), ("k", (H, K)), ("v", (HV, K)), ("a", (HV,)), ("b", (HV,)))}
    raw = tuple(x[n].view(torch.int16).numpy().tobytes() for n in "qkvab")
    work = DecodeWork(0, tuple(map(str, range(B))), positions=None, bf16_bytes=raw,
                      input_dims=tuple(tuple(x[n].shape) for n in "qkvab"), finite_checked=False)
    batch = StepBatch(1)
    batch.add(work, [r * shape.num_layers for r in range(B)])
    names = ("fill", "check", "h2d call", "kernel call", "d2h call", "event record", "device wait")
    times: dict[str, list[float]] = {n: [] for n in names}
    plan = backend._plan(B, 1)
    for i in range(calls + 20):
        staging = backend._staging_for(plan)
        views = staging.views_for(plan, (B, 1))
        t = [time.perf_counter()]
        cuda._fill_staging(batch, plan, staging.host_mem, staging.host_bytes, views.host)
        t.append(time.perf_counter())
        assert not cuda._staged_nonfinite(batch, plan, views)
        t.append(time.perf_counter())
        with torch.cuda.stream(backend.stream):
            views.dev_all.copy_(views.host_all, non_blocking=True)
            t.append(time.perf_counter())
            dev = views.dev
            backend._kernel(backend.state_pool, dev["slots"], dev["layers"], dev["q"], dev["k"], dev["v"], dev["a"],
                            dev["b"], backend.A_log, backend.dt_bias, views.out_dev, scale=backend.scale)
            t.append(time.perf_counter())
            views.out_host.copy_(views.out_dev, non_blocking=True)
            t.append(time.perf_counter())
            staging.done.record(backend.stream)
            t.append(time.perf_counter())
        staging.done.synchronize()
        t.append(time.perf_counter())
        if i >= 20:
            for n, a, b in zip(names, t, t[1:]):
                times[n].append(b - a)
    print(f"B={B}: host pinned buffer is_pinned={views.host_all.is_pinned()}")
    print("| step of submit | p50 us |\n|---|---|")
    for n in names:
        print(f"| {n} | {1e6 * statistics.median(times[n]):.1f} |")


if __name__ == "__main__":
    main()
