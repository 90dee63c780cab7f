"""The engine's lane (gdn_server/_native_lane.c) against the path it stands in for.

Two engines, alike but for the lane, read the same front-end link frames: a real EngineLink
over a socket pair with its shared-memory rings, a real Scheduler (its C loops on in both) and a
CPU backend. One takes plain one-row steps as lane records, the other as DecodeWorks. Random
rounds mix what the lane takes with everything it must leave to the Python path in its place:
several sessions or tokens, speculative steps and the commits after them, retries, wrong
positions, unknown sessions, another owner, cancels, request ids, control operations between
reads, a backend that fails, a small max_batch_rows and a small queue. Both engines must send
the same replies and leave the same session records, state pools and counts.
"""
from __future__ import annotations

import itertools
import select
import socket

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_server import sessions as sessions_module
from gdn_server.backends import staging
from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.engine_link import EngineLink
from gdn_server.errors import GdnError
from gdn_server.lifecycle import commit_speculation
from gdn_server.link import FrameBuffer, decode_reply, encode_cancel, encode_request
from gdn_server.link_ring import RequestRing
from gdn_server.native import module as native_module
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.weights import random_gate_params
from gdn_server.work import DecodeWork, StepBatch

from util import bf16_step_inputs, numbered_sessions, session_records, step_positions

pytestmark = pytest.mark.skipif(
    native_module is None or not hasattr(native_module, "LaneRun"), reason="gdn_server._native is not built"
)

SHAPE = ModelShape(num_layers=3, num_q_heads=1, num_v_heads=2, head_dim_k=8, head_dim_v=8)
SESSIONS = 6
OWNERS = (None,) * (SESSIONS - 1) + ("alice",)
RING_BYTES = 1 << 20


class _Engine:
    """An engine process's link, scheduler and CPU backend, with the worker's end of the socket."""

    def __init__(self, lane: bool, max_rows: int, max_queue_rows: int) -> None:
        self.backend = CpuBackend(SHAPE, random_gate_params(SHAPE, 0), SESSIONS, speculative_sessions=2)
        self.fail_next = False
        self.launches: list[tuple] = []
        submit = self.backend.submit

        def recording_submit(batch):
            # sorted: the lane's rows come after the others', the Python path's in admission order
            self.launches.append((batch.tokens, sorted(zip(batch.slots, batch.out_slots, batch.layers))))
            if batch.lane is not None:
                _check_lane_staging(batch)
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("the device is gone")
            return submit(batch)

        self.backend.submit = recording_submit
        self.table, self.ids = numbered_sessions(self.backend, SHAPE.num_layers, OWNERS)
        config = SchedulerConfig(max_batch_rows=max_rows, max_queue_rows=max_queue_rows)
        self.scheduler = Scheduler(self.backend, self.table, config, native=native_module)
        self.lane_rows = 0
        queue = self.scheduler.submit_decodes

        def counting_submit(requests):
            self.lane_rows += sum(r.rows for r in requests if type(r) is native_module.LaneRun)
            queue(requests)

        self.scheduler.submit_decodes = counting_submit
        self.link = EngineLink("/nonexistent/never-bound.sock", SHAPE, Placement([Shard(0, None, self.table, self.scheduler)]))
        self.link._lane = lane
        self.worker, engine_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.worker.setblocking(False)
        self.conn = self.link._adopt(engine_sock)
        self.conn.greeted = True  # the hello's business: the rings are set here, in one buffer
        memory = memoryview(bytearray(2 * RING_BYTES))
        self.link._use_rings(self.conn, memory[:RING_BYTES], memory[RING_BYTES:])
        self.request_ring, self.reply_view = RequestRing(memory[:RING_BYTES]), memory[RING_BYTES:]
        self.incoming = FrameBuffer()
        self.replies: dict[int, tuple] = {}
        self.control_answers: list = []
        self.previous: list = []

    def send(self, frames: list[bytes]) -> None:
        data = b"".join(bytes(f) for f in frames)
        self.worker.sendall(data)
        while select.select([self.conn.sock], [], [], 0)[0]:  # the loop's reads of what came
            self.link._read_from(self.conn)
        assert self.conn.open

    def round(self) -> None:
        self.previous = self.scheduler.run_round(self.previous)

    def collect(self) -> None:
        """The worker's reading of every reply sent so far."""
        self.link._sender.wait_idle()
        while select.select([self.worker], [], [], 0)[0]:
            assert self.incoming.fill(self.worker)
            for frame in self.incoming.frames():
                tag, result, _ = decode_reply(bytes(frame), SHAPE, self.reply_view)
                self.request_ring.free(tag)
                assert tag not in self.replies, f"request {tag} answered twice"
                if isinstance(result, GdnError):
                    self.replies[tag] = ("error", result.code, str(result))
                else:
                    self.replies[tag] = ("ok", bytes(result.out), result.shape, tuple(result.positions))

    def records(self) -> list:
        return session_records(self.table, self.ids)

    def close(self) -> None:
        self.link.close()
        self.worker.close()


def _check_lane_staging(batch: StepBatch) -> None:
    """A GPU backend stages the lane's rows straight from the request ring (LaneRun.fill, in C):
    the staging must hold what the same rows give as DecodeWorks through the Python fill."""
    plan = staging.make_plan(SHAPE, batch.rows, batch.tokens)
    as_works = StepBatch(tokens=batch.tokens, slots=list(batch.slots), out_slots=list(batch.out_slots),
                         layers=list(batch.layers), works=list(batch._host_works))
    filled = []
    for b, module in ((batch, native_module), (as_works, None)):
        buf = torch.full((plan.total,), 0xA5, dtype=torch.uint8)  # not zeros: a row left out shows
        views = {name: staging.carve(buf, plan.entries[name]) for name in staging.INPUTS}
        saved, staging.native = staging.native, module
        try:
            staging.fill(b, plan, memoryview(buf.numpy()), buf.numpy(), views)
        finally:
            staging.native = saved
        filled.append(buf)
    assert torch.equal(*filled)


def _bf16(seed: int, rows: int, T: int) -> tuple[tuple[bytes, ...], tuple[tuple[int, ...], ...]]:
    return bf16_step_inputs(SHAPE, seed, rows, T)


_step = st.tuples(
    st.just("step"),
    # mostly one session (what the lane takes); index SESSIONS: an unknown id
    st.one_of(
        *(st.lists(st.sampled_from(tuple(range(SESSIONS)) * 4 + (SESSIONS,)), min_size=1, max_size=1),) * 4,
        st.lists(st.sampled_from(tuple(range(SESSIONS))), min_size=2, max_size=3, unique=True),
    ),
    st.integers(0, SHAPE.num_layers - 1),
    st.sampled_from((1,) * 6 + (2,)),  # T
    st.sampled_from(("right",) * 8 + ("wrong", "retry", "retry", "none")),  # positions sent
    st.sampled_from((False,) * 8 + (True,)),  # speculative
    st.sampled_from((0,) * 15 + (1,)),  # 1: sent by another owner than the session's
    st.sampled_from((False,) * 12 + (True,)),  # cancelled right after it is sent
    st.sampled_from(("", "", "r")),  # request id
)
_commit = st.tuples(st.just("commit"), st.integers(0, SESSIONS - 1), st.integers(0, 2))
_fail = st.tuples(st.just("fail"))
_rounds = st.lists(
    st.lists(st.one_of(*(_step,) * 10, _commit, _fail), max_size=14), min_size=1, max_size=7
)


def _play(engine: _Engine, round_no: int, ops: list, tags: itertools.count) -> None:
    """One round's operations; positions come from the engine's records at the round's start.
    The frames between control operations go in one write, as a worker's burst."""
    expected: dict[tuple[int, int], int] = {}
    frames: list = []
    for k, op in enumerate(ops):
        if op[0] == "fail":
            engine.fail_next = True
            continue
        if op[0] == "commit":
            if frames:
                engine.send(frames)
                frames = []
            _, index, accepted = op
            sid = engine.ids[index]
            engine.scheduler.submit_control(
                lambda sid=sid, accepted=accepted, owner=OWNERS[index]: commit_speculation(
                    engine.table, engine.backend, sid, accepted, owner),
                lambda result, k=k: engine.control_answers.append((round_no, k, repr(result))),
            )
            continue
        _, indices, layer, T, pos_mode, speculative, other_owner, cancelled, rid = op
        ids = tuple(engine.ids[i] if i < SESSIONS else "nobody" for i in indices)
        found = [(i, engine.table.find(engine.ids[i]) if i < SESSIONS else None) for i in indices]
        positions = step_positions(found, layer, T, pos_mode, expected)
        raw, dims = _bf16(1000 * round_no + k, len(ids), T)
        owner = OWNERS[indices[0]] if indices[0] < SESSIONS else None
        if other_owner:
            owner = "mallory" if owner is None else None
        work = DecodeWork.of_bf16(layer, ids, positions, f"{rid}{round_no}.{k}" if rid else "", speculative, raw,
                                  dims, True, owner)
        tag = next(tags)
        frames += encode_request(tag, work, engine.request_ring)
        if cancelled:
            frames.append(encode_cancel(tag))
    if frames:
        engine.send(frames)


def _drain(engine: _Engine) -> None:
    for _ in range(100):
        engine.round()
        if not engine.previous and not engine.scheduler.queue_depth():
            return
    raise AssertionError("the scheduler did not drain")


def _same(a: _Engine, b: _Engine) -> None:
    a.collect()
    b.collect()
    assert a.replies == b.replies
    assert a.control_answers == b.control_answers
    assert a.records() == b.records()
    assert a.launches == b.launches


def _run(rounds: list, max_rows: int, max_queue_rows: int) -> tuple[_Engine, _Engine]:
    engines = [_Engine(True, max_rows, max_queue_rows), _Engine(False, max_rows, max_queue_rows)]
    try:
        for round_no, ops in enumerate(rounds):
            for engine in engines:
                _play(engine, round_no, ops, itertools.count(100 * round_no))
                engine.round()
            _same(*engines)
        for engine in engines:
            _drain(engine)
        _same(*engines)
        lane, python = engines
        assert torch.equal(lane.backend.state_pool, python.backend.state_pool)
        sa, sb = lane.scheduler.stats, python.scheduler.stats
        assert (sa.launches, sa.rows_launched, sa.requests) == (sb.launches, sb.rows_launched, sb.requests)
        assert python.lane_rows == 0
        sent = sum(1 for ops in rounds for op in ops if op[0] == "step")
        assert len(lane.replies) == sent  # every request answered once
        return lane, python
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.timeout(600)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds=_rounds, max_rows=st.sampled_from((1, 3, 64)), max_queue_rows=st.sampled_from((4, 10_000)))
def test_the_lane_answers_as_the_python_path(rounds, max_rows, max_queue_rows):
    _run(rounds, max_rows, max_queue_rows)


def _plain(session: int, layer: int) -> tuple:
    return ("step", [session], layer, 1, "right", False, 0, False, "")


@pytest.mark.timeout(120)
def test_plain_steps_take_the_lane():
    """Plain one-row steps of many sessions and layers go through the lane and give the Python
    path's answers; a retry, a wrong position and a speculative step among them leave it."""
    steady = [[_plain(s, layer) for s in range(SESSIONS - 1)] for layer in (0, 1, 2, 0, 1)]
    mixed = [_plain(0, 2), ("step", [1], 2, 1, "retry", False, 0, False, "r"), ("step", [2], 2, 1, "wrong", False, 0,
             False, ""), ("step", [3], 2, 2, "right", True, 0, False, ""), _plain(3, 2), _plain(4, 2)]
    lane, _ = _run(steady + [mixed], max_rows=64, max_queue_rows=10_000)
    assert lane.lane_rows >= 5 * (SESSIONS - 1) + 3


@pytest.mark.timeout(60)
def test_a_full_queue_takes_the_lane_records_that_fit_and_refuses_the_rest():
    lane, python = _run([[_plain(s, 0) for s in range(SESSIONS - 1)]], max_rows=64, max_queue_rows=3)
    refused = [r for r in lane.replies.values() if r[0] == "error"]
    assert len(refused) == 2 and all("queue is full" in r[2] for r in refused)


@pytest.mark.timeout(60)
def test_a_launch_that_fails_after_dispatch_rolls_the_lane_back():
    """A backend whose step fails when its output is read: every lane row is answered with the
    failure and its session's position and last step are as before the step."""
    engines = [_Engine(True, 64, 10_000), _Engine(False, 64, 10_000)]
    try:
        for engine in engines:
            submit = engine.backend.submit

            def failing_submit(batch, submit=submit):
                pending = submit(batch)

                def result_bytes():
                    raise RuntimeError("lost the device mid-step")

                pending.result_bytes = result_bytes
                return pending

            engine.backend.submit = failing_submit
            before = engine.records()
            _play(engine, 0, [_plain(s, 1) for s in range(SESSIONS - 1)], itertools.count())
            _drain(engine)
            assert engine.records() == before
        lane, python = engines
        _same(lane, python)
        assert lane.lane_rows == SESSIONS - 1
        assert all(r[0] == "error" and "lost the device" in r[2] for r in lane.replies.values())
    finally:
        for engine in engines:
            engine.close()


def test_a_step_record_made_in_c_is_the_python_one():
    """LaneRun.submitted makes StepRecord and LastStep without their __init__: every slot the
    Python __init__ fills must be filled (a new field would otherwise be missed)."""
    engine = _Engine(True, 64, 10_000)
    try:
        _play(engine, 0, [_plain(0, 1)], itertools.count())
        _drain(engine)
        last = engine.table.find(engine.ids[0]).last_steps[1]
        made = sessions_module.LastStep(0, sessions_module.StepRecord(1, 1, last.out), 0)
        for obj, ref in ((last, made), (last.record, made.record)):
            for slot in type(ref).__slots__:
                assert getattr(obj, slot) == getattr(ref, slot) or slot == "record", slot
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_worker_gone_with_lane_steps_queued_leaves_the_engine_as_the_python_path_does():
    """The worker's connection drops while its steps wait in the queue: they still run (their
    sessions advance, as on the Python path), their replies go nowhere, and nothing fails."""
    engines = [_Engine(True, 64, 10_000), _Engine(False, 64, 10_000)]
    try:
        for engine in engines:
            _play(engine, 0, [_plain(s, 2) for s in range(SESSIONS - 1)], itertools.count())
            engine.link._drop(engine.conn)
            _drain(engine)
        lane, python = engines
        assert lane.lane_rows == SESSIONS - 1
        assert lane.records() == python.records()
        assert all(r is not None and r[0][2] == 1 for r in lane.records()[: SESSIONS - 1])
        assert lane.scheduler.stats.requests == python.scheduler.stats.requests == SESSIONS - 1
    finally:
        for engine in engines:
            engine.close()
