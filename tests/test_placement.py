"""Placement across shards (one per GPU), exercised with CPU shards in-process."""
from __future__ import annotations

import pytest

from gdn_server.backends.cpu import CpuBackend
from gdn_server.config import ModelShape, SchedulerConfig
from gdn_server.errors import FailedPrecondition, NotFound
from gdn_server.placement import Placement, Shard
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import SessionTable
from gdn_server.weights import random_gate_params


def _placement(capacities: list[int]) -> Placement:
    shape = ModelShape(2, 1, 2)
    shards = []
    for index, capacity in enumerate(capacities):
        backend = CpuBackend(shape, random_gate_params(shape, 0), capacity)
        sessions = SessionTable(capacity, shape.num_layers)
        shards.append(Shard(index, backend, sessions, Scheduler(backend, sessions, SchedulerConfig())))
    return Placement(shards)


def test_new_sessions_go_to_the_shard_with_the_most_free_slots():
    placement = _placement([2, 3])
    order = []
    for _ in range(5):
        shard = placement.place()
        shard.sessions.create()
        order.append(shard.index)
    assert order == [1, 0, 1, 0, 1]  # most free first, ties to the lower index
    assert (placement.capacity, placement.in_use) == (5, 5)


def test_colocated_sessions_share_a_shard_and_mixed_requests_are_refused():
    placement = _placement([4, 4])
    a = placement.place().sessions.create()
    b = placement.place().sessions.create()  # the other shard: it had more free slots
    c = placement.place(colocate_with=a.id).sessions.create()
    assert placement.shard_of(a.id) is placement.shard_of(c.id)
    assert placement.shard_of(a.id) is not placement.shard_of(b.id)
    assert placement.shard_for([a.id, c.id]) is placement.shard_of(a.id)
    with pytest.raises(FailedPrecondition, match="different devices"):
        placement.shard_for([a.id, b.id])


def test_unknown_and_evicted_sessions_are_not_found_with_the_reason():
    placement = _placement([2, 2])
    shard = placement.place()
    s = shard.sessions.create()
    shard.sessions.evict(s.id, "it was idle for more than 1 s")
    with pytest.raises(NotFound, match="idle"):
        placement.shard_of(s.id)
    with pytest.raises(NotFound, match="unknown"):
        placement.shard_of("nope")
