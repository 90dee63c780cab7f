"""Where a serving process's time goes under load: py-spy samples of a real server while
gdn-loadtest drives it, summed per thread (self and inclusive samples per function).

    python bench/profile_server.py                          # qwen3-next on GPU 0, 1 and 64 clients
    python bench/profile_server.py --device cpu --model "--layers 4 --q-heads 2 --v-heads 4"
    python bench/profile_server.py --spy-on load            # the load generator instead
    python bench/profile_server.py --clients 1 --load-flags="--mode unary --batch 256"

For each clients value: a fresh server, a load run of --duration seconds, and py-spy recording
the server (or the gdn-loadtest process) over the measured part of the run. Writes the raw
stacks (prof_N.txt) and their summary (prof_N.md) to bench/out/profile-<UTC time>/ and prints
the head of each summary. py-spy comes from $PY_SPY or PATH. Where the host forbids attaching
to a running process (ptrace), py-spy starts the server itself; the warm-up's stacks (kernel
compiles) are then left out of the summary.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import common

_WARMUP_FRAMES = ("warmup", "compile", "start_server")  # stacks of the server's start, not of serving


def summarize(raw: Path, top: int = 30) -> str:
    threads: collections.Counter = collections.Counter()
    self_samples: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or any(f in stack for f in _WARMUP_FRAMES):
            continue  # a start-up stack, or a line py-spy wrote garbled
        n = int(count)
        frames = stack.split(";")
        thread = re.sub(r"\(\d+\)", "", frames[0]).strip()
        threads[thread] += n
        self_samples[(thread, frames[-1])] += n
        for frame in set(frames[1:]):
            inclusive[(thread, frame)] += n
    parts = [common.markdown_table(["thread", "samples"], threads.most_common()), "", "Self (leaf) samples:", "",
             common.markdown_table(["samples", "thread", "function"],
                                   [(n, t, f"`{f}`") for (t, f), n in self_samples.most_common(top)]),
             "", "Inclusive samples:", "",
             common.markdown_table(["samples", "thread", "function"],
                                   [(n, t, f"`{f}`") for (t, f), n in inclusive.most_common(top * 2)])]
    return "\n".join(parts)


def wait_for_load(target: str, clients: int, timeout: float) -> None:
    """Returns once the load's measured part has begun: the server has answered more steps than
    the clients' warm-up ones (so py-spy does not spend its seconds on the load's start-up)."""
    from gdn_client import Client

    deadline = time.monotonic() + timeout
    with Client(target) as client:
        while time.monotonic() < deadline:
            if client.stats().requests > 2 * clients:
                return
            time.sleep(0.1)
    raise RuntimeError(f"the load did not start within {timeout:.0f} s")


def profile_point(args: argparse.Namespace, py_spy: str, clients: int, out: Path) -> None:
    server_cmd = common.server_command(args.device, args.model, max(clients, 8), args.server_flags)
    raw = out / f"prof_{clients}.txt"
    spy = [py_spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--threads",
           *shlex.split(args.spy_flags)]
    load_flags = ["--clients", str(clients), "--duration", str(args.duration),
                  "--processes", str(args.load_processes), *shlex.split(args.load_flags)]
    server = common.Server(server_cmd, cwd=args.server_tree).start()
    load = wrapped = None
    try:
        target = server.wait()
        load = subprocess.Popen(common.loadtest_args(target, out / f"load_{clients}.json", load_flags), cwd=common.REPO)
        wait_for_load(target, clients, timeout=120.0)
        watched = load if args.spy_on == "load" else server.proc
        assert watched is not None
        recorded = subprocess.run([*spy, "-d", str(max(1, int(args.duration) - 1)), "--pid", str(watched.pid)],
                                  capture_output=True, text=True)
        load.wait(timeout=args.duration + 120)
        if recorded.returncode != 0 and args.spy_on == "load":
            print(f"py-spy could not attach to the load ({recorded.stderr.strip()[-200:]})", flush=True)
        elif recorded.returncode != 0:
            print(f"py-spy could not attach ({recorded.stderr.strip()[-200:]}); starting the server under it",
                  flush=True)
            server.stop()
            wrapped = common.Server([*spy, "--", *server_cmd], cwd=args.server_tree).start()
            target = wrapped.wait()
            subprocess.run(common.loadtest_args(target, out / f"load_{clients}.json", load_flags),
                           timeout=args.duration + 120, cwd=common.REPO)
            assert wrapped.proc is not None
            wrapped.proc.send_signal(signal.SIGINT)  # py-spy passes it on, then writes its file
            wrapped.proc.wait(60)
    finally:
        if load is not None and load.poll() is None:  # a load left running would skew the next point
            load.terminate()
            load.wait(30)
        for s in (server, wrapped):
            if s is not None:
                s.stop()
    if raw.exists():
        (out / f"prof_{clients}.md").write_text(summarize(raw) + "\n")
        print(f"\n## {clients} clients\n")
        print("\n".join(summarize(raw, top=12).splitlines()[:40]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0", help="server shape flags")
    p.add_argument("--server-flags", default="",
                   help="more gdn-server flags, e.g. --server-flags='--max-batch-rows 64'")
    p.add_argument("--server-tree", default=None,
                   help="profile the server of this source tree instead of this checkout's (e.g. an older commit's)")
    p.add_argument("--clients", default="1,64")
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--spy-on", choices=("server", "load"), default="server",
                   help="the process py-spy records: the server, or the gdn-loadtest process driving it "
                        "(with --load-processes > 1, add --subprocesses to --spy-flags for its children)")
    p.add_argument("--load-processes", type=int, default=1, help="gdn-loadtest --processes")
    p.add_argument("--load-flags", default="",
                   help="more gdn-loadtest flags, e.g. --load-flags='--mode unary --batch 256'")
    p.add_argument("--spy-flags", default="--nonblocking",
                   help="more py-spy record flags: '--native' for C frames too (pauses the process per sample)")
    p.add_argument("--out", default=None, help="parent folder of the results (default bench/out)")
    args = p.parse_args()
    py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not py_spy:
        sys.exit("py-spy not found (PATH or $PY_SPY)")
    out = common.out_path("profile", args.out, suffix="")
    out.mkdir(parents=True, exist_ok=True)
    for clients in (int(c) for c in args.clients.split(",")):
        profile_point(args, py_spy, clients, out)
    common.write_json(out / "run.json", {"args": vars(args)})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
