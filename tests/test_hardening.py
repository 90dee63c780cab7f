"""What a hostile client or a broken part must not be able to do: each test stands for one way the
server was made to hang, lose sessions, hold unbounded memory, report the wrong figure or accept
what it must refuse, and checks the clear status (or log line) that answers it now."""
from __future__ import annotations

import asyncio
import subprocess
import hashlib
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gdn_client import Client, ClientOptions, GdnError
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.config import ModelShape
from gdn_server.server import GdnApp, ServerSettings, build_app, serve
from gdn_server.snapshot import load_snapshot, save_snapshot
from gdn_server.weights import random_gate_params
from servers import SMALL_MODEL, start_server
from util import decode_request, random_inputs

SHAPE = ModelShape(3, 2, 4)  # SMALL_MODEL
L, H, HV, K = 3, 2, 4, 128


def _stub(address: str) -> tuple[grpc.Channel, gdn_pb2_grpc.GdnDecodeStub]:
    channel = grpc.insecure_channel(address)
    return channel, gdn_pb2_grpc.GdnDecodeStub(channel)


def _create(stub) -> str:
    return stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id


def _step(stub, sid: str, position: int | None = 0, seed: int = 0, layer: int = 0, T: int = 1):
    inputs = random_inputs(1, T, H, HV, gen=torch.Generator().manual_seed(seed))
    positions = None if position is None else [position]
    return stub.Decode(decode_request(layer, [sid], inputs, positions), timeout=30)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _zero_state_chunks(positions: list[int]) -> list[gdn_pb2.StateChunk]:
    data = bytes(2 * L * HV * K * K)
    header = gdn_pb2.StateHeader(
        num_layers=L, num_v_heads=HV, head_dim_k=K, head_dim_v=K, dtype="bfloat16", positions=positions,
        total_bytes=len(data), checksum=hashlib.sha256(data).hexdigest(),
    )
    return [gdn_pb2.StateChunk(header=header), *(gdn_pb2.StateChunk(data=data[i:i + (1 << 20)])
                                                  for i in range(0, len(data), 1 << 20))]


@pytest.fixture(scope="module")
def server():
    with start_server(*SMALL_MODEL, "--max-sessions", "16", "--max-sessions-per-client", "3", "--speculative-timeout-s", "1.5",
                      "--metrics-port", "0") as srv:
        yield srv


# -- 1. positions of 2^63 or more -------------------------------------------------------------

def test_positions_of_2_63_are_refused_where_they_enter_and_nothing_hangs(server):
    channel, stub = _stub(server.address)
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            stub.ImportState(iter(_zero_state_chunks([2**63] * L)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "2^63" in refused.value.details()
        sid = _create(stub)
        with pytest.raises(grpc.RpcError) as refused:
            _step(stub, sid, position=2**63)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the scheduler lives: the same session steps, and health tells the truth
        assert list(_step(stub, sid, position=0).positions) == [1]
        assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
        # the largest legal position is taken
        big = stub.ImportState(iter(_zero_state_chunks([2**63 - 1] * L)), timeout=30).session_id
        # a step that would take it to 2^63 is refused where it enters, with nothing applied ...
        with pytest.raises(grpc.RpcError) as refused:
            _step(stub, big, position=2**63 - 1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # ... so what the server exports, it imports again
        exported = list(stub.ExportState(gdn_pb2.ExportStateRequest(session_id=big), timeout=30))
        assert list(exported[0].header.positions) == [2**63 - 1] * L
        again = stub.ImportState(iter(exported), timeout=30).session_id
        for session_id in (big, again):
            stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=session_id), timeout=30)
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)


def _shards(max_sessions: int = 4):
    settings = ServerSettings(SHAPE, random_gate_params(SHAPE, 0), device="cpu", max_sessions=max_sessions)
    return build_app(settings).placement.shards


def test_a_snapshot_leaves_out_a_session_it_cannot_write_and_saves_the_others(tmp_path: Path, caplog):
    shards = _shards()
    table = shards[0].sessions
    good, bad = table.create(), table.create()
    good.positions = [5, 6, 7]
    bad.positions = [2**64, 0, 0]  # cannot be an int64: what an unchecked import once let in
    assert save_snapshot(tmp_path, shards, random_gate_params(SHAPE, 0)) is False
    assert "cannot be saved" in caplog.text and bad.id in caplog.text
    fresh = _shards()
    assert load_snapshot(tmp_path, fresh, random_gate_params(SHAPE, 0)) == 1
    assert fresh[0].sessions.get(good.id).positions == [5, 6, 7]


# -- 2. what parses wire bytes is protobuf itself ----------------------------------------------

def test_a_request_id_of_invalid_utf8_is_malformed_even_when_set_again(server):
    request = decode_request(0, ["x"], random_inputs(1, 1, H, HV))
    wire = request.SerializeToString() + bytes.fromhex("4a02fffe4a0130")  # request_id = b"\xff\xfe", then "0"
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/gdn.v1.GdnDecode/Decode")
        with pytest.raises(grpc.RpcError) as refused:
            call(wire, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in refused.value.details()


# -- 3. bounded resources: tests/test_admission.py -----------------------------------------------

# -- 4. liveness that tells the truth ---------------------------------------------------------

def _run_in_process(settings: ServerSettings, body) -> tuple[int, object]:
    """Serves `settings` in this process (its event loop on this, the main, thread: serve() takes
    the signals) while `body(app, address)` runs on another thread with real gRPC clients; stops
    the server when body returns, unless it stopped on its own. Returns (serve's exit status,
    what body returned)."""
    import gdn_server.server as server_module

    app: GdnApp = build_app(settings)
    outcome: dict = {}
    loop = asyncio.new_event_loop()
    real_start = server_module.start_server

    def run_body(address: str) -> None:
        try:
            outcome["result"] = body(app, address)
        except BaseException as e:  # re-raised on the test's thread
            outcome["error"] = e
        finally:
            try:
                loop.call_soon_threadsafe(app.failed.set)  # stop it, if it did not stop on its own
            except RuntimeError:  # it did: its loop is closed
                pass

    threads = []

    async def start(app_):
        server, port = await real_start(app_)
        threads.append(threading.Thread(target=run_body, args=(f"127.0.0.1:{port}",), daemon=True))
        threads[0].start()
        return server, port

    server_module.start_server = start
    try:
        status = loop.run_until_complete(asyncio.wait_for(serve(app), 120))
    finally:
        server_module.start_server = real_start
        loop.close()
    threads[0].join(60)
    if "error" in outcome:
        raise outcome["error"]
    return status, outcome.get("result")


def _wait_health(address: str, status: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _health(address) == status:
                return True
        except grpc.RpcError:
            return status == health_pb2.HealthCheckResponse.NOT_SERVING  # gone: not serving either
        time.sleep(0.1)
    return False


def _settings(**kw) -> ServerSettings:
    return ServerSettings(SHAPE, random_gate_params(SHAPE, 0), device="cpu", port=0, max_sessions=4, **kw)


def test_a_stalled_scheduler_turns_health_to_not_serving_and_the_server_exits_1(monkeypatch):
    import gdn_server.server as server_module

    monkeypatch.setattr(server_module, "STALLED_SCHEDULER_S", 1.0)

    def body(app, address):
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        scheduler = app.placement.shards[0].scheduler
        scheduler._loop_round = lambda: None  # noqa: SLF001 (a bug by hand: rounds are posted, none runs)
        channel, stub = _stub(address)
        with channel:
            sid = _create(stub)
            with pytest.raises(grpc.RpcError):
                inputs = random_inputs(1, 1, H, HV)
                stub.Decode(decode_request(0, [sid], inputs, [0]), timeout=3)  # never answered: the deadline ends it
        return _wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)

    status, saw = _run_in_process(_settings(grace_s=1.0), body)
    assert saw, "health still said SERVING with the scheduler stalled"
    assert status == 1


def _first_step_fails_internal(address: str) -> str:
    """A new session whose first step ends with INTERNAL; returns its id."""
    channel, stub = _stub(address)
    with channel:
        sid = _create(stub)
        with pytest.raises(grpc.RpcError) as failed:
            _step(stub, sid)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
    return sid


def test_a_lost_device_turns_health_to_not_serving():
    def body(app, address):
        backend = app.placement.shards[0].backend

        def broken(batch):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        backend.submit = broken
        backend.device_problem = lambda: "the device does not answer"
        _first_step_fails_internal(address)
        return _wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)

    status, saw = _run_in_process(_settings(), body)
    assert saw and status == 1


def test_an_exception_in_a_round_fails_that_round_with_internal_and_the_scheduler_goes_on():
    def body(app, address):
        planner = app.placement.shards[0].scheduler._planner  # noqa: SLF001
        real_admit = planner.admit
        calls = []

        def admit_once_broken(item):
            calls.append(item)
            if len(calls) == 1:
                raise OverflowError("a bug in admission")
            return real_admit(item)

        planner.admit = admit_once_broken
        sid = _first_step_fails_internal(address)
        channel, stub = _stub(address)
        with channel:
            assert list(_step(stub, sid, position=0).positions) == [1]  # nothing was applied, and it goes on
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING

    _run_in_process(_settings(), body)


# -- 5. the stats figure ---------------------------------------------------------------------

def test_getstats_queue_wait_matches_the_metric(server):
    channel, stub = _stub(server.address)
    with channel:
        sid = _create(stub)
        for n in range(30):
            _step(stub, sid, position=None, seed=n)
        stats = stub.GetStats(gdn_pb2.GetStatsRequest(), timeout=30)
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)
    port = next(line for line in server.log if "metrics on" in line).rsplit(":", 1)[1].split("/")[0]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    metric = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    waited = metric["gdn_queue_wait_seconds_sum"]
    assert abs(stats.queue_wait_seconds - waited) <= 0.05 * waited + 1e-3, (stats.queue_wait_seconds, waited)
    assert stats.queue_wait_seconds < stats.device_seconds  # one client: its steps hardly wait


# -- 6. what must be refused, and shared fairly --------------------------------------------------

def test_a_state_holding_nan_or_inf_is_refused_at_import(server):
    state = torch.zeros(L, HV, K, K, dtype=torch.bfloat16)
    state[1, 2, 3, 4] = float("nan")
    data = state.view(torch.int16).numpy().tobytes()
    header = gdn_pb2.StateHeader(num_layers=L, num_v_heads=HV, head_dim_k=K, head_dim_v=K, dtype="bfloat16",
                                 positions=[0] * L, total_bytes=len(data), checksum=hashlib.sha256(data).hexdigest())
    chunks = [gdn_pb2.StateChunk(header=header), gdn_pb2.StateChunk(data=data)]
    channel, stub = _stub(server.address)
    with channel, pytest.raises(grpc.RpcError) as refused:
        stub.ImportState(iter(chunks), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in refused.value.details()


def test_a_retry_with_other_inputs_is_refused_and_the_same_retry_answered_again(server):
    channel, stub = _stub(server.address)
    with channel:
        sid = _create(stub)
        first = _step(stub, sid, position=0, seed=1)
        again = _step(stub, sid, position=0, seed=1)  # the same request: answered, not applied twice
        assert again.o.data == first.o.data and list(again.positions) == [1]
        with pytest.raises(grpc.RpcError) as refused:
            _step(stub, sid, position=0, seed=2)  # same positions and T, other inputs
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "other than the first try" in refused.value.details()
        assert list(_step(stub, sid, position=1, seed=3).positions) == [2]
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)


def test_zero_tokens_are_refused_saying_so(server):
    channel, stub = _stub(server.address)
    with channel:
        sid = _create(stub)
        with pytest.raises(grpc.RpcError) as refused:
            _step(stub, sid, T=0)
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "T = 0" in refused.value.details() and "bytes" not in refused.value.details()


def test_without_auth_the_session_quota_is_per_client_connection(server):
    a = Client(server.address, ClientOptions(own_connection=True))
    b = Client(server.address, ClientOptions(own_connection=True))
    with a, b:
        mine = [a.create_session() for _ in range(3)]
        with pytest.raises(GdnError) as refused:
            a.create_session()
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        theirs = [b.create_session() for _ in range(3)]  # another client has a quota of its own
        for s in mine + theirs:
            s.close()


def test_drafts_hold_nothing_shared_and_stale_drafts_are_dropped(server):
    """Every session has its own history ring: a client's open drafts at every layer of every one
    of its sessions take nothing from another client's. A draft left open past
    --speculative-timeout-s is dropped, as if never sent: its positions go back, and the session
    may be exported again."""
    own = [("grpc.use_local_subchannel_pool", 1)]  # a connection each: two clients
    hog, other = (grpc.insecure_channel(server.address, options=own) for _ in range(2))
    hog, other = (hog, gdn_pb2_grpc.GdnDecodeStub(hog)), (other, gdn_pb2_grpc.GdnDecodeStub(other))
    with hog[0], other[0]:
        def draft(stub, sid: str, layer: int) -> None:
            req = decode_request(layer, [sid], random_inputs(1, 2, H, HV))
            req.speculative = True
            stub.Decode(req, timeout=30)

        hogged = [_create(hog[1]) for _ in range(3)]
        for sid in hogged:
            for layer in range(L):
                for _ in range(2):  # the second accepts the first whole and stays open
                    draft(hog[1], sid, layer)
        mine = _create(other[1])
        draft(other[1], mine, 0)
        with pytest.raises(grpc.RpcError) as refused:
            list(hog[1].ExportState(gdn_pb2.ExportStateRequest(session_id=hogged[0]), timeout=30))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        time.sleep(3.5)  # past --speculative-timeout-s
        for sid in hogged:
            reply = hog[1].Commit(gdn_pb2.CommitRequest(session_id=sid, accepted=0), timeout=30)
            assert list(reply.positions) == [2] * L and not reply.committed_layers
        chunks = list(hog[1].ExportState(gdn_pb2.ExportStateRequest(session_id=hogged[0]), timeout=30))
        assert list(chunks[0].header.positions) == [2] * L
        for stub, sid in [(hog[1], s) for s in hogged] + [(other[1], mine)]:
            stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)


def test_an_unfinished_snapshot_write_is_an_error_at_the_next_start(tmp_path: Path):
    (tmp_path / "snapshot-20261202T000000-dead").mkdir()  # a write that was killed before its manifest
    (tmp_path / "snapshot-20261202T000000-dead" / "000000.safetensors").write_bytes(b"partial")
    with start_server(*SMALL_MODEL, "--state-dir", str(tmp_path)) as srv:
        text = "".join(srv.log)
    assert " ERROR " in text and "never finished" in text


# -- 7. a repository that explains itself to a new user -------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _links(markdown: Path) -> list[str]:
    import re

    return [m.group(1) for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", markdown.read_text())
            if "://" not in m.group(1)]


def test_every_link_of_the_readme_and_docs_resolves_inside_the_repository():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for link in _links(page):
            target = (page.parent / link).resolve()
            assert target.is_relative_to(ROOT), f"{page.name} links outside the repository: {link}"
            assert target.exists(), f"{page.name} links to a missing file: {link}"


def test_the_proto_points_at_the_document_that_explains_it():
    import re

    header = (ROOT / "proto/gdn/v1/gdn.proto").read_text().split("syntax")[0]
    named = re.findall(r"docs/[\w./-]+\.md", header)
    assert named and all((ROOT / path).exists() for path in named), named


def test_the_readme_runs_an_example_that_exists():
    import re

    readme = (ROOT / "README.md").read_text()
    for script in re.findall(r"python (\S+\.py)", readme):
        assert (ROOT / script).exists(), script


def test_make_serve_installs_the_runtime_without_the_test_tools():
    out = subprocess.run(["make", "-n", "-B", "serve", "VENV=/nonexistent-venv"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install -q -e ." in out.stdout and "[dev]" not in out.stdout, out.stdout
