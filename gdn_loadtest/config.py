"""What one load run is asked to do (`LoadConfig`) and what it measured (`RunResult`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["Agreement", "LoadConfig", "RunResult"]


@dataclass(frozen=True)
class LoadConfig:
    target: str
    clients: int
    mode: str = "stream"  # "stream" (DecodeStream) or "unary" (Decode)
    batch: int = 1  # sessions per request
    tokens: int = 1  # T per step
    layers_per_token: int | None = None  # None: all layers
    requests: int | None = None  # total over all clients; or
    duration: float | None = None  # seconds
    dtype: str = "bf16"  # of the inputs on the wire
    seed: int = 0  # of the random inputs
    timeout: float = 30.0
    progress: bool = True  # a progress bar on stderr (where stderr is a terminal)
    # the clients of one load process share one connection (grpc's default for channels alike)
    # instead of each having its own
    shared_connection: bool = False
    verify: bool = False  # check every output against the reference math (gdn_loadtest.verify)
    server_seed: int = 0  # the server's --seed: its gate parameters, for verify
    shared_memory: str = "none"  # tensors inline, or in a "system" or "cuda" region (gdn_loadtest.shm)
    # each step a draft (speculative = true) and, after a pass over the layers, a Commit of a
    # random 0..T of its tokens for each session, as speculative decoding serves a model
    speculative: bool = False


@dataclass(frozen=True)
class Agreement:
    """How close the outputs --verify checked came to the reference math (gdn_loadtest.verify)."""

    outputs: int  # output numbers checked and found within the tolerance
    max_error: float  # the largest |o - expected| as a share of its head's largest |expected|
    max_share: float  # the largest |o - expected| as a share of the error allowed there (<= 1 passes)

    @staticmethod
    def merge(parts: Iterable["Agreement | None"]) -> "Agreement | None":
        """Several clients' agreements as one (None when none checked anything)."""
        found = [p for p in parts if p is not None and p.outputs]
        if not found:
            return None
        return Agreement(sum(p.outputs for p in found), max(p.max_error for p in found),
                         max(p.max_share for p in found))


@dataclass
class RunResult:
    kind: str  # "gdn" or "echo"
    mode: str
    clients: int
    batch: int
    tokens: int
    layers_per_token: int
    steps: int
    errors: int
    elapsed_s: float
    steps_per_s: float
    token_layers_per_s: float
    latency_ms: dict[str, float]
    request_bytes: int
    reply_bytes: int
    server: dict[str, Any] | None = None
    error_samples: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    round: int = 0  # which of --rounds this run belongs to (its echo run has the same)
    host_cpu: dict[str, float] | None = None  # the load host's CPU over the run (Linux; see host_cpu_usage)
    shared_connection: bool = False  # each load process's clients on one connection (LoadConfig)
    # cores the load generator's own processes used over the run (their CPU seconds / elapsed):
    # against host_cpu's busy_cores, what the load took of a host it shares with the server
    load_cores: float | None = None
    verified: bool = False  # every output was checked against the reference math
    speculative: bool = False  # steps were drafts, each pass over the layers settled by Commit (LoadConfig)
    agreement: Agreement | None = None  # with verified: how close the outputs came to it
    # speculative: each pass's Commit round trip (p50/p90/p99/mean/max ms, as latency_ms), apart
    # from the step whose time includes it; None when no pass was committed
    commit_ms: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("latencies_ms")
        return d
