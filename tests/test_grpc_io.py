"""Which of gRPC's I/O paths the server's processes and the echo floor run on (GRPC_EXPERIMENTS).

gdn-server asks gRPC for its older listener (gdn_server/__init__.py: one thread wake-up fewer
each way per message); gRPC reads the variable when it loads, so the package must set it before
anything of ours imports grpc, and an operator's own value must win. The echo floor is a plain
gRPC service: it runs with gRPC's defaults whatever its starter's environment holds, unless
GDN_ECHO_GRPC_EXPERIMENTS says otherwise. (The --frontends processes: tests/test_frontends.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gdn_server
from gdn_client._echo import echo_env
from util import environ_of

_PROBE = ("import os, sys; import gdn_server; "
          "assert 'grpc' not in sys.modules, 'gdn_server imported grpc before setting GRPC_EXPERIMENTS'; "
          "print(repr(os.environ.get('GRPC_EXPERIMENTS')))")


@pytest.mark.parametrize("given, expected", [
    (None, gdn_server.GRPC_EXPERIMENTS), ("", ""), ("-event_engine_client", "-event_engine_client"),
])
def test_the_server_package_picks_grpcs_io_before_grpc_loads(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(expected)
    assert gdn_server.GRPC_EXPERIMENTS == "-event_engine_listener"


def test_the_echo_floor_runs_on_grpcs_defaults_unless_asked(monkeypatch):
    monkeypatch.setenv("GRPC_EXPERIMENTS", gdn_server.GRPC_EXPERIMENTS)  # as in any process that imported gdn_server
    monkeypatch.delenv("GDN_ECHO_GRPC_EXPERIMENTS", raising=False)
    env = echo_env()
    assert env["GRPC_EXPERIMENTS"] == "" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == os.environ["PATH"]  # the rest of the environment is the caller's
    monkeypatch.setenv("GDN_ECHO_GRPC_EXPERIMENTS", gdn_server.GRPC_EXPERIMENTS)
    assert echo_env()["GRPC_EXPERIMENTS"] == gdn_server.GRPC_EXPERIMENTS


def test_the_echo_floor_started_by_the_loadtest_gets_that_environment(monkeypatch):
    """gdn-loadtest --echo's floor, end to end: the environment its process started with."""
    from gdn_client.loadtest import echo_server

    if not os.path.exists("/proc/self/environ"):
        pytest.skip("no /proc here to read a process's environment from")
    monkeypatch.setenv("GRPC_EXPERIMENTS", gdn_server.GRPC_EXPERIMENTS)
    monkeypatch.delenv("GDN_ECHO_GRPC_EXPERIMENTS", raising=False)
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with echo_server() as address:
        assert address.startswith("127.0.0.1:")
        assert len(started) == 1
        assert environ_of(started[0].pid)["GRPC_EXPERIMENTS"] == ""
