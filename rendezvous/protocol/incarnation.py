"""`Incarnation`: what the service and the SDK both know of a registered engine incarnation.

The service's `Engine` (rendezvous.core.model) adds its lease and fencing state; the SDK's `EngineInfo`
(clients) adds what the server reports with it. Both extend this record, so its fields exist once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rendezvous.protocol.enums import EngineRole
from rendezvous.protocol.records import KvLayout, NixlAgent


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
