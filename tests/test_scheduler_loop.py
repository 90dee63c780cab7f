"""The scheduler's rounds on an event loop, in-process with the CPU backend's math: launches done
when they return (a small CPU launch) and launches that finish later (as a device's do). The
paths a CPU server run does not reach on its own: polling a launch, the waiter thread, stop from
the loop's own thread, a round that raises."""
from __future__ import annotations

import asyncio
import sys
import time

import grpc
import pytest
import torch

from gdn_server.backends.base import PendingStep
from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.errors import GdnError
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import SessionTable
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeResult, DecodeWork

SHAPE = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2)


class _SlowStep(PendingStep):
    """A launch that takes a few milliseconds, as one on a device does: not ready at first."""

    def __init__(self, inner: PendingStep) -> None:
        self._inner = inner
        self._done_at = time.monotonic() + 0.003

    def ready(self) -> bool:
        return time.monotonic() >= self._done_at

    def wait(self) -> None:
        time.sleep(max(0.0, self._done_at - time.monotonic()))

    def result(self) -> torch.Tensor:
        self.wait()
        return self._inner.result()


class _DeviceLikeBackend(CpuBackend):
    """The CPU backend's math behind launches that finish later, as CudaBackend's do."""

    def submit(self, batch):
        return _SlowStep(super().submit(batch))


def _scheduler(backend_type: type = CpuBackend, config: SchedulerConfig = SchedulerConfig(),
               sessions_n: int = 3) -> tuple[Scheduler, list[str]]:
    backend = backend_type(SHAPE, random_gate_params(SHAPE, 0), max(4, sessions_n))
    sessions = SessionTable(max(4, sessions_n), SHAPE.num_layers)
    ids = [sessions.create().id for _ in range(sessions_n)]
    return Scheduler(backend, sessions, config), ids


def _work(session_id: str, layer: int, seed: int) -> DecodeWork:
    g = torch.Generator().manual_seed(seed)
    H, HV, K = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k
    x = {n: torch.randn(*s, generator=g) for n, s in
         {"q": (1, 1, H, K), "k": (1, 1, H, K), "v": (1, 1, HV, K), "a": (1, 1, HV), "b": (1, 1, HV)}.items()}
    return DecodeWork(layer, (session_id,), **x)


async def _run_steps(scheduler: Scheduler, ids: list[str]) -> list:
    loop = asyncio.get_running_loop()
    scheduler.start(loop)
    futures = []
    for step in range(4):
        for i, sid in enumerate(ids):
            fut = loop.create_future()
            scheduler.submit_decode(_work(sid, step % 2, 10 * step + i),
                                    lambda r, f=fut: loop.call_soon_threadsafe(f.set_result, r))
            futures.append(fut)
    results = await asyncio.wait_for(asyncio.gather(*futures), 30)
    scheduler.stop()  # on the loop's own thread: it runs what is left itself
    assert not scheduler.running
    return results


def test_launches_that_finish_later_are_answered_alike_and_waited_on_a_thread_only_under_load():
    outs = {}
    for backend_type in (CpuBackend, _DeviceLikeBackend):
        scheduler, ids = _scheduler(backend_type)
        results = asyncio.run(_run_steps(scheduler, ids))
        assert all(not isinstance(r, BaseException) for r in results), results
        outs[backend_type] = [(r.out, r.positions) for r in results]
    assert outs[CpuBackend] == outs[_DeviceLikeBackend]
    # _run_steps queues 12 requests at once: the loop left their launches' waits to the waiter thread
    assert scheduler._waiter is not None

    async def one_at_a_time(scheduler, ids):
        loop = asyncio.get_running_loop()
        scheduler.start(loop)
        for step in range(3):
            fut = loop.create_future()
            scheduler.submit_decode(_work(ids[0], 0, step), fut.set_result)
            assert not isinstance(await asyncio.wait_for(fut, 10), BaseException)
        scheduler.stop()

    scheduler, ids = _scheduler(_DeviceLikeBackend)
    asyncio.run(one_at_a_time(scheduler, ids))
    assert scheduler._waiter is None  # one request per launch: polled, no thread hand-off


@pytest.mark.parametrize("backend_type", [CpuBackend, _DeviceLikeBackend], ids=["done-at-once", "finish-later"])
def test_a_round_that_raises_answers_its_work_with_internal_and_the_scheduler_goes_on(backend_type):
    scheduler, ids = _scheduler(backend_type)
    launch = scheduler._launch
    calls = []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("bug")  # what a bug in admission would do
        return launch(*args, **kwargs)

    scheduler._launch = broken_once

    async def main():
        loop = asyncio.get_running_loop()
        scheduler.start(loop)
        results = []
        for seed in (1, 2):
            fut = loop.create_future()
            scheduler.submit_decode(_work(ids[0], 0, seed), lambda r, f=fut: loop.call_soon_threadsafe(f.set_result, r))
            results.append(await asyncio.wait_for(fut, 10))
        await asyncio.sleep(0.05)
        assert not scheduler._round_posted  # no round spins on after it
        scheduler.stop()
        return results

    failed, served = asyncio.run(main())
    assert isinstance(failed, GdnError) and failed.code == grpc.StatusCode.INTERNAL
    assert "internal scheduler error" in str(failed)
    assert isinstance(served, DecodeResult) and served.positions == (1,)  # the failed round applied nothing
    assert scheduler.stalled_s() == 0.0


def test_a_launch_whose_wait_returns_early_is_polled_to_its_end():
    """The waiter thread's wait can end before the launch does (a failed wait): the loop then
    polls that launch instead of waiting for a post that will not come."""

    class _EarlyWait(_SlowStep):
        def wait(self) -> None:
            raise RuntimeError("the wait failed")

        def result(self) -> torch.Tensor:
            _SlowStep.wait(self)
            return self._inner.result()

    class _Backend(_DeviceLikeBackend):
        def submit(self, batch):
            return _EarlyWait(CpuBackend.submit(self, batch))

    async def two_requests(scheduler, ids):
        loop = asyncio.get_running_loop()
        scheduler.start(loop)
        futs = [loop.create_future() for _ in range(2)]
        for i, fut in enumerate(futs):  # two requests in one launch: the loop hands its wait to the waiter
            scheduler.submit_decode(_work(ids[i], 0, i), fut.set_result)
        results = await asyncio.wait_for(asyncio.gather(*futs), 5)  # a launch nobody polls would never be answered
        scheduler.stop()
        return results

    scheduler, ids = _scheduler(_Backend)
    results = asyncio.run(two_requests(scheduler, ids))
    assert all(not isinstance(r, BaseException) for r in results), results
    assert scheduler._waiter is not None


def test_requests_from_another_thread_during_a_queue_delay_are_all_answered():
    """submit_decode may come from any thread. With --max-queue-delay-us the loop's round looks
    for the oldest pending request; a request queued from another thread meanwhile must not break
    that look (the deque must not be iterated while another thread appends to it)."""
    scheduler, ids = _scheduler(_DeviceLikeBackend, SchedulerConfig(max_queue_delay_us=200), sessions_n=16)
    works = [_work(sid, 0, i) for i, sid in enumerate(ids)]

    async def main() -> list:
        loop = asyncio.get_running_loop()
        scheduler.start(loop)
        results: list = []
        answered = asyncio.Event()
        total = 3000

        def done(result) -> None:
            results.append(result)
            if len(results) == total:
                loop.call_soon_threadsafe(answered.set)

        def submit_from_a_thread() -> None:  # as fast as it can, and never more than 64 queued
            for i in range(total):
                while i - len(results) >= 64:
                    time.sleep(0)
                scheduler.submit_decode(works[i % len(works)], done)

        await asyncio.wait_for(asyncio.gather(loop.run_in_executor(None, submit_from_a_thread), answered.wait()), 60)
        scheduler.stop()
        return results

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the two threads take turns as often as they can: the race's window is a few bytecodes
    try:
        results = asyncio.run(main())
    finally:
        sys.setswitchinterval(interval)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(results) == 3000 and not errors, errors[:3]


def test_requests_queue_in_order_until_the_queue_is_full():
    """Requests queue in order up to --max-queue-rows (a first request bigger than that still
    runs alone), the rest refused with UNAVAILABLE at once; after stop_accepting, every one is."""
    scheduler, ids = _scheduler(CpuBackend, SchedulerConfig(max_queue_rows=2))  # not started: nothing runs
    answers: dict[str, object] = {}

    def submit(i: int) -> None:
        scheduler.submit_decode(_work(ids[i], 0, seed=i), lambda result, i=i: answers.__setitem__(f"r{i}", result))

    for i in range(3):
        submit(i)
    assert scheduler.queue_depth() == 2
    assert list(answers) == ["r2"] and answers["r2"].code == grpc.StatusCode.UNAVAILABLE
    assert "queue is full" in str(answers["r2"])
    scheduler.stop_accepting()
    submit(2)
    assert scheduler.queue_depth() == 2 and "shutting down" in str(answers["r2"])

    async def drain():
        scheduler.start(asyncio.get_running_loop())  # what was queued still runs, in order
        scheduler.stop()

    asyncio.run(drain())
    assert [scheduler.sessions.find(i).positions[0] for i in ids] == [1, 1, 0]
    assert isinstance(answers["r0"], DecodeResult) and isinstance(answers["r1"], DecodeResult)
