"""Pinned host memory seen as a CUDA tensor, for kernels that read and write it in place.

With unified virtual addressing (every 64-bit CUDA host), memory from cudaHostAlloc, which is
what torch's pinned tensors are, can be used from kernels at the same address: a load or store
goes over PCIe, with no copy before or after the launch. Torch has no call that makes such a
tensor, so `device_alias` takes a pinned tensor's own DLPack export and relabels its device
from host to the GPU before importing it back. The alias shares the pinned tensor's memory and
keeps it alive; torch ops on the alias would run on the GPU against host memory, so it is only
for passing to kernels: the staging buffers of the smallest graphs (gdn_server/backends/cuda.py,
MAPPED_MAX_ROWS) and the segment tables (`_segments.SegmentTable`).
"""
from __future__ import annotations

import ctypes

import torch
import torch.utils.dlpack

_KDL_CUDA = 2  # DLDeviceType kDLCUDA


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):
    """The first fields of DLPack's DLTensor (and so of DLManagedTensor): data, then device."""

    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def device_alias(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` (a CUDA device with an index) at the same memory as `pinned`.

    Raises ValueError for a tensor that is not pinned host memory, RuntimeError where torch
    would not make the alias (a torch whose DLPack export changed, say): callers fall back to
    copies."""
    if pinned.device.type != "cpu" or not pinned.is_pinned():
        raise ValueError("device_alias needs a pinned host tensor")
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device_alias needs a CUDA device with an index, got {device}")
    capsule = torch.utils.dlpack.to_dlpack(pinned)
    head = _DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    if head.data != pinned.data_ptr():
        raise RuntimeError("torch's DLPack export does not start with the tensor's data pointer")
    head.device.device_type = _KDL_CUDA
    head.device.device_id = device.index
    alias = torch.utils.dlpack.from_dlpack(capsule)
    if alias.device != device or alias.data_ptr() != pinned.data_ptr() or alias.shape != pinned.shape:
        raise RuntimeError(f"torch made {alias.device} at {alias.data_ptr():#x}, not an alias of the pinned tensor")
    return alias
