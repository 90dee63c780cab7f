"""CPU checks of the history-ring kernels: they compile for sm_90a with no GPU (CUTE_DSL_ARCH=sm_90a),
and bad arguments raise ValueError naming the argument."""
from __future__ import annotations

import os

import pytest
import torch
import tvm_ffi

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from gdn_server.kernels._ring_api import (  # noqa: E402
    RING, WIDE_VERIFY_MIN_CTAS, check_ring_variant, compile_ring, folded_base, new_ring, ring_bytes_per_row, ring_shapes,
    ring_variants, validate_ring_args, verify_qk_heads, wide_qk_heads,
)

D = 128


COMPILED = [(1, 16, 32), (4, 16, 32), (8, 16, 32), (0, 16, 32), (4, 8, 32), (4, 32, 32)]


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("T,H,HV", COMPILED)
def test_compiles_for_sm90a(T, H, HV, state_dtype):
    fn = compile_ring(T, H, HV, state_dtype)
    assert fn is compile_ring(T, H, HV, state_dtype)  # cached per state dtype
    assert isinstance(fn, tvm_ffi.Function)  # the bare function, called with positional arguments


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("T,H,HV,wide", [(1, 16, 32, 2), (4, 16, 32, 2), (4, 32, 32, 4), (2, 8, 32, 1), (5, 16, 32, 1)])
def test_wide_verify_ctas_compile_for_sm90a(T, H, HV, wide, state_dtype):
    assert wide_qk_heads(T, H, HV) == wide
    assert ring_variants(T, H, HV) == tuple(sorted({1, wide}))
    if wide > 1:
        assert compile_ring(T, H, HV, state_dtype, wide) is not compile_ring(T, H, HV, state_dtype)


def test_launch_size_picks_the_cta_width():
    assert verify_qk_heads(512, 4, 16, 32) == 2 and verify_qk_heads(16, 4, 16, 32) == 1
    assert verify_qk_heads(512, 8, 16, 32) == 1  # a long verify keeps one q/k head
    big = WIDE_VERIFY_MIN_CTAS  # rows enough at any H
    assert verify_qk_heads(big, 1, 32, 32) == 4 and verify_qk_heads(big, 1, 8, 32) == 1
    with pytest.raises(ValueError):
        compile_ring(4, 16, 32, "bfloat16", 4)
    with pytest.raises(ValueError):
        compile_ring(8, 16, 32, "bfloat16", 2)


def test_state_dtypes_are_separate_kernels():
    assert compile_ring(4, 16, 32, "float32") is not compile_ring(4, 16, 32, "bfloat16")


@pytest.mark.parametrize("T,H,HV", [(9, 16, 32), (-1, 16, 32), (4, 16, 24), (4, 0, 32), (4, 2, 32)])
def test_unsupported_shapes_are_value_errors(T, H, HV):
    with pytest.raises(ValueError):
        check_ring_variant(T, H, HV)


def test_unsupported_state_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="float16"):
        check_ring_variant(4, 16, 32, "float16")


def test_folded_base_is_the_kernels_rule():
    assert [folded_base(P, 4) for P in (0, 4, 12, 13, 16)] == [0, 4, 12, 0, 0]
    assert folded_base(RING - 8, 8) == RING - 8 and folded_base(RING - 7, 8) == 0


def _args(B=3, T=4, H=16, HV=32, N=5, state_dtype=torch.bfloat16):
    bf = torch.bfloat16
    ring_k, ring_u, ring_g = new_ring(N, H, HV, device="cpu", state_dtype=str(state_dtype).removeprefix("torch."))
    return dict(
        state=torch.zeros(N, HV, D, D, dtype=state_dtype), rows=torch.arange(B, dtype=torch.int32),
        hist=torch.zeros(B, dtype=torch.int32), ring_k=ring_k, ring_u=ring_u, ring_g=ring_g,
        layers=torch.zeros(B, dtype=torch.int32), q=torch.zeros(B, T, H, D, dtype=bf), k=torch.zeros(B, T, H, D, dtype=bf),
        v=torch.zeros(B, T, HV, D, dtype=bf), a=torch.zeros(B, T, HV, dtype=bf), b=torch.zeros(B, T, HV, dtype=bf),
        A_log=torch.zeros(2, HV), dt_bias=torch.zeros(2, HV), out=torch.zeros(B, T, HV, D, dtype=bf),
    )


def _check(args):
    fixed = ("state", "rows", "hist", "ring_k", "ring_u", "ring_g")
    validate_ring_args(*(args[n] for n in fixed), **{n: v for n, v in args.items() if n not in fixed}, require_cuda=False)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_good_arguments_pass_and_shapes_agree(state_dtype):
    _check(_args(state_dtype=state_dtype))
    assert ring_shapes(5, 16, 32) == dict(ring_k=(5, 16, RING, D), ring_u=(5, 32, D, RING), ring_g=(5, 32, RING))


@pytest.mark.parametrize("name,value", [
    ("q", torch.zeros(3, 4, 16, D)),  # float32
    ("v", torch.zeros(3, 4, 16, D, dtype=torch.bfloat16)),  # wrong HV
    ("rows", torch.arange(3)),  # int64
    ("hist", torch.zeros(2, dtype=torch.int32)),  # wrong B
    ("ring_u", torch.zeros(5, 32, D, RING, dtype=torch.bfloat16)),  # bf16 corrections
    ("ring_k", torch.zeros(5, 16, 8, D, dtype=torch.bfloat16)),  # 8 entries
    ("ring_g", torch.zeros(4, 32, RING)),  # rows of another pool
    ("out", torch.zeros(3, 4, 32, D, dtype=torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)),
    ("q", torch.zeros(3, 9, 16, D, dtype=torch.bfloat16)),  # T = 9
    ("state", torch.zeros(5, 32, D, D, dtype=torch.float16)),  # not a state dtype
])
def test_bad_argument_is_a_value_error(name, value):
    args = _args()
    args[name] = value
    with pytest.raises(ValueError):
        _check(args)


def test_corrections_follow_the_state_dtype():
    """An fp32 state's ring holds fp32 corrections (fp16 ones would cap its accuracy), a bf16
    state's fp16 ones; either kind beside the other state is a ValueError naming ring_u."""
    assert new_ring(1, 16, 32, device="cpu", state_dtype="float32")[1].dtype == torch.float32
    assert new_ring(1, 16, 32, device="cpu")[1].dtype == torch.float16
    assert ring_bytes_per_row(16, 32, "float32") - ring_bytes_per_row(16, 32) == 32 * D * RING * 2
    for state_dtype, other in ((torch.bfloat16, torch.float32), (torch.float32, torch.float16)):
        args = _args(state_dtype=state_dtype)
        args["ring_u"] = args["ring_u"].to(other)
        with pytest.raises(ValueError, match="ring_u"):
            _check(args)
