"""CPU backend ("cpu-torch"): the reference the GPU backend is checked against, and the default on
machines without a GPU. The pool's rows (bf16, or fp32 with --state-dtype float32) and their
history rings (float32: the CPU has no use for narrower terms) live in host memory; a plain step
reads the rows' states, folds a row's committed ring entries into its fp32 copy, runs the fp32
math of `torch_math` and writes the states back once (a bf16 state rounded then). A verify runs
the same math from the folded fp32 state, writes no state and appends its tokens' ring terms; a
row whose ring would overflow has its entries folded and written (rounded) first, and the verify
starts from that stored state, as a plain step after the fold would.

The pool's memory grows with the sessions in use, not with capacity, so a CPU server can offer
many sessions and still idle small: rows and their rings are stored in blocks of whole session
slots, each an anonymous memory mapping made when one of its slots is first used. The OS hands it out as zero pages on
first touch, and takes it back whole when the block's last slot in use is reset, whatever malloc
would keep. A row of a block not made reads as zeros, so a free slot holds a zero state as before.
"""
from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep, check_state_dtype
from gdn_server.backends.torch_math import StepWorkspace, exp_lane_aligned, fold_ring
from gdn_server.config import ModelShape
from gdn_server.kernels import folded_base
from gdn_server.kernels._ring_api import RING
from gdn_server.weights import GateParams
from gdn_server.work import INPUT_NAMES, StepBatch

# A launch runs in chunks of rows whose fp32 state fits in this many bytes, each on a StepWorkspace
# kept per (rows, T) over one shared fp32 buffer: a chunk is then ~25 torch calls that allocate
# nothing (32 rows of the 4-value-head test model, 4 of qwen3-next), and its state stays in the
# cache across the three passes a token makes over it; smaller chunks pay for more calls
# (bench/DECISIONS.md, entry 20).
CHUNK_WORK_BYTES = 8 << 20
PLANS_KEPT = 64  # (rows, T) shapes; the oldest goes when more come (rows <= a chunk, T <= 8 in use)

# Every launch runs on one thread: a step makes dozens of parallel calls, each of which wakes a
# passive pool thread (slower at every launch size) or waits for a spinning one that lost its core
# to the event loop; one thread also leaves the other cores to gRPC and the loop
# (bench/DECISIONS.md, entry 20).


# Launches of at least this much state work (rows x T x HV x V x K values) run on a worker thread
# instead of the event loop: milliseconds of work, long enough that blocking the loop would delay
# every other client's messages, and that the thread hand-off is small beside it (bench/DECISIONS.md,
# entry 20). A smaller launch is done when submit returns: a lone client's step has no hand-off.
OFFLOAD_WORK = 4 << 20


class _WorkerStep(PendingStep):
    """A launch running on the CPU backend's worker thread."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def ready(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.exception()  # blocks until done, raises nothing

    def result(self) -> torch.Tensor:
        return self._future.result().result()


# Blocks hold whole session slots, at least this many bytes of them: one slot each for qwen3-next
# (36 MiB a session), many for small test models, so a server of thousands of tiny sessions makes a
# few hundred mappings rather than one each (the kernel allows about 65k per process).
BLOCK_MIN_BYTES = 4 << 20


def _mapped_zeros(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros [rows, *row_shape] of `dtype` in an anonymous mapping of their own: the OS maps zero
    pages on first touch (nothing is written here) and unmaps them when the last tensor on it is freed."""
    values = rows
    for n in row_shape:
        values *= n
    return torch.frombuffer(mmap.mmap(-1, dtype.itemsize * values), dtype=dtype).view(rows, *row_shape)


def cpu_ring_bytes_per_row(shape: ModelShape) -> int:
    """Bytes of one pool row's float32 ring: k [H, RING, K], u [HV, V, RING], G [HV, RING]."""
    s = shape
    return 4 * RING * (s.num_q_heads * s.head_dim_k + s.num_v_heads * s.head_dim_v + s.num_v_heads)


class _Block:
    """One mapping of `slots` whole slots' rows and rings, and which of those slots may hold a state."""

    __slots__ = ("rows", "grouped", "ring_k", "ring_u", "ring_g", "in_use")

    def __init__(self, rows: torch.Tensor, grouped: torch.Tensor, ring: tuple[torch.Tensor, ...]) -> None:
        self.rows = rows  # [slots * L, HV, V, K]
        self.grouped = grouped  # the same rows as StepWorkspace.run writes them: [slots * L, H, HV // H, V, K]
        # [slots * L, H, RING, K], [slots * L, HV, V, RING], [slots * L, HV, RING]; entries past a
        # row's committed ones are never read, so a reset or reused row's ring needs no clearing
        self.ring_k, self.ring_u, self.ring_g = ring
        self.in_use: set[int] = set()  # slots (pool-wide numbers) whose rows were handed out since their reset


class CpuBackend(Backend):
    name = "cpu-torch"

    def __init__(self, shape: ModelShape, gates: GateParams, max_sessions: int, scale: float | None = None) -> None:
        super().__init__(shape, gates, max_sessions, scale)
        H, HV, V, K = shape.num_q_heads, shape.num_v_heads, shape.head_dim_v, shape.head_dim_k
        L = shape.num_layers
        slot_bytes = shape.state_bytes_per_session
        self._slots_per_block = max(1, -(-BLOCK_MIN_BYTES // slot_bytes))
        self._rows_per_block = self._slots_per_block * L
        # a block is made on its first use and dropped when none of its slots is in use
        self._blocks: list[_Block | None] = [None] * -(-(self.pool_rows // L) // self._slots_per_block)
        self._row_shape = (HV, V, K)
        self._grouped_shape = (H, HV // H, V, K)
        self.A_log = gates.A_log.float().contiguous()
        self.dt_bias = gates.dt_bias.float().contiguous()
        # per layer -exp(A_log) and dt_bias side by side [L, 2, HV]: a launch gathers both in one call
        self._gate_params = torch.stack([exp_lane_aligned(self.A_log).neg_(), self.dt_bias], 1)
        self._layer_gates = [(g[0:1][None], g[1:2][None]) for g in self._gate_params]  # [1, 1, HV] each
        self._chunk_rows = max(1, CHUNK_WORK_BYTES // (4 * HV * V * K))
        self._work = torch.empty(self._chunk_rows, HV, V, K, dtype=torch.float32)
        self._plans: dict[tuple[int, int], StepWorkspace] = {}
        self._worker: ThreadPoolExecutor | None = None  # big launches' thread, started on first use
        self._last_offloaded: Future | None = None
        self._row_views: dict[int, torch.Tensor] = {}
        self._ring_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def ring_bytes_per_row(self) -> int:
        return cpu_ring_bytes_per_row(self.shape)

    def _block_for_use(self, row: int) -> _Block:
        """The block of pool row `row`, made if need be, with the row's slot marked in use."""
        index = row // self._rows_per_block
        block = self._blocks[index]
        if block is None:
            n, s = self._rows_per_block, self.shape
            H, HV, V, K = s.num_q_heads, s.num_v_heads, s.head_dim_v, s.head_dim_k
            rows = _mapped_zeros(n, self._row_shape, self.pool_dtype)
            ring = (_mapped_zeros(n, (H, RING, K), torch.float32), _mapped_zeros(n, (HV, V, RING), torch.float32),
                    _mapped_zeros(n, (HV, RING), torch.float32))
            block = self._blocks[index] = _Block(rows, rows.view(n, *self._grouped_shape), ring)
        block.in_use.add(row // self.shape.num_layers)
        return block

    def _row_view(self, row: int) -> torch.Tensor:
        """Pool row `row` as [H, group, V, K], kept until its slot is reset: indexing costs a torch
        call each time."""
        block = self._block_for_use(row)
        view = self._row_views[row] = block.grouped[row % self._rows_per_block]
        return view

    def _ring_view(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pool row `row`'s ring (k, u, G), kept until its slot is reset."""
        view = self._ring_views.get(row)
        if view is None:
            block = self._block_for_use(row)
            i = row % self._rows_per_block
            view = self._ring_views[row] = (block.ring_k[i], block.ring_u[i], block.ring_g[i])
        return view

    def state_bytes_in_use(self) -> int:
        """Bytes of the blocks made, states and rings: what the pool can hold in memory now (at most
        pool_bytes plus a block's rounding)."""
        return sum(block.rows.nbytes + sum(t.nbytes for t in (block.ring_k, block.ring_u, block.ring_g))
                   for block in self._blocks if block is not None)

    def read_rows(self, rows: Sequence[int]) -> torch.Tensor:
        """[len(rows), HV, V, K] copy of pool rows (zeros for a row of a block not made)."""
        out = torch.zeros(len(rows), *self._row_shape, dtype=self.pool_dtype)
        per_block = self._rows_per_block
        for i, row in enumerate(rows):
            block = self._blocks[row // per_block]
            if block is not None:
                out[i].copy_(block.rows[row % per_block])
        return out

    def write_rows(self, rows: Sequence[int], states: torch.Tensor) -> None:
        """Overwrites pool rows from [len(rows), HV, V, K] (a copy_ per row: index_copy_ of bf16 rows
        ran 5x slower)."""
        per_block = self._rows_per_block
        for row, state in zip(rows, states):
            self._block_for_use(row).rows[row % per_block].copy_(state)

    def _plan(self, rows: int, tokens: int) -> StepWorkspace:
        plan = self._plans.get((rows, tokens))
        if plan is None:
            if len(self._plans) >= PLANS_KEPT:
                del self._plans[next(iter(self._plans))]
            s = self.shape
            plan = self._plans[rows, tokens] = StepWorkspace(
                rows, tokens, s.num_q_heads, s.num_v_heads, s.head_dim_v, s.head_dim_k, self.scale,
                work=self._work[:rows],
            )
        return plan

    def submit(self, batch: StepBatch) -> PendingStep:
        """Runs a small launch now; a big one (or any behind one) on the backend's worker thread,
        so the event loop that launched it keeps serving gRPC meanwhile."""
        s = self.shape
        work = batch.num_rows * batch.tokens * s.num_v_heads * s.head_dim_v * s.head_dim_k
        behind = self._last_offloaded is not None and not self._last_offloaded.done()
        if work < OFFLOAD_WORK and not behind:
            return self._step(batch)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="gdn-cpu-step")
        self._last_offloaded = self._worker.submit(self._step, batch)
        return _WorkerStep(self._last_offloaded)

    def synchronize(self) -> None:
        if self._last_offloaded is not None:
            self._last_offloaded.exception()  # waits; a failure is its launch's to report

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _step(self, batch: StepBatch) -> PendingStep:
        R, T = batch.num_rows, batch.tokens
        q, k, v, a, b = (xs[0] if len(xs) == 1 else torch.cat(xs) for xs in map(batch.inputs, INPUT_NAMES))
        if R == 1:
            neg_A, dt_bias = self._layer_gates[batch.layers[0]]
        else:
            gates = self._gate_params.index_select(0, torch.tensor(batch.layers))
            neg_A, dt_bias = gates[:, 0:1], gates[:, 1:2]
        # the pool's rows themselves, read and written one call per row: no gather or scatter pass
        # (index_copy_ of bf16 rows ran 5x slower than a copy_ per row)
        views = self._row_views
        state = [views[row] if row in views else self._row_view(row) for row in batch.rows]
        verify, hist = batch.verify, batch.hist
        rings = [self._ring_view(row) if verify or p else None for row, p in zip(batch.rows, hist)]
        chunk = self._chunk_rows
        # every buffer the launch needs exists before the first state is written (StepWorkspace.run
        # writes a chunk's states in its last calls), so a failure leaves every state unchanged
        plans = [self._plan(min(chunk, R - first), T) for first in range(0, R, chunk)]
        s = self.shape
        out = None if R <= chunk else torch.empty(R, T, s.num_v_heads, s.head_dim_v, dtype=torch.bfloat16)
        # one thread for this step only (see the top of this module): set_num_threads holds for this
        # thread's calls, and is also the count that a thread making its first torch call meanwhile
        # starts with and keeps (slower big calls there, the same results)
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(1)
        try:
            for first, plan in zip(range(0, R, chunk), plans):
                rows = slice(first, first + plan.rows)
                start = self._start_states(plan, state[rows], rings[rows], hist[rows], T if verify else 0)
                o = plan.run(start, None if verify else state[rows], q[rows], k[rows], v[rows], a[rows], b[rows],
                             neg_A[rows], dt_bias[rows])
                if verify:
                    self._append(plan, rings[rows], hist[rows])
                if out is None:
                    return DoneStep(o.to(torch.bfloat16))
                out[rows].copy_(o)
            return DoneStep(out)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def _start_states(self, plan: StepWorkspace, state: list[torch.Tensor], rings: list, hist: list[int],
                      verify_tokens: int) -> list[torch.Tensor]:
        """The states a chunk's tokens start from: a row's pool state, or for a row with committed
        entries that state with them folded, in float32 in the plan's work row (which the step's
        first call then reads in place). A verify whose entries would overflow the ring
        (`verify_tokens` > 0, folded_base 0) writes the fold to the pool first, rounded, and starts
        from what it stored."""
        start = list(state)
        for r, (P, ring) in enumerate(zip(hist, rings)):
            if not P:
                continue
            work = plan.S5[r]
            fold_ring(state[r], *ring, P, work)
            if verify_tokens and folded_base(P, verify_tokens) == 0:
                state[r].copy_(work)
                work.copy_(state[r])
            start[r] = work
        return start

    def _append(self, plan: StepWorkspace, rings: list, hist: list[int]) -> None:
        """A verify chunk's ring terms into its rows' rings: entries [base, base + T), base =
        folded_base(P, T), G continuing from entry base - 1."""
        T = plan.tokens
        G = plan.g.cumsum(1)  # [R, T, HV]: log-decay summed over the verify's tokens
        for r, (P, (ring_k, ring_u, ring_g)) in enumerate(zip(hist, rings)):
            base = folded_base(P, T)
            ring_k[:, base : base + T].copy_(plan.k_in[r].transpose(0, 1))
            ring_u[:, :, base : base + T].copy_(plan.u[:, r].permute(1, 2, 0))
            if base:
                torch.add(G[r].t(), ring_g[:, base - 1 : base], out=ring_g[:, base : base + T])
            else:
                ring_g[:, :T].copy_(G[r].t())

    def fold(self, rows: list[int], hist: list[int]) -> None:
        work = torch.empty(self._grouped_shape, dtype=torch.float32)
        for row, P in zip(rows, hist):
            if P:
                state = self._row_view(row)
                state.copy_(fold_ring(state, *self._ring_view(row), P, work))

    def warmup(self) -> None:
        """A one-row step on zeros outside the pool, so the first request does not pay the one-time
        costs (its plan, the math libraries' first calls, the fp32 buffer's pages)."""
        s = self.shape
        H, HV, V, K = s.num_q_heads, s.num_v_heads, s.head_dim_v, s.head_dim_k
        self._work.zero_()
        state = torch.zeros(1, HV, V, K, dtype=self.pool_dtype)
        qk, v, ab = torch.zeros(1, 1, H, K), torch.zeros(1, 1, HV, V), torch.zeros(1, 1, HV)
        self._plan(1, 1).run(state, state.view(1, H, HV // H, V, K), qk, qk, v, ab, ab, *self._layer_gates[0])

    def _session_rows(self, session_slot: int) -> range:
        L = self.shape.num_layers
        return range(session_slot * L, (session_slot + 1) * L)

    def reset_session(self, session_slot: int) -> None:
        rows = self._session_rows(session_slot)
        index = rows[0] // self._rows_per_block
        block = self._blocks[index]
        if block is None or session_slot not in block.in_use:
            return  # never handed out since its last reset: already zero
        for row in rows:
            self._row_views.pop(row, None)
            self._ring_views.pop(row, None)
        block.in_use.discard(session_slot)
        if block.in_use:
            first = rows[0] % self._rows_per_block
            block.rows[first:first + len(rows)].zero_()
        else:
            self._blocks[index] = None  # its mapping goes back to the OS with the last view of it

    def copy_session(self, src_slot: int, dst_slot: int) -> None:
        src = self._session_rows(src_slot)
        block = self._blocks[src[0] // self._rows_per_block]
        if block is None or src_slot not in block.in_use:
            self.reset_session(dst_slot)  # a zero state: no memory for it
        else:
            self.write_rows(self._session_rows(dst_slot), self.read_rows(src))

    def read_session(self, session_slot: int) -> torch.Tensor:
        return self.read_rows(self._session_rows(session_slot))

    def write_session(self, session_slot: int, state: torch.Tensor) -> None:
        check_state_dtype(state, self.pool_dtype)
        self.write_rows(self._session_rows(session_slot), state)
