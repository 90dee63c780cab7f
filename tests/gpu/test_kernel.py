"""The CuTe DSL decode kernel against the float64 reference, on a CUDA GPU (H200 / sm_90a), over a
bf16 and an fp32 state pool.

A bf16 state is held to its rounding (5e-3 of float64), an fp32 one to fp32 arithmetic (2e-5);
outputs are bf16 either way. The full sweep (more shapes, 64-step drift, timings) is
bench/kernel.py (--state-dtype float32 for the fp32 pool); this is the quick gate.
"""
from __future__ import annotations

import math

import pytest
import torch

from util import run_kernel
from reference import gdn_reference_step, kernel_inputs, rel_err

D = 128
DEV = "cuda"
STATE_DTYPES = [torch.bfloat16, torch.float32]
STATE_TOL = {torch.bfloat16: 5e-3, torch.float32: 2e-5}


def _untouched_equal(pool, before, untouched) -> bool:
    """Bit-for-bit equality of the rows no launch row names (NaN-safe: compares the bits)."""
    bits = torch.int16 if pool.dtype == torch.bfloat16 else torch.int32
    return torch.equal(pool[untouched].view(bits), before[untouched].view(bits))


SHAPES = [(T, H, HV) for H, HV in [(16, 32), (8, 32), (32, 32)] for T in (1, 2, 3, 4)]
SHAPES += [(T, H, HV) for H, HV in [(16, 32), (8, 32)] for T in (5, 6, 7, 8)]  # speculative decoding


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("T,H,HV", SHAPES)
@pytest.mark.parametrize("B", [1, 7, 64])
def test_matches_reference(B, T, H, HV, state_dtype):
    """Mixed layers, padding rows (zero outputs, no state touched), rows no launch row names left
    bit-for-bit."""
    gen = torch.Generator(device=DEV).manual_seed(B * 100 + T * 10 + H)
    N = 2 * B + 8
    pool = (torch.randn(N, HV, D, D, device=DEV, generator=gen) * 0.5).to(state_dtype)
    before = pool.clone()
    slots = torch.randperm(N, device=DEV, generator=gen)[:B].to(torch.int32)
    if B > 1:
        slots[::3] = -1  # padding rows
    x = kernel_inputs(B, T, H, HV, 3, gen)
    out = torch.full((B, T, HV, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    run_kernel(pool, slots, x, out)
    torch.cuda.synchronize()

    live = slots >= 0
    ls = slots[live].long()
    lay = x["layers"][live].long()
    o_ref, s_ref = gdn_reference_step(
        before[ls].float(), *(x[n][live] for n in ("q", "k", "v", "a", "b")),
        x["A_log"][lay], x["dt_bias"][lay], dtype=torch.float64)
    assert rel_err(out[live].float(), o_ref.to(DEV)) < 5e-3
    assert rel_err(pool[ls].float(), s_ref) < STATE_TOL[state_dtype]
    assert (out[~live] == 0).all()
    untouched = torch.ones(N, dtype=torch.bool, device=DEV)
    untouched[ls] = False
    assert _untouched_equal(pool, before, untouched)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("T", [1, 4, 7])
def test_out_slots_reads_one_slot_and_writes_another(T, state_dtype):
    """Each row reads slots[i] and writes out_slots[i]; one row updates in place, one writes no
    state (out_slot -1), padding rows touch nothing: every other slot stays bit-for-bit."""
    B, H, HV = 24, 16, 32
    gen = torch.Generator(device=DEV).manual_seed(40 + T)
    N = 3 * B
    pool = (torch.randn(N, HV, D, D, device=DEV, generator=gen) * 0.5).to(state_dtype)
    before = pool.clone()
    perm = torch.randperm(N, device=DEV, generator=gen).to(torch.int32)
    slots, out_slots = perm[:B].clone(), perm[B:2 * B].clone()
    out_slots[1] = slots[1]
    out_slots[2] = -1
    slots[3::5] = -1
    x = kernel_inputs(B, T, H, HV, 2, gen)
    out = torch.full((B, T, HV, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    run_kernel(pool, slots, x, out, out_slots=out_slots)
    torch.cuda.synchronize()

    live = slots >= 0
    lay = x["layers"][live].long()
    o_ref, s_ref = gdn_reference_step(
        before[slots[live].long()].float(), *(x[n][live] for n in ("q", "k", "v", "a", "b")),
        x["A_log"][lay], x["dt_bias"][lay], dtype=torch.float64)
    assert rel_err(out[live].float(), o_ref.to(DEV)) < 5e-3
    assert (out[~live] == 0).all()
    wrote = out_slots[live] >= 0
    ws = out_slots[live][wrote].long()
    assert rel_err(pool[ws].float(), s_ref[wrote]) < STATE_TOL[state_dtype]
    untouched = torch.ones(N, dtype=torch.bool, device=DEV)
    untouched[ws] = False
    assert _untouched_equal(pool, before, untouched)
    assert torch.equal(pool[slots[4].long()], before[slots[4].long()])  # a read slot, unchanged


@pytest.mark.parametrize("change", ["int64", "short", "cpu"])
def test_bad_out_slots_raise_value_error(change):
    B, T, H, HV = 4, 2, 16, 32
    gen = torch.Generator(device=DEV).manual_seed(6)
    pool = torch.zeros(8, HV, D, D, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(B, device=DEV, dtype=torch.int32)
    x = kernel_inputs(B, T, H, HV, 2, gen)
    out = torch.zeros(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    run_kernel(pool, slots, x, out)  # compiled and cached: the fast path checks out_slots too
    bad = dict(int64=(slots + 4).long(), short=(slots + 4)[:2].contiguous(), cpu=(slots + 4).cpu())[change]
    pool_before = pool.clone()
    with pytest.raises(ValueError):
        run_kernel(pool, slots, x, out, out_slots=bad)
    torch.cuda.synchronize()
    assert torch.equal(pool, pool_before)


def test_steps_without_drift():
    B, T, H, HV, steps = 16, 2, 16, 32, 64
    gen = torch.Generator(device=DEV).manual_seed(7)
    pool = (torch.randn(B + 4, HV, D, D, device=DEV, generator=gen) * 0.5).to(torch.bfloat16)
    slots = torch.randperm(B + 4, device=DEV, generator=gen)[:B].to(torch.int32)
    ls = slots.long()
    s_ref = pool[ls].double()
    out = torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    for _ in range(steps):
        x = kernel_inputs(B, T, H, HV, 2, gen)
        run_kernel(pool, slots, x, out)
        lay = x["layers"].long()
        o_ref, s_new = gdn_reference_step(s_ref, x["q"], x["k"], x["v"], x["a"], x["b"],
                                          x["A_log"][lay], x["dt_bias"][lay], dtype=torch.float64)
        s_ref = s_new.to(torch.bfloat16).double()  # the kernel rounds once per step too
        assert rel_err(out.float(), o_ref.to(DEV)) < 5e-3
        assert rel_err(pool[ls].float(), s_new) < 5e-3


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_cuda_graph_replay_matches_eager(state_dtype):
    B, T, H, HV = 32, 3, 16, 32
    gen = torch.Generator(device=DEV).manual_seed(3)
    pool0 = (torch.randn(B + 4, HV, D, D, device=DEV, generator=gen) * 0.5).to(state_dtype)
    slots = torch.randperm(B + 4, device=DEV, generator=gen)[:B].to(torch.int32)
    x = kernel_inputs(B, T, H, HV, 2, gen)
    pool_e, out_e = pool0.clone(), torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    run_kernel(pool_e, slots, x, out_e)
    pool_g, out_g = pool0.clone(), torch.empty_like(out_e)
    run_kernel(pool_g.clone(), slots, x, out_g)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(pool_g, slots, x, out_g)
    pool_g.copy_(pool0)
    out_g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, out_e) and torch.equal(pool_g, pool_e)


@pytest.mark.parametrize("change", ["q_dtype", "out_batch", "slots_int64", "v_cpu", "k_strided", "K_64"])
def test_bad_arguments_raise_value_error(change):
    from gdn_server.kernels import gdn_decode

    B, T, H, HV = 4, 1, 16, 32
    gen = torch.Generator(device=DEV).manual_seed(5)
    pool = torch.zeros(8, HV, D, D, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(B, device=DEV, dtype=torch.int32)
    x = kernel_inputs(B, T, H, HV, 2, gen)
    out = torch.zeros(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    run_kernel(pool, slots, x, out)  # the variant is compiled and cached: the fast path checks too
    args = dict(state=pool, slots=slots, layers=x["layers"], q=x["q"], k=x["k"], v=x["v"], a=x["a"],
                b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"], out=out)
    bad = dict(
        q_dtype=dict(q=x["q"].float()),
        out_batch=dict(out=out[:2]),
        slots_int64=dict(slots=slots.long()),
        v_cpu=dict(v=x["v"].cpu()),
        k_strided=dict(k=torch.empty(B, T, D, H, device=DEV, dtype=torch.bfloat16).transpose(2, 3)),
        K_64=dict(q=x["q"][..., :64].contiguous(), k=x["k"][..., :64].contiguous()),
    )[change]
    pool_before = pool.clone()
    with pytest.raises(ValueError):
        gdn_decode(*dict(args, **bad).values())
    torch.cuda.synchronize()
    assert torch.equal(pool, pool_before)


def test_default_scale_is_inverse_sqrt_k():
    from gdn_server.kernels import gdn_decode

    B, T, H, HV = 3, 1, 16, 32
    gen = torch.Generator(device=DEV).manual_seed(11)
    pool = (torch.randn(B, HV, D, D, device=DEV, generator=gen) * 0.5).to(torch.bfloat16)
    slots = torch.arange(B, device=DEV, dtype=torch.int32)
    x = kernel_inputs(B, T, H, HV, 1, gen)
    args = (slots, x["layers"], x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"])
    p1, o1 = pool.clone(), torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    p2, o2 = pool.clone(), torch.empty_like(o1)
    gdn_decode(p1, *args, o1)
    gdn_decode(p2, *args, o2, scale=1.0 / math.sqrt(D))
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)
