"""Starting a server as a child process and reading its address from the line every server of
ours prints once it serves (gdn-server, the echo floor, the bench servers): `listening on HOST:PORT`.

Shared by the bench scripts (each runs with this folder on sys.path, as `python bench/x.py` does).
"""
from __future__ import annotations

import re
import subprocess
import time

LISTENING = re.compile(r"listening on (\S+):(\d+)")


def wait_listening(proc: subprocess.Popen, timeout: float = 600, seen: list[str] | None = None) -> str:
    """HOST:PORT from `proc`'s output (a text pipe), read up to the listening line (the lines
    before it are appended to `seen` if given); the process is killed and RuntimeError raised if
    it ends or `timeout` passes first, with the last lines it wrote (its reason, usually)."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    last: list[str] = []
    for line in proc.stdout:
        if seen is not None:
            seen.append(line)
        m = LISTENING.search(line)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        last = (last + [line.rstrip()])[-12:]
        if time.monotonic() > deadline:
            break
    proc.kill()
    said = "\n  ".join(last) if last else "(nothing)"
    raise RuntimeError(f"server did not start: {' '.join(map(str, proc.args))}\n  its last output:\n  {said}")


def start_listening(cmd: list[str], timeout: float = 600, env: dict[str, str] | None = None,
                    cwd: str | None = None, seen: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `cmd` (its stderr joined to stdout; `env`: its environment, default this process's;
    `cwd`: its working directory, default this process's) and waits for its listening line (the
    lines before it go to `seen` if given)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                            cwd=cwd)
    return proc, wait_listening(proc, timeout, seen)
