"""Model shapes and server settings, as plain frozen dataclasses."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

MAX_TOKENS_PER_STEP = 4
MAX_SPECULATIVE_TOKENS = 8  # draft tokens of one speculative step
# The state pool's element types (--state-dtype) and their bytes. bfloat16 is the default: half the
# memory and half the device time of a step of float32, which some models' serving configs ask for
# (docs/operations.md, --state-dtype).
STATE_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
DEFAULT_STATE_DTYPE = "bfloat16"
# A server process runs several Python threads (gRPC's poller, the event loop, a scheduler
# thread on the CPU, a device waiter): a thread woken by I/O would otherwise wait up to 5 ms
# (Python's default) for a busy one to yield the GIL (bench/DECISIONS.md, entry 10).
GIL_SWITCH_INTERVAL_S = 0.0002
# gRPC's I/O for the connections a server accepts: with gRPC's default listener (EventEngine), a
# message's bytes are read on an EventEngine thread and handed to the thread that polls grpc.aio's
# completion queue, which wakes the event loop: one thread wake-up more each way than the older
# path, where the completion-queue thread reads the socket itself (bench/DECISIONS.md, entry 12).
# gRPC reads the choice from GRPC_EXPERIMENTS when it loads, so `gdn-server`'s entry point sets it
# before grpc is imported (importing the package sets nothing); an operator's own GRPC_EXPERIMENTS
# wins.
GRPC_EXPERIMENTS = "-event_engine_listener"
# torch's OpenMP threads (a big request's staging copies and NaN/Inf check, the CPU backend's big
# launches) spin after each parallel region by default, taking the cores that gRPC's threads and the
# event loop need (bench/DECISIONS.md, entry 11). OpenMP reads OMP_WAIT_POLICY when torch loads, so
# `gdn-server`'s entry point sets it before torch is imported; an operator's own value wins. (CPU
# launches run on one thread and never wake the pool: gdn_server/backends/cpu.py.)
OMP_WAIT_POLICY = "PASSIVE"


@dataclass(frozen=True)
class ModelShape:
    """Shapes of the GDN layers served and of their states. Value head j reads query/key head
    j // (HV // H)."""

    num_layers: int
    num_q_heads: int  # H
    num_v_heads: int  # HV
    head_dim_k: int = 128  # K
    head_dim_v: int = 128  # V
    max_tokens_per_step: int = MAX_TOKENS_PER_STEP
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS
    state_dtype: str = DEFAULT_STATE_DTYPE  # element type of the states held: a key of STATE_DTYPE_BYTES

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_v_heads", "head_dim_k", "head_dim_v"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.state_dtype not in STATE_DTYPE_BYTES:
            raise ValueError(f"state dtype must be one of {', '.join(STATE_DTYPE_BYTES)}, got {self.state_dtype!r}")
        if self.num_v_heads % self.num_q_heads:
            raise ValueError(
                f"value heads ({self.num_v_heads}) must be a multiple of query heads ({self.num_q_heads})"
            )

    @property
    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_k)

    @property
    def state_element_bytes(self) -> int:
        return STATE_DTYPE_BYTES[self.state_dtype]

    @property
    def state_bytes_per_session(self) -> int:
        """The state of one session over all layers and value heads, in the state dtype."""
        return self.state_element_bytes * self.num_layers * self.num_v_heads * self.head_dim_v * self.head_dim_k



def default_kernel_cache() -> Path:
    """Where a CUDA server keeps its compiled kernels (`gdn-server --kernel-cache`):
    `$XDG_CACHE_HOME/gdn-serve/kernels`, else `~/.cache/gdn-serve/kernels`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdn-serve" / "kernels"

PRESETS: dict[str, ModelShape] = {
    # Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers (of 48), 16 q/k heads, 32 value heads, 128-dim heads
    "qwen3-next": ModelShape(num_layers=36, num_q_heads=16, num_v_heads=32, head_dim_k=128, head_dim_v=128),
}


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_rows: int = 1024  # rows (session x layer) per launch at most
    max_queue_delay_us: int = 0  # extra wait for more work once something is pending
    max_queue_rows: int = 8192  # rows waiting for the device at most; more is refused with UNAVAILABLE
