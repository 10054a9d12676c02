"""Engine sessions: a registration kept alive, its events watched, its transfers re-asserted.

A session survives what a long-running engine meets:
- a broken Watch stream resumes from the sequence after the last event delivered, and a broken KeepAlive
  stream is reopened; so is one the server ended without an error (a replica shutting down gracefully, a
  proxy's stream timeout), on the client's next endpoint, as after an UNAVAILABLE;
- a watch that fell behind the server's retention lists the engine's transfers and delivers a
  `Resynced` notification instead of the lost events;
- a server restart (a new epoch: a memory store lost everything) or a lost registration
  (ENGINE_NOT_FOUND, LEASE_EXPIRED) makes it register a new incarnation and re-assert the
  transfers it still wants, then deliver a `Reregistered` notification.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Self

import grpc

from rendezvous.clients._config import SessionConfig
from rendezvous.clients._memo import remember
from rendezvous.clients._retry import Backoff, renewal_wait, retry_hint
from rendezvous.clients._types import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    EngineInfo,
    EngineRole,
    EngineSpec,
    EngineView,
    EventType,
    ItemResult,
    Registration,
    Reregistered,
    Resynced,
    RevocationAck,
    ServerEvent,
    SessionCause,
    SessionEvent,
    SourceReadySpec,
    TargetSpec,
    TransferState,
)
from rendezvous.clients.aio import AsyncRendezvousClient
from rendezvous.protocol.errors import Cancelled, FailedPrecondition, Reason, RendezvousError

log = logging.getLogger("rendezvous.clients.session")

EventHandler = Callable[[SessionEvent], Awaitable[None]]
"""A coroutine function a session calls with each event, one at a time, in order."""

BatchCall = Callable[..., Awaitable[list[ItemResult]]]

_ENGINE_GONE = frozenset({Reason.ENGINE_NOT_FOUND, Reason.LEASE_EXPIRED})
_TRANSFER_GONE = frozenset({Reason.TRANSFER_ENDED, Reason.TRANSFER_NOT_FOUND})
_OVER = frozenset({TransferState.COMMITTED, TransferState.RELEASED, TransferState.ABORTED})
_ENDING_EVENTS = frozenset({EventType.TRANSFER_COMMITTED, EventType.TRANSFER_ABORTED})
_ENDED_KEPT = 65_536
_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)


def write_fence(sent: float, lease_ttl: float, renew_fraction: float) -> float:
    """Until when a lease granted `lease_ttl` by a RegisterEngine or KeepAlive sent at `sent` is certainly held, less
    the margin that WRITEs posted up to then have to land: `sent + lease_ttl * (1 - margin)`.

    The service lapses the lease no earlier than `sent + lease_ttl` (it counts the TTL from when it got the call,
    which is after `sent`), and only then tells the consumer PEER_LOST and lets it reuse its blocks: a WRITE posted
    before the fence has `margin * lease_ttl` to land. The margin is one renewal period (`renew_fraction`), but at
    most half of what a renewal leaves of the lease (`(1 - renew_fraction) / 2`): the next renewal is sent
    `renew_fraction` of the TTL after this one was answered, and its answer must move the fence on before it is
    reached, or a healthy engine would stop writing between renewals. With the default third, the fence is two
    thirds of the TTL after the renewal was sent, the next renewal goes out at a third, so a renewal may take a
    third of the TTL before writes stop; and a producer cut off from the service stops writing a third of the TTL
    before the service can even lapse its lease."""
    return sent + lease_ttl * (1 - _margin(renew_fraction))


def follow_fence(sent: float, lease_remaining: float, lease_ttl: float, renew_fraction: float) -> float:
    """The write fence of a rank that follows another's registration (`RankSession`), from a GetEngine sent at `sent`
    whose answer said `lease_remaining` of the lease was left: `sent + lease_remaining - margin * lease_ttl`, with
    `write_fence`'s margin for the WRITEs posted before it to land.

    The server measured what was left when it answered, after `sent`, by the clock it lapses the lease by: the lease
    lapses no earlier than `sent + lease_remaining`, whatever this host's clock says of the server's (only their
    rates must agree; between a service's replicas, their skew counts: docs/operations.md)."""
    return sent + lease_remaining - lease_ttl * _margin(renew_fraction)


def follow_period(lease_ttl: float, renew_fraction: float) -> float:
    """How often a following rank reads the lease: half of what its fence leaves of the lease at worst.

    The registering rank renews every `renew_fraction` of the TTL, so a read may find as little as
    `1 - renew_fraction` of it left (less the renewal's own time); the fence is then `1 - renew_fraction - margin`
    of the TTL after the read was sent, and the next read, sent half of that later, has the other half to be
    answered before a healthy engine's writes would stop. A sixth of the TTL with the default third."""
    return lease_ttl * (1 - renew_fraction - _margin(renew_fraction)) / 2


def _margin(renew_fraction: float) -> float:
    """The fraction of the TTL a WRITE posted before the fence has to land (`write_fence`)."""
    return min(renew_fraction, (1 - renew_fraction) / 2)


def _smaller_batch(err: RendezvousError, sent: int) -> int:
    """The batch size to try after `sent` items were refused BATCH_TOO_LARGE: the server's limit (its ErrorInfo
    metadata), else half."""
    try:
        limit = int(err.metadata.get("limit", ""))
    except ValueError:
        limit = 0
    return limit if 0 < limit < sent else max(sent // 2, 1)


class _Closed:
    """Ends the event queue."""


_CLOSED = _Closed()


class LiveTransfers:
    """What an engine asserted and still wants: re-sent to each new incarnation.

    A consumer's target and a producer's claim or ready source are kept until this engine sees the
    transfer end for it: COMMITTED (the bytes arrived), RELEASED, ABORTED or unknown to the server.
    """

    def __init__(self) -> None:
        self.targets: dict[str, TargetSpec] = {}
        self.claims: dict[str, ClaimSpec] = {}
        self.sources: dict[str, SourceReadySpec] = {}
        # Transfers an event ended, by the count of ends at that moment: a call's result that was in flight
        # while the event arrived must not bring them back (its answer says MATCHED; the event came later
        # on the server and earlier here). The newest _ENDED_KEPT only: older calls are long answered.
        self._ends = 0
        self._ended: OrderedDict[str, int] = OrderedDict()
        # The calls recorded so far, and for each transfer held the count when a call last asserted it: a listing
        # read while a call was answered may lack that call's transfer, and `retain` must not drop it.
        self._records = 0
        self._asserted: dict[str, int] = {}

    def mark(self) -> int:
        """A position to pass to `record` as `since`: ends noted after it win over that call's results."""
        return self._ends

    def __len__(self) -> int:
        return len(self.targets.keys() | self.claims.keys() | self.sources.keys())

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self.targets or transfer_id in self.claims or transfer_id in self.sources

    def records(self) -> int:
        """A position to pass to `retain` as `since`: transfers a call asserted after it are kept."""
        return self._records

    def end(self, transfer_id: str) -> None:
        """Forget a transfer."""
        self.targets.pop(transfer_id, None)
        self.claims.pop(transfer_id, None)
        self.sources.pop(transfer_id, None)
        self._asserted.pop(transfer_id, None)

    def record(
        self,
        table: dict[str, Any] | None,
        specs: Sequence[Any],
        results: Sequence[ItemResult],
        since: int | None = None,
    ) -> None:
        """Note a batch's results; items of an asserting call (table given) are remembered there.

        `since` is `mark()` taken before the call was sent: a transfer an event ended after it stays ended.
        """
        self._records += 1
        for spec, result in zip(specs, results, strict=True):
            if result.ok and result.state not in _OVER:
                if table is not None and (since is None or self._ended.get(spec.transfer_id, since) <= since):
                    table[spec.transfer_id] = spec
                    self._asserted[spec.transfer_id] = self._records
            elif result.ok or (result.error is not None and result.error.reason in _TRANSFER_GONE):
                self.end(spec.transfer_id)

    def on_event(self, event: ServerEvent) -> None:
        """Note an event: committed and aborted transfers are over."""
        if event.type in _ENDING_EVENTS and event.transfer is not None:
            transfer_id = event.transfer.transfer_id
            self.end(transfer_id)
            self._ends += 1
            remember(self._ended, transfer_id, self._ends, _ENDED_KEPT)

    def retain(self, live: Iterable[str], since: int | None = None) -> set[str]:
        """Keep only these transfers (the server's view after a resync), and those a call asserted after `since`
        (`records()` taken before the view was read: it may have been read before the call's write). Returns
        those dropped."""
        keep = set(live)
        dropped: set[str] = set()
        for table in (self.targets, self.claims, self.sources):
            for transfer_id in table.keys() - keep:
                if since is None or self._asserted.get(transfer_id, 0) <= since:
                    del table[transfer_id]
                    self._asserted.pop(transfer_id, None)
                    dropped.add(transfer_id)
        return dropped


class EngineSession:
    """An engine's registration, lease and event stream, kept alive across failures.

    `start()` (or `async with`) registers the engine, then renews its lease over a KeepAlive stream
    every `renew_fraction` of the TTL and watches its events. Events go to `handler` if one is given,
    else to `events()`. Transfer calls made through the session use its current incarnation, wait
    while it re-registers, and are remembered so they can be re-asserted (see the module doc).
    Use `ProducerSession` or `ConsumerSession`, which add the calls of each role.

    `writable_until` is the write fence of a producer's data plane (readable from any thread; see `write_fence`).
    """

    def __init__(
        self,
        client: AsyncRendezvousClient,
        spec: EngineSpec,
        *,
        config: SessionConfig | None = None,
        handler: EventHandler | None = None,
    ) -> None:
        self._client = client
        self._spec = spec
        self._config = config or SessionConfig()
        self._handler = handler
        self._queue: asyncio.Queue[SessionEvent | _Closed] = asyncio.Queue()
        self._live = LiveTransfers()
        self._registration: Registration | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._dispatch_task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None
        self._registering: asyncio.Task[Registration] | None = None  # a re-registration's RegisterEngine (`_register`)
        self._reregistered = asyncio.Event()  # cleared while a recovery has not registered the new incarnation yet
        self._remove_listener: Callable[[], None] | None = None
        self._failure: RendezvousError | None = None
        self._closing = False  # `begin_close` was called: no recovery any more
        self._settling = False  # closing a healthy session: calls as its incarnation still go, until the lease
        self._lost = False  # closed while re-registering, before the new incarnation was registered
        self._sending: set[asyncio.Future[list[ItemResult]]] = set()  # calls sent and not answered yet
        self._cutoff: asyncio.TimerHandle | None = None  # cuts the calls still unanswered once the lease may lapse
        self._closed = False
        self._fenced = True  # it keeps a write fence (a RankSession may not: `fenced`)
        self._lease_until = 0.0  # the current incarnation's write fence (`write_fence`)
        self._replacing = False  # from a re-registration's start until the handler took its Reregistered
        self._taken_of = (0, 0)  # (epoch, incarnation) whose events the handler takes (`events_incarnation`)
        self.writable_until = 0.0
        """Until when (`time.monotonic()`, asyncio's `loop.time()`) the engine may post WRITEs into its consumers'
        blocks: the send time of the last RegisterEngine or KeepAlive answered, plus the TTL it granted, less a
        margin for the WRITEs in flight (`write_fence`). Past it the lease may be gone, and the consumer may have
        been told PEER_LOST and reused its blocks. A plain float, so another thread (the NIXL writer) reads it
        without a lock. 0.0 before `start`; closed (moved to the moment, if later) when a re-registration starts,
        the old incarnation gone with its lease, and after `close`; a re-registration moves it on to the new
        incarnation's lease only once the handler (or `events()`'s reader) has taken its `Reregistered`, which
        tells which of the old incarnation's transfers live on: until then, nothing assigned to the old one is
        written. A writer that asks meanwhile fails its generation rather than waits for the re-registration, as
        waiting would not make the write safe: the service no longer fences an assignment of the replaced
        incarnation. A lapsed lease (ENGINE_NOT_FOUND, LEASE_EXPIRED) aborted its transfers and told their consumers
        PEER_LOST; a new epoch forgot which generation it assigned to whom, so a consumer whose transfer ends in it
        before it is matched again (aborted, or refused when re-asserted) is sent no TRANSFER_REVOKED to wait for and
        reuses its blocks at once. A `RankSession` holds no lease: its fence follows the lease rank 0 holds
        (`follow_fence`)."""

    # State

    @property
    def client(self) -> AsyncRendezvousClient:
        """The client the session calls through."""
        return self._client

    @property
    def engine_id(self) -> str:
        """The engine's id."""
        return self._spec.engine_id

    @property
    def engine(self) -> EngineInfo:
        """The current incarnation as registered."""
        return self._registered().engine

    @property
    def incarnation(self) -> int:
        """The current incarnation (0 before `start`)."""
        return self._registration.engine.incarnation if self._registration else 0

    @property
    def epoch(self) -> int:
        """The server epoch the current incarnation was registered in."""
        return self._registration.epoch if self._registration else 0

    @property
    def incarnation_id(self) -> tuple[int, int]:
        """The current incarnation as `(epoch, incarnation)`: unlike its number alone, it names one incarnation
        across server restarts too (a new epoch may number its incarnations anew)."""
        return (self.epoch, self.incarnation)

    @property
    def events_incarnation(self) -> tuple[int, int]:
        """The incarnation (`(epoch, incarnation)`, as `incarnation_id`) whose events the handler (or `events()`'s
        reader) is taking: the current one's only once it took the `Reregistered` that announced it, as the events
        of the one it replaced come before. What it was assigned so far was assigned to this incarnation."""
        return self._taken_of

    @property
    def replacing(self) -> bool:
        """A re-registration closed the write fence and the handler has not taken its `Reregistered` yet (a session
        that keeps a write fence: see `writable_until`)."""
        return self._replacing

    def is_current(self, incarnation_id: tuple[int, int]) -> bool:
        """Whether `incarnation_id` (`(epoch, incarnation)`) is the current incarnation, with no re-registration
        under way to replace it."""
        recovering = self._recovery is not None and not self._recovery.done()
        return incarnation_id == self.incarnation_id and not recovering

    @property
    def live_transfers(self) -> LiveTransfers:
        """The transfers the session would re-assert now (read-only by convention)."""
        return self._live

    @property
    def failure(self) -> RendezvousError | None:
        """The error that stopped the session, if one did (e.g. the server refused to register it)."""
        return self._failure

    def _registered(self) -> Registration:
        if self._registration is None:
            raise RuntimeError("the session is not started")
        return self._registration

    # Lifecycle

    async def start(self) -> EngineInfo:
        """Register the engine and start renewing its lease and watching its events."""
        if self._registration is not None or self._closing:
            raise RuntimeError("a session starts once")
        sent = asyncio.get_running_loop().time()
        self._registration = await self._client.register_engine(self._spec)
        self._taken_of = self.incarnation_id
        self._leased(sent, self._registration.engine.lease_ttl)
        self._remove_listener = self._client.add_epoch_listener(self._on_epoch)
        self._keepalive_task = asyncio.create_task(self._keep_alive(), name=f"keepalive {self.engine_id}")
        self._start_watch()
        if self._handler is not None:
            self._dispatch_task = asyncio.create_task(self._dispatch(self._handler), name=f"events {self.engine_id}")
        return self.engine

    def begin_close(self) -> None:
        """Start closing (idempotent; `close` begins with it), so that what the session's calls wait for ends.

        The lease is no longer renewed (nor, by a `RankSession`, read) and the write fence is closed. A re-registration
        under way (a `RankSession`'s wait for the next incarnation rank 0 registers) is cancelled, though not its
        RegisterEngine in flight (`close` takes its answer over), and none starts any more: the calls waiting for it,
        and any made later, fail with `Cancelled` at once, and so do the calls in flight, sent as the incarnation it
        replaces. On a healthy session, calls as the current incarnation still go
        and are waited for, so that what an agent submitted last (a completion) is reported before the engine is
        deregistered; but only while the lease last renewed (or read) certainly holds, until its write fence: a call
        still unanswered then fails with `Cancelled`. (A `RankSession` with no fence, a consumer rank's, knows no
        lease: its calls in flight have their own deadline.)
        """
        if self._closing:
            return
        self._closing = True
        self._close_fence()
        recovery = self._recovery
        recovering = recovery is not None and not recovery.done()
        self._lost = recovering and not self._reregistered.is_set()
        self._settling = not recovering and self._failure is None
        for task in (recovery, self._keepalive_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        loop = asyncio.get_running_loop()
        if not self._settling or self._lease_until <= loop.time():
            self._cut()
        elif self._lease_until != math.inf:
            self._cutoff = loop.call_at(self._lease_until, self._cut)

    def _cut(self) -> None:
        """The calls in flight fail with `Cancelled` (`_send`), and so do later ones (`_ready`)."""
        self._settling = False
        for call in list(self._sending):
            call.cancel()

    async def close(self, *, deregister: bool = True) -> None:
        """Stop the background tasks and, unless told not to, deregister the engine.

        It begins with `begin_close`: calls waiting for a re-registration (or, on a `RankSession`, for an incarnation
        to follow) fail with `Cancelled` at once; the calls in flight of a healthy session are waited for, until
        the lease may have lapsed, before the engine is deregistered; calls made from now on fail with `Cancelled`.

        Closed while re-registering, before the new incarnation is registered, it does not deregister the incarnation
        being replaced, gone already (its lease lapsed, or the server forgot it), and the recovery is cancelled, so
        no new one is registered after close. A RegisterEngine the recovery already sent may land all the same:
        close waits for its answer, up to a lease TTL, and deregisters the incarnation it registered (that one, by
        its number: never a later one another process registered). Only an incarnation whose RegisterEngine was
        not answered within that time (a service that stopped answering) may remain; never renewed, it lapses with
        its lease. With `deregister=False` the RegisterEngine in flight is cancelled, and not waited for.
        """
        if self._closed:
            return
        self.begin_close()
        self._closed = True
        while self._sending:
            await asyncio.wait(list(self._sending))
        if self._cutoff is not None:
            self._cutoff.cancel()
        if self._remove_listener is not None:
            self._remove_listener()
        current = asyncio.current_task()
        tasks = [
            t
            for t in (self._keepalive_task, self._watch_task, self._recovery, self._dispatch_task)
            if t is not None and t is not current
        ]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._queue.put_nowait(_CLOSED)
        if not deregister or self._failure is not None:
            registration = None
            if self._registering is not None:
                self._registering.cancel()
                await asyncio.wait([self._registering])
        else:
            registration = await self._orphan() if self._lost else self._registration
        if registration is not None:
            try:
                await self._client.deregister_engine(self.engine_id, registration.engine.incarnation)
            except RendezvousError as err:
                if err.reason not in _ENGINE_GONE and err.reason != Reason.STALE_INCARNATION:
                    raise

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def events(self) -> AsyncIterator[SessionEvent]:
        """The session's events in order; ends when the session closes, raises if it failed."""
        if self._handler is not None:
            raise RuntimeError("this session delivers its events to its handler")
        while True:
            item = await self._queue.get()
            if isinstance(item, _Closed):
                self._queue.put_nowait(item)
                if self._failure is not None:
                    raise self._failure
                return
            yield item
            self._taken(item)

    # Transfer calls shared by both roles

    async def complete_transfers(
        self, completions: Sequence[CompletionSpec], *, assigned_to: tuple[int, int] | None = None
    ) -> list[ItemResult]:
        """Report the outcomes of moving bytes (the producer in push mode, the consumer in pull).

        A refused item is returned, not raised. `assigned_to`: the incarnation (`(epoch, incarnation)`: its
        `events_incarnation` when it was told of the writes) whose assignments these outcomes answer. They belong
        to it: sent once any re-registration is done, as that incarnation only; when it was replaced (before, or
        while the call was in flight) nothing is sent again, and each item is refused here with STALE_INCARNATION,
        as the service refuses a replaced incarnation's call. The service ended (a lapsed lease, a re-registration)
        or forgot (a new epoch) a replaced incarnation's assignments; sent as the new incarnation, a report would
        act on the new one's match of the same transfer and generation, a FAILED one aborting a transfer both
        sides re-asserted. None: sent as the current incarnation, like every other call.
        """
        if assigned_to is None:
            return await self._call(self._client.complete_transfers, completions)
        return await self._call_as(self._client.complete_transfers, completions, assigned_to)

    async def _acknowledge_revocations(
        self, acks: Sequence[RevocationAck], revoked_to: tuple[int, int] | None
    ) -> list[ItemResult]:
        """AcknowledgeRevocations (a producer's, or a producer rank's) as `revoked_to` only, when given: an ack says
        that no WRITE of a generation the service revoked from that incarnation can land. After a re-registration
        (a new epoch: the transfer matched again, its generations numbered anew) the same generation may be the new
        incarnation's, whose WRITE may still be in flight: sent as the new one, a replaced incarnation's ack would
        let the consumer free blocks that WRITE can still land in. The service ended or forgot the revocation."""
        if revoked_to is None:
            return await self._call(self._client.acknowledge_revocations, acks)
        return await self._call_as(self._client.acknowledge_revocations, acks, revoked_to)

    async def complete_transfer(self, completion: CompletionSpec) -> ItemResult:
        """Report one outcome; raises the item's error."""
        return (await self.complete_transfers((completion,)))[0].raise_for_error()

    async def abort_transfers(self, aborts: Sequence[AbortSpec]) -> list[ItemResult]:
        """Abort transfers this engine takes part in; the peers are told. A refused item is returned, not raised."""
        return await self._call(self._client.abort_transfers, aborts)

    async def abort_transfer(self, abort: AbortSpec) -> ItemResult:
        """Abort one transfer; raises the item's error."""
        return (await self.abort_transfers((abort,)))[0].raise_for_error()

    async def _call(
        self, send: BatchCall, specs: Sequence[Any], table: dict[str, Any] | None = None
    ) -> list[ItemResult]:
        """Send a batch as the current incarnation; track what it asserted (into table) or ended.

        If the engine's registration is gone, re-register first and send again. If the incarnation
        was replaced while an asserting call was in flight, its effects may belong to a server that
        forgot them: send it again as the new incarnation (asserting twice is harmless).
        """
        incarnation = await self._ready()
        since = self._live.mark()
        try:
            results = await self._send(send, specs, incarnation)
        except RendezvousError as err:
            if not self._replaced(err, incarnation) or self._closing:  # closing: no new incarnation will come
                raise
            incarnation = await self._ready()
            results = await self._send(send, specs, incarnation)
        self._live.record(table, specs, results, since)
        if table is not None and incarnation != self.incarnation:
            return await self._call(send, specs, table)
        return results

    async def _call_as(
        self, send: BatchCall, specs: Sequence[Any], incarnation_id: tuple[int, int]
    ) -> list[ItemResult]:
        """Send a batch as the incarnation `incarnation_id` only (see `complete_transfers`'s `assigned_to`,
        `acknowledge_revocations`' `revoked_to`): once it was replaced, each item is refused with STALE_INCARNATION,
        unsent."""
        incarnation = await self._ready()
        if (self.epoch, incarnation) == incarnation_id:
            since = self._live.mark()
            try:
                results = await self._send(send, specs, incarnation)
            except RendezvousError as err:
                if not self._replaced(err, incarnation):
                    raise
            else:
                self._live.record(None, specs, results, since)  # what they ended (a commit) is not re-asserted
                return results
        epoch, number = incarnation_id
        stale = FailedPrecondition(
            Reason.STALE_INCARNATION,
            f"engine {self.engine_id}: incarnation {number} (epoch {epoch}) was replaced by {self.incarnation}"
            f" (epoch {self.epoch}): not sent as the new one",
        )
        return [ItemResult(spec.transfer_id, TransferState.UNSPECIFIED, stale) for spec in specs]

    async def _send(self, send: BatchCall, specs: Sequence[Any], incarnation: int) -> list[ItemResult]:
        """One call as `incarnation`, which `begin_close` may cut: it then fails with `Cancelled`."""
        call = asyncio.ensure_future(send(self.engine_id, specs, incarnation=incarnation))
        self._sending.add(call)
        call.add_done_callback(self._sending.discard)
        try:
            return await call  # cancelling the caller cancels the call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closing and call.cancelled() and not (task is not None and task.cancelling()):
                raise Cancelled(
                    "", f"the session of engine {self.engine_id} closed before the call was answered"
                ) from None
            raise

    async def _ready(self) -> int:
        """The incarnation to act as, once any re-registration in progress is done."""
        recovery = self._recovery
        if recovery is not None and not recovery.done():
            await asyncio.wait([recovery])  # waiting must not cancel it; `begin_close` cancels it
        if self._failure is not None:
            raise self._failure
        if self._closed or (self._closing and not self._settling):
            raise Cancelled("", f"the session of engine {self.engine_id} is closed")
        return self._registered().engine.incarnation

    def _replaced(self, err: RendezvousError, incarnation: int) -> bool:
        """Whether err says the incarnation is (or is being) replaced, so the call may be resent."""
        if err.reason in _ENGINE_GONE:
            self._recover(Reason(err.reason), incarnation)
            return True
        if err.reason != Reason.STALE_INCARNATION:
            return False
        # Replaced already, or by the re-registration under way (the server may have its new incarnation
        # before this session does): either way the call is resent as the new incarnation.
        return incarnation != self.incarnation or (self._recovery is not None and not self._recovery.done())

    # Re-registration

    def _on_epoch(self, old: int, new: int) -> None:
        registration = self._registration
        if registration is not None and new != registration.epoch:
            self._recover(SessionCause.EPOCH_CHANGED, registration.engine.incarnation)

    def _recover(self, cause: Reason | SessionCause, incarnation: int) -> None:
        """Start re-registering, unless it is under way or incarnation was already replaced."""
        if self._recovery is not None and not self._recovery.done():
            return
        if self._closing or self._failure is not None or incarnation != self.incarnation:
            return
        log.warning("engine %s re-registering: %s", self.engine_id, cause)
        if self._fenced:  # the incarnation is gone, its lease with it: nothing assigned to it is written any more
            self._replacing = True
            self._close_fence()
        self._reregistered.clear()  # from now: a close() before the registration deregisters only `_orphan`'s
        self._recovery = asyncio.create_task(self._reregister(cause), name=f"reregister {self.engine_id}")

    async def _reregister(self, cause: Reason | SessionCause) -> None:
        previous = self.incarnation
        self._reregistered.clear()
        watch = self._watch_task
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
            await asyncio.wait([watch])
        backoff = Backoff(self._config.reconnect)
        registered = False
        results: dict[str, ItemResult] = {}  # every round's, the last per transfer (one may end another's)
        while True:
            try:
                if not registered:
                    sent = asyncio.get_running_loop().time()
                    self._registration = await self._register()
                    self._leased(sent, self._registration.engine.lease_ttl)  # the fence opens at `_taken`
                    registered = True
                    self._reregistered.set()  # its lease runs from now: the keep-alive renews it meanwhile
                await self._reassert(results)
                break
            except RendezvousError as err:
                if err.reason in _ENGINE_GONE:
                    registered = False
                    self._reregistered.clear()
                elif err.code not in _TRANSIENT:
                    self._fail(err)
                    return
                # Re-asserting again as the same incarnation is harmless; registering again would
                # abort what this incarnation already re-asserted.
                log.warning("engine %s re-registration failed, retrying: %s", self.engine_id, err)
                await asyncio.sleep(backoff.after(err))
        log.info("engine %s re-registered as incarnation %d", self.engine_id, self.incarnation)
        self._deliver(Reregistered(cause, previous, self.incarnation, self.epoch, tuple(results.values())))
        self._start_watch()

    async def _register(self) -> Registration:
        """A re-registration's RegisterEngine, which cancelling the recovery does not cancel: once sent it may land
        whether or not its answer is awaited, so `close` takes its answer over and deregisters what it registered."""
        call = asyncio.create_task(self._client.register_engine(self._spec), name=f"register {self.engine_id}")
        self._registering = call
        registration = await asyncio.shield(call)
        self._registering = None  # taken: from here on the recovery deregisters what it registered, or close does
        return registration

    async def _orphan(self) -> Registration | None:
        """The incarnation the cancelled recovery's RegisterEngine registered, if it was sent: its answer is waited
        for up to a lease TTL (as long as that incarnation, never renewed, would live); unanswered by then, the call
        is cancelled and None is returned, as for a call that failed (it registered nothing) or was never sent."""
        call, self._registering = self._registering, None
        if call is None:
            return None
        if not call.done():
            await asyncio.wait([call], timeout=self._registered().engine.lease_ttl)
            if not call.done():
                call.cancel()
                await asyncio.wait([call])
        if call.cancelled() or call.exception() is not None:
            return None
        return call.result()

    async def _reassert(self, results: dict[str, ItemResult]) -> None:
        """Send what the session still wants to the new incarnation: targets, claims, ready sources; each item's
        result into `results`, by transfer id."""
        live, client, size = self._live, self._client, self._config.reassert_batch
        for send, table in (
            (client.register_targets, live.targets),
            (client.claim_transfers, live.claims),
            (client.mark_sources_ready, live.sources),
        ):
            specs: list[Any] = list(table.values())
            start = 0
            while start < len(specs):
                chunk = specs[start : start + size]
                since = live.mark()
                try:
                    chunk_results = await send(self.engine_id, chunk, incarnation=self.incarnation)
                except RendezvousError as err:
                    if err.reason != Reason.BATCH_TOO_LARGE or len(chunk) == 1:
                        raise
                    size = _smaller_batch(err, len(chunk))  # the server's limit is below reassert_batch
                    continue
                live.record(table, chunk, chunk_results, since)
                results.update((r.transfer_id, r) for r in chunk_results)
                start += len(chunk)

    def _fail(self, err: RendezvousError) -> None:
        log.error("engine session %s stopped: %s", self.engine_id, err)
        self._failure = err
        self._queue.put_nowait(_CLOSED)
        current = asyncio.current_task()
        for task in (self._keepalive_task, self._watch_task):
            if task is not None and task is not current:
                task.cancel()

    # The write fence

    def _leased(self, sent: float, lease_ttl: float) -> None:
        """A RegisterEngine or KeepAlive of the current incarnation sent at `sent` was answered: move the fence on
        (unless a re-registration waits for its Reregistered to be taken)."""
        self._move_fence(write_fence(sent, lease_ttl, self._config.renew_fraction))

    def _move_fence(self, until: float) -> None:
        """The current incarnation's lease holds until `until` (less the margin): the fence moves there, unless a
        re-registration waits for its Reregistered to be taken."""
        self._lease_until = until
        if not self._replacing and not self._closing:
            self.writable_until = until

    def _close_fence(self) -> None:
        self.writable_until = min(self.writable_until, time.monotonic())  # asyncio's loop.time()

    def _taken(self, item: SessionEvent) -> None:
        """The handler (or `events()`'s reader) took `item`: a Reregistered of the current incarnation, with no
        other re-registration under way, opens the fence on its lease."""
        if isinstance(item, Reregistered):
            self._taken_of = (item.epoch, item.incarnation)
        if (
            isinstance(item, Reregistered)
            and self._replacing
            and item.incarnation == self.incarnation
            and (self._recovery is None or self._recovery.done())
            and not self._closing
        ):
            self._replacing = False
            self.writable_until = self._lease_until

    # Background tasks

    async def _keep_alive(self) -> None:
        """Renew the lease every renew_fraction of its TTL; a failed renewal is retried after the reconnect backoff,
        or, refused with the server's retry hint (RATE_LIMITED), after the hint, bounded by what is left of the lease
        (`renewal_wait`)."""
        fraction = self._config.renew_fraction
        backoff = Backoff(self._config.reconnect)
        delay = self.engine.lease_ttl * fraction
        incarnation = self.incarnation
        loop = asyncio.get_running_loop()
        expires = loop.time() + self.engine.lease_ttl  # when the lease lapses, by this session's reckoning
        while True:
            async with self._client.keep_alive() as stream:
                try:
                    while True:
                        await asyncio.sleep(delay)
                        incarnation = self.incarnation
                        # Unanswered for as long as the wait between renewals, it is given up while the lease
                        # still has time for another endpoint to renew it.
                        bound = self.engine.lease_ttl * fraction
                        sent = loop.time()
                        renewal = await stream.renew(self.engine_id, incarnation, timeout=bound)
                        backoff.reset()
                        delay = renewal.lease_ttl * fraction
                        expires = sent + renewal.lease_ttl
                        if incarnation == self.incarnation:
                            self._leased(sent, renewal.lease_ttl)
                except RendezvousError as err:
                    if self._replaced(err, incarnation):
                        await self._until_registered()
                        if self._failure is not None:
                            return
                        delay = self.engine.lease_ttl * fraction
                        expires = loop.time() + self.engine.lease_ttl
                    elif err.code in _TRANSIENT:
                        delay = backoff.next()
                        hint = retry_hint(err)
                        if hint is not None:
                            # The last moment to renew: what a renewal may take (its bound) before the lease lapses.
                            latest = expires - loop.time() - self.engine.lease_ttl * fraction
                            delay = renewal_wait(delay, hint, latest)
                        log.warning(
                            "engine %s lease renewal failed, retrying in %.2f s: %s", self.engine_id, delay, err
                        )
                    else:
                        self._fail(err)
                        return

    async def _until_registered(self) -> None:
        """Until a recovery under way has registered the new incarnation (whose lease runs from then, however long
        its re-assertion takes) or ended."""
        recovery = self._recovery
        if recovery is None or recovery.done() or self._reregistered.is_set():
            return
        registered = asyncio.ensure_future(self._reregistered.wait())
        try:
            await asyncio.wait([recovery, registered], return_when=asyncio.FIRST_COMPLETED)
        finally:
            registered.cancel()

    def _start_watch(self) -> None:
        start = self._registered().watch_start_sequence
        self._watch_task = asyncio.create_task(self._watch(start), name=f"watch {self.engine_id}")

    async def _watch(self, sequence: int) -> None:
        """Deliver the incarnation's events from sequence on, resuming after every disconnect.

        A resync (the server no longer holds sequence) advances sequence only once the transfer
        list was delivered, so a failure in between resyncs again.
        """
        incarnation, epoch = self.incarnation, self.epoch
        backoff = Backoff(self._config.reconnect)
        max_batch = self._config.watch_max_batch
        resync_at: int | None = None
        loop = asyncio.get_running_loop()
        while True:
            failed: RendezvousError | None = None
            opened = loop.time()
            try:
                if resync_at is not None:
                    await self._resync(resync_at)
                    sequence, resync_at = resync_at, None
                async with self._client.watch(self.engine_id, sequence, max_batch=max_batch) as stream:
                    async for batch in stream:
                        if batch.events or batch.resync_required:  # not the header every opening sends
                            backoff.reset()
                        if batch.epoch != epoch:
                            self._recover(SessionCause.EPOCH_CHANGED, incarnation)
                            return
                        if batch.resync_required:
                            await self._resync(batch.resync_sequence)
                            sequence = batch.resync_sequence
                        for event in batch.events:
                            self._live.on_event(event)
                            self._deliver(event)
                            sequence = event.sequence + 1
                log.info("engine %s watch ended by the server; resuming at %d", self.engine_id, sequence)
            except RendezvousError as err:
                if err.reason in _ENGINE_GONE:
                    self._recover(Reason(err.reason), incarnation)
                    return
                if err.reason == Reason.SEQUENCE_INVALID:
                    # The engine's log restarted below our position: rebuild the view, follow the new log.
                    resync_at = int(err.metadata.get("last_sequence", "0")) + 1
                elif err.code not in _TRANSIENT:
                    self._fail(err)
                    return
                log.warning("engine %s watch failed; resuming at %d: %s", self.engine_id, sequence, err)
                failed = err
            if loop.time() - opened >= self._config.reconnect.max_backoff:  # it worked for a while: start over
                backoff.reset()
            await asyncio.sleep(backoff.after(failed))

    async def _resync(self, sequence: int) -> None:
        since = self._live.records()
        transfers = tuple([t async for t in self._client.iter_transfers(self.engine_id)])
        dropped = self._live.retain((t.transfer_id for t in transfers if t.state not in _OVER), since)
        unlisted = dropped - {t.transfer_id for t in transfers}  # not those it lists COMMITTED: the listing says so
        self._deliver(Resynced(sequence, transfers, tuple(sorted(unlisted))))

    def _deliver(self, item: SessionEvent) -> None:
        self._queue.put_nowait(item)

    async def _dispatch(self, handler: EventHandler) -> None:
        while True:
            item = await self._queue.get()
            if isinstance(item, _Closed):
                return
            try:
                await handler(item)
            except Exception:
                log.exception("engine %s event handler failed on %r", self.engine_id, item)
            self._taken(item)


class RankSession(EngineSession):
    """The session of one of a multi-rank engine's other ranks: it follows the registration rank 0 made.

    A multi-rank engine registers once, with every rank's agent, from one process (`EngineSession`, rank 0).
    The other ranks' processes each open a `RankSession`: it finds the current incarnation with GetEngine,
    watches the engine's events from that incarnation's `watch_start_sequence` (so it misses none) and sends
    its rank's calls (CompleteTransfers, AcknowledgeRevocations) as that incarnation. It neither renews the lease
    nor re-asserts transfers: when the incarnation is replaced (rank 0 re-registered after a server restart or a
    lost lease) it waits for the next one, follows it and delivers `Reregistered`. Closing it deregisters nothing.

    Its write fence (`writable_until`, unless created with `fenced=False`: a rank that writes nothing) follows the
    lease rank 0 holds: it reads the lease with GetEngine (BASIC view: no agent metadata) every `follow_period`
    (a sixth of the TTL by default) and moves the fence to the read's send time plus what the server said was left
    of the lease, less the margin (`follow_fence`). A read that fails moves nothing, so a rank cut off from the
    service stops writing on its own, before the lease can lapse; a read that finds the incarnation gone or
    replaced closes the fence, and it opens on the next incarnation once its `Reregistered` was taken, as a
    registering session's does. From a server that does not report `lease_remaining`, no fence can be known:
    `writable_until` is then `math.inf` (a warning says so), and a producer rank that follows stops writing a
    transfer only when its own Watch tells it the transfer ended.
    """

    def __init__(
        self,
        client: AsyncRendezvousClient,
        engine_id: str,
        *,
        config: SessionConfig | None = None,
        handler: EventHandler | None = None,
        fenced: bool = True,
    ) -> None:
        super().__init__(client, EngineSpec(engine_id, "", EngineRole.UNSPECIFIED), config=config, handler=handler)
        self._fenced = fenced
        self.writable_until = 0.0 if fenced else math.inf
        if not fenced:  # no lease is read: closing waits for the calls in flight for their own deadline
            self._lease_until = math.inf

    async def start(self, incarnation: int = 0) -> EngineInfo:
        """Follow the engine's incarnation (the first one newer than `incarnation - 1`) and watch its events."""
        if self._registration is not None or self._closing:
            raise RuntimeError("a session starts once")
        self._registration = await self._follow(incarnation - 1 if incarnation else 0)
        self._taken_of = self.incarnation_id
        self._remove_listener = self._client.add_epoch_listener(self._on_epoch)
        if self._fenced:  # the lease's task: it reads the lease rank 0 renews
            self._keepalive_task = asyncio.create_task(self._read_lease(), name=f"lease {self.engine_id}")
        self._start_watch()
        if self._handler is not None:
            self._dispatch_task = asyncio.create_task(self._dispatch(self._handler), name=f"events {self.engine_id}")
        return self.engine

    async def close(self, *, deregister: bool = False) -> None:
        """Stop following; the engine's registration is rank 0's to end. Calls waiting for an incarnation to follow
        (rank 0 gone, and perhaps never to register again) fail with `Cancelled` at once (`begin_close`)."""
        await super().close(deregister=False)

    async def _follow(self, previous: int) -> Registration:
        """The engine's live incarnation newer than `previous`, waiting (with backoff) until there is one; the fence
        is set to its lease (opened at once only when no re-registration waits for its Reregistered)."""
        backoff = Backoff(self._config.reconnect)
        loop = asyncio.get_running_loop()
        while True:
            try:
                sent = loop.time()
                engine = await self._client.get_engine(self.engine_id)
                if engine.incarnation > previous:
                    self._lease_read(sent, engine)
                    return Registration(engine, engine.watch_start_sequence, self._client.epoch)
            except RendezvousError as err:
                if err.reason not in _ENGINE_GONE and err.code not in _TRANSIENT:
                    raise
                await asyncio.sleep(backoff.after(err))
                continue
            await asyncio.sleep(backoff.next())

    def _lease_read(self, sent: float, engine: EngineInfo) -> None:
        """A GetEngine sent at `sent` answered the followed incarnation: move the fence on (`follow_fence`)."""
        if not self._fenced:
            return
        if engine.lease_remaining is None:
            if self._lease_until != math.inf:
                log.warning(
                    "engine %s: the server does not report lease_remaining; rank writes are not fenced", self.engine_id
                )
            self._move_fence(math.inf)
            return
        ttl, fraction = engine.lease_ttl, self._config.renew_fraction
        self._move_fence(follow_fence(sent, engine.lease_remaining, ttl, fraction))

    async def _read_lease(self) -> None:
        """Read the followed incarnation's lease every `follow_period` and move the fence on; a failed read is
        retried after the reconnect backoff (at most the period) and moves nothing; a read that finds the
        incarnation gone or replaced follows the next one (`_recover`) and waits until it does."""
        backoff = Backoff(self._config.reconnect)
        loop = asyncio.get_running_loop()
        fraction = self._config.renew_fraction
        delay = follow_period(self.engine.lease_ttl, fraction)
        while True:
            await asyncio.sleep(delay)
            await self._until_followed()
            if self._failure is not None:
                return
            period = follow_period(self.engine.lease_ttl, fraction)
            delay = period
            incarnation = self.incarnation
            try:
                sent = loop.time()
                engine = await self._client.get_engine(self.engine_id, view=EngineView.BASIC, timeout=period)
            except RendezvousError as err:
                if self._replaced(err, incarnation):
                    delay = 0.0  # once the next incarnation is followed, its lease is read at once
                elif err.code in _TRANSIENT:
                    delay = min(backoff.after(err), period)
                    log.warning("engine %s lease read failed, retrying in %.2f s: %s", self.engine_id, delay, err)
                else:
                    self._fail(err)
                    return
                continue
            backoff.reset()
            recovering = self._recovery is not None and not self._recovery.done()
            if engine.incarnation == incarnation == self.incarnation and not recovering:
                self._lease_read(sent, engine)
            elif engine.incarnation > incarnation:  # rank 0 registered anew: this incarnation is gone
                self._recover(Reason.STALE_INCARNATION, incarnation)
                delay = 0.0

    async def _until_followed(self) -> None:
        """Until a recovery under way follows the next incarnation (or ends)."""
        recovery = self._recovery
        if recovery is not None and not recovery.done():
            await asyncio.wait([recovery])  # waiting must not cancel it

    async def acknowledge_revocations(
        self, acks: Sequence[RevocationAck], *, revoked_to: tuple[int, int] | None = None
    ) -> list[ItemResult]:
        """A producer rank's promise not to write revoked generations (name the rank in each).

        A refused item is returned, not raised. `revoked_to`: as `ProducerSession.acknowledge_revocations`'s.
        """
        return await self._acknowledge_revocations(acks, revoked_to)

    def _replaced(self, err: RendezvousError, incarnation: int) -> bool:
        if err.reason in _ENGINE_GONE or err.reason == Reason.STALE_INCARNATION:
            self._recover(Reason(err.reason), incarnation)
            return True
        return False

    async def _reregister(self, cause: Reason | SessionCause) -> None:
        previous = self.incarnation
        watch = self._watch_task
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
            await asyncio.wait([watch])
        try:
            self._registration = await self._follow(previous)
        except RendezvousError as err:
            self._fail(err)
            return
        log.info("engine %s rank session follows incarnation %d", self.engine_id, self.incarnation)
        self._deliver(Reregistered(cause, previous, self.incarnation, self.epoch, ()))
        self._start_watch()
