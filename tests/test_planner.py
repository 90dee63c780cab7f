"""The planner on plain objects: a session table, queued items and round plans built directly,
launches applied with `launched` and answered with `Planner.finish`; no server, backend or loop."""
from __future__ import annotations

import pytest
import torch

from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, InvalidArgument
from gdn_server.planner import Admitted, ControlItem, DecodeItem, Launch, Planner, launched, roll_back
from gdn_server.sessions import SessionTable
from gdn_server.work import DecodeResult, DecodeWork, StepBatch

SHAPE = ModelShape(num_layers=2, num_q_heads=1, num_v_heads=2, head_dim_k=8, head_dim_v=8)


def _table() -> SessionTable:
    return SessionTable(8, SHAPE.num_layers)


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
    rows, T = launch.batch.num_rows, launch.batch.tokens
    out = torch.arange(rows, dtype=torch.bfloat16)[:, None, None, None].expand(rows, T, SHAPE.num_v_heads, SHAPE.head_dim_v)
    return planner.finish(launch, out.contiguous().view(torch.uint8).numpy().tobytes())


def _planner(table: SessionTable, max_rows: int = 16) -> Planner:
    return Planner(table, max_rows, SHAPE)


def test_one_launch_per_T_and_kind_up_to_the_row_cap_and_each_session_once_in_arrival_order():
    table = _table()
    a, b, c, d, e = (table.create().id for _ in range(5))
    items = [DecodeItem(_work(ids, T=T, speculative=spec), print) for ids, T, spec in
             (([a, b], 1, False), ([c], 2, False), ([a], 1, False), ([d], 1, False), ([e], 1, True), ([b, c], 2, False))]
    plan = _planner(table, max_rows=5).plan(items, quiet=True)
    assert {key: [m.item for m in launch.members] for key, launch in plan.launches.items()} == {
        (1, False): [items[0], items[3]], (2, False): [items[1]], (1, True): [items[4]]}
    # items[2] names a session already in the plan; items[5] too (and the row cap is reached)
    assert plan.deferred == [items[2], items[5]] and plan.answers == []
    launch = plan.launches[1, False]
    assert [m.first_row for m in launch.members] == [0, 2]
    assert launch.batch.rows == [table.get(s).home_row(0) for s in (a, b, d)] and launch.batch.hist == [0, 0, 0]
    assert not launch.batch.verify and plan.launches[1, True].batch.verify


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
    assert behind.barrier is control and behind.deferred == [later] and list(behind.launches) == [(1, False)]


def test_a_session_control_waits_for_its_session_only_never_for_other_launches():
    table = _table()
    a, b, c = (table.get(table.create().id) for _ in range(3))
    planner = _planner(table)
    running = planner.plan([DecodeItem(_work([c.id]), print)], quiet=True).launches[1, False]
    launched(running, 0.0, table)  # c's step is on the device, unfinished
    commit_a, commit_c = (ControlItem(lambda: None, print, session_id=s.id) for s in (a, c))
    step_b, step_a, commit_b = DecodeItem(_work([b.id]), print), DecodeItem(_work([a.id]), print), ControlItem(
        lambda: None, print, session_id=b.id)
    plan = planner.plan([step_b, commit_a, step_a, commit_b, commit_c], quiet=False)
    # a's Commit runs this round though launches are in flight; a's next step waits for a later
    # round (it must see the Commit's records); b's Commit stays behind b's step in this plan,
    # c's behind c's step still on the device
    assert plan.settle == [commit_a] and plan.barrier is None and plan.first is None
    assert [m.item for m in plan.launches[1, False].members] == [step_b]
    assert plan.deferred == [step_a, commit_b, commit_c]
    planner.finish(running, bytes(2 * SHAPE.num_v_heads * SHAPE.head_dim_v))  # c's step finished: its Commit may run
    assert planner.plan([commit_c], quiet=False).settle == [commit_c]


def _step(planner, table, s, T, speculative=False, layer=0, seed=0):
    """One step of session `s` planned and run; returns its member."""
    plan = planner.plan([DecodeItem(_work([s.id], layer=layer, T=T, speculative=speculative, seed=seed), print)],
                        quiet=True)
    launch = plan.launches[T, speculative]
    _run(planner, launch, table)
    return launch.members[0]


def test_planning_changes_no_record_and_launched_applies_the_step():
    table = _table()
    s = table.create()
    planner = _planner(table)
    plan = planner.plan([DecodeItem(_work([s.id], T=3, speculative=True), print)], quiet=True)
    (member,) = plan.launches[3, True].members
    assert member.rows == [s.home_row(0)] and member.hist == [0]
    assert s.positions == [0, 0] and not s.drafts and not s.last_steps  # nothing applied yet
    _run(planner, plan.launches[3, True], table)
    assert s.positions == [3, 0] and s.drafts[0].base == 0 and s.drafts[0].tokens == 3 and s.hist == [0, 0]
    # a second draft accepts the first whole: it is launched with P = 3 and appends after it
    member = _step(planner, table, s, 2, speculative=True, seed=1)
    assert member.hist == [3] and s.positions == [5, 0] and s.drafts[0].base == 3 and s.hist == [3, 0]
    # a plain step accepts the open draft too and folds every entry (the backend does): P = 0
    member = _step(planner, table, s, 1, seed=2)
    assert member.rows == [s.home_row(0)] and member.hist == [5]
    assert s.positions == [6, 0] and not s.drafts and s.hist == [0, 0]


def test_the_ring_folds_where_a_draft_would_overflow_it_and_commit_is_bookkeeping():
    table = _table()
    s = table.create()
    planner = _planner(table)
    for i in range(3):  # 3 drafts of 5, each fully accepted by the next: P = 0, 5, 10
        assert _step(planner, table, s, 5, speculative=True, seed=i).hist == [5 * i]
    assert s.drafts[0].base == 10 and s.positions[0] == 15
    # 15 committed entries and 4 more overflow the ring of 16: the verify folds first, base 0
    member = _step(planner, table, s, 4, speculative=True, seed=3)
    assert member.hist == [15] and s.drafts[0].base == 0 and s.hist[0] == 0
    assert table.commit(s, 2, 0.0) == [0]
    assert s.hist[0] == 2 and s.positions[0] == 17 and not s.drafts and 0 not in s.last_steps
    assert _step(planner, table, s, 8, speculative=True, seed=4).hist == [2]
    table.drop_drafts(s)  # a draft dropped leaves its base committed
    assert s.hist[0] == 2 and s.positions[0] == 17 and not s.drafts
    assert table.hist_rows(s) == ([s.home_row(0), s.home_row(1)], [2, 0])
    table.folded(s)
    assert s.hist == [0, 0]


def test_a_large_launch_of_plain_steps_runs_as_a_verify_and_commits_its_entries():
    table = _table()
    sessions = [table.create() for _ in range(5)]
    planner = Planner(table, 16, SHAPE, ring_min_rows=3)
    s = sessions[0]
    _step(planner, table, s, 2, speculative=True)  # s has an open draft of 2 at layer 0
    # below the backend's rows, nothing committed: in place; from them on: a verify, entries committed
    small = planner.plan([DecodeItem(_work([t.id for t in sessions[3:]]), print)], quiet=True).launches[1, False]
    assert not small.batch.verify
    plan = planner.plan([DecodeItem(_work([t.id for t in sessions[:3]], T=4, seed=1), print),
                         DecodeItem(_work([t.id for t in sessions[3:]], T=4, speculative=True, seed=2), print)],
                        quiet=True)
    plain, drafts = plan.launches[4, False], plan.launches[4, True]
    assert plain.batch.verify and drafts.batch.verify and plain.batch.hist == [2, 0, 0]
    assert s.hist[0] == 0 and s.drafts  # planning applied nothing
    _run(planner, plain, table)
    # s's draft was accepted whole, then the step's 4 entries committed after it; no draft is open
    assert [t.hist[0] for t in sessions[:3]] == [6, 4, 4] and not s.drafts and s.positions[0] == 6
    assert s.last_steps[0].record.speculative is False  # a retry of it is a plain step
    # a ring that would overflow is folded first by the verify: the step's entries start it again
    for seed in range(3, 6):
        _run(planner, planner.plan([DecodeItem(_work([t.id for t in sessions[:3]], T=4, seed=seed), print)],
                                   quiet=True).launches[4, False], table)
    assert [t.hist[0] for t in sessions[:3]] == [4, 16, 16] and s.positions[0] == 18
    # a failed launch puts back the P it was launched with
    plan = planner.plan([DecodeItem(_work([t.id for t in sessions[:3]], T=4, seed=6), print)], quiet=True)
    launch = plan.launches[4, False]
    launched(launch, 0.0, table)
    assert [t.hist[0] for t in sessions[:3]] == [8, 4, 4]
    roll_back(launch.members[0], table)
    assert [t.hist[0] for t in sessions[:3]] == [4, 16, 16] and s.positions[0] == 18
    # a small launch whose rows have entries committed and room for its tokens appends too: writing
    # the states would first cost a fold of those rows
    small = planner.plan([DecodeItem(_work([s.id, sessions[3].id], T=3, seed=7), print)], quiet=True)
    small = small.launches[3, False]
    assert small.batch.verify and small.batch.hist == [4, 0]
    _run(planner, small, table)
    assert s.hist[0] == 7 and sessions[3].hist[0] == 3
    # one that would fill a ring folds and writes in place (the backend folds): back on the plain
    # kernel; so is a small launch with nothing committed
    t = sessions[1]
    small = planner.plan([DecodeItem(_work([s.id, t.id], seed=8), print)], quiet=True).launches[1, False]
    assert not small.batch.verify and small.batch.hist == [7, 16]
    _run(planner, small, table)
    assert s.hist[0] == 0 and t.hist[0] == 0
    small = planner.plan([DecodeItem(_work([s.id, t.id], seed=9), print)], quiet=True).launches[1, False]
    assert not small.batch.verify


def test_a_launch_record_built_directly_applies_and_rolls_back():
    table = _table()
    s, t = table.create(), table.create()
    planner = _planner(table)
    _step(planner, table, s, 3, speculative=True)  # s has an open draft of 3 at layer 0
    work = _work([s.id, t.id], T=2, speculative=True, seed=5)
    launch = Launch(StepBatch(2, verify=True))
    launch.add(Admitted(DecodeItem(work, print), [s, t], [s.home_row(0), t.home_row(0)], [3, 0]))
    assert launch.batch.rows == [s.home_row(0), t.home_row(0)] and launch.batch.hist == [3, 0]
    launched(launch, 0.0, table)
    assert s.positions[0] == 5 and t.positions[0] == 2 and s.drafts[0].base == 3 and t.drafts[0].base == 0
    roll_back(launch.members[0], table)  # the launch failed after it was queued
    # the draft it accepted stays accepted (an earlier launch wrote it); its own is gone
    assert s.positions[0] == 3 and t.positions[0] == 0 and s.hist[0] == 3 and not s.drafts and not t.drafts


def test_a_retry_waits_for_its_step_then_is_answered_from_the_kept_output():
    table = _table()
    a, b = table.create(), table.create()
    planner = _planner(table)
    first = DecodeItem(_work([a.id, b.id], positions=(0, 0)), print)
    plan = planner.plan([first], quiet=True)
    launched(plan.launches[1, False], 0.0, table)
    again = DecodeItem(_work([b.id], positions=(0,), digests=(1,)), print)  # b's row of the first request
    assert planner.plan([again], quiet=True).deferred == [again]  # its output is not there yet
    planner.finish(plan.launches[1, False], torch.arange(2, dtype=torch.bfloat16).repeat_interleave(16)
                   .view(torch.uint8).numpy().tobytes())
    ((item, answer),) = planner.plan([again], quiet=True).answers
    assert item is again and isinstance(answer, DecodeResult)
    assert answer.positions == (1,) and torch.frombuffer(answer.out, dtype=torch.bfloat16).eq(1).all()
    # the same step as a draft, or with other inputs, is no retry: nothing is applied
    for work in (_work([b.id], positions=(0,), speculative=True, digests=(1,)), _work([b.id], positions=(0,), digests=(7,))):
        ((_, error),) = planner.plan([DecodeItem(work, print)], quiet=True).answers
        assert isinstance(error, FailedPrecondition)
    assert b.positions == [1, 0] and not b.drafts


def test_commit_settles_drafts_in_the_table():
    table = _table()
    s = table.create()
    planner = _planner(table)
    for layer in (0, 1):
        _step(planner, table, s, 3, speculative=True, layer=layer)
    with pytest.raises(InvalidArgument, match="more than"):
        table.commit(s, 4, 0.0)
    assert sorted(s.drafts) == [0, 1] and s.positions == [3, 3]  # a refused Commit changed nothing
    assert table.commit(s, 2, 0.0) == [0, 1]
    assert s.positions == [2, 2] and s.hist == [2, 2] and not s.drafts and not s.last_steps
    _step(planner, table, s, 3, speculative=True)
    assert table.commit(s, 3, 0.0) == [0]  # a full accept keeps the step a retry is answered from
    assert s.positions == [5, 2] and s.hist == [5, 2] and s.last_steps[0].count_before == 2


def test_each_step_rewrites_its_sessions_last_step_and_a_retry_reads_its_own_row():
    table = _table()
    a, b, c = (table.create() for _ in range(3))
    planner = _planner(table)
    first = planner.plan([DecodeItem(_work([a.id, b.id, c.id], positions=(0, 0, 0)), print)], quiet=True)
    _run(planner, first.launches[1, False], table)  # rows 0, 1, 2 hold 0, 1, 2
    second = planner.plan([DecodeItem(_work([c.id, a.id], positions=(1, 1), seed=1), print)], quiet=True)
    launched(second.launches[1, False], 0.0, table)  # in flight: c is row 0, a row 1
    assert (a.last_steps[0].count_before, a.last_steps[0].row, c.last_steps[0].row) == (1, 1, 0)
    # b's last step is still the first: its retry is answered; a's and c's have moved on
    ((_, answer),) = planner.plan([DecodeItem(_work([b.id], positions=(0,), digests=(1,)), print)], quiet=True).answers
    assert answer.positions == (1,) and torch.frombuffer(answer.out, dtype=torch.bfloat16).eq(1).all()
    ((_, error),) = planner.plan([DecodeItem(_work([a.id], positions=(0,), digests=(0,)), print)], quiet=True).answers
    assert isinstance(error, FailedPrecondition)
    again = DecodeItem(_work([a.id, c.id], positions=(1, 1), digests=(101, 100)), print)
    assert planner.plan([again], quiet=True).deferred == [again]  # the second's output is not there yet
    launch = second.launches[1, False]
    planner.finish(launch, torch.arange(2, dtype=torch.bfloat16).repeat_interleave(16).view(torch.uint8).numpy().tobytes())
    ((_, answer),) = planner.plan([again], quiet=True).answers
    assert answer.positions == (2, 2)
    assert torch.frombuffer(answer.out, dtype=torch.bfloat16).tolist() == [1.0] * 16 + [0.0] * 16
    whole = DecodeItem(_work([c.id, a.id], positions=(1, 1), digests=(100, 101)), print)  # as it was sent
    ((_, answer),) = planner.plan([whole], quiet=True).answers
    assert torch.frombuffer(answer.out, dtype=torch.bfloat16).tolist() == [0.0] * 16 + [1.0] * 16
    roll_back(launch.members[0], table)  # had it failed: each session back where the second found it
    assert a.positions == [1, 0] and c.positions == [1, 0] and 0 not in a.last_steps and 0 not in c.last_steps
    assert b.positions == [1, 0] and b.last_steps[0].count_before == 0
