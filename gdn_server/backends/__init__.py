"""Backends behind one interface (`Backend`): `cpu` (torch) and `cuda` (CuTe DSL kernel)."""
from __future__ import annotations

import logging

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep, default_speculative_sessions
from gdn_server.config import ModelShape
from gdn_server.weights import GateParams

__all__ = ["Backend", "DoneStep", "PendingStep", "default_cpu_sessions", "make_backends", "resolve_device"]

log = logging.getLogger(__name__)

# The CPU backend's default session count: as many as fit in CPU_STATE_BUDGET_BYTES of state pool,
# the speculative scratch rows included (each speculative session adds 2 rows per layer), at
# least 1 and at most DEFAULT_CPU_SESSIONS. The CPU serves small models, tests and embedded use,
# where the server must stay light: a fixed 64 gave qwen3-next (37.7 MB of bf16 state per session)
# a 4.6 GB pool and 5 GB of RSS. 256 MiB keeps a server well under 1 GB (qwen3-next: 2 sessions,
# 226 MB with their scratch; a model whose one session is bigger gets that one), and the small
# test models (~1 MB a session with scratch) keep their 64. --max-sessions sets any other count.
CPU_STATE_BUDGET_BYTES = 256 << 20
DEFAULT_CPU_SESSIONS = 64


def default_cpu_sessions(shape: ModelShape, speculative_sessions: int | None = None) -> int:
    """The CPU backend's session count when none is configured (CPU_STATE_BUDGET_BYTES)."""
    row_bytes = shape.state_bytes_per_session // shape.num_layers

    def pool_bytes(sessions: int) -> int:  # Backend.pool_bytes of a backend of `sessions`
        spec = default_speculative_sessions(sessions) if speculative_sessions is None else speculative_sessions
        return (sessions + 2 * min(spec, sessions)) * shape.num_layers * row_bytes

    sessions = DEFAULT_CPU_SESSIONS
    while sessions > 1 and pool_bytes(sessions) > CPU_STATE_BUDGET_BYTES:
        sessions -= 1
    return sessions


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
    scale: float | None = None, speculative_sessions: int | None = None, memory_share: float = 1.0,
) -> list[tuple[int, Backend]]:
    """One backend per device: every visible GPU (or those in `devices`), or the CPU alone.

    `max_sessions` and `speculative_sessions` are per device; without `max_sessions`, a GPU's
    pool takes `memory_share` of what one process would (several processes share the device).
    Returns (device index, backend).
    """
    device = resolve_device(device)
    if device == "cpu":
        # `--devices 0,1` on the CPU: that many independent CPU shards (pool, table, scheduler each),
        # so multi-device placement and one engine process per device run without a GPU (tests, CI)
        indices = (0,) if devices is None else devices
        if not indices or len(set(indices)) != len(indices) or min(indices) < 0:
            raise ValueError(f"--devices {list(indices)}: device numbers must be >= 0, each named once")
        from gdn_server.backends.cpu import CpuBackend

        sessions = default_cpu_sessions(shape, speculative_sessions)
        return [
            (i, CpuBackend(shape, gates, max_sessions or sessions, scale, speculative_sessions))
            for i in indices
        ]
    count = torch.cuda.device_count()
    indices = tuple(range(count)) if devices is None else devices
    bad = [i for i in indices if not 0 <= i < count]
    if bad or len(set(indices)) != len(indices) or not indices:
        raise ValueError(f"--devices {list(indices)}: this host has CUDA devices 0..{count - 1}, each named once")
    from gdn_server.backends.cuda import CudaBackend

    return [
        (i, CudaBackend(shape, gates, max_sessions, scale, device=f"cuda:{i}", speculative_sessions=speculative_sessions,
                        memory_share=memory_share))
        for i in indices
    ]
