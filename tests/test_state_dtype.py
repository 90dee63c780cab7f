"""`--state-dtype float32`: a pool of fp32 states, end to end on real CPU servers.

Every path that holds or moves a state: steps (bit-for-bit the CPU backend's, and far closer to
float64 than a bf16 state), ModelInfo, export and import (refused across dtypes unless the header
asks for the conversion), fork, speculative steps and Commit, snapshots across a restart (and
across a change of --state-dtype), the capacity arithmetic and the kernel's argument rules.
"""
from __future__ import annotations

import dataclasses
import hashlib
import shutil

import grpc
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.backends import default_cpu_sessions
from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape
from reference import gdn_reference_step, rel_err
from servers import start_server
from test_sessions import (
    MODEL, RPC_TIMEOUT, SHAPE, Conn, Cursor, Replay, make_gates, request, rpc_code, script_step, write_weights,
)
from util import cli_refusal, decode_request, random_inputs

SHAPE32 = dataclasses.replace(SHAPE, state_dtype="float32")
L, H, HV, K = SHAPE.num_layers, SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k


@pytest.fixture(scope="module")
def gates():
    return make_gates(SHAPE, seed=11)


@pytest.fixture(scope="module")
def weights(tmp_path_factory, gates) -> str:
    return write_weights(tmp_path_factory.mktemp("dtype") / "gates.safetensors", gates)


@pytest.fixture(scope="module")
def pair(weights):
    """A bf16 server (the default) and an fp32 one of the same model."""
    flags = (*MODEL, "--weights", weights, "--max-sessions", "12")
    with start_server(*flags) as bf16, start_server(*flags, "--state-dtype", "float32") as fp32:
        a, b = Conn(bf16.address), Conn(fp32.address)
        a.address, b.address = bf16.address, fp32.address  # for gdn_client's own tests
        yield a, b
        a.close()
        b.close()


def export(conn: Conn, sid: str) -> list[gdn_pb2.StateChunk]:
    return list(conn.stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sid), timeout=RPC_TIMEOUT))


def exported_state(chunks: list[gdn_pb2.StateChunk]) -> torch.Tensor:
    dtype = getattr(torch, chunks[0].header.dtype)
    data = bytearray(b"".join(c.data for c in chunks[1:]))
    return torch.frombuffer(data, dtype=dtype).reshape(L, HV, K, K)


def converting(chunks: list[gdn_pb2.StateChunk]) -> list[gdn_pb2.StateChunk]:
    """The same stream with the header's convert_dtype set."""
    out = [gdn_pb2.StateChunk.FromString(c.SerializeToString()) for c in chunks]
    out[0].header.convert_dtype = True
    return out


def close(conn: Conn, *sids: str) -> None:
    for sid in sids:
        conn.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)


def exact_states(gates, seed: int, steps: range) -> torch.Tensor:
    """The float64 states [L, HV, V, K] after `steps` of a script, never rounded."""
    state = torch.zeros(L, HV, K, K, dtype=torch.float64)
    for n in steps:
        step = script_step(SHAPE, seed, n)
        x, l = step.inputs, step.layer
        _, s = gdn_reference_step(state[l : l + 1], x["q"], x["k"], x["v"], x["a"], x["b"],
                                  gates.A_log[l : l + 1], gates.dt_bias[l : l + 1])
        state[l] = s[0]
    return state


def test_model_info_names_the_state_dtype(pair):
    a, b = pair
    info = lambda conn: conn.stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT)  # noqa: E731
    assert info(a).state_dtype == "bfloat16"
    assert info(b).state_dtype == "float32"
    assert info(b).max_sessions == info(a).max_sessions == 12


def test_fp32_steps_are_the_cpu_backends_and_far_closer_to_exact(pair, gates):
    a, b = pair
    steps = range(30)
    runs = {}
    for conn in (a, b):
        cur = Cursor(conn.create())
        runs[conn] = (cur, cur.run(conn, SHAPE, 1, steps))
    cur32, outs32 = runs[b]
    assert outs32 == Replay(SHAPE32, gates).run(1, steps)  # bit for bit
    assert runs[a][1] == Replay(SHAPE, gates).run(1, steps)
    assert outs32 != runs[a][1]  # the fp32 server did keep more than the bf16 one

    chunks = export(b, cur32.sid)
    header = chunks[0].header
    assert header.dtype == "float32" and not header.convert_dtype
    assert header.total_bytes == 4 * L * HV * K * K == SHAPE32.state_bytes_per_session == 2 * SHAPE.state_bytes_per_session
    exact = exact_states(gates, 1, steps)
    err32 = rel_err(exported_state(chunks), exact)
    err16 = rel_err(exported_state(export(a, runs[a][0].sid)), exact)
    assert err32 < 1e-5, err32
    assert err32 * 100 < err16, (err32, err16)
    close(a, runs[a][0].sid)
    close(b, cur32.sid)


def test_fp32_export_imports_into_fp32_and_continues_bitwise(pair, gates):
    _, b = pair
    src = Cursor(b.create())
    src.run(b, SHAPE, 2, range(6))
    moved = Cursor(b.stub.ImportState(iter(export(b, src.sid)), timeout=RPC_TIMEOUT).session_id, list(src.positions))
    expected = Replay(SHAPE32, gates).run(2, range(12))[6:]
    assert moved.run(b, SHAPE, 2, range(6, 12)) == expected
    assert src.run(b, SHAPE, 2, range(6, 12)) == expected
    close(b, src.sid, moved.sid)


def test_import_across_dtypes_is_refused_unless_converted_on_purpose(pair, gates):
    a, b = pair
    s16, s32 = Cursor(a.create()), Cursor(b.create())
    s16.run(a, SHAPE, 3, range(5))
    s32.run(b, SHAPE, 3, range(5))
    from16, from32 = export(a, s16.sid), export(b, s32.sid)
    for conn, chunks, theirs, ours in ((a, from32, "float32", "bfloat16"), (b, from16, "bfloat16", "float32")):
        in_use = conn.in_use()
        code, details = rpc_code(lambda: conn.stub.ImportState(iter(chunks), timeout=RPC_TIMEOUT))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert theirs in details and ours in details and "convert_dtype" in details, details
        assert conn.in_use() == in_use  # nothing was created

    # converted on purpose: fp32 -> bf16 rounds to nearest even, bf16 -> fp32 is exact
    narrowed = a.stub.ImportState(iter(converting(from32)), timeout=RPC_TIMEOUT).session_id
    widened = b.stub.ImportState(iter(converting(from16)), timeout=RPC_TIMEOUT).session_id
    got16, got32 = export(a, narrowed), export(b, widened)
    assert got16[0].header.dtype == "bfloat16" and not got16[0].header.convert_dtype
    assert list(got16[0].header.positions) == s32.positions
    assert torch.equal(exported_state(got16), exported_state(from32).to(torch.bfloat16))
    assert torch.equal(exported_state(got32), exported_state(from16).float())
    # and the imported sessions step on from there as their server's backend does
    step = script_step(SHAPE, 3, 5)
    for conn, sid, shape, state in ((a, narrowed, SHAPE, exported_state(got16)), (b, widened, SHAPE32, exported_state(got32))):
        reply = conn.stub.Decode(request(sid, step, s16.positions[step.layer]), timeout=RPC_TIMEOUT)
        replay = Replay(shape, gates)
        replay.backend.write_session(0, state)
        assert [reply.o.data] == replay.run(3, range(5, 6))
    close(a, s16.sid, narrowed)
    close(b, s32.sid, widened)


@pytest.mark.parametrize("how", ["bytes of the other dtype", "unknown dtype", "a value beyond bf16"])
def test_bad_dtype_headers_are_refused(pair, how):
    a, b = pair
    sid = b.create()
    Cursor(sid).run(b, SHAPE, 4, range(3))
    chunks = [gdn_pb2.StateChunk.FromString(c.SerializeToString()) for c in export(b, sid)]
    target = b
    if how == "bytes of the other dtype":  # fp32 bytes announced as bf16 ones
        chunks[0].header.dtype = "bfloat16"
        chunks[0].header.convert_dtype = True
    elif how == "unknown dtype":
        chunks[0].header.dtype = "float16"
        chunks[0].header.convert_dtype = True
    else:  # finite in fp32, Inf once rounded to bf16
        state = exported_state(chunks).clone()
        state[0, 0, 0, 0] = 3.4e38
        data = state.view(torch.uint8).numpy().tobytes()
        chunks = [chunks[0], gdn_pb2.StateChunk(data=data[: 1 << 20]), gdn_pb2.StateChunk(data=data[1 << 20 :])]
        chunks[0].header.checksum = hashlib.sha256(data).hexdigest()
        chunks[0].header.convert_dtype = True
        close(b, b.stub.ImportState(iter(chunks), timeout=RPC_TIMEOUT).session_id)  # fine as fp32 in fp32
        target = a
    in_use = target.in_use()
    code, details = rpc_code(lambda: target.stub.ImportState(iter(chunks), timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert target.in_use() == in_use
    close(b, sid)


def test_fork_and_speculative_steps_keep_fp32_states(pair, gates):
    _, b = pair
    parent = Cursor(b.create())
    prefix = parent.run(b, SHAPE, 5, range(4))
    child = Cursor(b.stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=parent.sid),
                                      timeout=RPC_TIMEOUT).session_id, list(parent.positions))
    assert export(b, child.sid)[1:] == export(b, parent.sid)[1:]
    replay = Replay(SHAPE32, gates)
    assert replay.run(5, range(4)) == prefix
    branch = replay.fork()
    assert parent.run(b, SHAPE, 5, range(4, 8)) == replay.run(5, range(4, 8))
    assert child.run(b, SHAPE, 6, range(4, 8)) == branch.run(6, range(4, 8))

    # a draft of 3 tokens committed to 2 leaves the state of a plain step of the first 2 (the export
    # folds its ring into the fp32 state: the same to fp32 rounding)
    gen = torch.Generator().manual_seed(9)
    drafter, twin = b.create(), b.create()
    x = random_inputs(1, 3, H, HV, K, gen=gen)
    for layer in range(L):
        req = decode_request(layer, [drafter], x)
        req.speculative = True
        b.stub.Decode(req, timeout=RPC_TIMEOUT)
        b.stub.Decode(decode_request(layer, [twin], {k: v[:, :2] for k, v in x.items()}), timeout=RPC_TIMEOUT)
    reply = b.stub.Commit(gdn_pb2.CommitRequest(session_id=drafter, accepted=2), timeout=RPC_TIMEOUT)
    assert list(reply.positions) == [2] * L
    drafted, plain = export(b, drafter), export(b, twin)
    assert drafted[0].header.positions == plain[0].header.positions
    assert rel_err(exported_state(drafted), exported_state(plain)) < 1e-5
    close(b, parent.sid, child.sid, drafter, twin)


def test_snapshots_keep_fp32_states_and_convert_across_a_dtype_change(tmp_path, weights, gates):
    state_dir = tmp_path / "state"
    flags = (*MODEL, "--weights", weights, "--state-dir", str(state_dir))
    with start_server(*flags, "--state-dtype", "float32") as first:
        conn = Conn(first.address)
        cur = Cursor(conn.create())
        cur.run(conn, SHAPE, 7, range(5))
        saved = exported_state(export(conn, cur.sid)).clone()
        conn.close()
        assert first.stop() == 0
    kept = tmp_path / "kept"
    shutil.copytree(state_dir, kept)
    with start_server(*flags, "--state-dtype", "float32") as second:
        conn = Conn(second.address)
        assert "restored 1 session(s)" in "".join(second.log)
        assert cur.run(conn, SHAPE, 7, range(5, 9)) == Replay(SHAPE32, gates).run(7, range(9))[5:]
        conn.close()
        assert "converted" not in "".join(second.log)
    # the same snapshot into a bf16 server: restored rounded, and the log says so
    shutil.rmtree(state_dir)
    shutil.copytree(kept, state_dir)
    with start_server(*flags) as third:
        conn = Conn(third.address)
        log = "".join(third.log)
        assert "restored 1 session(s)" in log and "WARNING" in log and "converted to bfloat16" in log, log
        chunks = export(conn, cur.sid)
        assert chunks[0].header.dtype == "bfloat16"
        assert torch.equal(exported_state(chunks), saved.to(torch.bfloat16))
        conn.close()


def test_capacity_counts_four_bytes_an_element():
    shape = ModelShape(num_layers=2, num_q_heads=2, num_v_heads=4)
    wide = dataclasses.replace(shape, state_dtype="float32")
    assert wide.state_bytes_per_session == 2 * shape.state_bytes_per_session == 4 * 2 * 4 * 128 * 128
    gates = make_gates(shape, seed=1)
    b16, b32 = CpuBackend(shape, gates, 6), CpuBackend(wide, gates, 6)
    assert b32.pool_dtype == torch.float32 and b16.pool_dtype == torch.bfloat16
    assert b32.pool_bytes - b16.pool_bytes == 6 * shape.state_bytes_per_session  # the rings are the same
    assert b32.read_session(0).dtype == torch.float32
    with pytest.raises(ValueError, match="bfloat16"):
        b32.write_session(0, torch.zeros(2, 4, 128, 128, dtype=torch.bfloat16))
    qwen = ModelShape(36, 16, 32)
    host = 16 << 30
    # twice the state and the same ring per row: 95 sessions where bf16 states offer 165
    wide_sessions = default_cpu_sessions(dataclasses.replace(qwen, state_dtype="float32"), memory_bytes=host)
    assert default_cpu_sessions(qwen, memory_bytes=host) // 2 < wide_sessions < default_cpu_sessions(qwen, memory_bytes=host)
    with pytest.raises(ValueError, match="state dtype"):
        ModelShape(2, 2, 4, state_dtype="float16")


def test_the_command_line_takes_only_the_two_dtypes():
    assert "invalid choice" in cli_refusal("--state-dtype", "float16")


def test_kernel_arguments_take_either_state_dtype():
    from gdn_server.kernels import check_variant, validate_decode_args

    def args(state_dtype):
        bf = torch.bfloat16
        B, T = 3, 2
        return dict(
            state=torch.zeros(5, 32, 128, 128, dtype=state_dtype), slots=torch.arange(B, dtype=torch.int32),
            layers=torch.zeros(B, dtype=torch.int32), q=torch.zeros(B, T, 16, 128, dtype=bf),
            k=torch.zeros(B, T, 16, 128, dtype=bf), v=torch.zeros(B, T, 32, 128, dtype=bf),
            a=torch.zeros(B, T, 32, dtype=bf), b=torch.zeros(B, T, 32, dtype=bf),
            A_log=torch.zeros(2, 32), dt_bias=torch.zeros(2, 32), out=torch.zeros(B, T, 32, 128, dtype=bf),
        )

    for dtype in (torch.bfloat16, torch.float32):
        validate_decode_args(*args(dtype).values(), require_cuda=False)
    with pytest.raises(ValueError, match="float32"):
        validate_decode_args(*args(torch.float16).values(), require_cuda=False)
    with pytest.raises(ValueError, match="float32"):  # q must stay bf16 whatever the state
        validate_decode_args(*dict(args(torch.float32), q=torch.zeros(3, 2, 16, 128)).values(), require_cuda=False)
    check_variant(1, 16, 32, "float32")
    with pytest.raises(ValueError, match="float16"):
        check_variant(1, 16, 32, "float16")


def test_the_client_reads_fp32_exports_and_asks_for_a_conversion(pair):
    """gdn_client: ExportedState.state() has the export's dtype, and converting() is what lets a
    server of the other dtype import it."""
    from gdn_client import Client, InvalidArgumentError

    a, b = pair
    with Client(a.address) as bf16, Client(b.address) as fp32:
        src = fp32.create_session()
        x = random_inputs(1, 1, H, HV, K)
        src.decode(0, x["q"], x["k"], x["v"], x["a"], x["b"])
        exported = src.export()
        assert exported.state().dtype == torch.float32 and exported.state().abs().sum() > 0
        with pytest.raises(InvalidArgumentError):
            bf16.import_state(exported)
        moved = bf16.import_state(exported.converting())
        assert not exported.header.convert_dtype  # converting() left the original as it was
        assert torch.equal(moved.export().state(), exported.state().to(torch.bfloat16))
        moved.close()
        src.close()
