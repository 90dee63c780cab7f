"""The asyncio client: `AsyncClient` and `AsyncSession`.

Same surface as the blocking client, with ``await``; request building, position bookkeeping and
reply parsing are the shared ones from `gdn_client._codec`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Sequence

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
from gdn_client._errors import GdnError, NotFoundError, error_from_rpc
from gdn_client._options import ClientOptions
from gdn_client._sessions_ext import ExportedState
from gdn_client._stream import AsyncDecodeStream
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc

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
    """

    def __init__(self, target: str, options: ClientOptions | None = None) -> None:
        self.target = target
        self.options = options or ClientOptions()
        self._channel = make_aio_channel(target, self.options)
        self._stub = gdn_pb2_grpc.GdnDecodeStub(self._channel)
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

    async def _run_step(self, step: PreparedStep) -> torch.Tensor:
        try:
            reply = await self._call(self._stub.Decode, step.request, retry=True)
        except GdnError as err:
            step.fail(err, in_doubt=err.retryable)
            raise
        except asyncio.CancelledError:
            step.fail(GdnError("cancelled"), in_doubt=True)
            raise
        return step.complete(reply)

    async def model_info(self) -> ModelInfo:
        """The served model's shape and capacity."""
        return model_info_from_proto(
            await self._call(self._stub.GetModelInfo, gdn_pb2.GetModelInfoRequest(), retry=True)
        )

    async def stats(self) -> Stats:
        """The server's counters (launches, rows per launch, requests)."""
        return stats_from_proto(await self._call(self._stub.GetStats, gdn_pb2.GetStatsRequest(), retry=True))

    async def create_session(self, colocate_with: "AsyncSession | str | None" = None) -> "AsyncSession":
        """Creates a session; close it with ``await s.close()`` or use ``async with``.

        ``colocate_with``: on the same device as that session (see `Client.create_session`).
        """
        sid = colocate_with.id if isinstance(colocate_with, AsyncSession) else (colocate_with or "")
        reply = await self._call(self._stub.CreateSession, gdn_pb2.CreateSessionRequest(colocate_with=sid))
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
        if isinstance(session, AsyncSession):
            await session.close()
            return
        await self._call(self._stub.CloseSession, gdn_pb2.CloseSessionRequest(session_id=session))

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
        """One atomic step for B sessions: [B, T, ...] inputs, bf16 o [B, T, HV, V]."""
        step = prepare_step(layer, [s._cursor for s in sessions], q, k, v, a, b, single=False)
        return await self._run_step(step)

    async def import_state(self, exported: ExportedState) -> "AsyncSession":
        """A new session on this server holding an exported state; not retried."""
        try:
            reply = await self._stub.ImportState(
                iter(list(exported.chunks())), timeout=self.options.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        session = AsyncSession(self, reply.session_id)
        session._cursor._adopt(list(exported.header.positions))
        return session

    def stream(self) -> AsyncDecodeStream:
        """Opens a pipelined DecodeStream (``async with client.stream() as st``)."""
        return AsyncDecodeStream(self)

    async def close(self) -> None:
        await self._channel.close()

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
        reply = await self._client._call(
            self._client._stub.Commit, gdn_pb2.CommitRequest(session_id=self.id, accepted=accepted), retry=True
        )
        self._cursor._adopt(list(reply.positions))
        return self.positions

    async def fork(self) -> "AsyncSession":
        """A copy of this session (states and positions) on the same device; not retried."""
        self._cursor._require_settled("fork()")
        reply = await self._client._call(self._client._stub.ForkSession, gdn_pb2.ForkSessionRequest(session_id=self.id))
        child = AsyncSession(self._client, reply.session_id)
        child._cursor._adopt(self._cursor.positions())
        return child

    async def export(self) -> ExportedState:
        """This session's state and positions (see `AsyncClient.import_state`)."""
        self._cursor._require_settled("export()")
        call = self._client._stub.ExportState(
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
            await self._client._call(
                self._client._stub.CloseSession, gdn_pb2.CloseSessionRequest(session_id=self.id), retry=True
            )
        except NotFoundError:
            pass

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"
