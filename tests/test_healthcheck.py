"""`python -m gdn_server.healthcheck`: each outcome of a probe has its own exit code.

The probe runs as a subprocess, as Docker's HEALTHCHECK and Kubernetes exec probes run it, against
a real gdn-server process (for SERVING and an unknown service name) or a bare gRPC server on a
free loopback port (for the answers a healthy gdn-server never gives: NOT_SERVING, no health
service at all).
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from concurrent import futures
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gdn_server.healthcheck import (
    EXIT_NOT_SERVING,
    EXIT_RPC_ERROR,
    EXIT_SERVING,
    EXIT_UNKNOWN_SERVICE,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
)
from servers import SMALL_MODEL, start_server

PROBE_TIMEOUT_S = 60  # the subprocess as a whole: interpreter start, grpc import, one RPC


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gdn_server.healthcheck", *args], capture_output=True, text=True,
                          timeout=PROBE_TIMEOUT_S)


@pytest.fixture(scope="module")
def server():
    with start_server(*SMALL_MODEL) as s:
        yield s


@contextlib.contextmanager
def bare_grpc_server(status: int | None) -> Iterator[str]:
    """A gRPC server on a free loopback port with the standard health service answering `status`
    for "" (None: no health service at all, so Check is UNIMPLEMENTED); yields its address."""
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    if status is not None:
        servicer = health.HealthServicer()
        servicer.set("", status)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None)


def free_port() -> int:
    """A loopback port nothing listens on (bound once by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serving_exits_0(server):
    r = probe("--address", server.address)
    assert r.returncode == EXIT_SERVING == 0, r.stderr
    assert r.stdout.strip() == "SERVING"
    r = probe("--address", server.address, "--service", "gdn.v1.GdnDecode")
    assert r.returncode == EXIT_SERVING, r.stderr


def test_unknown_service_has_its_own_code(server):
    r = probe("--address", server.address, "--service", "no.such.Service")
    assert r.returncode == EXIT_UNKNOWN_SERVICE == 3, (r.stdout, r.stderr)
    assert "no.such.Service" in r.stderr


def test_nothing_listening_exits_2():
    r = probe("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert r.returncode == EXIT_UNREACHABLE == 2, (r.stdout, r.stderr)
    assert "unreachable" in r.stderr


def test_a_server_that_never_answers_exits_2():
    """A socket that accepts connections and says nothing: the deadline passes."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # the kernel completes TCP handshakes; no HTTP/2 ever comes back
        r = probe("--address", f"127.0.0.1:{sock.getsockname()[1]}", "--timeout", "1")
    assert r.returncode == EXIT_UNREACHABLE, (r.stdout, r.stderr)


def test_not_serving_exits_1():
    with bare_grpc_server(health_pb2.HealthCheckResponse.NOT_SERVING) as address:
        r = probe("--address", address)
    assert r.returncode == EXIT_NOT_SERVING == 1, (r.stdout, r.stderr)
    assert r.stdout.strip() == "NOT_SERVING"


def test_no_health_service_exits_4():
    with bare_grpc_server(None) as address:
        r = probe("--address", address)
    assert r.returncode == EXIT_RPC_ERROR == 4, (r.stdout, r.stderr)
    assert "UNIMPLEMENTED" in r.stderr


def test_bad_flags_exit_64_not_2():
    r = probe("--no-such-flag")
    assert r.returncode == EXIT_USAGE == 64, (r.stdout, r.stderr)
    r = probe("--tls-ca", "/nonexistent/ca.pem", "--address", f"127.0.0.1:{free_port()}")
    assert r.returncode == EXIT_USAGE, (r.stdout, r.stderr)


def test_help_documents_every_exit_code():
    r = probe("--help")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    for code, word in ((0, "SERVING"), (1, "NOT_SERVING"), (2, "unreachable"), (3, "NOT_FOUND"),
                       (4, "RPC failure"), (64, "command line")):
        assert any(line.lstrip().startswith(f"{code} ") and word in line for line in lines), (code, r.stdout)
