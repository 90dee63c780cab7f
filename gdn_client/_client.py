"""The synchronous client: `Client` and its `Session`."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import grpc
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
from gdn_client.proto.gdn.v1 import gdn_pb2

if TYPE_CHECKING:
    from gdn_client._stream import DecodeStream

__all__ = ["Client", "Session"]

logger = logging.getLogger("gdn_client")
_R = TypeVar("_R")


def make_channel(target: str, options: ClientOptions) -> grpc.Channel:
    creds = options.channel_credentials()
    args = options.channel_options()
    channel = grpc.secure_channel(target, creds, args) if creds else grpc.insecure_channel(target, args)
    if options.interceptors:
        channel = grpc.intercept_channel(channel, *options.interceptors)
    return channel


class Client:
    """A blocking client of a gdn-serve server.

    >>> from gdn_client import Client
    >>> with Client("127.0.0.1:50051") as client:                     # doctest: +SKIP
    ...     info = client.model_info()
    ...     with client.session() as s:
    ...         T, H, HV, K = 1, info.num_q_heads, info.num_v_heads, info.head_dim_k
    ...         q, k = torch.randn(T, H, K), torch.randn(T, H, K)
    ...         v, a, b = torch.randn(T, HV, K), torch.randn(T, HV), torch.randn(T, HV)
    ...         o = s.decode(0, q, k, v, a, b)                        # bf16 [T, HV, V]

    ``options`` sets deadlines, retries, TLS and a bearer token (see `ClientOptions`).

    A host that runs several server processes (``gdn-server --processes K``) is reached through
    its one address as well: the client learns the processes' ports from GetModelInfo once (on
    the first session call), opens a channel to each on the host of ``target`` (same options),
    creates new sessions round robin over the processes, skipping full ones, and sends every call
    of a session to the process it lives in (its id names it). Those ports must be reachable on
    that host as the server reports them.
    """

    def __init__(self, target: str, options: ClientOptions | None = None) -> None:
        self.target = target
        self.options = options or ClientOptions()
        self._routes: ProcessRoutes[grpc.Channel] = ProcessRoutes(target, lambda t: make_channel(t, self.options))
        self._channel = self._routes.channel  # the target's
        self._metadata = self.options.call_metadata()

    # -- plumbing ------------------------------------------------------------------------------

    def _call(self, method: Callable[..., _R], request: Any, *, retry: bool = False) -> _R:
        """Calls a unary method; retries UNAVAILABLE/DEADLINE_EXCEEDED when ``retry`` is set."""
        delays = self.options.backoff_delays() if retry else iter(())
        while True:
            try:
                return method(request, timeout=self.options.timeout, metadata=self._metadata)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            delay = next(delays, None) if err.retryable else None
            if delay is None:
                raise err from None
            logger.info("%s; retrying in %.3f s", err, delay)
            time.sleep(delay)

    def _learn_processes(self) -> None:
        """Asks the target for the server's processes, unless they are known."""
        if not self._routes.known:
            self._routes.learn(self._call(self._routes.stub.GetModelInfo, gdn_pb2.GetModelInfoRequest(), retry=True))

    def _stub_of(self, process: int | None) -> Any:
        """The stub of server process `process` (None: the target)."""
        if process is not None:
            self._learn_processes()
        return self._routes.stub_of(process)

    def _stub_for(self, *session_ids: str) -> Any:
        """The stub of the process these sessions live in; FailedPreconditionError if they live
        in different ones."""
        return self._stub_of(self._routes.home(session_ids))

    def _on_a_process_with_room(self, send: Callable[[Any], _R]) -> _R:
        """`send(stub)` to the server's processes in new-session order, until one is not full."""
        self._learn_processes()
        order = self._routes.new_session_order()
        for process in order:
            try:
                return send(self._routes.stub_of(process))
            except ResourceExhaustedError as err:
                full = err
        raise self._routes.all_full(full)

    def _run_step(self, step: PreparedStep) -> torch.Tensor:
        try:
            stub = self._stub_for(*step.request.session_ids)
        except GdnError as err:
            step.fail(err)  # not sent
            raise
        try:
            reply = self._call(stub.Decode, step.request, retry=True)
        except GdnError as err:
            step.fail(err, in_doubt=err.retryable)
            raise
        return step.complete(reply)

    def _close(self, session_id: str, *, retry: bool) -> None:
        request = gdn_pb2.CloseSessionRequest(session_id=session_id)
        self._call(self._stub_for(session_id).CloseSession, request, retry=retry)

    # -- public API ----------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        """The served model's shape and capacity (fresh from the server every call).

        On a host of several server processes, ``max_sessions``, ``sessions_in_use`` and
        ``devices`` are the whole host's (summed over the processes that answer; one that does
        not, e.g. while it restarts, is left out with a warning); the rest is the target's.

        >>> with Client("127.0.0.1:50051") as client:                 # doctest: +SKIP
        ...     info = client.model_info()
        ...     free = info.max_sessions - info.sessions_in_use
        """
        request = gdn_pb2.GetModelInfoRequest()
        target_info = self._call(self._routes.stub.GetModelInfo, request, retry=True)
        self._routes.learn(target_info)
        others = []
        for process in self._routes.other_processes():
            try:
                others.append(self._call(self._routes.stub_of(process).GetModelInfo, request, retry=True))
            except GdnError as err:
                logger.warning("server process %d left out of model_info: %s", process, err)
        return model_info_from_proto(target_info, *others)

    def stats(self) -> Stats:
        """The target server process's counters (launches, rows per launch, requests); on a host of
        several processes, those of the one at ``target`` only."""
        return stats_from_proto(self._call(self._routes.stub.GetStats, gdn_pb2.GetStatsRequest(), retry=True))

    def create_session(self, colocate_with: "Session | str | None" = None) -> "Session":
        """Creates a session (its state starts at zero); close it, or use it as a context manager.

        ``colocate_with`` puts it in the same server process and on the same device as that
        session, so both can go in one `decode_batch` request. Not retried: a lost reply would
        leak a session slot on the server.

        >>> with Client("127.0.0.1:50051") as client:                 # doctest: +SKIP
        ...     s = client.create_session()
        ...     buddy = client.create_session(colocate_with=s)
        ...     o = client.decode_batch(0, [s, buddy], q, k, v, a, b)   # [2, T, ...] inputs
        """
        buddy = _session_id(colocate_with)
        if buddy:
            request = gdn_pb2.CreateSessionRequest(colocate_with=buddy)
            reply = self._call(self._stub_for(buddy).CreateSession, request)
        else:
            reply = self._on_a_process_with_room(
                lambda stub: self._call(stub.CreateSession, gdn_pb2.CreateSessionRequest())
            )
        return Session(self, reply.session_id)

    def session(self) -> "Session":
        """Same as `create_session`; reads well as ``with client.session() as s:``."""
        return self.create_session()

    def close_session(self, session: "Session | str") -> None:
        """Closes a session by object or id; raises NotFoundError if the server does not know it."""
        if isinstance(session, Session):
            session.close()
            return
        self._close(session, retry=False)

    def decode_batch(
        self,
        layer: int,
        sessions: Sequence["Session"],
        q: TensorLike,
        k: TensorLike,
        v: TensorLike,
        a: TensorLike,
        b: TensorLike,
    ) -> torch.Tensor:
        """One step at ``layer`` for B sessions at once, atomically.

        q, k: [B, T, H, K]; v: [B, T, HV, V]; a, b: [B, T, HV]. Returns bf16 o [B, T, HV, V].
        The sessions must live in one server process and on one device: create them with
        ``create_session(colocate_with=...)``; FailedPreconditionError otherwise.
        """
        step = prepare_step(layer, [s._cursor for s in sessions], q, k, v, a, b, single=False)
        return self._run_step(step)

    def import_state(self, exported: ExportedState) -> "Session":
        """Creates a session on this server holding an exported state (see `Session.export`), which
        continues exactly as the exported session would: migration between replicas.

        Not retried: a lost reply would leak a session slot on the server.

        >>> with Client("gdn-0:50051") as here, Client("gdn-1:50051") as there:  # doctest: +SKIP
        ...     s = here.create_session()
        ...     o = s.decode(0, q, k, v, a, b)
        ...     moved = there.import_state(s.export())                   # continues where s is
        ...     s.close()
        """
        reply = self._on_a_process_with_room(lambda stub: self._call_stream_in(stub.ImportState, exported.chunks()))
        session = Session(self, reply.session_id)
        session._cursor._adopt(list(exported.header.positions))
        return session

    def _call_stream_in(self, method: Callable[..., _R], requests: Any) -> _R:
        try:
            return method(requests, timeout=self.options.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def stream(self) -> "DecodeStream":
        """Opens a pipelined DecodeStream; see `DecodeStream`."""
        from gdn_client._stream import DecodeStream

        return DecodeStream(self)

    def close(self) -> None:
        """Closes the channels. Sessions stay open on the server until closed."""
        for channel in self._routes.channels():
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.target!r})"


def _session_id(session: "Session | str | None") -> str:
    if session is None:
        return ""
    return session if isinstance(session, str) else session.id


class Session:
    """A sequence's recurrent state on the server, one per layer, and its positions.

    Every step sends the session's position at that layer, so a step lost in transit is resent
    safely and never applied twice. Use it as a context manager to close it on exit.
    """

    def __init__(self, client: Client, session_id: str) -> None:
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
        """Tokens taken so far per layer (as far as this client has sent them)."""
        return self._cursor.positions()

    def decode(
        self, layer: int, q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike, b: TensorLike,
        *, speculative: bool = False,
    ) -> torch.Tensor:
        """One step of T tokens at ``layer``.

        q, k: [T, H, K]; v: [T, HV, V]; a, b: [T, HV] (or the batched form with B = 1), torch
        bf16/f16/f32 or numpy f16/f32. Returns bf16 o [T, HV, V]. ``speculative=True`` makes it a
        draft step (T up to ModelInfo.max_speculative_tokens) that `commit` settles; prefer
        `speculate()`.
        """
        step = prepare_step(layer, [self._cursor], q, k, v, a, b, single=True, speculative=speculative)
        return self._client._run_step(step)

    def commit(self, accepted: int) -> dict[int, int]:
        """Keeps the first ``accepted`` tokens of every open speculative step (one per layer) and
        drops the rest; returns the positions per layer afterwards. Safe to retry."""
        reply = self._client._call(
            self._client._stub_for(self.id).Commit, gdn_pb2.CommitRequest(session_id=self.id, accepted=accepted),
            retry=True,
        )
        self._cursor._adopt(list(reply.positions))
        return self.positions

    def speculate(self) -> "Speculation":
        """A draft-and-verify step over every layer, settled by `Speculation.commit`.

        >>> with session.speculate() as spec:                            # doctest: +SKIP
        ...     for layer in range(info.num_layers):                     # T draft tokens per layer
        ...         o = spec.decode(layer, q[layer], k[layer], v[layer], a[layer], b[layer])
        ...     accepted = verify(o)                                     # tokens the target model keeps
        ...     spec.commit(accepted)                                    # states rewound to `accepted`

        Leaving the block without `commit` (an exception, say) commits 0 tokens: the session is as
        before the draft.
        """
        return Speculation(self)

    def fork(self) -> "Session":
        """A new session whose states and positions are copies of this one's (prefix sharing, beam
        search). Not retried: a lost reply would leak a session slot on the server."""
        self._cursor._require_settled("fork()")
        request = gdn_pb2.ForkSessionRequest(session_id=self.id)
        reply = self._client._call(self._client._stub_for(self.id).ForkSession, request)
        child = Session(self._client, reply.session_id)
        child._cursor._adopt(self._cursor.positions())
        return child

    def export(self) -> ExportedState:
        """This session's state and positions, to move it to another server with `Client.import_state`."""
        self._cursor._require_settled("export()")
        try:
            chunks = self._client._stub_for(self.id).ExportState(
                gdn_pb2.ExportStateRequest(session_id=self.id), timeout=self._client.options.timeout,
                metadata=self._client._metadata,
            )
            return ExportedState.from_chunks(chunks)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def recover(self) -> list[torch.Tensor]:
        """Resends steps whose outcome stayed unknown after the last retry; returns their outputs.

        Resending is safe (same positions): the server applies a step at most once.
        """
        outs = []
        for step in self._cursor.in_doubt():
            outs.append(self._client._run_step(step))
        return outs

    def close(self) -> None:
        """Closes the session on the server; closing twice is a no-op."""
        if self._cursor.closed:
            return
        self._cursor.closed = True
        try:
            self._client._close(self.id, retry=True)
        except NotFoundError:
            pass  # a retried close whose first attempt went through

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rebind(self, client: Client, cursor: SessionCursor) -> None:
        """Points this object at the same session's new home (after a migration)."""
        self._client = client
        self._cursor = cursor

    def __repr__(self) -> str:
        return f"Session({self.id!r})"


class Speculation:
    """An open draft step of one session (see `Session.speculate`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.committed: dict[int, int] | None = None

    def decode(self, layer: int, q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike, b: TensorLike) -> torch.Tensor:
        """A speculative step of T draft tokens at ``layer``; returns bf16 o [T, HV, V]."""
        return self.session.decode(layer, q, k, v, a, b, speculative=True)

    def commit(self, accepted: int) -> dict[int, int]:
        """Keeps the first ``accepted`` tokens at every layer; returns the positions afterwards."""
        self.committed = self.session.commit(accepted)
        return self.committed

    def __enter__(self) -> "Speculation":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.committed is None:
            self.commit(0)
