"""Small helpers for the end-to-end tests: request building and gate-parameter files."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.wire import tensor_to_proto


def cli_refusal(*argv: str) -> str:
    """gdn-server's command line run in this process on `argv`, which it must refuse before
    anything starts (exit code 2, as argparse's errors exit); returns what it printed on stderr.
    In-process: a refusal checked in a fresh interpreter cost ~3 s of imports each."""
    from gdn_server import cli, server

    err = io.StringIO()
    accepted = AssertionError(f"gdn-server {' '.join(argv)}: not refused, it went on to start")
    with mock.patch.object(cli, "tune_process"), contextlib.redirect_stderr(err), \
            mock.patch.object(server, "build_app", side_effect=accepted):  # a regression fails here, not hangs
        with pytest.raises(SystemExit) as exited:
            cli.main(["--device", "cpu", "--port", "0", *argv])
    assert exited.value.code == 2, (argv, err.getvalue())
    return err.getvalue()


def write_gates(path: Path, layers: int, v_heads: int, seed: int = 0, hf_names: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes float32 A_log/dt_bias [HV] per layer; returns them stacked [L, HV]."""
    g = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.empty(layers, v_heads).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.empty(layers, v_heads).uniform_(-6.0, -2.0, generator=g)
    tensors = {}
    for i in range(layers):
        # HF checkpoints number every decoder layer; GDN layers are a subset (here every other one)
        prefix = f"model.layers.{2 * i + 1}.linear_attn." if hf_names else f"layers.{i}."
        tensors[prefix + "A_log"] = A_log[i].contiguous()
        tensors[prefix + "dt_bias"] = dt_bias[i].contiguous()
    save_file(tensors, str(path))
    return A_log, dt_bias


def random_inputs(B: int, T: int, H: int, HV: int, K: int = 128, gen: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Fresh random q, k, v, a, b (never zeros)."""
    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, HV, K), "a": r(B, T, HV), "b": r(B, T, HV)}


def run_kernel(pool: torch.Tensor, slots: torch.Tensor, x: dict[str, torch.Tensor], out: torch.Tensor, **kw):
    """gdn_decode over the pool with `x` (reference.kernel_inputs) into `out`."""
    from gdn_server.kernels import gdn_decode

    return gdn_decode(pool, slots, x["layers"], x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                      out, **kw)


def decode_request(layer: int, sessions: list[str], inputs: dict[str, torch.Tensor], positions=None,
                   request_id: str = "") -> gdn_pb2.DecodeRequest:
    req = gdn_pb2.DecodeRequest(layer=layer, session_ids=sessions, request_id=request_id)
    for name in ("q", "k", "v", "a", "b"):
        tensor_to_proto(inputs[name], getattr(req, name))
    if positions is not None:
        req.positions[:] = positions
    return req
