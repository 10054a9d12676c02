"""The one error tree of the rendezvous, raised by the service and by the SDK (as etcd's rpctypes serves both).

Every failure is a `RendezvousError`. Its subclass follows the gRPC status code (AIP-193: the code says
whether and when the caller may retry); `reason` is the UPPER_SNAKE `google.rpc.ErrorInfo` reason that says
what exactly went wrong, and fixes the code through `REASON_CODES` (generated from the proto)::

    RendezvousError                 code, reason, domain, metadata, message, retry_after
    ├── Cancelled                   CANCELLED
    ├── Unknown                     UNKNOWN
    ├── InvalidArgument             INVALID_ARGUMENT     e.g. ID_EMPTY, BATCH_TOO_LARGE
    ├── DeadlineExceeded            DEADLINE_EXCEEDED    the call's own timeout
    ├── NotFound                    NOT_FOUND            ENGINE_NOT_FOUND, TRANSFER_NOT_FOUND
    ├── AlreadyExists               ALREADY_EXISTS       TARGET_CONFLICT, CLAIM_CONFLICT, ...
    ├── PermissionDenied            PERMISSION_DENIED    NOT_PARTICIPANT, IDENTITY_MISMATCH, BINDING_MISMATCH, ...
    ├── ResourceExhausted           RESOURCE_EXHAUSTED   TOO_MANY_TRANSFERS, TOO_MANY_WATCHERS, BUDGET_EXHAUSTED
    ├── FailedPrecondition          FAILED_PRECONDITION  LEASE_EXPIRED, STALE_INCARNATION, TRANSFER_ENDED, ...
    ├── Aborted                     ABORTED
    ├── OutOfRange                  OUT_OF_RANGE         BLOCK_ID_OUT_OF_RANGE, SEQUENCE_INVALID
    ├── Unimplemented               UNIMPLEMENTED
    ├── Internal                    INTERNAL             INTERNAL_ERROR
    ├── Unavailable                 UNAVAILABLE          STORE_UNAVAILABLE, SHUTTING_DOWN; retried by the clients
    ├── DataLoss                    DATA_LOSS
    └── Unauthenticated             UNAUTHENTICATED      UNAUTHENTICATED_TOKEN

`RendezvousError(reason, message)` is an instance of the subclass of the reason's code, so what the service
raises is what the SDK catches. The same classes describe per-item failures of batched calls. No protobuf here:
rendezvous.protocol.convert maps an error to and from google.rpc.Status.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from rendezvous.protocol import reasons
from rendezvous.protocol.reasons import ERROR_DOMAIN, Reason

REASON_CODES: Mapping[Reason, grpc.StatusCode] = {
    reason: grpc.StatusCode[name] for reason, name in reasons.REASON_CODES.items()
}
"""The status code of each reason, as the protocol defines it (proto/rendezvous/v1/errors.proto): the one table."""


class RendezvousError(Exception):
    """A failed call or batch item.

    Attributes:
        code: the gRPC status code (the reason's, for a reason the protocol defines).
        reason: the ErrorInfo reason, a `Reason` when the service raises it ("" when the error carried none,
            e.g. a connection failure; a reason a newer server sent reads as its text).
        domain: the ErrorInfo domain; `ERROR_DOMAIN` for errors of the rendezvous server.
        metadata: the ErrorInfo metadata (e.g. transfer_id, current_generation).
        message: the human-readable message.
        retry_after: seconds after which the caller may retry the same call (google.rpc.RetryInfo); None when
            the server gives no hint.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __new__(cls, reason: str = "", *args: object, **kwargs: object) -> RendezvousError:
        if cls is RendezvousError:
            cls = _CLASSES.get(REASON_CODES.get(reason, cls.code), cls)  # type: ignore[call-overload]
        error: RendezvousError = super().__new__(cls)
        return error

    def __init__(self, reason: str, message: str, *, retry_after: float | None = None, **metadata: object) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.domain = ERROR_DOMAIN
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}
        self.code = REASON_CODES.get(reason, type(self).code)  # type: ignore[call-overload]

    def __str__(self) -> str:
        reason = f" [{self.reason}]" if self.reason else ""
        return f"{self.code.name}{reason}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code.name}, reason={self.reason!r}, message={self.message!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (
            error_for,
            (self.code, self.message),
            {"reason": self.reason, "domain": self.domain, "metadata": self.metadata, "retry_after": self.retry_after},
        )


class Cancelled(RendezvousError):
    """The call was cancelled, usually by the caller."""

    code = grpc.StatusCode.CANCELLED


class Unknown(RendezvousError):
    """An error without a known status."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(RendezvousError):
    """The request is malformed; fix it before retrying."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(RendezvousError):
    """The call's timeout passed before an answer came."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(RendezvousError):
    """The engine or transfer is unknown."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RendezvousError):
    """Another engine or generation already holds what the request asked for."""

    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(RendezvousError):
    """The caller may not act on this engine or transfer."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(RendezvousError):
    """A limit was reached; retry once load has gone down."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(RendezvousError):
    """The request does not fit the current state; do not retry until the state changes."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(RendezvousError):
    """A concurrency conflict; retry at a higher level."""

    code = grpc.StatusCode.ABORTED


class OutOfRange(RendezvousError):
    """A value is outside what the server holds (a block id, a watch start_sequence)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(RendezvousError):
    """The server does not implement the call."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(RendezvousError):
    """A server bug."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(RendezvousError):
    """No endpoint could serve the call (after the client's retries and failover), or the server is draining."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(RendezvousError):
    """Unrecoverable data loss."""

    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(RendezvousError):
    """The call carried no valid credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


_CLASSES: dict[grpc.StatusCode, type[RendezvousError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def error_for(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str = "",
    domain: str = "",
    metadata: Mapping[str, str] | None = None,
    retry_after: float | None = None,
) -> RendezvousError:
    """The exception of the class that matches code, as received (the code is kept even where the reason is one
    this protocol maps to another: what the peer said, not what it should have)."""
    error = _CLASSES.get(code, RendezvousError)(reason, message, retry_after=retry_after)
    error.code = code
    error.domain = domain
    error.metadata = dict(metadata or {})
    return error


def clip(text: str, max_bytes: int) -> str:
    """text cut to at most max_bytes of UTF-8, on a character boundary, ending in "..." when cut (an error
    travels in trailers, which clients cap; the service clips abort messages the same way)."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    return data[: max(max_bytes - 3, 0)].decode(errors="ignore") + "..."[:max_bytes]


def transfer_not_found(transfer_id: str) -> RendezvousError:
    """The answer for a transfer id the service does not know (or forgot)."""
    return RendezvousError(Reason.TRANSFER_NOT_FOUND, f"transfer {transfer_id} is unknown", transfer_id=transfer_id)


__all__ = [
    "ERROR_DOMAIN",
    "REASON_CODES",
    "Aborted",
    "AlreadyExists",
    "Cancelled",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "Reason",
    "RendezvousError",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "clip",
    "error_for",
    "transfer_not_found",
]
