"""The asyncio client: `AsyncClient` and `AsyncSession`: the operations of gdn_client._calls run
with awaited grpc.aio stubs. Same surface as the blocking client, with ``await``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Sequence, TypeVar

import grpc
import grpc.aio
import torch

from gdn_client import _calls
from gdn_client._calls import STREAM_OUT, UNARY, Call, Op
from gdn_client._errors import error_from_rpc
from gdn_client._info import ModelInfo, Stats
from gdn_client._options import ClientOptions
from gdn_client._routing import ProcessRoutes
from gdn_client._sessions_ext import ExportedState
from gdn_client._shared_memory import AsyncSharedMemory, Region
from gdn_client._steps import PreparedStep, SessionCursor, TensorLike, prepare_step
from gdn_client._stream import AsyncDecodeStream

__all__ = ["AsyncClient", "AsyncSession", "AsyncSpeculation"]

logger = logging.getLogger("gdn_client")
_R = TypeVar("_R")


def make_aio_channel(target: str, options: ClientOptions) -> grpc.aio.Channel:
    creds = options.channel_credentials()
    args = options.channel_options()
    interceptors = list(options.interceptors) or None
    if creds:
        return grpc.aio.secure_channel(target, creds, args, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, args, interceptors=interceptors)


class AsyncClient:
    """An asyncio client of a gdn-serve server (grpc.aio); create it inside a running loop.

    >>> async def main():                                             # doctest: +SKIP
    ...     async with AsyncClient("127.0.0.1:50051") as client:
    ...         async with client.session() as s:
    ...             o = await s.decode(0, q, k, v, a, b)              # bf16 [T, HV, V]
    ...         async with client.stream() as st:
    ...             outs = await asyncio.gather(*(st.submit(l, s2, q, k, v, a, b) for l in range(3)))

    Follows the processes of a host running several (``gdn-server --processes K``) as `Client`
    does, with the same routing (gdn_client._routing).
    """

    def __init__(self, target: str, options: ClientOptions | None = None) -> None:
        self.target = target
        self.options = options or ClientOptions()
        self._routes: ProcessRoutes[grpc.aio.Channel] = ProcessRoutes(
            target, lambda t: make_aio_channel(t, self.options)
        )
        self._channel = self._routes.channel  # the target's
        self._metadata = self.options.call_metadata()
        self._regions: list[Region] = []  # shared-memory regions of this client (shared_memory())

    # -- plumbing ------------------------------------------------------------------------------

    async def _call(self, method: Any, request: Any, *, retry: bool = False) -> Any:
        delays = self.options.backoff_delays() if retry else iter(())
        while True:
            try:
                return await method(request, timeout=self.options.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            delay = next(delays, None) if err.retryable else None
            if delay is None:
                raise err from None
            logger.info("%s; retrying in %.3f s", err, delay)
            await asyncio.sleep(delay)

    async def _perform(self, call: Call) -> Any:
        """One RPC of an operation (gdn_client._calls), on the stub of its process."""
        method = getattr(self._routes.stub_of(call.process), call.method)
        if call.kind == UNARY:
            return await self._call(method, call.request, retry=call.retry)
        try:
            if call.kind == STREAM_OUT:
                rpc = method(call.request, timeout=self.options.timeout, metadata=self._metadata)
                return [reply async for reply in rpc]
            return await method(iter(call.request), timeout=self.options.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def _run(self, op: Op[_R]) -> _R:
        return await _calls.drive_async(op, self._perform)

    async def _stub_of(self, process: int | None) -> Any:
        """The stub of server process `process` (None: the target), its processes learned first."""
        if process is not None:
            await self._run(_calls.learn_processes(self._routes))
        return self._routes.stub_of(process)

    async def _run_step(self, step: PreparedStep) -> torch.Tensor:
        return await self._run(_calls.run_step(self._routes, step))

    async def _register(self, region: Region, process: int | None) -> None:
        await self._run(_calls.register(region, process))

    async def _unregister(self, region: Region, process: int | None) -> None:
        await self._run(_calls.unregister(region, process))

    # -- public API ----------------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        """The served model's shape and capacity; on a host of several server processes, the
        sessions and capacity are the whole host's (see `Client.model_info`).

        >>> async def free_sessions(target: str) -> int:               # doctest: +SKIP
        ...     async with AsyncClient(target) as client:
        ...         info = await client.model_info()
        ...         return info.max_sessions - info.sessions_in_use
        """
        return await self._run(_calls.model_info(self._routes))

    async def stats(self) -> Stats:
        """The target server process's counters (launches, rows per launch, requests)."""
        return await self._run(_calls.stats())

    async def create_session(self, colocate_with: "AsyncSession | str | None" = None) -> "AsyncSession":
        """Creates a session; close it with ``await s.close()`` or use ``async with``.

        ``colocate_with``: in the same process and on the same device as that session (see
        `Client.create_session`).

        >>> async def pair(client: AsyncClient) -> tuple[AsyncSession, AsyncSession]:  # doctest: +SKIP
        ...     s = await client.create_session()
        ...     return s, await client.create_session(colocate_with=s)
        """
        buddy = colocate_with.id if isinstance(colocate_with, AsyncSession) else (colocate_with or "")
        return AsyncSession(self, await self._run(_calls.create_session(self._routes, buddy)))

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator["AsyncSession"]:
        """``async with client.session() as s:`` creates a session and closes it on exit."""
        s = await self.create_session()
        try:
            yield s
        finally:
            await s.close()

    async def close_session(self, session: "AsyncSession | str") -> None:
        """Closes a session by object or id; raises NotFoundError if the server does not know it."""
        if isinstance(session, AsyncSession):
            await session.close()
            return
        await self._run(_calls.close_session(self._routes, session, retry=False))

    async def decode_batch(
        self,
        layer: int,
        sessions: Sequence["AsyncSession"],
        q: TensorLike,
        k: TensorLike,
        v: TensorLike,
        a: TensorLike,
        b: TensorLike,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One atomic step for B sessions of one server process and device (see
        `Client.decode_batch`): [B, T, ...] inputs, bf16 o [B, T, HV, V] (written into ``out``
        where given, a tensor of the client's `shared_memory`)."""
        step = prepare_step(layer, [s._cursor for s in sessions], q, k, v, a, b, single=False,
                            regions=self._regions, out=out)
        return await self._run_step(step)

    async def import_state(self, exported: ExportedState) -> "AsyncSession":
        """A new session on this server holding an exported state; not retried.

        >>> async def move(session: AsyncSession, to: AsyncClient) -> AsyncSession:  # doctest: +SKIP
        ...     moved = await to.import_state(await session.export())
        ...     await session.close()
        ...     return moved
        """
        return AsyncSession(self, await self._run(_calls.import_state(self._routes, exported)))

    async def shared_memory(self, byte_size: int, device: str | torch.device = "cpu") -> AsyncSharedMemory:
        """A registered region of shared memory (see `Client.shared_memory`).

        >>> async with await client.shared_memory(16 << 20) as shm:   # doctest: +SKIP
        ...     q = shm.tensor((1, 16, 128))
        """
        region = Region(byte_size, device)
        try:
            await self._register(region, None)
        except BaseException:
            region.close()
            raise
        return AsyncSharedMemory(self, region)

    def stream(self) -> AsyncDecodeStream:
        """Opens a pipelined DecodeStream (``async with client.stream() as st``)."""
        return AsyncDecodeStream(self)

    async def close(self) -> None:
        """Closes the channels. Sessions stay open on the server until closed."""
        for channel in self._routes.channels():
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient({self.target!r})"


class AsyncSession:
    """The asyncio counterpart of `Session`."""

    def __init__(self, client: AsyncClient, session: "str | SessionCursor") -> None:
        """The session of id `session` on `client`'s server (its positions start from the
        client's view: none taken yet)."""
        self._client = client
        self._cursor = session if isinstance(session, SessionCursor) else SessionCursor(session)

    @property
    def id(self) -> str:
        return self._cursor.session_id

    @property
    def closed(self) -> bool:
        return self._cursor.closed

    @property
    def positions(self) -> dict[int, int]:
        return self._cursor.positions()

    async def decode(
        self, layer: int, q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike, b: TensorLike,
        *, speculative: bool = False, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of T tokens at ``layer``: [T, ...] inputs, bf16 o [T, HV, V]. ``speculative``:
        a draft step that `commit` settles (prefer `speculate`); ``out``: see `Session.decode`."""
        step = prepare_step(layer, [self._cursor], q, k, v, a, b, single=True, speculative=speculative,
                            regions=self._client._regions, out=out)
        return await self._client._run_step(step)

    async def commit(self, accepted: int) -> dict[int, int]:
        """Keeps the first ``accepted`` tokens of every open speculative step; returns positions."""
        return await self._client._run(_calls.commit(self._client._routes, self._cursor, accepted))

    def speculate(self) -> "AsyncSpeculation":
        """A draft-and-verify step over every layer (see `Session.speculate`).

        >>> async with session.speculate() as spec:                      # doctest: +SKIP
        ...     for layer in range(info.num_layers):
        ...         o = await spec.decode(layer, q[layer], k[layer], v[layer], a[layer], b[layer])
        ...     await spec.commit(verify(o))
        """
        return AsyncSpeculation(self)

    async def fork(self) -> "AsyncSession":
        """A copy of this session (states and positions) on the same device; not retried."""
        return AsyncSession(self._client, await self._client._run(_calls.fork(self._client._routes, self._cursor)))

    async def export(self) -> ExportedState:
        """This session's state and positions (see `AsyncClient.import_state`)."""
        return await self._client._run(_calls.export_state(self._client._routes, self._cursor))

    async def recover(self) -> list[torch.Tensor]:
        """Resends steps whose outcome stayed unknown after the last retry."""
        return await self._client._run(_calls.recover(self._client._routes, self._cursor))

    async def close(self) -> None:
        await self._client._run(_calls.close_cursor(self._client._routes, self._cursor))

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"


class AsyncSpeculation:
    """An open draft step of one `AsyncSession` (see `AsyncSession.speculate`)."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session
        self.committed: dict[int, int] | None = None

    async def decode(self, layer: int, q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike,
                     b: TensorLike) -> torch.Tensor:
        """A speculative step of T draft tokens at ``layer``; returns bf16 o [T, HV, V]."""
        return await self.session.decode(layer, q, k, v, a, b, speculative=True)

    async def commit(self, accepted: int) -> dict[int, int]:
        """Keeps the first ``accepted`` tokens at every layer; returns the positions afterwards."""
        self.committed = await self.session.commit(accepted)
        return self.committed

    async def __aenter__(self) -> "AsyncSpeculation":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.committed is None:
            await self.commit(0)
