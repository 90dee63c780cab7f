"""Client options: deadline, retries, TLS, bearer token, message size. Shared by both clients."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import grpc

__all__ = ["ClientOptions"]

_MiB = 1 << 20
# a channel with a subchannel pool of its own opens its own connection (grpc otherwise shares one
# between a process's channels of the same target and arguments)
OWN_CONNECTION_ARG = ("grpc.use_local_subchannel_pool", 1)


@dataclass(frozen=True)
class ClientOptions:
    """How a `Client` or `AsyncClient` talks to the server.

    Attributes:
        timeout: deadline in seconds for each RPC attempt (None: no deadline).
        max_attempts: attempts per decode step on UNAVAILABLE / DEADLINE_EXCEEDED, at least 1.
            Decode steps carry ``positions``, so a resent step is never applied twice.
        backoff_initial, backoff_max, backoff_multiplier: exponential backoff between attempts
            (seconds), with full jitter.
        tls: use a secure channel; implied by any of the three certificate fields.
        root_certificates: PEM bytes of the CA that signed the server (None: system roots).
        private_key, certificate_chain: PEM bytes of a client certificate (mutual TLS).
        server_name_override: TLS name to check instead of the target host (tests only).
        token: bearer token, sent as ``authorization: Bearer <token>`` metadata on every call.
        max_message_bytes: largest message sent or received.
        metadata: extra (key, value) metadata pairs sent on every call.
        interceptors: grpc client interceptors wrapped around the channel (sync client only
            takes ``grpc.*ClientInterceptor``; the async client takes ``grpc.aio`` ones).
        channel_args: extra raw ``grpc.*`` channel arguments.
        own_connection: open a TCP connection of this client's own (one per server process).
            By default grpc gives the clients of one process that have the same target and
            options one shared connection (their calls are HTTP/2 streams on it). Where auth is
            off, the server counts ``--max-sessions-per-client`` per connection: clients that
            share one also share that limit. Give each client its own connection to count it on
            its own (a load generator's simulated users, say).

    >>> opts = ClientOptions(timeout=5.0, token="s3cret", max_attempts=5)
    >>> opts.call_metadata()
    (('authorization', 'Bearer s3cret'),)
    >>> ClientOptions().replace(timeout=1.0).timeout
    1.0
    """

    timeout: float | None = 30.0
    max_attempts: int = 4
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    backoff_multiplier: float = 2.0
    tls: bool = False
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name_override: str | None = None
    token: str | None = None
    max_message_bytes: int = 256 * _MiB
    metadata: tuple[tuple[str, str], ...] = ()
    interceptors: Sequence[Any] = field(default=(), compare=False)
    channel_args: tuple[tuple[str, Any], ...] = ()
    own_connection: bool = False

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be positive or None, got {self.timeout}")
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("private_key and certificate_chain go together (mutual TLS)")

    def replace(self, **changes: Any) -> "ClientOptions":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def secure(self) -> bool:
        return self.tls or any(
            x is not None for x in (self.root_certificates, self.private_key, self.certificate_chain)
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials, or None for a plaintext channel."""
        if not self.secure:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if self.server_name_override:
            opts.append(("grpc.ssl_target_name_override", self.server_name_override))
        if self.own_connection:
            opts.append(OWN_CONNECTION_ARG)
        opts.extend(self.channel_args)
        return opts

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        md = tuple(self.metadata)
        if self.token:
            md = (("authorization", f"Bearer {self.token}"),) + md
        return md

    def backoff_delays(self) -> Iterator[float]:
        """Delays before attempts 2..max_attempts (exponential, full jitter)."""
        delay = self.backoff_initial
        for _ in range(self.max_attempts - 1):
            yield random.uniform(0.0, delay)
            delay = min(delay * self.backoff_multiplier, self.backoff_max)
