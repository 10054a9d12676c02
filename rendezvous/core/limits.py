"""Explicit, configurable limits and timing defaults of the rendezvous."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""The largest request message a server reads (`--max-message-bytes`; larger: RESOURCE_EXHAUSTED, unread). It is
gRPC's own default receive limit: the largest registration the default limits accept takes 2.8 MiB
(tests/security/test_stall.py), and no response under them reaches it (tests/security/test_sizes.py)."""

DEFAULT_RECEIVE_WINDOW_BYTES = 256 << 10
"""Each call's HTTP/2 receive window: a 4 MiB request refused before it is read costs the server 0.4-0.5 ms
(0.3-0.4 ms at 64 KiB, 0.8-0.9 ms at 1 MiB, 1.9-2.6 ms with gRPC's own probing); a request the server reads
flows at 256 KiB per round trip (over 1 ms, 256 MB/s; on loopback no slower than gRPC's own window)."""


@dataclass(frozen=True)
class Limits:
    """Hard limits; requests beyond them are rejected with a reason, never truncated.

    Three exceptions, because none is worth refusing a call for: an abort or completion message is
    clipped to `max_abort_message_bytes`, a response (a ListEngines or ListTransfers page, a Watch batch) is cut
    before it grows past `max_response_bytes` (the rest follows in the next page or batch), and a MatchPrefixes
    answer's counts stop at the depth of the chain its `max_index_query_lookups` lookups reach. Byte sizes
    are of UTF-8. Under the defaults the largest single engine or event stays under 4 MiB, the receive
    limit of a gRPC client left at its defaults (tests/security/test_sizes.py checks it).

    The memory budget (`max_engines` to `max_agent_metadata_bytes_per_identity`) bounds what the server
    holds in total, whatever each request's size: live engines, block ids of live transfers and agent
    metadata bytes of live engines, over the whole server and per identity (the auth identity that
    registered the engine; without auth only the global budgets apply). The rule is
    `rendezvous.core.budget`; a request over budget is refused with BUDGET_EXHAUSTED. What each unit
    costs, measured in the memory store (docs/security.md, "Limits against abuse"): a block id 40-48 bytes
    (a 65,536-block target 2.6 MiB), an engine about 150 KiB before its agent metadata (10,000 engines held
    1.47 GB), agent metadata its bytes (and in RSS up to as much again: glibc's heap keeps the native copies
    of the requests). Under the defaults the budget allows about 10,000 x 150 KiB (1.5 GiB) of engines,
    25 M x 40-48 B (1-1.1 GiB) of block ids and 1 GiB of agent metadata: more than a fleet holds (a decode
    engine rarely has more than 100,000 KV blocks, and its live targets name at most the blocks it has; a
    per-identity 4 M is 40 such engines with every block in flight), but a bound an operator can lower.
    """

    max_id_length: int = 256
    max_blocks_per_target: int = 65_536
    max_batch_items: int = 4_096
    max_live_transfers_per_engine: int = 100_000
    max_agents_per_engine: int = 256
    max_regions_per_agent: int = 16_384
    max_regions_per_engine: int = 16_384
    max_agent_metadata_bytes: int = 1 << 20
    max_engine_agent_metadata_bytes: int = 2 << 20
    max_labels: int = 64
    max_label_key_bytes: int = 256
    max_label_value_bytes: int = 4_096
    max_labels_bytes: int = 16_384
    max_abort_message_bytes: int = 1_024
    max_events_per_engine: int = 100_000
    max_event_bytes_per_engine: int = 64 << 20
    """The bytes an engine's event log may hold (an event: its transfer's block ids and its peer's agent metadata
    and labels; the Redis store counts the stored text); past it the oldest events go and a watcher behind them
    resyncs. The newest event always stays, whatever its size."""
    max_event_bytes_per_identity: int = 256 << 20
    """The bytes the event logs of one identity's engines may hold together (4 engines at the per-engine bound:
    without it an identity's 1,000 engines could hold 64 GiB); past it that identity's oldest events go first."""
    max_event_bytes_total: int = 1 << 30
    """The bytes all event logs may hold (the agent metadata budget's size, docs/security.md, "Threat model:
    memory"); past it the oldest events of the server go first."""
    max_watchers_per_engine: int = 16
    max_watch_buffer_bytes: int = 128 << 20
    """The bytes of Watch responses their readers have not taken, over the server's streams; past it the
    streams waiting longest are dropped (RESOURCE_EXHAUSTED / BUDGET_EXHAUSTED, rendezvous.server.watch_buffers)."""
    max_list_page: int = 10_000
    max_engine_page: int = 1_000
    default_engine_page: int = 100
    max_response_bytes: int = 2 << 20
    max_engines: int = 10_000
    max_engines_per_identity: int = 1_000
    max_live_blocks: int = 25_000_000
    max_live_blocks_per_identity: int = 4_000_000
    max_agent_metadata_bytes_total: int = 1 << 30
    max_agent_metadata_bytes_per_identity: int = 256 << 20
    max_capacity_transfers: int = 1_000_000
    """The largest EngineCapacity.max_transfers an engine may declare (larger is CAPACITY_INVALID)."""
    max_capacity_blocks: int = 1 << 40
    """The largest EngineCapacity.max_blocks an engine may declare."""
    max_credits_per_engine: int = 1_024
    """The most unexpired credit reservations one consumer engine's ledger may hold (a router reserves for a
    request it is about to send there, and the request's target takes the reservation's place): past it
    ReserveCredits is ENGINE_CAPACITY_EXCEEDED (`limit` "reservations"), whatever the engine's capacity. It bounds
    the ledgers' memory and each reservation's work, which reads every reservation of its engine."""
    max_answer_bytes: int = 1 << 20
    """The largest answer kept for a request_id's retries (AIP-155; RegisterEngine's is kept without the agent
    metadata, regions and labels its request repeats); a larger one is not kept and a retry runs again."""
    max_answers_bytes: int = 256 << 20
    """The bytes all kept answers may hold; past it the oldest go (a retry of theirs runs again)."""
    max_answers_bytes_per_identity: int = 32 << 20
    """The bytes one identity's kept answers may hold; past it that identity's oldest go first."""
    max_parts_per_completion: int = 4_096
    """The most parts one CompletionSpec may report (more is TOO_MANY_PARTS); checking them is O(n log n)."""
    max_parts_per_request: int = 65_536
    """The most parts a CompleteTransfers request may carry over all its completions (more: the request is
    refused with TOO_MANY_PARTS before any part is converted or any transfer looked up)."""
    max_index_blocks_per_engine: int = 1_000_000
    """The blocks the KV index may hold for one engine (KvIndexService; past it a report is INDEX_FULL): more than
    a large engine's prefix cache (a GPU with 80 GiB of KV at 16 tokens a block rarely has 500,000 blocks)."""
    max_index_blocks_total: int = 20_000_000
    """The blocks the KV index may hold over the server (INDEX_FULL past it); about 100 B each in memory or Redis
    (docs/security.md, "Limits against abuse"): 2 GB at the bound."""
    max_index_blocks_per_identity: int = 4_000_000
    """The blocks the KV index may hold for the engines of one identity together (INDEX_FULL past it; the identity
    that registered them, as the memory budget charges it; without auth only the other bounds apply): so one
    identity's engines cannot take the whole server's bound."""
    max_index_blocks_per_request: int = 65_536
    """The most block hashes one ReportCacheEvents or ReplaceCachedBlocks request may carry in all (a larger
    snapshot is refused with INDEX_QUERY_TOO_LARGE: send it as a snapshot and reports)."""
    max_index_query_blocks: int = 4_096
    """The longest chain MatchPrefixes takes (64 Ki tokens at 16 a block); longer is INDEX_QUERY_TOO_LARGE."""
    max_index_query_engines: int = 1_024
    """The most pools, or engine ids, one MatchPrefixes names (INDEX_QUERY_TOO_LARGE past it)."""
    max_index_query_lookups: int = 4_194_304
    """The most block lookups one MatchPrefixes makes (one per selected engine and block looked at): its work, which
    the number of indexed engines would otherwise set. Past it the answer is cut at the depth of the chain the
    lookups reached, never refused (rendezvous.store.cache_index.leading_counts): an engine that holds more counts
    that depth. The default is max_index_query_engines x max_index_query_blocks: a query naming its engines is never
    cut."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {f.name} must be a whole number >= 1, not {value!r}")


@dataclass(frozen=True)
class Timeouts:
    """Timing policy in seconds: leases, how long each half waits, how long records linger."""

    default_lease_ttl: float = 10.0
    min_lease_ttl: float = 1.0
    max_lease_ttl: float = 300.0
    default_target_timeout: float = 60.0
    default_claim_timeout: float = 60.0
    max_timeout: float = 3_600.0
    release_timeout: float = 120.0
    tombstone_ttl: float = 300.0
    default_credit_ttl: float = 30.0
    """How long an unspent credit reservation lasts when ReserveCredits names no ttl (max: max_timeout)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"timeout {f.name} must be a finite number of seconds > 0, not {value!r}")
        if not self.min_lease_ttl <= self.default_lease_ttl <= self.max_lease_ttl:
            raise ValueError(
                f"lease TTLs must be ordered min <= default <= max, not {self.min_lease_ttl:g} <= "
                f"{self.default_lease_ttl:g} <= {self.max_lease_ttl:g}"
            )
