"""What only an fp32 state pool has, on a CUDA GPU (H200 / sm_90a): it stays exact where a bf16 one
drifts, and a server with `--state-dtype float32` exports fp32 states. The kernel's and the CUDA
backend's checks run for both dtypes in test_kernel.py and test_cuda_backend.py;
bench/kernel.py --state-dtype float32 is the full sweep and timing.
"""
from __future__ import annotations

import grpc
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from gdn_server.config import ModelShape
from gdn_server.weights import random_gate_params
from reference import gdn_reference_step, kernel_inputs, rel_err
from servers import start_server
from util import decode_request, random_inputs, run_kernel

D = 128
DEV = "cuda"
STATE_TOL = 2e-5


def _reference(state, x, rows):
    lay = x["layers"][rows].long()
    return gdn_reference_step(state, *(x[n][rows] for n in ("q", "k", "v", "a", "b")),
                              x["A_log"][lay], x["dt_bias"][lay], dtype=torch.float64)


def test_fp32_state_stays_exact_where_bf16_drifts():
    """256 steps of both pools on the same inputs against one float64 state never rounded."""
    B, T, H, HV, steps = 8, 1, 16, 32, 256
    gen = torch.Generator(device=DEV).manual_seed(17)
    gates = random_gate_params(ModelShape(1, H, HV), seed=17)  # the server's: long memories
    slots = torch.arange(B, device=DEV, dtype=torch.int32)
    pools = {dt: torch.zeros(B, HV, D, D, device=DEV, dtype=dt) for dt in (torch.bfloat16, torch.float32)}
    exact = torch.zeros(B, HV, D, D, device=DEV, dtype=torch.float64)
    out = torch.empty(B, T, HV, D, device=DEV, dtype=torch.bfloat16)
    for _ in range(steps):
        x = kernel_inputs(B, T, H, HV, 1, gen)
        x["A_log"], x["dt_bias"] = gates.A_log.to(DEV), gates.dt_bias.to(DEV)
        for pool in pools.values():
            run_kernel(pool, slots, x, out)
        _, exact = _reference(exact, x, slice(None))
    err32 = rel_err(pools[torch.float32], exact)
    err16 = rel_err(pools[torch.bfloat16], exact)
    assert err32 < STATE_TOL, err32
    assert err32 * 100 < err16, (err32, err16)


def test_fp32_server_on_the_gpu():
    """ModelInfo names the dtype; steps agree with float64; an export is an fp32 stream that a
    bf16 server takes only when asked to convert it."""
    H, HV = 16, 32
    gates = random_gate_params(ModelShape(2, H, HV), seed=5)
    gen = torch.Generator().manual_seed(8)
    flags = ("--device", "cuda", "--devices", "0", "--layers", "2", "--q-heads", str(H), "--v-heads", str(HV),
             "--seed", "5", "--max-sessions", "8")
    with start_server(*flags, "--state-dtype", "float32", timeout=300) as srv, \
            grpc.insecure_channel(srv.address) as channel:
        stub = gdn_pb2_grpc.GdnDecodeStub(channel)
        info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=60)
        assert (info.backend, info.state_dtype) == ("cuda-cute", "float32")
        sessions = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=60).session_id for _ in range(3)]
        exact = torch.zeros(2, 3, HV, D, D, dtype=torch.float64)
        for step in range(6):
            for layer in range(2):
                x = random_inputs(3, step % 4 + 1, H, HV, gen=gen, dtype=torch.bfloat16)
                o = tensor_from_proto(stub.Decode(decode_request(layer, sessions, x), timeout=120).o)
                layers = [layer] * 3
                o_ref, exact[layer] = gdn_reference_step(exact[layer], **x, A_log=gates.A_log[layers],
                                                         dt_bias=gates.dt_bias[layers])
                assert rel_err(o, o_ref) < 5e-3
        chunks = list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sessions[1]), timeout=60))
        assert chunks[0].header.dtype == "float32"
        state = torch.frombuffer(bytearray(b"".join(c.data for c in chunks[1:])), dtype=torch.float32)
        assert rel_err(state.reshape(2, HV, D, D), exact[:, 1]) < STATE_TOL
