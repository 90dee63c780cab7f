"""The scheduler: one queue for every client of a device, turned into backend launches.

It is the driver of a vLLM v1 shaped scheduler. Each round (once something is pending it waits at
most `max_queue_delay_us` for more) the pure planner (gdn_server.planner) turns the queued items
and the session table into a launch plan; the driver runs it (backend.submit, control items) and
gives each finished launch's output to the planner's finisher for the answers. Control operations
(close, fork, export, import, eviction, commit) run between launches, once nothing is in flight.

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

from gdn_server.backends.base import Backend
from gdn_server.config import SchedulerConfig
from gdn_server.errors import GdnError, Unavailable
from gdn_server.planner import (
    ControlItem, DecodeItem, Done, Item, Launch, Planner, launched, roll_back,
)
from gdn_server.sessions import SessionTable
from gdn_server.work import DecodeWork, StepBatch

log = logging.getLogger(__name__)

# launches a scheduler on the event loop keeps on the device at once: fewer than a backend's
# staging sets (CudaBackend.RING), so a launch never waits for a set to come free
LOOP_MAX_IN_FLIGHT = 4
# After a round answers, the loop keeps polling its sockets (it does not sleep) this long: a client
# stepping through a model's layers sends its next request right after each reply, and a sleeping
# loop must then be woken first, with its caches gone cold. It costs a core while clients keep the
# server busy, none once they stop (bench/DECISIONS.md, entry 14).
BUSY_POLL_S = 0.001


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


@dataclass
class SchedulerStats:
    launches: int = 0  # backend calls
    rows_launched: int = 0
    requests: int = 0  # decode requests answered successfully
    batches: int = 0  # rounds that ran at least one backend call
    queue_wait_s: float = 0.0  # total time requests waited between submit and their launch
    device_s: float = 0.0  # total time from launch to result of backend calls


class Scheduler:
    def __init__(self, backend: Backend, sessions: SessionTable, config: SchedulerConfig = SchedulerConfig()) -> None:
        if config.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {config.max_batch_rows}")
        if config.max_queue_rows < 1:
            raise ValueError(f"max_queue_rows must be >= 1, got {config.max_queue_rows}")
        self.backend = backend
        self.sessions = sessions
        self.config = config
        self._planner = Planner(sessions, config.max_batch_rows, backend.shape, backend.ring_min_rows)
        self.stats = SchedulerStats()
        # metrics hooks, called on the event loop's thread
        self.on_launch: Callable[[int, float], None] | None = None  # (rows, device s)
        self.on_dispatch: Callable[[float], None] | None = None  # (queue wait s) per request launched
        # why the device is unusable, once a launch failed and the device does not answer; None while it is fine
        self.device_error: str | None = None
        self._pending: deque[Item] = deque()
        self._pending_rows = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._accepting = True
        self._round_items: list[Item] = []  # taken by the round now running
        self._last_round = time.monotonic()  # when a round last ran (`stalled_s`)
        # the loop, its thread, launches on the device (oldest first), a control item waiting for
        # them, and whether a round is already posted
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._in_flight: list[Launch] = []
        self._barrier: ControlItem | None = None
        self._round_posted = False
        self._drained = threading.Event()
        self._waiter: threading.Thread | None = None  # blocks on launches for the loop, started on first use
        self._waiter_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting_on: Any = None
        self._waited: Any = None  # the last launch the waiter's wait returned for
        self._spin_until = 0.0  # the loop polls until then (BUSY_POLL_S)
        self._spinning = False

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
        self._enqueue(DecodeItem(work, done, cancelled))

    def submit_control(self, fn: Callable[[], Any], done: Done, session_id: str | None = None) -> None:
        """Runs `fn()` between launches, once every earlier request has finished; with a
        `session_id`, `fn` changes only that session's records and runs once the session's
        earlier requests have run on the device, whatever other sessions have in flight
        (planner.ControlItem)."""
        self._enqueue(ControlItem(fn, done, session_id))

    async def control(self, fn: Callable[[], Any], session_id: str | None = None) -> Any:
        """`submit_control`, awaited on the loop the rounds run on: `fn()`'s result, or its
        exception raised."""
        fut = asyncio.get_running_loop().create_future()
        self.submit_control(fn, settle(fut), session_id)
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

    def _enqueue(self, item: Item) -> None:
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

    def _take_pending(self) -> list[Item]:
        """Everything queued (call with the lock held)."""
        items = list(self._pending)
        self._pending.clear()
        self._pending_rows = 0
        return items

    def _requeue(self, deferred: list[Item]) -> None:
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
        first = next((i for i in self._pending if type(i) is DecodeItem), None)
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
                self._hand_to_waiter(self._in_flight[0].pending)
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
        if in_flight[0].pending is self._waited:  # waited for and still not ready (its wait failed): poll
            return False
        return len(in_flight) > 1 or len(in_flight[0].members) > 1

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
        while ready < len(in_flight) and in_flight[ready].pending.ready():
            ready += 1
        if ready:
            self._in_flight = in_flight[ready:]
            self._finish(in_flight[:ready])

    def _drain_here(self) -> None:
        """Runs everything queued to the end on this (the loop's) thread, waiting on the device."""
        while self._advance():
            if self._in_flight and not self._in_flight[0].pending.ready():
                self._in_flight[0].pending.wait()
        self._drained.set()

    # -- launches: the planner's plan run, its launches answered --------------------------------
    def _launch(self, items: list[Item], in_flight: list[Launch], quiet: bool) -> tuple[list[Item], ControlItem | None]:
        """Plans `items` and launches the batches. Returns (deferred items, a control item to run
        once the launches are done and before the deferred items)."""
        plan = self._planner.plan(items, quiet)
        while True:
            for item, answer in plan.answers:
                item.done(answer)
            for control in plan.settle:
                self._run_control(control, device=False)
            if plan.first is None:
                break
            self._run_control(plan.first)  # before the rest is planned: it may change their sessions
            plan = self._planner.plan(plan.deferred, quiet)
        for launch in plan.launches.values():
            self._submit(launch, in_flight)
        return plan.deferred, plan.barrier

    def _submit(self, launch: Launch, in_flight: list[Launch]) -> None:
        batch, members = launch.batch, launch.members
        launch.started = started = time.monotonic()
        try:
            launch.pending = self.backend.submit(batch)
        except Exception as e:  # a backend failure fails this batch; the server stays up if the device does
            self._backend_failed(e, batch.num_rows)
            for m in members:
                m.item.done(GdnError(f"backend failure: {e}"))
            return
        launched(launch, time.monotonic(), self.sessions)  # later requests see the new positions
        on_dispatch = self.on_dispatch
        queue_wait = 0.0
        for m in members:
            wait = started - m.item.enqueued
            queue_wait += wait
            if on_dispatch is not None:
                on_dispatch(wait)
        self.stats.queue_wait_s += queue_wait
        in_flight.append(launch)

    def _finish(self, in_flight: list[Launch]) -> None:
        for launch in in_flight:
            batch, members, started = launch.batch, launch.members, launch.started
            try:
                whole = launch.pending.result_bytes()  # the backend's buffer, reused later: read here, never kept
                kept = launch.pending.kept_outputs()
            except Exception as e:
                self._backend_failed(e, batch.num_rows)
                for m in members:
                    roll_back(m, self.sessions)
                    m.item.done(GdnError(f"backend failure: {e}"))
                continue
            device_s = time.monotonic() - started
            stats = self.stats
            stats.launches += 1
            stats.rows_launched += batch.num_rows
            stats.batches += 1
            stats.device_s += device_s
            stats.requests += len(members)  # counted before the answers: a GetStats may follow one
            if self.on_launch is not None:
                self.on_launch(batch.num_rows, device_s)
            for m, result in zip(members, self._planner.finish(launch, whole, kept)):
                m.item.done(result)
        self._keep_polling()

    def _keep_polling(self) -> None:
        """Keeps the loop polling for BUSY_POLL_S from now: a callback that posts itself again, on
        its own rather than a round, so new work still waits one iteration for its round (see
        `_post_soon`)."""
        self._spin_until = time.monotonic() + BUSY_POLL_S
        if not self._spinning and self._loop is not None:
            self._spinning = True
            self._loop.call_soon(self._spin)

    def _spin(self) -> None:
        if time.monotonic() < self._spin_until and not self._stopping:
            self._loop.call_soon(self._spin)
        else:
            self._spinning = False

    def _backend_failed(self, error: Exception, rows: int) -> None:
        log.error("backend launch failed (%d rows)", rows, exc_info=error)
        problem = self.backend.device_problem()
        if problem is not None and self.device_error is None:
            self.device_error = problem
            log.error("the device is unusable: %s", problem)

    def _run_control(self, item: ControlItem, device: bool = True) -> None:
        """Runs a control item; `device`: after the device has finished all it was given."""
        try:
            if device:
                self.backend.synchronize()
            result = item.fn()
        except Exception as e:
            if not isinstance(e, GdnError):
                log.exception("control operation failed")
            item.done(e)
            return
        item.done(result)
