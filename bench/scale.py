"""Scale-out benchmark (issue 8): one server process over one GPU against the same over two.

For each device set it starts `gdn-server --preset qwen3-next --devices ...`, reads the session
capacity from GetModelInfo, then drives N streaming clients (T=1, every layer cycled) from
several `gdn-loadtest` processes at once (one Python load process tops out long before a GPU
does), and sums their throughput. The same load against the gRPC echo floor, with as many
processes, says whether the bound is the GPU, the server's Python front end, or the loader.

    python bench/scale.py --frontends 0,8 --out bench/results   # on a host with two GPUs (~5 min)

With --no-echo it also reports the CPU cores each process of the server (router or one process,
engines, workers) and the load processes used during each point, from /proc: what bounds a point
(a process at ~1.0 core is saturated; all cores busy means the host is).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import start_server, stop  # noqa: E402  (same folder: the serving bench's helpers)


def model_info(target: str) -> dict:
    from gdn_client import Client

    with Client(target) as client:
        info = client.model_info()
    return {"max_sessions": info.max_sessions, "backend": info.backend}


def parallel_load(target: str, clients: int, procs: int, duration: float, echo: bool) -> dict:
    """Runs `procs` loadtest processes with clients/procs clients each; sums their results."""
    per = max(1, clients // procs)
    outs, running = [], []
    tmp = Path(tempfile.mkdtemp())
    for p in range(procs):
        out = tmp / f"load{p}.json"
        cmd = [sys.executable, "-m", "gdn_client.loadtest", "--target", target, "--clients", str(per), "--mode",
               "stream", "--tokens", "1", "--duration", str(duration), "--no-progress", "--json", str(out),
               "--seed", str(p)]
        if echo:
            cmd.append("--echo")
        running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    for proc in running:
        _, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise RuntimeError(f"loadtest failed: {err[-2000:]}")
    result = {"clients": per * procs, "procs": procs, "gdn_steps_per_s": 0.0, "echo_steps_per_s": 0.0,
              "p50_ms": [], "p99_ms": [], "rows_per_launch": []}
    for out in outs:
        for run in json.loads(out.read_text())["runs"]:
            key = "gdn_steps_per_s" if run["kind"] == "gdn" else "echo_steps_per_s"
            result[key] += run["steps_per_s"]
            if run["kind"] == "gdn":
                result["p50_ms"].append(run["latency_ms"]["p50"])
                result["p99_ms"].append(run["latency_ms"]["p99"])
                if run.get("server"):
                    result["rows_per_launch"].append(run["server"]["mean_rows_per_launch"])
    return result


# -- where the CPU goes: per process of the server, and the load processes --------------------------

def _cpu_seconds_by_pid() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, user+system CPU seconds so far), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()  # fields from 3 (state) on
        table[int(entry)] = (int(rest[1]), cmd, (int(rest[11]) + int(rest[12])) / tick)
    return table


def _role(cmd: str) -> str:
    if "gdn_server.engine" in cmd:
        return "engine"
    if "gdn_server.frontend" in cmd:
        return "worker"
    return "server"  # the one process, or the router with --frontends


def server_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process of the server rooted at `root`, with its role."""
    table = _cpu_seconds_by_pid()
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, (ppid, _, _) in table.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return {pid: (_role(table[pid][1]), table[pid][2]) for pid in tree if pid in table}


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (the load processes, once they ended)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cores_used(before: dict, after: dict, seconds: float) -> dict[str, list[float]]:
    """Cores (CPU seconds per second) each server process used between two `server_cpu` looks,
    by role, busiest first."""
    by_role: dict[str, list[float]] = {}
    for pid, (role, cpu) in after.items():
        used = cpu - before.get(pid, (role, 0.0))[1]
        by_role.setdefault(role, []).append(round(used / seconds, 2))
    return {role: sorted(v, reverse=True) for role, v in by_role.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next")
    p.add_argument("--device-sets", default="0;0,1", help="semicolon list of --devices values")
    p.add_argument("--clients", default="128,512")
    p.add_argument("--procs", type=int, default=8, help="load processes per point")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--max-sessions", type=int, default=1300, help="per device, for the throughput runs (room for every point's clients at once)")
    p.add_argument("--frontends", default="0", help="comma list of --frontends values per device set")
    p.add_argument("--no-echo", action="store_true", help="skip the echo floor (then CPU per process is reported)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "capacity": {}, "throughput": []}

    for devices in args.device_sets.split(";"):
        # capacity with the default sizing (80% of each GPU's free memory)
        cap_args = argparse.Namespace(device=args.device, model=f"{args.model} --devices {devices}", max_sessions=None)
        proc, target = start_server(cap_args)
        try:
            results["capacity"][devices] = model_info(target)
        finally:
            stop(proc)
        run_args = argparse.Namespace(device=args.device, model=f"{args.model} --devices {devices}",
                                      max_sessions=args.max_sessions)
        for i, frontends in enumerate(int(f) for f in args.frontends.split(",")):
            proc, target = start_server(run_args, "--frontends", str(frontends))
            try:
                for clients in (int(c) for c in args.clients.split(",")):
                    # the echo floor does not depend on the server: once per device set
                    echo = i == 0 and not args.no_echo
                    cpu_before, load_before, started = server_cpu(proc.pid), children_cpu(), time.monotonic()
                    r = parallel_load(target, clients, args.procs, args.duration, echo=echo)
                    if not echo:
                        # the server works only while the load runs (`duration`); the loaders also
                        # spend their start-up (imports) inside the window
                        window = time.monotonic() - started
                        r["cores"] = cores_used(cpu_before, server_cpu(proc.pid), args.duration)
                        r["cores"]["load procs (sum)"] = [round((children_cpu() - load_before) / window, 2)]
                        r["cpu_window_s"] = round(window, 2)
                    r["devices"] = devices
                    r["frontends"] = frontends
                    results["throughput"].append(r)
                    print(json.dumps(r), flush=True)
            finally:
                stop(proc)

    (out / "scale.json").write_text(json.dumps(results, indent=1))
    lines = ["| devices | sessions (default sizing) |", "|---|---|"]
    lines += [f"| {d} | {c['max_sessions']:,} |" for d, c in results["capacity"].items()]
    lines += ["", "| devices | frontends | clients | load procs | steps/s | echo steps/s (same procs) | % of echo | "
              "p50 ms (median over procs) | rows/launch |", "|---|---|---|---|---|---|---|---|---|"]
    echo = {(r["devices"], r["clients"]): r["echo_steps_per_s"] for r in results["throughput"] if r["echo_steps_per_s"]}
    for r in results["throughput"]:
        p50 = sorted(r["p50_ms"])[len(r["p50_ms"]) // 2] if r["p50_ms"] else float("nan")
        rpl = sum(r["rows_per_launch"]) / len(r["rows_per_launch"]) if r["rows_per_launch"] else float("nan")
        floor = echo.get((r["devices"], r["clients"]))
        pct = f"{100 * r['gdn_steps_per_s'] / floor:.0f}%" if floor else "-"
        lines.append(f"| {r['devices']} | {r['frontends']} | {r['clients']} | {r['procs']} | {r['gdn_steps_per_s']:,.0f} | "
                     f"{floor or float('nan'):,.0f} | {pct} | {p50:.2f} | {rpl:.1f} |")
    cpu_rows = [r for r in results["throughput"] if "cores" in r]
    if cpu_rows:
        lines += ["", "CPU cores used per process (busiest first): server processes over the load's duration, "
                  "load processes over the whole window (with their start-up):", "",
                  "| devices | frontends | clients | window s | " + " | ".join(("server", "engine", "worker", "load procs (sum)"))
                  + " |", "|---|---|---|---|---|---|---|---|"]
        for r in cpu_rows:
            cells = [", ".join(f"{c:.2f}" for c in r["cores"].get(k, [])) or "-"
                     for k in ("server", "engine", "worker", "load procs (sum)")]
            lines.append(f"| {r['devices']} | {r['frontends']} | {r['clients']} | {r['cpu_window_s']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "scale.md").write_text(table + "\n")
    print(table)



if __name__ == "__main__":
    main()
