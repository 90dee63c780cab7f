"""The engine's host cost per decode request under `--frontends N`, on any machine (CPU only).

    python bench/engine_path.py                          # table: us of CPU per request at 1, 8, 64 per round
    python bench/engine_path.py --json bench/results/engine_path.json
    python bench/engine_path.py --profile --per-round 64  # cProfile of the engine path, top functions
    python bench/engine_path.py --per-round 21 --frames-per-read 1  # a recv per frame, not per round
    python bench/engine_path.py --no-rings                # payloads in the link's frames, not in rings
    python bench/engine_path.py --per-round 24 --phases   # and the engine thread's time per phase

What runs is the engine's real code, without gRPC and without its threads' waiting:

  request frames (link.encode_request of DecodeWork made as validation.py makes them: bf16,
  qwen3-next heads, T=1, B=1, positions sent; sessions and layers cycled like many clients)
  -> a real socket pair -> EngineLink's reader code (FrameBuffer read, peek, placement, queue)
  -> Scheduler.run_round (admission, positions, batching, backend submit, answers)
  -> a fake device backend doing CudaBackend's host work: the same staging code
     (gdn_server/backends/staging.py: memcpy of each request's bytes into a preallocated buffer,
     int32 index writes, a ring of 8 staging sets); its "device" returns each row's v as the output,
     one copy per launch, standing in for the D2H copy
  -> reply frames (link.encode_reply), handed to the link's sender thread once per round as the
     engine does (written with one sendmsg per worker per round where gdn_server._native is not built).
The payloads go through the link's shared-memory rings (gdn_server.link_ring) as between real
processes (here both ends map one buffer), unless --no-rings.

A round is what the scheduler thread does per iteration: read and queue the round's frames, admit
and submit them, answer the previous round's batch (pipelined as on a GPU), write the replies. CPU
time is `time.thread_time()` of the thread running all that; building the request frames (the
workers' job) and reading the replies (the workers' job) are outside it. Not measured: the event
loop's wake-ups and its callbacks around the reads (the engine reads its links on its loop).

Every reply is checked (tag, position, and output = the request's own v bytes), and a sha256 of all
replies is printed, so two versions of the engine can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import platform
import pstats
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

from gdn_server.backends.base import Backend, PendingStep
from gdn_server.backends.staging import Plan, carve, fill, make_plan
from gdn_server.config import PRESETS, ModelShape, SchedulerConfig
from gdn_server.engine_link import SOCKET_BUFFER_BYTES, EngineLink
from gdn_server.link import LENGTH, FrameBuffer, decode_reply, encode_ack, encode_request, send_frames
from gdn_server.link_ring import REPLY_RING_BYTES, REQUEST_RING_BYTES, RequestRing
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import SessionTable
from gdn_server.tuning import freeze_startup_objects, tune_gc
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeResult, DecodeWork, StepBatch

RING = 8  # staging sets, as CudaBackend
PAYLOADS = 64  # distinct random inputs, reused round robin (building them is not what is measured)


class HostStaging:
    """One staging set of CudaBackend without its device twin: an ordinary (not pinned) input
    buffer and the output buffer the device's D2H copy would fill, made once and reused (also
    bench/frontend.py's)."""

    def __init__(self, plan: Plan) -> None:
        self.host = torch.empty(plan.total, dtype=torch.uint8)
        self.host_bytes = self.host.numpy()
        self.host_mem = memoryview(self.host_bytes)
        self.out_host = torch.zeros(plan.out_bytes, dtype=torch.uint8)
        self.views: dict[tuple[int, int], tuple[dict[str, torch.Tensor], torch.Tensor]] = {}

    def views_for(self, plan: Plan, key: tuple[int, int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        views = self.views.get(key)
        if views is None:  # made once per (R, T), as CudaBackend's _Views
            host = {name: carve(self.host, e) for name, e in plan.entries.items()}
            out = self.out_host[: plan.out_bytes].view(torch.bfloat16).view(plan.out_shape)
            views = self.views[key] = (host, out)
        return views


class HostStagingRing:
    """RING host staging sets used in turn, and the staging plan per (R, T), as CudaBackend keeps
    them; a set too small for a launch is replaced by one that fits (also bench/frontend.py's)."""

    def __init__(self, shape: ModelShape, reserve_rows: int | None = None) -> None:
        """`reserve_rows`: make every set big enough for that many rows at the largest T up front
        (nothing allocated while timing)."""
        self.shape = shape
        self._plans: dict[tuple[int, int], Plan] = {}
        reserve = make_plan(shape, reserve_rows, shape.max_tokens_per_step) if reserve_rows else None
        self._ring: list[HostStaging | None] = [HostStaging(reserve) if reserve else None for _ in range(RING)]
        self._next = 0
        self.found: dict[int, str] | None = {}

    def stage(self, batch: StepBatch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Fills the next set with `batch` (CudaBackend's own fill); returns its input views and
        its output buffer [R, T, HV, V]."""
        R, T = batch.rows, batch.tokens
        plan = self._plans.get((R, T))
        if plan is None:
            plan = self._plans[(R, T)] = make_plan(self.shape, R, T)
        staging = self._ring[self._next]
        if staging is None or staging.host.numel() < plan.total or staging.out_host.numel() < plan.out_bytes:
            staging = self._ring[self._next] = HostStaging(plan)
        self._next = (self._next + 1) % RING
        host, out = staging.views_for(plan, (R, T))
        # what the fill's NaN/Inf check of unchecked inputs found ({} or None: see staging.fill)
        self.found = fill(batch, plan, staging.host_mem, staging.host_bytes, host)
        return host, out


class _EchoStep(PendingStep):
    """The "device" result: each row's staged v, which has the output's shape [R, T, HV, V]."""

    def __init__(self, v: torch.Tensor, out: torch.Tensor) -> None:
        self._v, self._out = v, out

    def result(self) -> torch.Tensor:
        self._out.copy_(self._v)  # stands in for the D2H copy the host waits for
        return self._out


class HostStagingBackend(Backend):
    """CudaBackend's host work per launch (staging plan, ring, fill) with no device behind it."""

    name = "host-staging"

    def __init__(self, shape: ModelShape, max_sessions: int, max_rows: int) -> None:
        super().__init__(shape, random_gate_params(shape, 0), max_sessions, None, speculative_sessions=0)
        self._staging = HostStagingRing(shape, reserve_rows=max_rows)

    def submit(self, batch: StepBatch) -> PendingStep:
        host, out = self._staging.stage(batch)
        return _EchoStep(host["v"], out)

    # session operations: the bench never calls them
    def reset_session(self, session_slot: int) -> None:
        pass

    def copy_session(self, src_slot: int, dst_slot: int) -> None:
        raise NotImplementedError

    def read_session(self, session_slot: int) -> torch.Tensor:
        raise NotImplementedError

    def write_session(self, session_slot: int, state: torch.Tensor) -> None:
        raise NotImplementedError

    def copy_rows(self, src_rows: list[int], dst_rows: list[int]) -> None:
        raise NotImplementedError


class Workers:
    """The front-end workers' side: request frames in, reply frames checked."""

    def __init__(self, shape: ModelShape, session_ids: list[str], sock: socket.socket, seed: int = 0,
                 rings: tuple[RequestRing, memoryview] | None = None) -> None:
        self.shape = shape
        self.request_ring, self.reply_ring = rings if rings is not None else (None, None)
        self.read_to = self.acked = 0
        self.ids = session_ids
        self.sock = sock
        self.next = 0  # request number = tag
        H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
        g = torch.Generator().manual_seed(seed)
        dims = {"q": (1, 1, H, K), "k": (1, 1, H, K), "v": (1, 1, HV, V), "a": (1, 1, HV), "b": (1, 1, HV)}
        self.payloads = []
        for _ in range(PAYLOADS):
            # as validation.py: tensors of the wire bytes, and the raw bytes of all-bf16 requests
            raw = {n: torch.randn(*d, generator=g).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
                   for n, d in dims.items()}
            tensors = {n: torch.frombuffer(raw[n], dtype=torch.bfloat16).view(dims[n]) for n in dims}
            self.payloads.append((tensors, tuple(raw[n] for n in dims)))
        self.expected: dict[int, tuple[int, bytes]] = {}  # tag -> (position after, output bytes)
        self.replies = FrameBuffer(buffer_bytes=4 << 20)
        self.answered = 0
        self.digest = hashlib.sha256()

    def send(self, n: int) -> None:
        """n requests: session i % S at its next layer (every session walks the layers in order)."""
        S, L = len(self.ids), self.shape.num_layers
        parts: list[bytes] = []
        for _ in range(n):
            i = self.next
            self.next += 1
            step = i // S
            layer, position = step % L, step // L
            tensors, raw = self.payloads[i % PAYLOADS]
            work = DecodeWork(layer=layer, session_ids=(self.ids[i % S],), positions=(position,), request_id=f"r{i}",
                              speculative=False, bf16_bytes=raw, **tensors)
            parts += encode_request(i, work, self.request_ring)
            self.expected[i] = (position + 1, raw[2])  # the echo device answers with v
        if self.read_to != self.acked:  # as EngineLinkClient: the ack ahead of the requests
            self.acked = self.read_to
            parts.insert(0, encode_ack(self.acked))
        send_frames(self.sock, parts)

    def receive(self) -> None:
        """Reads and checks every reply there is (without blocking)."""
        while True:
            try:
                if not self.replies.fill(self.sock):
                    raise RuntimeError("the engine closed the link")
            except BlockingIOError:
                return
            for frame in self.replies.frames():
                tag, result, read_to = decode_reply(bytes(frame), self.shape, self.reply_ring)
                if read_to is not None:
                    self.read_to = read_to
                if self.request_ring is not None:
                    self.request_ring.free(tag)
                if not isinstance(result, DecodeResult):
                    raise RuntimeError(f"request {tag} failed: {result}")
                position, out = self.expected.pop(tag)
                if result.positions != (position,) or result.out != out:
                    raise RuntimeError(f"request {tag}: wrong reply (positions {result.positions}, want {position})")
                # what the reply says, whichever way its output came
                self.digest.update(repr((tag, result.positions, result.shape)).encode() + result.out)
                self.answered += 1


class Engine:
    """The engine's objects, driven from one thread."""

    def __init__(self, shape: ModelShape, sessions: int, max_rows: int, rings: bool = True) -> None:
        self.backend = HostStagingBackend(shape, sessions, max_rows)
        self.table = SessionTable(sessions, shape.num_layers)
        self.scheduler = Scheduler(self.backend, self.table, SchedulerConfig(max_batch_rows=max(1024, max_rows)))
        self.placement = Placement([Shard(0, self.backend, self.table, self.scheduler)])
        self.link = EngineLink(f"/tmp/engine-path-{os.getpid()}.sock", shape, self.placement)  # never bound
        engine_sock, worker_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        worker_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        worker_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        worker_sock.setblocking(False)
        self.conn = self.link._adopt(engine_sock)
        self.conn.greeted = True  # the hello is the real link's business: the rings are set here
        worker_rings = None
        if rings:  # one buffer both ends map, as the worker's memfd
            memory = memoryview(bytearray(REQUEST_RING_BYTES + REPLY_RING_BYTES))
            self.link._use_rings(self.conn, memory[:REQUEST_RING_BYTES], memory[REQUEST_RING_BYTES:])
            worker_rings = (RequestRing(memory[:REQUEST_RING_BYTES]), memory[REQUEST_RING_BYTES:])
        ids = [self.table.create().id for _ in range(sessions)]
        self.workers = Workers(shape, ids, worker_sock, rings=worker_rings)
        self.previous: list = []

    def read(self, n: int) -> None:
        """What the link's reader does on a readable socket, until n requests are queued."""
        queued = self.scheduler.queue_depth
        while queued() < n:
            if not self.conn.open:
                raise RuntimeError("the engine dropped the link (a bad frame? see the log)")
            self.link._read_from(self.conn)
            self.link.flush()  # as the reader does after each wake-up (nothing to write here)

    def round(self, n: int) -> None:
        """The engine's work for n queued requests: the reads, then one scheduler iteration and
        its reply write."""
        self.read(n)
        self.previous = self.scheduler.run_round(self.previous)

    def wait_sent(self) -> None:
        """Until the link's sender thread has written every reply queued (its CPU is not the
        engine thread's, so it is not counted: that is what the thread is for)."""
        if self.link._sender is not None:
            self.link._sender.wait_idle()

    def close(self) -> None:
        self.link.close()
        self.workers.sock.close()


class PhaseTimer:
    """--phases: wall time of the engine thread's phases (its link reads, a round's admission and
    launch, a round's answers, the reply hand-off), by wrapping those methods of one engine's
    objects. Each wrapper costs ~0.2 us a call: compare versions, not absolute figures."""

    PHASES = (("link", "_read_from", "link reads (decode, queue)"), ("scheduler", "_launch", "admission and launch"),
              ("scheduler", "_finish", "answers"), ("link", "flush", "reply hand-off"))

    def __init__(self, engine: "Engine") -> None:
        self.ns = {label: 0 for _, _, label in self.PHASES}
        for owner_name, method, label in self.PHASES:
            owner = getattr(engine, owner_name)
            wrapped = self._wrap(getattr(owner, method), label)
            setattr(owner, method, wrapped)  # an instance attribute: callers through self find it
            hooks = engine.scheduler.after_answers
            for i, hook in enumerate(hooks):
                if hook == getattr(type(owner), method).__get__(owner):  # the bound method, kept at start
                    hooks[i] = wrapped

    def _wrap(self, fn: Callable, label: str) -> Callable:
        ns = self.ns

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[label] += time.perf_counter_ns() - t0
        return timed

    def reset(self) -> None:
        for label in self.ns:
            self.ns[label] = 0

    def per_request(self, requests: int) -> dict[str, float]:
        return {label: ns / 1e3 / requests for label, ns in self.ns.items()}


def measure(engine: Engine, per_round: int, requests: int, profiler: cProfile.Profile | None,
            frames_per_read: int = 0) -> dict:
    """CPU per request over `requests`, `per_round` a round. frames_per_read > 0: the workers
    write a round's frames that many at a time, and the engine reads each write on its own (one
    recv per write, as when each wake-up finds a frame or two) instead of the round's in one."""
    rounds = max(1, requests // per_round)
    stats = engine.scheduler.stats
    launches0, rows0 = stats.launches, stats.rows_launched
    answered0 = engine.workers.answered
    cpu = 0.0

    def timed(engine_step: Callable[[int], None], n: int, profile: bool = True) -> None:
        """The engine's part: its thread's CPU time counted (and profiled, where asked)."""
        nonlocal cpu
        on = profile and profiler is not None
        if on:
            profiler.enable()
        t0 = time.thread_time()
        engine_step(n)
        cpu += time.thread_time() - t0
        if on:
            profiler.disable()

    wall0 = time.perf_counter()
    for _ in range(rounds):
        if frames_per_read > 0:
            for first in range(0, per_round, frames_per_read):
                engine.workers.send(min(frames_per_read, per_round - first))  # not timed
                timed(engine.read, min(per_round, first + frames_per_read))
        else:
            engine.workers.send(per_round)  # the workers' job: not timed
        timed(engine.round, per_round)
        engine.wait_sent()
        engine.workers.receive()
    timed(engine.round, 0, profile=False)  # answers the last batch
    wall = time.perf_counter() - wall0
    engine.wait_sent()
    engine.workers.receive()
    done = engine.workers.answered - answered0
    if done != rounds * per_round or engine.workers.expected:
        raise RuntimeError(f"{done} replies for {rounds * per_round} requests")
    return {
        "requests_per_round": per_round,
        "requests": done,
        "us_per_request": 1e6 * cpu / done,
        "frames_per_read": frames_per_read or per_round,
        "rows_per_launch": (stats.rows_launched - rows0) / max(1, stats.launches - launches0),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-round", default="1,8,64", help="requests per scheduler round (comma separated)")
    p.add_argument("--requests", type=int, default=6000, help="requests per measurement")
    p.add_argument("--repeat", type=int, default=5, help="measurements per setting; the median is reported")
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--label", default="", help="a name for this version of the engine, kept in the JSON")
    p.add_argument("--frames-per-read", type=int, default=0,
                   help="the workers write (and the engine reads) a round's frames this many at a time; "
                        "0: a round's in one write")
    p.add_argument("--no-rings", action="store_true", help="payloads in the link's frames, not in shared-memory rings")
    p.add_argument("--profile", action="store_true", help="cProfile the engine path (times are inflated)")
    p.add_argument("--top", type=int, default=30, help="functions to list with --profile")
    p.add_argument("--phases", action="store_true",
                   help="also time the engine thread's phases (link reads, launch, answers, hand-off) per request")
    args = p.parse_args()
    per_round = [int(x) for x in args.per_round.split(",")]
    if max(per_round) > args.sessions:
        p.error("--sessions must be at least the largest --per-round (a round's sessions are distinct)")

    # the request bytes are read-only, as in the server (torch warns once about that)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.set_num_threads(1)  # every copy on the timed thread (thread_time would miss a pool's work)
    shape = PRESETS["qwen3-next"]
    engine = Engine(shape, args.sessions, max(per_round), rings=not args.no_rings)
    tune_gc()  # as every engine process does at start (GDN_GC_GEN0)
    freeze_startup_objects()  # as the engine process does once it is ready to serve
    profiler = cProfile.Profile() if args.profile else None
    phases = PhaseTimer(engine) if args.phases else None
    results = []
    try:
        for n in per_round:
            measure(engine, n, min(args.requests, 50 * n), None, args.frames_per_read)  # warm-up: plans, views, caches
            if phases is not None:
                phases.reset()
            runs = [measure(engine, n, args.requests, profiler, args.frames_per_read) for _ in range(args.repeat)]
            us = [r["us_per_request"] for r in runs]
            row = dict(runs[0], us_per_request=statistics.median(us), us_min=min(us), us_max=max(us), repeats=len(us))
            if phases is not None:
                row["phases_us_per_request"] = phases.per_request(sum(r["requests"] for r in runs))
            row["requests_per_s_one_core"] = 1e6 / row["us_per_request"]
            results.append(row)
            print(f"{n:>4} per round: {row['us_per_request']:7.1f} us CPU/request (min {min(us):.1f}, "
                  f"max {max(us):.1f}; {row['rows_per_launch']:.1f} rows/launch)", file=sys.stderr)
    finally:
        engine.close()

    print()
    print("| requests per round | frames per read | us CPU per request (median) | min - max | requests/s on one core |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['requests_per_round']} | {r['frames_per_read']} | {r['us_per_request']:.1f} | {r['us_min']:.1f} - "
              f"{r['us_max']:.1f} | {r['requests_per_s_one_core']:,.0f} |")
    if phases is not None:
        labels = [label for _, _, label in PhaseTimer.PHASES]
        print("\n| requests per round | " + " | ".join(f"{label}, us/request" for label in labels) + " | sum |")
        print("|---|" + "---|" * (len(labels) + 1))
        for r in results:
            ph = r["phases_us_per_request"]
            print(f"| {r['requests_per_round']} | " + " | ".join(f"{ph[label]:.2f}" for label in labels)
                  + f" | {sum(ph.values()):.2f} |")
    digest = engine.workers.digest.hexdigest()
    print(f"\nreplies sha256 {digest} ({engine.workers.answered} replies, every one checked)")
    if profiler is not None:
        out = io.StringIO()
        st = pstats.Stats(profiler, stream=out).strip_dirs()
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
        print(out.getvalue())
    if args.json:
        doc = {
            "label": args.label,
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "torch": torch.__version__, "cpus": os.cpu_count()},
            "shape": {"layers": shape.num_layers, "H": shape.num_q_heads, "HV": shape.num_v_heads,
                      "K": shape.head_dim_k, "V": shape.head_dim_v, "T": 1, "B": 1},
            "sessions": args.sessions,
            "requests": args.requests,
            "profiled": args.profile,
            "results": results,
            "replies_sha256": digest,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
