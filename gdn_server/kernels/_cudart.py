"""The CUDA runtime that torch loaded, through ctypes, for the few calls torch makes dearer or
has no binding for: a graph's launch (torch's `CUDAGraph.replay` costs ~10 us more host time a
replay where the server's caches are cold: bench/DECISIONS.md, entry 8), the copies and
page-locking of shared-memory regions (gdn_server.shared_memory). Loaded on first use."""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

MEMCPY_DEFAULT = 4  # cudaMemcpyKind: the direction from the addresses (unified addressing)


@functools.cache
def runtime() -> Any:
    """ctypes' handle of libcudart, by the soname of torch's CUDA major version."""
    import torch

    lib = ctypes.CDLL(f"libcudart.so.{(torch.version.cuda or '').split('.')[0]}")
    lib.cudaGraphLaunch.argtypes = (ctypes.c_void_p, ctypes.c_void_p)  # (cudaGraphExec_t, cudaStream_t)
    return lib


def clear_last_error() -> None:
    """Reads, and so clears, the runtime's last error: a failed call leaves it set, and the next
    launch's check (torch's, the kernels') would report it as that launch's failure."""
    try:
        runtime().cudaGetLastError()
    except (OSError, AttributeError):
        log.warning("could not clear the CUDA runtime's last error; the next launch may report it")
