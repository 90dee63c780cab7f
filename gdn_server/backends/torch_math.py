"""The decode step in vectorised torch (fp32 math), shared by the CPU backend and GPU fallbacks.

Vectorised over rows and heads; the only Python loop is over the T <= 4 tokens of a step, whose
recurrence is sequential.
"""
from __future__ import annotations

import torch


_LANES = 64  # a multiple of every SIMD width torch's CPU kernels use (AVX-512 fp32 is 16 lanes)


def _lane_aligned(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise transcendental, computed over a length padded to whole SIMD vectors.

    torch's CPU kernels run exp/log1p/sigmoid through vectorised code for whole vectors and
    scalar code for the tail, which can differ in the last bit; which elements fall in the tail
    depends on the batch size. Padding puts every element on the vector path, so a row's result
    does not depend on how many other rows share its call.
    """
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _LANES
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return fn(flat)[: x.numel()].view(x.shape)


def gdn_step_fp32(
    state: torch.Tensor,  # [B, HV, V, K] float32, updated in place
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, HV, V]
    a: torch.Tensor,  # [B, T, HV]
    b: torch.Tensor,  # [B, T, HV]
    A_log: torch.Tensor,  # [B, HV] float32, each row's layer already gathered
    dt_bias: torch.Tensor,  # [B, HV] float32
    scale: float,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """Applies T tokens to `state` (kept fp32 between tokens) and returns o [B, T, HV, V] float32."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    group = HV // H
    q, k, v, a, b = (x.float() for x in (q, k, v, a, b))
    qn = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if group > 1:  # value head j reads query/key head j // group
        qn = qn.repeat_interleave(group, dim=2)
        kn = kn.repeat_interleave(group, dim=2)
    x = softplus_beta * (a + dt_bias[:, None, :])
    softplus = torch.where(x <= softplus_threshold, _lane_aligned(lambda t: torch.log1p(torch.exp(t)), x), x)
    softplus = softplus / softplus_beta
    decay = _lane_aligned(torch.exp, -_lane_aligned(torch.exp, A_log)[:, None, :] * softplus)  # [B, T, HV]
    beta = _lane_aligned(torch.sigmoid, b)  # [B, T, HV]
    out = torch.empty(B, T, HV, v.shape[3], dtype=torch.float32, device=state.device)
    for t in range(T):
        k_t = kn[:, t].unsqueeze(-1)  # [B, HV, K, 1]
        state.mul_(decay[:, t, :, None, None])
        pred = torch.matmul(state, k_t).squeeze(-1)  # [B, HV, V]
        delta = beta[:, t, :, None] * (v[:, t] - pred)
        state.add_(delta.unsqueeze(-1) * kn[:, t].unsqueeze(-2))  # outer(delta, k)
        out[:, t] = torch.matmul(state, qn[:, t].unsqueeze(-1)).squeeze(-1)
    return out
