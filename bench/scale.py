"""Scale benchmark: K plain server processes on one GPU, the clients shared out among them.

For each K of --processes it starts K independent `gdn-server` processes on the same device
(each with its own port and its own sessions; they share nothing but the GPU and the host),
then for each clients value N runs one gdn-loadtest per server at once, each with N/K of the
clients (DecodeStream, T=1, every layer cycled). K=1 is one server with all the clients: the
reference the others are read against.

    python bench/scale.py                                  # K = 1, 4, 8 at 64 and 256 clients (H200)
    python bench/scale.py --processes 4 --clients 256 --duration 10
    python bench/scale.py --launch one-command             # one `gdn-server --processes K` instead
    python bench/scale.py --device cpu --model "--layers 4 --q-heads 2 --v-heads 4" \\
        --processes 1,2 --clients 8 --duration 2           # a smoke run on any machine

The K load runs start together but each warms up on its own, so their own measured windows
differ by a second or two, and the sum of their figures would overstate what K servers do at
once. So steps/s is counted on the servers instead, over one window of --duration seconds that
all K loads cover: once every server has answered its clients' first steps, the servers'
request counters (GetStats) are read, then read again --duration seconds later. Each load runs
--slack seconds longer than the window; "loads throughout" says whether all K were still
running when the window closed (if not, raise --slack). Latencies are the loads' own.

The K servers of a GPU share it through an MPS daemon this script starts (as `gdn-server
--processes K` does for its processes), so that they measure what the one command serves.

With --launch one-command it starts one `gdn-server --processes K` (K server processes behind
one port) and one gdn-loadtest with all N clients against it (its processes start measuring
together); steps/s is then that load's own figure.

No echo floor here: bench/serve.py measures it beside one server.

Prints one table; writes bench/out/scale-<UTC time>.json (every gdn-loadtest document, the
commands, date, commit and this command line).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import common
from gdn_loadtest.processes import shares
from gdn_server.supervisor import Mps

ONE_COMMAND_FLAG = "--processes"  # gdn-server's flag for K processes on one device


def start_servers(args: argparse.Namespace, k: int) -> list[common.Server]:
    flags = shlex.split(args.server_flags)
    if args.launch == "one-command":
        if k > 1:
            flags = [ONE_COMMAND_FLAG, str(k), *flags]
        cmds = [common.server_command(args.device, args.model, args.max_sessions, flags)]
    else:
        per_server = args.max_sessions or math.ceil(max(args.clients) / k) + 16
        cmds = [common.server_command(args.device, args.model, per_server, flags) for _ in range(k)]
    # K separate servers on one GPU share it as `gdn-server --processes K` does: through MPS
    env = {**os.environ, **args.mps_env} if args.mps_env and k > 1 else None
    servers = [common.Server(cmd, env=env, cwd=args.server_tree).start() for cmd in cmds]  # their warm-ups overlap
    try:
        for server in servers:
            server.wait()
    except Exception:
        for server in servers:
            server.stop()
        raise
    return servers


def common_window(servers: list[common.Server], clients: list[int], loads: list[subprocess.Popen], seconds: float,
                  settle: float = 1.0, timeout: float = 300.0) -> dict:
    """Steps/s summed over the servers within one window of `seconds` that every load covers,
    from the servers' own counters."""
    from gdn_client import Client

    stubs = [Client(s.target) for s in servers]
    try:
        base = [c.stats() for c in stubs]
        deadline = time.monotonic() + timeout
        # past its warm-up a load's clients have each had more than their first steps answered
        while any(c.stats().requests - b.requests <= 2 * n for c, b, n in zip(stubs, base, clients)):
            if any(p.poll() is not None for p in loads):
                raise RuntimeError("a load ended before every load had started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the loads did not all start within {timeout:.0f} s")
            time.sleep(0.1)
        time.sleep(settle)
        before, t0 = [c.stats() for c in stubs], time.monotonic()
        time.sleep(seconds)
        after, t1 = [c.stats() for c in stubs], time.monotonic()
        throughout = all(p.poll() is None for p in loads)
    finally:
        for c in stubs:
            c.close()
    deltas = [a.since(b) for a, b in zip(after, before)]
    launches = sum(d.launches for d in deltas)
    return {"window_s": t1 - t0, "steps_per_s": sum(d.requests for d in deltas) / (t1 - t0),
            "steps_per_s_by_server": [d.requests / (t1 - t0) for d in deltas],
            "rows_per_launch": sum(d.rows_launched for d in deltas) / launches if launches else float("nan"),
            "loads_throughout": throughout}


def load_point(args: argparse.Namespace, servers: list[common.Server], clients: int, tmp: Path) -> dict:
    """N clients over the servers, one gdn-loadtest each, at once."""
    per_server = shares(clients, len(servers))
    servers = servers[: len(per_server)]
    load_procs = shares(max(args.load_processes, len(servers)), len(servers))
    counted_here = args.launch == "separate"
    duration = args.duration + args.slack if counted_here else args.duration
    running = []
    for i, (server, n, procs) in enumerate(zip(servers, per_server, load_procs)):
        flags = ["--mode", "stream", "--tokens", "1", "--clients", str(n), "--processes", str(procs),
                 "--duration", str(duration), "--seed", str(i), *shlex.split(args.load_flags)]
        out = tmp / f"k{len(servers)}_n{clients}_{i}.json"
        running.append((out, flags, common.start_loadtest(server.target, out, flags)))
    window = None
    try:
        if counted_here:
            window = common_window(servers, per_server, [proc for *_, proc in running], args.duration)
    finally:
        failed = []
        for _, flags, proc in running:
            _, err = proc.communicate(timeout=duration + 900)
            if proc.returncode:
                failed.append(f"gdn-loadtest failed ({' '.join(flags)}):\n{err[-3000:]}")
    if failed:
        raise RuntimeError("\n".join(failed))
    docs = [json.loads(out.read_text()) for out, *_ in running]
    gdn = [common.runs(doc)[0] for doc in docs]
    loads_sum = sum(r["steps_per_s"] for r in gdn)
    return {
        "clients": clients, "servers": len(servers), "clients_per_server": per_server, "load_processes": load_procs,
        "steps_per_s": window["steps_per_s"] if window else loads_sum,
        "steps_per_s_loads_sum": loads_sum,
        "window": window,
        "p50_ms_median_of_servers": statistics.median(r["latency_ms"]["p50"] for r in gdn),
        "p99_ms_max_of_servers": max(r["latency_ms"]["p99"] for r in gdn),
        "rows_per_launch": window["rows_per_launch"] if window else common.rows_per_launch(gdn[0]),
        "loads_throughout": window["loads_throughout"] if window else True,
        "errors": sum(r["errors"] for r in gdn),
        "loadtests": docs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0", help="server shape flags (one GPU)")
    p.add_argument("--processes", default="1,4,8", help="server processes K, a comma list")
    p.add_argument("--clients", default="64,256", help="clients N over all servers, a comma list")
    p.add_argument("--duration", type=float, default=6.0, help="seconds of the measured window")
    p.add_argument("--slack", type=float, default=6.0,
                   help="seconds each load runs beyond the window, to cover the others' warm-ups")
    p.add_argument("--load-processes", type=int, default=8,
                   help="load processes in all, shared out among the servers (at least one each)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="per server (default: its share of the largest clients value, plus 16; "
                        "the server's own default would give each process most of the GPU's memory)")
    p.add_argument("--launch", choices=("separate", "one-command"), default="separate",
                   help="K separate gdn-server commands (default), or one `gdn-server --processes K`")
    p.add_argument("--server-flags", default="",
                   help="more gdn-server flags for every server, e.g. --server-flags='--max-batch-rows 64'")
    p.add_argument("--load-flags", default="", help="more gdn-loadtest flags for every load run")
    p.add_argument("--server-tree", default=None,
                   help="run the servers from this source tree instead of this checkout (e.g. an older "
                        "commit's, to measure before and after in one session); the load stays this one's")
    p.add_argument("--out", default=None, help="folder of the result file (default bench/out)")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    ks = [int(k) for k in args.processes.split(",")]

    path = common.out_path("scale", args.out)
    points: list[dict] = []
    mps = Mps.start() if args.launch == "separate" and args.device == "cuda" and max(ks) > 1 else None
    args.mps_env = mps.env if mps is not None else None  # recorded in the JSON with the other arguments
    with contextlib.ExitStack() as cleanup, tempfile.TemporaryDirectory() as tmp:
        if mps is not None:
            cleanup.callback(mps.stop)
        for k in ks:
            servers = start_servers(args, k)
            try:
                for clients in args.clients:
                    # one-command: one address, and the server shares the connections out
                    point = load_point(args, servers, clients, Path(tmp))
                    point.update(processes=k, launch=args.launch,
                                 server_commands=[common.shown(s.cmd) for s in servers])
                    points.append(point)
                    print(f"K={k} N={clients}: {point['steps_per_s']:,.0f} steps/s, loads throughout: "
                          f"{point['loads_throughout']}", flush=True)
                    common.write_json(path, {"args": vars(args), "points": points})
            finally:
                for server in servers:
                    server.stop()

    rows = [[pt["processes"], pt["clients"], "/".join(map(str, sorted(set(pt["clients_per_server"])))),
             common.fmt(pt["steps_per_s"]), f"{pt['p50_ms_median_of_servers']:.3f}",
             f"{pt['p99_ms_max_of_servers']:.3f}", common.fmt(pt["rows_per_launch"], ".1f"),
             "yes" if pt["loads_throughout"] else "NO", pt["errors"]] for pt in points]
    print()
    print(common.markdown_table(["processes K", "clients N", "clients per server", "steps/s (sum)",
                                 "p50 ms (median of servers)", "p99 ms (worst server)", "rows/launch",
                                 "loads throughout", "errors"], rows))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
