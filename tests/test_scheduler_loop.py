"""The scheduler on an event loop (`Scheduler.start_on`), in-process with the CPU backend: the
paths a server run does not reach on its own (stop from the loop's own thread, a round that
raises), and the same answers as the scheduler on its thread."""
from __future__ import annotations

import asyncio

import pytest
import torch

from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.errors import GdnError
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import SessionTable
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork

SHAPE = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2)


def _scheduler() -> tuple[Scheduler, list[str]]:
    backend = CpuBackend(SHAPE, random_gate_params(SHAPE, 0), 4)
    sessions = SessionTable(4, SHAPE.num_layers, range(backend.home_rows, backend.pool_rows))
    ids = [sessions.create().id for _ in range(3)]
    return Scheduler(backend, sessions, SchedulerConfig(runs_on="loop")), ids


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


def test_runs_on_is_checked():
    with pytest.raises(ValueError, match="runs_on"):
        SchedulerConfig(runs_on="gpu")
