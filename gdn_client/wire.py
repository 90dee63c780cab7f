"""Tensor <-> protobuf codec shared by the client and the server.

A `gdn.v1.Tensor` is row-major, little-endian bytes with a dtype and a shape. Both sides use
torch for the conversion because numpy has no bfloat16. Decoding never copies: the returned
tensor is a read-only view of the message bytes (copy it before writing into it).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2
# the raw-byte checks (no torch), re-exported: this module is where clients look for them. It also
# silences torch.frombuffer's warning about read-only buffers, which this module's views are too.
from gdn_client.proto.checks import (  # noqa: F401
    ITEMSIZE_OF, WireFormatError, all_finite, check_layout, first_nonfinite, has_nonfinite, torch_dtypes,
)

TORCH_DTYPE_OF: dict[int, torch.dtype] = torch_dtypes()
WIRE_DTYPE_OF: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPE_OF.items()}
_NUMPY_TO_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}


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


def tensor_from_parts(wire_dtype: int, shape: tuple[int, ...], data: bytes, name: str = "tensor", *,
                      finite: bool = False) -> torch.Tensor:
    """`tensor_from_proto` on a Tensor message's fields, for callers that keep the bytes too."""
    numel = check_layout(wire_dtype, shape, len(data), name)
    dtype = TORCH_DTYPE_OF[wire_dtype]
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if finite and has_nonfinite(data, wire_dtype):
        raise WireFormatError(f"{name} has NaN or Inf values")
    return torch.frombuffer(data, dtype=dtype).view(shape)
