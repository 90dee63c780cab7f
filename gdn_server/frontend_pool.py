"""The router's side of `--frontends N` workers: reserve the public port, start the workers,
restart one that dies, and stop them first on shutdown (their in-flight calls still reach the
engines). `spawn_ready` starts engine processes too."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from typing import Callable

from gdn_server.frontend import FrontendSettings

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0  # a cold start imports torch and grpc; an engine also compiles its kernels
MIN_UPTIME_S = 10.0  # a worker that dies sooner than this twice in a row is not restarted again


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Binds (not listens) a SO_REUSEPORT socket on host:port; returns it and the port.

    It fails like a server would when someone else holds the port, turns port 0 into a real
    one for the workers to share, and keeps that port ours while workers come and go."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    # A plain bind first: SO_REUSEPORT alone would happily share the port with another server
    # of this user that has workers too. SO_REUSEADDR only lets it pass old TIME_WAIT connections.
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
        address = (address[0], probe.getsockname()[1], *address[2:])
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock, sock.getsockname()[1]


class FrontendPool:
    """N front-end worker processes (`python -m gdn_server.frontend`)."""

    def __init__(self, count: int, settings_for: Callable[[int], FrontendSettings]) -> None:
        self.count = count
        self._settings_for = settings_for
        self._procs: list[asyncio.subprocess.Process | None] = [None] * count
        self._watchers: list[asyncio.Task] = []
        self._stopping = False

    async def start(self) -> None:
        """Starts every worker and returns once all of them serve; raises if one cannot."""
        try:
            for i in range(self.count):
                self._procs[i] = await self._spawn(i)
        except BaseException:
            await self.stop(0)
            raise
        self._watchers = [asyncio.create_task(self._watch(i)) for i in range(self.count)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None and p.returncode is None]

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        settings = self._settings_for(index)
        env = dict(os.environ)
        if settings.metrics_dir:  # read by prometheus_client when the worker imports it
            env["PROMETHEUS_MULTIPROC_DIR"] = settings.metrics_dir
        return await spawn_ready("gdn_server.frontend", settings.to_json(), f"front end {index}", env)

    async def _watch(self, index: int) -> None:
        """Restarts worker `index` when it dies (the engines and every session are unaffected)."""
        quick_deaths = 0
        while True:
            proc = self._procs[index]
            started = time.monotonic()
            code = await proc.wait()
            if self._stopping:
                return
            quick_deaths = quick_deaths + 1 if time.monotonic() - started < MIN_UPTIME_S else 0
            if quick_deaths >= 2:
                log.error("front end %d keeps dying (exit code %d); not restarting it", index, code)
                return
            log.error("front end %d exited with code %d; restarting it", index, code)
            try:
                self._procs[index] = await self._spawn(index)
            except RuntimeError as e:
                log.error("%s", e)
                return

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to every worker (each finishes its in-flight calls within grace_s), then wait."""
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        procs = [p for p in self._procs if p is not None and p.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), grace_s + 5.0)
            except asyncio.TimeoutError:
                log.error("front end (pid %d) did not stop in time; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def spawn_ready(module: str, settings_json: str, name: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    """Starts `python -m module` with its settings on stdin; returns once it prints `ready`.
    RuntimeError (and the process killed) if it exits or stays silent instead."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )
    try:
        proc.stdin.write(settings_json.encode())
        await proc.stdin.drain()
        proc.stdin.close()
        line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
    except asyncio.TimeoutError:
        line = b""
    except BaseException:  # cancelled (the server is stopping) or the pipe broke: leave no orphan
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    if line.strip() != b"ready":
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        code = await proc.wait()
        raise RuntimeError(f"{name} did not start (exit code {code}; its log is above)")
    return proc


def private_socket_dir() -> str:
    """A fresh directory only this user can enter, for the server's Unix sockets."""
    path = tempfile.mkdtemp(prefix="gdn-engine-")
    os.chmod(path, 0o700)
    return path
