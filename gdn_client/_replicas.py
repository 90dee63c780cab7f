"""Sessions spread over several gdn-serve replicas (hosts), each session at home on one of them.

A session's state lives on one GPU of one replica, so a session is sticky: every call of it goes
to its home replica. `ReplicaSet` creates each new session on the replica with the most free
capacity (from GetModelInfo) and moves a session to another replica on request (ExportState ->
ImportState), e.g. to drain a replica before it is stopped. The `Session` object keeps working
after a move: it is re-pointed at its new home.

Each replica is a `Client`, which itself follows the server processes of a replica that runs
several (``gdn-server --processes K``): a replica's free capacity is that of all its processes.
`AsyncReplicaSet` is the asyncio form, over `AsyncClient`s; the choices (which replica a new
session goes to, when a replica counts as serving) are the same functions for both.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gdn_client._aio import AsyncClient, AsyncSession
from gdn_client._client import Client, Session
from gdn_client._errors import GdnError, ResourceExhaustedError
from gdn_client._options import ClientOptions

logger = logging.getLogger(__name__)

_SERVICE = "gdn.v1.GdnDecode"  # the name the server's health service reports


class ReplicaSet:
    """Several replicas of one model behind one client.

    >>> from gdn_client import ReplicaSet
    >>> replicas = ReplicaSet(["gdn-0:50051", "gdn-1:50051"])           # doctest: +SKIP
    >>> s = replicas.create_session()          # doctest: +SKIP
    >>> o = s.decode(0, q, k, v, a, b)         # doctest: +SKIP
    >>> replicas.migrate(s, "gdn-1:50051")     # doctest: +SKIP
    >>> replicas.home_of(s)                    # doctest: +SKIP
    'gdn-1:50051'

    A new session goes to the replica with the most free sessions; every call of it to its home
    replica; `migrate` moves it (here: draining gdn-0, the session continues on gdn-1).

    All replicas must serve the same model (shapes and weights), or migrated sessions would
    continue with other numbers.
    """

    def __init__(self, targets: Sequence[str], options: ClientOptions | None = None) -> None:
        _check_targets(targets)
        self.clients: dict[str, Client] = {t: Client(t, options) for t in targets}

    @property
    def targets(self) -> list[str]:
        return list(self.clients)

    def free_capacity(self) -> dict[str, int]:
        """Free session slots per replica; replicas that do not answer, or that report NOT_SERVING
        on the gRPC health service (starting, or draining before a shutdown), are left out."""
        free = {}
        for target, client in self.clients.items():
            if not _serving(_health_check(client)):
                continue
            try:
                info = client.model_info()
            except GdnError as err:
                logger.warning("replica %s: %s", target, err)
                continue
            free[target] = info.max_sessions - info.sessions_in_use
        return free

    def create_session(self) -> Session:
        """A new session on the replica with the most free capacity."""
        for target in placement_order(self.free_capacity()):
            try:
                return self.clients[target].create_session()
            except ResourceExhaustedError:  # filled up since we asked: try the next one
                continue
        raise ResourceExhaustedError("no replica has a free session slot")

    def session(self) -> Session:
        """Same as `create_session`; reads well as ``with replicas.session() as s:``."""
        return self.create_session()

    def home_of(self, session: Session) -> str:
        """The target of the replica that holds `session`'s state."""
        return session._client.target

    def migrate(self, session: Session, target: str) -> Session:
        """Moves `session` to the replica `target` and returns it (the same object, re-pointed).

        Export, import on `target`, then close on the old home; if the import fails the session
        stays where it was. Call it while no step of this session is in flight (steps sent to the
        old home after the export would not move with it).
        """
        if target not in self.clients:
            raise ValueError(f"{target!r} is not one of this set's replicas {self.targets}")
        source = session._client
        if source.target == target:
            return session
        exported = session.export()
        moved = self.clients[target].import_state(exported)
        old_id = session.id
        session._rebind(moved._client, moved._cursor)
        try:
            source._close(old_id, retry=True)
        except GdnError as err:  # the state lives on at the new home; the old copy idles out
            logger.warning("migrated session %s to %s but could not close it on %s: %s", old_id, target, source.target, err)
        return session

    def close(self) -> None:
        for client in self.clients.values():
            client.close()

    def __enter__(self) -> "ReplicaSet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReplicaSet({self.targets!r})"


class AsyncReplicaSet:
    """The asyncio `ReplicaSet`, over `AsyncClient`s (create it inside a running loop).

    >>> async with AsyncReplicaSet(["gdn-0:50051", "gdn-1:50051"]) as replicas:   # doctest: +SKIP
    ...     s = await replicas.create_session()
    ...     o = await s.decode(0, q, k, v, a, b)
    ...     await replicas.migrate(s, "gdn-1:50051")
    """

    def __init__(self, targets: Sequence[str], options: ClientOptions | None = None) -> None:
        _check_targets(targets)
        self.clients: dict[str, AsyncClient] = {t: AsyncClient(t, options) for t in targets}

    @property
    def targets(self) -> list[str]:
        return list(self.clients)

    async def free_capacity(self) -> dict[str, int]:
        """Free session slots per serving replica (see `ReplicaSet.free_capacity`), asked of all
        replicas at once."""
        async def free_of(target: str, client: AsyncClient) -> int | None:
            if not _serving(await _health_check_async(client)):
                return None
            try:
                info = await client.model_info()
            except GdnError as err:
                logger.warning("replica %s: %s", target, err)
                return None
            return info.max_sessions - info.sessions_in_use

        answers = await asyncio.gather(*(free_of(t, c) for t, c in self.clients.items()))
        return {t: n for t, n in zip(self.clients, answers) if n is not None}

    async def create_session(self) -> AsyncSession:
        """A new session on the replica with the most free capacity."""
        for target in placement_order(await self.free_capacity()):
            try:
                return await self.clients[target].create_session()
            except ResourceExhaustedError:
                continue
        raise ResourceExhaustedError("no replica has a free session slot")

    def home_of(self, session: AsyncSession) -> str:
        return session._client.target

    async def migrate(self, session: AsyncSession, target: str) -> AsyncSession:
        """Moves `session` to the replica `target` (see `ReplicaSet.migrate`)."""
        if target not in self.clients:
            raise ValueError(f"{target!r} is not one of this set's replicas {self.targets}")
        source = session._client
        if source.target == target:
            return session
        moved = await self.clients[target].import_state(await session.export())
        old_id = session.id
        session._client, session._cursor = moved._client, moved._cursor
        try:
            await source.close_session(old_id)
        except GdnError as err:
            logger.warning("migrated session %s to %s but could not close it on %s: %s", old_id, target, source.target, err)
        return session

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def __aenter__(self) -> "AsyncReplicaSet":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncReplicaSet({self.targets!r})"


def _check_targets(targets: Sequence[str]) -> None:
    if not targets:
        raise ValueError("a ReplicaSet needs at least one target")
    if len(set(targets)) != len(targets):
        raise ValueError("replica targets must be distinct")


def placement_order(free: dict[str, int]) -> list[str]:
    """The replicas a new session tries, most free slots first, full ones left out.

    >>> placement_order({"a": 2, "b": 5, "c": 0})
    ['b', 'a']
    """
    return [t for t in sorted(free, key=lambda t: -free[t]) if free[t] > 0]


_HEALTH_REQUEST = health_pb2.HealthCheckRequest(service=_SERVICE)


def _health_check(client: Client) -> Any:
    """The replica's health answer for GdnDecode, or the RpcError it failed with."""
    stub = health_pb2_grpc.HealthStub(client._channel)
    try:
        return stub.Check(_HEALTH_REQUEST, timeout=client.options.timeout, metadata=client._metadata)
    except grpc.RpcError as err:
        return err


async def _health_check_async(client: AsyncClient) -> Any:
    stub = health_pb2_grpc.HealthStub(client._channel)
    try:
        return await stub.Check(_HEALTH_REQUEST, timeout=client.options.timeout, metadata=client._metadata)
    except grpc.RpcError as err:
        return err


def _serving(answer: Any) -> bool:
    """Whether a health answer (or its RpcError) counts as serving: a server without the health
    service does (its GetModelInfo answer decides)."""
    if isinstance(answer, grpc.RpcError):
        if answer.code() == grpc.StatusCode.UNIMPLEMENTED:
            return True
        logger.warning("replica health check failed: %s", answer.code().name)
        return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING
