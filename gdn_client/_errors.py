"""The one exception type of the client, with a subclass per status code the service uses.

Every failure the client reports is a `GdnError` carrying the gRPC status code and the server's
message; transport exceptions are translated here, in one place, and raised `from None` so the
caller sees the service's words rather than a grpc traceback.
"""
from __future__ import annotations

import grpc

__all__ = [
    "GdnError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "FailedPreconditionError",
    "UnauthenticatedError",
    "UnavailableError",
    "DeadlineExceededError",
    "error_from_rpc",
    "error_from_code",
]

_CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}

# Transient failures where the request may or may not have reached the server: retry these, and
# only where resending the same request cannot apply it twice.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class GdnError(Exception):
    """A request failed; ``code`` is the ``grpc.StatusCode`` and ``message`` the server's text.

    >>> err = error_from_code(5, "unknown session 'x'")
    >>> isinstance(err, NotFoundError), err.code, err.message
    (True, <StatusCode.NOT_FOUND: (5, 'not found')>, "unknown session 'x'")
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    @property
    def retryable(self) -> bool:
        """True for failures in transit (UNAVAILABLE, DEADLINE_EXCEEDED)."""
        return self.code in RETRYABLE_CODES


class InvalidArgumentError(GdnError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(GdnError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(GdnError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(GdnError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnauthenticatedError(GdnError):
    code = grpc.StatusCode.UNAUTHENTICATED


class UnavailableError(GdnError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(GdnError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


_SUBCLASS_BY_CODE: dict[grpc.StatusCode, type[GdnError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        ResourceExhaustedError,
        FailedPreconditionError,
        UnauthenticatedError,
        UnavailableError,
        DeadlineExceededError,
    )
}


def error_from_status(code: grpc.StatusCode, message: str) -> GdnError:
    """The `GdnError` (subclass) for a status code."""
    cls = _SUBCLASS_BY_CODE.get(code)
    return cls(message) if cls is not None else GdnError(message, code)


def error_from_code(number: int, message: str) -> GdnError:
    """The `GdnError` for a numeric status code, as carried by DecodeStream's ``error_code``."""
    return error_from_status(_CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)


def error_from_rpc(exc: grpc.RpcError) -> GdnError:
    """Translates a grpc (sync or aio) RpcError into a `GdnError`."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else None
    return error_from_status(code or grpc.StatusCode.UNKNOWN, details or str(exc))
