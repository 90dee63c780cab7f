"""A/B of servers that stay up: every side's server starts once, then the load alternates between
them round after round (ABBA order), with no restart and no echo run in between.

Why: on the H200 a `gpu_session.sh abserve` or `variants` run costs ~70 s (a fresh server, its
load, then an echo of the same load), so a 10-minute call held two or three pairs, and pairs
that close tell nothing at these runs' spread (bench/NOTES.md, twenty-fourth session). Here a
pair costs two load runs (~2 x (duration + 3) s) after one start-up of every side together.
The idle side's processes sleep between their runs (the scheduler's busy poll ends 1 ms after
its last answer).

    python bench/ab_live.py --side "base|.ab_base||--frontends 8" --side "new|.||--frontends 8" \\
        --clients 64 --rounds 8 --duration 3 --load-processes 4 --out bench/results/ablive
    python bench/ab_live.py --device cpu --model "--layers 2 --q-heads 2 --v-heads 4" \\
        --side "a|.|GDN_GC_GEN0=700|" --side "b|.||" --clients 4 --rounds 2 --duration 1   # a smoke run

A side is `LABEL|ROOT|ENV|FLAGS`: its checkout's root (run from there, on PYTHONPATH), environment
settings (`NAME=value ...`) and gdn-server flags. The load generator is this tree's gdn-loadtest
for every side, or with `--load link` this tree's bench/link_load.py: the same clients' steps
written straight onto the engine's decode link, no gRPC, no workers (sides need `--frontends`),
which measures the engine's ceiling behind a front end that costs nothing. Prints a table of
every run, each side's median, and the paired ratios of each side to the first; writes
ab_live.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from listening import start_listening  # this folder (python bench/ab_live.py puts it on sys.path)
from procstat import cpu_s, stat_fields  # this folder

REPO = Path(__file__).resolve().parent.parent  # this tree: its gdn-loadtest drives every side


def env_with_root(root: Path, **more: str) -> dict[str, str]:
    """This process's environment, with `more` and with `root` first on PYTHONPATH."""
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **more, "PYTHONPATH": path}


@dataclass
class Side:
    label: str
    root: Path
    env: dict[str, str]
    flags: list[str]
    proc: subprocess.Popen | None = None
    target: str = ""
    metrics_url: str = ""  # its /metrics (--cpu-window: started with --metrics-port 0)
    link_path: str = ""  # its engine's decode link (--load link)
    tmpdir: str = ""  # its TMPDIR, ours to remove once it stopped (--load link)
    runs: list[dict] = field(default_factory=list)


def parse_side(spec: str) -> Side:
    parts = spec.split("|")
    if len(parts) != 4 or not parts[0]:
        raise argparse.ArgumentTypeError(f"a side is LABEL|ROOT|ENV|FLAGS, got {spec!r}")
    label, root, env_text, flags = parts
    env = {}
    for word in env_text.split():
        name, sep, value = word.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{spec!r}: environment settings are NAME=value, got {word!r}")
        env[name] = value
    path = (REPO / root).resolve() if not os.path.isabs(root) else Path(root)
    if not (path / "gdn_server").is_dir():
        raise argparse.ArgumentTypeError(f"{spec!r}: no gdn_server package under {path}")
    return Side(label, path, env, flags.split())


def _drain(proc: subprocess.Popen, label: str) -> None:
    """Reads the server's output after its listening line, so a chatty one never blocks on a full
    pipe; warnings are passed on with the side's label."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(f"[{label}] {line}")


def start(side: Side, args: argparse.Namespace) -> None:
    cmd = [sys.executable, "-m", "gdn_server", "--host", "127.0.0.1", "--port", "0", "--device", args.device,
           *args.model.split(), "--max-sessions", str(args.max_sessions), "--log-level", "WARNING", *side.flags]
    if args.cpu_window > 0 and "--metrics-port" not in side.flags:
        cmd += ["--metrics-port", "0"]
    env = dict(side.env)
    if args.load == "link":  # the router makes its private sockets under TMPDIR: one of our own, to find its link
        if "--frontends" not in side.flags:
            raise SystemExit(f"--load link: side {side.label} needs --frontends (an engine with a decode link)")
        env["TMPDIR"] = tempfile.mkdtemp(prefix="ablive-")  # short: a Unix socket's path has ~107 bytes
    seen: list[str] = []
    side.proc, side.target = start_listening(cmd, timeout=args.start_timeout, env=env_with_root(side.root, **env),
                                             cwd=str(side.root), seen=seen)
    if args.load == "link":
        links = glob.glob(os.path.join(env["TMPDIR"], "gdn-engine-*", "link-0.sock"))
        if len(links) != 1:
            raise SystemExit(f"side {side.label}: expected one engine link under {env['TMPDIR']}, found {links}")
        side.link_path = links[0]
        side.tmpdir = env["TMPDIR"]
    side.metrics_url = next((m.group(1) for line in seen if (m := re.search(r"metrics on (\S+)", line))), "")
    threading.Thread(target=_drain, args=(side.proc, side.label), daemon=True).start()


def stop(side: Side) -> None:
    if side.proc is None:
        return
    side.proc.terminate()
    try:
        side.proc.wait(60)
    except subprocess.TimeoutExpired:
        side.proc.kill()
    if side.tmpdir:
        shutil.rmtree(side.tmpdir, ignore_errors=True)


def _proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far) of every process (Linux /proc; {} elsewhere)."""
    stats = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit() and (fields := stat_fields(f"/proc/{entry}/stat")) is not None:
            stats[int(entry)] = (int(fields[1]), cpu_s(fields))
    return stats


def _thread_s(pid: int) -> dict[int, float]:
    """tid -> CPU seconds so far of each of a process's threads."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    fields = {int(tid): stat_fields(f"/proc/{pid}/task/{tid}/stat") for tid in tids}
    return {tid: cpu_s(f) for tid, f in fields.items() if f is not None}


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "gdn_server.engine" in cmd:
        return "engine"
    if "gdn_server.frontend" in cmd:
        return "worker"
    return "router"


def _samples(url: str, family: str, suffix: str) -> list:
    """The samples of one metric family on a server's /metrics whose names end in `suffix`
    (`_total` of a counter, `_sum` of a histogram)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return [s for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples if s.name.endswith(suffix)]


def _metrics_cpu_s(url: str) -> dict[str, float]:
    """role -> CPU seconds so far of the server's processes of that role, from its /metrics
    (gdn_process_cpu_seconds_total: each process's own clock)."""
    return {s.labels["role"]: s.value for s in _samples(url, "gdn_process_cpu_seconds", "_total")}


def cpu_snapshot(side: Side) -> tuple[dict[str, float], dict[str, dict[int, float]]]:
    """The server's CPU seconds so far by role (/metrics), and per thread ({tid: seconds}, from
    /proc) of its engine process and of all its workers together."""
    stats = _proc_stats()
    children = {pid: _role(pid) for pid, (ppid, _) in stats.items() if ppid == side.proc.pid}
    engines = [pid for pid, role in children.items() if role == "engine"] or [side.proc.pid]  # one process: its own
    threads = {"engine thread": _thread_s(engines[0]), "worker thread": {}}
    for pid, role in children.items():
        if role == "worker":
            threads["worker thread"].update(_thread_s(pid))
    return _metrics_cpu_s(side.metrics_url), threads


def cores_used(before: tuple, after: tuple, seconds: float) -> dict[str, float]:
    """Cores each role used between two snapshots, and the busiest thread of the engine (its
    loop's, where the engine's work runs) and of the workers (a loop's: a worker's bound)."""
    (roles0, threads0), (roles1, threads1) = before, after
    used = {role: round((s - roles0.get(role, 0.0)) / seconds, 2) for role, s in roles1.items()}
    for name, now in threads1.items():
        deltas = [s - threads0.get(name, {}).get(tid, s) for tid, s in now.items()]
        if deltas:
            used[name] = round(max(deltas) / seconds, 2)
    return used


def _rows_launched(url: str) -> float:
    """The rows a server's engines have launched so far (gdn_launch_rows' sum): counted where the
    steps run, so a load on the engine's link (--load link), which no worker sees, counts too."""
    return sum(s.value for s in _samples(url, "gdn_launch_rows", "_sum"))


def _wait_for_steps(side: Side, load_proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Returns once the server has launched steps since this call (the load has started)."""
    first = _rows_launched(side.metrics_url)
    deadline = time.monotonic() + timeout_s
    while _rows_launched(side.metrics_url) == first:
        if load_proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no steps reached {side.label} from the load")
        time.sleep(0.05)


def load(side: Side, args: argparse.Namespace, out: Path, round_index: int) -> dict:
    path = out / f"{side.label}_{round_index}.json"
    if args.load == "link":
        cmd = [sys.executable, str(REPO / "bench" / "link_load.py"), "--target", side.target, "--link", side.link_path,
               "--json", str(path), "--clients", str(args.clients), "--duration", str(args.duration),
               "--processes", str(args.load_processes)]
    else:
        cmd = [sys.executable, "-m", "gdn_client.loadtest", "--target", side.target, "--no-progress", "--json",
               str(path), "--clients", str(args.clients), "--mode", "stream", "--tokens", "1", "--duration",
               str(args.duration), "--processes", str(args.load_processes), *args.load_flags.split()]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env=env_with_root(REPO))
    cores = {}
    try:
        if args.cpu_window > 0:  # the load's steady part: after its start-up, before its end
            # from the load's first steps on: its processes' start-up took over 6 s on the H200 VM,
            # so a window timed from its launch fell before the load (the zeros of 2026-12-01)
            _wait_for_steps(side, proc)
            time.sleep(args.cpu_after)
            before, at = cpu_snapshot(side), time.monotonic()
            time.sleep(args.cpu_window)
            cores = cores_used(before, cpu_snapshot(side), time.monotonic() - at)
        if proc.wait(600) != 0:
            raise RuntimeError(f"the {args.load} load failed against {side.label} (exit {proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.kill()
    run = next(r for r in json.loads(path.read_text())["runs"] if r["kind"] == "gdn")
    server = run.get("server") or {}
    if args.cpu_window > 0:  # over the whole run: the load's own processes, and the host's busy cores
        if run.get("load_cores") is not None:
            cores["load"] = round(run["load_cores"], 2)
        if run.get("host_cpu"):
            cores["host busy"] = round(run["host_cpu"]["busy_cores"], 2)
    return {"round": round_index, "steps_per_s": run["steps_per_s"], "p50_ms": run["latency_ms"]["p50"],
            "p99_ms": run["latency_ms"]["p99"], "rows_per_launch": server.get("mean_rows_per_launch", float("nan")),
            "errors": run.get("errors", 0), "cores": cores}


def table(sides: list[Side]) -> str:
    lines = ["| side | round | steps/s | p50 ms | p99 ms | rows/launch | errors |", "|---|---|---|---|---|---|---|"]
    for side in sides:
        for r in side.runs:
            lines.append(f"| {side.label} | {r['round']} | {r['steps_per_s']:,.0f} | {r['p50_ms']:.3f} | "
                         f"{r['p99_ms']:.3f} | {r['rows_per_launch']:.1f} | {r['errors']} |")
    lines += ["", "| side | median steps/s | median p50 ms | median rows/launch | paired steps/s against "
              f"{sides[0].label}: median ratio (rounds higher) |", "|---|---|---|---|---|"]
    for side in sides:
        if not side.runs:
            continue
        med = lambda key: statistics.median(r[key] for r in side.runs)  # noqa: E731
        if side is sides[0]:
            paired = "-"
        else:
            ratios = [r["steps_per_s"] / b["steps_per_s"] for r, b in zip(side.runs, sides[0].runs)]
            paired = f"{statistics.median(ratios):.3f} ({sum(x > 1 for x in ratios)} of {len(ratios)})"
        lines.append(f"| {side.label} | {med('steps_per_s'):,.0f} | {med('p50_ms'):.3f} | {med('rows_per_launch'):.1f} | {paired} |")
    roles = sorted({role for side in sides for r in side.runs for role in r.get("cores", {})})
    if roles:  # --cpu-window: where the cores went, median over each side's runs
        lines += ["", "| side | " + " | ".join(f"{role} (cores)" for role in roles) + " |",
                  "|---|" + "---|" * len(roles)]
        for side in sides:
            cells = []
            for role in roles:
                values = [r["cores"][role] for r in side.runs if role in r.get("cores", {})]
                cells.append(f"{statistics.median(values):.2f}" if values else "-")
            lines.append(f"| {side.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", type=parse_side, action="append", required=True, help="LABEL|ROOT|ENV|FLAGS (two or more)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0", help="server shape flags (one GPU)")
    p.add_argument("--max-sessions", type=int, default=512)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=3.0, help="seconds per load run")
    p.add_argument("--rounds", type=int, default=6, help="load runs per side, alternating (ABBA)")
    p.add_argument("--load-processes", type=int, default=4)
    p.add_argument("--load-flags", default="", help="more gdn-loadtest flags for every run")
    p.add_argument("--load", choices=("grpc", "link"), default="grpc",
                   help="grpc: gdn-loadtest's clients over the public port; link: bench/link_load.py's on the "
                        "engine's decode link (no gRPC, no workers: the engine's ceiling; sides need --frontends)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--cpu-window", type=float, default=0.0,
                   help="seconds of each load run over which the cores of the server's processes are measured, by "
                        "role (server, or engine and worker: gdn_process_cpu_seconds_total from the side's /metrics, "
                        "which it is then started with) and the busiest thread of the engine and of the workers "
                        "(Linux /proc); the load's own cores and the host's busy cores come from gdn-loadtest, over "
                        "the whole run (0: none of this)")
    p.add_argument("--cpu-after", type=float, default=1.0,
                   help="seconds after the load's first steps reach the server that the window starts")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/ab_live"))
    args = p.parse_args()
    sides: list[Side] = args.side
    if len(sides) < 2 or len({s.label for s in sides}) != len(sides):
        p.error("give two or more --side, each with its own label")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(len(sides)) as pool:  # every side's start-up at once
            list(pool.map(lambda s: start(s, args), sides))
        print(f"servers up in {time.monotonic() - started:.0f} s: "
              + ", ".join(f"{s.label} {s.target}" for s in sides), flush=True)
        for round_index in range(args.rounds):
            order = sides if round_index % 2 == 0 else sides[::-1]
            for side in order:
                run = load(side, args, out, round_index)
                side.runs.append(run)
                cores = ", ".join(f"{role} {n:.2f}" for role, n in sorted(run["cores"].items()))
                print(f"{side.label} {round_index}: {run['steps_per_s']:,.0f} steps/s, p50 {run['p50_ms']:.3f} ms, "
                      f"{run['rows_per_launch']:.1f} rows/launch" + (f"; cores: {cores}" if cores else ""), flush=True)
                save(sides, args, out)  # after every run: a call cut short by its time limit keeps what ran
    finally:
        for side in sides:
            stop(side)
    print(save(sides, args, out))


def save(sides: list[Side], args: argparse.Namespace, out: Path) -> str:
    """Writes the table and the JSON of the runs so far; returns the table."""
    text = table(sides)
    (out / "ab_live.md").write_text(text + "\n")
    (out / "ab_live.json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items() if k != "side"},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sides": [{"label": s.label, "root": str(s.root), "env": s.env, "flags": s.flags, "runs": s.runs} for s in sides],
    }, indent=1))
    return text


if __name__ == "__main__":
    main()
