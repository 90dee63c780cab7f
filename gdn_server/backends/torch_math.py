"""The decode step in vectorised torch (fp32 math): the CPU backend's, the one torch implementation.

Vectorised over rows and heads; the only Python loop is over the T tokens of a step, whose
recurrence is sequential. Written for few-row launches on the CPU, where each torch call costs a
microsecond or two of dispatch whatever its size (as much as the math of a small model's row), so
a step is as few calls as the math allows: the gates of every row and token in six, the norms and
k.q in eight, beta v in one, and per token five. Per token, with S the state before it, d its decay, beta its write
strength, k and q normalised (q times the scale):

    S_d = d S;  [p, s] = [k, q] S_d^T;  u = beta (v - p);  o = s + u (k.q);  S' = S_d + u k^T

o = S' q written out, so one matmul reads the state for both products. A verify (a speculative
step, `run` without a new state) writes no state and keeps each token's ring terms instead: the
normalised k, u and the log-decay g = log d (gdn_server/backends/base.py: the history ring; `fold_ring`
applies them to a state). [k, q] S_d^T, the vectors
on the left, runs several times faster in torch's CPU matmul than S_d [k, q] (bench/DECISIONS.md,
entry 20). Value head j reads query/key head j // group: the state is
viewed as [B * H, group * V, K] for the matmul and [B, H, group, V, K] for the update, so q and k
broadcast over the group without being copied.
"""
from __future__ import annotations

from typing import Sequence

import torch


_LANES = 64  # a multiple of every SIMD width torch's CPU kernels use (AVX-512 fp32 is 16 lanes)


def _padded(numel: int) -> int:
    return -(-numel // _LANES) * _LANES


def exp_lane_aligned(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float32, computed over a buffer padded to whole SIMD vectors (see StepWorkspace)."""
    flat = torch.zeros(_padded(x.numel()), dtype=torch.float32, device=x.device)
    flat[: x.numel()] = x.reshape(-1)
    return flat.exp_()[: x.numel()].view(x.shape)


class StepWorkspace:
    """The buffers of one launch shape (rows, T) and every view of them a step uses, made once:
    `run` is then ~20 torch calls for a one-token step, none of which allocates or builds a view.
    The CPU backend keeps the plans of its small launches; a plan is used by one step at a time.

    A row's result does not depend on the other rows of its launch (tests/test_cpu_backend.py):
    torch's CPU kernels run exp/log1p/sigmoid through vectorised code for whole SIMD vectors and
    scalar code for the tail, which can differ in the last bit, and which elements fall in the
    tail would depend on how many rows share a call. So both gates are computed in one buffer
    whose rows are padded to whole vectors (`_LANES`): every element takes the vector path. The
    state's elementwise calls work on whole rows of V * K elements (a multiple of every vector
    width), and the matmuls compute each (row, head) product alone.
    """

    def __init__(
        self, rows: int, tokens: int, num_q_heads: int, num_v_heads: int, head_dim_v: int, head_dim_k: int,
        scale: float, device: torch.device | str = "cpu", work: torch.Tensor | None = None,
        softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
    ) -> None:
        R, T, H, HV, V, K = rows, tokens, num_q_heads, num_v_heads, head_dim_v, head_dim_k
        G = HV // H
        self.rows, self.tokens = R, T
        self.softplus_beta, self.softplus_threshold = softplus_beta, softplus_threshold
        f32 = {"dtype": torch.float32, "device": device}
        # the fp32 state between tokens [R, HV, V, K]; may be the caller's (in place)
        self.work = torch.empty(R, HV, V, K, **f32) if work is None else work
        S5 = self.S5 = self.work.view(R, H, G, V, K)
        n = R * T * HV
        self.gates = torch.zeros(2, _padded(n), **f32)  # [0]: a + dt_bias, [1]: b -> beta
        self.gate_x, self.gate_b = self.gates[0], self.gates[1]
        self.x, self.beta = self.gate_x[:n].view(R, T, HV), self.gate_b[:n].view(R, T, HV)
        self.softplus = torch.empty(_padded(n), **f32)  # -> decay
        decay = self.decay = self.softplus[:n].view(R, T, HV)
        # token-major, so that each token's [R, H, 2, K] is contiguous: [..., 0, :] = k, [..., 1, :] = q
        self.qk = torch.empty(T, R, H, 2, K, **f32)
        self.k_in = self.qk.select(3, 0).transpose(0, 1)  # [R, T, H, K]
        self.q_in = self.qk.select(3, 1).transpose(0, 1)
        self.qk3 = self.qk.view(T * R * H, 2, K)
        self.qk3_t = self.qk3.transpose(1, 2)
        self.gram = torch.empty(T * R * H, 2, 2, **f32)  # k.k, q.q; then k.q of the normalised k, q
        self.norms = self.gram.diagonal(dim1=1, dim2=2).view(T, R, H, 2)
        self.inv = torch.empty(T, R, H, 2, **f32)  # 1 / |k|, scale / |q|
        self.inv_b = self.inv[..., None]
        self.scales = torch.tensor([1.0, scale], **f32)
        kq = self.gram[:, 0, 1].view(T, R, H)
        self.bv = torch.empty(R, T, HV, V, **f32)  # beta v
        self.beta_b = self.beta[..., None]
        self.ps = torch.empty(R * H, 2, G * V, **f32)  # p, s of the token at hand
        p, s = self.ps[:, 0].view(R, H, G, V), self.ps[:, 1].view(R, H, G, V)
        # u of every token, token-major (each token's [R, HV, V] contiguous): a verify's ring terms
        self.u = torch.empty(T, R, HV, V, **f32)
        self.g = torch.empty(R, T, HV, **f32)  # log-decay of every token, kept by a verify
        self.o = torch.empty(R, T, HV, V, **f32)
        work_t = self.work.view(R * H, G * V, K).transpose(1, 2)
        self.steps = [
            (decay[:, t, :, None, None], self.qk[t].view(R * H, 2, K), work_t, self.bv[:, t].view(R, H, G, V),
             self.beta[:, t].view(R, H, G, 1), p, s, self.u[t].view(R, H, G, V), kq[t, :, :, None, None],
             self.o[:, t].view(R, H, G, V), S5, self.u[t].view(R, H, G, V, 1), self.qk[t, :, :, None, None, 0, :])
            for t in range(T)
        ]
        # the first read and the last write one row at a time, for states held as separate rows
        self.first_rows = list(zip(decay[:, 0].view(R, H, G, 1, 1).unbind(0), S5.unbind(0)))
        self.last_rows = list(zip(S5.unbind(0), self.u[T - 1].view(R, H, G, V, 1).unbind(0),
                                  self.qk[T - 1, :, :, None, None, 0, :].unbind(0)))

    def run(
        self,
        state: torch.Tensor | Sequence[torch.Tensor],  # [R, HV, V, K] or R rows [H, G, V, K]; any float dtype
        # [R, H, G, V, K] or R rows [H, G, V, K]; may be `state`; None: a verify
        new_state: torch.Tensor | Sequence[torch.Tensor] | None,
        q: torch.Tensor,  # [R, T, H, K] any float dtype
        k: torch.Tensor,  # [R, T, H, K]
        v: torch.Tensor,  # [R, T, HV, V]
        a: torch.Tensor,  # [R, T, HV]
        b: torch.Tensor,  # [R, T, HV]
        neg_A: torch.Tensor,  # [R, 1, HV] float32: -exp(A_log) of each row's layer (exp_lane_aligned)
        dt_bias: torch.Tensor,  # [R, 1, HV] float32
    ) -> torch.Tensor:
        """Applies T tokens: reads `state`, keeps it fp32 between tokens, writes `new_state`
        (rounded to its dtype once) in the step's last calls, after everything else. Without a
        `new_state` (a verify) no state is written, and the tokens' ring terms stay in the plan's
        buffers until its next run: `k_in` [R, T, H, K] (normalised), `u` [T, R, HV, V] and `g`
        [R, T, HV]. Returns o [R, T, HV, V] float32, the plan's buffer (valid until its next run)."""
        # gates: decay = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b)
        torch.add(a, dt_bias, out=self.x)
        self.beta.copy_(b)
        torch._C._nn.softplus(self.gate_x, self.softplus_beta, self.softplus_threshold, out=self.softplus)
        self.decay.mul_(neg_A)
        if new_state is None:
            self.g.copy_(self.decay)
        self.softplus.exp_()
        self.gate_b.sigmoid_()
        # k / |k| and q scale / |q|; then their product, from the normalised vectors
        self.k_in.copy_(k)
        self.q_in.copy_(q)
        torch.bmm(self.qk3, self.qk3_t, out=self.gram)
        torch.add(self.norms, 1e-6, out=self.inv).rsqrt_().mul_(self.scales)
        self.qk.mul_(self.inv_b)
        torch.bmm(self.qk3, self.qk3_t, out=self.gram)
        torch.mul(v, self.beta_b, out=self.bv)
        T = self.tokens
        for t, (d, qk_t, work_t, bv, beta, p, s, u4, kq, o, S5, u5, k_t) in enumerate(self.steps):
            if t > 0:
                self.work.mul_(d)
            elif isinstance(state, torch.Tensor):
                torch.mul(state, d, out=self.work)
            else:
                for row, (d_r, work_r) in zip(state, self.first_rows):
                    torch.mul(row, d_r, out=work_r)
            torch.bmm(qk_t, work_t, out=self.ps)
            torch.addcmul(bv, beta, p, value=-1, out=u4)
            torch.addcmul(s, u4, kq, out=o)
            if t < T - 1:
                torch.addcmul(S5, u5, k_t, out=S5)
            elif new_state is None:
                pass  # a verify: o of the last token needs no state after it
            elif isinstance(new_state, torch.Tensor):
                torch.addcmul(S5, u5, k_t, out=new_state)
            else:
                for row, (S_r, u_r, k_r) in zip(new_state, self.last_rows):
                    torch.addcmul(S_r, u_r, k_r, out=row)
        return self.o


def fold_ring(
    state: torch.Tensor,  # [HV, V, K] (any view, e.g. [H, G, V, K]) of any float dtype: S_0
    ring_k: torch.Tensor,  # [H, RING, K] float32: normalised k per entry
    ring_u: torch.Tensor,  # [HV, V, RING] float32: u per entry
    ring_g: torch.Tensor,  # [HV, RING] float32: G, the log-decay summed from the ring's start
    entries: int,  # P > 0: how many entries to apply
    out: torch.Tensor,  # [HV, V, K] float32 (may be `state`'s memory when state is float32)
) -> torch.Tensor:
    """S_P = e^{G_P} S_0 + sum_{i<P} e^{G_P - G_i} u_i k_i^T into `out` (float32), one matmul per
    query/key head over its group of value heads."""
    H, K = ring_k.shape[0], ring_k.shape[2]
    HV, V = ring_u.shape[0], ring_u.shape[1]
    P = entries
    G_P = ring_g[:, P - 1 : P]  # [HV, 1]
    torch.mul(state.view(HV, V, K), G_P.exp()[:, :, None], out=out.view(HV, V, K))
    weighted = ring_u[:, :, :P] * (G_P - ring_g[:, :P]).exp_()[:, None, :]  # [HV, V, P]
    out.view(H, HV // H * V, K).baddbmm_(weighted.view(H, HV // H * V, P), ring_k[:, :P])
    return out
