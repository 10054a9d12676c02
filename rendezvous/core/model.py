"""Domain records of the rendezvous: engines, transfers and events.

Records are immutable; transitions return new records. Enum values equal the
protocol's so the wire mapping is a cast. Times are seconds since the Unix epoch
(wall clock, shared by every replica of a Redis-backed deployment).
"""

from __future__ import annotations

import hashlib
import types
from array import array
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

from rendezvous.protocol.enums import (
    LIVE_STATES,
    AbortReason,
    CompletionOutcome,
    EngineRole,
    EventType,
    MemoryKind,
    TransferMode,
    TransferState,
)
from rendezvous.protocol.events import Event
from rendezvous.protocol.incarnation import Incarnation
from rendezvous.protocol.records import EngineCapacity, KvLayout, KvRegion, NixlAgent, TransferTimes
from rendezvous.protocol.transfer import TransferRecord

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "LIVE_STATES",
    "AbortReason",
    "Addressed",
    "Engine",
    "EngineCapacity",
    "Event",
    "EventType",
    "KvLayout",
    "KvRegion",
    "MemoryKind",
    "Mode",
    "NixlAgent",
    "Outcome",
    "Role",
    "State",
    "Transfer",
    "TransferTimes",
    "evolve",
    "keywords",
    "positional",
]

# The protocol's vocabulary under the names the core speaks (same objects, not copies).
Role = EngineRole
State = TransferState
Mode = TransferMode
Outcome = CompletionOutcome


@dataclass(frozen=True)
class Engine(Incarnation):
    """A registered engine incarnation and its lease."""

    lease_expires_at: float
    registered_at: float
    # When the incarnation ended (deregistered, expired or replaced); 0.0 while live.
    ended_at: float = 0.0
    # The incarnation this one replaced while the loss of that one's transfers is not known to be
    # applied (0 when none): whoever finds it set (re-registration, keep-alive, sweep) applies it.
    unlost_incarnation: int = 0
    # A sequence from which a watch sees all of this incarnation's events (its ranks that did not register
    # follow it from here).
    watch_start_sequence: int = 0
    # The auth identity that registered this incarnation ("" without auth): the memory budget's per-identity
    # tallies charge it (rendezvous.core.budget).
    owner: str = ""
    # What a consumer admits at once (rendezvous.core.credits); no limit by default.
    capacity: EngineCapacity = field(default_factory=EngineCapacity)

    def alive(self, now: float) -> bool:
        """True while the lease holds and the incarnation has not ended."""
        return not self.ended_at and self.lease_expires_at > now

    def num_blocks(self) -> int | None:
        """Blocks addressable in every region of every agent, or None when no region is published."""
        counts = [r.num_blocks for a in self.agents for r in a.regions]
        return min(counts) if counts else None


@dataclass(frozen=True, slots=True)
class Transfer(TransferRecord):
    """One transfer as the service keeps it: what it reports (`TransferRecord`) and its fencing state.

    `reported_ranks` names the ranks that reported `assigned_generation`, or `revoking_generation` while one
    is pending (never both at once); in pull, the consumer ranks that reported `generation`. `source_block_ids`
    is None until the producer says them.
    """

    deadline: float  # every stored transfer has one (it stays in its place: third)
    # Generation the producer was told to write and may still be writing; 0 when none.
    assigned_generation: int = 0
    # A tombstone's block ids, as digests ("<target>:<source>", `blocks_digest`; "" while the record holds
    # them): an ended transfer keeps no block ids (up to megabytes each, for tombstone_ttl), only enough to
    # tell a retried call with the same blocks from one with others.
    block_digests: str = ""

    @property
    def unsettled(self) -> bool:
        """True while the transfer still ties up its engines: live, or ended with a revoked generation
        the producer has not let go of (the consumer's blocks stay pinned until it does or is lost)."""
        return not self.state.terminal or bool(self.revoking_generation)

    def participants(self) -> tuple[str, ...]:
        """Engine ids taking part, consumer first."""
        consumer, producer = self.consumer_engine_id, self.producer_engine_id
        if consumer and producer:
            return (consumer, producer)
        return (consumer,) if consumer else (producer,) if producer else ()

    def counterpart(self, engine_id: str) -> str:
        """The other participant's engine id, or "" when there is none yet."""
        if engine_id == self.consumer_engine_id:
            return self.producer_engine_id
        if engine_id == self.producer_engine_id:
            return self.consumer_engine_id
        return ""


def blocks_digest(blocks: tuple[int, ...] | None) -> str:
    """A stable digest of block ids ("" for None: not given)."""
    if blocks is None:
        return ""
    return hashlib.blake2b(array("q", blocks).tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True, slots=True)
class Addressed:
    """An event and the engine whose log it goes to."""

    engine_id: str
    event: Event[Transfer, Engine]


R = TypeVar("R", Transfer, TransferTimes, Event[Transfer, Engine])
_KEEP: Any = object()
"""A parameter not given (a copy keeps the record's value; a factory default is made)."""
Record = TypeVar("Record", bound="DataclassInstance")
"""Any frozen slots dataclass a builder makes (`positional`, `keywords`): the hot path's records and values."""


def _builder(
    cls: type[Record], parameters: str, value: Callable[[Field[Any]], str], names: Mapping[str, Any] | None = None
) -> Callable[..., Record]:
    """A generated function `(parameters)` that builds a `cls` (a frozen slots dataclass without
    `__post_init__`, or one that extends one such as `Transfer` does) whose field `f` is the expression
    `value(f)`; `names` are what the parameters' defaults and the expressions may name.

    The record is built as an instance of a class with the same slots and base whose attributes are plainly
    settable (so each field costs one plain attribute store, not a frozen `object.__setattr__` call: ~0.3 us a
    Transfer instead of ~3.7 us for `dataclasses.replace`) and then becomes a `cls`, which the same layout
    allows.
    """
    every = fields(cls)
    base = cls.__mro__[1]  # object, Generic (Event), or the one record cls extends
    inherited = tuple(getattr(base, "__slots__", ()))
    slots: tuple[str, ...] = cls.__dict__["__slots__"]
    assert len(cls.__mro__) <= 3 and inherited + slots == tuple(f.name for f in every), f"{cls.__name__}: slots"
    assert not hasattr(cls, "__post_init__"), f"{cls.__name__}: no __post_init__"
    # Both of object's own: CPython fills a type's one setattr slot from __setattr__ and __delattr__ together,
    # and a frozen base's Python __delattr__ alone would make every store a Python-level call (~2.7x evolve).
    own = {"__slots__": slots, "__setattr__": object.__setattr__, "__delattr__": object.__delattr__}
    # A generic record's own bases (Generic[...]): plain Generic cannot be subclassed, and the layouts must match.
    bases = cls.__dict__.get("__orig_bases__", (base,))
    settable = types.new_class(f"_Settable{cls.__name__}", bases, exec_body=lambda namespace: namespace.update(own))
    lines = [f"def build({parameters}):", "    new = _new(_settable)"]
    lines += [f"    new.{f.name} = {value(f)}" for f in every]
    lines += ["    new.__class__ = _cls", "    return new"]
    namespace: dict[str, Any] = {"_KEEP": _KEEP, "_new": object.__new__, "_settable": settable, "_cls": cls}
    namespace.update(names or {})
    exec("\n".join(lines), namespace)  # generated from the dataclass's own field names, as dataclasses does
    build: Callable[..., Record] = namespace["build"]
    return build


def _copier(cls: type[R]) -> Callable[..., R]:
    """A function (record, **changes) -> a copy of record with changes (an unknown field name is a TypeError,
    as in `dataclasses.replace`)."""
    keep = ", ".join(f"{f.name}=_KEEP" for f in fields(cls))
    return _builder(cls, f"record, *, {keep}", lambda f: f"record.{f.name} if {f.name} is _KEEP else {f.name}")


def positional(cls: type[Record]) -> Callable[..., Record]:
    """`cls(*values)` with every field given, in order, without the frozen `__init__`'s cost (the Redis
    store's codec decodes records with it; the coordinator builds a batch item's values with it)."""
    return _builder(cls, ", ".join(f.name for f in fields(cls)), lambda f: f.name)


def keywords(cls: type[Record]) -> Callable[..., Record]:
    """`cls(**values)`, the fields not given at the class's defaults, without the frozen `__init__`'s cost (a
    transition's new records)."""
    names: dict[str, Any] = {}
    parameters = []
    for f in fields(cls):
        if f.default is not MISSING:
            names[f"_default_{f.name}"] = f.default
            parameters.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            names[f"_factory_{f.name}"] = f.default_factory
            parameters.append(f"{f.name}=_KEEP")
        else:
            parameters.append(f.name)

    def value(f: Field[Any]) -> str:
        return f.name if f.default_factory is MISSING else f"_factory_{f.name}() if {f.name} is _KEEP else {f.name}"

    return _builder(cls, "*, " + ", ".join(parameters), value, names)


_COPIERS: dict[type, Callable[..., Any]] = {cls: _copier(cls) for cls in (Transfer, TransferTimes, Event)}


def evolve(record: R, **changes: Any) -> R:
    """`dataclasses.replace` for the records transitions copy on every step (Transfer, TransferTimes, Event),
    at a fraction of its cost: every field as it is (none has an `__init__`-only meaning), then the changes."""
    result: R = _COPIERS[type(record)](record, **changes)
    return result
