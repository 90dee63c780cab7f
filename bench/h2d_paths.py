"""Ways to get a big request's inputs onto the GPU and check them for NaN/Inf (issue 4 (c)).

    python bench/h2d_paths.py --batch 256 --out bench/results/h2d_paths

For one B-session request of the qwen3-next preset (q, k: B*16*128 bf16; v: B*32*128; a, b: B*32),
held as bytes objects (as the server's parser leaves them), it times per request:
  staged      memcpy into a pinned buffer (torch's pool for >= 512 KiB, as the server does), one
              host-to-device copy, synchronize
  pageable    a host-to-device copy from each bytes object as it is (torch copy_: the driver
              stages pageable memory itself), synchronize
  cpu_check   the server's NaN/Inf check on the host (gdn_client.wire.first_nonfinite)
  gpu_check   per-row NaN/Inf flags computed on the device from the copied inputs, copied back,
              synchronize (what a check after the host-to-device copy costs)
Requests rotate over 8 distinct byte sets (no warm cache). Median of --iters, in microseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_client import wire  # noqa: E402
from gdn_client.proto.gdn.v1 import gdn_pb2  # noqa: E402
from gdn_server.backends.staging import PARALLEL_COPY_BYTES  # noqa: E402


def _bytes(n: int, gen: torch.Generator) -> bytes:
    return torch.randn(n, generator=gen).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default="bench/results/h2d_paths")
    args = p.parse_args()
    B = args.batch
    sizes = [B * 16 * 128, B * 16 * 128, B * 32 * 128, B * 32, B * 32]  # bf16 values per input
    gen = torch.Generator().manual_seed(0)
    sets = [[_bytes(n, gen) for n in sizes] for _ in range(8)]
    total = sum(sizes) * 2
    dev = torch.device("cuda")
    stream = torch.cuda.Stream()
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pinned_np = pinned.numpy()
    pinned_mem = memoryview(pinned_np)
    dev_buf = torch.empty(total, dtype=torch.uint8, device=dev)
    offsets, o = [], 0
    for n in sizes:
        offsets.append(o)
        o += n * 2
    flags_host = torch.empty(B, dtype=torch.bool, pin_memory=True)

    def staged(bufs):
        for off, data in zip(offsets, bufs):
            if len(data) >= PARALLEL_COPY_BYTES:
                torch.from_numpy(pinned_np[off:off + len(data)]).copy_(torch.frombuffer(data, dtype=torch.uint8))
            else:
                pinned_mem[off:off + len(data)] = data
        with torch.cuda.stream(stream):
            dev_buf.copy_(pinned, non_blocking=True)
        stream.synchronize()

    def pageable(bufs):
        with torch.cuda.stream(stream):
            for off, data in zip(offsets, bufs):
                dev_buf[off:off + len(data)].copy_(torch.frombuffer(data, dtype=torch.uint8), non_blocking=True)
        stream.synchronize()

    def cpu_check(bufs):
        assert wire.first_nonfinite(bufs, gdn_pb2.BF16) is None

    def gpu_check(bufs):
        with torch.cuda.stream(stream):
            bad = None
            for off, n in zip(offsets, sizes):
                x = dev_buf[off:off + 2 * n].view(torch.bfloat16).view(B, -1)
                row_bad = ~torch.isfinite(x).all(dim=1)
                bad = row_bad if bad is None else bad | row_bad
            flags_host.copy_(bad, non_blocking=True)
        stream.synchronize()
        assert not bool(flags_host.any())

    results = {}
    for name, fn in (("staged", staged), ("pageable", pageable), ("cpu_check", cpu_check), ("gpu_check", gpu_check)):
        for i in range(10):
            fn(sets[i % 8])
        times = []
        for i in range(args.iters):
            bufs = sets[i % 8]
            t0 = time.perf_counter()
            fn(bufs)
            times.append(time.perf_counter() - t0)
        results[name] = {"p50_us": statistics.median(times) * 1e6, "min_us": min(times) * 1e6}
    lines = [f"B={B}, {total / 2**20:.2f} MiB of inputs, torch threads {torch.get_num_threads()}",
             "| path | p50 us | min us |", "|---|---|---|"]
    lines += [f"| {k} | {v['p50_us']:.0f} | {v['min_us']:.0f} |" for k, v in results.items()]
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h2d_paths.json").write_text(json.dumps({"batch": B, "bytes": total, "results": results,
                                                     "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    (out / "h2d_paths.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
