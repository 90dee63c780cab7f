"""gdn-loadtest: N concurrent clients decoding against a gdn-serve server, next to a gRPC floor.

Each client (an asyncio task with its own channel and TCP connection) owns ``--batch`` sessions
and walks them through the model as a decoder would: layer 0..L-1 for one token, then the next
token, one step in flight at a time (a layer's input depends on the previous layer's output).
Inputs are random, drawn and encoded once per client before timing (a few sets, rotated);
requests always carry positions.

    gdn-loadtest --target 127.0.0.1:50051 --clients 1,8,64 --mode stream --duration 10 \\
        --echo --json results.json --plot plots/

prints one row per clients value: steps/s, tokens*layers/s (= steps/s * B * T), p50/p90/p99
latency, errors, the server's mean rows per kernel launch over the run (GetStats delta), and with
``--echo`` the same load against a bytes echo server with identical message sizes
(`gdn_client._echo`, started as a subprocess) and our throughput as a percentage of it. Each echo
run follows the run of ours it is compared with. ``--rounds K`` repeats each pair K times,
alternating, and adds a line per clients value with the median of the K percentages: a host's
echo rate moves by 10-20% from one run to the next, and so does a single percentage.
``--processes P`` spreads each run's clients over P load processes started together (one Python
process costs ~40-60 us of CPU per step, and near 64 clients can be the bound of a run). The
JSON records, per run, how busy the load's host was (busy cores, and steal: time a VM's
hypervisor gave to others): with the server on the same host, a run near all cores busy or with
much steal measures the host. It also records the cores the load's own processes used
(``load_cores``: their CPU seconds over the run): the part of the busy cores that is not the
server's.

Latency is what both kinds of client have in common: from handing a ready request to gRPC until
its reply's bytes are in. Building the next request (our client adds each step's header to
pre-encoded tensors: a copy of the whole request) and checking the reply (our client parses it)
are client work the echo client does not do; they run outside that interval, and count in
steps/s, since each client sends its next step only after.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Sequence

import grpc
import grpc.aio
import numpy as np
import torch
from google.protobuf.message import DecodeError

from gdn_client._codec import ModelInfo, Stats, encode_request, model_info_from_proto, stats_from_proto
from gdn_client._echo import STREAM as ECHO_STREAM
from gdn_client._echo import UNARY as ECHO_UNARY
from gdn_client._echo import echo_env, echo_request
from gdn_client._errors import GdnError, error_from_code, error_from_rpc
from gdn_client._gc import tune_gc
from gdn_client._h2_native import NativeChannel
from gdn_client._malloc import tune_malloc
from gdn_client._options import ClientOptions
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc

__all__ = ["LoadConfig", "RunResult", "run_load", "main"]

logger = logging.getLogger("gdn_client.loadtest")

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_CHANNELS = ClientOptions(max_message_bytes=256 << 20)  # only its channel arguments are used


def _client_channel_args(cfg: LoadConfig) -> list[tuple[str, Any]]:
    """A load client's channel arguments: its own connection unless cfg.shared_connection.

    grpc shares one TCP connection between the channels of a process that have the same target
    and arguments: 64 clients would be 64 HTTP/2 streams on one connection, and a server with
    several --frontends workers behind one port (SO_REUSEPORT spreads connections, not streams)
    would see a load process as one client. Separate client processes have a connection each."""
    return _CHANNELS.replace(own_connection=not cfg.shared_connection).channel_options()


@dataclass(frozen=True)
class LoadConfig:
    target: str
    clients: int
    mode: str = "stream"  # "stream" or "unary"
    batch: int = 1  # sessions per request
    tokens: int = 1  # T per step
    layers_per_token: int | None = None  # None: all layers
    requests: int | None = None  # total over all clients; or
    duration: float | None = None  # seconds
    dtype: str = "bf16"
    seed: int = 0
    timeout: float = 30.0
    progress: bool = True
    # the clients of one load process share one connection (grpc's default for channels alike)
    # instead of each having its own
    shared_connection: bool = False
    # the clients' gRPC: "grpc" (grpc.aio) or "native" (HTTP/2 in C, gdn_client._h2_native)
    client_transport: str = "grpc"


@dataclass
class RunResult:
    kind: str  # "gdn" or "echo"
    mode: str
    clients: int
    batch: int
    tokens: int
    layers_per_token: int
    steps: int
    errors: int
    elapsed_s: float
    steps_per_s: float
    token_layers_per_s: float
    latency_ms: dict[str, float]
    request_bytes: int
    reply_bytes: int
    server: dict[str, Any] | None = None
    error_samples: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    round: int = 0  # which of --rounds this run belongs to (its echo run has the same)
    host_cpu: dict[str, float] | None = None  # the load host's CPU over the run (Linux; see host_cpu_usage)
    shared_connection: bool = False  # each load process's clients on one connection (LoadConfig)
    # cores the load generator's own processes used over the run (their CPU seconds / elapsed):
    # against host_cpu's busy_cores, what the load took of a host it shares with the server
    load_cores: float | None = None

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("latencies_ms")
        return d


class _Budget:
    """Shared stop condition: a request count or a deadline."""

    def __init__(self, requests: int | None, duration: float | None) -> None:
        self.left = requests
        self.duration = duration
        self.deadline = float("inf")

    def start(self) -> None:
        if self.duration is not None:
            self.deadline = time.perf_counter() + self.duration

    def take(self) -> bool:
        if time.perf_counter() >= self.deadline:
            return False
        if self.left is None:
            return True
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclass
class _ClientTally:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(msg)


def _host_cpu_ticks() -> list[int] | None:
    """The host's CPU time counters (/proc/stat's first line), or None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    return [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal


def host_cpu_usage(before: list[int] | None, after: list[int] | None) -> dict[str, float] | None:
    """How busy the whole host was between two `_host_cpu_ticks()`: cores in use (of `cores`) and
    the share of time the hypervisor gave to others (steal). A run whose host is near all cores
    busy, or steals much, measures the host, not the server: the figure that tells them apart."""
    if before is None or after is None:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (b - a for a, b in zip(before, after))
    total = user + nice + system + idle + iowait + irq + softirq + steal
    if total <= 0:
        return None
    cores = os.cpu_count() or 1
    busy = user + nice + system + irq + softirq
    return {"cores": cores, "busy_cores": cores * busy / total, "steal_pct": 100.0 * steal / total}


# -- one exchange per step: the same loop drives gdn and echo --------------------------------------
# A worker has prepare() -> request bytes (not timed), send(request) -> reply bytes (timed) and
# check(reply) (not timed; raises GdnError for an error reply); exchange() does all three.


INPUT_SETS = 4  # pre-drawn input sets per client, rotated step by step
_DECODE = "/gdn.v1.GdnDecode/Decode"
_DECODE_STREAM = "/gdn.v1.GdnDecode/DecodeStream"


class _GdnWorker:
    """One client of the gdn server: its sessions, inputs and positions.

    The inputs are drawn and encoded before timing: each of INPUT_SETS sets is serialized once
    (session ids and tensors), and a step sends the bytes of its small header fields (layer,
    positions, request_id) followed by those of its set. Protobuf reads concatenated encodings as
    one message, so the server sees an ordinary DecodeRequest; the client does no per-step
    re-encoding of megabytes of tensors, as the echo floor does none.
    """

    def __init__(self, cfg: LoadConfig, info: ModelInfo, index: int) -> None:
        self.cfg = cfg
        self.layers = min(cfg.layers_per_token or info.num_layers, info.num_layers)
        self.channel = grpc.aio.insecure_channel(cfg.target, _client_channel_args(cfg))
        self.stub = gdn_pb2_grpc.GdnDecodeStub(self.channel)
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + index)
        B, T, H, HV, K, V = cfg.batch, cfg.tokens, info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v
        shapes = [(B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV), (B, T, HV)]
        self.inputs = [[torch.randn(*s, generator=gen).to(_DTYPES[cfg.dtype]) for s in shapes]
                       for _ in range(INPUT_SETS)]
        self.bodies: list[bytes] = []  # per input set: session ids and tensors, serialized
        self.session_ids: list[str] = []
        self.positions = [0] * info.num_layers
        self.step_index = 0
        self.layer = 0
        self.call: Any = None
        self.request_bytes = 0
        self.reply_bytes = 0
        # requests go out as bytes we encoded, replies come in as bytes (as the echo client's do):
        # check() parses them after the latency is taken
        self.decode = self.channel.unary_unary(_DECODE)

    async def open(self) -> None:
        for _ in range(self.cfg.batch):  # one device for all of them: they share every request
            request = gdn_pb2.CreateSessionRequest(colocate_with=self.session_ids[0] if self.session_ids else "")
            reply = await self.stub.CreateSession(request, timeout=self.cfg.timeout)
            self.session_ids.append(reply.session_id)
        self.bodies = [encode_request(0, self.session_ids, (), x).SerializeToString() for x in self.inputs]
        self.native = _native_connection(self.cfg)
        if self.native is not None:
            self.decode = self.native.unary(_DECODE)
        if self.cfg.mode == "stream":
            self.call = self.native.stream(_DECODE_STREAM) if self.native else self.channel.stream_stream(_DECODE_STREAM)()

    def prepare(self) -> bytes:
        self.layer = layer = self.step_index % self.layers
        header = gdn_pb2.DecodeRequest(
            layer=layer, positions=[self.positions[layer]] * self.cfg.batch, request_id=str(self.step_index)
        ).SerializeToString()
        wire = header + self.bodies[self.step_index % INPUT_SETS]
        self.request_bytes = len(wire)
        return wire

    async def send(self, request: bytes) -> bytes:
        return await _round_trip(self.call, self.decode, request, self.cfg.timeout, "DecodeStream")

    def check(self, reply: bytes) -> None:
        """Parses the reply (a DecodeStream error arrives in it) and advances the positions."""
        try:
            msg = gdn_pb2.DecodeResponse.FromString(reply)
        except DecodeError as exc:
            raise GdnError(f"malformed reply: {exc}") from None
        if msg.error_code:
            raise error_from_code(msg.error_code, msg.error_message)
        self.positions[self.layer] += self.cfg.tokens
        self.step_index += 1
        if not self.reply_bytes:
            self.reply_bytes = len(reply)

    async def exchange(self) -> None:
        self.check(await self.send(self.prepare()))

    async def close(self) -> None:
        await _end_stream(self.call)
        if self.native is not None:
            self.native.close()
        for sid in self.session_ids:
            with contextlib.suppress(grpc.RpcError):
                await self.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=self.cfg.timeout)
        await self.channel.close()


async def _end_stream(call: Any) -> None:
    """Half-closes an open stream and reads it to its end (with read(): the API it was used
    with; grpc.aio refuses to mix read() and iteration on one call)."""
    if call is None:
        return
    with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError, GdnError):
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass


async def _round_trip(stream: Any, unary: Any, request: bytes, timeout: float, stream_name: str) -> bytes:
    """One request's reply bytes: over the open `stream`, or (None) by one `unary` call; an RPC
    error becomes the client's error type, a stream that ends becomes UNAVAILABLE."""
    try:
        if stream is None:
            return await unary(request, timeout=timeout)
        await stream.write(request)
        reply = await stream.read()
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None
    if reply is grpc.aio.EOF:
        raise GdnError(f"{stream_name} ended", grpc.StatusCode.UNAVAILABLE)
    return reply


class _EchoWorker:
    """One client of the echo server, with a gdn step's message sizes."""

    def __init__(self, cfg: LoadConfig, address: str, request_bytes: int, reply_bytes: int) -> None:
        self.cfg = cfg
        self.channel = grpc.aio.insecure_channel(address, _client_channel_args(cfg))
        self.address = address
        self.payload = echo_request(request_bytes, reply_bytes)
        self.reply_bytes = reply_bytes
        self.call: Any = None  # the open stream in stream mode
        self.unary = self.channel.unary_unary(ECHO_UNARY)
        self.native: Any = None

    async def open(self) -> None:
        self.native = _native_connection(dataclasses.replace(self.cfg, target=self.address))
        if self.native is not None:
            self.unary = self.native.unary(ECHO_UNARY)
        if self.cfg.mode == "stream":
            self.call = self.native.stream(ECHO_STREAM) if self.native else self.channel.stream_stream(ECHO_STREAM)()

    def prepare(self) -> bytes:
        return self.payload

    async def send(self, request: bytes) -> bytes:
        return await _round_trip(self.call, self.unary, request, self.cfg.timeout, "echo stream")

    def check(self, reply: bytes) -> None:
        if len(reply) != self.reply_bytes:
            raise GdnError(f"echo reply of {len(reply)} bytes, expected {self.reply_bytes}")

    async def exchange(self) -> None:
        self.check(await self.send(self.prepare()))

    async def close(self) -> None:
        await _end_stream(self.call)
        if self.native is not None:
            self.native.close()
        await self.channel.close()


def _native_connection(cfg: LoadConfig) -> Any:
    """A client's connection over the native transport when cfg asks for it, else None."""
    if cfg.client_transport != "native":
        return None
    return NativeChannel.current().connect(cfg.target, shared=cfg.shared_connection)


async def _drive(
    workers: Sequence[Any], cfg: LoadConfig, label: str, before_measure: Callable[[], Awaitable[None]] | None = None,
    bar: Any = None,
) -> tuple[list[_ClientTally], float, dict[str, float] | None, float]:
    """Opens and warms every worker up with one step, then runs the budget; returns tallies,
    elapsed, the host's CPU use meanwhile and this process's CPU seconds meanwhile. `bar`
    (update/refresh/close) replaces the progress bar."""
    await asyncio.gather(*(w.open() for w in workers))
    await asyncio.gather(*(w.exchange() for w in workers))  # warm-up: connections, first launch
    if before_measure is not None:
        await before_measure()
    budget = _Budget(cfg.requests, cfg.duration)
    if bar is None:
        bar = _progress(cfg, label)
    tallies = [_ClientTally() for _ in workers]

    async def loop(worker: Any, tally: _ClientTally) -> None:
        lat = tally.latencies
        while budget.take():
            request = worker.prepare()
            try:
                t0 = time.perf_counter()
                reply = await worker.send(request)
                t1 = time.perf_counter()
                worker.check(reply)
            except GdnError as err:
                tally.error(str(err))
                if err.code == grpc.StatusCode.UNAVAILABLE:
                    return  # the connection is gone; stop this client
                continue
            finally:
                bar.update()
            lat.append(t1 - t0)

    budget.start()
    ticks = _host_cpu_ticks()
    t0, cpu0 = time.perf_counter(), time.process_time()
    ticker = asyncio.ensure_future(_tick(bar, budget)) if cfg.duration is not None else None
    try:
        await asyncio.gather(*(loop(w, t) for w, t in zip(workers, tallies)))
    finally:
        elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        if ticker is not None:
            ticker.cancel()
        bar.close()
    return tallies, elapsed, host_cpu_usage(ticks, _host_cpu_ticks()), cpu_s


async def _tick(bar: Any, budget: _Budget) -> None:
    while True:  # keeps the bar moving when replies stall
        await asyncio.sleep(0.5)
        bar.refresh()


def _progress(cfg: LoadConfig, label: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=cfg.requests, desc=label, unit="step", disable=not cfg.progress, leave=False, mininterval=0.25,
        file=sys.stderr,
    )


def _result(kind: str, cfg: LoadConfig, layers: int, tallies: list[_ClientTally], elapsed: float,
            request_bytes: int, reply_bytes: int, server: dict | None, host: dict | None = None,
            load_cpu_s: float | None = None) -> RunResult:
    lat_ms = np.array([x for t in tallies for x in t.latencies], dtype=np.float64) * 1e3
    steps = int(lat_ms.size)
    pct = {}
    if steps:
        p50, p90, p99 = np.percentile(lat_ms, [50, 90, 99])
        pct = {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(lat_ms.mean()),
               "max": float(lat_ms.max())}
    rate = steps / elapsed if elapsed > 0 else 0.0
    return RunResult(
        kind=kind, mode=cfg.mode, clients=cfg.clients, batch=cfg.batch, tokens=cfg.tokens,
        layers_per_token=layers, steps=steps, errors=sum(t.errors for t in tallies), elapsed_s=elapsed,
        steps_per_s=rate, token_layers_per_s=rate * cfg.batch * cfg.tokens, latency_ms=pct,
        request_bytes=request_bytes, reply_bytes=reply_bytes, server=server,
        error_samples=[s for t in tallies for s in t.error_samples][:5], latencies_ms=lat_ms.tolist(), host_cpu=host,
        shared_connection=cfg.shared_connection,
        load_cores=None if load_cpu_s is None or elapsed <= 0 else load_cpu_s / elapsed,
    )


async def _server_view(target: str, timeout: float) -> tuple[ModelInfo, Stats]:
    async with grpc.aio.insecure_channel(target, _CHANNELS.channel_options()) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        try:
            info = await stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=timeout)
            stats = await stub.GetStats(gdn_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
    return model_info_from_proto(info), stats_from_proto(stats)


async def run_load(cfg: LoadConfig, processes: int = 1) -> RunResult:
    """One load run against a gdn server (one clients value), its clients in `processes` processes."""
    info, _ = await _server_view(cfg.target, cfg.timeout)
    free = info.max_sessions - info.sessions_in_use
    if cfg.clients * cfg.batch > free:
        raise GdnError(
            f"{cfg.clients} clients x {cfg.batch} sessions need {cfg.clients * cfg.batch} sessions; "
            f"the server has {free} free (--max-sessions)", grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
    before: Stats | None = None

    async def snapshot() -> None:
        nonlocal before
        _, before = await _server_view(cfg.target, cfg.timeout)

    label = f"gdn {cfg.mode} x{cfg.clients}"
    if processes > 1:
        tallies, elapsed, host, cpu_s, sizes = await _spread(cfg, "gdn", processes, {}, label, snapshot)
        layers, request_bytes, reply_bytes = sizes
        _, after = await _server_view(cfg.target, cfg.timeout)
    else:
        workers = [_GdnWorker(cfg, info, i) for i in range(cfg.clients)]
        try:
            tallies, elapsed, host, cpu_s = await _drive(workers, cfg, label, snapshot)
            _, after = await _server_view(cfg.target, cfg.timeout)
        finally:
            await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        w0 = workers[0]
        layers, request_bytes, reply_bytes = w0.layers, w0.request_bytes, w0.reply_bytes
    delta = after.since(before) if before is not None else after
    server = {
        "backend": after.backend, "launches": delta.launches, "rows_launched": delta.rows_launched,
        "requests": delta.requests, "batches": delta.batches, "mean_rows_per_launch": delta.mean_rows_per_launch,
        "device_seconds": delta.device_seconds, "queue_wait_seconds": delta.queue_wait_seconds,
    }
    return _result("gdn", cfg, layers, tallies, elapsed, request_bytes, reply_bytes, server, host, cpu_s)


async def run_echo(cfg: LoadConfig, address: str, request_bytes: int, reply_bytes: int, layers: int,
                   processes: int = 1) -> RunResult:
    """The same load against the echo server, its clients in `processes` processes."""
    label = f"echo {cfg.mode} x{cfg.clients}"
    if processes > 1:
        sizes = {"request_bytes": request_bytes, "reply_bytes": reply_bytes}
        tallies, elapsed, host, cpu_s, _ = await _spread(dataclasses.replace(cfg, target=address), "echo", processes,
                                                         sizes, label)
    else:
        workers = [_EchoWorker(cfg, address, request_bytes, reply_bytes) for _ in range(cfg.clients)]
        try:
            tallies, elapsed, host, cpu_s = await _drive(workers, cfg, label)
        finally:
            await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    return _result("echo", cfg, layers, tallies, elapsed, request_bytes, reply_bytes, None, host, cpu_s)


# -- several load processes (--processes) ----------------------------------------------------------
# One Python load process costs ~40-60 us of CPU per step (gRPC's stream write and read, asyncio):
# near 64 clients it, not the server, can be what a run measures (bench/NOTES.md). With
# --processes P the parent splits the clients over P children (this module with --child). Each
# child opens and warms up its clients, prints "ready" and waits; the parent takes the server's
# stats once every child is ready and sends "go" to all, so their measured windows coincide.
# Children print "progress <steps>" as they run and one "result <json>" line at the end; the
# parent sums their steps over the longest child's time and pools their latencies.

_CHILD_FLAG = "--child"
_READY_TIMEOUT_S = 180.0  # a child imports torch and grpc, opens its sessions, warms up
_PROGRESS_EVERY_S = 0.25


def _shares(total: int, parts: int) -> list[int]:
    """`total` split into at most `parts` near-equal positive shares."""
    return [n for n in (total // parts + (i < total % parts) for i in range(parts)) if n]


async def _spread(
    cfg: LoadConfig, kind: str, processes: int, extra: dict[str, Any], label: str,
    before_measure: Callable[[], Awaitable[None]] | None = None, child_command: Sequence[str] | None = None,
) -> tuple[list[_ClientTally], float, dict[str, float] | None, float, list[int] | None]:
    """Runs `cfg`'s clients in child processes; returns their tallies (one per child), the
    longest child's elapsed time, the host's CPU use from "go" to the last result, the CPU
    seconds of every load process (this one's from "go" to the last result, the children's over
    their runs), and for gdn steps [layers, request bytes, reply bytes]. `child_command`: what
    starts a child (default: this module's `--child`; a benchmark with clients of its own kind
    gives its own, speaking the same protocol through `_child_main`)."""
    parts = min(processes, cfg.clients, cfg.clients if cfg.requests is None else max(1, cfg.requests))
    clients = _shares(cfg.clients, parts)
    requests = None if cfg.requests is None else _shares(cfg.requests, parts) or [0]
    children: list[asyncio.subprocess.Process] = []
    try:
        first = 0
        for i, n in enumerate(clients):
            part = dataclasses.replace(cfg, clients=n, progress=False,
                                       requests=None if requests is None else requests[i])
            spec = {"kind": kind, "config": dataclasses.asdict(part), "first_index": first, **extra}
            first += n
            child = await asyncio.create_subprocess_exec(
                *(child_command or (sys.executable, "-m", "gdn_client.loadtest", _CHILD_FLAG)),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 30,
            )
            assert child.stdin is not None
            child.stdin.write(json.dumps(spec).encode() + b"\n")
            children.append(child)
        for index, child in enumerate(children):
            await _expect(child, index, "ready", _READY_TIMEOUT_S)
        if before_measure is not None:
            await before_measure()
        ticks, cpu0 = _host_cpu_ticks(), time.process_time()
        for child in children:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
        bar = _progress(cfg, label)
        try:
            results = await asyncio.gather(*(_child_result(c, i, cfg, bar) for i, c in enumerate(children)))
        finally:
            bar.close()
        host, own_cpu_s = host_cpu_usage(ticks, _host_cpu_ticks()), time.process_time() - cpu0
    finally:
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()
    tallies = []
    for r in results:
        latencies = np.frombuffer(base64.b64decode(r["latencies"]), dtype=np.float64).tolist()
        tallies.append(_ClientTally(latencies, r["errors"], r["error_samples"]))
    cpu_s = own_cpu_s + sum(r["cpu_s"] for r in results)
    return tallies, max(r["elapsed"] for r in results), host, cpu_s, results[0]["sizes"]


async def _child_line(child: asyncio.subprocess.Process, index: int, timeout: float) -> tuple[str, str]:
    """The next protocol line of a child as (word, rest); a child that ends or stalls is an error."""
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), timeout)
    except asyncio.TimeoutError:
        raise GdnError(f"load process {index} said nothing for {timeout:.0f} s",
                       grpc.StatusCode.DEADLINE_EXCEEDED) from None
    if not line:
        code = await child.wait()
        raise GdnError(f"load process {index} exited ({code}) before its result", grpc.StatusCode.UNKNOWN)
    word, _, rest = line.decode().strip().partition(" ")
    if word == "error":  # the child's own GdnError, passed on as it is
        err = json.loads(rest)
        raise GdnError(f"load process {index}: {err['message']}", grpc.StatusCode[err["code"]])
    return word, rest


async def _expect(child: asyncio.subprocess.Process, index: int, word: str, timeout: float) -> None:
    got, _ = await _child_line(child, index, timeout)
    if got != word:
        raise GdnError(f"load process {index}: expected {word!r}, got {got!r}")


async def _child_result(child: asyncio.subprocess.Process, index: int, cfg: LoadConfig, bar: Any) -> dict:
    """Reads a child's progress into `bar` until its result; waits for it to exit."""
    reported = 0
    while True:
        word, rest = await _child_line(child, index, cfg.timeout + 30.0)
        if word == "progress":
            steps = int(rest)
            bar.update(steps - reported)
            reported = steps
        elif word == "result":
            await child.wait()
            return json.loads(rest)
        else:
            raise GdnError(f"load process {index}: unexpected line {word!r}")


class _LineProgress:
    """A child's progress sink: the step count on stdout at most every _PROGRESS_EVERY_S."""

    def __init__(self) -> None:
        self.steps = 0
        self._next = 0.0

    def update(self, n: int = 1) -> None:
        self.steps += n
        now = time.perf_counter()
        if now >= self._next:
            self._next = now + _PROGRESS_EVERY_S
            self.refresh()

    def refresh(self) -> None:
        print(f"progress {self.steps}", flush=True)

    def close(self) -> None:
        self.refresh()


async def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One child's share of a spread run (see _spread)."""
    cfg = LoadConfig(**spec["config"])
    first = spec["first_index"]
    if spec["kind"] == "gdn":
        info, _ = await _server_view(cfg.target, cfg.timeout)
        workers: list[Any] = [_GdnWorker(cfg, info, first + i) for i in range(cfg.clients)]
    else:
        workers = [_EchoWorker(cfg, cfg.target, spec["request_bytes"], spec["reply_bytes"])
                   for _ in range(cfg.clients)]
    loop = asyncio.get_running_loop()

    async def wait_for_go() -> None:
        print("ready", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "go":
            raise GdnError("the parent load process went away", grpc.StatusCode.CANCELLED)

    try:
        tallies, elapsed, _, cpu_s = await _drive(workers, cfg, spec["kind"], wait_for_go, bar=_LineProgress())
    finally:
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    w0 = workers[0]
    latencies = np.array([x for t in tallies for x in t.latencies], dtype=np.float64)
    return {
        "elapsed": elapsed, "cpu_s": cpu_s, "latencies": base64.b64encode(latencies.tobytes()).decode(),
        "errors": sum(t.errors for t in tallies), "error_samples": [m for t in tallies for m in t.error_samples][:5],
        # what a gdn step measured (its sizes are the echo's inputs; the echo's own are known)
        "sizes": [w0.layers, w0.request_bytes, w0.reply_bytes] if spec["kind"] == "gdn" else None,
    }


def _child_main(child: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] = _child) -> int:
    """`python -m gdn_client.loadtest --child`: one spec line on stdin, protocol lines on stdout
    (`child` runs the spec: this module's clients by default)."""
    spec = json.loads(sys.stdin.readline())
    try:
        result = asyncio.run(child(spec))
    except GdnError as err:
        print("error " + json.dumps({"message": str(err.message), "code": err.code.name}), flush=True)
        return 1
    print("result " + json.dumps(result), flush=True)
    return 0


# -- echo server subprocess ------------------------------------------------------------------------

_LISTENING = re.compile(r"listening on (\S+):(\d+)")


@contextlib.contextmanager
def echo_server(timeout: float = 30.0) -> Iterator[str]:
    """Starts `gdn_client._echo` on 127.0.0.1, port 0, as a subprocess; yields its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gdn_client._echo", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=echo_env(),
    )
    try:
        deadline = time.monotonic() + timeout
        address = None
        assert proc.stdout is not None
        while address is None:
            line = proc.stdout.readline()
            if not line and (proc.poll() is not None or time.monotonic() > deadline):
                raise RuntimeError("echo server did not start")
            m = _LISTENING.search(line)
            if m:
                address = f"{m.group(1)}:{m.group(2)}"
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- report ----------------------------------------------------------------------------------------


def format_table(results: Sequence[RunResult]) -> str:
    """A plain-text table, one row per run; echo rows carry our throughput as % of them."""
    header = ["kind", "mode", "clients", "B", "T", "steps", "steps/s", "tok*layers/s",
              "p50 ms", "p90 ms", "p99 ms", "errors", "rows/launch", "% of echo"]
    shares = pct_of_echo(results)
    rows = []
    for r in results:
        lat = r.latency_ms
        share = shares.get((r.mode, r.clients, r.round)) if r.kind == "echo" else None
        pct = "" if share is None else f"{share:.1f}%"
        rows.append([
            r.kind, r.mode, str(r.clients), str(r.batch), str(r.tokens), str(r.steps),
            f"{r.steps_per_s:,.1f}", f"{r.token_layers_per_s:,.1f}",
            *(f"{lat[p]:.3f}" if p in lat else "-" for p in ("p50", "p90", "p99")),
            str(r.errors), f"{r.server['mean_rows_per_launch']:.2f}" if r.server else "-", pct,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    for (mode, clients), values in pct_of_echo_by_point(results).items():
        if len(values) > 1:
            lines.append(f"{mode} x{clients}: median {statistics.median(values):.1f}% of echo over "
                         f"{len(values)} rounds ({', '.join(f'{v:.1f}' for v in values)})")
    return "\n".join(lines)


def pct_of_echo(results: Sequence[RunResult]) -> dict[tuple[str, int, int], float]:
    """Our steps/s as % of the echo's, per (mode, clients, round): each echo run against the run
    of ours it followed."""
    ours = {(r.mode, r.clients, r.round): r for r in results if r.kind == "gdn"}
    shares = {}
    for r in results:
        key = (r.mode, r.clients, r.round)
        if r.kind == "echo" and key in ours and r.steps_per_s:
            shares[key] = 100.0 * ours[key].steps_per_s / r.steps_per_s
    return shares


def pct_of_echo_by_point(results: Sequence[RunResult]) -> dict[tuple[str, int], list[float]]:
    """Every round's % of echo, per (mode, clients), in round order."""
    by_point: dict[tuple[str, int], list[float]] = {}
    for (mode, clients, _), share in sorted(pct_of_echo(results).items(), key=lambda kv: kv[0][2]):
        by_point.setdefault((mode, clients), []).append(share)
    return by_point


def write_plots(results: Sequence[RunResult], directory: Path) -> list[Path]:
    """Throughput against concurrency (when several clients values ran) and latency CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    by_kind: dict[str, list[RunResult]] = {}
    for r in results:
        by_kind.setdefault(f"{r.kind} {r.mode}", []).append(r)
    if len({r.clients for r in results}) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, rs in by_kind.items():
            rs = sorted(rs, key=lambda r: r.clients)
            repeated = len({r.clients for r in rs}) < len(rs)  # --rounds: a point per round, no line
            ax.plot([r.clients for r in rs], [r.steps_per_s for r in rs], marker="o", label=label,
                    linestyle="none" if repeated else "-")
        ax.set_xscale("log", base=2)
        ticks = sorted({r.clients for r in results})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("steps/s")
        ax.set_title(f"throughput (B={results[0].batch}, T={results[0].tokens})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = directory / "throughput_vs_clients.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        if not r.latencies_ms:
            continue
        lat = np.sort(np.asarray(r.latencies_ms))
        label = f"{r.kind} {r.mode} x{r.clients}" + (f" round {r.round}" if r.round else "")
        ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("latency per step (ms)")
    ax.set_ylabel("fraction of steps")
    ax.set_title("latency CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    path = directory / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


# -- command line ----------------------------------------------------------------------------------


def _clients_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes integers like 1,8,64, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--clients needs positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gdn-loadtest",
        description="Concurrent decode load against a gdn-serve server, optionally next to a gRPC echo floor.",
    )
    p.add_argument("--target", default="127.0.0.1:50051", help="server address (default 127.0.0.1:50051)")
    p.add_argument("--clients", type=_clients_list, default=[1],
                   help="concurrent clients; a comma list runs each value in turn (e.g. 1,8,64)")
    p.add_argument("--mode", choices=["stream", "unary"], default="stream", help="DecodeStream or unary Decode")
    p.add_argument("--batch", type=int, default=1, help="sessions per request B (default 1)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per step T (default 1)")
    p.add_argument("--layers-per-token", type=int, default=None, help="cycle only the first N layers")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, help="seconds per run")
    stop.add_argument("--requests", type=int, default=None, help="steps per run, over all clients")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="input dtype on the wire")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--timeout", type=float, default=30.0, help="per-call deadline (s)")
    p.add_argument("--echo", action="store_true", help="also run the same load against a bytes echo server")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each clients value this many times (with --echo: ours then the echo's, alternately)")
    p.add_argument("--processes", type=int, default=1,
                   help="spread each run's clients over this many load processes (default 1; one Python "
                        "process tops out near 20k steps/s, see the README)")
    p.add_argument("--shared-connection", action="store_true",
                   help="the clients of a load process share one TCP connection (HTTP/2 streams on it; grpc's "
                        "default for alike channels) instead of one connection each, as separate clients have")
    p.add_argument("--client-transport", choices=["grpc", "native"], default="grpc",
                   help="the clients' gRPC: grpc.aio (default), or HTTP/2 in C (the server's workers' transport, "
                        "over libnghttp2): a fraction of the CPU per step, for a load host that shares its cores "
                        "with the server")
    p.add_argument("--json", type=Path, default=None, help="write results to this JSON file")
    p.add_argument("--plot", type=Path, default=None, help="write PNG charts into this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


async def _run_all(args: argparse.Namespace, echo_address: str | None) -> list[RunResult]:
    """Per clients value and round: our run, then (with an echo address) the echo's run of the
    same message sizes right after it, so each pair sees the host in the same state."""
    results: list[RunResult] = []
    for n in args.clients:
        for round_index in range(args.rounds):
            cfg = LoadConfig(
                target=args.target, clients=n, mode=args.mode, batch=args.batch, tokens=args.tokens,
                layers_per_token=args.layers_per_token, requests=args.requests, duration=args.duration,
                dtype=args.dtype, seed=args.seed, timeout=args.timeout, progress=not args.no_progress,
                shared_connection=args.shared_connection, client_transport=args.client_transport,
            )
            ours = dataclasses.replace(await run_load(cfg, args.processes), round=round_index)
            results.append(ours)
            if echo_address is None:
                continue
            echo = await run_echo(dataclasses.replace(cfg, target=echo_address), echo_address, ours.request_bytes,
                                  ours.reply_bytes, ours.layers_per_token, args.processes)
            results.append(dataclasses.replace(echo, round=round_index))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    # one client process drives both our server and the echo floor: tuned like the servers, it
    # adds no page-fault cost of its own to either side of the comparison
    tune_malloc(logger)
    tune_gc(logger)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == [_CHILD_FLAG]:  # a load process of a --processes run (see _spread)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        return _child_main()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.duration is None and args.requests is None:
        args.duration = 10.0
    if args.batch < 1 or args.tokens < 1 or args.rounds < 1 or args.processes < 1:
        print("gdn-loadtest: --batch, --tokens, --rounds and --processes must be >= 1", file=sys.stderr)
        return 2
    try:
        with echo_server() if args.echo else contextlib.nullcontext() as address:
            results = asyncio.run(_run_all(args, address))
    except GdnError as err:
        print(f"gdn-loadtest: {err}", file=sys.stderr)
        return 1
    print(format_table(results))
    for r in results:
        for sample in r.error_samples:
            print(f"  {r.kind} x{r.clients} error: {sample}", file=sys.stderr)
    if args.json is not None:
        shares = pct_of_echo(results)
        doc = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "runs": [], "pct_of_echo": []}
        for r in results:
            d = r.summary()
            share = shares.get((r.mode, r.clients, r.round)) if r.kind == "echo" else None
            if share is not None:
                d["gdn_pct_of_echo"] = share
            doc["runs"].append(d)
        for (mode, clients), values in pct_of_echo_by_point(results).items():
            doc["pct_of_echo"].append({"mode": mode, "clients": clients, "rounds": values,
                                       "median": statistics.median(values)})
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
    if args.plot is not None:
        for path in write_plots(results, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
