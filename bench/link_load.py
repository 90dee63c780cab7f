"""The engine behind a front end that costs nothing: decode steps written straight onto an engine's
decode link, with no gRPC and no worker in between.

Why: at 64 clients behind `--frontends 8` the host's cores run out on the workers' and the load's
gRPC (bench/NOTES.md, twenty-sixth session), so batching on/off there measures Python gRPC as much
as the engine. This load plays the workers' part with their own link code
(gdn_server.frontend.EngineLinkClient: request frames, the shared-memory rings, reply frames) and
nothing else, so what it measures is the engine's ceiling: what any front end, however cheap,
could get out of this engine at this concurrency.

    gdn-server --frontends 1 ...   # with TMPDIR set: its link is TMPDIR/gdn-engine-*/link-0.sock
    python bench/link_load.py --target 127.0.0.1:PORT --link /tmp/x/gdn-engine-abc/link-0.sock \\
        --clients 64 --processes 8 --duration 5 --json out.json

Each load process is one link connection (as a worker is) carrying its share of the clients;
each client has one session, cycles the model's layers token by token and has one step in
flight, as gdn-loadtest's streaming clients do. Sessions are made and closed over gRPC. The JSON
is gdn-loadtest's (`runs[0]`: steps/s, latency, the server's rows per launch, the load's and the
host's cores), so bench/ab_live.py reads either (`--load link` there).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gdn_client._errors import GdnError as ClientError  # noqa: E402
from gdn_client.loadtest import (  # noqa: E402  (the load's own machinery: one way to count)
    LoadConfig, _child_main, _drive, _LineProgress, _result, _server_view, _spread,
)
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc  # noqa: E402
from gdn_server.config import ModelShape  # noqa: E402
from gdn_server.errors import GdnError as ServerError  # noqa: E402
from gdn_server.frontend import EngineLinkClient  # noqa: E402
from gdn_server.link import input_shapes  # noqa: E402
from gdn_server.work import DecodeResult, DecodeWork  # noqa: E402

INPUT_SETS = 4  # pre-drawn inputs per client, rotated (fresh random data, never zeros)


class LinkClient:
    """One client: a session, its inputs and positions, its steps on a shared link (gdn-loadtest's
    worker interface: open, prepare, send, check, exchange, close)."""

    def __init__(self, target: str, link: EngineLinkClient, shape: ModelShape, seed: int, timeout: float) -> None:
        self.target, self.link, self.shape, self.timeout = target, link, shape, timeout
        self.dims = input_shapes(shape, 1, 1)
        gen = torch.Generator().manual_seed(seed)
        self.inputs = [tuple(_bf16_bytes(torch.randn(*d, generator=gen)) for d in self.dims)
                       for _ in range(INPUT_SETS)]
        self.reply_bytes = shape.num_v_heads * shape.head_dim_v * 2
        self.positions = [0] * shape.num_layers
        self.step_index = 0
        self.layer = 0
        self.session_id = ""

    async def open(self) -> None:
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = gdn_pb2_grpc.GdnDecodeStub(channel)
            reply = await stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=self.timeout)
        self.session_id = reply.session_id

    def prepare(self) -> DecodeWork:
        self.layer = layer = self.step_index % self.shape.num_layers
        return DecodeWork.of_bf16(
            layer, (self.session_id,), (self.positions[layer],), "", False,
            self.inputs[self.step_index % INPUT_SETS], self.dims, True,
        )

    async def send(self, work: DecodeWork) -> DecodeResult:
        try:
            return await self.link.submit(work)
        except ServerError as err:  # the load's error type, so _drive counts it
            raise ClientError(err.message, err.code) from None

    def check(self, result: DecodeResult) -> None:
        if len(result.out) != self.reply_bytes or tuple(result.positions) != (self.positions[self.layer] + 1,):
            raise ClientError(f"reply of {len(result.out)} bytes at {tuple(result.positions)}; expected "
                              f"{self.reply_bytes} at ({self.positions[self.layer] + 1},)")
        self.positions[self.layer] += 1
        self.step_index += 1

    async def exchange(self) -> None:
        self.check(await self.send(self.prepare()))

    async def close(self) -> None:
        if not self.session_id:
            return
        async with grpc.aio.insecure_channel(self.target) as channel:
            with contextlib.suppress(grpc.RpcError):
                await gdn_pb2_grpc.GdnDecodeStub(channel).CloseSession(
                    gdn_pb2.CloseSessionRequest(session_id=self.session_id), timeout=self.timeout)


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()


async def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One load process (gdn-loadtest's child protocol): one link, its share of the clients,
    measured from the parent's "go"."""
    cfg = LoadConfig(**spec["config"])
    info, _ = await _server_view(cfg.target, cfg.timeout)
    shape = ModelShape(info.num_layers, info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v)
    link = await EngineLinkClient.connect(spec["link"], shape)
    clients = [LinkClient(cfg.target, link, shape, cfg.seed * 100_003 + spec["first_index"] + i, cfg.timeout)
               for i in range(cfg.clients)]
    loop = asyncio.get_running_loop()

    async def wait_for_go() -> None:
        print("ready", flush=True)
        if (await loop.run_in_executor(None, sys.stdin.readline)).strip() != "go":
            raise ClientError("the parent load process went away", grpc.StatusCode.CANCELLED)

    try:
        tallies, elapsed, _, cpu_s = await _drive(clients, cfg, "link", wait_for_go, bar=_LineProgress())
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await link.close()
    latencies = np.array([x for t in tallies for x in t.latencies], dtype=np.float64)
    return {"elapsed": elapsed, "cpu_s": cpu_s, "latencies": base64.b64encode(latencies.tobytes()).decode(),
            "errors": sum(t.errors for t in tallies), "error_samples": [m for t in tallies for m in t.error_samples][:5],
            "sizes": [shape.num_layers, sum(len(x) for x in clients[0].inputs[0]), clients[0].reply_bytes]}


async def run(cfg: LoadConfig, link: str, processes: int) -> dict[str, Any]:
    """The whole run, through gdn-loadtest's own spreading over processes: children started and
    warmed up, the server's stats taken before "go" and after the last result."""
    before = None

    async def snapshot() -> None:
        nonlocal before
        _, before = await _server_view(cfg.target, cfg.timeout)

    tallies, elapsed, host, cpu_s, sizes = await _spread(
        cfg, "link", processes, {"link": link}, "link", snapshot, child_command=(sys.executable, __file__, "--child"))
    _, after = await _server_view(cfg.target, cfg.timeout)
    delta = after.since(before)
    server = {"backend": after.backend, "launches": delta.launches, "rows_launched": delta.rows_launched,
              "requests": delta.requests, "mean_rows_per_launch": delta.mean_rows_per_launch,
              "device_seconds": delta.device_seconds, "queue_wait_seconds": delta.queue_wait_seconds}
    layers, request_bytes, reply_bytes = sizes
    summary = _result("gdn", cfg, layers, tallies, elapsed, request_bytes, reply_bytes, server, host, cpu_s).summary()
    summary["load"] = "link"  # not gRPC: see this file's docstring
    return summary


def main() -> int:
    if sys.argv[1:] == ["--child"]:
        return _child_main(_child)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the server's gRPC address (sessions, stats)")
    p.add_argument("--link", required=True, help="the engine's decode link socket")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--processes", type=int, default=8, help="load processes, one link connection each")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cfg = LoadConfig(target=args.target, clients=args.clients, mode="stream", tokens=1, duration=args.duration,
                     timeout=args.timeout, progress=False)
    try:
        summary = asyncio.run(run(cfg, args.link, max(1, min(args.processes, args.clients))))
    except ClientError as err:
        print(f"link_load: {err}", file=sys.stderr)
        return 1
    lat = summary["latency_ms"]
    print(f"{summary['steps_per_s']:,.0f} steps/s, p50 {lat.get('p50', float('nan')):.3f} ms, "
          f"{summary['server']['mean_rows_per_launch']:.1f} rows/launch, {summary['errors']} errors, "
          f"load {summary['load_cores']:.2f} cores")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": [summary]}, indent=2))
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
