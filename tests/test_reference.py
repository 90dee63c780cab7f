"""The bench scripts' vectorised reference token (`token_all_heads`) against the reference step
written for clarity (`gdn_reference_step`): the drift runs hold the kernels to the former."""
from __future__ import annotations

import math

import torch

from reference import gdn_reference_step, rel_err, token_all_heads


def test_token_all_heads_is_the_reference_step():
    gen = torch.Generator().manual_seed(3)
    B, H, HV, D, T = 3, 2, 4, 16, 3
    S = torch.randn(B, HV, D, D, generator=gen, dtype=torch.float64)
    q, k = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    v = torch.randn(B, T, HV, D, generator=gen)
    a, b = (torch.randn(B, T, HV, generator=gen) * 4 for _ in range(2))  # some a past softplus's threshold
    a[0, 0, 0] = 30.0
    A_log, dt_bias = torch.randn(B, HV, generator=gen), torch.randn(B, HV, generator=gen)
    o_want, S_want = gdn_reference_step(S, q, k, v, a, b, A_log, dt_bias)
    S_got, outs = S.clone(), []
    for t in range(T):
        outs.append(token_all_heads(S_got, q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], A_log, dt_bias,
                                    1.0 / math.sqrt(D)))
    assert rel_err(torch.stack(outs, 1), o_want) < 1e-12
    assert rel_err(S_got, S_want) < 1e-12
