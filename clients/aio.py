"""The asyncio client: one method per RPC, typed in and out.

Requests are built and answers parsed by `rendezvous.clients._commands`, the definition shared with the
sync client (`rendezvous.clients.sync`); the unary calls that send them are `rendezvous.clients._async_calls`'s, from
which the sync client's are generated; this module adds the streams. Create the client inside a
running event loop: its gRPC channels (one per endpoint, opened on first use) belong to that loop.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

import grpc

from rendezvous.clients import _commands as commands
from rendezvous.clients import _convert
from rendezvous.clients._async_calls import AsyncCalls
from rendezvous.clients._types import LeaseRenewal, WatchBatch
from rendezvous.protocol.errors import Unavailable


class AsyncRendezvousClient(AsyncCalls):
    """An asyncio client of RendezvousService.

    Unary calls are retried per the configured `RetryPolicy` (UNAVAILABLE fails over to the next
    endpoint); mutating calls carry a fresh request id that their retries reuse. Batched calls
    answer one `ItemResult` per item; their single-item forms raise the item's error. Every
    answer's epoch is tracked: `epoch`, and `add_epoch_listener` to hear of a server restart.
    Failures raise `RendezvousError` subclasses.
    """

    # Streams

    def watch(self, engine_id: str, start_sequence: int = 0, *, max_batch: int = 0) -> AsyncWatchStream:
        """Open a Watch stream of an engine's events from start_sequence (0: only new events).

        The stream is not resumed after a failure; `EngineSession` does that.
        """
        index, stub = self._endpoints.current()
        call = stub.Watch(commands.watch_request(engine_id, start_sequence, max_batch), metadata=self._metadata())
        return AsyncWatchStream(self, call, index)

    def keep_alive(self) -> AsyncKeepAliveStream:
        """Open a KeepAlive stream; `renew` sends one renewal and waits for its answer."""
        index, stub = self._endpoints.current()
        return AsyncKeepAliveStream(self, stub.KeepAlive(metadata=self._metadata()), index)


class AsyncWatchStream:
    """An open Watch stream: iterate for `WatchBatch`es.

    The first batch, sent when the watch is established, is usually empty. Iteration ends when the
    server closes the stream (e.g. it is shutting down; the client then moves on to its next endpoint, as
    after an UNAVAILABLE) or after `cancel()`, and raises `RendezvousError` when the stream fails. Leaving
    `async with` cancels it.
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
            if not self._cancelled:
                self._client._ended(self._index)
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
    """An open KeepAlive stream; one stream can renew the leases of several engines in turn.

    A stream the server ended, with an error or without one, renews nothing more: open another.
    """

    def __init__(self, client: AsyncRendezvousClient, call: Any, index: int) -> None:
        self._client = client
        self._call = call
        self._index = index

    async def renew(self, engine_id: str, incarnation: int, timeout: float | None = None) -> LeaseRenewal:
        """Renew an engine incarnation's lease; raises if it cannot be (e.g. LEASE_EXPIRED). Without an answer
        within `timeout` seconds (None: no bound) the stream is cancelled, the endpoint given up like an
        UNAVAILABLE one (a replica that went silent without closing its connections), and Unavailable raised;
        so it is when the server ended the stream without an error (a replica shutting down, a proxy's stream
        timeout)."""
        try:
            async with asyncio.timeout(timeout):
                await self._call.write(commands.keep_alive_request(engine_id, incarnation))
                response = await self._call.read()
        except grpc.RpcError as error:
            raise self._client._failed(error, self._index) from error
        except TimeoutError:
            self.cancel()
            self._client._endpoints.failover(self._index)
            raise Unavailable("", f"no KeepAlive answer within {timeout:g} s") from None
        except asyncio.InvalidStateError:
            response = grpc.aio.EOF  # the server already ended the stream without an error
        if response is grpc.aio.EOF:
            self._client._ended(self._index)
            raise Unavailable("", "the server closed the KeepAlive stream")
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
