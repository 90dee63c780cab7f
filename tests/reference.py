"""fp32 reference of one Gated Delta Net decode step, written for clarity, not speed.

This is the oracle every backend is checked against: plain torch on float64/float32, one
token at a time, no batching tricks. It follows docs/protocol.md, section 4, line by line.
`kernel_inputs` draws the random arguments of a kernel launch that the GPU tests and the kernel
benchmarks (bench/, which load this file) check against it.
"""
from __future__ import annotations

import math

import torch


def gdn_reference_step(
    state: torch.Tensor,  # [B, HV, V, K] float32, the state before the step
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, HV, V]
    a: torch.Tensor,  # [B, T, HV]
    b: torch.Tensor,  # [B, T, HV]
    A_log: torch.Tensor,  # [B, HV] float32, already gathered per row's layer
    dt_bias: torch.Tensor,  # [B, HV] float32, already gathered per row's layer
    scale: float | None = None,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [B, T, HV, V], new_state [B, HV, V, K]) in ``dtype``, state not rounded."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    S = state.to(dtype).clone()
    q, k, v, a, b = (x.to(dtype) for x in (q, k, v, a, b))
    A_log, dt_bias = A_log.to(dtype), dt_bias.to(dtype)
    out = torch.empty(B, T, HV, V, dtype=dtype)
    for t in range(T):
        for j in range(HV):
            h = j // group
            qn = q[:, t, h] / torch.sqrt((q[:, t, h] ** 2).sum(-1, keepdim=True) + 1e-6) * scale
            kn = k[:, t, h] / torch.sqrt((k[:, t, h] ** 2).sum(-1, keepdim=True) + 1e-6)
            x = softplus_beta * (a[:, t, j] + dt_bias[:, j])
            sp = torch.where(x <= softplus_threshold, torch.log1p(torch.exp(x)) / softplus_beta, x / softplus_beta)
            decay = torch.exp(-torch.exp(A_log[:, j]) * sp)  # [B]
            beta = torch.sigmoid(b[:, t, j])  # [B]
            Sj = S[:, j] * decay[:, None, None]  # [B, V, K]
            pred = torch.einsum("bvk,bk->bv", Sj, kn)
            delta = beta[:, None] * (v[:, t, j] - pred)
            Sj = Sj + delta[:, :, None] * kn[:, None, :]
            out[:, t, j] = torch.einsum("bvk,bk->bv", Sj, qn)
            S[:, j] = Sj
    return out, S


def token_all_heads(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, scale: float) -> torch.Tensor:
    """One token of `gdn_reference_step` for every row and head at once, in float64, for runs of
    thousands of steps (the bench scripts' drift runs): S [B, HV, V, K] float64 is updated in
    place; q, k [B, H, K], v [B, HV, V], a, b [B, HV], A_log and dt_bias [B or 1, HV]; returns
    o [B, HV, V] float64. tests/test_reference.py holds it to `gdn_reference_step`."""
    group = v.shape[1] // q.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    qn = (q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale).repeat_interleave(group, 1)
    kn = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, 1)
    x = a.double() + dt_bias.double()
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
    decay = torch.exp(-torch.exp(A_log.double()) * softplus)
    beta = torch.sigmoid(b.double())
    S.mul_(decay[..., None, None])
    pred = torch.einsum("bjvk,bjk->bjv", S, kn)
    S.add_((beta[..., None] * (v - pred))[..., None] * kn[..., None, :])
    return torch.einsum("bjvk,bjk->bjv", S, qn)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    x64, r64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return float((x64 - r64).norm() / r64.norm().clamp_min(1e-30))


class ReferenceModel:
    """Per-(session, layer) states advanced by `gdn_reference_step`, rounded to bf16 once per step
    as the service stores them. Mirrors one server's view of a set of sessions."""

    def __init__(self, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int = 128, scale: float | None = None):
        self.A_log = A_log.float()  # [L, HV]
        self.dt_bias = dt_bias.float()
        self.num_v_heads = A_log.shape[1]
        self.head_dim = head_dim
        self.scale = scale
        self.states: dict[tuple[str, int], torch.Tensor] = {}

    def state(self, session: str, layer: int) -> torch.Tensor:
        key = (session, layer)
        if key not in self.states:
            self.states[key] = torch.zeros(self.num_v_heads, self.head_dim, self.head_dim)
        return self.states[key]

    def step(self, layer: int, sessions: list[str], q, k, v, a, b) -> torch.Tensor:
        """Applies one request; returns o [B, T, HV, V] float64 (before bf16 output rounding)."""
        state = torch.stack([self.state(s, layer) for s in sessions]).float()
        B = len(sessions)
        A = self.A_log[layer].expand(B, -1)
        dt = self.dt_bias[layer].expand(B, -1)
        out, new = gdn_reference_step(state, q.float(), k.float(), v.float(), a.float(), b.float(), A, dt, self.scale)
        for i, s in enumerate(sessions):
            self.states[(s, layer)] = new[i].to(torch.bfloat16).float()
        return out


def kernel_inputs(B: int, T: int, H: int, HV: int, L: int, gen: torch.Generator, device: str = "cuda",
                  D: int = 128) -> dict[str, torch.Tensor]:
    """Random bf16 q, k, v, a, b of B rows and T tokens, float32 gates (A_log, dt_bias) of L
    layers and a random layer per row (int32): the arguments of a kernel launch, on `device`."""
    bf = torch.bfloat16

    def rnd(*s):
        return torch.randn(*s, device=device, generator=gen)

    return dict(
        q=rnd(B, T, H, D).to(bf), k=rnd(B, T, H, D).to(bf), v=rnd(B, T, HV, D).to(bf),
        a=rnd(B, T, HV).to(bf), b=rnd(B, T, HV).to(bf),
        A_log=torch.log(torch.empty(L, HV, device=device).uniform_(1.0, 16.0, generator=gen)),
        dt_bias=rnd(L, HV) * 0.5,
        layers=torch.randint(0, L, (B,), device=device, generator=gen, dtype=torch.int32),
    )
