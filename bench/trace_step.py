"""Where one step's latency goes at N=1: timestamps of every stage of a T=1 step, client and
server, on one host (CLOCK_MONOTONIC is shared by the two processes).

    python bench/trace_step.py --device cuda --steps 3000          # one-process server, auto scheduler
    python bench/trace_step.py --device cuda --batch 256 --mode unary --steps 200   # issue 4 (c)
    python bench/trace_step.py --device cpu --model "--layers 4 --q-heads 2 --v-heads 4" \\
        --server-flags "--scheduler-runs-on loop"
    python bench/trace_step.py --echo-only --echo-work-us 200 --echo-work-kind spin   # the echo alone,
        # plain and with 200 us of work per step, in turn: does a server's own work lengthen its legs?
    python bench/trace_step.py --device cuda --server-flags "--frontends 8"   # through a worker and an engine
    python bench/trace_step.py --device cpu --fake-device auto --batch 256 --mode unary --steps 100 \
        --server-flags "--frontends 1 --frontend-transport native" --client-transport native
        # (c) through a native worker on any machine: the engine's backend is the host-only one

The server runs in a child process with a few of its methods wrapped to take a timestamp (this
file, --serve; the product code has no tracing in it). One client, gdn-loadtest's own worker,
sends --steps steps over one stream after a warm-up, one at a time, so the i-th timestamp of
each stage belongs to the i-th step. Then the same client against the bytes echo of the same
sizes. Prints the median and p90 of each segment and writes trace_step.json.

Segments: client send -> the request's bytes reach the DecodeRequest parser ("parse") -> parsed
("parsed") -> the servicer has it ("in") -> validated and queued
("queued") -> its round starts ("round") -> [CUDA backend: submit called ("submit") -> inputs
staged ("filled") -> the NaN/Inf check validation left to it done ("checked"), big requests only]
-> the backend's submit returned ("submitted") ->
the round that answers it starts ("finish") -> futures settled ("answered") -> the stream's
writer has its reply bytes ("reply") -> client has the reply.

With --frontends N in --server-flags the router starts its workers and engines through
bench/trace_child.py, which stamps them too (FRONTEND_STAGES): the worker's parse, its checks
("validated"), the request's ring copy and frame ("framed"), its link's frame out ("sent"), the
engine's read of it ("link in"), the engine's stages as above, its replies handed to the link's
sender ("flushed"), the worker's read of the reply ("reply in") and its DecodeResponse's bytes ("reply").
Every process uses CLOCK_MONOTONIC, one clock on one host.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path


import numpy as np
from listening import start_listening  # this folder (python bench/trace_step.py puts it on sys.path)

STAGES = ("parse", "parsed", "in", "queued", "round", "submit", "filled", "checked", "submitted", "finish", "answered",
          "reply")
# With --frontends N in --server-flags: a worker's stages, its engine's, then the worker's again.
# "validated": the worker has checked the request; "framed": its inputs are in the request ring and
# its frame is made; "sent": the worker's link has written the frame; "link in": the engine reads
# it; "flushed": the engine's round has handed its replies to the link's sender; "reply in": the
# worker reads the reply.
FRONTEND_STAGES = ("parse", "parsed", "in", "validated", "framed", "sent", "link in", "queued", "round", "submit",
                   "filled", "checked", "submitted", "finish", "answered", "flushed", "reply in", "reply")
# inside the CUDA backend's submit; "checked" only where validation left the NaN/Inf check to it
OPTIONAL = ("submit", "filled", "checked", "link in")  # "link in": not where the C takes a ring's request whole


# -- the server side (--serve): wrap a few methods, dump the stamps at exit --------------------------

def _work(kind: str, us: int):
    """`us` microseconds of work per step for the echo's handler (--echo-work-us): a spin on the
    clock (no memory traffic), or reads over a 64 MiB buffer (caches evicted, as a server's own
    ~200 us of Python, torch and CUDA calls would evict gRPC's). Asks whether a server's own work
    between its transport legs lengthens those legs."""
    if us <= 0:
        return lambda: None
    buffer = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    chunk, place = 256 << 10, [0]

    def work() -> None:
        deadline = time.monotonic_ns() + us * 1000
        while time.monotonic_ns() < deadline:
            if kind == "touch":
                start = place[0]
                int(buffer[start:start + chunk].sum())
                place[0] = (start + chunk) % len(buffer)

    return work


def _serve_echo(trace_out: str, work_kind: str, work_us: int) -> int:
    """The bytes echo (gdn_client._echo) with a stamp when its handler has a request and one when
    it has the reply: the echo's two transport legs, to set beside ours."""
    from gdn_client import _echo

    stamps: dict[str, list[int]] = {"echo in": [], "echo out": []}
    reply = _echo._reply
    work = _work(work_kind, work_us)

    def traced(request: bytes) -> bytes:
        stamps["echo in"].append(time.monotonic_ns())
        work()
        out = reply(request)
        stamps["echo out"].append(time.monotonic_ns())
        return out

    _echo._reply = traced
    atexit.register(lambda: Path(trace_out).write_text(json.dumps(stamps)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _echo.main(["--host", "127.0.0.1", "--port", "0"])
    return 0


def _around(stamps: dict[str, list[int]], owner, name: str, before: str | None = None, after: str | None = None,
            when=lambda *a, **k: True) -> None:
    """Replaces `owner.name` with a wrapper that appends a timestamp to stamps[before] before the
    call and to stamps[after] after it, for the calls `when` accepts."""
    original = getattr(owner, name)
    now = time.monotonic_ns

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        on = when(*args, **kwargs)
        if on and before:
            stamps[before].append(now())
        result = original(*args, **kwargs)
        if on and after:
            stamps[after].append(now())
        return result

    setattr(owner, name, wrapped)


def install_stamps(role: str) -> dict[str, list[int]]:
    """Wraps this process's methods of `role` ("server": one process; "worker" and "engine":
    the --frontends children) to append a timestamp per stage; returns the stamps."""
    from gdn_server import decode_rpcs, protowire, scheduler, servicer
    from gdn_server.backends import cpu, cuda

    if role == "worker":  # imported before protowire's parser is wrapped: it keeps the plain one, wrapped below
        from gdn_server import frontend_native

    stamps: dict[str, list[int]] = {s: [] for s in (STAGES if role == "server" else FRONTEND_STAGES)}
    around = functools.partial(_around, stamps)

    if role in ("server", "worker"):
        # the server's DecodeRequest parser (RejectMalformed looks it up when the server is built)
        around(protowire, "parse_decode_request", before="parse", after="parsed")
    if role == "server":  # (a worker's replies are made as it reads them from its link: stamped below)
        around(decode_rpcs, "_reply", before="reply")
    if role in ("server", "engine"):
        around(scheduler.Scheduler, "_launch", before="round", when=lambda self, items, *a, **k: bool(items))
        around(cuda.CudaBackend, "submit", before="submit", after="submitted")
        around(cuda, "_fill_staging", after="filled")
        around(cuda, "_staged_nonfinite", after="checked")
        around(cpu.CpuBackend, "submit", after="submitted")
        around(scheduler.Scheduler, "_finish", before="finish", after="answered",
               when=lambda self, in_flight: bool(in_flight))
    if role == "server":
        around(servicer.GdnDecodeServicer, "_submit_decode", before="in", after="queued")
    elif role == "worker":
        from gdn_server import frontend

        # --frontend-transport native: its parser (the grpc transport's is protowire's, wrapped above)
        around(frontend_native, "parse_decode_request", before="parse", after="parsed")
        around(frontend.FrontendDecodeRpcs, "_submit_decode", before="in")  # a DecodeStream's request
        around(frontend.FrontendDecodeRpcs, "_validated", after="validated")
        around(frontend, "encode_request", after="framed")  # its inputs copied into the ring, its frame made
        around(frontend.EngineLinkClient, "_send", after="sent")  # submit and submit_to alike
        around(frontend, "decode_reply", before="reply in")  # the worker's read of the engine's reply frame
        around(frontend, "encode_decode_reply", after="reply")  # its DecodeResponse's bytes, made from the ring
    elif role == "engine":
        from gdn_server import engine_link, link

        if int(os.environ.get("GDN_TRACE_BATCH", "1")) > 1:
            # a big request comes in many reads where it rides in its frame: its decode (_take) is
            # its stamp; one whose inputs are in the ring is taken whole in C, unstamped (OPTIONAL)
            around(engine_link.EngineLink, "_take", before="link in",
                   when=lambda self, conn, frame, queued: frame[0] == link.KIND_DECODE)
        else:  # a plain step is taken in C (no _take): its read is its stamp
            around(engine_link.EngineLink, "_read_from", before="link in")
        around(scheduler.Scheduler, "submit_decodes", after="queued")
        # after each round of answers (and after each read, with nothing to send: not stamped)
        around(engine_link.EngineLink, "flush", after="flushed", when=lambda self: bool(self._dirty))
    return stamps


def stamp_child(role: str, out: Path) -> None:
    """For bench/trace_child.py: this --frontends child's stamps, written to `out` at its exit."""
    stamps = install_stamps(role)
    if role == "engine" and os.environ.get("GDN_TRACE_FAKE_DEVICE"):
        _fake_engine_device(stamps)
    atexit.register(lambda: out.write_text(json.dumps(stamps)))


def _fake_engine_device(stamps: dict[str, list[int]]) -> None:
    """--fake-device with --frontends: this engine's backend is bench/frontend.py's host-only one
    (CUDA's staging copies, a 60 us "device", zeros out), so a big request's hops through a worker
    and the link can be traced on a machine without a GPU, with no CPU kernel in the way."""
    from gdn_server import server

    import frontend  # this folder, on the children's PYTHONPATH

    _around(stamps, frontend.HostOnlyBackend, "submit", after="submitted")

    def host_only_backends(device, devices, shape, gates, max_sessions, scale=None, speculative_sessions=None):
        return [(0, frontend.HostOnlyBackend(shape, gates, max_sessions or 600, speculative_sessions=0))]

    server.make_backends = host_only_backends


def _spawning_traced_children(stamps_dir: Path, fake_device: bool = False, hook: str = "trace_step:stamp_child") -> None:
    """Makes this --frontends router start its workers and engines through bench/trace_child.py,
    which stamps them with `hook` (each writes its own file into `stamps_dir`)."""
    from gdn_server import frontend_pool, router

    bench = str(Path(__file__).resolve().parent)
    roles = {"gdn_server.frontend": "worker", "gdn_server.engine": "engine"}

    def wrap(original):
        async def spawn_ready(module, settings_json, name, env):
            env = {**env, "GDN_TRACE_MODULE": module, "GDN_TRACE_ROLE": roles[module], "GDN_TRACE_HOOK": hook,
                   **({"GDN_TRACE_FAKE_DEVICE": "1"} if fake_device else {}),
                   "GDN_TRACE_DIR": str(stamps_dir), "PYTHONPATH": os.pathsep.join(
                       [bench, str(Path(bench).parent), env.get("PYTHONPATH", "")])}
            return await original("trace_child", settings_json, name, env)
        return spawn_ready

    frontend_pool.spawn_ready = wrap(frontend_pool.spawn_ready)
    router.spawn_ready = wrap(router.spawn_ready)


def _serve(trace_out: str, flags: list[str], fake_device: str | None, serial_copies: bool) -> int:
    from gdn_server import cli
    from gdn_server.backends import staging

    if serial_copies:  # big copies and NaN/Inf checks on one thread, as before they went to torch
        import gdn_client.wire_checks

        staging.PARALLEL_COPY_BYTES = gdn_client.wire_checks._PARALLEL_CHECK_BYTES = 1 << 62

    if _frontends(flags):  # the decode path runs in the children; this router only starts them
        _spawning_traced_children(Path(trace_out).parent / "children", fake_device is not None)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        return cli.main(flags)
    stamps = install_stamps("server")
    atexit.register(lambda: Path(trace_out).write_text(json.dumps(stamps)))
    if fake_device is not None:  # bench/frontend.py's server: CUDA's host work, a 60 us "device"
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import frontend

        _around(stamps, frontend.HostOnlyBackend, "submit", after="submitted")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # atexit runs on the way out
        frontend.run_server(0, sessions=600, runs_on=fake_device)
        return 0
    return cli.main(flags)


def _frontends(flags: list[str]) -> bool:
    """Whether server flags ask for --frontends workers (N > 0)."""
    for i, flag in enumerate(flags):
        if flag == "--frontends" and i + 1 < len(flags):
            return flags[i + 1] != "0"
        if flag.startswith("--frontends="):
            return flag.split("=", 1)[1] != "0"
    return False


# -- the client side -------------------------------------------------------------------------------

async def _client_run(worker, warmup: int, steps: int) -> list[tuple[int, int]]:
    await worker.open()
    times = []
    for i in range(warmup + steps):
        request = worker.prepare()
        t0 = time.monotonic_ns()
        reply = await worker.send(request)
        t1 = time.monotonic_ns()
        worker.check(reply)
        if i >= warmup:
            times.append((t0, t1))
    await worker.close()
    return times


async def _gdn_client(target: str, warmup: int, steps: int, batch: int, mode: str, transport: str = "grpc"):
    from gdn_client.loadtest import LoadConfig, _GdnWorker, _server_view

    cfg = LoadConfig(target=target, clients=1, batch=batch, mode=mode, progress=False, client_transport=transport)
    info, _ = await _server_view(target, 30)
    worker = _GdnWorker(cfg, info, 0)
    times = await _client_run(worker, warmup, steps)
    return times, worker.request_bytes, worker.reply_bytes


async def _echo_client(address: str, request_bytes: int, reply_bytes: int, warmup: int, steps: int, mode: str,
                       transport: str = "grpc"):
    from gdn_client.loadtest import LoadConfig, _EchoWorker

    cfg = LoadConfig(target=address, clients=1, mode=mode, progress=False, client_transport=transport)
    return await _client_run(_EchoWorker(cfg, address, request_bytes, reply_bytes), warmup, steps)


@contextlib.contextmanager
def _started(cmd: list[str], env: dict[str, str] | None = None):
    """Starts a server child process; yields its address; stops it (its stamps are written at exit)."""
    proc, address = start_listening(cmd, env=env)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(60)


def _pct(values_ns: list[int] | np.ndarray) -> tuple[float, float]:
    a = np.asarray(values_ns, dtype=np.float64) / 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 90))


def _segments(points: list[tuple[str, np.ndarray]]) -> list[dict]:
    """The p50 and p90 of each segment between successive (stage, timestamps) points."""
    rows = []
    for (a, ta), (b, tb) in zip(points, points[1:]):
        p50, p90 = _pct(tb - ta)
        rows.append({"from": a, "to": b, "p50_us": p50, "p90_us": p90})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trace-out", help=argparse.SUPPRESS)
    p.add_argument("--serve-echo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="--preset qwen3-next --devices 0")
    p.add_argument("--server-flags", default="")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--batch", type=int, default=1, help="sessions per request (B)")
    p.add_argument("--mode", default="stream", choices=("stream", "unary"))
    p.add_argument("--client-transport", default="grpc", choices=("grpc", "native"),
                   help="the client's transport, ours and the echo's alike (gdn-loadtest --client-transport)")
    p.add_argument("--serial-copies", action="store_true",
                   help="no torch thread pool for big copies and checks (the server as before it used one)")
    p.add_argument("--fake-device", choices=("auto", "loop", "thread"),
                   help="serve with bench/frontend.py's host-only backend (any machine), scheduler on this")
    p.add_argument("--echo-work-us", type=int, default=0,
                   help="the echo's handler works this long per step (between its legs): do the legs grow?")
    p.add_argument("--echo-work-kind", choices=("spin", "touch"), default="touch",
                   help="that work: a spin on the clock, or reads over 64 MiB (caches evicted)")
    p.add_argument("--echo-only", action="store_true",
                   help="only the echo (with --echo-work-us: its legs against the plain echo's, both run)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args, rest = p.parse_known_args()
    if args.serve_echo:
        sys.exit(_serve_echo(args.trace_out, args.echo_work_kind, args.echo_work_us))
    if args.serve:
        sys.exit(_serve(args.trace_out, rest, args.fake_device, args.serial_copies))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.echo_only:
        _echo_work_table(args, out)
        return
    trace = out / "trace_server.json"
    children = out / "children"  # --frontends: a stamps file per worker and engine
    if children.exists():
        for old in children.glob("*.json"):
            old.unlink()
    children.mkdir(exist_ok=True)
    cmd = [sys.executable, __file__, "--serve", "--trace-out", str(trace), "--host", "127.0.0.1", "--port", "0",
           "--device", args.device, "--max-sessions", str(max(8, args.batch)), "--log-level", "WARNING", *args.model.split(),
           *args.server_flags.split(), *(["--fake-device", args.fake_device] if args.fake_device else []),
           *(["--serial-copies"] if args.serial_copies else [])]
    os.environ["GDN_TRACE_BATCH"] = str(args.batch)  # the engines' stamps (install_stamps), through the router's env
    with _started(cmd) as target:
        times, request_bytes, reply_bytes = asyncio.run(
            _gdn_client(target, args.warmup, args.steps, args.batch, args.mode, args.client_transport))
    echo_rows, echo = _echo_legs(args, out, request_bytes, reply_bytes, args.echo_work_us)

    frontends = _frontends(args.server_flags.split())
    stamps = _children_stamps(children, args.warmup + args.steps) if frontends else json.loads(trace.read_text())
    n = args.steps
    # the server saw the warm-up steps first (and a CloseSession round after ours)
    w = args.warmup
    stamps = {s: v for s, v in stamps.items() if s not in OPTIONAL or len(v) >= w + n}
    server = {s: np.asarray(v[w:w + n], dtype=np.int64) for s, v in stamps.items()}
    if any(len(v) < n for v in server.values()):
        raise RuntimeError(f"missing stamps: { {s: len(v) for s, v in stamps.items()} }")
    sent = np.asarray([t[0] for t in times], dtype=np.int64)
    got = np.asarray([t[1] for t in times], dtype=np.int64)
    order = FRONTEND_STAGES if frontends else STAGES
    rows = _segments([("client sent", sent), *((s, server[s]) for s in order if s in server),
                      ("client has reply", got)])
    total = _pct(got - sent)
    lines = ["| segment | p50 us | p90 us |", "|---|---|---|"]
    lines += [f"| {r['from']} -> {r['to']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} |" for r in rows]
    lines += [f"| **round trip (ours)** | {total[0]:.1f} | {total[1]:.1f} |"]
    lines += [f"| echo: {r['from']} -> {r['to']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} |" for r in echo_rows]
    lines += [f"| **round trip (echo, same bytes)** | {echo[0]:.1f} | {echo[1]:.1f} |"]
    table = "\n".join(lines)
    print(table)
    (out / "trace_step.md").write_text(table + "\n")
    (out / "trace_step.json").write_text(json.dumps({
        "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "segments": rows, "echo_segments": echo_rows,
        "round_trip_us": {"p50": total[0], "p90": total[1]}, "echo_round_trip_us": {"p50": echo[0], "p90": echo[1]},
        "request_bytes": request_bytes, "reply_bytes": reply_bytes,
    }, indent=1))


def _children_stamps(directory: Path, count: int) -> dict[str, list[int]]:
    """The --frontends children's stamps, stage by stage: one client's steps all go through one
    worker and one engine, so each stage's stamps come from the one file with at least `count`
    (the other workers saw none of them)."""
    merged: dict[str, list[int]] = {}
    for path in sorted(directory.glob("*.json")):
        for stage, values in json.loads(path.read_text()).items():
            if len(values) >= count:
                if stage in merged:
                    raise RuntimeError(f"stage {stage!r} stamped by two processes (several clients' workers?)")
                merged[stage] = values
    if not merged:
        raise RuntimeError(f"no child wrote its stamps into {directory}")
    return merged


def _echo_legs(args, out: Path, request_bytes: int, reply_bytes: int, work_us: int) -> tuple[list[dict], tuple[float, float]]:
    """The echo of the same bytes at N=1: its segments (client -> handler -> client) and round trip."""
    echo_trace = out / "trace_echo.json"
    cmd = [sys.executable, __file__, "--serve-echo", "--trace-out", str(echo_trace),
           "--echo-work-kind", args.echo_work_kind, "--echo-work-us", str(work_us)]
    from gdn_client._echo import echo_env  # the floor on gRPC's defaults, as gdn-loadtest --echo starts it

    with _started(cmd, env=echo_env()) as address:
        echo_times = asyncio.run(_echo_client(address, request_bytes, reply_bytes, args.warmup, args.steps, args.mode,
                                              args.client_transport))
    w, n = args.warmup, args.steps
    # the echo's legs: its handler's stamps, after the warm-up (it served only this client)
    echo_stamps = {k: np.asarray(v[w:w + n], dtype=np.int64) for k, v in json.loads(echo_trace.read_text()).items()}
    e_sent = np.asarray([t[0] for t in echo_times], dtype=np.int64)
    e_got = np.asarray([t[1] for t in echo_times], dtype=np.int64)
    rows = _segments([("client sent", e_sent), ("echo in", echo_stamps["echo in"]),
                      ("echo out", echo_stamps["echo out"]), ("client has reply", e_got)])
    return rows, _pct(e_got - e_sent)


# a qwen3-next T=1, B=1 DecodeRequest and its reply (trace_step.json of the real server)
ECHO_ONLY_REQUEST_BYTES, ECHO_ONLY_REPLY_BYTES = 16614, 8213


def _echo_work_table(args, out: Path) -> None:
    """--echo-only: the plain echo's legs, then the echo's with --echo-work-us of work per step
    between them, alternating, so a host's drift shows. Writes echo_work.json."""
    runs = []
    for _ in range(2):
        for us in (0, args.echo_work_us):
            rows, total = _echo_legs(args, out, ECHO_ONLY_REQUEST_BYTES, ECHO_ONLY_REPLY_BYTES, us)
            runs.append({"work_us": us, "kind": args.echo_work_kind, "segments": rows,
                         "round_trip_us": {"p50": total[0], "p90": total[1]}})
    lines = ["| echo's work per step | client -> handler p50 us | handler -> client p50 us | round trip p50 us |",
             "|---|---|---|---|"]
    for r in runs:
        legs = r["segments"]
        lines.append(f"| {r['work_us']} us ({r['kind']}) | {legs[0]['p50_us']:.1f} | {legs[2]['p50_us']:.1f} | "
                     f"{r['round_trip_us']['p50']:.1f} |")
    table = "\n".join(lines)
    print(table)
    (out / "echo_work.md").write_text(table + "\n")
    (out / "echo_work.json").write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                    "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
