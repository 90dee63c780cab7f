"""CpuBackend's step against the fp64 reference (tests/reference.py), in process.

Random states and inputs; several rows, T from 1 to the speculative 8, value heads grouped over
query heads, rows of different layers in one launch; verifies over the history ring with random
accepts, folds where the ring overflows, plain steps that fold it. And a row's output and new
state are bitwise the same whether it runs alone or with other rows: the scheduler batches rows
of unrelated clients, and a client's numbers must not depend on who else was served with it.
"""
from __future__ import annotations

import pytest
import torch

from gdn_server.backends import default_cpu_sessions
import random

from gdn_server.backends.cpu import CpuBackend
from gdn_server.backends.torch_math import StepWorkspace, exp_lane_aligned
from gdn_server.config import PRESETS, ModelShape
from gdn_server.kernels import folded_base
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork, StepBatch
from reference import gdn_reference_step, rel_err


def _backend(shape: ModelShape, seed: int = 0, sessions: int = 8) -> CpuBackend:
    backend = CpuBackend(shape, random_gate_params(shape, seed), sessions)
    gen = torch.Generator().manual_seed(seed)
    rows = _pool(backend).shape
    backend.write_rows(range(backend.pool_rows), 0.1 * torch.randn(rows, generator=gen))
    return backend


def _pool(backend: CpuBackend) -> torch.Tensor:
    """A copy of every row of the backend's pool."""
    return backend.read_rows(range(backend.pool_rows))


def _work(shape: ModelShape, layer: int, rows: int, T: int, gen: torch.Generator, dtype=torch.bfloat16) -> DecodeWork:
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v

    def r(*dims):
        return torch.randn(*dims, generator=gen).to(dtype)

    return DecodeWork(layer, tuple(f"s{i}" for i in range(rows)),
                      q=r(rows, T, H, K), k=r(rows, T, H, K), v=r(rows, T, HV, V), a=r(rows, T, HV), b=r(rows, T, HV))


def _reference(backend: CpuBackend, batch: StepBatch, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [rows, T, HV, V], new states [rows, HV, V, K]) in fp64, from the pool as it was."""
    x = {name: torch.cat([getattr(w, name) for w in batch.works]).float() for name in "qkvab"}
    layers = torch.tensor(batch.layers)
    return gdn_reference_step(
        before[torch.tensor(batch.rows)].float(), x["q"], x["k"], x["v"], x["a"], x["b"],
        backend.A_log[layers], backend.dt_bias[layers], backend.scale,
    )


@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("heads", [(1, 1), (2, 4), (1, 4), (16, 32)], ids=["mha1", "gqa2", "gqa4", "qwen3-next"])
def test_matches_the_fp64_reference(heads, T):
    """Requests of several rows at different layers in one launch, in every input dtype."""
    H, HV = heads
    shape = ModelShape(num_layers=3, num_q_heads=H, num_v_heads=HV)
    backend = _backend(shape, seed=T)
    gen = torch.Generator().manual_seed(100 * H + T)
    batch = StepBatch(T)
    session = iter(range(backend.max_sessions))
    for r, (layer, rows) in enumerate([(0, 1), (2, 3), (1, 2), (2, 1)]):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[r % 3]
        slots = [next(session) * shape.num_layers + layer for _ in range(rows)]
        batch.add(_work(shape, layer, rows, T, gen, dtype), slots, [0] * rows)
    before = _pool(backend)
    out = backend.submit(batch).result()
    o_ref, s_ref = _reference(backend, batch, before)
    assert out.dtype == torch.bfloat16 and out.shape == (batch.num_rows, T, HV, shape.head_dim_v)
    # bf16 output rounding alone is ~2e-3 (relative, as a norm); the fp32 math adds ~1e-7
    assert rel_err(out, o_ref) < 2.5e-3
    new = backend.read_rows(batch.rows)
    assert rel_err(new, s_ref) < 2.5e-3
    # rounded once: each element is the fp64 state rounded to bf16 or its neighbour, but for the
    # fp32 math's absolute error on elements near 0 (cancellations)
    slack = s_ref.abs() * 2 ** -7 + 1e-7 * s_ref.abs().max()
    assert (new.double() - s_ref.to(torch.bfloat16).double()).abs().le(slack).all()
    untouched = torch.ones(backend.pool_rows, dtype=torch.bool)
    untouched[torch.tensor(batch.rows)] = False
    assert torch.equal(_pool(backend)[untouched], before[untouched])


def test_a_row_is_bitwise_the_same_alone_or_in_any_launch():
    """40 one-row requests (of both layers), each alone and in launches of 3, 16, 17, 33 and all 40
    rows (more than a chunk of 32): the same bits. Many rows and tokens, because a gate that
    differs in its last bit (torch computes a few elements of a call on a scalar path) reaches the
    bf16 results only now and then."""
    shape = ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4)
    n = 40
    for T in (1, 3, 8):
        gen = torch.Generator().manual_seed(T)
        works = [_work(shape, i % 2, 1, T, gen) for i in range(n)]
        slots = [i * shape.num_layers + w.layer for i, w in enumerate(works)]
        results = {}
        for size in (1, 3, 16, 17, 33, n):
            backend = _backend(shape, seed=1, sessions=n)
            outs = []
            for first in range(0, n, size):
                batch = StepBatch(T)
                for i in range(first, min(first + size, n)):
                    batch.add(works[i], [slots[i]], [0])
                outs.append(backend.submit(batch).result().clone())
            results[size] = (torch.cat(outs), backend.read_rows(slots))
        out0, state0 = results[1]
        for size, (out, state) in results.items():
            for i in range(n):
                assert torch.equal(out[i], out0[i]), (T, size, i)
                assert torch.equal(state[i], state0[i]), (T, size, i)


def test_steps_chain_like_the_reference():
    """Ten steps of one session, T cycling 1..4: the bf16 state carried between steps drifts no
    further from an fp64 reference that rounds its state to bf16 after each step too."""
    shape = ModelShape(num_layers=1, num_q_heads=2, num_v_heads=4)
    backend = _backend(shape, seed=3, sessions=1)
    gen = torch.Generator().manual_seed(3)
    state = backend.read_rows([0]).float()
    for step in range(10):
        T = step % 4 + 1
        batch = StepBatch(T)
        batch.add(_work(shape, 0, 1, T, gen), [0], [0])
        out = backend.submit(batch).result()
        w = batch.works[0]
        o_ref, state = gdn_reference_step(state, w.q.float(), w.k.float(), w.v.float(), w.a.float(), w.b.float(),
                                          backend.A_log[:1], backend.dt_bias[:1], backend.scale)
        state = state.to(torch.bfloat16).float()
        assert rel_err(out, o_ref) < 2.5e-3, step
        assert rel_err(backend.read_rows([0]), state) < 2.5e-3, step


def test_the_workspace_step_on_an_fp32_state_matches_the_reference():
    """StepWorkspace.run, the CPU backend's math, on fp32 states [B, HV, V, K] updated in place:
    within fp32 rounding of the float64 reference (the backend's pool tests allow bf16's)."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, HV, K = 3, 4, 2, 4, 128
    state = 0.1 * torch.randn(B, HV, K, K, generator=gen)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, K, generator=gen)
    a, b = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    A_log, dt_bias = torch.rand(B, HV, generator=gen) * 2.7, torch.randn(B, HV, generator=gen) - 4
    o_ref, s_ref = gdn_reference_step(state, q, k, v, a, b, A_log, dt_bias, K ** -0.5)
    work = StepWorkspace(B, T, H, HV, K, K, K ** -0.5, state.device, state, 1.0, 20.0)
    neg_A = exp_lane_aligned(A_log).neg_()
    o = work.run(state, work.S5, q, k, v, a, b, neg_A[:, None, :], dt_bias[:, None, :])
    assert rel_err(o, o_ref) < 1e-5 and rel_err(state, s_ref) < 1e-5


class _RingModel:
    """What the bookkeeping above the backend keeps per row (P, an open draft), and the fp64
    state each row logically holds: the pool state with its committed entries applied, rounded
    to the pool's dtype where the backend writes a fold."""

    def __init__(self, backend: CpuBackend, rows: list[int]) -> None:
        self.backend = backend
        self.rows = rows
        self.hist = {row: 0 for row in rows}
        self.state = {row: backend.read_rows([row]).double() for row in rows}  # logical, committed
        self.draft: dict[int, tuple[int, list[torch.Tensor]]] = {}  # row -> (base, logical state after each token)

    def step(self, rows: list[int], layer: int, T: int, gen: torch.Generator, speculative: bool) -> None:
        b = self.backend
        work = _work(b.shape, layer, len(rows), T, gen)
        batch = StepBatch(T, verify=speculative)
        hist = [self.launch_hist(row) for row in rows]
        batch.add(work, rows, hist)
        pool = b.read_rows(rows)
        out = b.submit(batch).result()
        for i, (row, P) in enumerate(zip(rows, hist)):
            start = self.accepted(row)
            if speculative and P and not folded_base(P, T):  # folded into the pool first: rounded
                start = start.to(b.pool_dtype).double()
            x = {name: getattr(work, name)[i : i + 1].double() for name in "qkvab"}
            states = []
            s = start
            for t in range(T):
                o_ref, s = gdn_reference_step(s, *(x[n][:, t : t + 1] for n in "qkvab"), b.A_log[[layer]],
                                              b.dt_bias[[layer]], b.scale)
                assert rel_err(out[i : i + 1, t : t + 1], o_ref) < 2.5e-3, (row, P, T, t)
                states.append(s)
            if speculative:
                base = folded_base(P, T)
                if base or not P:  # no fold: the verify leaves the state alone
                    assert torch.equal(b.read_rows([row]), pool[i : i + 1]), (row, P, T)
                self.draft[row] = (base, states)
                self.state[row] = start
                self.hist[row] = base
            else:
                self.draft.pop(row, None)
                self.state[row] = states[-1].to(b.pool_dtype).double()
                self.hist[row] = 0
                assert rel_err(b.read_rows([row]), self.state[row]) < 2.5e-3

    def launch_hist(self, row: int) -> int:
        if row in self.draft:
            base, states = self.draft[row]
            return base + len(states)
        return self.hist[row]

    def accepted(self, row: int) -> torch.Tensor:
        """The logical state a next step starts from (an open draft accepted whole)."""
        if row in self.draft:
            return self.draft[row][1][-1]
        return self.state[row]

    def commit(self, row: int, n: int) -> None:
        base, states = self.draft.pop(row)
        self.hist[row] = base + n
        if n:
            self.state[row] = states[n - 1]


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
def test_verifies_with_random_accepts_fold_where_the_ring_overflows(state_dtype):
    """Rows of one launch at different P (some folding first, some not), random T and accepts,
    plain steps between: every output against fp64, states untouched by a verify that does not
    fold, and after `fold` each state is the committed tokens' (the verify's own start rounded at
    a fold, as the backend stores it)."""
    shape = ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4, state_dtype=state_dtype)
    backend = _backend(shape, seed=7, sessions=4)
    rows = [0, 3, 4, 7]
    model = _RingModel(backend, rows)
    gen, pick = torch.Generator().manual_seed(7), random.Random(7)
    for step in range(40):
        launch = pick.sample(rows, pick.randint(1, 4))
        for layer in (0, 1):
            part = [r for r in launch if r % 2 == layer]
            if not part:
                continue
            if step % 7 == 6:
                model.step(part, layer, pick.randint(1, 4), gen, speculative=False)
                continue
            model.step(part, layer, pick.randint(1, 8), gen, speculative=True)
            for row in part:
                if pick.random() < 0.7:
                    model.commit(row, pick.randint(0, len(model.draft[row][1])))
    for row in rows:
        if row in model.draft:
            model.commit(row, len(model.draft[row][1]))
    backend.fold(rows, [model.hist[r] for r in rows])
    for row in rows:
        assert rel_err(backend.read_rows([row]), model.state[row]) < 2.5e-3, row


def test_a_verify_answers_as_the_plain_step_from_the_folded_state():
    """A verify from P committed entries gives, to fp32 rounding, the outputs of a plain step run
    on the state those entries fold into (an fp32 pool: no rounding between the two)."""
    shape = ModelShape(num_layers=1, num_q_heads=2, num_v_heads=4, state_dtype="float32")
    backend = _backend(shape, seed=11, sessions=1)
    gen = torch.Generator().manual_seed(11)
    draft = StepBatch(6, verify=True)
    draft.add(_work(shape, 0, 1, 6, gen), [0], [0])
    backend.submit(draft).result()  # 6 entries, all committed below
    work = _work(shape, 0, 1, 4, gen)
    verify = StepBatch(4, verify=True)
    verify.add(work, [0], [6])
    spec = backend.submit(verify).result().clone()
    backend.fold([0], [6])
    plain = StepBatch(4)
    plain.add(work, [0], [0])
    out = backend.submit(plain).result()
    assert (spec.float() - out.float()).abs().le(out.float().abs() * 2 ** -7 + 1e-6).all()
    assert rel_err(spec, out) < 1e-4


def test_default_cpu_sessions_fit_half_the_host_memory():
    """Small models get 256 sessions; qwen3-next's pool in full use, history rings included, fits in
    half of the host's memory."""
    from gdn_server.backends import CPU_STATE_MEMORY_SHARE, DEFAULT_CPU_SESSIONS, make_backends

    small = ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4)
    assert default_cpu_sessions(small) == DEFAULT_CPU_SESSIONS == 256
    qwen = PRESETS["qwen3-next"]
    gates = random_gate_params(qwen, 0)
    host = 8 << 30
    sessions = default_cpu_sessions(qwen, memory_bytes=host)
    assert 1 < sessions < DEFAULT_CPU_SESSIONS
    assert CpuBackend(qwen, gates, sessions).pool_bytes <= CPU_STATE_MEMORY_SHARE * host
    assert CpuBackend(qwen, gates, sessions + 1).pool_bytes > CPU_STATE_MEMORY_SHARE * host
    huge = ModelShape(num_layers=1000, num_q_heads=64, num_v_heads=128)
    assert default_cpu_sessions(huge, memory_bytes=host) == 1
    ((_, backend),) = make_backends("cpu", None, qwen, gates, None)
    assert backend.max_sessions == default_cpu_sessions(qwen)  # this host's memory
    ((_, backend),) = make_backends("cpu", None, small, random_gate_params(small, 0), 3)
    assert backend.max_sessions == 3  # a configured count wins


def test_state_memory_grows_with_the_sessions_in_use_and_freed_slots_read_as_zero():
    """Blocks of slots are made on first use and dropped when their last slot is reset; a slot
    reset beside a slot still in use is zeroed; a session copied from an unused slot is zero."""
    shape = ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4)
    backend = CpuBackend(shape, random_gate_params(shape, 0), 64)
    per_block = backend._slots_per_block
    assert per_block > 2 and backend.state_bytes_in_use() == 0
    gen = torch.Generator().manual_seed(7)
    batch = StepBatch(1)
    batch.add(_work(shape, 1, 2, 1, gen), [0 * 2 + 1, 1 * 2 + 1], [0, 0])  # sessions 0 and 1 at layer 1
    backend.submit(batch).result()
    block_bytes = backend.state_bytes_in_use()
    assert block_bytes == per_block * (shape.state_bytes_per_session + shape.num_layers * backend.ring_bytes_per_row())
    far = per_block + 1  # a slot of the next block
    backend.write_session(far, 0.1 * torch.randn(2, 4, 128, 128, generator=gen).to(torch.bfloat16))
    assert backend.state_bytes_in_use() == 2 * block_bytes
    assert backend.read_session(0)[1].abs().sum() > 0
    backend.reset_session(0)  # session 1 still uses the block: zeroed in place
    assert backend.state_bytes_in_use() == 2 * block_bytes
    assert not backend.read_session(0).any() and backend.read_session(1)[1].any()
    backend.reset_session(1)
    backend.reset_session(far)
    assert backend.state_bytes_in_use() == 0
    assert not _pool(backend).any()
    backend.copy_session(3, far)  # from a slot never used: stays unmade
    assert backend.state_bytes_in_use() == 0
    batch = StepBatch(1)
    batch.add(_work(shape, 1, 1, 1, gen), [0 * 2 + 1], [0])  # slot 0 taken again: it starts from zero
    out = backend.submit(batch).result()
    fresh = _backend(shape, sessions=64)
    fresh.reset_session(0)
    assert torch.equal(out, fresh.submit(batch).result())


def test_warmup_leaves_the_pool_alone():
    backend = _backend(ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4), sessions=2)
    before = _pool(backend)
    backend.warmup()
    assert torch.equal(_pool(backend), before)


def test_big_launches_run_on_the_worker_thread_in_order_with_the_same_results(monkeypatch):
    """A launch of OFFLOAD_WORK or more runs on the backend's worker thread (its handle is not done
    at once), a small one queued behind it waits its turn there, and every output and state is
    bitwise what the same launches give on the caller's thread."""
    from gdn_server.backends import cpu

    shape = ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4)
    runs = {}
    for offload in (False, True):
        monkeypatch.setattr(cpu, "OFFLOAD_WORK", 4 * 4 * 128 * 128 if offload else 1 << 62)  # 4 rows, T=1
        backend = _backend(shape, seed=5, sessions=8)
        gen = torch.Generator().manual_seed(5)
        handles = []
        for rows, layer in ((6, 0), (1, 1), (6, 1)):  # big, small behind it, big again
            batch = StepBatch(1)
            batch.add(_work(shape, layer, rows, 1, gen), [2 * r + layer for r in range(rows)], [0] * rows)
            handles.append(backend.submit(batch))
        outs = [h.result().clone() for h in handles]
        backend.synchronize()
        runs[offload] = (outs, _pool(backend), backend._worker is not None)
        backend.close()
    assert runs[True][2] and not runs[False][2]
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    assert torch.equal(runs[True][1], runs[False][1])
