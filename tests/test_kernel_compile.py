"""CPU checks of the CuTe DSL decode kernel: every variant compiles for sm_90a, and bad
arguments raise ValueError, with no GPU (CUTE_DSL_ARCH=sm_90a)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import tvm_ffi

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from gdn_server.kernels import (  # noqa: E402
    CHECKED_HEADS,
    SUPPORTED_T,
    UNROLLED_T,
    check_variant,
    compile_all_variants,
    compile_variant,
    compiled_segments,
    gdn_decode,
    validate_decode_args,
)

D = 128


def test_import_is_cheap_and_needs_no_gpu():
    code = "import sys, gdn_server.kernels; assert 'cutlass' not in sys.modules, 'cutlass imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


# T = 1..8 for Qwen3-Next's heads, the unrolled T = 1..4 for the other ratios: what compile_all_variants covers.
CHECKED = [(T, H, HV) for i, (H, HV) in enumerate(CHECKED_HEADS) for T in (SUPPORTED_T if i == 0 else UNROLLED_T)]


@pytest.mark.parametrize("T,H,HV", CHECKED)
def test_variant_compiles_for_sm90a(T, H, HV):
    fn = compile_variant(T, H, HV)
    assert fn is compile_variant(T, H, HV)  # cached: compiled once per (T, H, HV)
    assert isinstance(fn, tvm_ffi.Function)  # the bare function, called with positional arguments


@pytest.mark.parametrize("scan", [True, False])
def test_segment_kernels_compile_for_sm90a(scan):
    """The check and the copy of tensors in a client's GPU memory (kernels._segments)."""
    fn = compiled_segments(scan)
    assert fn is compiled_segments(scan) and fn is not compiled_segments(not scan)


def test_compile_all_variants_covers_the_checked_shapes():
    got = {(v.T, v.H, v.HV) for v in compile_all_variants()}
    assert got == set(CHECKED)
    assert {T for T, H, HV in got if (H, HV) == (16, 32)} == set(range(1, 9))


@pytest.mark.parametrize("T,H,HV", [(0, 16, 32), (9, 16, 32), (1, 16, 24), (1, 0, 32)])
def test_unsupported_variant_is_a_value_error(T, H, HV):
    with pytest.raises(ValueError):
        check_variant(T, H, HV)


def _args(B=3, T=2, H=16, HV=32, device="cpu", out_slots=False):
    bf = torch.bfloat16
    return dict(
        state=torch.zeros(5, HV, D, D, dtype=bf, device=device),
        slots=torch.arange(B, dtype=torch.int32, device=device),
        layers=torch.zeros(B, dtype=torch.int32, device=device),
        q=torch.zeros(B, T, H, D, dtype=bf, device=device),
        k=torch.zeros(B, T, H, D, dtype=bf, device=device),
        v=torch.zeros(B, T, HV, D, dtype=bf, device=device),
        a=torch.zeros(B, T, HV, dtype=bf, device=device),
        b=torch.zeros(B, T, HV, dtype=bf, device=device),
        A_log=torch.zeros(2, HV, dtype=torch.float32, device=device),
        dt_bias=torch.zeros(2, HV, dtype=torch.float32, device=device),
        out=torch.zeros(B, T, HV, D, dtype=bf, device=device),
        **({"out_slots": torch.arange(B, 2 * B, dtype=torch.int32, device=device)} if out_slots else {}),
    )


def _call(fn, args, **kw):
    args = dict(args)
    extra = {"out_slots": args.pop("out_slots")} if "out_slots" in args else {}
    return fn(*args.values(), **extra, **kw)


def test_cpu_tensors_are_a_value_error():
    with pytest.raises(ValueError, match="CUDA"):
        gdn_decode(*_args().values())


@pytest.mark.parametrize("T", [1, 4, 5, 8])
def test_valid_shapes_pass_the_shape_rules(T):
    _call(validate_decode_args, _args(T=T), require_cuda=False)
    _call(validate_decode_args, _args(T=T, out_slots=True), require_cuda=False)


BAD = {
    "q_dtype": lambda a: dict(q=a["q"].float()),
    "state_dtype": lambda a: dict(state=a["state"].half()),
    "slots_int64": lambda a: dict(slots=a["slots"].long()),
    "A_log_bf16": lambda a: dict(A_log=a["A_log"].bfloat16()),
    "out_batch": lambda a: dict(out=a["out"][:2]),
    "v_heads": lambda a: dict(v=a["v"][:, :, :16].contiguous()),
    "k_shape": lambda a: dict(k=a["k"][:, :1].contiguous()),
    "a_ndim": lambda a: dict(a=a["a"][..., None]),
    "layers_len": lambda a: dict(layers=a["layers"][:1]),
    "dt_bias_heads": lambda a: dict(dt_bias=a["dt_bias"][:, :8].contiguous()),
    "state_heads": lambda a: dict(state=a["state"][:, :16].contiguous()),
    "head_dim_64": lambda a: dict(q=a["q"][..., :64].contiguous(), k=a["k"][..., :64].contiguous()),
    "T_9": lambda a: _args(T=9),
    "out_slots_int64": lambda a: dict(out_slots=a["slots"].long()),
    "out_slots_len": lambda a: dict(out_slots=a["slots"][:2].contiguous()),
    "out_slots_2d": lambda a: dict(out_slots=a["slots"][:, None]),
    "out_slots_meta": lambda a: dict(out_slots=a["slots"].to("meta")),
    "out_slots_list": lambda a: dict(out_slots=[0, 1, 2]),
    "hv_not_multiple": lambda a: dict(q=a["q"][:, :, :12].contiguous(), k=a["k"][:, :, :12].contiguous()),
    "k_strided": lambda a: dict(k=a["k"].transpose(2, 3).contiguous().transpose(2, 3)),
    "not_a_tensor": lambda a: dict(b=[0.0]),
    "empty_pool": lambda a: dict(state=a["state"][:0]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_are_value_errors(name):
    args = _args()
    args.update(BAD[name](args))
    with pytest.raises(ValueError):
        _call(validate_decode_args, args, require_cuda=False)
    with pytest.raises(ValueError):
        _call(gdn_decode, args)
