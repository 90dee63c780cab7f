"""grpc.health.v1, server reflection, Prometheus metrics and the SIGTERM drain (the healthcheck probe's
exit codes: tests/test_healthcheck.py)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from servers import SMALL_MODEL, start_server
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from util import decode_request, random_inputs

H, HV = 2, 4
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _step(stub, sid: str, position: int, seed: int = 0, timeout: float = 30):
    inputs = random_inputs(1, 1, H, HV, gen=torch.Generator().manual_seed(seed))
    return stub.Decode(decode_request(0, [sid], inputs, positions=[position]), timeout=timeout)


def _probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdn_server.healthcheck", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def server():
    with start_server(*SMALL_MODEL, "--metrics-port", "0") as s:
        yield s


def test_health_serving(server):
    assert _health(server.address) == SERVING
    assert _health(server.address, "gdn.v1.GdnDecode") == SERVING
    with pytest.raises(grpc.RpcError) as e:
        _health(server.address, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"gdn.v1.GdnDecode", "grpc.health.v1.Health"} <= services
        file = db.FindFileContainingSymbol("gdn.v1.GdnDecode")
        methods = {m.name for s in file.service if s.name == "GdnDecode" for m in s.method}
        assert {"Decode", "DecodeStream", "CreateSession", "CloseSession"} <= methods


def _scrape(server) -> dict[str, list]:
    url = next(m.group(1) for line in server.log if (m := re.search(r"metrics on (\S+)", line)))
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _scrape_until(server, ok, timeout: float = 10.0) -> dict:
    """Scrapes until `ok(metrics)` (a session closes as a control item, after the RPC's reply)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _scrape(server)
        if ok(m):
            return m
        assert time.monotonic() < deadline, "gauges never caught up"
        time.sleep(0.1)


def _value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics(server):
    with grpc.insecure_channel(server.address) as ch:
        stub = gdn_pb2_grpc.GdnDecodeStub(ch)
        sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
        for pos in range(3):
            _step(stub, sid, pos)
        with pytest.raises(grpc.RpcError):
            _step(stub, sid, 99)  # FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError):
            stub.Decode(gdn_pb2.DecodeRequest(session_ids=[sid]), timeout=10)  # INVALID_ARGUMENT
        good = decode_request(0, [sid], random_inputs(1, 1, H, HV), positions=[3])
        bad = decode_request(0, ["nope"], random_inputs(1, 1, H, HV))
        replies = list(stub.DecodeStream(iter([good, bad]), timeout=10))
        assert [r.error_code for r in replies] == [0, grpc.StatusCode.NOT_FOUND.value[0]]
        m = _scrape(server)
        rpcs = m["gdn_rpcs"]
        assert _value(rpcs, "gdn_rpcs_total", method="Decode", code="OK") >= 3
        assert _value(rpcs, "gdn_rpcs_total", method="Decode", code="FAILED_PRECONDITION") >= 1
        assert _value(rpcs, "gdn_rpcs_total", method="Decode", code="INVALID_ARGUMENT") >= 1
        assert _value(rpcs, "gdn_rpcs_total", method="CreateSession", code="OK") >= 1
        assert _value(rpcs, "gdn_rpcs_total", method="DecodeStream", code="OK") >= 1
        steps = m["gdn_decode_requests"]
        assert _value(steps, "gdn_decode_requests_total", method="DecodeStream", code="OK") >= 1
        assert _value(steps, "gdn_decode_requests_total", method="DecodeStream", code="NOT_FOUND") >= 1
        assert _value(steps, "gdn_decode_requests_total", method="Decode", code="OK") >= 3
        assert _value(m["gdn_rpc_duration_seconds"], "gdn_rpc_duration_seconds_count", method="Decode") >= 5
        assert _value(m["gdn_launch_rows"], "gdn_launch_rows_count") >= 4
        assert _value(m["gdn_launch_rows"], "gdn_launch_rows_sum") >= 4
        assert _value(m["gdn_queue_wait_seconds"], "gdn_queue_wait_seconds_count") >= 4
        assert _value(m["gdn_device_seconds"], "gdn_device_seconds_count") >= 4
        m = _scrape_until(server, lambda m: _value(m["gdn_sessions_in_use"], "gdn_sessions_in_use") >= 1)
        assert _value(m["gdn_sessions_capacity"], "gdn_sessions_capacity") == 256
        # 256 sessions x 3 layers, each a bf16 state and a float32 ring of 16 entries (k, u, G)
        ring = 4 * 16 * (2 * 128 + 4 * 128 + 4)
        assert _value(m["gdn_state_pool_bytes"], "gdn_state_pool_bytes") == 256 * 3 * (2 * 4 * 128 * 128 + ring)
        assert "gdn_queue_depth" in m
        assert _value(m["gdn_process_cpu_seconds"], "gdn_process_cpu_seconds_total") > 0  # the process's own CPU
        stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=10)
        _scrape_until(server, lambda m: _value(m["gdn_sessions_in_use"], "gdn_sessions_in_use") == 0)


def test_metrics_off_by_default():
    with start_server(*SMALL_MODEL) as s:
        assert not any("metrics on" in line for line in s.log)


def test_sigterm_reports_not_serving_then_drains():
    """--shutdown-delay-s: NOT_SERVING at once, requests still served during the delay, exit 0."""
    with start_server(*SMALL_MODEL, "--shutdown-delay-s", "3") as s:
        with grpc.insecure_channel(s.address) as ch:
            stub = gdn_pb2_grpc.GdnDecodeStub(ch)
            sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
            assert _health(s.address) == SERVING
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 2
            while _health(s.address) != NOT_SERVING:
                assert time.monotonic() < deadline, "health did not go NOT_SERVING"
                time.sleep(0.05)
            assert _health(s.address, "gdn.v1.GdnDecode") == NOT_SERVING
            assert list(_step(stub, sid, 0).positions) == [1]  # still serving while load balancers notice
            assert _probe("--address", s.address).returncode == 1
        assert s.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 >= 2.5


def test_sigterm_lets_in_flight_requests_finish():
    # --max-queue-delay-us keeps a request pending for 1.5 s: it is surely in flight at SIGTERM
    with start_server(*SMALL_MODEL, "--max-queue-delay-us", "1500000") as s:
        with grpc.insecure_channel(s.address) as ch:
            stub = gdn_pb2_grpc.GdnDecodeStub(ch)
            sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=10).session_id
            outcome: dict = {}

            def call():
                try:
                    outcome["positions"] = list(_step(stub, sid, 0).positions)
                except grpc.RpcError as e:  # pragma: no cover - the failure is reported below
                    outcome["error"] = e.code()

            t = threading.Thread(target=call)
            t.start()
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
            t.join(30)
            assert outcome == {"positions": [1]}
        assert s.proc.wait(timeout=30) == 0
