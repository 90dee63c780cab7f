"""Real server processes on free loopback ports, for every test that needs one.

`start_server(*flags)` runs `python -m gdn_server --host 127.0.0.1 --port 0 ...`, waits for its
`listening on HOST:PORT` line and stops it with SIGTERM at the end. `tests/conftest.py` builds
the `small_server` fixture on it (3 layers, H=2, HV=4, K=V=128). Tests import this module as
`servers` (pytest's `pythonpath = ["tests"]`).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator


SMALL_MODEL = ("--layers", "3", "--q-heads", "2", "--v-heads", "4", "--head-dim", "128")
# the suite run against the workers' gRPC in C (GDN_TEST_SERVER_FLAGS="... --frontend-transport
# native"): servers that need TLS or the Python decode path (GDN_NATIVE=0) cannot start there
NATIVE_TRANSPORT_MODE = "native" in os.environ.get("GDN_TEST_SERVER_FLAGS", "").replace("=", " ").split()
_LISTENING = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    host: str
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def _pump(stream, sink: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)


@contextlib.contextmanager
def start_server(*flags: str, timeout: float = 60.0, env: dict | None = None) -> Iterator[ServerProcess]:
    """Starts a real server process and yields it once it accepts requests.

    GDN_TEST_SERVER_TIMEOUT raises `timeout` (CUDA servers compile their kernels first)."""
    timeout = max(timeout, float(os.environ.get("GDN_TEST_SERVER_TIMEOUT", 0)))
    cmd = [sys.executable, "-m", "gdn_server", "--host", "127.0.0.1", "--port", "0", *flags]
    extra = os.environ.get("GDN_TEST_SERVER_FLAGS", "").split()  # e.g. "--frontends 2": the suite in that mode
    cmd += extra
    if "--device" not in flags and "--device" not in extra:  # (argparse takes the last --device given)
        cmd += ["--device", "cpu"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    log: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc.stdout, log), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    match = None
    while match is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {cmd}\n{''.join(log)}")
        for line in list(log):
            match = _LISTENING.search(line)
            if match:
                break
        time.sleep(0.02)
    server = ServerProcess(proc, match.group(1), int(match.group(2)), log)
    try:
        yield server
    finally:
        server.stop()
