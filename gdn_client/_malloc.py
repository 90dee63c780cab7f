"""glibc malloc thresholds for processes that move multi-MiB messages (the server, its echo floor,
the load generator).

Why: with glibc's defaults a buffer above the mmap threshold (128 KiB at start, raised on the fly
up to 32 MiB as such buffers are freed) gets fresh pages from the kernel, and memory freed at the
top of the heap is handed back once more than the trim threshold (twice the mmap threshold) is
free. A B=256 decode request is ~4 MiB in, 2 MiB out, and each one passes through several
buffers of that size (gRPC's receive buffer, the parsed message, the reply, its serialization),
so every request paid page faults on every page of every one of them: ~30% of the server's time
went to the kernel's page-fault path (bench/results/request_cost_cpu.md). Serving such buffers
from the heap and keeping freed memory in the process lets the next request reuse warm pages.

The same settings as ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824`` in
the environment, but set by the process itself (so they do not leak into children that did not
ask for them) and only where the environment does not already choose them. The cost: a process
keeps up to TRIM_THRESHOLD of freed heap instead of returning it; buffers above MMAP_THRESHOLD
(state snapshots, state pools) still come from and go back to the kernel directly.

No import of gdn_server here: the echo server and gdn-loadtest (gdn_client) call it too, so the
floor they measure runs under the same allocator settings as the service.
"""
from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["DISABLE_ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune_malloc"]

DISABLE_ENV = "GDN_MALLOC_TUNING"  # "0" keeps glibc's defaults (inherited by child processes)

# the most glibc allows: some versions refuse an mmap threshold above HEAP_MAX_SIZE / 2 = 32 MiB on
# 64-bit hosts (mallopt returns 0; 2.36 accepts more), so 32 MiB is accepted by every version
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# parameter -> (environment variable, GLIBC_TUNABLES name) that would already have set it
_ENV_OF = {
    _M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    _M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
}
_NAMES = {_M_MMAP_THRESHOLD: "M_MMAP_THRESHOLD", _M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD"}


def _glibc_mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc (musl, macOS, Windows)."""
    try:
        # the symbols already loaded into this process (libc among them); no ldconfig lookup
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # only glibc has it (musl has a mallopt that does nothing)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def _chosen_by_environment(param: int) -> bool:
    env, tunable = _ENV_OF[param]
    return env in os.environ or tunable in os.environ.get("GLIBC_TUNABLES", "")


def tune_malloc(log: logging.Logger | None = None, *, mmap_threshold: int = MMAP_THRESHOLD,
                trim_threshold: int = TRIM_THRESHOLD) -> dict[str, int]:
    """Sets glibc's mmap and trim thresholds for this process; returns what was set.

    Call it first thing in a process's entry point (before big buffers are allocated: glibc uses
    the new thresholds from the next allocation on). A threshold the environment already sets is
    left alone; with GDN_MALLOC_TUNING=0, or off glibc, it does nothing. Refused values are logged, never raised: the process
    works either way, only slower.
    """
    log = log or logging.getLogger("gdn_client")
    if os.environ.get(DISABLE_ENV, "") == "0":  # glibc's defaults, e.g. to measure what tuning buys
        log.debug("%s=0: malloc thresholds left as they are", DISABLE_ENV)
        return {}
    mallopt = _glibc_mallopt()
    if mallopt is None:
        log.debug("not glibc: malloc thresholds left as they are")
        return {}
    applied: dict[str, int] = {}
    for param, value in ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold)):
        name = _NAMES[param]
        if _chosen_by_environment(param):
            log.debug("%s: set by the environment, left alone", name)
            continue
        if mallopt(param, value) != 1:  # glibc returns 1 on success, 0 on a refused value
            log.warning("mallopt(%s, %d) refused by glibc; big buffers keep their default handling", name, value)
            continue
        applied[name] = value
    log.debug("malloc thresholds set: %s", applied)
    return applied
