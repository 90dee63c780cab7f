"""The process settings of the load's processes and of the echo floor: gdn-server's own.

The echo floor is the yardstick our service is measured against, and the load's clients move
the same multi-MiB messages: both run under the allocator and collector settings gdn-server
gives its processes (gdn_server/tuning.py says why they matter), so neither side of a
comparison pays a cost the other does not. The values must match gdn_server/tuning.py's; this
package does not import the server, and tests/test_loadtest.py checks that they agree.
"""
from __future__ import annotations

import ctypes
import gc
import logging

__all__ = ["GC_GEN0", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_process"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20  # buffers up to this size come from the heap, reusing warm pages
TRIM_THRESHOLD = 64 << 20  # freed heap above this goes back to the kernel
GC_GEN0 = 20_000  # the collector's first threshold
_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def tune_process() -> None:
    """Sets glibc's mmap and trim thresholds (elsewhere, nothing) and the collector's first
    threshold for this process; call it first thing, before big buffers are allocated."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process, libc among them
        libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        mallopt = None
    if mallopt is not None:
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        mallopt.restype = ctypes.c_int
        for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            if mallopt(param, value) != 1:  # glibc returns 1 on success
                log.warning("mallopt(%d, %d) refused by glibc; big buffers keep their default handling", param, value)
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0, gen1, gen2)
