"""`Batcher`: items submitted during one event-loop turn go to the rendezvous service as one batched call.

Agents submit one item per transfer (a claim, a completion, an acknowledgement) from many places; the
batcher turns them into one RPC per turn, which is what the protocol's repeated items are for. A turn's
items are cut into calls of at most `max_items` and `CALL_BUDGET` (`weight`), so no call nears the server's
request limits (4 MiB a message, 65,536 written parts a CompleteTransfers: docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from rendezvous.clients._types import ItemResult
from rendezvous.protocol.errors import Reason, RendezvousError

__all__ = ["Batcher", "batcher_of", "log_refusal"]

logger = logging.getLogger(__name__)

S = TypeVar("S")
SendBatch = Callable[[Sequence[S]], Awaitable[list[ItemResult]]]

CALL_BUDGET = 1 << 20
"""The most one call's items weigh (`weight`): a quarter of the server's default message size."""
_ITEM_BYTES = 300
"""An item's ids, numbers and binding on the wire, at most (ids are 256 characters at most)."""
_BLOCK_ID_BYTES = 10
"""A block id's varint, at most."""
_PART_WEIGHT = 64
"""A written part (about 12 bytes) weighs more than its bytes: a call then carries at most 16,384 parts."""


def weight(item: object) -> int:
    """What an item weighs against CALL_BUDGET: about its bytes on the wire, at most."""
    message: str = getattr(item, "message", "")
    return (
        _ITEM_BYTES
        + _BLOCK_ID_BYTES * len(getattr(item, "block_ids", ()))
        + _PART_WEIGHT * len(getattr(item, "parts", ()))
        + len(message.encode())
    )


class Batcher(Generic[S]):
    """Coalesces `submit`ted items into calls of at most `max_items` and CALL_BUDGET, sent on the next loop turn
    (an item that alone weighs more goes in a call of its own)."""

    def __init__(self, name: str, send: SendBatch[S], *, max_items: int = 256) -> None:
        self._name = name
        self._send = send
        self._max_items = max_items
        self._pending: list[tuple[S, asyncio.Future[ItemResult]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def idle(self) -> bool:
        """Whether no item waits and no call is in flight."""
        return not self._pending and not self._tasks

    def submit(self, item: S) -> asyncio.Future[ItemResult]:
        """Queue one item; the future gets its `ItemResult` (or the call's exception)."""
        future: asyncio.Future[ItemResult] = asyncio.get_running_loop().create_future()
        if not self._pending:
            task = asyncio.create_task(self._flush(), name=f"batch {self._name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._pending.append((item, future))
        return future

    def submit_logged(self, item: S) -> None:
        """Queue one item whose outcome nobody awaits: errors are logged."""
        self.submit(item).add_done_callback(self._log_outcome)

    async def close(self) -> None:
        """Wait for the calls in flight."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the rest of this turn's items join
        pending, self._pending = self._pending, []
        for chunk in self._calls(pending):
            try:
                results = await self._send([item for item, _ in chunk])
            except Exception as e:
                for _, future in chunk:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, future), result in zip(chunk, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _calls(
        self, pending: list[tuple[S, asyncio.Future[ItemResult]]]
    ) -> list[list[tuple[S, asyncio.Future[ItemResult]]]]:
        """pending in order, cut into calls of at most max_items items and CALL_BUDGET of weight."""
        calls: list[list[tuple[S, asyncio.Future[ItemResult]]]] = []
        call: list[tuple[S, asyncio.Future[ItemResult]]] = []
        total = 0
        for entry in pending:
            w = weight(entry[0])
            if call and (len(call) == self._max_items or total + w > CALL_BUDGET):
                calls.append(call)
                call, total = [], 0
            call.append(entry)
            total += w
        if call:
            calls.append(call)
        return calls

    def _log_outcome(self, future: asyncio.Future[ItemResult]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            error = future.result().error
        if error is not None:
            logger.warning("%s: %s", self._name, error)


def batcher_of(
    batchers: dict[tuple[int, int], Batcher[S]], incarnation_id: tuple[int, int], name: str, send: SendBatch[S]
) -> Batcher[S]:
    """The batcher of the items answering `incarnation_id` (`(epoch, incarnation)`), which `send` sends as that
    incarnation only; a replaced incarnation's is dropped once its calls are done."""
    batcher = batchers.get(incarnation_id)
    if batcher is None:
        for key, old in list(batchers.items()):
            if old.idle:
                del batchers[key]
        batcher = batchers[incarnation_id] = Batcher(name, send)
    return batcher


def stale(future: asyncio.Future[ItemResult]) -> bool:
    """Whether a batched item was refused as a replaced incarnation's (STALE_INCARNATION: unsent, in the SDK)."""
    failure = None if future.cancelled() else (future.exception() or future.result().error)
    return isinstance(failure, RendezvousError) and failure.reason == Reason.STALE_INCARNATION


def log_refusal(method: str, transfer_id: str, generation: int, future: asyncio.Future[ItemResult]) -> None:
    """Log a batched item's failure; a replaced incarnation's item refused unsent (what it answers ended with it)
    at info only."""
    failure = None if future.cancelled() else (future.exception() or future.result().error)
    if stale(future):
        logger.info("%s %s:%d: %s", method, transfer_id, generation, failure)
    elif failure is not None:
        logger.warning("%s %s:%d: %s", method, transfer_id, generation, failure)
