"""DecodeRequest (protobuf) -> DecodeWork (validated inputs). Everything a request can get wrong
on its own (without looking at session state) is caught here as InvalidArgument.

It runs on the event loop for every decode request, so the common case (all five inputs bf16)
builds no tensor: shapes and byte lengths are checked as integers, the NaN/Inf check reads all
five inputs in one pass (big ones each on their own, on several cores), and the DecodeWork carries
the raw bytes (memoryviews of the received message for big requests, gdn_server.protowire): a GPU
backend copies them into its staging buffer as they are; the CPU backend's tensors are built from
them when it reads them.
Requests with f16/f32 inputs become tensors here.

A request the native parser read (protowire.ParsedDecodeRequest) is checked by the native
module first, in one call; what it does not pass (invalid, or not all bf16) goes through the
Python checks below, which name the problem.
"""
from __future__ import annotations

import functools

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.wire_checks import WireFormatError, as_float32_bytes, check_layout, first_nonfinite, has_nonfinite
from gdn_server.config import ModelShape
from gdn_server.errors import InvalidArgument
from gdn_server.native import module as native
from gdn_server.protowire import DecodeRequestView, ParsedDecodeRequest
from gdn_server.work import INPUT_NAMES, DecodeWork

MAX_SESSION_ID_LEN = 128
# bf16 inputs of at least this many bytes in all may leave their NaN/Inf check to the backend
# (`defer_finite_check`), which reads them where it has just staged them: one pass over the
# request's bytes fewer on the event loop (H200, B=256: validation 633 -> 162 us, the staged
# check 208 us; bench/NOTES.md). Below it the check is cheap either way.
DEFERRED_CHECK_BYTES = 1 << 20


def decode_work_from_request(
    req: gdn_pb2.DecodeRequest | DecodeRequestView | ParsedDecodeRequest, shape: ModelShape,
    defer_finite_check: bool = False, f32_as_bytes: bool = False,
) -> DecodeWork:
    """Validates a DecodeRequest against the model shape; raises InvalidArgument with a precise reason.

    With `defer_finite_check`, bf16 inputs of DEFERRED_CHECK_BYTES or more are not checked for
    NaN/Inf here: the work says so (`finite_checked=False`) and the backend checks them. With
    `f32_as_bytes` (a front-end worker), inputs not all in BF16 become float32 bytes
    (`DecodeWork.f32_bytes`, what the link carries) instead of tensors: no torch."""
    if type(req) is ParsedDecodeRequest:
        work = _checked_natively(req, shape, defer_finite_check)
        if work is not None:
            return work
    L = shape.num_layers
    if req.layer >= L:
        raise InvalidArgument(f"layer {req.layer} out of range: the model has {L} layers (0..{L - 1})")
    session_ids = tuple(req.session_ids)
    B = len(session_ids)
    if B == 0:
        raise InvalidArgument("session_ids is empty: a request names at least one session")
    if len(set(session_ids)) != B:
        raise InvalidArgument("duplicate session ids in one request")
    lengths = tuple(map(len, session_ids))  # one C-level pass; the loop below runs only on a bad id
    if min(lengths) == 0 or max(lengths) > MAX_SESSION_ID_LEN:
        for sid in session_ids:
            if not sid or len(sid) > MAX_SESSION_ID_LEN:
                raise InvalidArgument(f"malformed session id {sid[:MAX_SESSION_ID_LEN]!r}")

    messages = []
    for name in INPUT_NAMES:
        if not req.HasField(name):
            raise InvalidArgument(f"tensor {name} is missing")
        messages.append(getattr(req, name))
    all_bf16 = all(m.dtype == gdn_pb2.BF16 for m in messages)
    dims, raw = [], []
    for name, msg in zip(INPUT_NAMES, messages):
        d = tuple(msg.shape)
        data = msg.data  # a fresh bytes object per access: read it once
        try:
            check_layout(msg.dtype, d, len(data), name)
        except WireFormatError as e:
            raise InvalidArgument(str(e)) from None
        dims.append(d)
        raw.append(data)

    _check_dims(dims, B, bool(req.speculative), shape)
    tensors = {}
    finite_checked = True
    if all_bf16:
        if defer_finite_check and sum(map(len, raw)) >= DEFERRED_CHECK_BYTES:
            finite_checked = False
        else:
            check_finite(raw)
    elif f32_as_bytes:  # f16/f32 (or a mix) in a worker: each checked for NaN/Inf, then widened
        for name, msg, data in zip(INPUT_NAMES, messages, raw):
            if has_nonfinite(data, msg.dtype, parallel=False):  # numpy's, not torch's threads
                raise nonfinite_input(name)
        f32 = tuple(as_float32_bytes(msg.dtype, data) for msg, data in zip(messages, raw))
    else:  # f16/f32 (or a mix): tensors now, each checked for NaN/Inf
        from gdn_client.wire import tensor_from_parts  # torch: loaded already where tensors are wanted

        for name, msg, d, data in zip(INPUT_NAMES, messages, dims, raw):
            try:
                tensors[name] = tensor_from_parts(msg.dtype, d, data, name, finite=True)
            except WireFormatError as e:
                raise InvalidArgument(str(e)) from None

    positions = None
    if len(req.positions):
        if len(req.positions) != B:
            raise InvalidArgument(f"positions has {len(req.positions)} entries for {B} sessions")
        positions = tuple(req.positions)  # uint64 fields read as Python ints already

    common = dict(
        layer=int(req.layer), session_ids=session_ids, positions=positions, request_id=req.request_id,
        speculative=bool(req.speculative),
    )
    if all_bf16:
        return DecodeWork(**common, bf16_bytes=tuple(raw), input_dims=tuple(dims), finite_checked=finite_checked)
    if f32_as_bytes:
        return DecodeWork(**common, f32_bytes=f32, input_dims=tuple(dims))
    return DecodeWork(**common, **tensors)


def _checked_natively(req: ParsedDecodeRequest, shape: ModelShape, defer_finite_check: bool) -> DecodeWork | None:
    """The DecodeWork of a valid all-bf16 request, checked in C; None for the Python checks."""
    verdict = native.check_bf16_step(req, _limits(shape), DEFERRED_CHECK_BYTES)
    if not verdict:
        return None
    layer, session_ids, positions, request_id, speculative, tensors = req
    raw = tuple([t[2] for t in tensors])
    finite_checked = True
    if verdict == 2:  # DEFERRED_CHECK_BYTES or more: not checked in C
        if defer_finite_check:
            finite_checked = False
        else:
            check_finite(raw)
    return DecodeWork.of_bf16(
        layer, session_ids, positions or None, request_id, speculative, raw, tuple([t[1] for t in tensors]),
        finite_checked,
    )


@functools.lru_cache(maxsize=8)
def _limits(shape: ModelShape) -> tuple[int, ...]:
    """The model's limits as `check_bf16_step` takes them."""
    return (shape.num_layers, shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v,
            shape.max_tokens_per_step, shape.max_speculative_tokens, MAX_SESSION_ID_LEN)


def check_finite(raw: "tuple[bytes | memoryview, ...] | list[bytes | memoryview]") -> None:
    """InvalidArgument naming the first of q, k, v, a, b (their bf16 bytes) with a NaN or Inf."""
    bad = first_nonfinite(raw, gdn_pb2.BF16)
    if bad is not None:
        raise nonfinite_input(INPUT_NAMES[bad])


def nonfinite_input(name: str) -> InvalidArgument:
    """The error for input `name` (q, k, v, a or b) holding a NaN or Inf, wherever it is found."""
    return InvalidArgument(f"{name} has NaN or Inf values")


def _check_dims(dims: list[tuple[int, ...]], B: int, speculative: bool, shape: ModelShape) -> None:
    """Checks the five input shapes against B and the model."""
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    q = dims[0]
    if len(q) != 4:
        raise InvalidArgument(f"q must be [B, T, H, K] = [{B}, T, {H}, {K}], got {list(q)}")
    T = int(q[1])
    max_T = shape.max_speculative_tokens if speculative else shape.max_tokens_per_step
    if not 1 <= T <= max_T:
        kind = "speculative step" if speculative else "step"
        raise InvalidArgument(f"T = {T} tokens per {kind} is out of range 1..{max_T}")
    expected = ((B, T, H, K), (B, T, H, K), (B, T, HV, V), (B, T, HV), (B, T, HV))
    for name, got, want in zip(INPUT_NAMES, dims, expected):
        if got != want:
            raise InvalidArgument(f"{name} must have shape {list(want)} (B={B}, T={T}), got {list(got)}")
