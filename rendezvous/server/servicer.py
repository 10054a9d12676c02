"""The gRPC servicer: maps RendezvousService RPCs onto the coordinator.

Cross-cutting rules live in `_rpc`: domain errors become google.rpc.Status with an ErrorInfo
(AIP-193), mutating calls with a request_id return their first answer on retry (AIP-155), and
every call is counted by method and status code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_status import rpc_status

from rendezvous import __version__, wire
from rendezvous.coordinator import Coordinator, ItemOutcome
from rendezvous.core.limits import Limits
from rendezvous.core.model import Engine, Event, State, Transfer
from rendezvous.core.parts import check_request_part_count
from rendezvous.core.validation import check_batch
from rendezvous.credit_ledger import CreditOutcome
from rendezvous.pacing import Pacer, paced_map
from rendezvous.protocol import convert, tracing
from rendezvous.protocol.convert import duration, number, seconds, timestamp
from rendezvous.protocol.errors import Reason, RendezvousError, transfer_not_found
from rendezvous.protocol.requests import CompletionSpec, SourceReadySpec, TargetSpec
from rendezvous.server import disclosure, idempotency
from rendezvous.server.authfile import ANONYMOUS, Caller
from rendezvous.server.failures import as_error
from rendezvous.server.metrics import Metrics
from rendezvous.server.watch_buffers import Stream, WatchBuffers
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ResponseT = TypeVar("ResponseT", bound=Message)
SpecT = TypeVar("SpecT")
M = TypeVar("M", bound=Message)
Handler = Callable[[Any, Any, grpc.aio.ServicerContext, Caller], Awaitable[ResponseT]]
Served = Callable[..., Awaitable[ResponseT]]
"""A unary RPC as served: (servicer, request, context), and the Caller where the auth guard hands one."""


def _shutting_down() -> RendezvousError:
    """What an open stream is told when the server stops: UNAVAILABLE, so a client resumes elsewhere or later."""
    return RendezvousError(Reason.SHUTTING_DOWN, "the server is shutting down; resume on another replica or later")


async def _abort(context: grpc.aio.ServicerContext, err: RendezvousError) -> None:
    await context.abort_with_status(rpc_status.to_status(convert.error_status(err)))


def _rpc(response_type: type[ResponseT]) -> Callable[[Handler[ResponseT]], Served[ResponseT]]:
    """Error mapping, metrics and, for requests with a request_id, idempotency (AIP-155) of a unary handler."""

    def decorate(handler: Handler[ResponseT]) -> Served[ResponseT]:
        method = handler.__name__

        @functools.wraps(handler)
        async def wrapped(
            self: RendezvousServicer, request: Any, context: grpc.aio.ServicerContext, caller: Caller = ANONYMOUS
        ) -> ResponseT:
            started = time.perf_counter()
            code = "OK"
            engine_id = getattr(request, "engine_id", "")
            # The call's metadata is read only when tracing is on: off, a span costs nothing.
            incoming = (context.invocation_metadata() or ()) if tracing.enabled() else ()
            request_id = getattr(request, "request_id", "")
            with tracing.rpc_span(method, engine_id, incoming=incoming):
                try:
                    key = _answer_key(method, engine_id, caller, request_id) if request_id else ""
                    store = self.coordinator.store
                    if key:
                        kept = await store.get_response(key)
                        if kept is not None:
                            return idempotency.answer(request, kept, response_type)
                    response = await handler(self, request, context, caller)
                    if key:
                        value = idempotency.entry(request, response, self.coordinator.limits.max_answer_bytes)
                        if value is not None:
                            await store.put_response(key, value, self.idempotency_ttl, caller.key)
                    return response
                except Exception as exc:
                    err = as_error(exc, method, request_id)
                    code = err.code.name
                    await _abort(context, err)
                finally:
                    self.metrics.rpc_done(method, code, time.perf_counter() - started)
            raise AssertionError("unreachable: abort_with_status raises")

        return wrapped

    return decorate


def _answer_key(method: str, engine_id: str, caller: Caller, request_id: str) -> str:
    """Where a call's answer is kept for its retries: under the engine it acts for, which only identities that may
    act for it can name; a call for no engine (the router's) under its caller's identity too, so that one identity's
    request ids neither answer nor refuse (REQUEST_ID_REUSED) another's."""
    if engine_id or not caller.key:
        return f"{method}/{engine_id}/{request_id}"
    return f"{method}/@{caller.key}/{request_id}"


def _batch_rpc(
    response_type: type[ResponseT],
    field: str,
    spec: Callable[[Any, Limits], SpecT],
    apply: Callable[..., Awaitable[list[ItemOutcome]]],
    takes_half: bool = False,
    check: Callable[[Any, Limits], None] | None = None,
    observe: Callable[[Metrics, Sequence[SpecT], Sequence[ItemOutcome]], None] | None = None,
) -> Served[ResponseT]:
    """A batched transfer RPC: the items of the request's repeated `field`, each converted by spec (under the
    server's limits), through one coordinator call, one ItemResult each, in order.

    The request's shape is checked on the message before any item is converted or any record looked up (the
    item count, and check's limits over all items), and conversion and answers yield to the event loop
    (rendezvous.pacing). takes_half: the call takes a half of its transfers (or, AbortTransfers, ends them), so
    the caller's exemption from bindings is passed on. observe: counts what the items carried, once they are
    answered.
    """
    method = response_type.__name__.removesuffix("Response")

    async def handler(
        self: RendezvousServicer, request: Any, context: grpc.aio.ServicerContext, caller: Caller
    ) -> ResponseT:
        extra = {"exempt": caller.exempt} if takes_half else {}
        raw = getattr(request, field)
        limits = self.coordinator.limits
        check_batch(len(raw), limits)
        if check is not None:
            check(request, limits)
        items = await paced_map(lambda message: spec(message, limits), raw)
        outcomes = await apply(self.coordinator, request.engine_id, request.incarnation, items, **extra)
        _trace_items(outcomes)
        if observe is not None:
            observe(self.metrics, items, outcomes)
        response = response_type(header=await self._header(seen=True))
        results = response.results  # type: ignore[attr-defined]
        await self._results(method, outcomes, results, caller.hides_non_participation)
        return response

    handler.__name__ = handler.__qualname__ = method
    return _rpc(response_type)(handler)


def _plain(convert: Callable[[M], SpecT]) -> Callable[[M, Limits], SpecT]:
    """A converter that needs no limits, as `_batch_rpc` calls one."""
    return lambda message, _limits: convert(message)


def _target_spec(message: pb.TargetSpec, limits: Limits) -> TargetSpec:
    return convert.target_spec(message, limits.max_blocks_per_target)


def _source_spec(message: pb.SourceReadySpec, limits: Limits) -> SourceReadySpec:
    return convert.source_spec(message, limits.max_blocks_per_target)


def _completion_spec(message: pb.CompletionSpec, limits: Limits) -> CompletionSpec:
    return convert.completion_spec(message, limits.max_parts_per_completion)


def _check_parts(request: pb.CompleteTransfersRequest, limits: Limits) -> None:
    """The parts of all the request's completions, counted on the message: none is converted first."""
    check_request_part_count(sum(len(c.parts) for c in request.completions), limits)


def _count_parts(metrics: Metrics, specs: Sequence[CompletionSpec], outcomes: Sequence[ItemOutcome]) -> None:
    """Parts of progressive writes in the accepted completions."""
    parts = sum(len(spec.parts) for spec, o in zip(specs, outcomes, strict=True) if o.error is None)
    if parts:
        metrics.written_parts.inc(parts)


def _trace_items(outcomes: Sequence[ItemOutcome]) -> None:
    """One event per batch item on the call's span: the transfer, and the state it is in now or the error."""
    span = tracing.current()
    if span is tracing.NO_SPAN:
        return
    for o in outcomes:
        attributes = tracing.about(transfer_id=o.transfer_id)
        if o.transfer is not None:
            attributes |= tracing.about(generation=o.transfer.generation)
            attributes["kv_rendezvous.state"] = o.transfer.state.name
        if o.error is not None:
            attributes["kv_rendezvous.error"] = o.error.reason
        span.add_event("transfer", attributes)


_FRAMING_BYTES = 16
"""Allowance for an item's tag and length in a repeated field, over the item's own ByteSize."""


def _weigh(message: Message) -> int:
    return message.ByteSize() + _FRAMING_BYTES


def _event_responses(events: Sequence[Event[Transfer, Engine]], budget: int) -> Iterator[pb.WatchResponse]:
    """The events in order, in consecutive responses whose events weigh at most budget in all (`_weigh`), or of
    one event that alone weighs more (as `paging.chunks` cuts them). Each event is built in its response
    (no copy); one that does not fit moves to the next response. Lazy, like `paging.chunks`."""
    response = pb.WatchResponse()
    weight = 0
    for event in events:
        message = response.events.add()
        wire.fill_event(message, event)
        w = _weigh(message)
        if weight and weight + w > budget:
            moved = pb.Event()
            moved.CopyFrom(message)
            del response.events[-1]
            yield response
            response = pb.WatchResponse()
            response.events.append(moved)
            weight = 0
        weight += w
    if response.events:
        yield response


def _cancellation_lost() -> bool:
    """Whether this task was cancelled but runs on: something it awaited swallowed the CancelledError."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class WatcherRegistry:
    """Counts open Watch streams per engine and enforces the per-engine limit."""

    def __init__(self, max_per_engine: int, metrics: Metrics) -> None:
        self._open: Counter[str] = Counter()
        self._max = max_per_engine
        self._metrics = metrics

    @property
    def total(self) -> int:
        """Open streams on this server."""
        return sum(self._open.values())

    def enter(self, engine_id: str) -> None:
        """Count a new stream, or refuse it past the limit."""
        if self._open[engine_id] >= self._max:
            raise RendezvousError(
                Reason.TOO_MANY_WATCHERS,
                f"engine {engine_id} already has {self._max} open watches",
                limit=self._max,
            )
        self._open[engine_id] += 1
        self._metrics.watchers.inc()

    def leave(self, engine_id: str) -> None:
        """Forget a closed stream."""
        self._open[engine_id] -= 1
        if not self._open[engine_id]:
            del self._open[engine_id]
        self._metrics.watchers.dec()


class RendezvousServicer(pb_grpc.RendezvousServiceServicer):
    """RendezvousService over a coordinator."""

    def __init__(
        self,
        coordinator: Coordinator,
        metrics: Metrics,
        server_id: str,
        idempotency_ttl: float,
        watch_batch: int,
        stopping: asyncio.Event,
    ) -> None:
        self.coordinator = coordinator
        self.metrics = metrics
        self.server_id = server_id
        self.idempotency_ttl = idempotency_ttl
        self.watch_batch = watch_batch
        self.watchers = WatcherRegistry(coordinator.limits.max_watchers_per_engine, metrics)
        self.watch_buffers = WatchBuffers(coordinator.limits.max_watch_buffer_bytes, metrics)
        self.started_at = time.time()
        self._stopping = stopping

    async def _header(self, seen: bool = False) -> pb.ResponseHeader:
        """The response header. seen: the call's store calls showed the revision its answer must cover (its
        writes, the events it read), so the revision this server last saw will do (Store.answered_revision: no
        store call where the store tracks it); other answers carry the store's current revision."""
        store = self.coordinator.store
        revision = await (store.answered_revision() if seen else store.revision())
        return pb.ResponseHeader(epoch=store.epoch, revision=revision, server_id=self.server_id)

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
        """Fail a stream call with exc, counted under its status code (unary calls: `_rpc`)."""
        err = as_error(exc, method)
        self.metrics.rpcs.labels(method, err.code.name).inc()
        await _abort(context, err)

    async def _results(self, method: str, outcomes: Sequence[ItemOutcome], results: Any, hides: bool) -> None:
        """One ItemResult per outcome, added to a response's results in place (no message copied in); yields to
        the event loop between items (rendezvous.pacing). hides: a NOT_PARTICIPANT item is answered as an
        unknown id (rendezvous.server.disclosure)."""
        self.metrics.batch_items(method, len(outcomes))
        pacer = Pacer()
        for o in outcomes:
            await pacer.tick()
            item = results.add(transfer_id=o.transfer_id)
            if o.error is not None:
                if hides and o.error.reason == Reason.NOT_PARTICIPANT:
                    disclosure.answer_as_unknown(method, item)
                else:
                    item.status.CopyFrom(convert.error_status(o.error))
            if o.transfer is not None:
                item.state = number(o.transfer.state)
                item.revoking_generation = o.transfer.revoking_generation

    # Engines

    @_rpc(pb.RegisterEngineResponse)
    async def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.RegisterEngineResponse:
        # The registering identity owns the engine for the memory budget (per-identity tallies; none without auth).
        # Up to 16,384 regions and 2 MiB of metadata: converted, registered and answered in separate turns.
        pacer = Pacer()
        agents = await paced_map(convert.agent, request.agents)
        spec = replace(convert.engine_spec(request, agents), owner=caller.key)
        engine, start = await self.coordinator.register_engine(spec)
        await pacer.tick()
        return pb.RegisterEngineResponse(
            header=await self._header(seen=True),
            engine=wire.engine_message(engine, now=self.coordinator.clock()),
            watch_start_sequence=start,
        )

    async def KeepAlive(
        self, request_iterator: AsyncIterator[pb.KeepAliveRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KeepAliveResponse]:
        async for request in request_iterator:
            try:
                if self._stopping.is_set():
                    raise _shutting_down()
                engine = await self.coordinator.keep_alive(request.engine_id, request.incarnation)
                header = await self._header(seen=True)
                response = pb.KeepAliveResponse(
                    header=header, engine_id=engine.engine_id, lease_ttl=duration(engine.lease_ttl)
                )
            except Exception as exc:
                await self._refuse(context, "KeepAlive", exc)
                return
            self.metrics.rpcs.labels("KeepAlive", "OK").inc()
            yield response

    @_rpc(pb.DeregisterEngineResponse)
    async def DeregisterEngine(
        self, request: pb.DeregisterEngineRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.DeregisterEngineResponse:
        aborted = await self.coordinator.deregister_engine(request.engine_id, request.incarnation)
        return pb.DeregisterEngineResponse(header=await self._header(seen=True), aborted_transfers=aborted)

    @_rpc(pb.GetEngineResponse)
    async def GetEngine(
        self, request: pb.GetEngineRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.GetEngineResponse:
        view = wire.engine_view(request.view)
        engine = await self.coordinator.get_engine(request.engine_id)
        live, usage = await self.coordinator.engine_tallies([engine])
        header = await self._header()
        # The lease left as of the last store call: a renewal the read missed only makes it shorter.
        message = wire.engine_message(
            engine,
            view.with_agent_metadata,
            live[engine.engine_id],
            view.with_labels,
            now=self.coordinator.clock(),
        )
        for engine_usage in usage.values():
            message.credits.CopyFrom(convert.credits_message(engine_usage))
        return pb.GetEngineResponse(header=header, engine=message)

    @_rpc(pb.ListEnginesResponse)
    async def ListEngines(
        self, request: pb.ListEnginesRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.ListEnginesResponse:
        role = wire.role_filter(request.role)
        view = wire.engine_view(request.view)
        messages: dict[str, pb.Engine] = {}

        def weigh(engine: Engine) -> int:
            # Built once: the page keeps the messages it was cut by (their lease_remaining set again as it is sent).
            messages[engine.engine_id] = message = wire.engine_message(
                engine, view.with_agent_metadata, include_labels=view.with_labels, now=self.coordinator.clock()
            )
            return _weigh(message)

        page = await self.coordinator.list_engines(request.pool, role, request.page_size, request.page_token, weigh)
        live, usage = await self.coordinator.engine_tallies(page.engines)
        engines = [messages[e.engine_id] for e in page.engines]
        for message in engines:
            message.live_transfers = live[message.engine_id]
            if message.engine_id in usage:
                message.credits.CopyFrom(convert.credits_message(usage[message.engine_id]))
        header = await self._header()
        now = self.coordinator.clock()  # after the last store call: what is left of each lease as the page is sent
        for record, message in zip(page.engines, engines, strict=True):
            message.lease_remaining.CopyFrom(convert.remaining_duration(record.lease_expires_at - now))
        return pb.ListEnginesResponse(header=header, engines=engines, next_page_token=page.next_page_token)

    # Transfers

    RegisterTargets = _batch_rpc(
        pb.RegisterTargetsResponse, "targets", _target_spec, Coordinator.register_targets, takes_half=True
    )
    ClaimTransfers = _batch_rpc(
        pb.ClaimTransfersResponse, "claims", _plain(convert.claim_spec), Coordinator.claim_transfers, takes_half=True
    )
    MarkSourcesReady = _batch_rpc(
        pb.MarkSourcesReadyResponse, "sources", _source_spec, Coordinator.mark_sources_ready, takes_half=True
    )
    CompleteTransfers = _batch_rpc(
        pb.CompleteTransfersResponse,
        "completions",
        _completion_spec,
        Coordinator.complete_transfers,
        check=_check_parts,
        observe=_count_parts,
    )
    AcknowledgeRevocations = _batch_rpc(
        pb.AcknowledgeRevocationsResponse, "acks", _plain(convert.revocation_ack), Coordinator.acknowledge_revocations
    )
    ReleaseTargets = _batch_rpc(
        pb.ReleaseTargetsResponse, "releases", _plain(convert.release_spec), Coordinator.release_targets
    )
    AbortTransfers = _batch_rpc(
        pb.AbortTransfersResponse, "aborts", _plain(convert.abort_spec), Coordinator.abort_transfers, takes_half=True
    )

    # Credits

    def _credit_results(self, method: str, outcomes: Sequence[CreditOutcome]) -> list[pb.CreditResult]:
        self.metrics.items.labels(method).inc(len(outcomes))
        for o in outcomes:
            self.metrics.credits.labels(method, o.error.reason if o.error else "OK").inc()
        return [
            pb.CreditResult(
                transfer_id=o.transfer_id,
                status=convert.error_status(o.error) if o.error else None,
                engine_id=o.reservation.engine_id if o.reservation else "",
                expire_time=timestamp(o.reservation.expires_at) if o.reservation else None,
            )
            for o in outcomes
        ]

    @_rpc(pb.ReserveCreditsResponse)
    async def ReserveCredits(
        self, request: pb.ReserveCreditsRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.ReserveCreditsResponse:
        check_batch(len(request.reservations), self.coordinator.limits)  # before any item is converted
        outcomes = await self.coordinator.reserve_credits(
            [convert.credit_spec(c) for c in request.reservations], seconds(request.ttl)
        )
        return pb.ReserveCreditsResponse(
            header=await self._header(), results=self._credit_results("ReserveCredits", outcomes)
        )

    @_rpc(pb.ReleaseCreditsResponse)
    async def ReleaseCredits(
        self, request: pb.ReleaseCreditsRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.ReleaseCreditsResponse:
        outcomes = await self.coordinator.release_credits(list(request.transfer_ids))
        return pb.ReleaseCreditsResponse(
            header=await self._header(), results=self._credit_results("ReleaseCredits", outcomes)
        )

    @_rpc(pb.GetTransferResponse)
    async def GetTransfer(
        self, request: pb.GetTransferRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.GetTransferResponse:
        transfer = await self.coordinator.get_transfer(request.transfer_id)
        if caller.acts_for is not None and not await disclosure.takes_part(caller.acts_for, transfer):
            raise transfer_not_found(request.transfer_id)
        return pb.GetTransferResponse(header=await self._header(), transfer=convert.transfer_message(transfer))

    @_rpc(pb.ListTransfersResponse)
    async def ListTransfers(
        self, request: pb.ListTransfersRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.ListTransfersResponse:
        states = [State(s) for s in request.states if s in State._value2member_map_]
        if len(states) != len(request.states):
            raise RendezvousError(Reason.STATE_INVALID, "states must be known TransferState values")
        messages: dict[str, pb.Transfer] = {}

        def weigh(transfer: Transfer) -> int:
            messages[transfer.transfer_id] = message = convert.transfer_message(transfer)
            return _weigh(message)

        page = await self.coordinator.list_transfers(
            request.engine_id, states, request.page_size, request.page_token, weigh
        )
        return pb.ListTransfersResponse(
            header=await self._header(),
            transfers=[messages[t.transfer_id] for t in page.transfers],
            next_page_token=page.next_page_token,
        )

    @_rpc(pb.GetStatusResponse)
    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> pb.GetStatusResponse:
        counts = await self.coordinator.counts()
        return pb.GetStatusResponse(
            header=await self._header(),
            version=__version__,
            store=self.coordinator.store.name,
            live_engines=counts.live_engines,
            transfers_by_state={s.name: n for s, n in counts.transfers_by_state.items()},
            watchers=self.watchers.total,
            start_time=timestamp(self.started_at),
        )

    # Events

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        """Header first (the watch is established), then event batches; resync when the log was trimmed."""
        coordinator = self.coordinator
        engine_id = request.engine_id
        try:
            sequence = await coordinator.check_watch(engine_id, request.start_sequence)
            self.watchers.enter(engine_id)
        except Exception as exc:
            await self._refuse(context, "Watch", exc)
            return
        try:
            self.metrics.rpcs.labels("Watch", "OK").inc()
            batch = min(request.max_batch or self.watch_batch, self.watch_batch)
            stream, buffers = Stream(context), self.watch_buffers
            yield pb.WatchResponse(header=await self._header())
            while not self._stopping.is_set():
                if _cancellation_lost():
                    # The caller went away, and the store lost the cancellation of this handler (redis-py 8.2
                    # loses one that lands while it reconnects): without this the stream would wait on forever.
                    raise asyncio.CancelledError
                page = await coordinator.read_events(engine_id, sequence, batch)
                if page.resync_sequence is not None:
                    self.metrics.resyncs.inc()
                    sequence = page.resync_sequence
                    resync = pb.WatchResponse(
                        header=await self._header(), resync_required=True, resync_sequence=sequence
                    )
                    with buffers.sending(stream, resync.ByteSize()):
                        yield resync
                elif page.events:
                    # Cut by bytes too, converted lazily: a peer's large agent metadata or labels, repeated in
                    # many events, must not make one response larger than a client accepts.
                    for response in _event_responses(page.events, coordinator.limits.max_response_bytes):
                        sequence = response.events[-1].sequence + 1
                        self.metrics.events_sent.inc(len(response.events))
                        response.header.CopyFrom(await self._header(seen=True))
                        with buffers.sending(stream, response.ByteSize()):
                            yield response
                    if sequence > page.last_sequence:
                        # The log was read to its end: wait for more (no empty read first: one round trip less
                        # to a networked store; a forgotten engine shows on the read after the wait).
                        await coordinator.wait_events(engine_id, sequence - 1, timeout=0.5)
                elif page.forgotten:
                    raise RendezvousError(
                        Reason.ENGINE_NOT_FOUND,
                        f"engine {engine_id} was forgotten; register again",
                        engine_id=engine_id,
                    )
                else:
                    await coordinator.wait_events(engine_id, sequence - 1, timeout=0.5)
            raise _shutting_down()
        except grpc.aio.AbortError:
            raise  # the status is already on its way (a slow reader's, rendezvous.server.watch_buffers)
        except Exception as exc:
            await _abort(context, as_error(exc, "Watch"))
        finally:
            self.watchers.leave(engine_id)
