"""Where a serving process's time goes under load: py-spy samples of a real server while
gdn-loadtest drives it, summarised per thread (self and inclusive samples per function).

    python bench/profile_server.py --device cuda --clients 1,64 --out bench/results/profile
    python bench/profile_server.py --device cpu --model "--layers 4 --q-heads 2 --v-heads 4"

For each clients value: a fresh server, a load run of --duration seconds, and py-spy recording
the server for the middle of it (raw stacks in prof_N.txt, the summary in prof_N.md). py-spy is
taken from PATH or from $PY_SPY. It attaches to the running server; where the host forbids
that (ptrace), it starts the server itself, and the warm-up's samples (kernel compiles) are
dropped from the summary.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from listening import wait_listening  # this folder (python bench/profile_server.py puts it on sys.path)


_WARMUP_FRAMES = ("warmup", "compile", "start_server")  # stacks of the server's start, not of serving


def summarize(raw: Path, top: int = 30) -> str:
    threads: collections.Counter = collections.Counter()
    self_samples: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or any(f in stack for f in _WARMUP_FRAMES):
            continue  # a start-up stack, or one py-spy wrote garbled (seen with --subprocesses)
        n = int(count)
        frames = stack.split(";")
        thread = re.sub(r"\(\d+\)", "", frames[0]).strip()
        threads[thread] += n
        self_samples[(thread, frames[-1])] += n
        for frame in set(frames[1:]):
            inclusive[(thread, frame)] += n
    lines = ["| thread | samples |", "|---|---|"] + [f"| {t} | {n} |" for t, n in threads.most_common()]
    lines += ["", "Self (leaf) samples:", "", "| samples | thread | function |", "|---|---|---|"]
    lines += [f"| {n} | {t} | `{f}` |" for (t, f), n in self_samples.most_common(top)]
    lines += ["", "Inclusive samples:", "", "| samples | thread | function |", "|---|---|---|"]
    lines += [f"| {n} | {t} | `{f}` |" for (t, f), n in inclusive.most_common(top * 2)]
    return "\n".join(lines)


def wait_for_load(target: str, clients: int, timeout: float) -> None:
    """Returns once the load's measured part has begun: the server has answered more steps than
    the clients' warm-up ones (one each)."""
    from gdn_client import Client

    deadline = time.monotonic() + timeout
    with Client(target) as client:
        while time.monotonic() < deadline:
            if client.stats().requests > 2 * clients:
                return
            time.sleep(0.1)
    raise RuntimeError(f"the load did not start within {timeout:.0f} s")


def profile_point(args: argparse.Namespace, py_spy: str, clients: int, out: Path) -> None:
    server_cmd = [sys.executable, "-m", "gdn_server", "--host", "127.0.0.1", "--port", "0", "--device", args.device,
                  *args.model.split(), "--max-sessions", str(max(clients, 8)), "--log-level", "WARNING",
                  *args.server_flags.split()]
    raw = out / f"prof_{clients}.txt"
    spy_flags = ["record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--threads", *args.spy_flags.split()]
    proc = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    wrapped = load = None
    try:
        target = wait_listening(proc, 600)
        load_cmd = [sys.executable, "-m", "gdn_client.loadtest", "--target", target, "--clients", str(clients),
                    "--duration", str(args.duration), "--no-progress", "--processes", str(args.load_processes)]
        load = subprocess.Popen(load_cmd)
        # py-spy records the measured part of the load only: the load imports torch, opens its
        # sessions and warms up first (spread over processes, its children do so in turn, which
        # took longer than a fixed lead: the first such profile caught 1 sample)
        wait_for_load(target, clients, timeout=120.0)
        watched = load if args.spy_on == "load" else proc
        spy = subprocess.run(
            [py_spy, *spy_flags, "-d", str(max(1, int(args.duration) - 1)), "--pid", str(watched.pid)],
            capture_output=True, text=True,
        )
        load.wait(timeout=args.duration + 120)
        if spy.returncode != 0 and args.spy_on == "load":
            print(f"py-spy could not attach to the load ({spy.stderr.strip()[-200:]})", flush=True)
        elif spy.returncode != 0:  # no ptrace of a sibling here: py-spy starts the server itself
            print(f"py-spy could not attach ({spy.stderr.strip()[-200:]}); starting the server under it", flush=True)
            proc.terminate()
            proc.wait(30)
            wrapped = subprocess.Popen([py_spy, *spy_flags, "--", *server_cmd], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, bufsize=1)
            target = wait_listening(wrapped, 600)
            load_cmd[load_cmd.index("--target") + 1] = target
            subprocess.run(load_cmd, timeout=args.duration + 120)
            wrapped.send_signal(signal.SIGINT)  # py-spy forwards it, then writes its file
            wrapped.wait(60)
    finally:
        for p in (proc, wrapped, load):  # a load left running would skew the next measurement
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(30)
    if raw.exists():
        (out / f"prof_{clients}.md").write_text(summarize(raw) + "\n")
        print(f"\n## {clients} clients\n")
        print("\n".join(summarize(raw, top=12).splitlines()[:40]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0")
    p.add_argument("--server-flags", default="", help="more gdn-server flags, e.g. '--scheduler-runs-on thread'")
    p.add_argument("--clients", default="1,64")
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--spy-on", choices=("server", "load"), default="server",
                   help="the process py-spy records: the server, or the gdn-loadtest process driving it "
                        "(with --load-processes, add --subprocesses to --spy-flags for its children)")
    p.add_argument("--load-processes", type=int, default=1, help="gdn-loadtest --processes")
    p.add_argument("--spy-flags", default="--nonblocking",
                   help="more py-spy record flags: '--native' for C frames too (pauses the server per sample)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results") + "/profile")
    args = p.parse_args()
    py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not py_spy:
        sys.exit("py-spy not found (PATH or $PY_SPY)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for clients in (int(c) for c in args.clients.split(",")):
        profile_point(args, py_spy, clients, out)


if __name__ == "__main__":
    main()
