"""The scheduler's pure part: queued items and the session table in, a launch plan out
(`Planner.plan`); a launch's output in, its answers out (`Planner.finish`). No I/O, threads,
asyncio or backend calls (the driver, gdn_server.scheduler, owns those), so every admission rule
runs on plain objects.

A plan holds one batch per T, at most `max_batch_rows` rows in all (a single bigger request still
goes alone). A session has at most one row in a plan; a request whose session is already in it,
or behind an earlier deferred request, is deferred, so each session's requests apply in arrival
order. Checks that depend on session state run here, when the session's earlier steps are known to
be applied. Requests are atomic: every session of one is checked before any row is added.

- Answers decided while planning (errors, retries answered from kept outputs) are returned as
  (item, answer) pairs: planning calls no answer callback, and the driver gives them, in arrival order,
  before it runs or launches anything.
- A control item that may run at once (nothing in flight, batched or deferred before it) ends the
  plan (`Plan.first`): later requests may name the session it closes, forks or imports, so they
  are planned once it has run.
- Routing changes session records (an implicit commit, scratch rows taken), as a step's rows are
  fixed there; positions and last steps move in `launched`, once the backend has queued the step.
- A session's own state changes when a step is queued or its launch fails are methods of the
  Session (`step_queued`, `step_failed`); `launched` and `roll_back` apply them to a batch.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, GdnError
from gdn_server.sessions import Provisional, Session, SessionTable, StepRecord
from gdn_server.validation import check_finite
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
    """A queued control operation: runs between launches, once nothing is in flight."""

    __slots__ = ("fn", "done")
    rows = 0  # queued, it holds no rows

    def __init__(self, fn: Callable[[], Any], done: Done) -> None:
        self.fn = fn
        self.done = done


Item = DecodeItem | ControlItem


class Admitted:
    """A request in a batch: its sessions and where its rows sit in the launch."""

    __slots__ = ("item", "sessions", "first_row", "read_rows", "write_rows", "released", "record", "positions")

    def __init__(self, item: DecodeItem, sessions: list[Session]) -> None:
        self.item = item
        self.sessions = sessions
        self.first_row = 0
        self.read_rows: list[int] = []  # pool row each session's state is read from
        self.write_rows: list[int] = []  # pool row each session's new state goes to
        self.released: list[int] = []  # scratch rows free once this step is queued
        self.record: StepRecord | None = None  # set when launched: what each session's LastStep points at
        self.positions: tuple[int, ...] = ()  # each session's count at the layer after this step


class Plan:
    """One round's launches, and what waits."""

    __slots__ = ("batches", "deferred", "barrier", "first", "answers")

    def __init__(self) -> None:
        self.batches: dict[int, tuple[StepBatch, list[Admitted]]] = {}  # T -> batch, its members in row order
        self.deferred: list[Item] = []  # to plan later (once `first` has run, else in a later round)
        self.barrier: ControlItem | None = None  # to run once these launches are done, before `deferred`
        self.first: ControlItem | None = None  # to run before anything else (there are no batches)
        self.answers: list[tuple[DecodeItem, Any]] = []  # (item, DecodeResult or GdnError), in arrival order


class NotReady(Exception):
    """A retry whose original step has not finished yet."""


class Planner:
    """Admission, routing and answers for one device's session table (not slotted: a test
    replaces `admit` on the instance)."""

    def __init__(self, sessions: SessionTable, max_batch_rows: int, shape: ModelShape) -> None:
        self.sessions = sessions
        self.max_batch_rows = max_batch_rows
        self._heads = shape.num_v_heads
        self._head_dim = shape.head_dim_v

    def plan(self, items: list[Item], quiet: bool) -> Plan:
        """Plans `items` (in arrival order); `quiet`: nothing is in flight on the device, so a
        control item met before anything is batched may run at once."""
        plan = Plan()
        batches, deferred, answers = plan.batches, plan.deferred, plan.answers
        busy: set[str] = set()  # sessions with a row in this plan, or behind a deferred request
        rows, max_rows, admit = 0, self.max_batch_rows, self.admit
        for idx, item in enumerate(items):
            if type(item) is ControlItem:
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
            if not busy.isdisjoint(ids) or (rows and rows + n > max_rows):
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
            try:
                if not work.finite_checked and (work.speculative or any(s.provisional or s.scratch_current for s in admitted)):
                    # routing this step changes session records (a commit, scratch rows): check
                    # its inputs first, so a step the backend would refuse changes nothing
                    check_finite(work.bf16_bytes)
                member = self.route(item, admitted)
            except GdnError as e:
                answers.append((item, e))
                continue
            entry = batches.get(work.tokens)
            if entry is None:
                entry = batches[work.tokens] = (StepBatch(work.tokens), [])
            batch, members = entry
            member.first_row = batch.rows
            members.append(member)
            batch.add(work, member.read_rows, member.write_rows)
            busy.update(ids)
            rows += n
        return plan

    def admit(self, item: DecodeItem) -> list[Session] | DecodeResult | GdnError:
        """Checks sessions, owner and positions, once the sessions' earlier steps are applied.
        Returns the sessions to apply the step to, or the item's answer: an error, or a retry of
        the last step answered from its kept output. NotReady: that output is not there yet."""
        work = item.work
        try:
            sessions = list(map(self.sessions.get, work.session_ids))
            for s in sessions:
                if s.owner != work.owner:
                    s.check_owner(work.owner)  # raises
            if work.positions is None:
                return sessions
            layer = work.layer
            retries = 0
            for index, (s, pos) in enumerate(zip(sessions, work.positions)):
                count = s.positions[layer]
                if pos == count:
                    continue
                last = s.last_steps.get(layer)
                if (last is None or last.count_before != pos or last.tokens != work.tokens
                        or last.record.speculative != work.speculative):
                    raise FailedPrecondition(
                        f"session {s.id}: position {pos} at layer {layer} does not match the server's "
                        f"count {count} (nor is it a retry of the last step: same position, T and speculative flag)"
                    )
                if last.digest != work.digests[index]:
                    raise FailedPrecondition(
                        f"session {s.id}: a retry of the step at position {pos}, layer {layer}, with inputs "
                        "other than the first try's: a step is applied once, with the inputs it was first sent"
                    )
                if last.out is None:
                    raise NotReady()
                retries += 1
            if retries == 0:
                return sessions
            if retries != len(sessions):
                raise FailedPrecondition("positions mix a retry of the last step with a new step in one request")
            if not work.finite_checked:  # a retry is refused for bad inputs as a first try would be
                check_finite(work.bf16_bytes)
            return self.replay(work, sessions)
        except GdnError as e:
            return e

    def route(self, item: DecodeItem, sessions: list[Session]) -> Admitted:
        """Picks each session's read and write rows for an admitted step.

        A plain step reads the committed state and writes the session's own row. A speculative
        step writes a scratch row instead, so the state it started from survives until Commit.
        A new step at a layer with an open speculative step commits all of its tokens first (the
        positions already count them): the scratch row it wrote becomes the committed state.
        """
        work = item.work
        layer = work.layer
        speculative = work.speculative
        scratch = self.sessions.take_scratch_rows(len(sessions), work.owner_key) if speculative else []
        member = Admitted(item, sessions)
        for i, s in enumerate(sessions):
            home = s.slot * s.num_layers + layer
            if s.provisional and layer in s.provisional:  # implicit commit of all T tokens
                superseded = s.accept_all(layer)
                if superseded is not None:
                    member.released.append(superseded)
            read = s.scratch_current.get(layer, home) if s.scratch_current else home
            if speculative:
                write = scratch[i]
            else:
                write = home
                if read != home:  # the state goes home with this step; its scratch row is free after
                    member.released.append(s.scratch_current.pop(layer))
            member.read_rows.append(read)
            member.write_rows.append(write)
        return member

    def replay(self, work: DecodeWork, sessions: list[Session]) -> DecodeResult:
        """Answers a retried step from the outputs kept when it was first applied."""
        parts = []
        for s in sessions:
            last = s.last_steps[work.layer]
            row_bytes = len(last.out) // last.rows
            parts.append(last.out[last.row * row_bytes : (last.row + 1) * row_bytes])
        positions = tuple(s.positions[work.layer] for s in sessions)
        shape = (work.rows, work.tokens, self._heads, self._head_dim)
        return DecodeResult(b"".join(parts), shape, positions, work.request_id)

    def finish(self, batch: StepBatch, members: list[Admitted], whole: bytes | memoryview) -> list[DecodeResult]:
        """The answers of a finished launch, one per member in order, from its output `whole`
        (the backend's buffer: copied here, never kept); keeps each step's output for retries."""
        row_bytes = len(whole) // batch.rows
        tokens, heads, head_dim = batch.tokens, self._heads, self._head_dim
        results = []
        for m in members:
            rows = len(m.sessions)
            data = bytes(whole[m.first_row * row_bytes : (m.first_row + rows) * row_bytes])
            m.record.out = data  # what a retry of this step is answered from, for each of its sessions
            results.append(DecodeResult(data, (rows, tokens, heads, head_dim), m.positions, m.item.work.request_id))
        return results


def launched(members: list[Admitted], tokens: int, now: float, table: SessionTable) -> None:
    """The batch is queued on the device: each session's position and last step move
    (`Session.step_queued`), so later requests see them, and the scratch rows its steps supersede
    are free to write again."""
    for m in members:
        work = m.item.work
        layer = work.layer
        m.record = record = StepRecord(tokens, len(m.sessions), work.speculative)
        digests = work.digests
        after = []
        for row, s in enumerate(m.sessions):
            provisional = None
            if work.speculative:
                provisional = Provisional(
                    row=m.write_rows[row], read_row=m.read_rows[row], tokens=tokens, count_before=s.positions[layer],
                    inputs=tuple(t[row : row + 1] for t in (work.q, work.k, work.v, work.a, work.b)),
                )
            after.append(s.step_queued(layer, record, row, digests[row] if digests else None, now, provisional))
        m.positions = tuple(after)
        for released in m.released:  # superseded by this step: a later launch may write them again
            table.give_scratch(released)


def roll_back(member: Admitted, table: SessionTable) -> None:
    """Undoes `launched` for a step whose launch failed after it was queued."""
    layer = member.item.work.layer
    for s in member.sessions:
        freed = s.step_failed(layer, member.record, member.write_rows)
        if freed is not None:
            table.give_scratch(freed)
