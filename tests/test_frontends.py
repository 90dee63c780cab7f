"""`--frontends N`: gRPC worker processes in front of one engine process per device.

Real processes on loopback (two CPU "devices" stand in for two GPUs): the same script of requests
gets bit-identical replies from a server with workers and one without, on one device and on two;
sessions spread over the engines and the per-client limit counts across them; identities and
ownership hold through the workers; a worker that dies is replaced without losing a session;
workers and engines leave with the router; an engine that dies stops the server while the others
save their sessions; snapshots carry over between the modes; the port is refused when taken.
(The whole suite also runs in this mode with `GDN_TEST_SERVER_FLAGS="--frontends 2" make test`.)
"""
from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from servers import SMALL_MODEL, start_server
from util import NEEDS_NATIVE_TRANSPORT, decode_request, environ_of, random_inputs

H, HV = 2, 4
FRONTENDS = ("--frontends", "2")
ONE_WORKER = ("--frontends", "1")  # where the number of workers does not matter: quicker to start
TWO_DEVICES = ("--devices", "0,1")
_PIDS = re.compile(r"front-end workers \(pids (\[[\d, ]*\])\)")
_ENGINE_PIDS = re.compile(r"engines for devices \[[\d, ]*\] \(pids (\[[\d, ]*\])\)")


def _pids(server, pattern: re.Pattern = _PIDS) -> list[int]:
    for line in server.log:
        m = pattern.search(line)
        if m:
            return ast.literal_eval(m.group(1))
    raise AssertionError(f"no {pattern.pattern} in the log:\n" + "".join(server.log))


def _worker_pids(server) -> list[int]:
    return _pids(server, _PIDS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _script(stub) -> list[bytes]:
    """A bit of everything a decode client does; returns every reply's bytes in order."""
    out: list[bytes] = []
    a = stub.CreateSession(gdn_pb2.CreateSessionRequest()).session_id
    b = stub.CreateSession(gdn_pb2.CreateSessionRequest(colocate_with=a)).session_id
    gen = torch.Generator().manual_seed(11)
    for layer in range(3):  # both sessions in one request, bf16 inputs, positions
        x = random_inputs(2, 1, H, HV, gen=gen, dtype=torch.bfloat16)
        out.append(stub.Decode(decode_request(layer, [a, b], x, positions=[0, 0]), timeout=30).SerializeToString())
    x = random_inputs(1, 2, H, HV, gen=gen)  # float32 inputs, T = 2
    out.append(stub.Decode(decode_request(0, [a], x), timeout=30).SerializeToString())
    x = random_inputs(1, 1, H, HV, gen=gen, dtype=torch.float16)  # float16 inputs
    out.append(stub.Decode(decode_request(2, [a], x), timeout=30).SerializeToString())
    x = random_inputs(1, 1, H, HV, gen=gen)
    x["v"] = x["v"].bfloat16()  # dtypes mixed in one request
    out.append(stub.Decode(decode_request(2, [b], x), timeout=30).SerializeToString())
    x = random_inputs(1, 1, H, HV, gen=gen)
    x["k"][0, 0, 1, 5] = float("nan")  # a NaN in a float32 input: refused, naming it
    with pytest.raises(grpc.RpcError) as e:
        stub.Decode(decode_request(2, [b], x), timeout=30)
    out.append(f"{e.value.code()} {e.value.details()}".encode())
    stream = [decode_request(layer, [b], random_inputs(1, 1, H, HV, gen=gen), request_id=f"r{layer}")
              for layer in (1, 2, 0, 1)]
    out += [r.SerializeToString() for r in stub.DecodeStream(iter(stream), timeout=30)]
    spec = decode_request(1, [a], random_inputs(1, 3, H, HV, gen=gen))  # speculative, then accept 1 of 3
    spec.speculative = True
    out.append(stub.Decode(spec, timeout=30).SerializeToString())
    out.append(stub.Commit(gdn_pb2.CommitRequest(session_id=a, accepted=1), timeout=30).SerializeToString())
    child = stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=a), timeout=30).session_id
    chunks = list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=child), timeout=30))
    copy = stub.ImportState(iter(chunks), timeout=30).session_id
    for sid in (a, child, copy):
        x = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(5))
        out.append(stub.Decode(decode_request(1, [sid], x), timeout=30).SerializeToString())
    with pytest.raises(grpc.RpcError) as e:  # errors come back with their codes and messages
        stub.Decode(decode_request(0, [a], random_inputs(1, 1, H, HV), positions=[99]), timeout=30)
    out.append(f"{e.value.code()} {e.value.details().replace(a, '<a>')}".encode())
    bad = decode_request(0, [a], random_inputs(1, 1, H, HV))
    bad.q.data = bad.q.data[:-2]
    with pytest.raises(grpc.RpcError) as e:
        stub.Decode(bad, timeout=30)
    out.append(f"{e.value.code()} {e.value.details()}".encode())
    info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=30)
    out.append(f"{info.sessions_in_use} {info.max_sessions}".encode())
    return out


@pytest.mark.parametrize("devices, transport", [
    ((), "grpc"), (TWO_DEVICES, "grpc"),
    # the rounds on the event loop, as with a GPU: the engine's default there answers inline
    # (SchedulerConfig.device_wait), the one process's polls; the CPU's launches are done at once
    (("--scheduler-runs-on", "loop"), "grpc"),
    # the workers' gRPC in C (tests/test_frontend_native.py has the transport's own cases; the
    # routes to two engines are the same Python either way)
    pytest.param((), "native", marks=NEEDS_NATIVE_TRANSPORT),
], ids=["one-device", "two-devices", "one-device-rounds-on-loop", "one-device-native"])
def test_workers_answer_exactly_as_one_process(devices, transport):
    flags = (*SMALL_MODEL, "--seed", "3", "--max-sessions", "16", *devices)
    workers = (*FRONTENDS, "--frontend-transport", transport, "--metrics-port", "0")
    with start_server(*flags) as plain, start_server(*flags, *workers) as fronted:
        with grpc.insecure_channel(plain.address) as ch:
            expected = _script(gdn_pb2_grpc.GdnDecodeStub(ch))
        with grpc.insecure_channel(fronted.address) as ch:
            got = _script(gdn_pb2_grpc.GdnDecodeStub(ch))
        assert got == expected
        # the workers' RPC counts reach the router's /metrics, summed
        url = next(m.group(1) for line in fronted.log if (m := re.search(r"metrics on (\S+)", line)))
        import urllib.request

        text = urllib.request.urlopen(url, timeout=10).read().decode()
        ok_decodes = sum(float(v) for v in re.findall(r'gdn_decode_requests_total\{code="OK",method="Decode"\} (\S+)', text))
        assert ok_decodes == 10  # 3 layers, f32, f16, mixed, speculative, 3 after fork/import
        assert re.search(r'gdn_rpcs_total\{code="OK",method="CreateSession"\} 2\.0', text), text
        assert re.search(r'gdn_decode_requests_total\{code="OK",method="DecodeStream"\} 4\.0', text)


@pytest.mark.parametrize("transport", ["grpc", pytest.param("native", marks=NEEDS_NATIVE_TRANSPORT)])
def test_identity_ownership_and_quota_through_workers(tmp_path, transport):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice:tok-alice-0123456789\nbob:tok-bob-0123456789\n")
    alice, bob = (("authorization", "Bearer tok-alice-0123456789"),), (("authorization", "Bearer tok-bob-0123456789"),)
    workers = (*FRONTENDS, "--frontend-transport", transport)
    with start_server(*SMALL_MODEL, *workers, "--auth-token-file", str(tokens), "--max-sessions-per-client", "2") as s, \
            grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=alice, timeout=10).session_id
        x = random_inputs(1, 1, H, HV)
        assert list(stub.Decode(decode_request(0, [sid], x), metadata=alice, timeout=10).positions) == [1]
        for call in (lambda: stub.Decode(decode_request(0, [sid], x), metadata=bob, timeout=10),
                     lambda: stub.ForkSession(gdn_pb2.ForkSessionRequest(session_id=sid), metadata=bob, timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        replies = list(stub.DecodeStream(iter([decode_request(0, [sid], x)]), metadata=bob, timeout=10))
        assert replies[0].error_code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=alice, timeout=10)
        with pytest.raises(grpc.RpcError) as e:  # the per-identity quota counts across workers
            stub.CreateSession(gdn_pb2.CreateSessionRequest(), metadata=alice, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _decode_retrying(address: str, sid: str, layer: int, position: int, deadline: float) -> list[int]:
    """One positioned step, retried (new channel each time) while connections fail over."""
    x = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(position))
    while True:
        try:
            with grpc.insecure_channel(address) as ch:
                reply = gdn_pb2_grpc.GdnDecodeStub(ch).Decode(decode_request(layer, [sid], x, positions=[position]),
                                                               timeout=10)
                return list(reply.positions)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_dead_worker_is_replaced_and_sessions_survive():
    with start_server(*SMALL_MODEL, *FRONTENDS) as s:
        with grpc.insecure_channel(s.address) as ch:
            sid = gdn_pb2_grpc.GdnDecodeStub(ch).CreateSession(gdn_pb2.CreateSessionRequest()).session_id
        deadline = time.monotonic() + 60
        assert _decode_retrying(s.address, sid, 0, 0, deadline) == [1]
        first, second = _worker_pids(s)
        os.kill(first, signal.SIGKILL)
        while not any("restarting it" in line for line in s.log):
            assert time.monotonic() < deadline, "".join(s.log)
            time.sleep(0.05)
        for position in range(1, 6):  # served all along (by the survivor, then by both)
            assert _decode_retrying(s.address, sid, 0, position, deadline) == [position + 1]
        assert _alive(second) and s.proc.poll() is None


def test_workers_and_engines_leave_with_the_router():
    with start_server(*SMALL_MODEL, *FRONTENDS, *TWO_DEVICES) as s:
        pids = _worker_pids(s) + _pids(s, _ENGINE_PIDS)
        assert len(pids) == 4
        s.proc.kill()  # no clean shutdown: engines see their parent gone, workers their links close
        s.proc.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, f"processes {pids} outlived the router"
            time.sleep(0.05)


def test_workers_and_engines_load_grpc_with_the_servers_io_path(monkeypatch):
    """GRPC_EXPERIMENTS is read when gRPC loads: the router sets gdn-server's value
    (gdn_server/__init__.py) and its workers and engines must start with it in their environment,
    even where the router's own environment did not have it."""
    import gdn_server

    if not os.path.exists("/proc/self/environ"):
        pytest.skip("no /proc here to read a process's environment from")
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)  # the router's environment lacks it
    with start_server(*SMALL_MODEL, *ONE_WORKER) as s:
        for pid in _worker_pids(s) + _pids(s, _ENGINE_PIDS):
            assert environ_of(pid).get("GRPC_EXPERIMENTS") == gdn_server.GRPC_EXPERIMENTS, pid


def _loads_torch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped (Linux: /proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_a_worker_serves_requests_without_torch():
    """A worker imports no torch (~2 s of CPU and ~200 MB a process) and loads none to serve
    steps, unary and streamed, bf16 or not (it widens f16/f32 inputs to float32 bytes with
    numpy); its engine does."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc here to read a process's mappings from")
    with start_server(*SMALL_MODEL, *ONE_WORKER) as s, grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
        gen = torch.Generator().manual_seed(3)
        x = random_inputs(1, 1, H, HV, gen=gen, dtype=torch.bfloat16)
        assert list(stub.Decode(decode_request(0, [sid], x, positions=[0]), timeout=10).positions) == [1]
        steps = [decode_request(layer, [sid], random_inputs(1, 1, H, HV, gen=gen, dtype=torch.bfloat16),
                                positions=[0]) for layer in (1, 2)]
        assert [list(r.positions) for r in stub.DecodeStream(iter(steps), timeout=10)] == [[1], [1]]
        for position, dtype in enumerate((torch.float16, torch.float32), start=1):
            x = random_inputs(1, 1, H, HV, gen=gen, dtype=dtype)
            assert list(stub.Decode(decode_request(0, [sid], x, positions=[position]), timeout=10).positions) == [
                position + 1]
        (worker,) = _worker_pids(s)
        assert not _loads_torch(worker)
        assert all(_loads_torch(pid) for pid in _pids(s, _ENGINE_PIDS))


def test_one_engine_per_device_places_and_limits_across_them():
    with start_server(*SMALL_MODEL, *FRONTENDS, *TWO_DEVICES, "--max-sessions", "64", "--max-sessions-per-client", "3") as s, \
            grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        engines = _pids(s, _ENGINE_PIDS)
        assert len(set(engines)) == 2 and s.proc.pid not in engines
        ids = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id for _ in range(3)]
        info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=10)
        assert [(d.index, d.sessions_in_use, d.max_sessions) for d in info.devices] == [(0, 2, 64), (1, 1, 64)]
        assert (info.sessions_in_use, info.max_sessions) == (3, 128)
        with pytest.raises(grpc.RpcError) as e:  # the limit holds over both engines
            stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        x = random_inputs(2, 1, H, HV)
        with pytest.raises(grpc.RpcError) as e:  # sessions 0 and 1 sit on different engines
            stub.Decode(decode_request(0, ids[:2], x), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different devices" in e.value.details()
        assert list(stub.Decode(decode_request(0, [ids[0], ids[2]], x), timeout=10).positions) == [1, 1]
        for sid in ids:  # every session is served by its own engine, from either worker
            assert list(stub.Decode(decode_request(1, [sid], random_inputs(1, 1, H, HV)), timeout=10).positions) == [1]
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=ids[1]), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            stub.Decode(decode_request(1, [ids[1]], random_inputs(1, 1, H, HV)), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)  # the closed one freed a place
        stats = stub.GetStats(gdn_pb2.GetStatsRequest(), timeout=10)
        assert (stats.requests, stats.sessions_in_use, stats.max_sessions) == (4, 3, 128)


def test_evicted_sessions_leave_the_per_client_count():
    """Engines evict idle sessions on their own; the router's count of a client's sessions follows."""
    with start_server(*SMALL_MODEL, *ONE_WORKER, *TWO_DEVICES, "--session-idle-timeout-s", "1",
                      "--max-sessions-per-client", "1") as s, grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        first = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        deadline = time.monotonic() + 20
        while True:  # once `first` is evicted, the client may hold a new one
            try:
                second = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.2)
        assert list(stub.Decode(decode_request(0, [second], random_inputs(1, 1, H, HV)), timeout=10).positions) == [1]
        with pytest.raises(grpc.RpcError) as e:
            stub.Decode(decode_request(0, [first], random_inputs(1, 1, H, HV)), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "evicted" in e.value.details()


def _positions_after_step(stub, sid: str, layer: int, position: int) -> list[int]:
    x = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(position))
    return list(stub.Decode(decode_request(layer, [sid], x, positions=[position]), timeout=10).positions)


def test_snapshots_carry_over_between_modes(tmp_path):
    """Sessions saved by engines (one directory per device) load into one process, and back;
    a device no engine serves any more hands its sessions to the first engine."""
    state = ("--state-dir", str(tmp_path))
    with start_server(*SMALL_MODEL, *ONE_WORKER, *TWO_DEVICES, *state) as s, grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        ids = [stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id for _ in range(3)]
        for sid in ids:
            assert _positions_after_step(stub, sid, 0, 0) == [1]
    assert sorted(p.parent.name for p in tmp_path.glob("device-*/manifest.json")) == ["device-0", "device-1"]
    rounds = [(TWO_DEVICES, ()), (TWO_DEVICES, ONE_WORKER), (("--devices", "0"), ONE_WORKER)]
    for step, (devices, mode) in enumerate(rounds, start=1):
        with start_server(*SMALL_MODEL, *mode, *devices, *state) as s, grpc.insecure_channel(s.address) as ch:
            stub = gdn_pb2_grpc.GdnDecodeStub(ch)
            for sid in ids:  # the same sessions, their positions where they were
                assert _positions_after_step(stub, sid, 0, step) == [step + 1]
            assert stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=10).sessions_in_use == 3


def test_an_engine_that_dies_stops_the_server_and_the_others_save(tmp_path):
    with start_server(*SMALL_MODEL, *ONE_WORKER, *TWO_DEVICES, "--state-dir", str(tmp_path)) as s, \
            grpc.insecure_channel(s.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        for _ in range(2):  # one session on each device
            stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10)
        os.kill(_pids(s, _ENGINE_PIDS)[1], signal.SIGKILL)
        assert s.proc.wait(60) == 1
        assert "the engine of device 1 exited" in "".join(s.log)
    assert (tmp_path / "device-0" / "manifest.json").exists()
    assert not (tmp_path / "device-1" / "manifest.json").exists()


def test_a_taken_port_is_refused():
    with start_server(*SMALL_MODEL) as plain, start_server(*SMALL_MODEL, *FRONTENDS) as fronted:
        for taken in (plain.port, fronted.port):  # by a plain server, and by another with workers
            r = subprocess.run([sys.executable, "-m", "gdn_server", *SMALL_MODEL, "--device", "cpu", *FRONTENDS,
                                "--host", "127.0.0.1", "--port", str(taken)], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 2 and "cannot serve" in r.stderr, r.stderr
    with socket.socket() as probe:  # and nothing was left listening
        probe.bind(("127.0.0.1", fronted.port))
