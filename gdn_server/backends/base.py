"""The backend interface: a pool of states with their history rings, and the decode step over a StepBatch.

A backend owns the state pool [num_sessions * L, HV, V, K] (K fastest; bf16 or fp32, the shape's
`state_dtype`, `pool_dtype` as a torch dtype), a history ring of RING entries per pool row, and
A_log/dt_bias [L, HV]. `submit` starts one call over a batch of rows that share T and returns a
handle whose `result()` is the bf16 output [rows, T, HV, V] on the CPU.

The ring (the bookkeeping is the session table's, gdn_server.sessions): entry i of a row holds
k_i (the normalized k of token i), u_i = beta_i (v_i - e^{g_i} S_{i-1} k_i) and G_i, the log-decay
summed since the ring's start, so that the state with a row's first P entries applied is

    S_P = e^{G_P} S_0 + sum_{i<P} e^{G_P - G_i} u_i k_i^T

A verify batch (`StepBatch.verify`) answers from that state without writing it and appends
its T tokens' entries at base = folded_base(P, T); a fold writes S_P into the state (rounded to
the pool dtype then, and only then). Where a backend's verify with the fold amortized costs less
than its plain step, `ring_min_rows` says from how many rows a launch of plain steps runs as a
verify, each row's entries committed at once (gdn_server.planner). The scheduler keeps a few
handles in flight (scheduler.LOOP_MAX_IN_FLIGHT at most), so a backend may overlap the next
batches' assembly with this one's run.
State-changing session operations (`reset`, `copy`, `read`, `write`, `fold`) are only called
when no step is in flight.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gdn_server.config import ModelShape
from gdn_server.weights import GateParams
from gdn_server.work import StepBatch


class PendingStep(ABC):
    @abstractmethod
    def result(self) -> torch.Tensor:
        """Blocks until the step is done; returns bf16 [rows, T, HV, V] on the CPU, valid until
        LOOP_MAX_IN_FLIGHT (4) more steps have been submitted (callers copy what they keep)."""

    def result_bytes(self) -> memoryview:
        """`result()` as flat bytes (bf16, row-major), valid as long as the result is. A backend
        that reuses its output buffers overrides this with a view made once per buffer, so that a
        launch's answers do not pay this default's three torch calls on the event loop."""
        return memoryview(self.result().view(torch.uint8).reshape(-1).numpy())

    def ready(self) -> bool:
        """True once `result()` would not block (a scheduler on an event loop polls this)."""
        return True

    def kept_outputs(self) -> dict[int, memoryview]:
        """Once done: outputs of requests whose o the launch wrote into their own memory (a
        DeviceSpan o_ref) that it also copied apart from its reused buffers, by the request's
        first row: what a retry of such a step is answered from (`result()` need not hold those
        rows). None here."""
        return {}

    def wait(self) -> None:
        """Blocks until `result()` would not block, without holding the GIL where it can."""
        self.result()


class DoneStep(PendingStep):
    """A step that completed synchronously."""

    def __init__(self, out: torch.Tensor) -> None:
        self._out = out

    def result(self) -> torch.Tensor:
        return self._out


def check_state_dtype(state: torch.Tensor, pool_dtype: torch.dtype) -> None:
    """ValueError unless `state` is of the pool's dtype (what `Backend.write_session` takes)."""
    if state.dtype != pool_dtype:
        raise ValueError(f"a state of {state.dtype} cannot be written to a pool of {pool_dtype}")


class Backend(ABC):
    name: str  # "cpu-torch" or "cuda-cute"
    device_name: str = "cpu"  # what ModelInfo.devices reports
    # A launch of plain steps with at least this many rows runs as a verify (its entries committed
    # at once, the fold amortized over the ring's 16 entries), and so does a smaller one whose rows
    # have entries committed and room for its tokens (gdn_server.planner); None: plain steps always
    # write the states. Set where it measures faster at every T from that many rows on.
    ring_min_rows: int | None = None

    def __init__(self, shape: ModelShape, gates: GateParams, max_sessions: int, scale: float | None) -> None:
        if gates.A_log.shape != (shape.num_layers, shape.num_v_heads):
            raise ValueError(
                f"gate params are {list(gates.A_log.shape)}, model needs [{shape.num_layers}, {shape.num_v_heads}]"
            )
        self.shape = shape
        self.pool_dtype: torch.dtype = getattr(torch, shape.state_dtype)
        self.max_sessions = max_sessions
        self.scale = shape.default_scale if scale is None else float(scale)
        # one pool row per (session slot, layer): row slot * L + layer, each with its ring
        self.pool_rows = max_sessions * shape.num_layers

    def ring_bytes_per_row(self) -> int:
        """Bytes of one pool row's history ring: the device ring's (`kernels.ring_dtypes` beside the
        pool's state dtype), unless a backend stores its ring otherwise."""
        from gdn_server.kernels import ring_bytes_per_row

        return ring_bytes_per_row(self.shape.num_q_heads, self.shape.num_v_heads, self.shape.state_dtype)

    @property
    def pool_bytes(self) -> int:
        """The pool's bytes in full use: every row's state and ring."""
        return self.pool_rows * (self.shape.state_bytes_per_session // self.shape.num_layers + self.ring_bytes_per_row())

    @abstractmethod
    def submit(self, batch: StepBatch) -> PendingStep:
        """Starts one call over all rows of `batch` (distinct pool rows, one T). A plain batch
        folds each row's `hist` entries into its state first (rows with none are read as they
        are), then runs the step, which writes the states. A verify batch (`batch.verify`)
        answers from each state with its `hist` entries applied and writes only ring entries
        [base, base + T), base = folded_base(P, T): a row whose P + T entries would overflow its
        ring folds them into its state first, in the same call. Inputs come checked for NaN/Inf
        (gdn_server.validation, where they enter)."""

    @abstractmethod
    def fold(self, rows: list[int], hist: list[int]) -> None:
        """Folds each row's first hist[i] ring entries into its state (rows with hist 0 are left
        untouched), before anything submitted later runs; a read of the state that follows sees them."""

    @abstractmethod
    def reset_session(self, session_slot: int) -> None:
        """Zeroes a session's state at every layer."""

    @abstractmethod
    def copy_session(self, src_slot: int, dst_slot: int) -> None:
        """Copies a session's state at every layer (fork)."""

    @abstractmethod
    def read_session(self, session_slot: int) -> torch.Tensor:
        """[L, HV, V, K] copy of a session's state in `pool_dtype`, on the CPU."""

    @abstractmethod
    def write_session(self, session_slot: int, state: torch.Tensor) -> None:
        """Overwrites a session's state from [L, HV, V, K] in `pool_dtype` (ValueError for another
        dtype: a state of another dtype is converted on purpose where it enters, never here)."""

    def warmup(self) -> None:
        """Prepares everything a first step would otherwise pay for (kernel compiles)."""

    def synchronize(self) -> None:
        """Waits for all queued device work."""

    def device_problem(self) -> str | None:
        """Why the device cannot run work any more (asked after a launch failed), or None while it can."""
        return None

    def close(self) -> None:
        """Releases device resources."""
