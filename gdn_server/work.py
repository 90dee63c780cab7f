"""Message types that flow through the server: validated requests, backend batches, results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gdn_server._wire import encode_reply, reply_o_data

INPUT_NAMES = ("q", "k", "v", "a", "b")


class DeviceSpan:
    """Bytes of GPU memory that a request names (a tensor or o_ref in a client's CUDA region), by
    address: what the check and the launch need, since both kernels read tables of addresses.
    Not a tensor view: a view costs a few torch calls per reference on the event loop, where a
    request through CUDA memory has six references. `memory` (the region's uint8 tensor, or a
    tensor made for the request) keeps that memory mapped while a request holds the span."""

    __slots__ = ("memory", "offset", "nbytes", "address", "device")

    def __init__(self, memory: torch.Tensor, offset: int, nbytes: int, address: int, device: int) -> None:
        self.memory = memory
        self.offset = offset  # in `memory`
        self.nbytes = nbytes
        self.address = address  # of the first byte
        self.device = device  # CUDA device index

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "DeviceSpan":
        """The span of a whole contiguous CUDA tensor."""
        return cls(tensor, 0, tensor.numel() * tensor.element_size(), tensor.data_ptr(), tensor.device.index)

    def tensor(self) -> torch.Tensor:
        """The bytes as a uint8 tensor (on a GPU, or on the host for page-locked memory), for the
        copies torch makes (to or from another device, a cast, a retry's o)."""
        return self.memory.view(torch.uint8).reshape(-1)[self.offset:self.offset + self.nbytes]


class _Input:
    """A DecodeWork input (q, k, v, a or b), built from the request's raw bf16 bytes on first use.

    On a GPU the bytes are all a bf16 step needs, a speculative one too (they are copied into the
    staging buffer as they are); the tensors cost microseconds a request to build and are wanted
    only by the CPU backend. A non-data descriptor: once built (or given), the tensor sits in the
    instance's __dict__ and is read like any attribute.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self._index = INPUT_NAMES.index(name)

    def __get__(self, work: "DecodeWork | None", owner: type | None = None) -> torch.Tensor | None:
        if work is None:
            return None  # read on the class
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


class DecodeWork:
    """One validated DecodeRequest: B distinct sessions, one layer, T tokens each. Not changed once
    made. A plain class, not a frozen dataclass: one is made per request on the event loop, and a
    frozen dataclass's __init__ sets each of its fields through object.__setattr__."""

    q = _Input()  # [B, T, H, K], in the wire dtype: given (f16/f32 requests) or built from bf16_bytes
    k = _Input()  # [B, T, H, K]
    v = _Input()  # [B, T, HV, V]
    a = _Input()  # [B, T, HV]
    b = _Input()  # [B, T, HV]

    def __init__(
        self, layer: int, session_ids: tuple[str, ...], q: Any = None, k: Any = None, v: Any = None, a: Any = None,
        b: Any = None,
        positions: tuple[int, ...] | None = None, request_id: str = "", owner: str | None = None,
        owner_key: str | None = None, speculative: bool = False,
        bf16_bytes: tuple[bytes | memoryview, ...] | None = None,
        input_dims: tuple[tuple[int, ...], ...] | None = None,
        digests: tuple[int, ...] = (), output: "memoryview | torch.Tensor | DeviceSpan | None" = None,
    ) -> None:
        d = self.__dict__
        d.update(
            layer=layer, session_ids=session_ids,
            positions=positions,  # tokens each session has taken at `layer`, when given
            request_id=request_id,
            owner=owner,  # the caller's identity where auth is on; must own every session
            # whose quotas the caller draws on: the owner, or without auth the peer
            owner_key=owner_key,
            speculative=speculative,  # a draft step: provisional until Commit or the next step at the layer
            # q, k, v, a, b as the request's raw bf16 bytes, when all five came as BF16: a GPU
            # backend copies them into its pinned staging buffer as they are
            bf16_bytes=bf16_bytes,
            input_dims=input_dims,  # their shapes, to build the tensors from the bytes
            # each session's inputs as sent, digested (validation.checked_digests): a retry must match
            digests=digests,
            # where the reply's o goes: a view of a shared-memory region the client named (o_ref),
            # which the servicer fills when it answers; None: o travels in the reply
            output=output,
        )
        if q is None:
            if bf16_bytes is None or input_dims is None:
                raise TypeError("DecodeWork needs q, k, v, a, b, or bf16_bytes and input_dims")
            d["_tokens"] = input_dims[0][1]
        else:  # tensors, or DeviceSpans of bf16 in GPU memory (their shapes in input_dims)
            d.update(q=q, k=k, v=v, a=a, b=b, _tokens=input_dims[0][1] if input_dims is not None else int(q.shape[1]))

    @property
    def nbytes(self) -> int:
        """The inputs' bytes, as they came."""
        if self.bf16_bytes is not None:
            return sum(map(len, self.bf16_bytes))
        return sum(getattr(self, name).nbytes for name in INPUT_NAMES)

    @property
    def rows(self) -> int:
        return len(self.session_ids)

    @property
    def tokens(self) -> int:
        return self._tokens


class DecodeResult:
    """The answer to one DecodeWork: its DecodeResponse as sent where o travels in it (`reply`,
    encoded by gdn_server._wire from the bf16 o [B, T, HV, V] given as raw little-endian bytes),
    and o's bytes inside it (`out`, a read-only view of `reply`: what a retry is answered from and
    an o_ref's region gets). The output is copied once, from the buffer it is given (a backend's,
    reused later) into the reply; nothing else copies it. A step whose launch wrote o where the
    request asked (a DeviceSpan o_ref) is answered by `written` instead, with no copy. A plain slotted
    class, not a frozen dataclass: one is made per answered request, and a frozen dataclass's
    __init__ costs several times more. Not changed once made."""

    __slots__ = ("reply", "out", "shape", "positions", "request_id", "replayed")

    def __init__(self, out: bytes | memoryview, shape: tuple[int, ...], positions: tuple[int, ...],
                 request_id: str = "", replayed: bool = False) -> None:
        self.reply = encode_reply(out, shape, positions, request_id)
        self.out = reply_o_data(self.reply)
        self.shape = shape
        self.positions = positions
        self.request_id = request_id
        # answered from a kept output, not by a launch: an o_ref a launch writes itself (a
        # DeviceSpan: gdn_server/backends/cuda.py) is written from `out` instead
        self.replayed = replayed

    @classmethod
    def written(cls, out: memoryview, shape: tuple[int, ...], positions: tuple[int, ...],
                request_id: str = "") -> "DecodeResult":
        """The answer to a step whose launch wrote o into the request's o_ref: `out` the copy of o
        the launch kept apart (for retries), and no `reply` (None): an answer into an o_ref is
        encoded by the servicer, with o's dtype and shape only (servicer.decode_response)."""
        result = cls.__new__(cls)
        result.reply = None
        result.out, result.shape, result.positions, result.request_id = out, shape, positions, request_id
        result.replayed = False
        return result

    def __repr__(self) -> str:
        return (f"DecodeResult(out=<{len(self.out)} bytes>, shape={self.shape}, positions={self.positions}, "
                f"request_id={self.request_id!r})")


@dataclass
class StepBatch:
    """Rows of one backend call: all rows share T; each row is one (session, layer) state, a pool
    row the launch reads and writes, and appears once.

    `hist` is each row's committed ring entries P at launch time (gdn_server.sessions: the ring).
    A plain batch folds the rows with P > 0 into their states first, then writes the states; a
    verify batch (`verify`) reads the states and writes only ring entries [base, base + T),
    base = folded_base(P, T) (a row whose P + T entries would overflow its ring folds first). Its
    rows are drafts, or plain steps the planner runs through the ring (`Planner._through_ring`);
    the session table, not the backend, tells them apart.

    Inputs stay in the requests they arrived in (`works`); the backend copies them into its own
    staging buffer (bf16 bytes with memcpys, or one concatenation per input), so the scheduler does
    no per-row copy and builds no tensor.
    """

    tokens: int  # T
    rows: list[int] = field(default_factory=list)  # pool row of each row, read and written
    layers: list[int] = field(default_factory=list)  # layer per row
    works: list[DecodeWork] = field(default_factory=list)  # the requests, in row order
    hist: list[int] = field(default_factory=list)  # committed ring entries P per row, at launch
    verify: bool = False  # a verify batch: every row appends ring entries, no state is written

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def inputs(self, name: str) -> list[torch.Tensor]:
        """Each request's tensor `name` (q, k, v, a or b; [B_r, T, ...]), for backends that
        compute on the host (built from a bf16 request's bytes on first read)."""
        return [getattr(w, name) for w in self.works]

    def add(self, work: DecodeWork, rows: list[int], hist: list[int]) -> None:
        self.rows.extend(rows)
        self.hist.extend(hist)
        self.layers.extend([work.layer] * len(rows))
        self.works.append(work)
