"""Shards: one state pool, session table and scheduler per device, and where sessions live.

One server process drives every GPU it is given (several processes on one host each drive
theirs: gdn_server.supervisor). Each GPU is a `Shard`: its own backend (state
pool and launch stream), session table and scheduler, so batches form per GPU and the
GPUs run side by side. A session lives on one shard for its whole life (its state is there);
`Placement` puts new sessions on the shard with the most free slots (or next to a session the
client names) and finds a session's shard by id. A request's sessions must share a shard, since
one request is one atomic launch.

On the CPU there is one shard, and all of this is a lookup in a list of one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from gdn_server.backends import Backend
from gdn_server.errors import FailedPrecondition, NotFound
from gdn_server.scheduler import Scheduler
from gdn_server.sessions import Session, SessionTable


@dataclass
class Shard:
    index: int  # the CUDA device ordinal (or the CPU shard's number)
    backend: Backend
    sessions: SessionTable
    scheduler: Scheduler

    @property
    def free(self) -> int:
        return self.sessions.capacity - len(self.sessions)


class Placement:
    def __init__(self, shards: list[Shard]) -> None:
        if not shards:
            raise ValueError("a server needs at least one shard")
        self.shards = shards

    def __iter__(self):
        return iter(self.shards)

    @property
    def capacity(self) -> int:
        return sum(s.sessions.capacity for s in self.shards)

    @property
    def in_use(self) -> int:
        return sum(len(s.sessions) for s in self.shards)

    def place(self, colocate_with: str | None = None, identity: str | None = None) -> Shard:
        """The shard for a new session: that of `colocate_with` when given (so both can share a
        request; it must be a session of `identity`'s, else PermissionDenied), else the one with
        the most free slots (ties to the lowest index)."""
        if colocate_with:
            shard = self.shard_of(colocate_with)
            shard.sessions.get(colocate_with).check_owner(identity)
            return shard
        return max(self.shards, key=lambda s: (s.free, -s.index))

    def find(self, session_id: str) -> tuple[Shard, Session] | None:
        for shard in self.shards:
            session = shard.sessions.find(session_id)
            if session is not None:
                return shard, session
        return None

    def shard_of(self, session_id: str) -> Shard:
        """The shard holding a session; NotFound (saying why, if it was evicted) otherwise."""
        found = self.find(session_id)
        if found is not None:
            return found[0]
        for shard in self.shards:
            if shard.sessions.was_evicted(session_id):
                shard.sessions.get(session_id)  # raises NotFound with the eviction reason
        self.shards[0].sessions.get(session_id)  # raises: NotFound, or where it lives on this host
        raise NotFound(f"unknown or closed session {session_id!r}")

    def shard_for(self, session_ids: Iterable[str]) -> Shard:
        """The one shard every session of a request lives on. With one shard, that one: its
        scheduler finds unknown sessions when it admits the request, so the event loop does not
        look every session up twice."""
        if len(self.shards) == 1:
            return self.shards[0]
        shards = {shard.index: shard for shard in map(self.shard_of, session_ids)}
        if len(shards) > 1:
            raise FailedPrecondition(
                f"the sessions of one request live on different devices {sorted(shards)}: send them in separate "
                "requests, or create them together (CreateSessionRequest.colocate_with)"
            )
        return shards.popitem()[1]
