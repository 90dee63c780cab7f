"""Small helpers for the end-to-end tests: request building and gate-parameter files."""
from __future__ import annotations

import contextlib
import io
import itertools
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_client.wire import tensor_to_proto
from gdn_client._h2_native import native_transport_problem


# tests of `--frontend-transport native` and `gdn-loadtest --client-transport native`
NEEDS_NATIVE_TRANSPORT = pytest.mark.skipif(
    native_transport_problem() is not None, reason=f"no native transport: {native_transport_problem()}"
)


def cli_refusal(*argv: str) -> str:
    """gdn-server's command line run in this process on `argv`, which it must refuse before
    anything starts (exit code 2, as argparse's errors exit); returns what it printed on stderr.
    In-process: a refusal checked in a fresh interpreter cost ~3 s of imports each."""
    from gdn_server import cli

    err = io.StringIO()
    accepted = AssertionError(f"gdn-server {' '.join(argv)}: not refused, it went on to start")
    with mock.patch.object(cli, "tune_malloc"), mock.patch.object(cli, "tune_gc"), contextlib.redirect_stderr(err), \
            mock.patch.object(cli, "build_app", side_effect=accepted), \
            mock.patch.object(cli, "run_loop", side_effect=accepted):  # a regression fails here, not hangs
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


def decode_request(layer: int, sessions: list[str], inputs: dict[str, torch.Tensor], positions=None,
                   request_id: str = "") -> gdn_pb2.DecodeRequest:
    req = gdn_pb2.DecodeRequest(layer=layer, session_ids=sessions, request_id=request_id)
    for name in ("q", "k", "v", "a", "b"):
        tensor_to_proto(inputs[name], getattr(req, name))
    if positions is not None:
        req.positions[:] = positions
    return req


def environ_of(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (Linux: /proc/PID/environ)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry]
    return {k.decode(): v.decode() for k, v in items}


def step_positions(sessions: list, layer: int, T: int, mode: str, expected: dict) -> tuple[int, ...] | None:
    """The positions a random test's step sends for `sessions` (each (key, Session or None for an
    unknown one)) at `layer`: "right" (each session's count after the round's earlier steps,
    kept in `expected`), "wrong" (5 past it), "retry" (the last step's start, where there is one)
    or "none" (not sent)."""
    if mode == "none":
        return None
    positions = []
    for key, s in sessions:
        now = expected.get((key, layer), s.positions[layer] if s is not None else 0)
        if mode == "wrong":
            now += 5
        elif mode == "retry" and s is not None and layer in s.last_steps:
            now = s.last_steps[layer].count_before
        positions.append(now)
        expected[(key, layer)] = now + T
    return tuple(positions)


def session_records(table, ids: list[str]) -> list:
    """What a scheduler leaves of each session (None for one gone): positions, last steps with
    their outputs, scratch rows and speculative records, to compare two schedulers by."""
    out = []
    for sid in ids:
        s = table.find(sid)
        if s is None:
            out.append(None)
            continue
        last = {
            layer: (ls.count_before, ls.row, ls.tokens, ls.rows, None if ls.out is None else bytes(ls.out))
            for layer, ls in s.last_steps.items()
        }
        provisional = {layer: (p.row, p.read_row, p.tokens, p.count_before) for layer, p in s.provisional.items()}
        out.append((list(s.positions), last, dict(s.scratch_current), provisional))
    return out


def bf16_step_inputs(shape, seed: int, rows: int, T: int) -> tuple[tuple[bytes, ...], tuple[tuple[int, ...], ...]]:
    """Random q, k, v, a, b of a step as raw bf16 bytes, and their shapes (DecodeWork.of_bf16's)."""
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    dims = ((rows, T, H, K), (rows, T, H, K), (rows, T, HV, V), (rows, T, HV), (rows, T, HV))
    raw = tuple(torch.randn(d, generator=g).to(torch.bfloat16).view(torch.int16).numpy().tobytes() for d in dims)
    return raw, dims


def numbered_sessions(backend, num_layers: int, owners: tuple) -> tuple:
    """A session table over `backend`'s pool (its scratch rows after the homes) with a session per
    owner in `owners`, whose ids are s0, s1, ...: two worlds built alike hold the same ids.
    Returns (table, ids)."""
    from gdn_server import sessions as sessions_module

    table = sessions_module.SessionTable(len(owners), num_layers, range(backend.home_rows, backend.pool_rows))
    counter = itertools.count()
    with mock.patch.object(sessions_module, "new_session_id", lambda: f"s{next(counter)}"):
        ids = [table.create(owner=owner).id for owner in owners]
    return table, ids

