"""Serving benchmark (issue 4): the service under load against a plain gRPC echo floor.

Runs, on one host (the GPU host for the published figures):
  (a) N = 1, 8, 64, 256 streaming clients, one session each, T=1, every layer cycled per token,
      qwen3-next preset: steps/s, p50/p99, mean rows per launch, with the echo floor beside it (d);
  (b) the same with batching off (--max-batch-rows 1);
  (c) one client sending B=256 sessions per request, unary: time per request against the
      server's device time per launch and the echo of the same bytes.
Each part is one `gdn-loadtest` run against a fresh server process, once per `--frontends` value
(0: gRPC in the engine process; N: N worker processes in front of it); results go to one JSON
file and a markdown table.

    python bench/serve.py --device cuda --frontends 0,4 --out bench/results   # one process, then 4 workers
    python bench/serve.py --device cuda --runs-on loop,thread                 # the scheduler on the loop vs a thread
    python bench/serve.py --device cpu --clients 1,8 --duration 2              # a smoke run anywhere
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from listening import start_listening  # this folder (python bench/serve.py puts it on sys.path)




def start_server(args: argparse.Namespace, *extra: str) -> tuple[subprocess.Popen, str]:
    sizing = [] if args.max_sessions is None else ["--max-sessions", str(args.max_sessions)]
    cmd = [sys.executable, "-m", "gdn_server", "--host", "127.0.0.1", "--port", "0", "--device", args.device,
           *args.model.split(), *sizing, "--log-level", "WARNING", *extra]
    return start_listening(cmd)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def loadtest(target: str, out: Path, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "gdn_client.loadtest", "--target", target, "--no-progress", "--json", str(out), *flags]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, timeout=1200)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0", help="server shape flags (one GPU)")
    p.add_argument("--clients", default="1,8,64,256")
    p.add_argument("--duration", type=float, default=4.0, help="seconds per load point")
    p.add_argument("--batch-sessions", type=int, default=256, help="B of part (c)")
    p.add_argument("--max-sessions", type=int, default=512)
    p.add_argument("--frontends", default="0", help="comma list of --frontends values, each run side by side")
    p.add_argument("--runs-on", default="auto",
                   help="comma list of --scheduler-runs-on values (auto, loop, thread), each run side by side")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--skip", default="", help="comma list of parts to skip: a,b,c")
    p.add_argument("--rounds", type=int, default=1,
                   help="each load point this many times, ours and the echo's alternately (gdn-loadtest --rounds)")
    p.add_argument("--load-processes", type=int, default=1,
                   help="load processes per run of parts a and b (gdn-loadtest --processes; the echo's too)")
    p.add_argument("--shared-connection", action="store_true",
                   help="each load process's clients share one connection (gdn-loadtest --shared-connection)")
    p.add_argument("--server-flags", default="",
                   help="more gdn-server flags for every part, e.g. '--max-queue-delay-us 50'")
    p.add_argument("--load-flags", default="",
                   help="more gdn-loadtest flags for every part, e.g. '--client-transport native'")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": []}
    common = ["--mode", "stream", "--tokens", "1", "--duration", str(args.duration), "--rounds", str(args.rounds),
              "--processes", str(args.load_processes), *(["--shared-connection"] if args.shared_connection else []),
              *args.load_flags.split()]
    big = ["--clients", "1", "--batch", str(args.batch_sessions), "--mode", "unary", "--tokens", "1",
           "--duration", str(args.duration), "--rounds", str(args.rounds), *args.load_flags.split()]

    variants = [(int(f), r) for f in args.frontends.split(",") for r in args.runs_on.split(",")]
    for i, (frontends, runs_on) in enumerate(variants):
        echo = ["--echo"] if i == 0 else []  # the floor does not depend on the server: measure it once
        parts = [
            ("a_batched", (), ["--clients", args.clients, *echo, *common]),
            ("b_unbatched", ("--max-batch-rows", "1"), ["--clients", args.clients, *common]),
            ("c_big_batch", (), [*big, *echo]),
        ]
        for name, server_flags, load_flags in parts:
            if name[0] in skip:
                continue
            proc, target = start_server(args, *server_flags, *args.server_flags.split(), "--frontends", str(frontends),
                                        "--scheduler-runs-on", runs_on)
            try:
                run = loadtest(target, out / f"serve_{name[0]}_f{frontends}_{runs_on}.json", *load_flags)
            finally:
                stop(proc)
            results["parts"].append({"part": name, "frontends": frontends, "runs_on": runs_on, **run})

    (out / "serve.json").write_text(json.dumps(results, indent=1))
    table = summarize(results)
    (out / "serve.md").write_text(table + "\n")
    print(table)


def summarize(results: dict) -> str:
    args = results.get("args", {})
    connections = "one per load process" if args.get("shared_connection") else "one per client"
    lines = [f"Load: {args.get('load_processes', 1)} process(es); TCP connections: {connections}.", "", "| part | frontends | scheduler | clients | B | steps/s | p50 ms | p99 ms | rows/launch | device us/launch | "
             "echo steps/s | echo p50 ms | % of echo | host cores busy, steal (ours; echo) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    echo = {}  # the echo run that followed each of ours (same clients, B and round); part b has none
    for part in results["parts"]:
        for r in part["runs"]:
            if r["kind"] == "echo":
                echo[(r["clients"], r["batch"], r.get("round", 0))] = r
    for part in results["parts"]:
        for r in part["runs"]:
            if r["kind"] != "gdn":
                continue
            e = echo.get((r["clients"], r["batch"], r.get("round", 0)))
            srv = r.get("server") or {}
            launches = srv.get("launches") or 0
            dev_us = 1e6 * srv.get("device_seconds", 0.0) / launches if launches else float("nan")
            lines.append(
                f"| {part['part']} | {part['frontends']} | {part.get('runs_on', 'thread')} | {r['clients']} | {r['batch']} | "
                f"{r['steps_per_s']:,.0f} | "
                f"{r['latency_ms']['p50']:.3f} | {r['latency_ms']['p99']:.3f} | "
                f"{srv.get('mean_rows_per_launch', float('nan')):.1f} | {dev_us:.0f} | "
                + (f"{e['steps_per_s']:,.0f} | {e['latency_ms']['p50']:.3f} | {100 * r['steps_per_s'] / e['steps_per_s']:.0f}% |"
                   if e else "- | - | - |")
                + f" {_host(r)}{'; ' + _host(e) if e else ''} |"
            )
    for part in results["parts"]:
        for point in part.get("pct_of_echo", []):
            if len(point["rounds"]) > 1:
                lines.append(f"\n{part['part']} x{point['clients']}: median {point['median']:.0f}% of echo over "
                             f"{len(point['rounds'])} rounds ({', '.join(f'{v:.0f}' for v in point['rounds'])})")
    return "\n".join(lines)


def _host(run: dict) -> str:
    """The load host's CPU over a run (gdn-loadtest's host_cpu): busy cores of all, steal."""
    cpu = run.get("host_cpu")
    return "-" if not cpu else f"{cpu['busy_cores']:.1f}/{cpu['cores']}, {cpu['steal_pct']:.1f}%"


if __name__ == "__main__":
    main()
