"""CPU time per step, thread by thread, of the server and of the load process: ours and the echo.

    python bench/cpu_split.py --device cuda --clients 1,64          # a real gdn-server on the GPU
    python bench/cpu_split.py --fake-device --clients 64            # bench/frontend.py's server, any machine
    python bench/cpu_split.py --clients 64 --server-flags "--device-wait poll"   # A/B a server flag

For each clients value: gdn-loadtest's own client code drives a fresh server for --duration
seconds (streams, T=1, qwen3-next on the GPU), then the bytes echo of the same sizes, while this
process reads /proc for every thread's CPU time of the server and of itself (the load). Prints
CPU microseconds per step per thread group (the server's main thread, gRPC's threads, the rest)
and how busy the main thread was (CPU seconds / wall seconds): a main thread near 100% busy is
the bound; well below it, the steps wait elsewhere (the load, the hops). Writes cpu_split.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_client._echo import echo_env  # noqa: E402
from gdn_client.loadtest import LoadConfig, run_echo, run_load  # noqa: E402
from listening import start_listening  # noqa: E402  (this folder)
from serve import start_server  # noqa: E402  (this folder: the serving bench's gdn-server command)

_TICK = os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, CPU seconds) of every thread of `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _groups(pid: int, before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between two readings: main thread, gRPC's threads, everything else."""
    spent = {"main": 0.0, "grpc": 0.0, "other": 0.0}
    for tid, (name, cpu) in after.items():
        delta = cpu - before.get(tid, (name, 0.0))[1]
        group = "main" if tid == pid else "grpc" if name.startswith(("event_engine", "grpc")) else "other"
        spent[group] += delta
    return spent


def _measure(pid: int, run) -> tuple[object, dict, dict, float]:
    me = os.getpid()
    s0, l0, t0 = _threads(pid), _threads(me), time.perf_counter()
    result = run()
    wall = time.perf_counter() - t0
    return result, _groups(pid, s0, _threads(pid)), _groups(me, l0, _threads(me)), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0", help="server shape flags (one GPU)")
    p.add_argument("--max-sessions", type=int, default=512)
    p.add_argument("--fake-device", action="store_true", help="bench/frontend.py's host-only server instead")
    p.add_argument("--clients", default="1,64")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--server-flags", default="", help="more gdn-server flags (not with --fake-device)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args()
    fake_server = [sys.executable, str(Path(__file__).resolve().parent / "frontend.py"), "--serve", "--port", "0"]
    rows = []
    echo, echo_address = start_listening([sys.executable, "-m", "gdn_client._echo", "--port", "0"], env=echo_env())
    try:
        for n in (int(c) for c in args.clients.split(",")):
            server, target = (start_listening(fake_server) if args.fake_device
                              else start_server(args, *args.server_flags.split()))
            try:
                cfg = LoadConfig(target=target, clients=n, duration=args.duration, progress=False)
                ours, s, l, wall = _measure(server.pid, lambda: asyncio.run(run_load(cfg)))
            finally:
                server.terminate()
                server.wait(60)
            ecfg = LoadConfig(target=echo_address, clients=n, duration=args.duration, progress=False)
            theirs, es, el, ewall = _measure(
                echo.pid, lambda: asyncio.run(run_echo(ecfg, echo_address, ours.request_bytes, ours.reply_bytes, 36)))
            for kind, r, srv, load, w in (("gdn", ours, s, l, wall), ("echo", theirs, es, el, ewall)):
                steps = r.steps
                rows.append({
                    "kind": kind, "clients": n, "steps_per_s": r.steps_per_s, "p50_ms": r.latency_ms["p50"],
                    "server_us_per_step": {k: 1e6 * v / steps for k, v in srv.items()},
                    "load_us_per_step": {k: 1e6 * v / steps for k, v in load.items()},
                    "server_main_busy": srv["main"] / w, "load_main_busy": load["main"] / w,
                })
    finally:
        echo.terminate()
        echo.wait(30)
    lines = ["| kind | N | steps/s | p50 ms | server main us/step | server gRPC us/step | server other us/step "
             "| server main busy | load main us/step | load main busy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        su, lu = r["server_us_per_step"], r["load_us_per_step"]
        lines.append(f"| {r['kind']} | {r['clients']} | {r['steps_per_s']:,.0f} | {r['p50_ms']:.2f} | {su['main']:.0f} | "
                     f"{su['grpc']:.0f} | {su['other']:.0f} | {r['server_main_busy']:.0%} | {lu['main']:.0f} | "
                     f"{r['load_main_busy']:.0%} |")
    print("\n".join(lines))
    out = Path(args.out) / "cpu_split"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_split.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args),
                                                      "rows": rows}, indent=1))
    (out / "cpu_split.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
