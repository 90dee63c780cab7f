"""CuTe DSL kernels of speculative steps through a history ring: the verify and the fold.

A (session, layer) state S0 (the *checkpoint*) is read, never written, by a speculative step
(the verify): each of its T tokens appends an entry to the row's ring, and its outputs come from
S0 and the ring. With k^_j the normalised key, G_j the log-decay summed from the checkpoint
through entry j and u_j the entry's *correction*, the state after n entries is

    S_n = e^{G_n} S0 + sum_{j < n} e^{G_n - G_j} u_j k^_j^T

and the delta rule S_t = a_t S_{t-1} + beta_t (v_t - a_t S_{t-1} k^_t) k^_t^T gives, for the T
tokens of a step over a ring of P entries, with y_t = S0 k^_t and z_t = S0 q^_t (vectors over V),

    r_t = e^{G_t} y_t + sum_{j < P} e^{G_t - G_j} (k^_j . k^_t) u_j        (ring part)
    u_t = beta_t (v_t - r_t - sum_{P <= j < t} e^{G_t - G_j} (k^_j . k^_t) u_j)
    o_t = e^{G_t} z_t + sum_{j <= t} e^{G_t - G_j} (k^_j . q^_t) u_j

In matrix form over the step's tokens, w = beta (v - r), u = Tm w and o = r_q + M2 w, where
Tm = (I + diag(beta) L)^-1 (L the strictly lower in-step key Gram, weighted by the decays) and
M2 = CQ Tm (CQ the in-step key-query Gram, diagonal included): two T x T matrices per head.
Accepting a of the T tokens is bookkeeping (P += a); the fold writes S_P and empties the ring.

Ring layout (per pool row, i.e. per (session, layer); RING = 16 entries):

    ring_k [N, H, RING, K]   bf16  the tokens' raw keys: exact inputs of the tensor-core products,
                                   normalised by an fp32 factor where read (a bf16 copy of k^
                                   would put 2^-9 relative error in every update)
    ring_u [N, HV, V, RING]  fp16  corrections u, entry index fastest: a V-row's entries are one
                                   32-byte sector and the A operand of a matrix product as loaded
                                   (fp16 keeps 3 more bits than bf16 in the same bytes). Beside
                                   an fp32 state they are fp32 (64-byte rows), split into fp16
                                   head + tail operands where read.
    ring_g [N, HV, RING]     fp32  G_j, the log-decay from the checkpoint through entry j

Work split. One verify CTA of 8 warps per (batch row, `RingConfig.qk_heads` q/k heads: one, or
in a launch of many rows enough for four value heads, `_ring_api.verify_qk_heads`) handles their
value heads one after another; warp w owns V-rows [16w, 16w + 16) of each. Owning every reader and writer of a row's ring keys in one
CTA is what lets a verify fold a full ring and reuse its slots in the same launch: the ring is
read into shared memory before one barrier and written after it. The fold kernel takes one q/k
head a CTA.

Memory. A CTA waits for memory once: as it starts it loads its first head's state into
registers and copies every head's values and ring corrections into shared memory with cp.async
(no registers held while in flight); a long verify (T >= PREFETCH_FROM_T) instead asks L2 for
every head's state as it starts and reads the first into registers after its prologue, whose
solves would otherwise hold those registers too. Outputs and ring entries leave through a warp's
own shared tile as whole 32-byte sectors (2-byte stores would write sectors partly, which the
memory system pays for as read-modify-writes and extra L2 traffic).

Tensor cores (mma.sync m16n8k16, fp32 accumulate) do the products:
- S0 [k_1..k_T, q_1..q_T]: A = 16 state rows, B = the raw bf16 tokens (exact inputs), 16 MMAs
  per warp and head; the 1/|k|, scale/|q| and e^{G} factors scale the fp32 results.
- the ring part: A = the rows' fp16 corrections (exact; an fp32 state's fp32 ones as head +
  tail), B = the [16 x 2T] coefficients split into fp16 hi + lo parts (two MMAs give ~fp32
  accuracy; three with a correction's tail).
- u = Tm w, o = r_q + M2 w: the fp32 w split into bf16 hi + lo, and Tm, M2 split the same way.
- the fold: S = e^{G_P} S0 + U (w_j k^_j): A = fp16 corrections, B = fp16 weighted keys (for an
  fp32 state both as head + tail, three MMAs).
- per CTA, the Grams of the tokens with the ring's and the step's keys.
The K dimension is permuted consistently on both operands, so that a thread's state fragment is
two 16-byte loads per row chunk, identical for the state as the A operand (verify) and as the
accumulator (fold): lane (g, c) = (lane / 4, lane % 4) holds rows g and g + 8 of its warp's 16,
K elements [32 s + 8 c, 32 s + 8 c + 8) for s = 0..3. Ring entries are permuted the same way
(thread c holds entries 4c..4c+3), so a row's corrections are one 8-byte load.

The state's dtype is a compile-time parameter (`RingConfig.state_dtype`), as in `_decode_kernel`:
a bf16 state is the A operand as loaded and a fold rounds it to bf16 once; an fp32 state's
fragment holds the same K elements as fp32 (two 16-byte loads per chunk), is split into bf16
head + tail A operands for the products (two MMAs, ~2^-16 relative: a bf16 operand would put
2^-9 in every correction) and is the fold's accumulator as it is, stored without rounding. Its
ring's corrections are fp32 and a fold's operands head + tail: fp16 corrections would hold an
fp32 state 36x above its drift in place (bench/RESULTS.md, the drift of drafts). An fp32
fragment is twice the registers, so that variant runs one CTA per SM instead of two (no
128-register cap to spill under).
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T as _ir

from ._ring_api import PREFETCH_FROM_T

RING = 16  # entries per (pool row, head): one k16 step of the products
HEAD_DIM = 128
WARPS = 8
THREADS = 32 * WARPS
MAX_T = 8  # the step's tokens are one n8 tile
EPS = 1e-6
PADDED = HEAD_DIM + 32  # bf16 row stride of the shared key tables
# A verify of PREFETCH_FROM_T tokens or more asks L2 for its value heads' states when it starts
# and reads the first into registers after its prologue (`_ring_api.PREFETCH_FROM_T`)
# Two CTAs per SM (registers capped at 128): one CTA's barriers and tables overlap the other's
# state loads. The carveout stays the driver's default (-1); naming it keeps the compile from
# asking a GPU for its shared memory size, so the kernels also compile where there is none.
_OCCUPANCY = dict(min_blocks_per_mp=2, preferred_smem_carveout=-1)
_OCCUPANCY_FP32 = dict(min_blocks_per_mp=1, preferred_smem_carveout=-1)
STATE_DTYPES = ("bfloat16", "float32")  # the pool's element types; `_api.STATE_DTYPES`


def _row_major(shape: tuple) -> cute.Layout:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return cute.make_layout(shape, stride=tuple(reversed(stride)))


# ----------------------------------------------------------------------------- PTX helpers
def _asm(types: list, args: list, text: str, constraints: str, side_effects: bool = False):
    ret = types[0] if len(types) == 1 else llvm.StructType.get_literal(types)
    return llvm.inline_asm(ret, [x.ir_value() for x in args], text, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _f32s(r, n: int) -> list:
    return [Float32(llvm.extractvalue(_ir.f32(), r, [i])) for i in range(n)]


def _i32s(r, n: int) -> list:
    return [Int32(llvm.extractvalue(_ir.i32(), r, [i])) for i in range(n)]


def _mma(kind: str, a: list, b: list, c: list) -> list:
    """D = A B + C for one m16n8k16 tile; kind 'bf16' or 'f16'; a: 4 Int32, b: 2 Int32 (packed
    pairs), c: 4 Float32. Fragment layouts are PTX's (lane g = lane / 4, c = lane % 4):
    a = A[g][2c:2c+2], A[g+8][2c:2c+2], A[g][8+2c:..], A[g+8][8+2c:..]; b = B[2c:2c+2][g],
    B[8+2c:..][g]; d = D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1]."""
    r = _asm([_ir.f32()] * 4, [*c, *a, *b],
             f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
             "{$0,$1,$2,$3}, {$8,$9,$10,$11}, {$12,$13}, {$4,$5,$6,$7};",
             "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r")
    return _f32s(r, 4)


def _unpack(x, kind: str) -> list:
    """(low, high) halves of a packed bf16x2 / f16x2 word as Float32."""
    r = _asm([_ir.f32()] * 2, [x],
             f"{{ .reg .b16 _l, _h; mov.b32 {{_l, _h}}, $2; cvt.f32.{kind} $0, _l; cvt.f32.{kind} $1, _h; }}", "=f,=f,r")
    return _f32s(r, 2)


def _pack(lo, hi, kind: str):
    """Two Float32 rounded to one packed bf16x2 / f16x2 word (lo in the low half)."""
    return Int32(_asm([_ir.i32()], [lo, hi], f"cvt.rn.{kind}x2.f32 $0, $2, $1;", "=r,f,f"))


def _split(lo, hi, kind: str) -> list:
    """Two Float32 as two packed words (head, tail) with x = head + tail to about 2^-16 (bf16)
    or 2^-22 (f16) relative: the head rounded, the tail the rounded remainder."""
    r = _asm([_ir.i32()] * 2, [lo, hi],
             f"{{ .reg .b32 _p; .reg .b16 _l, _h; .reg .f32 _fl, _fh; cvt.rn.{kind}x2.f32 _p, $3, $2; "
             f"mov.b32 {{_l, _h}}, _p; cvt.f32.{kind} _fl, _l; cvt.f32.{kind} _fh, _h; sub.f32 _fl, $2, _fl; "
             f"sub.f32 _fh, $3, _fh; cvt.rn.{kind}x2.f32 $1, _fh, _fl; mov.b32 $0, _p; }}", "=r,=r,f,f")
    return _i32s(r, 2)


# ----------------------------------------------------------------------------- shared pieces
@cute.jit
def _load16(row32: cute.Tensor, chunk, dst: cute.Tensor):
    """16-byte load of Int32 elements [4 chunk, 4 chunk + 4) of a contiguous row into dst."""
    cute.autovec_copy(cute.flat_divide(row32, (4,))[None, chunk], dst)


@cute.jit
def _load_rows(t32: cute.Tensor, row0, c, dst: cute.Tensor):
    """Rows row0 and row0 + 8 of a [rows, 64] Int32 (bf16 pairs) matrix, this lane's four 16-byte
    chunks [32 s + 8 c, +8) of each, into dst[4, s, r] (the A/B fragment layout of the products)."""
    for r in cutlass.range_constexpr(2):
        for s in cutlass.range_constexpr(4):
            _load16(t32[row0 + 8 * r, None], 4 * s + c, dst[None, s, r])


@cute.jit
def _store_rows(src: cute.Tensor, t32: cute.Tensor, row0, c):
    for r in cutlass.range_constexpr(2):
        for s in cutlass.range_constexpr(4):
            cute.autovec_copy(src[None, s, r], cute.flat_divide(t32[row0 + 8 * r, None], (4,))[None, 4 * s + c])


def _state_fragment(fp32: bool) -> cute.Tensor:
    """Registers for this lane's two state rows (`_load_rows`' K elements): bf16 pairs as Int32
    [4 words, 4 chunks, 2 rows], or fp32 [4, 2 halves, 4 chunks, 2 rows] (element e of a chunk at
    [e % 4, e // 4]: a 16-byte load per half)."""
    if fp32:
        return cute.make_rmem_tensor((4, 2, 4, 2), Float32)
    return cute.make_rmem_tensor((4, 4, 2), Int32)


@cute.jit
def _load_state(t: cute.Tensor, row0, c, dst: cute.Tensor, fp32: cutlass.Constexpr):
    """One value head's state rows row0, row0 + 8 ([V, K] of the state's dtype; bf16 seen as Int32
    pairs) into `_state_fragment` registers."""
    if cutlass.const_expr(fp32):
        for r in cutlass.range_constexpr(2):
            for s in cutlass.range_constexpr(4):
                for hf in cutlass.range_constexpr(2):
                    _load16(t[row0 + 8 * r, None], 8 * s + 2 * c + hf, dst[None, hf, s, r])
    else:
        _load_rows(t, row0, c, dst)


@cute.jit
def _store_state(src: cute.Tensor, t: cute.Tensor, row0, c, fp32: cutlass.Constexpr):
    if cutlass.const_expr(fp32):
        for r in cutlass.range_constexpr(2):
            for s in cutlass.range_constexpr(4):
                for hf in cutlass.range_constexpr(2):
                    cute.autovec_copy(src[None, hf, s, r], cute.flat_divide(t[row0 + 8 * r, None], (4,))[None, 8 * s + 2 * c + hf])
    else:
        _store_rows(src, t, row0, c)


@cute.jit
def _state_at(rS: cute.Tensor, e: int, s: int, r: int) -> Float32:
    """Element e (0..7) of chunk s of row r of an fp32 state fragment."""
    return rS[e % 4, e // 4, s, r]


@cute.jit
def _row_products(rA: cute.Tensor, sTok32: cute.Tensor, g, c, acc: cute.Tensor, fp32: cutlass.Constexpr = False):
    """acc[:, n] += A B_n over K = 128: A = the two rows of rA (an m16 tile, `_load_rows`' layout),
    B_0 = the step's keys (rows 0..7 of sTok32), B_1 its queries (rows 8..15), this lane's token g
    read from shared memory a chunk at a time."""
    rB = cute.make_rmem_tensor((4, 2), Int32)
    for s in cutlass.range_constexpr(4):
        for n in cutlass.range_constexpr(2):
            _load16(sTok32[8 * n + g, None], 4 * s + c, rB[None, n])
        for hf in cutlass.range_constexpr(2):
            if cutlass.const_expr(fp32):  # head + tail of each fp32 pair: two products
                parts = [_split(_state_at(rA, 2 * w, s, r), _state_at(rA, 2 * w + 1, s, r), "bf16")
                         for w in (2 * hf, 2 * hf + 1) for r in (0, 1)]
                for p in cutlass.range_constexpr(2):
                    a = [parts[0][p], parts[1][p], parts[2][p], parts[3][p]]
                    for n in cutlass.range_constexpr(2):
                        d = _mma("bf16", a, [rB[2 * hf, n], rB[2 * hf + 1, n]], [acc[i, n] for i in range(4)])
                        for i in cutlass.range_constexpr(4):
                            acc[i, n] = d[i]
            else:
                a = [rA[2 * hf, s, 0], rA[2 * hf, s, 1], rA[2 * hf + 1, s, 0], rA[2 * hf + 1, s, 1]]
                for n in cutlass.range_constexpr(2):
                    d = _mma("bf16", a, [rB[2 * hf, n], rB[2 * hf + 1, n]], [acc[i, n] for i in range(4)])
                    for i in cutlass.range_constexpr(4):
                        acc[i, n] = d[i]


@cute.jit
def _table_rows(sA32: cute.Tensor, sTok32: cute.Tensor, g, c, acc: cute.Tensor, products: cutlass.Constexpr = True):
    """Rows g and g + 8 of a shared [rows, 64] Int32 (bf16 pairs) table: their sums of squares
    over K (each over the row's 4 lanes), and with `products` acc[:, n] += A B_n as
    `_row_products` takes them. The rows come a 16-byte chunk at a time, so 8 registers of them are
    live rather than 32 (the tables are built while the CTA's first state rows sit in registers)."""
    rA = cute.make_rmem_tensor((4, 2), Int32)
    rB = cute.make_rmem_tensor((4, 2), Int32)
    ss0 = Float32(0.0)
    ss1 = Float32(0.0)
    for s in cutlass.range_constexpr(4):
        for r in cutlass.range_constexpr(2):
            _load16(sA32[g + 8 * r, None], 4 * s + c, rA[None, r])
        for i in cutlass.range_constexpr(4):
            lo, hi = _unpack(rA[i, 0], "bf16")
            ss0 = ss0 + lo * lo + hi * hi
            lo, hi = _unpack(rA[i, 1], "bf16")
            ss1 = ss1 + lo * lo + hi * hi
        if cutlass.const_expr(products):
            for n in cutlass.range_constexpr(2):
                _load16(sTok32[8 * n + g, None], 4 * s + c, rB[None, n])
            for hf in cutlass.range_constexpr(2):
                a = [rA[2 * hf, 0], rA[2 * hf, 1], rA[2 * hf + 1, 0], rA[2 * hf + 1, 1]]
                for n in cutlass.range_constexpr(2):
                    d = _mma("bf16", a, [rB[2 * hf, n], rB[2 * hf + 1, n]], [acc[i, n] for i in range(4)])
                    for i in cutlass.range_constexpr(4):
                        acc[i, n] = d[i]
    ss0 = ss0 + cute.arch.shuffle_sync_bfly(ss0, offset=1)
    ss0 = ss0 + cute.arch.shuffle_sync_bfly(ss0, offset=2)
    ss1 = ss1 + cute.arch.shuffle_sync_bfly(ss1, offset=1)
    ss1 = ss1 + cute.arch.shuffle_sync_bfly(ss1, offset=2)
    return ss0, ss1


@cute.jit
def _log_gates(a_raw, b_raw, neg_a: Float32, dt_bias: Float32, sp_beta: Float32, sp_threshold: Float32):
    """(log-decay, beta) of one token: -exp(A_log) * softplus(a + dt_bias), sigmoid(b)."""
    x = a_raw.to(Float32) + dt_bias
    bx = sp_beta * x
    softplus = x
    if bx <= sp_threshold:
        softplus = cute.math.log(Float32(1.0) + cute.math.exp(bx, fastmath=True), fastmath=True) / sp_beta
    beta = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-b_raw.to(Float32), fastmath=True))
    return neg_a * softplus, beta


def _prefetch_l2(t: cute.Tensor, nbytes: int) -> None:
    """Ask L2 for the `nbytes` contiguous bytes at `t` (one bulk prefetch: no registers or shared
    memory held, nothing to wait for)."""
    llvm.inline_asm(None, [t.iterator.toint().ir_value(), Int32(nbytes).ir_value()],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def _async_copy_atom():
    """16-byte global -> shared copies that hold no registers while in flight (cp.async)."""
    return cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32, num_bits_per_copy=128)


@cute.jit
def _stage_rows(atom, src: cute.Tensor, dst: cute.Tensor, head0, group: int, rows: int, chunks: int, tidx):
    """cp.async of heads head0 .. head0 + group - 1 of src [heads, rows, 4 chunks Int32] into dst
    [group, rows, 4 chunks]: one 16-byte chunk per thread per pass, no registers held while in
    flight. The step's values (one batch row's, heads first) and the ring corrections (one pool
    row's) both come this way."""
    n = group * rows * chunks
    for it in cutlass.range_constexpr((n + THREADS - 1) // THREADS):
        idx = tidx + it * THREADS
        if idx < n:
            h = idx // (rows * chunks)
            row = (idx // chunks) % rows
            ch = idx % chunks
            cute.copy(atom, cute.flat_divide(src[head0 + h, row, None], (4,))[None, ch],
                      cute.flat_divide(dst[h, row, None], (4,))[None, ch])


def _heads_first(t: cute.Tensor) -> cute.Tensor:
    """A [T, HV, W] view as [HV, T, W] (the same memory)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0, 2]))


def _ring_u_fragment(fp32: bool) -> cute.Tensor:
    """Registers for `_ring_u_regs`: [2 pairs, 2 rows, head | tail] packed fp16 pairs (no tail
    for a bf16 state)."""
    return cute.make_rmem_tensor((2, 2, 2 if fp32 else 1), Int32)


@cute.jit
def _ring_u_regs(sU: cute.Tensor, P, row0, c, rU: cute.Tensor, fp32: cutlass.Constexpr = False):
    """The rows' corrections of entries 4c..4c+3 from the head's staged ring as A operands
    (rU[p, r, 0] = entries 4c + 2p, +1 of row r), entries >= P zeroed (a stale slot must not
    meet a zero weight as inf * 0; unstaged shared memory is never more than a select's input).
    A bf16 state's ring holds them as fp16 (sU [V, 8] Int32 pairs), an fp32 state's as fp32
    (sU [V, 16] fp32 bits), split here into fp16 head rU[p, r, 0] and tail rU[p, r, 1]."""
    sUf = cute.recast_tensor(sU, Float32)
    for p in cutlass.range_constexpr(2):
        j = 4 * c + 2 * p
        for r in cutlass.range_constexpr(2):
            if cutlass.const_expr(fp32):
                x0 = cutlass.select_(j < P, sUf[row0 + 8 * r, j], Float32(0.0))
                x1 = cutlass.select_(j + 1 < P, sUf[row0 + 8 * r, j + 1], Float32(0.0))
                parts = _split(x0, x1, "f16")
                rU[p, r, 0] = parts[0]
                rU[p, r, 1] = parts[1]
            else:
                x = sU[row0 + 8 * r, 2 * c + p]
                rU[p, r, 0] = cutlass.select_(j + 1 < P, x, cutlass.select_(j < P, x & Int32(0xFFFF), Int32(0)))


@cute.jit
def _store_outputs(o: list, sO32: cute.Tensor, mO32: cute.Tensor, b, head, warp, lane, g, c, T: int):
    """This warp's outputs of one head (o[i]: row 16 warp + g + 8 (i // 2), token 2c + i % 2) as
    whole 32-byte sectors, one per token: gathered in the warp's own shared tile sO32 [8 tokens,
    8 bf16 pairs], then one 16-byte store per lane (2-byte stores to global memory would each
    leave a sector partly written)."""
    sO = cute.recast_tensor(sO32, BFloat16)
    cute.arch.sync_warp()  # the previous head's copy-out has read the tile
    for i in cutlass.range_constexpr(4):
        t = 2 * c + i % 2
        if t < T:
            sO[t, g + 8 * (i // 2)] = o[i].to(BFloat16)
    cute.arch.sync_warp()
    if lane < 2 * T:
        t = lane // 2
        cute.autovec_copy(cute.flat_divide(sO32[t, None], (4,))[None, lane % 2],
                          cute.flat_divide(mO32[b, t, head, None], (4,))[None, 2 * warp + lane % 2])


@cute.jit
def _store_ring_u(u: list, sU: cute.Tensor, gU32: cute.Tensor, peff, warp, lane, g, c, T: int,
                  fp32: cutlass.Constexpr = False):
    """The step's corrections (u[i]: row 16 warp + g + 8 (i // 2), token 2c + i % 2, entry
    peff + token) written into the head's staged ring rows (sU [V, 8 | 16] Int32: fp16 pairs for a
    bf16 state, fp32 for an fp32 one; this warp's 16 rows its own), which then go out whole: 32
    (64) bytes a row, one (two) 16-byte stores per lane. Entries past the new ones carry whatever
    sU held: nothing reads a ring past its P."""
    cute.arch.sync_warp()  # every lane has read its corrections from these rows
    elem = Float32 if fp32 else Float16
    sUe = cute.recast_tensor(sU, elem)
    for i in cutlass.range_constexpr(4):
        t = 2 * c + i % 2
        if t < T:
            sUe[16 * warp + g + 8 * (i // 2), peff + t] = u[i].to(elem)
    cute.arch.sync_warp()
    chunks = 4 if fp32 else 2
    for it in cutlass.range_constexpr(chunks // 2):
        idx = lane + 32 * it
        row = 16 * warp + idx // chunks
        cute.autovec_copy(cute.flat_divide(sU[row, None], (4,))[None, idx % chunks],
                          cute.flat_divide(gU32[row, None], (4,))[None, idx % chunks])


@cute.jit
def _fold_rows(rS: cute.Tensor, rU: cute.Tensor, sKw: cute.Tensor, decay: Float32, g, c, fp32: cutlass.Constexpr = False):
    """rS (`_state_fragment`) <- e^{G_P} S0 + U (w_j k^_j): 16 n8 tiles, the
    accumulator of tile 4s + i the thread's own state chunk s, elements [2i, 2i + 2). For a bf16
    state, U and w_j k^_j are one fp16 operand each: their 2^-12 roundings are a quarter of the
    bf16 rounding of the state that follows, and tails would cost 32 registers (the occupancy).
    An fp32 state takes both as fp16 head + tail (three products: head head, head tail, tail
    head; about 2^-22), or each fold would put 2^-12 into a state that keeps 2^-24."""
    a = [rU[0, 0, 0], rU[0, 1, 0], rU[1, 0, 0], rU[1, 1, 0]]
    for s in cutlass.range_constexpr(4):
        for i in cutlass.range_constexpr(4):
            if cutlass.const_expr(fp32):
                d = [_state_at(rS, 2 * i + e, s, r) * decay for r in (0, 1) for e in (0, 1)]
            else:
                lo0, hi0 = _unpack(rS[i, s, 0], "bf16")
                lo1, hi1 = _unpack(rS[i, s, 1], "bf16")
                d = [lo0 * decay, hi0 * decay, lo1 * decay, hi1 * decay]
            kp = 32 * s + 8 * (g // 2) + 2 * i + g % 2  # the K element of column g of this tile
            d = _mma("f16", a, [sKw[kp, 2 * c], sKw[kp, 2 * c + 1]], d)
            if cutlass.const_expr(fp32):
                d = _mma("f16", a, [sKw[kp, 8 + 2 * c], sKw[kp, 8 + 2 * c + 1]], d)
                d = _mma("f16", [rU[0, 0, 1], rU[0, 1, 1], rU[1, 0, 1], rU[1, 1, 1]], [sKw[kp, 2 * c], sKw[kp, 2 * c + 1]], d)
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        rS[(2 * i + e) % 4, (2 * i + e) // 4, s, r] = d[2 * r + e]
            else:
                rS[i, s, 0] = _pack(d[0], d[1], "bf16")
                rS[i, s, 1] = _pack(d[2], d[3], "bf16")


@cute.jit
def _stage_ring_keys(rk32: cute.Tensor, sRK32: cute.Tensor, P, tidx):
    """Entries < P of the head's raw ring keys into shared memory (zeros past P): one 16-byte
    chunk per thread."""
    j = tidx // 16
    ch = tidx % 16
    tmp = cute.make_rmem_tensor((4,), Int32)
    tmp.fill(0)
    if j < P:
        _load16(rk32[j, None], ch, tmp)
    cute.autovec_copy(tmp, cute.flat_divide(sRK32[j, None], (4,))[None, ch])


@cute.jit
def _fold_tables(sRK: cute.Tensor, sRn: cute.Tensor, sGr: cute.Tensor, sKw: cute.Tensor, sDec: cute.Tensor,
                 P, heads: int, group: int, tidx, fp32: cutlass.Constexpr = False):
    """sKw[h, k, entries] = w_j k^_j in fp16 (an fp32 state's: fp16 heads, then their tails from
    column 8), w_j = e^{G_P - G_j} (0 past P), and sDec[h] = e^{G_P}, for the CTA's `heads` value
    heads (value head h reads the keys of its q/k head h // group: sRK [q/k heads, RING, K],
    sRn [q/k heads, RING]): thread -> K element tidx % 128, entries 8 (tidx // 128) .. +8."""
    k = tidx % HEAD_DIM
    jh = tidx // HEAD_DIM
    for h in cutlass.range_constexpr(heads):
        qi = h // group
        gp = sGr[h, P - 1]
        for e in cutlass.range_constexpr(4):
            j = 8 * jh + 2 * e
            x = []
            for d in cutlass.range_constexpr(2):
                w = cute.math.exp(gp - sGr[h, j + d], fastmath=True) * sRn[qi, j + d]
                x.append(cutlass.select_(j + d < P, sRK[qi, j + d, k].to(Float32) * w, Float32(0.0)))
            if cutlass.const_expr(fp32):
                parts = _split(x[0], x[1], "f16")
                sKw[h, k, 4 * jh + e] = parts[0]
                sKw[h, k, 8 + 4 * jh + e] = parts[1]
            else:
                sKw[h, k, 4 * jh + e] = _pack(x[0], x[1], "f16")
        if tidx == h:
            sDec[h] = cute.math.exp(gp, fastmath=True)


# ----------------------------------------------------------------------------- kernels
@dataclass(frozen=True)
class RingConfig:
    """Static configuration of one compiled verify (T > 0) or fold (T = 0)."""

    T: int  # tokens of a verify; 0 for the fold
    H: int
    HV: int
    state_dtype: str = "bfloat16"  # the pool's element type, one of STATE_DTYPES
    qk_heads: int = 1  # q/k heads one verify CTA covers (`_ring_api.verify_qk_heads`); the fold's is 1

    @property
    def fp32(self) -> bool:
        return self.state_dtype == "float32"

    @property
    def group(self) -> int:
        """Value heads per q/k head."""
        return self.HV // self.H

    @property
    def u_words(self) -> int:
        """32-bit words of a ring-correction row (16 entries): fp16 for a bf16 state, fp32 for an fp32 one."""
        return RING * (4 if self.fp32 else 2) // 4

    @property
    def occupancy(self) -> dict:
        return _OCCUPANCY_FP32 if self.fp32 else _OCCUPANCY

    @property
    def name_suffix(self) -> str:  # the bf16 kernels keep their names
        return "_f32state" if self.fp32 else ""


class RingVerifyKernel:
    """A speculative step of T tokens over the history ring (module docstring). A row whose
    P + T > RING first folds its P entries into its state (written in place; a bf16 state rounded
    once) and appends at entry 0: the caller's new P is then `accepted`, else P + `accepted`."""

    def __init__(self, cfg: RingConfig):
        if (not 1 <= cfg.T <= MAX_T or cfg.H < 1 or cfg.HV % cfg.H or cfg.HV // cfg.H > WARPS
                or cfg.state_dtype not in STATE_DTYPES or not 1 <= cfg.qk_heads <= WARPS // 2 or cfg.H % cfg.qk_heads):
            raise ValueError(f"bad ring verify config {cfg}")
        self.cfg = cfg

    def __repr__(self) -> str:
        c = self.cfg
        wide = f"_qk{c.qk_heads}" if c.qk_heads > 1 else ""
        return f"GdnRingVerify_T{c.T}_H{c.H}_HV{c.HV}{wide}{c.name_suffix}"

    @cute.jit
    def __call__(
        self,
        mS: cute.Tensor,  # [N, HV, V, K] bf16 or fp32 checkpoint states (written only by a fold)
        mRow: cute.Tensor,  # [B] int32 pool row; < 0: padding
        mHist: cute.Tensor,  # [B] int32 committed ring entries P
        mLayer: cute.Tensor,  # [B] int32
        mQ: cute.Tensor,  # [B, T, H, K] bf16
        mK: cute.Tensor,  # [B, T, H, K] bf16
        mV: cute.Tensor,  # [B, T, HV, V] bf16
        mA: cute.Tensor,  # [B, T, HV] bf16
        mB: cute.Tensor,  # [B, T, HV] bf16
        mALog: cute.Tensor,  # [L, HV] fp32
        mDtBias: cute.Tensor,  # [L, HV] fp32
        mRingK: cute.Tensor,  # [N, H, RING, K] bf16
        mRingU: cute.Tensor,  # [N, HV, V, RING] fp16
        mRingG: cute.Tensor,  # [N, HV, RING] fp32
        mO: cute.Tensor,  # [B, T, HV, V] bf16
        scale: Float32,
        softplus_beta: Float32,
        softplus_threshold: Float32,
        stream: cuda.CUstream,
    ):
        self.kernel(
            mS, mRow, mHist, mLayer, mQ, mK, mV, mA, mB, mALog, mDtBias, mRingK, mRingU, mRingG, mO,
            scale, softplus_beta, softplus_threshold,
        ).launch(grid=(mRow.shape[0] * (self.cfg.H // self.cfg.qk_heads), 1, 1), block=(THREADS, 1, 1), stream=stream,
                 **self.cfg.occupancy)

    @cute.kernel
    def kernel(
        self,
        mS: cute.Tensor,
        mRow: cute.Tensor,
        mHist: cute.Tensor,
        mLayer: cute.Tensor,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mRingK: cute.Tensor,
        mRingU: cute.Tensor,
        mRingG: cute.Tensor,
        mO: cute.Tensor,
        scale: Float32,
        softplus_beta: Float32,
        softplus_threshold: Float32,
    ):
        cfg = self.cfg
        T = cfg.T
        group = cfg.group
        Q = cfg.qk_heads  # q/k heads of this CTA
        heads = Q * group  # its value heads: h = 0..heads-1 is value head head0 + h, of q/k head qh0 + h // group
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        b = bidx // (cfg.H // Q)
        qh0 = (bidx % (cfg.H // Q)) * Q
        head0 = qh0 * group
        row0 = 16 * warp + g  # this thread's V-rows: row0, row0 + 8

        smem = cutlass.memory.SmemAllocator()
        # rows padded to 320 bytes: a quarter warp's 16-byte reads of rows g, g + 1 hit distinct banks
        sRK = smem.allocate_tensor(BFloat16, cute.make_layout((Q, RING, HEAD_DIM), stride=(RING * PADDED, PADDED, 1)),
                                   byte_alignment=16)
        sRK32 = cute.recast_tensor(sRK, Int32)
        sTok = smem.allocate_tensor(BFloat16, cute.make_layout((Q, 16, HEAD_DIM), stride=(16 * PADDED, PADDED, 1)),
                                    byte_alignment=16)
        sTok32 = cute.recast_tensor(sTok, Int32)  # per q/k head: raw k_0..k_7, q_0..q_7 (zeros past T)
        sGram = smem.allocate_tensor(Float32, _row_major((Q, 2, 2, RING, 8)), byte_alignment=16)  # [qi, ring|step, k|q, j, t]
        sTn = smem.allocate_tensor(Float32, _row_major((Q, 2, 8)), byte_alignment=16)  # 1/|k_t|, scale/|q_t|
        sRn = smem.allocate_tensor(Float32, _row_major((Q, RING)), byte_alignment=16)  # 1/|ring k_j|
        sLg = smem.allocate_tensor(Float32, _row_major((heads, 8)), byte_alignment=16)  # log-decays
        sBeta = smem.allocate_tensor(Float32, _row_major((heads, 8)), byte_alignment=16)
        sGr = smem.allocate_tensor(Float32, _row_major((heads, RING)), byte_alignment=16)  # ring G_j
        sSc = smem.allocate_tensor(Float32, _row_major((heads, 2, 8)), byte_alignment=16)  # e^{G_t} / |k_t|, .. |q_t|
        sCR = smem.allocate_tensor(Int32, _row_major((heads, 2, 2, 8, RING // 2)), byte_alignment=16)  # [h, hi|lo, k|q, t, j/2]
        sTM = smem.allocate_tensor(Int32, _row_major((heads, 2, 2, 8, 4)), byte_alignment=16)  # [h, hi|lo, Tm|M2, t, j/2]
        sKw = smem.allocate_tensor(Int32, _row_major((heads, HEAD_DIM, cfg.u_words)), byte_alignment=16)
        sDec = smem.allocate_tensor(Float32, _row_major((heads,)), byte_alignment=16)
        sU = smem.allocate_tensor(Int32, _row_major((heads, HEAD_DIM, cfg.u_words)), byte_alignment=16)  # ring u
        sV32 = smem.allocate_tensor(Int32, _row_major((heads, T, HEAD_DIM // 2)), byte_alignment=16)  # v, bf16 pairs
        sV = cute.recast_tensor(sV32, BFloat16)
        sO32 = smem.allocate_tensor(Int32, _row_major((WARPS, 8, 8)), byte_alignment=16)  # per warp [token, bf16 pairs]

        fp32 = cfg.fp32
        s32 = mS if cutlass.const_expr(fp32) else cute.recast_tensor(mS, Int32)  # [N, HV, V, 128 fp32 | 64 bf16 pairs]
        u32 = cute.recast_tensor(mRingU, Int32)  # [N, HV, V, 8]
        rk32 = cute.recast_tensor(mRingK, Int32)  # [N, H, RING, 64]
        k32 = cute.recast_tensor(mK, Int32)  # [B, T, H, 64]
        q32 = cute.recast_tensor(mQ, Int32)
        v32 = cute.recast_tensor(mV, Int32)  # [B, T, HV, 64]
        o32 = cute.recast_tensor(mO, Int32)  # [B, T, HV, 64]

        slot = mRow[b]
        if slot >= 0:  # uniform per CTA
            P = cutlass.max(cutlass.min(mHist[b], Int32(RING)), Int32(0))
            fold = P + T > RING
            peff = cutlass.select_(fold, Int32(0), P)  # ring entries the verify reads
            layer = mLayer[b]

            # 1. loads: head 0's state rows, the tokens (B fragments), the ring keys and G, the gates;
            #    the later heads' states asked of L2, and every head's values and ring corrections
            #    copied to shared memory without holding registers: a CTA waits for memory once,
            #    not once per head
            rS = _state_fragment(fp32)
            if cutlass.const_expr(T >= PREFETCH_FROM_T):
                # a long prologue: every head's state asked of L2 now, the first read into registers
                # after it (its solves would otherwise hold those 32 registers too)
                if tidx == 0:
                    for h in cutlass.range_constexpr(heads):
                        _prefetch_l2(s32[slot, head0 + h, None, None], HEAD_DIM * HEAD_DIM * (4 if fp32 else 2))
            else:
                _load_state(s32[slot, head0, None, None], row0, c, rS, fp32)
            atom = _async_copy_atom()
            _stage_rows(atom, _heads_first(v32[b, None, None, None]), sV32, head0, heads, T, 16, tidx)
            # every row's whole ring, P = 0 too: the rows go back whole, and bytes past the new
            # entries must be what was there (a launch's memory is a function of its inputs)
            _stage_rows(atom, u32[slot, None, None, None], sU, head0, heads, HEAD_DIM, cfg.u_words // 4, tidx)
            cute.arch.cp_async_commit_group()
            for qi in cutlass.range_constexpr(Q):
                tmp = cute.make_rmem_tensor((4,), Int32)  # thread -> (k|q, token, 16-byte chunk)
                tmp.fill(0)
                n = tidx // 128
                t = (tidx // 16) % 8
                if t < T:
                    if n == 0:
                        _load16(k32[b, t, qh0 + qi, None], tidx % 16, tmp)
                    else:
                        _load16(q32[b, t, qh0 + qi, None], tidx % 16, tmp)
                cute.autovec_copy(tmp, cute.flat_divide(sTok32[qi, 8 * n + t, None], (4,))[None, tidx % 16])
                _stage_ring_keys(rk32[slot, qh0 + qi, None, None], sRK32[qi, None, None], P, tidx)
            if tidx < heads * 8:
                h = tidx // 8
                t = tidx % 8
                lg = Float32(0.0)
                beta = Float32(0.0)
                if t < T:
                    head = head0 + h
                    lg, beta = _log_gates(mA[b, t, head], mB[b, t, head], -cute.math.exp(mALog[layer, head], fastmath=True),
                                          mDtBias[layer, head], softplus_beta, softplus_threshold)
                sLg[h, t] = lg
                sBeta[h, t] = beta
            if tidx < heads * RING:
                h = tidx // RING
                j = tidx % RING
                gj = mRingG[slot, head0 + h, j]
                sGr[h, j] = cutlass.select_(j < P, gj, Float32(0.0))
            cute.arch.sync_threads()

            # 2. norms and Grams, per q/k head qi: warp 2 qi the ring keys with the tokens, warp
            #    2 qi + 1 the step's keys
            for qi in cutlass.range_constexpr(Q):
                if warp == 2 * qi:
                    acc = cute.make_rmem_tensor((4, 2), Float32)
                    acc.fill(0.0)
                    ss0, ss1 = _table_rows(sRK32[qi, None, None], sTok32[qi, None, None], g, c, acc)
                    if c == 0:
                        sRn[qi, g] = cute.math.rsqrt(ss0 + EPS, fastmath=True)
                        sRn[qi, g + 8] = cute.math.rsqrt(ss1 + EPS, fastmath=True)
                    for n in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(4):
                            sGram[qi, 0, n, g + 8 * (i // 2), 2 * c + i % 2] = acc[i, n]
                if warp == 2 * qi + 1:
                    acc = cute.make_rmem_tensor((4, 2), Float32)
                    acc.fill(0.0)
                    # rows k_g, q_g; rows g: k_g . (k|q)_t; rows g + 8 (q_g . x) unused
                    ssk, ssq = _table_rows(sTok32[qi, None, None], sTok32[qi, None, None], g, c, acc)
                    if c == 0:
                        sTn[qi, 0, g] = cute.math.rsqrt(ssk + EPS, fastmath=True)
                        sTn[qi, 1, g] = cute.math.rsqrt(ssq + EPS, fastmath=True) * scale
                    for n in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(2):
                            sGram[qi, 1, n, g, 2 * c + i] = acc[i, n]
            cute.arch.sync_threads()

            # 3. per-head tables
            # ring coefficients e^{G_t - G_j} (k^_j . k^_t | q^_t) as fp16 head + tail: (h, k|q, t, j pair)
            for it in cutlass.range_constexpr((heads * 128 + THREADS - 1) // THREADS):
                idx = tidx + it * THREADS
                if idx < heads * 128:
                    h = idx // 128
                    qi = h // group
                    n = (idx // 64) % 2
                    t = (idx // 8) % 8
                    jp = idx % 8
                    gt = self._g_at(sLg, sGr, h, t, peff)
                    x = []
                    for d in cutlass.range_constexpr(2):
                        j = 2 * jp + d
                        val = (cute.math.exp(gt - sGr[h, j], fastmath=True) * sRn[qi, j] * sTn[qi, n, t]
                               * sGram[qi, 0, n, j, t])
                        x.append(cutlass.select_(j < peff, cutlass.select_(t < T, val, Float32(0.0)), Float32(0.0)))
                    hi, lo = _split(x[0], x[1], "f16")
                    sCR[h, 0, n, t, jp] = hi
                    sCR[h, 1, n, t, jp] = lo
            if tidx < heads * 16:
                h = tidx // 16
                n = (tidx // 8) % 2
                t = tidx % 8
                gt = self._g_at(sLg, sGr, h, t, peff)
                sSc[h, n, t] = cutlass.select_(t < T, cute.math.exp(gt, fastmath=True) * sTn[h // group, n, t], Float32(0.0))
            if warp < heads:
                qi = warp // group
                self._solve_tables(sLg, sBeta, sGr, sGram[qi, None, None, None, None], sTn[qi, None, None], sTM, warp,
                                   lane, peff)
            if fold:
                _fold_tables(sRK, sRn, sGr, sKw, sDec, P, heads, group, tidx, fp32)
            # the step's entries join the ring (after the barrier above: nothing reads the ring's
            # keys or G from memory past it, so a fold's slots can be reused)
            if tidx < heads * T:
                h = tidx // T
                t = tidx % T
                mRingG[slot, head0 + h, peff + t] = self._g_at(sLg, sGr, h, t, peff)
            if tidx < T * 16:
                t = tidx // 16
                ch = tidx % 16
                for qi in cutlass.range_constexpr(Q):
                    tmp = cute.make_rmem_tensor((4,), Int32)
                    _load16(sTok32[qi, t, None], ch, tmp)
                    cute.autovec_copy(tmp, cute.flat_divide(rk32[slot, qh0 + qi, peff + t, None], (4,))[None, ch])
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            # 4. the value heads, one after another; each warp its 16 rows
            if cutlass.const_expr(T >= PREFETCH_FROM_T):
                _load_state(s32[slot, head0, None, None], row0, c, rS, fp32)
            rU = _ring_u_fragment(fp32)
            rV = cute.make_rmem_tensor((4,), Float32)
            acc = cute.make_rmem_tensor((4, 2), Float32)
            for h in cutlass.range_constexpr(heads):
                head = head0 + h
                gS = s32[slot, head, None, None]
                # the corrections and values are read from shared memory where they are used, so
                # that they hold no registers across the state's products
                if fold:
                    _ring_u_regs(sU[h, None, None], P, row0, c, rU, fp32)
                    _fold_rows(rS, rU, sKw[h, None, None], sDec[h], g, c, fp32)
                    _store_state(rS, gS, row0, c, fp32)
                acc.fill(0.0)
                _row_products(rS, sTok32[h // group, None, None], g, c, acc, fp32)  # [v, t]: S k_t | S q_t, raw
                if cutlass.const_expr(h + 1 < heads):
                    _load_state(s32[slot, head + 1, None, None], row0, c, rS, fp32)
                for n in cutlass.range_constexpr(2):
                    for i in cutlass.range_constexpr(4):
                        acc[i, n] = acc[i, n] * sSc[h, n, 2 * c + i % 2]
                if peff > 0:
                    _ring_u_regs(sU[h, None, None], P, row0, c, rU, fp32)
                    # corrections x coefficients (head, tail); an fp32 state's corrections' tails too
                    for m in cutlass.range_constexpr(3 if fp32 else 2):  # (part, hl): (0, 0), (0, 1), (1, 0)
                        a = [rU[0, 0, m // 2], rU[0, 1, m // 2], rU[1, 0, m // 2], rU[1, 1, m // 2]]
                        for n in cutlass.range_constexpr(2):
                            d = _mma("f16", a, [sCR[h, m % 2, n, g, 2 * c], sCR[h, m % 2, n, g, 2 * c + 1]],
                                     [acc[i, n] for i in range(4)])
                            for i in cutlass.range_constexpr(4):
                                acc[i, n] = d[i]
                for i in cutlass.range_constexpr(4):
                    t = 2 * c + i % 2
                    rV[i] = Float32(0.0)
                    if t < T:
                        rV[i] = sV[h, t, row0 + 8 * (i // 2)].to(Float32)
                # w = beta (v - r) as bf16 head + tail: the A operand [v, (j head | j tail)]
                w = []
                for i in cutlass.range_constexpr(4):
                    t = 2 * c + i % 2
                    w.append(cutlass.select_(t < T, sBeta[h, t] * (rV[i] - acc[i, 0]), Float32(0.0)))
                w0 = _split(w[0], w[1], "bf16")
                w1 = _split(w[2], w[3], "bf16")
                aw = [w0[0], w1[0], w0[1], w1[1]]
                zero = Int32(0)
                for m in cutlass.range_constexpr(2):  # Tm (the corrections), M2 (the outputs), each stored at once
                    hi = sTM[h, 0, m, g, c]
                    lo = sTM[h, 1, m, g, c]
                    d = [Float32(0.0)] * 4
                    if cutlass.const_expr(m == 1):
                        d = [acc[i, 1] for i in range(4)]
                    d = _mma("bf16", aw, [hi, hi], d)
                    d = _mma("bf16", aw, [lo, zero], d)
                    if cutlass.const_expr(m == 0):
                        _store_ring_u(d, sU[h, None, None], u32[slot, head, None, None], peff, warp, lane, g, c, T, fp32)
                    else:
                        _store_outputs(d, sO32[warp, None, None], o32, b, head, warp, lane, g, c, T)
        else:
            if tidx < HEAD_DIM:  # padding row: zero outputs
                for h in cutlass.range_constexpr(heads):
                    for t in cutlass.range_constexpr(T):
                        mO[b, t, head0 + h, tidx] = BFloat16(0.0)

    @cute.jit
    def _g_at(self, sLg: cute.Tensor, sGr: cute.Tensor, h, t, peff) -> Float32:
        """G of the step's token t (any t < 8): the ring's last G plus the step's log-decays."""
        acc = cutlass.select_(peff > 0, sGr[h, cutlass.max(peff - 1, Int32(0))], Float32(0.0))
        for i in cutlass.range_constexpr(self.cfg.T):
            acc = acc + cutlass.select_(i <= t, sLg[h, i], Float32(0.0))
        return acc

    @cute.jit
    def _solve_tables(self, sLg: cute.Tensor, sBeta: cute.Tensor, sGr: cute.Tensor, sGram: cute.Tensor, sTn: cute.Tensor,
                      sTM: cute.Tensor, h, lane, peff):
        """Warp h: lane j0 = lane % 8 solves column j0 of Tm = (I + diag(beta) L)^-1 by forward
        substitution and forms column j0 of M2 = CQ Tm; both stored as bf16 head + tail pairs."""
        T = self.cfg.T
        j0 = lane % 8
        gs = []
        acc = cutlass.select_(peff > 0, sGr[h, cutlass.max(peff - 1, Int32(0))], Float32(0.0))
        for t in cutlass.range_constexpr(T):
            acc = acc + sLg[h, t]
            gs.append(acc)
        x = []
        for t in cutlass.range_constexpr(T):
            acc = cutlass.select_(j0 == t, Float32(1.0), Float32(0.0))
            for j in cutlass.range_constexpr(t):
                ell = cute.math.exp(gs[t] - gs[j], fastmath=True) * sTn[0, j] * sTn[0, t] * sGram[1, 0, j, t]
                acc = acc - sBeta[h, t] * ell * x[j]
            x.append(acc)
        m2 = []
        for t in cutlass.range_constexpr(T):
            acc = Float32(0.0)
            for j in cutlass.range_constexpr(t + 1):
                cq = cute.math.exp(gs[t] - gs[j], fastmath=True) * sTn[0, j] * sTn[1, t] * sGram[1, 1, j, t]
                acc = acc + cq * x[j]
            m2.append(acc)
        tables = [x + [Float32(0.0)] * (8 - T), m2 + [Float32(0.0)] * (8 - T)]
        for t in cutlass.range_constexpr(8):
            for m in cutlass.range_constexpr(2):
                mine = tables[m][t]
                other = cute.arch.shuffle_sync_bfly(mine, offset=1)
                hi, lo = _split(mine, other, "bf16")
                if lane < 8:
                    if j0 % 2 == 0:
                        sTM[h, 0, m, t, j0 // 2] = hi
                        sTM[h, 1, m, t, j0 // 2] = lo


class RingFoldKernel:
    """Folds each row's first `hist` ring entries into its state, written in place (a bf16 state
    rounded once; module docstring); the caller then sets the row's P to 0."""

    def __init__(self, cfg: RingConfig):
        if cfg.T != 0 or cfg.H < 1 or cfg.HV % cfg.H or cfg.state_dtype not in STATE_DTYPES or cfg.qk_heads != 1:
            raise ValueError(f"bad ring fold config {cfg}")
        self.cfg = cfg

    def __repr__(self) -> str:
        return f"GdnRingFold_H{self.cfg.H}_HV{self.cfg.HV}{self.cfg.name_suffix}"

    @cute.jit
    def __call__(
        self,
        mS: cute.Tensor,  # [N, HV, V, K] bf16 or fp32, updated in place
        mRow: cute.Tensor,  # [B] int32 pool row; < 0: padding
        mHist: cute.Tensor,  # [B] int32 entries to fold (0: nothing)
        mRingK: cute.Tensor,  # [N, H, RING, K] bf16
        mRingU: cute.Tensor,  # [N, HV, V, RING] fp16
        mRingG: cute.Tensor,  # [N, HV, RING] fp32
        stream: cuda.CUstream,
    ):
        self.kernel(mS, mRow, mHist, mRingK, mRingU, mRingG).launch(
            grid=(mRow.shape[0] * self.cfg.H, 1, 1), block=(THREADS, 1, 1), stream=stream, **self.cfg.occupancy)

    @cute.kernel
    def kernel(
        self,
        mS: cute.Tensor,
        mRow: cute.Tensor,
        mHist: cute.Tensor,
        mRingK: cute.Tensor,
        mRingU: cute.Tensor,
        mRingG: cute.Tensor,
    ):
        cfg = self.cfg
        group = cfg.HV // cfg.H
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        b = bidx // cfg.H
        qh = bidx % cfg.H
        row0 = 16 * warp + g

        smem = cutlass.memory.SmemAllocator()
        # the key tables of one q/k head, shaped as the verify's (`_fold_tables`)
        sRK = smem.allocate_tensor(BFloat16, cute.make_layout((1, RING, HEAD_DIM), stride=(RING * PADDED, PADDED, 1)),
                                   byte_alignment=16)
        sRK32 = cute.recast_tensor(sRK, Int32)[0, None, None]
        sRn = smem.allocate_tensor(Float32, _row_major((1, RING)), byte_alignment=16)
        sGr = smem.allocate_tensor(Float32, _row_major((group, RING)), byte_alignment=16)
        sKw = smem.allocate_tensor(Int32, _row_major((group, HEAD_DIM, cfg.u_words)), byte_alignment=16)
        sDec = smem.allocate_tensor(Float32, _row_major((group,)), byte_alignment=16)
        sU = smem.allocate_tensor(Int32, _row_major((group, HEAD_DIM, cfg.u_words)), byte_alignment=16)

        fp32 = cfg.fp32
        s32 = mS if cutlass.const_expr(fp32) else cute.recast_tensor(mS, Int32)
        u32 = cute.recast_tensor(mRingU, Int32)
        rk32 = cute.recast_tensor(mRingK, Int32)

        slot = mRow[b]
        P = cutlass.max(cutlass.min(mHist[b], Int32(RING)), Int32(0))
        if slot < 0:
            P = Int32(0)
        if P > 0:  # uniform per CTA
            rS = _state_fragment(fp32)
            _load_state(s32[slot, qh * group, None, None], row0, c, rS, fp32)
            _stage_rows(_async_copy_atom(), u32[slot, None, None, None], sU, qh * group, group, HEAD_DIM, cfg.u_words // 4, tidx)
            cute.arch.cp_async_commit_group()
            _stage_ring_keys(rk32[slot, qh, None, None], sRK32, P, tidx)
            if tidx < group * RING:
                h = tidx // RING
                j = tidx % RING
                gj = mRingG[slot, qh * group + h, j]
                sGr[h, j] = cutlass.select_(j < P, gj, Float32(0.0))
            cute.arch.sync_threads()
            if warp == 0:
                ss0, ss1 = _table_rows(sRK32, sRK32, g, c, None, products=False)
                if c == 0:
                    sRn[0, g] = cute.math.rsqrt(ss0 + EPS, fastmath=True)
                    sRn[0, g + 8] = cute.math.rsqrt(ss1 + EPS, fastmath=True)
            cute.arch.sync_threads()
            _fold_tables(sRK, sRn, sGr, sKw, sDec, P, group, group, tidx, fp32)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            rU = _ring_u_fragment(fp32)
            for h in cutlass.range_constexpr(group):
                head = qh * group + h
                gS = s32[slot, head, None, None]
                _ring_u_regs(sU[h, None, None], P, row0, c, rU, fp32)
                _fold_rows(rS, rU, sKw[h, None, None], sDec[h], g, c, fp32)
                _store_state(rS, gS, row0, c, fp32)
                if cutlass.const_expr(h + 1 < group):
                    _load_state(s32[slot, head + 1, None, None], row0, c, rS, fp32)
