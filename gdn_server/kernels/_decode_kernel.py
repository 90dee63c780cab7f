"""CuTe DSL kernel: one Gated Delta Net decode step (T = 1..8 tokens) over a state pool of bf16 or fp32.

Layout contract (all tensors row-major, contiguous, on one CUDA device):

    mS       [N, HV, V, K]  bf16 or fp32 (the variant's state dtype)  state pool, K fastest
    mSlot    [B]            int32  slot each row reads its state from; < 0 marks a padding row
    mOutSlot [B]            int32  slot each row writes its new state to (may equal mSlot);
                                   < 0: the new state is not written (outputs only)
    mLayer   [B]            int32  layer per row, indexes mALog / mDtBias
    mQ, mK   [B, T, H, K]   bf16
    mV       [B, T, HV, V]  bf16
    mA, mB   [B, T, HV]     bf16
    mALog    [L, HV]        fp32
    mDtBias  [L, HV]        fp32
    mO       [B, T, HV, V]  bf16   written for every row (zeros for padding rows)

B, N and L are symbolic: one compiled function serves every batch size.

Work split. The rows of one state S[V, K] are independent (o[v] and the update of S[v, :] need
only S[v, :], k, q and v[v]), so one CTA owns a tile of `rows_per_cta` V-rows of one
(batch row, value head). Inside a warp, 8 consecutive lanes share one V-row and each lane holds
16 of its K elements as 16-byte vectors of n = 16 / (state element bytes) elements: lane c holds
[n*c + 8n*j, n*c + 8n*j + n) for j < 16 / n, i.e. [8c, 8c+8) and [64+8c, 64+8c+8) of a bf16
state, [4c, 4c+4), [32+4c, ...), [64+4c, ...), [96+4c, ...) of an fp32 one. Each warp load
instruction then covers 4 rows x 128 contiguous bytes whatever the dtype; q and k are read in the
same split (8- or 16-byte loads). A thread owns `rows_per_thread` rows, spaced 4 * warps apart,
and keeps their state in fp32 registers across all T tokens: the state is read once and written
once per step, whatever T. The state dtype is a compile-time parameter (`state_dtype`): an fp32
state is loaded into and stored from those registers as it is, a bf16 one converted.

Per-token vectors. Two ways to get each token's q, k and gates to the threads (`prep`):
- inline (T = 1): every thread loads its 16 elements of raw q and k and three 8-lane butterfly
  reductions give |q|^2, |k|^2 and q.k; no shared memory, no barrier.
- prep (T > 1): while the state loads are in flight, 8-lane group t of the CTA normalises q_t
  and k_t once and computes token t's gates into shared memory (sQK, sGate); after one barrier
  every thread reads its 2 x 16 normalised elements per token with 16-byte loads (a layout
  without bank conflicts) instead of redoing the norms, 9 shuffles and the gates itself.
  Tokens are unrolled for T <= 4; for T = 5..8 the token loop stays a loop, so no per-token
  value is live across tokens.

Row dots (`scatter`). Each of a thread's R rows needs U.k and U.q summed over its 8 lanes:
- butterfly: 3 shuffles per dot, 6R per token, every lane gets every total;
- reduce-scatter (R = 4 or 8): the 2R partial sums are halved across the 8 lanes in 3 levels
  (7 shuffles), the lane left with U_p.k computes delta_p and the row's lanes fetch it (R
  shuffles): 7 + R instead of 6R shuffles, which issue at a quarter of the FMA rate.

Math. The registers hold U with S = gamma * U (gamma = product of this step's decays, one value
per (row, head)); with g the decay, b the beta gate, k^ and q^ the normalised key and the scaled
normalised query, a token is

    gamma *= g
    sk = U . k^,  sq = U . q^                      (one pass, one 8-lane reduction each)
    delta = b * (v - gamma * sk)
    o     = gamma * sq + delta * (q^ . k^)
    U    += (delta / gamma) * k^

(the inline path uses raw q, k and folds 1/|q|, 1/|k| into the scalars). 3 FMAs per state element
and token; S = gamma * U is formed once, when the state is written (gamma is folded into U early
if it falls below RESCALE_BELOW, so 1/gamma stays finite). A one-token inline step needs no
lazy decay: each row becomes S = g S + delta k^ once its dots are known, and goes to memory right
then, so that a CTA's stores start while its later rows are still computing (bench/DECISIONS.md,
entry 1). This is the recurrence of docs/protocol.md,
section 4 (decay, delta rule, o = S_new . q), rearranged, in fp32; a bf16 state is rounded once,
when it is written.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

HEAD_DIM = 128  # K = V = 128, the only size the kernel supports
LANES_PER_ROW = 8  # lanes sharing one V-row
VEC = 8  # bf16 elements per 16-byte access
ELEMS_PER_THREAD = HEAD_DIM // LANES_PER_ROW  # 16 K elements of each row per thread
ROWS_PER_WARP = 32 // LANES_PER_ROW  # 4
MAX_T = 8
MAX_UNROLLED_T = 4  # token loops are unrolled up to this T
EPS = 1e-6
RESCALE_BELOW = 1e-20  # lazy decay: fold gamma into the registers below this
STATE_DTYPES = {"bfloat16": BFloat16, "float32": Float32}  # the pool's element types


@dataclass(frozen=True)
class DecodeConfig:
    """Static configuration of one compiled variant."""

    T: int  # tokens per step, 1..8
    H: int  # q/k heads
    HV: int  # value heads, a multiple of H
    warps: int = 2  # warps per CTA
    rows_per_thread: int = 4  # V-rows held in registers by each thread
    prep: bool = True  # per-token q/k/gates prepared once per CTA in shared memory
    scatter: bool = False  # reduce-scatter the row dots across the 8 lanes (rows_per_thread 4 or 8)
    state_dtype: str = "bfloat16"  # the pool's element type, a key of STATE_DTYPES

    @property
    def state_type(self):
        return STATE_DTYPES[self.state_dtype]

    @property
    def vec(self) -> int:
        """State elements per 16-byte access, and so per contiguous run of a lane's K elements."""
        return 16 // (self.state_type.width // 8)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def rows_per_cta(self) -> int:
        return ROWS_PER_WARP * self.warps * self.rows_per_thread

    @property
    def tiles_per_head(self) -> int:
        return HEAD_DIM // self.rows_per_cta


@cute.jit
def _sum8(x: Float32) -> Float32:
    """Sum over the 8 consecutive lanes of a row group (every lane gets the total)."""
    for i in cutlass.range_constexpr(3):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


@cute.jit
def _reduce_scatter8(vals: list, c) -> list:
    """Sum n = len(vals) values (n = 8 or 16) over the 8 lanes of a row group, leaving lane c
    with the totals of vals[c * n/8 + j], j < n/8: 7 shuffles instead of 3 per value. At each
    butterfly level a lane sends the half of its values that its partner keeps."""
    for level in cutlass.range_constexpr(3):
        offset = 4 >> level
        upper = (c & offset) != 0  # this lane keeps the upper half
        half = len(vals) // 2
        nxt = []
        for j in cutlass.range_constexpr(half):
            lo, hi = vals[j], vals[j + half]
            send = Float32(cutlass.select_(upper, lo, hi))
            keep = Float32(cutlass.select_(upper, hi, lo))
            nxt.append(keep + cute.arch.shuffle_sync_bfly(send, offset=offset))
        vals = nxt
    return vals


@cute.jit
def _load_vec(row: cute.Tensor, chunk, dst: cute.Tensor, vec: cutlass.Constexpr = VEC):
    """Load of elements [vec*chunk, vec*chunk+vec) of a contiguous row into dst (vec values)."""
    cute.autovec_copy(cute.flat_divide(row, (vec,))[None, chunk], dst)


@cute.jit
def _load_qk(mQ: cute.Tensor, mK: cute.Tensor, b, t, qk_head, c, scale: Float32, vec: cutlass.Constexpr = VEC):
    """Lane c's 16 elements of raw q_t and k_t (fp32), in runs of `vec` (the state's split, module
    docstring), and, summed over the 8-lane group, rq = scale / |q|, rk = 1 / |k| and q^.k^ (with
    the scale)."""
    runs = ELEMS_PER_THREAD // vec
    qraw = cute.make_rmem_tensor((vec, runs), BFloat16)
    kraw = cute.make_rmem_tensor((vec, runs), BFloat16)
    for h in cutlass.range_constexpr(runs):
        _load_vec(mQ[b, t, qk_head, None], c + LANES_PER_ROW * h, qraw[None, h], vec)
        _load_vec(mK[b, t, qk_head, None], c + LANES_PER_ROW * h, kraw[None, h], vec)
    qv = qraw.load().to(Float32)
    kv = kraw.load().to(Float32)
    sqq = Float32(0.0)
    skk = Float32(0.0)
    sqk = Float32(0.0)
    for i in cutlass.range_constexpr(ELEMS_PER_THREAD):
        sqq = sqq + qv[i] * qv[i]
        skk = skk + kv[i] * kv[i]
        sqk = sqk + qv[i] * kv[i]
    rq = cute.math.rsqrt(_sum8(sqq) + EPS, fastmath=True) * scale
    rk = cute.math.rsqrt(_sum8(skk) + EPS, fastmath=True)
    return qv, kv, rq, rk, _sum8(sqk) * rq * rk


@cute.jit
def _gates(a_raw, b_raw, neg_a: Float32, dt_bias: Float32, sp_beta: Float32, sp_threshold: Float32):
    """(decay, beta) of one token: exp(-exp(A_log) * softplus(a + dt_bias)), sigmoid(b)."""
    x = a_raw.to(Float32) + dt_bias
    bx = sp_beta * x
    softplus = x
    if bx <= sp_threshold:
        softplus = cute.math.log(Float32(1.0) + cute.math.exp(bx, fastmath=True), fastmath=True) / sp_beta
    decay = cute.math.exp(neg_a * softplus, fastmath=True)
    beta = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-b_raw.to(Float32), fastmath=True))
    return decay, beta


class GdnDecodeKernel:
    """Decode step for one (T, H, HV) variant; see the module docstring for the layout."""

    def __init__(self, cfg: DecodeConfig):
        if cfg.HV % cfg.H != 0:
            raise ValueError(f"HV={cfg.HV} is not a multiple of H={cfg.H}")
        if not 1 <= cfg.T <= MAX_T:
            raise ValueError(f"T={cfg.T} is outside 1..{MAX_T}")
        if cfg.T > MAX_UNROLLED_T and not cfg.prep:
            raise ValueError(f"T={cfg.T} needs the shared-memory prep path")
        if HEAD_DIM % cfg.rows_per_cta != 0 or cfg.rows_per_thread > LANES_PER_ROW:
            raise ValueError(f"bad tiling {cfg}")
        if cfg.scatter and cfg.rows_per_thread not in (4, 8):
            raise ValueError(f"the reduce-scatter needs 4 or 8 rows per thread: {cfg}")
        self.cfg = cfg

    def __repr__(self) -> str:  # names the compiled kernel
        c = self.cfg
        kind = ("prep" if c.prep else "inline") + ("_rs" if c.scatter else "")
        dtype = "" if c.state_dtype == "bfloat16" else "_f32state"
        return f"GdnDecode_T{c.T}_H{c.H}_HV{c.HV}_w{c.warps}_r{c.rows_per_thread}_{kind}{dtype}"

    @cute.jit
    def __call__(
        self,
        mS: cute.Tensor,  # [N, HV, V, K] bf16 or fp32
        mSlot: cute.Tensor,  # [B] int32
        mOutSlot: cute.Tensor,  # [B] int32
        mLayer: cute.Tensor,  # [B] int32
        mQ: cute.Tensor,  # [B, T, H, K] bf16
        mK: cute.Tensor,  # [B, T, H, K] bf16
        mV: cute.Tensor,  # [B, T, HV, V] bf16
        mA: cute.Tensor,  # [B, T, HV] bf16
        mB: cute.Tensor,  # [B, T, HV] bf16
        mALog: cute.Tensor,  # [L, HV] fp32
        mDtBias: cute.Tensor,  # [L, HV] fp32
        mO: cute.Tensor,  # [B, T, HV, V] bf16
        scale: Float32,
        softplus_beta: Float32,
        softplus_threshold: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        num_ctas = mQ.shape[0] * (cfg.HV * cfg.tiles_per_head)
        self.kernel(
            mS, mSlot, mOutSlot, mLayer, mQ, mK, mV, mA, mB, mALog, mDtBias, mO,
            scale, softplus_beta, softplus_threshold,
        ).launch(grid=(num_ctas, 1, 1), block=(cfg.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mS: cute.Tensor,  # [N, HV, V, K] bf16 or fp32
        mSlot: cute.Tensor,  # [B] int32
        mOutSlot: cute.Tensor,  # [B] int32
        mLayer: cute.Tensor,  # [B] int32
        mQ: cute.Tensor,  # [B, T, H, K] bf16
        mK: cute.Tensor,  # [B, T, H, K] bf16
        mV: cute.Tensor,  # [B, T, HV, V] bf16
        mA: cute.Tensor,  # [B, T, HV] bf16
        mB: cute.Tensor,  # [B, T, HV] bf16
        mALog: cute.Tensor,  # [L, HV] fp32
        mDtBias: cute.Tensor,  # [L, HV] fp32
        mO: cute.Tensor,  # [B, T, HV, V] bf16
        scale: Float32,
        softplus_beta: Float32,
        softplus_threshold: Float32,
    ):
        cfg = self.cfg
        T, R = cfg.T, cfg.rows_per_thread
        tiles = cfg.tiles_per_head
        row_stride = ROWS_PER_WARP * cfg.warps  # distance between a thread's rows
        vec = cfg.vec  # a lane's K elements come in runs of vec: 16-byte state accesses
        runs = ELEMS_PER_THREAD // vec

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        c = lane % LANES_PER_ROW  # chunk index inside the row group
        row0 = (bidx % tiles) * cfg.rows_per_cta + (tidx // 32) * ROWS_PER_WARP + lane // LANES_PER_ROW
        head = (bidx // tiles) % cfg.HV
        b = bidx // (tiles * cfg.HV)
        qk_head = head // (cfg.HV // cfg.H)

        if cutlass.const_expr(cfg.prep):
            # Per token t: q^ and k^ as [4 floats, lane c, group g] (lane c's 16 elements are
            # [g*32 + 4c, g*32 + 4c + 4) for g = 0..3: 16-byte accesses without bank conflicts),
            # and (decay, beta, q^.k^, unused).
            smem = cutlass.memory.SmemAllocator()
            sQK = smem.allocate_tensor(Float32, cute.make_layout((4, LANES_PER_ROW, 4, 2, T)), byte_alignment=16)  # [4, 8, 4, q|k, T]
            sGate = smem.allocate_tensor(Float32, cute.make_layout((4, T)), byte_alignment=16)  # [4, T]

        slot = mSlot[b]
        if slot >= 0:  # uniform per CTA
            layer = mLayer[b]
            gS = mS[slot, head, None, None]  # [V, K]

            # Issue every state load of this thread first: 16 / vec x 16 B per row, an fp32 state
            # straight into the registers the tokens work on, a bf16 one into its own to convert.
            st = cute.make_rmem_tensor((vec, runs, R), Float32)
            sraw = st
            if cutlass.const_expr(cfg.state_dtype != "float32"):
                sraw = cute.make_rmem_tensor((vec, runs, R), cfg.state_type)
            for p in cutlass.range_constexpr(R):
                for h in cutlass.range_constexpr(runs):
                    _load_vec(gS[row0 + p * row_stride, None], c + LANES_PER_ROW * h, sraw[None, h, p], vec)
            neg_a = -cute.math.exp(mALog[layer, head], fastmath=True)
            dt_bias = mDtBias[layer, head]

            if cutlass.const_expr(cfg.prep):
                # 8-lane group gi prepares tokens gi, gi + groups, ... (whole warps skip).
                groups = cfg.threads // LANES_PER_ROW
                gi = tidx // LANES_PER_ROW
                for j in cutlass.range_constexpr((T + groups - 1) // groups):
                    if (tidx // 32) * ROWS_PER_WARP + j * groups < T:  # uniform per warp
                        t = cutlass.min(gi + j * groups, T - 1)  # lanes past T redo token T-1
                        qv, kv, rq, rk, kq = _load_qk(mQ, mK, b, t, qk_head, c, scale, vec)
                        decay, beta = _gates(mA[b, t, head], mB[b, t, head], neg_a, dt_bias,
                                             softplus_beta, softplus_threshold)
                        if gi + j * groups < T:
                            rnorm = cute.make_rmem_tensor((4, 4, 2), Float32)  # [4, g, q|k]
                            for i in cutlass.range_constexpr(ELEMS_PER_THREAD):
                                rnorm[i % 4, i // 4, 0] = qv[i] * rq
                                rnorm[i % 4, i // 4, 1] = kv[i] * rk
                            for g in cutlass.range_constexpr(4):
                                for w in cutlass.range_constexpr(2):
                                    cute.autovec_copy(rnorm[None, g, w], sQK[None, c, g, w, t])
                            if c == 0:
                                sGate[0, t] = decay
                                sGate[1, t] = beta
                                sGate[2, t] = kq
                cute.arch.sync_threads()

            if cutlass.const_expr(cfg.state_dtype != "float32"):
                st.store(sraw.load().to(Float32))

            # Lazy decay: the state is S = gamma * U with U in registers, so a token costs
            # 3 ops per element (two dot FMAs, one update FMA) instead of 4; gamma is folded
            # back when the state is written. The decay is one value per (row, head), so the
            # rescale branch below is uniform across the CTA.
            gamma = Float32(1.0)
            rows_stored = T == 1 and not cfg.prep and not cfg.scatter  # as they are formed, below
            if cutlass.const_expr(cfg.prep):
                rgate = cute.make_rmem_tensor((4,), Float32)
                rqk = cute.make_rmem_tensor((4, 4, 2), Float32)  # [4, g, q|k]
                for t in cutlass.range(T, unroll_full=T <= MAX_UNROLLED_T):
                    cute.autovec_copy(sGate[None, t], rgate)
                    for g in cutlass.range_constexpr(4):
                        for w in cutlass.range_constexpr(2):
                            cute.autovec_copy(sQK[None, c, g, w, t], rqk[None, g, w])
                    gamma = self._rescaled(st, gamma * rgate[0])
                    self._rows(mV, mO, st, rqk[None, None, 1], rqk[None, None, 0], b, t, head, row0, c,
                               gamma, gamma, rgate[1], rgate[2], cute.arch.rcp_approx(gamma))
            elif cutlass.const_expr(rows_stored):
                qv, kv, rq, rk, kq = _load_qk(mQ, mK, b, 0, qk_head, c, scale, vec)
                decay, beta = _gates(mA[b, 0, head], mB[b, 0, head], neg_a, dt_bias, softplus_beta, softplus_threshold)
                out_slot = mOutSlot[b]
                written = (mS[cutlass.max(out_slot, Int32(0)), head, None, None], out_slot, sraw)
                self._rows(mV, mO, st, kv, qv, b, 0, head, row0, c, decay * rk, decay * rq, beta, kq, rk,
                           decay=decay, written=written)
            else:
                for t in cutlass.range_constexpr(T):
                    qv, kv, rq, rk, kq = _load_qk(mQ, mK, b, t, qk_head, c, scale, vec)
                    decay, beta = _gates(mA[b, t, head], mB[b, t, head], neg_a, dt_bias,
                                         softplus_beta, softplus_threshold)
                    gamma = self._rescaled(st, gamma * decay)
                    self._rows(mV, mO, st, kv, qv, b, t, head, row0, c,
                               gamma * rk, gamma * rq, beta, kq, rk * cute.arch.rcp_approx(gamma))

            out_slot = mOutSlot[b]
            if cutlass.const_expr(not rows_stored) and out_slot >= 0:
                gOut = mS[out_slot, head, None, None]  # [V, K]
                for i in cutlass.range_constexpr(ELEMS_PER_THREAD * R):
                    st[i] = st[i] * gamma
                if cutlass.const_expr(cfg.state_dtype != "float32"):
                    sraw.store(st.load().to(cfg.state_type))
                for p in cutlass.range_constexpr(R):
                    self._store_row(sraw, gOut, row0 + p * row_stride, c, p)
        else:
            # Padding row: no state access, zero outputs.
            if c < R:
                for t in cutlass.range_constexpr(T):
                    mO[b, t, head, row0 + c * row_stride] = BFloat16(0.0)

    @cute.jit
    def _store_row(self, sraw: cute.Tensor, gOut: cute.Tensor, row, c, p):
        """The thread's slices of its row p (`sraw`, in the state's dtype) to row `row` of gOut [V, K]."""
        vec = self.cfg.vec
        for h in cutlass.range_constexpr(ELEMS_PER_THREAD // vec):
            cute.autovec_copy(sraw[None, h, p], cute.flat_divide(gOut[row, None], (vec,))[None, c + LANES_PER_ROW * h])

    @cute.jit
    def _rescaled(self, st: cute.Tensor, gamma: Float32) -> Float32:
        """gamma, or 1 after folding it into U when it is small enough to make 1/gamma overflow."""
        if gamma < RESCALE_BELOW:
            for i in cutlass.range_constexpr(ELEMS_PER_THREAD * self.cfg.rows_per_thread):
                st[i] = st[i] * gamma
            gamma = Float32(1.0)
        return gamma

    @cute.jit
    def _rows(self, mV: cute.Tensor, mO: cute.Tensor, st: cute.Tensor, kv, qv, b, t, head, row0, c,
              gk: Float32, gq: Float32, beta: Float32, kq: Float32, dk_scale: Float32, decay=None, written=None):
        """One token over the thread's rows: o = gq (U.qv) + delta kq, U += delta dk_scale kv,
        delta = beta (v - gk (U.kv)); lane c < R of each row group writes o of row c. With `decay`
        (a one-token step without lazy decay) U becomes decay U + delta dk_scale kv instead; with
        `written` = (gOut [V, K], out slot, sraw) each row goes to gOut once formed (slot >= 0)."""
        R, vec = self.cfg.rows_per_thread, self.cfg.vec
        row_stride = ROWS_PER_WARP * self.cfg.warps
        if cutlass.const_expr(self.cfg.scatter):
            self._rows_scatter(mV, mO, st, kv, qv, b, t, head, row0, c, gk, gq, beta, kq, dk_scale)
        else:
            o_mine = Float32(0.0)
            for p in cutlass.range_constexpr(R):
                sk = Float32(0.0)
                sq = Float32(0.0)
                for i in cutlass.range_constexpr(ELEMS_PER_THREAD):
                    u = st[i % vec, i // vec, p]
                    sk = sk + u * kv[i]
                    sq = sq + u * qv[i]
                sk = _sum8(sk)
                sq = _sum8(sq)
                vv = mV[b, t, head, row0 + p * row_stride].to(Float32)
                delta = beta * (vv - gk * sk)
                o = gq * sq + delta * kq
                dk = delta * dk_scale
                for i in cutlass.range_constexpr(ELEMS_PER_THREAD):
                    if cutlass.const_expr(decay is None):
                        st[i % vec, i // vec, p] = st[i % vec, i // vec, p] + dk * kv[i]
                    else:
                        st[i % vec, i // vec, p] = st[i % vec, i // vec, p] * decay + dk * kv[i]
                if c == p:
                    o_mine = o
                if cutlass.const_expr(written is not None):
                    gOut, out_slot, sraw = written
                    if out_slot >= 0:
                        if cutlass.const_expr(self.cfg.state_dtype != "float32"):
                            sraw[None, None, p].store(st[None, None, p].load().to(self.cfg.state_type))
                        self._store_row(sraw, gOut, row0 + p * row_stride, c, p)
            if c < R:
                mO[b, t, head, row0 + c * row_stride] = o_mine.to(BFloat16)

    @cute.jit
    def _rows_scatter(self, mV: cute.Tensor, mO: cute.Tensor, st: cute.Tensor, kv, qv, b, t, head, row0, c,
                      gk: Float32, gq: Float32, beta: Float32, kq: Float32, dk_scale: Float32):
        """`_rows` with the 2R partial dots reduce-scattered: the lane holding U_p.k of row p
        computes delta_p and the others fetch it (R shuffles); 7 + R shuffles per token
        instead of 6R. R = 4: lane 2p holds U_p.k, lane 2p+1 U_p.q and writes o_p; R = 8:
        lane p holds both."""
        R, vec = self.cfg.rows_per_thread, self.cfg.vec
        row_stride = ROWS_PER_WARP * self.cfg.warps
        per_lane = 2 * R // LANES_PER_ROW  # reduced values per lane: 1 or 2
        dots = []
        for p in cutlass.range_constexpr(R):
            sk = Float32(0.0)
            sq = Float32(0.0)
            for i in cutlass.range_constexpr(ELEMS_PER_THREAD):
                u = st[i % vec, i // vec, p]
                sk = sk + u * kv[i]
                sq = sq + u * qv[i]
            dots.append(sk)
            dots.append(sq)
        mine = _reduce_scatter8(dots, c)
        my_row = c * R // LANES_PER_ROW
        vv = mV[b, t, head, row0 + my_row * row_stride].to(Float32)
        delta_mine = beta * (vv - gk * mine[0])  # meaningful on the lane holding U.k of my_row
        base = (cute.arch.lane_idx() // LANES_PER_ROW) * LANES_PER_ROW
        delta_row = Float32(0.0)
        for p in cutlass.range_constexpr(R):
            delta = cute.arch.shuffle_sync(delta_mine, offset=base + p * LANES_PER_ROW // R)
            if my_row == p:
                delta_row = delta
            dk = delta * dk_scale
            for i in cutlass.range_constexpr(ELEMS_PER_THREAD):
                st[i % vec, i // vec, p] = st[i % vec, i // vec, p] + dk * kv[i]
        if (c + 1) % (LANES_PER_ROW // R) == 0:  # the lane holding U.q of my_row
            o = gq * mine[per_lane - 1] + delta_row * kq
            mO[b, t, head, row0 + my_row * row_stride] = o.to(BFloat16)
