"""GPU tests: every test in this folder is marked `gpu` and skipped cleanly where CUDA is absent."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# pytest puts this folder first on sys.path, so `from conftest import start_server` in the tests
# beside this file finds this module, not tests/conftest.py: hand on the shared helpers they use.
_spec = importlib.util.spec_from_file_location("_tests_shared_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _shared  # dataclasses look their module up
_spec.loader.exec_module(_shared)
start_server = _shared.start_server


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    skip = None if _cuda_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
