"""Model shapes and server settings, as plain frozen dataclasses."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TOKENS_PER_STEP = 4
MAX_SPECULATIVE_TOKENS = 8  # draft tokens of one speculative step
# Every server process runs several Python threads (gRPC's poller, the event loop, schedulers):
# a thread woken by I/O would otherwise wait up to 5 ms (Python's default) for a busy one to
# yield the GIL. Set by `gdn-server` and by each --frontends worker.
GIL_SWITCH_INTERVAL_S = 0.0002


@dataclass(frozen=True)
class ModelShape:
    """Shapes of the GDN layers served. Value head j reads query/key head j // (HV // H)."""

    num_layers: int
    num_q_heads: int  # H
    num_v_heads: int  # HV
    head_dim_k: int = 128  # K
    head_dim_v: int = 128  # V
    max_tokens_per_step: int = MAX_TOKENS_PER_STEP
    max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_q_heads", "num_v_heads", "head_dim_k", "head_dim_v"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_v_heads % self.num_q_heads:
            raise ValueError(
                f"value heads ({self.num_v_heads}) must be a multiple of query heads ({self.num_q_heads})"
            )

    @property
    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_k)

    @property
    def state_bytes_per_session(self) -> int:
        """bf16 state of one session over all layers and value heads."""
        return 2 * self.num_layers * self.num_v_heads * self.head_dim_v * self.head_dim_k


PRESETS: dict[str, ModelShape] = {
    # Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers (of 48), 16 q/k heads, 32 value heads, 128-dim heads
    "qwen3-next": ModelShape(num_layers=36, num_q_heads=16, num_v_heads=32, head_dim_k=128, head_dim_v=128),
}


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_rows: int = 1024  # rows (session x layer) per backend call at most
    max_queue_delay_us: int = 0  # extra wait for more work once something is pending
    max_queue_rows: int = 8192  # rows waiting for the device at most; more is refused with UNAVAILABLE
    # where rounds run: "loop" (callbacks on the server's event loop: no thread hand-offs; for
    # backends whose steps run on a device), "thread" (a thread of its own: for backends that
    # compute on the host) or "auto" (loop when the backend is asynchronous, else thread)
    runs_on: str = "auto"
    # with rounds on the event loop, how it waits for a launch: "inline" (the round that launches
    # waits for the device and answers: no pipelining, but a request is answered one round
    # sooner), "poll" (the round returns; an event query once per loop iteration: the loop never
    # sleeps while a launch runs), "thread" (a waiter thread blocks on the launch and wakes the
    # loop) or "auto": inline in an engine behind --frontends workers (no decode RPCs on its
    # loop) of one device; where the loop serves clients' gRPC, which must never wait on the
    # device, poll while it serves one request at a time and the thread once launches carry
    # several (polling would take the loop's time from them)
    device_wait: str = "auto"
    # with rounds on the event loop: after answering, the loop keeps polling (never sleeps) this
    # long for the next request; costs a core while clients keep it busy (gdn_server.busy_poll).
    # 0: the loop sleeps whenever it is idle. On the H200 host a 1 ms window cut one client's p50
    # by 13-24% (a step run with the caches warm) and left 64 clients even (bench/NOTES.md,
    # eighteenth session); an idle server still sleeps once the window has passed
    busy_poll_us: int = 1000
    # under load, a round waits until the queue holds this share of the rows in circulation
    # (estimated from the launch rate and each session's time between steps; gdn_server.batch_fill),
    # for at most batch_fill_max_us after its oldest request. One client stepping alone is never
    # held. 0: off. Off by default: a client with work of its own between steps (a model's other
    # layers) would wait out holds on its critical path; on the H200, one process at 64 closed-loop
    # clients, 0.5 gave 42 rows per launch against 28-32 and as many steps/s (bench/NOTES.md,
    # twenty-second session). The cap: half of a 64-client cycle there (~6 ms)
    batch_fill: float = 0.0
    batch_fill_max_us: int = 3000
    # no hold while fewer rows than this are in circulation: at 8 clients the loop has time to
    # spare and a hold cost one process 2-13% of its steps/s on the H200 (bench/NOTES.md,
    # twenty-third session); from 64 up it is saturated and a hold cost nothing. Between the two.
    batch_fill_min_rows: int = 32

    def __post_init__(self) -> None:
        if self.runs_on not in SCHEDULER_RUNS_ON:
            raise ValueError(f"runs_on must be one of {', '.join(SCHEDULER_RUNS_ON)}, got {self.runs_on!r}")
        if self.device_wait not in DEVICE_WAIT:
            raise ValueError(f"device_wait must be one of {', '.join(DEVICE_WAIT)}, got {self.device_wait!r}")
        if self.busy_poll_us < 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {self.busy_poll_us}")
        if not 0.0 <= self.batch_fill <= 1.0:
            raise ValueError(f"batch_fill must be in [0, 1], got {self.batch_fill}")
        if self.batch_fill_max_us < 0:
            raise ValueError(f"batch_fill_max_us must be >= 0, got {self.batch_fill_max_us}")
        if self.batch_fill_min_rows < 0:
            raise ValueError(f"batch_fill_min_rows must be >= 0, got {self.batch_fill_min_rows}")


SCHEDULER_RUNS_ON = ("auto", "loop", "thread")
DEVICE_WAIT = ("auto", "poll", "thread", "inline")
