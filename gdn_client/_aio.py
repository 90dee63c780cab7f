"""The asyncio client: `AsyncClient` and `AsyncSession`.

Same surface as the blocking client, with ``await``; request building, position bookkeeping and
reply parsing are the shared ones from `gdn_client._codec`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc
import grpc.aio
import torch

from gdn_client._codec import (
    ModelInfo,
    PreparedStep,
    SessionCursor,
    Stats,
    TensorLike,
    model_info_from_proto,
    prepare_step,
    stats_from_proto,
)
from gdn_client._errors import GdnError, NotFoundError, ResourceExhaustedError, error_from_rpc
from gdn_client._options import ClientOptions
from gdn_client._routing import ProcessRoutes
from gdn_client._sessions_ext import ExportedState
from gdn_client._stream import AsyncDecodeStream
from gdn_client.proto.gdn.v1 import gdn_pb2

__all__ = ["AsyncClient", "AsyncSession"]

logger = logging.getLogger("gdn_client")


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

    async def _learn_processes(self) -> None:
        """Asks the target for the server's processes unless known (see `Client`)."""
        if not self._routes.known:
            self._routes.learn(
                await self._call(self._routes.stub.GetModelInfo, gdn_pb2.GetModelInfoRequest(), retry=True)
            )

    async def _stub_of(self, process: int | None) -> Any:
        """The stub of server process `process` (None: the target)."""
        if process is not None:
            await self._learn_processes()
        return self._routes.stub_of(process)

    async def _stub_for(self, *session_ids: str) -> Any:
        """The stub of the process these sessions live in (FailedPreconditionError if several)."""
        return await self._stub_of(self._routes.home(session_ids))

    async def _on_a_process_with_room(self, send: Callable[[Any], Awaitable[Any]]) -> Any:
        """`await send(stub)` on the server's processes in new-session order, until one is not full."""
        await self._learn_processes()
        order = self._routes.new_session_order()
        for process in order:
            try:
                return await send(self._routes.stub_of(process))
            except ResourceExhaustedError as err:
                full = err
        raise self._routes.all_full(full)

    async def _run_step(self, step: PreparedStep) -> torch.Tensor:
        try:
            stub = await self._stub_for(*step.request.session_ids)
        except GdnError as err:
            step.fail(err)  # not sent
            raise
        except asyncio.CancelledError:
            step.fail(GdnError("cancelled"))
            raise
        try:
            reply = await self._call(stub.Decode, step.request, retry=True)
        except GdnError as err:
            step.fail(err, in_doubt=err.retryable)
            raise
        except asyncio.CancelledError:
            step.fail(GdnError("cancelled"), in_doubt=True)
            raise
        return step.complete(reply)

    async def _close(self, session_id: str, *, retry: bool) -> None:
        request = gdn_pb2.CloseSessionRequest(session_id=session_id)
        await self._call((await self._stub_for(session_id)).CloseSession, request, retry=retry)

    async def model_info(self) -> ModelInfo:
        """The served model's shape and capacity; on a host of several server processes, the
        sessions and capacity are the whole host's (see `Client.model_info`).

        >>> async def free_sessions(target: str) -> int:               # doctest: +SKIP
        ...     async with AsyncClient(target) as client:
        ...         info = await client.model_info()
        ...         return info.max_sessions - info.sessions_in_use
        """
        request = gdn_pb2.GetModelInfoRequest()
        target_info = await self._call(self._routes.stub.GetModelInfo, request, retry=True)
        self._routes.learn(target_info)
        processes = self._routes.other_processes()
        replies = await asyncio.gather(
            *(self._call(self._routes.stub_of(p).GetModelInfo, request, retry=True) for p in processes),
            return_exceptions=True,
        )
        others = []
        for process, reply in zip(processes, replies):
            if isinstance(reply, GdnError):
                logger.warning("server process %d left out of model_info: %s", process, reply)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                others.append(reply)
        return model_info_from_proto(target_info, *others)

    async def stats(self) -> Stats:
        """The target server process's counters (launches, rows per launch, requests)."""
        return stats_from_proto(await self._call(self._routes.stub.GetStats, gdn_pb2.GetStatsRequest(), retry=True))

    async def create_session(self, colocate_with: "AsyncSession | str | None" = None) -> "AsyncSession":
        """Creates a session; close it with ``await s.close()`` or use ``async with``.

        ``colocate_with``: in the same process and on the same device as that session (see
        `Client.create_session`).

        >>> async def pair(client: AsyncClient) -> tuple[AsyncSession, AsyncSession]:  # doctest: +SKIP
        ...     s = await client.create_session()
        ...     return s, await client.create_session(colocate_with=s)
        """
        buddy = colocate_with.id if isinstance(colocate_with, AsyncSession) else (colocate_with or "")
        if buddy:
            request = gdn_pb2.CreateSessionRequest(colocate_with=buddy)
            reply = await self._call((await self._stub_for(buddy)).CreateSession, request)
        else:
            reply = await self._on_a_process_with_room(
                lambda stub: self._call(stub.CreateSession, gdn_pb2.CreateSessionRequest())
            )
        return AsyncSession(self, reply.session_id)

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
        await self._close(session, retry=False)

    async def decode_batch(
        self,
        layer: int,
        sessions: Sequence["AsyncSession"],
        q: TensorLike,
        k: TensorLike,
        v: TensorLike,
        a: TensorLike,
        b: TensorLike,
    ) -> torch.Tensor:
        """One atomic step for B sessions of one server process and device (see
        `Client.decode_batch`): [B, T, ...] inputs, bf16 o [B, T, HV, V]."""
        step = prepare_step(layer, [s._cursor for s in sessions], q, k, v, a, b, single=False)
        return await self._run_step(step)

    async def import_state(self, exported: ExportedState) -> "AsyncSession":
        """A new session on this server holding an exported state; not retried.

        >>> async def move(session: AsyncSession, to: AsyncClient) -> AsyncSession:  # doctest: +SKIP
        ...     moved = await to.import_state(await session.export())
        ...     await session.close()
        ...     return moved
        """

        async def send(stub: Any) -> Any:
            try:
                return await stub.ImportState(
                    iter(list(exported.chunks())), timeout=self.options.timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                raise error_from_rpc(exc) from None

        reply = await self._on_a_process_with_room(send)
        session = AsyncSession(self, reply.session_id)
        session._cursor._adopt(list(exported.header.positions))
        return session

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

    def __init__(self, client: AsyncClient, session_id: str) -> None:
        self._client = client
        self._cursor = SessionCursor(session_id)

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
        *, speculative: bool = False,
    ) -> torch.Tensor:
        """One step of T tokens at ``layer``: [T, ...] inputs, bf16 o [T, HV, V]. ``speculative``:
        a draft step that `commit` settles (see `Session.speculate`)."""
        step = prepare_step(layer, [self._cursor], q, k, v, a, b, single=True, speculative=speculative)
        return await self._client._run_step(step)

    async def commit(self, accepted: int) -> dict[int, int]:
        """Keeps the first ``accepted`` tokens of every open speculative step; returns positions."""
        stub = await self._client._stub_for(self.id)
        reply = await self._client._call(
            stub.Commit, gdn_pb2.CommitRequest(session_id=self.id, accepted=accepted), retry=True
        )
        self._cursor._adopt(list(reply.positions))
        return self.positions

    async def fork(self) -> "AsyncSession":
        """A copy of this session (states and positions) on the same device; not retried."""
        self._cursor._require_settled("fork()")
        stub = await self._client._stub_for(self.id)
        reply = await self._client._call(stub.ForkSession, gdn_pb2.ForkSessionRequest(session_id=self.id))
        child = AsyncSession(self._client, reply.session_id)
        child._cursor._adopt(self._cursor.positions())
        return child

    async def export(self) -> ExportedState:
        """This session's state and positions (see `AsyncClient.import_state`)."""
        self._cursor._require_settled("export()")
        stub = await self._client._stub_for(self.id)
        call = stub.ExportState(
            gdn_pb2.ExportStateRequest(session_id=self.id), timeout=self._client.options.timeout,
            metadata=self._client._metadata,
        )
        try:
            return ExportedState.from_chunks([chunk async for chunk in call])
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    async def recover(self) -> list[torch.Tensor]:
        """Resends steps whose outcome stayed unknown after the last retry."""
        return [await self._client._run_step(step) for step in self._cursor.in_doubt()]

    async def close(self) -> None:
        if self._cursor.closed:
            return
        self._cursor.closed = True
        try:
            await self._client._close(self.id, retry=True)
        except NotFoundError:
            pass

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"
