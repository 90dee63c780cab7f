"""Fixtures shared by every test module; the helpers behind them live in `servers`."""
from __future__ import annotations

from typing import Iterator

import pytest

from servers import SMALL_MODEL, ServerProcess, start_server


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    """One small CPU server per test module (3 layers, H=2, HV=4, 64 sessions, seed 7)."""
    with start_server(*SMALL_MODEL, "--max-sessions", "64", "--seed", "7") as server:
        yield server
