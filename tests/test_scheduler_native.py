"""The scheduler's C loops for plain steps (gdn_server/_native_scheduler.c) against its Python.

Two identical worlds (CPU backend, session table, scheduler) take the same random rounds: steps
plain and speculative, retries, wrong positions, unknown sessions, other owners, cancelled
requests, commits between steps, rounds past max_batch_rows. One scheduler runs plain steps in C,
the other runs everything in Python. They must launch the same batches, give the same answers in
the same order and leave the same session records and state pools.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.errors import GdnError
from gdn_server.lifecycle import commit_speculation
from gdn_server.native import module as native_module
from gdn_server.scheduler import Scheduler
from gdn_server.decode_rpcs import encode_decode_reply
from gdn_server.sessions import SessionTable
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeResult, DecodeWork

from util import bf16_step_inputs, numbered_sessions, session_records, step_positions

pytestmark = pytest.mark.skipif(
    native_module is None or not hasattr(native_module, "admit_plain"), reason="gdn_server._native is not built"
)

SHAPE = ModelShape(num_layers=3, num_q_heads=1, num_v_heads=2, head_dim_k=8, head_dim_v=8)
SESSIONS = 6
OWNERS = (None,) * (SESSIONS - 1) + ("alice",)  # the owner of each session; the request's is its first session's

class _World:
    """A CPU backend, a session table and a scheduler, built the same way every time."""

    def __init__(self, native, max_rows: int, encode: bool) -> None:
        self.backend = CpuBackend(SHAPE, random_gate_params(SHAPE, 0), SESSIONS, speculative_sessions=2)
        self.launches: list[tuple] = []
        submit = self.backend.submit

        def recording_submit(batch):
            self.launches.append(
                (batch.tokens, list(batch.slots), list(batch.out_slots), list(batch.layers),
                 [w.request_id for w in batch.works])
            )
            return submit(batch)

        self.backend.submit = recording_submit
        self.table, self.ids = numbered_sessions(self.backend, SHAPE.num_layers, OWNERS)
        self.scheduler = Scheduler(self.backend, self.table, SchedulerConfig(max_batch_rows=max_rows), native=native)
        if encode:
            self.scheduler.encode_reply = encode_decode_reply
        self.answers: list[tuple] = []
        self.previous: list = []

    def answer(self, request_id: str):
        def done(result) -> None:
            if isinstance(result, DecodeResult):
                self.answers.append(
                    (request_id, "ok", bytes(result.out), result.shape, result.positions, result.request_id,
                     None if result.wire is None else bytes(result.wire))
                )
            else:
                kind = type(result).__name__
                self.answers.append((request_id, kind, str(result) if isinstance(result, GdnError) else repr(result)))
        return done

    def records(self) -> list:
        return session_records(self.table, self.ids)


def _bf16(seed: int, rows: int, T: int) -> tuple[tuple[bytes, ...], tuple[tuple[int, ...], ...]]:
    return bf16_step_inputs(SHAPE, seed, rows, T)


_step = st.tuples(
    st.just("step"),
    # index SESSIONS: an unknown id (rarely)
    st.lists(st.sampled_from(tuple(range(SESSIONS)) * 4 + (SESSIONS,)), min_size=1, max_size=3, unique=True),
    st.integers(0, SHAPE.num_layers - 1),
    st.sampled_from((1, 1, 1, 2)),  # T
    st.sampled_from(("right",) * 6 + ("wrong", "retry", "retry", "none")),  # positions sent
    st.sampled_from((False,) * 4 + (True,)),  # speculative
    st.sampled_from((0,) * 15 + (1,)),  # 1: sent by another owner than the first session's
    st.sampled_from((False,) * 15 + (True,)),  # cancelled before its round
)
_commit = st.tuples(st.just("commit"), st.integers(0, SESSIONS - 1), st.integers(0, 2))
_rounds = st.lists(
    st.lists(st.one_of(*(_step,) * 6, _commit), max_size=12), min_size=1, max_size=8
)

def _queue(world: _World, round_no: int, ops: list) -> None:
    """Queues one round's operations; positions come from the world's records at the round's start.
    The decode requests between control items go in with one submit_decodes, as the front-end
    link queues a read's (its items made in C where the world's scheduler is native)."""
    expected: dict[tuple[int, int], int] = {}  # (session, layer) -> the position after earlier steps of this round
    run: list[tuple] = []
    for k, op in enumerate(ops):
        request_id = f"r{round_no}.{k}"
        if op[0] == "commit":
            if run:
                world.scheduler.submit_decodes(run)
                run = []
            _, index, accepted = op
            sid = world.ids[index]
            world.scheduler.submit_control(
                lambda sid=sid, accepted=accepted, owner=OWNERS[index]: commit_speculation(
                    world.table, world.backend, sid, accepted, owner
                ),
                world.answer(request_id),
            )
            continue
        _, indices, layer, T, pos_mode, speculative, other_owner, cancelled = op
        ids = tuple(world.ids[i] if i < SESSIONS else "nobody" for i in indices)
        found = [(i, world.table.find(world.ids[i]) if i < SESSIONS else None) for i in indices]
        positions = step_positions(found, layer, T, pos_mode, expected)
        raw, dims = _bf16(1000 * round_no + k, len(ids), T)
        work = DecodeWork.of_bf16(layer, ids, positions, request_id, speculative, raw, dims, True)
        owner = OWNERS[indices[0]] if indices[0] < SESSIONS else None
        work.__dict__["owner"] = ("mallory" if owner is None else None) if other_owner else owner
        gone = (lambda: True) if cancelled else None
        run.append((work, world.answer(request_id), gone))
    if run:
        world.scheduler.submit_decodes(run)


def _drain(world: _World) -> None:
    for _ in range(100):
        world.previous = world.scheduler.run_round(world.previous)
        if not world.previous and not world.scheduler.queue_depth():
            return
    raise AssertionError("the scheduler did not drain")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds=_rounds, max_rows=st.sampled_from((1, 3, 64)), encode=st.booleans())
def test_native_rounds_match_python_rounds(rounds, max_rows, encode):
    worlds = [_World(native_module, max_rows, encode), _World(None, max_rows, encode)]
    for round_no, ops in enumerate(rounds):
        for world in worlds:
            _queue(world, round_no, ops)
            world.previous = world.scheduler.run_round(world.previous)
        native, python = worlds
        assert native.launches == python.launches
        assert native.answers == python.answers
        assert native.records() == python.records()
    for world in worlds:
        _drain(world)
    native, python = worlds
    assert native.launches == python.launches
    assert native.answers == python.answers
    assert native.records() == python.records()
    assert torch.equal(native.backend.state_pool, python.backend.state_pool)
    assert _same_counts(native, python)


def _same_counts(a: _World, b: _World) -> bool:
    """SchedulerStats but the timings, which differ between runs."""
    sa, sb = a.scheduler.stats, b.scheduler.stats
    return (sa.launches, sa.rows_launched, sa.requests, sa.batches) == (sb.launches, sb.rows_launched, sb.requests, sb.batches)


def test_native_rounds_take_plain_steps():
    """The C loops run for plain steps: a round of plain steps goes through admit_plain,
    submit_plain and finish_plain once each."""
    world = _World(native_module, 64, True)
    calls: dict[str, int] = {}

    class Counting:
        def __getattr__(self, name):
            fn = getattr(native_module, name)

            def counted(*args):
                calls[name] = calls.get(name, 0) + 1
                return fn(*args)
            return counted

    world.scheduler._native = Counting()
    _queue(world, 0, [("step", [i], 0, 1, "right", False, 0, False) for i in range(SESSIONS)])
    world.previous = world.scheduler.run_round(world.previous)
    _drain(world)
    assert calls == {"admit_plain": 1, "submit_plain": 1, "finish_plain": 1}
    assert [a[1] for a in world.answers] == ["ok"] * SESSIONS
    assert [r[0][0] for r in world.records()] == [1] * SESSIONS


def test_items_made_in_c_are_the_python_items():
    """make_decode_items builds what submit_decodes' Python builds: the same work, done,
    cancelled and rows, with the one clock reading it is given."""
    from gdn_server.scheduler import _DecodeItem

    table = SessionTable(2, SHAPE.num_layers)
    ids = [table.create().id for _ in range(2)]
    raw, dims = _bf16(1, 2, 1)
    works = [DecodeWork.of_bf16(0, tuple(ids), None, "both", False, raw, dims, True),
             DecodeWork.of_bf16(1, (ids[0],), None, "one", False, *_bf16(2, 1, 1), True)]
    dones = [lambda r: None, lambda r: None]
    requests = [(works[0], dones[0], None), (works[1], dones[1], lambda: False)]
    items = native_module.make_decode_items(requests, _DecodeItem, 12.5)
    assert [type(i) for i in items] == [_DecodeItem, _DecodeItem]
    for item, (work, done, cancelled) in zip(items, requests):
        reference = _DecodeItem(work, done, len(work.session_ids), cancelled)
        # every slot __init__ fills (a field added there and not in the C fails here), alike but the clock
        for name in _DecodeItem.__slots__:
            assert getattr(item, name) == getattr(reference, name) or name == "enqueued", name
        assert item.enqueued == 12.5
    with pytest.raises(TypeError, match="each request is"):
        native_module.make_decode_items([(works[0], dones[0])], _DecodeItem, 0.0)


def test_a_read_that_fits_the_queue_goes_in_whole_and_in_order():
    """submit_decodes' one-extend path (every request fits under --max-queue-rows) queues what
    the item-by-item path would, in order."""
    world = _World(native_module, 64, False)
    raw, dims = _bf16(3, 1, 1)
    requests = [(DecodeWork.of_bf16(layer, (world.ids[i],), None, f"q{i}.{layer}", False, raw, dims, True),
                 world.answer(f"q{i}.{layer}"), None) for layer in range(2) for i in range(3)]
    world.scheduler.submit_decodes(requests)
    assert world.scheduler.queue_depth() == 6
    _drain(world)
    assert [(a[0], a[1]) for a in world.answers] == [(f"q{i}.{layer}", "ok") for layer in range(2) for i in range(3)]
    assert [world.table.find(world.ids[i]).positions[:2] for i in range(3)] == [[1, 1]] * 3
