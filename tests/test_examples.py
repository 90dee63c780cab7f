"""The examples and the worked example of docs/protocol.md, run for real.

Every `examples/*.py` runs as a subprocess, as a user would run it, against a real server process
on a free loopback port. The worked example's numbers (a JSON block in docs/protocol.md) are
checked against the fp32 reference and against a server answering raw gRPC requests built from
the JSON alone, as a client in another language would build them.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from reference import ReferenceModel
from servers import start_server

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PROTOCOL_DOC = ROOT / "docs" / "protocol.md"
SCRIPT_TIMEOUT_S = 120  # one example: interpreter and torch import, a few steps on a tiny model
RPC_TIMEOUT_S = 30
EXAMPLE_MODEL = ("--layers", "2", "--q-heads", "2", "--v-heads", "4", "--head-dim", "128")
LAYERS, V_HEADS = 2, 4

# what each example must print, besides exiting 0; a new example without an entry here is still
# run and must still exit 0
EXPECTED_OUTPUT = {
    "quickstart.py": [": 2 layers, H=2, HV=4, K=128, V=128", "token 2: last layer o[0, 0, :4] = [",
                      "positions per layer: {0: 3, 1: 3}"],
    "check_math.py": ["all outputs agree with the numpy math"],
}


@pytest.fixture(scope="module")
def gates_file(tmp_path_factory) -> Path:
    """Gate parameters for the examples' server, so check_math.py can check the decay too."""
    gen = torch.Generator().manual_seed(11)
    A_log = torch.log(torch.empty(LAYERS, V_HEADS).uniform_(1.0, 16.0, generator=gen))
    dt_bias = torch.empty(LAYERS, V_HEADS).uniform_(-6.0, -2.0, generator=gen)
    path = tmp_path_factory.mktemp("gates") / "gates.safetensors"
    save_file({f"layers.{i}.{name}": t[i].contiguous() for i in range(LAYERS)
               for name, t in (("A_log", A_log), ("dt_bias", dt_bias))}, str(path))
    return path


@pytest.fixture(scope="module")
def example_server(gates_file):
    with start_server(*EXAMPLE_MODEL, "--weights", str(gates_file)) as server:
        yield server


def run_example(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=SCRIPT_TIMEOUT_S)


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= set(EXPECTED_OUTPUT)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, example_server, gates_file):
    extra = ["--weights", str(gates_file)] if script.name == "check_math.py" else []
    r = run_example(script, example_server.address, *extra)
    assert r.returncode == 0, f"{script.name} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    for text in EXPECTED_OUTPUT.get(script.name, []):
        assert text in r.stdout, (text, r.stdout)


def test_check_math_without_weights_skips_only_the_decay(example_server):
    r = run_example(ROOT / "examples" / "check_math.py", example_server.address)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert "decay not checked" in r.stdout and "all outputs agree" in r.stdout


def test_check_math_notices_wrong_math(example_server, tmp_path):
    """The check can fail: gates other than the server's make the decay, hence o, disagree."""
    wrong = tmp_path / "wrong.safetensors"
    save_file({f"layers.{i}.{name}": torch.full((V_HEADS,), value) for i in range(LAYERS)
               for name, value in (("A_log", 2.0), ("dt_bias", 1.0))}, str(wrong))
    r = run_example(ROOT / "examples" / "check_math.py", example_server.address, "--weights", str(wrong))
    assert r.returncode == 1, f"{r.stdout}\n{r.stderr}"
    assert "MISMATCH" in r.stdout


# -- the worked example of docs/protocol.md ------------------------------------------------------

def worked_example() -> dict:
    """The JSON block after the `worked-example-json` marker in docs/protocol.md."""
    text = PROTOCOL_DOC.read_text()
    m = re.search(r"<!-- worked-example-json.*?-->\s*```json\n(.*?)\n```", text, re.S)
    assert m, "docs/protocol.md has no worked-example JSON block"
    return json.loads(m.group(1))


def bf16_bytes(values) -> bytes:
    """Exact bfloat16 values (nested lists) as the wire's little-endian bytes."""
    bits = np.asarray(values, dtype="<f4").view("<u4")
    assert not (bits & 0xFFFF).any(), "a value of the worked example is not exact in bfloat16"
    return (bits >> 16).astype("<u2").tobytes()


def bf16_values(data: bytes) -> np.ndarray:
    return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4")


def wire_tensor(values, dtype: int) -> gdn_pb2.Tensor:
    arr = np.asarray(values, dtype="<f4")
    data = arr.tobytes() if dtype == gdn_pb2.F32 else bf16_bytes(values)
    return gdn_pb2.Tensor(dtype=dtype, shape=list(arr.shape), data=data)


def test_worked_example_matches_the_reference():
    ex = worked_example()
    model = ReferenceModel(torch.tensor(ex["gates"]["A_log"]), torch.tensor(ex["gates"]["dt_bias"]),
                           head_dim=ex["model"]["head_dim"])
    assert ex["model"]["scale"] == 1 / ex["model"]["head_dim"] ** 0.5  # the default scale is what it uses
    for step in ex["steps"]:
        o = model.step(0, ["s"], *(torch.tensor(step[name]) for name in "qkvab"))
        assert o.to(torch.bfloat16).float().tolist() == step["o"]
        assert bf16_bytes(step["o"]).hex() == step["o_data_hex"]
        state = model.states[("s", 0)]  # bf16-rounded, as stored
        assert state.tolist() == step["state_after"]
        assert hashlib.sha256(bf16_bytes(step["state_after"])).hexdigest() == step["state_sha256"]


@pytest.mark.skipif("--device" in os.environ.get("GDN_TEST_SERVER_FLAGS", ""),
                    reason="the worked example gives the CPU backend's bits (K = 4)")
@pytest.mark.parametrize("dtype", [gdn_pb2.F32, gdn_pb2.BF16], ids=["F32", "BF16"])
def test_worked_example_matches_a_server(dtype: int, tmp_path):
    ex = worked_example()
    m, gates = ex["model"], ex["gates"]
    weights = tmp_path / "gates.safetensors"
    save_file({f"layers.{i}.{name}": torch.tensor(gates[name][i]) for i in range(m["layers"])
               for name in ("A_log", "dt_bias")}, str(weights))
    flags = ("--layers", str(m["layers"]), "--q-heads", str(m["q_heads"]), "--v-heads", str(m["v_heads"]),
             "--head-dim", str(m["head_dim"]), "--weights", str(weights), "--device", "cpu")
    with start_server(*flags) as server, grpc.insecure_channel(server.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
        assert info.scale == pytest.approx(m["scale"])
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=RPC_TIMEOUT_S).session_id
        for i, step in enumerate(ex["steps"]):
            request = gdn_pb2.DecodeRequest(layer=0, session_ids=[sid], positions=step["positions"],
                                            request_id=f"step {i}")
            for name in "qkvab":
                getattr(request, name).CopyFrom(wire_tensor(step[name], dtype))
            reply = stub.Decode(request, timeout=RPC_TIMEOUT_S)
            assert reply.request_id == f"step {i}"
            assert list(reply.positions) == step["positions_after"]
            assert reply.o.dtype == gdn_pb2.BF16
            assert list(reply.o.shape) == list(np.asarray(step["o"]).shape)
            assert reply.o.data.hex() == step["o_data_hex"]
            assert bf16_values(reply.o.data).tolist() == np.asarray(step["o"]).ravel().tolist()

            chunks = list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sid), timeout=RPC_TIMEOUT_S))
            header = chunks[0].header
            assert chunks[0].HasField("header") and not chunks[0].data
            assert (header.num_layers, header.num_v_heads, header.head_dim_k, header.head_dim_v, header.dtype) == (
                m["layers"], m["v_heads"], m["head_dim"], m["head_dim"], "bfloat16")
            assert list(header.positions) == step["positions_after"]
            data = b"".join(c.data for c in chunks[1:])
            assert header.total_bytes == len(data) == 2 * m["layers"] * m["v_heads"] * m["head_dim"] ** 2
            assert header.checksum == hashlib.sha256(data).hexdigest() == step["state_sha256"]
            assert bf16_values(data).tolist() == np.asarray(step["state_after"]).ravel().tolist()
