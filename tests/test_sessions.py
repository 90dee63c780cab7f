"""Sessions that survive: fork, export/import between servers, snapshot on SIGTERM and restore,
retries applied once, idle eviction. Real server processes (CPU backend) on loopback.

Outputs are compared bitwise with an in-process `CpuBackend` running the same script one session
at a time (the CPU math gives a row the same bits whatever else is in its batch), and, for fork,
with the fp64 oracle of tests/reference.py.
"""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from gdn_client._sessions_ext import ExportedState
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_to_proto
from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape
from gdn_server.weights import GateParams
from gdn_server.work import DecodeWork, StepBatch
from servers import start_server
from reference import gdn_reference_step, rel_err

SHAPE = ModelShape(num_layers=3, num_q_heads=2, num_v_heads=4, head_dim_k=32, head_dim_v=32)
MODEL = ("--layers", "3", "--q-heads", "2", "--v-heads", "4", "--head-dim", "32")
# a state of 5 * 8 * 128 * 128 * 2 bytes = 1.25 MiB: the export stream needs two data chunks
BIG_SHAPE = ModelShape(num_layers=5, num_q_heads=2, num_v_heads=8, head_dim_k=128, head_dim_v=128)
BIG_MODEL = ("--layers", "5", "--q-heads", "2", "--v-heads", "8", "--head-dim", "128")
RPC_TIMEOUT = 10.0
MiB = 1 << 20


# -- helpers ---------------------------------------------------------------------------------------


def make_gates(shape: ModelShape, seed: int) -> GateParams:
    g = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.empty(shape.num_layers, shape.num_v_heads).uniform_(1.0, 16.0, generator=g))
    dt_bias = torch.empty(shape.num_layers, shape.num_v_heads).uniform_(-6.0, -2.0, generator=g)
    return GateParams(A_log.contiguous(), dt_bias.contiguous())


def write_weights(path: Path, gates: GateParams) -> str:
    tensors = {}
    for i in range(gates.num_layers):
        tensors[f"layers.{i}.A_log"] = gates.A_log[i].contiguous()
        tensors[f"layers.{i}.dt_bias"] = gates.dt_bias[i].contiguous()
    save_file(tensors, str(path))
    return str(path)


@dataclass(frozen=True)
class Step:
    layer: int
    tokens: int
    inputs: dict  # q, k [1, T, H, K]; v [1, T, HV, V]; a, b [1, T, HV]; float32


def script_step(shape: ModelShape, seed: int, n: int) -> Step:
    """Step n of a session's deterministic script: layers in turn, T of 1..3."""
    layer = n % shape.num_layers
    tokens = 1 + (n // shape.num_layers + seed) % 3
    g = torch.Generator().manual_seed(seed * 100_003 + n)
    H, HV, K, V = shape.num_q_heads, shape.num_v_heads, shape.head_dim_k, shape.head_dim_v
    inputs = {
        "q": torch.randn(1, tokens, H, K, generator=g),
        "k": torch.randn(1, tokens, H, K, generator=g),
        "v": torch.randn(1, tokens, HV, V, generator=g),
        "a": torch.randn(1, tokens, HV, generator=g),
        "b": torch.randn(1, tokens, HV, generator=g),
    }
    return Step(layer, tokens, inputs)


def request(sid: str, step: Step, position: int | None) -> gdn_pb2.DecodeRequest:
    req = gdn_pb2.DecodeRequest(layer=step.layer, session_ids=[sid])
    for name, t in step.inputs.items():
        tensor_to_proto(t, getattr(req, name))
    if position is not None:
        req.positions[:] = [position]
    return req


class Replay:
    """An uninterrupted in-process run: the bits a server must answer."""

    def __init__(self, shape: ModelShape, gates: GateParams) -> None:
        self.shape = shape
        self.backend = CpuBackend(shape, gates, max_sessions=1)

    def run(self, seed: int, steps: range) -> list[bytes]:
        outs = []
        for n in steps:
            step = script_step(self.shape, seed, n)
            batch = StepBatch(step.tokens)
            work = DecodeWork(step.layer, ("s",), positions=None, **step.inputs)
            batch.add(work, [step.layer], [0])  # session slot 0
            outs.append(self.backend.submit(batch).result().view(torch.int16).numpy().tobytes())
        return outs

    def fork(self) -> "Replay":
        other = Replay.__new__(Replay)
        other.shape = self.shape
        other.backend = CpuBackend(self.shape, GateParams(self.backend.A_log, self.backend.dt_bias), max_sessions=1)
        other.backend.write_session(0, self.backend.read_session(0))
        return other


class Oracle:
    """The fp64 reference of tests/reference.py, with the state rounded to bf16 after each step."""

    def __init__(self, shape: ModelShape, gates: GateParams) -> None:
        self.shape, self.gates = shape, gates
        self.state = torch.zeros(shape.num_layers, shape.num_v_heads, shape.head_dim_v, shape.head_dim_k)

    def step(self, step: Step) -> torch.Tensor:
        l = step.layer
        x = step.inputs
        o, s = gdn_reference_step(
            self.state[l : l + 1], x["q"], x["k"], x["v"], x["a"], x["b"],
            self.gates.A_log[l : l + 1], self.gates.dt_bias[l : l + 1],
        )
        self.state[l] = s[0].to(torch.bfloat16).float()
        return o[0]

    def copy(self) -> "Oracle":
        other = Oracle(self.shape, self.gates)
        other.state = self.state.clone()
        return other


class Conn:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = gdn_pb2_grpc.GdnDecodeStub(self.channel)

    def create(self) -> str:
        return self.stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=RPC_TIMEOUT).session_id

    def in_use(self) -> int:
        return self.stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=RPC_TIMEOUT).sessions_in_use

    def close(self) -> None:
        self.channel.close()


@dataclass
class Cursor:
    """A client's view of one session: its id and next position per layer."""

    sid: str
    positions: list[int] = field(default_factory=lambda: [0] * SHAPE.num_layers)

    def run(self, conn: Conn, shape: ModelShape, seed: int, steps: range) -> list[bytes]:
        outs = []
        for n in steps:
            step = script_step(shape, seed, n)
            reply = conn.stub.Decode(request(self.sid, step, self.positions[step.layer]), timeout=RPC_TIMEOUT)
            self.positions[step.layer] += step.tokens
            assert list(reply.positions) == [self.positions[step.layer]]
            outs.append(reply.o.data)
        return outs


def rpc_code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


@pytest.fixture(scope="module")
def gates() -> GateParams:
    return make_gates(SHAPE, seed=3)


@pytest.fixture(scope="module")
def weights(tmp_path_factory, gates) -> str:
    return write_weights(tmp_path_factory.mktemp("weights") / "gates.safetensors", gates)


# -- fork ------------------------------------------------------------------------------------------


def test_fork_then_diverge(weights, gates):
    with start_server(*MODEL, "--weights", weights, "--max-sessions", "3") as server:
        conn = Conn(server.address)
        parent = Cursor(conn.create())
        prefix = parent.run(conn, SHAPE, 1, range(5))
        child = Cursor(conn.stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=parent.sid),
                                             timeout=RPC_TIMEOUT).session_id)
        assert child.sid != parent.sid
        child.positions = list(parent.positions)  # the fork took the parent's positions
        # the branches diverge: each follows its own script from here
        out_parent = parent.run(conn, SHAPE, 1, range(5, 11))
        out_child = child.run(conn, SHAPE, 2, range(5, 11))

        replay = Replay(SHAPE, gates)
        assert replay.run(1, range(5)) == prefix
        branch = replay.fork()
        assert replay.run(1, range(5, 11)) == out_parent
        assert branch.run(2, range(5, 11)) == out_child

        oracle = Oracle(SHAPE, gates)
        for n in range(5):
            oracle.step(script_step(SHAPE, 1, n))
        oracle_child = oracle.copy()
        for oracle_, seed, outs in ((oracle, 1, out_parent), (oracle_child, 2, out_child)):
            for n, got in zip(range(5, 11), outs):
                step = script_step(SHAPE, seed, n)
                o = torch.frombuffer(bytearray(got), dtype=torch.bfloat16).reshape(1, step.tokens, 4, 32)[0]
                assert rel_err(o, oracle_.step(step)) < 2e-2

        # a fork of nothing, and a fork with no room
        code, _ = rpc_code(lambda: conn.stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id="nope"), timeout=RPC_TIMEOUT))
        assert code == grpc.StatusCode.NOT_FOUND
        conn.create()
        code, _ = rpc_code(lambda: conn.stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=parent.sid), timeout=RPC_TIMEOUT))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert conn.in_use() == 3
        conn.close()


# -- export / import -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_gates() -> GateParams:
    return make_gates(BIG_SHAPE, seed=5)


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory, big_gates):
    """Two replicas of the same model (the export test migrates between them)."""
    path = write_weights(tmp_path_factory.mktemp("big") / "gates.safetensors", big_gates)
    with start_server(*BIG_MODEL, "--weights", path, "--max-sessions", "4") as a, \
            start_server(*BIG_MODEL, "--weights", path, "--max-sessions", "2") as b:
        yield Conn(a.address), Conn(b.address)


def export(conn: Conn, sid: str) -> list[gdn_pb2.StateChunk]:
    return list(conn.stub.ExportState(gdn_pb2.ExportStateRequest(session_id=sid), timeout=RPC_TIMEOUT))


def test_export_import_continues_bitwise(big_pair, big_gates):
    a, b = big_pair
    src = Cursor(a.create(), [0] * BIG_SHAPE.num_layers)
    before = src.run(a, BIG_SHAPE, 7, range(8))
    chunks = export(a, src.sid)

    header = chunks[0].header
    assert chunks[0].HasField("header") and not any(c.HasField("header") for c in chunks[1:])
    assert (header.num_layers, header.num_v_heads, header.head_dim_k, header.head_dim_v) == (5, 8, 128, 128)
    assert header.dtype == "bfloat16" and list(header.positions) == src.positions
    assert header.total_bytes == BIG_SHAPE.state_bytes_per_session == sum(len(c.data) for c in chunks)
    assert all(len(c.data) <= MiB for c in chunks) and len(chunks) >= 3

    moved = Cursor(b.stub.ImportState(iter(chunks), timeout=RPC_TIMEOUT).session_id, list(src.positions))
    after_moved = moved.run(b, BIG_SHAPE, 7, range(8, 16))
    after_src = src.run(a, BIG_SHAPE, 7, range(8, 16))  # exporting left the source as it was

    expected = Replay(BIG_SHAPE, big_gates).run(7, range(16))
    assert before == expected[:8]
    assert after_moved == expected[8:] and after_src == expected[8:]
    # the imported session checks positions like any other
    code, _ = rpc_code(lambda: b.stub.Decode(request(moved.sid, script_step(BIG_SHAPE, 7, 16), 0), timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    b.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=moved.sid), timeout=RPC_TIMEOUT)
    a.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=src.sid), timeout=RPC_TIMEOUT)


def test_client_side_exported_state_round_trips(big_pair, big_gates):
    a, b = big_pair
    src = Cursor(a.create(), [0] * BIG_SHAPE.num_layers)
    src.run(a, BIG_SHAPE, 8, range(4))
    exported = ExportedState.from_chunks(export(a, src.sid))
    assert exported.positions == {l: p for l, p in enumerate(src.positions) if p}
    assert exported.state().shape == (5, 8, 128, 128)
    blob = exported.to_bytes()
    with pytest.raises(ValueError):
        ExportedState.from_bytes(blob[:-1])
    moved = Cursor(b.stub.ImportState(ExportedState.from_bytes(blob).chunks(), timeout=RPC_TIMEOUT).session_id,
                   list(src.positions))
    assert moved.run(b, BIG_SHAPE, 8, range(4, 6)) == Replay(BIG_SHAPE, big_gates).run(8, range(6))[4:]
    b.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=moved.sid), timeout=RPC_TIMEOUT)
    a.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=src.sid), timeout=RPC_TIMEOUT)


def _corrupt(chunks: list[gdn_pb2.StateChunk], how: str) -> list[gdn_pb2.StateChunk]:
    chunks = [gdn_pb2.StateChunk.FromString(c.SerializeToString()) for c in chunks]
    if how == "flipped byte":
        data = bytearray(chunks[1].data)
        data[12345] ^= 0x40
        chunks[1].data = bytes(data)
    elif how == "truncated":
        chunks = chunks[:-1]
    elif how == "short last chunk":
        chunks[-1].data = chunks[-1].data[:-2]
    elif how == "extra bytes":
        chunks.append(gdn_pb2.StateChunk(data=b"\0\0"))
    elif how == "no header":
        chunks = chunks[1:]
    elif how == "header only":
        chunks = chunks[:1]
    elif how == "two headers":
        chunks.insert(1, gdn_pb2.StateChunk(header=chunks[0].header))
    elif how == "other model":
        chunks[0].header.num_layers += 1
    elif how == "other dtype":
        chunks[0].header.dtype = "float16"
    elif how == "wrong checksum":
        chunks[0].header.checksum = "0" * 64
    elif how == "positions short":
        del chunks[0].header.positions[-1]
    elif how == "oversized chunk":
        chunks[1].data = chunks[1].data + chunks[2].data[:16]
        chunks[2].data = chunks[2].data[16:]
    elif how == "empty stream":
        chunks = []
    return chunks


@pytest.mark.parametrize("how", [
    "flipped byte", "truncated", "short last chunk", "extra bytes", "no header", "header only", "two headers",
    "other model", "other dtype", "wrong checksum", "positions short", "oversized chunk", "empty stream",
])
def test_import_refuses_bad_streams(big_pair, how):
    a, b = big_pair
    src = Cursor(a.create(), [0] * BIG_SHAPE.num_layers)
    src.run(a, BIG_SHAPE, 9, range(3))
    chunks = export(a, src.sid)
    a.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=src.sid), timeout=RPC_TIMEOUT)
    in_use = b.in_use()
    code, details = rpc_code(lambda: b.stub.ImportState(iter(_corrupt(chunks, how)), timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert b.in_use() == in_use  # nothing was created


def test_import_when_full_and_export_unknown(big_pair):
    a, b = big_pair
    sid = a.create()
    chunks = export(a, sid)
    held = [b.stub.ImportState(iter(chunks), timeout=RPC_TIMEOUT).session_id for _ in range(2 - b.in_use())]
    code, _ = rpc_code(lambda: b.stub.ImportState(iter(chunks), timeout=RPC_TIMEOUT))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _ = rpc_code(lambda: export(a, "nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    for s in held:
        b.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=s), timeout=RPC_TIMEOUT)
    a.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT)


# -- retries ---------------------------------------------------------------------------------------


def test_retried_step_is_applied_once_even_across_a_restart(tmp_path, weights, gates):
    state_dir = str(tmp_path / "state")
    expected = Replay(SHAPE, gates).run(4, range(8))
    with start_server(*MODEL, "--weights", weights, "--state-dir", state_dir) as server:
        conn = Conn(server.address)
        cur = Cursor(conn.create())
        assert cur.run(conn, SHAPE, 4, range(3)) == expected[:3]
        # step 3's reply is "lost": the client sends the same request (same positions) again
        step = script_step(SHAPE, 4, 3)
        req = request(cur.sid, step, cur.positions[step.layer])
        first = conn.stub.Decode(req, timeout=RPC_TIMEOUT)
        again = conn.stub.Decode(req, timeout=RPC_TIMEOUT)
        assert first.o.data == again.o.data == expected[3]
        assert list(first.positions) == list(again.positions)
        cur.positions[step.layer] += step.tokens
        # step 4's reply is lost in a shutdown
        step = script_step(SHAPE, 4, 4)
        req = request(cur.sid, step, cur.positions[step.layer])
        assert conn.stub.Decode(req, timeout=RPC_TIMEOUT).o.data == expected[4]
        conn.close()
        assert server.stop() == 0
    with start_server(*MODEL, "--weights", weights, "--state-dir", state_dir) as server:
        conn = Conn(server.address)
        assert conn.stub.Decode(req, timeout=RPC_TIMEOUT).o.data == expected[4]  # answered again, not applied
        cur.positions[step.layer] += step.tokens
        assert cur.run(conn, SHAPE, 4, range(5, 8)) == expected[5:]
        conn.close()


# -- SIGTERM under load, restart -------------------------------------------------------------------


class LoadClient(threading.Thread):
    """Runs one session's script with raw stubs, retrying (same positions) through a restart."""

    def __init__(self, target: dict, sid: str, seed: int, steps: int, deadline: float, start: threading.Barrier) -> None:
        super().__init__(daemon=True)
        self.target, self.cursor, self.seed, self.steps, self.deadline = target, Cursor(sid), seed, steps, deadline
        self.start_together = start
        self.outs: list[bytes] = []
        self.retries = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        address, conn = None, None
        try:
            self.start_together.wait(30)
            while len(self.outs) < self.steps and time.monotonic() < self.deadline:
                if self.target["address"] != address:
                    if conn is not None:
                        conn.close()
                    address = self.target["address"]
                    conn = Conn(address)
                step = script_step(SHAPE, self.seed, len(self.outs))
                req = request(self.cursor.sid, step, self.cursor.positions[step.layer])
                try:
                    reply = conn.stub.Decode(req, timeout=2.0)
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                        grpc.StatusCode.CANCELLED):
                        raise
                    self.retries += 1
                    time.sleep(0.05)
                    continue
                self.cursor.positions[step.layer] += step.tokens
                self.outs.append(reply.o.data)
        except BaseException as e:
            self.error = e
        finally:
            if conn is not None:
                conn.close()


def test_sigterm_under_load_then_restore(tmp_path, weights, gates):
    state_dir = str(tmp_path / "state")
    clients_n, steps = 16, 12
    flags = (*MODEL, "--weights", weights, "--state-dir", state_dir, "--max-sessions", "32")
    deadline = time.monotonic() + 120
    with start_server(*flags) as first:
        conn = Conn(first.address)
        idle = Cursor(conn.create())  # a session with no traffic survives too
        idle_out = idle.run(conn, SHAPE, 99, range(2))
        target = {"address": first.address}
        barrier = threading.Barrier(clients_n)
        clients = [LoadClient(target, conn.create(), 200 + i, steps, deadline, barrier) for i in range(clients_n)]
        conn.close()
        for c in clients:
            c.start()
        while min(len(c.outs) for c in clients) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.stop(signal.SIGTERM) == 0
        progress = [len(c.outs) for c in clients]
    assert max(progress) < steps, "a client finished before the restart"
    assert "wrote 17 session(s)" in "".join(first.log), "".join(first.log)
    with start_server(*flags) as second:
        assert "restored 17 session(s)" in "".join(second.log)
        target["address"] = second.address
        for c in clients:
            c.join(max(0.0, deadline - time.monotonic()))
        conn = Conn(second.address)
        assert idle.run(conn, SHAPE, 99, range(2, 4)) == Replay(SHAPE, gates).run(99, range(4))[2:]
        assert conn.in_use() == clients_n + 1
        conn.close()
    for c in clients:
        assert c.error is None, repr(c.error)
        assert len(c.outs) == steps, f"client {c.seed} finished {len(c.outs)} of {steps} steps"
        assert c.outs == Replay(SHAPE, gates).run(c.seed, range(steps)), f"client {c.seed} diverged"
    assert idle_out == Replay(SHAPE, gates).run(99, range(2))


# -- refused snapshots -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_snapshot(tmp_path_factory, weights) -> tuple[Path, list[Cursor]]:
    """A state dir written by a clean shutdown, with two sessions that took some steps."""
    state_dir = tmp_path_factory.mktemp("saved") / "state"
    with start_server(*MODEL, "--weights", weights, "--state-dir", str(state_dir)) as server:
        conn = Conn(server.address)
        cursors = [Cursor(conn.create()), Cursor(conn.create())]
        for i, cur in enumerate(cursors):
            cur.run(conn, SHAPE, 50 + i, range(4))
        conn.close()
        assert server.stop() == 0
    return state_dir, cursors


def _damage(state_dir: Path, how: str) -> None:
    manifest_path = state_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    session_file = state_dir / manifest["sessions"][1]["file"]
    if how == "flipped byte in a session file":
        data = bytearray(session_file.read_bytes())
        data[-100] ^= 0x01
        session_file.write_bytes(bytes(data))
    elif how == "truncated session file":
        session_file.write_bytes(session_file.read_bytes()[:-1000])
    elif how == "missing session file":
        session_file.unlink()
    elif how == "edited manifest":
        manifest["sessions"][0]["owner"] = "someone else"
        manifest_path.write_text(json.dumps(manifest))
    elif how == "truncated manifest":
        manifest_path.write_bytes(manifest_path.read_bytes()[:-10])


@pytest.mark.parametrize("how", [
    "flipped byte in a session file", "truncated session file", "missing session file", "edited manifest",
    "truncated manifest",
])
def test_damaged_snapshot_is_refused_whole(tmp_path, weights, saved_snapshot, how):
    source, cursors = saved_snapshot
    state_dir = tmp_path / "state"
    shutil.copytree(source, state_dir)
    _damage(state_dir, how)
    with start_server(*MODEL, "--weights", weights, "--state-dir", str(state_dir)) as server:
        conn = Conn(server.address)
        assert conn.in_use() == 0  # never half-loaded
        for cur in cursors:
            code, _ = rpc_code(lambda: conn.stub.Decode(request(cur.sid, script_step(SHAPE, 50, 4), None),
                                                        timeout=RPC_TIMEOUT))
            assert code == grpc.StatusCode.NOT_FOUND
        conn.close()
        log = "".join(server.log)
    assert "ERROR" in log and "refusing the session snapshot" in log, log
    root = state_dir
    assert len(list(root.glob("rejected-*/manifest.json"))) == 1  # kept for inspection
    assert json.loads((root / "manifest.json").read_text())["sessions"] == []  # the new, empty one


def test_snapshot_of_another_model_is_refused(tmp_path, saved_snapshot):
    source, _ = saved_snapshot
    state_dir = tmp_path / "state"
    shutil.copytree(source, state_dir)
    with start_server("--layers", "2", "--q-heads", "2", "--v-heads", "4", "--head-dim", "32",
                      "--state-dir", str(state_dir)) as server:
        assert Conn(server.address).in_use() == 0
        log = "".join(server.log)
    assert "refusing the session snapshot" in log and "this server serves" in log, log


# -- idle eviction ---------------------------------------------------------------------------------


def test_idle_sessions_are_evicted(weights):
    with start_server(*MODEL, "--weights", weights, "--session-idle-timeout-s", "0.6") as server:
        conn = Conn(server.address)
        idle, busy = Cursor(conn.create()), Cursor(conn.create())
        idle.run(conn, SHAPE, 1, range(1))
        closed = conn.create()
        conn.stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=closed), timeout=RPC_TIMEOUT)
        n, until = 0, time.monotonic() + 2.0
        while time.monotonic() < until:  # `busy` keeps stepping, `idle` does nothing
            busy.run(conn, SHAPE, 2, range(n, n + 1))
            n += 1
            time.sleep(0.1)
        code, details = rpc_code(lambda: idle.run(conn, SHAPE, 1, range(1, 2)))
        assert code == grpc.StatusCode.NOT_FOUND and "idle" in details, details
        code, details = rpc_code(lambda: export(conn, idle.sid))
        assert code == grpc.StatusCode.NOT_FOUND and "evicted" in details
        code, details = rpc_code(lambda: conn.stub.Decode(request(closed, script_step(SHAPE, 1, 0), None),
                                                          timeout=RPC_TIMEOUT))
        assert code == grpc.StatusCode.NOT_FOUND and "idle" not in details  # closed, not evicted
        busy.run(conn, SHAPE, 2, range(n, n + 1))
        assert conn.in_use() == 1
        conn.close()
