"""gdn-loadtest against the CPU server: short bounded runs, results checked through --json."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_client import loadtest
from util import NEEDS_NATIVE_TRANSPORT


def _runs(path) -> list[dict]:
    doc = json.loads(path.read_text())
    return doc["runs"]


def test_stream_with_echo_json_and_plots(small_server, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "results.json"
    rc = loadtest.main([
        "--target", small_server.address, "--clients", "1,3", "--mode", "stream", "--requests", "60",
        "--batch", "2", "--tokens", "2", "--echo", "--json", str(out), "--plot", str(tmp_path / "plots"),
        "--no-progress",
    ])
    assert rc == 0
    runs = _runs(out)
    gdn = [r for r in runs if r["kind"] == "gdn"]
    echo = [r for r in runs if r["kind"] == "echo"]
    assert [r["clients"] for r in gdn] == [1, 3] and [r["clients"] for r in echo] == [1, 3]
    for r in gdn:
        assert r["steps"] == 60 and r["errors"] == 0 and r["layers_per_token"] == 3
        assert r["steps_per_s"] > 0 and r["token_layers_per_s"] == pytest.approx(r["steps_per_s"] * 4)
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p90"] <= r["latency_ms"]["p99"]
        srv = r["server"]
        assert srv["requests"] == 60 and srv["launches"] >= 1
        assert srv["mean_rows_per_launch"] >= 2  # every request carries B=2 rows
    for r, g in zip(echo, gdn):  # the floor sees the same message sizes
        assert (r["request_bytes"], r["reply_bytes"]) == (g["request_bytes"], g["reply_bytes"])
        assert r["steps"] == 60 and r["errors"] == 0 and r["gdn_pct_of_echo"] > 0
    assert (tmp_path / "plots" / "throughput_vs_clients.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0


def test_rounds_alternate_ours_and_the_echo_and_report_the_median(small_server, tmp_path, capsys):
    """--rounds 3 --echo: ours then the echo, three times per clients value, each echo run compared
    with the run of ours just before it, and the median of the three percentages reported."""
    out = tmp_path / "rounds.json"
    rc = loadtest.main([
        "--target", small_server.address, "--clients", "2", "--requests", "20", "--echo", "--rounds", "3",
        "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [(r["kind"], r["round"]) for r in runs] == [
        ("gdn", 0), ("echo", 0), ("gdn", 1), ("echo", 1), ("gdn", 2), ("echo", 2)]
    shares = [100.0 * g["steps_per_s"] / e["steps_per_s"] for g, e in zip(runs[::2], runs[1::2])]
    assert [e["gdn_pct_of_echo"] for e in runs[1::2]] == pytest.approx(shares)
    (point,) = doc["pct_of_echo"]
    assert point["clients"] == 2 and point["rounds"] == pytest.approx(shares)
    assert point["median"] == pytest.approx(sorted(shares)[1])
    assert f"median {sorted(shares)[1]:.1f}% of echo over 3 rounds" in capsys.readouterr().out


def test_processes_split_the_clients_and_sum_their_steps(small_server, tmp_path):
    """--processes 2: five clients over two load processes, ours and the echo's; the steps of both
    processes count, the server saw every one of them, and each keeps its own sessions."""
    out = tmp_path / "spread.json"
    rc = loadtest.main([
        "--target", small_server.address, "--clients", "5", "--requests", "81", "--processes", "2",
        "--batch", "2", "--echo", "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    gdn, echo = _runs(out)
    assert (gdn["kind"], echo["kind"]) == ("gdn", "echo")
    for r in (gdn, echo):
        assert r["clients"] == 5 and r["steps"] == 81 and r["errors"] == 0
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert gdn["server"]["requests"] == 81 and gdn["server"]["mean_rows_per_launch"] >= 2
    assert (echo["request_bytes"], echo["reply_bytes"]) == (gdn["request_bytes"], gdn["reply_bytes"]) != (0, 0)
    assert gdn["layers_per_token"] == 3
    for r in (gdn, echo):  # the load processes' own CPU (all three processes' seconds over the run)
        assert 0 < r["load_cores"] <= (os.cpu_count() or 1) * 1.05
    if Path("/proc/stat").exists():  # the host's CPU over each run: the whole host's, from the parent
        cpu = gdn["host_cpu"]  # the CPU server computes all through ours (tens of ms: many clock ticks)
        assert 0 < cpu["busy_cores"] <= cpu["cores"] and 0 <= cpu["steal_pct"] <= 100
        cpu = echo["host_cpu"]  # the echo's 81 steps may take less than a clock tick (then None)
        assert cpu is None or (0 <= cpu["busy_cores"] <= cpu["cores"] and 0 <= cpu["steal_pct"] <= 100)
    # more processes than steps: every client still runs (fewer processes), each step counted once
    rc = loadtest.main([
        "--target", small_server.address, "--clients", "3", "--requests", "2", "--processes", "4",
        "--json", str(out), "--no-progress",
    ])
    (run,) = _runs(out)
    assert rc == 0 and (run["clients"], run["steps"], run["server"]["requests"]) == (3, 2, 2)


def test_host_cpu_usage_counts_busy_cores_and_steal(monkeypatch):
    monkeypatch.setattr(loadtest.os, "cpu_count", lambda: 16)
    before = [1000, 0, 500, 9000, 10, 0, 5, 40]  # user nice system idle iowait irq softirq steal
    after = [1300, 0, 600, 9500, 10, 0, 5, 140]  # +300 user, +100 system, +500 idle, +100 steal
    usage = loadtest.host_cpu_usage(before, after)
    assert usage == {"cores": 16, "busy_cores": pytest.approx(16 * 400 / 1000), "steal_pct": pytest.approx(10.0)}
    assert loadtest.host_cpu_usage(None, after) is None and loadtest.host_cpu_usage(after, after) is None


def test_a_load_process_that_fails_fails_the_run_with_its_error():
    """A child that cannot reach its server: its UNAVAILABLE comes back as the run's error."""
    import asyncio

    import grpc

    cfg = loadtest.LoadConfig(target="127.0.0.1:1", clients=2, requests=4, timeout=5.0, progress=False)
    with pytest.raises(loadtest.GdnError) as info:
        asyncio.run(loadtest.run_echo(cfg, "127.0.0.1:1", 64, 32, 1, processes=2))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "load process" in info.value.message


async def _echo_counting_connections(cfg: loadtest.LoadConfig, processes: int) -> tuple[set[str], loadtest.RunResult]:
    """Runs `cfg`'s echo load against a bytes echo (the floor's wire protocol) that records each
    stream's peer (the client's address and port: one per TCP connection)."""
    import struct

    import grpc
    import grpc.aio

    from gdn_client import _echo

    peers: set[str] = set()

    async def stream(requests, context):
        peers.add(context.peer())
        async for request in requests:
            (size,) = struct.unpack_from("<I", request)
            yield bytes(size)

    server = grpc.aio.server()
    service, method = _echo.STREAM.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        service, {method: grpc.stream_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        address = f"127.0.0.1:{port}"
        result = await loadtest.run_echo(dataclasses.replace(cfg, target=address), address, 256, 64, 1, processes)
    finally:
        await server.stop(None)
    return peers, result


@pytest.mark.parametrize("processes", [1, 2])
def test_each_client_has_its_own_connection_unless_shared(processes):
    """grpc puts alike channels of one process on one TCP connection; the load's clients each get
    their own (a server's workers behind one port share connections out, not streams), and with
    shared_connection=True one per load process."""
    import asyncio

    cfg = loadtest.LoadConfig(target="", clients=4, requests=40, timeout=10.0, progress=False)
    peers, result = asyncio.run(_echo_counting_connections(cfg, processes))
    assert len(peers) == 4 and result.steps == 40 and result.errors == 0 and not result.shared_connection
    shared = dataclasses.replace(cfg, shared_connection=True)
    peers, result = asyncio.run(_echo_counting_connections(shared, processes))
    assert len(peers) == processes and result.steps == 40 and result.shared_connection


def test_rounds_must_be_positive(small_server, capsys):
    assert loadtest.main(["--target", small_server.address, "--rounds", "0", "--no-progress"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_unary_console_script(small_server, tmp_path):
    out = tmp_path / "unary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gdn_client.loadtest", "--target", small_server.address, "--clients", "2",
         "--mode", "unary", "--requests", "30", "--layers-per-token", "2", "--dtype", "f32",
         "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "steps/s" in proc.stdout and "p99 ms" in proc.stdout
    (run,) = _runs(out)
    assert run["mode"] == "unary" and run["steps"] == 30 and run["errors"] == 0
    assert run["layers_per_token"] == 2 and run["server"]["requests"] == 30


def test_too_many_sessions_is_a_clear_error(small_server, capsys):
    rc = loadtest.main(["--target", small_server.address, "--clients", "65", "--requests", "1", "--no-progress"])
    assert rc == 1
    assert "sessions" in capsys.readouterr().err


def _glibc() -> bool:
    import platform

    return platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="mallopt thresholds are a glibc feature")
def test_tune_malloc_sets_the_thresholds_the_environment_leaves_open(monkeypatch):
    from gdn_client import _malloc
    from gdn_server.tuning import tune_malloc

    for env in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", _malloc.DISABLE_ENV):
        monkeypatch.delenv(env, raising=False)
    # sets them in this test process too: it only changes how much freed heap pytest keeps
    assert tune_malloc() == {"M_MMAP_THRESHOLD": 32 << 20, "M_TRIM_THRESHOLD": 1 << 30}
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(1 << 30))  # the operator's choice wins
    assert tune_malloc() == {"M_MMAP_THRESHOLD": 32 << 20}
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=33554432")
    assert tune_malloc() == {}
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv(_malloc.DISABLE_ENV, "0")
    assert tune_malloc() == {}


def test_tune_malloc_is_a_no_op_without_glibc(monkeypatch):
    from gdn_client import _malloc

    monkeypatch.setattr(_malloc, "_glibc_mallopt", lambda: None)
    assert _malloc.tune_malloc() == {}


@NEEDS_NATIVE_TRANSPORT
@pytest.mark.parametrize("mode", ["stream", "unary"])
def test_native_clients_drive_the_server_and_the_echo(small_server, tmp_path, mode):
    """--client-transport native: the same runs over the HTTP/2 transport in C; every step is a
    real call the server saw, every reply is parsed and checked, the echo gets the same sizes."""
    out = tmp_path / "native.json"
    rc = loadtest.main([
        "--target", small_server.address, "--clients", "3", "--requests", "45", "--mode", mode, "--processes", "2",
        "--batch", "2", "--echo", "--client-transport", "native", "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    gdn, echo = _runs(out)
    for r in (gdn, echo):
        assert r["steps"] == 45 and r["errors"] == 0 and 0 < r["latency_ms"]["p50"]
    assert gdn["server"]["requests"] == 45 and gdn["server"]["mean_rows_per_launch"] >= 2
    assert (echo["request_bytes"], echo["reply_bytes"]) == (gdn["request_bytes"], gdn["reply_bytes"]) != (0, 0)


@NEEDS_NATIVE_TRANSPORT
def test_native_calls_end_with_the_servers_status(small_server):
    """A native client call's status is the server's: an error as GdnError with its code, a stream
    whose bad request is answered in-band and that then ends OK, a closed connection's calls."""
    import asyncio

    import grpc
    import grpc.aio

    from gdn_client._errors import GdnError
    from gdn_client._h2_native import NativeChannel
    from gdn_client.proto.gdn.v1 import gdn_pb2

    async def calls() -> None:
        channel = NativeChannel.current()
        connection = channel.connect(small_server.address)
        with pytest.raises(GdnError) as e:
            await connection.unary("/gdn.v1.GdnDecode/NoSuchMethod")(b"")
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
        reply = await connection.unary("/gdn.v1.GdnDecode/GetModelInfo")(b"")
        assert gdn_pb2.ModelInfo.FromString(reply).num_layers == 3
        stream = connection.stream("/gdn.v1.GdnDecode/DecodeStream")
        await stream.write(gdn_pb2.DecodeRequest(layer=99, session_ids=["x"], request_id="r").SerializeToString())
        answer = gdn_pb2.DecodeResponse.FromString(await stream.read())
        assert (answer.request_id, answer.error_code) == ("r", grpc.StatusCode.INVALID_ARGUMENT.value[0])
        await stream.done_writing()
        assert await stream.read() is grpc.aio.EOF
        open_call = connection.stream("/gdn.v1.GdnDecode/DecodeStream")
        connection.close()
        with pytest.raises(GdnError) as e:
            await open_call.read()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        channel.close()

    asyncio.run(calls())
