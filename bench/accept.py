"""How fast a grpc.aio server takes new calls while its event loop is busy: the floor under a
load that opens calls at a steady rate (gdn-loadtest --speculative sends a unary Commit per session
each pass over the layers).

    python bench/accept.py                        # busy chunks 0, 0.3, 1, 3 ms; GIL switch 0.2 ms
    python bench/accept.py --busy-ms 0,1 --switch-ms 5,0.2
    python bench/accept.py --busy-ms 1 --accept-loops 1,2,4

For each point a bare grpc.aio server (one generic unary method, no interceptor, nothing of
gdn_server) runs in a child process whose event loop is kept busy by a task of pure Python work
that yields after every --busy-ms (0: an idle loop); this process then sends bursts of --calls
unary calls at once, each on its own channel (so each is a new call on the server), and reports
when the last of a burst came back, and that time per call: new calls are taken one after another,
so it is the pace at which the server takes them.

--accept-loops N runs N - 1 more loops taking new calls beside grpc.aio's own one (through
grpc.aio's private Cython core: an experiment, not something gdn-server does), to show whether that
one loop is what sets the pace.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

import common

METHOD = "/bench.Accept/Echo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def extra_accept_loop(server, handler) -> None:
    """Takes new calls of `server` and runs `handler` for each, as grpc.aio's own accept loop does
    (with no interceptors, concurrency limit or cancellation watcher). It calls names private to
    grpc.aio's Cython core (grpcio 1.84-1.85), which is why only this experiment does it."""
    from grpc._cython import cygrpc

    class Resolver:
        def resolve_handler(self, *args):
            return handler

    core, loop, resolver = server._server, asyncio.get_running_loop(), Resolver()
    while True:
        state = await core._request_call()
        loop.create_task(cygrpc._handle_rpc(None, resolver, (), state, loop, False))


async def serve(port: int, busy_ms: float, switch_ms: float, accept_loops: int) -> None:
    """The child: a bare echo server, its loop busy in chunks of `busy_ms` of Python work."""
    import grpc

    sys.setswitchinterval(switch_ms / 1e3)
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Accept", {"Echo": handler}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    # held here: the loop keeps only weak references to tasks
    extra = [asyncio.ensure_future(extra_accept_loop(server, handler)) for _ in range(accept_loops - 1)]
    print("ready", flush=True)
    while busy_ms > 0:
        until = time.perf_counter() + busy_ms / 1e3
        while time.perf_counter() < until:
            pass
        await asyncio.sleep(0)  # one chunk per loop turn: the server's own callbacks run between
    await server.wait_for_termination()


async def bursts(port: int, calls: int, rounds: int) -> list[float]:
    """Seconds from a burst's start until its last reply, per round."""
    import grpc

    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(calls)]
    echoes = [ch.unary_unary(METHOD) for ch in channels]
    await asyncio.gather(*(echo(b"x", timeout=30) for echo in echoes))  # connections up before timing
    spreads = []
    for _ in range(rounds):
        start = time.perf_counter()
        await asyncio.gather(*(echo(b"x", timeout=30) for echo in echoes))
        spreads.append(time.perf_counter() - start)
        await asyncio.sleep(0.2)
    for ch in channels:
        await ch.close()
    return spreads


def point(busy_ms: float, switch_ms: float, accept_loops: int, calls: int, rounds: int) -> dict:
    port = free_port()
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(busy_ms), str(switch_ms),
                              str(accept_loops)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the bare server did not start")
        spreads = asyncio.run(bursts(port, calls, rounds))
    finally:
        child.kill()
        child.wait(10)
    spread = statistics.median(spreads)
    return {"busy_ms": busy_ms, "switch_ms": switch_ms, "accept_loops": accept_loops, "calls": calls,
            "burst_ms": spread * 1e3, "per_call_ms": spread * 1e3 / calls, "bursts_ms": [s * 1e3 for s in spreads]}


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--serve":
        asyncio.run(serve(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy-ms", default="0,0.3,1,3", help="chunks of Python work between the loop's turns")
    p.add_argument("--switch-ms", default="0.2", help="GIL switch intervals (gdn-server sets 0.2 ms)")
    p.add_argument("--accept-loops", default="1", help="loops taking new calls (1: grpc.aio's own only)")
    p.add_argument("--calls", type=int, default=20, help="calls per burst, each on its own channel")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="folder of the result file (default bench/out)")
    args = p.parse_args()
    results = [point(float(b), float(s), int(n), args.calls, args.rounds) for s in args.switch_ms.split(",")
               for n in args.accept_loops.split(",") for b in args.busy_ms.split(",")]
    print(common.markdown_table(
        ["busy chunk ms", "GIL switch ms", "accept loops", f"burst of {args.calls}, ms (median)", "per call, ms"],
        [(r["busy_ms"], r["switch_ms"], r["accept_loops"], f"{r['burst_ms']:.1f}", f"{r['per_call_ms']:.2f}")
         for r in results]))
    path = common.write_json(common.out_path("accept", args.out), {"points": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
