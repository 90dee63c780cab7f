"""What the native module's threaded copies cost on this host, thread count by thread count.

    python bench/copy_threads.py                       # table; --json out.json for the figures

gdn_server._native starts its copy threads on every call (copy_bf16_spans for a big request's
inputs, encode_decode_response for a big reply). This times, per thread count:
- a call on 2 bytes: the cost of starting and joining the threads alone;
- a B=256 request's inputs (q, k, v, a, b of qwen3-next, ~4.1 MiB) copied into a staging-sized
  buffer, with and without the NaN/Inf check in the same pass;
- a B=256 reply (2 MiB of output) encoded;
- the same inputs written into a worker's request ring (ring_write: streaming stores, shared
  memory of the link's size), at the ring's successive places.
Sources are rotated over 4 sets, so no copy reads what the last one just read. Median of --runs.
"""
from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402

from gdn_server.link_ring import REQUEST_RING_BYTES  # noqa: E402
from gdn_server.native import module as native  # noqa: E402
from gdn_server.tuning import tune_malloc  # noqa: E402

SETS = 4


def _median_us(fn, runs: int) -> float:
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--json", default="")
    args = p.parse_args()
    if native is None:
        sys.exit("gdn_server._native is not built (or GDN_NATIVE=0): nothing to time")
    tune_malloc()
    rng = np.random.default_rng(0)
    B, H, HV, K = 256, 16, 32, 128
    sizes = (B * H * K, B * H * K, B * HV * K, B * HV, B * HV)  # bf16 elements of q, k, v, a, b

    def bf16(n: int) -> bytes:  # finite bf16 words: the high halves of float32 normals
        return (rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()

    inputs = [[bf16(n) for n in sizes] for _ in range(SETS)]
    outputs = [memoryview(bf16(B * HV * K)) for _ in range(SETS)]
    dst = bytearray(sum(2 * n for n in sizes) + 4096)
    offsets = np.cumsum([0, *[2 * n for n in sizes[:-1]]]).tolist()
    positions = tuple(range(B))
    ring = mmap.mmap(-1, REQUEST_RING_BYTES)  # shared memory, as link_ring.make_shared maps it
    ring_view = memoryview(ring)
    laps = REQUEST_RING_BYTES // len(dst)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        row = {"threads": threads}
        row["start_join_us"] = _median_us(lambda i: native.copy_bf16_spans(dst, [(0, b"\0\0", False)], threads), args.runs)
        for check in (False, True):
            key = "inputs_copy_check_us" if check else "inputs_copy_us"
            row[key] = _median_us(
                lambda i: native.copy_bf16_spans(dst, [(o, x, check) for o, x in zip(offsets, inputs[i % SETS])], threads),
                args.runs,
            )
        row["ring_write_us"] = _median_us(
            lambda i: native.ring_write(ring_view, (i % laps) * len(dst), inputs[i % SETS], threads), args.runs
        )
        row["reply_2mib_us"] = _median_us(
            lambda i: native.encode_decode_response(outputs[i % SETS], (B, 1, HV, K), positions, "r", threads), args.runs
        )
        rows.append(row)
    print("| threads | start + join only us | B=256 inputs copy us | copy + NaN/Inf check us | inputs into a request ring us "
          "| 2 MiB reply us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['start_join_us']:.1f} | {r['inputs_copy_us']:.1f} | {r['inputs_copy_check_us']:.1f} "
              f"| {r['ring_write_us']:.1f} | {r['reply_2mib_us']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
