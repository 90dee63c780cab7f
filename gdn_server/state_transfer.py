"""The ExportState / ImportState stream: one session's state as a sequence of `StateChunk`s.

Stream format (what `encode_state` yields and `StateAssembler` accepts):

    chunk 0     header only: StateHeader {num_layers L, num_v_heads HV, head_dim_k K, head_dim_v V,
                dtype "bfloat16" or "float32" (E = 2 or 4 bytes), positions [L] (tokens taken per
                layer), total_bytes = E*L*HV*V*K, checksum = sha256 hex of the state bytes}; data empty
    chunk 1..n  data only: the state bytes in order, at most `MAX_CHUNK_BYTES` (1 MiB) each

The state bytes are the tensor [L, HV, V, K] (K fastest) of the header's dtype, row-major,
little-endian: exactly what `Backend.read_session` returns and `Backend.write_session` takes. The
receiver refuses (InvalidArgument) a stream whose header is missing, repeated or does not match its
model shape, whose dtype is not the server's state dtype (unless the header's `convert_dtype` asks
for the conversion: then the state is converted to the server's dtype, on purpose, never
otherwise), a position of 2^63 or more, a chunk over 1 MiB, more or fewer bytes than announced,
bytes whose sha256 differs from the header's, or a state holding NaN or Inf (after a conversion:
an fp32 value beyond bf16's range would become Inf); nothing is created unless the whole stream
checks out. Memory is bounded: the receiver allocates the announced size only after checking it
equals the size of its model's state in the header's dtype.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import torch

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.config import STATE_DTYPE_BYTES, ModelShape
from gdn_server.errors import InvalidArgument
from gdn_server.limits import MAX_CHUNK_BYTES
from gdn_server.validation import MAX_POSITION

@dataclass(frozen=True)
class SessionState:
    """One session's recurrent state and positions, detached from any pool."""

    state: torch.Tensor  # [L, HV, V, K] bf16 or fp32 (its pool's dtype), CPU, contiguous
    positions: tuple[int, ...]  # tokens taken per layer


def dtype_name(dtype: torch.dtype) -> str:
    """The name a StateHeader, ModelInfo and --state-dtype give `dtype`: bfloat16 or float32."""
    return str(dtype).removeprefix("torch.")


def state_bytes(state: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a state tensor, without copying."""
    return memoryview(state.contiguous().view(torch.uint8).numpy()).cast("B")


def state_from_bytes(data: bytes | bytearray, shape: ModelShape, dtype: str | None = None) -> torch.Tensor:
    """[L, HV, V, K] of `dtype` (default: the shape's state dtype) from raw bytes (a bytearray is
    used in place, bytes are copied)."""
    L, HV, V, K = shape.num_layers, shape.num_v_heads, shape.head_dim_v, shape.head_dim_k
    buf = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buf, dtype=getattr(torch, dtype or shape.state_dtype)).reshape(L, HV, V, K)


def encode_state(session: SessionState, chunk_bytes: int = MAX_CHUNK_BYTES) -> Iterator[gdn_pb2.StateChunk]:
    """Yields the header chunk, then the state bytes in chunks of at most `chunk_bytes`."""
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
    L, HV, V, K = session.state.shape
    data = state_bytes(session.state)
    header = gdn_pb2.StateHeader(
        num_layers=L,
        num_v_heads=HV,
        head_dim_k=K,
        head_dim_v=V,
        dtype=dtype_name(session.state.dtype),
        positions=list(session.positions),
        total_bytes=len(data),
        checksum=hashlib.sha256(data).hexdigest(),
    )
    yield gdn_pb2.StateChunk(header=header)
    for start in range(0, len(data), chunk_bytes):
        yield gdn_pb2.StateChunk(data=bytes(data[start : start + chunk_bytes]))


class StateAssembler:
    """Checks and collects an incoming chunk stream; `finish()` returns the SessionState.

    Every method raises InvalidArgument on the first thing wrong with the stream.
    """

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self._header: gdn_pb2.StateHeader | None = None
        self._buf: bytearray | None = None
        self._received = 0
        self._sha = hashlib.sha256()

    def add(self, chunk: gdn_pb2.StateChunk) -> None:
        if chunk.HasField("header"):
            if self._header is not None:
                raise InvalidArgument("state stream has a second header: only the first chunk carries one")
            self._check_header(chunk.header)
            self._header = chunk.header
            self._buf = bytearray(chunk.header.total_bytes)
        elif self._header is None:
            raise InvalidArgument("state stream does not start with a header chunk")
        data = chunk.data
        if not data:
            return
        if len(data) > MAX_CHUNK_BYTES:
            raise InvalidArgument(f"state chunk of {len(data)} bytes is over the {MAX_CHUNK_BYTES}-byte limit")
        end = self._received + len(data)
        if end > len(self._buf):
            raise InvalidArgument(f"state stream has more bytes than the {len(self._buf)} its header announces")
        self._buf[self._received : end] = data
        self._sha.update(data)
        self._received = end

    def finish(self) -> SessionState:
        if self._header is None:
            raise InvalidArgument("state stream is empty: no header chunk")
        if self._received != len(self._buf):
            raise InvalidArgument(
                f"state stream is truncated: {self._received} of {len(self._buf)} announced bytes arrived"
            )
        if self._sha.hexdigest() != self._header.checksum.lower():
            raise InvalidArgument("state stream checksum mismatch: the state bytes are corrupt")
        state = state_from_bytes(self._buf, self.shape, self._header.dtype)
        self._buf = None
        if self._header.dtype != self.shape.state_dtype:  # convert_dtype was set (_check_header)
            state = state.to(getattr(torch, self.shape.state_dtype))
        if not bool(torch.isfinite(state).all()):  # a session that would answer NaN for ever
            raise InvalidArgument(
                "state holds NaN or Inf values"
                + (f" once converted to {self.shape.state_dtype}" if self._header.dtype != self.shape.state_dtype else "")
            )
        return SessionState(state, tuple(int(p) for p in self._header.positions))

    def _check_header(self, h: gdn_pb2.StateHeader) -> None:
        s = self.shape
        got = (h.num_layers, h.num_v_heads, h.head_dim_k, h.head_dim_v)
        want = (s.num_layers, s.num_v_heads, s.head_dim_k, s.head_dim_v)
        if got != want:
            raise InvalidArgument(
                f"state is for layers/v_heads/K/V = {list(got)}, this server serves {list(want)}"
            )
        if h.dtype not in STATE_DTYPE_BYTES:
            raise InvalidArgument(f"state dtype {h.dtype!r} is not one of {', '.join(map(repr, STATE_DTYPE_BYTES))}")
        if h.dtype != s.state_dtype and not h.convert_dtype:
            raise InvalidArgument(
                f"state dtype {h.dtype!r} is not this server's {s.state_dtype!r}: set the header's convert_dtype "
                "to have it converted"
            )
        if len(h.positions) != s.num_layers:
            raise InvalidArgument(f"state header has {len(h.positions)} positions for {s.num_layers} layers")
        if max(h.positions) > MAX_POSITION:
            raise InvalidArgument(f"state header position {max(h.positions)} is out of range: positions are below 2^63")
        size = s.state_bytes_per_session // s.state_element_bytes * STATE_DTYPE_BYTES[h.dtype]
        if h.total_bytes != size:
            raise InvalidArgument(f"state header announces {h.total_bytes} bytes, a {h.dtype} state is {size} bytes")
        if len(h.checksum) != 64:
            raise InvalidArgument("state header checksum must be a sha256 hex digest")
