"""GPU tests: every test in this folder is marked `gpu` and skipped cleanly where CUDA is absent."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# The kernels of the test servers' shape (H = 16, HV = 32, both state dtypes, the segment kernels
# of --allow-shared-memory), compiled into the kernel cache once before any test runs.
_FILL_CACHE = [sys.executable, "-m", "gdn_server", "--layers", "2", "--q-heads", "16", "--v-heads", "32",
               "--compile-kernels", "--state-dtype"]


def pytest_configure(config):
    """On a GPU machine, kernels compiled in this process go to the kernel cache that the test
    servers use too (`gdn-server --kernel-cache`'s default), so each is compiled once for the run,
    not once per worker and server; and the run's first process (xdist's controller, or the only
    one) fills that cache with the test servers' kernels before the workers start, two processes
    at once, so that servers starting together do not all compile. A failure there is a warning:
    the servers then compile for themselves."""
    if not _cuda_available():
        return
    from gdn_server.config import default_kernel_cache
    from gdn_server.kernels._compiled import use_disk_cache

    use_disk_cache(default_kernel_cache())
    if hasattr(config, "workerinput"):
        return
    fills = [subprocess.Popen([*_FILL_CACHE, dtype], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for dtype in ("bfloat16", "float32")]
    for fill in fills:
        try:
            _, err = fill.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            fill.kill()
            err = "timed out"
        if fill.returncode:
            warnings.warn(f"could not fill the kernel cache before the GPU tests: {err[-2000:]}")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    skip = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
