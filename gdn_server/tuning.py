"""Process-wide tuning the server applies at start, before it allocates anything big. Nothing
here reads or changes the environment.

`tune_malloc`: with glibc's defaults a buffer above the mmap threshold (128 KiB at start, raised
on the fly as such buffers are freed) gets fresh pages from the kernel. A B=256 decode request
passes through several multi-MiB buffers (gRPC's receive buffer, the parsed message, the reply),
so every request paid page faults on each of their pages; serving them from the heap lets the
next request reuse warm pages (bench/DECISIONS.md, entry 21). The trim
threshold bounds what the process keeps: freed heap above it goes back to the kernel, so memory
that a burst of big or hostile messages took is returned once they are gone.

`tune_gc`: CPython collects its youngest generation whenever 700 more objects are alive than at
the last pass; a serving process has more than that in flight (a dozen objects per request from
its read to its reply), so at 64 clients a pass ran every round or so, walking every live
request. 20,000 puts a pass every few thousand requests; objects freed by their reference counts
never wait for one (entry 21).

`freeze_startup_objects`, once a process is ready to serve, takes the objects alive then (torch's
and gRPC's modules, the kernels, ~190k objects) out of the collector's full passes, each of which
would otherwise walk them all with the event loop stopped, every few seconds under load (entry 21).
"""
from __future__ import annotations

import ctypes
import gc
import logging

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # the most every glibc version accepts (HEAP_MAX_SIZE / 2 on 64-bit hosts)
TRIM_THRESHOLD = 256 << 20  # a few big requests' buffers stay warm; more goes back to the kernel
GC_GEN0 = 20_000
_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def tune_malloc() -> bool:
    """glibc mallopt(M_MMAP_THRESHOLD, 32 MiB) and mallopt(M_TRIM_THRESHOLD, 256 MiB) for this
    process; off glibc, nothing. Returns whether both were set."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process, libc among them
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        log.debug("not glibc: malloc thresholds left as they are")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = True
    for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if mallopt(param, value) != 1:  # glibc returns 1 on success
            log.warning("mallopt(%d, %d) refused by glibc; big buffers keep their default handling", param, value)
            ok = False
    return ok


def tune_gc() -> None:
    """The collector's first threshold for a serving process (GC_GEN0); the older ones stay."""
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0, gen1, gen2)


def tune_process() -> None:
    """`tune_malloc` and `tune_gc`: what every process that moves decode messages runs first
    (gdn-server's, and gdn-loadtest's load and echo floor, so that neither side of a comparison
    pays a cost the other does not)."""
    tune_malloc()
    tune_gc()


def freeze_startup_objects() -> int:
    """gc.collect() then gc.freeze(): what start-up made is never scanned again by the collector.
    Call it once, when the process is ready to serve. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the garbage collector's passes", frozen)
    return frozen
