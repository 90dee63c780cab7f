"""The command line: the flags docs/operations.md lists, clear errors for bad ones, weights files in both namings."""
from __future__ import annotations

import argparse
import subprocess
import sys

import grpc
import torch

from servers import start_server
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.wire import tensor_from_proto
from reference import ReferenceModel, rel_err
from util import cli_refusal, decode_request, random_inputs, write_gates


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdn_server", *args], capture_output=True, text=True, timeout=120)


def test_bad_command_lines_fail_with_a_reason(tmp_path):
    cases = {
        ("--layers", "2", "--q-heads", "3", "--v-heads", "4"): "multiple",
        ("--layers", "2"): "--q-heads",
        ("--preset", "qwen3-next", "--layers", "3"): "cannot be combined",
        ("--preset", "qwen3-next", "--weights", str(tmp_path / "missing.safetensors")): "--weights",
        ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--max-sessions", "0"): "--max-sessions",
        ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--max-calls", "0"): "max-calls",
        ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--max-calls-per-client", "0"): "max-calls-per-client",
        ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--message-timeout-s", "0"): "message-timeout-s",
        ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--idle-connection-timeout-s", "0"):
            "idle-connection-timeout-s",
        ("--layers", "1", "--q-heads", "1", "--v-heads", "1", "--speculative-timeout-s", "0"):
            "--speculative-timeout-s",
    }
    for args, reason in cases.items():
        stderr = cli_refusal(*args)
        assert reason in stderr, (args, stderr)


def test_weights_with_layer_count_mismatch_is_refused(tmp_path):
    write_gates(tmp_path / "g.safetensors", layers=2, v_heads=4)
    result = _run_cli("--device", "cpu", "--port", "0", "--layers", "3", "--q-heads", "2", "--v-heads", "4",
                      "--weights", str(tmp_path / "g.safetensors"))
    assert result.returncode == 2 and "2 GDN layers" in result.stderr


def test_a_state_dir_that_cannot_be_written_is_a_start_failure(tmp_path):
    (tmp_path / "file").write_text("")
    result = _run_cli("--device", "cpu", "--port", "0", "--layers", "1", "--q-heads", "1", "--v-heads", "1",
                      "--state-dir", str(tmp_path / "file" / "state"))
    assert result.returncode == 2 and "not a writable directory" in result.stderr


def test_hugging_face_weight_names_are_renumbered(tmp_path):
    path = tmp_path / "hf.safetensors"
    A_log, dt_bias = write_gates(path, layers=2, v_heads=4, seed=4, hf_names=True)
    ref = ReferenceModel(A_log, dt_bias)
    gen = torch.Generator().manual_seed(0)
    with start_server("--layers", "2", "--q-heads", "2", "--v-heads", "4", "--weights", str(path)) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = gdn_pb2_grpc.GdnDecodeStub(channel)
            sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id
            for layer in (0, 1, 1):
                inputs = random_inputs(1, 2, 2, 4, gen=gen)
                reply = stub.Decode(decode_request(layer, [sid], inputs), timeout=30)
                assert rel_err(tensor_from_proto(reply.o), ref.step(layer, [sid], **inputs)) < 5e-3


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_no_model_flags_serve_qwen3_next_shapes_idle_small_and_exit_cleanly_on_sigint():
    """The embedded default: qwen3-next shapes, the host's default CPU capacity, and state memory
    only for the sessions in use: the server idles under 500 MB, holds a session's 36 MiB while it
    lives and gives them back when it closes."""
    from gdn_server.backends import default_cpu_sessions
    from gdn_server.config import PRESETS

    with start_server() as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = gdn_pb2_grpc.GdnDecodeStub(channel)
            info = stub.GetModelInfo(gdn_pb2.GetModelInfoRequest(), timeout=30)
            assert (info.num_layers, info.num_q_heads, info.num_v_heads, info.head_dim_k) == (36, 16, 32, 128)
            assert info.max_sessions == default_cpu_sessions(PRESETS["qwen3-next"])
            idle = _rss_bytes(srv.proc.pid)
            assert idle < 500e6, idle
            sid = stub.CreateSession(gdn_pb2.CreateSessionRequest(), timeout=30).session_id
            gen = torch.Generator().manual_seed(0)
            for layer in range(info.num_layers):
                stub.Decode(decode_request(layer, [sid], random_inputs(1, 1, 16, 32, gen=gen)), timeout=30)
            in_use = _rss_bytes(srv.proc.pid)
            assert in_use > idle + (30 << 20), (idle, in_use)
            stub.CloseSession(gdn_pb2.CloseSessionRequest(session_id=sid), timeout=30)
            closed = _rss_bytes(srv.proc.pid)
            assert closed < in_use - (30 << 20), (idle, in_use, closed)
        import signal
        assert srv.stop(signal.SIGINT) == 0


def test_help_gives_every_flag_a_default_and_hides_the_supervisors_flags():
    from gdn_server.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert "--process-index" not in text and "--process-ports" not in text
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        assert action.help and "default" in action.help, (action.option_strings, action.help)
