"""Tensor <-> protobuf codec shared by the client and the server.

A `gdn.v1.Tensor` is row-major, little-endian bytes with a dtype and a shape. Both sides use
torch for the conversion because numpy has no bfloat16. Decoding never copies: the returned
tensor is a read-only view of the message bytes (copy it before writing into it).
"""
from __future__ import annotations

import math
import sys
import threading
import warnings
from typing import Any

import numpy as np
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2

if sys.byteorder != "little":  # the wire format is little-endian; so is every host we ship for
    raise ImportError("gdn-serve needs a little-endian host")

# torch.frombuffer warns once per process that a bytes object is not writable; we only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

TORCH_DTYPE_OF: dict[int, torch.dtype] = {
    gdn_pb2.BF16: torch.bfloat16,
    gdn_pb2.F16: torch.float16,
    gdn_pb2.F32: torch.float32,
}
WIRE_DTYPE_OF: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPE_OF.items()}
ITEMSIZE_OF: dict[int, int] = {gdn_pb2.BF16: 2, gdn_pb2.F16: 2, gdn_pb2.F32: 4}
# Bits that are all ones in the exponent of an Inf or NaN, per wire dtype, read as unsigned ints.
_NONFINITE_EXPONENT = {gdn_pb2.BF16: (np.uint16, 0x7F80), gdn_pb2.F16: (np.uint16, 0x7C00), gdn_pb2.F32: (np.uint32, 0x7F800000)}
_NUMPY_TO_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}
# The NaN/Inf check masks the words chunk by chunk into a scratch buffer reused per thread: a
# temporary the size of the tensor would be a fresh multi-MiB allocation per big request (page
# faults on every one of its pages), and a chunk of 256-512 KiB stays in cache between the two passes.
_CHECK_CHUNK = 1 << 17  # words
_JOIN_LIMIT = 256 << 10  # bytes: first_nonfinite joins buffers up to this size for one check
# From this size on the check runs in torch, whose intra-op threads split it across cores (numpy
# uses one): ~4x less time for the 4 MiB of a B=256 step on the H200 host's 16 cores.
_PARALLEL_CHECK_BYTES = 1 << 20
_scratch = threading.local()


class WireFormatError(ValueError):
    """A Tensor message whose dtype, shape and byte length do not agree."""


def as_torch(x: Any) -> torch.Tensor:
    """Accepts a torch tensor or a numpy array (float16/float32) and returns a CPU torch tensor."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        if x.dtype not in _NUMPY_TO_TORCH:
            raise TypeError(f"numpy dtype {x.dtype} is not supported; use float16 or float32")
        return torch.from_numpy(np.ascontiguousarray(x))
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def tensor_to_proto(x: Any, out: gdn_pb2.Tensor | None = None) -> gdn_pb2.Tensor:
    """Encodes a bf16/f16/f32 tensor (torch or numpy) into a `gdn.v1.Tensor`."""
    t = as_torch(x)
    if t.dtype not in WIRE_DTYPE_OF:
        raise TypeError(f"dtype {t.dtype} is not supported on the wire; use bfloat16, float16 or float32")
    t = t.contiguous()
    msg = out if out is not None else gdn_pb2.Tensor()
    msg.dtype = WIRE_DTYPE_OF[t.dtype]
    msg.shape[:] = list(t.shape)
    # view as same-width integers: numpy has no bfloat16
    msg.data = t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()
    return msg


def tensor_from_proto(msg: gdn_pb2.Tensor, name: str = "tensor", *, finite: bool = False) -> torch.Tensor:
    """Decodes a `gdn.v1.Tensor` into a read-only torch view; raises WireFormatError when inconsistent.

    With ``finite=True`` a NaN or Inf anywhere is a WireFormatError too. That check reads the
    exponent bits of the raw bytes with numpy, several times cheaper than torch.isfinite on the
    small tensors of a decode step (it runs on the server's event loop for every request).
    """
    # protobuf hands out a new bytes object per access of `data`: read it once
    return tensor_from_parts(msg.dtype, tuple(msg.shape), msg.data, name, finite=finite)


def check_layout(wire_dtype: int, shape: tuple[int, ...], nbytes: int, name: str = "tensor") -> int:
    """Checks that a Tensor message's dtype, shape and byte length agree; returns its element count.

    Raises WireFormatError naming what is wrong. Plain integer work: no tensor is built."""
    dtype = TORCH_DTYPE_OF.get(wire_dtype)
    if dtype is None:
        raise WireFormatError(f"{name}: dtype {wire_dtype} is not one of BF16, F16, F32")
    itemsize = ITEMSIZE_OF[wire_dtype]
    numel = 1
    for s in shape:
        if s < 0:
            raise WireFormatError(f"{name}: negative dimension in shape {list(shape)}")
        numel *= s
        if numel * itemsize > nbytes:  # checked while multiplying so huge shapes can't overflow
            break
    if numel * itemsize != nbytes:
        raise WireFormatError(f"{name}: shape {list(shape)} of {dtype} needs {numel * itemsize} bytes, got {nbytes}")
    return numel


def tensor_from_parts(wire_dtype: int, shape: tuple[int, ...], data: bytes, name: str = "tensor", *,
                      finite: bool = False) -> torch.Tensor:
    """`tensor_from_proto` on a Tensor message's fields, for callers that keep the bytes too."""
    numel = check_layout(wire_dtype, shape, len(data), name)
    dtype = TORCH_DTYPE_OF[wire_dtype]
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if finite and _has_nonfinite(data, wire_dtype):
        raise WireFormatError(f"{name} has NaN or Inf values")
    return torch.frombuffer(data, dtype=dtype).view(shape)


def first_nonfinite(buffers: "list[Any] | tuple[Any, ...]", wire_dtype: int) -> int | None:
    """The index of the first buffer in ``buffers`` (each a whole number of ``wire_dtype`` values)
    holding a NaN or Inf, or None when all are finite.

    Small buffers are checked together (one join, one pass: the numpy calls per buffer cost more
    than the bytes do for a decode step's few KiB); big ones each on their own, with no joined copy.
    Only a failing check looks at the buffers one by one, to name the culprit.
    """
    total = sum(len(b) for b in buffers)
    if total == 0:
        return None
    if total <= _JOIN_LIMIT:
        if not _has_nonfinite(b"".join(buffers), wire_dtype):
            return None
    for index, data in enumerate(buffers):
        if len(data) and _has_nonfinite(data, wire_dtype):
            return index
    return None


def _has_nonfinite(data: Any, wire_dtype: int) -> bool:
    """True when some value of ``data`` (a non-empty buffer of ``wire_dtype`` values) is NaN or Inf.

    It reads the exponent bits: every masked word is <= mask, and equals it exactly where the
    exponent is all ones (Inf or NaN), so one max per chunk decides.
    """
    if len(data) >= _PARALLEL_CHECK_BYTES:
        return _has_nonfinite_parallel(data, wire_dtype)
    uint, mask = _NONFINITE_EXPONENT[wire_dtype]
    words = np.frombuffer(data, dtype=uint)
    scratch = getattr(_scratch, uint.__name__, None)
    if scratch is None:
        scratch = np.empty(_CHECK_CHUNK, dtype=uint)
        setattr(_scratch, uint.__name__, scratch)
    for start in range(0, words.size, _CHECK_CHUNK):
        chunk = words[start:start + _CHECK_CHUNK]
        masked = scratch[:chunk.size]
        np.bitwise_and(chunk, mask, out=masked)
        if masked.max() == mask:
            return True
    return False


def _has_nonfinite_parallel(data: Any, wire_dtype: int) -> bool:
    """`_has_nonfinite` in torch (`all_finite`)."""
    return not all_finite(torch.frombuffer(data, dtype=TORCH_DTYPE_OF[wire_dtype]))


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in the float tensor `x`: one read-only pass (min and max together, split over
    torch's intra-op threads); a NaN anywhere makes both NaN, an Inf makes one of them infinite.
    It writes nothing, where masking the words first writes a scratch copy and reads it back
    (bench/NOTES.md: 0.68 -> 0.50 ms for a B=256 step's 4 MiB on 2 cores)."""
    low, high = torch.aminmax(x)
    return math.isfinite(low.item()) and math.isfinite(high.item())
