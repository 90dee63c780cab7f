"""Transport security and caller identity: TLS / mutual TLS credentials and bearer tokens.

- `--tls-cert` / `--tls-key` (PEM) serve TLS; `--tls-client-ca` also requires and verifies a
  client certificate signed by that CA (mutual TLS).
- `--auth-token-file`: every RPC must carry `authorization: Bearer <token>` metadata, else it ends
  with UNAUTHENTICATED before any of its message is read (gdn_server.calls). The file holds one token a line, as
  `name:token` (the name is the caller's identity; several tokens may share a name, e.g. while one
  is rotated out) or a bare `token` (identity `token-<first 12 hex of its sha256>`). Blank lines
  and lines starting with `#` are skipped.
- The grpc.health.v1 service needs no token (Kubernetes probes and load balancers send none).

The identity of a call is the token's name when tokens are on, else the client certificate's
subject under mutual TLS, else None (no auth). gdn_server.calls checks the token and binds the
identity for the call (`bind_identity`); the servicer reads it with `current_identity()` and
records it as the owner of the sessions the call creates. A session is usable only by its owner
(PERMISSION_DENIED otherwise).
"""
from __future__ import annotations

import contextvars
import hashlib
from dataclasses import dataclass
from pathlib import Path

import grpc

_identity: contextvars.ContextVar[str | None] = contextvars.ContextVar("gdn_identity", default=None)


def current_identity() -> str | None:
    """The authenticated identity of the RPC being served (None where auth is off)."""
    return _identity.get()


def bind_identity(identity: str | None) -> None:
    """Binds the identity of the RPC being served (each RPC runs in its own task: no reset needed)."""
    _identity.set(identity)


def client_key(identity: str | None, context) -> str:
    """Whom a call counts against (its calls held, sessions, shared-memory regions): its identity
    where auth is on, else its peer (one per connection: a fairness bound between well-behaved
    clients; auth is what bounds a hostile one)."""
    return identity if identity is not None else f"peer {context.peer()}"


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


def peer_subject(context) -> str | None:
    """The verified client certificate's subject (or common name) of a mutual TLS call."""
    auth = context.auth_context() or {}
    for key in ("x509_subject", "x509_common_name"):
        values = auth.get(key)
        if values:
            v = values[0]
            return v.decode() if isinstance(v, bytes) else str(v)
    return None
