"""The CUDA backend against the CPU backend and float64, and the server on the GPU end to end, for
both state dtypes.

Plain launches of mixed sessions, layers, T and wire dtypes agree with the CPU backend; the
speculative path (verify batches through the history rings with random accepts, plain steps after
drafts, folds before a session is read) agrees with a float64 model of the committed states and
with the CPU backend's ring on the same batches.
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
from reference import ReferenceModel, gdn_reference_step, rel_err
from util import decode_request, random_inputs


DEV = "cuda"
STATE_DTYPES = ["bfloat16", "float32"]
# against the CPU backend / float64: outputs are bf16 either way; a bf16 state is held to its
# rounding, an fp32 one to fp32 arithmetic
OUT_TOL = 1e-2
# f16 and f32 wire inputs are rounded to bf16 on the GPU (the kernels' input dtype) and used as
# sent on the CPU: with an fp32 state that input rounding (2^-9), not the state's, bounds agreement
STATE_TOL = {"bfloat16": 1e-2, "float32": 4e-3}
RING_STATE_TOL = {"bfloat16": 5e-3, "float32": 2e-3}


def _work(layer: int, members: list[int], x: dict[str, torch.Tensor]) -> DecodeWork:
    raw = None
    if x["q"].dtype == torch.bfloat16:  # as validation hands them on: the bytes a GPU memcpys
        raw = tuple(x[n].contiguous().view(torch.int16).numpy().tobytes() for n in "qkvab")
    return DecodeWork(layer, tuple(map(str, members)), positions=None, bf16_bytes=raw, **x)


def step_batch(T: int, requests, num_layers: int, hist: dict[int, int] | None = None,
               speculative: bool = False) -> StepBatch:
    """A StepBatch of `requests` ((layer, session slots, inputs) each) as the scheduler forms one:
    row = slot * L + layer, each row's committed ring entries from `hist` (0 where absent)."""
    rows, layers, works = [], [], []
    for layer, members, x in requests:
        rows += [m * num_layers + layer for m in members]
        layers += [layer] * len(members)
        works.append(x if isinstance(x, DecodeWork) else _work(layer, members, x))
    hist = hist or {}
    return StepBatch(tokens=T, rows=rows, layers=layers, works=works, hist=[hist.get(r, 0) for r in rows],
                     verify=speculative)


def _requests(rng: random.Random, gen: torch.Generator, shape: ModelShape, sessions: int, T: int, rows: int,
              dtypes=(torch.bfloat16,)):
    """Requests of `rows` distinct sessions in all, each of one layer and 1..5 sessions."""
    free = rng.sample(range(sessions), rows)
    requests = []
    while free:
        B = min(len(free), rng.randint(1, 5))
        members, free = free[:B], free[B:]
        x = random_inputs(B, T, shape.num_q_heads, shape.num_v_heads, gen=gen, dtype=rng.choice(dtypes))
        requests.append((rng.randrange(shape.num_layers), members, x))
    return requests


def _session_states(backend, sessions: int) -> torch.Tensor:
    return torch.stack([backend.read_session(s) for s in range(sessions)]).double()


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_cuda_and_cpu_backends_agree_on_plain_steps(state_dtype):
    """Plain launches of mixed sessions, layers, T and wire dtypes, after warm-up (graphs by bucket
    for T = 1, padding rows included): outputs and states agree with the CPU backend's."""
    shape = ModelShape(num_layers=3, num_q_heads=16, num_v_heads=32, state_dtype=state_dtype)
    gates = random_gate_params(shape, seed=1)
    cpu = CpuBackend(shape, gates, max_sessions=48)
    gpu = CudaBackend(shape, gates, max_sessions=48, rows_hint=64)
    assert gpu.state_pool.dtype == getattr(torch, state_dtype)
    gpu.warmup()
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    worst = 0.0
    for _ in range(20):
        T = rng.choice([1, 1, 1, 2, 3, 4])
        R = rng.choice([1, 3, 8, 13, 40]) if T == 1 else rng.choice([2, 5, 11])
        requests = _requests(rng, gen, shape, 48, T, R, (torch.bfloat16, torch.float16, torch.float32))
        batch = step_batch(T, requests, shape.num_layers)
        outs = [backend.submit(batch).result().clone() for backend in (cpu, gpu)]
        worst = max(worst, rel_err(outs[1], outs[0].float()))
    assert worst < OUT_TOL, worst
    assert rel_err(_session_states(gpu, 48), _session_states(cpu, 48)) < STATE_TOL[state_dtype]
    state = cpu.read_session(5)
    gpu.write_session(7, state)
    assert torch.equal(gpu.read_session(7), state)
    with pytest.raises(ValueError):
        gpu.write_session(7, state.to(torch.float32 if state_dtype == "bfloat16" else torch.bfloat16))


def _reference_tokens(S, x, A_log, dt_bias):
    """float64 outputs [B, T, HV, V] and the states after 0..T tokens, on the GPU."""
    states, outs = [S], []
    for t in range(x["q"].shape[1]):
        o, S = gdn_reference_step(S, *(x[n][:, t:t + 1].to(DEV) for n in "qkvab"), A_log, dt_bias,
                                  dtype=torch.float64)
        outs.append(o.to(DEV))
        states.append(S.to(DEV))
    return torch.cat(outs, 1), states


def _speculative_trace(backends, shape: ModelShape, gates, sessions: int, launches: int, seed: int) -> dict:
    """Drafts (verify batches, T = 1..8, random accepts of 0..T per row), plain steps after drafts
    (folding the rows' rings first) and fold-before-export reads, the ring bookkeeping kept here
    as the session table keeps it, through every backend of `backends` on the same batches;
    checked against a float64 model of every row's committed state, rounded to the pool's dtype
    where the backend writes its state (plain steps and folds). Returns the worst errors."""
    from gdn_server.kernels import folded_base

    L, R_MAX = shape.num_layers, 16
    dtype = getattr(torch, shape.state_dtype)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = gates.A_log.to(DEV).double(), gates.dt_bias.to(DEV).double()
    HV, D = shape.num_v_heads, shape.head_dim_v
    model = {r: torch.zeros(HV, D, D, dtype=torch.float64, device=DEV) for r in range(sessions * L)}
    P = dict.fromkeys(model, 0)
    worst = dict(out=0.0, state=0.0, between=0.0)
    drafts = plain_after_draft = folds_in_verify = 0

    def stored(x):  # what a backend's state write keeps
        return x.to(dtype).double()

    def check_sessions(slots):
        for s in slots:
            rows = [s * L + layer for layer in range(L)]
            for row in rows:
                if P[row]:
                    model[row] = stored(model[row])
            want = torch.stack([model[row] for row in rows])
            for backend in backends:
                backend.fold(rows, [P[row] for row in rows])
                worst["state"] = max(worst["state"], rel_err(backend.read_session(s).to(DEV), want))
            for row in rows:
                P[row] = 0

    for launch in range(launches):
        speculative = rng.random() < 0.65
        T = rng.randint(1, shape.max_speculative_tokens) if speculative else rng.randint(1, shape.max_tokens_per_step)
        R = rng.choice([1, 2, 5, 9, R_MAX])
        requests = _requests(rng, gen, shape, sessions, T, R)
        batch = step_batch(T, requests, L, P, speculative)
        outs = [backend.submit(batch).result().clone() for backend in backends]
        drafts += speculative
        plain_after_draft += not speculative and any(batch.hist)
        for other in outs[1:]:
            worst["between"] = max(worst["between"], rel_err(outs[0], other.float()))
        first = 0
        for layer, members, x in requests:
            rows = [m * L + layer for m in members]
            for row in rows:  # a fold before the step: the verify's where the ring would overflow, a plain step's always
                if P[row] and (not speculative or P[row] + T > R_MAX):
                    model[row] = stored(model[row])
                    folds_in_verify += speculative
            S = torch.stack([model[row] for row in rows])
            o_ref, states = _reference_tokens(S, x, A_log[[layer] * len(rows)], dt_bias[[layer] * len(rows)])
            got = outs[0][first:first + len(rows)]
            worst["out"] = max(worst["out"], rel_err(got.to(DEV).float(), o_ref))
            for i, row in enumerate(rows):
                if speculative:
                    accepted = rng.randint(0, T)
                    P[row] = folded_base(P[row], T) + accepted
                    model[row] = states[accepted][i]
                else:
                    P[row] = 0
                    model[row] = stored(states[T][i])
            first += len(rows)
        if launch % 7 == 6:  # an export (or fork, snapshot) of one session folds it first
            check_sessions([rng.randrange(sessions)])
    check_sessions(range(sessions))
    assert drafts and plain_after_draft and folds_in_verify, (drafts, plain_after_draft, folds_in_verify)
    return worst


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_speculative_steps_match_float64(state_dtype):
    """The CUDA backend's ring path after warm-up (verify graphs by bucket, padding rows
    included): every output, and every state read after a fold, against float64."""
    shape = ModelShape(num_layers=2, num_q_heads=16, num_v_heads=32, state_dtype=state_dtype)
    gates = random_gate_params(shape, seed=7)
    gpu = CudaBackend(shape, gates, max_sessions=24, rows_hint=32)
    gpu.warmup()
    assert any(key[0] == "verify" for st in gpu._ring for key in st.graphs), "no verify graphs captured"
    worst = _speculative_trace([gpu], shape, gates, sessions=24, launches=60, seed=8)
    print(f"speculative {state_dtype}: {worst}")
    assert worst["out"] < 5e-3, worst
    assert worst["state"] < RING_STATE_TOL[state_dtype], worst


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_speculative_steps_agree_with_the_cpu_backend(state_dtype):
    """The same drafts, accepts, plain steps and folds through the CPU backend's ring (torch) and
    the CUDA backend's (kernels, launched directly: no warm-up): the two implementations of one
    bookkeeping agree with each other and with float64."""
    shape = ModelShape(num_layers=2, num_q_heads=16, num_v_heads=32, state_dtype=state_dtype)
    gates = random_gate_params(shape, seed=9)
    backends = [CudaBackend(shape, gates, max_sessions=16), CpuBackend(shape, gates, max_sessions=16)]
    worst = _speculative_trace(backends, shape, gates, sessions=16, launches=30, seed=10)
    print(f"speculative vs cpu {state_dtype}: {worst}")
    assert worst["between"] < OUT_TOL, worst
    assert worst["out"] < 5e-3 and worst["state"] < RING_STATE_TOL[state_dtype], worst


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


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
def test_large_plain_launches_run_through_the_ring_and_match_the_reference(state_dtype):
    """A server runs a launch of RING_MIN_ROWS rows or more (by its state dtype) of plain steps
    as a verify with its entries committed (here rows enough for wide verify CTAs,
    `verify_qk_heads`): over enough steps that every ring fills and folds, with T = 1..4, a fork
    (which folds first) and small launches in between (narrow CTAs; they append where their rings
    have room, else fold and write in place), the outputs follow the float64 reference, and a
    fork steps exactly as its source."""
    from gdn_server.backends.cuda import RING_MIN_ROWS
    from gdn_server.kernels._ring_api import verify_qk_heads

    shape = ModelShape(num_layers=2, num_q_heads=16, num_v_heads=32, state_dtype=state_dtype)
    gates = random_gate_params(shape, seed=11)
    assert CudaBackend(shape, gates, max_sessions=1).ring_min_rows == RING_MIN_ROWS[state_dtype]
    ref = ReferenceModel(gates.A_log, gates.dt_bias)
    gen = torch.Generator().manual_seed(12)
    B = max(RING_MIN_ROWS[state_dtype] + 2, 130)
    assert verify_qk_heads(B, 1, 16, 32) > 1 and verify_qk_heads(3, 1, 16, 32) == 1
    with start_server("--device", "cuda", "--devices", "0", "--layers", "2", "--q-heads", "16", "--v-heads", "32",
                      "--seed", "11", "--max-sessions", str(B + 2), "--state-dtype", state_dtype, timeout=300) as srv:
        # a T = 4 reply of B rows is 4.3 MB, past grpc's default 4 MiB a message
        with grpc.insecure_channel(srv.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
            stub = gdn_pb2_grpc.GdnDecodeStub(channel)
            sessions = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=60).session_id for _ in range(B)]
            worst = 0.0
            for step in range(14):  # 35 tokens a layer: two folds of every ring
                layer = step % 2
                T = (1, 4, 2, 3)[step // 2 % 4]
                group = sessions if step % 5 != 4 else sessions[:3]  # a small launch: fold, then in place
                x = random_inputs(len(group), T, 16, 32, gen=gen)
                reply = stub.Decode(decode_request(layer, group, x), timeout=120)
                worst = max(worst, rel_err(tensor_from_proto(reply.o), ref.step(layer, group, **x)))
            assert worst < OUT_TOL, worst
            fork = stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=sessions[0]), timeout=60).session_id
            pair = [sessions[0], fork]
            for step in range(3):  # B + 1 rows: through the ring
                same, others = random_inputs(1, 2, 16, 32, gen=gen), random_inputs(B - 1, 2, 16, 32, gen=gen)
                x = {name: torch.cat([same[name], same[name], others[name]]) for name in same}
                o = tensor_from_proto(stub.Decode(decode_request(step % 2, pair + sessions[1:], x), timeout=120).o)
                assert torch.equal(o[0], o[1])


@pytest.mark.parametrize("mapped_rows", [None, 0, 4], ids=["default", "copies", "mapped-up-to-4"])
def test_small_launches_replay_graphs_bit_identical_to_direct_launches(mapped_rows, monkeypatch):
    """After warm-up, plain T=1 launches and verifies of every T of up to GRAPH_MAX_ROWS rows replay
    a captured graph (per staging set), and bigger ones up to the largest bucket are padded to a
    bucket's graph; the outputs, the state pool and the rings are bit-identical to a backend that
    launches directly, over enough launches to go round the staging ring twice (with random
    accepts, so that verifies fold and plain steps after drafts fold too). The graphs of up to MAPPED_MAX_ROWS rows
    run the kernel alone on the pinned buffers: as built (one row), none (every graph copies), or
    up to 4 rows (one backend mixing mapped and copying graphs over more row counts)."""
    from gdn_server.backends import cuda
    from gdn_server.kernels import folded_base

    if mapped_rows is not None:
        monkeypatch.setattr(cuda, "MAPPED_MAX_ROWS", mapped_rows)
    mapped = cuda.MAPPED_MAX_ROWS > 0
    shape = ModelShape(num_layers=3, num_q_heads=16, num_v_heads=32)
    gates = random_gate_params(shape, seed=3)
    sessions = 48
    # rows_hint 40: buckets up to 32 are captured, 33..40 launch directly
    graphed = CudaBackend(shape, gates, max_sessions=sessions, rows_hint=40)
    graphed.warmup()
    assert all(st.graphs for st in graphed._ring), "warm-up captured no graphs"
    assert graphed._bucket_max == 32
    # the mapped buffers were made (not given up on with a logged fallback to the copies)
    assert all((st._mapped is not None) == mapped for st in graphed._ring)
    direct = CudaBackend(shape, gates, max_sessions=sessions)  # no warm-up: no graphs
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    used_graph = padded = verifies = 0
    hist: dict[int, int] = {}
    for launch in range(6 * cuda.RING):
        # exact graphs, padded ones (9..32 rows) and direct launches (33+)
        R = rng.choice([*range(1, cuda.GRAPH_MAX_ROWS + 1), 9, 12, 13, 17, 27, 32, 33, 40])
        speculative = launch % 2 == 1
        T = rng.randint(1, shape.max_speculative_tokens) if speculative else 1
        members = rng.sample(range(sessions), R)
        layer = rng.randrange(shape.num_layers)
        x = random_inputs(R, T, shape.num_q_heads, shape.num_v_heads, gen=gen, dtype=torch.bfloat16)
        batch = step_batch(T, [(layer, members, x)], shape.num_layers, hist, speculative)
        outs = []
        for backend in (graphed, direct):
            pending = backend.submit(batch)
            for _ in range(1_000_000):  # the loop's poll, until the launch is done (a few us at most)
                if pending.ready():
                    break
            assert pending.ready()
            outs.append(pending.result().clone())
            # what the scheduler answers from: the batch's rows only, padded launch or not
            assert bytes(pending.result_bytes()) == outs[-1].view(torch.int16).numpy().tobytes()
        used_graph += R <= 32 and (speculative or not any(batch.hist))
        padded += cuda.GRAPH_MAX_ROWS < R <= 32 and cuda.padded_rows(R) > R
        verifies += speculative
        assert outs[0].shape[0] == R
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"launch {launch}, R={R}, T={T}"
        for row, p in zip(batch.rows, batch.hist):
            hist[row] = folded_base(p, T) + rng.randint(0, T) if speculative else 0
    assert used_graph >= cuda.RING and padded >= 2 and verifies >= cuda.RING
    assert torch.equal(graphed.state_pool.view(torch.int16), direct.state_pool.view(torch.int16))
    for ring_g, ring_d in zip(graphed.rings, direct.rings):
        assert torch.equal(ring_g.view(torch.int16) if ring_g.element_size() == 2 else ring_g.view(torch.int32),
                           ring_d.view(torch.int16) if ring_d.element_size() == 2 else ring_d.view(torch.int32))
    assert graphed.state_pool.abs().sum() > 0
