"""DecodeRequest (protobuf) -> DecodeWork (checked inputs). Everything a request can get wrong on
its own, without looking at session state, is caught here as InvalidArgument, before anything
is queued.

It runs on the event loop for every decode request, so the common case (all five inputs bf16)
builds no tensor: shapes and byte lengths are checked as integers, the NaN/Inf check reads the
exponent bits of the raw bytes, and the DecodeWork carries the bytes, which a GPU backend copies
into its staging buffer as they are. Requests with f16/f32 inputs become float tensors here.
"""
from __future__ import annotations

import math
import sys
import warnings
import zlib
from typing import Any, Sequence

import numpy as np
import torch

from gdn_client.proto.checks import (
    JOIN_LIMIT, WireFormatError, check_layout, first_nonfinite, has_nonfinite, torch_dtypes,
)
from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.config import ModelShape
from gdn_server.errors import InvalidArgument
from gdn_server.work import INPUT_NAMES, DecodeWork

if sys.byteorder != "little":  # the wire format is little-endian; so is every host this ships for
    raise ImportError("gdn-serve needs a little-endian host")

# torch.frombuffer warns once per process that a bytes object is not writable; it is only read
warnings.filterwarnings("ignore", message="The given buffer is not writable")

MAX_SESSION_ID_LEN = 128
MAX_REQUEST_ID_LEN = 256
MAX_POSITION = 2**63 - 1  # positions travel as uint64 and are kept as signed 64-bit counts
# bf16 inputs of at least this many bytes in all leave their NaN/Inf check to a backend that
# stages them (`defer_finite_check`), which reads them where it has just copied them: one pass
# over the request's bytes fewer on the event loop. Below it the check is cheap either way.
DEFERRED_CHECK_BYTES = 1 << 20
# The retry digest of a session's inputs reads every byte of its row (its five inputs' rows) up
# to this size; a longer row one byte in DIGEST_STRIDE (a prime, so every byte offset of an
# element is sampled somewhere). A row of q, k or v holds hundreds of values, so a retry with other inputs changes
# sampled bytes, while a multi-MiB request's digests cost tens of microseconds on the event loop
# instead of milliseconds.
DIGEST_FULL_ROW_BYTES = 1024
DIGEST_STRIDE = 61
TORCH_DTYPE = torch_dtypes()
_ALL_BF16 = (gdn_pb2.BF16,) * 5


def decode_work_from_request(
    req: gdn_pb2.DecodeRequest, shape: ModelShape, defer_finite_check: bool = False,
    owner: str | None = None, owner_key: str | None = None,
) -> DecodeWork:
    """Checks a DecodeRequest against the model shape; raises InvalidArgument with a precise reason.

    With `defer_finite_check`, bf16 inputs of DEFERRED_CHECK_BYTES or more are not checked for
    NaN/Inf here: the work says so (`finite_checked=False`) and the backend checks them."""
    L = shape.num_layers
    layer = req.layer
    if layer >= L:
        raise InvalidArgument(f"layer {layer} out of range: the model has {L} layers (0..{L - 1})")
    session_ids = tuple(req.session_ids)
    B = len(session_ids)
    if B == 1:
        if not 0 < len(session_ids[0]) <= MAX_SESSION_ID_LEN:
            raise _malformed_session_id(session_ids[0])
    else:
        if B == 0:
            raise InvalidArgument("session_ids is empty: a request names at least one session")
        if len(set(session_ids)) != B:
            raise InvalidArgument("duplicate session ids in one request")
        lengths = tuple(map(len, session_ids))
        if min(lengths) == 0 or max(lengths) > MAX_SESSION_ID_LEN:
            raise _malformed_session_id(next(sid for sid in session_ids if not sid or len(sid) > MAX_SESSION_ID_LEN))
    request_id = req.request_id
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id has {len(request_id)} characters, at most {MAX_REQUEST_ID_LEN}")
    positions = tuple(req.positions) or None
    if positions is not None:
        if len(positions) != B:
            raise InvalidArgument(f"positions has {len(positions)} entries for {B} sessions")
        if max(positions) > MAX_POSITION:
            raise InvalidArgument(f"position {max(positions)} is out of range: positions are below 2^63")

    speculative = req.speculative
    q, k, v, a, b = messages = (req.q, req.k, req.v, req.a, req.b)
    q_shape = q.shape
    layout = _layout(shape, B, q_shape[1]) if len(q_shape) == 4 and 0 < q_shape[1] <= shape.max_tokens_per_step else None
    raw = (q.data, k.data, v.data, a.data, b.data)  # a fresh bytes object per access of `data`: read once
    if (layout is None or speculative or tuple(map(len, raw)) != layout.bf16_bytes
            or (q.dtype, k.dtype, v.dtype, a.dtype, b.dtype) != _ALL_BF16
            or q_shape != layout.want[0] or k.shape != layout.want[1] or v.shape != layout.want[2]
            or a.shape != layout.want[3] or b.shape != layout.want[4]):
        # anything but the plain case (bf16 inputs of the shapes a step of B sessions and T
        # tokens has): the full checks, which say what is wrong, or take other dtypes
        return _checked_work(req, messages, raw, shape, layer, session_ids, positions, request_id,
                             bool(speculative), defer_finite_check, owner, owner_key)
    total = layout.total_bytes
    joined = b"".join(raw) if B == 1 and total <= JOIN_LIMIT else None
    finite_checked = not (defer_finite_check and total >= DEFERRED_CHECK_BYTES)
    if finite_checked:
        check_finite(raw, joined)
    return DecodeWork(
        layer, session_ids, positions=positions, request_id=request_id, owner=owner, owner_key=owner_key,
        bf16_bytes=raw, input_dims=layout.dims, finite_checked=finite_checked, digests=row_digests(raw, B, joined),
    )


class _Layout:
    """What the five inputs of a plain step of B sessions and T tokens look like: their shapes (as
    lists, what a repeated field compares equal to), dims and bf16 byte counts."""

    __slots__ = ("want", "dims", "bf16_bytes", "total_bytes")

    def __init__(self, shape: ModelShape, B: int, T: int) -> None:
        H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
        self.want = ([B, T, H, K], [B, T, H, K], [B, T, HV, V], [B, T, HV], [B, T, HV])
        self.dims = tuple(map(tuple, self.want))
        self.bf16_bytes = tuple(2 * math.prod(d) for d in self.dims)
        self.total_bytes = sum(self.bf16_bytes)


_LAYOUTS: dict[tuple[ModelShape, int, int], _Layout] = {}
_LAYOUTS_KEPT = 1024  # (shape, B, T) keys; requests of more sessions make theirs each time


def _layout(shape: ModelShape, B: int, T: int) -> _Layout:
    key = (shape, B, T)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _Layout(shape, B, T)
        if len(_LAYOUTS) < _LAYOUTS_KEPT and B <= 256:
            _LAYOUTS[key] = layout
    return layout


def _malformed_session_id(sid: str) -> InvalidArgument:
    return InvalidArgument(f"malformed session id {sid[:MAX_SESSION_ID_LEN]!r} (1..{MAX_SESSION_ID_LEN} characters)")


def _checked_work(
    req: gdn_pb2.DecodeRequest, messages: tuple, raw: tuple, shape: ModelShape, layer: int,
    session_ids: tuple[str, ...], positions: tuple[int, ...] | None, request_id: str, speculative: bool,
    defer_finite_check: bool, owner: str | None, owner_key: str | None,
) -> DecodeWork:
    """`decode_work_from_request` for every request but a plain bf16 step: each check in turn,
    raising the first failure's InvalidArgument."""
    B = len(session_ids)
    try:
        dims, _ = check_shapes(messages, B, speculative, shape)
    except InvalidArgument:
        for name in INPUT_NAMES:  # a tensor left out reads as an empty one: say which
            if not req.HasField(name):
                raise InvalidArgument(f"tensor {name} is missing") from None
        raise
    dtypes = [m.dtype for m in messages]
    for name, dtype, d, data in zip(INPUT_NAMES, dtypes, dims, raw):
        try:
            check_layout(dtype, d, len(data), name)
        except WireFormatError as e:
            raise InvalidArgument(str(e)) from None

    # a small request's inputs as one buffer: one pass each for the NaN/Inf check and the digest
    joined = b"".join(raw) if B == 1 and sum(map(len, raw)) <= JOIN_LIMIT else None
    common = dict(
        layer=layer, session_ids=session_ids, positions=positions, request_id=request_id,
        speculative=speculative, owner=owner, owner_key=owner_key, digests=row_digests(raw, B, joined),
    )
    if tuple(dtypes) == _ALL_BF16:
        finite_checked = not (defer_finite_check and sum(map(len, raw)) >= DEFERRED_CHECK_BYTES)
        if finite_checked:
            check_finite(raw, joined)
        return DecodeWork(**common, bf16_bytes=tuple(raw), input_dims=tuple(dims), finite_checked=finite_checked)
    tensors = {}
    for name, dtype, d, data in zip(INPUT_NAMES, dtypes, dims, raw):
        if len(data) and has_nonfinite(data, dtype):
            raise nonfinite_input(name)
        tensors[name] = (torch.frombuffer(data, dtype=TORCH_DTYPE[dtype]) if len(data)
                         else torch.empty(0, dtype=TORCH_DTYPE[dtype])).view(d)
    return DecodeWork(**common, **tensors)


def check_shapes(messages: Sequence[gdn_pb2.Tensor], B: int, speculative: bool,
                 shape: ModelShape) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Checks the five inputs' shapes against B, T and the model; returns the shapes and their
    element counts. (A repeated field compared with a list costs a fraction of reading it out.)"""
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    q = messages[0].shape
    if len(q) != 4:
        raise InvalidArgument(f"q must be [B, T, H, K] = [{B}, T, {H}, {K}], got {list(q)}")
    T = int(q[1])
    max_T = shape.max_speculative_tokens if speculative else shape.max_tokens_per_step
    kind = "a speculative step" if speculative else "a step"
    if T == 0:
        raise InvalidArgument(f"T = 0 tokens (q's second dimension): {kind} carries 1..{max_T} tokens")
    if not 1 <= T <= max_T:
        raise InvalidArgument(f"T = {T} tokens is out of range: {kind} carries 1..{max_T} tokens")
    expected = ([B, T, H, K], [B, T, H, K], [B, T, HV, V], [B, T, HV], [B, T, HV])
    for name, message, want in zip(INPUT_NAMES, messages, expected):
        if message.shape != want:
            raise InvalidArgument(f"{name} must have shape {want} (B={B}, T={T}), got {list(message.shape)}")
    qk, heads = B * T * H, B * T * HV
    return tuple(map(tuple, expected)), (qk * K, qk * K, heads * V, heads, heads)


def row_digests(raw: Sequence[Any], rows: int, joined: bytes | None = None) -> tuple[int, ...]:
    """A cheap digest of each session's inputs as sent: a CRC-32 of its row (its q, k, v, a and
    b rows, in that order), sampled when the row is long (DIGEST_STRIDE). A session's digest is
    the same whatever other sessions shared its request, so a retry may regroup sessions.
    `joined`: the five inputs as one buffer, where the caller made it already (one row)."""
    row_bytes = sum(map(len, raw)) // rows
    stride = 1 if row_bytes <= DIGEST_FULL_ROW_BYTES else DIGEST_STRIDE
    if rows == 1:
        whole = joined if joined is not None else b"".join(raw)
        return (zlib.crc32(whole if stride == 1 else memoryview(whole)[::stride].tobytes()),)
    parts, offset = [], 0
    for data in raw:  # each tensor's share of the sampled row: the stride runs on across tensors
        by_row = np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)
        parts.append(by_row[:, (-offset) % stride :: stride])
        offset += by_row.shape[1]
    return tuple(zlib.crc32(row) for row in np.concatenate(parts, axis=1))


def check_finite(raw: Sequence[Any], joined: bytes | None = None) -> None:
    """InvalidArgument naming the first of q, k, v, a, b (their bf16 bytes) with a NaN or Inf.
    `joined`: the five as one buffer, where the caller made it already (a small step's inputs)."""
    if joined is not None and not has_nonfinite(joined, gdn_pb2.BF16):
        return
    index = first_nonfinite(raw, gdn_pb2.BF16)
    if index is not None:
        raise nonfinite_input(INPUT_NAMES[index])


def nonfinite_input(name: str) -> InvalidArgument:
    """The error for input `name` (q, k, v, a or b) holding a NaN or Inf, wherever it is found."""
    return InvalidArgument(f"{name} has NaN or Inf values")
