"""gdn_server._native, the decode path's per-request work in C (gdn_server/_native.c; the
scheduler's loops in _native_scheduler.c; the --frontends link's in _native_link.c and
_native_replies.c), where it was built: `module` is it, or None. Each user keeps the Python code
it stands in for, which runs where the module is not built (no C compiler at install time) or
with GDN_NATIVE=0."""
from __future__ import annotations

import logging
import os
from typing import Any

# Copies of at least THREADED_COPY_BYTES (a big request's inputs into the staging buffer, a big
# reply's output) are split over COPY_THREADS threads by the native module. The H200 host's B=256
# step took the same time with torch's pool at 4, 8 or 16 threads (bench/NOTES.md).
THREADED_COPY_BYTES = 512 << 10
COPY_THREADS = min(8, os.cpu_count() or 1)


def _load() -> tuple[Any, str]:
    if os.environ.get("GDN_NATIVE", "1") == "0":
        return None, "turned off (GDN_NATIVE=0)"
    try:
        from gdn_server import _native
    except ImportError:  # not built here: the Python code runs
        return None, "not built"
    return _native, "loaded"


module, state = _load()  # state: "loaded", "not built" or "turned off (GDN_NATIVE=0)"


def log_state(log: logging.Logger) -> None:
    """Says whether the decode path's C module runs: without it every request's parse, checks and
    copies run in Python, at roughly half the steps per second (the H200 host, 2026-11-30:
    bench/results/evloop_v1_python_path against serve_v18), which nothing else would show."""
    if state == "loaded":
        log.info("native decode path: gdn_server._native")
    elif state == "not built":
        log.warning(
            "gdn_server._native is not built: the decode path's parse, checks and copies run in Python, "
            "at roughly half the throughput (install with a C compiler present, e.g. pip install .)"
        )
    else:
        log.info("native decode path %s: the Python code runs", state)
