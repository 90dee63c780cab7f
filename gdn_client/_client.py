"""The synchronous client: `Client` and its `Session`: the operations of gdn_client._calls run
with blocking stubs."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import grpc
import torch

from gdn_client import _calls
from gdn_client._calls import STREAM_OUT, UNARY, Call, Op
from gdn_client._errors import error_from_rpc
from gdn_client._info import ModelInfo, Stats
from gdn_client._options import ClientOptions
from gdn_client._routing import ProcessRoutes
from gdn_client._sessions_ext import ExportedState
from gdn_client._shared_memory import Region, SharedMemory
from gdn_client._steps import PreparedStep, SessionCursor, TensorLike, prepare_step

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
        self._regions: list[Region] = []  # shared-memory regions of this client (shared_memory())

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

    def _perform(self, call: Call) -> Any:
        """One RPC of an operation (gdn_client._calls), on the stub of its process."""
        method = getattr(self._routes.stub_of(call.process), call.method)
        if call.kind == UNARY:
            return self._call(method, call.request, retry=call.retry)
        try:
            if call.kind == STREAM_OUT:
                return list(method(call.request, timeout=self.options.timeout, metadata=self._metadata))
            return method(iter(call.request), timeout=self.options.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def _run(self, op: Op[_R]) -> _R:
        return _calls.drive(op, self._perform)

    def _stub_of(self, process: int | None) -> Any:
        """The stub of server process `process` (None: the target), its processes learned first."""
        if process is not None:
            self._run(_calls.learn_processes(self._routes))
        return self._routes.stub_of(process)

    def _run_step(self, step: PreparedStep) -> torch.Tensor:
        return self._run(_calls.run_step(self._routes, step))

    def _register(self, region: Region, process: int | None) -> None:
        self._run(_calls.register(region, process))

    def _unregister(self, region: Region, process: int | None) -> None:
        self._run(_calls.unregister(region, process))

    def _close(self, session_id: str, *, retry: bool) -> None:
        self._run(_calls.close_session(self._routes, session_id, retry))

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
        return self._run(_calls.model_info(self._routes))

    def stats(self) -> Stats:
        """The target server process's counters (launches, rows per launch, requests); on a host of
        several processes, those of the one at ``target`` only."""
        return self._run(_calls.stats())

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
        return Session(self, self._run(_calls.create_session(self._routes, _session_id(colocate_with))))

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
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step at ``layer`` for B sessions at once, atomically.

        q, k: [B, T, H, K]; v: [B, T, HV, V]; a, b: [B, T, HV]. Returns bf16 o [B, T, HV, V].
        The sessions must live in one server process and on one device: create them with
        ``create_session(colocate_with=...)``; FailedPreconditionError otherwise. Inputs from
        `shared_memory` go by reference; ``out`` (a tensor of one) is where o is written.
        """
        step = prepare_step(layer, [s._cursor for s in sessions], q, k, v, a, b, single=False,
                            regions=self._regions, out=out)
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
        return Session(self, self._run(_calls.import_state(self._routes, exported)))

    def shared_memory(self, byte_size: int, device: str | torch.device = "cpu") -> SharedMemory:
        """A region of `byte_size` bytes of shared memory, registered with the server (on the same
        host, started with ``--allow-shared-memory``): host memory (``device="cpu"``) or memory of
        a local GPU (``"cuda"``, ``"cuda:N"``) shared by CUDA IPC. Tensors from its ``tensor()``
        go to `Session.decode`, `decode_batch` and streams by reference, without a copy; see
        `SharedMemory`. Close it (or leave its ``with``) to unregister and free it.

        >>> with Client("127.0.0.1:50051") as client:                 # doctest: +SKIP
        ...     with client.shared_memory(16 << 20) as shm, client.session() as s:
        ...         q = shm.tensor((1, 16, 128)); q.copy_(torch.randn(1, 16, 128))
        ...         ...                                              # k, v, a, b and out alike
        ...         s.decode(0, q, k, v, a, b, out=o)
        """
        region = Region(byte_size, device)
        try:
            self._register(region, None)
        except BaseException:
            region.close()
            raise
        return SharedMemory(self, region)

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

    def __init__(self, client: Client, session: "str | SessionCursor") -> None:
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
        """Tokens taken so far per layer (as far as this client has sent them)."""
        return self._cursor.positions()

    def decode(
        self, layer: int, q: TensorLike, k: TensorLike, v: TensorLike, a: TensorLike, b: TensorLike,
        *, speculative: bool = False, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step of T tokens at ``layer``.

        q, k: [T, H, K]; v: [T, HV, V]; a, b: [T, HV] (or the batched form with B = 1), torch
        bf16/f16/f32 or numpy f16/f32. Returns bf16 o [T, HV, V]. ``speculative=True`` makes it a
        draft step (T up to ModelInfo.max_speculative_tokens) that `commit` settles; prefer
        `speculate()`. Inputs from the client's `shared_memory` go by reference; ``out``, a bf16
        [T, HV, V] tensor of one, is where o is written (and what is returned).
        """
        step = prepare_step(layer, [self._cursor], q, k, v, a, b, single=True, speculative=speculative,
                            regions=self._client._regions, out=out)
        return self._client._run_step(step)

    def commit(self, accepted: int) -> dict[int, int]:
        """Keeps the first ``accepted`` tokens of every open speculative step (one per layer) and
        drops the rest; returns the positions per layer afterwards. Safe to retry."""
        return self._client._run(_calls.commit(self._client._routes, self._cursor, accepted))

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
        return Session(self._client, self._client._run(_calls.fork(self._client._routes, self._cursor)))

    def export(self) -> ExportedState:
        """This session's state and positions, to move it to another server with `Client.import_state`."""
        return self._client._run(_calls.export_state(self._client._routes, self._cursor))

    def recover(self) -> list[torch.Tensor]:
        """Resends steps whose outcome stayed unknown after the last retry; returns their outputs.

        Resending is safe (same positions): the server applies a step at most once.
        """
        return self._client._run(_calls.recover(self._client._routes, self._cursor))

    def close(self) -> None:
        """Closes the session on the server; closing twice is a no-op."""
        self._client._run(_calls.close_cursor(self._client._routes, self._cursor))

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
