"""The session table: ids, pool slots and per-layer positions.

A session owns one *session slot*; its state for layer l lives at pool row
`slot * num_layers + l` (see `pool_slot`). Positions count the tokens a session has taken at each
layer. `LastStep` remembers the previous step per layer so a retried request (same positions,
same T) is answered again without being applied twice.

Only the scheduler thread mutates positions and last steps; `create`/`release` take the table lock
because they are also called from the gRPC event loop.
"""
from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from gdn_server.errors import NotFound, ResourceExhausted


@dataclass
class LastStep:
    """The previous applied step of one session at one layer."""

    count_before: int  # the session's position at that layer before the step
    tokens: int  # T of the step
    out: bytes | None = None  # the whole request's bf16 output bytes; None while still running
    row: int = 0  # this session's row in that request
    rows: int = 1  # B of that request


@dataclass
class Session:
    id: str
    slot: int
    num_layers: int
    owner: str | None = None  # the identity that created it, where auth is on
    positions: list[int] = field(default_factory=list)
    last_steps: dict[int, LastStep] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = [0] * self.num_layers

    def pool_slot(self, layer: int) -> int:
        return self.slot * self.num_layers + layer


def new_session_id() -> str:
    """128 random bits, URL-safe."""
    return secrets.token_urlsafe(16)


class SessionTable:
    """Live sessions by id, and the free session slots of the state pool."""

    def __init__(self, capacity: int, num_layers: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.num_layers = num_layers
        self._by_id: dict[str, Session] = {}
        # lowest slots first keeps a lightly used pool compact (friendlier to caches)
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_id)

    def create(self, owner: str | None = None, session_id: str | None = None) -> Session:
        """Takes a free slot (whose state is zero) for a new session; ResourceExhausted when full."""
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"no free session capacity: all {self.capacity} sessions are in use")
            sid = session_id or new_session_id()
            if sid in self._by_id:
                raise ValueError(f"session id {sid!r} already exists")
            session = Session(id=sid, slot=self._free.pop(), num_layers=self.num_layers, owner=owner)
            self._by_id[sid] = session
            return session

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise NotFound(f"unknown or closed session {session_id!r}")
        return session

    def remove(self, session_id: str) -> Session:
        """Forgets a session; its slot is not reusable until `free_slot` (after the state is zeroed)."""
        with self._lock:
            session = self._by_id.pop(session_id, None)
        if session is None:
            raise NotFound(f"unknown or closed session {session_id!r}")
        return session

    def free_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._by_id.values())
