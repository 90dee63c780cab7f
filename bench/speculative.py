"""Cost of speculative steps on the GPU, side by side with the plain step.

A speculative step is the plain kernel writing its new state to a scratch slot (`out_slots`)
instead of in place, so the step it started from survives until Commit. A full accept adopts the
scratch slot (no GPU work); a partial accept of n tokens replays them: one plain step with T = n.
Rules to check: spec / plain <= 1.25 at the same B and T, and a rollback costs at most one plain
step (replay(n) <= plain(T)).

Method as bench/kernel.py: H=16, HV=32, a 4096-slot pool, random slots, 8 rotated slot sets, device
time by CUDA-graph replay (median).

    python bench/speculative.py

Prints one table; writes bench/out/speculative-<UTC time>.json (with date, commit and command).
"""
from __future__ import annotations

import argparse
import json

import common  # first: it puts this checkout on sys.path
import torch

from gdn_server.kernels import gdn_decode

H, HV, D, SLOTS, SETS = 16, 32, 128, 4096, 8


def _inputs(B: int, T: int, gen: torch.Generator) -> dict:
    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    return dict(q=r(B, T, H, D), k=r(B, T, H, D), v=r(B, T, HV, D), a=r(B, T, HV), b=r(B, T, HV),
                out=torch.empty(B, T, HV, D, device="cuda", dtype=torch.bfloat16))


def _time(fn) -> float:
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return 1e3 * tt.do_bench_cudagraph(fn, rep=200, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="128x4,512x4,128x8,512x8", help="BxT list")
    p.add_argument("--out", default=None, help="folder of the result file (default bench/out)")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = (torch.randn(SLOTS, HV, D, D, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    L = 36
    A_log = torch.randn(L, HV, device="cuda", generator=gen)
    dt_bias = torch.randn(L, HV, device="cuda", generator=gen)
    rows = []
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        sets = []
        for _ in range(SETS):  # disjoint read and write slots, rotated so the state is cold in L2
            perm = torch.randperm(SLOTS, device="cuda", generator=gen).to(torch.int32)
            layers = torch.randint(0, L, (B,), device="cuda", generator=gen, dtype=torch.int32)
            sets.append((perm[:B].contiguous(), perm[B : 2 * B].contiguous(), layers, _inputs(B, T, gen)))
        i = [0]

        def step(spec: bool, tokens: int):
            # a replay of the accepted prefix gets contiguous inputs, as the server stages them;
            # made here, outside the timed launch, so copy kernels are not counted as the replay's
            inputs = [{n: x[n][:, :tokens].contiguous() for n in x} for *_, x in sets]

            def run():
                slots, scratch, layers, _ = sets[i[0] % SETS]
                x = inputs[i[0] % SETS]
                i[0] += 1
                gdn_decode(pool, slots, layers, x["q"], x["k"], x["v"], x["a"], x["b"], A_log, dt_bias, x["out"],
                           **({"out_slots": scratch} if spec else {}))
            return run

        plain = _time(step(False, T))
        spec = _time(step(True, T))
        replays = {n: _time(step(False, n)) for n in sorted({1, T // 2, T - 1}) if n >= 1}
        row = {"B": B, "T": T, "plain_us": plain, "speculative_us": spec, "spec_over_plain": spec / plain,
               "rollback_replay_us": replays, "worst_rollback_over_plain": max(replays.values()) / plain}
        rows.append(row)
        print(json.dumps(row), flush=True)
    path = common.write_json(common.out_path("speculative", args.out), {"args": vars(args), "rows": rows})
    table = common.markdown_table(
        ["B", "T", "plain us", "speculative us", "spec/plain (<= 1.25)", "rollback replay us (n: us)",
         "worst replay / plain (<= 1)"],
        [[r["B"], r["T"], f"{r['plain_us']:.1f}", f"{r['speculative_us']:.1f}", f"{r['spec_over_plain']:.2f}",
          ", ".join(f"{n}: {t:.1f}" for n, t in r["rollback_replay_us"].items()),
          f"{r['worst_rollback_over_plain']:.2f}"] for r in rows])
    print(table)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
