"""The unary side of a client, one method per RPC: connecting, closing, sending with retries.

Written once, for asyncio, in `clients/_async_calls.py`; `scripts/unasync.py` derives the blocking
form, `clients/_sync_calls.py`, from it by token replacement. The public clients (`rendezvous.clients.aio`,
`rendezvous.clients.sync`) add their streams on top.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc

from rendezvous.clients import _commands as commands
from rendezvous.clients._commands import Call
from rendezvous.clients._config import ClientConfig
from rendezvous.clients._retry import Attempts
from rendezvous.clients._transport import ClientBase
from rendezvous.clients._types import (
    AbortSpec,
    CacheReport,
    CacheSnapshot,
    ClaimSpec,
    CompletionSpec,
    CreditResult,
    CreditSpec,
    EngineInfo,
    EngineRole,
    EngineSpec,
    EngineView,
    IndexPosition,
    ItemResult,
    PrefixMatch,
    PrefixQuery,
    Registration,
    ReleaseSpec,
    RevocationAck,
    ServerStatus,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
    TransferPage,
    TransferState,
)
from rendezvous.protocol.errors import RendezvousError

ResultT = TypeVar("ResultT")


class AsyncCalls(ClientBase[grpc.aio.Channel]):
    """The unary calls of RendezvousService over `ClientBase`'s endpoints; see `AsyncRendezvousClient`."""

    def __init__(self, config: ClientConfig | str | Sequence[str]) -> None:
        """Connect to `config`: a full `ClientConfig`, one "host:port" or a list of them."""
        super().__init__(config, grpc.aio.insecure_channel, grpc.aio.secure_channel)

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        for channel in self._endpoints.take_channels():
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # Sending

    async def _invoke(self, call: Call[ResultT], timeout: float | None) -> ResultT:
        timeout = self._config.call_timeout if timeout is None else timeout
        started = time.monotonic()
        with self._span(call):
            index, stub = self._endpoints.current()
            try:
                response = await getattr(stub, call.method)(call.request, timeout=timeout, metadata=self._metadata())
            except grpc.RpcError as error:
                response = await self._retry(call, timeout, self._failed(error, index), started)
        self._epochs.observe(self._answered(call, response).header.epoch)
        return call.parse(response)

    async def _retry(self, call: Call[Any], timeout: float | None, error: RendezvousError, started: float) -> Any:
        attempts = Attempts(self._config.retry, len(self._endpoints), started)
        while True:
            delay = attempts.next_delay(error, call.idempotent)
            if delay is None:
                raise error
            if delay:
                await asyncio.sleep(delay)
            index, stub = self._endpoints.current()
            try:
                return await getattr(stub, call.method)(call.request, timeout=timeout, metadata=self._metadata())
            except grpc.RpcError as rpc_error:
                error = self._failed(rpc_error, index)

    # Engines

    async def register_engine(self, spec: EngineSpec, *, timeout: float | None = None) -> Registration:
        """Register a new incarnation of an engine; the previous one's transfers are aborted."""
        return await self._invoke(commands.register_engine(spec), timeout)

    async def deregister_engine(self, engine_id: str, incarnation: int = 0, *, timeout: float | None = None) -> int:
        """End an engine's incarnation (0: the current one); returns how many transfers were aborted."""
        return await self._invoke(commands.deregister_engine(engine_id, incarnation), timeout)

    async def get_engine(
        self,
        engine_id: str,
        *,
        view: EngineView = EngineView.FULL,
        transfer_id: str = "",
        timeout: float | None = None,
    ) -> EngineInfo:
        """One live engine, with its NIXL agents (view: how much of it; BASIC leaves out the agents' metadata and
        the labels, for a caller that does not connect to it). transfer_id: a live transfer whose bytes one of the
        caller's engines moves with that engine, through which an engine's token (without the router role) may
        read its peer (docs/security.md)."""
        return await self._invoke(commands.get_engine(engine_id, view, transfer_id), timeout)

    async def iter_engines(
        self,
        pool: str = "",
        role: EngineRole | None = None,
        *,
        page_size: int = 0,
        view: EngineView = EngineView.FULL,
        timeout: float | None = None,
    ) -> AsyncIterator[EngineInfo]:
        """Live engines sorted by id, optionally of one pool and role, page after page (page_size 0: the
        server's default; view: how much of each engine, BASIC or PLACEMENT for smaller pages; timeout: per
        page)."""
        token = ""
        while True:
            call = commands.list_engines(pool, role, view, page_size, token)
            page = await self._invoke(call, timeout)
            for engine in page.engines:
                yield engine
            token = page.next_page_token
            if not token:
                return

    async def list_engines(
        self,
        pool: str = "",
        role: EngineRole | None = None,
        *,
        view: EngineView = EngineView.FULL,
        timeout: float | None = None,
    ) -> list[EngineInfo]:
        """Every live engine sorted by id, optionally of one pool and role (all pages; timeout: per page)."""
        engines = self.iter_engines(pool, role, view=view, timeout=timeout)
        return [engine async for engine in engines]

    # Transfers

    async def register_targets(
        self, engine_id: str, targets: Sequence[TargetSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A consumer registers destination blocks (one result per target). A refused item is returned, not raised."""
        return await self._invoke(commands.register_targets(engine_id, incarnation, targets), timeout)

    async def register_target(
        self, engine_id: str, target: TargetSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A consumer registers the destination blocks of one transfer; raises the item's error."""
        return await self._invoke(commands.register_targets(engine_id, incarnation, (target,)).one(), timeout)

    async def claim_transfers(
        self, engine_id: str, claims: Sequence[ClaimSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A producer claims transfers (one result per claim). A refused item is returned, not raised."""
        return await self._invoke(commands.claim_transfers(engine_id, incarnation, claims), timeout)

    async def claim_transfer(
        self, engine_id: str, claim: ClaimSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A producer claims one transfer; raises the item's error."""
        return await self._invoke(commands.claim_transfers(engine_id, incarnation, (claim,)).one(), timeout)

    async def mark_sources_ready(
        self,
        engine_id: str,
        sources: Sequence[SourceReadySpec],
        *,
        incarnation: int = 0,
        timeout: float | None = None,
    ) -> list[ItemResult]:
        """A producer's source blocks are computed (one result per source). A refused item is returned, not raised."""
        return await self._invoke(commands.mark_sources_ready(engine_id, incarnation, sources), timeout)

    async def mark_source_ready(
        self, engine_id: str, source: SourceReadySpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A producer's source blocks of one transfer are computed; raises the item's error."""
        return await self._invoke(commands.mark_sources_ready(engine_id, incarnation, (source,)).one(), timeout)

    async def complete_transfers(
        self,
        engine_id: str,
        completions: Sequence[CompletionSpec],
        *,
        incarnation: int = 0,
        timeout: float | None = None,
    ) -> list[ItemResult]:
        """The side that moved the bytes reports outcomes (one result per completion).

        A refused item is returned, not raised.
        """
        return await self._invoke(commands.complete_transfers(engine_id, incarnation, completions), timeout)

    async def complete_transfer(
        self, engine_id: str, completion: CompletionSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """The side that moved the bytes reports one outcome; raises the item's error."""
        return await self._invoke(commands.complete_transfers(engine_id, incarnation, (completion,)).one(), timeout)

    async def acknowledge_revocations(
        self, engine_id: str, acks: Sequence[RevocationAck], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A producer confirms it will not write revoked generations (one result per ack).

        A refused item is returned, not raised.
        """
        return await self._invoke(commands.acknowledge_revocations(engine_id, incarnation, acks), timeout)

    async def acknowledge_revocation(
        self, engine_id: str, ack: RevocationAck, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A producer confirms it will not write one revoked generation; raises the item's error."""
        return await self._invoke(commands.acknowledge_revocations(engine_id, incarnation, (ack,)).one(), timeout)

    async def release_targets(
        self, engine_id: str, releases: Sequence[ReleaseSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A consumer is done with committed transfers (one result per release).

        A refused item is returned, not raised.
        """
        return await self._invoke(commands.release_targets(engine_id, incarnation, releases), timeout)

    async def release_target(
        self, engine_id: str, release: ReleaseSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A consumer is done with one committed transfer; raises the item's error."""
        return await self._invoke(commands.release_targets(engine_id, incarnation, (release,)).one(), timeout)

    async def abort_transfers(
        self, engine_id: str, aborts: Sequence[AbortSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """Abort transfers; engine_id "" acts as a router or operator (one result per abort).

        A refused item is returned, not raised.
        """
        return await self._invoke(commands.abort_transfers(engine_id, incarnation, aborts), timeout)

    async def abort_transfer(
        self, engine_id: str, abort: AbortSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """Abort one transfer; engine_id "" acts as a router or operator; raises the item's error."""
        return await self._invoke(commands.abort_transfers(engine_id, incarnation, (abort,)).one(), timeout)

    async def reserve_credits(
        self, reservations: Sequence[CreditSpec], *, ttl: float = 0.0, timeout: float | None = None
    ) -> list[CreditResult]:
        """Reserve credit on consumer engines for transfer ids (router role), each item atomically; ttl 0: the
        server's default. One result per item: its error, or the engine and expiry of the reservation.
        A refused item is returned, not raised."""
        return await self._invoke(commands.reserve_credits(reservations, ttl), timeout)

    async def release_credits(self, transfer_ids: Sequence[str], *, timeout: float | None = None) -> list[CreditResult]:
        """Drop the reservations of transfer ids (router role); an id without one is OK.

        A refused item is returned, not raised.
        """
        return await self._invoke(commands.release_credits(transfer_ids), timeout)

    async def get_transfer(self, transfer_id: str, *, timeout: float | None = None) -> TransferInfo:
        """One transfer, live or recently ended."""
        return await self._invoke(commands.get_transfer(transfer_id), timeout)

    async def list_transfers(
        self,
        engine_id: str = "",
        states: Sequence[TransferState] = (),
        *,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> TransferPage[TransferInfo]:
        """One page of transfers sorted by id, optionally of one engine; no states means the live ones."""
        return await self._invoke(commands.list_transfers(engine_id, states, page_size, page_token), timeout)

    async def iter_transfers(
        self, engine_id: str = "", states: Sequence[TransferState] = (), *, page_size: int = 0
    ) -> AsyncIterator[TransferInfo]:
        """Every transfer `list_transfers` would list, page after page."""
        token = ""
        while True:
            page = await self.list_transfers(engine_id, states, page_size=page_size, page_token=token)
            for transfer in page.transfers:
                yield transfer
            token = page.next_page_token
            if not token:
                return

    # The KV index

    async def report_cache_events(self, report: CacheReport, *, timeout: float | None = None) -> IndexPosition:
        """Report one numbered batch of an engine's cache events (KvIndexService). Raises INDEX_SEQUENCE_GAP
        (metadata expected_sequence) or INDEX_PARENT_UNKNOWN when the engine should send a snapshot."""
        return await self._invoke(commands.report_cache_events(report), timeout)

    async def replace_cached_blocks(self, snapshot: CacheSnapshot, *, timeout: float | None = None) -> IndexPosition:
        """Replace an engine's entry in the KV index by a snapshot of its cache."""
        return await self._invoke(commands.replace_cached_blocks(snapshot), timeout)

    async def match_prefixes(self, query: PrefixQuery, *, timeout: float | None = None) -> list[PrefixMatch]:
        """How many leading blocks of the query's chain each selected indexed engine holds, best first."""
        return await self._invoke(commands.match_prefixes(query), timeout)

    async def get_status(self, *, timeout: float | None = None) -> ServerStatus:
        """The operator summary of the server."""
        return await self._invoke(commands.get_status(), timeout)
