"""What a router calls: transfer ids, engines to send a request's two legs to, and aborts."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

from rendezvous.clients._prefix import IndexedPrefix, PrefixIndex
from rendezvous.clients._roles import mint_transfer_id
from rendezvous.clients._types import (
    AbortSpec,
    Binding,
    CreditResult,
    CreditSpec,
    EngineInfo,
    EngineRole,
    EngineView,
    ItemResult,
    KvLayout,
    PrefixMatch,
    PrefixQuery,
    TransferInfo,
)
from rendezvous.clients.aio import AsyncRendezvousClient
from rendezvous.protocol import bindings, kvmap
from rendezvous.protocol.errors import NotFound, RendezvousError

log = logging.getLogger(__name__)

_PAGE_SIZE = 1_000

WAIT_AFTER_INTERVALS = 5
"""An engine list older than this many refresh intervals is waited for; a younger stale one is used while it is
refreshed in the background."""

DEFAULT_BINDING_TTL = 600.0
"""Seconds a router's binding admits the engines it names (`RouterClient(binding_ttl=)`): long enough for a
request to wait in the engines' queues; an engine that already holds its half needs no live binding."""
"""Engines asked for per ListEngines page (the server caps it at its max_engine_page)."""


class PickPolicy(enum.Enum):
    """How a router chooses among the live engines of its pools."""

    ROUND_ROBIN = "round-robin"
    """In turn, in engine id order."""
    LEAST_LOADED = "least-loaded"
    """Fewest requests in flight from this router; ties go to fewer live transfers at the rendezvous (which
    counts other routers' work too, as of the last refresh), then in turn."""
    PREFIX_AWARE = "prefix-aware"
    """Least work: the prompt blocks an engine lacks (the fleet's KV index's answer, `IndexedPrefix`, where the
    caller has one; else `PrefixIndex`, what this router sent it before), plus one, plus `load_weight` times
    the same measure summed over the legs it has in flight from this router (the work queued ahead); ties as
    for least-loaded."""


def layout_difference(producer: KvLayout, consumer: KvLayout) -> str | None:
    """Why a producer with one layout cannot write into a consumer with the other, or None if it can.

    The rendezvous applies the same rule (`rendezvous.protocol.kvmap`), and the KV regions, when it matches
    a transfer.
    """
    mismatch = kvmap.layout_mismatch(producer, (), consumer, ())
    return None if mismatch is None else str(mismatch)


class RouterClient:
    """Picks engines for requests, counts what this router has in flight on each, and aborts transfers.

    Engine lists are cached per pool and role. A list older than `refresh_interval` seconds is refreshed in the
    background and used meanwhile, so a request does not wait for ListEngines; a request waits only for the
    first list, one older than WAIT_AFTER_INTERVALS intervals (an idle router's), or any with interval 0
    (`invalidate` forgets them). `rank_listed` ranks the last lists without a call, for a router whose rendezvous
    does not answer. `on_refresh_error`, if given, is told of each background refresh that failed (after it is
    logged), e.g. to stop calling a rendezvous that does not answer.
    With `binding_key` (the first key of the service's `--binding-key-file`), `bind` signs a transfer to the
    engines chosen for it, for `binding_ttl` seconds; the binding goes into both legs' `kv_transfer_params`.
    """

    def __init__(
        self,
        client: AsyncRendezvousClient,
        *,
        refresh_interval: float = 1.0,
        policy: PickPolicy = PickPolicy.ROUND_ROBIN,
        load_weight: float = 1.0,
        prefix_capacity: int = 1 << 18,
        binding_key: bytes | None = None,
        binding_ttl: float = DEFAULT_BINDING_TTL,
        clock: Callable[[], float] = time.monotonic,
        on_refresh_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must not be negative, not {load_weight:g}")
        if binding_key is not None and len(binding_key) < bindings.MIN_KEY_BYTES:
            raise ValueError(f"a binding key must be at least {bindings.MIN_KEY_BYTES} bytes")
        if binding_ttl <= 0:
            raise ValueError(f"binding_ttl must be positive, not {binding_ttl:g}")
        self._binding_key = binding_key
        self._binding_ttl = binding_ttl
        self._client = client
        self._refresh_interval = refresh_interval
        self.policy = policy
        self.load_weight = load_weight
        self.prefixes = PrefixIndex(prefix_capacity)
        self._work: Counter[str] = Counter()
        self._cache: dict[tuple[str, EngineRole], tuple[float, list[EngineInfo]]] = {}
        self._listed: dict[tuple[str, EngineRole], tuple[float, list[EngineInfo]]] = {}
        """The last list each pool and role got, kept through `invalidate` (`rank_listed`)."""
        self._refreshing: dict[tuple[str, EngineRole], asyncio.Task[list[EngineInfo]]] = {}
        self._clock = clock
        self._on_refresh_error = on_refresh_error
        self._turns: Counter[tuple[tuple[str, ...], EngineRole]] = Counter()
        self._in_flight: Counter[str] = Counter()

    @staticmethod
    def mint_transfer_id() -> str:
        """A fresh transfer id (a uuid4 in hex). Mint a new one for every attempt of a request."""
        return mint_transfer_id()

    def bind(self, transfer_id: str, producer: EngineInfo | str, consumer: EngineInfo | str) -> Binding | None:
        """The binding of transfer_id to the producer and consumer chosen for it; None without a binding key.

        One HMAC, no call: put `binding.to_params()` in both legs' `kv_transfer_params` under
        `rendezvous.protocol.bindings.PARAMS_KEY`.
        """
        if self._binding_key is None:
            return None
        producer_id = producer if isinstance(producer, str) else producer.engine_id
        consumer_id = consumer if isinstance(consumer, str) else consumer.engine_id
        expires = int(time.time() + self._binding_ttl) + 1
        return bindings.sign(self._binding_key, transfer_id, consumer_id, producer_id, expires)

    async def list_engines(self, pool: str = "", role: EngineRole | None = None) -> list[EngineInfo]:
        """Live engines sorted by id in the PLACEMENT view (no NIXL metadata), optionally of one pool and role:
        every page."""
        engines = self._client.iter_engines(pool, role, view=EngineView.PLACEMENT, page_size=_PAGE_SIZE)
        return [engine async for engine in engines]

    async def _live(self, pool: str, role: EngineRole) -> list[EngineInfo]:
        key = (pool, role)
        cached = self._cache.get(key)
        age = self._clock() - cached[0] if cached is not None else float("inf")
        if cached is None or age >= self._refresh_interval * WAIT_AFTER_INTERVALS:
            return await self._refresh(key)
        if age >= self._refresh_interval and key not in self._refreshing:
            task = asyncio.create_task(self._refresh(key))
            self._refreshing[key] = task
            task.add_done_callback(partial(self._refreshed, key))
        return cached[1]

    async def _refresh(self, key: tuple[str, EngineRole]) -> list[EngineInfo]:
        started = self._clock()
        engines = await self.list_engines(*key)
        self._cache[key] = self._listed[key] = (started, engines)
        return engines

    def _refreshed(self, key: tuple[str, EngineRole], task: asyncio.Task[list[EngineInfo]]) -> None:
        self._refreshing.pop(key, None)
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.warning("refreshing the engine list of %s failed: %s", key, error)  # the next request tries again
        if self._on_refresh_error is not None:
            self._on_refresh_error(error)

    async def refreshed(self) -> None:
        """Wait for the background refreshes of engine lists in flight."""
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)

    async def stop_refreshing(self) -> None:
        """Cancel the background refreshes in flight (before the client closes)."""
        for task in self._refreshing.values():
            task.cancel()
        await self.refreshed()

    async def pick_engine(
        self,
        pools: str | Sequence[str],
        role: EngineRole,
        *,
        layout: KvLayout | None = None,
        prefix: Sequence[int] = (),
        indexed: IndexedPrefix | None = None,
    ) -> EngineInfo:
        """A live engine of one of `pools` with `role`, chosen by the policy; with `layout`, only engines that
        can exchange KV with that layout qualify; `prefix` is the prompt's chained block hashes
        (`rendezvous.connector.prompts`), which the prefix-aware policy weighs by this router's memory, unless
        `indexed`, the KV index's answer for the prompt (`index_matches`), tells what the engines hold. Raises
        NotFound if no engine qualifies."""
        return (await self.rank_engines(pools, role, layout=layout, prefix=prefix, indexed=indexed))[0]

    async def rank_engines(
        self,
        pools: str | Sequence[str],
        role: EngineRole,
        *,
        layout: KvLayout | None = None,
        prefix: Sequence[int] = (),
        indexed: IndexedPrefix | None = None,
    ) -> list[EngineInfo]:
        """Every qualifying engine (as for `pick_engine`), best first by the policy: a caller that cannot use
        the first (no credit left on it) goes down the list. Raises NotFound if no engine qualifies."""
        names = (pools,) if isinstance(pools, str) else tuple(pools)
        engines = [engine for pool in names for engine in await self._live(pool, role)]
        if not engines:
            raise NotFound("", f"no live {role.name.lower()} engine in pool(s) {', '.join(names)}")
        if layout is not None:
            compatible = [e for e in engines if _difference(e, layout, role) is None]
            if not compatible:
                why = _difference(engines[0], layout, role)
                raise NotFound(
                    "",
                    f"no {role.name.lower()} engine in pool(s) {', '.join(names)} has a compatible KV layout "
                    f"({engines[0].engine_id}: {why})",
                )
            engines = compatible
        rotated = self._rotated(names, role, engines)
        if self.policy is PickPolicy.ROUND_ROBIN:
            return rotated
        if self.policy is PickPolicy.LEAST_LOADED:
            return sorted(rotated, key=lambda e: (self._in_flight[e.engine_id], e.live_transfers))
        weight = self.load_weight
        return sorted(
            rotated,
            key=lambda e: (
                self._leg_work(e.engine_id, prefix, indexed) + weight * self._work[e.engine_id],
                e.live_transfers,
            ),
        )

    def rank_listed(
        self, pools: str | Sequence[str], role: EngineRole, max_age: float, left_out: Collection[str] = ()
    ) -> list[EngineInfo]:
        """Without a call (for a router whose rendezvous does not answer): the engines of `pools` with `role` in
        the last list each pool got, where that list is at most `max_age` seconds old (`invalidate` does not forget
        it), but those whose ids are in `left_out`; fewest requests in flight from this router first, ties in turn.
        Raises NotFound if there is none."""
        names = (pools,) if isinstance(pools, str) else tuple(pools)
        now = self._clock()
        listed = [
            engine
            for pool in names
            if (last := self._listed.get((pool, role))) is not None and now - last[0] <= max_age
            for engine in last[1]
        ]
        engines = [engine for engine in listed if engine.engine_id not in left_out]
        if not engines:
            but = f" other than the {len(listed)} left out" if listed else ""
            raise NotFound(
                "",
                f"no {role.name.lower()} engine of pool(s) {', '.join(names)} listed in the last {max_age:g} s{but}",
            )
        return sorted(self._rotated(names, role, engines), key=lambda e: self._in_flight[e.engine_id])

    def _rotated(self, names: tuple[str, ...], role: EngineRole, engines: list[EngineInfo]) -> list[EngineInfo]:
        """The engines from this pick's turn on (round-robin, and the tie-break of the other policies)."""
        turn = self._turns[(names, role)]
        self._turns[(names, role)] += 1
        return engines[turn % len(engines) :] + engines[: turn % len(engines)]

    def _leg_work(self, engine_id: str, prefix: Sequence[int], indexed: IndexedPrefix | None = None) -> int:
        """A leg's work on an engine, in blocks: those of the prompt it lacks (as the index says, else as this
        router's memory guesses), plus one."""
        if indexed is not None:
            return indexed.uncached(engine_id) + 1
        return len(prefix) - self.prefixes.matched(engine_id, prefix) + 1

    async def index_matches(
        self, chain: Sequence[bytes], pools: Sequence[str], role: EngineRole | None = None
    ) -> list[PrefixMatch] | None:
        """The fleet's KV index's answer for a chain of block hashes (MatchPrefixes) among the engines of
        `pools`: each indexed engine's matched blocks and hashing. None while the index cannot answer (the
        caller falls back on its memory)."""
        try:
            return await self._client.match_prefixes(PrefixQuery(tuple(chain), pools=tuple(pools), role=role))
        except RendezvousError as e:
            log.warning("the KV index did not answer (%s): placing by this router's memory", e)
            return None

    async def pick_pair(
        self,
        producer_pools: str | Sequence[str],
        consumer_pools: str | Sequence[str],
        *,
        prefix: Sequence[int] = (),
    ) -> tuple[EngineInfo, EngineInfo]:
        """A producer and a consumer with compatible KV layouts for the two legs of one request."""
        consumer = await self.pick_engine(consumer_pools, EngineRole.CONSUMER, prefix=prefix)
        producer = await self.pick_engine(producer_pools, EngineRole.PRODUCER, layout=consumer.layout, prefix=prefix)
        return producer, consumer

    @contextmanager
    def in_flight(
        self, engine: EngineInfo, prefix: Sequence[int] = (), indexed: IndexedPrefix | None = None
    ) -> Iterator[None]:
        """Count a request leg as in flight on `engine` while the block runs (for least-loaded), with its work
        (for prefix-aware); the engine is then taken to hold the leg's prompt blocks `prefix`."""
        engine_id = engine.engine_id
        work = self._leg_work(engine_id, prefix, indexed)
        self.prefixes.record(engine_id, prefix)
        self._in_flight[engine_id] += 1
        self._work[engine_id] += work
        try:
            yield
        finally:
            for counter, amount in ((self._in_flight, 1), (self._work, work)):
                counter[engine_id] -= amount
                if not counter[engine_id]:
                    del counter[engine_id]

    async def lightest_load(self, pools: str | Sequence[str], role: EngineRole) -> int:
        """The fewest request legs this router has in flight on any live engine of `pools` with `role`
        (0 when there is none: nothing is busy)."""
        names = (pools,) if isinstance(pools, str) else tuple(pools)
        engines = [engine for pool in names for engine in await self._live(pool, role)]
        return min((self._in_flight[e.engine_id] for e in engines), default=0)

    def load(self, engine_id: str) -> int:
        """Request legs this router has in flight on an engine."""
        return self._in_flight[engine_id]

    def invalidate(self) -> None:
        """Forget the cached engine lists (e.g. after an engine failed a request)."""
        self._cache.clear()

    async def abort_transfers(self, aborts: Sequence[AbortSpec]) -> list[ItemResult]:
        """Abort transfers as the router; both sides are told. A refused item is returned, not raised."""
        return await self._client.abort_transfers("", aborts)

    async def abort_transfer(self, transfer_id: str, message: str = "") -> ItemResult:
        """Abort one transfer as the router; raises the item's error."""
        return await self._client.abort_transfer("", AbortSpec(transfer_id, message))

    async def reserve_credit(
        self, engine: EngineInfo | str, transfer_id: str, blocks: int = 0, ttl: float = 0.0
    ) -> CreditResult:
        """Reserve credit for one transfer on a consumer (ReserveCredits); raises the item's error, e.g.
        ResourceExhausted (ENGINE_CAPACITY_EXCEEDED) when another router took the last of it."""
        engine_id = engine if isinstance(engine, str) else engine.engine_id
        [result] = await self._client.reserve_credits([CreditSpec(transfer_id, engine_id, blocks)], ttl=ttl)
        return result.raise_for_error()

    async def release_credits(self, transfer_ids: Sequence[str]) -> list[CreditResult]:
        """Drop the reservations of transfer ids (ReleaseCredits); ids without one are OK.

        A refused item is returned, not raised.
        """
        return await self._client.release_credits(transfer_ids)

    async def get_transfer(self, transfer_id: str) -> TransferInfo:
        """One transfer's state."""
        return await self._client.get_transfer(transfer_id)


def _difference(engine: EngineInfo, layout: KvLayout, role: EngineRole) -> str | None:
    if role == EngineRole.PRODUCER:
        return layout_difference(engine.layout, layout)
    return layout_difference(layout, engine.layout)
