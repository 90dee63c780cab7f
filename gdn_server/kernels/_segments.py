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

import threading
from typing import Any, Callable

import numpy as np

# Columns of a segment table row
SRC, DST, ROW_WORDS, ROWS, FIRST_ROW, OFFSET = range(6)
SEGMENT_FIELDS = 6
THREADS = 256
MAX_GRID_ROWS = 65535  # CUDA's bound on a grid's y extent: a CTA takes every MAX_GRID_ROWS-th row past it

_compiled: dict[bool, Callable[..., Any]] = {}
_lock = threading.Lock()


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
        row_words = Int32(table[seg, ROW_WORDS])
        for row in range(first, Int32(table[seg, ROWS]), step):
            start = Int64(row) * Int64(row_words)
            src = cute.make_tensor(cute.make_ptr(Int16, table[seg, SRC] + start * 2, cute.AddressSpace.gmem,
                                                 assumed_align=2), cute.make_layout(row_words))
            if cutlass.const_expr(scan):
                offset = Int32(table[seg, OFFSET])
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
                    cute.arch.atomic_add((digests.iterator + Int32(table[seg, FIRST_ROW]) + row).llvm_ptr, total)
                if nonfinite != 0:
                    cute.arch.atomic_max((bad.iterator + seg).llvm_ptr, Int32(1))
            else:
                dst = cute.make_tensor(cute.make_ptr(Int16, table[seg, DST] + start * 2, cute.AddressSpace.gmem,
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
    return compiled.__tvm_ffi_object__() or compiled


def compiled_segments(scan: bool) -> Callable[..., Any]:
    """The compiled launcher (table, bad, digests, max_rows) of the scan or the copy; no GPU needed
    (CUTE_DSL_ARCH=sm_90a without one)."""
    fn = _compiled.get(scan)
    if fn is None:
        with _lock:
            fn = _compiled.get(scan)
            if fn is None:
                fn = _compiled[scan] = _build(scan)
    return fn


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


class TensorScan:
    """The NaN/Inf and digest check of one request's bf16 tensors in device memory, on their device:
    one table copy, one `segments_scan` and one copy back, on a stream of its own (so it never
    waits for the launches in flight to end), then an event the caller polls (`PendingScan`), so
    that the event loop serves other requests meanwhile. For the wire layer's check of
    CUDA-resident inputs, where they enter. Used from one thread (the event loop's)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = torch.device(device)
        # the highest priority: its few CTAs take SMs as the launches in flight free them, rather
        # than queueing behind those launches' CTAs while the request waits
        self.stream = torch.cuda.Stream(self.device, priority=-1)
        # buffers of checks whose answer was read: a check in flight holds one (there are as many
        # as requests waiting for their check at once, which admission bounds)
        self._free: list[_ScanBuffers] = []

    def __call__(self, tensors: "list[Any]", rows: int) -> "PendingScan":
        """Starts the check of bf16 tensors [rows, ...] on this device, contiguous, their row words
        in order making up a row; `PendingScan.result()` is (index of the first tensor holding a
        NaN or Inf, or None; each row's digest)."""
        import torch

        S = len(tensors)
        table_words = S * SEGMENT_FIELDS
        out_words = (S + rows + 1) // 2
        n = table_words + out_words
        buffers = self._free.pop() if self._free else None
        if buffers is None or buffers.words < n:
            buffers = _ScanBuffers(self.device, max(n, 1 << 10))
        host = buffers.host_np
        offset = 0
        for s, t in enumerate(tensors):
            row_words = t.numel() // rows
            host[s * SEGMENT_FIELDS:(s + 1) * SEGMENT_FIELDS] = (t.data_ptr(), 0, row_words, rows, 0, offset)
            offset += row_words
        host[table_words:n] = 0
        with torch.cuda.stream(self.stream):
            buffers.dev[:n].copy_(buffers.host[:n], non_blocking=True)
            table = buffers.dev[:table_words].view(S, SEGMENT_FIELDS)
            flags = buffers.dev[table_words:n].view(torch.int32)
            segments_scan(table, flags[:S], flags[S:S + rows], rows)
            buffers.host[table_words:n].copy_(buffers.dev[table_words:n], non_blocking=True)
            buffers.done.record(self.stream)
        return PendingScan(self, buffers, S, rows, table_words, n)


class _ScanBuffers:
    """One check's pinned and device int64 words (the table, then the int32 flags and digests)."""

    def __init__(self, device: Any, words: int) -> None:
        import torch

        self.words = words
        self.host = torch.zeros(words, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(words, dtype=torch.int64, device=device)
        self.done = torch.cuda.Event()


class PendingScan:
    """A started `TensorScan` check: `ready()` polls it, `result()` waits for and reads it (once)."""

    __slots__ = ("_scan", "_buffers", "_span")

    def __init__(self, scan: TensorScan, buffers: _ScanBuffers, S: int, rows: int, start: int, end: int) -> None:
        self._scan, self._buffers, self._span = scan, buffers, (S, rows, start, end)

    def ready(self) -> bool:
        return self._buffers.done.query()

    def result(self) -> tuple[int | None, tuple[int, ...]]:
        buffers = self._buffers
        buffers.done.synchronize()
        S, rows, start, end = self._span
        answer = buffers.host_np[start:end].view(np.int32)
        bad = next((s for s in range(S) if answer[s]), None)
        digests = tuple((answer[S:S + rows].astype(np.int64) & 0xFFFFFFFF).tolist())
        self._scan._free.append(buffers)
        return bad, digests
