"""Backends behind one interface (`Backend`): `cpu` (torch) and `cuda` (CuTe DSL kernel)."""
from __future__ import annotations

import logging

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep
from gdn_server.config import ModelShape
from gdn_server.weights import GateParams

__all__ = ["Backend", "DoneStep", "PendingStep", "make_backend", "resolve_device"]

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


def make_backend(
    device: str, shape: ModelShape, gates: GateParams, max_sessions: int | None, scale: float | None = None,
    speculative_sessions: int | None = None,
) -> Backend:
    device = resolve_device(device)
    if device == "cuda":
        from gdn_server.backends.cuda import CudaBackend

        return CudaBackend(shape, gates, max_sessions, scale, speculative_sessions=speculative_sessions)
    from gdn_server.backends.cpu import CpuBackend

    return CpuBackend(shape, gates, max_sessions or DEFAULT_CPU_SESSIONS, scale, speculative_sessions)
