"""What engines ask for: the items of registrations, batched transfer calls and credit reservations.

Defined once for the service (which reads them from the wire) and the SDK (which sends them); the one
mapping to and from messages is rendezvous.protocol.convert. A target's fields past its blocks are
keyword-only, so no call can mistake one number for another (a generation for a token count).
Enums a server does not know read as their UNSPECIFIED member, which the service refuses with a reason
(ROLE_UNSPECIFIED, MODE_INVALID, OUTCOME_UNSPECIFIED). Times are seconds; 0 means the server default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field

from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.enums import CompletionOutcome, EngineRole, TransferMode
from rendezvous.protocol.records import EngineCapacity, KvLayout, NixlAgent, WrittenPart


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """A registration: who the engine is, its role, layout and agents. lease_ttl 0 = server default."""

    engine_id: str
    pool: str
    role: EngineRole
    layout: KvLayout = field(default_factory=KvLayout)
    agents: tuple[NixlAgent, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    lease_ttl: float = 0.0
    capacity: EngineCapacity = field(default_factory=EngineCapacity)
    """Consumers: what the engine admits at once (live targets, their blocks); 0 fields: no limit. The
    service refuses RegisterTargets and ReserveCredits beyond it (ENGINE_CAPACITY_EXCEEDED)."""
    _: KW_ONLY
    owner: str = ""
    """The auth identity registering it ("" without auth): set by the server, never sent."""

    def __post_init__(self) -> None:
        if self.capacity.max_transfers < 0 or self.capacity.max_blocks < 0:
            raise ValueError(f"a capacity must not be negative: {self.capacity}")


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """A consumer's destination blocks for one generation of a transfer. timeout 0 = server default."""

    transfer_id: str
    block_ids: Sequence[int]
    _: KW_ONLY
    generation: int = 1
    num_tokens: int = 0
    timeout: float = 0.0
    mode: TransferMode = TransferMode.PUSH
    """PUSH or PULL; UNSPECIFIED as the service reads a mode it does not know (refused: MODE_INVALID)."""
    binding: Binding | None = None
    """The router's binding of the transfer to this consumer (from the request's `kv_transfer_params`)."""
    progressive: bool = False
    """Accept progressive writes: the producer may write parts as their KV is computed (push only, and
    num_tokens must be stated). The consumer still learns of the bytes only from the commit."""


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """A producer's claim on a transfer. timeout 0 = server default."""

    transfer_id: str
    timeout: float = 0.0
    binding: Binding | None = None
    """The router's binding of the transfer to this producer (from the request's `kv_transfer_params`)."""


@dataclass(frozen=True, slots=True)
class SourceReadySpec:
    """A producer's computed source blocks for a transfer."""

    transfer_id: str
    block_ids: Sequence[int]
    binding: Binding | None = None
    """The router's binding, checked by the service when this claims the transfer."""


@dataclass(frozen=True, slots=True)
class CompletionSpec:
    """The outcome of moving a generation's bytes (the producer in push mode, the consumer in pull)."""

    transfer_id: str
    generation: int
    outcome: CompletionOutcome = CompletionOutcome.SUCCEEDED
    """SUCCEEDED or FAILED; UNSPECIFIED is refused (OUTCOME_UNSPECIFIED)."""
    message: str = ""
    ranks: tuple[int, ...] = ()
    """Ranks of a multi-rank engine whose share this reports; () = all. The generation commits once every
    rank reported success; a failure of any rank aborts the transfer."""
    parts: tuple[WrittenPart, ...] = ()
    """With SUCCEEDED, for a progressive transfer: the parts these ranks wrote, which must tile their share
    (every target token x every layer they hold) without overlap; () = the whole share in one write."""


@dataclass(frozen=True, slots=True)
class RevocationAck:
    """A producer's promise not to write a revoked generation."""

    transfer_id: str
    generation: int
    ranks: tuple[int, ...] = ()
    """Producer ranks that make the promise; () = all."""


@dataclass(frozen=True, slots=True)
class ReleaseSpec:
    """A consumer is done with a committed generation of a transfer."""

    transfer_id: str
    generation: int


@dataclass(frozen=True, slots=True)
class AbortSpec:
    """Abort a transfer, with a message for logs and the peer."""

    transfer_id: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class CreditSpec:
    """Reserve credit for one transfer on one consumer engine (`blocks`: the target it will register)."""

    transfer_id: str
    engine_id: str
    blocks: int = 0


__all__ = [
    "AbortSpec",
    "ClaimSpec",
    "CompletionSpec",
    "CreditSpec",
    "EngineSpec",
    "ReleaseSpec",
    "RevocationAck",
    "SourceReadySpec",
    "TargetSpec",
]
