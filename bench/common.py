"""What the serving benchmarks share: a server process and its address, gdn-loadtest runs, and
result files.

Uses public interfaces only (`python -m gdn_server`, gdn-loadtest and its JSON; the scripts add
gdn_client's Client for a server's counters), so a benchmark measures what an operator runs.
Every result file goes to bench/out/ (ignored by git) as <name>-<UTC time>.json, with the date,
the commit and the command line that made it.

The scripts import this as `common` (`python bench/x.py` puts bench/ on sys.path).
"""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
LISTENING = re.compile(r"listening on (\S+):(\d+)")

# `python bench/x.py` then imports this checkout's packages even where none is installed (the
# GPU host runs the tree from a copy, not from an install)
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))


def reference() -> Any:
    """tests/reference.py, the float64 reference math and the kernels' random inputs, which the
    kernel benchmarks check against (a file of the tests, not of an installed package)."""
    spec = importlib.util.spec_from_file_location("gdn_reference", REPO / "tests" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- a server process ---------------------------------------------------------------------------

def server_command(device: str = "cuda", model: str = "--preset qwen3-next --devices 0",
                   max_sessions: int | None = None, flags: str | Sequence[str] = "") -> list[str]:
    """`gdn-server` on 127.0.0.1 and a free port, quiet but for warnings. `model`: shape flags
    (a preset or explicit sizes, and --devices); `flags`: any other gdn-server flags."""
    sizing = [] if max_sessions is None else ["--max-sessions", str(max_sessions)]
    extra = shlex.split(flags) if isinstance(flags, str) else list(flags)
    return [sys.executable, "-m", "gdn_server", "--host", "127.0.0.1", "--port", "0", "--device", device,
            *shlex.split(model), *sizing, "--log-level", "WARNING", *extra]


class Server:
    """A server started as a child process. `start()` returns at once; `wait()` blocks until
    the process prints `listening on HOST:PORT` (gdn-server does once it has compiled its
    kernels and serves) and returns that address. Starting several servers before waiting for
    any lets their warm-ups overlap."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> None:
        self.cmd = list(cmd)
        self.env = env
        self.cwd = REPO if cwd is None else cwd  # `python -m gdn_server` runs the package found there
        self.proc: subprocess.Popen | None = None
        self.target: str | None = None
        self._last: collections.deque[str] = collections.deque(maxlen=20)
        self._ready = threading.Event()  # set at the listening line, or when the output ends

    def start(self) -> "Server":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, env=self.env, cwd=self.cwd)
        # one reader for the process's whole life: a full pipe would block the server
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._last.append(line.rstrip())
            m = LISTENING.search(line) if self.target is None else None
            if m:
                self.target = f"{m.group(1)}:{m.group(2)}"
                self._ready.set()
        self._ready.set()

    def wait(self, timeout: float = 600.0) -> str:
        self._ready.wait(timeout)
        if self.target is not None:
            return self.target
        self.stop()
        said = "\n  ".join(self._last) or "(nothing)"
        raise RuntimeError(f"server did not start within {timeout:.0f} s: {shlex.join(self.cmd)}\n"
                           f"  its last output:\n  {said}")

    def last_output(self) -> list[str]:
        return list(self._last)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Server":
        if self.proc is None:
            self.start()
        if self.target is None:
            self.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- gdn-loadtest -------------------------------------------------------------------------------

def loadtest_command() -> list[str]:
    """How to run gdn-loadtest from this checkout: its own package, gdn_loadtest; a checkout
    that does not have that package yet carries the tool as gdn_client.loadtest."""
    if (REPO / "gdn_loadtest").is_dir() or importlib.util.find_spec("gdn_loadtest") is not None:
        return [sys.executable, "-m", "gdn_loadtest"]
    return [sys.executable, "-m", "gdn_client.loadtest"]


def loadtest_args(target: str, json_path: Path, flags: Iterable[str]) -> list[str]:
    return [*loadtest_command(), "--target", target, "--no-progress", "--json", str(json_path), *flags]


def run_loadtest(target: str, json_path: Path, flags: Iterable[str], timeout: float = 1200.0) -> dict[str, Any]:
    """One gdn-loadtest run (its table goes to this process's output); returns its JSON."""
    cmd = loadtest_args(target, json_path, flags)
    print("$", shown(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=timeout, cwd=REPO)
    return json.loads(json_path.read_text())


def start_loadtest(target: str, json_path: Path, flags: Iterable[str]) -> subprocess.Popen:
    """A gdn-loadtest run in the background (its output discarded but for errors)."""
    cmd = loadtest_args(target, json_path, flags)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)


def runs(doc: dict[str, Any], kind: str = "gdn") -> list[dict[str, Any]]:
    """The runs of one kind ("gdn" or "echo") in a gdn-loadtest JSON document."""
    return [r for r in doc.get("runs", []) if r.get("kind") == kind]


def rows_per_launch(run: dict[str, Any]) -> float:
    return (run.get("server") or {}).get("mean_rows_per_launch", float("nan"))


# -- result files -------------------------------------------------------------------------------

def git_commit() -> str:
    """The checkout's commit (with -dirty when tracked files differ from it). A copy of the
    tree without its .git says "unknown" unless BENCH_COMMIT names the commit it was made from."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BENCH_COMMIT", "unknown")


def utc_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def out_path(name: str, out_dir: str | Path | None = None, suffix: str = ".json") -> Path:
    """bench/out/<name>-<UTC time><suffix> (or the same under `out_dir`); the folder is made."""
    folder = Path(out_dir) if out_dir is not None else OUT
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{utc_stamp()}{suffix}"


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """`payload` with the date, the commit and this process's command line in front of it."""
    doc = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"), "commit": git_commit(),
           "command": shlex.join(["python", *sys.argv]), **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def shown(cmd: Sequence[str]) -> str:
    """A command line as a person would type it: `python` for this interpreter's path."""
    return shlex.join(["python" if a == sys.executable else a for a in cmd])


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ",.0f") -> str:
    """A number for a table cell; "-" for a missing or NaN one."""
    if value is None or value != value:
        return "-"
    return format(value, spec)
