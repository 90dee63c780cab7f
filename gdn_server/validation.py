"""A decode request's wire bytes -> DecodeWork (checked inputs). Everything a request can get
wrong on its own, without looking at session state, is caught here as InvalidArgument, before
anything is queued.

It runs on the event loop for every decode request. The common case, a step of bf16 inputs (plain
or speculative) in protobuf's plain encoding, is read, checked and digested from the raw bytes by
gdn_server._wire in one pass, and its DecodeWork carries views of the message's bytes, which a
GPU backend copies into its staging buffer as they are. Everything else is parsed by protobuf and
checked here in Python, which also says what is wrong with a request the C declined; f16/f32
inputs become float tensors here.

Every input leaves here checked for NaN/Inf: bf16 bytes by gdn_server._wire (the parse, or
`checked_digests` for the rest: one rule, in the same pass as the digests), f16/f32 bytes by
gdn_client.proto.checks, a big request (a tensor or o of DEVICE_READ_BYTES or more) with any
input a GPU reads in place (a DeviceSpan) on that GPU, all of its inputs together (the check the
resolver brings, `resolve.check_device`: one kernel launch for the requests of a turn of the
event loop, which the servicer polls through a PendingCheck). A small request's DeviceSpans are
copied to the host first (`resolve.read_device`: the copies of the requests of a turn of the
event loop made together, also polled through a PendingCheck) and checked like a message's bytes:
copies answer sooner than a check launch and its polls, and the launch then replays its graph.
Nothing after validation checks them again.

Tensors by reference (TensorRef, into a shared-memory region the caller registered) become views
of the region here, through the `resolve` function the servicer passes for the caller
(gdn_server.shared_memory): host memory as buffers like a message's bytes, memory a GPU reads in
place as DeviceSpans (addresses): CUDA memory, and page-locked host memory where the request has
a referenced tensor of DEVICE_READ_BYTES or more (those of a small request in CUDA memory are
then copied out, above). So the scheduler and the backends see a
DecodeWork of views and never learn about regions; an output reference (o_ref) becomes
`DecodeWork.output`, where the reply's o goes.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from gdn_client.proto.checks import (
    ITEMSIZE_OF, WireFormatError, check_layout, describe_shape, has_nonfinite,
    torch_dtypes,
)
from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server import _wire
from gdn_server._wire import CheckedStep, StepLimits
from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, InvalidArgument
from gdn_server.limits import MAX_REQUEST_ID_LEN, MAX_SESSION_ID_LEN
from gdn_server.shared_memory import DEVICE_READ_BYTES
from gdn_server.work import INPUT_NAMES, DecodeWork, DeviceSpan

MAX_POSITION = _wire.MAX_POSITION  # 2^63 - 1: positions travel as uint64 and are kept as signed 64-bit counts
TORCH_DTYPE = torch_dtypes()
_ALL_BF16 = (gdn_pb2.BF16,) * 5
_ALL_REFS = (tuple,) * 5  # the types of a CheckedStep's inputs when all five are by reference

# (inputs, rows, bf16=True) -> (index of the first bf16 input with a NaN or Inf, or None; each
# session's inputs as sent, digested: a CRC-32 of its q, k, v, a, b rows, sampled when long), in
# one pass over the bytes; the digest is what a retry of its step must match. gdn_server/_wire.c.
checked_digests = _wire.checked_digests
# A tensor reference's resolution (gdn_server.shared_memory.SharedMemoryRegistry.resolver):
# (region, offset, byte count, device_read=False) -> a buffer of host memory or a DeviceSpan of
# memory a GPU reads in place; its `check_device` starts the check of a big request's DeviceSpans
# and `read_device` the copy of a small one's (None where there can be none); `recall` and `keep`
# hold the resolved references of a request that names only references, for the next naming the
# same (gdn_server.shared_memory.Resolver)
Resolve = Callable[..., Any]


def step_limits(shape: ModelShape) -> StepLimits:
    """What `parse_decode_request` checks a step against, for a model of `shape`."""
    s = shape
    return StepLimits(
        num_layers=s.num_layers, num_q_heads=s.num_q_heads, num_v_heads=s.num_v_heads, head_dim_k=s.head_dim_k,
        head_dim_v=s.head_dim_v, max_tokens=s.max_tokens_per_step, max_speculative_tokens=s.max_speculative_tokens,
        max_session_id_len=MAX_SESSION_ID_LEN, max_request_id_len=MAX_REQUEST_ID_LEN,
    )


def parse_decode_request(data: bytes, limits: StepLimits) -> CheckedStep | gdn_pb2.DecodeRequest:
    """A DecodeRequest's wire bytes: a CheckedStep (gdn_server._wire) where they are a valid bf16
    step, plain or speculative, else the protobuf message, for `decode_work` to check; protobuf's
    DecodeError where they do not parse. The decode RPCs' request deserializer (`limits`:
    `step_limits`)."""
    step = _wire.parse_step(data, limits)
    return step if step is not None else gdn_pb2.DecodeRequest.FromString(data)


def decode_work(request: CheckedStep | gdn_pb2.DecodeRequest, shape: ModelShape, owner: str | None = None,
                owner_key: str | None = None, resolve: Resolve | None = None) -> "DecodeWork | PendingCheck":
    """The DecodeWork of a `parse_decode_request` result, owned by `owner` (its quota key
    `owner_key`), its tensor references resolved by `resolve` (None: the server takes none).
    Raises InvalidArgument with a precise reason (NotFound for an unknown region)."""
    if type(request) is CheckedStep:
        if request.by_reference:
            return _step_by_reference(request, shape, owner, owner_key, resolve)
        return DecodeWork(
            request.layer, request.session_ids, positions=request.positions, request_id=request.request_id,
            owner=owner, owner_key=owner_key, speculative=request.speculative, bf16_bytes=request.inputs,
            input_dims=request.dims, digests=request.digests,
        )
    return decode_work_from_request(request, shape, owner=owner, owner_key=owner_key, resolve=resolve)


def decode_work_from_request(
    req: gdn_pb2.DecodeRequest, shape: ModelShape, owner: str | None = None, owner_key: str | None = None,
    resolve: Resolve | None = None,
) -> "DecodeWork | PendingCheck":
    """Checks a DecodeRequest against the model shape; raises InvalidArgument with a precise reason.
    Tensor references are resolved with `resolve` (see `Resolve`; None: FailedPrecondition)."""
    L = shape.num_layers
    layer = req.layer
    if layer >= L:
        raise InvalidArgument(f"layer {layer} out of range: the model has {L} layers (0..{L - 1})")
    session_ids = tuple(req.session_ids)
    B = len(session_ids)
    if B == 0:
        raise InvalidArgument("session_ids is empty: a request names at least one session")
    if len(set(session_ids)) != B:
        raise InvalidArgument("duplicate session ids in one request")
    for sid in session_ids:
        if not 0 < len(sid) <= MAX_SESSION_ID_LEN:
            raise _malformed_session_id(sid)
    request_id = req.request_id
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id has {len(request_id)} characters, at most {MAX_REQUEST_ID_LEN}")
    positions = tuple(req.positions) or None
    if positions is not None:
        if len(positions) != B:
            raise InvalidArgument(f"positions has {len(positions)} entries for {B} sessions")
    messages = (req.q, req.k, req.v, req.a, req.b)
    raw = tuple(m.data for m in messages)  # a fresh bytes object per access of `data`: read once
    speculative = bool(req.speculative)
    try:
        dims = check_shapes(messages, B, speculative, shape)
    except InvalidArgument:
        for name in INPUT_NAMES:  # a tensor left out reads as an empty one: say which
            if not req.HasField(name):
                raise InvalidArgument(f"tensor {name} is missing") from None
        raise
    T = dims[0][1]
    if positions is not None and max(positions) > MAX_POSITION - T:
        raise InvalidArgument(
            f"position {max(positions)} + T = {T} is out of range: a session's count stays below 2^63"
        )
    dtypes = [m.dtype for m in messages]
    refs = [(m.ref.region, m.ref.offset) if m.HasField("ref") else None for m in messages]
    o_ref = (req.o_ref.region, req.o_ref.offset) if req.HasField("o_ref") else None
    raw, output, device_read = _resolved(raw, refs, o_ref, dtypes, dims, shape, resolve)
    common = dict(
        layer=layer, session_ids=session_ids, positions=positions, request_id=request_id,
        speculative=speculative, owner=owner, owner_key=owner_key, output=output,
    )
    return _checked_work(common, raw, dtypes, dims, resolve, device_read)


def _step_by_reference(step: CheckedStep, shape: ModelShape, owner: str | None, owner_key: str | None,
                       resolve: Resolve | None) -> "DecodeWork | PendingCheck":
    """The DecodeWork of a step checked by the C parse with inputs or o by reference. The C has
    checked every input's dtype (bf16), shape and inline length, so a reference needs only its
    resolution here (what `_resolved` does for any request, with the layout checks)."""
    dims = step.dims
    inputs = step.inputs
    # a request with every tensor by reference: its references' resolution is kept for the
    # next request naming the same (a client steps through a model with a few sets of tensors)
    key = (inputs, step.o_ref, dims) if resolve is not None and _ALL_REFS == tuple(map(type, inputs)) else None
    layout = None if key is None else resolve.recall(key)
    if layout is None:
        raw = list(inputs)
        refs = [(i, x[0], x[1], 2 * math.prod(dims[i])) for i, x in enumerate(raw) if type(x) is tuple]
        output, device_read = _resolve_all(raw, refs, step.o_ref, _output_bytes(dims, shape), resolve)
        if key is not None:
            resolve.keep(key, [r[1] for r in refs] + ([step.o_ref[0]] if step.o_ref else []), (tuple(raw), output, device_read))
    else:
        raw, output, device_read = layout
    common = dict(
        layer=step.layer, session_ids=step.session_ids, positions=step.positions, request_id=step.request_id,
        speculative=step.speculative, owner=owner, owner_key=owner_key, output=output,
    )
    return _checked_work(common, tuple(raw), _ALL_BF16, dims, resolve, device_read)


def _resolved(raw: Sequence[Any], refs: Sequence[tuple[str, int] | None], o_ref: tuple[str, int] | None,
              dtypes: Sequence[int], dims: Sequence[tuple[int, ...]], shape: ModelShape,
              resolve: Resolve | None) -> tuple[tuple, Any, bool]:
    """The inputs' bytes, each reference (region, offset) resolved to a view of its region (the
    layout of each checked, by reference or inline), where o goes (None: in the reply), and
    whether the request is big enough for a GPU to read it in place (`_resolve_all`)."""
    out = list(raw)
    by_reference = []  # (input index, region, offset, bytes)
    for i, (name, dtype, d, data, ref) in enumerate(zip(INPUT_NAMES, dtypes, dims, raw, refs)):
        if ref is not None and len(data):
            raise InvalidArgument(f"tensor {name} has both data and ref: its bytes are in one place")
        nbytes = ITEMSIZE_OF.get(dtype, 0) * math.prod(d) if ref is not None else len(data)
        try:
            check_layout(dtype, d, nbytes, name)
        except WireFormatError as e:
            raise InvalidArgument(str(e)) from None
        if ref is not None:
            by_reference.append((i, ref[0], ref[1], nbytes))
    output, device_read = _resolve_all(out, by_reference, o_ref, _output_bytes(dims, shape), resolve)
    return tuple(out), output, device_read


def _resolve_all(raw: list, refs: Sequence[tuple[int, str, int, int]], o_ref: tuple[str, int] | None,
                 o_bytes: int, resolve: Resolve | None) -> tuple[Any, bool]:
    """Resolves each reference (input index, region, offset, bytes) into `raw` at its index;
    returns where o goes (the view of `o_bytes` at `o_ref`, or None: in the reply) and whether a
    GPU reads the request's references in place: where one of them, o_ref included, has
    DEVICE_READ_BYTES or more (page-locked host memory is then a DeviceSpan too). An output must
    not overlap an input, and one in CUDA memory starts on an even byte (o is written in bf16
    words). NotFound for an unknown region, InvalidArgument past a region's end."""
    if resolve is None and (refs or o_ref is not None):
        name = INPUT_NAMES[refs[0][0]] if refs else "o_ref"
        raise FailedPrecondition(f"{name} refers to shared memory, which this server does not accept "
                                 "(gdn-server --allow-shared-memory)")
    device_read = max((n for _, _, _, n in refs), default=0) >= DEVICE_READ_BYTES or (
        o_ref is not None and o_bytes >= DEVICE_READ_BYTES)
    for i, region, offset, nbytes in refs:
        raw[i] = resolve(region, offset, nbytes, device_read)
    if o_ref is None:
        return None, device_read
    region, start = o_ref
    output = resolve(region, start, o_bytes, device_read)
    if type(output) is DeviceSpan and output.address % 2:
        raise InvalidArgument(f"o_ref offset {start} in CUDA memory is odd: o is bf16, so it starts on an even byte")
    end = start + o_bytes
    for i, other_region, s, n in refs:
        if other_region == region and start < s + n and s < end:
            raise InvalidArgument(
                f"o_ref overlaps input {INPUT_NAMES[i]} in region {region!r}: outputs go where no input is")
    return output, device_read


def _output_bytes(dims: Sequence[tuple[int, ...]], shape: ModelShape) -> int:
    """The bytes of o, bf16 [B, T, HV, V]."""
    return 2 * dims[0][0] * dims[0][1] * shape.num_v_heads * shape.head_dim_v


class PendingCheck:
    """A request whose inputs a GPU is checking (`resolve.check_device`) or copying to the host
    (`resolve.read_device`), started: the caller polls `ready()` (the event loop serves others
    meanwhile), then `work()` is its DecodeWork, or raises InvalidArgument for a NaN or Inf."""

    __slots__ = ("_pending", "_finish")

    def __init__(self, pending: Any, finish: Callable[[Any], DecodeWork]) -> None:
        self._pending, self._finish = pending, finish  # finish(pending.result()) -> DecodeWork

    def ready(self) -> bool:
        return self._pending.ready()

    def abandon(self) -> None:
        """Ends the check or copy unread (its request will not be queued)."""
        try:
            self._pending.result()  # a check's buffers go back once every check of its batch is read
        except RuntimeError:  # a failed copy: nothing of it to give back
            pass

    def work(self) -> DecodeWork:
        return self._finish(self._pending.result())


def _scanned(common: dict, tensors: dict, dims: tuple) -> Callable[[Any], DecodeWork]:
    """The DecodeWork of a GPU check's (bad, digests) for inputs the launch reads where they are."""

    def finish(result: tuple) -> DecodeWork:
        bad, digests = result
        if bad is not None:
            raise nonfinite_input(INPUT_NAMES[bad])
        return DecodeWork(**common, **tensors, input_dims=dims, digests=digests)

    return finish


def _copied(common: dict, raw: tuple, on_device: Sequence[bool], dtypes: Sequence[int],
            dims: Sequence[tuple[int, ...]]) -> Callable[[Any], DecodeWork]:
    """The DecodeWork of a small request whose DeviceSpans were copied to the host, checked by the CPU."""

    def finish(copied: list) -> DecodeWork:
        host = iter(copied)
        return _checked_work(common, tuple(next(host) if there else r for r, there in zip(raw, on_device)), dtypes, dims)

    return finish


def _checked_work(common: dict, raw: tuple, dtypes: Sequence[int], dims: Sequence[tuple[int, ...]],
                  resolve: Resolve | None = None, device_read: bool = False) -> DecodeWork | PendingCheck:
    """The DecodeWork of resolved inputs of checked layout: their NaN/Inf check and digests. A
    big request (`device_read`) with an input a GPU reads in place (a DeviceSpan) gets all five so
    as bf16 (`_on_device`), checked there by `resolve.check_device` (a PendingCheck), and the
    backend's launch reads them there; a small one's DeviceSpans are copied to the host
    (`resolve.read_device`, a PendingCheck too), then checked and staged like a message's bytes."""
    B = len(common["session_ids"])
    if DeviceSpan in map(type, raw):
        on_device = [type(r) is DeviceSpan for r in raw]
        if not device_read:
            spans = [r for r, there in zip(raw, on_device) if there]
            return PendingCheck(resolve.read_device(spans), _copied(common, raw, on_device, dtypes, dims))
        spans = _on_device(raw, dtypes, on_device)
        return PendingCheck(resolve.check_device(spans, B), _scanned(common, dict(zip(INPUT_NAMES, spans)), tuple(dims)))
    if tuple(dtypes) == _ALL_BF16:  # checked and digested in one pass (gdn_server._wire)
        bad, digests = checked_digests(raw, B)
        if bad is not None:
            raise nonfinite_input(INPUT_NAMES[bad])
        return DecodeWork(**common, bf16_bytes=tuple(raw), input_dims=tuple(dims), digests=digests)
    tensors = {}
    for name, dtype, d, data in zip(INPUT_NAMES, dtypes, dims, raw):
        torch_dtype = TORCH_DTYPE[dtype]
        if len(data) and has_nonfinite(data, dtype):
            raise nonfinite_input(name)
        tensors[name] = (torch.frombuffer(data, dtype=torch_dtype) if len(data) else torch.empty(0, dtype=torch_dtype)).view(d)
    digests = checked_digests(raw, B, False)[1]  # f16/f32: checked above
    return DecodeWork(**common, **tensors, digests=digests)


def _on_device(raw: Sequence[Any], dtypes: Sequence[int], on_device: Sequence[bool]) -> list[DeviceSpan]:
    """A request's five inputs as bf16 DeviceSpans that the device of its first DeviceSpan reads:
    those it reads where they are (its memory, page-locked host memory) as bf16 at an even address
    as they are (no torch call: the common case), the others copied to it (message bytes, host
    memory, another GPU's memory), realigned or cast, by torch."""
    device = next(r.device for r, there in zip(raw, on_device) if there)
    spans = []
    made = False  # whether any input was copied or cast here
    for dtype, data, there in zip(dtypes, raw, on_device):
        if there and dtype == gdn_pb2.BF16 and data.device == device and data.address % 2 == 0:
            spans.append(data)
            continue
        torch_dtype = TORCH_DTYPE[dtype]
        if there:  # a copy of its bytes on `device` (CUDA copies bytes at any address)
            t = data.tensor().to(f"cuda:{device}", copy=True).view(torch_dtype)
        else:  # a message's bytes or host shared memory, beside device inputs: one copy over
            t = torch.frombuffer(data, dtype=torch_dtype) if len(data) else torch.empty(0, dtype=torch_dtype)
            t = t.to(f"cuda:{device}")
        spans.append(DeviceSpan.of(t.to(torch.bfloat16).contiguous()))
        made = True
    if made:  # those copies run on the thread's current stream; the check runs on its own
        torch.cuda.current_stream(device).synchronize()
    return spans


def _malformed_session_id(sid: str) -> InvalidArgument:
    return InvalidArgument(f"malformed session id {sid[:MAX_SESSION_ID_LEN]!r} (1..{MAX_SESSION_ID_LEN} characters)")


def check_shapes(messages: Sequence[gdn_pb2.Tensor], B: int, speculative: bool,
                 shape: ModelShape) -> tuple[tuple[int, ...], ...]:
    """Checks the five inputs' shapes against B, T and the model; returns the shapes. (A repeated
    field compared with a list costs a fraction of reading it out.)"""
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    q = messages[0].shape
    if len(q) != 4:
        raise InvalidArgument(f"q must be [B, T, H, K] = [{B}, T, {H}, {K}], got {describe_shape(q)}")
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
            raise InvalidArgument(f"{name} must have shape {want} (B={B}, T={T}), got {describe_shape(message.shape)}")
    return tuple(map(tuple, expected))


def nonfinite_input(name: str) -> InvalidArgument:
    """The error for input `name` (q, k, v, a or b) holding a NaN or Inf, wherever it is found."""
    return InvalidArgument(f"{name} has NaN or Inf values")
