"""Domain errors. Each carries the gRPC status code it maps to; gdn_server.calls turns them into
statuses, in one place for every RPC."""
from __future__ import annotations

import grpc

class GdnError(Exception):
    """A request that cannot be served as sent. Recoverable: the server and all states are unchanged."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidArgument(GdnError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GdnError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(GdnError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(GdnError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class WrongProcess(FailedPrecondition):
    """A session that lives in another server process of this host (gdn-server --processes)."""

    def __init__(self, session_id: str, index: int, port: int, own_index: int, own_port: int) -> None:
        super().__init__(
            f"session {session_id!r} lives in server process {index}: send its calls to port {port} of this host "
            f"(this is process {own_index}, port {own_port}; gdn_client follows sessions to their process)"
        )
        self.port = port


class Unavailable(GdnError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(GdnError):
    """A call that did not send its request in time (--message-timeout-s)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(GdnError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(GdnError):
    """The session belongs to another identity (only where auth is on)."""

    code = grpc.StatusCode.PERMISSION_DENIED
