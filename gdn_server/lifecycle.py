"""Session operations that touch the state pool: fork, export, import and idle eviction.

Each function here changes or reads session state, so it must run on the scheduler thread as a
control item (`Scheduler.submit_control`): after every earlier decode step has finished, before
any later one, with no step in flight. The servicer and the server only queue them.

Invariant kept by all of them: a free slot holds a zero state (a slot is zeroed before it goes
back to the free list), and a failed operation leaves no half-made session behind.
"""
from __future__ import annotations

import logging
import time

from gdn_server.backends import Backend
from gdn_server.sessions import Session, SessionTable
from gdn_server.state_transfer import SessionState

log = logging.getLogger(__name__)


def _discard(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Undoes a half-made session: zero its slot, return it."""
    sessions.remove(session.id)
    backend.reset_session(session.slot)
    sessions.free_slot(session.slot)


def fork_session(sessions: SessionTable, backend: Backend, source_id: str, identity: str | None = None) -> Session:
    """A new session of `identity` whose states (every layer) and positions are copies of
    `source_id`'s (which `identity` must own, where auth is on)."""
    source = sessions.get(source_id)
    source.check_owner(identity)
    child = sessions.create(owner=identity)
    try:
        backend.copy_session(source.slot, child.slot)  # device-side copy on the GPU
    except BaseException:
        _discard(sessions, backend, child)
        raise
    child.positions = list(source.positions)
    source.last_used = child.last_used = time.monotonic()
    return child


def export_session(sessions: SessionTable, backend: Backend, session_id: str, identity: str | None = None) -> SessionState:
    """A CPU copy of a session's state and positions."""
    session = sessions.get(session_id)
    session.check_owner(identity)
    state = backend.read_session(session.slot).contiguous()
    session.last_used = time.monotonic()
    return SessionState(state, tuple(session.positions))


def import_session(
    sessions: SessionTable,
    backend: Backend,
    state: SessionState,
    owner: str | None = None,
    session_id: str | None = None,
) -> Session:
    """A new session holding `state` (ResourceExhausted when the pool is full)."""
    session = sessions.create(owner=owner, session_id=session_id)
    try:
        backend.write_session(session.slot, state.state)
    except BaseException:
        _discard(sessions, backend, session)
        raise
    session.positions = list(state.positions)
    session.last_used = time.monotonic()
    return session


def idle_sessions(sessions: SessionTable, timeout_s: float, now: float | None = None) -> list[str]:
    """Ids of sessions unused for longer than `timeout_s` (a read-only look; safe from any thread)."""
    now = time.monotonic() if now is None else now
    return [s.id for s in sessions.sessions() if now - s.last_used > timeout_s]


def evict_idle(sessions: SessionTable, backend: Backend, timeout_s: float) -> list[str]:
    """Closes every session idle for longer than `timeout_s`; they answer NOT_FOUND saying so."""
    evicted = []
    for sid in idle_sessions(sessions, timeout_s):
        session = sessions.evict(sid, f"it was idle for more than {timeout_s:g} s (--session-idle-timeout-s)")
        backend.reset_session(session.slot)
        sessions.free_slot(session.slot)
        evicted.append(sid)
    if evicted:
        log.info("evicted %d idle session(s) (idle > %g s)", len(evicted), timeout_s)
    return evicted
