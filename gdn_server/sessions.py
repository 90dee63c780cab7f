"""The session table: ids, session slots, pool rows and per-layer positions.

A session owns one *session slot*; its state for layer l lives at *pool row*
`slot * num_layers + l`, its *home row* (`Session.home_row`). Positions count the tokens a session
has taken at each layer. `LastStep` remembers the previous step per layer so a retried request
(same positions, T, speculative flag and inputs) is answered again without being applied twice.

Speculative steps (drafts) write into *scratch rows* after the sessions' home rows, so the state
before the step survives until `Commit`: a `Draft` records such a step per layer. A fully
accepted draft leaves the committed state in its scratch row (`Session.accepted_rows`) until the
next plain step at that layer writes it back home, so acceptance costs no extra copy.

Every change of a session's record is a method of `SessionTable` (creation, removal, a step
queued or failed, a Commit, drafts dropped, states brought home): the planner only reads records
to compute a step's rows, and applies them through the table once the backend has queued the
step. Only the scheduler's rounds call those methods; `create`/`remove` take the table lock
because they are also called from the gRPC event loop.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gdn_client.proto.ids import process_of, process_prefix
from gdn_server.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted, WrongProcess
from gdn_server.limits import MAX_EVICTED_IDS, MAX_SCRATCH_FRACTION_PER_CLIENT


class StepRecord:
    """One applied decode request: T, its sessions' count and, once the step has finished, its
    whole bf16 output. Every session of the request points at the same record (`LastStep`), so
    the output is set once for all of them, and each step keeps its own even when a later step of
    the same session and layer is already queued behind it."""

    __slots__ = ("tokens", "rows", "speculative", "out")

    def __init__(self, tokens: int, rows: int, speculative: bool = False, out: bytes | None = None) -> None:
        self.tokens = tokens  # T of the step
        self.rows = rows  # rows of `out`
        self.speculative = speculative  # a draft: a retry must be one too
        self.out = out  # the output bytes of those rows; None while the step runs


class LastStep:
    """The previous applied step of one session at one layer (what a retry is answered from)."""

    __slots__ = ("count_before", "record", "row", "digest")

    def __init__(self, count_before: int, record: StepRecord, row: int = 0, digest: int | None = None) -> None:
        self.count_before = count_before  # the session's position at that layer before the step
        self.record = record
        self.row = row  # this session's row in the record's output
        self.digest = digest  # this session's inputs of the step, as first sent (validation.row_digests)

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
    """An uncommitted speculative step of one session at one layer."""

    row: int  # scratch row holding the state after all T tokens
    read_row: int  # row holding the committed state the step started from (left untouched)
    tokens: int  # T
    count_before: int  # position at that layer before the step
    inputs: tuple[torch.Tensor, ...]  # this session's q, k, v, a, b of the step, each [1, T, ...]


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
    accepted_rows: dict[int, int] = field(default_factory=dict)  # layer -> scratch row holding its committed state
    drafts: dict[int, Draft] = field(default_factory=dict)  # layer -> uncommitted speculative step

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = [0] * self.num_layers

    def home_row(self, layer: int) -> int:
        """The pool row of the session's own state at `layer`."""
        return self.slot * self.num_layers + layer

    def committed_row(self, layer: int) -> int:
        """The pool row a next step at `layer` reads: where the state after every token taken at
        that layer lives (an open draft counts as accepted, as a next step accepts it)."""
        if self.drafts and layer in self.drafts:
            return self.drafts[layer].row
        home = self.slot * self.num_layers + layer
        return self.accepted_rows.get(layer, home) if self.accepted_rows else home

    def superseded_rows(self, layer: int, speculative: bool) -> list[int]:
        """The scratch rows a next step at `layer` frees once it is queued: the row an open draft
        started from (its state is replaced by the draft's, accepted), and for a plain step the
        row holding the committed state, which the step writes home."""
        rows = []
        home = self.slot * self.num_layers + layer
        draft = self.drafts.get(layer) if self.drafts else None
        if draft is not None and draft.read_row != home:
            rows.append(draft.read_row)
        if not speculative:
            current = self.committed_row(layer)
            if current != home:
                rows.append(current)
        return rows

    def scratch_rows(self) -> list[int]:
        """Every scratch row this session holds."""
        return list(self.accepted_rows.values()) + [d.row for d in self.drafts.values()]

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
        self, capacity: int, num_layers: int, scratch_rows: range = range(0), quota: OwnerQuota | None = None,
        homes: ProcessHomes | None = None,
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
        self._scratch_free = list(reversed(scratch_rows))
        self.scratch_capacity = len(scratch_rows)
        self._scratch_holder: dict[int, str | None] = {}  # scratch row -> who took it
        self._scratch_held: dict[str | None, int] = {}  # who -> scratch rows held
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
        for row in session.scratch_rows():  # a dropped speculative state is never read again
            self.give_scratch(row)
        session.accepted_rows.clear()
        session.drafts.clear()
        return session

    # -- a session's record changes as its steps are queued, fail or are settled ----------------
    def step_queued(
        self, session: Session, layer: int, record: StepRecord, row: int, digest: int | None, now: float,
        read_row: int, write_row: int, inputs: tuple[torch.Tensor, ...] = (),
    ) -> int:
        """A step of `session` at `layer` (row `row` of `record`), reading `read_row` and writing
        `write_row`, is queued on the device: an open draft at the layer is accepted whole, the
        position moves by the step's tokens, the step becomes the one a retry is answered from, a
        draft (`record.speculative`, with its `inputs`) is open until Commit, and the scratch rows
        the step supersedes are free again. Returns the new position."""
        freed = session.superseded_rows(layer, record.speculative)
        draft = session.drafts.pop(layer, None)
        if draft is not None:  # the step reads the draft's state: accepted, as if committed whole
            session.accepted_rows[layer] = draft.row
        before = session.positions[layer]
        after = session.positions[layer] = before + record.tokens
        session.last_steps[layer] = LastStep(before, record, row, digest)
        session.last_used = now
        if record.speculative:
            session.drafts[layer] = Draft(write_row, read_row, record.tokens, before, inputs)
        else:  # a plain step writes the state home
            session.accepted_rows.pop(layer, None)
        for scratch in freed:  # superseded by this step: a later launch may write them again
            self.give_scratch(scratch)
        return after

    def step_failed(self, session: Session, layer: int, record: StepRecord, write_row: int) -> None:
        """Undoes the position, last step and draft of `step_queued` for a step whose launch failed
        after it was queued; its scratch row is free again. (An accepted draft stays accepted:
        its state was written by an earlier launch.)"""
        last = session.last_steps.get(layer)
        if last is not None and last.record is record:
            session.positions[layer] = last.count_before
            del session.last_steps[layer]
        draft = session.drafts.get(layer)
        if draft is not None and draft.row == write_row:
            del session.drafts[layer]
            self.give_scratch(draft.row)

    def commit(self, session: Session, accepted: int, now: float) -> list[tuple[int, Draft]]:
        """Settles every open draft of `session` to its first `accepted` tokens (InvalidArgument,
        and nothing changed, when a draft has fewer). A fully accepted draft's scratch row becomes
        the committed state; a partly accepted one is dropped, its position set to the accepted
        prefix. Returns (layer, dropped draft) for each partly accepted draft with accepted > 0:
        the caller replays those tokens in place at the draft's `read_row`."""
        drafts = dict(sorted(session.drafts.items()))
        too_many = {layer: d.tokens for layer, d in drafts.items() if accepted > d.tokens}
        if too_many:
            raise InvalidArgument(f"accepted = {accepted} is more than the speculative step's T at layer(s) {too_many}")
        replay = []
        for layer, draft in drafts.items():
            del session.drafts[layer]
            if accepted == draft.tokens:
                session.accepted_rows[layer] = draft.row
                if draft.read_row != session.home_row(layer):
                    self.give_scratch(draft.read_row)
                continue
            self.give_scratch(draft.row)
            session.positions[layer] = draft.count_before + accepted
            session.last_steps.pop(layer, None)  # that step's output no longer describes the state
            if accepted:
                replay.append((layer, draft))
        session.last_used = now
        return replay

    def drop_drafts(self, session: Session) -> None:
        """Forgets every open draft of `session`, as if it had never been sent: positions go back,
        the drafts' scratch rows are free."""
        for layer, draft in list(session.drafts.items()):
            self.give_scratch(draft.row)
            session.positions[layer] = draft.count_before
            session.last_steps.pop(layer, None)
            del session.drafts[layer]

    def rows_away(self, session: Session) -> tuple[list[int], list[int]]:
        """(scratch rows, home rows) of the committed states `session` holds away from home, by
        layer: what `came_home` expects the caller to have copied."""
        layers = sorted(session.accepted_rows)
        return [session.accepted_rows[l] for l in layers], [session.home_row(l) for l in layers]

    def came_home(self, session: Session) -> None:
        """The committed states of `rows_away` have been copied home: their scratch rows are free."""
        for layer in list(session.accepted_rows):
            self.give_scratch(session.accepted_rows.pop(layer))

    @property
    def scratch_share(self) -> int:
        """Scratch rows one client may hold at once: MAX_SCRATCH_FRACTION_PER_CLIENT of them, at
        least one speculative session's worth (2 per layer); stale drafts are released after a
        while besides (`--speculative-timeout-s`)."""
        share = int(self.scratch_capacity * MAX_SCRATCH_FRACTION_PER_CLIENT)
        return max(share, min(2 * self.num_layers, self.scratch_capacity))

    def take_scratch_rows(self, n: int, holder: str | None = None) -> list[int]:
        """`n` free scratch rows at once for `holder` (a session's quota key), or
        ResourceExhausted and none."""
        with self._lock:
            if len(self._scratch_free) < n:
                raise ResourceExhausted(
                    f"no free speculative capacity: {len(self._scratch_free)} of {self.scratch_capacity} scratch rows "
                    f"free, {n} needed (--speculative-sessions)"
                )
            held = self._scratch_held.get(holder, 0)
            if held + n > self.scratch_share:
                raise ResourceExhausted(
                    f"this client holds {held} of the {self.scratch_capacity} speculative scratch rows and may hold "
                    f"{self.scratch_share}: Commit its open speculative steps first"
                )
            rows = [self._scratch_free.pop() for _ in range(n)]
            self._scratch_held[holder] = held + n
            for row in rows:
                self._scratch_holder[row] = holder
            return rows

    def scratch_in_use(self) -> int:
        """Scratch rows taken (open drafts, and accepted states not yet home)."""
        return self.scratch_capacity - len(self._scratch_free)

    def give_scratch(self, row: int) -> None:
        with self._lock:
            self._scratch_free.append(row)
            if row in self._scratch_holder:
                holder = self._scratch_holder.pop(row)
                left = self._scratch_held[holder] - 1
                if left:
                    self._scratch_held[holder] = left
                else:
                    del self._scratch_held[holder]

    def free_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._by_id.values())
