"""The floor of a native gRPC front end: the bytes echo of gdn-loadtest served by bench/h2_floor.c
(C, HTTP/2 through the system's libnghttp2), by the workers' own transport (gdn_server._native's
H2Transport, the same HTTP/2 in C, each message answered by Python on uvloop, as
`--frontend-transport native` does) and by grpc.aio (gdn_client._echo), all driven by
gdn-loadtest's own echo clients with a decode step's sizes.

    python bench/h2_floor.py                                  # 8 and 64 clients, 2 rounds
    python bench/h2_floor.py --clients 64 --rounds 3 --load-processes 4 --json out.json

What it says: how much CPU a step's transport costs the server when HTTP/2 runs in C, with and
without Python answering each message, against grpc.aio's (~150-230 us per step on the hosts we
measure; bench/NOTES.md).
That is the floor of a C worker in front of the engine, before any of a worker's own work
(parsing and checking the request, the link, the reply's encoding). Each server is first checked
to be a correct echo (`check`). Prints a table and writes JSON: steps/s, p50, and the server's
CPU per step (its process's CPU time over the run, from /proc, divided by the steps).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_client._echo import STREAM, UNARY, _reply, echo_env, echo_request  # noqa: E402
from gdn_client.loadtest import LoadConfig, run_echo  # noqa: E402
from listening import start_listening  # noqa: E402  (this folder)
from procstat import cpu_s, stat_fields  # noqa: E402  (this folder)

HERE = Path(__file__).resolve().parent
REQUEST_BYTES = 16_614  # a qwen3-next DecodeRequest of one session, T=1, as gdn-loadtest sends it
REPLY_BYTES = 8_213  # its DecodeResponse


def _libnghttp2() -> str:
    """What to link: the file GDN_LIBNGHTTP2 names (bench/gpu_session.sh sets it, and
    LD_LIBRARY_PATH, for a carried copy), else the system's library."""
    lib = os.environ.get("GDN_LIBNGHTTP2") or ctypes.util.find_library("nghttp2")
    if lib is None:
        raise SystemExit("h2_floor: no libnghttp2 on this machine (set GDN_LIBNGHTTP2 to a libnghttp2.so.14)")
    return lib if "/" in lib else f"-l:{lib}"  # a file is linked as itself


def build(out_dir: Path) -> Path:
    """Compiles h2_floor.c against the system's libnghttp2 (no header needed: nghttp2_api.h
    declares what it uses)."""
    binary = out_dir / "h2_floor"
    subprocess.run(["gcc", "-O2", "-pthread", str(HERE / "h2_floor.c"), "-o", str(binary), _libnghttp2()],
                   check=True)
    return binary


def serve_transport() -> None:
    """The echo through the workers' H2Transport: HTTP/2 in C, each message answered by Python on
    uvloop's loop (`python bench/h2_floor.py --serve-transport`)."""
    import socket

    import uvloop  # noqa: PLC0415  (only this child needs it)

    from gdn_server.native import module as native  # noqa: PLC0415

    paths = (STREAM, UNARY)

    async def main() -> None:
        transport = native.H2Transport(256 << 20)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.setblocking(False)
        transport.add_listener(listener.detach())
        echoes: set[int] = set()  # open streams of the echo's methods

        def handle(events: list) -> None:
            for event in events:
                kind, h = event[0], event[1]
                if kind == native.H2_OPEN:
                    if event[2] in paths:
                        echoes.add(h)
                    else:
                        transport.finish(h, 12)  # UNIMPLEMENTED
                elif kind == native.H2_MESSAGE and h in echoes:
                    transport.send(h, _reply(event[2]))
                elif kind == native.H2_HALF_CLOSE and h in echoes:
                    transport.finish(h, 0)
                    echoes.discard(h)
                elif kind == native.H2_GONE:
                    echoes.discard(h)

        def ready() -> None:
            handle(transport.poll())
            handle(transport.flush())

        asyncio.get_running_loop().add_reader(transport.fileno(), ready)
        print(f"listening on 127.0.0.1:{port}", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


async def check(address: str) -> None:
    """Each server must be a correct echo before it is timed: unary and streamed replies byte for
    byte (three streams on one connection), a 3 MB message, UNIMPLEMENTED for another method, a
    stream cancelled mid-way and a connection dropped with a stream open, each followed by a
    call that is still served."""
    async with grpc.aio.insecure_channel(address) as channel:
        unary = channel.unary_unary(UNARY)
        request = echo_request(REQUEST_BYTES, REPLY_BYTES)
        assert await unary(request, timeout=10) == _reply(request), "unary echo"
        calls = [channel.stream_stream(STREAM)() for _ in range(3)]
        for i in range(50):
            for call in calls:
                message = echo_request(100 + i * 300, i * 97)
                await call.write(message)
                assert await call.read() == _reply(message), f"stream echo {i}"
        for call in calls:
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK, "stream end"
        try:
            await channel.unary_unary("/gdn.bench.Nope/Nope")(b"x", timeout=10)
            raise AssertionError("an unknown method was answered")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e.code()
        big = echo_request(3_000_000, 2_000_000)
        assert await unary(big, timeout=30) == _reply(big), "3 MB echo"
        call = channel.stream_stream(STREAM)()
        await call.write(request)
        await call.read()
        call.cancel()
        assert await unary(request, timeout=10) == _reply(request), "after a cancelled stream"
    async with grpc.aio.insecure_channel(address) as dropped:
        call = dropped.stream_stream(STREAM)()
        await call.write(request)
        await call.read()
    async with grpc.aio.insecure_channel(address) as channel:
        assert await channel.unary_unary(UNARY)(request, timeout=10) == _reply(request), "after a dropped connection"


def one_run(pid: int, address: str, clients: int, args: argparse.Namespace) -> dict:
    cfg = LoadConfig(target=address, clients=clients, mode="stream", duration=args.duration, progress=False)
    stat = f"/proc/{pid}/stat"
    before, t0 = cpu_s(stat_fields(stat)), time.monotonic()
    result = asyncio.run(run_echo(cfg, address, args.request_bytes, args.reply_bytes, 1, args.load_processes))
    used = cpu_s(stat_fields(stat)) - before
    # the server's CPU over the whole call (start-up and warm-up of the clients included, a few
    # percent at these durations): an upper bound on its cost per measured step
    return {"steps_per_s": result.steps_per_s, "p50_ms": result.latency_ms.get("p50", float("nan")),
            "errors": result.errors, "steps": result.steps, "server_cpu_s": used,
            "server_us_per_step": used / max(1, result.steps) * 1e6, "wall_s": time.monotonic() - t0,
            "load_cores": result.load_cores}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="8,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--load-processes", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="the C echo's epoll threads")
    p.add_argument("--request-bytes", type=int, default=REQUEST_BYTES)
    p.add_argument("--reply-bytes", type=int, default=REPLY_BYTES)
    p.add_argument("--json", type=Path)
    p.add_argument("--serve-transport", action="store_true", help=argparse.SUPPRESS)  # a child: see serve_transport
    args = p.parse_args()
    if args.serve_transport:
        serve_transport()
        return
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        servers = {
            "c-nghttp2": start_listening([str(binary), "0", str(args.threads)], timeout=60),
            "c-transport+python": start_listening([sys.executable, __file__, "--serve-transport"], timeout=60),
            "grpc.aio": start_listening([sys.executable, "-m", "gdn_client._echo", "--host", "127.0.0.1", "--port", "0"],
                                        timeout=60, env=echo_env()),
        }
        try:
            for name, (_, address) in servers.items():
                asyncio.run(check(address))
                print(f"{name}: a correct echo", flush=True)
            for clients in (int(c) for c in args.clients.split(",")):
                for round_index in range(args.rounds):
                    order = list(servers.items())
                    for name, (proc, address) in order if round_index % 2 == 0 else order[::-1]:
                        run = {"server": name, "clients": clients, "round": round_index,
                               **one_run(proc.pid, address, clients, args)}
                        runs.append(run)
                        print(f"{name} x{clients} round {round_index}: {run['steps_per_s']:,.0f} steps/s, "
                              f"p50 {run['p50_ms']:.3f} ms, server {run['server_us_per_step']:.1f} us CPU/step, "
                              f"{run['errors']} errors", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.kill()
                proc.wait()
    servers_order = ("c-nghttp2", "c-transport+python", "grpc.aio")
    lines = ["| server | clients | median steps/s | median p50 ms | median server CPU us/step |", "|---|---|---|---|---|"]
    for clients in sorted({r["clients"] for r in runs}):
        for name in servers_order:
            rs = [r for r in runs if r["server"] == name and r["clients"] == clients]
            med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
            lines.append(f"| {name} | {clients} | {med('steps_per_s'):,.0f} | {med('p50_ms'):.3f} | "
                         f"{med('server_us_per_step'):.1f} |")
    print("\n".join(lines))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                         "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))


if __name__ == "__main__":
    main()
