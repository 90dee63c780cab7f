"""The decode RPCs' shared half, and a DecodeResponse's wire form.

`DecodeRpcs` serves Decode and DecodeStream over any way of running a validated request: in this
process (gdn_server.servicer.GdnDecodeServicer) or in an engine process behind a front-end
worker's link (gdn_server.frontend). Domain errors (`GdnError`) become status codes here: a
unary call aborts with the code, a DecodeStream answers the failing request with
`error_code`/`error_message` and keeps going.

It imports neither torch nor the scheduler and backends: a front-end worker imports it, and
serves bf16 requests without torch (~2 s of CPU and ~200 MB less per worker process).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import threading
from typing import Any, AsyncIterator, Callable

import grpc

from gdn_client.proto.gdn.v1 import gdn_pb2
from gdn_server.config import ModelShape
from gdn_server.errors import GdnError
from gdn_server.native import COPY_THREADS, THREADED_COPY_BYTES
from gdn_server.native import module as native
from gdn_server.protowire import encode_varint
from gdn_server.rpc_wrap import Serialized, serialized_responses_ok
from gdn_server.security import current_identity
from gdn_server.validation import decode_work_from_request
from gdn_server.work import DecodeResult, DecodeWork

MAX_STREAM_IN_FLIGHT = 64  # requests of one DecodeStream read ahead of their replies


def settle_on(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Future, Callable[[Any], None]]:
    """A future on `loop` and a thread-safe callback that resolves it (exceptions are raised).

    Call it on the loop's thread. The callback settles the future at once when it is called on
    that thread too (a scheduler running on the loop), else through `call_soon_threadsafe`."""
    fut = loop.create_future()
    loop_thread = threading.get_ident()

    def _settle(result: Any) -> None:
        if fut.done():  # the RPC was cancelled meanwhile
            return
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def done(result: Any) -> None:
        if threading.get_ident() == loop_thread:
            _settle(result)
        else:
            loop.call_soon_threadsafe(_settle, result)

    return fut, done


def decode_response(result: DecodeResult) -> gdn_pb2.DecodeResponse:
    # o is filled in place: `o=gdn_pb2.Tensor(...)` would copy the output bytes twice (into the
    # Tensor, then the Tensor into the reply), a fresh MiB-sized buffer each for big batches
    reply = gdn_pb2.DecodeResponse(positions=result.positions, request_id=result.request_id)
    o = reply.o
    o.dtype = gdn_pb2.BF16
    o.shape.extend(result.shape)
    o.data = bytes(result.out)  # protobuf takes bytes, not a view
    return reply


_O_TAG = b"\x0a"  # DecodeResponse.o: field 1, length-delimited
_DATA_TAG = b"\x1a"  # Tensor.data: field 3, length-delimited


def decode_response_wire(result: DecodeResult) -> bytes:
    """`decode_response(result).SerializeToString()`, byte for byte, with one copy of the output."""
    return encode_decode_response(result)[0]


def encode_decode_response(result: DecodeResult) -> tuple[bytes, int]:
    """`decode_response_wire(result)` and the offset of the output bytes in it: in C where the
    native module is built (one allocation, one copy of the output), else in Python."""
    return encode_decode_reply(result.out, result.shape, result.positions, result.request_id)


def encode_decode_reply(out: Any, shape: tuple, positions: tuple, request_id: str) -> tuple[bytes, int]:
    """`encode_decode_response` of a result's parts (the scheduler's `encode_reply`: it answers
    with the DecodeResult it builds from the wire)."""
    if native is not None:
        threads = COPY_THREADS if len(out) >= THREADED_COPY_BYTES else 1
        return native.encode_decode_response(out, shape, tuple(positions), request_id, threads)
    return encode_decode_response_python(DecodeResult(out, shape, tuple(positions), request_id))


def encode_decode_response_python(result: DecodeResult) -> tuple[bytes, int]:
    """`encode_decode_response` without the native module.

    The message route copies the output bytes three times (into the message, into upb's encode
    buffer, into the serialized bytes: 6 MiB of memory traffic for a B=256 reply); here protobuf
    serializes only the small fields and one join writes the output after them, in the order upb
    writes fields (by number: o first, and in o dtype, shape, then data). The output may be any
    buffer (the scheduler encodes straight from the device's pinned output, Scheduler.encode_reply).
    """
    head = gdn_pb2.Tensor(dtype=gdn_pb2.BF16, shape=result.shape).SerializeToString()
    rest = gdn_pb2.DecodeResponse(positions=result.positions, request_id=result.request_id).SerializeToString()
    data = result.out
    if not len(data):  # proto3 leaves an empty bytes field out
        wire = _O_TAG + encode_varint(len(head)) + head + rest
        return wire, len(wire)
    data_len = encode_varint(len(data))
    o_len = encode_varint(len(head) + 1 + len(data_len) + len(data))
    wire = b"".join((_O_TAG, o_len, head, _DATA_TAG, data_len, data, rest))
    return wire, len(wire) - len(rest) - len(data)


def _reply(result: DecodeResult) -> gdn_pb2.DecodeResponse | Serialized:
    """The reply to a successful decode, already serialized where the call's handler passes that on."""
    if serialized_responses_ok():
        return Serialized(result.wire if result.wire is not None else decode_response_wire(result))
    return decode_response(result)


def error_response(request_id: str, error: GdnError) -> gdn_pb2.DecodeResponse:
    return gdn_pb2.DecodeResponse(
        request_id=request_id, error_code=error.code.value[0], error_message=error.message
    )


class DecodeRpcs:
    """Decode and DecodeStream over any way of running a validated request (`_start_decode`):
    in this process (GdnDecodeServicer) or in the engine process (gdn_server.frontend)."""

    shape: ModelShape
    metrics = None  # gdn_server.metrics.RpcMetrics, when counted in this process
    # big bf16 requests leave their NaN/Inf check to the backend (validation.DEFERRED_CHECK_BYTES)
    # where one runs them: in this process, or behind a front-end worker's link (which says so)
    defer_finite_check = False
    # requests not all in BF16 as float32 bytes, not tensors (validation.decode_work_from_request):
    # where they only pass on through a front-end worker's link, which then needs no torch
    f32_as_bytes = False

    def _start_decode(self, request: gdn_pb2.DecodeRequest) -> asyncio.Future:
        """Validates one decode request and queues it; returns the future of its DecodeResult.

        Raises GdnError for what validation finds; the future raises it for what the scheduler
        finds."""
        raise NotImplementedError

    def _submit_decode(
        self, request: gdn_pb2.DecodeRequest, done: Callable[[Any], None], cancelled: Callable[[], bool]
    ) -> asyncio.Future | None:
        """`_start_decode` without a future of its own (DecodeStream answers a slot per request):
        `done` gets the DecodeResult or GdnError, on any thread; once `cancelled()` is true the
        request is dropped before the device. Returns what the caller cancels when it gives up
        (a future, or a front-end worker's link request), where the way of running the request
        has one. Raises GdnError for what validation finds."""
        return self._answering(self._start_decode(request), done)

    @staticmethod
    def _answering(fut: asyncio.Future, done: Callable[[Any], None]) -> asyncio.Future:
        """`fut`, which calls `done` with its result or error once it has one (not if cancelled)."""
        fut.add_done_callback(functools.partial(_settle_into, done))
        return fut

    def _validated(self, request: gdn_pb2.DecodeRequest) -> DecodeWork:
        work = decode_work_from_request(request, self.shape, self.defer_finite_check, self.f32_as_bytes)
        identity = current_identity()
        if identity is not None:  # every session must be this caller's
            work = dataclasses.replace(work, owner=identity)
        return work

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.count_decode(method, code)

    async def _decode(self, request: gdn_pb2.DecodeRequest) -> DecodeResult:
        """Validates and runs one unary decode request; raises GdnError."""
        code = grpc.StatusCode.CANCELLED  # unless it ends otherwise (cancelling the task cancels `fut`)
        try:
            result = await self._start_decode(request)
            code = grpc.StatusCode.OK
            return result
        except GdnError as e:
            code = e.code
            raise
        finally:
            self._count("Decode", code)

    async def Decode(self, request, context):
        try:
            result = await self._decode(request)
        except GdnError as e:
            await context.abort(e.code, e.message)
        return _reply(result)

    async def DecodeStream(self, request_iterator: AsyncIterator[gdn_pb2.DecodeRequest], context) -> None:
        # A reader task validates and queues up to MAX_STREAM_IN_FLIGHT requests ahead of their
        # replies, so one stream is pipelined; this coroutine answers them in request order. Per
        # message: a slot the scheduler answers into, and one wake-up of this coroutine when the
        # oldest slot is answered (no future, queue or wake-up per request besides). Replies go
        # out with context.write (grpc.aio's reader/writer API), not as an async generator's
        # items: grpc would resume the generator, and each wrapping of the handler's, per reply.
        stream = _ReplyStream(asyncio.get_running_loop())

        async def read() -> None:
            try:
                async for request in request_iterator:
                    answer = _Answer(stream, request.request_id)
                    stream.answers.append(answer)
                    try:
                        answer.future = self._submit_decode(request, answer, stream.is_closed)
                    except GdnError as e:
                        answer(e)
                    except BaseException:
                        stream.answers.pop()  # never to be answered: the writer must not wait for it
                        raise
                    if len(stream.answers) >= MAX_STREAM_IN_FLIGHT:
                        await stream.room()
            except Exception as e:  # the stream broke: let the writer end the RPC
                stream.finish(e)
                return
            stream.finish(None)

        reader = asyncio.ensure_future(read())
        try:
            answers = stream.answers
            while True:
                if answers and answers[0].result is not _PENDING:
                    answer = answers.popleft()
                    stream.made_room()
                    await context.write(self._stream_reply(answer))
                elif not answers and stream.ended:
                    if stream.error is not None:
                        raise stream.error
                    break
                else:
                    await stream.next_answer()
        finally:
            stream.closed = True  # queued requests are dropped before the device (the scheduler's `cancelled`)
            reader.cancel()
            for answer in stream.answers:
                if answer.future is not None:
                    answer.future.cancel()

    def _stream_reply(self, answer: "_Answer") -> gdn_pb2.DecodeResponse | Serialized:
        result = answer.result
        if isinstance(result, GdnError):
            self._count("DecodeStream", result.code)
            return error_response(answer.request_id, result)
        if isinstance(result, BaseException):
            raise result
        self._count("DecodeStream", grpc.StatusCode.OK)
        return _reply(result)


_PENDING = object()  # an _Answer's result before the answer


def _settle_into(done: Callable[[Any], None], fut: asyncio.Future) -> None:
    if not fut.cancelled():
        error = fut.exception()
        done(error if error is not None else fut.result())


class _Answer:
    """One request of a DecodeStream: called with its DecodeResult or error (the scheduler's
    `done`, from any thread), it keeps the first answer and wakes the stream's writer when the
    oldest request has its answer."""

    __slots__ = ("stream", "request_id", "result", "future")

    def __init__(self, stream: "_ReplyStream", request_id: str) -> None:
        self.stream = stream
        self.request_id = request_id
        self.result: Any = _PENDING
        self.future: Any = None  # what _submit_decode returned: cancelled if the stream ends first

    def __call__(self, result: Any) -> None:
        stream = self.stream
        if threading.get_ident() != stream.loop_thread:
            stream.loop.call_soon_threadsafe(self, result)
            return
        if self.result is _PENDING:
            self.result = result
            answers = stream.answers
            if answers and answers[0] is self:
                stream.wake_writer()


class _ReplyStream:
    """A DecodeStream's requests in flight, oldest first, and the reader's and writer's waits."""

    __slots__ = ("loop", "loop_thread", "answers", "ended", "error", "closed", "_writer_waits", "_reader_waits")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.answers: collections.deque[_Answer] = collections.deque()
        self.ended = False  # the reader is done: no more requests
        self.error: BaseException | None = None  # why the reading broke, if it did
        self.closed = False  # the RPC is over
        self._writer_waits: asyncio.Future | None = None
        self._reader_waits: asyncio.Future | None = None

    def is_closed(self) -> bool:
        return self.closed

    def finish(self, error: BaseException | None) -> None:
        self.ended, self.error = True, error
        self.wake_writer()

    def next_answer(self) -> asyncio.Future:
        """For the writer: resolves when the oldest request is answered, or the reading ends."""
        fut = self._writer_waits = self.loop.create_future()
        return fut

    def wake_writer(self) -> None:
        fut, self._writer_waits = self._writer_waits, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def room(self) -> asyncio.Future:
        """For the reader: resolves when fewer than MAX_STREAM_IN_FLIGHT requests are in flight."""
        fut = self._reader_waits = self.loop.create_future()
        return fut

    def made_room(self) -> None:
        fut = self._reader_waits
        if fut is not None and len(self.answers) < MAX_STREAM_IN_FLIGHT:
            self._reader_waits = None
            if not fut.done():
                fut.set_result(None)
