"""Process-wide tuning the server applies at start, before it allocates anything big.

`tune_malloc` raises glibc's mmap threshold to 32 MiB and its trim threshold to 1 GiB, so the
multi-MiB buffers each big decode request passes through (receive buffer, parsed message, reply)
come from the heap and reuse warm pages instead of faulting fresh ones in from the kernel per
request (bench/results/request_cost_cpu.md: ~1.7x less time per B=256 request on the CPU box).
Every server entry point calls it: `gdn-server` (gdn_server.cli), each engine
(gdn_server.engine) and each front-end worker (gdn_server.frontend). The echo floor and
gdn-loadtest call the same helper (gdn_client._malloc), so the floor is measured under the same
allocator settings as the service.

`tune_gc` raises the garbage collector's first threshold from 700 to 20,000 objects, above what
a serving process has in flight (gdn_client/_gc.py says why); the echo floor and gdn-loadtest
set it too.

`freeze_startup_objects`, called once a process is ready to serve, takes the objects alive then
(torch's and gRPC's modules, the kernels, the staging buffers' tensors: ~190k of them) out of
the garbage collector's full passes. Each full pass otherwise walks them all: ~90 ms with the
event loop stopped for every stream at once, every few seconds under load (CPU box, host-only
backend at 64 clients: a full collection 81-97 ms before, 0.2-5.5 ms after; bench/NOTES.md).
"""
from __future__ import annotations

import gc
import logging

from gdn_client._malloc import MMAP_THRESHOLD, TRIM_THRESHOLD
from gdn_client._gc import tune_gc as _tune_gc
from gdn_client._malloc import tune_malloc as _tune_malloc

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "freeze_startup_objects", "tune_gc", "tune_malloc"]

log = logging.getLogger(__name__)


def tune_malloc() -> dict[str, int]:
    """glibc mallopt(M_MMAP_THRESHOLD, 32 MiB) and mallopt(M_TRIM_THRESHOLD, 1 GiB) for this
    process, unless the environment sets them (MALLOC_*_ or GLIBC_TUNABLES); a no-op (a debug
    log) with GDN_MALLOC_TUNING=0 or off glibc. Returns the thresholds it set, by mallopt name."""
    return _tune_malloc(log)


def tune_gc() -> int:
    """The garbage collector's first threshold for this process (GDN_GC_GEN0, default 20,000).
    Returns it."""
    return _tune_gc(log)


def freeze_startup_objects() -> int:
    """gc.collect() then gc.freeze(): what start-up made is never scanned again by the collector
    (and never freed by it: only start-up's garbage is collected first). Call it once, when the
    process is ready to serve. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the garbage collector's passes", frozen)
    return frozen
