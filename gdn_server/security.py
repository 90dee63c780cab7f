"""Transport security and caller identity: TLS / mutual TLS credentials and bearer tokens.

- `--tls-cert` / `--tls-key` (PEM) serve TLS; `--tls-client-ca` also requires and verifies a
  client certificate signed by that CA (mutual TLS).
- `--auth-token-file`: every RPC must carry `authorization: Bearer <token>` metadata, else it ends
  with UNAUTHENTICATED before its request is even parsed. The file holds one token a line, as
  `name:token` (the name is the caller's identity; several tokens may share a name, e.g. while one
  is rotated out) or a bare `token` (identity `token-<first 12 hex of its sha256>`). Blank lines
  and lines starting with `#` are skipped.
- The grpc.health.v1 service needs no token (Kubernetes probes and load balancers send none).

The identity of a call is the token's name when tokens are on, else the client certificate's
subject under mutual TLS, else None (no auth). `AuthInterceptor` binds it for the call;
the servicer reads it with `current_identity()` and records it as the owner of the sessions the
call creates. A session is usable only by its owner (PERMISSION_DENIED otherwise).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path


import grpc

from gdn_server.errors import GdnError, InvalidArgument
from gdn_server.rpc_wrap import wrap_handler

HEALTH_PREFIX = "/grpc.health.v1.Health/"

_identity: contextvars.ContextVar[str | None] = contextvars.ContextVar("gdn_identity", default=None)


def current_identity() -> str | None:
    """The authenticated identity of the RPC being served (None where auth is off)."""
    return _identity.get()


@dataclass(frozen=True)
class SecurityConfig:
    tls_cert: str | None = None  # PEM certificate chain of the server
    tls_key: str | None = None  # PEM private key of the server
    tls_client_ca: str | None = None  # PEM CA bundle: require and verify client certificates
    auth_token_file: str | None = None  # `name:token` lines
    max_sessions_per_client: int | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.max_sessions_per_client is not None and self.max_sessions_per_client < 1:
            raise ValueError("--max-sessions-per-client must be >= 1")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def mutual_tls(self) -> bool:
        return bool(self.tls_client_ca)


def load_tokens(path: str | Path) -> dict[str, str]:
    """token -> identity from a token file; ValueError on a malformed or empty file."""
    tokens: dict[str, str] = {}
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        if not sep:
            name, token = f"token-{hashlib.sha256(line.encode()).hexdigest()[:12]}", line
        name, token = name.strip(), token.strip()
        if not name or not token:
            raise ValueError(f"{path}:{lineno}: expected `name:token` or `token`")
        if any(c.isspace() for c in token):
            raise ValueError(f"{path}:{lineno}: a token cannot contain whitespace")
        if tokens.get(token, name) != name:
            raise ValueError(f"{path}:{lineno}: the same token is listed under two names")
        tokens[token] = name
    if not tokens:
        raise ValueError(f"{path}: no tokens")
    return tokens


def server_credentials(cfg: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for add_secure_port, or None for a plaintext port."""
    if not cfg.tls:
        return None
    key = Path(cfg.tls_key).read_bytes()
    chain = Path(cfg.tls_cert).read_bytes()
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=ca is not None)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token (when tokens are on) and binds the caller's identity for the call."""

    def __init__(self, tokens: dict[str, str] | None, mutual_tls: bool) -> None:
        self._tokens = [(t.encode(), name) for t, name in (tokens or {}).items()]
        self._check_tokens = tokens is not None
        self._mutual_tls = mutual_tls

    def identity_for(self, metadata) -> str | None:
        """The identity of a valid `authorization: Bearer <token>` entry, else None."""
        for key, value in metadata or ():
            if key != "authorization":
                continue
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, presented = value.strip().partition(" ")
            if scheme.lower() != "bearer":
                continue
            candidate = presented.strip().encode()
            found = None
            for token, name in self._tokens:  # compare with every token: no early exit
                if hmac.compare_digest(candidate, token):
                    found = name
            if found is not None:
                return found
        return None

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        identity: str | None = None
        if self._check_tokens:
            identity = self.identity_for(handler_call_details.invocation_metadata)
            if identity is None:
                return _unauthenticated(handler)
        if identity is None and self._mutual_tls:
            return _with_identity(handler, peer_subject)
        return _with_identity(handler, lambda context: identity)


def _with_identity(handler: grpc.RpcMethodHandler, identity_of) -> grpc.RpcMethodHandler:
    """`handler` with `identity_of(context)` bound as the caller's identity for each call."""

    @contextlib.asynccontextmanager
    async def bind(context):
        _identity.set(identity_of(context))  # each RPC runs in its own task: no reset needed
        yield

    return wrap_handler(handler, bind)


def peer_subject(context) -> str | None:
    """The verified client certificate's subject (or common name) of a mutual TLS call."""
    auth = context.auth_context() or {}
    for key in ("x509_subject", "x509_common_name"):
        values = auth.get(key)
        if values:
            v = values[0]
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def _unauthenticated(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that reads nothing and ends the call with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "missing or invalid `authorization: Bearer <token>` metadata"
        )

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)



class _Malformed:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class RejectMalformed(grpc.aio.ServerInterceptor):
    """Bytes that do not parse as the request message end the call with INVALID_ARGUMENT.

    grpc.aio would answer UNKNOWN and log a traceback per bad message (cheap log flooding for any
    client). This parses with the handler's own deserializer but catches its error; reading the
    bad message raises InvalidArgument (in whichever task reads the stream), and the call ends
    with that status in its own task (aborting from a reader task would clash with its writes).
    A GdnError escaping any behaviour is mapped the same way instead of becoming UNKNOWN.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def deserializer(data: bytes):
            try:
                return parse(data)
            except Exception as e:  # DecodeError, or whatever a generated parser raises
                return _Malformed(e)

        def check(message, context):
            if isinstance(message, _Malformed):
                raise InvalidArgument(f"malformed request message: {message.error}")
            return message

        return wrap_handler(handler, _domain_errors_as_status, map_request=check, request_deserializer=deserializer)


@contextlib.asynccontextmanager
async def _domain_errors_as_status(context):
    try:
        yield
    except GdnError as e:
        await context.abort(e.code, e.message)
