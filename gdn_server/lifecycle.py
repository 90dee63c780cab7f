"""Session operations that touch the state pool: fork, export, import and idle eviction.

Each function here changes or reads session state, so it must run in the scheduler's rounds as a
control item (`Scheduler.submit_control`): after every earlier decode step has finished, before
any later one, with no step in flight. The servicer and the server only queue them.

Invariant kept by all of them: a free slot holds a zero state (a slot is zeroed before it goes
back to the free list), and a failed operation leaves no half-made session behind.
"""
from __future__ import annotations

import logging
import time

from gdn_server.backends import Backend
from gdn_server.errors import FailedPrecondition, InvalidArgument
from gdn_server.sessions import Session, SessionTable
from gdn_server.state_transfer import SessionState

log = logging.getLogger(__name__)


def _discard(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Undoes a half-made session: zero its slot, return it."""
    sessions.remove(session.id)
    backend.reset_session(session.slot)
    sessions.free_slot(session.slot)


def fold_session(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Folds every layer's committed ring entries into the session's state, so that slot-wide
    operations (copy, read) see them: the export and snapshot formats hold a state alone, and a
    fold is one small launch (bench/DECISIONS.md, entry 4)."""
    if any(session.hist):
        backend.fold(*sessions.hist_rows(session))
        sessions.folded(session)


def settled(sessions: SessionTable, backend: Backend, session: Session) -> Session:
    """The session with its rings folded; FailedPrecondition while a draft is open."""
    if session.drafts:
        raise FailedPrecondition(
            f"session {session.id!r} has an uncommitted speculative step at layer(s) "
            f"{sorted(session.drafts)}: Commit it first"
        )
    fold_session(sessions, backend, session)
    return session


def drop_speculation(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Forgets open drafts (as if never sent) and folds the rings: what a snapshot saves, so a
    restart never resumes a half-committed session."""
    sessions.drop_drafts(session)
    fold_session(sessions, backend, session)


def commit_speculation(
    sessions: SessionTable, session_id: str, accepted: int, identity: str | None = None
) -> tuple[list[int], list[int]]:
    """Settles every open draft of a session to its first `accepted` tokens: bookkeeping of the
    session's rings, no launch. Returns (positions per layer, the
    layers settled). Atomic: a bad `accepted` changes nothing."""
    session = sessions.get(session_id)
    session.check_owner(identity)
    layers = sessions.commit(session, accepted, time.monotonic())
    return list(session.positions), layers


def fork_session(
    sessions: SessionTable, backend: Backend, source_id: str, identity: str | None = None,
    quota_key: str | None = None,
) -> Session:
    """A new session of `identity` whose states (every layer) and positions are copies of
    `source_id`'s (which `identity` must own, where auth is on)."""
    source = sessions.get(source_id)
    source.check_owner(identity)
    settled(sessions, backend, source)
    child = sessions.create(owner=identity, quota_key=quota_key)
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
    settled(sessions, backend, session)
    state = backend.read_session(session.slot).contiguous()
    session.last_used = time.monotonic()
    return SessionState(state, tuple(session.positions))


def import_session(
    sessions: SessionTable,
    backend: Backend,
    state: SessionState,
    owner: str | None = None,
    session_id: str | None = None,
    quota_key: str | None = None,
) -> Session:
    """A new session holding `state` (ResourceExhausted when the pool is full)."""
    session = sessions.create(owner=owner, session_id=session_id, quota_key=quota_key)
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


def stale_speculation(sessions: SessionTable, timeout_s: float) -> list[Session]:
    """Sessions with an open draft and unused for longer than `timeout_s` (a read-only look; safe
    from any thread)."""
    now = time.monotonic()
    return [s for s in sessions.with_drafts() if now - s.last_used > timeout_s]


def release_stale_speculation(sessions: SessionTable, timeout_s: float) -> list[str]:
    """Drops the open drafts of every `stale_speculation` session, as if never sent (their
    positions go back, P to the draft's base): a client that leaves a draft open cannot keep its
    session from being forked or exported, nor a retry of the draft answered, for ever. Returns
    their ids."""
    dropped = []
    for session in stale_speculation(sessions, timeout_s):
        sessions.drop_drafts(session)
        dropped.append(session.id)
    if dropped:
        log.info("dropped the open speculative steps of %d session(s) unused for %g s", len(dropped), timeout_s)
    return dropped


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
