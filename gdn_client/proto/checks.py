"""Checks on a `gdn.v1.Tensor`'s raw bytes, without torch: its layout (dtype, shape and byte
length agree) and NaN/Inf values.

They sit beside the generated stubs because both sides of the wire make them: the client on the
replies it decodes (gdn_client.wire), the server on the requests it takes (gdn_server.validation)
and on the inputs its backends stage. The server imports this package, `gdn_client.proto`, and
nothing else of the client. Importing this module loads no torch, so a tool that only checks raw
messages needs none.

The NaN/Inf rule lives here: a value is refused when its exponent bits are all ones. The checks
below apply it to raw bytes (numpy, one thread) and to big host tensors (`all_finite`, torch's
threads); gdn_server/_wire.c applies the same rule to a plain step's bf16 bytes as it parses them
(tests/test_wire_c.py checks it against these), and gdn_server/kernels/_segments.py to bf16
tensors in GPU memory.
"""
from __future__ import annotations

import functools
import math
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from gdn_client.proto.gdn.v1 import gdn_pb2

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # the wire format is little-endian; so is every host we ship for
    raise ImportError("gdn-serve needs a little-endian host")

# torch.frombuffer (the big check) warns once per process that a bytes object is not writable;
# it is only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPE_NAME_OF: dict[int, str] = {gdn_pb2.BF16: "BF16", gdn_pb2.F16: "F16", gdn_pb2.F32: "F32"}
ITEMSIZE_OF: dict[int, int] = {gdn_pb2.BF16: 2, gdn_pb2.F16: 2, gdn_pb2.F32: 4}
# Bits that are all ones in the exponent of an Inf or NaN, per wire dtype, read as unsigned ints.
_NONFINITE_EXPONENT = {gdn_pb2.BF16: (np.uint16, 0x7F80), gdn_pb2.F16: (np.uint16, 0x7C00), gdn_pb2.F32: (np.uint32, 0x7F800000)}
# The NaN/Inf check masks the words chunk by chunk into a scratch buffer reused per thread: a
# temporary the size of the tensor would be a fresh multi-MiB allocation per big request (page
# faults on every one of its pages), and a chunk of 256-512 KiB stays in cache between the two passes.
_CHECK_CHUNK = 1 << 17  # words
JOIN_LIMIT = 256 << 10  # bytes: first_nonfinite joins buffers up to this size for one check
# From this size on the check runs in torch, whose intra-op threads split it across cores (numpy
# uses one): ~4x less time for the 4 MiB of a B=256 step on the H200 host's 16 cores.
_PARALLEL_CHECK_BYTES = 1 << 20
_scratch = threading.local()


MAX_DIMS_SHOWN = 8  # an error names a shape's first dimensions only: a message stays short


class WireFormatError(ValueError):
    """A Tensor message whose dtype, shape and byte length do not agree."""


def describe_shape(shape: Any) -> str:
    """A shape as an error message shows it: whole up to MAX_DIMS_SHOWN dimensions, else its first
    ones and how many there are (a shape of thousands of dimensions would make a status message
    longer than a client accepts in its metadata).

    >>> describe_shape([2, 3]), describe_shape(range(10))
    ('[2, 3]', '[0, 1, 2, 3, 4, 5, 6, 7, ... (10 dimensions)]')
    """
    dims = list(shape[:MAX_DIMS_SHOWN + 1]) if hasattr(shape, "__getitem__") else list(shape)
    if len(dims) <= MAX_DIMS_SHOWN:
        return str(dims)
    return f"[{', '.join(map(str, dims[:MAX_DIMS_SHOWN]))}, ... ({len(shape)} dimensions)]"


def check_layout(wire_dtype: int, shape: tuple[int, ...], nbytes: int, name: str = "tensor") -> int:
    """Checks that a Tensor message's dtype, shape and byte length agree; returns its element count.

    Raises WireFormatError naming what is wrong. Plain integer work: no tensor is built."""
    dtype = DTYPE_NAME_OF.get(wire_dtype)
    if dtype is None:
        raise WireFormatError(f"{name}: dtype {wire_dtype} is not one of BF16, F16, F32")
    itemsize = ITEMSIZE_OF[wire_dtype]
    numel = 1
    for s in shape:
        if s < 0:
            raise WireFormatError(f"{name}: negative dimension in shape {describe_shape(shape)}")
        numel *= s
        if numel * itemsize > nbytes:  # checked while multiplying so huge shapes can't overflow
            break
    if numel * itemsize != nbytes:
        raise WireFormatError(
            f"{name}: shape {describe_shape(shape)} of {dtype} needs {numel * itemsize} bytes, got {nbytes}"
        )
    return numel


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
    if total <= JOIN_LIMIT:
        if not has_nonfinite(b"".join(buffers), wire_dtype):
            return None
    for index, data in enumerate(buffers):
        if len(data) and has_nonfinite(data, wire_dtype):
            return index
    return None


def has_nonfinite(data: Any, wire_dtype: int, parallel: bool = True) -> bool:
    """True when some value of ``data`` (a non-empty buffer of ``wire_dtype`` values) is NaN or Inf.

    It reads the exponent bits: every masked word is <= mask, and equals it exactly where the
    exponent is all ones (Inf or NaN), so one max per chunk decides. From _PARALLEL_CHECK_BYTES
    on it runs in torch on several threads, unless `parallel` is False (a process that should
    not load torch for it).
    """
    if parallel and len(data) >= _PARALLEL_CHECK_BYTES:
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
    """`has_nonfinite` in torch (`all_finite`): loaded here on the first big check."""
    import torch

    return not all_finite(torch.frombuffer(data, dtype=torch_dtypes()[wire_dtype]))


@functools.cache
def torch_dtypes() -> dict[int, torch.dtype]:
    """The torch dtype of each wire dtype (torch is imported here, on the first call)."""
    import torch

    return {gdn_pb2.BF16: torch.bfloat16, gdn_pb2.F16: torch.float16, gdn_pb2.F32: torch.float32}


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in the float tensor `x`: one read-only pass (min and max together, split over
    torch's intra-op threads); a NaN anywhere makes both NaN, an Inf makes one of them infinite.
    It writes nothing, where masking the words first writes a scratch copy and reads it back
    (0.68 -> 0.50 ms for a B=256 step's 4 MiB on 2 cores)."""
    low, high = x.aminmax()  # the tensor's method: this module does not import torch
    return math.isfinite(low.item()) and math.isfinite(high.item())
