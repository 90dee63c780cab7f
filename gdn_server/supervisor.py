"""`gdn-server --processes K`: K plain server processes per device on one host, and a small
supervisor over them.

One server process is bound by Python's per-message gRPC work long before its GPU is: several
processes sharing the GPU serve more steps per second than one (docs/performance.md). Each
process here is exactly the server of one process (gdn_server.server), on a port of its own,
with its own share of the device's memory and its own snapshot directory. No process talks to
another: a session lives in the process that created it, and its id names that process
("p<index>.<random>"). ModelInfo lists every process's port, so gdn_client sends each session's
calls to its home; a client that sends them elsewhere gets FAILED_PRECONDITION naming the port.

The supervisor starts the processes (ports PORT, PORT+1, ... or free ones with --port 0), prints
where each listens and then `listening on HOST:PORT` of the first once all of them serve, restarts
a process that dies (its sessions are lost unless it wrote a snapshot), and forwards SIGTERM and
SIGINT, so that each process drains and writes its snapshot. It exits with the worst exit status
of its processes.

Processes that share a GPU do so through NVIDIA's Multi-Process Service (MPS), which the
supervisor starts for them: without it the GPU runs one process's work at a time and switches
between them, and K processes each launching a few rows serve fewer steps per second than one
process (bench/DECISIONS.md, entry 22). An operator who runs MPS already sets
CUDA_MPS_PIPE_DIRECTORY, and the processes then use that daemon.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_LISTENING = re.compile(r"^listening on (\S+):(\d+)")
RESTART_DELAY_S = 1.0  # before restarting a process that died; doubled for each quick death
MAX_RESTART_DELAY_S = 30.0
# How long a process may take to drain and write its snapshot after SIGTERM before it is killed:
# long, since a GPU's full pool takes minutes to write, and an orchestrator's own grace period is
# the bound that matters (Kubernetes kills the whole pod when it ends).
STOP_TIMEOUT_S = 3600.0
STABLE_AFTER_S = 60.0  # a process that served this long is fine again: the next restart is quick
# the extra flags of each process: its place among its peers, and every peer's port
CHILD_FLAGS = ("--process-index", "--process-ports")
_PR_SET_PDEATHSIG = 1  # prctl option of <linux/prctl.h>
MPS_CONTROL = "nvidia-cuda-mps-control"  # NVIDIA's MPS daemon, installed with the driver's utilities
MPS_TIMEOUT_S = 30.0  # to start the daemon, or to have it quit
MAX_AUTO_PROCESSES = 8  # per GPU, for --processes auto


@dataclass
class _Child:
    index: int
    device: int | None  # None: the CPU
    port: int
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    listening: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0


def free_ports(host: str, count: int) -> list[int]:
    """`count` ports free on `host` right now (bound and released at once)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` without `flags` and their values (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def child_argvs(argv: list[str], host: str, port: int, processes: int, devices: list[int] | None,
                state_dir: str | None, metrics_port: int | None) -> list[_Child]:
    """Each process's command line: the supervisor's own flags, with its port, device, snapshot
    directory and metrics port, and its place among its peers."""
    per_device = [None] if devices is None else devices
    count = processes * len(per_device)
    ports = list(range(port, port + count)) if port else free_ports(host, count)
    # each process is told the count (its share of the device's memory), never auto
    base = _without(argv, ("--port", "--devices", "--state-dir", "--metrics-port", "--processes", *CHILD_FLAGS))
    children = []
    for index in range(count):
        device = per_device[index // processes]
        args = [*base, "--processes", str(processes), "--port", str(ports[index]), "--process-index", str(index),
                "--process-ports", ",".join(map(str, ports))]
        if device is not None:
            args += ["--devices", str(device)]
        if state_dir:
            args += ["--state-dir", os.path.join(state_dir, f"process-{index}")]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port + index if metrics_port else 0)]
        children.append(_Child(index, device, ports[index], args))
    return children


class Mps:
    """An MPS control daemon of the supervisor's own, for its processes on the GPUs: `start`
    runs it in a fresh private directory (its pipes and logs), `env` is what the processes need
    to reach it, and `stop` has it quit once they have exited. Its server, which runs the work of
    every process on the GPU at once, starts with the first process that connects."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(directory, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(directory, "log")}

    @classmethod
    def start(cls) -> "Mps | None":
        """The daemon, started; None (logged) where it cannot run here: the processes then share
        the GPU by time slices."""
        if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
            log.info("GPU processes use the MPS daemon of CUDA_MPS_PIPE_DIRECTORY=%s",
                     os.environ["CUDA_MPS_PIPE_DIRECTORY"])
            return None
        control = shutil.which(MPS_CONTROL)
        if control is None:
            log.warning("%s is not installed: the GPU runs one process's work at a time, and few clients over "
                        "many processes serve fewer steps per second (docs/operations.md)", MPS_CONTROL)
            return None
        mps = cls(tempfile.mkdtemp(prefix="gdn-mps-"))
        for path in mps.env.values():
            os.mkdir(path)
        try:
            done = subprocess.run([control, "-d"], env={**os.environ, **mps.env}, capture_output=True, text=True,
                                  timeout=MPS_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            done = subprocess.CompletedProcess([control], -1, "", str(e))
        if done.returncode != 0:
            log.warning("%s -d failed (%s): the GPU runs one process's work at a time (docs/operations.md)",
                        MPS_CONTROL, (done.stderr or done.stdout).strip() or f"exit status {done.returncode}")
            shutil.rmtree(mps.directory, ignore_errors=True)
            return None
        log.info("GPU processes share the GPU through MPS (pipes in %s)", mps.env["CUDA_MPS_PIPE_DIRECTORY"])
        return mps

    def stop(self) -> None:
        try:
            subprocess.run([MPS_CONTROL], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                           text=True, timeout=MPS_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("the MPS daemon did not quit: %s", e)
        shutil.rmtree(self.directory, ignore_errors=True)


class Supervisor:
    def __init__(self, children: list[_Child], host: str, env: dict[str, str] | None = None) -> None:
        self.children = children
        self.host = host
        self.env = {**os.environ, **(env or {})}  # every process's environment (MPS's pipes)
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def _start(self, child: _Child) -> None:
        child.listening.clear()
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "gdn_server", *child.argv],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=self.env,
            preexec_fn=_stop_with_parent,
        )
        child.started = time.monotonic()
        threading.Thread(target=self._relay, args=(child, child.proc), daemon=True).start()

    def _relay(self, child: _Child, proc: subprocess.Popen) -> None:
        """Reprints a process's output under its index, and notes when it listens."""
        where = "cpu" if child.device is None else f"cuda:{child.device}"
        for line in iter(proc.stdout.readline, ""):
            listening = _LISTENING.match(line) is not None
            if listening:
                line = f"process {child.index} ({where}) serving on {self.host}:{child.port}\n"
            else:
                line = f"[process {child.index}] {line}"
            with self._lock:
                sys.stdout.write(line)
                sys.stdout.flush()
            if listening:
                child.listening.set()

    def run(self, start_timeout_s: float = 600.0) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        for child in self.children:
            self._start(child)
        deadline = time.monotonic() + start_timeout_s
        for child in self.children:
            while not child.listening.wait(0.1):
                if child.proc.poll() is not None or time.monotonic() > deadline or self.stopping.is_set():
                    log.error("process %d did not start (exit status %s): stopping every process",
                              child.index, child.proc.poll())
                    return max(self._stop_all(), 2)
        print(f"listening on {self.host}:{self.children[0].port}", flush=True)
        while not self.stopping.wait(0.2):
            for child in self.children:
                if child.proc.poll() is not None:
                    self._restart(child)
        return self._stop_all()

    def _restart(self, child: _Child) -> None:
        status = child.proc.returncode
        quick = time.monotonic() - child.started < STABLE_AFTER_S
        child.restarts = child.restarts + 1 if quick else 0
        delay = min(RESTART_DELAY_S * 2 ** max(child.restarts - 1, 0), MAX_RESTART_DELAY_S)
        log.error("process %d (port %d) exited with status %s: restarting it in %.0f s",
                  child.index, child.port, status, delay)
        if not self.stopping.wait(delay):
            self._start(child)

    def _stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM to every process (each drains and writes its snapshot); returns the worst exit status."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        worst = 0
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                status = child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("process %d did not stop in time: killed", child.index)
                child.proc.kill()
                status = child.proc.wait()
            worst = max(worst, abs(status))
        return worst


def auto_processes(gpus: int, cores: int) -> int:
    """`--processes auto`: processes per GPU for a host of `cores` cores and `gpus` GPUs in use;
    1 on the CPU (`gpus` = 0), whose backend computes on those cores.

    One process per two cores, leaving the other core to the clients and gRPC's threads, and at
    most 8 per GPU: 8 processes sharing a GPU through MPS on a 16-core host served 2.5-4x one
    process from 64 clients to 256 (bench/DECISIONS.md, entry 22); more per GPU were not measured.

    >>> auto_processes(gpus=1, cores=16), auto_processes(gpus=2, cores=16), auto_processes(gpus=1, cores=2)
    (8, 4, 1)
    >>> auto_processes(gpus=0, cores=64)
    1
    """
    if gpus < 1:
        return 1
    return max(1, min(MAX_AUTO_PROCESSES, cores // (2 * gpus)))


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's CPU set, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def supervise(children: list[_Child], host: str, share_gpus: bool) -> int:
    """Runs the processes under a `Supervisor`; with `share_gpus` (several processes per GPU)
    inside an MPS daemon of their own, stopped once they have exited."""
    mps = Mps.start() if share_gpus else None
    try:
        return Supervisor(children, host, mps.env if mps else None).run()
    finally:
        if mps is not None:
            mps.stop()


def _stop_with_parent() -> None:
    """In a new process, before it runs the server: SIGTERM when the supervisor dies (Linux), so a
    killed supervisor leaves no process holding its port and sessions; the process drains and
    writes its snapshot as on any SIGTERM."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError, TypeError):  # not Linux: the processes outlive a killed supervisor
        pass


def device_count() -> int:
    """CUDA devices visible to this host (0 without a GPU)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
