"""The planner on plain objects: a session table, queued items and round plans built directly,
launches applied with `launched` and answered with `Planner.finish`; no server, backend or loop."""
from __future__ import annotations

import pytest
import torch

from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from gdn_server.planner import ControlItem, DecodeItem, Launch, Planner, launched, not_launched, roll_back
from gdn_server.sessions import SessionTable
from gdn_server.work import DecodeResult, DecodeWork

SHAPE = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2, head_dim_k=8, head_dim_v=8)
HOME_ROWS = 8 * SHAPE.num_layers


def _table(scratch: int = 4) -> SessionTable:
    return SessionTable(8, SHAPE.num_layers, range(HOME_ROWS, HOME_ROWS + scratch))


def _work(ids, layer=0, T=1, positions=None, speculative=False, seed=0, digests=None) -> DecodeWork:
    """Random inputs for sessions `ids`; with positions, each row's digest is `digests` (default
    seed * 100 + row), standing for the digest of its inputs."""
    g = torch.Generator().manual_seed(seed)
    B, H, HV, K = len(ids), SHAPE.num_q_heads, SHAPE.num_v_heads, SHAPE.head_dim_k
    q, k, v = (torch.randn(B, T, n, K, generator=g) for n in (H, H, HV))
    a, b = torch.randn(B, T, HV, generator=g), torch.randn(B, T, HV, generator=g)
    if digests is None:
        digests = tuple(range(seed * 100, seed * 100 + B)) if positions is not None else ()
    return DecodeWork(layer, tuple(ids), q=q, k=k, v=v, a=a, b=b, positions=positions, speculative=speculative,
                      digests=digests)


def _run(planner: Planner, launch: Launch, table: SessionTable) -> list[DecodeResult]:
    """`launch` queued and finished with an output of its row indices, as a backend would answer."""
    launched(launch, 0.0, table)
    rows, T = launch.batch.rows, launch.batch.tokens
    out = torch.arange(rows, dtype=torch.bfloat16)[:, None, None, None].expand(rows, T, SHAPE.num_v_heads, SHAPE.head_dim_v)
    return planner.finish(launch, out.contiguous().view(torch.uint8).numpy().tobytes())


def _planner(table: SessionTable, max_rows: int = 16) -> Planner:
    return Planner(table, max_rows, SHAPE)


def test_one_launch_per_T_up_to_the_row_cap_and_each_session_once_in_arrival_order():
    table = _table()
    a, b, c, d = (table.create().id for _ in range(4))
    items = [DecodeItem(_work(ids, T=T), print) for ids, T in
             (([a, b], 1), ([c], 2), ([a], 1), ([d], 1), ([b, c], 2))]
    plan = _planner(table, max_rows=4).plan(items, quiet=True)
    assert {T: [m.item for m in launch.members] for T, launch in plan.launches.items()} == {
        1: [items[0], items[3]], 2: [items[1]]}
    # items[2] names a session already in the plan; items[4] too (and the row cap is reached)
    assert plan.deferred == [items[2], items[4]] and plan.answers == []
    launch = plan.launches[1]
    assert [m.first_row for m in launch.members] == [0, 2]
    assert launch.batch.read_rows == launch.batch.write_rows == [table.get(s).home_row(0) for s in (a, b, d)]


def test_a_control_item_runs_first_when_quiet_else_it_is_a_barrier_for_what_follows():
    table = _table()
    a, b = (table.create().id for _ in range(2))
    control = ControlItem(lambda: None, print)
    step, later = DecodeItem(_work([a]), print), DecodeItem(_work([b]), print)
    first = _planner(table).plan([control, step], quiet=True)
    assert first.first is control and first.deferred == [step] and not first.launches
    busy = _planner(table).plan([control, step], quiet=False)
    assert busy.barrier is control and busy.deferred == [step] and not busy.launches
    behind = _planner(table).plan([step, control, later], quiet=True)
    assert behind.barrier is control and behind.deferred == [later] and list(behind.launches) == [1]


def test_planning_changes_no_record_and_launched_applies_the_step():
    table = _table()
    s = table.create()
    planner = _planner(table)
    draft = DecodeItem(_work([s.id], T=3, speculative=True), print)
    plan = planner.plan([draft], quiet=True)
    (member,) = plan.launches[3].members
    assert member.read_rows == [s.home_row(0)] and member.write_rows == [HOME_ROWS]  # the first scratch row
    assert s.positions == [0, 0] and not s.drafts and not s.last_steps  # nothing applied yet
    _run(planner, plan.launches[3], table)
    assert s.positions == [3, 0] and s.drafts[0].row == HOME_ROWS and s.drafts[0].read_row == s.home_row(0)
    # a second draft reads the first's state (accepted whole) and writes another scratch row
    plan = planner.plan([DecodeItem(_work([s.id], T=2, speculative=True, seed=1), print)], quiet=True)
    assert plan.launches[2].members[0].read_rows == [HOME_ROWS] and table.scratch_in_use() == 2
    _run(planner, plan.launches[2], table)
    assert s.positions == [5, 0] and s.accepted_rows == {0: HOME_ROWS} and s.drafts[0].read_row == HOME_ROWS
    # a plain step reads the open draft's row, writes home and frees both scratch rows
    plan = planner.plan([DecodeItem(_work([s.id], seed=2), print)], quiet=True)
    (member,) = plan.launches[1].members
    assert member.read_rows == [s.drafts[0].row] and member.write_rows == [s.home_row(0)]
    assert table.scratch_in_use() == 2
    _run(planner, plan.launches[1], table)
    assert s.positions == [6, 0] and not s.drafts and not s.accepted_rows and table.scratch_in_use() == 0


def test_a_retry_waits_for_its_step_then_is_answered_from_the_kept_output():
    table = _table()
    a, b = table.create(), table.create()
    planner = _planner(table)
    first = DecodeItem(_work([a.id, b.id], positions=(0, 0)), print)
    plan = planner.plan([first], quiet=True)
    launched(plan.launches[1], 0.0, table)
    again = DecodeItem(_work([b.id], positions=(0,), digests=(1,)), print)  # b's row of the first request
    assert planner.plan([again], quiet=True).deferred == [again]  # its output is not there yet
    planner.finish(plan.launches[1], torch.arange(2, dtype=torch.bfloat16).repeat_interleave(16)
                   .view(torch.uint8).numpy().tobytes())
    ((item, answer),) = planner.plan([again], quiet=True).answers
    assert item is again and isinstance(answer, DecodeResult)
    assert answer.positions == (1,) and torch.frombuffer(answer.out, dtype=torch.bfloat16).eq(1).all()
    # the same step as a draft, or with other inputs, is no retry: nothing is applied
    for work in (_work([b.id], positions=(0,), speculative=True, digests=(1,)), _work([b.id], positions=(0,), digests=(7,))):
        ((_, error),) = planner.plan([DecodeItem(work, print)], quiet=True).answers
        assert isinstance(error, FailedPrecondition)
    assert b.positions == [1, 0] and not b.drafts


def test_a_failed_launch_rolls_back_and_a_refused_one_gives_its_scratch_rows_back():
    table = _table(scratch=2)
    s, t = table.create(), table.create()
    planner = _planner(table)
    plan = planner.plan([DecodeItem(_work([s.id], T=2, speculative=True), print)], quiet=True)
    launch = plan.launches[2]
    launched(launch, 0.0, table)
    roll_back(launch.members[0], table)  # the launch failed after it was queued
    assert s.positions == [0, 0] and not s.drafts and not s.last_steps and table.scratch_in_use() == 0
    plan = planner.plan([DecodeItem(_work([s.id, t.id], T=2, speculative=True), print)], quiet=True)
    assert table.scratch_in_use() == 2
    (answer,) = planner.plan([DecodeItem(_work([s.id], T=2, speculative=True, seed=4), print)], quiet=True).answers
    assert isinstance(answer[1], ResourceExhausted)  # every scratch row is reserved
    not_launched(plan.launches[2].members[0], table)  # the backend refused the launch: nothing ran
    assert table.scratch_in_use() == 0 and s.positions == t.positions == [0, 0]


def test_commit_settles_drafts_in_the_table():
    table = _table()
    s = table.create()
    planner = _planner(table)
    for layer in (0, 1):
        plan = planner.plan([DecodeItem(_work([s.id], layer=layer, T=3, speculative=True), print)], quiet=True)
        _run(planner, plan.launches[3], table)
    with pytest.raises(InvalidArgument, match="more than"):
        table.commit(s, 4, 0.0)
    assert sorted(s.drafts) == [0, 1] and s.positions == [3, 3]  # a refused Commit changed nothing
    replay = table.commit(s, 2, 0.0)
    assert [(layer, d.read_row) for layer, d in replay] == [(0, s.home_row(0)), (1, s.home_row(1))]
    assert s.positions == [2, 2] and not s.drafts and not s.last_steps and table.scratch_in_use() == 0
