"""The KV index's vocabulary (KvIndexService, proto/rendezvous/v1/index.proto): what engines report of their prefix
caches and what routers are answered.

The events are vLLM's KV events (vllm/distributed/kv_events.py: BlockStored, BlockRemoved, AllBlocksCleared) less
what the index does not keep (token ids, LoRA and medium). Defined once for the service and the SDK; the mapping to
and from messages is rendezvous.protocol.index_wire. A block hash is the engine's own bytes (1 to 32), or, for
engines that send 64-bit integer hashes, their 8 bytes big-endian (`hash_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.protocol.enums import EngineRole

MAX_HASH_BYTES = 32
"""The longest block hash (vLLM's sha256 digests)."""


def hash_of(block_hash: bytes | int) -> bytes:
    """A block hash as the protocol carries it: bytes as they are, an integer (vLLM's ExternalBlockHash with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) as its 8 bytes big-endian."""
    if isinstance(block_hash, int):
        return block_hash.to_bytes(8, "big")
    return block_hash


@dataclass(frozen=True, slots=True)
class BlockHashing:
    """How an engine hashes its blocks, so a router computes the same chain (BlockHashing in index.proto)."""

    algorithm: str
    seed: str = ""
    block_size: int = 16
    integer_hashes: bool = False


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive blocks of one chain now held; the first's parent is `parent` (b"" for a chain's first block)."""

    block_hashes: tuple[bytes, ...]
    parent: bytes = b""
    group: int = 0
    token_count: int = 0


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks no longer held."""

    block_hashes: tuple[bytes, ...]
    group: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing held any more."""


CacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared
"""One change to an engine's cache."""


@dataclass(frozen=True, slots=True)
class CacheReport:
    """One numbered batch of an engine's cache events (ReportCacheEvents); hashing is required on an entry's
    first batch."""

    engine_id: str
    sequence: int
    events: tuple[CacheEvent, ...]
    hashing: BlockHashing | None = None
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """Everything an engine holds as of the event numbered sequence (ReplaceCachedBlocks): hashes by group."""

    engine_id: str
    sequence: int
    hashing: BlockHashing
    groups: tuple[tuple[int, tuple[bytes, ...]], ...]
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class IndexPosition:
    """Where an engine's entry stands after a report or snapshot."""

    sequence: int
    block_count: int
    duplicate: bool = False
    left_out: int = 0
    """A snapshot's blocks not indexed, its last ones as sent: past the server's max_index_blocks_per_engine, or the
    room its identity's or the server's bound left."""
    cut_by: str = ""
    """The bound that cut a snapshot (left_out > 0): "engine" (max_index_blocks_per_engine, the engine's own),
    "identity" or "server" (shared with other engines: room may free without this engine evicting anything); ""
    when it was indexed whole, and from a server older than the field."""


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """Which engines hold how much of a chain (MatchPrefixes): engine_ids, else every indexed engine, narrowed by
    pools and role, and to those holding at least min_matched leading blocks."""

    block_hashes: tuple[bytes, ...]
    group: int = 0
    pools: tuple[str, ...] = ()
    engine_ids: tuple[str, ...] = ()
    role: EngineRole | None = None
    min_matched: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One indexed engine's answer: how many leading blocks of the chain it holds. `at_least`: the server's lookups
    (max_index_query_lookups) stopped at this depth of the chain, so the engine holds matched_blocks or more."""

    engine_id: str
    pool: str
    role: EngineRole
    matched_blocks: int
    hashing: BlockHashing
    sequence: int
    incarnation: int
    at_least: bool = False
