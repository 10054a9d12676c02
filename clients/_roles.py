"""Role helpers: what a router, a producer (prefill) and a consumer (decode) engine each call."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence

from clients._config import SessionConfig
from clients._exceptions import NotFound
from clients._session import EngineSession, EventHandler
from clients._types import (
    AbortSpec,
    ClaimSpec,
    EngineInfo,
    EngineRole,
    EngineSpec,
    ItemResult,
    KvLayout,
    NixlAgentInfo,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
)
from clients.aio import AsyncRendezvousClient


def mint_transfer_id() -> str:
    """A fresh transfer id (a uuid4 in hex). Mint a new one for every attempt of a request."""
    return uuid.uuid4().hex


class ConsumerSession(EngineSession):
    """A consumer (decode) engine: registers destination blocks and releases them once used.

    In pull mode the consumer also reports completions (`complete_transfers`).
    """

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
    ) -> None:
        spec = EngineSpec(
            engine_id, pool, EngineRole.CONSUMER, layout or KvLayout(), tuple(agents), dict(labels or {}), lease_ttl
        )
        super().__init__(client, spec, config=config, handler=handler)

    async def register_targets(self, targets: Sequence[TargetSpec]) -> list[ItemResult]:
        """Register destination blocks; they are re-asserted until committed, released or aborted."""
        return await self._call(self._client.register_targets, targets, self._live.targets)

    async def register_target(self, target: TargetSpec) -> ItemResult:
        """Register one transfer's destination blocks; raises the item's error."""
        return (await self.register_targets((target,)))[0].raise_for_error()

    async def release_targets(self, releases: Sequence[ReleaseSpec]) -> list[ItemResult]:
        """Release committed transfers (their blocks are the consumer's again).

        A transfer that committed before a server restart is unknown afterwards: its release
        answers TRANSFER_NOT_FOUND, which only means there is nothing left to release.
        """
        return await self._call(self._client.release_targets, releases)

    async def release_target(self, release: ReleaseSpec) -> ItemResult:
        """Release one committed transfer; raises the item's error."""
        return (await self.release_targets((release,)))[0].raise_for_error()


class ProducerSession(EngineSession):
    """A producer (prefill) engine: claims transfers, reports ready sources, completions and revocations."""

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
    ) -> None:
        spec = EngineSpec(
            engine_id, pool, EngineRole.PRODUCER, layout or KvLayout(), tuple(agents), dict(labels or {}), lease_ttl
        )
        super().__init__(client, spec, config=config, handler=handler)

    async def claim_transfers(self, claims: Sequence[ClaimSpec]) -> list[ItemResult]:
        """Claim transfers; claims are re-asserted until the transfer commits or aborts."""
        return await self._call(self._client.claim_transfers, claims, self._live.claims)

    async def claim_transfer(self, claim: ClaimSpec) -> ItemResult:
        """Claim one transfer; raises the item's error."""
        return (await self.claim_transfers((claim,)))[0].raise_for_error()

    async def mark_sources_ready(self, sources: Sequence[SourceReadySpec]) -> list[ItemResult]:
        """Report computed source blocks (claiming if needed); re-asserted until the transfer ends."""
        return await self._call(self._client.mark_sources_ready, sources, self._live.sources)

    async def mark_source_ready(self, source: SourceReadySpec) -> ItemResult:
        """Report one transfer's computed source blocks; raises the item's error."""
        return (await self.mark_sources_ready((source,)))[0].raise_for_error()

    async def acknowledge_revocations(self, acks: Sequence[RevocationAck]) -> list[ItemResult]:
        """Confirm revoked generations will not be written (never started, or drained)."""
        return await self._call(self._client.acknowledge_revocations, acks)

    async def acknowledge_revocation(self, ack: RevocationAck) -> ItemResult:
        """Confirm one revoked generation will not be written; raises the item's error."""
        return (await self.acknowledge_revocations((ack,)))[0].raise_for_error()


class RouterClient:
    """What a router needs: transfer ids, engines to send the two legs to, and aborts.

    Engine lists are cached for `refresh_interval` seconds and picked round-robin.
    """

    def __init__(self, client: AsyncRendezvousClient, *, refresh_interval: float = 1.0) -> None:
        self._client = client
        self._refresh_interval = refresh_interval
        self._cache: dict[tuple[str, EngineRole], tuple[float, list[EngineInfo]]] = {}
        self._turns: dict[tuple[str, EngineRole], int] = {}

    @staticmethod
    def mint_transfer_id() -> str:
        """A fresh transfer id (a uuid4 in hex). Mint a new one for every attempt of a request."""
        return mint_transfer_id()

    async def list_engines(self, pool: str = "", role: EngineRole | None = None) -> list[EngineInfo]:
        """Live engines sorted by id (without NIXL metadata), optionally of one pool and role."""
        return await self._client.list_engines(pool, role, omit_agent_metadata=True)

    async def pick_engine(self, pool: str, role: EngineRole) -> EngineInfo:
        """The next live engine of a pool and role, round-robin; raises NotFound if there is none."""
        key = (pool, role)
        cached = self._cache.get(key)
        now = time.monotonic()
        if cached is None or now - cached[0] >= self._refresh_interval:
            cached = (now, await self.list_engines(pool, role))
            self._cache[key] = cached
        engines = cached[1]
        if not engines:
            raise NotFound(f"no live {role.name.lower()} engine in pool {pool!r}")
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return engines[turn % len(engines)]

    async def pick_pair(self, producer_pool: str, consumer_pool: str) -> tuple[EngineInfo, EngineInfo]:
        """A producer and a consumer for the two legs of one request."""
        producer = await self.pick_engine(producer_pool, EngineRole.PRODUCER)
        consumer = await self.pick_engine(consumer_pool, EngineRole.CONSUMER)
        return producer, consumer

    def invalidate(self) -> None:
        """Forget the cached engine lists (e.g. after an engine failed a request)."""
        self._cache.clear()

    async def abort_transfers(self, aborts: Sequence[AbortSpec]) -> list[ItemResult]:
        """Abort transfers as the router; both sides are told."""
        return await self._client.abort_transfers("", aborts)

    async def abort_transfer(self, transfer_id: str, message: str = "") -> ItemResult:
        """Abort one transfer as the router; raises the item's error."""
        return await self._client.abort_transfer("", AbortSpec(transfer_id, message))

    async def get_transfer(self, transfer_id: str) -> TransferInfo:
        """One transfer's state."""
        return await self._client.get_transfer(transfer_id)
