"""Process-wide tuning the server applies at start, before it allocates anything big.

`tune_malloc` raises glibc's mmap threshold to 32 MiB and its trim threshold to 1 GiB, so the
multi-MiB buffers each big decode request passes through (receive buffer, parsed message, reply)
come from the heap and reuse warm pages instead of faulting fresh ones in from the kernel per
request (bench/results/request_cost_cpu.md: ~1.7x less time per B=256 request on the CPU box).
Every server entry point calls it: `gdn-server` (gdn_server.cli), each engine
(gdn_server.engine) and each front-end worker (gdn_server.frontend). The echo floor and
gdn-loadtest call the same helper (gdn_client._malloc), so the floor is measured under the same
allocator settings as the service.
"""
from __future__ import annotations

import logging

from gdn_client._malloc import MMAP_THRESHOLD, TRIM_THRESHOLD
from gdn_client._malloc import tune_malloc as _tune_malloc

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

log = logging.getLogger(__name__)


def tune_malloc() -> dict[str, int]:
    """glibc mallopt(M_MMAP_THRESHOLD, 32 MiB) and mallopt(M_TRIM_THRESHOLD, 1 GiB) for this
    process, unless the environment sets them (MALLOC_*_ or GLIBC_TUNABLES); a no-op (a debug
    log) with GDN_MALLOC_TUNING=0 or off glibc. Returns the thresholds it set, by mallopt name."""
    return _tune_malloc(log)
