"""`Incarnation`: what the service and the SDK both know of a registered engine incarnation, and `EngineInfo`,
the view of one that the service reports (GetEngine, ListEngines, an event's peer).

The service's `Engine` (rendezvous.core.model) adds its lease and fencing state to `Incarnation`; `EngineInfo`
adds what the server reports with it. Both extend this record, so its fields exist once; the one mapping of
an engine to and from the wire is rendezvous.protocol.convert's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rendezvous.protocol.enums import EngineRole
from rendezvous.protocol.records import EngineCapacity, EngineCredits, KvLayout, NixlAgent


@dataclass(frozen=True, slots=True)
class Incarnation:
    """One incarnation of an engine: what it registered and the lease TTL it was granted."""

    engine_id: str
    pool: str
    role: EngineRole
    layout: KvLayout
    agents: tuple[NixlAgent, ...]
    labels: Mapping[str, str]
    incarnation: int
    lease_ttl: float


@dataclass(frozen=True, slots=True)
class EngineInfo(Incarnation):
    """A registered engine incarnation as the server reports it."""

    lease_expire_time: float
    live_transfers: int
    register_time: float
    watch_start_sequence: int = 0
    """A Watch from here sees every event of this incarnation (how an engine's other ranks follow it)."""
    capacity: EngineCapacity = field(default_factory=EngineCapacity)
    """What the engine admits at once (0 fields: no limit)."""
    credits: EngineCredits = field(default_factory=EngineCredits)
    """What of the capacity is in use and reserved (as of the listing)."""
    lease_remaining: float | None = None
    """Seconds left of the lease when the server answered, by the clock that lapses it (RegisterEngine, GetEngine
    and ListEngines answers); None in an event's peer and from a server older than the field."""

    @property
    def free_transfers(self) -> int | None:
        """Transfers the engine has room for (capacity - in use - reserved, not below 0); None: no limit."""
        if not self.capacity.max_transfers:
            return None
        return max(self.capacity.max_transfers - self.credits.transfers, 0)

    @property
    def free_blocks(self) -> int | None:
        """Blocks the engine has room for; None: no limit."""
        if not self.capacity.max_blocks:
            return None
        return max(self.capacity.max_blocks - self.credits.blocks, 0)

    def has_credit(self, blocks: int = 0) -> bool:
        """Whether one more transfer of `blocks` fits in what is free (always, without a capacity)."""
        transfers, free_blocks = self.free_transfers, self.free_blocks
        return (transfers is None or transfers > 0) and (free_blocks is None or free_blocks >= blocks)
