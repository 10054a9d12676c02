"""The synchronous client: the same commands as `rendezvous.clients.aio`, over a blocking gRPC channel.

Requests are built and answers parsed by `rendezvous.clients._commands`, shared with the asyncio client;
the unary calls that send them are `rendezvous.clients._sync_calls`'s, generated from the asyncio client's
(`scripts/unasync.py`); this module adds the streams. The client is thread-safe: gRPC channels are, and the client keeps
no per-call state.
"""

from __future__ import annotations

import queue
from types import TracebackType
from typing import Any

import grpc

from rendezvous.clients import _commands as commands
from rendezvous.clients import _convert
from rendezvous.clients._sync_calls import SyncCalls
from rendezvous.clients._types import LeaseRenewal, WatchBatch
from rendezvous.protocol.errors import Unavailable
from rendezvous.v1 import rendezvous_pb2 as pb


class RendezvousClient(SyncCalls):
    """A blocking client of RendezvousService; see `AsyncRendezvousClient` for the behaviour."""

    # Streams

    def watch(self, engine_id: str, start_sequence: int = 0, *, max_batch: int = 0) -> WatchStream:
        """Open a Watch stream of an engine's events from start_sequence (0: only new events).

        The stream is not resumed after a failure.
        """
        index, stub = self._endpoints.current()
        call = stub.Watch(commands.watch_request(engine_id, start_sequence, max_batch), metadata=self._metadata())
        return WatchStream(self, call, index)

    def keep_alive(self) -> KeepAliveStream:
        """Open a KeepAlive stream; `renew` sends one renewal and waits for its answer."""
        index, stub = self._endpoints.current()
        return KeepAliveStream(self, stub.KeepAlive, index)


class WatchStream:
    """An open Watch stream: iterate for `WatchBatch`es.

    The first batch, sent when the watch is established, is usually empty. Iteration ends when the
    server closes the stream (the client then moves on to its next endpoint, as after an UNAVAILABLE) or
    after `cancel()` (callable from any thread), and raises `RendezvousError` when the stream fails.
    """

    def __init__(self, client: RendezvousClient, call: Any, index: int) -> None:
        self._client = client
        self._call = call
        self._index = index
        self._cancelled = False

    def __iter__(self) -> WatchStream:
        return self

    def __next__(self) -> WatchBatch:
        try:
            response = next(self._call)
        except StopIteration:
            if not self._cancelled:
                self._client._ended(self._index)
            raise
        except grpc.RpcError as error:
            if self._cancelled:
                raise StopIteration from None
            raise self._client._failed(error, self._index) from error
        self._client._epochs.observe(response.header.epoch)
        return _convert.watch_batch(response)

    def cancel(self) -> None:
        """Close the stream; a blocked iteration ends."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()


class KeepAliveStream:
    """An open KeepAlive stream; one stream can renew the leases of several engines in turn."""

    def __init__(self, client: RendezvousClient, method: Any, index: int) -> None:
        self._client = client
        self._index = index
        self._requests: queue.SimpleQueue[pb.KeepAliveRequest | None] = queue.SimpleQueue()
        self._responses = method(iter(self._requests.get, None), metadata=client._metadata())

    def renew(self, engine_id: str, incarnation: int) -> LeaseRenewal:
        """Renew an engine incarnation's lease; raises if it cannot be (e.g. LEASE_EXPIRED), and Unavailable when
        the server ended the stream without an error (the client moves on to its next endpoint)."""
        self._requests.put(commands.keep_alive_request(engine_id, incarnation))
        try:
            response = next(self._responses)
        except StopIteration:
            self._client._ended(self._index)
            raise Unavailable("", "the server closed the KeepAlive stream") from None
        except grpc.RpcError as error:
            raise self._client._failed(error, self._index) from error
        self._client._epochs.observe(response.header.epoch)
        return _convert.lease_renewal(response)

    def cancel(self) -> None:
        """Close the stream."""
        self._requests.put(None)
        self._responses.cancel()

    def __enter__(self) -> KeepAliveStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()
