"""Message types that flow through the server: validated requests, backend batches, results."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DecodeWork:
    """One validated DecodeRequest: B distinct sessions, one layer, T tokens each."""

    layer: int
    session_ids: tuple[str, ...]
    q: torch.Tensor  # [B, T, H, K]   wire dtype, CPU, read-only view of the request bytes
    k: torch.Tensor  # [B, T, H, K]
    v: torch.Tensor  # [B, T, HV, V]
    a: torch.Tensor  # [B, T, HV]
    b: torch.Tensor  # [B, T, HV]
    positions: tuple[int, ...] | None  # tokens each session has taken at `layer`, when given
    request_id: str = ""
    owner: str | None = None  # the caller's identity where auth is on; must own every session
    speculative: bool = False  # a draft step: provisional until Commit or the next step at the layer
    # q, k, v, a, b as the request's raw bf16 bytes, when all five came as BF16: a GPU backend
    # copies them into its pinned staging buffer with plain memcpys
    bf16_bytes: tuple[bytes, bytes, bytes, bytes, bytes] | None = None

    @property
    def rows(self) -> int:
        return len(self.session_ids)

    @property
    def tokens(self) -> int:
        return int(self.q.shape[1])


@dataclass(frozen=True)
class DecodeResult:
    """The answer to one DecodeWork: bf16 o [B, T, HV, V] as raw little-endian bytes."""

    out: bytes
    shape: tuple[int, ...]
    positions: tuple[int, ...]
    request_id: str = ""


@dataclass
class StepBatch:
    """Rows of one backend call: all rows share T; each row is (pool slot, layer) and appears once.

    Inputs are kept as the per-request tensors they arrived in; the backend copies each list into
    its own staging buffer with one concatenation per input, so the scheduler does no per-row copy.
    """

    tokens: int  # T
    slots: list[int] = field(default_factory=list)  # pool slot each row reads its state from
    out_slots: list[int] = field(default_factory=list)  # pool slot each row writes its new state to
    layers: list[int] = field(default_factory=list)  # layer per row
    q: list[torch.Tensor] = field(default_factory=list)  # each [B_r, T, H, K]
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)  # each [B_r, T, HV, V]
    a: list[torch.Tensor] = field(default_factory=list)  # each [B_r, T, HV]
    b: list[torch.Tensor] = field(default_factory=list)
    bf16_bytes: list[tuple[bytes, ...] | None] = field(default_factory=list)  # per request, see DecodeWork

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def in_place(self) -> bool:
        """Every row writes back to the slot it read (no speculative rows)."""
        return self.slots == self.out_slots

    def add(self, work: DecodeWork, slots: list[int], out_slots: list[int] | None = None) -> None:
        self.slots.extend(slots)
        self.out_slots.extend(slots if out_slots is None else out_slots)
        self.layers.extend([work.layer] * len(slots))
        self.q.append(work.q)
        self.k.append(work.k)
        self.v.append(work.v)
        self.a.append(work.a)
        self.b.append(work.b)
        self.bf16_bytes.append(work.bf16_bytes)
