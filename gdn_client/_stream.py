"""Pipelined decode over long-lived DecodeStream RPCs: `DecodeStream` (threads) and
`AsyncDecodeStream` (asyncio); one RPC (a lane) per server process the stream has steps for.

`submit` returns a future at once; each lane's replies come back in order and are matched to
requests by ``request_id``. A reply with ``error_code != 0`` becomes that future's exception and the stream
goes on. If the stream itself breaks with UNAVAILABLE (server restart, connection reset), it is
reopened with backoff and every unanswered request is resent in order: each carries its positions,
so the server answers steps it already applied without applying them again.

Tensors of the client's shared memory go by reference, as in `Session.decode`; a lane registers a
step's regions with its process before the step goes. A step whose region the server dropped is
answered NOT_FOUND (its future raises it, nothing applied), and the region is registered again
before the lane's next step that uses it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator, Sequence, Union

import grpc

from gdn_client import _calls
from gdn_client._errors import (
    GdnError,
    UnavailableError,
    error_from_code,
    error_from_rpc,
    error_from_status,
)
from gdn_client._shared_memory import missing_region
from gdn_client._steps import PreparedStep, TensorLike, prepare_step
from gdn_client.proto.gdn.v1 import gdn_pb2

if TYPE_CHECKING:
    from gdn_client._aio import AsyncClient, AsyncSession
    from gdn_client._client import Client, Session

__all__ = ["DecodeStream", "AsyncDecodeStream"]

logger = logging.getLogger("gdn_client")

_FutureT = Union[concurrent.futures.Future, asyncio.Future]


class _InFlight:
    """Requests sent and not yet answered, in send order; shared by both stream flavours."""

    def __init__(self, process: int | None) -> None:
        self.process = process  # the server process of the lane
        self._ids = itertools.count()
        self._pending: OrderedDict[str, tuple[_FutureT, PreparedStep]] = OrderedDict()
        self._replayed: set[str] = set()
        self.broken: GdnError | None = None  # set when the stream gave up; submit then raises

    def add(self, step: PreparedStep, fut: _FutureT) -> None:
        step.request.request_id = str(next(self._ids))
        self._pending[step.request.request_id] = (fut, step)

    def replay(self) -> list[PreparedStep]:
        """The unanswered steps, in order, marked as resent."""
        self._replayed.update(self._pending)
        return [step for _, step in self._pending.values()]

    def drop(self, step: PreparedStep, err: GdnError) -> None:
        """Fails a step that was never sent (its regions could not be registered)."""
        entry = self._pending.pop(step.request.request_id, None)
        if entry is not None:
            step.fail(err)
            _settle(entry[0], exc=err)

    def __len__(self) -> int:
        return len(self._pending)

    def resolve(self, reply: gdn_pb2.DecodeResponse) -> None:
        entry = self._pending.pop(reply.request_id, None)
        if entry is None:
            if not self._pending:
                logger.warning("DecodeStream reply %r matches no request", reply.request_id)
                return
            _, entry = self._pending.popitem(last=False)  # server did not echo request_id: FIFO
        fut, step = entry
        replayed = step.request.request_id in self._replayed
        self._replayed.discard(step.request.request_id)
        if reply.error_code:
            err = error_from_code(reply.error_code, reply.error_message)
            if step.regions and missing_region(err):  # the server dropped it: registered again before the next step
                for region in step.regions:
                    region.registered_on.discard(self.process)
            if replayed and err.code == grpc.StatusCode.FAILED_PRECONDITION:
                # The server remembers only the last step per (session, layer): an older step that
                # was applied before the stream broke can no longer be answered. Its fate is unknown.
                err = error_from_code(
                    reply.error_code,
                    f"{err.message} (resent after the stream broke; the step may have been applied: "
                    "keep one step in flight per session and layer to make resends exact)",
                )
                step.fail(err, in_doubt=True)
            else:
                step.fail(err)
            _settle(fut, exc=err)
            return
        try:
            _settle(fut, result=step.complete(reply))
        except GdnError as err:
            _settle(fut, exc=err)

    def fail_all(self, err: GdnError) -> None:
        self.broken = err
        while self._pending:
            _, (fut, step) = self._pending.popitem(last=False)
            step.fail(err, in_doubt=err.retryable)
            _settle(fut, exc=err)


def _settle(fut: _FutureT, *, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # cancelled by the caller
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


_END = None  # sentinel that ends a request iterator


class _Reconnecting:
    """Backoff across reopenings of one stream; reset by any reply."""

    _delays: Iterator[float] | None = None
    _client: Any

    def _next_delay(self, err: GdnError, closing: bool) -> float | None:
        if not err.retryable or closing:
            return None
        if self._delays is None:
            self._delays = self._client.options.backoff_delays()
        return next(self._delays, None)


class _Lanes:
    """What both stream flavours share: a lane (one DecodeStream RPC) per server process, opened
    on the first step for a session of that process. A step goes to its sessions' process (the
    sessions of one step must share one), so each session's steps stay in order on one lane."""

    def __init__(self, client: "Client | AsyncClient") -> None:
        self._client = client
        self._lanes: dict[int | None, Any] = {}
        self._lanes_lock = threading.Lock()
        self._closing = False

    def _new_lane(self, process: int | None) -> Any:
        raise NotImplementedError

    def _route(self, layer: int, sessions: Any, q, k, v, a, b, out) -> tuple[Any, PreparedStep]:
        """The lane of the step's process and the prepared step (positions reserved)."""
        one = hasattr(sessions, "_cursor")
        cursors = [sessions._cursor] if one else [s._cursor for s in sessions]
        process = self._client._routes.home([c.session_id for c in cursors])  # before any reservation
        step = prepare_step(layer, cursors, q, k, v, a, b, single=one, regions=self._client._regions, out=out)
        with self._lanes_lock:
            closed = self._closing
            if not closed and process not in self._lanes:
                self._lanes[process] = self._new_lane(process)
        if closed:
            err = UnavailableError("stream is closed")
            step.fail(err)
            raise err
        return self._lanes[process], step

    def _close_lanes(self) -> list[Any]:
        """Marks the stream closing; returns its lanes."""
        with self._lanes_lock:
            self._closing = True
            return list(self._lanes.values())


class DecodeStream(_Lanes):
    """Pipelined steps over DecodeStream (thread-safe).

    >>> with client.stream() as st:                                   # doctest: +SKIP
    ...     f0 = st.submit(0, session, q, k, v, a, b)                 # one session: [T, ...]
    ...     f1 = st.submit(0, [s1, s2], q2, k2, v2, a2, b2)           # batched: [B, T, ...]
    ...     o0, o1 = f0.result(), f1.result()

    Futures are `concurrent.futures.Future`; a failed step raises its `GdnError` from
    ``result()``. Closing waits for outstanding replies (up to the client's timeout).

    On a host of several server processes (``gdn-server --processes K``) the stream opens one
    DecodeStream RPC per process it has steps for, on first use: each step goes to the process
    its sessions live in (a batched step needs sessions of one process: FailedPreconditionError
    otherwise), and the steps of each session are answered in the order they were submitted.
    """

    def _new_lane(self, process: int | None) -> "_Lane":
        return _Lane(self._client, process)

    def submit(
        self,
        layer: int,
        sessions: "Session | Sequence[Session]",
        q: TensorLike,
        k: TensorLike,
        v: TensorLike,
        a: TensorLike,
        b: TensorLike,
        *,
        out: Any = None,
    ) -> concurrent.futures.Future:
        """Queues one step; the future's result is bf16 o ([T, HV, V] for one Session, else
        [B, T, HV, V]; ``out``, a tensor of the client's shared memory, where the server writes it)."""
        lane, step = self._route(layer, sessions, q, k, v, a, b, out)
        return lane.submit(step)

    def close(self, timeout: float | None = None) -> None:
        """Half-closes the stream and waits for the replies still due."""
        lanes = self._close_lanes()
        for lane in lanes:
            lane.half_close()
        wait = self._client.options.timeout if timeout is None else timeout
        deadline = None if wait is None else time.monotonic() + wait
        for lane in lanes:
            lane.finish(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "DecodeStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Lane(_Reconnecting):
    """One DecodeStream RPC to one server process, reopened (resending what is unanswered) when
    it breaks with UNAVAILABLE. Its reader thread opens the RPC, so that learning the server's
    processes, when a lane needs it first, happens there rather than in `submit`."""

    def __init__(self, client: "Client", process: int | None) -> None:
        self._client = client
        self._process = process
        self._lock = threading.Lock()
        self._inflight = _InFlight(process)
        self._closing = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._call: Any = None
        self._open([])

    def _open(self, replay: list[PreparedStep]) -> None:
        # caller holds self._lock (or is __init__)
        q: queue.SimpleQueue = queue.SimpleQueue()
        for step in replay:
            q.put(step)
        self._queue = q
        self._reader = threading.Thread(target=self._read, args=(q,), name="gdn-decode-stream", daemon=True)
        self._reader.start()

    def submit(self, step: PreparedStep) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            err = self._inflight.broken or (UnavailableError("stream is closed") if self._closing else None)
            if err is None:
                self._inflight.add(step, fut)
                self._queue.put(step)
        if err is not None:
            step.fail(err)
            raise error_from_status(err.code, err.message) from None
        return fut

    def _read(self, requests: queue.SimpleQueue) -> None:
        try:
            stub = self._client._stub_of(self._process)
            call = stub.DecodeStream(_drain(requests, self._registered), metadata=self._client._metadata)
            with self._lock:
                self._call = call
            for reply in call:
                with self._lock:
                    self._inflight.resolve(reply)
                    self._delays = None  # healthy again: a later break gets fresh retries
            err: GdnError | None = None
        except grpc.RpcError as exc:
            err = error_from_rpc(exc)
        except GdnError as exc:  # learning the processes failed
            err = exc
        with self._lock:
            if err is None and (self._closing or not len(self._inflight)):
                return
            if err is None:
                err = UnavailableError("DecodeStream ended with requests unanswered")
            delay = self._next_delay(err, self._closing)
            if delay is None:
                self._inflight.fail_all(err)
                return
        logger.info("DecodeStream broke (%s); reopening in %.3f s", err, delay)
        threading.Event().wait(delay)
        with self._lock:
            self._queue.put(_END)
            self._open(self._inflight.replay())  # a new reader thread takes over

    def _registered(self, step: PreparedStep) -> bool:
        """Registers the step's regions with the lane's process where needed; False (the step
        failed, not sent) if that fails."""
        try:
            self._client._run(_calls.registered(step.regions, self._process))
        except GdnError as err:
            with self._lock:
                self._inflight.drop(step, err)
            return False
        return True

    def half_close(self) -> None:
        """No more requests: the server answers those sent and ends the RPC."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._queue.put(_END)

    def finish(self, timeout: float | None) -> None:
        """Waits up to `timeout` for the replies still due; fails the requests left unanswered."""
        while True:
            reader = self._reader
            if reader is None:
                break
            reader.join(timeout)
            if reader.is_alive() or reader is self._reader:
                break
        with self._lock:
            if len(self._inflight):
                if self._call is not None:
                    self._call.cancel()
                self._inflight.fail_all(UnavailableError("stream closed before the reply came"))


def _drain(q: queue.SimpleQueue, registered: Any) -> Iterator[gdn_pb2.DecodeRequest]:
    while True:
        item = q.get()
        if item is _END:
            return
        if not item.regions or registered(item):
            yield item.request


class AsyncDecodeStream(_Lanes):
    """The asyncio flavour of `DecodeStream`; ``submit`` returns an `asyncio.Future`.

    >>> async with client.stream() as st:                             # doctest: +SKIP
    ...     futs = [st.submit(layer, session, q, k, v, a, b) for layer in range(3)]
    ...     outs = await asyncio.gather(*futs)

    Like `DecodeStream`, one DecodeStream RPC per server process it has steps for.
    """

    def _new_lane(self, process: int | None) -> "_AsyncLane":
        return _AsyncLane(self._client, process)

    def submit(
        self,
        layer: int,
        sessions: "AsyncSession | Sequence[AsyncSession]",
        q: TensorLike,
        k: TensorLike,
        v: TensorLike,
        a: TensorLike,
        b: TensorLike,
        *,
        out: Any = None,
    ) -> asyncio.Future:
        """Queues one step (no await needed); await the returned future for bf16 o (see
        `DecodeStream.submit` for ``out``)."""
        lane, step = self._route(layer, sessions, q, k, v, a, b, out)
        return lane.submit(step)

    async def close(self, timeout: float | None = None) -> None:
        """Half-closes the stream and waits for the replies still due."""
        lanes = self._close_lanes()
        for lane in lanes:
            lane.half_close()
        wait = self._client.options.timeout if timeout is None else timeout
        await asyncio.gather(*(lane.finish(wait) for lane in lanes))

    async def __aenter__(self) -> "AsyncDecodeStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _AsyncLane(_Reconnecting):
    """The asyncio `_Lane`: its reader task opens the RPC (awaiting the server's processes first
    where they are not known yet, which `submit`, not being a coroutine, cannot)."""

    def __init__(self, client: "AsyncClient", process: int | None) -> None:
        self._client = client
        self._process = process
        self._inflight = _InFlight(process)
        self._closing = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._call: Any = None
        self._reader: asyncio.Task | None = None
        self._open([])

    def _open(self, replay: list[PreparedStep]) -> None:
        q: asyncio.Queue = asyncio.Queue()
        for step in replay:
            q.put_nowait(step)
        self._queue = q
        self._reader = asyncio.get_running_loop().create_task(self._read(q))

    def submit(self, step: PreparedStep) -> asyncio.Future:
        err = self._inflight.broken or (UnavailableError("stream is closed") if self._closing else None)
        if err is not None:
            step.fail(err)
            raise error_from_status(err.code, err.message) from None
        fut = asyncio.get_running_loop().create_future()
        self._inflight.add(step, fut)
        self._queue.put_nowait(step)
        return fut

    async def _read(self, requests: asyncio.Queue) -> None:
        try:
            stub = await self._client._stub_of(self._process)
            self._call = stub.DecodeStream(_adrain(requests, self._registered), metadata=self._client._metadata)
            async for reply in self._call:
                self._inflight.resolve(reply)
                self._delays = None
            err: GdnError | None = None
        except grpc.RpcError as exc:
            err = error_from_rpc(exc)
        except GdnError as exc:  # learning the processes failed
            err = exc
        except asyncio.CancelledError:
            self._inflight.fail_all(UnavailableError("stream closed before the reply came"))
            raise
        if err is None and (self._closing or not len(self._inflight)):
            return
        if err is None:
            err = UnavailableError("DecodeStream ended with requests unanswered")
        delay = self._next_delay(err, self._closing)
        if delay is None:
            self._inflight.fail_all(err)
            return
        logger.info("DecodeStream broke (%s); reopening in %.3f s", err, delay)
        await asyncio.sleep(delay)
        self._queue.put_nowait(_END)
        self._open(self._inflight.replay())

    async def _registered(self, step: PreparedStep) -> bool:
        """See `_Lane._registered`."""
        try:
            await self._client._run(_calls.registered(step.regions, self._process))
        except GdnError as err:
            self._inflight.drop(step, err)
            return False
        return True

    def half_close(self) -> None:
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(_END)

    async def finish(self, timeout: float | None) -> None:
        """Waits up to `timeout` for the replies still due; fails the requests left unanswered."""
        while self._reader is not None:
            reader = self._reader
            try:
                await asyncio.wait_for(asyncio.shield(reader), timeout)
            except asyncio.TimeoutError:
                break
            if reader is self._reader:
                break
        if len(self._inflight):
            if self._call is not None:
                self._call.cancel()
            self._inflight.fail_all(UnavailableError("stream closed before the reply came"))


async def _adrain(q: asyncio.Queue, registered: Any) -> AsyncIterator[gdn_pb2.DecodeRequest]:
    while True:
        item = await q.get()
        if item is _END:
            return
        if not item.regions or await registered(item):
            yield item.request
