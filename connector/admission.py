"""Decode admission for the router: a request goes to a decode engine only with credit reserved on it.

A consumer that declared a capacity (`EngineCapacity`, `kv_connector_extra_config["max_transfers"]`) is only
sent a request once the router holds a reservation on it (`ReserveCredits`, one transfer and the prompt's
blocks, counted in that engine's own KV blocks, its `layout.block_size`, as its RegisterTargets counts them),
which the rendezvous grants atomically: several routers cannot spend the same credit. The router
tries the decode engines by its policy, skipping those its engine list shows full; one that refuses (another
router took the last credit) sends it to the next. When none has room the request waits in a bounded queue
(`max_queued`, `queue_timeout`) and tries again when credit may have come back: when this router releases a
reservation (at once), and at every engine-list refresh (other routers' releases, targets released by the
engines). A request that waits too long, or finds the queue full, is refused (`Refused`, the router's 503);
a client that hangs up while queued just leaves the queue. Engines without a capacity need no reservation.
The reservation is released when the request ends, however it ends; the engine's RegisterTargets has by then
taken its place (the rendezvous counts it once), and its TTL bounds what a crashed router leaves behind.
A reservation whose outcome the router does not know (ReserveCredits unanswered: a deadline, a lost connection)
is released as if granted, and a release that fails is retried until the rendezvous acknowledges it (or the
reservation's TTL has passed): neither waits out the TTL while the rendezvous answers. A client that goes away
while its ReserveCredits is in flight does not cancel the call: its credit is released once it is answered, so
the release cannot reach the rendezvous before the reservation does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rendezvous.clients import (
    CreditResult,
    EngineInfo,
    EngineRole,
    IndexedPrefix,
    NotFound,
    RendezvousError,
    RouterClient,
)

__all__ = [
    "NO_CAPACITY",
    "QUEUE_FULL",
    "QUEUE_TIMEOUT",
    "UNANSWERED",
    "Admission",
    "DecodeAdmission",
    "Refused",
    "RouterMetrics",
    "unanswered",
]

logger = logging.getLogger(__name__)

QUEUE_FULL = "queue_full"
"""Refused: no decode engine had credit and the queue held max_queued requests already."""
QUEUE_TIMEOUT = "queue_timeout"
"""Refused: the request waited queue_timeout seconds and no credit came back."""
NO_CAPACITY = "no_capacity"
"""Refused: no decode engine had credit, and the router queues nothing (max_queued or queue_timeout 0)."""
TOO_LARGE = "too_large"
"""Refused: the prompt needs more blocks than any decode engine of the pools admits at all (its `max_blocks`)."""
ENGINE_FULL = "engine_full"
"""Counted only: an engine refused a reservation (another router took the credit); the next was tried."""

_MIN_RETRY = 0.05
"""Queued requests retry at least this far apart (the engine-list refresh, when it is longer)."""
_MAX_RELEASE_BACKOFF = 1.0
"""A release that failed is retried at most this far apart."""
UNANSWERED = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)
"""Codes of a call whose answer the router did not get (or cannot read): it may have been applied."""


def unanswered(error: RendezvousError) -> bool:
    """Whether a call that raised `error` may have been applied by the rendezvous all the same."""
    return error.code in UNANSWERED


class Refused(Exception):
    """No decode engine admits the request: `reason` is QUEUE_FULL, QUEUE_TIMEOUT or NO_CAPACITY."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own (`GET /metrics`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.queued = Gauge(
            "kv_rendezvous_router_queued_requests",
            "Requests waiting for decode credit",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "kv_rendezvous_router_queue_wait_seconds",
            "Time queued requests waited for decode credit (admitted or not)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.refusals = Counter(
            "kv_rendezvous_router_refusals",
            "Requests refused for want of decode credit by reason (queue_full, queue_timeout, no_capacity), "
            "while the rendezvous did not answer (rendezvous_unavailable), and reservations an engine refused "
            "(engine_full)",
            ["reason"],
            registry=self.registry,
        )
        self.capacity = Gauge(
            "kv_rendezvous_router_pool_capacity_transfers",
            "Declared max_transfers summed over a decode pool's engines, as of the router's last listing",
            ["pool"],
            registry=self.registry,
        )
        self.free = Gauge(
            "kv_rendezvous_router_pool_free_transfers",
            "Free decode credit (transfers) in a pool, as of the router's last listing",
            ["pool"],
            registry=self.registry,
        )
        self.placements = Counter(
            "kv_rendezvous_router_prefix_placements",
            "Prefix-aware placements by what informed them: index (the fleet's KV index answered) or memory "
            "(the router's own memory of what it sent where)",
            ["source"],
            registry=self.registry,
        )
        self.local_prefills = Counter(
            "kv_rendezvous_router_local_prefills",
            "Requests sent to a decode engine alone, which computed the prompt itself, by why (the X-Kv-Prefill "
            "header: local-short, local-busy, local-unreachable)",
            ["why"],
            registry=self.registry,
        )
        self.unreachable = Gauge(
            "kv_rendezvous_router_rendezvous_unreachable",
            "1 while the rendezvous does not answer: requests go to decode engines alone (local-unreachable) or "
            "are refused 503 rendezvous_unavailable",
            registry=self.registry,
        )
        self.reserved = Counter(
            "kv_rendezvous_router_credit_reservations",
            "Reservations this router was granted",
            registry=self.registry,
        )

    def observe_pools(self, engines: Sequence[EngineInfo]) -> None:
        """Record the capacity and free credit of the pools these engines make up."""
        capacity: dict[str, int] = {}
        free: dict[str, int] = {}
        for e in engines:
            if e.free_transfers is None:
                continue
            capacity[e.pool] = capacity.get(e.pool, 0) + e.capacity.max_transfers
            free[e.pool] = free.get(e.pool, 0) + e.free_transfers
        for pool, value in capacity.items():
            self.capacity.labels(pool).set(value)
            self.free.labels(pool).set(free[pool])


@dataclass(frozen=True)
class Admission:
    """A decode engine that admitted a request; `reserved`: credit is held for `transfer_id` on it."""

    engine: EngineInfo
    transfer_id: str
    reserved: bool


class DecodeAdmission:
    """Reserves decode credit for requests, queueing those that find none (module docstring)."""

    def __init__(
        self,
        engines: RouterClient,
        metrics: RouterMetrics,
        *,
        max_queued: int = 100,
        queue_timeout: float = 30.0,
        credit_ttl: float = 60.0,
        retry_interval: float = 1.0,
        block_tokens: int = 16,
    ) -> None:
        if max_queued < 0 or queue_timeout < 0:
            raise ValueError("max_queued and queue_timeout must not be negative")
        if credit_ttl <= 0:
            raise ValueError("credit_ttl must be positive")
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.engines = engines
        self.metrics = metrics
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.credit_ttl = credit_ttl
        self.retry_interval = max(retry_interval, _MIN_RETRY)
        self.block_tokens = block_tokens
        """Tokens per block of an engine whose layout states no block size (the router's --prefix-block)."""
        self._waiters: deque[asyncio.Event] = deque()
        self._releasing: set[asyncio.Task[None]] = set()

    @property
    def queued(self) -> int:
        """Requests waiting for credit now."""
        return len(self._waiters)

    def blocks(self, engine: EngineInfo, tokens: int) -> int:
        """The KV blocks a prompt of `tokens` takes on `engine`: in its own block size (its RegisterTargets counts
        those), else in `block_tokens`."""
        size = engine.layout.block_size or self.block_tokens
        return -(-tokens // size)

    async def admit(
        self,
        pools: Sequence[str],
        transfer_id: str,
        tokens: int,
        prefix: Sequence[int] = (),
        indexed: IndexedPrefix | None = None,
    ) -> Admission:
        """A decode engine of `pools` with credit for one transfer of a prompt of `tokens` (in the engine's blocks,
        `blocks`), reserved for transfer_id;
        waits in the queue when there is none (engines ranked by `RouterClient.rank_engines` with `prefix` and
        `indexed`). Raises Refused, or NotFound when the pools have no engine."""
        admission = await self._try(pools, transfer_id, tokens, prefix, indexed)
        if admission is not None:
            return admission
        if not self.max_queued or not self.queue_timeout:
            raise self._refuse(NO_CAPACITY, f"no decode engine of {', '.join(pools)} has credit left")
        if len(self._waiters) >= self.max_queued:
            raise self._refuse(
                QUEUE_FULL, f"no decode engine has credit and {len(self._waiters)} requests are queued already"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.queue_timeout
        waiter = asyncio.Event()
        self._waiters.append(waiter)
        self.metrics.queued.inc()
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._refuse(
                        QUEUE_TIMEOUT, f"no decode credit came back within {self.queue_timeout:g} s (queue timeout)"
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, self.retry_interval)):
                        await waiter.wait()
                waiter.clear()
                admission = await self._try(pools, transfer_id, tokens, prefix, indexed)
                if admission is not None:
                    return admission
        finally:
            self._waiters.remove(waiter)
            self.metrics.queued.dec()
            self.metrics.queue_wait.observe(loop.time() - started)
            self._wake()  # credit may be left for the next one (or this one's turn passes on)

    def _refuse(self, reason: str, message: str) -> Refused:
        self.metrics.refusals.labels(reason).inc()
        return Refused(reason, message)

    async def _try(
        self,
        pools: Sequence[str],
        transfer_id: str,
        tokens: int,
        prefix: Sequence[int],
        indexed: IndexedPrefix | None,
    ) -> Admission | None:
        ranked = await self.engines.rank_engines(pools, EngineRole.CONSUMER, prefix=prefix, indexed=indexed)
        self.metrics.observe_pools(ranked)
        if ranked and all(0 < e.capacity.max_blocks < self.blocks(e, tokens) for e in ranked):  # no wait helps
            sizes = ", ".join(f"{self.blocks(e, tokens)} blocks of {e.engine_id}" for e in ranked[:3])
            raise self._refuse(
                TOO_LARGE, f"{tokens} tokens ({sizes}): no decode engine of {', '.join(pools)} admits as many"
            )
        for engine in ranked:
            if not engine.capacity.limited:
                return Admission(engine, transfer_id, reserved=False)
            blocks = self.blocks(engine, tokens)
            if not engine.has_credit(blocks):
                continue
            reserving = asyncio.ensure_future(self.engines.reserve_credit(engine, transfer_id, blocks, self.credit_ttl))
            try:
                await asyncio.shield(reserving)
            except asyncio.CancelledError:
                # The client went away while asking: the rendezvous may grant it yet. The call goes on, and what
                # it granted is given back once it is answered (a release sent now could overtake it).
                self._release_after(reserving, transfer_id)
                raise
            except NotFound:  # the engine is gone: the next listing will not show it
                self.engines.invalidate()
                continue
            except RendezvousError as e:
                if unanswered(e):
                    # The answer was lost: the rendezvous may have granted it. Give it back (retried until it is
                    # acknowledged), and try no other engine with this id (it could hold credit here): the
                    # rendezvous is not answering, so the request is refused (the router's 503).
                    self._release_soon(transfer_id)
                    raise
                if e.reason != "ENGINE_CAPACITY_EXCEEDED":
                    logger.warning("cannot reserve credit on %s: %s", engine.engine_id, e)
                self.metrics.refusals.labels(ENGINE_FULL).inc()
                continue
            self.metrics.reserved.inc()
            return Admission(engine, transfer_id, reserved=True)
        return None

    async def release(self, admission: Admission) -> None:
        """The request ended: give its credit back and let a queued request try again."""
        if admission.reserved:
            try:
                await self.engines.release_credits([admission.transfer_id])
            except RendezvousError as e:  # tried again in the background until the rendezvous takes it
                logger.warning("cannot release credit of %s yet: %s", admission.transfer_id, e)
                self._release_soon(admission.transfer_id, retry=True)
            self.engines.invalidate()  # the listing's credit is stale now
        self._wake()

    def _release_soon(self, transfer_id: str, *, retry: bool = False) -> None:
        """Release transfer_id's credit in the background, trying again (backing off) while the rendezvous does
        not answer, until it does or the reservation has lapsed (`credit_ttl`); `retry`: a first attempt failed."""
        task = asyncio.ensure_future(self._release_until_acknowledged(transfer_id, retry))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    def _release_after(self, reserving: asyncio.Future[CreditResult], transfer_id: str) -> None:
        """Once the ReserveCredits call `reserving` has ended, release transfer_id's credit in the background
        unless the rendezvous refused it (an unanswered call is released as if granted)."""

        async def settle() -> None:
            try:
                await reserving
            except asyncio.CancelledError:
                reserving.cancel()  # the router is closing (`close`): the reservation lapses at its TTL
                raise
            except NotFound:
                return
            except RendezvousError as e:
                if not unanswered(e):  # refused: nothing was granted
                    return
            await self._release_until_acknowledged(transfer_id, retry=False)

        task = asyncio.ensure_future(settle())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_until_acknowledged(self, transfer_id: str, retry: bool) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.credit_ttl
        backoff = _MIN_RETRY
        wait = retry  # a first attempt failed already: back off before the next
        while True:
            if wait:
                if loop.time() + backoff >= give_up:
                    logger.warning("credit of %s was not released: it lapses at its TTL", transfer_id)
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_RELEASE_BACKOFF)
            wait = True
            try:
                await self.engines.release_credits([transfer_id])
            except RendezvousError as e:
                if not unanswered(e):  # refused for good (e.g. permission): nothing a retry changes
                    logger.warning("cannot release credit of %s: %s", transfer_id, e)
                    return
                continue
            self.engines.invalidate()
            self._wake()
            return

    async def settled(self) -> None:
        """Wait until the background releases in flight are done (acknowledged or given up)."""
        while self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)

    async def close(self) -> None:
        """Stop the background releases (the router is closing; their reservations lapse at their TTL)."""
        for task in self._releasing:
            task.cancel()
        await asyncio.gather(*self._releasing, return_exceptions=True)

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.is_set():
                waiter.set()
                return
