"""Every operation of the client as a plan of RPCs: request building, routing and reply handling
in one place, for the blocking and the asyncio client alike.

An operation is a generator: it yields a `Call` (which method, which request, which server
process, whether to retry) and is sent the reply, or thrown the `GdnError` the call ended with,
until it returns its result. `Client` runs operations with blocking stubs, `AsyncClient` with
awaited ones (`drive` and `drive_async`): that loop and the RPCs' transport are all either client
adds. Routing is gdn_client._routing's; positions and steps are gdn_client._steps'.

>>> op = stats()
>>> call = next(op)
>>> call.method, call.process, call.retry
('GetStats', None, True)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Iterable, TypeVar

from gdn_client._errors import GdnError, NotFoundError, ResourceExhaustedError
from gdn_client._info import ModelInfo, Stats, model_info_from_proto, stats_from_proto
from gdn_client._routing import ProcessRoutes
from gdn_client._sessions_ext import ExportedState
from gdn_client._shared_memory import Region, already_registered, missing_region
from gdn_client._steps import PreparedStep, SessionCursor
from gdn_client.proto.gdn.v1 import gdn_pb2

__all__ = ["Call", "Op", "drive", "drive_async"]

logger = logging.getLogger("gdn_client")
_R = TypeVar("_R")

UNARY, STREAM_IN, STREAM_OUT = "unary", "stream_in", "stream_out"


@dataclass(frozen=True)
class Call:
    """One RPC an operation asks for: `method` of gdn.v1.GdnDecode with `request` (for a
    STREAM_IN call, the list of messages), to server process `process` (None: the target);
    UNAVAILABLE and DEADLINE_EXCEEDED are retried with backoff when `retry` is set. A STREAM_OUT
    call is answered with the list of its replies."""

    method: str
    request: Any
    process: int | None = None
    retry: bool = False
    kind: str = UNARY


Op = Generator[Call, Any, _R]


def drive(op: Op[_R], perform: Callable[[Call], Any]) -> _R:
    """Runs `op`, each of its calls by `perform` (blocking); returns what `op` returns."""
    try:
        call = next(op)
        while True:
            try:
                reply = perform(call)
            except BaseException as exc:  # the op decides: roll back, try elsewhere, or raise
                call = op.throw(exc)
            else:
                call = op.send(reply)
    except StopIteration as done:
        return done.value


async def drive_async(op: Op[_R], perform: Callable[[Call], Awaitable[Any]]) -> _R:
    """`drive` with an awaited `perform` (a cancellation is thrown into the op like an error)."""
    try:
        call = next(op)
        while True:
            try:
                reply = await perform(call)
            except BaseException as exc:
                call = op.throw(exc)
            else:
                call = op.send(reply)
    except StopIteration as done:
        return done.value


# -- the server's processes (gdn-server --processes) ------------------------------------------------

def learn_processes(routes: ProcessRoutes) -> Op[None]:
    """Asks the target for the server's processes, unless they are known."""
    if not routes.known:
        routes.learn((yield Call("GetModelInfo", gdn_pb2.GetModelInfoRequest(), retry=True)))


def home(routes: ProcessRoutes, session_ids: Iterable[str]) -> Op[int | None]:
    """The process these sessions live in (FailedPreconditionError if several), learned first."""
    process = routes.home(list(session_ids))
    if process is not None:
        yield from learn_processes(routes)
    return process


def on_a_process_with_room(routes: ProcessRoutes, method: str, request: Any, kind: str = UNARY) -> Op[Any]:
    """`method` on the server's processes in new-session order, until one is not full."""
    yield from learn_processes(routes)
    full = None
    for process in routes.new_session_order():
        try:
            return (yield Call(method, request, process, kind=kind))
        except ResourceExhaustedError as err:
            full = err
    raise routes.all_full(full)


# -- the server ---------------------------------------------------------------------------------------

def model_info(routes: ProcessRoutes) -> Op[ModelInfo]:
    """The target's ModelInfo, the host's capacity summed over the processes that answer."""
    request = gdn_pb2.GetModelInfoRequest()
    target_info = yield Call("GetModelInfo", request, retry=True)
    routes.learn(target_info)
    others = []
    for process in routes.other_processes():
        try:
            others.append((yield Call("GetModelInfo", request, process, retry=True)))
        except GdnError as err:
            logger.warning("server process %d left out of model_info: %s", process, err)
    return model_info_from_proto(target_info, *others)


def stats() -> Op[Stats]:
    return stats_from_proto((yield Call("GetStats", gdn_pb2.GetStatsRequest(), retry=True)))


# -- sessions -----------------------------------------------------------------------------------------

def create_session(routes: ProcessRoutes, colocate_with: str) -> Op[SessionCursor]:
    """A new session (not retried: a lost reply would leak a slot), beside `colocate_with` if given."""
    if colocate_with:
        process = yield from home(routes, [colocate_with])
        request = gdn_pb2.CreateSessionRequest(colocate_with=colocate_with)
        reply = yield Call("CreateSession", request, process)
    else:
        reply = yield from on_a_process_with_room(routes, "CreateSession", gdn_pb2.CreateSessionRequest())
    return SessionCursor(reply.session_id)


def close_session(routes: ProcessRoutes, session_id: str, retry: bool) -> Op[None]:
    process = yield from home(routes, [session_id])
    yield Call("CloseSession", gdn_pb2.CloseSessionRequest(session_id=session_id), process, retry=retry)


def close_cursor(routes: ProcessRoutes, cursor: SessionCursor) -> Op[None]:
    """Closes a session object's session once; a retried close whose first try went through
    answers NOT_FOUND, which is success here."""
    if cursor.closed:
        return
    cursor.closed = True
    try:
        yield from close_session(routes, cursor.session_id, retry=True)
    except NotFoundError:
        pass


def commit(routes: ProcessRoutes, cursor: SessionCursor, accepted: int) -> Op[dict[int, int]]:
    process = yield from home(routes, [cursor.session_id])
    request = gdn_pb2.CommitRequest(session_id=cursor.session_id, accepted=accepted)
    reply = yield Call("Commit", request, process, retry=True)
    cursor._adopt(list(reply.positions))
    return cursor.positions()


def fork(routes: ProcessRoutes, cursor: SessionCursor) -> Op[SessionCursor]:
    """A copy of the session (not retried: a lost reply would leak a slot)."""
    cursor._require_settled("fork()")
    process = yield from home(routes, [cursor.session_id])
    reply = yield Call("ForkSession", gdn_pb2.ForkSessionRequest(session_id=cursor.session_id), process)
    child = SessionCursor(reply.session_id)
    child._adopt(cursor.positions())
    return child


def export_state(routes: ProcessRoutes, cursor: SessionCursor) -> Op[ExportedState]:
    cursor._require_settled("export()")
    process = yield from home(routes, [cursor.session_id])
    chunks = yield Call("ExportState", gdn_pb2.ExportStateRequest(session_id=cursor.session_id), process,
                        kind=STREAM_OUT)
    return ExportedState.from_chunks(chunks)


def import_state(routes: ProcessRoutes, exported: ExportedState) -> Op[SessionCursor]:
    """A session holding `exported` (not retried: a lost reply would leak a slot)."""
    reply = yield from on_a_process_with_room(routes, "ImportState", list(exported.chunks()), kind=STREAM_IN)
    cursor = SessionCursor(reply.session_id)
    cursor._adopt(list(exported.header.positions))
    return cursor


# -- decode steps and shared memory ---------------------------------------------------------------

def register(region: Region, process: int | None) -> Op[None]:
    """Registers `region` with `process`; a region the server still holds under its name counts."""
    try:
        yield Call("RegisterSharedMemory", region.register_request(), process, retry=True)
    except GdnError as err:
        if not already_registered(err):
            raise
    region.registered_on.add(process)


def unregister(region: Region, process: int | None) -> Op[None]:
    region.registered_on.discard(process)
    yield Call("UnregisterSharedMemory", gdn_pb2.UnregisterSharedMemoryRequest(name=region.name), process,
               retry=True)


def registered(regions: Iterable[Region], process: int | None) -> Op[None]:
    """Registers those of `regions` that `process` does not have yet."""
    for region in regions:
        if process not in region.registered_on:
            yield from register(region, process)


def run_step(routes: ProcessRoutes, step: PreparedStep) -> Op[Any]:
    """Sends a prepared step to its sessions' process (registering its regions there first) and
    returns its output. A region the server dropped (NOT_FOUND for it) is registered again and
    the step resent once: nothing was applied. Failures roll the step back, or leave it in doubt
    where it may have been applied."""
    try:
        process = yield from home(routes, step.request.session_ids)
        yield from registered(step.regions, process)
    except BaseException as err:  # not sent
        step.fail(err if isinstance(err, GdnError) else GdnError("cancelled"))
        raise
    for attempt in range(2):
        try:
            reply = yield Call("Decode", step.request, process, retry=True)
            break
        except GdnError as err:
            if attempt == 0 and step.regions and missing_region(err):
                for region in step.regions:
                    region.registered_on.discard(process)
                try:
                    yield from registered(step.regions, process)
                    continue
                except GdnError as failed:
                    err = failed
            step.fail(err, in_doubt=err.retryable)
            raise err from None
        except BaseException:  # cancelled while the step was on its way
            step.fail(GdnError("cancelled"), in_doubt=True)
            raise
    return step.complete(reply)


def recover(routes: ProcessRoutes, cursor: SessionCursor) -> Op[list[Any]]:
    """Resends the session's steps whose outcome stayed unknown; their outputs."""
    outs = []
    for step in cursor.in_doubt():
        outs.append((yield from run_step(routes, step)))
    return outs
