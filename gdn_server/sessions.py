"""The session table: ids, session slots, pool rows, positions and the history rings' bookkeeping.

A session owns one *session slot*; its state for layer l lives at *pool row*
`slot * num_layers + l` (`Session.home_row`), beside that row's *history ring* of RING entries
(gdn_server/backends/base.py: what an entry holds). Positions count the tokens a session has
taken at each layer. `LastStep` remembers the previous step per layer so a retried request (same
positions, T, speculative flag and inputs) is answered again without being applied twice.

The ring, per (session, layer): P (`Session.hist`) is how many entries are committed, i.e. part
of the session's state though not yet folded into the pool row. A speculative step (a *draft*,
`Draft`) of T tokens writes entries [base, base + T), base = folded_base(P, T): P, or 0 where
P + T would overflow the ring and the backend folds the P entries into the state first. Then:

    Commit(n)            P = base + n (bookkeeping only: no launch)
    a next step there    accepts the open draft whole first: P = base + T
    the draft dropped    P = base (--speculative-timeout-s; entries past P are garbage)
    a plain step         the backend folds P entries into the state first; P = 0
    a plain step, run    its entries are appended as a draft's and committed at once:
      as a verify        P = folded_base(P, T) + T (which launches: planner.Planner._through_ring)
    fork, export, read   `Backend.fold` first (`hist_rows` / `folded`), then the state as it is

Every change of a session's record is a method of `SessionTable` (creation, removal, a step
queued or failed, a Commit, drafts dropped, rings folded): the planner only reads records to
compute a step's rows and each row's P, and applies them through the table once the backend has
queued the step. Only the scheduler's rounds call those methods; `create`/`remove` take the table
lock because they are also called from the gRPC event loop.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter

from gdn_client.proto.ids import process_of, process_prefix
from gdn_server.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, WrongProcess
from gdn_server.kernels import folded_base
from gdn_server.limits import MAX_EVICTED_IDS


class StepRecord:
    """One applied decode request: T, its sessions' count and, once the step has finished, its
    whole bf16 output. Every session of the request points at the same record (`LastStep`), so
    the output is set once for all of them, and each step keeps its own even when a later step of
    the same session and layer is already queued behind it."""

    __slots__ = ("tokens", "rows", "speculative", "out")

    def __init__(self, tokens: int, rows: int, speculative: bool = False,
                 out: bytes | memoryview | None = None) -> None:
        self.tokens = tokens  # T of the step
        self.rows = rows  # rows of `out`
        self.speculative = speculative  # a draft: a retry must be one too
        self.out = out  # the output bytes of those rows (a view in its reply); None while the step runs


class LastStep:
    """The previous applied step of one session at one layer (what a retry is answered from).
    One per (session, layer), rewritten in place by each later step there
    (`SessionTable.steps_queued`: a B = 256 request makes no object per session); read it where
    it is needed, never keep it across steps."""

    __slots__ = ("count_before", "record", "row", "digest")

    def __init__(self, count_before: int, record: StepRecord, row: int = 0, digest: int | None = None) -> None:
        self.count_before = count_before  # the session's position at that layer before the step
        self.record = record
        self.row = row  # this session's row in the record's output
        self.digest = digest  # this session's inputs of the step, as first sent (validation.checked_digests)

    @property
    def tokens(self) -> int:
        return self.record.tokens

    @property
    def rows(self) -> int:
        return self.record.rows

    @property
    def out(self) -> bytes | memoryview | None:
        return self.record.out


@dataclass
class Draft:
    """An uncommitted speculative step of one session at one layer: its ring entries
    [base, base + tokens)."""

    base: int  # committed entries the step kept before its own (folded_base of P at launch)
    tokens: int  # T
    count_before: int  # position at that layer before the step


@dataclass
class Session:
    id: str
    slot: int  # session slot: the session's index in the table (not a pool row)
    num_layers: int
    owner: str | None = None  # the identity that created it, where auth is on
    quota_key: str | None = None  # whose quota it counts against: the owner, or without auth the peer
    positions: list[int] = field(default_factory=list)
    last_steps: dict[int, LastStep] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)
    # committed ring entries P per layer; while a draft is open there, its base
    hist: list[int] = field(default_factory=list)
    drafts: dict[int, Draft] = field(default_factory=dict)  # layer -> uncommitted speculative step
    # the pool row of every layer, slot * num_layers + layer, made once: home_row and the planner
    # read it (the product, or a method call, costs twice the lookup in a B = 256 request)
    pool_rows: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = [0] * self.num_layers
        if not self.hist:
            self.hist = [0] * self.num_layers
        self.pool_rows = tuple(range(self.slot * self.num_layers, (self.slot + 1) * self.num_layers))

    def home_row(self, layer: int) -> int:
        """The pool row of the session's state at `layer`."""
        return self.pool_rows[layer]

    def launch_hist(self, layer: int) -> int:
        """The ring entries a next step at `layer` reads as committed: P, and an open draft's
        tokens (a next step accepts it whole: `SessionTable.steps_queued`)."""
        draft = self.drafts.get(layer) if self.drafts else None
        return self.hist[layer] if draft is None else draft.base + draft.tokens

    def has_running_step(self) -> bool:
        """Some step of the session is queued on the device and not finished (its output unset)."""
        return any(last.record.out is None for last in self.last_steps.values())

    def check_owner(self, identity: str | None) -> None:
        """PermissionDenied unless `identity` created this session (both None where auth is off)."""
        if self.owner != identity:
            raise PermissionDenied(f"session {self.id!r} belongs to another client")


def new_session_id() -> str:
    """128 random bits, URL-safe."""
    return secrets.token_urlsafe(16)


class ProcessHomes:
    """Where sessions live when a host runs several server processes (gdn-server --processes):
    this process's index and every process's port. A session's id names its process,
    "p<index>.<random>", so any process can tell a client where a session it lacks lives."""

    def __init__(self, index: int, ports: tuple[int, ...]) -> None:
        self.index = index
        self.ports = ports

    @property
    def prefix(self) -> str:
        return process_prefix(self.index)

    def elsewhere(self, session_id: str) -> WrongProcess | None:
        """The error for a session id that names another process of this host, else None."""
        index = process_of(session_id)
        if index is None or index == self.index or index >= len(self.ports):
            return None
        return WrongProcess(session_id, index, self.ports[index], self.index, self.ports[self.index])


class OwnerQuota:
    """Sessions held per identity, against `--max-sessions-per-client`; one is shared by every
    device's table, so the limit holds for the whole server."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # None: no limit
        self._held: dict[str | None, int] = {}
        self._lock = threading.Lock()

    def take(self, owner: str | None, *, enforce: bool = True) -> None:
        with self._lock:
            held = self._held.get(owner, 0)
            if enforce and self.limit is not None and held >= self.limit:
                raise ResourceExhausted(f"this client already holds {held} sessions, the most one client may hold")
            self._held[owner] = held + 1

    def give(self, owner: str | None) -> None:
        with self._lock:
            left = self._held.pop(owner, 1) - 1
            if left:
                self._held[owner] = left


class SessionTable:
    """Live sessions by id, and the free session slots of the state pool."""

    def __init__(
        self, capacity: int, num_layers: int, quota: OwnerQuota | None = None, homes: ProcessHomes | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.num_layers = num_layers
        self.quota = quota if quota is not None else OwnerQuota()
        self.homes = homes  # several processes on this host: ids name this one
        self._by_id: dict[str, Session] = {}
        self._evicted: OrderedDict[str, str] = OrderedDict()  # id -> why it was evicted
        # lowest slots first keeps a lightly used pool compact (friendlier to caches)
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_id)

    def create(
        self, owner: str | None = None, session_id: str | None = None, *, restoring: bool = False,
        quota_key: str | None = None,
    ) -> Session:
        """Takes a free slot (whose state is zero) for a new session; ResourceExhausted when full.

        `quota_key`: whose `--max-sessions-per-client` count it goes to (default: the owner).
        `restoring` (a snapshot on start) skips that limit: those sessions already existed.
        """
        quota_key = owner if quota_key is None else quota_key
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"no free session capacity: all {self.capacity} sessions are in use")
            sid = session_id or (self.homes.prefix if self.homes is not None else "") + new_session_id()
            if sid in self._by_id:
                raise ValueError(f"session id {sid!r} already exists")
            self.quota.take(quota_key, enforce=not restoring)
            session = Session(
                id=sid, slot=self._free.pop(), num_layers=self.num_layers, owner=owner, quota_key=quota_key
            )
            self._by_id[sid] = session
            return session

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def was_evicted(self, session_id: str) -> bool:
        return session_id in self._evicted

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise self._not_found(session_id)
        return session

    def get_all(self, session_ids: tuple[str, ...]) -> list[Session]:
        """The sessions of `session_ids`, in order (`get` of each, in one pass: one itemgetter
        call, which returns a tuple of two or more)."""
        try:
            if len(session_ids) == 1:
                return [self._by_id[session_ids[0]]]
            return list(itemgetter(*session_ids)(self._by_id))
        except KeyError:
            for sid in session_ids:
                self.get(sid)  # raises for the first one unknown
            raise

    def _not_found(self, session_id: str) -> NotFound | WrongProcess:
        if self.homes is not None:
            elsewhere = self.homes.elsewhere(session_id)
            if elsewhere is not None:
                return elsewhere
        reason = self._evicted.get(session_id)
        if reason is not None:
            return NotFound(f"session {session_id!r} was evicted: {reason}")
        return NotFound(f"unknown or closed session {session_id!r}")

    def evict(self, session_id: str, reason: str) -> Session:
        """`remove`, remembering why: later lookups of the id answer NotFound with `reason`."""
        session = self.remove(session_id)
        with self._lock:
            self._evicted[session_id] = reason
            while len(self._evicted) > MAX_EVICTED_IDS:
                self._evicted.popitem(last=False)
        return session

    def remove(self, session_id: str) -> Session:
        """Forgets a session; its slot is not reusable until `free_slot` (after the state is zeroed)."""
        with self._lock:
            session = self._by_id.pop(session_id, None)
            if session is not None:
                self.quota.give(session.quota_key)
        if session is None:
            raise self._not_found(session_id)
        return session

    # -- a session's record changes as its steps are queued, fail or are settled ----------------
    def steps_queued(
        self, sessions: list[Session], layer: int, record: StepRecord, digests: tuple[int, ...], now: float,
        hists: list[int], in_ring: bool = False,
    ) -> tuple[int, ...]:
        """A step of `sessions` at `layer` (session i is row i of `record`, its inputs digested as
        digests[i], where given), launched with hists[i] committed ring entries
        (`Session.launch_hist`), is queued on the device: for each session an open draft at the
        layer is accepted whole, the position moves by the step's tokens, the step becomes the one
        a retry is answered from; a draft (`record.speculative`) is open until Commit, its entries
        after folded_base(hist, T); a plain step leaves the ring folded (P = 0), or, launched as a
        verify (`in_ring`), its entries committed after the others (P = folded_base(hist, T) + T).
        Returns the new positions. One call per request, which makes no LastStep per session (each
        is rewritten in place): a B = 256 plain step spends ~0.2 us a session here."""
        tokens = record.tokens
        after = []
        row = 0
        for session, digest in zip(sessions, digests or repeat(None)):  # B digests, where given
            positions = session.positions
            before = positions[layer]
            positions[layer] = count = before + tokens
            after.append(count)
            last = session.last_steps.get(layer)
            if last is None:
                session.last_steps[layer] = LastStep(before, record, row, digest)
            else:
                last.count_before, last.record, last.row, last.digest = before, record, row, digest
            row += 1
            session.last_used = now
        if record.speculative:
            for session, hist, count in zip(sessions, hists, after):
                base = folded_base(hist, tokens)
                session.drafts[layer] = Draft(base, tokens, count - tokens)
                session.hist[layer] = base
        else:
            for session, hist in zip(sessions, hists):
                if session.drafts:
                    session.drafts.pop(layer, None)
                session.hist[layer] = folded_base(hist, tokens) + tokens if in_ring else 0
        return tuple(after)

    def step_failed(self, session: Session, layer: int, record: StepRecord, hist: int) -> None:
        """Undoes `steps_queued` for a step whose launch failed after it was queued: position, last
        step and its draft; P is what the step was launched with (an open draft it accepted stays
        accepted: an earlier launch wrote its entries)."""
        last = session.last_steps.get(layer)
        if last is not None and last.record is record:
            session.positions[layer] = last.count_before
            del session.last_steps[layer]
            session.drafts.pop(layer, None)
            session.hist[layer] = hist

    def commit(self, session: Session, accepted: int, now: float) -> list[int]:
        """Settles every open draft of `session` to its first `accepted` tokens (InvalidArgument,
        and nothing changed, when a draft has fewer): P = base + accepted, the position that of
        the accepted prefix. Bookkeeping only: the accepted entries are in the ring already, the
        others are past P. Returns the layers settled."""
        drafts = dict(sorted(session.drafts.items()))
        too_many = {layer: d.tokens for layer, d in drafts.items() if accepted > d.tokens}
        if too_many:
            raise InvalidArgument(f"accepted = {accepted} is more than the speculative step's T at layer(s) {too_many}")
        for layer, draft in drafts.items():
            del session.drafts[layer]
            session.hist[layer] = draft.base + accepted
            if accepted < draft.tokens:
                session.positions[layer] = draft.count_before + accepted
                session.last_steps.pop(layer, None)  # that step's output no longer describes the state
        session.last_used = now
        return list(drafts)

    def drop_drafts(self, session: Session) -> None:
        """Forgets every open draft of `session`, as if it had never been sent: positions go back,
        P to the draft's base."""
        for layer, draft in list(session.drafts.items()):
            session.hist[layer] = draft.base
            session.positions[layer] = draft.count_before
            session.last_steps.pop(layer, None)
            del session.drafts[layer]

    def hist_rows(self, session: Session) -> tuple[list[int], list[int]]:
        """(pool rows, committed entries P) of every layer of `session`: what `Backend.fold`
        takes before the session's state is read or copied as a whole; then `folded`."""
        return list(session.pool_rows), list(session.hist)

    def folded(self, session: Session) -> None:
        """Every layer's committed entries are in the state now (`Backend.fold`): P = 0."""
        session.hist = [0] * session.num_layers

    def with_drafts(self) -> list[Session]:
        """Sessions with an open draft (a read-only look; safe from any thread)."""
        return [s for s in self.sessions() if s.drafts]

    def free_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._by_id.values())
