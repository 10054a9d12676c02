"""ErrorInfo reasons of the protocol and the status code each comes with.

Generated from proto/rendezvous/v1/errors.proto by scripts/generate_stubs.py: do not edit.
Plain Python (no protobuf import), so the service core and the SDK share it at no cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

ERROR_DOMAIN = "kv-rendezvous.dev"
"""The google.rpc.ErrorInfo domain of every reason (the `error_domain` option of ErrorReason)."""


class Reason(StrEnum):
    """The reason of a google.rpc.ErrorInfo in ERROR_DOMAIN."""

    ID_EMPTY = "ID_EMPTY"
    """An engine, pool, agent or transfer id is empty."""

    ID_TOO_LONG = "ID_TOO_LONG"
    """An id is longer than the server's max_id_length."""

    ID_INVALID = "ID_INVALID"
    """An id has whitespace or unprintable characters."""

    ROLE_UNSPECIFIED = "ROLE_UNSPECIFIED"
    """RegisterEngine without PRODUCER or CONSUMER."""

    LAYOUT_INVALID = "LAYOUT_INVALID"
    """Negative layout sizes, TP or PP below 1, or KV heads that TP does not divide."""

    AGENTS_INVALID = "AGENTS_INVALID"
    """Bad NIXL agents: names, missing or repeated ranks, layers, regions, memory kind, limits
 (metadata bytes per agent and per engine included)."""

    BLOCK_ID_NEGATIVE = "BLOCK_ID_NEGATIVE"
    """A negative block id."""

    BLOCK_ID_DUPLICATE = "BLOCK_ID_DUPLICATE"
    """A block id listed twice."""

    BLOCK_ID_OUT_OF_RANGE = "BLOCK_ID_OUT_OF_RANGE"
    """A block id beyond the engine's registered regions."""

    TOO_MANY_BLOCKS = "TOO_MANY_BLOCKS"
    """More block ids than max_blocks_per_target."""

    GENERATION_INVALID = "GENERATION_INVALID"
    """A malformed generation."""

    TIMEOUT_INVALID = "TIMEOUT_INVALID"
    """A negative timeout or one above the server's maximum."""

    OUTCOME_UNSPECIFIED = "OUTCOME_UNSPECIFIED"
    """CompleteTransfers without SUCCEEDED or FAILED."""

    MODE_INVALID = "MODE_INVALID"
    """A TargetSpec.mode the server does not know."""

    LABELS_INVALID = "LABELS_INVALID"
    """More labels, or longer label keys, values or labels in all, than the server allows."""

    BATCH_EMPTY = "BATCH_EMPTY"
    """A batched call without items."""

    BATCH_TOO_LARGE = "BATCH_TOO_LARGE"
    """More items than max_batch_items."""

    SEQUENCE_INVALID = "SEQUENCE_INVALID"
    """A Watch start_sequence beyond the engine's latest event sequence + 1 (ErrorInfo metadata field:
 last_sequence)."""

    PAGE_TOKEN_INVALID = "PAGE_TOKEN_INVALID"
    """A page token this server did not issue."""

    STATE_INVALID = "STATE_INVALID"
    """An unknown state in a ListTransfers filter."""

    ENGINE_NOT_FOUND = "ENGINE_NOT_FOUND"
    """The engine is unknown (or forgotten)."""

    TRANSFER_NOT_FOUND = "TRANSFER_NOT_FOUND"
    """The transfer is unknown (or forgotten)."""

    ENGINE_CONFLICT = "ENGINE_CONFLICT"
    """A live engine id re-registered with another role or pool."""

    TARGET_CONFLICT = "TARGET_CONFLICT"
    """Another consumer targets the transfer, or the same generation with other blocks."""

    CLAIM_CONFLICT = "CLAIM_CONFLICT"
    """Another producer claimed the transfer."""

    WRONG_ROLE = "WRONG_ROLE"
    """The call is for the other side of the transfer."""

    NOT_PARTICIPANT = "NOT_PARTICIPANT"
    """The engine is neither the transfer's consumer nor its producer (with auth on, only
 admin identities are told so; others get TRANSFER_NOT_FOUND, as for an unknown id)."""

    STALE_GENERATION = "STALE_GENERATION"
    """A generation older than the transfer's current one."""

    STALE_INCARNATION = "STALE_INCARNATION"
    """The caller's incarnation was replaced."""

    LEASE_EXPIRED = "LEASE_EXPIRED"
    """The engine's lease ended; register again."""

    INVALID_STATE = "INVALID_STATE"
    """The transfer is not in a state that allows the call."""

    TRANSFER_ENDED = "TRANSFER_ENDED"
    """The transfer was released or aborted; mint a new id."""

    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"
    """Producer and consumer layouts are incompatible."""

    BLOCK_MISMATCH = "BLOCK_MISMATCH"
    """More target blocks than source blocks."""

    TOO_MANY_TRANSFERS = "TOO_MANY_TRANSFERS"
    """The engine is at its live-transfer limit."""

    TOO_MANY_WATCHERS = "TOO_MANY_WATCHERS"
    """The engine has as many open watches as allowed."""

    UNAUTHENTICATED_TOKEN = "UNAUTHENTICATED_TOKEN"
    """Auth is on and the call carried no known token or certificate, or the stream's
 identity left the auth file."""

    IDENTITY_MISMATCH = "IDENTITY_MISMATCH"
    """The caller's identity may not act for this engine, or not with that role or in that
 pool (ErrorInfo metadata field: role or pool)."""

    ROLE_REQUIRED = "ROLE_REQUIRED"
    """The call needs the router or admin role."""

    RATE_LIMITED = "RATE_LIMITED"
    """The caller's request rate is over its limit."""

    TOO_MANY_CONCURRENT_CALLS = "TOO_MANY_CONCURRENT_CALLS"
    """The caller has too many calls in flight."""

    STORE_UNAVAILABLE = "STORE_UNAVAILABLE"
    """The store cannot be reached; retry."""

    SHUTTING_DOWN = "SHUTTING_DOWN"
    """The server is draining; retry on another replica."""

    INTERNAL_ERROR = "INTERNAL_ERROR"
    """A bug; please report."""

    RANK_INVALID = "RANK_INVALID"
    """A rank named in a completion or acknowledgement is not one of the engine's."""

    BINDING_INVALID = "BINDING_INVALID"
    """A transfer binding that does not verify under the server's keys (forged, for another
 transfer, malformed) or that expired (ErrorInfo metadata field: mac or expire_time)."""

    BINDING_MISMATCH = "BINDING_MISMATCH"
    """A valid transfer binding that names another engine for the caller's half (ErrorInfo
 metadata field: consumer_engine_id or producer_engine_id)."""

    BINDING_REQUIRED = "BINDING_REQUIRED"
    """The server requires a transfer binding (it has a binding key and no --allow-unbound) and the half has none."""

    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    """The server's memory budget (engines, live block ids or agent metadata bytes, global or
 of the caller's identity) has no room for the request (ErrorInfo metadata budget, scope, limit)."""

    ENGINE_CAPACITY_EXCEEDED = "ENGINE_CAPACITY_EXCEEDED"
    """The consumer engine's declared capacity (EngineCapacity) has no room for the target
 or reservation (ErrorInfo metadata fields: engine_id, limit (transfers or blocks), max, in_use, reserved,
 requested)."""

    CAPACITY_INVALID = "CAPACITY_INVALID"
    """A declared capacity above the server's max_capacity_transfers or max_capacity_blocks."""

    CREDIT_CONFLICT = "CREDIT_CONFLICT"
    """The transfer id already holds a credit reservation on another engine or for other blocks."""

    PROGRESSIVE_NEEDS_TOKENS = "PROGRESSIVE_NEEDS_TOKENS"
    """A progressive target without num_tokens (its parts are ranges of those tokens)."""

    PROGRESSIVE_NEEDS_PUSH = "PROGRESSIVE_NEEDS_PUSH"
    """A progressive target in pull mode (only a pushing producer writes in parts)."""

    PROGRESSIVE_NOT_ACCEPTED = "PROGRESSIVE_NOT_ACCEPTED"
    """A completion with parts for a transfer whose target did not accept progressive writes."""

    TOO_MANY_PARTS = "TOO_MANY_PARTS"
    """More parts in one completion than max_parts_per_completion, or in one CompleteTransfers
 request than max_parts_per_request (then the whole request is refused)."""

    PART_OUT_OF_RANGE = "PART_OUT_OF_RANGE"
    """A part outside the target's tokens or the reporting ranks' layers, or an empty one
 (ErrorInfo metadata field: part, the part's index)."""

    PARTS_OVERLAP = "PARTS_OVERLAP"
    """Two parts of a completion share a token of a layer (ErrorInfo metadata field: part, other)."""

    PARTS_INCOMPLETE = "PARTS_INCOMPLETE"
    """The parts of a completion leave tokens of some layer unwritten (ErrorInfo metadata
 fields: layer, token)."""

    REQUEST_ID_REUSED = "REQUEST_ID_REUSED"
    """A request_id the server keeps an answer for came with a different request (ErrorInfo
 metadata field: request_id); a new request needs a new request_id."""

    MESSAGE_INVALID = "MESSAGE_INVALID"
    """The request's bytes do not parse as the method's message."""

    DATA_PLANE_VERSION_UNSUPPORTED = "DATA_PLANE_VERSION_UNSUPPORTED"
    """The engine's layout states a data_plane_version this server does not know (a newer
 connector: upgrade the servers first) (ErrorInfo metadata fields: data_plane_version, the engine's;
 supported, the newest this server knows)."""

    PAGE_SIZE_INVALID = "PAGE_SIZE_INVALID"
    """A negative page_size in ListEngines or ListTransfers."""

    VIEW_INVALID = "VIEW_INVALID"
    """A ListEngines view the server does not know."""

    INDEX_SEQUENCE_GAP = "INDEX_SEQUENCE_GAP"
    """A KV index report's sequence is past the one after the last applied: events were lost;
 send ReplaceCachedBlocks (ErrorInfo metadata fields: expected_sequence, sequence)."""

    INDEX_SEQUENCE_STALE = "INDEX_SEQUENCE_STALE"
    """A KV index report's sequence is below the last applied: an old batch, refused (the same
 sequence again is a no-op) (ErrorInfo metadata fields: expected_sequence, sequence)."""

    INDEX_PARENT_UNKNOWN = "INDEX_PARENT_UNKNOWN"
    """A stored block's parent is not held by the engine in the index; nothing of the batch
 applied; send ReplaceCachedBlocks (ErrorInfo metadata field: group_index)."""

    INDEX_FULL = "INDEX_FULL"
    """The KV index has no room for the blocks: the engine's, its identity's or the server's bound
 (ErrorInfo metadata fields: scope (engine, identity or server), limit, have, adding)."""

    INDEX_QUERY_TOO_LARGE = "INDEX_QUERY_TOO_LARGE"
    """A KV index request over a size limit: more hashes than max_index_blocks_per_request or
 max_index_query_blocks, or more pools or engines than max_index_query_engines (ErrorInfo metadata: limit)."""

    INDEX_HASHING_MISSING = "INDEX_HASHING_MISSING"
    """The engine's first KV index report or its snapshot does not say how it hashes blocks
 (BlockHashing), or says it badly."""

    INDEX_HASHING_MISMATCH = "INDEX_HASHING_MISMATCH"
    """A KV index report announces another BlockHashing than the engine's entry holds (a
 snapshot may change it)."""

    BLOCK_HASH_INVALID = "BLOCK_HASH_INVALID"
    """A block hash that is empty or longer than 32 bytes, an empty stored or removed event, or
 a token_count over its blocks' tokens."""


REASON_CODES: Mapping[Reason, str] = {
    Reason.ID_EMPTY: "INVALID_ARGUMENT",
    Reason.ID_TOO_LONG: "INVALID_ARGUMENT",
    Reason.ID_INVALID: "INVALID_ARGUMENT",
    Reason.ROLE_UNSPECIFIED: "INVALID_ARGUMENT",
    Reason.LAYOUT_INVALID: "INVALID_ARGUMENT",
    Reason.AGENTS_INVALID: "INVALID_ARGUMENT",
    Reason.BLOCK_ID_NEGATIVE: "INVALID_ARGUMENT",
    Reason.BLOCK_ID_DUPLICATE: "INVALID_ARGUMENT",
    Reason.BLOCK_ID_OUT_OF_RANGE: "OUT_OF_RANGE",
    Reason.TOO_MANY_BLOCKS: "INVALID_ARGUMENT",
    Reason.GENERATION_INVALID: "INVALID_ARGUMENT",
    Reason.TIMEOUT_INVALID: "INVALID_ARGUMENT",
    Reason.OUTCOME_UNSPECIFIED: "INVALID_ARGUMENT",
    Reason.MODE_INVALID: "INVALID_ARGUMENT",
    Reason.LABELS_INVALID: "INVALID_ARGUMENT",
    Reason.BATCH_EMPTY: "INVALID_ARGUMENT",
    Reason.BATCH_TOO_LARGE: "INVALID_ARGUMENT",
    Reason.SEQUENCE_INVALID: "OUT_OF_RANGE",
    Reason.PAGE_TOKEN_INVALID: "INVALID_ARGUMENT",
    Reason.STATE_INVALID: "INVALID_ARGUMENT",
    Reason.ENGINE_NOT_FOUND: "NOT_FOUND",
    Reason.TRANSFER_NOT_FOUND: "NOT_FOUND",
    Reason.ENGINE_CONFLICT: "ALREADY_EXISTS",
    Reason.TARGET_CONFLICT: "ALREADY_EXISTS",
    Reason.CLAIM_CONFLICT: "ALREADY_EXISTS",
    Reason.WRONG_ROLE: "FAILED_PRECONDITION",
    Reason.NOT_PARTICIPANT: "PERMISSION_DENIED",
    Reason.STALE_GENERATION: "FAILED_PRECONDITION",
    Reason.STALE_INCARNATION: "FAILED_PRECONDITION",
    Reason.LEASE_EXPIRED: "FAILED_PRECONDITION",
    Reason.INVALID_STATE: "FAILED_PRECONDITION",
    Reason.TRANSFER_ENDED: "FAILED_PRECONDITION",
    Reason.LAYOUT_MISMATCH: "FAILED_PRECONDITION",
    Reason.BLOCK_MISMATCH: "FAILED_PRECONDITION",
    Reason.TOO_MANY_TRANSFERS: "RESOURCE_EXHAUSTED",
    Reason.TOO_MANY_WATCHERS: "RESOURCE_EXHAUSTED",
    Reason.UNAUTHENTICATED_TOKEN: "UNAUTHENTICATED",
    Reason.IDENTITY_MISMATCH: "PERMISSION_DENIED",
    Reason.ROLE_REQUIRED: "PERMISSION_DENIED",
    Reason.RATE_LIMITED: "RESOURCE_EXHAUSTED",
    Reason.TOO_MANY_CONCURRENT_CALLS: "RESOURCE_EXHAUSTED",
    Reason.STORE_UNAVAILABLE: "UNAVAILABLE",
    Reason.SHUTTING_DOWN: "UNAVAILABLE",
    Reason.INTERNAL_ERROR: "INTERNAL",
    Reason.RANK_INVALID: "INVALID_ARGUMENT",
    Reason.BINDING_INVALID: "PERMISSION_DENIED",
    Reason.BINDING_MISMATCH: "PERMISSION_DENIED",
    Reason.BINDING_REQUIRED: "PERMISSION_DENIED",
    Reason.BUDGET_EXHAUSTED: "RESOURCE_EXHAUSTED",
    Reason.ENGINE_CAPACITY_EXCEEDED: "RESOURCE_EXHAUSTED",
    Reason.CAPACITY_INVALID: "INVALID_ARGUMENT",
    Reason.CREDIT_CONFLICT: "ALREADY_EXISTS",
    Reason.PROGRESSIVE_NEEDS_TOKENS: "INVALID_ARGUMENT",
    Reason.PROGRESSIVE_NEEDS_PUSH: "INVALID_ARGUMENT",
    Reason.PROGRESSIVE_NOT_ACCEPTED: "FAILED_PRECONDITION",
    Reason.TOO_MANY_PARTS: "INVALID_ARGUMENT",
    Reason.PART_OUT_OF_RANGE: "OUT_OF_RANGE",
    Reason.PARTS_OVERLAP: "INVALID_ARGUMENT",
    Reason.PARTS_INCOMPLETE: "INVALID_ARGUMENT",
    Reason.REQUEST_ID_REUSED: "INVALID_ARGUMENT",
    Reason.MESSAGE_INVALID: "INVALID_ARGUMENT",
    Reason.DATA_PLANE_VERSION_UNSUPPORTED: "FAILED_PRECONDITION",
    Reason.PAGE_SIZE_INVALID: "INVALID_ARGUMENT",
    Reason.VIEW_INVALID: "INVALID_ARGUMENT",
    Reason.INDEX_SEQUENCE_GAP: "FAILED_PRECONDITION",
    Reason.INDEX_SEQUENCE_STALE: "FAILED_PRECONDITION",
    Reason.INDEX_PARENT_UNKNOWN: "FAILED_PRECONDITION",
    Reason.INDEX_FULL: "RESOURCE_EXHAUSTED",
    Reason.INDEX_QUERY_TOO_LARGE: "INVALID_ARGUMENT",
    Reason.INDEX_HASHING_MISSING: "FAILED_PRECONDITION",
    Reason.INDEX_HASHING_MISMATCH: "FAILED_PRECONDITION",
    Reason.BLOCK_HASH_INVALID: "INVALID_ARGUMENT",
}
"""The google.rpc.Code name of each reason."""
