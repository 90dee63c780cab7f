"""The start of every process the router spawns (engines and front-end workers): its settings
arrive as one JSON document on stdin (gdn_server.frontend_pool.spawn_ready writes them)."""
from __future__ import annotations

import json
import logging
import signal
import sys
from dataclasses import asdict
from typing import TypeVar

from gdn_server.tuning import tune_gc, tune_malloc

S = TypeVar("S", bound="JsonSettings")


class JsonSettings:
    """A settings dataclass sent to a child process as JSON."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[S], text: str) -> S:
        return cls(**json.loads(text))


def start_child(settings_type: type[S], name: str) -> S:
    """Process-wide set-up, then the settings from stdin; `name` is a format string of their
    fields ("engine[{device_index}]") that prefixes every log line."""
    tune_malloc()  # before any big buffer: see gdn_server/tuning.py
    tune_gc()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the router decides
    settings = settings_type.from_json(sys.stdin.read())
    label = name.format(**vars(settings))
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,  # type: ignore[attr-defined]
                        format=f"%(asctime)s %(levelname)s {label} %(name)s: %(message)s")
    return settings
