"""What checking a decode request costs the event loop, per request, on this machine's CPU.

The server's code from a request's wire bytes to its DecodeWork (`parse_decode_request`, then
`decode_work`): the qwen3-next shapes, one session a request, T = 1, `--requests` requests a turn
of the event loop. Three ways of sending the same step:

  inline   the tensors' bytes in the message;
  system   references into a host shared-memory region the caller registered;
  cuda     references into a CUDA region, the copy out of it made by a memmove instead of a
           CUDA call (no GPU needed): what the CPU spends around that copy, which the server
           makes once for the requests of a turn (`shared_memory.DeviceAccess.read`).

    python bench/validation.py                  # 32 requests a turn
    python bench/validation.py --requests 1,32

Prints one table (median microseconds a request) and writes bench/out/validation-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import markdown_table, out_path, write_json  # noqa: E402
from gdn_client._shared_memory import Region  # noqa: E402
from gdn_client.proto.gdn.v1 import gdn_pb2  # noqa: E402
from gdn_server.config import ModelShape  # noqa: E402
from gdn_server.limits import SharedMemoryLimits  # noqa: E402
from gdn_server.shared_memory import DeviceAccess, SharedMemoryRegistry  # noqa: E402
from gdn_server.validation import PendingCheck, decode_work, parse_decode_request, step_limits  # noqa: E402

SHAPE = ModelShape(num_layers=48, num_q_heads=16, num_v_heads=32, head_dim_k=128, head_dim_v=128)
OWNER = "bench"


class HostCopies(DeviceAccess):
    """A DeviceAccess whose copies out of "CUDA memory" are memmoves from host memory."""

    def __init__(self) -> None:  # no torch.cuda: nothing of a GPU is opened
        self._reads = None

    def pin(self, address: int, nbytes: int) -> None:
        return None

    def _copy_out(self, runs: list[tuple[int, int]]) -> bytearray:
        out = bytearray(max(1, sum(end - start for start, end in runs)))
        base, offset = ctypes.addressof(ctypes.c_char.from_buffer(out)), 0
        for start, end in runs:
            ctypes.memmove(base + offset, start, end - start)
            offset += end - start
        return out


def requests(region: Region) -> tuple[bytes, bytes]:
    """One step's serialized request, inline and by reference into `region` (o_ref too)."""
    S = SHAPE
    tensors = [torch.randn(1, 1, S.num_q_heads, S.head_dim_k), torch.randn(1, 1, S.num_q_heads, S.head_dim_k),
               torch.randn(1, 1, S.num_v_heads, S.head_dim_v), torch.randn(1, 1, S.num_v_heads),
               torch.randn(1, 1, S.num_v_heads)]
    inline = gdn_pb2.DecodeRequest(session_ids=["s0"], layer=3)
    by_ref = gdn_pb2.DecodeRequest(session_ids=["s0"], layer=3)
    for name, x in zip("qkvab", tensors):
        x = x.bfloat16()
        t = getattr(inline, name)
        t.dtype, t.data = gdn_pb2.BF16, x.view(torch.uint8).numpy().tobytes()
        t.shape[:] = list(x.shape)
        placed = region.tensor(x.shape)
        placed.copy_(x)
        t = getattr(by_ref, name)
        t.dtype, t.ref.region, t.ref.offset = gdn_pb2.BF16, region.name, region.reference(placed)
        t.shape[:] = list(x.shape)
    o = region.tensor((1, 1, S.num_v_heads, S.head_dim_v))
    by_ref.o_ref.region, by_ref.o_ref.offset = region.name, region.reference(o)
    return inline.SerializeToString(), by_ref.SerializeToString()


def per_request_us(data: bytes, registry: SharedMemoryRegistry, n: int, turns: int) -> float:
    """Median time of a turn of `n` requests checked (copies out made, as the servicer's poll does), a request."""
    limits, resolve, times = step_limits(SHAPE), registry.resolver(OWNER), []
    for _ in range(turns):
        start = time.perf_counter()
        works = [decode_work(parse_decode_request(data, limits), SHAPE, OWNER, OWNER, resolve) for _ in range(n)]
        for w in works:
            if type(w) is PendingCheck and w.ready():
                w.work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default="32", help="requests a turn, comma-separated")
    p.add_argument("--turns", type=int, default=2000)
    p.add_argument("--out", default=None, help="folder of the JSON (bench/out)")
    args = p.parse_args()

    region = Region(1 << 20)
    try:
        system = SharedMemoryRegistry(SharedMemoryLimits())
        system.register(OWNER, region.name, region.byte_size, system=(region._key, 0))
        cuda = SharedMemoryRegistry(SharedMemoryLimits(), device=HostCopies())
        mapped = cuda.register(OWNER, region.name, region.byte_size, system=(region._key, 0))
        host = torch.frombuffer(mapped.memory, dtype=torch.uint8)  # the region as "CUDA memory" at its address
        mapped.kind, mapped._device_memory, mapped._address, mapped._device = "cuda", host, host.data_ptr(), 0
        inline, by_ref = requests(region)
        first = decode_work(parse_decode_request(by_ref, step_limits(SHAPE)), SHAPE, OWNER, OWNER, cuda.resolver(OWNER))
        if type(first) is not PendingCheck:  # the "cuda" path must be the copy-out one it names
            raise SystemExit("a reference into the stand-in CUDA region was not copied out: this script needs updating")
        first.ready()
        for data, registry in ((inline, system), (by_ref, system), (by_ref, cuda)):  # warm-up
            per_request_us(data, registry, 1, args.turns // 10)
        rows = []
        for n in (int(x) for x in args.requests.split(",")):
            rows.append({"requests": n,
                         "inline_us": per_request_us(inline, system, n, args.turns),
                         "system_us": per_request_us(by_ref, system, n, args.turns),
                         "cuda_us": per_request_us(by_ref, cuda, n, args.turns)})
    finally:
        region.close()
    print(markdown_table(["requests a turn", "inline us", "system refs us", "cuda refs us (copy emulated)"],
                         [(r["requests"], f"{r['inline_us']:.2f}", f"{r['system_us']:.2f}", f"{r['cuda_us']:.2f}")
                          for r in rows]))
    print("wrote", write_json(out_path("validation", args.out), {"rows": rows}))


if __name__ == "__main__":
    main()
