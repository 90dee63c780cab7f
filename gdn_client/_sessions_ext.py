"""Client side of ForkSession / ExportState / ImportState: the exported-state value and its codec.

`ExportedState` is what `Session.export()` returns and `Client.import_state()` takes: one session's
state [L, HV, V, K] (of the exporting server's --state-dtype, bf16 or fp32) as raw bytes plus its per-layer positions, checked against the header's
sha256 when it is assembled. It round-trips through the StateChunk stream of the server
(`from_chunks` / `chunks`) and through a single bytes blob (`to_bytes` / `from_bytes`) for callers
who keep it on disk or send it elsewhere. Shared by the sync and async clients: no I/O here.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from gdn_client.proto.gdn.v1 import gdn_pb2

MAX_CHUNK_BYTES = 1 << 20  # the server refuses larger chunks
_MAGIC = b"GDNSTATE"  # to_bytes: magic, u32 header length, StateHeader bytes, state bytes


@dataclass(frozen=True)
class ExportedState:
    header: gdn_pb2.StateHeader
    data: bytes  # the header's dtype (bfloat16 or float32) [L, HV, V, K], little-endian

    @property
    def positions(self) -> dict[int, int]:
        """Tokens taken per layer (layers with none left out), as `Session.positions` reports them."""
        return {layer: int(p) for layer, p in enumerate(self.header.positions) if p}

    @property
    def shape(self) -> tuple[int, int, int, int]:
        h = self.header
        return (h.num_layers, h.num_v_heads, h.head_dim_v, h.head_dim_k)

    def state(self) -> torch.Tensor:
        """The state as a tensor [L, HV, V, K] of the header's dtype (a copy)."""
        return torch.frombuffer(bytearray(self.data), dtype=getattr(torch, self.header.dtype)).reshape(self.shape)

    def converting(self) -> "ExportedState":
        """This state, asking the importing server to convert it to its own --state-dtype where the
        two differ (bf16 -> fp32 is exact, fp32 -> bf16 rounds once); without it such an import is
        refused with INVALID_ARGUMENT.

        >>> moved = fp32_server.import_state(bf16_session.export().converting())  # doctest: +SKIP
        """
        header = gdn_pb2.StateHeader()
        header.CopyFrom(self.header)
        header.convert_dtype = True
        return ExportedState(header, self.data)

    # -- the gRPC stream ----------------------------------------------------------------------------

    @classmethod
    def from_chunks(cls, chunks: Iterable[gdn_pb2.StateChunk]) -> "ExportedState":
        """Assembles an ExportState reply; ValueError if it is malformed or fails its checksum."""
        header, parts = None, []
        for chunk in chunks:
            if chunk.HasField("header"):
                if header is not None:
                    raise ValueError("state stream has two headers")
                header = chunk.header
            elif header is None:
                raise ValueError("state stream does not start with a header")
            if chunk.data:
                parts.append(chunk.data)
        if header is None:
            raise ValueError("state stream is empty")
        return cls._checked(header, b"".join(parts))

    def chunks(self, chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[gdn_pb2.StateChunk]:
        """The ImportState request stream: the header, then the bytes in chunks of at most 1 MiB."""
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}")
        yield gdn_pb2.StateChunk(header=self.header)
        view = memoryview(self.data)
        for start in range(0, len(view), chunk_bytes):
            yield gdn_pb2.StateChunk(data=bytes(view[start : start + chunk_bytes]))

    # -- one blob -----------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        head = self.header.SerializeToString()
        return _MAGIC + struct.pack("<I", len(head)) + head + self.data

    @classmethod
    def from_bytes(cls, blob: bytes) -> "ExportedState":
        if blob[: len(_MAGIC)] != _MAGIC or len(blob) < len(_MAGIC) + 4:
            raise ValueError("not an exported gdn-serve state")
        (n,) = struct.unpack_from("<I", blob, len(_MAGIC))
        start = len(_MAGIC) + 4
        header = gdn_pb2.StateHeader.FromString(blob[start : start + n])
        return cls._checked(header, bytes(blob[start + n :]))

    @classmethod
    def _checked(cls, header: gdn_pb2.StateHeader, data: bytes) -> "ExportedState":
        if len(data) != header.total_bytes:
            raise ValueError(f"state has {len(data)} bytes, its header announces {header.total_bytes}")
        if hashlib.sha256(data).hexdigest() != header.checksum:
            raise ValueError("state bytes fail their sha256 checksum")
        return cls(header, data)
