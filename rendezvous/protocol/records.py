"""The protocol's records that service and SDK share as they are: an engine's KV layout, its memory
regions and its NIXL agents, a consumer's capacity and its use, a transfer's moments and a progressive write's parts.
Frozen and plain Python (no protobuf); rendezvous.protocol.convert maps them to and from the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.protocol.enums import MemoryKind


@dataclass(frozen=True, slots=True)
class KvLayout:
    """An engine's KV cache shape; producer and consumer layouts must agree for a transfer to match."""

    model_fingerprint: str = ""
    dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    tp_size: int = 1
    pp_size: int = 1
    kv_layout: str = ""
    num_kv_heads: int = 0
    """KV heads of the whole model; TP rank r holds the r-th of tp_size equal slices. 0 = not stated."""
    data_plane_version: int = 0
    """The data-plane format the engine's connector speaks (rendezvous.protocol.dataplane). 0 = not stated (1)."""


@dataclass(frozen=True, slots=True)
class KvRegion:
    """A registered memory region of equally sized blocks: block b starts at base + b * stride."""

    base_address: int
    block_stride_bytes: int
    block_length_bytes: int
    num_blocks: int
    device_id: int = 0


@dataclass(frozen=True, slots=True)
class NixlAgent:
    """The data-plane identity of one rank: NIXL agent name, serialized metadata and KV regions."""

    name: str
    metadata: bytes
    rank: int = 0
    memory_kind: MemoryKind = MemoryKind.DRAM
    regions: tuple[KvRegion, ...] = ()
    first_layer: int = 0
    """First layer this rank holds (its pipeline stage's first)."""
    num_layers: int = 0
    """Layers this rank holds; 0 = all of the layout's (pipeline parallel size 1)."""


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """What a consumer engine admits at once: live targets (transfers) and their blocks, reservations
    included. 0 = no limit."""

    max_transfers: int = 0
    max_blocks: int = 0

    @property
    def limited(self) -> bool:
        """Whether either limit is set."""
        return bool(self.max_transfers or self.max_blocks)


@dataclass(frozen=True, slots=True)
class EngineCredits:
    """What of a consumer's capacity is spent, as the service counts it: live targets and reservations."""

    transfers_in_use: int = 0
    blocks_in_use: int = 0
    transfers_reserved: int = 0
    blocks_reserved: int = 0

    @property
    def transfers(self) -> int:
        """Transfers spent: live targets and reservations."""
        return self.transfers_in_use + self.transfers_reserved

    @property
    def blocks(self) -> int:
        """Blocks spent: of live targets and of reservations."""
        return self.blocks_in_use + self.blocks_reserved


@dataclass(frozen=True, slots=True)
class WrittenPart:
    """One part of a progressive write: tokens [first_token, +num_tokens) of the target (0 = its first token)
    x layers [first_layer, +num_layers) of the model; num_layers 0 = every layer the writing ranks hold (then
    first_layer is 0). The service checks a completion's parts (rendezvous.core.parts) and keeps none."""

    first_token: int
    num_tokens: int
    first_layer: int = 0
    num_layers: int = 0


@dataclass(frozen=True, slots=True)
class TransferTimes:
    """When each phase of a transfer began, in seconds since the Unix epoch (the service's wall clock; 0.0 = not
    yet). Named as the wire's `TransferTimes` fields."""

    target_time: float = 0.0
    claim_time: float = 0.0
    match_time: float = 0.0
    source_ready_time: float = 0.0
    commit_time: float = 0.0
    end_time: float = 0.0
