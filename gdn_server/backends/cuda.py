"""CUDA backend ("cuda-cute"): the state pool and its history rings on the GPU, one CuTe DSL launch per batch.

Every pool row (a session's state at one layer) has a history ring beside it (`kernels.new_ring`):
a verify batch runs `ring_verify`, which reads the states and writes only ring entries (folding
first a row whose P + T entries would overflow its ring); an accept is the caller's bookkeeping
(`StepBatch.hist`, each row's committed entries P). Its rows are drafts, or the plain steps of a
launch of RING_MIN_ROWS rows or more (16 over a bf16 pool, 64 over an fp32 one), which cost less
that way than written in place (and of a smaller launch whose rows have entries committed and
room for more: `planner.Planner._through_ring`). Another plain batch folds the rows with P > 0
(`ring_fold`, on the same stream right before the step) and then runs `gdn_decode`, which writes
the states in place. `fold` folds rows on demand (before a fork, export, snapshot or read of a session).

Per batch, on the backend's own stream:
  1. the requests' inputs are copied into one pinned host staging buffer (a memcpy per request
     and input; no per-row Python work), row, layer and P indices included (layout:
     gdn_server/backends/staging.py);
  2. one host-to-device copy of that buffer;
  3. one launch over all rows (mixed sessions, clients and layers): `gdn_decode` (after a
     `ring_fold` where some row has P > 0), or `ring_verify`;
  4. one device-to-host copy of the outputs into pinned memory, and an event.
A launch with inputs in a client's shared memory that the device reads where they are
(DeviceSpans of a big request: CUDA memory, or page-locked host memory) copies them into the
device buffer after step 2, by one `segments_copy`, and runs directly, not as a graph
(`_referenced_steps`); a small request's inputs come staged like a message's (the wire layer
copied them out of CUDA memory). Outputs whose o_ref is a DeviceSpan are written there after
step 3 (or after the graph) by one more `segments_copy` (`_write_outputs`). Both read their
segments from the staging set's table in mapped pinned memory (`kernels.SegmentTable`): a
launch's host calls are the costly part of a small step, and a table needs none of its own.
`submit` returns at once; `result()` waits for the event. A ring of staging sets lets the scheduler
assemble batch n+1 while batch n runs: a set is reused only after its previous event completed.
Small launches (GRAPH_MAX_ROWS rows; plain T=1 steps and verifies of every T) replay steps 2-4
as a CUDA graph captured per staging set at warm-up; bigger ones up to the largest of GRAPH_BUCKETS
are padded to the next bucket's rows (padding rows touch no state or ring) and replay that
bucket's graph. A plain launch with a fold launches directly: it runs only where a small launch
would fill a ring, and graphs of it would double the captures. Graphs by bucket, not one per row
count: a replay is one host call where a direct launch makes three (copy, kernel, copy), and a
few buckets keep the captures (per staging set) few, at the cost of padding rows' device time.
The graphs of up to MAPPED_MAX_ROWS rows hold the kernel alone: it reads the pinned staging
buffer and writes the pinned outputs in place (gdn_server/kernels/_mapped.py), with no copy
before or after it.

The backend takes only shapes its kernels cover (K = V = 128, HV a multiple of H and at most 8
times it): others are served by the CPU backend, the one torch implementation of the math and of
the ring, rather than by a torch copy of both on the GPU.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from gdn_server.backends.base import Backend, PendingStep, check_state_dtype
from gdn_server.kernels._compiled import disk_cache_folder
from gdn_server.kernels._cudart import clear_last_error, runtime as cudart_runtime
from gdn_server.kernels._mapped import device_alias
from gdn_server.backends.staging import StagingLayout, carve as _carve, fill as _fill_staging, make_layout
from gdn_server.config import ModelShape
from gdn_server.kernels import HEAD_DIM, SegmentTable, check_variant, ring_bytes_per_row
from gdn_server.kernels._ring_api import check_ring_variant
from gdn_server.weights import GateParams
from gdn_server.work import DeviceSpan, StepBatch

log = logging.getLogger(__name__)

MAX_DEFAULT_SESSIONS = 4096
POOL_MEMORY_FRACTION = 0.8  # of the free device memory, for the default --max-sessions
RING = 8  # staging sets; more than the batches the scheduler keeps in flight
# Launches of up to this many rows (T=1, in place) replay a CUDA graph of their three device
# operations, captured per staging set at warm-up: one host call instead of a copy, a kernel
# launch through tvm-ffi and a copy (bench/DECISIONS.md, entry 8). 0 turns graphs off.
GRAPH_MAX_ROWS = 8
# Bigger in-place T=1 launches are padded to the next of these row counts and replay its graph,
# whose one host call replaces a direct launch's three (bench/DECISIONS.md, entry 8). Padding costs
# only device time (the rows' H2D bytes; their CTAs read and write no state), which is why the steps
# are ~1.5x apart and end at 128, where the launch calls are a small share of a launch's host work.
GRAPH_BUCKETS = (12, 16, 24, 32, 48, 64, 96, 128)
# In-place T=1 launches of up to this many rows (at most GRAPH_MAX_ROWS) have graphs of the kernel
# alone on the pinned staging and output buffers, mapped into the device's address space, instead
# of a host-to-device copy, the kernel and a device-to-host copy: one graph node instead of three.
# One row, because that is where it pays: the kernel's reads over PCIe grow with the rows faster
# than the copies do (bench/DECISIONS.md, entry 7). 0 keeps the copies everywhere.
MAPPED_MAX_ROWS = 1

# A launch of plain steps with at least this many rows (by the pool's state dtype) runs as a
# verify, each row's entries committed at once (`Backend.ring_min_rows`): reading the states and
# writing T ring entries, with the fold of a full ring amortized, costs less than reading and
# writing the states (H200, bench/ring.py; bench/DECISIONS.md, entry 4). bf16: from 16 rows on at
# every T <= 4, 27-38% less at B = 512. fp32: from 64 rows on at every T measured, 3-7% less at
# B = 64 and 12-26% at B = 512; at 32 rows T = 2 is slower through the ring (39.5 against 38.4 us).
# Neither state drifts more than in place: a bf16 state is rounded once per fold instead of once
# per step, an fp32 state's ring keeps fp32 corrections.
RING_MIN_ROWS = dict(bfloat16=16, float32=64)

# A request's o of this many bytes or more that the launch writes into its o_ref is also copied
# apart by the launch, into pinned memory of its own, for retries: the CPU's copy of megabytes into
# the answer costs more than an allocation and a copy call, and leaves its caches cold for the
# rest of the step (bench/DECISIONS.md, entry 23). A smaller one goes through the host buffer and
# that copy, which costs less than the calls.
KEEP_APART_BYTES = 512 << 10

# What a launch runs (its graphs are keyed by it too)
PLAIN = "plain"  # gdn_decode, in place
FOLD_PLAIN = "fold+plain"  # ring_fold of the rows with P > 0, then gdn_decode
VERIFY = "verify"  # ring_verify


def check_kernel_shape(shape: ModelShape) -> None:
    """ValueError unless the backend's kernels cover `shape` (the CPU backend serves any shape)."""
    if shape.head_dim_k != HEAD_DIM or shape.head_dim_v != HEAD_DIM:
        raise ValueError(f"the CUDA backend's kernels need head dims K = V = {HEAD_DIM}, got K = {shape.head_dim_k}, "
                         f"V = {shape.head_dim_v}: serve this shape with --device cpu")
    try:
        check_variant(1, shape.num_q_heads, shape.num_v_heads, shape.state_dtype)
        check_ring_variant(1, shape.num_q_heads, shape.num_v_heads, shape.state_dtype)
    except ValueError as e:
        raise ValueError(f"the CUDA backend's kernels do not cover this shape ({e}): serve it with --device cpu") from None


def _byte_rows(out: torch.Tensor, row: int, n: int) -> torch.Tensor:
    """Rows [row, row + n) of a launch's output as flat bytes, for torch's copies (a few torch
    calls: made only for the outputs that torch copies)."""
    return out[row:row + n].reshape(-1).view(torch.uint8)


def padded_rows(rows: int) -> int:
    """The rows a launch of `rows` rows is staged and run with (its graph bucket, or itself)."""
    if rows <= GRAPH_MAX_ROWS:
        return rows
    for bucket in GRAPH_BUCKETS:
        if rows <= bucket:
            return bucket
    return rows


class _Staging:
    """One pinned host buffer and its device twin, carved into the inputs of one launch."""

    def __init__(self, device: torch.device, nbytes: int, out_bytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.device = device
        self.host_bytes = self.host.numpy()  # the same pinned memory, for torch's copies of big inputs
        self.host_mem = memoryview(self.host_bytes)  # and for the other copies and the int32 index arrays
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.out_dev = torch.empty(out_bytes, dtype=torch.uint8, device=device)
        self.out_host = torch.empty(out_bytes, dtype=torch.uint8, pin_memory=True)
        self.done = torch.cuda.Event()
        self.used = False
        self._views: dict[tuple[int, int], _Views] = {}
        # (kind, R, T) -> (the launch's graph, its cudaGraphExec_t, the memory its kernel writes o to)
        self.graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, int, torch.Tensor]] = {}
        # `host` and `out_host` as tensors on the device (MAPPED_MAX_ROWS), made on first use
        self._mapped: tuple[torch.Tensor, torch.Tensor] | None = None
        self._segments: SegmentTable | None = None  # made on the first launch with referenced tensors
        self.scratch = torch.zeros(1, dtype=torch.int32, device=device)  # segments_copy's unused flag outputs

    def mapped(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pinned input and output buffers as device tensors at the same memory."""
        if self._mapped is None:
            self._mapped = (device_alias(self.host, self.device), device_alias(self.out_host, self.device))
        return self._mapped

    def mapped_views(self, plan: StagingLayout, views: _Views) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """`views`' inputs and outputs, carved from the mapped buffers instead of `dev`."""
        host, out_host = self.mapped()
        inputs = {name: _carve(host, e) for name, e in plan.entries.items()}
        out = out_host[: plan.out_bytes].view(torch.bfloat16).view(views.out_host.shape)
        return inputs, out

    def views_for(self, plan: StagingLayout, key: tuple[int, int]) -> _Views:
        views = self._views.get(key)
        if views is None:
            out = (plan.out_shape, torch.bfloat16)
            out_host = self.out_host[: plan.out_bytes]
            views = _Views(
                host={name: _carve(self.host, e) for name, e in plan.entries.items()},
                dev={name: _carve(self.dev, e) for name, e in plan.entries.items()},
                host_all=self.host[: plan.total],
                dev_all=self.dev[: plan.total],
                out_dev=self.out_dev[: plan.out_bytes].view(torch.bfloat16).view(out[0]),
                out_host=out_host.view(torch.bfloat16).view(out[0]),
                out_host_bytes=memoryview(out_host.numpy()),
                rows=plan.rows,
            )
            self._views[key] = views
        return views

    @property
    def capacity(self) -> int:
        return self.host.numel()

    def segment_table(self, segments: int) -> SegmentTable:
        """This set's table of `segments_copy` segments, with room for `segments` of them."""
        table = self._segments
        if table is None or table.capacity < segments:
            table = self._segments = SegmentTable(self.device, max(64, 2 * segments))
        return table


@dataclass(frozen=True)
class _Views:
    """Tensor views of one staging set for one (R, T): made once, reused by every launch."""

    host: dict[str, torch.Tensor]
    dev: dict[str, torch.Tensor]
    host_all: torch.Tensor  # the used prefix of the pinned buffer
    dev_all: torch.Tensor
    out_dev: torch.Tensor
    out_host: torch.Tensor
    out_host_bytes: memoryview  # out_host's bytes, what the scheduler reads replies from
    rows: int  # the launch's rows, padding included (a plain int: a tensor's len() is a Python call)


class _CudaStep(PendingStep):
    def __init__(self, staging: _Staging, views: _Views, device: torch.device, rows: int,
                 kept: dict[int, torch.Tensor] | None = None) -> None:
        self._staging = staging
        self._views = views
        self._device = device
        self._rows = rows  # the batch's rows: the first of the launch's (padded) rows
        self._padded = rows < views.rows
        self._kept = kept  # first row -> pinned copy of a big o the launch wrote into a DeviceSpan o_ref

    def result(self) -> torch.Tensor:
        self._staging.done.synchronize()
        out = self._views.out_host
        return out[: self._rows] if self._padded else out

    def result_bytes(self) -> memoryview:
        self._staging.done.synchronize()
        views = self._views
        out = views.out_host_bytes
        return out[: len(out) // views.rows * self._rows] if self._padded else out

    def ready(self) -> bool:
        return self._staging.done.query()

    def kept_outputs(self) -> dict[int, memoryview]:
        if not self._kept:
            return {}
        return {row: memoryview(out.numpy()) for row, out in self._kept.items()}

    def wait(self) -> None:
        # called on the scheduler's waiter thread, whose current device is nobody's choice
        with torch.cuda.device(self._device):
            self._staging.done.synchronize()


def compile_kernels(shape: ModelShape) -> int:
    """Compiles (or loads, `kernels._compiled`) every kernel a backend of `shape` launches, as its
    warm-up does; no GPU needed (CUTE_DSL_ARCH=sm_90a without one). Returns how many."""
    from gdn_server.kernels import compile_ring, compile_variant, ring_variants

    s, count = shape, 0
    for T in range(1, s.max_tokens_per_step + 1):  # plain steps longer than this are refused upstream
        compile_variant(T, s.num_q_heads, s.num_v_heads, state_dtype=s.state_dtype)
        count += 1
    for T in range(s.max_speculative_tokens + 1):  # T = 0: the fold
        for qk_heads in ring_variants(T, s.num_q_heads, s.num_v_heads):  # CTA widths by launch size
            compile_ring(T, s.num_q_heads, s.num_v_heads, s.state_dtype, qk_heads)
            count += 1
    return count


class CudaBackend(Backend):
    name = "cuda-cute"

    def __init__(
        self,
        shape: ModelShape,
        gates: GateParams,
        max_sessions: int | None,
        scale: float | None = None,
        device: str | torch.device = "cuda",
        rows_hint: int = 256,
        memory_share: float = 1.0,
    ) -> None:
        check_kernel_shape(shape)
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        H, HV, V, K = shape.num_q_heads, shape.num_v_heads, shape.head_dim_v, shape.head_dim_k
        if max_sessions is None:
            # every session's states and their history rings fit in a fraction of free memory
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * POOL_MEMORY_FRACTION * memory_share)
            per_session = shape.state_bytes_per_session + shape.num_layers * ring_bytes_per_row(H, HV, shape.state_dtype)
            max_sessions = max(1, min(MAX_DEFAULT_SESSIONS, budget // per_session))
        super().__init__(shape, gates, max_sessions, scale)
        self.device_name = torch.cuda.get_device_name(self.device)
        self.ring_min_rows = RING_MIN_ROWS[shape.state_dtype]
        from gdn_server.kernels import gdn_decode, new_ring, ring_fold, ring_verify  # each compiles on first use

        self._decode, self._ring_verify, self._ring_fold = gdn_decode, ring_verify, ring_fold
        self.state_pool = torch.zeros(self.pool_rows, HV, V, K, dtype=self.pool_dtype, device=self.device)
        # (ring_k, ring_u, ring_g), one ring per pool row; entries past a row's P are never read
        # (the kernels mask them), so the rings need no clearing when a row is reset or reused
        self.rings = new_ring(self.pool_rows, H, HV, device=self.device, state_dtype=shape.state_dtype)
        self.A_log = gates.A_log.float().contiguous().to(self.device)
        self.dt_bias = gates.dt_bias.float().contiguous().to(self.device)
        self.stream = torch.cuda.Stream(self.device)
        # a graph is launched by cudaGraphLaunch on this stream, not torch's CUDAGraph.replay(),
        # which costs ~10 us more host time a replay in the server (bench/DECISIONS.md, entry 8)
        self._stream_handle = self.stream.cuda_stream
        self._graph_launch = cudart_runtime().cudaGraphLaunch
        self._ring: list[_Staging | None] = [None] * RING
        self._plans: dict[tuple[int, int], StagingLayout] = {}
        self._next = 0
        self._rows_hint = rows_hint
        # launches up to this many rows are padded to a graph bucket: buckets past rows_hint
        # (whose staging views are not made at warm-up) are not used, nor any before warm-up
        # has captured their graphs (a padded launch without a graph would gain nothing)
        self._bucket_max = 0

    # -- staging plans: where each input of a launch of R rows and T tokens sits ----------------
    def _plan(self, rows: int, tokens: int) -> StagingLayout:
        """The byte layout of a launch's inputs in a staging buffer, computed once per (R, T)."""
        plan = self._plans.get((rows, tokens))
        if plan is not None:
            return plan
        plan = make_layout(self.shape, rows, tokens)
        self._plans[(rows, tokens)] = plan
        return plan

    def _staging_for(self, plan: StagingLayout) -> _Staging:
        idx = self._next
        self._next = (idx + 1) % RING
        staging = self._ring[idx]
        if staging is not None and staging.used:
            staging.done.synchronize()  # its previous batch must be off the buffers
        if staging is None or staging.capacity < plan.total or staging.out_host.numel() < plan.out_bytes:
            staging = self._new_staging(plan)
            self._ring[idx] = staging
        staging.used = True
        return staging

    def _new_staging(self, plan: "StagingLayout | None" = None) -> _Staging:
        """A staging set for `plan`, and at least for rows_hint rows of the longest plain step and
        the biggest verify a graph covers (a set replaced by a bigger one loses its graphs)."""
        s = self.shape
        hints = [self._plan(self._rows_hint, s.max_tokens_per_step),
                 self._plan(min(self._rows_hint, max(GRAPH_MAX_ROWS, *GRAPH_BUCKETS)), s.max_speculative_tokens)]
        hints += [] if plan is None else [plan]
        return _Staging(self.device, max(h.total for h in hints), max(h.out_bytes for h in hints))

    def submit(self, batch: StepBatch) -> PendingStep:
        R, T = len(batch.rows), batch.tokens
        if batch.verify:
            kind = VERIFY
        else:
            kind = FOLD_PLAIN if any(batch.hist) else PLAIN
        # a launch a graph bucket covers runs as that bucket's rows (see GRAPH_BUCKETS)
        graphed = kind == VERIFY or (kind == PLAIN and T == 1)
        rows = padded_rows(R) if graphed and R <= self._bucket_max else R
        plan = self._plan(rows, T)
        staging = self._staging_for(plan)
        views = staging.views_for(plan, (rows, T))

        # 1. requests -> pinned staging: a memcpy per request and input for bf16 requests, a
        #    casting copy for f16/f32 ones; no per-row work. Inputs the device reads where they
        #    are (a client's shared memory) come back, to be copied on the device.
        on_device, host_from = _fill_staging(batch, plan, staging.host_mem, staging.host_bytes, views.host)
        # The backend's stream (and its device) becomes the thread's current one and stays so:
        # whatever else runs CUDA work on this thread names its stream itself. Entering and leaving
        # a torch.cuda.stream() context per launch cost about as much host time as the graph's
        # replay (bench/DECISIONS.md, entry 8).
        torch.cuda.set_stream(self.stream)
        out_refs = sum(type(w.output) is DeviceSpan for w in batch.works)
        # one table of `segments_copy` segments for the launch: its inputs', then its outputs'
        table = staging.segment_table(len(on_device) + out_refs) if on_device or out_refs else None
        first_output = 0  # the outputs' first segment
        if on_device:
            out, first_output = self._referenced_steps(staging, views, kind, on_device, host_from, table)
        else:
            graph, graph_exec, out = staging.graphs.get((kind, rows, T), (None, 0, views.out_dev))
            if graph is not None:  # steps 2-4 as captured for this staging set, kind and (rows, T)
                error = self._graph_launch(graph_exec, self._stream_handle)
                if error:
                    clear_last_error()
                    raise RuntimeError(f"cudaGraphLaunch failed (CUDA error {error})")
            else:
                self._device_steps(views, kind)
        kept = self._write_outputs(batch, staging, out, table, first_output) if out_refs else {}
        # the host buffer gets o where the kernels left it on the device and some request is
        # answered from that buffer (not every one had its rows kept apart)
        if on_device and len(kept) < len(batch.works):
            views.out_host.copy_(views.out_dev, non_blocking=True)
        staging.done.record(self.stream)
        return _CudaStep(staging, views, self.device, R, kept)

    def _referenced_steps(self, staging: _Staging, views: _Views, kind: str,
                          on_device: list[tuple[DeviceSpan, int, int]], host_from: int,
                          table: SegmentTable) -> tuple[torch.Tensor, int]:
        """Steps 2 and 3 of a launch with inputs the device reads where they are (DeviceSpans:
        its own memory, page-locked host memory of a big request): the staging buffer's copy cut
        to the part filled on the host (from byte `host_from`), the inputs copied from where they
        are into the device buffer by one `segments_copy` (torch's copies for a span of another
        device), the kernels; their segments are the first rows of `table`. Returns the device
        tensor holding o and the segments used; step 4 is the caller's."""
        from gdn_server.kernels import segments_copy

        here = self.device.index
        dev_base = staging.dev.data_ptr()
        segments = []  # (src, dst, row words, rows, 0, 0) in this device's memory
        for src, offset, n in on_device:
            if src.device == here:
                segments.append((src.address, dev_base + offset, src.nbytes // 2 // n, n, 0, 0))  # bf16: a word each
        views.dev_all[host_from:].copy_(views.host_all[host_from:], non_blocking=True)
        for src, offset, n in on_device:  # a DMA each
            if src.device != here:
                staging.dev[offset:offset + src.nbytes].copy_(src.tensor(), non_blocking=True)
        if segments:
            table.write(0, segments)
            segments_copy(table.rows(0, len(segments)), staging.scratch, max(seg[3] for seg in segments))
        self._launch_kernel(views.dev, views.out_dev, kind)
        return views.out_dev, len(segments)

    def _write_outputs(self, batch: StepBatch, staging: _Staging, out: torch.Tensor, table: SegmentTable,
                       first: int) -> dict[int, torch.Tensor]:
        """Step 4 for the requests whose o_ref is a DeviceSpan, after the kernels wrote o into
        `out` (device memory, or the mapped output buffer of a small graph): their rows copied
        there by one `segments_copy` of `table`'s segments from `first` on (torch's copies for a
        span of another device). Those of KEEP_APART_BYTES or more are also copied apart, each
        into pinned memory of its own (torch's caching host allocator), instead of into the
        reused host buffer: what a retry is answered from, with no copy by the CPU; returned by
        their first rows."""
        from gdn_server.kernels import segments_copy

        here = self.device.index
        segments = []  # (src, dst, row words, rows, 0, 0) in this device's memory
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # first row -> (device rows, pinned copy)
        row_bytes = out[0].numel() * 2
        out_base, row = out.data_ptr(), 0
        for w in batch.works:
            n = len(w.session_ids)
            output = w.output
            if type(output) is DeviceSpan:
                if output.device == here:
                    segments.append((out_base + row * row_bytes, output.address, row_bytes // 2, n, 0, 0))
                else:
                    output.tensor().copy_(_byte_rows(out, row, n), non_blocking=True)
                if output.nbytes >= KEEP_APART_BYTES:
                    kept[row] = (_byte_rows(out, row, n), torch.empty(output.nbytes, dtype=torch.uint8, pin_memory=True))
            row += n
        if segments:
            table.write(first, segments)
            segments_copy(table.rows(first, len(segments)), staging.scratch, max(seg[3] for seg in segments))
        for rows, copy in kept.values():
            copy.copy_(rows, non_blocking=True)
        return {row: copy for row, (_, copy) in kept.items()}

    def _device_steps(self, views: _Views, kind: str) -> None:
        """A launch's device work, on the current stream, from a filled staging set."""
        # 2. one host-to-device copy
        views.dev_all.copy_(views.host_all, non_blocking=True)
        # 3. one launch over every row (two with a fold)
        self._launch_kernel(views.dev, views.out_dev, kind)
        # 4. one device-to-host copy of the outputs
        views.out_host.copy_(views.out_dev, non_blocking=True)

    def _launch_kernel(self, inputs: dict[str, torch.Tensor], out: torch.Tensor, kind: str) -> None:
        """The kernels of a launch of `kind` over every row of `inputs` (device tensors, or the
        mapped staging buffer). The staged `slots` are the rows' pool rows, read and written."""
        rows, layers = inputs["slots"], inputs["layers"]
        q, k, v, a, b = inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"]
        if kind == VERIFY:
            self._ring_verify(self.state_pool, rows, inputs["hist"], layers, q, k, v, a, b, self.A_log, self.dt_bias,
                              *self.rings, out, scale=self.scale)
            return
        if kind == FOLD_PLAIN:
            self._ring_fold(self.state_pool, rows, inputs["hist"], *self.rings)
        self._decode(self.state_pool, rows, layers, q, k, v, a, b, self.A_log, self.dt_bias, out, scale=self.scale)

    def warmup(self) -> None:
        # each stage's time goes in the log: where a start spends its time, for operators and for us
        started = time.perf_counter()
        # the whole ring now: pinned allocations take milliseconds each, a stall of the first
        # launches (and of every request behind them) if left to the first RING batches
        for idx, staging in enumerate(self._ring):
            if staging is None:
                self._ring[idx] = self._new_staging()
        # and every staging set's views for one-token launches of up to rows_hint rows: building
        # them on first use (~20 torch calls per (R, T) and set) would take the event loop's time in
        # the first seconds of load. At the default rows_hint that is 2,048 views, ~40k tensor
        # objects: tens of MB of host memory and a fraction of a second, once.
        for staging in self._ring:
            for rows in range(1, self._rows_hint + 1):
                staging.views_for(self._plan(rows, 1), (rows, 1))
        staged = time.perf_counter()
        count = compile_kernels(self.shape)
        folder = disk_cache_folder()
        compiled = time.perf_counter()
        try:
            self._capture_graphs()
        except Exception:  # a driver or library that cannot capture: launch directly
            log.exception("could not capture the small launches as CUDA graphs; launching them directly")
            for staging in self._ring:
                staging.graphs.clear()
        torch.cuda.synchronize(self.device)
        log.info("warm-up %.1f s: staging %.1f s, %d kernels %.1f s (%s), %d graphs %.1f s",
                 time.perf_counter() - started, staged - started, count, compiled - staged,
                 f"kernel cache {folder}" if folder is not None else "compiled: no kernel cache",
                 sum(len(staging.graphs) for staging in self._ring), time.perf_counter() - compiled)

    def _capture_graphs(self) -> None:
        """A graph of each staging set's plain T=1 launch and verify of every T for every row count
        up to GRAPH_MAX_ROWS and every bucket up to rows_hint: `_device_steps`, or for up to
        MAPPED_MAX_ROWS rows the kernel alone on the mapped buffers.

        Rows are padding (row -1: no state or ring read or written) while anything runs here: one
        eager launch per (kind, R, T) (the launcher's first call sets itself up, which a capture
        must not see), then the captures, which record and run nothing."""
        if GRAPH_MAX_ROWS < 1:
            return
        buckets = tuple(b for b in GRAPH_BUCKETS if b <= self._rows_hint)
        mapped_rows = min(MAPPED_MAX_ROWS, GRAPH_MAX_ROWS)
        mapped = mapped_rows > 0 and self._mapped_staging_works(mapped_rows)
        launches = [(PLAIN, 1)] + [(VERIFY, T) for T in range(1, self.shape.max_speculative_tokens + 1)]
        with torch.cuda.device(self.device):  # a capture records on the current device
            side = torch.cuda.Stream(self.device)
            for (kind, tokens), R in ((launch, R) for launch in launches for R in (*range(1, GRAPH_MAX_ROWS + 1), *buckets)):
                plan = self._plan(R, tokens)
                for i, staging in enumerate(self._ring):
                    views = staging.views_for(plan, (R, tokens))
                    views.host["slots"].fill_(-1)
                    views.host["layers"].zero_()
                    views.host["hist"].zero_()
                    if mapped and R <= mapped_rows:  # the kernel alone, on the pinned buffers
                        inputs, out = staging.mapped_views(plan, views)
                        steps = functools.partial(self._launch_kernel, inputs, out, kind)
                    else:
                        out = views.out_dev
                        steps = functools.partial(self._device_steps, views, kind)
                    if i == 0:
                        with torch.cuda.stream(self.stream):
                            steps()
                        self.stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    # capture_begin/end, not torch.cuda.graph(): that one also synchronizes,
                    # collects garbage and empties the allocator's cache at every capture
                    with torch.cuda.stream(side):
                        graph.capture_begin()
                        try:
                            steps()
                        finally:
                            graph.capture_end()
                    staging.graphs[(kind, R, tokens)] = (graph, graph.raw_cuda_graph_exec(), out)
        if buckets:
            self._bucket_max = buckets[-1]

    def _mapped_staging_works(self, rows: int) -> bool:
        """Whether every staging set's buffers can be mapped for the kernel, for the launches of up
        to `rows` rows (MAPPED_MAX_ROWS); where they cannot, says why and keeps the copies."""
        try:
            for staging in self._ring:
                staging.mapped()
        except Exception:
            log.exception("pinned staging cannot be mapped for the kernel; the small graphs keep their copies")
            return False
        log.info("launches of up to %d rows run the kernel on mapped pinned staging", rows)
        return True

    # -- session operations (called with no step in flight) ----------------------------------
    def _rows(self, session_slot: int) -> slice:
        L = self.shape.num_layers
        return slice(session_slot * L, (session_slot + 1) * L)

    def reset_session(self, session_slot: int) -> None:
        with torch.cuda.stream(self.stream):
            self.state_pool[self._rows(session_slot)].zero_()

    def copy_session(self, src_slot: int, dst_slot: int) -> None:
        with torch.cuda.stream(self.stream):  # device-side copy
            self.state_pool[self._rows(dst_slot)].copy_(self.state_pool[self._rows(src_slot)])

    def read_session(self, session_slot: int) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            out = self.state_pool[self._rows(session_slot)].to("cpu", non_blocking=False)
        self.stream.synchronize()
        return out

    def write_session(self, session_slot: int, state: torch.Tensor) -> None:
        check_state_dtype(state, self.pool_dtype)
        with torch.cuda.stream(self.stream):
            self.state_pool[self._rows(session_slot)].copy_(state, non_blocking=False)
        self.stream.synchronize()

    def fold(self, rows: list[int], hist: list[int]) -> None:
        """Folds each row's `hist` ring entries into its state (rows with none are skipped)."""
        live = [(row, p) for row, p in zip(rows, hist) if p > 0]
        if not live:
            return
        with torch.cuda.stream(self.stream):
            pairs = torch.tensor(live, dtype=torch.int32).t().contiguous().to(self.device)
            self._ring_fold(self.state_pool, pairs[0], pairs[1], *self.rings)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def device_problem(self) -> str | None:
        # a CUDA error that poisons the context (an illegal address, a lost device) fails every
        # later call too: a plain synchronize tells it from a failure of one launch
        try:
            torch.cuda.synchronize(self.device)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    def close(self) -> None:
        self.stream.synchronize()
