"""Which server process serves a session, and a channel to each process (gdn-server --processes).

A server started with ``--processes K`` is several server processes on one host, each on a port
of its own. A session lives in one of them, and its id names it: ``"p<index>.<random>"``.
GetModelInfo of any process lists every process's port (``process_ports``, in process order) and
the answering one's place (``process_index``). `ProcessRoutes` keeps what a client learned from
that: a stub per process on the host of the client's target, the process of each session, and the
order in which a new session tries the processes.

It does no RPC itself: `Client` and `AsyncClient` fetch ModelInfo each in their own way (blocking
or awaited) and hand it to `learn`; every routing decision is made here, once for both.

A server of one process reports no ports and gives ids without that prefix: everything then goes
to the target, and nothing is learned before the first session call.
"""
from __future__ import annotations

import random
import re
import threading
from typing import Any, Callable, Generic, Sequence, TypeVar

from gdn_client._errors import FailedPreconditionError, ResourceExhaustedError
from gdn_client.proto.gdn.v1 import gdn_pb2, gdn_pb2_grpc
from gdn_client.proto.ids import process_of

__all__ = ["ProcessRoutes", "process_target"]

ChannelT = TypeVar("ChannelT")

# name-resolver prefixes of a gRPC target that come before host:port ("dns:///h:p", "ipv4:h:p")
_RESOLVER_PREFIX = re.compile(r"^(?:dns:(?://[^/]*/)?|ipv4:|ipv6:)")


def process_target(target: str, port: int) -> str:
    """The gRPC target of `port` on the host of `target`, spelled as the user spelled it.

    >>> process_target("gdn-0.local:50051", 50052), process_target("[::1]:50051", 50052)
    ('gdn-0.local:50052', '[::1]:50052')
    >>> process_target("dns:///10.0.0.7:50051", 50053)
    'dns:///10.0.0.7:50053'
    """
    prefix_match = _RESOLVER_PREFIX.match(target)
    prefix = prefix_match.group(0) if prefix_match else ""
    address = target[len(prefix):]
    if "," in address or "/" in address or not address:
        # unix sockets, address lists: no single host whose other ports could be reached
        raise ValueError(f"target {target!r} names no single host:port")
    if address.startswith("["):  # [IPv6]:port or [IPv6]
        host = address[: address.index("]") + 1]
    elif address.count(":") == 1:  # host:port
        host = address.split(":", 1)[0]
    elif ":" in address:  # a bare IPv6 address, no port
        host = f"[{address}]"
    else:  # a bare host: gRPC's default port
        host = address
    return f"{prefix}{host}:{port}"


class ProcessRoutes(Generic[ChannelT]):
    """The processes of the server behind one target, and a stub for each (one channel each,
    opened on first use by `open_channel`). Thread-safe.

    >>> import grpc
    >>> routes = ProcessRoutes("127.0.0.1:50051", open_channel=grpc.insecure_channel)
    >>> routes.learn(gdn_pb2.ModelInfo(process_ports=[50051, 50052], process_index=0))
    >>> routes.process_target(1), routes.home(["p1.a", "p1.b"])
    ('127.0.0.1:50052', 1)
    >>> sorted(routes.new_session_order())
    [0, 1]
    >>> for channel in routes.channels():
    ...     channel.close()
    """

    def __init__(self, target: str, open_channel: Callable[[str], ChannelT]) -> None:
        self.target = target
        self._open_channel = open_channel
        self.channel: ChannelT = open_channel(target)  # the target's: model info, stats, health
        self.stub = gdn_pb2_grpc.GdnDecodeStub(self.channel)
        self._lock = threading.Lock()
        self._known = False
        self.ports: tuple[int, ...] = ()  # every process's port; empty for a server of one process
        self.target_index = 0  # the target's own place among them
        self._stubs: dict[int, Any] = {}
        self._channels: dict[int, ChannelT] = {}
        self._next_new = 0  # the process the next new session tries first (round robin)

    @property
    def known(self) -> bool:
        """Whether the processes were learned (see `learn`)."""
        return self._known

    def other_processes(self) -> list[int]:
        """The processes other than the target (none for a server of one process)."""
        return [i for i in range(len(self.ports)) if i != self.target_index]

    def learn(self, info: gdn_pb2.ModelInfo) -> None:
        """Takes the processes from the target's ModelInfo (only the first call counts: a host's
        processes keep their ports while it runs)."""
        ports = tuple(int(p) for p in info.process_ports)
        if ports and not 0 <= info.process_index < len(ports):
            raise FailedPreconditionError(
                f"{self.target} reports process {info.process_index} of {len(ports)}: not a valid process list"
            )
        with self._lock:
            if self._known:
                return
            self.ports = ports
            self.target_index = int(info.process_index) if ports else 0
            # each client starts its round robin somewhere else, so many clients spread evenly
            self._next_new = random.randrange(len(ports)) if ports else 0
            self._known = True

    def home(self, session_ids: Sequence[str]) -> int | None:
        """The process all these sessions live in (None: a server of one process), or
        FailedPreconditionError, before anything is sent, when they live in different ones."""
        homes = {process_of(s) for s in session_ids}
        if len(homes) > 1:
            where = ", ".join(f"{s} in process {process_of(s)}" for s in session_ids)
            raise FailedPreconditionError(
                f"one decode step needs sessions of one server process ({where}): create the sessions "
                "of a batch with create_session(colocate_with=...)"
            )
        return homes.pop() if homes else None

    def process_target(self, index: int) -> str:
        """The gRPC target of process `index`."""
        return process_target(self.target, self.ports[index])

    def stub_of(self, index: int | None) -> Any:
        """The stub of process `index` (None: the target). Call `learn` first for an index."""
        if index is None:
            return self.stub
        if not self._known:
            raise RuntimeError("the server's processes are not learned yet")
        if index == self.target_index or index >= len(self.ports):
            # beyond the host's processes (an id from another server): the target answers NOT_FOUND
            return self.stub
        with self._lock:
            stub = self._stubs.get(index)
            if stub is None:
                try:
                    target = self.process_target(index)
                except ValueError as e:
                    raise FailedPreconditionError(
                        f"session lives in server process {index} (port {self.ports[index]}), which this "
                        f"client cannot reach: {e}"
                    ) from None
                channel = self._channels[index] = self._open_channel(target)
                stub = self._stubs[index] = gdn_pb2_grpc.GdnDecodeStub(channel)
            return stub

    def new_session_order(self) -> list[int | None]:
        """The processes a new session tries, in order: the next one in round robin, then the
        others (a process that is full answers RESOURCE_EXHAUSTED and the next one is tried)."""
        if not self.ports:
            return [None]
        with self._lock:
            first = self._next_new
            self._next_new = (first + 1) % len(self.ports)
        return [(first + i) % len(self.ports) for i in range(len(self.ports))]

    def all_full(self, last: ResourceExhaustedError) -> ResourceExhaustedError:
        """The error once every process refused a new session (`last`: the last refusal)."""
        if len(self.ports) < 2:
            return last
        return ResourceExhaustedError(f"all {len(self.ports)} server processes are full ({last.message})")

    def channels(self) -> list[ChannelT]:
        """Every channel opened, the target's first."""
        with self._lock:
            return [self.channel, *self._channels.values()]
