"""GPU tests: every test in this folder is marked `gpu` and skipped cleanly where CUDA is absent."""
from __future__ import annotations

from pathlib import Path

import pytest


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config):
    """On a GPU machine, kernels compiled in this process go to the kernel cache that the test
    servers use too (`gdn-server --kernel-cache`'s default): each is compiled once for the run, not
    once per worker and server."""
    if _cuda_available():
        from gdn_server.kernels._compiled import default_folder, use_disk_cache

        use_disk_cache(default_folder())


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    skip = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
