"""Host side of the GDN decode kernel: argument checks, the compile cache and the launch.

Importing this module is cheap: cutlass (and the kernel module) load on the first compile.
The launch path is built for a server: after the first call of a variant, `gdn_decode` reads
four shape entries and the state's dtype in Python, looks up the compiled function and calls it through tvm-ffi,
which checks every tensor's dtype, shape, strides, alignment and device against the compiled
signature in C before the launch (and raises ValueError on a mismatch). The kernel runs on
torch's current CUDA stream, allocates nothing and can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Any, Callable, Iterable

from gdn_server.config import STATE_DTYPE_BYTES

from ._compiled import cached_compile

HEAD_DIM = 128
SUPPORTED_T = (1, 2, 3, 4, 5, 6, 7, 8)
UNROLLED_T = (1, 2, 3, 4)  # the serving fast path; T = 5..8 (speculative decoding) compile on demand
# (H, HV) pairs compiled by `compile_all_variants` (the CI check): Qwen3-Next and two other ratios.
CHECKED_HEADS = ((16, 32), (8, 32), (32, 32))
# The state pool's element types, by the names the server's --state-dtype takes; the kernel is one
# kernel with the state's dtype as a compile-time parameter.
STATE_DTYPES = tuple(STATE_DTYPE_BYTES)


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: the static shape it serves and its tiling."""

    T: int
    H: int
    HV: int
    warps: int = 2
    rows_per_thread: int = 4
    prep: bool = True  # q/k norms and gates once per CTA in shared memory (T > 4 needs it)
    scatter: bool = False  # reduce-scatter of the row dots across the row's 8 lanes
    state_dtype: str = "bfloat16"  # the pool's element type, one of STATE_DTYPES


_cache: dict[Variant, Callable[..., Any]] = {}
# (T, H, HV, K, V, state torch dtype) -> the compiled function
_launchers: dict[tuple[Any, ...], Callable[..., Any]] = {}


def default_variant(T: int, H: int, HV: int, state_dtype: str = "bfloat16") -> Variant:
    """The variant `gdn_decode` uses for a (T, H, HV) shape and state dtype: the fastest of
    bench/kernel.py's candidates on an H200: T = 1 inline, T = 2 prep, T >= 3 prep with the
    reduce-scatter; one warp a CTA for T <= 2 and for an fp32 state's T = 3, two otherwise
    (bench/DECISIONS.md, entries 1 and 2)."""
    one_warp = T <= 2 or (T == 3 and state_dtype == "float32")
    return Variant(T, H, HV, warps=1 if one_warp else 2, prep=T > 1, scatter=T > 2, state_dtype=state_dtype)


def check_variant(T: int, H: int, HV: int, state_dtype: str = "bfloat16") -> None:
    """Raise ValueError unless the kernel supports this (T, H, HV) and state dtype."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {state_dtype!r} is not supported: one of {', '.join(STATE_DTYPES)}")
    if T not in SUPPORTED_T:
        raise ValueError(f"T={T} tokens per step is not supported (1..{SUPPORTED_T[-1]})")
    if H < 1 or HV < 1 or HV % H != 0:
        raise ValueError(f"HV={HV} must be a positive multiple of H={H}")


def compile_variant(
    T: int, H: int, HV: int, *, warps: int | None = None, rows_per_thread: int | None = None, prep: bool | None = None,
    scatter: bool | None = None, state_dtype: str = "bfloat16",
) -> Callable[..., Any]:
    """Compile (or fetch from the caches, `_compiled.cached_compile`) the kernel for one (T, H, HV)
    and state dtype; no GPU needed.

    Unset tiling options take `default_variant`'s. Without a GPU, set CUTE_DSL_ARCH=sm_90a. The
    result takes (state, slots, out_slots, layers, q, k, v, a, b, A_log, dt_bias, out, scale,
    softplus_beta, softplus_threshold) as torch tensors and floats and launches on torch's
    current stream.
    """
    check_variant(T, H, HV, state_dtype)
    d = default_variant(T, H, HV, state_dtype)
    variant = Variant(
        T, H, HV, d.warps if warps is None else warps, d.rows_per_thread if rows_per_thread is None else rows_per_thread,
        d.prep if prep is None else prep, d.scatter if scatter is None else scatter, state_dtype,
    )
    return cached_compile(_cache, variant, lambda: _compile(variant))


def compile_all_variants(
    heads: tuple[tuple[int, int], ...] = CHECKED_HEADS, state_dtypes: tuple[str, ...] = STATE_DTYPES,
) -> dict[Variant, Callable[..., Any]]:
    """Compile T = 1..4 for every (H, HV) in `heads`, and T = 5..8 for the first (Qwen3-Next),
    for every state dtype; returns {variant: compiled function}."""
    out = {}
    for dtype in state_dtypes:
        for i, (H, HV) in enumerate(heads):
            for T in SUPPORTED_T if i == 0 else UNROLLED_T:
                out[default_variant(T, H, HV, dtype)] = compile_variant(T, H, HV, state_dtype=dtype)
    return out


def fake(dtype: Any, shape: tuple, align: int) -> Any:
    """A compile-time stand-in of a row-major, contiguous GPU tensor."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=align)


def fake_step_inputs(batch: Any, T: int, H: int, HV: int, layers: Any) -> tuple:
    """The compile-time stand-ins of a step's layers [B], q, k [B, T, H, K], v [B, T, HV, V],
    a, b [B, T, HV] and the gates A_log, dt_bias [L, HV], in that order: the arguments every
    kernel here takes between its state and pool indices and its other outputs."""
    from cutlass import BFloat16, Float32, Int32

    D = HEAD_DIM
    return (
        fake(Int32, (batch,), 4),  # layers
        fake(BFloat16, (batch, T, H, D), 16),  # q
        fake(BFloat16, (batch, T, H, D), 16),  # k
        fake(BFloat16, (batch, T, HV, D), 16),  # v
        fake(BFloat16, (batch, T, HV), 2),  # a
        fake(BFloat16, (batch, T, HV), 2),  # b
        fake(Float32, (layers, HV), 4),  # A_log
        fake(Float32, (layers, HV), 4),  # dt_bias
    )


def _compile(variant: Variant) -> Callable[..., Any]:
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32
    from cutlass.cute.runtime import make_fake_stream

    from ._decode_kernel import STATE_DTYPES as STATE_TYPES, DecodeConfig, GdnDecodeKernel

    T, H, HV = variant.T, variant.H, variant.HV
    D = HEAD_DIM
    batch, slots, layers = cute.sym_int(), cute.sym_int(), cute.sym_int()

    kernel = GdnDecodeKernel(DecodeConfig(T, H, HV, variant.warps, variant.rows_per_thread, variant.prep, variant.scatter,
                                          variant.state_dtype))
    return cute.compile(
        kernel,
        fake(STATE_TYPES[variant.state_dtype], (slots, HV, D, D), 16),  # state
        fake(Int32, (batch,), 4),  # slots
        fake(Int32, (batch,), 4),  # out_slots
        *fake_step_inputs(batch, T, H, HV, layers),
        fake(BFloat16, (batch, T, HV, D), 16),  # out
        Float32(1.0),
        Float32(1.0),
        Float32(20.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )


def validate_decode_args(
    state, slots, layers, q, k, v, a, b, A_log, dt_bias, out, *, out_slots=None, require_cuda: bool = True,
) -> None:
    """Full check of gdn_decode's arguments; raises ValueError naming the offending argument.

    gdn_decode runs it on the first call of each shape; later calls rely on the compiled
    function's own checks. `require_cuda=False` lets CPU-only tests exercise the shape rules.
    """
    import torch

    named = dict(state=state, slots=slots, layers=layers, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out)
    if out_slots is not None:
        named["out_slots"] = out_slots
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if state.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"state must be torch.bfloat16 or torch.float32, got {state.dtype}")
    want_dtype = dict(state=state.dtype, slots=torch.int32, out_slots=torch.int32, layers=torch.int32,
                      A_log=torch.float32, dt_bias=torch.float32)
    for name, t in named.items():
        dtype = want_dtype.get(name, torch.bfloat16)
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    want_ndim = dict(state=4, slots=1, out_slots=1, layers=1, q=4, k=4, v=4, a=3, b=3, A_log=2, dt_bias=2, out=4)
    for name, t in named.items():
        if t.dim() != want_ndim[name]:
            raise ValueError(f"{name} must have {want_ndim[name]} dims, got shape {tuple(t.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM or V != HEAD_DIM:
        raise ValueError(f"head dims must be K = V = {HEAD_DIM}, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    check_variant(T, H, HV)
    L = A_log.shape[0]
    want_shape = dict(
        state=(state.shape[0], HV, V, K), slots=(B,), out_slots=(B,), layers=(B,), q=(B, T, H, K), k=(B, T, H, K),
        v=(B, T, HV, V), a=(B, T, HV), b=(B, T, HV), A_log=(L, HV), dt_bias=(L, HV), out=(B, T, HV, V),
    )
    for name, t in named.items():
        if tuple(t.shape) != want_shape[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want_shape[name]}")
    if state.shape[0] < 1 or L < 1:
        raise ValueError(f"state pool ({state.shape[0]} slots) and A_log ({L} layers) must not be empty")
    check_placement(named, require_cuda, aligned=("state", "q", "k", "v", "out"))


def check_placement(named: dict[str, Any], require_cuda: bool, aligned: Iterable[str]) -> None:
    """ValueError unless every tensor of `named` is contiguous and on the device of
    `named["state"]` (a CUDA one with `require_cuda`), and those named in `aligned` start on 16
    bytes: what a kernel here reads with vector loads."""
    device = named["state"].device
    for name, t in named.items():
        if require_cuda and t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, state is on {device}: all tensors must share one device")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    for name in aligned:
        if named[name].data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")


def _launcher(state, slots, layers, q, k, v, a, b, A_log, dt_bias, out, out_slots) -> Callable[..., Any]:
    validate_decode_args(state, slots, layers, q, k, v, a, b, A_log, dt_bias, out, out_slots=out_slots)
    _, T, H, _ = q.shape
    HV = v.shape[2]
    fn = compile_variant(T, H, HV, state_dtype=str(state.dtype).removeprefix("torch."))
    _launchers[(T, H, HV, HEAD_DIM, HEAD_DIM, state.dtype)] = fn
    return fn


def gdn_decode(
    state, slots, layers, q, k, v, a, b, A_log, dt_bias, out,
    *, scale: float | None = None, softplus_beta: float = 1.0, softplus_threshold: float = 20.0, out_slots=None,
):
    """One GDN decode step (docs/protocol.md, section 4) for B rows, T tokens each, in one launch; returns `out`.

    state     [num_slots, HV, 128, 128] bf16 or float32 (the variant compiled for its dtype), read at
              `slots`, written at `out_slots`; the math is fp32 either way, a bf16 state rounded
              once when written
    slots     [B] int32: the slot each row reads its state from; a negative slot marks a padding
              row (no state read or written, whatever its out_slot; zero outputs).
    out_slots [B] int32 or None (= slots, in-place update): the slot each row writes its new
              state to; a negative out_slot computes the outputs and writes no state. Slots other
              than the out_slots of live rows are left bit-for-bit untouched.
    layers    [B] int32: layer of each row, indexes A_log and dt_bias [L, HV] float32
    q, k      [B, T, H, 128] bf16;  v [B, T, HV, 128] bf16;  a, b [B, T, HV] bf16; T = 1..8
              (1..4 are the unrolled fast path; 5..8 compile on their first call)
    out       [B, T, HV, 128] bf16, written in full

    The caller keeps the rows independent: the live rows' out_slots are distinct and < num_slots,
    and no row writes a slot that another row reads (a row may write its own read slot).

    All tensors contiguous on one CUDA device; wrong shapes, dtypes or devices raise ValueError
    before anything is launched. Runs on torch's current stream.
    """
    try:
        batch, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        state_dtype = state.dtype
    except (AttributeError, TypeError, ValueError, IndexError):
        validate_decode_args(state, slots, layers, q, k, v, a, b, A_log, dt_bias, out, out_slots=out_slots)
        raise  # unreachable: the validator raises first
    fn = _launchers.get((T, H, HV, K, V, state_dtype))
    if fn is None:
        fn = _launcher(state, slots, layers, q, k, v, a, b, A_log, dt_bias, out, out_slots)
    if batch == 0:
        return out
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    if out_slots is None:
        out_slots = slots
    try:
        fn(state, slots, out_slots, layers, q, k, v, a, b, A_log, dt_bias, out, scale, softplus_beta, softplus_threshold)
    except (TypeError, ValueError) as e:
        raise ValueError(f"gdn_decode: {e}") from None
    return out
