"""Message types that flow through the server: validated requests, backend batches, results."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a front-end worker imports this module and needs no torch for bf16 requests
    import torch


INPUT_NAMES = ("q", "k", "v", "a", "b")


class _Input:
    """A DecodeWork input (q, k, v, a or b), built from the request's raw bf16 bytes on first use.

    validation.py passes the tensors it made; the engine's front-end link passes only the bytes
    (`bf16_bytes` and `input_dims`), since on a GPU the bytes are all a step needs: the tensors
    cost ~7 us a request to build and are wanted only by the CPU backend, speculative steps and
    requests that did not come as bf16. A non-data descriptor: once built (or given), the tensor
    sits in the instance's __dict__ and is read like any attribute.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._index = INPUT_NAMES.index(name)

    def __get__(self, work: "DecodeWork | None", owner: type | None = None) -> torch.Tensor | None:
        if work is None:
            return None  # the dataclass field's default
        import torch  # loaded by then wherever tensors are wanted (the backends import it)

        raw, dtype, dims = work.bf16_bytes, torch.bfloat16, work.input_dims
        if raw is None:
            raw, dtype = work.f32_bytes, torch.float32
        if raw is None or dims is None:
            raise AttributeError(f"DecodeWork has neither {self._name} nor raw bytes with input_dims to build it from")
        tensor = torch.frombuffer(raw[self._index], dtype=dtype).view(dims[self._index])
        work.__dict__[self._name] = tensor  # frozen: set the cache directly, as functools.cached_property does
        return tensor


@dataclass(frozen=True)
class DecodeWork:
    """One validated DecodeRequest: B distinct sessions, one layer, T tokens each."""

    layer: int
    session_ids: tuple[str, ...]
    # [B, T, ...] in the wire dtype, CPU, read-only views of the request bytes; given (validation.py),
    # or None with `bf16_bytes` and `input_dims`, and then built from the bytes when first read
    q: torch.Tensor = _Input()  # [B, T, H, K]
    k: torch.Tensor = _Input()  # [B, T, H, K]
    v: torch.Tensor = _Input()  # [B, T, HV, V]
    a: torch.Tensor = _Input()  # [B, T, HV]
    b: torch.Tensor = _Input()  # [B, T, HV]
    positions: tuple[int, ...] | None = None  # tokens each session has taken at `layer`, when given
    request_id: str = ""
    owner: str | None = None  # the caller's identity where auth is on; must own every session
    speculative: bool = False  # a draft step: provisional until Commit or the next step at the layer
    # q, k, v, a, b as the request's raw bf16 bytes (bytes, or read-only memoryviews of the
    # received message), when all five came as BF16: a GPU backend copies them into its pinned
    # staging buffer with plain memcpys
    bf16_bytes: tuple[bytes | memoryview, ...] | None = None
    # q, k, v, a, b widened to float32 bytes, for requests not all in BF16 that a front-end
    # worker checked: the engine takes them so (link.FLAG_F32), and the worker needs no torch
    f32_bytes: tuple[bytes, ...] | None = None
    # shapes of q, k, v, a, b; needed only when the tensors are not given (built from the bytes)
    input_dims: tuple[tuple[int, ...], ...] | None = None
    # False: validation left the NaN/Inf check of the inputs to the backend, which does it before
    # the step touches any state (big bf16 requests: gdn_server.validation.DEFERRED_CHECK_BYTES)
    finite_checked: bool = True

    def __post_init__(self) -> None:
        d = self.__dict__
        if d["q"] is None:  # not given: the descriptor builds each from the bytes when first read
            if (self.bf16_bytes is None and self.f32_bytes is None) or self.input_dims is None:
                raise TypeError("DecodeWork needs q, k, v, a, b, or bf16_bytes or f32_bytes and input_dims")
            for name in INPUT_NAMES:
                del d[name]
            d["_tokens"] = self.input_dims[0][1]
        else:
            d["_tokens"] = int(d["q"].shape[1])

    @classmethod
    def of_bf16(
        cls, layer: int, session_ids: tuple[str, ...], positions: tuple[int, ...] | None, request_id: str,
        speculative: bool, bf16_bytes: tuple, input_dims: tuple[tuple[int, ...], ...], finite_checked: bool,
        owner: str | None = None,
    ) -> DecodeWork:
        """`DecodeWork(..., bf16_bytes=, input_dims=)` for already checked arguments, at a quarter of
        the cost: a frozen dataclass's __init__ sets each field through object.__setattr__ and then
        runs __post_init__ (~3 us of a ~7 us native validation of a request, on the event loop; ~6.7 us
        of the engine's ~13 us decode of a link frame, CPU box)."""
        work = object.__new__(cls)
        work.__dict__.update(
            layer=layer, session_ids=session_ids, positions=positions, request_id=request_id, owner=owner,
            speculative=speculative, bf16_bytes=bf16_bytes, f32_bytes=None, input_dims=input_dims,
            finite_checked=finite_checked, _tokens=input_dims[0][1],
        )
        return work

    @property
    def rows(self) -> int:
        return len(self.session_ids)

    @property
    def tokens(self) -> int:
        return self._tokens


class DecodeResult:
    """The answer to one DecodeWork: bf16 o [B, T, HV, V] as raw little-endian bytes (or a
    read-only view of them). A plain slotted class, not a frozen dataclass: one is made per
    answered request, and a frozen dataclass's __init__ costs several times more. Not changed
    once made."""

    __slots__ = ("out", "shape", "positions", "request_id", "wire")

    def __init__(
        self, out: bytes | memoryview, shape: tuple[int, ...], positions: tuple[int, ...], request_id: str = "",
        wire: bytes | None = None,
    ) -> None:
        self.out = out
        self.shape = shape
        self.positions = positions
        self.request_id = request_id
        # the whole DecodeResponse in its wire form, where the scheduler encoded it
        # (Scheduler.encode_reply); `out` is then a view into it
        self.wire = wire

    def __repr__(self) -> str:
        return (f"DecodeResult(out=<{len(self.out)} bytes>, shape={self.shape}, positions={self.positions}, "
                f"request_id={self.request_id!r})")


@dataclass
class StepBatch:
    """Rows of one backend call: all rows share T; each row is (pool slot, layer) and appears once.

    Inputs stay in the requests they arrived in (`works`); the backend copies them into its own
    staging buffer (bf16 bytes with memcpys, or one concatenation per input), so the scheduler does
    no per-row copy and builds no tensor.
    """

    tokens: int  # T
    slots: list[int] = field(default_factory=list)  # pool slot each row reads its state from
    out_slots: list[int] = field(default_factory=list)  # pool slot each row writes its new state to
    layers: list[int] = field(default_factory=list)  # layer per row
    works: list[DecodeWork] = field(default_factory=list)  # the requests, in row order
    # the front-end link's plain one-row steps as C records (gdn_server._native.LaneRun), or None:
    # their rows come after the works' once the scheduler seals the batch (LaneRun.seal), and
    # staging copies their inputs straight from the link's request ring (LaneRun.fill)
    lane: Any = None

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def in_place(self) -> bool:
        """Every row writes back to the slot it read (no speculative rows)."""
        return self.slots == self.out_slots

    def inputs(self, name: str) -> list[torch.Tensor]:
        """Each request's tensor `name` (q, k, v, a or b; [B_r, T, ...]), for backends that
        compute on the host (built from a bf16 request's bytes on first read)."""
        return [getattr(w, name) for w in self._host_works]

    @cached_property
    def _host_works(self) -> list[DecodeWork]:
        """The works, then the lane's rows as DecodeWorks: made once per batch, not for each of
        the five inputs (a backend asks once the batch is sealed, so it does not change after)."""
        return self.works if self.lane is None else self.works + self.lane.works(DecodeWork)

    def add(self, work: DecodeWork, slots: list[int], out_slots: list[int] | None = None) -> None:
        self.slots.extend(slots)
        self.out_slots.extend(slots if out_slots is None else out_slots)
        self.layers.extend([work.layer] * len(slots))
        self.works.append(work)
