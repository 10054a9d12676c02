"""`Event`: one change that concerns an engine, as the service logs it and as the SDK reads it from a Watch.

One type for both: the service's events carry its own records (`Event[Transfer, Engine]`), the SDK's the views
it reads back (`Event[TransferInfo, EngineInfo]`). Its `sequence` is the event's position in its engine's log
(1, 2, 3, ...; the store assigns it), not the store-wide revision of response headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from rendezvous.protocol.enums import EventType
from rendezvous.protocol.incarnation import Incarnation
from rendezvous.protocol.transfer import TransferRecord

T = TypeVar("T", bound=TransferRecord)
E = TypeVar("E", bound=Incarnation)


@dataclass(frozen=True, slots=True)
class Event(Generic[T, E]):
    """A change that concerns one engine: its type and time, the transfer it is about, the generation, the peer
    engine (with its agents, for an assignment or a loss) and its position in the engine's log."""

    type: EventType
    time: float
    transfer: T | None = None
    generation: int = 0
    peer: E | None = None
    sequence: int = 0
