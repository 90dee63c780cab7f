"""Checks a server's decode outputs against the math of docs/protocol.md, written out in numpy.

    python examples/check_math.py [HOST:PORT] [--weights FILE.safetensors]

It runs three steps of one fresh session (T = 2 then T = 1 at the first layer, T = 2 at the
last) and computes the same steps here, in float64, with the state rounded to bfloat16 after each
step as the server stores it. It passes when every output agrees to within 2% of the output's
largest magnitude (the server's output is bfloat16, about 3 significant digits). Exit 0: all
agree; 1: a mismatch (printed).

The server's gate parameters A_log and dt_bias never go over the wire. With --weights (the file
the server was started with, names `layers.{i}.A_log` / `layers.{i}.dt_bias`) the check uses
them and random gate inputs `a`. Without it, every `a` is -10000: softplus(a + dt_bias) is then 0
and the decay exactly 1 whatever the gates are, so everything but the decay is still checked.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from gdn_client import Client

RELATIVE_TOLERANCE = 2e-2
NO_DECAY_A = -1.0e4  # a backend that rounds inputs to bfloat16 reads -9984: the decay is 1 either way


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32.

    A bfloat16 is the upper 16 bits of a float32; rounding adds half of the dropped part (less
    one, plus the kept part's lowest bit, which breaks ties towards even) before cutting it."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def gdn_step(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray,
             A_log: np.ndarray, dt_bias: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """One step of T tokens for one session at one layer.

    S [HV, V, K] (state before), q, k [T, H, K], v [T, HV, V], a, b [T, HV], A_log, dt_bias [HV].
    Returns (o [T, HV, V], state after, not rounded)."""
    T, H, _ = q.shape
    HV, V = v.shape[1], v.shape[2]
    group = HV // H  # value head j reads query/key head j // group
    S = S.astype(np.float64)  # a copy
    o = np.empty((T, HV, V))
    for t in range(T):
        for j in range(HV):
            h = j // group
            qn = q[t, h] / np.sqrt(np.sum(q[t, h] ** 2) + 1e-6) * scale
            kn = k[t, h] / np.sqrt(np.sum(k[t, h] ** 2) + 1e-6)
            x = a[t, j] + dt_bias[j]
            softplus = np.log1p(np.exp(x)) if x <= 20.0 else x
            decay = np.exp(-np.exp(A_log[j]) * softplus)
            beta = 1.0 / (1.0 + np.exp(-b[t, j]))
            S[j] = decay * S[j]
            S[j] = S[j] + beta * np.outer(v[t, j] - S[j] @ kn, kn)  # the delta rule
            o[t, j] = S[j] @ qn
    return o, S


def load_gates(path: str, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """A_log, dt_bias [L, HV] from the server's --weights file."""
    from safetensors.numpy import load_file

    tensors = load_file(path)
    A_log = np.stack([tensors[f"layers.{i}.A_log"] for i in range(num_layers)]).astype(np.float64)
    dt_bias = np.stack([tensors[f"layers.{i}.dt_bias"] for i in range(num_layers)]).astype(np.float64)
    return A_log, dt_bias


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("address", nargs="?", default="127.0.0.1:50051")
    p.add_argument("--weights", help="the server's --weights file (else the decay is not checked)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)

    def randn(*shape: int) -> np.ndarray:
        return bf16_round(rng.standard_normal(shape).astype(np.float32))  # what any backend reads exactly

    with Client(args.address) as client:
        info = client.model_info()
        L, H, HV, K, V = info.num_layers, info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v
        if args.weights:
            A_log, dt_bias = load_gates(args.weights, L)
        else:  # the gates only enter through the decay, which NO_DECAY_A pins to 1
            A_log, dt_bias = np.zeros((L, HV)), np.zeros((L, HV))
        print(f"{info.backend}: L={L}, H={H}, HV={HV}, K={K}, V={V}, scale={info.scale:.6g}, "
              f"decay {'checked' if args.weights else 'not checked (no --weights)'}")
        states = {layer: np.zeros((HV, V, K), dtype=np.float32) for layer in {0, L - 1}}
        steps = [(0, min(2, info.max_tokens_per_step)), (0, 1), (L - 1, min(2, info.max_tokens_per_step))]
        failures = 0
        with client.session() as session:
            for i, (layer, T) in enumerate(steps):
                q, k, v, b = randn(T, H, K), randn(T, H, K), randn(T, HV, V), randn(T, HV)
                a = randn(T, HV) if args.weights else np.full((T, HV), NO_DECAY_A, dtype=np.float32)
                got = session.decode(layer, q, k, v, a, b).float().numpy()
                want, after = gdn_step(states[layer], q, k, v, a, b, A_log[layer], dt_bias[layer], info.scale)
                states[layer] = bf16_round(after.astype(np.float32))  # the server stores bfloat16
                err = float(np.max(np.abs(got - want)))
                rel = err / max(float(np.max(np.abs(want))), 1e-6)
                ok = rel <= RELATIVE_TOLERANCE
                failures += not ok
                print(f"step {i}: layer {layer}, T={T}: max |o - numpy| = {err:.3g} "
                      f"({rel:.2%} of max |o|) {'OK' if ok else 'MISMATCH'}")
    print("all outputs agree with the numpy math" if not failures else f"{failures} step(s) disagree")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
