"""Role helpers: what a router, a producer (prefill) and a consumer (decode) engine each call."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import ClassVar

from rendezvous.clients._config import SessionConfig
from rendezvous.clients._session import EngineSession, EventHandler
from rendezvous.clients._types import (
    ClaimSpec,
    EngineCapacity,
    EngineRole,
    EngineSpec,
    ItemResult,
    KvLayout,
    NixlAgentInfo,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)
from rendezvous.clients.aio import AsyncRendezvousClient


def mint_transfer_id() -> str:
    """A fresh transfer id (a uuid4 in hex). Mint a new one for every attempt of a request."""
    return uuid.uuid4().hex


class RoleSession(EngineSession):
    """An engine session of one role (the subclass's `role`), registered from keyword arguments."""

    role: ClassVar[EngineRole]

    def __init__(
        self,
        client: AsyncRendezvousClient,
        engine_id: str,
        pool: str,
        *,
        layout: KvLayout | None = None,
        agents: Sequence[NixlAgentInfo] = (),
        labels: Mapping[str, str] | None = None,
        lease_ttl: float = 0.0,
        config: SessionConfig | None = None,
        handler: EventHandler | None = None,
        capacity: EngineCapacity | None = None,
    ) -> None:
        spec = EngineSpec(
            engine_id,
            pool,
            self.role,
            layout or KvLayout(),
            tuple(agents),
            dict(labels or {}),
            lease_ttl,
            capacity or EngineCapacity(),
        )
        super().__init__(client, spec, config=config, handler=handler)


class ConsumerSession(RoleSession):
    """A consumer (decode) engine: registers destination blocks and releases them once used.

    In pull mode the consumer also reports completions (`complete_transfers`).
    """

    role = EngineRole.CONSUMER

    async def register_targets(self, targets: Sequence[TargetSpec]) -> list[ItemResult]:
        """Register destination blocks; they are re-asserted until committed, released or aborted.

        A refused item is returned, not raised.
        """
        return await self._call(self._client.register_targets, targets, self._live.targets)

    async def register_target(self, target: TargetSpec) -> ItemResult:
        """Register one transfer's destination blocks; raises the item's error."""
        return (await self.register_targets((target,)))[0].raise_for_error()

    async def release_targets(self, releases: Sequence[ReleaseSpec]) -> list[ItemResult]:
        """Release committed transfers (their blocks are the consumer's again).

        Release a transfer after its TRANSFER_COMMITTED event, not on the data plane's notification: that
        usually comes before the producer's CompleteTransfers, and a release then is refused INVALID_STATE (it
        changes nothing; do not abort on it, the bytes are in). Not released, a commit is released after the
        server's release timeout. `rendezvous.clients.nixl.ConsumerAgent` releases for the engine: never call this for a
        transfer registered through it.
        A transfer that committed before a server restart is unknown afterwards: its release
        answers TRANSFER_NOT_FOUND, which only means there is nothing left to release.
        A refused item is returned, not raised.
        """
        return await self._call(self._client.release_targets, releases)

    async def release_target(self, release: ReleaseSpec) -> ItemResult:
        """Release one committed transfer; raises the item's error."""
        return (await self.release_targets((release,)))[0].raise_for_error()


class ProducerSession(RoleSession):
    """A producer (prefill) engine: claims transfers, reports ready sources, completions and revocations."""

    role = EngineRole.PRODUCER

    async def claim_transfers(self, claims: Sequence[ClaimSpec]) -> list[ItemResult]:
        """Claim transfers; claims are re-asserted until the transfer commits or aborts.

        A refused item is returned, not raised.
        """
        return await self._call(self._client.claim_transfers, claims, self._live.claims)

    async def claim_transfer(self, claim: ClaimSpec) -> ItemResult:
        """Claim one transfer; raises the item's error."""
        return (await self.claim_transfers((claim,)))[0].raise_for_error()

    async def mark_sources_ready(self, sources: Sequence[SourceReadySpec]) -> list[ItemResult]:
        """Report computed source blocks (claiming if needed); re-asserted until the transfer ends.

        A refused item is returned, not raised.
        """
        return await self._call(self._client.mark_sources_ready, sources, self._live.sources)

    async def mark_source_ready(self, source: SourceReadySpec) -> ItemResult:
        """Report one transfer's computed source blocks; raises the item's error."""
        return (await self.mark_sources_ready((source,)))[0].raise_for_error()

    async def acknowledge_revocations(
        self, acks: Sequence[RevocationAck], *, revoked_to: tuple[int, int] | None = None
    ) -> list[ItemResult]:
        """Confirm revoked generations will not be written (never started, or drained).

        A refused item is returned, not raised. `revoked_to`: the incarnation (`(epoch, incarnation)`: its
        `events_incarnation` when it was told of the revocations) whose revocations these acks answer; sent as it
        only, as `complete_transfers`'s `assigned_to` (once it was replaced, refused here with STALE_INCARNATION,
        unsent). None: sent as the current incarnation.
        """
        return await self._acknowledge_revocations(acks, revoked_to)

    async def acknowledge_revocation(self, ack: RevocationAck) -> ItemResult:
        """Confirm one revoked generation will not be written; raises the item's error."""
        return (await self.acknowledge_revocations((ack,)))[0].raise_for_error()
