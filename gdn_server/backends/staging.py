"""Host staging of one launch: where a batch's inputs and indices sit in one flat buffer, and the
host work that fills it.

The CUDA backend fills a pinned buffer with this and copies it to the device in one transfer;
bench/engine_path.py fills an ordinary buffer with the same code, so the engine's host cost can be
measured on any machine without skipping the copies the real path makes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gdn_server.config import ModelShape
from gdn_server.native import COPY_THREADS, THREADED_COPY_BYTES
from gdn_server.native import module as native
from gdn_server.work import StepBatch

ALIGN = 128  # bytes; keeps every carved view 16-byte aligned for the kernel's vector loads
# A request input at least this big is copied by torch (its intra-op thread pool splits the
# memcpy across cores); smaller ones by one slice assignment, which costs far less to start.
# One thread fills pinned memory at a few GB/s: 1.2 ms for a B=256 request on the H200 host.
PARALLEL_COPY_BYTES = 512 << 10
# A launch's small requests whose bytes add up to this much are copied by FILL_THREADS threads
# (the native module's pool, without the GIL). From cold caches, as in the server, on the H200
# host (bench/backend_step.py --variants): 100 one-row qwen3-next requests (1.6 MB) 847 -> 707 us
# of CudaBackend.submit; 27 (450 KB) 391 -> 431 us and 48-64 even, where waking the pool costs
# as much as it saves.
FILL_THREADED_BYTES = 1 << 20
FILL_THREADS = min(4, COPY_THREADS)
INPUTS = ("q", "k", "v", "a", "b")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Plan:
    """The byte layout of a launch's inputs in a staging buffer, for one (rows, T)."""

    entries: dict  # name -> (byte offset, shape, dtype, bytes)
    total: int  # bytes of inputs
    out_shape: tuple[int, ...]
    out_bytes: int

    @property
    def rows(self) -> int:
        """Rows the layout has room for: a batch's rows, or more where its launch is padded."""
        return self.out_shape[0]


def make_plan(shape: ModelShape, rows: int, tokens: int) -> Plan:
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    shapes = {
        "q": ((rows, tokens, H, K), torch.bfloat16, 2),
        "k": ((rows, tokens, H, K), torch.bfloat16, 2),
        "v": ((rows, tokens, HV, V), torch.bfloat16, 2),
        "a": ((rows, tokens, HV), torch.bfloat16, 2),
        "b": ((rows, tokens, HV), torch.bfloat16, 2),
        "slots": ((rows,), torch.int32, 4),
        "out_slots": ((rows,), torch.int32, 4),
        "layers": ((rows,), torch.int32, 4),
    }
    entries, offset = {}, 0
    for name, (shp, dtype, size) in shapes.items():
        nbytes = math.prod(shp) * size
        entries[name] = (offset, shp, dtype, nbytes)
        offset += _align(nbytes)
    out_shape = (rows, tokens, HV, V)
    return Plan(entries, offset, out_shape, math.prod(out_shape) * 2)


def carve(buf: torch.Tensor, entry: tuple) -> torch.Tensor:
    """The tensor view of one entry of a plan in a flat uint8 buffer."""
    offset, shape, dtype, nbytes = entry
    return buf[offset : offset + nbytes].view(dtype).view(shape)


def fill(
    batch: StepBatch, plan: Plan, host_mem: memoryview, host_bytes: np.ndarray, host_views: dict[str, torch.Tensor]
) -> dict[int, str] | None:
    """Copies `batch` into a staging buffer laid out by `plan`: a memcpy per request and input for
    bf16 requests (their raw bytes), a casting copy for the others, then the int32 index arrays.
    A plan with more rows than the batch (a padded launch) gets padding rows after the batch's:
    slot and out_slot -1 (the kernel reads and writes no state for them), layer 0, inputs left
    as they are (unread).

    `host_mem` and `host_bytes` are the buffer as a memoryview and a uint8 numpy array (slice
    assignment into a memoryview is the cheapest copy Python has); `host_views` the plan's tensor
    views of it, used only by requests that did not come as bf16.

    With the native module, the inputs of requests not yet checked for NaN/Inf
    (`finite_checked` False) are checked as they are copied, and the result says which hold one:
    {work index: first such input's name}. Without it the result is None: the caller checks the
    staged copy.
    """
    R = batch.rows
    room = plan.rows
    if R > room:
        raise ValueError(f"a batch of {R} rows does not fit a plan of {room}")
    entries = plan.entries
    # (byte offset, bytes per row) of each input: a request's bytes go at offset + first row * per row
    places = tuple([(entries[name][0], entries[name][3] // room) for name in INPUTS])
    found = None
    if native is not None:  # the small checked bf16 requests in one C call; the rest below
        left = native.fill_bf16(host_mem, places, batch.works, PARALLEL_COPY_BYTES, FILL_THREADED_BYTES, FILL_THREADS)
        found = _fill_natively(batch, set(left), places, host_mem, host_views) if left else {}
    else:
        _fill_in_python(batch, places, host_mem, host_bytes, host_views)
    if batch.lane is not None:  # the link's one-row steps, from its request ring (after the works' rows)
        batch.lane.fill(host_mem, places)
    for name, values, padding in (("slots", batch.slots, -1), ("layers", batch.layers, 0)) + (
        () if batch.in_place else (("out_slots", batch.out_slots, -1),)
    ):
        offset, _, _, nbytes = entries[name]
        column = host_bytes[offset : offset + nbytes].view(np.int32)
        if R == room:
            column[:] = values
        else:
            column[:R] = values
            column[R:] = padding
    return found


def _fill_natively(
    batch: StepBatch, which: set[int], places: tuple, host_mem: memoryview, host_views: dict[str, torch.Tensor]
) -> dict[int, str]:
    """`fill`'s copies of the works `fill_bf16` left: bf16 ones in one `copy_bf16_spans` call
    (several threads for big ones, checking the unchecked as they are copied), others by torch."""
    spans, owners = [], []  # owners[i]: (work index, input name) of spans[i] when it is checked
    first_row = 0
    for index, work in enumerate(batch.works):
        row = first_row
        n = len(work.session_ids)
        first_row += n
        if index not in which:
            continue
        raw = work.bf16_bytes
        if raw is None:
            for name, part in zip(INPUTS, (work.q, work.k, work.v, work.a, work.b)):
                host_views[name][row : row + n].copy_(part)
            continue
        check = not work.finite_checked
        for name, (offset, per_row), data in zip(INPUTS, places, raw):
            spans.append((offset + row * per_row, data, check))
            owners.append((index, name))
    if not spans:
        return {}
    big = sum(len(span[1]) for span in spans) >= THREADED_COPY_BYTES
    hits = native.copy_bf16_spans(host_mem, spans, COPY_THREADS if big else 1)
    found: dict[int, str] = {}
    for hit, (index, name) in zip(hits, owners):
        if hit and index not in found:  # spans run q to b: the first is the one to name
            found[index] = name
    return found


def _fill_in_python(
    batch: StepBatch, places: tuple, host_mem: memoryview, host_bytes: np.ndarray, host_views: dict[str, torch.Tensor]
) -> None:
    """`fill`'s copies without the native module."""
    row = 0
    for work in batch.works:
        n = len(work.session_ids)
        raw = work.bf16_bytes
        if raw is not None:
            for (offset, per_row), data in zip(places, raw):
                start = offset + row * per_row
                if len(data) >= PARALLEL_COPY_BYTES:
                    dst = torch.from_numpy(host_bytes[start : start + len(data)])
                    dst.copy_(torch.frombuffer(data, dtype=torch.uint8))
                else:
                    host_mem[start : start + len(data)] = data
        else:
            for name, part in zip(INPUTS, (work.q, work.k, work.v, work.a, work.b)):
                host_views[name][row : row + n].copy_(part)
        row += n
