"""Host staging of one launch: where a batch's inputs and indices sit in one flat buffer, the host
work that fills it (the inputs come checked for NaN/Inf from validation).

The layout (`make_layout`): q, k, v, a, b as bf16 [rows, T, ...], then the int32 slots (pool
rows, read and written), layers and hist (each row's committed ring entries P) [rows], each entry
at a multiple of ALIGN bytes. The CUDA backend fills a pinned buffer with this and copies it to
the device in one transfer (or lets the kernel read it in place). Nothing here needs a GPU, so
the tests check the layout and the fill on any machine.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from gdn_server import _wire
from gdn_server.config import ModelShape
from gdn_server.work import DeviceSpan, StepBatch

ALIGN = 128  # bytes; keeps every carved view 16-byte aligned for the kernel's vector loads
# A bf16 request input at least this big is copied by torch, whose intra-op thread pool splits
# the memcpy across cores; smaller ones by a memcpy in _wire.stage_inputs (one call for all of a
# launch's requests), which costs far less to start (bench/DECISIONS.md, entry 6).
PARALLEL_COPY_BYTES = 512 << 10
INPUTS = ("q", "k", "v", "a", "b")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class StagingLayout:
    """The byte layout of a launch's inputs in a staging buffer, for one (rows, T)."""

    entries: dict  # name -> (byte offset, shape, dtype, bytes)
    total: int  # bytes of inputs
    out_shape: tuple[int, ...]
    out_bytes: int

    @property
    def rows(self) -> int:
        """Rows the layout has room for: a batch's rows, or more where its launch is padded."""
        return self.out_shape[0]


def make_layout(shape: ModelShape, rows: int, tokens: int) -> StagingLayout:
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    shapes = {
        "q": ((rows, tokens, H, K), torch.bfloat16, 2),
        "k": ((rows, tokens, H, K), torch.bfloat16, 2),
        "v": ((rows, tokens, HV, V), torch.bfloat16, 2),
        "a": ((rows, tokens, HV), torch.bfloat16, 2),
        "b": ((rows, tokens, HV), torch.bfloat16, 2),
        "slots": ((rows,), torch.int32, 4),
        "layers": ((rows,), torch.int32, 4),
        "hist": ((rows,), torch.int32, 4),
    }
    entries, offset = {}, 0
    for name, (shp, dtype, size) in shapes.items():
        nbytes = math.prod(shp) * size
        entries[name] = (offset, shp, dtype, nbytes)
        offset += _align(nbytes)
    out_shape = (rows, tokens, HV, V)
    return StagingLayout(entries, offset, out_shape, math.prod(out_shape) * 2)


def carve(buf: torch.Tensor, entry: tuple) -> torch.Tensor:
    """The tensor view of one entry of a plan in a flat uint8 buffer."""
    offset, shape, dtype, nbytes = entry
    return buf[offset : offset + nbytes].view(dtype).view(shape)


def fill(
    batch: StepBatch, plan: StagingLayout, host_mem: memoryview, host_bytes: np.ndarray, host_views: dict[str, torch.Tensor]
) -> tuple[list[tuple[DeviceSpan, int, int]], int]:
    """Copies `batch` into a staging buffer laid out by `plan`: a memcpy per request and input for
    bf16 requests (their raw bytes, all of a batch's in one call of _wire.stage_inputs; torch's
    parallel copy for inputs of PARALLEL_COPY_BYTES or more), a casting copy for the others, then
    the int32 index arrays. A plan with more rows than the batch (a padded launch) gets padding
    rows after the batch's: slot -1 (the kernel reads and writes no state or ring for them), layer
    0, P 0, inputs left as they are (unread).

    `host_mem` and `host_bytes` are the buffer as a memoryview and a uint8 numpy array;
    `host_views` the plan's tensor views of it, used by requests that did not come as bf16.

    Inputs the device reads where they are (bf16 DeviceSpans of a client's shared memory: a
    request has all five so or none) skip the host buffer: returned as (span, byte offset in the
    layout, rows), for the backend to copy into its device buffer after the host buffer's own
    copy, with the first byte of the buffer filled here (the index arrays' where every input is
    such a span, else 0), where that copy can start.
    """
    R = batch.num_rows
    room = plan.rows
    if R > room:
        raise ValueError(f"a batch of {R} rows does not fit a plan of {room}")
    entries = plan.entries
    # (byte offset, bytes per row) of each input: a request's bytes go at offset + first row * per row
    places = [(entries[name][0], entries[name][3] // room) for name in INPUTS]
    raw_requests = []  # (first row, its five inputs' bytes) of the bf16 requests
    on_device: list[tuple[DeviceSpan, int, int]] = []
    host_from = entries["slots"][0]
    row = 0
    for work in batch.works:
        n = len(work.session_ids)
        raw = work.bf16_bytes
        if raw is not None:
            raw_requests.append((row, raw))
            host_from = 0
        elif type(work.q) is DeviceSpan:
            for (offset, per_row), part in zip(places, (work.q, work.k, work.v, work.a, work.b)):
                on_device.append((part, offset + row * per_row, n))
        else:
            for name, part in zip(INPUTS, (work.q, work.k, work.v, work.a, work.b)):
                host_views[name][row : row + n].copy_(part)
            host_from = 0
        row += n
    if raw_requests:
        for start, data in _wire.stage_inputs(host_mem, places, raw_requests, PARALLEL_COPY_BYTES):
            torch.from_numpy(host_bytes[start : start + len(data)]).copy_(torch.frombuffer(data, dtype=torch.uint8))
    for name, values, padding in (("slots", batch.rows, -1), ("layers", batch.layers, 0), ("hist", batch.hist, 0)):
        offset = entries[name][0]
        # struct packs a list of ints at a third of what numpy's conversion of it costs
        struct.pack_into(f"{R}i", host_mem, offset, *values)
        if R < room:
            struct.pack_into(f"{room - R}i", host_mem, offset + 4 * R, *(padding,) * (room - R))
    return on_device, host_from
