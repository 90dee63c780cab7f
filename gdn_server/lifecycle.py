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
from gdn_server.work import DecodeWork, StepBatch
from gdn_server.state_transfer import SessionState

log = logging.getLogger(__name__)


def _discard(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Undoes a half-made session: zero its slot, return it."""
    sessions.remove(session.id)
    backend.reset_session(session.slot)
    sessions.free_slot(session.slot)


def bring_home(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Moves accepted speculative states from scratch rows back to the session's home rows, so
    `slot`-wide operations (copy, read) see every layer's committed state."""
    if not session.accepted_rows:
        return
    backend.copy_rows(*sessions.rows_away(session))
    sessions.came_home(session)


def settled(sessions: SessionTable, backend: Backend, session: Session) -> Session:
    """The session with every state home; FailedPrecondition while a draft is open."""
    if session.drafts:
        raise FailedPrecondition(
            f"session {session.id!r} has an uncommitted speculative step at layer(s) "
            f"{sorted(session.drafts)}: Commit it first"
        )
    bring_home(sessions, backend, session)
    return session


def drop_speculation(sessions: SessionTable, backend: Backend, session: Session) -> None:
    """Forgets open drafts (as if never sent) and brings states home: what a snapshot saves, so
    a restart never resumes a half-committed session."""
    sessions.drop_drafts(session)
    bring_home(sessions, backend, session)


def commit_speculation(
    sessions: SessionTable, backend: Backend, session_id: str, accepted: int, identity: str | None = None
) -> tuple[list[int], list[int]]:
    """Settles every open draft of a session to its first `accepted` tokens.

    Fully accepted: the scratch row the draft wrote is the committed state (no copy). Partly
    accepted: the scratch row is dropped and the first `accepted` tokens are replayed from the
    untouched starting state, all layers in one backend call (one extra plain step at most).
    Returns (positions per layer, the layers settled). Atomic: a bad `accepted` changes nothing.
    """
    session = sessions.get(session_id)
    session.check_owner(identity)
    layers = sorted(session.drafts)
    replay = StepBatch(accepted)
    for layer, draft in sessions.commit(session, accepted, time.monotonic()):
        q, k, v, a, b = (t[:, :accepted] for t in draft.inputs)
        work = DecodeWork(layer, (session.id,), q=q, k=k, v=v, a=a, b=b, positions=None)
        replay.add(work, [draft.read_row])
    if replay.rows:
        backend.submit(replay).result()  # writes the replayed states in place, at their read rows
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
    """Sessions holding scratch rows (open drafts, or accepted states not yet home) and unused for
    longer than `timeout_s` (a read-only look; safe from any thread)."""
    now = time.monotonic()
    return [s for s in sessions.sessions() if (s.drafts or s.accepted_rows) and now - s.last_used > timeout_s]


def release_stale_speculation(sessions: SessionTable, backend: Backend, timeout_s: float) -> list[str]:
    """Settles the scratch rows of every `stale_speculation` session: its open speculative steps
    are dropped, as if never sent (their positions go back), and accepted states go home, so a
    client that leaves drafts open does not hold scratch rows for ever. Returns their ids."""
    settled_ids = []
    for session in stale_speculation(sessions, timeout_s):
        drop_speculation(sessions, backend, session)
        settled_ids.append(session.id)
    if settled_ids:
        log.info("released the speculative scratch rows of %d session(s) unused for %g s", len(settled_ids), timeout_s)
    return settled_ids


def evict_idle(sessions: SessionTable, backend: Backend, timeout_s: float) -> list[str]:
    """Closes every session idle for longer than `timeout_s`; they answer NOT_FOUND saying so."""
    evicted = []
    for sid in idle_sessions(sessions, timeout_s):
        session = sessions.evict(sid, f"it was idle for more than {timeout_s:g} s (--session-idle-timeout-s)")
        # evict() returned its scratch rows; its own rows are zeroed below
        backend.reset_session(session.slot)
        sessions.free_slot(session.slot)
        evicted.append(sid)
    if evicted:
        log.info("evicted %d idle session(s) (idle > %g s)", len(evicted), timeout_s)
    return evicted
