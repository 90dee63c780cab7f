"""--verify: every output number of every step checked against the decode math done on the client.

The load tool knows every input it sends. With --verify each client keeps its sessions' states
at every layer it drives (float32, rounded to bfloat16 at the end of each step, as the server
stores them), computes the output each step should have and compares it with the reply's. The
per-layer gate parameters A_log and dt_bias are the server's: drawn from its --seed when it was
started without --weights, by the server's own recipe (gdn_server.weights).

The math of one step, per value head j (reading query/key head j // (HV / H)), token by token:

    q = q / sqrt(sum(q*q) + 1e-6) * scale           k = k / sqrt(sum(k*k) + 1e-6)
    x = a + dt_bias;  softplus = log(1 + exp(x)) if x <= 20 else x
    decay = exp(-exp(A_log) * softplus);  beta = sigmoid(b)
    S = decay * S;  S = S + outer(beta * (v - S @ k), k);  o = S @ q

with the state S [V, K] kept in float32 between the tokens of a step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from gdn_client import ModelInfo
from gdn_loadtest.config import Agreement

if TYPE_CHECKING:
    from gdn_server.weights import GateParams

__all__ = ["VerificationError", "StateVerifier", "gate_params_from_seed", "reference_step",
           "ABS_TOLERANCE", "REL_TOLERANCE", "TOLERANCE_TEXT"]

# An output is right when |o - expected| <= REL_TOLERANCE * |expected| + ABS_TOLERANCE * (the
# largest |expected| of its session, token and head). bfloat16 keeps 8 significant bits: rounding
# the output costs up to 2^-8 of it. The states drift apart: each side rounds its state to
# bfloat16 once a step from float32 sums that may differ in the last bits, so an entry now and
# then rounds the other way, and that difference lives on in later steps. The update contracts
# (decay <= 1, I - beta k k^T) and bounds the drift: against the CPU server it stayed under 1.4%
# of a head's largest output over 2,000 steps per layer. A wrong gate parameter is off by
# several times that largest output within a few steps.
REL_TOLERANCE = 2.0 ** -7
ABS_TOLERANCE = 2.0 ** -4
TOLERANCE_TEXT = "|error| <= 2^-7 x |expected| + 2^-4 x the largest |expected| of its session, token and head"


class VerificationError(Exception):
    """A reply's output differs from the reference math beyond bfloat16's tolerance."""


def gate_params_from_seed(info: ModelInfo, seed: int) -> "GateParams":
    """The A_log and dt_bias a gdn-server of the model `info` started with ``--seed seed`` (and no
    --weights) uses: drawn by the server's own recipe (gdn_server.weights, imported here: only
    --verify needs it)."""
    from gdn_server.config import ModelShape
    from gdn_server.weights import random_gate_params

    shape = ModelShape(num_layers=info.num_layers, num_q_heads=info.num_q_heads, num_v_heads=info.num_v_heads,
                       head_dim_k=info.head_dim_k, head_dim_v=info.head_dim_v)
    return random_gate_params(shape, seed)


def reference_step(
    state: torch.Tensor,  # [B, HV, V, K] float32, advanced in place (not rounded)
    q: torch.Tensor,  # [B, T, H, K]
    k: torch.Tensor,  # [B, T, H, K]
    v: torch.Tensor,  # [B, T, HV, V]
    a: torch.Tensor,  # [B, T, HV]
    b: torch.Tensor,  # [B, T, HV]
    A_log: torch.Tensor,  # [HV] float32, the step's layer's
    dt_bias: torch.Tensor,  # [HV] float32
    scale: float,
) -> torch.Tensor:
    """Applies one step's T tokens to `state`; returns o [B, T, HV, V] float32 (not rounded)."""
    H, HV = q.shape[2], v.shape[2]
    group = HV // H
    q, k, v, a, b = (x.float() for x in (q, k, v, a, b))
    qn = (q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale).repeat_interleave(group, dim=2)
    kn = (k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, dim=2)
    x = a + dt_bias
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
    decay = torch.exp(-torch.exp(A_log) * softplus)  # [B, T, HV]
    beta = torch.sigmoid(b)
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(q.shape[1]):
        k_t = kn[:, t, :, :, None]  # [B, HV, K, 1]
        state.mul_(decay[:, t, :, None, None])
        predicted = (state @ k_t)[..., 0]  # [B, HV, V]
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state.add_(delta[..., None] * kn[:, t, :, None, :])
        out[:, t] = (state @ qn[:, t, :, :, None])[..., 0]
    return out


class StateVerifier:
    """One client's sessions as the server should hold them: a state per session and layer."""

    def __init__(self, info: ModelInfo, gates: "GateParams", session_ids: Sequence[str], layers: int,
                 server_seed: int) -> None:
        self.session_ids = list(session_ids)
        self.scale = info.scale
        self.gates = gates
        self.server_seed = server_seed
        B, HV, V, K = len(self.session_ids), info.num_v_heads, info.head_dim_v, info.head_dim_k
        self.states = torch.zeros(layers, B, HV, V, K)
        self.outputs = 0
        self.max_error = 0.0
        self.max_share = 0.0
        # process-wide: torch's intra-op threads spin after each parallel region, taking the cores
        # the server and the other clients need (a verified run went 450 -> 13 steps/s on 2
        # cores); a step's math here is small enough for one thread
        torch.set_num_threads(1)

    def check(self, layer: int, position: int, inputs: Sequence[torch.Tensor], output: torch.Tensor) -> None:
        """Advances the layer's states by one step of `inputs` (q, k, v, a, b) and compares the
        expected output with the server's `output` [B, T, HV, V]; raises VerificationError."""
        state = self.states[layer]
        expected = reference_step(state, *inputs, self.gates.A_log[layer], self.gates.dt_bias[layer], self.scale)
        state.copy_(state.to(torch.bfloat16))  # the server stores its states in bfloat16, once a step
        if tuple(output.shape) != tuple(expected.shape):
            raise VerificationError(f"layer {layer} position {position}: output of shape {list(output.shape)}, "
                                    f"expected {list(expected.shape)}")
        error = (output.float() - expected).abs()
        head_scale = expected.abs().amax(-1, keepdim=True)  # per session, token and head
        allowed = REL_TOLERANCE * expected.abs() + ABS_TOLERANCE * head_scale
        bad = ~(error <= allowed)  # NaN in the output is a mismatch too
        if not bool(bad.any()):
            self.outputs += error.numel()
            self.max_error = max(self.max_error, float((error / head_scale.clamp_min(1e-30)).max()))
            self.max_share = max(self.max_share, float((error / allowed.clamp_min(1e-30)).max()))
            return
        excess = torch.where(bad, error / allowed.clamp_min(1e-30), torch.zeros(()))
        excess = torch.nan_to_num(excess, nan=float("inf"))
        row, token, head, index = (int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        worst = (row, token, head, index)
        raise VerificationError(
            f"session {self.session_ids[row]} layer {layer} step at position {position} (token {token}, "
            f"value head {head}, index {index}): output {float(output[worst]):.6g}, expected "
            f"{float(expected[worst]):.6g} (allowed error there {float(allowed[worst]):.3g}); max |error| over the "
            f"step {float(error.nan_to_num(float('inf')).max()):.3g}, {int(bad.sum())} of {bad.numel()} outputs "
            f"beyond the tolerance, {TOLERANCE_TEXT} (the server's gates are taken from --server-seed "
            f"{self.server_seed}: was it started with --seed {self.server_seed} and no --weights?)"
        )

    def agreement(self) -> Agreement:
        """The outputs this verifier has passed so far, and how close they came."""
        return Agreement(self.outputs, self.max_error, self.max_share)
