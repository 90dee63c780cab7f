"""The scheduler on an event loop (`Scheduler.start_on`), in-process with the CPU backend: the
paths a server run does not reach on its own (stop from the loop's own thread, a round that
raises), and the same answers as the scheduler on its thread."""
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

    asynchronous = True

    def submit(self, batch):
        return _SlowStep(super().submit(batch))


def _scheduler(device_wait: str = "auto", backend_type: type = CpuBackend) -> tuple[Scheduler, list[str]]:
    backend = backend_type(SHAPE, random_gate_params(SHAPE, 0), 4)
    sessions = SessionTable(4, SHAPE.num_layers, range(backend.home_rows, backend.pool_rows))
    ids = [sessions.create().id for _ in range(3)]
    return Scheduler(backend, sessions, SchedulerConfig(runs_on="loop", device_wait=device_wait)), ids


def _work(session_id: str, layer: int, seed: int) -> DecodeWork:
    g = torch.Generator().manual_seed(seed)
    H, HV, K = SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k
    x = {n: torch.randn(*s, generator=g) for n, s in
         {"q": (1, 1, H, K), "k": (1, 1, H, K), "v": (1, 1, HV, K), "a": (1, 1, HV), "b": (1, 1, HV)}.items()}
    return DecodeWork(layer, (session_id,), **x)


async def _run_steps(scheduler: Scheduler, ids: list[str], on_loop: bool) -> list:
    loop = asyncio.get_running_loop()
    if on_loop:
        scheduler.start_on(loop)
    else:
        scheduler.start()
    futures = []
    for step in range(4):
        for i, sid in enumerate(ids):
            fut = loop.create_future()
            scheduler.submit_decode(_work(sid, step % 2, 10 * step + i),
                                    lambda r, f=fut: loop.call_soon_threadsafe(f.set_result, r))
            futures.append(fut)
    results = await asyncio.wait_for(asyncio.gather(*futures), 30)
    if on_loop:
        scheduler.stop()  # on the loop's own thread: it runs what is left itself
    else:
        await loop.run_in_executor(None, scheduler.stop)
    assert not scheduler.running
    return results


def test_the_loop_answers_as_the_thread_does_and_stops_on_its_own_thread():
    outs = {}
    for on_loop in (False, True):
        scheduler, ids = _scheduler()
        results = asyncio.run(_run_steps(scheduler, ids, on_loop))
        assert all(not isinstance(r, BaseException) for r in results), results
        outs[on_loop] = [(r.out, r.positions) for r in results]
    assert outs[True] == outs[False]


def test_a_round_that_raises_answers_the_queued_work():
    scheduler, ids = _scheduler()

    def broken(*args, **kwargs):
        raise RuntimeError("bug")

    scheduler._launch = broken  # what a bug in admission would do

    async def main():
        loop = asyncio.get_running_loop()
        scheduler.start_on(loop)
        fut = loop.create_future()
        scheduler.submit_decode(_work(ids[0], 0, 1), fut.set_result)
        result = await asyncio.wait_for(fut, 10)
        await asyncio.sleep(0.05)  # no round spins on after it
        assert not scheduler._round_scheduled
        return result

    result = asyncio.run(main())
    assert isinstance(result, GdnError) and "internal scheduler error" in str(result)


def test_runs_on_and_device_wait_are_checked():
    with pytest.raises(ValueError, match="runs_on"):
        SchedulerConfig(runs_on="gpu")
    with pytest.raises(ValueError, match="device_wait"):
        SchedulerConfig(device_wait="spin")


def test_every_device_wait_answers_alike_and_auto_uses_the_waiter_only_under_load():
    """Launches that take milliseconds: polled once per loop iteration, waited for by the waiter
    thread, or (auto) polled while one request is in flight and waited for once several are. The
    answers are the same; the waiter thread exists only where it was used."""
    outs, waited = {}, {}
    for mode in ("poll", "thread", "auto", "inline"):
        scheduler, ids = _scheduler(mode, _DeviceLikeBackend)
        results = asyncio.run(_run_steps(scheduler, ids, on_loop=True))
        assert all(not isinstance(r, BaseException) for r in results), results
        outs[mode] = [(r.out, r.positions) for r in results]
        waited[mode] = scheduler._waiter is not None
    assert outs["poll"] == outs["thread"] == outs["auto"] == outs["inline"]
    # _run_steps queues 12 requests at once; inline waits in the round itself
    assert waited == {"poll": False, "thread": True, "auto": True, "inline": False}

    async def one_at_a_time(scheduler, ids):
        loop = asyncio.get_running_loop()
        scheduler.start_on(loop)
        for step in range(3):
            fut = loop.create_future()
            scheduler.submit_decode(_work(ids[0], 0, step), fut.set_result)
            assert not isinstance(await asyncio.wait_for(fut, 10), BaseException)
        scheduler.stop()

    scheduler, ids = _scheduler("auto", _DeviceLikeBackend)
    asyncio.run(one_at_a_time(scheduler, ids))
    assert scheduler._waiter is None  # one request per launch: polled, no thread hand-off


def test_inline_answers_each_launch_in_the_round_that_made_it():
    """device_wait 'inline': a round's launch is answered before the round returns, so nothing
    is left in flight between rounds and no later round is needed to answer it."""
    scheduler, ids = _scheduler("inline", _DeviceLikeBackend)
    in_flight_after_rounds = []
    advance = scheduler._advance

    def recording_advance() -> bool:
        again = advance()
        in_flight_after_rounds.append(len(scheduler._in_flight))
        return again

    scheduler._advance = recording_advance

    async def main() -> list:
        loop = asyncio.get_running_loop()
        scheduler.start_on(loop)
        results = []
        for step in range(3):
            futs = [loop.create_future() for _ in ids]
            for i, (sid, fut) in enumerate(zip(ids, futs)):
                scheduler.submit_decode(_work(sid, 0, 10 * step + i), fut.set_result)
            results += await asyncio.wait_for(asyncio.gather(*futs), 10)
        scheduler.stop()
        return results

    results = asyncio.run(main())
    assert all(not isinstance(r, BaseException) for r in results), results
    assert [r.positions for r in results[-3:]] == [(3,)] * 3
    assert in_flight_after_rounds and set(in_flight_after_rounds) == {0}
    assert scheduler.stats.launches == 3  # each step's three requests in one launch
    assert scheduler._waiter is None


def test_auto_answers_inline_only_on_a_loop_that_serves_no_rpcs_and_only_one_scheduler():
    """device_wait 'auto': an engine's scheduler (its loop serves only the --frontends link) alone
    on its loop waits for the device in the launching round; a loop that serves gRPC, or holds
    several devices' schedulers, never waits on a device."""

    async def inline_on_loop(serves_rpcs: bool, schedulers: int) -> list[bool]:
        loop = asyncio.get_running_loop()
        made = [_scheduler("auto", _DeviceLikeBackend)[0] for _ in range(schedulers)]
        for scheduler in made:
            scheduler.loop_serves_rpcs = serves_rpcs
            scheduler.start_on(loop)
        return [scheduler.answers_inline() for scheduler in made]

    assert asyncio.run(inline_on_loop(False, 1)) == [True]
    assert asyncio.run(inline_on_loop(True, 1)) == [False]
    assert asyncio.run(inline_on_loop(False, 2)) == [False, False]


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

    async def one_step(scheduler, ids):
        loop = asyncio.get_running_loop()
        scheduler.start_on(loop)
        fut = loop.create_future()
        scheduler.submit_decode(_work(ids[0], 0, 1), fut.set_result)
        result = await asyncio.wait_for(fut, 5)  # a launch nobody polls would never be answered
        scheduler.stop()
        return result

    scheduler, ids = _scheduler("thread", _Backend)
    result = asyncio.run(one_step(scheduler, ids))
    assert not isinstance(result, BaseException), result
    assert scheduler._waiter is not None


def test_requests_from_another_thread_during_a_queue_delay_are_all_answered():
    """submit_decode may come from any thread. With --max-queue-delay-us the loop's round looks
    for the oldest pending request; a request queued from another thread meanwhile must not break
    that look (the H200 run of --frontends 8 with a 400 us delay answered 38 of 46,697 requests
    'internal scheduler error: deque mutated during iteration' while the link read on a thread)."""
    backend = _DeviceLikeBackend(SHAPE, random_gate_params(SHAPE, 0), 16)
    sessions = SessionTable(16, SHAPE.num_layers, range(backend.home_rows, backend.pool_rows))
    ids = [sessions.create().id for _ in range(16)]
    scheduler = Scheduler(backend, sessions, SchedulerConfig(runs_on="loop", max_queue_delay_us=200))
    works = [_work(sid, 0, i) for i, sid in enumerate(ids)]

    async def main() -> list:
        loop = asyncio.get_running_loop()
        scheduler.start_on(loop)
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


def test_a_batch_of_requests_queues_in_order_until_the_queue_is_full():
    """submit_decodes (the front-end link's reads) queues like submit_decode one by one: in
    order, up to --max-queue-rows (a first request bigger than that still runs alone), the rest
    refused with UNAVAILABLE at once; after stop_accepting, every one is refused."""
    backend = CpuBackend(SHAPE, random_gate_params(SHAPE, 0), 4)
    sessions = SessionTable(4, SHAPE.num_layers, range(backend.home_rows, backend.pool_rows))
    ids = [sessions.create().id for _ in range(3)]
    scheduler = Scheduler(backend, sessions, SchedulerConfig(max_queue_rows=2))  # not started: nothing runs
    answers: dict[str, object] = {}

    def request(i: int) -> tuple:
        return _work(ids[i], 0, seed=i), (lambda result, i=i: answers.__setitem__(f"r{i}", result)), None

    scheduler.submit_decodes([request(0), request(1), request(2)])
    assert scheduler.queue_depth() == 2
    assert list(answers) == ["r2"] and answers["r2"].code == grpc.StatusCode.UNAVAILABLE
    assert "queue is full" in str(answers["r2"])
    scheduler.stop_accepting()
    scheduler.submit_decodes([request(2)])
    assert scheduler.queue_depth() == 2 and "shutting down" in str(answers["r2"])
    previous = scheduler.run_round([])  # what was queued still runs, in order
    scheduler.run_round(previous)
    assert [sessions.find(i).positions[0] for i in ids] == [1, 1, 0]
    assert isinstance(answers["r0"], DecodeResult) and isinstance(answers["r1"], DecodeResult)
