"""The asyncio client: one method per RPC, typed in and out.

Requests are built and answers parsed by `clients._commands`, the definition shared with the
sync client (`clients.sync`); this module only sends them. Create the client inside a running
event loop: its gRPC channels (one per endpoint, opened on first use) belong to that loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from clients import _commands as commands
from clients import _convert
from clients._commands import Call
from clients._config import ClientConfig
from clients._exceptions import RendezvousError, Unavailable
from clients._retry import Attempts
from clients._transport import ClientBase
from clients._types import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    CreditResult,
    CreditSpec,
    EngineInfo,
    EngineRole,
    EngineSpec,
    ItemResult,
    LeaseRenewal,
    Registration,
    ReleaseSpec,
    RevocationAck,
    ServerStatus,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
    TransferPage,
    TransferState,
    WatchBatch,
)

ResultT = TypeVar("ResultT")


class AsyncRendezvousClient(ClientBase[grpc.aio.Channel]):
    """An asyncio client of RendezvousService.

    Unary calls are retried per the configured `RetryPolicy` (UNAVAILABLE fails over to the next
    endpoint); mutating calls carry a fresh request id that their retries reuse. Batched calls
    answer one `ItemResult` per item; their single-item forms raise the item's error. Every
    answer's epoch is tracked: `epoch`, and `add_epoch_listener` to hear of a server restart.
    Failures raise `RendezvousError` subclasses.
    """

    def __init__(self, config: ClientConfig | str | Sequence[str]) -> None:
        """Connect to `config`: a full `ClientConfig`, one "host:port" or a list of them."""
        super().__init__(config, grpc.aio.insecure_channel, grpc.aio.secure_channel)

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        for channel in self._endpoints.take_channels():
            await channel.close()

    async def __aenter__(self) -> AsyncRendezvousClient:
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
        self._epochs.observe(response.header.epoch)
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

    async def get_engine(self, engine_id: str, *, timeout: float | None = None) -> EngineInfo:
        """One live engine, with its NIXL agents."""
        return await self._invoke(commands.get_engine(engine_id), timeout)

    async def iter_engines(
        self,
        pool: str = "",
        role: EngineRole | None = None,
        *,
        page_size: int = 0,
        omit_agent_metadata: bool = False,
        omit_labels: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[EngineInfo]:
        """Live engines sorted by id, optionally of one pool and role, page after page (page_size 0: the
        server's default; timeout: per page)."""
        token = ""
        while True:
            call = commands.list_engines(pool, role, omit_agent_metadata, omit_labels, page_size, token)
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
        omit_agent_metadata: bool = False,
        omit_labels: bool = False,
        timeout: float | None = None,
    ) -> list[EngineInfo]:
        """Every live engine sorted by id, optionally of one pool and role (all pages; timeout: per page)."""
        engines = self.iter_engines(
            pool, role, omit_agent_metadata=omit_agent_metadata, omit_labels=omit_labels, timeout=timeout
        )
        return [engine async for engine in engines]

    # Transfers

    async def register_targets(
        self, engine_id: str, targets: Sequence[TargetSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A consumer registers destination blocks (one result per target)."""
        return await self._invoke(commands.register_targets(engine_id, incarnation, targets), timeout)

    async def register_target(
        self, engine_id: str, target: TargetSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A consumer registers the destination blocks of one transfer; raises the item's error."""
        return await self._invoke(commands.register_targets(engine_id, incarnation, (target,)).one(), timeout)

    async def claim_transfers(
        self, engine_id: str, claims: Sequence[ClaimSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A producer claims transfers (one result per claim)."""
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
        """A producer's source blocks are computed (one result per source)."""
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
        """The side that moved the bytes reports outcomes (one result per completion)."""
        return await self._invoke(commands.complete_transfers(engine_id, incarnation, completions), timeout)

    async def complete_transfer(
        self, engine_id: str, completion: CompletionSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """The side that moved the bytes reports one outcome; raises the item's error."""
        return await self._invoke(commands.complete_transfers(engine_id, incarnation, (completion,)).one(), timeout)

    async def acknowledge_revocations(
        self, engine_id: str, acks: Sequence[RevocationAck], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A producer confirms it will not write revoked generations (one result per ack)."""
        return await self._invoke(commands.acknowledge_revocations(engine_id, incarnation, acks), timeout)

    async def acknowledge_revocation(
        self, engine_id: str, ack: RevocationAck, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A producer confirms it will not write one revoked generation; raises the item's error."""
        return await self._invoke(commands.acknowledge_revocations(engine_id, incarnation, (ack,)).one(), timeout)

    async def release_targets(
        self, engine_id: str, releases: Sequence[ReleaseSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """A consumer is done with committed transfers (one result per release)."""
        return await self._invoke(commands.release_targets(engine_id, incarnation, releases), timeout)

    async def release_target(
        self, engine_id: str, release: ReleaseSpec, *, incarnation: int = 0, timeout: float | None = None
    ) -> ItemResult:
        """A consumer is done with one committed transfer; raises the item's error."""
        return await self._invoke(commands.release_targets(engine_id, incarnation, (release,)).one(), timeout)

    async def abort_transfers(
        self, engine_id: str, aborts: Sequence[AbortSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        """Abort transfers; engine_id "" acts as a router or operator (one result per abort)."""
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
        server's default. One result per item: its error, or the engine and expiry of the reservation."""
        return await self._invoke(commands.reserve_credits(reservations, ttl), timeout)

    async def release_credits(self, transfer_ids: Sequence[str], *, timeout: float | None = None) -> list[CreditResult]:
        """Drop the reservations of transfer ids (router role); an id without one is OK."""
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
    ) -> TransferPage:
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

    async def get_status(self, *, timeout: float | None = None) -> ServerStatus:
        """The operator summary of the server."""
        return await self._invoke(commands.get_status(), timeout)

    # Streams

    def watch(self, engine_id: str, start_revision: int = 0, *, max_batch: int = 0) -> AsyncWatchStream:
        """Open a Watch stream of an engine's events from start_revision (0: only new events).

        The stream is not resumed after a failure; `EngineSession` does that.
        """
        index, stub = self._endpoints.current()
        call = stub.Watch(commands.watch_request(engine_id, start_revision, max_batch), metadata=self._metadata())
        return AsyncWatchStream(self, call, index)

    def keep_alive(self) -> AsyncKeepAliveStream:
        """Open a KeepAlive stream; `renew` sends one renewal and waits for its answer."""
        index, stub = self._endpoints.current()
        return AsyncKeepAliveStream(self, stub.KeepAlive(metadata=self._metadata()), index)


class AsyncWatchStream:
    """An open Watch stream: iterate for `WatchBatch`es.

    The first batch, sent when the watch is established, is usually empty. Iteration ends when the
    server closes the stream (e.g. it is shutting down) or after `cancel()`, and raises
    `RendezvousError` when the stream fails. Leaving `async with` cancels it.
    """

    def __init__(self, client: AsyncRendezvousClient, call: Any, index: int) -> None:
        self._client = client
        self._call = call
        self._index = index
        self._cancelled = False

    def __aiter__(self) -> AsyncWatchStream:
        return self

    async def __anext__(self) -> WatchBatch:
        if self._cancelled:
            raise StopAsyncIteration
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            raise self._client._failed(error, self._index) from error
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._cancelled and task is not None and not task.cancelling():
                raise StopAsyncIteration from None  # cancel() from another task ends the iteration
            raise
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        self._client._epochs.observe(response.header.epoch)
        return _convert.watch_batch(response)

    def cancel(self) -> None:
        """Close the stream; an iteration in progress in another task ends."""
        self._cancelled = True
        self._call.cancel()

    async def __aenter__(self) -> AsyncWatchStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()


class AsyncKeepAliveStream:
    """An open KeepAlive stream; one stream can renew the leases of several engines in turn."""

    def __init__(self, client: AsyncRendezvousClient, call: Any, index: int) -> None:
        self._client = client
        self._call = call
        self._index = index

    async def renew(self, engine_id: str, incarnation: int) -> LeaseRenewal:
        """Renew an engine incarnation's lease; raises if it cannot be (e.g. LEASE_EXPIRED)."""
        try:
            await self._call.write(commands.keep_alive_request(engine_id, incarnation))
            response = await self._call.read()
        except grpc.RpcError as error:
            raise self._client._failed(error, self._index) from error
        except asyncio.InvalidStateError:
            response = grpc.aio.EOF  # the server already ended the stream without an error
        if response is grpc.aio.EOF:
            raise Unavailable("the server closed the KeepAlive stream")
        self._client._epochs.observe(response.header.epoch)
        return _convert.lease_renewal(response)

    def cancel(self) -> None:
        """Close the stream."""
        self._call.cancel()

    async def __aenter__(self) -> AsyncKeepAliveStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()
