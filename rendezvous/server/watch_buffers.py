"""Bytes that Watch streams handed to gRPC and a reader has not taken yet, bounded over the server.

A Watch response is counted from the moment it is yielded until gRPC asks for the next one (the transport
took it: the client's flow-control window had room). A stopped or slow reader leaves its response counted
for as long as it does not read. When a response would take the total past `Limits.max_watch_buffer_bytes`,
the streams that have waited longest are dropped, as Redis's `client-output-buffer-limit` and the
kube-apiserver watch cache drop slow watchers: each ends with RESOURCE_EXHAUSTED / BUDGET_EXHAUSTED
(`budget` = `watch_buffer_bytes`) after what it was sent, and its handler's state (the events it read, the
response) is freed at once. The client resumes from the sequence after the last event it received.
The stream sending never drops itself: one response alone may pass the bound (responses are cut at
`max_response_bytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any

import grpc
from grpc_status import rpc_status

from rendezvous.protocol import convert
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server.metrics import Metrics

WATCH_BUFFER_BYTES = "watch_buffer_bytes"


HANDLER_TASK: ContextVar[asyncio.Task[Any] | None] = ContextVar("watch_handler_task", default=None)
"""The task gRPC serves a Watch call in (`HandlerTask`): an interceptor that wraps the stream (auth) may step
the servicer's generator in tasks of its own, and cancelling one of those would not end the call."""


class HandlerTask(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Notes, for Watch calls, the task gRPC serves the call in (`HANDLER_TASK`), before any other interceptor."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.endswith("/Watch"):
            HANDLER_TASK.set(asyncio.current_task())
        return await continuation(handler_call_details)


class Stream:
    """One Watch stream: its call, and the task that serves it (cancelled to drop it)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context
        self.task = HANDLER_TASK.get() or asyncio.current_task()

    def drop(self, err: RendezvousError) -> None:
        """End the stream with err (sent after what the transport holds) and free its handler now."""
        ending = asyncio.ensure_future(self.context.abort_with_status(rpc_status.to_status(convert.error_status(err))))
        ending.add_done_callback(_ended)
        if self.task is not None:
            self.task.cancel()


def _ended(ending: asyncio.Future[None]) -> None:
    # abort_with_status always raises (AbortError): the status is on its way.
    if not ending.cancelled():
        ending.exception()


class WatchBuffers:
    """The bytes of Watch responses not yet taken by their readers, per stream and over the server."""

    def __init__(self, max_bytes: int, metrics: Metrics) -> None:
        self._pending: OrderedDict[Stream, int] = OrderedDict()  # waiting longest first
        self._max = max_bytes
        self._metrics = metrics
        self.bytes = 0

    @contextlib.contextmanager
    def sending(self, stream: Stream, size: int) -> Iterator[None]:
        """Count size bytes for stream while the body (the yield of a response) runs; past the bound, drop
        the streams that have waited longest first."""
        self._pending[stream] = size
        self._add(size)
        try:
            while self.bytes > self._max:
                victim = next((s for s in self._pending if s is not stream), None)
                if victim is None:
                    break
                held = self._release(victim)
                self._metrics.watch_dropped.inc()
                victim.drop(_slow_reader(self._max, held))
            yield
        finally:
            self._release(stream)

    def _release(self, stream: Stream) -> int:
        size = self._pending.pop(stream, 0)
        self._add(-size)
        return size

    def _add(self, n: int) -> None:
        if n:
            self.bytes += n
            self._metrics.watch_buffer_bytes.set(self.bytes)


def _slow_reader(limit: int, held: int) -> RendezvousError:
    return RendezvousError(
        Reason.BUDGET_EXHAUSTED,
        f"this Watch stream held {held} bytes its reader did not take while Watch streams held more than "
        f"{limit}; watch again from the sequence after the last event received",
        budget=WATCH_BUFFER_BYTES,
        scope="server",
        limit=limit,
    )
