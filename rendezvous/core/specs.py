"""What engines ask for: the inputs of registrations and transfer operations."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rendezvous.core.model import EngineCapacity, KvLayout, Mode, NixlAgent, Outcome, Role
from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.records import WrittenPart


@dataclass(frozen=True)
class EngineSpec:
    """A registration: who the engine is, its layout and agents. lease_ttl 0 = server default."""

    engine_id: str
    pool: str
    role: Role | None
    layout: KvLayout = field(default_factory=KvLayout)
    agents: tuple[NixlAgent, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    lease_ttl: float = 0.0
    owner: str = ""
    """The auth identity registering it ("" without auth); set by the server, not the request."""
    capacity: EngineCapacity = field(default_factory=EngineCapacity)
    """What a consumer admits at once (rendezvous.core.credits); zero fields: no limit."""


@dataclass(frozen=True)
class TargetSpec:
    """A consumer's destination blocks for a transfer. timeout 0 = server default."""

    transfer_id: str
    block_ids: tuple[int, ...]
    generation: int = 1
    num_tokens: int = 0
    timeout: float = 0.0
    # None: a mode this server does not know (rejected with MODE_INVALID).
    mode: Mode | None = Mode.PUSH
    binding: Binding | None = None
    """The router's binding of the transfer (rendezvous.core.bindings); None: none was sent."""
    progressive: bool = False
    """The consumer accepts progressive writes (push only, num_tokens > 0)."""


@dataclass(frozen=True)
class ClaimSpec:
    """A producer's claim on a transfer. timeout 0 = server default."""

    transfer_id: str
    timeout: float = 0.0
    binding: Binding | None = None
    """The router's binding of the transfer (rendezvous.core.bindings); None: none was sent."""


@dataclass(frozen=True)
class SourceReadySpec:
    """A producer's computed source blocks for a transfer."""

    transfer_id: str
    block_ids: tuple[int, ...]
    binding: Binding | None = None
    """The router's binding, checked when the call would claim the transfer; None: none was sent."""


@dataclass(frozen=True)
class CompletionSpec:
    """The outcome of moving a generation's bytes. outcome None = unspecified (rejected)."""

    transfer_id: str
    generation: int
    outcome: Outcome | None
    message: str = ""
    ranks: tuple[int, ...] = ()
    """Ranks of the moving engine whose share this reports; () = all of them."""
    parts: tuple[WrittenPart, ...] = ()
    """With SUCCEEDED, the parts the ranks wrote progressively (rendezvous.core.parts); () = one whole write."""


@dataclass(frozen=True)
class RevocationAck:
    """A producer's promise not to write a revoked generation."""

    transfer_id: str
    generation: int
    ranks: tuple[int, ...] = ()
    """Producer ranks that make the promise; () = all of them."""


@dataclass(frozen=True)
class ReleaseSpec:
    """A consumer is done with a committed transfer."""

    transfer_id: str
    generation: int


@dataclass(frozen=True)
class AbortSpec:
    """Abort a transfer, with a message for logs and the peer."""

    transfer_id: str
    message: str = ""
