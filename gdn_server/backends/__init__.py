"""Backends behind one interface (`Backend`): `cpu` (torch) and `cuda` (CuTe DSL kernel)."""
from __future__ import annotations

import logging
import os

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep
from gdn_server.config import ModelShape
from gdn_server.weights import GateParams

__all__ = ["Backend", "DoneStep", "PendingStep", "default_cpu_sessions", "make_backends", "resolve_device"]

log = logging.getLogger(__name__)

# The CPU backend's default session count: DEFAULT_CPU_SESSIONS, or fewer where the pool in full
# use (every session's states and their history rings) would not fit in CPU_STATE_MEMORY_SHARE of
# the host's memory (a container's memory limit counts as the host's), at least 1. The CPU pool
# takes memory only for the sessions in use (gdn_server/backends/cpu.py), so an idle server stays
# small whatever its capacity, and capacity is bounded by what those sessions may grow to: 256
# qwen3-next sessions with their fp32 rings are 12.4 GiB, so a host of 24.8 GiB or more offers all
# 256, one of 16 GiB 165 and one of 8 GiB 82 (an fp32 state, --state-dtype float32, offers fewer).
# --max-sessions sets any other count.
DEFAULT_CPU_SESSIONS = 256
CPU_STATE_MEMORY_SHARE = 0.5


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit where that is lower (in a container)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            memory = min(memory, int(text))
    return memory


def default_cpu_sessions(shape: ModelShape, memory_bytes: int | None = None) -> int:
    """The CPU backend's session count when none is configured (see DEFAULT_CPU_SESSIONS), for a
    host of `memory_bytes` (default: this one's, host_memory_bytes)."""
    budget = CPU_STATE_MEMORY_SHARE * (host_memory_bytes() if memory_bytes is None else memory_bytes)
    from gdn_server.backends.cpu import cpu_ring_bytes_per_row

    per_session = shape.state_bytes_per_session + shape.num_layers * cpu_ring_bytes_per_row(shape)  # Backend.pool_bytes
    return max(1, min(DEFAULT_CPU_SESSIONS, int(budget // per_session)))


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
    scale: float | None = None, memory_share: float = 1.0,
) -> list[tuple[int, Backend]]:
    """One backend per device: every visible GPU (or those in `devices`), or the CPU alone.

    `max_sessions` is per device; without `max_sessions`, a GPU's
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

        sessions = max_sessions or default_cpu_sessions(shape)
        return [(i, CpuBackend(shape, gates, sessions, scale)) for i in indices]
    count = torch.cuda.device_count()
    indices = tuple(range(count)) if devices is None else devices
    bad = [i for i in indices if not 0 <= i < count]
    if bad or len(set(indices)) != len(indices) or not indices:
        raise ValueError(f"--devices {list(indices)}: this host has CUDA devices 0..{count - 1}, each named once")
    from gdn_server.backends.cuda import CudaBackend

    return [
        (i, CudaBackend(shape, gates, max_sessions, scale, device=f"cuda:{i}", memory_share=memory_share))
        for i in indices
    ]
