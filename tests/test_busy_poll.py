"""Busy polling (gdn_server.busy_poll): the loop stays awake for the window after an answer, then
sleeps again; a scheduler on the loop keeps it awake between the steps of a client, and so does a
front-end worker's link to its engine."""
from __future__ import annotations

import asyncio
import contextlib
import selectors
import socket
import threading
import time
from typing import Iterator

import grpc
import pytest

from gdn_server.busy_poll import LoopSpinner
from gdn_server.config import SchedulerConfig
from gdn_server.errors import GdnError, Unavailable
from gdn_server import frontend
from gdn_server.frontend import EngineLinkClient
from gdn_server.link import FrameBuffer, encode_reply, request_tag
from gdn_server.server import start_scheduler
from gdn_server.placement import Shard

from test_scheduler_loop import SHAPE, _DeviceLikeBackend, _scheduler, _work


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


@contextlib.contextmanager
def _fake_engine(path: str, delay_s: float) -> Iterator[None]:
    """An engine listening at `path` on a thread, for one worker link (`_answer_link`)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    engine = threading.Thread(target=_answer_link, args=(listener, delay_s), daemon=True)
    engine.start()
    try:
        yield
    finally:
        listener.close()
        engine.join(10)


def _answer_link(listener: socket.socket, delay_s: float) -> None:
    """An engine's end of one worker link that answers every request frame, `delay_s` late, with
    an error reply (the worker's side of the wait is what is under test)."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(30)
        incoming, hello_read = FrameBuffer(), False
        try:
            while incoming.fill(conn):
                for frame in incoming.frames():
                    if not hello_read:  # the link's first frame
                        hello_read = True
                        continue
                    time.sleep(delay_s)
                    reply = encode_reply(request_tag(frame), Unavailable("answered by the fake engine"))
                    conn.sendall(b"".join(reply))
        except OSError:  # the worker closed the link
            return


@pytest.mark.timeout(60)
@pytest.mark.parametrize("busy_poll_us", [0, 200_000])
def test_a_front_end_worker_keeps_its_loop_polling_while_the_engine_answers_and_between_steps(tmp_path, busy_poll_us):
    """A worker at one client waits twice a step: for the engine's reply, then for the client's
    next request. With busy polling its loop polls through both; with it off (0) it sleeps."""
    path = str(tmp_path / "link.sock")
    selector = _CountingSelector()

    async def main():
        loop = asyncio.get_running_loop()
        spinner = LoopSpinner.of(loop, busy_poll_us / 1e6) if busy_poll_us else None
        client = await EngineLinkClient.connect(path, SHAPE, rings=False, spinner=spinner)
        try:
            for step in range(3):
                sleeps = selector.sleeps
                with pytest.raises(GdnError, match="fake engine") as answer:
                    await asyncio.wait_for(client.submit(_work("s", 0, step)), 10)
                assert answer.value.code == grpc.StatusCode.UNAVAILABLE
                waiting = selector.sleeps - sleeps
                sleeps = selector.sleeps
                await asyncio.sleep(0.02)  # the client's think time between two steps
                between = selector.sleeps - sleeps
                if busy_poll_us:
                    assert waiting == 0 and between == 0, (waiting, between)
                else:
                    assert waiting >= 1 and between >= 1, (waiting, between)
        finally:
            await client.close()

    with _fake_engine(path, 0.02):
        _run(main, selector)


class _RecordingSpinner:
    window_s = 0.001

    def __init__(self) -> None:
        self.touches = 0

    def touch(self) -> None:
        self.touches += 1


@pytest.mark.timeout(60)
def test_a_front_end_link_stops_polling_once_its_requests_overlap(tmp_path, monkeypatch):
    """A worker whose link carries several requests at once (several busy clients) leaves its
    loop to sleep for CROWDED_HOLD_S: it has work enough to stay awake, and spinning would take
    a core from the rest. Alone again after that, it polls again."""
    monkeypatch.setattr(frontend, "CROWDED_HOLD_S", 0.3)
    path = str(tmp_path / "link.sock")
    spinner = _RecordingSpinner()

    async def answered(fut: asyncio.Future) -> None:
        with pytest.raises(GdnError, match="fake engine"):
            await asyncio.wait_for(fut, 10)

    async def main():
        client = await EngineLinkClient.connect(path, SHAPE, rings=False, spinner=spinner)
        try:
            await answered(client.submit(_work("s", 0, 0)))
            assert spinner.touches == 2  # alone: its send and its reply
            first = client.submit(_work("s", 0, 1))
            second = client.submit(_work("s", 0, 2))  # overlaps the first: crowded from here
            await answered(first)
            await answered(second)
            await answered(client.submit(_work("s", 0, 3)))  # alone, but within the hold
            assert spinner.touches == 3, spinner.touches  # only the first of the overlapping two
            await asyncio.sleep(0.35)
            await answered(client.submit(_work("s", 0, 4)))
            assert spinner.touches == 5, spinner.touches
        finally:
            await client.close()

    with _fake_engine(path, 0.01):
        asyncio.run(main())
