"""Segment copies and checks by address: the kernels that let a launch use tensors where a client
left them (its CUDA IPC memory on this GPU) instead of where a request's bytes came.

A *segment* is `rows` rows of `row_words` 16-bit words at a device-readable address: one input
of one request (its B sessions' rows), or one request's share of a launch's output. A table of
segments (int64 [S, SEGMENT_FIELDS], one row each) drives one launch of either kernel:

- `segments_scan` reads every segment and writes, per segment, whether it holds a bf16 NaN or Inf
  (`bad[s]`, 0 or 1) and adds each row's weighted word sum into `digests[first_row + r]`: the
  digest of a row is sum_i (2 (offset + i) + 1) * word_i mod 2^32 over the words of its row in
  all of its segments, `offset` the segment's first word within the row (what
  gdn_server.validation's device check gives a retry to match).
- `segments_copy` copies each segment to its destination address.

One CTA per (segment, row), a CTA taking every 65535th row past its own where there are more:
its threads stride over the row's words, so any row length works and addresses need only be
2-byte aligned (a reference's offset is the client's choice). The point is one launch for all of
a batch's segments instead of one copy call per tensor. Both run on torch's current stream.
"""

import struct
from typing import Any, Callable

import numpy as np

from ._compiled import cached_compile

# Columns of a segment table row
SRC, DST, ROW_WORDS, ROWS, FIRST_ROW, OFFSET = range(6)
SEGMENT_FIELDS = 6
THREADS = 256
MAX_GRID_ROWS = 65535  # CUDA's bound on a grid's y extent: a CTA takes every MAX_GRID_ROWS-th row past it

_cache: dict[tuple[str, bool], Callable[..., Any]] = {}


def _build(scan: bool) -> Callable[..., Any]:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int16, Int32, Int64
    from cutlass.cute.runtime import make_fake_stream

    from ._api import fake

    @cute.kernel
    def kernel(table: cute.Tensor, bad: cute.Tensor, digests: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        seg, first, _ = cute.arch.block_idx()
        _, step, _ = cute.arch.grid_dim()
        # the segment's fields are read once: the table is pinned host memory, a read of it a
        # round trip over PCIe
        row_words = Int32(table[seg, ROW_WORDS])
        rows = Int32(table[seg, ROWS])
        src_base = table[seg, SRC]
        if cutlass.const_expr(scan):
            offset = Int32(table[seg, OFFSET])
            first_row = Int32(table[seg, FIRST_ROW])
        else:
            dst_base = table[seg, DST]
        for row in range(first, rows, step):
            start = Int64(row) * Int64(row_words)
            src = cute.make_tensor(cute.make_ptr(Int16, src_base + start * 2, cute.AddressSpace.gmem,
                                                 assumed_align=2), cute.make_layout(row_words))
            if cutlass.const_expr(scan):
                total = Int32(0)
                nonfinite = Int32(0)
                for i in range(tid, row_words, THREADS):
                    word = Int32(src[i])
                    bits = word & 0xFFFF
                    total = total + bits * (2 * (offset + i) + 1)  # int32: wraps mod 2^32
                    if bits & 0x7F80 == 0x7F80:  # bf16 exponent all ones: NaN or Inf
                        nonfinite = Int32(1)
                total = cute.arch.warp_reduction_sum(total)
                if tid % 32 == 0:
                    cute.arch.atomic_add((digests.iterator + first_row + row).llvm_ptr, total)
                if nonfinite != 0:
                    cute.arch.atomic_max((bad.iterator + seg).llvm_ptr, Int32(1))
            else:
                dst = cute.make_tensor(cute.make_ptr(Int16, dst_base + start * 2, cute.AddressSpace.gmem,
                                                     assumed_align=2), cute.make_layout(row_words))
                for i in range(tid, row_words, THREADS):
                    dst[i] = src[i]

    @cute.jit
    def launch(table: cute.Tensor, bad: cute.Tensor, digests: cute.Tensor, max_rows: Int32, stream):
        kernel(table, bad, digests).launch(grid=(table.shape[0], max_rows, 1), block=(THREADS, 1, 1), stream=stream)

    # bad and digests of any length: the caller sizes them to the table and its rows
    compiled = cute.compile(
        launch, fake(Int64, (cute.sym_int(), SEGMENT_FIELDS), 8), fake(Int32, (cute.sym_int(),), 4),
        fake(Int32, (cute.sym_int(),), 4),
        Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi",
    )
    return compiled


def compiled_segments(scan: bool) -> Callable[..., Any]:
    """The compiled launcher (table, bad, digests, max_rows) of the scan or the copy; no GPU needed
    (CUTE_DSL_ARCH=sm_90a without one)."""
    return cached_compile(_cache, ("segments", scan), lambda: _build(scan))


def compile_segment_kernels() -> int:
    """Compiles (or loads) the scan and the copy, what a server with shared memory launches beside
    its decode kernels; returns how many (2)."""
    compiled_segments(True), compiled_segments(False)
    return 2


def segments_scan(table, bad, digests, max_rows: int) -> None:
    """NaN/Inf flags `bad` [S] and row digests `digests` [rows] (int32, zeroed by the caller) of
    the segments of `table` [S, SEGMENT_FIELDS] (int64, on the device), `max_rows` the most rows
    of any segment."""
    if table.shape[0] and max_rows:
        compiled_segments(True)(table, bad, digests, min(max_rows, MAX_GRID_ROWS))


def segments_copy(table, scratch, max_rows: int) -> None:
    """Copies the segments of `table` to their destinations; `scratch` any int32 device tensor
    (passed as the scan's outputs, which the copy never touches)."""
    if table.shape[0] and max_rows:
        compiled_segments(False)(table, scratch, scratch, min(max_rows, MAX_GRID_ROWS))


class SegmentTable:
    """A pinned table of segments (int64 [capacity, SEGMENT_FIELDS]) that the kernels read where it
    is, mapped into the device's address space (`_mapped.device_alias`): filled on the host
    (`write`), passed to a launch as `rows(first, count)`. A launch's table then costs no copy call
    before it (a host call, where the kernel's few reads of each row over PCIe cost less than a
    microsecond of device time). Rows a launch in flight reads must not be written again before
    it ends: the callers reuse a table only after the launches that read it."""

    def __init__(self, device: Any, capacity: int) -> None:
        import torch

        from ._mapped import device_alias

        self.capacity = capacity
        self.host = torch.zeros(capacity, SEGMENT_FIELDS, dtype=torch.int64, pin_memory=True)
        self._host_mem = memoryview(self.host.numpy()).cast("B")
        device = torch.device(device)
        if device.index is None:  # "cuda": the current device, as torch's own calls read it
            device = torch.device("cuda", torch.cuda.current_device())
        self._mapped = device_alias(self.host, device)

    def write(self, first: int, rows: "list[tuple[int, ...]]") -> None:
        """Rows of SEGMENT_FIELDS ints from table row `first` on (one struct call: the fastest way
        from Python ints to the pinned bytes)."""
        struct.pack_into(f"{SEGMENT_FIELDS * len(rows)}q", self._host_mem, 8 * SEGMENT_FIELDS * first,
                         *[v for row in rows for v in row])

    def rows(self, first: int, count: int) -> Any:
        """Rows [first, first + count) as the device sees them: the table a launch takes."""
        return self._mapped[first:first + count]


class TensorScan:
    """The NaN/Inf and digest check of requests' bf16 tensors in device memory, on their device.

    A request's check joins the open batch (`__call__`, which only writes the table); the batch is
    launched by the first poll or read of any of its checks: one table copy, one `segments_scan`
    and one copy back for every request that arrived meanwhile, on a stream of its own (so it never
    waits for the launches in flight to end), then an event the callers poll (`PendingScan`) while
    the event loop serves other requests. A caller that yields once before its first poll lets the
    requests of the same turn of the loop share the launch. For the wire layer's check of
    CUDA-resident inputs, where they enter. Used from one thread (the event loop's)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        # the highest priority: its few CTAs take SMs as the launches in flight free them, rather
        # than queueing behind those launches' CTAs while the request waits
        self.stream = torch.cuda.Stream(self.device, priority=-1)
        # buffers of batches whose answers were all read: a batch in flight holds one (there are as
        # many as batches with a request still waiting for its answer, which admission bounds)
        self._free: list[_ScanBuffers] = []
        self._open: _ScanBatch | None = None

    def __call__(self, spans: "list[Any]", rows: int) -> "PendingScan":
        """Adds the check of bf16 tensors [rows, ...] in device memory (objects with `address` and
        `nbytes`: gdn_server.work.DeviceSpan), contiguous, their row words in order making up a
        row; `PendingScan.result()` is (index of the first tensor holding a NaN or Inf, or None;
        each row's digest)."""
        batch = self._open
        if batch is None or not batch.fits(len(spans), rows):
            if batch is not None:
                self.launch(batch)
            buffers = self._free.pop() if self._free else None
            if buffers is None or not buffers.fits(len(spans), rows):
                buffers = _ScanBuffers(self.device, max(BATCH_SEGMENTS, len(spans)), max(BATCH_ROWS, rows))
            batch = self._open = _ScanBatch(buffers)
        return PendingScan(self, batch, *batch.add(spans, rows))

    def launch(self, batch: "_ScanBatch") -> None:
        """Starts the batch's check (the open batch is closed by it)."""
        import torch

        if self._open is batch:
            self._open = None
        b = batch.buffers
        S, rows = batch.segments, batch.rows
        with torch.cuda.stream(self.stream):
            table = b.table.rows(0, S)
            b.dev_out.zero_()
            segments_scan(table, b.dev_out[:S], b.dev_out[b.segments:b.segments + rows], batch.max_rows)
            b.host_out.copy_(b.dev_out, non_blocking=True)
            b.done.record(self.stream)
        batch.launched = True

    def release(self, batch: "_ScanBatch") -> None:
        """A check of `batch` was read: its buffers are free once every check of it was."""
        batch.unread -= 1
        if batch.unread == 0 and batch.launched:
            self._free.append(batch.buffers)


# A batch has room for this many segments (5 a request) and digest rows at least
BATCH_SEGMENTS = 320
BATCH_ROWS = 4096


class _ScanBuffers:
    """One batch's segment table and answers (int32, pinned and on the device: a flag per
    segment, then a digest per row)."""

    def __init__(self, device: Any, segments: int, rows: int) -> None:
        import torch

        self.segments, self.rows = segments, rows
        self.table = SegmentTable(device, segments)
        self.host_out = torch.zeros(segments + rows, dtype=torch.int32, pin_memory=True)
        self.host_out_np = self.host_out.numpy()
        self.dev_out = torch.empty(segments + rows, dtype=torch.int32, device=device)
        self.done = torch.cuda.Event()

    def fits(self, segments: int, rows: int) -> bool:
        return segments <= self.segments and rows <= self.rows


class _ScanBatch:
    """The checks of one launch: their segments' table rows, written as they are added."""

    __slots__ = ("buffers", "segments", "rows", "max_rows", "launched", "finished", "unread")

    def __init__(self, buffers: _ScanBuffers) -> None:
        self.buffers = buffers
        self.segments = self.rows = self.max_rows = self.unread = 0
        self.launched = self.finished = False

    def fits(self, segments: int, rows: int) -> bool:
        return self.buffers.fits(self.segments + segments, self.rows + rows)

    def add(self, spans: "list[Any]", rows: int) -> tuple[int, int, int, int]:
        """Writes a check's segments; returns (first segment, segments, first row, rows)."""
        first_segment, first_row = self.segments, self.rows
        segments, offset = [], 0
        for span in spans:
            row_words = span.nbytes // 2 // rows
            segments.append((span.address, 0, row_words, rows, first_row, offset))
            offset += row_words
        self.buffers.table.write(first_segment, segments)
        self.segments += len(spans)
        self.rows += rows
        self.max_rows = max(self.max_rows, rows)
        self.unread += 1
        return first_segment, len(spans), first_row, rows

    def done(self) -> bool:
        if not self.finished:
            self.finished = self.buffers.done.query()
        return self.finished


class PendingScan:
    """A check added to a `TensorScan` batch: `ready()` polls it (launching its batch if it was
    not yet), `result()` waits for and reads it (once)."""

    __slots__ = ("_scan", "_batch", "_span")

    def __init__(self, scan: TensorScan, batch: _ScanBatch, first_segment: int, segments: int, first_row: int,
                 rows: int) -> None:
        self._scan, self._batch, self._span = scan, batch, (first_segment, segments, first_row, rows)

    def ready(self) -> bool:
        batch = self._batch
        if not batch.launched:
            self._scan.launch(batch)
        return batch.done()

    def result(self) -> tuple[int | None, tuple[int, ...]]:
        batch = self._batch
        if not batch.launched:
            self._scan.launch(batch)
        buffers = batch.buffers
        if not batch.finished:
            buffers.done.synchronize()
            batch.finished = True
        first_segment, S, first_row, rows = self._span
        answer = buffers.host_out_np
        flags = answer[first_segment:first_segment + S]
        bad = next((s for s in range(S) if flags[s]), None)
        start = buffers.segments + first_row
        digests = tuple((answer[start:start + rows].astype(np.int64) & 0xFFFFFFFF).tolist())
        self._scan.release(batch)
        return bad, digests
