"""The smallest complete client: model info, one session, three tokens through every layer.

    python examples/quickstart.py [HOST:PORT]        (default 127.0.0.1:50051)

Start a server first, e.g. `gdn-server --device cpu --layers 2 --q-heads 2 --v-heads 4`. The
inputs are random (seeded, so two runs print the same numbers against the same server); a real
model would pass its own q, k, v, a, b per GDN layer. Nothing is checked: it prints what it gets.
"""
from __future__ import annotations

import sys

import torch

from gdn_client import Client, GdnError


def main(address: str) -> int:
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    with Client(address) as client:
        info = client.model_info()
        H, HV, K, V = info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v
        print(f"{info.backend}: {info.num_layers} layers, H={H}, HV={HV}, K={K}, V={V}, "
              f"{info.sessions_in_use}/{info.max_sessions} sessions in use")
        with client.session() as session:  # closed (its slot freed) on leaving the block
            for token in range(3):
                for layer in range(info.num_layers):
                    q, k = randn(1, H, K), randn(1, H, K)  # [T, H, K] with T = 1 token
                    v = randn(1, HV, V)                    # [T, HV, V]
                    a, b = randn(1, HV), randn(1, HV)      # [T, HV]
                    o = session.decode(layer, q, k, v, a, b)  # bf16 [T, HV, V]
                values = ", ".join(f"{x:+.4f}" for x in o[0, 0, :4].float().tolist())
                print(f"token {token}: last layer o[0, 0, :4] = [{values}]")
            print(f"positions per layer: {session.positions}")
    return 0


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
    try:
        sys.exit(main(target))
    except GdnError as e:  # unreachable server, no free session, ...: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
