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
    """Starts a real server process and yields it once it accepts requests (CUDA servers compile
    their kernels first: give them a longer `timeout`)."""
    cmd = [sys.executable, "-m", "gdn_server", "--host", "127.0.0.1", "--port", "0", *flags]
    if "--device" not in flags:
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
