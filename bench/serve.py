"""Serving benchmark: one server under gdn-loadtest, beside a plain gRPC echo of the same bytes.

Parts, each against a fresh server process (qwen3-next on one GPU by default):
  stream     N streaming clients (DecodeStream), one session each, T=1, every layer cycled per
             token; N = --clients (1, 64, 256);
  big        one client sending B = --batch-sessions sessions per unary request (256);
  unbatched  the stream part again with --max-batch-rows 1 (only with --unbatched): what
             batching buys.
With --shared-memory system,cuda the stream and big parts run again with the clients' tensors in
shared memory (gdn-loadtest --shared-memory; parts "stream-system", "big-cuda", ...), against the
same server (--allow-shared-memory), beside the inline ones.
`gdn-loadtest --echo` runs the same load against a bytes echo server right after each of our
runs, in the same call, so each pair sees the host in the same state (for a shared-memory run:
the small messages it sends). A host's echo rate moves 10-20% from one call to the next: compare
the ratios, not absolute figures across calls.

    python bench/serve.py                                    # the H200 figures of bench/RESULTS.md
    python bench/serve.py --clients 64 --rounds 3            # one point, three pairs of runs
    python bench/serve.py --server-tree ../old               # another commit's server, this load
    python bench/serve.py --server-tree .before --server-tree .   # before and after, one run
    python bench/serve.py --shared-memory system,cuda        # inline, host shm and CUDA IPC
    python bench/serve.py --device cpu --model "--layers 4 --q-heads 2 --v-heads 4" \\
        --clients 1,8 --batch-sessions 16 --duration 2       # a smoke run on any machine
    python bench/serve.py --null-launch --clients 1 --rounds 2   # qwen3-next shapes, no GPU

--null-launch measures the server without its kernels, on any machine: a CPU server whose launches
do no math (each answers zeros of the output's shape) and everything else real (gRPC, admission,
validation and its C pass, scheduler, planner, answers). Beside the echo it says what the
server's own work adds to a step; with --server-tree, which of two commits adds less, with no GPU.

Parts with the same server flags share one server process, started afresh for them. With several
--server-tree, a server of each tree runs side by side (the idle ones take no CPU; --max-sessions
bounds the GPU memory each holds) and every part runs against each tree in turn, round by round
(parts named "<tree>:<part>"): with --rounds 3, A B A B A B rather than A A A B B B, so that a
host whose speed drifts within the call moves both trees' figures alike.
Prints one table; writes bench/out/serve-<UTC time>.json (every gdn-loadtest document, the
server and load commands, date, commit and this command line).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

import common

# `--null-launch`: gdn-server (its own command line, after `-c`) with the CPU backend's launch
# replaced by one that does no math
NULL_LAUNCH = """
import sys, torch
from gdn_server.backends import cpu
from gdn_server.backends.base import DoneStep
from gdn_server.cli import main
outputs = {}
def submit(self, batch):
    key = (batch.num_rows, batch.tokens)
    if key not in outputs:
        outputs[key] = DoneStep(torch.zeros(*key, self.shape.num_v_heads, self.shape.head_dim_v, dtype=torch.bfloat16))
    return outputs[key]
cpu.CpuBackend.submit = submit
sys.exit(main(sys.argv[1:]))
"""


def parts(args: argparse.Namespace) -> list[tuple[str, list[str], list[str]]]:
    """(name, extra server flags, gdn-loadtest flags) of each part to run."""
    timing = ["--duration", str(args.duration), *shlex.split(args.load_flags)]  # one round a run: main() repeats
    stream = ["--mode", "stream", "--tokens", "1", "--clients", args.clients,
              "--processes", str(args.load_processes), *timing]
    modes = [m for m in args.shared_memory.split(",") if m]
    server = ["--allow-shared-memory"] if modes else []
    chosen = []
    for mode in ["none", *modes]:
        suffix, where = ("", []) if mode == "none" else (f"-{mode}", ["--shared-memory", mode])
        if args.clients:
            chosen.append((f"stream{suffix}", server, [*stream, "--echo", *where]))
        if args.batch_sessions > 0:
            chosen.append((f"big{suffix}", server, ["--mode", "unary", "--tokens", "1", "--clients", "1",
                                                   "--batch", str(args.batch_sessions), "--echo", *timing, *where]))
    if args.unbatched and args.clients:
        chosen.append(("unbatched", ["--max-batch-rows", "1"], stream))
    return chosen


def table(results: list[dict]) -> str:
    rows = []
    for part in results:
        doc = part["loadtest"]
        echoes = {(r["clients"], r["batch"], r.get("round", 0)): r for r in common.runs(doc, "echo")}
        for r in common.runs(doc):
            e = echoes.get((r["clients"], r["batch"], r.get("round", 0)))
            p50 = r["latency_ms"]["p50"]
            rows.append([
                part["part"], part.get("round", 0), r["clients"], r["batch"], common.fmt(r["steps_per_s"]),
                f"{p50:.3f}", f"{r['latency_ms']['p99']:.3f}", common.fmt(common.rows_per_launch(r), ".1f"),
                common.fmt(e and e["steps_per_s"]), f"{e['latency_ms']['p50']:.3f}" if e else "-",
                f"{100 * r['steps_per_s'] / e['steps_per_s']:.0f}%" if e else "-",
                f"{p50 / e['latency_ms']['p50']:.2f}x" if e else "-",
            ])
    return common.markdown_table(
        ["part", "round", "clients", "B", "steps/s", "p50 ms", "p99 ms", "rows/launch", "echo steps/s", "echo p50 ms",
         "steps/s % of echo", "p50 / echo p50"], rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0", help="server shape flags (one GPU)")
    p.add_argument("--clients", default="1,64,256", help="clients values of the stream part ('' skips it)")
    p.add_argument("--batch-sessions", type=int, default=256, help="B of the big part (0 skips it)")
    p.add_argument("--unbatched", action="store_true", help="also run the stream part with --max-batch-rows 1")
    p.add_argument("--shared-memory", default="", help="also run the stream and big parts with the tensors in "
                                                       "shared memory of these kinds: system, cuda (e.g. system,cuda)")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    p.add_argument("--rounds", type=int, default=1,
                   help="pairs of runs (ours, then the echo's) per point; with several trees, each round "
                        "runs every tree before the next round starts")
    p.add_argument("--load-processes", type=int, default=4,
                   help="load processes of the stream parts (the echo's too): one Python process costs "
                        "~40-60 us of CPU per step and would bound a run near 64 clients by itself")
    p.add_argument("--max-sessions", type=int, default=512)
    p.add_argument("--server-flags", default="",
                   help="more gdn-server flags for every part, e.g. --server-flags='--max-batch-rows 64'")
    p.add_argument("--load-flags", default="",
                   help="more gdn-loadtest flags for every part, e.g. --load-flags='--dtype f32'")
    p.add_argument("--server-tree", action="append", default=None,
                   help="run the server from this source tree instead of this checkout (e.g. an older "
                        "commit's; '.' is this checkout); given several times, every part runs against "
                        "each tree in turn, to measure before and after in one run; the load stays this one's")
    p.add_argument("--null-launch", action="store_true",
                   help="a CPU server whose launches do no math: the server's own cost beside the echo, no GPU")
    p.add_argument("--out", default=None, help="folder of the result file (default bench/out)")
    args = p.parse_args()
    if args.null_launch:
        args.device = "cpu"
        if args.model == p.get_default("model"):  # the same shapes, not on GPU 0
            args.model = "--preset qwen3-next"

    path = common.out_path("serve", args.out)
    results: list[dict] = []
    groups: dict[tuple[str, ...], list[tuple[str, list[str]]]] = {}  # server flags -> its parts
    for name, server_flags, load_flags in parts(args):
        groups.setdefault(tuple(server_flags), []).append((name, load_flags))
    trees = args.server_tree or [None]
    with tempfile.TemporaryDirectory() as tmp:
        for server_flags, group in groups.items():
            cmd = common.server_command(args.device, args.model, args.max_sessions,
                                        [*server_flags, *shlex.split(args.server_flags)])
            if args.null_launch:  # the same command line, through NULL_LAUNCH
                cmd = [sys.executable, "-c", NULL_LAUNCH, *cmd[cmd.index("gdn_server") + 1:]]
            servers = [common.Server(cmd, cwd=tree if tree not in (None, ".") else None) for tree in trees]
            try:
                for server in servers:  # their warm-ups overlap
                    server.start()
                for server in servers:
                    server.wait()
                for round_index in range(args.rounds):
                    for tree, server in zip(trees, servers):
                        label = f"{tree}:" if len(trees) > 1 else ""
                        for name, load_flags in group:
                            doc = common.run_loadtest(server.target, Path(tmp) / f"{name}.json", load_flags)
                            results.append({"part": label + name, "round": round_index, "server_tree": tree,
                                            "server_command": common.shown(cmd),
                                            "loadtest_flags": shlex.join(load_flags), "loadtest": doc})
                        common.write_json(path, {"args": vars(args), "parts": results})  # survives a failure
            finally:
                for server in servers:
                    server.stop()
    print()
    print(table(results))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
