"""`TransferRecord`: what the service and the SDK both know of one transfer.

The service's `Transfer` (rendezvous.core.model) adds the fencing state it never reports
(`assigned_generation`) and a tombstone's block digests; the SDK's `TransferInfo` (clients) is what a
server reports. Both extend this record, so its fields exist once, as `Incarnation` serves engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rendezvous.protocol.enums import AbortReason, TransferMode, TransferState
from rendezvous.protocol.records import TransferTimes


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One transfer, keyed by its router-minted id: its state, generation, both halves and moments."""

    transfer_id: str
    state: TransferState
    deadline: float = 0.0
    """When the transfer aborts unless it ended (seconds since the Unix epoch); 0.0: not reported."""
    mode: TransferMode = TransferMode.PUSH
    generation: int = 0
    consumer_engine_id: str = ""
    consumer_incarnation: int = 0
    producer_engine_id: str = ""
    producer_incarnation: int = 0
    target_block_ids: tuple[int, ...] = ()
    source_block_ids: tuple[int, ...] | None = None
    """The producer's source blocks (pull); None while it has not said them (the service's record only)."""
    num_tokens: int = 0
    abort_reason: AbortReason = AbortReason.UNSPECIFIED
    abort_message: str = ""
    revoking_generation: int = 0
    """A generation revoked from the producer and not yet acknowledged (it may still be writing it); 0: none."""
    times: TransferTimes = field(default_factory=TransferTimes)
    reported_ranks: tuple[int, ...] = ()
    """Ranks of the moving engine that reported the generation in flight so far, sorted. A multi-rank
    engine's generation commits, or its revocation is confirmed, once every rank is here."""
    progressive: bool = False
    """The consumer accepts progressive writes of the current generation (`TargetSpec.progressive`): the
    producer may write it in parts and report them (`CompletionSpec.parts`); otherwise it writes the whole
    generation at once."""
