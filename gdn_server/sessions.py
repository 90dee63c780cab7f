"""The session table: ids, pool slots and per-layer positions.

A session owns one *session slot*; its state for layer l lives at pool row
`slot * num_layers + l` (see `pool_slot`). Positions count the tokens a session has taken at each
layer. `LastStep` remembers the previous step per layer so a retried request (same positions,
same T) is answered again without being applied twice.

Speculative steps (draft tokens) write into *scratch rows* after the sessions' own rows, so the
state before the step survives until `Commit`: `Provisional` records such a step per layer. A
fully accepted step leaves the committed state in its scratch row (`scratch_current`) until the
next plain step at that layer writes it back home, so acceptance costs no extra copy.

Only the scheduler's rounds mutate positions, last steps and speculative records; `create`/`remove`
take the table lock because they are also called from the gRPC event loop.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gdn_client.proto.ids import process_of, process_prefix
from gdn_server.errors import NotFound, PermissionDenied, ResourceExhausted, WrongProcess


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
class Provisional:
    """An uncommitted speculative step of one session at one layer."""

    row: int  # scratch row holding the state after all T tokens
    read_row: int  # row holding the committed state the step started from (left untouched)
    tokens: int  # T
    count_before: int  # position at that layer before the step
    inputs: tuple[torch.Tensor, ...]  # this session's q, k, v, a, b of the step, each [1, T, ...]


@dataclass
class Session:
    id: str
    slot: int
    num_layers: int
    owner: str | None = None  # the identity that created it, where auth is on
    quota_key: str | None = None  # whose quota it counts against: the owner, or without auth the peer
    positions: list[int] = field(default_factory=list)
    last_steps: dict[int, LastStep] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)
    scratch_current: dict[int, int] = field(default_factory=dict)  # layer -> scratch row with the committed state
    provisional: dict[int, Provisional] = field(default_factory=dict)  # layer -> uncommitted speculative step

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = [0] * self.num_layers

    def pool_slot(self, layer: int) -> int:
        """The session's own (home) pool row for `layer`."""
        return self.slot * self.num_layers + layer

    def scratch_rows(self) -> list[int]:
        """Every scratch row this session holds."""
        return list(self.scratch_current.values()) + [p.row for p in self.provisional.values()]

    def accept_all(self, layer: int) -> int | None:
        """Commits every token of the open speculative step at `layer`: the scratch row it wrote
        becomes the committed state (no copy). Returns the scratch row that held the state before
        it, which the caller frees once no queued launch reads it, or None."""
        pending = self.provisional.pop(layer)
        self.scratch_current[layer] = pending.row
        return pending.read_row if pending.read_row != self.pool_slot(layer) else None

    def step_queued(self, layer: int, record: StepRecord, row: int, digest: int | None, now: float,
                    provisional: Provisional | None = None) -> int:
        """A step of this session at `layer` (row `row` of `record`) is queued on the device: the
        position moves by its tokens, it becomes the step a retry is answered from, and a
        speculative step is open until Commit. Returns the new position."""
        before = self.positions[layer]
        after = self.positions[layer] = before + record.tokens
        self.last_steps[layer] = LastStep(before, record, row, digest)
        self.last_used = now
        if provisional is not None:
            self.provisional[layer] = provisional
        return after

    def step_failed(self, layer: int, record: StepRecord, write_rows: list[int]) -> int | None:
        """Undoes `step_queued` for a step whose launch failed after it was queued. Returns the
        scratch row of its open speculative step, now free, or None."""
        last = self.last_steps.get(layer)
        if last is not None and last.record is record:
            self.positions[layer] = last.count_before
            del self.last_steps[layer]
        pending = self.provisional.get(layer)
        if pending is not None and pending.row in write_rows:
            del self.provisional[layer]
            return pending.row
        return None

    def check_owner(self, identity: str | None) -> None:
        """PermissionDenied unless `identity` created this session (both None where auth is off)."""
        if self.owner != identity:
            raise PermissionDenied(f"session {self.id!r} belongs to another client")


MAX_EVICTED_IDS = 65536  # evicted ids remembered (oldest forgotten first), to answer why they are gone


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
        session.scratch_current.clear()
        session.provisional.clear()
        return session

    @property
    def scratch_share(self) -> int:
        """Scratch rows one client may hold at once: half of them (at least one speculative
        session's worth, 2 per layer), so a client that leaves drafts open cannot shut every other
        client out of speculative steps; stale drafts are released after a while besides
        (`--speculative-timeout-s`)."""
        return max(self.scratch_capacity // 2, min(2 * self.num_layers, self.scratch_capacity))

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
