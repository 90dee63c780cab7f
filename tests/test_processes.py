"""`gdn-server --processes K`: the supervisor, and gdn_client reaching every process through the
one address it is given (real processes on loopback ports, a tiny CPU model).

Outputs are compared with those of a server of one process with the same --seed: on the CPU the
math of a row does not depend on the other rows of its launch, so they must be equal.
"""
from __future__ import annotations

import asyncio
import doctest
import json
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch

from gdn_client import (
    AsyncClient,
    AsyncSession,
    Client,
    ClientOptions,
    FailedPreconditionError,
    NotFoundError,
    ReplicaSet,
)
from gdn_client._routing import process_target
from gdn_client.proto.ids import process_of
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server import supervisor
from servers import ServerProcess, start_server
from util import cli_refusal, decode_request, random_inputs

L, H, HV = 2, 2, 4
MODEL = ("--layers", str(L), "--q-heads", str(H), "--v-heads", str(HV), "--head-dim", "128", "--device", "cpu",
         "--seed", "7", "--max-sessions", "8")
PROCESSES = ("--processes", "2")
SERVING = re.compile(r"^process (\d+) \(cpu\) serving on (\S+):(\d+)")
# fast reconnects to a process that restarted, and enough retries to outlast its start
PATIENT = ClientOptions(
    timeout=20, max_attempts=12, backoff_initial=0.2, backoff_max=1.0,
    channel_args=(("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)),
)


@pytest.fixture(scope="module")
def host() -> Iterator[ServerProcess]:
    """A supervisor of two server processes."""
    with start_server(*MODEL, *PROCESSES) as srv:
        yield srv


@pytest.fixture(scope="module")
def solo() -> Iterator[ServerProcess]:
    """A server of one process with the same model and weights: the reference (room for the
    reference sessions of every test, left open)."""
    with start_server(*MODEL, "--max-sessions", "64") as srv:
        yield srv


def serving_ports(server: ServerProcess) -> dict[int, int]:
    """Each process's port, from the supervisor's `process i (cpu) serving on HOST:PORT` lines."""
    return {int(m.group(1)): int(m.group(3)) for m in map(SERVING.match, list(server.log)) if m}


def step_inputs(seed: int, T: int = 1, B: int | None = None) -> dict[str, torch.Tensor]:
    x = random_inputs(1 if B is None else B, T, H, HV, gen=torch.Generator().manual_seed(seed))
    return {n: t[0] for n, t in x.items()} if B is None else x


def stub(port: int) -> tuple[grpc.Channel, gdn_pb2_grpc.GdnDecodeStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, gdn_pb2_grpc.GdnDecodeStub(channel)


def sessions_in_each_process(client: Client, per_process: int = 1) -> dict[int, list]:
    """New sessions, `per_process` in each of the two processes (new sessions go round robin)."""
    made: dict[int, list] = {0: [], 1: []}
    while min(len(v) for v in made.values()) < per_process:
        s = client.create_session()
        made[process_of(s.id)].append(s)
    for extra in (s for v in made.values() for s in v[per_process:]):
        extra.close()
    return {p: v[:per_process] for p, v in made.items()}


def child_pids(supervisor_pid: int) -> dict[int, int]:
    """The supervisor's server processes: pid by process index (from their command lines)."""
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text().split()
    pids = {}
    for pid in map(int, children):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--process-index" in argv:
            pids[int(argv[argv.index(b"--process-index") + 1])] = pid
    return pids


def wait_serving(port: int, timeout: float = 30.0) -> gdn_pb2.ModelInfo:
    """GetModelInfo of the process on `port`, once it answers."""
    deadline = time.monotonic() + timeout
    while True:
        channel, s = stub(port)
        try:
            return s.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=1.0)
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
        finally:
            channel.close()


# -- the supervisor ---------------------------------------------------------------------------------


def test_supervisor_serves_every_process_and_names_a_sessions_home(host):
    ports = serving_ports(host)
    assert sorted(ports) == [0, 1] and ports[0] == host.port and ports[1] != ports[0]
    for index, port in ports.items():
        info = wait_serving(port, timeout=5)
        assert list(info.process_ports) == [ports[0], ports[1]] and info.process_index == index

    (c0, s0), (c1, s1) = stub(ports[0]), stub(ports[1])
    try:
        sid = s0.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
        assert process_of(sid) == 0
        with pytest.raises(grpc.RpcError) as wrong:
            s1.Decode(decode_request(0, [sid], step_inputs(1, B=1), positions=[0]), timeout=10)
        assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"port {ports[0]}" in wrong.value.details() and "process 0" in wrong.value.details()
        with pytest.raises(grpc.RpcError) as wrong:
            s1.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=10)
        assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        s0.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=10)
    finally:
        c0.close()
        c1.close()


def test_bad_process_flags_are_refused():
    for bad in ("0", "-2", "many"):
        assert "takes a count >= 1 or auto" in cli_refusal(*MODEL, "--processes", bad)
    assert "go together" in cli_refusal(*MODEL, "--process-index", "0")
    assert "go together" in cli_refusal(*MODEL, "--process-ports", "50051,50052")
    assert "must name this process" in cli_refusal(*MODEL, "--port", "50051", "--process-index", "2",
                                                  "--process-ports", "50051,50052")


def test_process_targets_keep_the_users_host_spelling():
    assert process_target("localhost:50051", 50052) == "localhost:50052"
    assert process_target("[::1]:50051", 50053) == "[::1]:50053"
    assert process_target("dns:///gdn.internal:50051", 50052) == "dns:///gdn.internal:50052"
    assert process_target("ipv4:10.0.0.7:50051", 50052) == "ipv4:10.0.0.7:50052"
    with pytest.raises(ValueError):
        process_target("unix:/run/gdn.sock", 50052)
    assert (process_of("p12.abc"), process_of("abc"), process_of("pp1.x")) == (12, None, None)
    import gdn_client._routing
    import gdn_client.proto.ids

    assert doctest.testmod(gdn_client._routing).failed == 0
    assert doctest.testmod(supervisor).attempted and doctest.testmod(supervisor).failed == 0
    assert doctest.testmod(gdn_client.proto.ids).attempted and doctest.testmod(gdn_client.proto.ids).failed == 0


def test_a_replica_set_counts_and_follows_a_replicas_processes(host, solo):
    """A replica of two processes: its free capacity is both processes', and a session migrates
    off either process and back."""
    with ReplicaSet([host.address, solo.address], ClientOptions(timeout=20)) as replicas, \
            Client(solo.address) as ref:
        in_use = replicas.clients[host.address].model_info().sessions_in_use
        assert replicas.free_capacity()[host.address] == 16 - in_use
        homes = sessions_in_each_process(replicas.clients[host.address])
        for p in (0, 1):
            s, r = homes[p][0], ref.create_session()
            x = step_inputs(100 + p)
            assert torch.equal(s.decode(0, **x), r.decode(0, **x))
            replicas.migrate(s, solo.address)
            assert replicas.home_of(s) == solo.address
            replicas.migrate(s, host.address)  # back, into a process of the host's choice
            assert replicas.home_of(s) == host.address and s.positions == {0: 1}
            x = step_inputs(110 + p)
            assert torch.equal(s.decode(0, **x), r.decode(0, **x))
            s.close()
        assert replicas.free_capacity()[host.address] == 16 - in_use  # nothing left behind


# -- gdn_client through one address ------------------------------------------------------------------


def test_client_reaches_both_processes_through_one_address_with_the_outputs_of_one_process(host, solo):
    with Client(host.address, ClientOptions(timeout=20)) as client, Client(solo.address) as ref:
        info = client.model_info()  # the whole host's capacity
        assert info.process_ports == tuple(serving_ports(host)[i] for i in (0, 1)) and info.process_index == 0
        assert info.max_sessions == 16 and [(d.index, d.max_sessions) for d in info.devices] == [(0, 16)]
        homes = sessions_in_each_process(client)
        s0, s1 = homes[0][0], homes[1][0]
        r0, r1 = ref.create_session(), ref.create_session()
        assert client.model_info().sessions_in_use == 2

        # decode, each session at its home
        for i in range(3):
            for s, r, seed in ((s0, r0, 10 + i), (s1, r1, 20 + i)):
                x = step_inputs(seed, T=1 + i % 2)
                assert torch.equal(s.decode(i % L, **x), r.decode(i % L, **x))

        # a batch: colocated sessions only, refused before anything is sent otherwise
        buddy, rbuddy = client.create_session(colocate_with=s1), ref.create_session(colocate_with=r1)
        assert process_of(buddy.id) == 1
        xb = step_inputs(30, B=2)
        assert torch.equal(client.decode_batch(0, [s1, buddy], **xb), ref.decode_batch(0, [r1, rbuddy], **xb))
        before = (s0.positions, s1.positions)
        with pytest.raises(FailedPreconditionError, match="colocate_with"):
            client.decode_batch(1, [s0, s1], **xb)
        assert (s0.positions, s1.positions) == before  # nothing reserved, nothing sent

        # one stream over sessions of both processes, steps of each session in order
        with client.stream() as st, ref.stream() as rst:
            xs = [(layer, s, r, step_inputs(40 + 2 * layer + j))
                  for layer in range(L) for j, (s, r) in enumerate(((s0, r0), (s1, r1)))]
            futs = [(st.submit(layer, s, **x), rst.submit(layer, r, **x)) for layer, s, r, x in xs]
            for got, want in futs:
                assert torch.equal(got.result(timeout=20), want.result(timeout=20))
            with pytest.raises(FailedPreconditionError):
                st.submit(0, [s0, s1], **xb)

        # fork (in its parent's process), export and import, and their outputs
        child, rchild = s1.fork(), r1.fork()
        assert process_of(child.id) == 1 and child.positions == s1.positions
        moved, rmoved = client.import_state(s0.export()), ref.import_state(r0.export())
        assert moved.positions == s0.positions
        x = step_inputs(50)
        outs = [s.decode(1, **x) for s in (s1, child, s0, moved)]
        refs = [r.decode(1, **x) for r in (r1, rchild, r0, rmoved)]
        assert all(torch.equal(o, r) for o, r in zip(outs, refs))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])

        # close, through the one address too
        for s in (s0, s1, buddy, child):
            s.close()
        client.close_session(moved.id)
        with pytest.raises(NotFoundError):
            client.close_session(s1.id)
        assert client.model_info().sessions_in_use == 0

    # a client given process 1's port reaches process 0 as well
    with Client(f"127.0.0.1:{serving_ports(host)[1]}") as client:
        homes = sessions_in_each_process(client)
        assert client.model_info().process_index == 1
        for s in (homes[0][0], homes[1][0]):
            s.decode(0, **step_inputs(60))
            s.close()


def test_async_client_reaches_both_processes_through_one_address(host, solo):
    x, xb = step_inputs(70, T=2), step_inputs(71, B=2)
    with Client(solo.address) as ref:
        r = ref.create_session()
        rbuddy = ref.create_session(colocate_with=r)
        want = [r.decode(0, **x), ref.decode_batch(1, [r, rbuddy], **xb)]
        with ref.stream() as rst:
            want.append(rst.submit(1, r, **step_inputs(72)).result(timeout=20))
        rchild = r.fork()
        want.append(rchild.decode(0, **step_inputs(73)))

    async def main() -> None:
        async with AsyncClient(host.address, ClientOptions(timeout=20)) as client:
            sessions = [await client.create_session() for _ in range(2)]
            assert {process_of(s.id) for s in sessions} == {0, 1}
            assert (await client.model_info()).max_sessions == 16
            with pytest.raises(FailedPreconditionError, match="colocate_with"):
                await client.decode_batch(0, sessions, **xb)
            for s in sessions:
                buddy = await client.create_session(colocate_with=s)
                assert process_of(buddy.id) == process_of(s.id)
                got = [await s.decode(0, **x), await client.decode_batch(1, [s, buddy], **xb)]
                async with client.stream() as st:
                    got.append(await st.submit(1, s, **step_inputs(72)))
                child = await s.fork()
                got.append(await child.decode(0, **step_inputs(73)))
                assert all(torch.equal(g, w) for g, w in zip(got, want))
                moved = await client.import_state(await s.export())
                assert moved.positions == s.positions
                for t in (s, buddy, child, moved):
                    await t.close()

            # a client that knows nothing yet learns the processes on a session id's first call
            ids = [(await client.create_session()).id for _ in range(2)]
            assert {process_of(sid) for sid in ids} == {0, 1}
            async with AsyncClient(host.address) as fresh:
                async with fresh.stream() as st:
                    assert torch.equal(await st.submit(0, AsyncSession(fresh, ids[0]), **x), want[0])
                assert torch.equal(await AsyncSession(fresh, ids[1]).decode(0, **x), want[0])
                for sid in ids:
                    await fresh.close_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_killed_process_is_restarted_and_the_others_sessions_are_untouched(host, solo):
    ports = serving_ports(host)
    with Client(host.address, PATIENT) as client, Client(solo.address) as ref:
        homes = sessions_in_each_process(client)
        survivor, lost, r = homes[0][0], homes[1][0], ref.create_session()
        x = step_inputs(80)
        assert torch.equal(survivor.decode(0, **x), r.decode(0, **x))
        lost.decode(0, **x)

        restarts_before = sum(1 for line in list(host.log) if SERVING.match(line) and line.startswith("process 1"))
        os.kill(child_pids(host.proc.pid)[1], signal.SIGKILL)
        x = step_inputs(81)
        assert torch.equal(survivor.decode(0, **x), r.decode(0, **x))  # process 0 did not notice
        wait_serving(ports[1], timeout=20)  # restarted on its port
        assert any("process 1" in line and "restarting it" in line for line in list(host.log))
        assert sum(1 for line in list(host.log) if SERVING.match(line) and line.startswith("process 1")) \
            == restarts_before + 1
        with pytest.raises(NotFoundError):  # its sessions died with it (no --state-dir)
            lost.decode(0, **x)
        x = step_inputs(82)
        assert torch.equal(survivor.decode(1, **x), r.decode(1, **x))
        again = sessions_in_each_process(client)  # new sessions land in the restarted one too
        for s in (*again[0], *again[1], survivor):
            s.decode(0, **x)
            s.close()


def test_sigterm_snapshots_each_process_and_a_restarted_supervisor_restores_them(tmp_path, solo):
    port = two_free_ports()
    flags = (*MODEL, *PROCESSES, "--port", str(port), "--state-dir", str(tmp_path))
    with Client(f"127.0.0.1:{port}", PATIENT) as client, Client(solo.address) as ref:
        with start_server(*flags) as first:
            homes = sessions_in_each_process(client)
            pairs = [(homes[p][0], ref.create_session()) for p in (0, 1)]
            for i, (s, r) in enumerate(pairs):
                x = step_inputs(90 + i, T=2)
                assert torch.equal(s.decode(0, **x), r.decode(0, **x))
            assert first.stop() == 0
        for p, (s, _) in enumerate(pairs):
            manifest = json.loads((tmp_path / f"process-{p}" / "manifest.json").read_text())
            assert [entry["id"] for entry in manifest["sessions"]] == [s.id]

        with start_server(*flags):
            for i, (s, r) in enumerate(pairs):  # the same ids and positions, the same client
                assert s.positions == {0: 2}
                x = step_inputs(95 + i)
                assert torch.equal(s.decode(0, **x), r.decode(0, **x))
                assert torch.equal(s.decode(1, **x), r.decode(1, **x))
                s.close()


def two_free_ports() -> int:
    """A port P such that P and P+1 are free on loopback now."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def test_auto_on_the_cpu_is_one_process():
    """--processes auto on a host without a GPU: one server process (no supervisor, ids unprefixed)."""
    with start_server(*MODEL, "--processes", "auto") as srv, Client(srv.address) as client:
        assert not client.model_info().process_ports and "process 0" not in "".join(srv.log)
        assert process_of(client.create_session().id) is None


# A stand-in for NVIDIA's MPS control daemon: logs how it was called, its pipe directory and
# what it read, and fails when $FAKE_MPS_FAIL is set.
FAKE_MPS = """#!/bin/sh
if [ "$1" = "-d" ]; then
  [ -n "$FAKE_MPS_FAIL" ] && { echo "daemon refused" >&2; exit 1; }
  echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
else
  echo "$(cat) $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
fi
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / supervisor.MPS_CONTROL
    control.write_text(FAKE_MPS)
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(tmp_path / "mps.log"))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    return tmp_path / "mps.log"


def test_processes_sharing_a_gpu_get_an_mps_daemon_of_their_own(fake_mps):
    mps = supervisor.Mps.start()
    assert mps is not None
    pipe, logs = mps.env["CUDA_MPS_PIPE_DIRECTORY"], mps.env["CUDA_MPS_LOG_DIRECTORY"]
    assert os.path.isdir(pipe) and os.path.isdir(logs)
    assert fake_mps.read_text().split() == ["start", pipe, logs]
    mps.stop()
    assert fake_mps.read_text().splitlines()[1].split() == ["quit", pipe]  # the daemon of those pipes quits
    assert not os.path.exists(mps.directory)


def test_without_an_mps_daemon_the_processes_still_run(fake_mps, monkeypatch, caplog):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    assert supervisor.Mps.start() is None
    assert "daemon refused" in caplog.text
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/site-mps")  # the operator's own daemon: used as it is
    monkeypatch.delenv("FAKE_MPS_FAIL")
    assert supervisor.Mps.start() is None and not fake_mps.exists()


def test_each_process_is_told_the_count_never_auto():
    children = supervisor.child_argvs(["--processes", "auto", "--layers", "2"], "127.0.0.1", 50051, 3, [0],
                                      None, None)
    for child in children:
        assert child.argv.count("--processes") == 1 and child.argv[child.argv.index("--processes") + 1] == "3"
