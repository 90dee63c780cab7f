"""Sessions and decode steps, shared by the sync and async clients and both stream flavours.

Nothing here does I/O. A session's positions are a `SessionCursor`. A decode call is prepared
into a `PreparedStep` (the DecodeRequest plus the position bookkeeping of the sessions it covers),
sent by whichever transport, and then either `complete`d with the reply or `fail`ed with the
error; both clients and both stream helpers go through the same three calls, so the position
rules live in one place:

- positions are reserved when a step is prepared (so pipelined steps of one session get
  consecutive positions) and always sent, which makes resending a step safe;
- a step the server refused rolls the reservation back;
- a step whose fate is unknown after the last retry leaves the layer "in doubt": further steps
  on that layer are refused until `recover()` resends the very same request.

Tensors that live in one of the client's shared-memory regions (gdn_client._shared_memory) go by
reference; an `out` tensor in a region is where the server writes o.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from google.protobuf.internal import api_implementation

from gdn_client._errors import FailedPreconditionError, GdnError, NotFoundError
from gdn_client._shared_memory import Region, references
from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.wire import WIRE_DTYPE_OF, WireFormatError, as_torch, tensor_from_proto, tensor_to_proto

__all__ = ["SessionCursor", "PreparedStep", "prepare_step", "batch_inputs"]

logger = logging.getLogger("gdn_client")

# upb (the default protobuf runtime) hands out a new bytes object per access of a bytes field, so
# the tensor decoded from a reply's `o.data` is the only holder of that memory and can be returned
# without copying it (a 2 MiB copy per B=256 reply). bytes are immutable to Python code, but one
# that nothing else references cannot be observed changing; torch keeps it alive as the storage.
# The pure-Python runtime returns the bytes the message keeps: there the output is copied.
_FRESH_BYTES = api_implementation.Type() == "upb"

TensorLike = Any  # torch.Tensor or numpy.ndarray (float16/float32; torch also bfloat16)


# -- tensors --------------------------------------------------------------------------------------

_RANKS = {"q": 4, "k": 4, "v": 4, "a": 3, "b": 3}  # batched ranks: [B, T, ...]


def batch_inputs(
    q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike, b: TensorLike, *, batch: int | None,
    regions: Sequence[Region] = (),
) -> tuple[torch.Tensor, ...]:
    """Returns q, k, v, a, b as torch tensors of the batched form [B, T, ...]: on the CPU, or where
    they are for those in one of `regions` (they go by reference).

    ``batch=None`` means one session: [T, H, K] (or [1, T, H, K]) and so on. Otherwise the leading
    dimension must equal ``batch``. Only ranks and B are checked here; the server checks the rest.
    """
    out = []
    for name, x in zip("qkvab", (q, k, v, a, b)):
        in_region = isinstance(x, torch.Tensor) and any(r.reference(x) is not None for r in regions)
        t = x.detach() if in_region else as_torch(x)
        rank = _RANKS[name]
        if batch is None and t.dim() == rank - 1:
            t = t.unsqueeze(0)
        want_b = 1 if batch is None else batch
        if t.dim() != rank or t.shape[0] != want_b:
            form = "[T, ...] or [1, T, ...]" if batch is None else f"[{batch}, T, ...]"
            raise ValueError(f"{name} has shape {list(t.shape)}; expected rank {rank} in the form {form}")
        out.append(t)
    return tuple(out)


def encode_request(
    layer: int, session_ids: Sequence[str], positions: Sequence[int], tensors: Sequence[torch.Tensor],
    regions: Sequence[Region] = (), out: torch.Tensor | None = None,
) -> tuple[gdn_pb2.DecodeRequest, tuple[Region, ...]]:
    """The DecodeRequest of a step, and the regions it refers to: each input in one of `regions`
    by reference, the others inline; `out` (in a region) as o_ref."""
    req = gdn_pb2.DecodeRequest(layer=layer, session_ids=list(session_ids), positions=list(positions))
    refs = references(regions, [*tensors, out]) if regions else [None] * 6
    for name, t, ref in zip("qkvab", tensors, refs):
        msg = getattr(req, name)
        if ref is None:
            tensor_to_proto(t, msg)
        else:
            if t.dtype not in WIRE_DTYPE_OF:
                raise TypeError(f"{name}: dtype {t.dtype} is not supported on the wire; use bfloat16, float16 or float32")
            msg.dtype = WIRE_DTYPE_OF[t.dtype]
            msg.shape[:] = list(t.shape)
            msg.ref.region, msg.ref.offset = ref[0].name, ref[1]
    if out is not None:
        if refs[5] is None:
            raise ValueError("out must be a dense bfloat16 tensor of one of the client's shared-memory regions")
        req.o_ref.region, req.o_ref.offset = refs[5][0].name, refs[5][1]
    used = tuple(dict.fromkeys(ref[0] for ref in refs if ref is not None))
    return req, used


# -- sessions and steps ---------------------------------------------------------------------------


class SessionCursor:
    """Per-session bookkeeping: the position of the next step at each layer, layers in doubt."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.closed = False
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}
        self._in_doubt: dict[int, PreparedStep] = {}

    def positions(self) -> dict[int, int]:
        with self._lock:
            return {layer: n for layer, n in self._next.items() if n}

    def in_doubt(self) -> list["PreparedStep"]:
        with self._lock:
            return list(dict.fromkeys(self._in_doubt.values()))

    def _reserve(self, layer: int, tokens: int) -> int:
        # caller holds self._lock
        if self.closed:
            raise NotFoundError(f"session {self.session_id!r} is closed")
        if layer in self._in_doubt:
            raise FailedPreconditionError(
                f"session {self.session_id!r}, layer {layer}: an earlier step's outcome is unknown "
                "after the last retry; call recover() to resend it before decoding further"
            )
        pos = self._next.get(layer, 0)
        self._next[layer] = pos + tokens
        return pos

    def _rollback(self, layer: int, pos: int) -> None:
        with self._lock:
            self._next[layer] = min(self._next.get(layer, 0), pos)

    def _mark_in_doubt(self, layer: int, pos: int, step: "PreparedStep") -> None:
        with self._lock:
            self._next[layer] = min(self._next.get(layer, 0), pos)
            self._in_doubt[layer] = step

    def _adopt(self, positions: "Sequence[int] | dict[int, int]") -> None:
        """Takes positions (a per-layer list from the server, or a {layer: n} dict) as the next
        steps' positions."""
        items = positions.items() if isinstance(positions, dict) else enumerate(positions)
        with self._lock:
            self._next = {int(layer): int(p) for layer, p in items}

    def _require_settled(self, what: str) -> None:
        with self._lock:
            if self._in_doubt:
                raise FailedPreconditionError(
                    f"session {self.session_id!r}: steps at layer(s) {sorted(self._in_doubt)} are in doubt; "
                    f"call recover() before {what}"
                )

    def _settle(self, layer: int, after: int, step: "PreparedStep") -> None:
        with self._lock:
            if self._in_doubt.get(layer) is step:
                del self._in_doubt[layer]
            if self._next.get(layer, 0) < after:
                self._next[layer] = after


@dataclass(eq=False)
class PreparedStep:
    """One DecodeRequest ready to send, with the positions it reserved."""

    request: gdn_pb2.DecodeRequest
    cursors: tuple[SessionCursor, ...]
    layer: int
    tokens: int
    positions: tuple[int, ...]
    single: bool  # one session, per-session shapes: the output drops the batch dimension
    regions: tuple[Region, ...] = ()  # the shared-memory regions the request refers to
    output: torch.Tensor | None = field(default=None, repr=False)  # where o goes ([B, T, HV, V] view), if in a region

    def complete(self, response: gdn_pb2.DecodeResponse) -> torch.Tensor:
        """Parses a successful reply and advances the sessions; returns bf16 o (the `out` tensor
        the server wrote it into, where the step has one)."""
        try:
            if self.output is not None:
                if list(response.o.shape) != list(self.output.shape) or response.o.data:
                    raise WireFormatError(f"o of shape {list(response.o.shape)} for an output in shared memory")
                o = self.output
            else:
                o = tensor_from_proto(response.o, "o")
        except WireFormatError as e:
            self.fail(GdnError(str(e)), in_doubt=True)
            raise GdnError(f"malformed reply: {e}") from None
        want = (len(self.cursors), self.tokens)
        if tuple(o.shape[:2]) != want or o.dim() != 4:
            self.fail(GdnError("malformed reply"), in_doubt=True)
            raise GdnError(f"reply o has shape {list(o.shape)}, expected [{want[0]}, {want[1]}, HV, V]")
        after = list(response.positions)
        for i, cur in enumerate(self.cursors):
            expect = self.positions[i] + self.tokens
            got = after[i] if i < len(after) else expect
            if got != expect:
                logger.warning(
                    "session %s layer %d: server reports position %d, expected %d",
                    cur.session_id, self.layer, got, expect,
                )
            cur._settle(self.layer, got, self)
        if not _FRESH_BYTES and self.output is None:
            o = o.clone()  # the view aliases bytes the message still holds
        return o[0] if self.single else o

    def fail(self, error: GdnError, *, in_doubt: bool = False) -> None:
        """Records a failed step: rolled back, or in doubt when it may have been applied."""
        for cur, pos in zip(self.cursors, self.positions):
            if in_doubt:
                cur._mark_in_doubt(self.layer, pos, self)
            else:
                cur._rollback(self.layer, pos)


def prepare_step(
    layer: int,
    cursors: Sequence[SessionCursor],
    q: TensorLike,
    k: TensorLike,
    v: TensorLike,
    a: TensorLike,
    b: TensorLike,
    *,
    single: bool,
    speculative: bool = False,
    regions: Sequence[Region] = (),
    out: torch.Tensor | None = None,
) -> PreparedStep:
    """Validates the inputs, reserves positions and builds the DecodeRequest (inputs and `out`
    in one of `regions` by reference)."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    if not cursors:
        raise ValueError("a decode step needs at least one session")
    if single and len(cursors) != 1:
        raise ValueError("per-session shapes need exactly one session")
    tensors = batch_inputs(q, k, v, a, b, batch=None if single else len(cursors), regions=regions)
    tokens = int(tensors[0].shape[1])
    if len({c.session_id for c in cursors}) != len(cursors):
        raise ValueError("a batched step needs distinct sessions")
    output = None
    if out is not None:
        output = out.unsqueeze(0) if single and out.dim() == 3 else out
        want = (len(cursors), tokens)
        if output.dim() != 4 or tuple(output.shape[:2]) != want or output.dtype != torch.bfloat16:
            raise ValueError(f"out must be bfloat16 [{want[0]}, {want[1]}, HV, V], got {out.dtype} {list(out.shape)}")
    request, used = encode_request(layer, [c.session_id for c in cursors], (), tensors, regions, output)
    ordered = sorted(cursors, key=id)  # one lock order, so concurrent batches cannot deadlock
    reserved: list[tuple[SessionCursor, int]] = []
    for cur in ordered:
        cur._lock.acquire()
    try:
        for cur in cursors:  # reserve all or none
            reserved.append((cur, cur._reserve(layer, tokens)))
    except BaseException:
        for cur, pos in reserved:
            cur._next[layer] = pos
        raise
    finally:
        for cur in ordered:
            cur._lock.release()
    positions = tuple(pos for _, pos in reserved)
    request.positions[:] = positions
    request.speculative = speculative
    return PreparedStep(request, tuple(cursors), layer, tokens, positions, single, used, output)
