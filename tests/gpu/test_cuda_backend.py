"""The CUDA backend against the CPU backend, and the server on the GPU end to end.

A recorded multi-client trace (mixed sessions, layers and T, several requests per launch) is
replayed through both backends: outputs and states agree within bf16 rounding.
"""
from __future__ import annotations

import random

import grpc
import pytest
import torch

from servers import start_server
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from gdn_server.backends.cpu import CpuBackend
from gdn_server.backends.cuda import CudaBackend
from gdn_server.config import ModelShape
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork, StepBatch
from reference import ReferenceModel, rel_err
from util import decode_request, random_inputs


def _trace(shape: ModelShape, sessions: int, launches: int, seed: int):
    """Launches of requests as the scheduler would form them: per launch one T, distinct
    (session, layer) rows, several requests of mixed layers and dtypes."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    trace = []
    for _ in range(launches):
        T = rng.randint(1, 4)
        free = list(range(sessions))
        rng.shuffle(free)
        requests = []
        while len(free) >= 1 and len(requests) < 6:
            B = min(len(free), rng.randint(1, 5))
            members, free = free[:B], free[B:]
            layer = rng.randrange(shape.num_layers)
            x = random_inputs(B, T, shape.num_q_heads, shape.num_v_heads, gen=gen, dtype=rng.choice(dtypes))
            requests.append((layer, members, x))
        trace.append((T, requests))
    return trace


def test_cuda_and_cpu_backends_agree_on_a_recorded_trace():
    """Plain rows write back in place; every third request is speculative and writes scratch rows."""
    shape = ModelShape(num_layers=4, num_q_heads=16, num_v_heads=32)
    gates = random_gate_params(shape, seed=1)
    cpu = CpuBackend(shape, gates, max_sessions=24, speculative_sessions=8)
    gpu = CudaBackend(shape, gates, max_sessions=24, speculative_sessions=8)
    worst = 0.0
    for launch, (T, requests) in enumerate(_trace(shape, sessions=24, launches=20, seed=2)):
        outs = []
        for backend in (cpu, gpu):
            batch = StepBatch(T)
            scratch = iter(range(backend.home_rows, backend.pool_rows))
            for r, (layer, members, x) in enumerate(requests):
                raw = None
                if x["q"].dtype == torch.bfloat16:  # as validation hands them on: the bytes a GPU memcpys
                    raw = tuple(x[n].contiguous().view(torch.int16).numpy().tobytes() for n in "qkvab")
                work = DecodeWork(layer, tuple(map(str, members)), positions=None, bf16_bytes=raw, **x)
                reads = [m * shape.num_layers + layer for m in members]
                writes = [next(scratch) for _ in members] if (launch + r) % 3 == 0 else None
                batch.add(work, reads, writes)
            outs.append(backend.submit(batch).result().clone())
        worst = max(worst, rel_err(outs[1], outs[0].float()))
    state_err = rel_err(gpu.state_pool.cpu(), cpu.read_rows(range(cpu.pool_rows)).float())
    assert worst < 1e-2, worst
    assert state_err < 1e-2, state_err


def test_server_on_the_gpu_matches_the_reference():
    gates = random_gate_params(ModelShape(3, 16, 32), seed=5)
    ref = ReferenceModel(gates.A_log, gates.dt_bias)
    gen = torch.Generator().manual_seed(3)
    # one device: a request's sessions must share one (see test_multi_gpu.py for two)
    with start_server("--device", "cuda", "--devices", "0", "--layers", "3", "--q-heads", "16", "--v-heads", "32",
                      "--seed", "5", "--max-sessions", "16", timeout=300) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = gdn_pb2_grpc.GdnDecodeStub(channel)
            assert stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=60).backend == "cuda-cute"
            sessions = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=60).session_id for _ in range(3)]
            for step in range(8):
                for layer in range(3):  # bf16 on the wire (memcpy staging) and f32 (casting copy)
                    x = random_inputs(3, step % 4 + 1, 16, 32, gen=gen, dtype=(torch.bfloat16, torch.float32)[step % 2])
                    reply = stub.Decode(decode_request(layer, sessions, x), timeout=120)
                    assert rel_err(tensor_from_proto(reply.o), ref.step(layer, sessions, **x)) < 1e-2


@pytest.mark.parametrize("mapped_rows", [None, 0, 4], ids=["default", "copies", "mapped-up-to-4"])
def test_small_launches_replay_graphs_bit_identical_to_direct_launches(mapped_rows, monkeypatch):
    """After warm-up, in-place T=1 launches of up to GRAPH_MAX_ROWS rows replay a captured graph
    (per staging set), and bigger ones up to the largest bucket are padded to a bucket's graph;
    the outputs and the state pool are bit-identical to a backend that launches directly, over
    enough launches to go round the staging ring twice. The graphs of up to MAPPED_MAX_ROWS rows
    run the kernel alone on the pinned buffers: as built (one row), none (every graph copies), or
    up to 4 rows (one backend mixing mapped and copying graphs over more row counts)."""
    from gdn_server.backends import cuda

    if mapped_rows is not None:
        monkeypatch.setattr(cuda, "MAPPED_MAX_ROWS", mapped_rows)
    mapped = cuda.MAPPED_MAX_ROWS > 0
    shape = ModelShape(num_layers=3, num_q_heads=16, num_v_heads=32)
    gates = random_gate_params(shape, seed=3)
    sessions = 48
    # rows_hint 40: buckets up to 32 are captured, 33..40 launch directly
    graphed = CudaBackend(shape, gates, max_sessions=sessions, speculative_sessions=0, rows_hint=40)
    graphed.warmup()
    assert all(st.graphs for st in graphed._ring), "warm-up captured no graphs"
    assert graphed._bucket_max == 32
    # the mapped buffers were made (not given up on with a logged fallback to the copies)
    assert all((st._mapped is not None) == mapped for st in graphed._ring)
    direct = CudaBackend(shape, gates, max_sessions=sessions, speculative_sessions=0)  # no warm-up: no graphs
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    used_graph = padded = 0
    for launch in range(3 * cuda.RING):
        # exact graphs, padded ones (9..32 rows) and direct launches (33+)
        R = rng.choice([*range(1, cuda.GRAPH_MAX_ROWS + 1), 9, 12, 13, 17, 27, 32, 33, 40])
        members = rng.sample(range(sessions), R)
        layer = rng.randrange(shape.num_layers)
        x = random_inputs(R, 1, shape.num_q_heads, shape.num_v_heads, gen=gen, dtype=torch.bfloat16)
        raw = tuple(x[n].contiguous().view(torch.int16).numpy().tobytes() for n in "qkvab")
        outs = []
        for backend in (graphed, direct):
            batch = StepBatch(1)
            batch.add(DecodeWork(layer, tuple(map(str, members)), positions=None, bf16_bytes=raw, **x),
                      [m * shape.num_layers + layer for m in members])
            pending = backend.submit(batch)
            for _ in range(1_000_000):  # the loop's poll, until the launch is done (a few us at most)
                if pending.ready():
                    break
            assert pending.ready()
            outs.append(pending.result().clone())
            # what the scheduler answers from: the batch's rows only, padded launch or not
            assert bytes(pending.result_bytes()) == outs[-1].view(torch.int16).numpy().tobytes()
        used_graph += R <= 32
        padded += cuda.GRAPH_MAX_ROWS < R <= 32 and cuda.padded_rows(R) > R
        assert outs[0].shape[0] == R
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"launch {launch}, R={R}"
    assert used_graph >= cuda.RING and padded >= 2
    assert torch.equal(graphed.state_pool.view(torch.int16), direct.state_pool.view(torch.int16))
    assert graphed.state_pool.abs().sum() > 0


def test_unchecked_inputs_are_checked_in_staging_before_anything_runs():
    """Requests validation left unchecked (big bf16 ones): the backend finds the NaN/Inf in their
    copies in its pinned staging, names each culprit and input, and the state pool is untouched;
    without a culprit the same batch runs and agrees with the CPU backend. A one-row launch (its
    graph maps the staging), a small one (a graph with copies) and a big one (padded to a bucket)."""
    from gdn_server.backends.base import NonFiniteInputs

    shape = ModelShape(num_layers=2, num_q_heads=16, num_v_heads=32)
    gates = random_gate_params(shape, seed=3)
    gpu = CudaBackend(shape, gates, max_sessions=16)
    cpu = CpuBackend(shape, gates, max_sessions=16)
    gpu.warmup()
    gen = torch.Generator().manual_seed(4)
    for rows_each in ((1,), (1, 2, 3), (40, 1, 60)):
        inputs = [random_inputs(n, 1, 16, 32, gen=gen, dtype=torch.bfloat16) for n in rows_each]

        def batch_of(culprits: dict[int, str]) -> StepBatch:
            batch, first = StepBatch(1), 0
            for r, x in enumerate(inputs):
                x = {k: v.clone() for k, v in x.items()}
                if r in culprits:
                    x[culprits[r]].view(-1)[-1] = float("nan") if r else float("-inf")
                raw = tuple(x[n].view(torch.int16).numpy().tobytes() for n in "qkvab")
                ids = tuple(f"r{r}s{i}" for i in range(len(x["q"])))
                work = DecodeWork(1, ids, bf16_bytes=raw, input_dims=tuple(tuple(x[n].shape) for n in "qkvab"),
                                  finite_checked=False)
                batch.add(work, [(first + i) % 16 * 2 + 1 for i in range(len(ids))])
                first += len(ids)
            return batch

        culprits = {r: name for r, name in {0: "k", 2: "b"}.items() if r < len(rows_each)}
        before = gpu.state_pool.clone()
        try:
            gpu.submit(batch_of(culprits))
        except NonFiniteInputs as e:
            assert {i: str(err) for i, err in e.errors.items()} == {
                r: f"{name} has NaN or Inf values" for r, name in culprits.items()}
        else:
            raise AssertionError(f"NaN/Inf in {culprits} went unnoticed")
        gpu.synchronize()
        assert torch.equal(gpu.state_pool, before)
        if sum(rows_each) <= 16:  # distinct slots: the batch can run as it is
            pending = gpu.submit(batch_of({}))
            out = pending.result().clone()
            # the bytes the scheduler answers from: the same output, through the view made once
            assert bytes(pending.result_bytes()) == out.view(torch.uint8).reshape(-1).numpy().tobytes()
            ref = cpu.submit(batch_of({})).result()
            assert rel_err(out, ref.float()) < 1e-2
