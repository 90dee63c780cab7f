"""The decode kernel over an fp32 state pool, and the CUDA backend and server with
`--state-dtype float32`, on a CUDA GPU (H200 / sm_90a).

The fp32 state is held to 2e-5 of the float64 reference (the bf16 one to its rounding, 5e-3);
outputs are bf16 either way. bench/kernel.py --state-dtype float32 is the full sweep and timing.
"""
from __future__ import annotations

import random

import grpc
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from gdn_server.backends.cpu import CpuBackend
from gdn_server.backends.cuda import CudaBackend
from gdn_server.config import ModelShape
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork, StepBatch
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


SHAPES = [(T, H, HV) for H, HV in [(16, 32), (8, 32), (32, 32)] for T in (1, 2, 3, 4)]
SHAPES += [(T, 16, 32) for T in (5, 6, 7, 8)]  # speculative drafts


@pytest.mark.parametrize("T,H,HV", SHAPES)
@pytest.mark.parametrize("B", [1, 7, 64])
def test_fp32_state_matches_float64(B, T, H, HV):
    """Mixed layers, padding rows (zero outputs, no state touched), slots no row names left
    bit-for-bit; the new state within fp32 arithmetic of float64."""
    gen = torch.Generator(device=DEV).manual_seed(B * 100 + T * 10 + H + 1)
    N = 2 * B + 8
    pool = torch.randn(N, HV, D, D, device=DEV, generator=gen) * 0.5
    before = pool.clone()
    slots = torch.randperm(N, device=DEV, generator=gen)[:B].to(torch.int32)
    if B > 1:
        slots[::3] = -1
    x = kernel_inputs(B, T, H, HV, 3, gen)
    out = torch.full((B, T, HV, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    run_kernel(pool, slots, x, out)
    torch.cuda.synchronize()

    live = slots >= 0
    ls = slots[live].long()
    o_ref, s_ref = _reference(before[ls], x, live)
    assert rel_err(out[live].float(), o_ref.to(DEV)) < 5e-3
    assert rel_err(pool[ls], s_ref) < STATE_TOL
    assert (out[~live] == 0).all()
    untouched = torch.ones(N, dtype=torch.bool, device=DEV)
    untouched[ls] = False
    assert torch.equal(pool[untouched].view(torch.int32), before[untouched].view(torch.int32))


@pytest.mark.parametrize("T", [1, 4, 7])
def test_fp32_out_slots(T):
    """Rows read one slot and write another (one in place, one writing nothing): the
    speculative steps' scratch rows."""
    B, H, HV = 24, 16, 32
    gen = torch.Generator(device=DEV).manual_seed(50 + T)
    N = 3 * B
    pool = torch.randn(N, HV, D, D, device=DEV, generator=gen) * 0.5
    before = pool.clone()
    perm = torch.randperm(N, device=DEV, generator=gen).to(torch.int32)
    slots, out_slots = perm[:B].clone(), perm[B:2 * B].clone()
    out_slots[1] = slots[1]
    out_slots[2] = -1
    slots[3::5] = -1
    x = kernel_inputs(B, T, H, HV, 2, gen)
    out = torch.full((B, T, HV, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    run_kernel(pool, slots, x, out, out_slots=out_slots)
    torch.cuda.synchronize()

    live = slots >= 0
    o_ref, s_ref = _reference(before[slots[live].long()], x, live)
    assert rel_err(out[live].float(), o_ref.to(DEV)) < 5e-3
    wrote = out_slots[live] >= 0
    ws = out_slots[live][wrote].long()
    assert rel_err(pool[ws], s_ref[wrote]) < STATE_TOL
    untouched = torch.ones(N, dtype=torch.bool, device=DEV)
    untouched[ws] = False
    assert torch.equal(pool[untouched].view(torch.int32), before[untouched].view(torch.int32))


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


def test_fp32_cuda_backend_matches_the_fp32_cpu_backend():
    """Launches of mixed layers and T through the CUDA backend after warm-up (graphs by bucket for
    in-place T = 1, padding rows included) and speculative launches into scratch rows, against the
    CPU backend with an fp32 pool: states within fp32 arithmetic, outputs within bf16's."""
    shape = ModelShape(num_layers=3, num_q_heads=16, num_v_heads=32, state_dtype="float32")
    gates = random_gate_params(shape, seed=6)
    gpu = CudaBackend(shape, gates, max_sessions=48, speculative_sessions=8, rows_hint=64)
    cpu = CpuBackend(shape, gates, max_sessions=48, speculative_sessions=8)
    assert gpu.state_pool.dtype == torch.float32
    gpu.warmup()
    rng = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    worst = 0.0
    for launch in range(16):
        T = rng.choice([1, 1, 1, 2, 3, 4])
        R = rng.choice([1, 3, 8, 13, 40]) if T == 1 else rng.choice([2, 5])
        members = rng.sample(range(48), R)
        layer = rng.randrange(shape.num_layers)
        x = randomkernel_inputs(R, T, 16, 32, gen=gen, dtype=torch.bfloat16)
        raw = tuple(x[n].contiguous().view(torch.int16).numpy().tobytes() for n in "qkvab")
        speculative = T > 1 and launch % 2 == 1
        outs = []
        for backend in (cpu, gpu):
            batch = StepBatch(T)
            reads = [m * shape.num_layers + layer for m in members]
            writes = list(range(backend.home_rows, backend.home_rows + R)) if speculative else None
            batch.add(DecodeWork(layer, tuple(map(str, members)), positions=None, bf16_bytes=raw, **x), reads, writes)
            outs.append(backend.submit(batch).result().clone())
        worst = max(worst, rel_err(outs[1], outs[0].float()))
    gpu.synchronize()
    assert worst < 5e-3, worst
    assert rel_err(gpu.state_pool.cpu(), cpu.read_rows(range(cpu.pool_rows))) < STATE_TOL
    state = cpu.read_session(5)
    gpu.write_session(7, state)
    assert torch.equal(gpu.read_session(7), state)
    with pytest.raises(ValueError):
        gpu.write_session(7, state.to(torch.bfloat16))


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
                x = randomkernel_inputs(3, step % 4 + 1, H, HV, gen=gen, dtype=torch.bfloat16)
                o = tensor_from_proto(stub.Decode(decode_request(layer, sessions, x), timeout=120).o)
                layers = [layer] * 3
                o_ref, exact[layer] = gdn_reference_step(exact[layer], **x, A_log=gates.A_log[layers],
                                                         dt_bias=gates.dt_bias[layers])
                assert rel_err(o, o_ref) < 5e-3
        chunks = list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sessions[1]), timeout=60))
        assert chunks[0].header.dtype == "float32"
        state = torch.frombuffer(bytearray(b"".join(c.data for c in chunks[1:])), dtype=torch.float32)
        assert rel_err(state.reshape(2, HV, D, D), exact[:, 1]) < STATE_TOL
