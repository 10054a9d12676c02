"""Pipelining: the commands that tasks issue in one event-loop iteration go out together."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex

from rendezvous.store.base import StoreUnavailableError


class Pipeliner:
    """Sends the commands that tasks issue in one loop iteration as one pipeline: one write, one round trip.

    With many requests in flight this saves most of the client's per-command cost (syscalls, pool
    checkout, timeouts) and Redis's; a lone command goes out as a plain one. Replies are parsed as
    the client's own methods parse them.
    """

    def __init__(
        self, client: aioredis.Redis, max_in_flight: int, wait_replicas: int = 0, wait_timeout: float = 0.5
    ) -> None:
        self._client = client
        # WAIT after each pipeline (RedisOptions.wait_replicas): its writes are acknowledged once replicated.
        self._wait = (wait_replicas, max(1, round(wait_timeout * 1000)))
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        # Batches beyond this wait here (the pool itself would refuse them).
        self._slots = asyncio.Semaphore(max_in_flight)

    async def call(self, *args: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((args, future))
        if len(self._queue) == 1:
            task = asyncio.create_task(self._send())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return await future

    async def _send(self) -> None:
        async with self._slots:
            await self._send_batch()

    async def _send_batch(self) -> None:
        batch, self._queue = self._queue, []
        try:
            if self._wait[0]:
                results = await self._replicated(batch)
            elif len(batch) == 1:
                results = [await self._single(batch[0][0])]
            else:
                pipe = self._client.pipeline(transaction=False)
                for args, _ in batch:
                    pipe.execute_command(*args)
                results = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as err:  # the connection failed: every caller of the batch gets the error
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def _replicated(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> list[Any]:
        """The batch, then WAIT on the same connection; fewer replicas than asked fail every command."""
        replicas, timeout_ms = self._wait
        pipe = self._client.pipeline(transaction=False)
        for args, _ in batch:
            pipe.execute_command(*args)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        *results, reached = await pipe.execute(raise_on_error=False)
        if isinstance(reached, Exception):
            raise reached
        if int(reached) < replicas:
            raise StoreUnavailableError(
                f"the writes reached {reached} of {replicas} replicas within {timeout_ms} ms (WAIT)"
            )
        return results

    async def close(self) -> None:
        """Cancel what is queued or being sent."""
        for _, future in self._queue:
            future.cancel()
        self._queue = []
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)

    async def _single(self, args: tuple[Any, ...]) -> Any:
        try:
            return await self._client.execute_command(*args)  # type: ignore[no-untyped-call]
        except rex.ResponseError as err:
            return err
