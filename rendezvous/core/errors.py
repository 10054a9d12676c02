"""The error vocabulary of the rendezvous: a status code and an ErrorInfo reason.

Codes follow AIP-193 (pick by "can the caller retry?"); reasons are UPPER_SNAKE and
documented in docs/protocol.md. This module knows nothing of gRPC: the server maps
`Code` names onto `grpc.StatusCode` members of the same name.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from rendezvous.protocol import ERROR_DOMAIN, Reason
from rendezvous.protocol.reasons import REASON_CODES as REASON_CODE_NAMES


class Code(StrEnum):
    """Canonical status codes used by the service (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    ABORTED = "ABORTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


REASON_CODES: Mapping[Reason, Code] = {reason: Code(code) for reason, code in REASON_CODE_NAMES.items()}
"""The status code of each reason, as the protocol defines it (proto/rendezvous/v1/errors.proto)."""


class RendezvousError(Exception):
    """A rejected operation: a reason (which fixes the status code), a message and metadata.

    `retry_after`: seconds after which the caller may retry the same call (sent as google.rpc.RetryInfo);
    None when the server gives no hint.
    """

    def __init__(self, reason: Reason, message: str, *, retry_after: float | None = None, **metadata: object) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}

    @property
    def code(self) -> Code:
        """The status code this reason maps to."""
        return REASON_CODES[self.reason]

    def __repr__(self) -> str:
        return f"RendezvousError({self.reason.value}, {self.message!r})"


def transfer_not_found(transfer_id: str) -> RendezvousError:
    """The answer for a transfer id the service does not know (or forgot)."""
    return RendezvousError(Reason.TRANSFER_NOT_FOUND, f"transfer {transfer_id} is unknown", transfer_id=transfer_id)


__all__ = ["ERROR_DOMAIN", "REASON_CODES", "Code", "Reason", "RendezvousError", "transfer_not_found"]
