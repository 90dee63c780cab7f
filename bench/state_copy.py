"""A plain copy of a step's state traffic on this GPU, timed in the same run as the kernels.

A decode step reads each batch row's state (one [HV, 128, 128] block of the pool at the row's
slot) and, for a plain step, writes it back in place; a speculative verify only reads it. The
kernels below do that and nothing else (Triton, one program per tile of one (row, head) state):
the plainest kernel that moves the same bytes from the same slots. It is a yardstick, not a
floor: a kernel that streams its tiles more cleverly can beat it (FlashInfer's fp32 T = 1 kernel
ran 1% below it at B = 512 on the H200, bench/RESULTS.md).

    us = state_copy_us(pool, slot_sets, write=True)   # best of TILINGS, CUDA-graph median
"""
from __future__ import annotations

from typing import Sequence

import torch

try:  # GPU hosts; importing this module (and the scripts that do, for their --help) needs no Triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# (elements per program, warps): the tilings timed; the copy's time is the fastest. 4096 fp32 elements
# is a 32-row tile of one head, as the decode kernel's CTA holds.
TILINGS = ((4096, 4), (8192, 4), (16384, 8))

if triton is not None:
    @triton.jit
    def _state_pass(pool, slots, sink, TILE: tl.constexpr, TILES: tl.constexpr, HEAD: tl.constexpr, HV: tl.constexpr,
                    WRITE: tl.constexpr):
        pid = tl.program_id(0)
        tile = pid % TILES
        head = (pid // TILES) % HV
        row = pid // (TILES * HV)
        slot = tl.load(slots + row).to(tl.int64)
        base = pool + slot * (HV * HEAD) + head * HEAD + tile * TILE
        offs = tl.arange(0, TILE)
        x = tl.load(base + offs)
        if WRITE:
            tl.store(base + offs, x)  # in place, as a step writes its state back
        else:
            tl.store(sink + pid, tl.sum(x.to(tl.float32), axis=0))  # one value per tile: the loads stay live


def state_copy_us(pool: torch.Tensor, slot_sets: Sequence[torch.Tensor], write: bool = True, rep_ms: int = 100) -> float:
    """Device time of reading (and, with `write`, rewriting in place) the states of one slot set
    of a pool [N, HV, V, K], the sets rotated call by call as the kernels' timings rotate theirs;
    the fastest of TILINGS, each the median of a CUDA-graph replay."""
    import triton.testing as tt

    HV, head = pool.shape[1], pool.shape[2] * pool.shape[3]
    B = slot_sets[0].shape[0]
    sink = torch.empty(B * HV * head // min(t for t, _ in TILINGS), device=pool.device, dtype=torch.float32)
    best = float("inf")
    for tile, warps in TILINGS:
        i = [0]

        def run():
            slots = slot_sets[i[0] % len(slot_sets)]
            i[0] += 1
            _state_pass[(B * HV * (head // tile),)](pool, slots, sink, TILE=tile, TILES=head // tile, HEAD=head,
                                                    HV=HV, WRITE=write, num_warps=warps)

        run()
        torch.cuda.synchronize()
        best = min(best, 1e3 * tt.do_bench_cudagraph(run, rep=rep_ms, return_mode="median"))
    return best
