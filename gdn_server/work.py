"""Message types that flow through the server: validated requests, backend batches, results."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


INPUT_NAMES = ("q", "k", "v", "a", "b")


class _Input:
    """A DecodeWork input (q, k, v, a or b), built from the request's raw bf16 bytes on first use.

    On a GPU the bytes are all a bf16 step needs (they are copied into the staging buffer as they
    are); the tensors cost microseconds a request to build and are wanted only by the CPU backend
    and speculative steps. A non-data descriptor: once built (or given), the tensor sits in the
    instance's __dict__ and is read like any attribute.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._index = INPUT_NAMES.index(name)

    def __get__(self, work: "DecodeWork | None", owner: type | None = None) -> torch.Tensor | None:
        if work is None:
            return None  # the dataclass field's default
        raw, dims = work.bf16_bytes, work.input_dims
        if raw is None or dims is None:
            raise AttributeError(f"DecodeWork has neither {self._name} nor raw bytes with input_dims to build it from")
        data = raw[self._index]
        if not len(data):  # torch.frombuffer refuses an empty buffer
            tensor = torch.empty(dims[self._index], dtype=torch.bfloat16)
        else:
            tensor = torch.frombuffer(data, dtype=torch.bfloat16).view(dims[self._index])
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
    # whose share of speculative scratch rows the step draws on: the owner, or without auth the peer
    owner_key: str | None = None
    speculative: bool = False  # a draft step: provisional until Commit or the next step at the layer
    # q, k, v, a, b as the request's raw bf16 bytes (bytes, or read-only memoryviews of the
    # received message), when all five came as BF16: a GPU backend copies them into its pinned
    # staging buffer with plain memcpys
    bf16_bytes: tuple[bytes | memoryview, ...] | None = None
    # shapes of q, k, v, a, b; needed only when the tensors are not given (built from the bytes)
    input_dims: tuple[tuple[int, ...], ...] | None = None
    # False: validation left the NaN/Inf check of the inputs to the backend, which does it before
    # the step touches any state (big bf16 requests: gdn_server.validation.DEFERRED_CHECK_BYTES)
    finite_checked: bool = True
    # each session's inputs as sent, digested (gdn_server.validation.row_digests): a retry must match
    digests: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        d = self.__dict__
        if d["q"] is None:  # not given: the descriptor builds each from the bytes when first read
            if self.bf16_bytes is None or self.input_dims is None:
                raise TypeError("DecodeWork needs q, k, v, a, b, or bf16_bytes and input_dims")
            for name in INPUT_NAMES:
                del d[name]
            d["_tokens"] = self.input_dims[0][1]
        else:
            d["_tokens"] = int(d["q"].shape[1])

    @property
    def rows(self) -> int:
        return len(self.session_ids)

    @property
    def tokens(self) -> int:
        return self._tokens


class DecodeResult:
    """The answer to one DecodeWork: bf16 o [B, T, HV, V] as raw little-endian bytes. A plain
    slotted class, not a frozen dataclass: one is made per answered request, and a frozen
    dataclass's __init__ costs several times more. Not changed once made."""

    __slots__ = ("out", "shape", "positions", "request_id")

    def __init__(self, out: bytes, shape: tuple[int, ...], positions: tuple[int, ...], request_id: str = "") -> None:
        self.out = out
        self.shape = shape
        self.positions = positions
        self.request_id = request_id

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
        return [getattr(w, name) for w in self.works]

    def add(self, work: DecodeWork, slots: list[int], out_slots: list[int] | None = None) -> None:
        self.slots.extend(slots)
        self.out_slots.extend(slots if out_slots is None else out_slots)
        self.layers.extend([work.layer] * len(slots))
        self.works.append(work)
