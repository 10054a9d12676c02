"""The error vocabulary of the rendezvous: a status code and an ErrorInfo reason.

Codes follow AIP-193 (pick by "can the caller retry?"); reasons are UPPER_SNAKE and
documented in docs/protocol.md. This module knows nothing of gRPC: the server maps
`Code` names onto `grpc.StatusCode` members of the same name.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

ERROR_DOMAIN = "kv-rendezvous"


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


class Reason(StrEnum):
    """ErrorInfo reasons. Each has one code; see `REASON_CODES`."""

    ID_EMPTY = "ID_EMPTY"
    ID_TOO_LONG = "ID_TOO_LONG"
    ID_INVALID = "ID_INVALID"
    ROLE_UNSPECIFIED = "ROLE_UNSPECIFIED"
    LAYOUT_INVALID = "LAYOUT_INVALID"
    AGENTS_INVALID = "AGENTS_INVALID"
    BLOCK_ID_NEGATIVE = "BLOCK_ID_NEGATIVE"
    BLOCK_ID_DUPLICATE = "BLOCK_ID_DUPLICATE"
    BLOCK_ID_OUT_OF_RANGE = "BLOCK_ID_OUT_OF_RANGE"
    TOO_MANY_BLOCKS = "TOO_MANY_BLOCKS"
    GENERATION_INVALID = "GENERATION_INVALID"
    TIMEOUT_INVALID = "TIMEOUT_INVALID"
    OUTCOME_UNSPECIFIED = "OUTCOME_UNSPECIFIED"
    BATCH_EMPTY = "BATCH_EMPTY"
    BATCH_TOO_LARGE = "BATCH_TOO_LARGE"
    REVISION_INVALID = "REVISION_INVALID"
    PAGE_TOKEN_INVALID = "PAGE_TOKEN_INVALID"
    STATE_INVALID = "STATE_INVALID"
    ENGINE_NOT_FOUND = "ENGINE_NOT_FOUND"
    TRANSFER_NOT_FOUND = "TRANSFER_NOT_FOUND"
    ENGINE_CONFLICT = "ENGINE_CONFLICT"
    TARGET_CONFLICT = "TARGET_CONFLICT"
    CLAIM_CONFLICT = "CLAIM_CONFLICT"
    WRONG_ROLE = "WRONG_ROLE"
    NOT_PARTICIPANT = "NOT_PARTICIPANT"
    STALE_GENERATION = "STALE_GENERATION"
    STALE_INCARNATION = "STALE_INCARNATION"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    INVALID_STATE = "INVALID_STATE"
    TRANSFER_ENDED = "TRANSFER_ENDED"
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"
    BLOCK_MISMATCH = "BLOCK_MISMATCH"
    TOO_MANY_TRANSFERS = "TOO_MANY_TRANSFERS"
    TOO_MANY_WATCHERS = "TOO_MANY_WATCHERS"
    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL_ERROR = "INTERNAL_ERROR"


REASON_CODES: Mapping[Reason, Code] = {
    Reason.ID_EMPTY: Code.INVALID_ARGUMENT,
    Reason.ID_TOO_LONG: Code.INVALID_ARGUMENT,
    Reason.ID_INVALID: Code.INVALID_ARGUMENT,
    Reason.ROLE_UNSPECIFIED: Code.INVALID_ARGUMENT,
    Reason.LAYOUT_INVALID: Code.INVALID_ARGUMENT,
    Reason.AGENTS_INVALID: Code.INVALID_ARGUMENT,
    Reason.BLOCK_ID_NEGATIVE: Code.INVALID_ARGUMENT,
    Reason.BLOCK_ID_DUPLICATE: Code.INVALID_ARGUMENT,
    Reason.BLOCK_ID_OUT_OF_RANGE: Code.OUT_OF_RANGE,
    Reason.TOO_MANY_BLOCKS: Code.INVALID_ARGUMENT,
    Reason.GENERATION_INVALID: Code.INVALID_ARGUMENT,
    Reason.TIMEOUT_INVALID: Code.INVALID_ARGUMENT,
    Reason.OUTCOME_UNSPECIFIED: Code.INVALID_ARGUMENT,
    Reason.BATCH_EMPTY: Code.INVALID_ARGUMENT,
    Reason.BATCH_TOO_LARGE: Code.INVALID_ARGUMENT,
    Reason.REVISION_INVALID: Code.OUT_OF_RANGE,
    Reason.PAGE_TOKEN_INVALID: Code.INVALID_ARGUMENT,
    Reason.STATE_INVALID: Code.INVALID_ARGUMENT,
    Reason.ENGINE_NOT_FOUND: Code.NOT_FOUND,
    Reason.TRANSFER_NOT_FOUND: Code.NOT_FOUND,
    Reason.ENGINE_CONFLICT: Code.ALREADY_EXISTS,
    Reason.TARGET_CONFLICT: Code.ALREADY_EXISTS,
    Reason.CLAIM_CONFLICT: Code.ALREADY_EXISTS,
    Reason.WRONG_ROLE: Code.FAILED_PRECONDITION,
    Reason.NOT_PARTICIPANT: Code.PERMISSION_DENIED,
    Reason.STALE_GENERATION: Code.FAILED_PRECONDITION,
    Reason.STALE_INCARNATION: Code.FAILED_PRECONDITION,
    Reason.LEASE_EXPIRED: Code.FAILED_PRECONDITION,
    Reason.INVALID_STATE: Code.FAILED_PRECONDITION,
    Reason.TRANSFER_ENDED: Code.FAILED_PRECONDITION,
    Reason.LAYOUT_MISMATCH: Code.FAILED_PRECONDITION,
    Reason.BLOCK_MISMATCH: Code.FAILED_PRECONDITION,
    Reason.TOO_MANY_TRANSFERS: Code.RESOURCE_EXHAUSTED,
    Reason.TOO_MANY_WATCHERS: Code.RESOURCE_EXHAUSTED,
    Reason.STORE_UNAVAILABLE: Code.UNAVAILABLE,
    Reason.SHUTTING_DOWN: Code.UNAVAILABLE,
    Reason.INTERNAL_ERROR: Code.INTERNAL,
}


class RendezvousError(Exception):
    """A rejected operation: a reason (which fixes the status code), a message and metadata."""

    def __init__(self, reason: Reason, message: str, **metadata: object) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in metadata.items()}

    @property
    def code(self) -> Code:
        """The status code this reason maps to."""
        return REASON_CODES[self.reason]

    def __repr__(self) -> str:
        return f"RendezvousError({self.reason.value}, {self.message!r})"
