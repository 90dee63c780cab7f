"""Request building and response parsing shared by the sync and async clients.

Nothing here does I/O. A decode call is prepared into a `PreparedStep` (the DecodeRequest plus the
position bookkeeping of the sessions it covers), sent by whichever transport, and then either
`complete`d with the reply or `fail`ed with the error; both clients and both stream helpers go
through the same three calls, so the position rules live in one place:

- positions are reserved when a step is prepared (so pipelined steps of one session get
  consecutive positions) and always sent, which makes resending a step safe;
- a step the server refused rolls the reservation back;
- a step whose fate is unknown after the last retry leaves the layer "in doubt": further steps
  on that layer are refused until `recover()` resends the very same request.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TypeVar

import torch
from google.protobuf.internal import api_implementation

from gdn_client._errors import FailedPreconditionError, GdnError, NotFoundError
from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.wire import WireFormatError, as_torch, tensor_from_proto, tensor_to_proto

__all__ = ["ModelInfo", "Stats", "SessionCursor", "PreparedStep", "prepare_step", "batch_inputs"]

logger = logging.getLogger("gdn_client")

# upb (the default protobuf runtime) hands out a new bytes object per access of a bytes field, so
# the tensor decoded from a reply's `o.data` is the only holder of that memory and can be returned
# without copying it (a 2 MiB copy per B=256 reply). bytes are immutable to Python code, but one
# that nothing else references cannot be observed changing; torch keeps it alive as the storage.
# The pure-Python runtime returns the bytes the message keeps: there the output is copied.
_FRESH_BYTES = api_implementation.Type() == "upb"

TensorLike = Any  # torch.Tensor or numpy.ndarray (float16/float32; torch also bfloat16)


@dataclass(frozen=True)
class ModelInfo:
    """The served model's shape (mirrors ``gdn.v1.ModelInfo``)."""

    num_layers: int
    num_q_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    max_tokens_per_step: int
    max_sessions: int
    sessions_in_use: int
    backend: str
    state_dtype: str
    scale: float
    max_speculative_tokens: int = 0
    devices: tuple["DeviceInfo", ...] = ()  # capacity per device (one per GPU; one for the CPU)
    # several server processes on one host (gdn-server --processes): every process's port, in
    # process order, and the target's place among them; () and 0 for a server of one process
    process_ports: tuple[int, ...] = ()
    process_index: int = 0


@dataclass(frozen=True)
class DeviceInfo:
    """One device of the server (mirrors ``gdn.v1.DeviceInfo``)."""

    index: int
    name: str
    max_sessions: int
    sessions_in_use: int


@dataclass(frozen=True)
class Stats:
    """Server counters (mirrors ``gdn.v1.Stats``); take deltas between two snapshots."""

    launches: int
    rows_launched: int
    requests: int
    batches: int
    mean_rows_per_launch: float
    sessions_in_use: int
    max_sessions: int
    backend: str
    device_seconds: float = 0.0  # summed submit-to-result time of backend calls
    queue_wait_seconds: float = 0.0  # summed time requests waited before their launch

    def since(self, before: "Stats") -> "Stats":
        """The counters accumulated between ``before`` and this snapshot."""
        launches = self.launches - before.launches
        rows = self.rows_launched - before.rows_launched
        return dataclasses.replace(
            self,
            launches=launches,
            rows_launched=rows,
            requests=self.requests - before.requests,
            batches=self.batches - before.batches,
            mean_rows_per_launch=rows / launches if launches else 0.0,
            device_seconds=self.device_seconds - before.device_seconds,
            queue_wait_seconds=self.queue_wait_seconds - before.queue_wait_seconds,
        )


_T = TypeVar("_T")


def _from_proto(cls: type[_T], msg: Any) -> _T:
    return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def model_info_from_proto(msg: gdn_pb2.ModelInfo, *others: gdn_pb2.ModelInfo) -> ModelInfo:
    """`msg` as a `ModelInfo`; with the ModelInfo of the host's other server processes
    (`others`), the sessions and capacity are those of the whole host: summed over the processes,
    per device too (the processes of one device share it)."""
    repeated = ("devices", "process_ports")
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(ModelInfo) if f.name not in repeated}
    devices: dict[tuple[int, str], DeviceInfo] = {}
    for info in (msg, *others):
        for d in info.devices:
            seen = devices.get((d.index, d.name))
            devices[(d.index, d.name)] = _from_proto(DeviceInfo, d) if seen is None else dataclasses.replace(
                seen, max_sessions=seen.max_sessions + d.max_sessions,
                sessions_in_use=seen.sessions_in_use + d.sessions_in_use,
            )
    fields["max_sessions"] = sum(info.max_sessions for info in (msg, *others))
    fields["sessions_in_use"] = sum(info.sessions_in_use for info in (msg, *others))
    return ModelInfo(**fields, devices=tuple(devices.values()), process_ports=tuple(msg.process_ports))


def stats_from_proto(msg: gdn_pb2.Stats) -> Stats:
    return _from_proto(Stats, msg)


# -- tensors --------------------------------------------------------------------------------------

_RANKS = {"q": 4, "k": 4, "v": 4, "a": 3, "b": 3}  # batched ranks: [B, T, ...]


def batch_inputs(
    q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike, b: TensorLike, *, batch: int | None
) -> tuple[torch.Tensor, ...]:
    """Returns q, k, v, a, b as CPU torch tensors of the batched form [B, T, ...].

    ``batch=None`` means one session: [T, H, K] (or [1, T, H, K]) and so on. Otherwise the leading
    dimension must equal ``batch``. Only ranks and B are checked here; the server checks the rest.
    """
    out = []
    for name, x in zip("qkvab", (q, k, v, a, b)):
        t = as_torch(x)
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
    layer: int, session_ids: Sequence[str], positions: Sequence[int], tensors: Iterable[torch.Tensor]
) -> gdn_pb2.DecodeRequest:
    req = gdn_pb2.DecodeRequest(layer=layer, session_ids=list(session_ids), positions=list(positions))
    for name, t in zip("qkvab", tensors):
        tensor_to_proto(t, getattr(req, name))
    return req


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

    def complete(self, response: gdn_pb2.DecodeResponse) -> torch.Tensor:
        """Parses a successful reply and advances the sessions; returns bf16 o."""
        try:
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
        if not _FRESH_BYTES:
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
) -> PreparedStep:
    """Validates the inputs, reserves positions and builds the DecodeRequest."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    if not cursors:
        raise ValueError("a decode step needs at least one session")
    if single and len(cursors) != 1:
        raise ValueError("per-session shapes need exactly one session")
    tensors = batch_inputs(q, k, v, a, b, batch=None if single else len(cursors))
    tokens = int(tensors[0].shape[1])
    if len({c.session_id for c in cursors}) != len(cursors):
        raise ValueError("a batched step needs distinct sessions")
    request = encode_request(layer, [c.session_id for c in cursors], (), tensors)
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
    return PreparedStep(request, tuple(cursors), layer, tokens, positions, single)
