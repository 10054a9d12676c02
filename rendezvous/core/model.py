"""Domain records of the rendezvous: engines, transfers and events.

Records are immutable; transitions return new records. Enum values equal the
protocol's so the wire mapping is a cast. Times are seconds since the Unix epoch
(wall clock, shared by every replica of a Redis-backed deployment).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum


class Role(IntEnum):
    """Which side of a transfer an engine plays."""

    PRODUCER = 1
    CONSUMER = 2


class MemoryKind(IntEnum):
    """Where an engine's KV regions live."""

    DRAM = 1
    VRAM = 2


class State(IntEnum):
    """Lifecycle state of a transfer."""

    TARGETED = 1
    CLAIMED = 2
    MATCHED = 3
    COMMITTED = 4
    RELEASED = 5
    ABORTED = 6

    @property
    def terminal(self) -> bool:
        """Released and aborted transfers are tombstones: kept briefly, never revived."""
        return self in (State.RELEASED, State.ABORTED)


LIVE_STATES = (State.TARGETED, State.CLAIMED, State.MATCHED, State.COMMITTED)


class Mode(IntEnum):
    """Which side moves the bytes."""

    PUSH = 1
    PULL = 2


class AbortReason(IntEnum):
    """Why a transfer was aborted."""

    NONE = 0
    REQUESTED = 1
    DEADLINE_EXCEEDED = 2
    PEER_LOST = 3
    LAYOUT_MISMATCH = 4
    TRANSFER_FAILED = 5
    BLOCK_MISMATCH = 6


class EventType(IntEnum):
    """Kinds of engine events."""

    TRANSFER_ASSIGNED = 1
    TRANSFER_REVOKED = 2
    SOURCE_READY = 3
    TRANSFER_COMMITTED = 4
    TRANSFER_ABORTED = 5
    PEER_LOST = 6
    REVOCATION_CONFIRMED = 7


class Outcome(IntEnum):
    """Result of moving a generation's bytes."""

    SUCCEEDED = 1
    FAILED = 2


@dataclass(frozen=True)
class KvLayout:
    """An engine's KV cache shape; producer and consumer must agree to match."""

    model_fingerprint: str = ""
    dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    tp_size: int = 1
    pp_size: int = 1
    kv_layout: str = ""


@dataclass(frozen=True)
class KvRegion:
    """A registered region of equally sized blocks: block b starts at base + b * stride."""

    base_address: int
    block_stride_bytes: int
    block_length_bytes: int
    num_blocks: int
    device_id: int = 0


@dataclass(frozen=True)
class NixlAgent:
    """The data-plane identity of one rank: NIXL agent name, metadata and regions."""

    name: str
    metadata: bytes
    rank: int = 0
    memory_kind: MemoryKind = MemoryKind.DRAM
    regions: tuple[KvRegion, ...] = ()


@dataclass(frozen=True)
class Engine:
    """A registered engine incarnation and its lease."""

    engine_id: str
    pool: str
    role: Role
    layout: KvLayout
    agents: tuple[NixlAgent, ...]
    labels: Mapping[str, str]
    incarnation: int
    lease_ttl: float
    lease_expires_at: float
    registered_at: float
    # When the incarnation ended (deregistered, expired or replaced); 0.0 while live.
    ended_at: float = 0.0

    def alive(self, now: float) -> bool:
        """True while the lease holds and the incarnation has not ended."""
        return not self.ended_at and self.lease_expires_at > now

    def num_blocks(self) -> int | None:
        """Blocks addressable in every region of every agent, or None when no region is published."""
        counts = [r.num_blocks for a in self.agents for r in a.regions]
        return min(counts) if counts else None


@dataclass(frozen=True)
class TransferTimes:
    """When each phase began (0.0 = not yet)."""

    target: float = 0.0
    claim: float = 0.0
    match: float = 0.0
    source_ready: float = 0.0
    commit: float = 0.0
    end: float = 0.0


@dataclass(frozen=True)
class Transfer:
    """One transfer, keyed by its router-minted id."""

    transfer_id: str
    state: State
    deadline: float
    mode: Mode = Mode.PUSH
    generation: int = 0
    consumer_engine_id: str = ""
    consumer_incarnation: int = 0
    producer_engine_id: str = ""
    producer_incarnation: int = 0
    target_block_ids: tuple[int, ...] = ()
    source_block_ids: tuple[int, ...] | None = None
    num_tokens: int = 0
    abort_reason: AbortReason = AbortReason.NONE
    abort_message: str = ""
    # Generation the producer was told to write and may still be writing; 0 when none.
    assigned_generation: int = 0
    # Generation revoked from the producer and not yet acknowledged; 0 when none.
    revoking_generation: int = 0
    times: TransferTimes = field(default_factory=TransferTimes)

    @property
    def unsettled(self) -> bool:
        """True while the transfer still ties up its engines: live, or ended with a revoked generation
        the producer has not let go of (the consumer's blocks stay pinned until it does or is lost)."""
        return not self.state.terminal or bool(self.revoking_generation)

    def participants(self) -> tuple[str, ...]:
        """Engine ids taking part, consumer first."""
        return tuple(e for e in (self.consumer_engine_id, self.producer_engine_id) if e)

    def counterpart(self, engine_id: str) -> str:
        """The other participant's engine id, or "" when there is none yet."""
        if engine_id == self.consumer_engine_id:
            return self.producer_engine_id
        if engine_id == self.producer_engine_id:
            return self.consumer_engine_id
        return ""


@dataclass(frozen=True)
class Event:
    """A change that concerns one engine; the store assigns its revision."""

    type: EventType
    time: float
    transfer: Transfer | None = None
    generation: int = 0
    peer: Engine | None = None
    revision: int = 0


@dataclass(frozen=True)
class Addressed:
    """An event and the engine whose log it goes to."""

    engine_id: str
    event: Event
