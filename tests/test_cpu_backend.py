"""CpuBackend's step against the fp64 reference (tests/reference.py), in process.

Random states and inputs; several rows, T from 1 to the speculative 8, value heads grouped over
query heads, rows of different layers in one launch, rows that write a slot other than the one
they read. And a row's output and new state are bitwise the same whether it runs alone or with
other rows: the scheduler batches rows of unrelated clients, and a client's numbers must not
depend on who else was served with it.
"""
from __future__ import annotations

import pytest
import torch

from gdn_server.backends import default_cpu_sessions
from gdn_server.backends.cpu import CpuBackend
from gdn_server.backends.torch_math import gdn_step_fp32
from gdn_server.config import PRESETS, ModelShape
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork, StepBatch
from reference import gdn_reference_step, rel_err


def _backend(shape: ModelShape, seed: int = 0, sessions: int = 8) -> CpuBackend:
    backend = CpuBackend(shape, random_gate_params(shape, seed), sessions, speculative_sessions=4)
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
        before[torch.tensor(batch.read_rows)].float(), x["q"], x["k"], x["v"], x["a"], x["b"],
        backend.A_log[layers], backend.dt_bias[layers], backend.scale,
    )


@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("heads", [(1, 1), (2, 4), (1, 4), (16, 32)], ids=["mha1", "gqa2", "gqa4", "qwen3-next"])
def test_matches_the_fp64_reference(heads, T):
    """Requests of several rows at different layers in one launch; every third writes scratch rows."""
    H, HV = heads
    shape = ModelShape(num_layers=3, num_q_heads=H, num_v_heads=HV)
    backend = _backend(shape, seed=T)
    gen = torch.Generator().manual_seed(100 * H + T)
    batch = StepBatch(T)
    scratch = iter(range(backend.home_rows, backend.pool_rows))
    session = iter(range(backend.max_sessions))
    for r, (layer, rows) in enumerate([(0, 1), (2, 3), (1, 2), (2, 1)]):
        dtype = (torch.bfloat16, torch.float16, torch.float32)[r % 3]
        slots = [next(session) * shape.num_layers + layer for _ in range(rows)]
        out_slots = [next(scratch) for _ in slots] if r % 3 == 2 else None
        batch.add(_work(shape, layer, rows, T, gen, dtype), slots, out_slots)
    assert not batch.in_place
    before = _pool(backend)
    out = backend.submit(batch).result()
    o_ref, s_ref = _reference(backend, batch, before)
    assert out.dtype == torch.bfloat16 and out.shape == (batch.rows, T, HV, shape.head_dim_v)
    # bf16 output rounding alone is ~2e-3 (relative, as a norm); the fp32 math adds ~1e-7
    assert rel_err(out, o_ref) < 2.5e-3
    new = backend.read_rows(batch.write_rows)
    assert rel_err(new, s_ref) < 2.5e-3
    # rounded once: each element is the fp64 state rounded to bf16 or its neighbour, but for the
    # fp32 math's absolute error on elements near 0 (cancellations)
    slack = s_ref.abs() * 2 ** -7 + 1e-7 * s_ref.abs().max()
    assert (new.double() - s_ref.to(torch.bfloat16).double()).abs().le(slack).all()
    untouched = torch.ones(backend.pool_rows, dtype=torch.bool)
    untouched[torch.tensor(batch.write_rows)] = False
    assert torch.equal(_pool(backend)[untouched], before[untouched])  # slots read but not written too


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
                    batch.add(works[i], [slots[i]])
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
        batch.add(_work(shape, 0, 1, T, gen), [0])
        out = backend.submit(batch).result()
        w = batch.works[0]
        o_ref, state = gdn_reference_step(state, w.q.float(), w.k.float(), w.v.float(), w.a.float(), w.b.float(),
                                          backend.A_log[:1], backend.dt_bias[:1], backend.scale)
        state = state.to(torch.bfloat16).float()
        assert rel_err(out, o_ref) < 2.5e-3, step
        assert rel_err(backend.read_rows([0]), state) < 2.5e-3, step


def test_gdn_step_fp32_matches_the_reference():
    """The fp32 step as the GPU backend's torch fallback calls it: state [B, HV, V, K] updated in place."""
    gen = torch.Generator().manual_seed(5)
    B, T, H, HV, K = 3, 4, 2, 4, 128
    state = 0.1 * torch.randn(B, HV, K, K, generator=gen)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, HV, K, generator=gen)
    a, b = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    A_log, dt_bias = torch.rand(B, HV, generator=gen) * 2.7, torch.randn(B, HV, generator=gen) - 4
    o_ref, s_ref = gdn_reference_step(state, q, k, v, a, b, A_log, dt_bias, K ** -0.5)
    o = gdn_step_fp32(state, q, k, v, a, b, A_log, dt_bias, K ** -0.5)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(state, s_ref) < 1e-5


def test_copy_rows_copies_as_the_rows_were():
    backend = _backend(ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2), sessions=4)
    before = _pool(backend)
    backend.copy_rows([0, 1, 2], [1, 2, 5])  # rows 1 and 2 are both read and overwritten
    assert torch.equal(backend.read_rows([1, 2, 5]), before[torch.tensor([0, 1, 2])])
    assert torch.equal(backend.read_rows([0])[0], before[0])


def test_default_cpu_sessions_fit_half_the_host_memory():
    """Small models get 256 sessions; qwen3-next's pool in full use, scratch rows included, fits in
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
    huge = ModelShape(num_layers=200, num_q_heads=64, num_v_heads=128)
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
    batch.add(_work(shape, 1, 2, 1, gen), [0 * 2 + 1, 1 * 2 + 1])  # sessions 0 and 1 at layer 1
    backend.submit(batch).result()
    block_bytes = backend.state_bytes_in_use()
    assert block_bytes == per_block * shape.state_bytes_per_session
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
    batch.add(_work(shape, 1, 1, 1, gen), [0 * 2 + 1])  # slot 0 taken again: it starts from zero
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
            batch.add(_work(shape, layer, rows, 1, gen), [2 * r + layer for r in range(rows)])
            handles.append(backend.submit(batch))
        outs = [h.result().clone() for h in handles]
        backend.synchronize()
        runs[offload] = (outs, _pool(backend), backend._worker is not None)
        backend.close()
    assert runs[True][2] and not runs[False][2]
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    assert torch.equal(runs[True][1], runs[False][1])
