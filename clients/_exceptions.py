"""The SDK's one exception tree.

Every failure the clients raise is a `RendezvousError`. Its subclass follows the gRPC status
code (AIP-193: the code says whether and when the caller may retry); `reason` is the
UPPER_SNAKE `google.rpc.ErrorInfo` reason that says what exactly went wrong::

    RendezvousError                 code, reason, domain, metadata, message
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
    ├── OutOfRange                  OUT_OF_RANGE         BLOCK_ID_OUT_OF_RANGE, REVISION_INVALID
    ├── Unimplemented               UNIMPLEMENTED
    ├── Internal                    INTERNAL
    ├── Unavailable                 UNAVAILABLE          retried by the clients; then raised
    ├── DataLoss                    DATA_LOSS
    └── Unauthenticated             UNAUTHENTICATED

The same classes describe per-item failures of batched calls (`ItemResult.error`).
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rendezvous.protocol import ERROR_DOMAIN, Reason


class RendezvousError(Exception):
    """A failed call or batch item.

    Attributes:
        code: the gRPC status code.
        reason: the ErrorInfo reason ("" when the error carried none, e.g. a connection failure).
        domain: the ErrorInfo domain; `ERROR_DOMAIN` for errors of the rendezvous server.
        metadata: the ErrorInfo metadata (e.g. transfer_id, current_generation).
        message: the human-readable message.
        retry_after: seconds the server asked to wait before retrying (google.rpc.RetryInfo), or None.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        reason: str = "",
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
        code: grpc.StatusCode | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata: dict[str, str] = dict(metadata or {})
        self.retry_after = retry_after
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        reason = f" [{self.reason}]" if self.reason else ""
        return f"{self.code.name}{reason}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code.name}, reason={self.reason!r}, message={self.message!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild,
            (type(self), self.message, self.reason, self.domain, self.metadata, self.code, self.retry_after),
        )


def _rebuild(
    cls: type[RendezvousError],
    message: str,
    reason: str,
    domain: str,
    metadata: dict[str, str],
    code: grpc.StatusCode,
    retry_after: float | None,
) -> RendezvousError:
    return cls(message, reason=reason, domain=domain, metadata=metadata, code=code, retry_after=retry_after)


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
    """A value is outside what the server holds (a block id, a watch revision)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(RendezvousError):
    """The server does not implement the call."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(RendezvousError):
    """A server bug."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(RendezvousError):
    """No endpoint could serve the call (after the client's retries and failover)."""

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
_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_for(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str = "",
    domain: str = "",
    metadata: Mapping[str, str] | None = None,
    retry_after: float | None = None,
) -> RendezvousError:
    """The exception of the class that matches code."""
    return _CLASSES.get(code, RendezvousError)(
        message, reason=reason, domain=domain, metadata=metadata, code=code, retry_after=retry_after
    )


def from_status(status: status_pb2.Status) -> RendezvousError:
    """The exception described by a google.rpc.Status (with at most one ErrorInfo and one RetryInfo detail)."""
    code = _CODES_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    info: error_details_pb2.ErrorInfo | None = None
    retry_after: float | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and info is None:
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = max(0.0, retry.retry_delay.ToTimedelta().total_seconds())
    if info is None:
        return error_for(code, status.message, retry_after=retry_after)
    return error_for(
        code, status.message, reason=info.reason, domain=info.domain, metadata=info.metadata, retry_after=retry_after
    )


def from_rpc_error(error: grpc.RpcError) -> RendezvousError:
    """The exception for a failed gRPC call (sync or asyncio), keeping the call's error as cause."""
    call: grpc.Call = error  # grpc's errors are also their calls
    try:
        status = rpc_status.from_call(call)
    except ValueError:
        status = None  # details that contradict the status line: trust the status line
    converted = from_status(status) if status is not None else error_for(call.code(), call.details() or "")
    converted.__cause__ = error
    return converted


__all__ = [
    "ERROR_DOMAIN",
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
    "error_for",
    "from_rpc_error",
    "from_status",
]
