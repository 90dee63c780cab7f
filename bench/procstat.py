"""CPU seconds of a process or thread from Linux /proc: one reader for the bench scripts that
measure where a host's cores go (ab_live.py, h2_floor.py)."""
from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def stat_fields(path: str | Path) -> list[str] | None:
    """The fields of a /proc/.../stat file after the command's name (so [0] is the state, [1] the
    parent pid), or None when the process or thread is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def cpu_s(fields: list[str]) -> float:
    """User plus system CPU seconds from `stat_fields`' fields."""
    return (int(fields[11]) + int(fields[12])) / TICK
