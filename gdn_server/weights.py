"""Per-layer gate parameters: A_log and dt_bias of [L, HV], float32.

From a safetensors file (`layers.{i}.A_log` / `layers.{i}.dt_bias`, or Hugging Face names
`model.layers.{i}.linear_attn.A_log` / `.dt_bias`, renumbered 0..L-1 in layer order), or drawn
from a seed:

    A_log   = log(U(1, 16))                      # decay rate exp(A_log) in [1, 16], as Qwen3-Next inits it
    dt      = exp(U(log 1e-3, log 1e-1))         # Mamba-style time step
    dt_bias = log(expm1(dt))                     # inverse softplus, so softplus(dt_bias) = dt
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gdn_server.config import ModelShape

_PLAIN = re.compile(r"^layers\.(\d+)\.(A_log|dt_bias)$")
_HF = re.compile(r"^model\.layers\.(\d+)\.linear_attn\.(A_log|dt_bias)$")


@dataclass(frozen=True)
class GateParams:
    A_log: torch.Tensor  # [L, HV] float32
    dt_bias: torch.Tensor  # [L, HV] float32

    @property
    def num_layers(self) -> int:
        return int(self.A_log.shape[0])


def random_gate_params(shape: ModelShape, seed: int) -> GateParams:
    """Draws A_log and dt_bias from the distribution in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    L, HV = shape.num_layers, shape.num_v_heads
    A = torch.empty(L, HV).uniform_(1.0, 16.0, generator=gen)
    log_dt = torch.empty(L, HV).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
    dt = torch.exp(log_dt)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # log(expm1(dt)), stable for small dt
    return GateParams(A_log=torch.log(A).float().contiguous(), dt_bias=dt_bias.float().contiguous())


def load_gate_params(path: str | Path, num_v_heads: int) -> GateParams:
    """Reads A_log/dt_bias for every GDN layer in a safetensors file; raises ValueError if malformed."""
    from safetensors import safe_open

    found: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            m = _PLAIN.match(key) or _HF.match(key)
            if m:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = f.get_tensor(key)
    if not found:
        raise ValueError(f"{path}: no layers.{{i}}.A_log / dt_bias tensors (nor HF linear_attn names)")
    A_logs, dt_biases = [], []
    for idx in sorted(found):  # HF files number all decoder layers: keep GDN ones in order, renumbered
        entry = found[idx]
        for name in ("A_log", "dt_bias"):
            if name not in entry:
                raise ValueError(f"{path}: layer {idx} has no {name}")
            t = entry[name]
            if tuple(t.shape) != (num_v_heads,) or not t.is_floating_point():
                raise ValueError(f"{path}: layer {idx} {name} must be float [{num_v_heads}], got {t.dtype} {list(t.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{path}: layer {idx} {name} has non-finite values")
        A_logs.append(entry["A_log"].float())
        dt_biases.append(entry["dt_bias"].float())
    return GateParams(A_log=torch.stack(A_logs).contiguous(), dt_bias=torch.stack(dt_biases).contiguous())
