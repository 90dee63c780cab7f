"""Busy polling (gdn_server.busy_poll): the loop stays awake for the window after an answer, then
sleeps again; and a scheduler on the loop keeps it awake between the steps of a client."""
from __future__ import annotations

import asyncio
import selectors
import time

import pytest

from gdn_server.busy_poll import LoopSpinner
from gdn_server.config import SchedulerConfig
from gdn_server.server import start_scheduler
from gdn_server.placement import Shard

from test_scheduler_loop import _DeviceLikeBackend, _scheduler, _work


class _CountingSelector(selectors.DefaultSelector):
    """Counts the loop's selects that may sleep (timeout None or > 0) and those that poll (0)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps = self.polls = 0

    def select(self, timeout=None):
        if timeout == 0:
            self.polls += 1
        else:
            self.sleeps += 1
        return super().select(timeout)


def _run(main, selector: _CountingSelector):
    loop = asyncio.SelectorEventLoop(selector)
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_the_loop_polls_for_the_window_after_a_touch_and_then_sleeps():
    selector = _CountingSelector()

    async def main():
        spinner = LoopSpinner(asyncio.get_running_loop(), 0.05)
        spinner.touch()
        assert spinner.spinning
        await asyncio.sleep(0.02)  # inside the window: the loop polls instead of sleeping
        polls, sleeps = selector.polls, selector.sleeps
        assert polls > 10 and sleeps <= 1, (polls, sleeps)
        spinner.touch()  # a touch extends the window
        await asyncio.sleep(0.04)
        assert spinner.spinning
        deadline = time.monotonic() + 5
        while spinner.spinning and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not spinner.spinning  # past the window it stops by itself
        before = selector.polls
        await asyncio.sleep(0.05)  # an idle loop sleeps: no more polling
        return selector.polls - before

    assert _run(main, selector) <= 2


def test_one_spinner_per_loop_with_the_longest_window():
    async def main():
        loop = asyncio.get_running_loop()
        a = LoopSpinner.of(loop, 0.001)
        b = LoopSpinner.of(loop, 0.003)
        assert a is b and a.window_s == 0.003

    asyncio.run(main())
    with pytest.raises(ValueError):
        LoopSpinner(asyncio.new_event_loop(), 0)
    with pytest.raises(ValueError, match="busy_poll_us"):
        SchedulerConfig(busy_poll_us=-1)
    # on by default, with a window longer than a lone client's round trip on the H200 (~0.3 ms)
    assert SchedulerConfig().busy_poll_us == 1000


@pytest.mark.parametrize("busy_poll_us", [0, 200_000])
def test_a_scheduler_on_the_loop_keeps_it_polling_between_steps_unless_turned_off(busy_poll_us):
    """A client stepping one session: with busy polling (on by default), the gaps between its steps
    are polled, not slept; with it off (0), the loop sleeps in them. The answers are the same."""
    selector = _CountingSelector()

    async def main():
        scheduler, ids = _scheduler("poll", _DeviceLikeBackend)
        scheduler.config = SchedulerConfig(runs_on="loop", device_wait="poll", busy_poll_us=busy_poll_us)
        loop = asyncio.get_running_loop()
        start_scheduler(Shard(0, scheduler.backend, scheduler.sessions, scheduler), loop)
        results = []
        for step in range(3):
            fut = loop.create_future()
            scheduler.submit_decode(_work(ids[0], 0, step), fut.set_result)
            results.append(await asyncio.wait_for(fut, 10))
            sleeps = selector.sleeps
            await asyncio.sleep(0.02)  # the client's think time between two steps
            slept = selector.sleeps - sleeps
            assert (slept == 0) if busy_poll_us else (slept >= 1), slept
        scheduler.stop()
        return [r.positions for r in results]

    assert _run(main, selector) == [(1,), (2,), (3,)]

