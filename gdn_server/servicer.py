"""The gRPC servicer: protobuf in -> domain calls -> protobuf out.

It stays thin: requests are checked by gdn_server.validation, run by each device's scheduler
(decode steps) or as control items between launches (session operations), and answered here.
The decode RPCs take their messages as bytes, which validation reads (a bf16 step in C, the
rest through protobuf), and send results encoded by gdn_server._wire (`add_to_server`).
Domain errors (`GdnError`) raised here become status codes in gdn_server.calls, for every RPC;
a DecodeStream answers a bad request in its place with the error's code (`error_response`).
The event loop never waits on the device: the scheduler answers each request through a callback
(a future's for a unary call, the stream's slot for a DecodeStream message).

Identity: where auth is on, the caller's identity owns the sessions it creates. Without auth
every session is open to every caller, and `--max-sessions-per-client` counts per peer
(connection) instead.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
from typing import Any, AsyncIterator, Callable

import grpc
import torch

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server._wire import CheckedStep, encode_reply
from gdn_server.config import ModelShape
from gdn_server.errors import FailedPrecondition, GdnError, InvalidArgument, ResourceExhausted
from gdn_server.lifecycle import commit_speculation, export_session, fork_session, import_session
from gdn_server.limits import (
    MAX_CHUNKS_READ_AFTER_ERROR, MAX_HELD_REQUEST_BYTES, MAX_STREAM_HELD_BYTES, MAX_STREAM_IN_FLIGHT,
)
from gdn_server.placement import Placement, Shard
from gdn_server.security import client_key, current_identity
from gdn_server.sessions import ProcessHomes
from gdn_server.shared_memory import SharedMemoryRegistry
from gdn_server.state_transfer import StateAssembler, encode_state
from gdn_server.scheduler import settle
from gdn_server.validation import PendingCheck, decode_work, parse_decode_request, step_limits
from gdn_server.work import DecodeResult, DecodeWork, DeviceSpan

log = logging.getLogger(__name__)



def decode_response(result: DecodeResult, output: Any = None) -> bytes:
    """The serialized DecodeResponse of a step's result: its reply as encoded; with `output` (a
    request's o_ref, as a view of its region), o is in the region and the reply's o has its dtype
    and shape only. A memoryview (host memory) gets o here; a DeviceSpan (memory a GPU writes in
    place: gdn_server.shared_memory) got it from the launch (gdn_server/backends/cuda.py), unless
    the answer is a retry's, from the kept output."""
    if output is None:
        return result.reply
    if type(output) is not DeviceSpan:  # a memoryview of host memory
        output[:] = result.out
    elif result.replayed:
        output.tensor().copy_(torch.frombuffer(result.out, dtype=torch.uint8))
    return encode_reply(b"", result.shape, result.positions, result.request_id)


async def _checked(pending: PendingCheck) -> DecodeWork:
    """The DecodeWork of a request whose inputs are checked on their GPU or copied out of it,
    polled once per turn of the event loop (a check takes tens of microseconds; other requests
    run meanwhile)."""
    try:
        await asyncio.sleep(0)  # the requests of this turn of the loop join the same check or copies
        while not pending.ready():
            await asyncio.sleep(0)
    except BaseException:  # the call went away: the check's buffers go back all the same
        pending.abandon()
        raise
    return pending.work()


def serialize_reply(reply: bytes | gdn_pb2.DecodeResponse) -> bytes:
    """The decode RPCs' response serializer: results come serialized, error replies as messages."""
    return reply if type(reply) is bytes else reply.SerializeToString()


def error_response(request_id: str, error: GdnError) -> gdn_pb2.DecodeResponse:
    return gdn_pb2.DecodeResponse(request_id=request_id, error_code=error.code.value[0], error_message=error.message)


class GdnDecodeServicer(gdn_pb2_grpc.GdnDecodeServicer):
    def __init__(self, shape: ModelShape, placement: Placement, backend_name: str,
                 homes: ProcessHomes | None = None) -> None:
        self.shape = shape
        self.homes = homes  # the host's other server processes, where there are several
        self.placement = placement
        self.backend_name = backend_name
        self.metrics = None  # gdn_server.metrics.Metrics, when --metrics-port is on
        self.held_bytes = 0  # input bytes of the decode requests being served (MAX_HELD_REQUEST_BYTES)
        # the callers' shared-memory regions (--allow-shared-memory); None: the server takes none
        self.shared_memory: SharedMemoryRegistry | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _hold(self, nbytes: int) -> None:
        """Counts a request's bytes as held until `_release`; refuses it beyond the budget (a lone
        request always goes: one request is bounded by the message size)."""
        if self.held_bytes and self.held_bytes + nbytes > MAX_HELD_REQUEST_BYTES:
            raise ResourceExhausted(
                f"the server holds {self.held_bytes >> 20} MiB of decode requests, its limit: retry later"
            )
        self.held_bytes += nbytes

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serves gdn.v1.GdnDecode on `server`: the generated handlers, with the decode RPCs'
        messages read by validation.parse_decode_request and their results sent as encoded."""
        handlers = _HandlerCapture()
        gdn_pb2_grpc.add_GdnDecodeServicer_to_server(self, handlers)
        methods = handlers.methods
        parse = functools.partial(parse_decode_request, limits=step_limits(self.shape))
        for name, factory in (("Decode", grpc.unary_unary_rpc_method_handler),
                              ("DecodeStream", grpc.stream_stream_rpc_method_handler)):
            methods[name] = factory(getattr(self, name), request_deserializer=parse, response_serializer=serialize_reply)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(handlers.service, methods),))
        server.add_registered_method_handlers(handlers.service, methods)

    def _decode_work(self, request: CheckedStep | gdn_pb2.DecodeRequest, identity: str | None,
                     owner_key: str) -> DecodeWork | PendingCheck:
        """Checks a request of the caller `identity` (`owner_key`: its client_key, which also owns
        its shared-memory regions). Raises GdnError for what validation finds; inputs in GPU memory
        are checked there while the loop serves other requests (a PendingCheck: `_checked`)."""
        regions = self.shared_memory
        resolve = regions.resolver(owner_key) if regions is not None else None
        return decode_work(request, self.shape, identity, owner_key, resolve)

    def _submit_decode(self, work: DecodeWork, done: Callable[[Any], None],
                       cancelled: Callable[[], bool]) -> tuple[int, Any]:
        """Counts a checked request's bytes as held (`_hold`) and queues it; `done` gets its
        DecodeResult or GdnError. Returns the bytes held, which the caller releases once the
        request is answered, and where its output goes (DecodeWork.output, for decode_response)."""
        shard = self.placement.shard_for(work.session_ids)
        nbytes = work.nbytes
        self._hold(nbytes)
        shard.scheduler.submit_decode(work, done, cancelled=cancelled)
        return nbytes, work.output

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self.metrics is not None:
            self.metrics.count_decode(method, code)

    # -- decode steps -----------------------------------------------------------------------
    async def Decode(self, request, context):
        fut = asyncio.get_running_loop().create_future()
        code = grpc.StatusCode.CANCELLED  # unless it ends otherwise (a cancelled call cancels `fut`)
        nbytes = 0
        try:
            identity = current_identity()
            work = self._decode_work(request, identity, client_key(identity, context))
            if type(work) is PendingCheck:
                work = await _checked(work)
            nbytes, output = self._submit_decode(work, settle(fut), fut.cancelled)
            result = await fut
            code = grpc.StatusCode.OK
        except GdnError as e:  # its status is set by gdn_server.calls
            code = e.code
            raise
        finally:
            self._release(nbytes)
            self._count("Decode", code)
        return decode_response(result, output)

    async def DecodeStream(self, request_iterator: AsyncIterator[gdn_pb2.DecodeRequest], context) -> None:
        # A reader task checks and queues requests ahead of their replies (bounded: see
        # MAX_STREAM_IN_FLIGHT), so one stream is pipelined; this coroutine answers them in request
        # order. Per message: a slot the scheduler answers into, and one wake-up of this coroutine
        # when the oldest slot is answered. Replies go out with context.write (grpc.aio's
        # reader/writer API): an async generator would be resumed by grpc for every reply.
        stream = _ReplyStream(asyncio.get_running_loop())
        identity = current_identity()  # one caller per call: read once, not per message
        owner_key = client_key(identity, context)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    answer = _Answer(stream, request.request_id, 0)
                    stream.answers.append(answer)
                    try:
                        work = self._decode_work(request, identity, owner_key)
                        if type(work) is PendingCheck:
                            work = await _checked(work)
                        answer.nbytes, answer.output = self._submit_decode(work, answer, stream.is_closed)
                        stream.held_bytes += answer.nbytes
                    except GdnError as e:
                        answer(e)
                    except BaseException:
                        stream.answers.pop()  # never to be answered: the writer must not wait for it
                        stream.held_bytes -= answer.nbytes
                        self._release(answer.nbytes)
                        raise
                    if stream.full():
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
                    stream.held_bytes -= answer.nbytes
                    self._release(answer.nbytes)
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
            for answer in stream.answers:  # never to be written: their bytes are not held any more
                self._release(answer.nbytes)
            stream.answers.clear()

    def _stream_reply(self, answer: "_Answer") -> gdn_pb2.DecodeResponse:
        result = answer.result
        if isinstance(result, GdnError):
            self._count("DecodeStream", result.code)
            return error_response(answer.request_id, result)
        if isinstance(result, BaseException):
            raise result
        self._count("DecodeStream", grpc.StatusCode.OK)
        return decode_response(result, answer.output)

    # -- sessions and the rest -------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        s = self.shape
        return gdn_pb2.ModelInfo(
            num_layers=s.num_layers,
            num_q_heads=s.num_q_heads,
            num_v_heads=s.num_v_heads,
            head_dim_k=s.head_dim_k,
            head_dim_v=s.head_dim_v,
            max_tokens_per_step=s.max_tokens_per_step,
            max_speculative_tokens=s.max_speculative_tokens,
            max_sessions=self.placement.capacity,
            sessions_in_use=self.placement.in_use,
            backend=self.backend_name,
            state_dtype=s.state_dtype,
            scale=self.placement.shards[0].backend.scale,
            devices=[
                gdn_pb2.DeviceInfo(
                    index=shard.index, name=shard.backend.device_name, max_sessions=shard.sessions.capacity,
                    sessions_in_use=len(shard.sessions),
                )
                for shard in self.placement
            ],
            process_ports=self.homes.ports if self.homes is not None else (),
            process_index=self.homes.index if self.homes is not None else 0,
            shared_memory=self.shared_memory is not None,
        )

    async def CreateSession(self, request, context):
        identity = current_identity()
        shard = self.placement.place(request.colocate_with or None, identity)
        session = shard.sessions.create(owner=identity, quota_key=client_key(identity, context))
        return gdn_pb2.CreateSessionResponse(session_id=session.id)

    async def CloseSession(self, request, context):
        sid = request.session_id
        identity = current_identity()

        def close(shard: Shard) -> None:  # runs after every earlier step of this session
            shard.sessions.get(sid).check_owner(identity)
            session = shard.sessions.remove(sid)
            shard.backend.reset_session(session.slot)  # a free slot always holds a zero state
            shard.sessions.free_slot(session.slot)

        shard = self.placement.shard_of(sid)
        await shard.scheduler.control(lambda: close(shard))
        return gdn_pb2.CloseSessionResponse()

    async def Commit(self, request, context):
        identity = current_identity()
        # after the session's earlier steps (the speculative one included) have run on the device:
        # bookkeeping of the session's rings, so other clients' launches need not drain first
        shard = self.placement.shard_of(request.session_id)
        positions, layers = await shard.scheduler.control(
            lambda: commit_speculation(shard.sessions, request.session_id, int(request.accepted), identity),
            session_id=request.session_id,
        )
        return gdn_pb2.CommitResponse(positions=positions, committed_layers=layers)

    async def ForkSession(self, request, context):
        identity = current_identity()  # read here: the lambda runs later, outside this call's context
        # after every earlier step of the source: the copy sees all of them; same device
        shard = self.placement.shard_of(request.session_id)
        child = await shard.scheduler.control(
            lambda: fork_session(
                shard.sessions, shard.backend, request.session_id, identity, client_key(identity, context)
            ),
        )
        return gdn_pb2.CreateSessionResponse(session_id=child.id)

    async def ExportState(self, request, context):
        identity = current_identity()
        shard = self.placement.shard_of(request.session_id)
        state = await shard.scheduler.control(
            lambda: export_session(shard.sessions, shard.backend, request.session_id, identity)
        )
        # checksum and chunking off the event loop (tens of MiB for a large model)
        chunks = await asyncio.get_running_loop().run_in_executor(None, lambda: list(encode_state(state)))
        for chunk in chunks:
            yield chunk

    async def ImportState(self, request_iterator, context):
        assembler = StateAssembler(self.shape)
        identity = current_identity()
        refused: GdnError | None = None
        unread = MAX_CHUNKS_READ_AFTER_ERROR
        async for chunk in request_iterator:
            if refused is None:
                try:
                    assembler.add(chunk)
                except GdnError as e:
                    refused = e
                continue
            # Read on a little before answering: ending a client stream while the caller is still
            # writing makes some gRPC clients (grpc.aio among them) report
            # INTERNAL instead of our status.
            unread -= 1
            if unread == 0:
                break
        if refused is not None:
            raise refused
        state = assembler.finish()  # the whole stream checks out before anything is created
        shard = self.placement.place()
        session = await shard.scheduler.control(
            lambda: import_session(
                shard.sessions, shard.backend, state, owner=identity, quota_key=client_key(identity, context)
            ),
        )
        return gdn_pb2.CreateSessionResponse(session_id=session.id)

    # -- shared memory (gdn_server.shared_memory) ----------------------------------------------
    async def RegisterSharedMemory(self, request, context):
        regions = self._regions()
        owner = client_key(current_identity(), context)
        kind = request.WhichOneof("region")
        if kind == "system":
            regions.register(owner, request.name, request.byte_size,
                             system=(request.system.key, request.system.offset))
        elif kind == "cuda":
            regions.register(owner, request.name, request.byte_size,
                             cuda=(request.cuda.ipc_handle, request.cuda.device))
        else:
            raise InvalidArgument("a region is system or cuda shared memory: set one of them")
        return gdn_pb2.RegisterSharedMemoryResponse()

    async def UnregisterSharedMemory(self, request, context):
        self._regions().unregister(client_key(current_identity(), context), request.name)
        return gdn_pb2.UnregisterSharedMemoryResponse()

    def _regions(self) -> SharedMemoryRegistry:
        if self.shared_memory is None:
            raise FailedPrecondition("this server does not accept shared memory (gdn-server --allow-shared-memory)")
        return self.shared_memory

    async def GetStats(self, request, context):
        stats = [shard.scheduler.stats for shard in self.placement]  # summed over devices
        launches = sum(st.launches for st in stats)
        rows = sum(st.rows_launched for st in stats)
        return gdn_pb2.Stats(
            launches=launches,
            rows_launched=rows,
            requests=sum(st.requests for st in stats),
            batches=sum(st.batches for st in stats),
            mean_rows_per_launch=rows / launches if launches else 0.0,
            sessions_in_use=self.placement.in_use,
            max_sessions=self.placement.capacity,
            backend=self.backend_name,
            device_seconds=sum(st.device_s for st in stats),
            queue_wait_seconds=sum(st.queue_wait_s for st in stats),
        )


class _HandlerCapture:
    """Stands in for a server to the generated add_GdnDecodeServicer_to_server: keeps its handlers."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, methods: dict) -> None:
        self.service, self.methods = service, dict(methods)


_PENDING = object()  # an _Answer's result before the answer


class _Answer:
    """One request of a DecodeStream: called with its DecodeResult or error (the scheduler's
    `done`, on the loop's thread), it keeps the first answer and wakes the stream's writer when the
    oldest request has its answer."""

    __slots__ = ("stream", "request_id", "result", "nbytes", "output")

    def __init__(self, stream: "_ReplyStream", request_id: str, nbytes: int) -> None:
        self.stream = stream
        self.request_id = request_id
        self.nbytes = nbytes  # the request's input bytes, held until it is answered
        self.output: Any = None  # where its o goes (DecodeWork.output): None, in the reply
        self.result: Any = _PENDING

    def __call__(self, result: Any) -> None:  # on the loop's thread, where rounds answer
        stream = self.stream
        if self.result is _PENDING:
            self.result = result
            answers = stream.answers
            if answers and answers[0] is self:
                stream.wake_writer()


class _ReplyStream:
    """A DecodeStream's requests in flight, oldest first, and the reader's and writer's waits."""

    __slots__ = ("loop", "answers", "held_bytes", "ended", "error", "closed", "_writer_waits", "_reader_waits")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.answers: collections.deque[_Answer] = collections.deque()
        self.held_bytes = 0  # input bytes of the requests in flight
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

    def full(self) -> bool:
        """Whether the reader must wait before it reads another request."""
        return len(self.answers) >= MAX_STREAM_IN_FLIGHT or self.held_bytes >= MAX_STREAM_HELD_BYTES

    def room(self) -> asyncio.Future:
        """For the reader: resolves once the stream is no longer `full`."""
        fut = self._reader_waits = self.loop.create_future()
        return fut

    def made_room(self) -> None:
        fut = self._reader_waits
        if fut is not None and not self.full():
            self._reader_waits = None
            if not fut.done():
                fut.set_result(None)
