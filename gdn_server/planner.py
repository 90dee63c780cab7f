"""The scheduler's pure part: queued items and the session table in, a launch plan out
(`Planner.plan`); a launch's output in, its answers out (`Planner.finish`). No I/O, threads,
asyncio or backend calls (the driver, gdn_server.scheduler, owns those), so every admission rule
runs on plain objects.

Glossary (the names the scheduler, the session table and the backends share):
- *session slot*: a session's index in the table (`Session.slot`); never a pool row.
- *pool row*: one (session, layer) state in the backend's state pool, `slot * L + l`
  (`Session.home_row`); a launch reads and writes its rows in place (`StepBatch.rows`; the CuTe
  kernels call them `slots` / `rows`).
- *ring*: each pool row's history of RING entries beside its state, terms of tokens not yet
  folded into it (gdn_server/backends/base.py).
- *P* / *committed entries*: the ring entries that are part of a session's state at a layer
  (`Session.hist`; a launch's `StepBatch.hist` is each row's P at launch time).
- *draft*: an uncommitted speculative step of a session at a layer (`sessions.Draft`), its ring
  entries after the committed ones; a *verify* is a launch that appends ring entries and writes
  no state: the drafts' launch, and, where the backend sets `ring_min_rows`, a launch of plain
  steps whose entries are committed at once (`Planner._through_ring` says which).
- *round plan* (`RoundPlan`): what one scheduler round launches and what waits; a *launch*
  (`Launch`) is one backend call of it, one T and kind (plain or verify), its batch and members
  (`Admitted`, one per request). (The backends' own per-shape layouts are
  `staging.StagingLayout` and `torch_math.StepWorkspace`.)

A round plan holds one launch per (T, speculative), at most `max_batch_rows` rows in all (a single
bigger request still goes alone); once the round is planned, a launch of plain steps may become
a verify (`StepBatch.verify`, `Planner._through_ring`). A session has at most one row
in a plan; a request whose session is already in it, or behind an earlier deferred request, is
deferred, so each session's requests apply in arrival order. Checks that depend on session state
run here, when the session's earlier steps are known to be applied. Requests are atomic: every
session of one is checked before any row is added.

- Answers decided while planning (errors, retries answered from kept outputs) are returned as
  (item, answer) pairs: planning calls no answer callback, and the driver gives them, in arrival order,
  before it runs or launches anything.
- A control item that may run at once (nothing in flight, batched or deferred before it) ends the
  plan (`RoundPlan.first`): later requests may name the session it closes, forks or imports, so they
  are planned once it has run.
- A control item of one session (`ControlItem.session_id`: Commit, bookkeeping of the session's
  records) waits for that session's steps only: where the session has no row in the plan, no
  deferred request and no step still on the device, it is settled in this round
  (`RoundPlan.settle`, run before the launches are queued), else deferred; either way the
  session's later requests wait for a later round. A barrier there would drain every client's
  launches for each Commit; waiting for the session's own steps keeps a launch that fails from
  meeting a draft a Commit already settled.
- Planning reads session records and changes none: it computes each step's rows and their P.
  `launched` applies a queued launch to the records through the session table's methods (P, the
  open draft, positions); `roll_back` undoes it where the launch then fails. A launch the
  backend refused before it ran (a failed submit) changed nothing to undo.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, GdnError
from gdn_server.kernels import folded_base
from gdn_server.sessions import Session, SessionTable, StepRecord
from gdn_server.work import DecodeResult, DecodeWork, StepBatch

Done = Callable[[Any], None]  # called once, on the event loop's thread, with a result or an exception


class DecodeItem:
    """A queued decode request (slotted: one is made per request on the event loop)."""

    __slots__ = ("work", "done", "rows", "cancelled", "enqueued")

    def __init__(self, work: DecodeWork, done: Done, cancelled: Callable[[], bool] | None = None) -> None:
        self.work = work
        self.done = done
        self.rows = len(work.session_ids)
        self.cancelled = cancelled
        self.enqueued = time.monotonic()


class ControlItem:
    """A queued control operation. With no `session_id`, it runs between launches once nothing is
    in flight (it may touch the device). With one, it is bookkeeping of that session's records
    only (Commit): it runs in order with the session's steps, once they have run on the
    device, and holds back no other session."""

    __slots__ = ("fn", "done", "session_id")
    rows = 0  # queued, it holds no rows

    def __init__(self, fn: Callable[[], Any], done: Done, session_id: str | None = None) -> None:
        self.fn = fn
        self.done = done
        self.session_id = session_id


Item = DecodeItem | ControlItem


class Admitted:
    """A request in a batch: its sessions and where its rows sit in the launch."""

    __slots__ = ("item", "sessions", "first_row", "rows", "hist", "record", "positions")

    def __init__(self, item: DecodeItem, sessions: list[Session], rows: list[int], hist: list[int]) -> None:
        self.item = item
        self.sessions = sessions
        self.first_row = 0
        self.rows = rows  # each session's pool row at the layer
        self.hist = hist  # each session's committed ring entries there at launch (Session.launch_hist)
        self.record: StepRecord | None = None  # set when launched: what each session's LastStep points at
        self.positions: tuple[int, ...] = ()  # each session's count at the layer after this step


class Launch:
    """One backend call of a round plan: a batch of one T and kind and its members in row order; once
    submitted, the backend's handle and when it was submitted (the driver's in-flight record)."""

    __slots__ = ("batch", "members", "pending", "started")

    def __init__(self, batch: StepBatch, members: list[Admitted] | None = None) -> None:
        self.batch = batch
        self.members: list[Admitted] = [] if members is None else members
        self.pending: Any = None  # the backend's PendingStep, once submitted
        self.started = 0.0  # time.monotonic() at submit

    def add(self, member: Admitted) -> None:
        member.first_row = len(self.batch.rows)
        self.members.append(member)
        self.batch.add(member.item.work, member.rows, member.hist)


class RoundPlan:
    """One round's launches, and what waits."""

    __slots__ = ("launches", "deferred", "barrier", "first", "answers", "settle")

    def __init__(self) -> None:
        self.launches: dict[tuple[int, bool], Launch] = {}  # (T, speculative) -> its launch
        self.deferred: list[Item] = []  # to plan later (once `first` has run, else in a later round)
        self.barrier: ControlItem | None = None  # to run once these launches are done, before `deferred`
        self.first: ControlItem | None = None  # to run before anything else (there are no batches)
        self.answers: list[tuple[DecodeItem, Any]] = []  # (item, DecodeResult or GdnError), in arrival order
        self.settle: list[ControlItem] = []  # session bookkeeping to run now: no session of it is in `launches`


class NotReady(Exception):
    """A retry whose original step has not finished yet."""


class Planner:
    """Admission, routing and answers for one device's session table (not slotted: a test
    replaces `admit` on the instance)."""

    def __init__(self, sessions: SessionTable, max_batch_rows: int, shape: ModelShape,
                 ring_min_rows: int | None = None) -> None:
        self.sessions = sessions
        self.max_batch_rows = max_batch_rows
        self._heads = shape.num_v_heads
        self._head_dim = shape.head_dim_v
        # plain launches of this many rows or more run as verifies (`Backend.ring_min_rows`), for
        # the T a verify takes
        self.ring_min_rows = ring_min_rows
        self._ring_max_tokens = shape.max_speculative_tokens

    def plan(self, items: list[Item], quiet: bool) -> RoundPlan:
        """Plans `items` (in arrival order); `quiet`: nothing is in flight on the device, so a
        control item met before anything is batched may run at once."""
        plan = RoundPlan()
        batches, deferred, answers = plan.launches, plan.deferred, plan.answers
        busy: set[str] = set()  # sessions with a row in this plan, or behind a deferred request
        rows, max_rows, admit = 0, self.max_batch_rows, self.admit
        last = len(items) - 1
        for idx, item in enumerate(items):
            if type(item) is ControlItem:
                sid = item.session_id
                if sid is not None:  # one session's bookkeeping: behind that session's steps only
                    session = self.sessions.find(sid)
                    if sid in busy or (session is not None and session.has_running_step()):
                        deferred.append(item)
                    else:
                        plan.settle.append(item)
                    busy.add(sid)  # its later steps see the records it changes: a later round
                    continue
                if deferred:  # an earlier request is held back: the barrier stays behind it
                    deferred.extend(items[idx:])
                    break
                if quiet and not batches:
                    plan.first = item  # runs at once: the rest is planned once it has run
                else:
                    plan.barrier = item  # later requests wait until it has run
                deferred.extend(items[idx + 1 :])
                break
            work = item.work
            ids = work.session_ids
            n = len(ids)
            if (busy and not busy.isdisjoint(ids)) or (rows and rows + n > max_rows):
                busy.update(ids)
                deferred.append(item)
                continue
            if item.cancelled is not None and item.cancelled():
                continue  # the client gave up: never reaches the device
            try:
                admitted = admit(item)
            except NotReady:  # a retry of a step still on the device: answer it next round
                busy.update(ids)
                deferred.append(item)
                continue
            if type(admitted) is not list:
                answers.append((item, admitted))  # an error, or a retry's answer
                continue
            member = self.route(item, admitted)
            key = (work.tokens, work.speculative)
            launch = batches.get(key)
            if launch is None:
                launch = batches[key] = Launch(StepBatch(work.tokens, verify=work.speculative))
            launch.add(member)
            if idx != last:  # what is busy matters to later items only
                busy.update(ids)
            rows += n
        if self.ring_min_rows is not None:
            for (tokens, speculative), launch in batches.items():
                if not speculative and tokens <= self._ring_max_tokens and self._through_ring(launch.batch):
                    launch.batch.verify = True
        return plan

    def _through_ring(self, batch: StepBatch) -> bool:
        """Whether a launch of plain steps runs as a verify: one of ring_min_rows rows or more, where
        that costs less than writing the states; or a smaller one with entries committed in some
        row and room for its tokens in every row's ring, where writing the states would first cost
        a fold of those rows (a launch, and a read and write of their states) that the verify puts
        off to when a ring fills. A small launch that would fill a ring folds and writes in place,
        so sessions that stay in small launches are back on the plain kernel within 16 tokens."""
        if batch.num_rows >= self.ring_min_rows:
            return True
        most = max(batch.hist)
        return most > 0 and folded_base(most, batch.tokens) == most

    def admit(self, item: DecodeItem) -> list[Session] | DecodeResult | GdnError:
        """Checks sessions, owner and positions, once the sessions' earlier steps are applied.
        Returns the sessions to apply the step to, or the item's answer: an error, or a retry of
        the last step answered from its kept output. NotReady: that output is not there yet."""
        work = item.work
        try:
            sessions = self.sessions.get_all(work.session_ids)
            owner, layer = work.owner, work.layer
            # each session's count at the layer, in the pass that checks the owner
            counts = [s.positions[layer] for s in sessions if s.owner is owner or s.owner == owner]
            if len(counts) != len(sessions):
                for s in sessions:
                    s.check_owner(owner)  # raises for the first one of another owner
            if work.positions is None:
                return sessions
            if tuple(counts) == work.positions:
                return sessions  # every session's next step: no retry to look for
            retries = 0
            tokens, speculative, digests = work.tokens, work.speculative, work.digests
            for index, (s, pos, count) in enumerate(zip(sessions, work.positions, counts)):
                if pos == count:
                    continue
                last = s.last_steps.get(layer)
                if (last is None or last.count_before != pos or (record := last.record).tokens != tokens
                        or record.speculative != speculative):
                    raise FailedPrecondition(
                        f"session {s.id}: position {pos} at layer {layer} does not match the server's "
                        f"count {count} (nor is it a retry of the last step: same position, T and speculative flag)"
                    )
                if last.digest != digests[index]:
                    raise FailedPrecondition(
                        f"session {s.id}: a retry of the step at position {pos}, layer {layer}, with inputs "
                        "other than the first try's: a step is applied once, with the inputs it was first sent"
                    )
                if record.out is None:
                    raise NotReady()
                retries += 1
            if retries == 0:
                return sessions
            if retries != len(sessions):
                raise FailedPrecondition("positions mix a retry of the last step with a new step in one request")
            return self.replay(work, sessions)
        except GdnError as e:
            return e

    def route(self, item: DecodeItem, sessions: list[Session]) -> Admitted:
        """Each session's pool row and committed ring entries for an admitted step; changes no
        record. An open draft at the layer counts as committed (a next step accepts it whole)."""
        layer = item.work.layer
        # Session.home_row and Session.launch_hist of each session, read inline (a method call
        # a session cost as much as the rest of planning a B = 256 request)
        if len(sessions) == 1:  # one client's step: no comprehension to set up
            (s,) = sessions
            return Admitted(item, sessions, [s.pool_rows[layer]], [s.launch_hist(layer) if s.drafts else s.hist[layer]])
        rows = [s.pool_rows[layer] for s in sessions]
        hist = [s.launch_hist(layer) if s.drafts else s.hist[layer] for s in sessions]
        return Admitted(item, sessions, rows, hist)

    def replay(self, work: DecodeWork, sessions: list[Session]) -> DecodeResult:
        """Answers a retried step from the outputs kept when it was first applied."""
        layer = work.layer
        lasts = [s.last_steps[layer] for s in sessions]
        record = lasts[0].record
        if record.rows == len(lasts) and all(last.record is record and last.row == row for row, last in enumerate(lasts)):
            out = record.out  # the whole request retried as it was sent: its kept output is the answer's
        else:
            parts = []
            for last in lasts:
                row_bytes = len(last.out) // last.rows
                parts.append(last.out[last.row * row_bytes : (last.row + 1) * row_bytes])
            out = b"".join(parts)
        positions = tuple([s.positions[layer] for s in sessions])
        shape = (work.rows, work.tokens, self._heads, self._head_dim)
        return DecodeResult(out, shape, positions, work.request_id, replayed=True)

    def finish(self, launch: Launch, whole: bytes | memoryview,
               kept: dict[int, memoryview] | None = None) -> list[DecodeResult]:
        """The answers of a finished launch, one per member in order, from its output `whole`
        (the backend's buffer, never kept: each member's rows are copied once, into its encoded
        reply), or for a member whose o the launch wrote into its o_ref, from the copy the launch
        kept (`kept`, by first row: PendingStep.kept_outputs); keeps each step's output (its view
        in the reply, or that copy) for retries."""
        batch = launch.batch
        row_bytes = len(whole) // batch.num_rows
        tokens, heads, head_dim = batch.tokens, self._heads, self._head_dim
        results = []
        for m in launch.members:
            rows = len(m.sessions)
            out = kept.get(m.first_row) if kept else None
            if out is not None:
                result = DecodeResult.written(out, (rows, tokens, heads, head_dim), m.positions, m.item.work.request_id)
            else:
                result = DecodeResult(whole[m.first_row * row_bytes : (m.first_row + rows) * row_bytes],
                                      (rows, tokens, heads, head_dim), m.positions, m.item.work.request_id)
            m.record.out = result.out  # what a retry of this step is answered from, for each of its sessions
            results.append(result)
        return results


def launched(launch: Launch, now: float, table: SessionTable) -> None:
    """`launch` is queued on the device: each session's record moves (`SessionTable.steps_queued`),
    so later requests see the new positions, drafts and P."""
    batch = launch.batch
    tokens, in_ring = batch.tokens, batch.verify
    for m in launch.members:
        work = m.item.work
        m.record = record = StepRecord(tokens, len(m.sessions), work.speculative)
        m.positions = table.steps_queued(m.sessions, work.layer, record, work.digests, now, m.hist, in_ring)


def roll_back(member: Admitted, table: SessionTable) -> None:
    """Undoes `launched` for a step whose launch failed after it was queued."""
    layer = member.item.work.layer
    for s, hist in zip(member.sessions, member.hist):
        table.step_failed(s, layer, member.record, hist)
