"""--batch-fill: the rows-in-circulation estimate on scripted launch streams, and the hold in the
scheduler, on its thread and on an event loop, with the CPU backend."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gdn_server.backends.cpu import CpuBackend
from gdn_server.batch_fill import ESTIMATE_PERIOD_S, GAP_CAP_S, BatchFill
from gdn_server.config import SchedulerConfig
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import SessionTable
from gdn_server.weights import random_gate_params
from tests.test_scheduler_loop import SHAPE, _DeviceLikeBackend, _work


def _closed_loop(fill: BatchFill, clients: int, cycle_s: float, launches_per_cycle: int, seconds: float) -> None:
    """Feeds `fill` the launches of `clients` closed loops, each stepping once per `cycle_s`, the
    server launching `launches_per_cycle` times per cycle."""
    interval = cycle_s / launches_per_cycle
    rows = clients / launches_per_cycle
    t = 100.0
    for _ in range(int(seconds / interval)):
        fill.launched(round(rows), cycle_s, t)
        t += interval


@pytest.mark.parametrize("clients, cycle_s, launches", [(64, 0.0058, 2), (64, 0.0058, 3), (8, 0.0011, 4), (256, 0.018, 4)])
def test_closed_loops_estimate_to_their_client_count(clients, cycle_s, launches):
    fill = BatchFill(0.5, 0.001)
    _closed_loop(fill, clients, cycle_s, launches, seconds=0.2)
    assert fill.rows_in_circulation == pytest.approx(clients, rel=0.15)
    assert fill.target_rows() == pytest.approx(clients / 2, rel=0.15)


def test_one_client_stepping_alone_is_never_held():
    fill = BatchFill(0.5, 0.001)
    _closed_loop(fill, 1, 0.0003, 1, seconds=0.2)
    assert fill.rows_in_circulation == pytest.approx(1, rel=0.1)
    assert fill.hold_s(pending_rows=1, oldest_enqueued=0.0, now=0.0) == 0.0


def test_no_hold_below_the_minimum_rows_in_circulation():
    """8 clients (a loop with time to spare) are not held under a minimum of 32; 64 are."""
    few, many = BatchFill(0.5, 0.001, min_rows=32), BatchFill(0.5, 0.001, min_rows=32)
    _closed_loop(few, 8, 0.0011, 4, seconds=0.2)
    _closed_loop(many, 64, 0.0058, 2, seconds=0.2)
    assert few.target_rows() >= 2.0  # without the minimum, one row of a target of ~4 would wait
    assert few.hold_s(pending_rows=1, oldest_enqueued=5.0, now=5.0) == 0.0
    assert many.hold_s(pending_rows=10, oldest_enqueued=5.0, now=5.0002) == pytest.approx(0.0008)


def test_the_hold_ends_at_the_target_or_after_max_hold():
    fill = BatchFill(0.5, 0.001)
    _closed_loop(fill, 64, 0.0058, 2, seconds=0.2)
    assert fill.hold_s(pending_rows=10, oldest_enqueued=5.0, now=5.0002) == pytest.approx(0.0008)
    assert fill.hold_s(pending_rows=10, oldest_enqueued=5.0, now=5.002) == 0.0
    assert fill.hold_s(pending_rows=40, oldest_enqueued=5.0, now=5.0) == 0.0


def test_rarely_stepping_sessions_count_by_how_often_they_step():
    """A session that steps once a second adds one row a second; it must not count as a client
    the launches should wait for (its sampled gap is capped)."""
    fill = BatchFill(0.5, 0.001)
    t = 0.0
    for _ in range(200):  # one row every 20 ms, each from a session that last stepped 1 s ago
        fill.launched(1, 1.0, t)
        t += 0.02
    assert fill.rows_in_circulation == pytest.approx(1 * GAP_CAP_S / 0.02, rel=0.1)
    assert fill.hold_s(pending_rows=1, oldest_enqueued=t, now=t) == 0.0


def test_an_idle_spell_drops_the_estimate_at_once():
    fill = BatchFill(0.5, 0.001)
    _closed_loop(fill, 64, 0.0058, 2, seconds=0.2)
    assert fill.rows_in_circulation > 50
    t = 1000.0  # long after: one client comes back, stepping alone
    for _ in range(2 + int(ESTIMATE_PERIOD_S / 0.0003)):
        fill.launched(1, 0.0003, t)
        t += 0.0003
    assert fill.rows_in_circulation < 2


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="fraction"):
        BatchFill(1.5, 0.001)
    with pytest.raises(ValueError, match="batch_fill"):
        SchedulerConfig(batch_fill=-0.1)
    with pytest.raises(ValueError, match="batch_fill_max_us"):
        SchedulerConfig(batch_fill=0.5, batch_fill_max_us=-1)
    with pytest.raises(ValueError, match="batch_fill_min_rows"):
        SchedulerConfig(batch_fill=0.5, batch_fill_min_rows=-1)
    with pytest.raises(ValueError, match="min_rows"):
        BatchFill(0.5, 0.001, min_rows=-1)
    assert not BatchFill(0.0, 0.001).enabled and not BatchFill(0.5, 0.0).enabled


HOLD_S = 0.4  # long against a CI box's scheduling noise


def _held_scheduler(runs_on: str) -> tuple[Scheduler, list[str]]:
    backend_type = _DeviceLikeBackend if runs_on == "loop" else CpuBackend
    backend = backend_type(SHAPE, random_gate_params(SHAPE, 0), 8)
    sessions = SessionTable(8, SHAPE.num_layers, range(backend.home_rows, backend.pool_rows))
    ids = [sessions.create().id for _ in range(8)]
    # min rows 0: the hold of 8 clients' worth of rows is what these tests look at
    config = SchedulerConfig(runs_on=runs_on, batch_fill=0.5, batch_fill_max_us=int(HOLD_S * 1e6), batch_fill_min_rows=0)
    scheduler = Scheduler(backend, sessions, config)
    # as if 8 clients were stepping in closed loops: launches wait for 4 rows
    scheduler.batch_fill.rows_in_circulation = 8.0
    scheduler.batch_fill.period_s = 1e9  # and the estimate stays put for the test
    return scheduler, ids


def _timed_answers(submit, count: int) -> float:
    """Seconds until `count` answers came, through `submit(done)`."""
    answered = threading.Event()
    results: list = []

    def done(result) -> None:
        results.append(result)
        if len(results) == count:
            answered.set()

    start = time.monotonic()
    submit(done)
    assert answered.wait(10), "no answer"
    assert not any(isinstance(r, BaseException) for r in results), results
    return time.monotonic() - start


@pytest.mark.parametrize("runs_on", ["thread", "loop"])
def test_a_launch_waits_for_the_target_rows_or_the_hold(runs_on):
    """One row of a target of four waits out the hold; four rows queued together launch at once,
    in one launch."""
    scheduler, ids = _held_scheduler(runs_on)

    def one(done) -> None:
        scheduler.submit_decode(_work(ids[0], 0, 1), done)

    def four(done) -> None:
        scheduler.submit_decodes([(_work(sid, 1, i), done, None) for i, sid in enumerate(ids[:4])])

    if runs_on == "thread":
        scheduler.start()
        alone, together = _timed_answers(one, 1), _timed_answers(four, 4)
        scheduler.stop()
    else:
        async def main() -> tuple[float, float]:
            loop = asyncio.get_running_loop()
            scheduler.start_on(loop)
            alone = await loop.run_in_executor(None, _timed_answers, one, 1)
            together = await loop.run_in_executor(None, _timed_answers, four, 4)
            await loop.run_in_executor(None, scheduler.stop)
            return alone, together

        alone, together = asyncio.run(main())
    assert alone >= HOLD_S * 0.95, alone
    assert together < HOLD_S * 0.75, together
    assert scheduler.stats.launches == 2 and scheduler.stats.rows_launched == 5


class _GatedCpuBackend(CpuBackend):
    """The CPU backend, whose first launch waits for the test to let it go."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()

    def submit(self, batch):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)
        return super().submit(batch)


def test_the_thread_scheduler_answers_its_last_launch_before_it_holds():
    """While a launch runs, one more request queues, short of the target: the launch's answers
    go out at once (their clients' next steps may be the rows the hold waits for), and the new
    request waits out the hold."""
    backend = _GatedCpuBackend(SHAPE, random_gate_params(SHAPE, 0), 8)
    sessions = SessionTable(8, SHAPE.num_layers, range(backend.home_rows, backend.pool_rows))
    ids = [sessions.create().id for _ in range(5)]
    scheduler = Scheduler(backend, sessions, SchedulerConfig(
        runs_on="thread", batch_fill=0.5, batch_fill_max_us=int(HOLD_S * 1e6), batch_fill_min_rows=0))
    scheduler.batch_fill.rows_in_circulation = 8.0  # launches wait for 4 rows
    scheduler.batch_fill.period_s = 1e9
    answered: dict[int, float] = {}
    done_all = threading.Event()

    def done_for(i: int):
        def done(result) -> None:
            assert not isinstance(result, BaseException), result
            answered[i] = time.monotonic()
            if len(answered) == 5:
                done_all.set()
        return done

    scheduler.start()
    start = time.monotonic()
    scheduler.submit_decodes([(_work(sid, 0, i), done_for(i), None) for i, sid in enumerate(ids[:4])])
    assert backend.entered.wait(10)
    scheduler.submit_decode(_work(ids[4], 0, 4), done_for(4))  # queued while the first launch runs
    backend.release.set()
    assert done_all.wait(10)
    scheduler.stop()
    assert max(answered[i] - start for i in range(4)) < HOLD_S * 0.75, answered
    assert answered[4] - start >= HOLD_S * 0.95, answered
