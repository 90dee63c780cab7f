"""The cyclic garbage collector's first threshold for processes that serve or load many small
messages (the server's processes, its echo floor, the load generator).

Why: CPython collects its youngest generation whenever the objects allocated and still alive
since the last collection pass 700. A serving process has more than that in flight at once: each
decode request is a dozen or more objects alive from its read to its reply (the request, its
queue item, its batch entry, its step records, its answer), so at 64 clients the threshold was
crossed every round or so, and each pass walked every one of those live objects (and moved them
into the older generations, walked again there). On the CPU box, bench/engine_path.py at 64
requests a round ran 1,300-1,700 young-generation passes per 90k requests, and the collector's
functions were ~6% of the process's samples under perf; with 20,000 there was one, and the
collector's ~3% of the samples were start-up's (the full collection before gc.freeze).
Objects freed by their reference counts never wait for a pass: the threshold only decides how
much cyclic garbage may build up before one, and how long a pass may take when it comes (a few
ms for 20,000 objects, rarely).

GDN_GC_GEN0=N sets another first threshold (700 is CPython's own). No import of gdn_server
here: the echo server and gdn-loadtest call it too, so the floor they measure runs under the
same collector settings as the service.
"""
from __future__ import annotations

import gc
import logging
import os

__all__ = ["DEFAULT_GEN0", "GEN0_ENV", "tune_gc"]

GEN0_ENV = "GDN_GC_GEN0"
DEFAULT_GEN0 = 20_000


def gen0_from_env() -> int:
    """The first threshold GDN_GC_GEN0 asks for, or DEFAULT_GEN0; a value that is not a positive
    whole number is refused by name (0 would turn automatic collection off)."""
    raw = os.environ.get(GEN0_ENV)
    if raw is None or raw == "":
        return DEFAULT_GEN0
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{GEN0_ENV} must be a positive number of objects, got {raw!r}")
    return value


def tune_gc(logger: logging.Logger | None = None) -> int:
    """Sets the collector's first threshold (gen0_from_env); the older generations' stay as they
    are. Returns the threshold set."""
    gen0 = gen0_from_env()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
    if logger is not None:
        logger.debug("garbage collector: first threshold %d", gen0)
    return gen0
