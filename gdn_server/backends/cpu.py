"""CPU backend ("cpu-torch"): the reference the GPU backend is checked against, and the default on
machines without a GPU. The pool's rows (bf16, or fp32 with --state-dtype float32) live in host
memory; each step reads the rows' states from it, runs the fp32 math of `torch_math` and writes
them back once (a bf16 state rounded then).

The pool's memory grows with the sessions in use, not with capacity, so a CPU server can offer
many sessions and still idle small: rows are stored in blocks of whole session slots (the
speculative scratch rows after the sessions' count as slots of L rows too), each an anonymous
memory mapping made when one of its slots is first used. The OS hands it out as zero pages on
first touch, and takes it back whole when the block's last slot in use is reset, whatever malloc
would keep. A row of a block not made reads as zeros, so a free slot holds a zero state as before.
"""
from __future__ import annotations

import mmap
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from gdn_server.backends.base import Backend, DoneStep, PendingStep, check_state_dtype, check_unchecked_inputs
from gdn_server.backends.torch_math import StepWorkspace, exp_lane_aligned
from gdn_server.config import ModelShape
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


class _Block:
    """One mapping of `slots` whole slots' rows, and which of those slots may hold a state."""

    __slots__ = ("rows", "grouped", "in_use")

    def __init__(self, rows: torch.Tensor, grouped: torch.Tensor) -> None:
        self.rows = rows  # [slots * L, HV, V, K]
        self.grouped = grouped  # the same rows as StepWorkspace.run writes them: [slots * L, H, HV // H, V, K]
        self.in_use: set[int] = set()  # slots (pool-wide numbers) whose rows were handed out since their reset


class CpuBackend(Backend):
    name = "cpu-torch"

    def __init__(
        self, shape: ModelShape, gates: GateParams, max_sessions: int, scale: float | None = None,
        speculative_sessions: int | None = None,
    ) -> None:
        super().__init__(shape, gates, max_sessions, scale, speculative_sessions)
        H, HV, V, K = shape.num_q_heads, shape.num_v_heads, shape.head_dim_v, shape.head_dim_k
        L = shape.num_layers
        slot_bytes = shape.state_bytes_per_session
        self._slots_per_block = max(1, -(-BLOCK_MIN_BYTES // slot_bytes))
        self._rows_per_block = self._slots_per_block * L
        # slots of L rows over the whole pool: the sessions' own, then the scratch rows' (pool_rows is
        # a multiple of L); a block is made on its first use and dropped when none of its slots is
        # in use (scratch slots stay in use: their rows are taken and given back without a reset)
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

    def _block_for_use(self, row: int) -> _Block:
        """The block of pool row `row`, made if need be, with the row's slot marked in use."""
        index = row // self._rows_per_block
        block = self._blocks[index]
        if block is None:
            rows = _mapped_zeros(self._rows_per_block, self._row_shape, self.pool_dtype)
            block = self._blocks[index] = _Block(rows, rows.view(self._rows_per_block, *self._grouped_shape))
        block.in_use.add(row // self.shape.num_layers)
        return block

    def _row_view(self, row: int) -> torch.Tensor:
        """Pool row `row` as [H, group, V, K], kept until its slot is reset: indexing costs a torch
        call each time."""
        block = self._block_for_use(row)
        view = self._row_views[row] = block.grouped[row % self._rows_per_block]
        return view

    def state_bytes_in_use(self) -> int:
        """Bytes of the blocks made: what the pool can hold in memory now (at most pool_bytes plus a
        block's rounding)."""
        return sum(block.rows.nbytes for block in self._blocks if block is not None)

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
        check_unchecked_inputs(batch)  # before anything runs: NonFiniteInputs changes nothing
        s = self.shape
        work = batch.rows * batch.tokens * s.num_v_heads * s.head_dim_v * s.head_dim_k
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
        R, T = batch.rows, batch.tokens
        q, k, v, a, b = (xs[0] if len(xs) == 1 else torch.cat(xs) for xs in map(batch.inputs, INPUT_NAMES))
        if R == 1:
            neg_A, dt_bias = self._layer_gates[batch.layers[0]]
        else:
            gates = self._gate_params.index_select(0, torch.tensor(batch.layers))
            neg_A, dt_bias = gates[:, 0:1], gates[:, 1:2]
        # the pool's rows themselves, read and written one call per row: no gather or scatter pass
        # (index_copy_ of bf16 rows ran 5x slower than a copy_ per row)
        views = self._row_views
        state = [views[slot] if slot in views else self._row_view(slot) for slot in batch.read_rows]
        new_state = [views[slot] if slot in views else self._row_view(slot) for slot in batch.write_rows]
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
            if out is None:
                o = plans[0].run(state, new_state, q, k, v, a, b, neg_A, dt_bias)
                return DoneStep(o.to(torch.bfloat16))
            for first, plan in zip(range(0, R, chunk), plans):
                rows = slice(first, first + plan.rows)
                o = plan.run(state[rows], new_state[rows], q[rows], k[rows], v[rows], a[rows], b[rows],
                             neg_A[rows], dt_bias[rows])
                out[rows].copy_(o)
            return DoneStep(out)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

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

    def copy_rows(self, src_rows: list[int], dst_rows: list[int]) -> None:
        # gathered first, so a row that is both copied and overwritten is copied as it was
        self.write_rows(dst_rows, self.read_rows(src_rows))
