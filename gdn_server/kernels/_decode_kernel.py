"""CuTe DSL kernel: one Gated Delta Net decode step (T = 1..4 tokens) over a BF16 state pool.

Layout contract (all tensors row-major, contiguous, on one CUDA device):

    mS      [N, HV, V, K]  bf16   state pool, K fastest, updated in place
    mSlot   [B]            int32  pool slot per row; < 0 marks a padding row
    mLayer  [B]            int32  layer per row, indexes mALog / mDtBias
    mQ, mK  [B, T, H, K]   bf16
    mV      [B, T, HV, V]  bf16
    mA, mB  [B, T, HV]     bf16
    mALog   [L, HV]        fp32
    mDtBias [L, HV]        fp32
    mO      [B, T, HV, V]  bf16   written for every row (zeros for padding rows)

B, N and L are symbolic: one compiled function serves every batch size.

Work split. The rows of one state S[V, K] are independent (o[v] and the update of S[v, :] need
only S[v, :], k, q and v[v]), so one CTA owns a tile of `rows_per_cta` V-rows of one
(batch row, value head). Inside a warp, 8 consecutive lanes share one V-row: lane c of the
group holds K elements [8c, 8c+8) and [64+8c, 64+8c+8) as two 16-byte vectors, so each warp
load instruction covers 4 rows x 128 contiguous bytes. A thread owns `rows_per_thread` rows,
spaced 4 * warps apart, and keeps their state in fp32 registers across all T tokens: the state
is read once and written once per step, whatever T.

Per token the thread loads its 16 elements of q and k (L1/L2 hits), and three 8-lane
butterfly reductions give |q|^2, |k|^2 and q.k, so normalisation needs no shared memory and no
barrier. The registers hold U with S = gamma * U (gamma = product of this step's decays, one
value per (row, head)); with g the decay, b the beta gate, rk = 1/|k|, rq = scale/|q| and raw
(unnormalised) q, k, a token is

    gamma *= g
    sk = U . k_raw,  sq = U . q_raw               (one pass, one 8-lane reduction)
    delta = b * (v - gamma * rk * sk)
    o     = gamma * rq * sq + delta * rk * rq * (q_raw . k_raw)
    U    += (delta * rk / gamma) * k_raw

3 FMAs per state element and token; S = gamma * U is formed once, when the state is written
(gamma is folded into U early if it falls below RESCALE_BELOW, so 1/gamma stays finite). This
is the API.md recurrence (decay, delta rule, o = S_new . q) rearranged, in fp32.
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
EPS = 1e-6
RESCALE_BELOW = 1e-20  # lazy decay: fold gamma into the registers below this


@dataclass(frozen=True)
class DecodeConfig:
    """Static configuration of one compiled variant."""

    T: int  # tokens per step, 1..4
    H: int  # q/k heads
    HV: int  # value heads, a multiple of H
    warps: int = 2  # warps per CTA
    rows_per_thread: int = 4  # V-rows held in registers by each thread

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
def _load_vec(row: cute.Tensor, chunk, dst: cute.Tensor):
    """16-byte load of elements [8*chunk, 8*chunk+8) of a contiguous row into dst (8 values)."""
    cute.autovec_copy(cute.flat_divide(row, (VEC,))[None, chunk], dst)


class GdnDecodeKernel:
    """Decode step for one (T, H, HV) variant; see the module docstring for the layout."""

    def __init__(self, cfg: DecodeConfig):
        if cfg.HV % cfg.H != 0:
            raise ValueError(f"HV={cfg.HV} is not a multiple of H={cfg.H}")
        if not 1 <= cfg.T <= 4:
            raise ValueError(f"T={cfg.T} is outside 1..4")
        if HEAD_DIM % cfg.rows_per_cta != 0 or cfg.rows_per_thread > LANES_PER_ROW:
            raise ValueError(f"bad tiling {cfg}")
        self.cfg = cfg

    def __repr__(self) -> str:  # names the compiled kernel
        c = self.cfg
        return f"GdnDecode_T{c.T}_H{c.H}_HV{c.HV}_w{c.warps}_r{c.rows_per_thread}"

    @cute.jit
    def __call__(
        self,
        mS: cute.Tensor,  # [N, HV, V, K] bf16
        mSlot: cute.Tensor,  # [B] int32
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
            mS, mSlot, mLayer, mQ, mK, mV, mA, mB, mALog, mDtBias, mO,
            scale, softplus_beta, softplus_threshold,
        ).launch(grid=(num_ctas, 1, 1), block=(cfg.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mS: cute.Tensor,  # [N, HV, V, K] bf16
        mSlot: cute.Tensor,  # [B] int32
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

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        c = lane % LANES_PER_ROW  # chunk index inside the row group
        row0 = (bidx % tiles) * cfg.rows_per_cta + (tidx // 32) * ROWS_PER_WARP + lane // LANES_PER_ROW
        head = (bidx // tiles) % cfg.HV
        b = bidx // (tiles * cfg.HV)
        qk_head = head // (cfg.HV // cfg.H)

        slot = mSlot[b]
        if slot >= 0:
            layer = mLayer[b]
            gS = mS[slot, head, None, None]  # [V, K]

            # Issue every state load of this thread first: 2 x 16 B per row.
            sraw = cute.make_rmem_tensor((VEC, 2, R), BFloat16)
            for p in cutlass.range_constexpr(R):
                for h in cutlass.range_constexpr(2):
                    _load_vec(gS[row0 + p * row_stride, None], c + LANES_PER_ROW * h, sraw[None, h, p])
            neg_a = -cute.math.exp(mALog[layer, head], fastmath=True)
            dt_bias = mDtBias[layer, head]

            st = cute.make_rmem_tensor((VEC, 2, R), Float32)
            st.store(sraw.load().to(Float32))
            inv_sp_beta = Float32(1.0) / softplus_beta

            # Lazy decay: the state is S = gamma * U with U in registers, so a token costs
            # 3 ops per element (two dot FMAs, one update FMA) instead of 4; gamma is folded
            # back when the state is written. The decay is one value per (row, head), so the
            # rescale branch below is uniform across the CTA.
            gamma = Float32(1.0)
            qraw = cute.make_rmem_tensor((VEC, 2), BFloat16)
            kraw = cute.make_rmem_tensor((VEC, 2), BFloat16)
            for t in cutlass.range_constexpr(T):
                for h in cutlass.range_constexpr(2):
                    _load_vec(mQ[b, t, qk_head, None], c + LANES_PER_ROW * h, qraw[None, h])
                    _load_vec(mK[b, t, qk_head, None], c + LANES_PER_ROW * h, kraw[None, h])
                qv = qraw.load().to(Float32)
                kv = kraw.load().to(Float32)

                # Norms and q.k over the 128 elements (8 lanes x 16).
                sqq = Float32(0.0)
                skk = Float32(0.0)
                sqk = Float32(0.0)
                for i in cutlass.range_constexpr(2 * VEC):
                    sqq = sqq + qv[i] * qv[i]
                    skk = skk + kv[i] * kv[i]
                    sqk = sqk + qv[i] * kv[i]
                rq = cute.math.rsqrt(_sum8(sqq) + EPS, fastmath=True) * scale
                rk = cute.math.rsqrt(_sum8(skk) + EPS, fastmath=True)
                kq = _sum8(sqk) * rq * rk

                # Gates.
                x = mA[b, t, head].to(Float32) + dt_bias
                bx = softplus_beta * x
                softplus = x
                if bx <= softplus_threshold:
                    softplus = cute.math.log(Float32(1.0) + cute.math.exp(bx, fastmath=True), fastmath=True) * inv_sp_beta
                gamma = gamma * cute.math.exp(neg_a * softplus, fastmath=True)
                beta = cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-mB[b, t, head].to(Float32), fastmath=True))
                if gamma < RESCALE_BELOW:  # fold gamma into U before 1/gamma can overflow
                    for i in cutlass.range_constexpr(2 * VEC * R):
                        st[i] = st[i] * gamma
                    gamma = Float32(1.0)
                gk = gamma * rk
                gq = gamma * rq
                rk_over_gamma = rk * cute.arch.rcp_approx(gamma)

                o_mine = Float32(0.0)
                for p in cutlass.range_constexpr(R):
                    sk = Float32(0.0)
                    sq = Float32(0.0)
                    for i in cutlass.range_constexpr(2 * VEC):
                        u = st[i % VEC, i // VEC, p]
                        sk = sk + u * kv[i]
                        sq = sq + u * qv[i]
                    sk = _sum8(sk)
                    sq = _sum8(sq)
                    vv = mV[b, t, head, row0 + p * row_stride].to(Float32)
                    delta = beta * (vv - gk * sk)
                    o = gq * sq + delta * kq
                    dk = delta * rk_over_gamma
                    for i in cutlass.range_constexpr(2 * VEC):
                        st[i % VEC, i // VEC, p] = st[i % VEC, i // VEC, p] + dk * kv[i]
                    if c == p:
                        o_mine = o
                if c < R:
                    mO[b, t, head, row0 + c * row_stride] = o_mine.to(BFloat16)

            for i in cutlass.range_constexpr(2 * VEC * R):
                st[i] = st[i] * gamma
            sraw.store(st.load().to(BFloat16))
            for p in cutlass.range_constexpr(R):
                for h in cutlass.range_constexpr(2):
                    cute.autovec_copy(
                        sraw[None, h, p],
                        cute.flat_divide(gS[row0 + p * row_stride, None], (VEC,))[None, c + LANES_PER_ROW * h],
                    )
        else:
            # Padding row: no state access, zero outputs.
            if c < R:
                for t in cutlass.range_constexpr(T):
                    mO[b, t, head, row0 + c * row_stride] = BFloat16(0.0)
