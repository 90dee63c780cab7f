"""Backends behind one interface (`Backend`): `cpu` (torch) and `cuda` (CuTe DSL kernel)."""
from __future__ import annotations

import logging

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep
from gdn_server.config import ModelShape
from gdn_server.weights import GateParams

__all__ = ["Backend", "DoneStep", "PendingStep", "make_backends", "resolve_device"]

log = logging.getLogger(__name__)

DEFAULT_CPU_SESSIONS = 64


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible")
    return device


def make_backends(
    device: str, devices: tuple[int, ...] | None, shape: ModelShape, gates: GateParams, max_sessions: int | None,
    scale: float | None = None, speculative_sessions: int | None = None,
) -> list[tuple[int, Backend]]:
    """One backend per device: every visible GPU (or those in `devices`), or the CPU alone.

    `max_sessions` and `speculative_sessions` are per device. Returns (device index, backend).
    """
    device = resolve_device(device)
    if device == "cpu":
        # `--devices 0,1` on the CPU: that many independent CPU shards (pool, table, scheduler each),
        # so multi-device placement and one engine process per device run without a GPU (tests, CI)
        indices = (0,) if devices is None else devices
        if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
            raise ValueError(f"--devices {list(indices)}: device numbers must be >= 0, each named once")
        from gdn_server.backends.cpu import CpuBackend

        return [
            (i, CpuBackend(shape, gates, max_sessions or DEFAULT_CPU_SESSIONS, scale, speculative_sessions))
            for i in indices
        ]
    count = torch.cuda.device_count()
    indices = tuple(range(count)) if devices is None else devices
    bad = [i for i in indices if not 0 <= i < count]
    if bad or len(set(indices)) != len(indices) or not indices:
        raise ValueError(f"--devices {list(indices)}: this host has CUDA devices 0..{count - 1}, each named once")
    from gdn_server.backends.cuda import CudaBackend

    return [
        (i, CudaBackend(shape, gates, max_sessions, scale, device=f"cuda:{i}", speculative_sessions=speculative_sessions))
        for i in indices
    ]
