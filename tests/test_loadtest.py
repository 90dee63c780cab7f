"""gdn-loadtest (the gdn_loadtest package) against the CPU server: short bounded runs, results
checked through --json, the table and the exit code."""
from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch

from gdn_client import GdnError, ModelInfo
from gdn_loadtest import cli, drive, echo, processes, verify
from gdn_loadtest.config import LoadConfig, RunResult
from gdn_loadtest.run import run_echo
from reference import gdn_reference_step

SERVER_SEED = 7  # the small_server fixture's --seed


def _runs(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def _table_rows(out: str) -> list[list[str]]:
    """The result table's rows (after its header line), as columns."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["kind", "mode"])
    return [line.split() for line in lines[start + 1:] if line.split() and line.split()[0] in ("gdn", "echo")]


def test_stream_with_echo_json_and_plots(small_server, tmp_path, capsys):
    """Two clients values against ours and the echo floor: the JSON's figures, the echo with our
    message sizes, our share of the echo on our rows only, the charts."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "results.json"
    rc = cli.main([
        "--target", small_server.address, "--clients", "1,3", "--mode", "stream", "--requests", "60",
        "--batch", "2", "--tokens", "2", "--echo", "--json", str(out), "--plot", str(tmp_path / "plots"),
        "--no-progress",
    ])
    assert rc == 0
    runs = _runs(out)
    gdn = [r for r in runs if r["kind"] == "gdn"]
    echo_runs = [r for r in runs if r["kind"] == "echo"]
    assert [r["clients"] for r in gdn] == [1, 3] and [r["clients"] for r in echo_runs] == [1, 3]
    assert all(r["commit_ms"] is None for r in runs)  # plain steps commit nothing
    for r in gdn:
        assert r["steps"] == 60 and r["errors"] == 0 and r["layers_per_token"] == 3 and not r["verified"]
        assert r["steps_per_s"] > 0 and r["token_layers_per_s"] == pytest.approx(r["steps_per_s"] * 4)
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p90"] <= r["latency_ms"]["p99"]
        srv = r["server"]
        assert srv["requests"] == 60 and srv["launches"] >= 1
        assert srv["mean_rows_per_launch"] >= 2  # every request carries B=2 rows
    for e, g in zip(echo_runs, gdn):  # the floor sees the same message sizes
        assert (e["request_bytes"], e["reply_bytes"]) == (g["request_bytes"], g["reply_bytes"])
        assert e["steps"] == 60 and e["errors"] == 0 and "pct_of_echo" not in e
        assert g["pct_of_echo"] == pytest.approx(100.0 * g["steps_per_s"] / e["steps_per_s"])
    # the table: the share of the echo stands on our rows; the echo's own row leaves it empty
    rows = _table_rows(capsys.readouterr().out)
    assert [row[0] for row in rows] == ["gdn", "echo", "gdn", "echo"]
    for row, run in zip(rows, runs):
        if run["kind"] == "gdn":
            assert row[-1] == f"{run['pct_of_echo']:.1f}%"
        else:
            assert len(row) == 13 and not row[-1].endswith("%")  # 13 columns: "% of echo" is blank
    assert (tmp_path / "plots" / "throughput_vs_clients.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0


def test_rounds_alternate_ours_and_the_echo_and_report_the_median(small_server, tmp_path, capsys):
    """--rounds 3 --echo: ours then the echo, three times per clients value, each run of ours
    compared with the echo run just after it, and the median of the three percentages reported."""
    out = tmp_path / "rounds.json"
    rc = cli.main([
        "--target", small_server.address, "--clients", "2", "--requests", "20", "--echo", "--rounds", "3",
        "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [(r["kind"], r["round"]) for r in runs] == [
        ("gdn", 0), ("echo", 0), ("gdn", 1), ("echo", 1), ("gdn", 2), ("echo", 2)]
    shares = [100.0 * g["steps_per_s"] / e["steps_per_s"] for g, e in zip(runs[::2], runs[1::2])]
    assert [g["pct_of_echo"] for g in runs[::2]] == pytest.approx(shares)
    (point,) = doc["pct_of_echo"]
    assert point["clients"] == 2 and point["rounds"] == pytest.approx(shares)
    assert point["median"] == pytest.approx(sorted(shares)[1])
    assert f"median {sorted(shares)[1]:.1f}% of echo over 3 rounds" in capsys.readouterr().out


def test_processes_split_the_clients_and_sum_their_steps(small_server, tmp_path):
    """--processes 2: five clients over two load processes, ours and the echo's; the steps of both
    processes count, the server saw every one of them, and each keeps its own sessions."""
    out = tmp_path / "spread.json"
    rc = cli.main([
        "--target", small_server.address, "--clients", "5", "--requests", "81", "--processes", "2",
        "--batch", "2", "--echo", "--json", str(out), "--no-progress",
    ])
    assert rc == 0
    gdn, echo_run = _runs(out)
    assert (gdn["kind"], echo_run["kind"]) == ("gdn", "echo")
    for r in (gdn, echo_run):
        assert r["clients"] == 5 and r["steps"] == 81 and r["errors"] == 0
        assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    assert gdn["server"]["requests"] == 81 and gdn["server"]["mean_rows_per_launch"] >= 2
    assert (echo_run["request_bytes"], echo_run["reply_bytes"]) == (gdn["request_bytes"], gdn["reply_bytes"]) != (0, 0)
    assert gdn["layers_per_token"] == 3
    for r in (gdn, echo_run):  # the load processes' own CPU (all three processes' seconds over the run)
        assert 0 < r["load_cores"] <= (os.cpu_count() or 1) * 1.05
    if Path("/proc/stat").exists():  # the host's CPU over each run: the whole host's, from the parent
        cpu = gdn["host_cpu"]  # the CPU server computes all through ours (tens of ms: many clock ticks)
        assert 0 < cpu["busy_cores"] <= cpu["cores"] and 0 <= cpu["steal_pct"] <= 100
        cpu = echo_run["host_cpu"]  # the echo's 81 steps may take less than a clock tick (then None)
        assert cpu is None or (0 <= cpu["busy_cores"] <= cpu["cores"] and 0 <= cpu["steal_pct"] <= 100)
    # more processes than steps: every client still runs (fewer processes), each step counted once
    rc = cli.main([
        "--target", small_server.address, "--clients", "3", "--requests", "2", "--processes", "4",
        "--json", str(out), "--no-progress",
    ])
    (run,) = _runs(out)
    assert rc == 0 and (run["clients"], run["steps"], run["server"]["requests"]) == (3, 2, 2)


def test_host_cpu_usage_counts_busy_cores_and_steal(monkeypatch):
    monkeypatch.setattr(drive.os, "cpu_count", lambda: 16)
    before = [1000, 0, 500, 9000, 10, 0, 5, 40]  # user nice system idle iowait irq softirq steal
    after = [1300, 0, 600, 9500, 10, 0, 5, 140]  # +300 user, +100 system, +500 idle, +100 steal
    usage = drive.host_cpu_usage(before, after)
    assert usage == {"cores": 16, "busy_cores": pytest.approx(16 * 400 / 1000), "steal_pct": pytest.approx(10.0)}
    assert drive.host_cpu_usage(None, after) is None and drive.host_cpu_usage(after, after) is None


def test_a_load_process_that_fails_fails_the_run_with_its_error():
    """A child that cannot reach its server: its UNAVAILABLE comes back as the run's error."""
    cfg = LoadConfig(target="127.0.0.1:1", clients=2, requests=4, timeout=5.0, progress=False)
    with pytest.raises(GdnError) as info:
        asyncio.run(run_echo(cfg, "127.0.0.1:1", 64, 32, 1, processes=2))
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "load process" in info.value.message


async def _echo_counting_connections(cfg: LoadConfig, processes: int) -> tuple[set[str], RunResult]:
    """Runs `cfg`'s echo load against a bytes echo (the floor's wire protocol) that records each
    stream's peer (the client's address and port: one per TCP connection)."""
    peers: set[str] = set()

    async def stream(requests, context):
        peers.add(context.peer())
        async for request in requests:
            (size,) = struct.unpack_from("<I", request)
            yield bytes(size)

    server = grpc.aio.server()
    service, method = echo.STREAM.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        service, {method: grpc.stream_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        result = await run_echo(cfg, f"127.0.0.1:{port}", 256, 64, 1, processes)
    finally:
        await server.stop(None)
    return peers, result


@pytest.mark.parametrize("processes", [1, 2])
def test_each_client_has_its_own_connection_unless_shared(processes):
    """grpc puts alike channels of one process on one TCP connection; the load's clients each get
    their own (a server's workers behind one port share connections out, not streams), and with
    shared_connection=True one per load process."""
    cfg = LoadConfig(target="", clients=4, requests=40, timeout=10.0, progress=False)
    peers, result = asyncio.run(_echo_counting_connections(cfg, processes))
    assert len(peers) == 4 and result.steps == 40 and result.errors == 0 and not result.shared_connection
    shared = dataclasses.replace(cfg, shared_connection=True)
    peers, result = asyncio.run(_echo_counting_connections(shared, processes))
    assert len(peers) == processes and result.steps == 40 and result.shared_connection


@pytest.mark.parametrize("flags, named", [
    (["--rounds", "0"], "--rounds"), (["--layers-per-token", "0"], "--layers-per-token"),
    (["--requests", "0"], "--requests"), (["--duration", "-1"], "--duration"),
])
def test_nonsense_counts_are_refused_by_name(flags, named, capsys):
    assert cli.main(["--target", "127.0.0.1:1", *flags, "--no-progress"]) == 2
    assert named in capsys.readouterr().err


def test_unary_console_script(small_server, tmp_path):
    out = tmp_path / "unary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gdn_loadtest", "--target", small_server.address, "--clients", "2",
         "--mode", "unary", "--requests", "30", "--layers-per-token", "2", "--dtype", "f32",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "steps/s" in proc.stdout and "p99 ms" in proc.stdout
    assert "|" not in proc.stderr  # stderr is a pipe here, not a terminal: no progress bar on it
    (run,) = _runs(out)
    assert run["mode"] == "unary" and run["steps"] == 30 and run["errors"] == 0
    assert run["layers_per_token"] == 2 and run["server"]["requests"] == 30


@pytest.mark.parametrize("processes", [1, 2])
def test_speculative_drafts_commit_each_pass_and_follow_the_committed_positions(small_server, tmp_path, capsys,
                                                                                processes):
    """Drafts of T = 3 through 2 layers, a Commit of a random 0..3 tokens per pass: every step is
    applied (a position the server does not hold would be FAILED_PRECONDITION), pass after pass.
    The Commits' round trip is reported on its own, in the JSON and the table, from one load
    process or pooled over two."""
    out = tmp_path / "spec.json"
    rc = cli.main(["--target", small_server.address, "--clients", "2", "--batch", "2", "--tokens", "3",
                   "--speculative", "--layers-per-token", "2", "--requests", "24", "--no-progress",
                   "--processes", str(processes), "--json", str(out)])
    assert rc == 0
    (run,) = _runs(out)
    assert run["speculative"] and run["steps"] == 24 and run["errors"] == 0 and run["error_samples"] == []
    commit = run["commit_ms"]
    assert 0 < commit["p50"] <= commit["p90"] <= commit["p99"] <= commit["max"]
    assert 0 < commit["mean"] <= commit["max"]
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["kind", "mode"])
    assert "p99 ms  commit p50 ms  commit p99 ms  errors" in header
    (row,) = _table_rows("\n".join(lines))
    assert row[11:13] == [f"{commit['p50']:.3f}", f"{commit['p99']:.3f}"]
    assert "--verify follows plain steps only" in cli._argument_problem(
        cli.build_parser().parse_args(["--speculative", "--verify"]))


class _CommittingWorker:
    """A worker whose every step settles a pass: step n's Commits took n ms; step 3's reply is wrong."""

    def __init__(self) -> None:
        self.n = 0
        self.commit_s: float | None = None

    async def open(self) -> None:
        pass

    def prepare(self) -> bytes:
        return b""

    async def send(self, request: bytes) -> bytes:
        self.n += 1
        self.commit_s = self.n * 1e-3
        return b"wrong" if self.n == 3 else b"ok"

    def check(self, reply: bytes) -> None:
        if reply == b"wrong":
            raise GdnError("a wrong reply")

    async def exchange(self) -> None:
        self.check(await self.send(self.prepare()))

    async def close(self) -> None:
        pass


class _Quiet:
    def show(self, steps: int, elapsed: float) -> None:
        pass

    def close(self) -> None:
        pass


def test_commit_round_trips_count_with_their_steps_and_travel_exactly():
    """A Commit's time counts as its step's latency does: not the warm-up step's, not a failed
    step's; the run's commit_ms are the pooled samples' percentiles, None where nothing was
    committed; and the samples cross from a load process to the parent bit for bit."""
    cfg = LoadConfig(target="", clients=1, requests=5, progress=False, speculative=True)
    measured = asyncio.run(drive.drive([_CommittingWorker()], cfg, "gdn", progress=_Quiet()))
    (tally,) = measured.tallies
    assert tally.commit_latencies == pytest.approx([2e-3, 4e-3, 5e-3, 6e-3]) and tally.errors == 1
    assert len(tally.latencies) == 4
    result = drive.run_result("gdn", cfg, 1, measured, 0, 0)
    assert result.commit_ms == pytest.approx({"p50": 4.5, "p90": 5.7, "p99": 5.97, "mean": 4.25, "max": 6.0})
    assert "commit_ms" in result.summary() and "commit_latencies" not in result.summary()
    plain = drive.Measured([drive.ClientTally([1e-3])], 1.0, None, 0.0)
    assert drive.run_result("gdn", dataclasses.replace(cfg, speculative=False), 1, plain, 0, 0).commit_ms is None
    samples = [1e-3 / 3, 0.1, 2.5e-7]
    assert processes._decode(processes._encode(iter(samples))) == samples
    assert processes._decode(processes._encode([])) == []


def test_too_many_sessions_is_refused_before_any_run(small_server, capsys):
    """The largest clients value is checked against the server's free sessions before the first
    run: no run starts, and the message says what is needed and what the server has."""
    rc = cli.main(["--target", small_server.address, "--clients", "1,65", "--requests", "1", "--no-progress"])
    assert rc == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # not even the 1-client run
    assert "65 clients x 1 sessions (--batch) need 65 sessions at once" in captured.err
    assert "has 64 free (64 in all, 0 in use)" in captured.err and "--max-sessions" in captured.err


def test_a_run_that_fails_later_leaves_the_finished_rows(monkeypatch, tmp_path, capsys):
    """The server goes away after the first of two runs: the first run's row is still printed
    (and written to --json) before the second's error, and the exit code is 1."""
    from servers import SMALL_MODEL, start_server

    real_run_load = cli.run_load
    with start_server(*SMALL_MODEL, "--max-sessions", "4") as server:
        async def run_then_stop_the_server(cfg, processes=1):
            if cfg.clients == 2:
                server.stop()
            return await real_run_load(cfg, processes)

        monkeypatch.setattr(cli, "run_load", run_then_stop_the_server)
        out = tmp_path / "partial.json"
        rc = cli.main(["--target", server.address, "--clients", "1,2", "--requests", "5", "--timeout", "5",
                       "--json", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1
    assert [row[:3] for row in _table_rows(captured.out)] == [["gdn", "stream", "1"]]
    assert "gdn-loadtest: " in captured.err and "UNAVAILABLE" in captured.err
    (run,) = _runs(out)
    assert run["clients"] == 1 and run["steps"] == 5


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_knows_the_runs_end_and_shows_only_on_a_terminal(small_server, monkeypatch, capsys):
    """A duration run's bar counts its seconds out of the total, with the time left (ETA); a run
    of so many steps counts them out of the total. Off where stderr is not a terminal, and with
    --no-progress."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["--target", small_server.address, "--duration", "0.6", "--clients", "2"]) == 0
    bar = terminal.getvalue()
    assert "/0.6 s [" in bar and "<00:0" in bar and "steps/s" in bar  # total, elapsed<remaining, rate
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["--target", small_server.address, "--requests", "40"]) == 0
    assert "/40 [" in terminal.getvalue() and "<" in terminal.getvalue()
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["--target", small_server.address, "--requests", "10", "--no-progress"]) == 0
    assert terminal.getvalue() == ""
    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(["--target", small_server.address, "--requests", "10"]) == 0  # stderr not a terminal
    assert capsys.readouterr().err == ""


def test_verify_checks_every_output_against_the_reference_math(small_server, tmp_path, capsys):
    """--verify with the server's seed: every output matches (T=2, B=2, stream; and unary over two
    load processes, each checking its own clients), and the report gives the largest error and
    the tolerance."""
    out = tmp_path / "verify.json"
    for flags in (["--mode", "stream", "--clients", "2"], ["--mode", "unary", "--clients", "3", "--processes", "2"]):
        rc = cli.main(["--target", small_server.address, *flags, "--requests", "60", "--batch", "2", "--tokens", "2",
                       "--verify", "--server-seed", str(SERVER_SEED), "--json", str(out), "--no-progress"])
        assert rc == 0
        (run,) = _runs(out)
        assert run["verified"] and run["steps"] == 60 and run["errors"] == 0
        agreement = run["agreement"]
        # every output number of the measured steps and of each client's warm-up step: B x T x HV x V each
        clients = int(flags[flags.index("--clients") + 1])
        assert agreement["outputs"] == (60 + clients) * 2 * 2 * 4 * 128
        assert 0 < agreement["max_error"] < 0.05 and 0 < agreement["max_share"] <= 1
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("--verify:"))
        assert f"all {agreement['outputs']:,} output numbers matched" in line and verify.TOLERANCE_TEXT in line
        assert f"{100 * agreement['max_error']:.3g}% of its head's largest output" in line


@pytest.mark.parametrize("processes", [1, 2])
def test_verify_fails_the_run_on_wrong_outputs(small_server, capsys, processes):
    """Told a wrong server seed, the check expects other gate parameters than the server's and
    must fail the run, naming where (session, layer, position) and by how much."""
    rc = cli.main(["--target", small_server.address, "--clients", "2", "--requests", "60", "--verify",
                   "--server-seed", str(SERVER_SEED + 1), "--processes", str(processes), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "--verify: a wrong output" in err and "session " in err and " layer " in err and "position " in err
    assert "max |error|" in err and f"--server-seed {SERVER_SEED + 1}" in err
    assert ("load process" in err) == (processes > 1)


def _model(H: int, HV: int, K: int) -> ModelInfo:
    return ModelInfo(num_layers=2, num_q_heads=H, num_v_heads=HV, head_dim_k=K, head_dim_v=K, max_tokens_per_step=4,
                     max_sessions=8, sessions_in_use=0, backend="cpu-torch", state_dtype="bfloat16",
                     scale=K ** -0.5)


def test_the_verifier_follows_the_reference_and_names_a_wrong_output():
    """The verifier's vectorised math against tests/reference.py (float64, head by head) over
    several steps of T=3 with two value heads per query head; then one output number off by
    a few percent of its head's scale is reported with its session, layer and position."""
    B, T, H, HV, K = 2, 3, 2, 4, 32
    info = _model(H, HV, K)
    gates = verify.gate_params_from_seed(info, 3)
    verifier = verify.StateVerifier(info, gates, ["s0", "s1"], layers=2, server_seed=3)
    gen = torch.Generator().manual_seed(0)
    state = torch.zeros(B, HV, K, K)
    for step in range(4):
        inputs = [torch.randn(*s, generator=gen).to(torch.bfloat16)
                  for s in ((B, T, H, K), (B, T, H, K), (B, T, HV, K), (B, T, HV), (B, T, HV))]
        expected, state = gdn_reference_step(state, *inputs, gates.A_log[1].expand(B, -1),
                                             gates.dt_bias[1].expand(B, -1), info.scale)
        state = state.to(torch.bfloat16).float()  # the server's storage, once a step
        output = expected.to(torch.bfloat16)
        if step < 3:
            verifier.check(1, step * T, inputs, output)  # the server's right answer passes
            continue
        head_scale = float(expected[1, 2, 3].abs().max())
        output[1, 2, 3, 5] += 0.2 * head_scale
        with pytest.raises(verify.VerificationError) as wrong:
            verifier.check(1, step * T, inputs, output)
        message = str(wrong.value)
        assert "session s1 layer 1 step at position 9 (token 2, value head 3, index 5)" in message
        assert "max |error|" in message and "1 of 768 outputs" in message


def test_the_tool_is_beside_the_client_library():
    """gdn_client holds no load tool or echo server, and the tool imports nothing of gdn_server
    but its process settings (gdn_server.tuning, dependency-free); --verify alone loads the
    server's gate parameter recipe."""
    code = ("import sys, importlib.util; import gdn_loadtest.cli, gdn_loadtest.processes, gdn_loadtest.echo; "
            "assert importlib.util.find_spec('gdn_client.loadtest') is None; "
            "assert importlib.util.find_spec('gdn_client._echo') is None; "
            "print(sorted(m for m in sys.modules if m.startswith('gdn_server')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['gdn_server', 'gdn_server.tuning']"


def test_the_load_and_the_floor_run_under_the_servers_process_settings():
    """The tool's processes take the server's own allocator and collector settings (one
    implementation, gdn_server.tuning): applying them sets the collector's first threshold."""
    import gc

    from gdn_server import tuning

    thresholds = gc.get_threshold()
    try:
        tuning.tune_process()
        assert gc.get_threshold() == (tuning.GC_GEN0, *thresholds[1:])
    finally:
        gc.set_threshold(*thresholds)
