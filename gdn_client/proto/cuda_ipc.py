"""CUDA IPC for shared-memory regions (gdn.v1.CudaSharedMemory), through the CUDA driver API.

Both sides of the wire use it: a client allocates device memory and exports its handle
(`DeviceAllocation`), the server opens the handle once, when the region is registered
(`open_handle`). The handle is the 64 bytes of a cudaIpcMemHandle_t (CUipcMemHandle is the same
bytes), so a client in any language that calls cudaIpcGetMemHandle on a cudaMalloc'd pointer
interoperates. The memory comes out as a torch uint8 tensor (through __cuda_array_interface__),
so neither side needs more than torch and the driver.

Memory from cuMemAlloc, not torch's caching allocator: a handle names a whole allocation, and a
torch tensor may be a piece of a larger cached block. Nothing here runs at import time.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable

HANDLE_BYTES = 64
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]  # CUipcMemHandle, passed by value


class CudaIpcError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaIpcError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise CudaIpcError(f"{call} failed: {(name.value or b'?').decode()} ({status})")


def _symbol(lib: ctypes.CDLL, name: str) -> Any:
    """The driver's current version of a call (cuda.h maps e.g. cuMemAlloc to cuMemAlloc_v2)."""
    return getattr(lib, name + "_v2", None) or getattr(lib, name)


class _Context:
    """The device's primary context (the one torch uses), current on this thread for a block."""

    def __init__(self, device: int) -> None:
        lib = _driver()
        self._lib = lib
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
        self._ctx = ctypes.c_void_p()
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")

    def __enter__(self) -> ctypes.CDLL:
        _check(self._lib, _symbol(self._lib, "cuCtxPushCurrent")(self._ctx), "cuCtxPushCurrent")
        return self._lib

    def __exit__(self, *exc: object) -> None:
        popped = ctypes.c_void_p()
        _symbol(self._lib, "cuCtxPopCurrent")(ctypes.byref(popped))


class _ArrayInterface:
    """What torch.as_tensor reads a device pointer through."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3, "strides": None,
        }


def _as_tensor(pointer: int, nbytes: int, device: int) -> Any:
    import torch

    return torch.as_tensor(_ArrayInterface(pointer, nbytes), device=torch.device("cuda", device))


def open_handle(handle: bytes, device: int, nbytes: int) -> tuple[Any, Callable[[], None]]:
    """Opens another process's allocation from its IPC handle on `device`: a CUDA uint8 tensor of
    its first `nbytes` bytes, and the function that closes it. CudaIpcError where the handle does
    not open (not a live allocation, another host, the same process) or the device is not there."""
    if len(handle) != HANDLE_BYTES:
        raise CudaIpcError(f"an IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
    ctx = _Context(device)
    pointer = ctypes.c_uint64()
    raw = _IpcMemHandle.from_buffer_copy(handle)
    with ctx as lib:
        _check(lib, _symbol(lib, "cuIpcOpenMemHandle")(ctypes.byref(pointer), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
               "cuIpcOpenMemHandle")
        size = ctypes.c_size_t()
        base = ctypes.c_uint64()
        _check(lib, _symbol(lib, "cuMemGetAddressRange")(ctypes.byref(base), ctypes.byref(size), pointer),
               "cuMemGetAddressRange")
    if nbytes > size.value:
        close_handle(pointer.value, device)
        raise CudaIpcError(f"the allocation has {size.value} bytes, fewer than the {nbytes} asked for")
    tensor = _as_tensor(pointer.value, nbytes, device)
    return tensor, functools.partial(close_handle, pointer.value, device)


def close_handle(pointer: int, device: int) -> None:
    """Closes an allocation opened by `open_handle` (its tensors must not be used after)."""
    with _Context(device) as lib:
        _check(lib, lib.cuIpcCloseMemHandle(ctypes.c_uint64(pointer)), "cuIpcCloseMemHandle")


class DeviceAllocation:
    """`nbytes` of device memory on `device` from cuMemAlloc, with its IPC handle and a torch view.

    >>> mem = DeviceAllocation(1 << 20, device=0)          # doctest: +SKIP
    >>> mem.tensor.view(torch.bfloat16)[:4] = 1.0          # doctest: +SKIP
    >>> mem.handle                                         # doctest: +SKIP
    b'...'   (64 bytes for RegisterSharedMemory's CudaSharedMemory.ipc_handle)
    >>> mem.free()                                         # doctest: +SKIP
    """

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self.nbytes = nbytes
        self.device = device
        self._ctx = _Context(device)
        pointer = ctypes.c_uint64()
        handle = _IpcMemHandle()
        with self._ctx as lib:
            _check(lib, _symbol(lib, "cuMemAlloc")(ctypes.byref(pointer), ctypes.c_size_t(nbytes)), "cuMemAlloc")
            self.pointer = pointer.value
            _check(lib, lib.cuIpcGetMemHandle(ctypes.byref(handle), pointer), "cuIpcGetMemHandle")
        self.handle = bytes(handle)
        self.tensor = _as_tensor(self.pointer, nbytes, device)

    def free(self) -> None:
        """Frees the memory (once); its tensor must not be used after."""
        if self.pointer:
            self.tensor = None
            with self._ctx as lib:
                _check(lib, _symbol(lib, "cuMemFree")(ctypes.c_uint64(self.pointer)), "cuMemFree")
            self.pointer = 0
