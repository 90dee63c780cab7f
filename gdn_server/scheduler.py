"""The scheduler: one queue for every client, one thread that turns it into backend calls.

Each iteration takes whatever is pending (up to `max_batch_rows` rows; once something is pending
it waits at most `max_queue_delay_us` for more), groups the rows by T and makes one backend call
per group. A call mixes sessions, clients and layers; a (session, layer) pair never appears twice
in one call, and a request whose session already has a row in this iteration (or an earlier
request still waiting) waits for the next iteration, so each session's requests apply in order.

Session checks that depend on state (unknown session, positions, retries) happen here, when a
request is admitted, because only then are the session's earlier steps known to be applied.
Requests are atomic: every session of a request is checked before any row is added.

Control operations (close, fork, export, import, eviction) are queued too and run between
batches, after every earlier step has finished and before any later one starts.

Pipelining: a backend's `submit` may return before the device is done. The loop submits batch n,
then finishes batch n-1 (waits for its output and answers it) while n runs.

Plain steps (not speculative, positions as expected, no speculative record at any layer) take
C loops where gdn_server._native is built (_native_scheduler.c: admission and routing in
`_launch`, the position bookkeeping in `_submit`, the answers in `_finish`); everything else runs
the Python below, which stays the reference (tests/test_scheduler_native.py).

Behind `--frontends` workers, an engine's plain one-row steps come as C records (LaneRun,
gdn_server/_native_lane.c), queued like any item: a run's records are admitted in C into the
round's batch for T=1 (`StepBatch.lane`, its rows after the others'), deferred as a run of their
own, or handed back one at a time as a _DecodeItem when a step is not plain, which then takes the
Python path in the run's place; their positions, step records and replies are done in C too
(tests/test_lane.py holds them to the Python path's answers).

Where rounds run (`SchedulerConfig.runs_on`):
- on a thread of their own (`start`): requests are handed over with a condition variable and
  answered through the `done` callbacks. For backends that compute on the host (the CPU one).
- on the server's event loop (`start_on`): a round is a loop callback, scheduled when work
  arrives; while a launch is on the device the loop keeps serving gRPC and polls the launch
  (`PendingStep.ready`) once per loop iteration, so it never blocks on the device. One thread
  does everything: no hand-off (a wake-up and a GIL switch, each way) per request, which is
  most of a step's latency at low load (bench/NOTES.md). Where the loop also serves gRPC it
  never waits for the device: a round returns while its launch runs, and the loop polls the
  launch once per iteration (one request in flight) or, under load, a waiter thread blocks on
  it and wakes the loop. An engine behind --frontends workers (decode steps come over their
  link; its gRPC serves the router's few control calls) instead waits for the device in the
  round that launched (tens of microseconds for a small launch) and answers at once: no
  pipelining, but a request spends one round fewer in the engine, which on the H200 raised
  both its throughput and its rows per launch at 64 clients (bench/NOTES.md, fourteenth
  session). SchedulerConfig.device_wait picks.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from gdn_server.backends.base import Backend, NonFiniteInputs
from gdn_server.batch_fill import BatchFill
from gdn_server.config import SchedulerConfig
from gdn_server.errors import FailedPrecondition, GdnError, Unavailable
from gdn_server.native import module as native_module
from gdn_server.sessions import LastStep, Provisional, Session, SessionTable, StepRecord
from gdn_server.validation import check_finite
from gdn_server.work import DecodeResult, DecodeWork, StepBatch

log = logging.getLogger(__name__)

Done = Callable[[Any], None]  # called once, on the scheduler's thread, with a result or an exception
# launches a scheduler on the event loop keeps on the device at once: fewer than a backend's
# staging sets (CudaBackend.RING), so submitting never waits for a set to come free
LOOP_MAX_IN_FLIGHT = 4
# the schedulers started on each event loop (start_on): SchedulerConfig.device_wait "auto"
# answers inline only where a scheduler has its loop to itself
_SCHEDULERS_ON: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakSet] = weakref.WeakKeyDictionary()


class _DecodeItem:
    """A queued decode request. A plain slotted class, not a dataclass: one is made per request on
    the event loop, and a dataclass's __init__ with a default factory costs several times more."""

    __slots__ = ("work", "done", "rows", "cancelled", "enqueued")

    def __init__(self, work: DecodeWork, done: Done, rows: int, cancelled: Callable[[], bool] | None = None) -> None:
        self.work = work
        self.done = done
        self.rows = rows
        self.cancelled = cancelled
        self.enqueued = time.monotonic()


@dataclass
class _ControlItem:
    fn: Callable[[], Any]
    done: Done
    rows = 0  # a class attribute, not a field: queued, it holds no rows


class _Admitted:
    """A request in a batch: its sessions and where its rows sit in the backend call (slotted, as
    _DecodeItem: one per request per launch)."""

    __slots__ = ("item", "sessions", "first_row", "read_rows", "write_rows", "released", "record", "positions")

    def __init__(self, item: _DecodeItem, sessions: list[Session], first_row: int) -> None:
        self.item = item
        self.sessions = sessions
        self.first_row = first_row
        self.read_rows: list[int] = []  # pool row each session's state is read from
        self.write_rows: list[int] = []  # pool row each session's new state goes to
        self.released: list[int] = []  # scratch rows free once this step is queued
        self.record: StepRecord | None = None  # set when submitted: the step each session's LastStep points at
        self.positions: tuple[int, ...] = ()  # each session's count at the layer after this step (the reply's)


class _NotReady(Exception):
    """A retry whose original step has not finished yet."""


@dataclass
class SchedulerStats:
    launches: int = 0  # backend calls
    rows_launched: int = 0
    requests: int = 0  # decode requests answered successfully
    batches: int = 0  # iterations that ran at least one backend call
    queue_wait_s: float = 0.0  # total time requests waited between submit and launch
    device_s: float = 0.0  # total time from submit to result of backend calls

    @property
    def mean_rows_per_launch(self) -> float:
        return self.rows_launched / self.launches if self.launches else 0.0


class Scheduler:
    def __init__(
        self, backend: Backend, sessions: SessionTable, config: SchedulerConfig = SchedulerConfig(),
        native: Any = native_module,
    ) -> None:
        """`native`: gdn_server._native, whose loops take a round's plain steps (the common case)
        in C; None runs every request through the Python (the reference the C is tested against)."""
        if config.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {config.max_batch_rows}")
        if config.max_queue_rows < 1:
            raise ValueError(f"max_queue_rows must be >= 1, got {config.max_queue_rows}")
        self.backend = backend
        self.sessions = sessions
        self.config = config
        self.stats = SchedulerStats()
        # --batch-fill: under load, a round waits for a share of the rows in circulation
        self.batch_fill = BatchFill(config.batch_fill, config.batch_fill_max_us / 1e6, config.batch_fill_min_rows)
        # metrics hooks, called on the scheduler thread
        self.on_launch: Callable[[int, float, float], None] | None = None  # (rows, longest queue wait s, device s)
        self.on_dispatch: Callable[[float], None] | None = None  # (queue wait s) per request sent to the device
        # whether the event loop this runs on (start_on) also serves the decode RPCs, as in a server
        # of one process; an engine behind --frontends workers gets them over its link instead, and
        # there device_wait "auto" answers inline (the loop may wait for the device)
        self.loop_serves_rpcs = True
        # called after each round of answers (e.g. to write buffered replies with one system call)
        self.after_answers: list[Callable[[], None]] = []
        # where this process's gRPC servicer sends the replies (gdn_server.decode_rpcs.encode_decode_reply:
        # (output, shape, positions, request_id) -> (wire, offset of the output in it)): each is
        # then encoded straight from the backend's output buffer, one copy of the output instead
        # of one into a bytes object and another into the reply. None: answers carry bytes.
        self.encode_reply: Callable[[Any, tuple, tuple, str], tuple[bytes, int]] | None = None
        self._pending: deque[_DecodeItem | _ControlItem] = deque()
        self._pending_rows = 0
        # the condition's own lock, taken directly where nothing waits or is notified: `with` on a
        # Lock is one C call, on a Condition a Python-level __enter__ and __exit__ per request
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._stopping = False
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="gdn-scheduler", daemon=True)
        # on an event loop (start_on): the loop, its thread, launches on the device (oldest
        # first), a control item waiting for them, and whether a round is already scheduled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._in_flight: list = []
        self._barrier: _ControlItem | None = None
        self._round_scheduled = False
        self._round_items: list[_DecodeItem | _ControlItem] = []  # taken by the round now running
        self._drained = threading.Event()
        # SchedulerConfig.device_wait's waiter thread, started on first use, and the launch it waits for
        self._waiter: threading.Thread | None = None
        self._waiter_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting_on: Any = None
        self._waited: Any = None  # the last launch the waiter's wait returned for
        self._loop_peers: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # the schedulers on our loop
        # the C loops over plain steps (_native_scheduler.c), or None: everything in Python
        self._native = native if native is not None and hasattr(native, "admit_plain") else None
        self._make_items = getattr(self._native, "make_decode_items", None)
        # the front-end link's plain one-row steps as C records (gdn_server/_native_lane.c), or
        # None where the native module has no lane: the link then queues _DecodeItems only
        self.lane_type: type | None = getattr(self._native, "LaneRun", None)

    # -- called from any thread -------------------------------------------------------------
    def start(self) -> None:
        """Runs rounds on a thread of the scheduler's own."""
        self._thread.start()

    def start_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs rounds as callbacks on `loop` (call this on the loop's thread)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._loop_peers = _SCHEDULERS_ON.setdefault(loop, weakref.WeakSet())
        self._loop_peers.add(self)

    def answers_inline(self) -> bool:
        """Whether the round that launches waits for the device and answers: device_wait "inline",
        or "auto" where the loop serves no decode RPCs (an engine behind --frontends workers) and
        this is its only scheduler (several devices' rounds on one loop would wait on each other)."""
        mode = self.config.device_wait
        return mode == "inline" or (mode == "auto" and not self.loop_serves_rpcs and len(self._loop_peers) == 1)

    def submit_decode(self, work: DecodeWork, done: Done, cancelled: Callable[[], bool] | None = None) -> None:
        self._enqueue([_DecodeItem(work, done, len(work.session_ids), cancelled)])

    def submit_decodes(self, requests: list[tuple[DecodeWork, Done, Callable[[], bool] | None]]) -> None:
        """`submit_decode` of each (work, done, cancelled), in order, under one lock (the
        front-end link queues all the requests of one read at once); the items are made in C
        where gdn_server._native is built (one clock read for all of them)."""
        if self._make_items is not None:
            items = self._make_items(requests, _DecodeItem, time.monotonic())
        else:
            items = [_DecodeItem(work, done, len(work.session_ids), cancelled) for work, done, cancelled in requests]
        self._enqueue(items)

    def submit_control(self, fn: Callable[[], Any], done: Done) -> None:
        """Runs `fn()` on the scheduler thread once every earlier request has finished."""
        self._enqueue([_ControlItem(fn, done)])

    def stop_accepting(self) -> None:
        """New work is refused with UNAVAILABLE from now on; queued work still runs."""
        with self._cv:
            self._accepting = False

    def stop(self, timeout: float = 30.0) -> None:
        """Finishes everything queued, then stops the thread (or the loop's rounds). On an event
        loop, call it from another thread while the loop runs (run_in_executor), or from the
        loop's own thread, which then runs what is left itself."""
        with self._cv:
            self._accepting = False
            self._stopping = True
            self._cv.notify()
        if self._loop is not None:
            if threading.get_ident() == self._loop_thread:
                self._drain_here()
            else:
                self._schedule_round()
                self._drained.wait(timeout)
            return
        if self._thread.is_alive():
            self._thread.join(timeout)

    def queue_depth(self) -> int:
        """Requests (and control operations) waiting; a lane run counts each of its records."""
        lane_type = self.lane_type
        with self._lock:  # no iterating the deque while another thread queues
            if lane_type is None:
                return len(self._pending)
            return sum(len(item) if type(item) is lane_type else 1 for item in self._pending)

    def _enqueue(self, items: list[_DecodeItem | _ControlItem]) -> None:
        post = False  # whether this call posts the loop's next round
        refused: list[tuple[_DecodeItem | _ControlItem, GdnError]] = []
        with self._lock:
            queued = 0
            total = sum(item.rows for item in items) if len(items) > 1 else -1
            if 0 <= total and self._accepting and self._pending_rows + total <= self.config.max_queue_rows:
                # all of them fit (the loop below would take each): one extend, not a step per item
                self._pending.extend(items)
                self._pending_rows += total
                queued = len(items)
                items = ()
            limit = self.config.max_queue_rows
            for item in items:
                rows = item.rows
                if not self._accepting:
                    refused.append((item, Unavailable("the server is shutting down")))
                elif type(item) is self.lane_type and self._pending_rows + rows > limit:
                    # one-row requests, each taken or refused as a _DecodeItem would be: those that fit go in
                    if self._pending_rows < limit:
                        head = item.take(limit - self._pending_rows)
                        self._pending.append(head)
                        self._pending_rows += head.rows
                        queued += 1
                    refused.append((item, Unavailable(
                        f"the server's queue is full ({self._pending_rows} rows waiting); retry later")))
                elif rows and self._pending_rows and self._pending_rows + rows > limit:
                    # bounded: slow clients and bursts cannot pile up unbounded memory; clients retry
                    refused.append((item, Unavailable(
                        f"the server's queue is full ({self._pending_rows} rows waiting); retry later")))
                else:
                    self._pending.append(item)
                    self._pending_rows += rows
                    queued += 1
            if queued:
                if self._loop is None:  # only the scheduler thread waits on the condition
                    self._cv.notify()
                post = self._loop is not None and not self._round_scheduled
                if post:
                    self._round_scheduled = True
        for item, error in refused:
            item.done(error)
        if post:
            self._post_round()

    def _schedule_round(self, poll: bool = False) -> None:
        """Makes sure a round callback is on the loop's queue (one at a time)."""
        with self._cv:
            if self._round_scheduled:
                return
            self._round_scheduled = True
        self._post_round(poll)

    def _post_round(self, poll: bool = False) -> None:
        loop = self._loop
        if threading.get_ident() != self._loop_thread:  # e.g. the waiter thread, or stop()
            loop.call_soon_threadsafe(self._loop_round)
        elif poll:
            loop.call_soon(self._loop_round)
        else:
            # New work: run the round one loop iteration later, after the requests whose reads
            # completed together with this one (their tasks are queued behind this callback) have
            # been queued too. Else a round would follow every request and none would be batched.
            loop.call_soon(loop.call_soon, self._loop_round)

    # -- the scheduler thread ---------------------------------------------------------------
    def _run(self) -> None:
        previous: list = []  # batches submitted last iteration, possibly still on the device
        while True:
            with self._cv:
                if not (previous and not self._pending):
                    while not self._pending and not self._stopping:
                        self._cv.wait()
                    if not self._pending and self._stopping:
                        return
                if previous and self._hold_s() > 0:
                    # answer the last launch before holding: its clients' next steps may be the
                    # very rows the hold waits for
                    items = []
                else:
                    self._wait_for_more()
                    items = self._take_pending()
            previous = self._round(items, previous)

    def run_round(self, previous: list) -> list:
        """One iteration of the scheduler loop over whatever is queued, on the caller's thread
        (bench/engine_path.py; the scheduler's own thread must not be running). `previous` is
        what the last call returned (batches still to answer), [] at first."""
        with self._cv:
            items = self._take_pending()
        return self._round(items, previous)

    def _take_pending(self) -> list[_DecodeItem | _ControlItem]:
        """Everything queued (with `_cv` held)."""
        items = list(self._pending)
        self._pending.clear()
        self._pending_rows = 0
        return items

    def _round(self, items: list[_DecodeItem | _ControlItem], previous: list) -> list:
        """Admits and submits `items`, then answers `previous` while they run; returns what is
        now in flight."""
        current: list = []
        deferred, control = self._launch(items, current, quiet=not previous)
        # batch n is queued on the device: answer batch n-1 while it runs
        self._finish(previous)
        previous = current
        if control is not None:
            self._finish(previous)
            previous = []
            self._run_control(control)
        for hook in self.after_answers:
            hook()
        if deferred:
            self._requeue(deferred)
        return previous

    # -- on the event loop -------------------------------------------------------------------
    def _loop_round(self) -> None:
        with self._lock:
            self._round_scheduled = False
        try:
            again = self._advance()
        except Exception as e:  # a bug: answer what is queued (nobody would), keep polling the device
            log.exception("scheduler round failed")
            self._fail_pending(GdnError(f"internal scheduler error: {e}"))
            again = bool(self._in_flight)
        if again:
            # the waiter's own post comes when the launch it waits for ends; one it has already
            # waited for that still is not ready (its wait failed) is polled
            if self._waits_on_thread() and self._in_flight[0][0] is not self._waited:
                self._hand_to_waiter(self._in_flight[0][0])
            else:
                self._schedule_round(poll=True)  # polls the device once per loop iteration; I/O runs in between
        elif self._stopping:
            self._drained.set()

    def _waits_on_thread(self) -> bool:
        """Whether the loop leaves the wait for its oldest launch to the waiter thread instead of
        polling it (SchedulerConfig.device_wait). Only when the launch is all there is to come
        back for: queued work that could launch now keeps the loop polling."""
        in_flight = self._in_flight
        if not in_flight or (self._pending and len(in_flight) < LOOP_MAX_IN_FLIGHT and self._barrier is None):
            return False
        mode = self.config.device_wait
        if self.answers_inline():  # only a round that launched nothing gets here with a launch in flight
            return False
        if mode == "auto":  # several requests in flight: the loop has their clients to serve meanwhile
            _, batch, members, _ = in_flight[0]
            return len(in_flight) > 1 or len(members) + (len(batch.lane) if batch.lane is not None else 0) > 1
        return mode == "thread"

    def _hand_to_waiter(self, step: Any) -> None:
        if self._waiting_on is step:  # already waited for: its end posts the next round
            return
        self._waiting_on = step
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_for_launches, name="gdn-device-wait", daemon=True)
            self._waiter.start()
        self._waiter_queue.put(step)

    def _wait_for_launches(self) -> None:
        """The waiter thread: blocks on each launch handed to it (without the GIL), then posts a
        round to the loop, which answers it."""
        while True:
            step = self._waiter_queue.get()
            try:
                step.wait()
            except Exception:  # the round that answers the launch reports its failure
                pass
            self._waited = step
            try:
                self._schedule_round()
            except RuntimeError:  # the loop is closed: the server is gone
                return

    def _advance(self) -> bool:
        """Answers the launches the device has finished, runs a waiting control item once nothing
        is in flight, and launches what is queued. Returns whether there is more to do."""
        in_flight = self._in_flight
        ready = 0
        while ready < len(in_flight) and in_flight[ready][0].ready():
            ready += 1
        answered = ready > 0
        if ready:
            self._in_flight = in_flight[ready:]
            self._finish(in_flight[:ready])
        if self._barrier is not None and not self._in_flight:
            control, self._barrier = self._barrier, None
            self._run_control(control)
            answered = True
        if (self._barrier is None and self._pending and len(self._in_flight) < LOOP_MAX_IN_FLIGHT
                and self._batch_is_due()):
            with self._cv:
                items = self._round_items = self._take_pending()
            # admission answers some requests at once (errors, retries): they count as answers too
            deferred, self._barrier = self._launch(items, self._in_flight, quiet=not self._in_flight)
            self._round_items = []
            answered = True
            if deferred:
                self._requeue(deferred)
            if self._in_flight and self.answers_inline():
                # answer in the round that launched: the loop waits out the device's time here
                # (tens of us for a small launch) instead of coming back a round later, so a
                # request spends one round fewer in the server
                done, self._in_flight = self._in_flight, []
                self._finish(done)
        if answered:
            for hook in self.after_answers:
                hook()
        return bool(self._in_flight or self._pending or self._barrier)

    def _batch_is_due(self) -> bool:
        """False while --max-queue-delay-us or --batch-fill asks to wait for more rows (and they may
        still come)."""
        if self.config.max_queue_delay_us <= 0 and not self.batch_fill.enabled:
            return True
        with self._lock:  # other threads may queue meanwhile (_enqueue): no iterating the deque under them
            return self._hold_s() <= 0.0

    def _hold_s(self) -> float:
        """How much longer the pending work should wait for more before it launches (0: now).
        Called with the lock held."""
        delay = self.config.max_queue_delay_us / 1e6
        fill = self.batch_fill
        if (delay <= 0 and not fill.enabled) or self._stopping or self._pending_rows >= self.config.max_batch_rows:
            return 0.0
        first = next((i for i in self._pending if not isinstance(i, _ControlItem)), None)
        if first is None:  # control items only: they never wait
            return 0.0
        now = time.monotonic()
        hold = delay - (now - first.enqueued)
        if fill.enabled:
            hold = max(hold, fill.hold_s(self._pending_rows, first.enqueued, now))
        return max(hold, 0.0)

    def _drain_here(self) -> None:
        """Runs everything queued to the end on this (the loop's) thread, waiting on the device."""
        while self._advance():
            if self._in_flight and not self._in_flight[0][0].ready():
                self._in_flight[0][0].result()  # block: nothing else may run meanwhile
        self._drained.set()

    def _fail_pending(self, error: GdnError) -> None:
        """Answers with `error` everything queued, and the round that failed (its items may have
        been answered already: a future or link reply takes the first answer only)."""
        with self._cv:
            items = self._round_items + self._take_pending()
        self._round_items = []
        control, self._barrier = self._barrier, None
        for item in items + ([control] if control is not None else []):
            item.done(error)

    def _requeue(self, deferred: list[_DecodeItem | _ControlItem]) -> None:
        with self._cv:
            self._pending.extendleft(reversed(deferred))
            self._pending_rows += sum(i.rows for i in deferred)  # a _ControlItem's are 0

    def _wait_for_more(self) -> None:
        """On the scheduler's thread, with `_cv` held: waits out `_hold_s` (new work wakes it)."""
        while self._pending:
            hold = self._hold_s()
            if hold <= 0:
                return
            self._cv.wait(hold)

    def _launch(
        self, items: list[_DecodeItem | _ControlItem], in_flight: list, quiet: bool
    ) -> tuple[list[_DecodeItem | _ControlItem], _ControlItem | None]:
        """Admits what it can into per-T batches and submits them. Returns (deferred, control to
        run before the deferred items)."""
        batches: dict[int, tuple[StepBatch, list[_Admitted]]] = {}
        busy: set[str] = set()  # sessions with a row in this iteration, or behind a deferred request
        rows = 0
        deferred: list[_DecodeItem | _ControlItem] = []
        control: _ControlItem | None = None
        max_rows = self.config.max_batch_rows
        fast = self._native.admit_plain if self._native is not None else None
        if fast is not None:
            state = (_DecodeItem, self.sessions.by_id, busy, deferred, batches, StepBatch, _Admitted)
        lane_type = self.lane_type
        if lane_type is not None:
            lane_state = (self.sessions.by_id, busy, deferred, batches, StepBatch, _DecodeItem, DecodeWork, partial)
        idx, count = 0, len(items)
        while idx < count:
            if fast is not None:
                # the C takes plain steps as the code below would; it stops at the first item it
                # leaves to this loop, which takes that one item before handing back
                idx, rows = fast(items, idx, rows, max_rows, state)
                if idx == count:
                    break
            item = items[idx]
            idx += 1
            if type(item) is lane_type:
                # the link's plain one-row steps, in C; a record whose step is not plain comes back
                # as a _DecodeItem, taken below in its place, and the run goes on after it
                rows, odd = item.admit(rows, max_rows, lane_state)
                if odd is None:
                    continue
                items.insert(idx, item)
                count += 1
                item = odd
            if isinstance(item, _ControlItem):
                if deferred:  # an earlier request is held back: the barrier stays behind it
                    deferred.extend(items[idx - 1 :])
                    break
                if quiet and not batches:
                    self._run_control(item)
                    continue
                control = item  # a barrier: later requests wait until it has run
                deferred.extend(items[idx:])
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
            except _NotReady:  # a retry of a step still on the device: answer it next iteration
                busy.update(ids)
                deferred.append(item)
                continue
            if admitted is None:
                continue  # answered (error or retry) already
            if not work.finite_checked and (work.speculative or any(s.provisional or s.scratch_current for s in admitted)):
                # routing this step changes session records (a commit, scratch rows): check its
                # inputs now, so that one the backend would refuse changes nothing (rare: big and
                # speculative); the backend checks plain steps' inputs where they are staged
                try:
                    check_finite(work.bf16_bytes)
                except GdnError as e:
                    item.done(e)
                    continue
            try:
                member = self._route(item, admitted)
            except GdnError as e:
                item.done(e)
                continue
            T = work.tokens
            entry = batches.get(T)
            if entry is None:  # not setdefault: that would build a StepBatch per request
                entry = batches[T] = (StepBatch(T), [])
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
        """Checks sessions and positions. Returns the sessions to apply the step to, or None when
        the item was answered here (an error, or a retry of the last step)."""
        work = item.work
        try:
            sessions = list(map(self.sessions.get, work.session_ids))
            owner = work.owner
            for s in sessions:
                if s.owner != owner:
                    s.check_owner(owner)  # raises
            if work.positions is None:
                return sessions
            layer = work.layer
            retries = 0
            for s, pos in zip(sessions, work.positions):
                count = s.positions[layer]
                if pos == count:
                    continue
                last = s.last_steps.get(layer)
                if last is not None and last.count_before == pos and last.tokens == work.tokens:
                    if last.out is None:
                        raise _NotReady()
                    retries += 1
                    continue
                raise FailedPrecondition(
                    f"session {s.id}: position {pos} at layer {layer} does not match the server's "
                    f"count {count} (nor is it a retry of the last step)"
                )
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
        scratch = self.sessions.take_scratch_rows(len(sessions)) if speculative else []
        member = _Admitted(item, sessions, 0)
        read_rows, write_rows, released = member.read_rows, member.write_rows, member.released
        for i, s in enumerate(sessions):
            home = s.slot * s.num_layers + layer  # Session.pool_slot, inline: this runs per row
            if s.provisional and layer in s.provisional:  # implicit commit of all T tokens
                superseded = s.accept_all(layer)
                if superseded is not None:
                    released.append(superseded)
            read = s.scratch_current.get(layer, home) if s.scratch_current else home
            if speculative:
                write = scratch[i]
            else:
                write = home
                if read != home:  # the state goes home with this step; its scratch row is free after
                    released.append(s.scratch_current.pop(layer))
            read_rows.append(read)
            write_rows.append(write)
        return member

    def _replay(self, work: DecodeWork, sessions: list[Session]) -> DecodeResult:
        """Answers a retried step from the outputs kept when it was first applied."""
        parts = []
        for s in sessions:
            last = s.last_steps[work.layer]
            row_bytes = len(last.out) // last.rows
            parts.append(last.out[last.row * row_bytes : (last.row + 1) * row_bytes])
        shape = self._out_shape(work.rows, work.tokens)
        positions = tuple(s.positions[work.layer] for s in sessions)
        return DecodeResult(b"".join(parts), shape, positions, work.request_id)

    def _out_shape(self, rows: int, tokens: int) -> tuple[int, ...]:
        shp = self.backend.shape
        return (rows, tokens, shp.num_v_heads, shp.head_dim_v)

    def _submit(self, batch: StepBatch, members: list[_Admitted], in_flight: list) -> None:
        started = time.monotonic()
        lane = batch.lane
        if lane is not None:
            lane.seal(batch)  # its rows after the members'
        if self.batch_fill.enabled:
            # one session's previous step (the time it was queued on the device, as `now` below),
            # read before this step sets last_used again
            if members:
                sampled = members[len(members) // 2].sessions
                last_step = sampled[0].last_used if sampled else None
            else:
                sampled = lane.sample_session()
                last_step = sampled.last_used if sampled is not None else None
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
            if keep or lane is not None:
                rest = StepBatch(batch.tokens, lane=lane)  # the lane's rows were checked by the workers
                for m in keep:
                    m.first_row = rest.rows
                    rest.add(m.item.work, m.read_rows, m.write_rows)
                self._submit(rest, keep, in_flight)
            return
        except Exception as e:  # a backend failure fails this batch only; the server stays up
            log.exception("backend call failed (%d rows)", batch.rows)
            for m in members:
                if m.item.work.speculative:
                    for row in m.write_rows:
                        self.sessions.give_scratch(row)
                m.item.done(GdnError(f"backend failure: {e}"))
            if lane is not None:
                lane.done(GdnError(f"backend failure: {e}"))
            return
        now = time.monotonic()
        on_dispatch = self.on_dispatch
        tokens = batch.tokens  # every request of a batch has this T
        queue_wait = 0.0
        rest = members
        if self._native is not None:  # the C does the loop below for plain steps, and leaves the rest
            queue_wait, rest = self._native.submit_plain(
                members, tokens, started, now, on_dispatch, StepRecord, LastStep
            )
        for m in rest:  # the step is queued on the device: later requests see the new positions
            item = m.item
            work = item.work
            queue_wait += now - item.enqueued
            if on_dispatch is not None:
                on_dispatch(started - item.enqueued)
            layer, speculative = work.layer, work.speculative
            m.record = record = StepRecord(tokens, len(m.sessions))
            after = []
            for row, s in enumerate(m.sessions):
                positions = s.positions
                before = positions[layer]
                positions[layer] = after_step = before + tokens
                after.append(after_step)
                s.last_steps[layer] = LastStep(before, record, row)
                s.last_used = now
                if speculative:
                    s.provisional[work.layer] = Provisional(
                        row=m.write_rows[row], read_row=m.read_rows[row], tokens=work.tokens, count_before=before,
                        inputs=tuple(t[row : row + 1] for t in (work.q, work.k, work.v, work.a, work.b)),
                    )
            m.positions = tuple(after)
            # rows superseded by this step: any later launch on the stream may write them again
            for released in m.released:
                self.sessions.give_scratch(released)
        if lane is not None:  # as the loop above, for the lane's rows
            queue_wait += lane.submitted(now, started, on_dispatch, StepRecord, LastStep)
        self.stats.queue_wait_s += queue_wait
        if self.batch_fill.enabled:
            self.batch_fill.launched(batch.rows, None if last_step is None else now - last_step, now)
        in_flight.append((pending, batch, members, started))

    def _finish(self, in_flight: list) -> None:
        for pending, batch, members, started in in_flight:
            try:
                # the backend's buffer, reused by a later launch: read here, never kept
                whole = pending.result_bytes()
            except Exception as e:
                log.exception("backend step failed (%d rows)", batch.rows)
                for m in members:
                    self._roll_back(m)
                    m.item.done(GdnError(f"backend failure: {e}"))
                if batch.lane is not None:
                    batch.lane.roll_back()
                    batch.lane.done(GdnError(f"backend failure: {e}"))
                continue
            device_s = time.monotonic() - started
            self.stats.launches += 1
            self.stats.rows_launched += batch.rows
            self.stats.batches += 1
            self.stats.device_s += device_s
            lane = batch.lane
            if self.on_launch is not None:
                first = min([m.item.enqueued for m in members] + ([lane.enqueued] if lane else []))
                self.on_launch(batch.rows, started - first, device_s)
            encode = self.encode_reply
            # without encode (an engine behind workers) each request's output is copied once,
            # straight out of the buffer, into bytes of its own: its record.out and its answer
            row_bytes = len(whole) // batch.rows
            single = len(members) == 1
            # counted before the answers, as GetStats may follow one
            self.stats.requests += len(members) + (len(lane) if lane is not None else 0)
            if lane is not None:  # each row's output into its step's record and its reply, in C
                lane.finish(whole, row_bytes)
                whole = whole[: (batch.rows - len(lane)) * row_bytes]  # the members' rows come first
            shp = self.backend.shape
            tail = (shp.num_v_heads, shp.head_dim_v)
            if self._native is not None:  # the loop below, in C (every member: answers are alike for every step)
                self._native.finish_plain(members, whole, row_bytes, batch.tokens, tail, encode, DecodeResult)
                continue
            for m in members:
                rows = len(m.sessions)
                data = whole if single else whole[m.first_row * row_bytes : (m.first_row + rows) * row_bytes]
                shape, request_id = (rows, batch.tokens, *tail), m.item.work.request_id
                wire = None
                if encode is not None:
                    wire, at = encode(data, shape, m.positions, request_id)
                    data = memoryview(wire)[at : at + len(data)]  # the output's copy in the reply
                else:
                    data = bytes(data)
                m.record.out = data  # what a retry of this step is answered from, for each of its sessions
                m.item.done(DecodeResult(data, shape, m.positions, request_id, wire))

    def _roll_back(self, member: _Admitted) -> None:
        """Undoes the position advance of a step whose backend call failed after dispatch."""
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

    @property
    def running(self) -> bool:
        """True while queued work may still change states: the scheduler's thread is alive, or
        (on an event loop) it has not drained since stop()."""
        if self._loop is not None:
            return not self._drained.is_set()
        return self._thread.is_alive()

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
