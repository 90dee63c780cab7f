"""Host side of the history-ring kernels (`_ring_kernel`): ring allocation, argument checks, the
compile cache and the launches of the speculative verify and the fold.

Importing this module is cheap: cutlass loads on the first compile. As in `_api`, a launch after
the first of its shape looks up the compiled function and calls it through tvm-ffi, which checks
every tensor's dtype, shape, strides, alignment and device in C; the kernels run on torch's
current stream, allocate nothing and can be captured in a CUDA graph.

The bookkeeping a caller keeps per (session, layer) row is P, the ring's committed entries:

    verify of T tokens:  folds first if P + T > RING (then appends at entry 0); new P is
                         `folded_base(P, T) + accepted` -- an accept launches nothing
    fold:                writes the state with the P entries applied; new P is 0
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ._api import STATE_DTYPES, check_placement, fake, fake_step_inputs
from ._compiled import cached_compile

HEAD_DIM = 128
RING = 16  # entries per (pool row, head); `_ring_kernel.RING`
MAX_T = 8
# A verify of this many tokens or more asks L2 for its value heads' states when it starts and
# reads the first into registers after its prologue: the prologue (Grams, solves) is long enough
# to hide the prefetch, a shorter one's is not and the extra traffic in flight slows it
# (bench/DECISIONS.md, kernel entry 4)
PREFETCH_FROM_T = 5
# A short verify's CTA covers as many q/k heads as make this many value heads: its prologue
# (tokens, Grams, solves) is the chain its first state load waits behind, and four value heads
# amortize it best (bench/DECISIONS.md, entry 4: 8-10% less time at B = 512, T = 1 and 4 than
# one q/k head of qwen3-next's two value heads; eight were faster only at T = 1, and would need
# more shared memory than two CTAs an SM have). A long verify keeps one q/k head: its prologue
# hides its prefetch, and four value heads measured no faster there.
VERIFY_VALUE_HEADS = 4
# ...but only where a launch has that many wide CTAs: fewer, wider CTAs fill the GPU's slots in
# fewer, less even waves (bench/DECISIONS.md, entry 4; qwen3-next, a step with full accepts, us
# narrow / wide: B = 48 rows, 384 wide CTAs, T = 1 25.7 / 28.5 and T = 4 31.3 / 36.7; about even
# at B = 64 to 128; B = 512 216.4 / 196.2 and 258.8 / 238.7)
WIDE_VERIFY_MIN_CTAS = 1024

_cache: dict[tuple[int, int, int, str, int], Callable[..., Any]] = {}


def folded_base(P: int, T: int) -> int:
    """The ring entries a verify of T tokens keeps before its own: P, or 0 where it folds first."""
    return 0 if P + T > RING else P


def ring_shapes(num_rows: int, H: int, HV: int) -> dict[str, tuple[int, ...]]:
    """Shapes of a pool's ring tensors: ring_k, ring_u, ring_g (`ring_dtypes`)."""
    return dict(ring_k=(num_rows, H, RING, HEAD_DIM), ring_u=(num_rows, HV, HEAD_DIM, RING), ring_g=(num_rows, HV, RING))


def ring_dtypes(state_dtype: str = "bfloat16") -> dict[str, str]:
    """Element types of the ring tensors beside a state pool of `state_dtype`: raw keys bf16 (the
    inputs, exact), log-decays fp32, corrections fp16 beside a bf16 state and fp32 beside an fp32
    one (fp16 corrections would put 2^-12 into every fold of a state that keeps 2^-24)."""
    return dict(ring_k="bfloat16", ring_u="float32" if state_dtype == "float32" else "float16", ring_g="float32")


_BYTES = dict(bfloat16=2, float16=2, float32=4)


def ring_bytes_per_row(H: int, HV: int, state_dtype: str = "bfloat16") -> int:
    """Device bytes of one pool row's ring tensors (what a pool's memory budget counts beside its state)."""
    dtypes = ring_dtypes(state_dtype)
    return sum(math.prod(shape) * _BYTES[dtypes[name]] for name, shape in ring_shapes(1, H, HV).items())


def new_ring(num_rows: int, H: int, HV: int, device: Any = "cuda", state_dtype: str = "bfloat16"):
    """Zeroed ring tensors (ring_k, ring_u, ring_g) for a pool of `num_rows` states of `state_dtype`."""
    import torch

    shapes, dtypes = ring_shapes(num_rows, H, HV), ring_dtypes(state_dtype)
    return tuple(torch.zeros(shapes[name], dtype=getattr(torch, dtypes[name]), device=device) for name in shapes)


def wide_qk_heads(T: int, H: int, HV: int) -> int:
    """q/k heads of a wide verify CTA for (T, H, HV): as many as make VERIFY_VALUE_HEADS value heads
    (at most four, two warps each for the Grams; a divisor of H), 1 where there is no wider CTA
    (a verify of PREFETCH_FROM_T tokens or more, or a q/k head with that many value heads)."""
    if T >= PREFETCH_FROM_T or T < 1 or H < 1 or HV % H:
        return 1
    q = min(4, max(1, VERIFY_VALUE_HEADS // (HV // H)))
    while H % q:
        q -= 1
    return q


def verify_qk_heads(B: int, T: int, H: int, HV: int) -> int:
    """q/k heads one CTA of a verify launch of B rows covers: the wide CTA's (`wide_qk_heads`)
    where that launch still has WIDE_VERIFY_MIN_CTAS CTAs, else 1."""
    q = wide_qk_heads(T, H, HV)
    return q if B * (H // q) >= WIDE_VERIFY_MIN_CTAS else 1


def check_ring_variant(T: int, H: int, HV: int, state_dtype: str = "bfloat16") -> None:
    """Raise ValueError unless the ring kernels support this (T, H, HV) and state dtype; T = 0 is
    the fold."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state dtype {state_dtype!r} is not supported: one of {', '.join(STATE_DTYPES)}")
    if not 0 <= T <= MAX_T:
        raise ValueError(f"T={T} tokens per verify is not supported (1..{MAX_T})")
    if H < 1 or HV < 1 or HV % H != 0 or HV // H > 8:
        raise ValueError(f"HV={HV} must be a multiple of H={H}, at most 8 times it")


def compile_ring(T: int, H: int, HV: int, state_dtype: str = "bfloat16", qk_heads: int = 1) -> Callable[..., Any]:
    """Compile (or fetch) the verify of T tokens (T = 0: the fold) for (H, HV) over a state pool of
    `state_dtype` (one of STATE_DTYPES, a compile-time parameter of one kernel), its CTAs over
    `qk_heads` q/k heads (1, or `wide_qk_heads`); no GPU needed (set CUTE_DSL_ARCH=sm_90a without one)."""
    check_ring_variant(T, H, HV, state_dtype)
    if qk_heads not in (1, wide_qk_heads(T, H, HV)):
        raise ValueError(f"qk_heads={qk_heads} for T={T}, H={H}, HV={HV}: 1 or {wide_qk_heads(T, H, HV)}")
    return cached_compile(_cache, (T, H, HV, state_dtype, qk_heads), lambda: _compile(T, H, HV, state_dtype, qk_heads))


def ring_variants(T: int, H: int, HV: int) -> tuple[int, ...]:
    """The `qk_heads` a launch of T tokens may use (`verify_qk_heads`): what to compile ahead."""
    return tuple(sorted({1, wide_qk_heads(T, H, HV)}))


def _compile(T: int, H: int, HV: int, state_dtype: str, qk_heads: int) -> Callable[..., Any]:
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32
    from cutlass.cute.runtime import make_fake_stream

    from ._decode_kernel import STATE_DTYPES as STATE_TYPES
    from ._ring_kernel import RingConfig, RingFoldKernel, RingVerifyKernel

    D = HEAD_DIM
    batch, rows, layers = cute.sym_int(), cute.sym_int(), cute.sym_int()

    state = fake(STATE_TYPES[state_dtype], (rows, HV, D, D), 16)
    row_idx, hist = fake(Int32, (batch,), 4), fake(Int32, (batch,), 4)
    cute_types = dict(bfloat16=BFloat16, float16=Float16, float32=Float32)
    dtypes = ring_dtypes(state_dtype)
    ring = tuple(fake(cute_types[dtypes[name]], shape, 16) for name, shape in ring_shapes(rows, H, HV).items())
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    cfg = RingConfig(T, H, HV, state_dtype, qk_heads)
    if T == 0:
        return cute.compile(RingFoldKernel(cfg), state, row_idx, hist, *ring, stream, options="--enable-tvm-ffi")
    return cute.compile(
        RingVerifyKernel(cfg), state, row_idx, hist,
        *fake_step_inputs(batch, T, H, HV, layers),
        *ring,
        fake(BFloat16, (batch, T, HV, D), 16),  # out
        Float32(1.0), Float32(1.0), Float32(20.0), stream,
        options="--enable-tvm-ffi",
    )


def validate_ring_args(state, rows, hist, ring_k, ring_u, ring_g, *, layers=None, q=None, k=None, v=None, a=None,
                       b=None, A_log=None, dt_bias=None, out=None, require_cuda: bool = True) -> None:
    """Full check of a verify's (or, without the token tensors, a fold's) arguments; raises
    ValueError naming the offending argument."""
    import torch

    named = dict(state=state, rows=rows, hist=hist, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)
    tokens = dict(layers=layers, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out)
    verify = any(t is not None for t in tokens.values())
    if verify:
        named.update(tokens)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(state, torch.Tensor) or state.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"state must be a torch.bfloat16 or torch.float32 tensor, got {getattr(state, 'dtype', type(state).__name__)}")
    dtypes = dict(state=state.dtype, rows=torch.int32, hist=torch.int32, layers=torch.int32, A_log=torch.float32, dt_bias=torch.float32,
                  **{name: getattr(torch, dt) for name, dt in ring_dtypes(str(state.dtype).removeprefix("torch.")).items()})
    for name, t in named.items():
        want = dtypes.get(name, torch.bfloat16)
        if t.dtype != want:
            raise ValueError(f"{name} must be {want}, got {t.dtype}")
    if state.dim() != 4 or state.shape[2:] != (HEAD_DIM, HEAD_DIM) or state.shape[0] < 1:
        raise ValueError(f"state must be [rows, HV, {HEAD_DIM}, {HEAD_DIM}], got {tuple(state.shape)}")
    N, HV = state.shape[0], state.shape[1]
    if ring_k.dim() != 4:
        raise ValueError(f"ring_k must be [rows, H, {RING}, {HEAD_DIM}], got {tuple(ring_k.shape)}")
    H = ring_k.shape[1]
    B = rows.shape[0] if rows.dim() == 1 else -1
    want = dict(state=tuple(state.shape), rows=(B,), hist=(B,), **ring_shapes(N, H, HV))
    if verify:
        if q is None or q.dim() != 4:
            raise ValueError("q must be [B, T, H, 128]")
        T = q.shape[1]
        L = A_log.shape[0] if A_log.dim() == 2 else -1
        want.update(layers=(B,), q=(B, T, H, HEAD_DIM), k=(B, T, H, HEAD_DIM), v=(B, T, HV, HEAD_DIM), a=(B, T, HV),
                    b=(B, T, HV), A_log=(L, HV), dt_bias=(L, HV), out=(B, T, HV, HEAD_DIM))
        check_ring_variant(T, H, HV)
        if T < 1 or L < 1:
            raise ValueError(f"a verify needs T >= 1 tokens and A_log of >= 1 layer, got T={T}, A_log {tuple(A_log.shape)}")
    else:
        check_ring_variant(0, H, HV)
    for name, t in named.items():
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want[name]}")
    check_placement(named, require_cuda, aligned=[name for name, t in named.items() if t.dim() >= 3])


_checked: set[tuple] = set()


def _key(T: int, state, ring_k) -> tuple:
    """The compile key of a launch's arguments (checked in full by `validate_ring_args` on its first
    launch): (T, H, HV, state dtype name)."""
    def dim(t, i):
        return t.shape[i] if getattr(t, "dim", lambda: 0)() == 4 else -1

    return T, dim(ring_k, 1), dim(state, 1), str(getattr(state, "dtype", "")).removeprefix("torch.")


def ring_verify(state, rows, hist, layers, q, k, v, a, b, A_log, dt_bias, ring_k, ring_u, ring_g, out,
                *, scale: float | None = None, softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
                qk_heads: int | None = None):
    """A speculative step of T tokens for B rows over their history rings, in one launch; returns `out`.

    state   [rows, HV, 128, 128] bf16 or fp32 checkpoints (the kernel compiled for its dtype): read;
            written only by a row that folds
    rows    [B] int32 pool row of each batch row; < 0 marks padding (nothing read or written but
            zero outputs). Live rows must be distinct.
    hist    [B] int32 committed ring entries P (0..16). A row with P + T > 16 folds its P entries
            into its state first and appends at entry 0 (`folded_base`).
    layers  [B] int32 layer of each row, indexes A_log and dt_bias [L, HV] fp32
    q, k    [B, T, H, 128] bf16;  v [B, T, HV, 128] bf16;  a, b [B, T, HV] bf16; T = 1..8
    ring_k  [rows, H, 16, 128] bf16, ring_u [rows, HV, 128, 16] fp16 (fp32 beside an fp32 state),
            ring_g [rows, HV, 16] fp32 (`new_ring`): entries [base, base + T) are written
    out     [B, T, HV, 128] bf16, written in full
    qk_heads q/k heads per CTA: None picks by the launch's size (`verify_qk_heads`); tests and
            benchmarks name one (1 or `wide_qk_heads`) to run both at any B
    """
    key = _key(q.shape[1] if getattr(q, "dim", lambda: 0)() == 4 else -1, state, ring_k)
    if key not in _checked:
        validate_ring_args(state, rows, hist, ring_k, ring_u, ring_g, layers=layers, q=q, k=k, v=v, a=a, b=b,
                           A_log=A_log, dt_bias=dt_bias, out=out)
        _checked.add(key)
    if qk_heads is None:
        qk_heads = verify_qk_heads(q.shape[0], *key[:3])
    fn = compile_ring(*key, qk_heads=qk_heads)
    if q.shape[0] == 0:
        return out
    scale = 1.0 / math.sqrt(HEAD_DIM) if scale is None else scale
    try:
        fn(state, rows, hist, layers, q, k, v, a, b, A_log, dt_bias, ring_k, ring_u, ring_g, out, scale,
           softplus_beta, softplus_threshold)
    except (TypeError, ValueError) as e:
        raise ValueError(f"ring_verify: {e}") from None
    return out


def ring_fold(state, rows, hist, ring_k, ring_u, ring_g) -> None:
    """Folds each row's first hist[i] ring entries into its state (in place, bf16 or fp32); the caller's
    P becomes 0. Rows with rows[i] < 0 or hist[i] == 0 are left untouched."""
    key = _key(0, state, ring_k)
    if key not in _checked:
        validate_ring_args(state, rows, hist, ring_k, ring_u, ring_g)
        _checked.add(key)
    fn = compile_ring(*key)
    if rows.shape[0] == 0:
        return
    try:
        fn(state, rows, hist, ring_k, ring_u, ring_g)
    except (TypeError, ValueError) as e:
        raise ValueError(f"ring_fold: {e}") from None
