"""End-to-end decode semantics against real server processes (CPU backend).

Numerics against the fp64 reference, batching across concurrent clients, every error code of
docs/protocol.md leaving all states unchanged, idempotent retries, capacity.
"""
from __future__ import annotations

import random
import threading

import grpc
import pytest
import torch

from servers import start_server
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from reference import ReferenceModel, rel_err
from util import decode_request, random_inputs, write_gates

LAYERS = 3
TIMEOUT = 30  # seconds per RPC: nothing in these tests may hang


def _stub(address: str) -> tuple[grpc.Channel, gdn_pb2_grpc.GdnDecodeStub]:
    channel = grpc.insecure_channel(address)
    return channel, gdn_pb2_grpc.GdnDecodeStub(channel)


def _create(stub, n: int) -> list[str]:
    return [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=TIMEOUT).session_id for _ in range(n)]


def _decode(stub, layer, sessions, inputs, positions=None):
    reply = stub.Decode(decode_request(layer, sessions, inputs, positions), timeout=TIMEOUT)
    return tensor_from_proto(reply.o).clone(), list(reply.positions)


@pytest.fixture(scope="module")
def gates(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "gates.safetensors"
    A_log, dt_bias = write_gates(path, LAYERS, v_heads=4, seed=3)
    return path, A_log, dt_bias


@pytest.fixture(scope="module")
def server(gates):
    """The CPU server (its scheduler on a thread of its own). A queue delay makes concurrent
    clients' steps meet in one launch (and tests that they do)."""
    with start_server("--layers", str(LAYERS), "--q-heads", "2", "--v-heads", "4", "--weights", str(gates[0]),
                      "--max-sessions", "40", "--max-queue-delay-us", "3000") as srv:
        yield srv


@pytest.mark.parametrize("q_heads", [4, 2, 1], ids=["gqa1", "gqa2", "gqa4"])
def test_numerics_match_reference_over_many_steps(tmp_path, q_heads):
    """16 steps per session, T cycling 1..4, three layers, bf16/f16/f32 inputs, 3 sessions per request."""
    A_log, dt_bias = write_gates(tmp_path / "g.safetensors", LAYERS, v_heads=4, seed=11)
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(q_heads)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    with start_server("--layers", str(LAYERS), "--q-heads", str(q_heads), "--v-heads", "4",
                      "--weights", str(tmp_path / "g.safetensors")) as srv:
        channel, stub = _stub(srv.address)
        sessions = _create(stub, 3)
        worst = 0.0
        for step in range(16):
            T = step % 4 + 1
            for layer in range(LAYERS):
                inputs = random_inputs(3, T, q_heads, 4, gen=gen, dtype=dtypes[step % 3])
                out, positions = _decode(stub, layer, sessions, inputs)
                expected = ref.step(layer, sessions, **inputs)
                assert out.dtype == torch.bfloat16 and out.shape == (3, T, 4, 128)
                assert positions == [sum(s % 4 + 1 for s in range(step + 1))] * 3
                worst = max(worst, rel_err(out, expected))
        channel.close()
    # bf16 output rounding alone is ~2e-3; drift from bf16 state rounding must stay at that level
    assert worst < 5e-3, worst


def test_concurrent_clients_get_exactly_their_solo_outputs(server):
    """32 clients with their own sessions, steps interleaved and batched by the server, give
    bit-for-bit the outputs of running each session alone on a fresh server."""
    n_clients, n_steps = 32, 8
    plans = []
    for c in range(n_clients):
        rng = random.Random(c)
        gen = torch.Generator().manual_seed(1000 + c)
        plans.append([(rng.randrange(LAYERS), random_inputs(1, rng.randint(1, 4), 2, 4, gen=gen)) for _ in range(n_steps)])
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_clients)

    def client(c: int) -> None:
        try:
            channel, stub = _stub(server.address)
            (sid,) = _create(stub, 1)
            barrier.wait(timeout=TIMEOUT)
            results[c] = [_decode(stub, layer, [sid], inputs)[0] for layer, inputs in plans[c]]
            stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=TIMEOUT)
            channel.close()
        except BaseException as e:  # surfaced below
            errors.append(e)

    before = _stats(server.address)
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    after = _stats(server.address)
    launches = after.launches - before.launches
    rows = after.rows_launched - before.rows_launched
    assert rows == n_clients * n_steps
    assert launches < rows, "concurrent requests were never batched together"

    with start_server("--layers", str(LAYERS), "--q-heads", "2", "--v-heads", "4",
                      "--weights", _weights_flag(server)) as solo:
        channel, stub = _stub(solo.address)
        for c in range(n_clients):
            (sid,) = _create(stub, 1)
            for i, (layer, inputs) in enumerate(plans[c]):
                out, _ = _decode(stub, layer, [sid], inputs)
                assert torch.equal(out, results[c][i]), f"client {c} step {i} differs from its solo run"
        channel.close()


def _stats(address: str) -> gdn_pb2.Stats:
    channel, stub = _stub(address)
    try:
        return stub.GetStats(gdn_pb2.GetStatsRequest(), timeout=TIMEOUT)
    finally:
        channel.close()


def _weights_flag(srv) -> str:
    args = srv.proc.args
    return args[args.index("--weights") + 1]


def _expect_code(code: grpc.StatusCode, fn, *args, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def test_every_error_code_leaves_states_unchanged(server, gates):
    _, A_log, dt_bias = gates
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(5)
    channel, stub = _stub(server.address)
    s1, s2, doomed = _create(stub, 3)
    good = random_inputs(2, 2, 2, 4, gen=gen)
    out, _ = _decode(stub, 1, [s1, s2], good)
    ref.step(1, [s1, s2], **good)
    stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=doomed), timeout=TIMEOUT)

    base = decode_request(1, [s1, s2], random_inputs(2, 1, 2, 4, gen=gen))
    bad: list[tuple[grpc.StatusCode, gdn_pb2.DecodeRequest, str]] = []

    def variant(code, why, mutate):
        req = gdn_pb2.DecodeRequest()
        req.CopyFrom(base)
        mutate(req)
        bad.append((code, req, why))

    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    variant(INVALID, "shape", lambda r: (r.q.shape.__setitem__(2, 1), r.q.shape.__setitem__(3, 256)))
    variant(INVALID, "dtype", lambda r: setattr(r.k, "dtype", gdn_pb2.DTYPE_UNSPECIFIED))
    variant(INVALID, "byte length", lambda r: setattr(r.v, "data", r.v.data[:-2]))
    variant(INVALID, "layer", lambda r: setattr(r, "layer", LAYERS))
    nan = random_inputs(2, 1, 2, 4, gen=gen)
    nan["a"][1, 0, 2] = float("nan")
    variant(INVALID, "nan", lambda r: r.CopyFrom(decode_request(1, [s1, s2], nan)))
    inf = random_inputs(2, 1, 2, 4, gen=gen, dtype=torch.bfloat16)
    inf["q"][0, 0, 1, 7] = float("inf")
    variant(INVALID, "inf", lambda r: r.CopyFrom(decode_request(1, [s1, s2], inf)))
    variant(INVALID, "duplicate ids", lambda r: r.session_ids.__setitem__(1, s1))
    variant(INVALID, "T=5", lambda r: r.CopyFrom(decode_request(1, [s1, s2], random_inputs(2, 5, 2, 4, gen=gen))))
    variant(INVALID, "T=0", lambda r: r.CopyFrom(decode_request(1, [s1, s2], random_inputs(2, 0, 2, 4, gen=gen))))
    variant(INVALID, "missing tensor", lambda r: r.ClearField("b"))
    variant(INVALID, "positions count", lambda r: r.positions.extend([2]))
    variant(grpc.StatusCode.NOT_FOUND, "unknown", lambda r: r.session_ids.__setitem__(1, "no-such-session"))
    variant(grpc.StatusCode.NOT_FOUND, "closed", lambda r: r.session_ids.__setitem__(0, doomed))
    variant(grpc.StatusCode.FAILED_PRECONDITION, "positions ahead", lambda r: r.positions.extend([2, 3]))
    variant(grpc.StatusCode.FAILED_PRECONDITION, "positions behind", lambda r: r.positions.extend([1, 2]))

    for code, req, why in bad:
        details = _expect_code(code, stub.Decode, req, timeout=TIMEOUT)
        assert details, why

    # the same requests on one stream: each gets an error reply, and the stream goes on
    ok_inputs = random_inputs(2, 1, 2, 4, gen=gen)
    stream_reqs = [req for _, req, _ in bad] + [decode_request(1, [s1, s2], ok_inputs, positions=[2, 2], request_id="ok")]
    replies = list(stub.DecodeStream(iter(stream_reqs), timeout=TIMEOUT))
    assert [r.error_code for r in replies[:-1]] == [code.value[0] for code, _, _ in bad]
    assert all(r.error_message for r in replies[:-1])
    assert replies[-1].error_code == 0 and replies[-1].request_id == "ok"
    assert list(replies[-1].positions) == [3, 3]
    expected = ref.step(1, [s1, s2], **ok_inputs)
    assert rel_err(tensor_from_proto(replies[-1].o), expected) < 5e-3

    # nothing above touched the states: a further step still matches the reference
    more = random_inputs(2, 3, 2, 4, gen=gen)
    out, positions = _decode(stub, 1, [s1, s2], more, positions=[3, 3])
    assert positions == [6, 6]
    assert rel_err(out, ref.step(1, [s1, s2], **more)) < 5e-3
    channel.close()


def test_retry_with_positions_answers_again_without_applying_twice(server, gates):
    _, A_log, dt_bias = gates
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(9)
    channel, stub = _stub(server.address)
    s1, s2 = _create(stub, 2)
    first = random_inputs(2, 3, 2, 4, gen=gen)
    out1, pos1 = _decode(stub, 2, [s1, s2], first, positions=[0, 0])
    out2, pos2 = _decode(stub, 2, [s1, s2], first, positions=[0, 0])  # the reply was "lost": retry
    assert pos1 == pos2 == [3, 3]
    assert torch.equal(out1, out2)
    ref.step(2, [s1, s2], **first)
    # a retry of a single session of that request works too, from its own row
    out_one, _ = _decode(stub, 2, [s2], {k: v[1:] for k, v in first.items()}, positions=[0])
    assert torch.equal(out_one[0], out1[1])
    # a retry with another T is not a retry
    _expect_code(grpc.StatusCode.FAILED_PRECONDITION, _decode, stub, 2, [s1], random_inputs(1, 2, 2, 4, gen=gen), [0])
    nxt = random_inputs(2, 1, 2, 4, gen=gen)
    out3, pos3 = _decode(stub, 2, [s1, s2], nxt, positions=[3, 3])
    assert pos3 == [4, 4]
    assert rel_err(out3, ref.step(2, [s1, s2], **nxt)) < 5e-3  # applied exactly once before
    channel.close()


def test_requests_of_one_session_keep_their_order_on_a_stream(server, gates):
    _, A_log, dt_bias = gates
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(21)
    channel, stub = _stub(server.address)
    (sid,) = _create(stub, 1)
    steps = [(i % LAYERS, random_inputs(1, 1 + i % 4, 2, 4, gen=gen)) for i in range(24)]
    replies = list(stub.DecodeStream(iter(decode_request(l, [sid], x, request_id=str(i)) for i, (l, x) in enumerate(steps)),
                                     timeout=TIMEOUT))
    assert [r.request_id for r in replies] == [str(i) for i in range(len(steps))]
    for (layer, inputs), reply in zip(steps, replies):
        assert reply.error_code == 0, reply.error_message
        assert rel_err(tensor_from_proto(reply.o), ref.step(layer, [sid], **inputs)) < 5e-3
    channel.close()


def test_full_pool_is_resource_exhausted_and_close_frees_the_slot():
    with start_server("--layers", "1", "--q-heads", "1", "--v-heads", "2", "--max-sessions", "2") as srv:
        channel, stub = _stub(srv.address)
        a, b = _create(stub, 2)
        info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
        assert (info.max_sessions, info.sessions_in_use, info.backend) == (2, 2, "cpu-torch")
        _expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.CreateSession, gdn_pb2.CreateSessionRequest(), timeout=TIMEOUT)
        gen = torch.Generator().manual_seed(1)
        first, _ = _decode(stub, 0, [a], random_inputs(1, 2, 1, 2, gen=gen))
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=a), timeout=TIMEOUT)
        _expect_code(grpc.StatusCode.NOT_FOUND, stub.CloseSession, gdn_pb2.CloseSessionRequest(session_id=a), timeout=TIMEOUT)
        (c,) = _create(stub, 1)
        assert c not in (a, b)
        # the reused slot starts from a zero state: same inputs as a's first step give a's output
        gen = torch.Generator().manual_seed(1)
        again, positions = _decode(stub, 0, [c], random_inputs(1, 2, 1, 2, gen=gen))
        assert torch.equal(first, again) and positions == [2]
        channel.close()


def test_model_info_describes_the_model(server):
    channel, stub = _stub(server.address)
    info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert (info.num_layers, info.num_q_heads, info.num_v_heads, info.head_dim_k, info.head_dim_v) == (LAYERS, 2, 4, 128, 128)
    assert info.max_tokens_per_step == 4 and info.state_dtype == "bfloat16"
    channel.close()


def test_pipelined_steps_of_one_layer_report_their_own_positions_and_retries(server, gates):
    """Steps of one session at one layer, streamed without waiting for replies (several are in
    flight at once, in separate launches): each reply carries the count after its own step, not
    after a later one, and a retry of the last step answers that step's outputs."""
    _, A_log, dt_bias = gates
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(33)
    channel, stub = _stub(server.address)
    (sid,) = _create(stub, 1)
    steps = [random_inputs(1, 1, 2, 4, gen=gen) for _ in range(32)]
    requests = [decode_request(1, [sid], x, positions=[i], request_id=str(i)) for i, x in enumerate(steps)]
    replies = list(stub.DecodeStream(iter(requests), timeout=TIMEOUT))
    assert [r.error_message for r in replies] == [""] * len(steps)
    assert [list(r.positions) for r in replies] == [[i + 1] for i in range(len(steps))]
    outs = [tensor_from_proto(r.o).clone() for r in replies]
    for x, out in zip(steps, outs):
        assert rel_err(out, ref.step(1, [sid], **x)) < 5e-3
    again, positions = _decode(stub, 1, [sid], steps[-1], positions=[len(steps) - 1])
    assert positions == [len(steps)]
    assert torch.equal(again, outs[-1])
    channel.close()
