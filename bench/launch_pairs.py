"""Rows per launch, launch by launch: what caps a launch's rows at N clients with one step each
in flight.

    python bench/launch_pairs.py --clients 8,64,256 --duration 8 \\
        --server-flags "--frontends 8 --frontend-transport native" --load-flags "--client-transport native --processes 8"
    python bench/launch_pairs.py --device cpu --fake-device --model "--layers 2 --q-heads 2 --v-heads 4" \\
        --server-flags "--frontends 2" --clients 8 --duration 3        # a smoke run on any machine
    python bench/launch_pairs.py --clients 64 --take-delay-us 0,100,150,200,300   # how soon do answered clients return?

The claim it tests (bench/NOTES.md, thirtieth session): a closed loop of N clients, each with one
step in flight, served by an engine that takes its queue again as soon as it has answered a
launch (as it does whenever steps are queued by then: it never waits while work is queued),
gives launches whose consecutive pairs hold at most N rows. A launch's rows cannot be queued
again for the next one: their replies go out at its end, and the next launch takes what is
queued right then ("reply -> next take"), sooner than any of those clients can have sent its
next step. So the mean over a run is at most N/2: N/2 less half the steps still in transit at
each launch (`stragglers`: N - k[n] - k[n+1]). Only an engine that waits, with work queued, for
the clients it has just answered can pass N/2 (`--batch-fill`). An engine that finds its queue
empty waits too, and its next launch may hold some of the last one's rows; that happens where
the engine has time to spare, not at the N where it is the bound.

gdn-server runs as a `--frontends` router whose engines start through bench/trace_child.py with
this file's `log_child`: each engine logs, per launch, when its round took the queue and how many
rows it launched, and when each round's replies went to the link's sender. Each clients value
runs on a fresh server. Prints a table; writes launch_pairs.json. The middle 80% of each run's
launches (by time) are used, which leaves out the ramp up and down.

`--take-delay-us D` holds each take until D us after the engine's last replies, the loop reading
the link meanwhile: an experiment, not a policy (the engine idles). Rows per launch against D
says how many of the clients just answered are back D us later: what work moved from after the
take to before it (as the staging fill could be) would gain without the idling.
"""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from listening import start_listening  # this folder (python bench/launch_pairs.py puts it on sys.path)

REPO = Path(__file__).resolve().parent.parent


# -- in the engine (through bench/trace_child.py) ---------------------------------------------------

def log_child(role: str, out: Path) -> None:
    """GDN_TRACE_HOOK for an engine: logs its launches, written to `out` at its exit. A worker
    is left as it is."""
    if role != "engine":
        return
    from gdn_server import engine_link, scheduler

    if os.environ.get("GDN_TRACE_FAKE_DEVICE"):  # --fake-device: bench/frontend.py's host-only backend
        from trace_step import _fake_engine_device  # this folder

        _fake_engine_device({"submitted": []})

    log: dict[str, list[int]] = {"taken": [], "rows": [], "flushed": []}
    now = time.monotonic_ns
    taken_at = [0]
    launch, submit, flush = scheduler.Scheduler._launch, scheduler.Scheduler._submit, engine_link.EngineLink.flush

    @functools.wraps(launch)
    def logged_launch(self, items, *args, **kwargs):
        if items:
            taken_at[0] = now()  # the round has just taken the queue
        return launch(self, items, *args, **kwargs)

    @functools.wraps(submit)
    def logged_submit(self, batch, *args, **kwargs):
        result = submit(self, batch, *args, **kwargs)
        log["taken"].append(taken_at[0])
        log["rows"].append(batch.rows)  # after: a lane's rows join the batch in submit
        return result

    @functools.wraps(flush)
    def logged_flush(self):
        if self._dirty:  # a round's answers (or a read's refusals) going out
            log["flushed"].append(now())
        return flush(self)

    scheduler.Scheduler._launch, scheduler.Scheduler._submit = logged_launch, logged_submit
    engine_link.EngineLink.flush = logged_flush
    delay_ns = int(float(os.environ.get("GDN_PAIRS_TAKE_DELAY_US", "0")) * 1000)
    if delay_ns > 0:
        # --take-delay-us: no take sooner than this after the last replies went out; the loop
        # keeps reading the link meanwhile (the round polls again next iteration), so the
        # clients just answered can come back into the next launch. A stand-in, idle, for work
        # the engine could do there instead (bench/NOTES.md, thirtieth session)
        is_due = scheduler.Scheduler._batch_is_due

        @functools.wraps(is_due)
        def held_until_delay(self):
            if log["flushed"] and now() < log["flushed"][-1] + delay_ns:
                return False
            return is_due(self)

        scheduler.Scheduler._batch_is_due = held_until_delay
    atexit.register(lambda: out.write_text(json.dumps(log)))


def _serve(log_dir: str, flags: list[str], fake_device: bool) -> int:
    from gdn_server import cli

    from trace_step import _spawning_traced_children  # this folder

    _spawning_traced_children(Path(log_dir), fake_device, hook="launch_pairs:log_child")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return cli.main(flags)


# -- the driver ---------------------------------------------------------------------------------------

def analyse(log: dict[str, list[int]], clients: int, keep: float = 0.8) -> dict:
    """The pairs of consecutive launches of one engine's log, over the middle `keep` of its launches
    by time. A launch's replies are the first flush after its round took the queue."""
    taken = np.asarray(log["taken"], dtype=np.int64)
    rows = np.asarray(log["rows"], dtype=np.int64)
    flushed = np.asarray(sorted(log["flushed"]), dtype=np.int64)
    if len(rows) < 10:
        raise RuntimeError(f"only {len(rows)} launches logged")
    span = taken[-1] - taken[0]
    lo, hi = taken[0] + span * (1 - keep) / 2, taken[-1] - span * (1 - keep) / 2
    sel = np.flatnonzero((taken >= lo) & (taken <= hi))
    k = rows[sel]
    pairs = k[:-1] + k[1:]
    # each launch's replies: the first flush after its round began; the gap to the next round's take
    at = np.searchsorted(flushed, taken[sel], side="right")
    ok = at < len(flushed)
    reply = np.where(ok, flushed[np.minimum(at, len(flushed) - 1)], 0)
    gap_us = (taken[sel][1:] - reply[:-1])[ok[:-1]] / 1e3
    round_us = np.diff(taken[sel]) / 1e3
    return {
        "clients": clients, "launches": int(len(k)), "mean_rows": float(k.mean()), "half": clients / 2,
        "pair_rows_max": int(pairs.max()), "pairs_over_n_pct": float(100 * np.mean(pairs > clients)),
        "stragglers_mean": float(np.mean(clients - pairs)),
        "rows_p10_p50_p90": [float(x) for x in np.percentile(k, [10, 50, 90])],
        "gap_us_p50_p90": [float(x) for x in np.percentile(gap_us, [50, 90])] if len(gap_us) else [],
        "round_us_p50": float(np.percentile(round_us, 50)),
    }


def run_one(args, clients: int, out: Path, delay_us: float = 0.0) -> dict:
    log_dir = out / (f"logs_{clients}" if not delay_us else f"logs_{clients}_delay{delay_us:g}")
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("*.json"):
        old.unlink()
    cmd = [sys.executable, __file__, "--serve", "--log-dir", str(log_dir), "--host", "127.0.0.1", "--port", "0",
           "--device", args.device, "--max-sessions", str(max(16, clients)), "--log-level", "WARNING",
           *args.model.split(), *args.server_flags.split(), *(["--fake-device"] if args.fake_device else [])]
    env = {**os.environ, "GDN_PAIRS_TAKE_DELAY_US": str(delay_us)}
    proc, target = start_listening(cmd, cwd=str(REPO), env=env)
    try:
        load_json = out / f"{log_dir.name.replace('logs', 'load')}.json"
        subprocess.run([sys.executable, "-m", "gdn_client.loadtest", "--target", target, "--no-progress",
                        "--json", str(load_json), "--clients", str(clients), "--mode", "stream", "--tokens", "1",
                        "--duration", str(args.duration), *args.load_flags.split()], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, timeout=600)
    finally:
        proc.send_signal(signal.SIGTERM)  # the router drains; its engines write their logs as they exit
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    run = next(r for r in json.loads(load_json.read_text())["runs"] if r["kind"] == "gdn")
    logs = [json.loads(p.read_text()) for p in sorted(log_dir.glob("engine_*.json"))]
    if len(logs) != 1:
        raise RuntimeError(f"expected one engine's log in {log_dir}, found {len(logs)}")
    result = analyse(logs[0], clients)
    result.update(take_delay_us=delay_us, steps_per_s=run["steps_per_s"], p50_ms=run["latency_ms"]["p50"],
                  loadtest_rows_per_launch=(run.get("server") or {}).get("mean_rows_per_launch"))
    return result


def table(results: list[dict]) -> str:
    lines = ["| clients | take delay us | steps/s | launches | rows/launch (N/2) | loadtest's rows/launch | "
             "rows p10/p50/p90 | max rows of two launches | pairs over N | stragglers per launch | "
             "reply -> next take us p50/p90 | round us p50 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        gap = "/".join(f"{x:.0f}" for x in r["gap_us_p50_p90"]) or "-"
        lt = r["loadtest_rows_per_launch"]
        spread = "/".join(f"{x:.0f}" for x in r["rows_p10_p50_p90"])
        lines.append(
            f"| {r['clients']} | {r['take_delay_us']:g} | {r['steps_per_s']:,.0f} | {r['launches']:,} | "
            f"{r['mean_rows']:.2f} ({r['half']:g}) | {'-' if lt is None else f'{lt:.2f}'} | {spread} | "
            f"{r['pair_rows_max']} | {r['pairs_over_n_pct']:.2f}% | {r['stragglers_mean']:.2f} | {gap} | "
            f"{r['round_us_p50']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--fake-device", action="store_true",
                   help="the engine's backend is bench/frontend.py's host-only one (staging copies, a 60 us "
                        "\"device\"): the CUDA engine's scheduler on any machine")
    p.add_argument("--model", default="--preset qwen3-next --devices 0")
    p.add_argument("--server-flags", default="--frontends 8 --frontend-transport native",
                   help="gdn-server flags (need --frontends: the log is an engine's)")
    p.add_argument("--load-flags", default="--client-transport native --processes 8", help="more gdn-loadtest flags")
    p.add_argument("--clients", default="64", help="a comma list: each value on a fresh server")
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--take-delay-us", default="0",
                   help="a comma list: the engine takes its queue no sooner than this after its last replies "
                        "(an experiment: how soon do the clients just answered come back?); each on a fresh server")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results/launch_pairs"))
    args, rest = p.parse_known_args()
    if args.serve:
        sys.exit(_serve(args.log_dir, rest, args.fake_device))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_one(args, int(n), out, float(d))
               for n in args.clients.split(",") for d in args.take_delay_us.split(",")]
    text = table(results)
    print(text)
    (out / "launch_pairs.md").write_text(text + "\n")
    (out / "launch_pairs.json").write_text(json.dumps(
        {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}, indent=1))


if __name__ == "__main__":
    main()
