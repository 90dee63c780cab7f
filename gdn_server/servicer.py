"""The gRPC servicer: protobuf in -> validated work -> scheduler -> protobuf out.

It stays thin. Decode and DecodeStream come from gdn_server.decode_rpcs (a front-end worker
serves them too); this class runs their requests on this process's schedulers and adds the
session and control RPCs. Domain errors (`GdnError`) become status codes here and only here. The
event loop never waits on the device: the scheduler answers each request through a callback (a
future's for a unary call, the stream's slot for a DecodeStream message).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_server.config import ModelShape
from gdn_server.decode_rpcs import DecodeRpcs, settle_on
from gdn_server.errors import GdnError
from gdn_server.lifecycle import commit_speculation, export_session, fork_session, import_session
from gdn_server.placement import Placement, Shard
from gdn_server.security import current_identity
from gdn_server.state_transfer import StateAssembler, encode_state

log = logging.getLogger(__name__)

MAX_CHUNKS_READ_AFTER_ERROR = 16  # ImportState: chunks drained after a bad one, before the error reply


class GdnDecodeServicer(DecodeRpcs, gdn_pb2_grpc.GdnDecodeServicer):
    defer_finite_check = True  # its schedulers' backends are in this process

    def __init__(self, shape: ModelShape, placement: Placement, backend_name: str) -> None:
        self.shape = shape
        self.placement = placement
        self.backend_name = backend_name
        self.metrics = None  # gdn_server.metrics.RpcMetrics, when --metrics-port is on

    # -- helpers ----------------------------------------------------------------------------
    async def _control(self, shard: Shard, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on `shard`'s scheduler thread between batches; returns its result."""
        fut, done = settle_on(asyncio.get_running_loop())
        shard.scheduler.submit_control(fn, done)
        return await fut

    def _start_decode(self, request: gdn_pb2.DecodeRequest) -> asyncio.Future:
        # A cancelled future (client gone, deadline passed) is dropped before the device.
        fut, done = settle_on(asyncio.get_running_loop())
        self._submit_decode(request, done, fut.cancelled)
        return fut

    def _submit_decode(self, request: gdn_pb2.DecodeRequest, done: Callable[[Any], None],
                       cancelled: Callable[[], bool]) -> None:
        work = self._validated(request)
        shard = self.placement.shard_for(work.session_ids)
        shard.scheduler.submit_decode(work, done, cancelled=cancelled)

    # -- RPCs -------------------------------------------------------------------------------
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
            state_dtype="bfloat16",
            scale=self.placement.shards[0].backend.scale,
            devices=[
                gdn_pb2.DeviceInfo(
                    index=shard.index, name=shard.backend.device_name, max_sessions=shard.sessions.capacity,
                    sessions_in_use=len(shard.sessions),
                )
                for shard in self.placement
            ],
        )

    async def CreateSession(self, request, context):
        try:
            shard = self.placement.place(request.colocate_with or None)
            session = shard.sessions.create(owner=current_identity())
        except GdnError as e:
            await context.abort(e.code, e.message)
        return gdn_pb2.CreateSessionResponse(session_id=session.id)

    async def CloseSession(self, request, context):
        sid = request.session_id
        identity = current_identity()

        def close(shard: Shard) -> None:  # runs after every earlier step of this session
            shard.sessions.get(sid).check_owner(identity)
            session = shard.sessions.remove(sid)
            shard.backend.reset_session(session.slot)  # a free slot always holds a zero state
            shard.sessions.free_slot(session.slot)

        try:
            shard = self.placement.shard_of(sid)
            await self._control(shard, lambda: close(shard))
        except GdnError as e:
            await context.abort(e.code, e.message)
        return gdn_pb2.CloseSessionResponse()

    async def Commit(self, request, context):
        identity = current_identity()
        try:  # after the session's earlier steps (the speculative one included) have run
            shard = self.placement.shard_of(request.session_id)
            positions, layers = await self._control(
                shard,
                lambda: commit_speculation(
                    shard.sessions, shard.backend, request.session_id, int(request.accepted), identity
                ),
            )
        except GdnError as e:
            await context.abort(e.code, e.message)
        return gdn_pb2.CommitResponse(positions=positions, committed_layers=layers)

    async def ForkSession(self, request, context):
        identity = current_identity()  # read here: the lambda runs on the scheduler thread
        try:  # after every earlier step of the source: the copy sees all of them; same device
            shard = self.placement.shard_of(request.session_id)
            child = await self._control(
                shard, lambda: fork_session(shard.sessions, shard.backend, request.session_id, identity)
            )
        except GdnError as e:
            await context.abort(e.code, e.message)
        return gdn_pb2.CreateSessionResponse(session_id=child.id)

    async def ExportState(self, request, context):
        identity = current_identity()
        try:
            shard = self.placement.shard_of(request.session_id)
            state = await self._control(
                shard, lambda: export_session(shard.sessions, shard.backend, request.session_id, identity)
            )
        except GdnError as e:
            await context.abort(e.code, e.message)
        # checksum and chunking off the event loop (tens of MiB for a large model)
        chunks = await asyncio.get_running_loop().run_in_executor(None, lambda: list(encode_state(state)))
        for chunk in chunks:
            yield chunk

    async def ImportState(self, request_iterator, context):
        assembler = StateAssembler(self.shape)
        identity = current_identity()
        try:
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
                # writing makes some gRPC clients (grpc.aio, e.g. a --frontends worker) report
                # INTERNAL instead of our status.
                unread -= 1
                if unread == 0:
                    break
            if refused is not None:
                raise refused
            state = assembler.finish()  # the whole stream checks out before anything is created
            shard = self.placement.place()
            session = await self._control(
                shard, lambda: import_session(shard.sessions, shard.backend, state, owner=identity)
            )
        except GdnError as e:
            await context.abort(e.code, e.message)
        return gdn_pb2.CreateSessionResponse(session_id=session.id)

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

