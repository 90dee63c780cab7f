"""The scheduler: one queue for every client of a device, turned into backend launches.

A round takes whatever is pending (once something is pending it waits at most
`max_queue_delay_us` for more), admits requests into one batch per T (at most `max_batch_rows`
rows in all, though a single bigger request still goes alone) and launches each batch. A batch
mixes sessions, clients and layers; a session never has two rows in one round, and a request
whose session is already in this round (or behind an earlier deferred request) waits for the
next, so each session's requests apply in the order they arrived.

Checks that depend on session state (unknown session, owner, positions, retries) happen at
admission, when the session's earlier steps are known to be applied. Requests are atomic: every
session of a request is checked before any row is added, and a request fails whole.

Control operations (close, fork, export, import, eviction, commit) are queued too and run
between launches, once nothing is in flight and before any later request is admitted.

Rounds run as callbacks on the server's event loop: no thread hand-off (a wake-up and a GIL
switch each way) per request, which is most of a step's latency at low load. A backend's launch
only starts work (on a device, or on the CPU backend's worker thread for a big launch; a small
CPU launch is done when it returns), and the loop never waits for it: while one request is in
flight the loop polls the launch once per iteration; under load a waiter thread blocks on it and
wakes the loop, so polling does not take the loop's time from the clients it serves.

A round that raises (a bug, not a request's fault) fails that round's requests with INTERNAL and
the scheduler goes on. A backend failure fails its batch; `device_error` then says whether the
device itself is gone, and `stalled_s` how long queued work has waited for a round that never
came: the server's health reports both.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from gdn_server.backends.base import Backend, NonFiniteInputs
from gdn_server.config import SchedulerConfig
from gdn_server.errors import FailedPrecondition, GdnError, Unavailable
from gdn_server.sessions import LastStep, Provisional, Session, SessionTable, StepRecord
from gdn_server.validation import check_finite
from gdn_server.work import DecodeResult, DecodeWork, StepBatch

log = logging.getLogger(__name__)

Done = Callable[[Any], None]  # called once, on the event loop's thread, with a result or an exception
# launches a scheduler on the event loop keeps on the device at once: fewer than a backend's
# staging sets (CudaBackend.RING), so a launch never waits for a set to come free
LOOP_MAX_IN_FLIGHT = 4


def settle(fut: asyncio.Future) -> Done:
    """A `Done` that settles `fut` with its result, or its exception raised, unless the future is
    done already (its call was cancelled). Answers come on the loop's thread, where rounds run."""

    def done(result: Any) -> None:
        if fut.done():
            return
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    return done


class _DecodeItem:
    """A queued decode request (slotted: one is made per request on the event loop)."""

    __slots__ = ("work", "done", "rows", "cancelled", "enqueued")

    def __init__(self, work: DecodeWork, done: Done, cancelled: Callable[[], bool] | None = None) -> None:
        self.work = work
        self.done = done
        self.rows = len(work.session_ids)
        self.cancelled = cancelled
        self.enqueued = time.monotonic()


@dataclass
class _ControlItem:
    fn: Callable[[], Any]
    done: Done
    rows = 0  # a class attribute, not a field: queued, it holds no rows


class _Admitted:
    """A request in a batch: its sessions and where its rows sit in the launch."""

    __slots__ = ("item", "sessions", "first_row", "read_rows", "write_rows", "released", "record", "positions")

    def __init__(self, item: _DecodeItem, sessions: list[Session]) -> None:
        self.item = item
        self.sessions = sessions
        self.first_row = 0
        self.read_rows: list[int] = []  # pool row each session's state is read from
        self.write_rows: list[int] = []  # pool row each session's new state goes to
        self.released: list[int] = []  # scratch rows free once this step is queued
        self.record: StepRecord | None = None  # set when launched: what each session's LastStep points at
        self.positions: tuple[int, ...] = ()  # each session's count at the layer after this step


class _NotReady(Exception):
    """A retry whose original step has not finished yet."""


@dataclass
class SchedulerStats:
    launches: int = 0  # backend calls
    rows_launched: int = 0
    requests: int = 0  # decode requests answered successfully
    batches: int = 0  # rounds that ran at least one backend call
    queue_wait_s: float = 0.0  # total time requests waited between submit and their launch
    device_s: float = 0.0  # total time from launch to result of backend calls

    @property
    def mean_rows_per_launch(self) -> float:
        return self.rows_launched / self.launches if self.launches else 0.0


class Scheduler:
    def __init__(self, backend: Backend, sessions: SessionTable, config: SchedulerConfig = SchedulerConfig()) -> None:
        if config.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {config.max_batch_rows}")
        if config.max_queue_rows < 1:
            raise ValueError(f"max_queue_rows must be >= 1, got {config.max_queue_rows}")
        self.backend = backend
        self.sessions = sessions
        self.config = config
        self.stats = SchedulerStats()
        # metrics hooks, called on the event loop's thread
        self.on_launch: Callable[[int, float, float], None] | None = None  # (rows, longest queue wait s, device s)
        self.on_dispatch: Callable[[float], None] | None = None  # (queue wait s) per request launched
        # why the device is unusable, once a launch failed and the device does not answer; None while it is fine
        self.device_error: str | None = None
        self._pending: deque[_DecodeItem | _ControlItem] = deque()
        self._pending_rows = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._accepting = True
        self._round_items: list[_DecodeItem | _ControlItem] = []  # taken by the round now running
        self._last_round = time.monotonic()  # when a round last ran (`stalled_s`)
        # the loop, its thread, launches on the device (oldest first), a control item waiting for
        # them, and whether a round is already posted
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._in_flight: list = []
        self._barrier: _ControlItem | None = None
        self._round_posted = False
        self._drained = threading.Event()
        self._waiter: threading.Thread | None = None  # blocks on launches for the loop, started on first use
        self._waiter_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting_on: Any = None
        self._waited: Any = None  # the last launch the waiter's wait returned for

    # -- called from any thread -------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs rounds on `loop` from now on (call this on the loop's thread)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._last_round = time.monotonic()
        if self._pending:
            self._post_round()

    def stalled_s(self) -> float:
        """How long work has been queued with no round run since (0 while rounds run): a round
        that never comes means every queued request hangs."""
        if self._loop is None or not (self._pending or self._in_flight or self._barrier):
            return 0.0
        return time.monotonic() - self._last_round

    def submit_decode(self, work: DecodeWork, done: Done, cancelled: Callable[[], bool] | None = None) -> None:
        """Queues a validated request; `done` gets its DecodeResult or GdnError. Once `cancelled()`
        is true the request is dropped before it reaches the device."""
        self._enqueue(_DecodeItem(work, done, cancelled))

    def submit_control(self, fn: Callable[[], Any], done: Done) -> None:
        """Runs `fn()` between launches, once every earlier request has finished."""
        self._enqueue(_ControlItem(fn, done))

    async def control(self, fn: Callable[[], Any]) -> Any:
        """`submit_control`, awaited on the loop the rounds run on: `fn()`'s result, or its
        exception raised."""
        fut = asyncio.get_running_loop().create_future()
        self.submit_control(fn, settle(fut))
        return await fut

    def stop_accepting(self) -> None:
        """New work is refused with UNAVAILABLE from now on; queued work still runs."""
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float = 30.0) -> None:
        """Finishes everything queued, then stops: call it from another thread while the loop
        runs (run_in_executor), or from the loop's thread, which then runs what is left itself."""
        with self._lock:
            self._accepting = False
            self._stopping = True
        if self._loop is None:
            self._drained.set()  # never started: nothing ran, nothing will
        elif threading.get_ident() == self._loop_thread:
            self._drain_here()
        else:
            self._post_round()
            self._drained.wait(timeout)

    @property
    def running(self) -> bool:
        """True while queued work may still change states."""
        return not self._drained.is_set()

    def queue_depth(self) -> int:
        """Requests and control operations waiting."""
        return len(self._pending)

    def _enqueue(self, item: _DecodeItem | _ControlItem) -> None:
        error = None
        post = False
        with self._lock:
            rows = item.rows
            if not self._accepting:
                error = Unavailable("the server is shutting down")
            elif rows and self._pending_rows and self._pending_rows + rows > self.config.max_queue_rows:
                # bounded: slow devices and bursts cannot pile up memory; clients retry
                error = Unavailable(f"the server's queue is full ({self._pending_rows} rows waiting); retry later")
            else:
                self._pending.append(item)
                self._pending_rows += rows
                if self._loop is not None and not self._round_posted:
                    self._round_posted = post = True
        if error is not None:
            item.done(error)
        elif post:
            self._post_soon()

    def _take_pending(self) -> list[_DecodeItem | _ControlItem]:
        """Everything queued (call with the lock held)."""
        items = list(self._pending)
        self._pending.clear()
        self._pending_rows = 0
        return items

    def _requeue(self, deferred: list[_DecodeItem | _ControlItem]) -> None:
        with self._lock:
            self._pending.extendleft(reversed(deferred))
            self._pending_rows += sum(i.rows for i in deferred)

    def _fail_round(self, error: Exception) -> None:
        """A round raised: its requests (and a control item waiting on it) get INTERNAL; every
        one of them may have been answered already, and only the first answer counts."""
        log.error("scheduler round failed; its requests get INTERNAL", exc_info=error)
        items, self._round_items = self._round_items, []
        control, self._barrier = self._barrier, None
        failure = GdnError(f"internal scheduler error: {type(error).__name__}: {error}")
        for item in items + ([control] if control is not None else []):
            try:
                item.done(failure)
            except Exception:  # a broken callback must not stop the others' answers
                log.exception("answering a failed round")

    def _hold_s(self) -> float:
        """How much longer pending work should wait for more before it launches (0: now). Lock held."""
        delay = self.config.max_queue_delay_us / 1e6
        if delay <= 0 or self._stopping or self._pending_rows >= self.config.max_batch_rows:
            return 0.0
        first = next((i for i in self._pending if type(i) is _DecodeItem), None)
        if first is None:  # control items never wait
            return 0.0
        return max(delay - (time.monotonic() - first.enqueued), 0.0)

    # -- on the event loop -------------------------------------------------------------------
    def _post_soon(self) -> None:
        loop = self._loop
        if threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._loop_round)
        else:
            # new work: run the round one loop iteration later, after the requests whose reads
            # completed together with this one have been queued too; else a round would follow
            # every request and none would be batched
            loop.call_soon(loop.call_soon, self._loop_round)

    def _post_round(self, poll: bool = False) -> None:
        """Makes sure one round callback is on the loop's queue."""
        with self._lock:
            if self._round_posted:
                return
            self._round_posted = True
        if poll and threading.get_ident() == self._loop_thread:
            self._loop.call_soon(self._loop_round)
        else:
            self._loop.call_soon_threadsafe(self._loop_round)

    def _loop_round(self) -> None:
        with self._lock:
            self._round_posted = False
        self._last_round = time.monotonic()
        try:
            again = self._advance()
        except Exception as e:
            self._fail_round(e)
            again = bool(self._in_flight or self._pending)
        if again:
            if self._leave_wait_to_thread():
                self._hand_to_waiter(self._in_flight[0][0])
            else:
                self._post_round(poll=True)  # polls once per loop iteration; I/O runs in between
        elif self._stopping:
            self._drained.set()

    def _leave_wait_to_thread(self) -> bool:
        """Whether the loop leaves the wait for its oldest launch to the waiter thread instead of
        polling: only when that launch is all there is to come back for and it carries several
        requests (their clients' next messages are what the loop should serve meanwhile)."""
        in_flight = self._in_flight
        if not in_flight or (self._pending and len(in_flight) < LOOP_MAX_IN_FLIGHT and self._barrier is None):
            return False
        if in_flight[0][0] is self._waited:  # waited for and still not ready (its wait failed): poll
            return False
        return len(in_flight) > 1 or len(in_flight[0][2]) > 1

    def _hand_to_waiter(self, step: Any) -> None:
        if self._waiting_on is step:  # already handed over: its end posts the next round
            return
        self._waiting_on = step
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_for_launches, name="gdn-device-wait", daemon=True)
            self._waiter.start()
        self._waiter_queue.put(step)

    def _wait_for_launches(self) -> None:
        """The waiter thread: blocks on each launch handed to it, then posts a round to the loop."""
        while True:
            step = self._waiter_queue.get()
            try:
                step.wait()
            except Exception:  # the round that answers the launch reports its failure
                pass
            self._waited = step
            try:
                self._post_round()
            except RuntimeError:  # the loop is closed: the server is gone
                return

    def _advance(self) -> bool:
        """Answers the launches the device has finished, runs a waiting control item once nothing
        is in flight, and launches what is queued. Returns whether there is more to do."""
        self._answer_ready()
        if self._barrier is not None and not self._in_flight:
            control, self._barrier = self._barrier, None
            self._run_control(control)
        if self._barrier is None and self._pending and len(self._in_flight) < LOOP_MAX_IN_FLIGHT:
            with self._lock:
                due = self._hold_s() <= 0
                items = self._round_items = self._take_pending() if due else []
            if due:
                deferred, self._barrier = self._launch(items, self._in_flight, quiet=not self._in_flight)
                self._round_items = []
                if deferred:
                    self._requeue(deferred)
                self._answer_ready()  # a launch done when it returned (a small CPU one): no round more
        return bool(self._in_flight or self._pending or self._barrier)

    def _answer_ready(self) -> None:
        """Answers the oldest launches that are done, in launch order."""
        in_flight = self._in_flight
        ready = 0
        while ready < len(in_flight) and in_flight[ready][0].ready():
            ready += 1
        if ready:
            self._in_flight = in_flight[ready:]
            self._finish(in_flight[:ready])

    def _drain_here(self) -> None:
        """Runs everything queued to the end on this (the loop's) thread, waiting on the device."""
        while self._advance():
            if self._in_flight and not self._in_flight[0][0].ready():
                self._in_flight[0][0].wait()
        self._drained.set()

    # -- admission and launches (either thread) ------------------------------------------------
    def _launch(
        self, items: list[_DecodeItem | _ControlItem], in_flight: list, quiet: bool
    ) -> tuple[list[_DecodeItem | _ControlItem], _ControlItem | None]:
        """Admits what it can into per-T batches and launches them. Returns (deferred items,
        a control item to run once the launches are done and before the deferred items)."""
        batches: dict[int, tuple[StepBatch, list[_Admitted]]] = {}
        busy: set[str] = set()  # sessions with a row in this round, or behind a deferred request
        rows = 0
        deferred: list[_DecodeItem | _ControlItem] = []
        control: _ControlItem | None = None
        max_rows = self.config.max_batch_rows
        for idx, item in enumerate(items):
            if type(item) is _ControlItem:
                if deferred:  # an earlier request is held back: the barrier stays behind it
                    deferred.extend(items[idx:])
                    break
                if quiet and not batches:
                    self._run_control(item)
                    continue
                control = item  # later requests wait until it has run
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
                admitted = self._admit(item)
            except _NotReady:  # a retry of a step still on the device: answer it next round
                busy.update(ids)
                deferred.append(item)
                continue
            if admitted is None:
                continue  # answered already (an error, or a retry)
            try:
                if not work.finite_checked and (work.speculative or any(s.provisional or s.scratch_current for s in admitted)):
                    # routing this step changes session records (a commit, scratch rows): check
                    # its inputs first, so a step the backend would refuse changes nothing
                    check_finite(work.bf16_bytes)
                member = self._route(item, admitted)
            except GdnError as e:
                item.done(e)
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
        for batch, members in batches.values():
            self._submit(batch, members, in_flight)
        return deferred, control

    def _admit(self, item: _DecodeItem) -> list[Session] | None:
        """Checks sessions, owner and positions. Returns the sessions to apply the step to, or
        None when the item was answered here (an error, or a retry of the last step)."""
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
                if last is None or last.count_before != pos or last.tokens != work.tokens:
                    raise FailedPrecondition(
                        f"session {s.id}: position {pos} at layer {layer} does not match the server's "
                        f"count {count} (nor is it a retry of the last step)"
                    )
                if last.digest != work.digests[index]:
                    raise FailedPrecondition(
                        f"session {s.id}: a retry of the step at position {pos}, layer {layer}, with inputs "
                        "other than the first try's: a step is applied once, with the inputs it was first sent"
                    )
                if last.out is None:
                    raise _NotReady()
                retries += 1
            if retries == 0:
                return sessions
            if retries != len(sessions):
                raise FailedPrecondition("positions mix a retry of the last step with a new step in one request")
            if not work.finite_checked:  # a retry is refused for bad inputs as a first try would be
                check_finite(work.bf16_bytes)
            item.done(self._replay(work, sessions))
            return None
        except GdnError as e:
            item.done(e)
            return None

    def _route(self, item: _DecodeItem, sessions: list[Session]) -> _Admitted:
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
        member = _Admitted(item, sessions)
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

    def _replay(self, work: DecodeWork, sessions: list[Session]) -> DecodeResult:
        """Answers a retried step from the outputs kept when it was first applied."""
        parts = []
        for s in sessions:
            last = s.last_steps[work.layer]
            row_bytes = len(last.out) // last.rows
            parts.append(last.out[last.row * row_bytes : (last.row + 1) * row_bytes])
        positions = tuple(s.positions[work.layer] for s in sessions)
        return DecodeResult(b"".join(parts), self._out_shape(work.rows, work.tokens), positions, work.request_id)

    def _out_shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        shape = self.backend.shape
        return (rows, tokens, shape.num_v_heads, shape.head_dim_v)

    def _submit(self, batch: StepBatch, members: list[_Admitted], in_flight: list) -> None:
        started = time.monotonic()
        try:
            pending = self.backend.submit(batch)
        except NonFiniteInputs as e:  # nothing ran: answer the culprits, launch the others again
            keep = []
            for index, m in enumerate(members):
                error = e.errors.get(index)
                if error is None:
                    keep.append(m)
                else:  # routed without touching session records (_launch checked those that would)
                    m.item.done(error)
            if keep:
                rest = StepBatch(batch.tokens)
                for m in keep:
                    m.first_row = rest.rows
                    rest.add(m.item.work, m.read_rows, m.write_rows)
                self._submit(rest, keep, in_flight)
            return
        except Exception as e:  # a backend failure fails this batch; the server stays up if the device does
            self._backend_failed(e, batch.rows)
            for m in members:
                if m.item.work.speculative:
                    for row in m.write_rows:
                        self.sessions.give_scratch(row)
                m.item.done(GdnError(f"backend failure: {e}"))
            return
        now = time.monotonic()
        on_dispatch = self.on_dispatch
        tokens = batch.tokens
        queue_wait = 0.0
        for m in members:  # the step is queued on the device: later requests see the new positions
            work = m.item.work
            wait = started - m.item.enqueued
            queue_wait += wait
            if on_dispatch is not None:
                on_dispatch(wait)
            layer = work.layer
            m.record = record = StepRecord(tokens, len(m.sessions))
            digests = work.digests
            after = []
            for row, s in enumerate(m.sessions):
                before = s.positions[layer]
                s.positions[layer] = before + tokens
                after.append(before + tokens)
                s.last_steps[layer] = LastStep(before, record, row, digests[row] if digests else None)
                s.last_used = now
                if work.speculative:
                    s.provisional[layer] = Provisional(
                        row=m.write_rows[row], read_row=m.read_rows[row], tokens=tokens, count_before=before,
                        inputs=tuple(t[row : row + 1] for t in (work.q, work.k, work.v, work.a, work.b)),
                    )
            m.positions = tuple(after)
            for released in m.released:  # superseded by this step: a later launch may write them again
                self.sessions.give_scratch(released)
        self.stats.queue_wait_s += queue_wait
        in_flight.append((pending, batch, members, started))

    def _finish(self, in_flight: list) -> None:
        for pending, batch, members, started in in_flight:
            try:
                whole = pending.result_bytes()  # the backend's buffer, reused later: read here, never kept
            except Exception as e:
                self._backend_failed(e, batch.rows)
                for m in members:
                    self._roll_back(m)
                    m.item.done(GdnError(f"backend failure: {e}"))
                continue
            device_s = time.monotonic() - started
            stats = self.stats
            stats.launches += 1
            stats.rows_launched += batch.rows
            stats.batches += 1
            stats.device_s += device_s
            stats.requests += len(members)  # counted before the answers: a GetStats may follow one
            if self.on_launch is not None:
                self.on_launch(batch.rows, started - min(m.item.enqueued for m in members), device_s)
            row_bytes = len(whole) // batch.rows
            for m in members:
                rows = len(m.sessions)
                data = bytes(whole[m.first_row * row_bytes : (m.first_row + rows) * row_bytes])
                m.record.out = data  # what a retry of this step is answered from, for each of its sessions
                m.item.done(DecodeResult(data, self._out_shape(rows, batch.tokens), m.positions, m.item.work.request_id))

    def _backend_failed(self, error: Exception, rows: int) -> None:
        log.error("backend launch failed (%d rows)", rows, exc_info=error)
        problem = self.backend.device_problem()
        if problem is not None and self.device_error is None:
            self.device_error = problem
            log.error("the device is unusable: %s", problem)

    def _roll_back(self, member: _Admitted) -> None:
        """Undoes the position advance of a step whose launch failed after it was queued."""
        layer = member.item.work.layer
        for s in member.sessions:
            last = s.last_steps.get(layer)
            if last is not None and last.record is member.record:
                s.positions[layer] = last.count_before
                del s.last_steps[layer]
            pending = s.provisional.get(layer)
            if pending is not None and pending.row in member.write_rows:
                del s.provisional[layer]
                self.sessions.give_scratch(pending.row)

    def _run_control(self, item: _ControlItem) -> None:
        try:
            self.backend.synchronize()
            result = item.fn()
        except Exception as e:
            if not isinstance(e, GdnError):
                log.exception("control operation failed")
            item.done(e)
            return
        item.done(result)
