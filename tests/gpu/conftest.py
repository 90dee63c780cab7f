"""GPU tests: every test here is marked `gpu` and skipped cleanly where CUDA is absent."""
from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # torch is a dependency; a broken install still just skips
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
