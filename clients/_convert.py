"""The wire mapping of the SDK's views of answers (requests and errors map in rendezvous.protocol.convert)."""

from __future__ import annotations

from rendezvous.clients._types import (
    CreditResult,
    EngineInfo,
    EnginePage,
    Event,
    EventType,
    ItemResult,
    LeaseRenewal,
    Registration,
    ServerEvent,
    ServerStatus,
    TransferInfo,
    TransferPage,
    TransferState,
    WatchBatch,
)
from rendezvous.protocol import convert
from rendezvous.protocol.convert import engine, error, seconds, unix_time
from rendezvous.v1 import rendezvous_pb2 as pb

_BatchResponse = (
    pb.RegisterTargetsResponse
    | pb.ClaimTransfersResponse
    | pb.MarkSourcesReadyResponse
    | pb.CompleteTransfersResponse
    | pb.AcknowledgeRevocationsResponse
    | pb.ReleaseTargetsResponse
    | pb.AbortTransfersResponse
)
"""Every batched mutating call answers with one of these; all carry `results`."""


# Messages -> records


def credit_results(m: pb.ReserveCreditsResponse | pb.ReleaseCreditsResponse) -> list[CreditResult]:
    """The results of ReserveCredits or ReleaseCredits, in request order."""
    return [
        CreditResult(
            r.transfer_id,
            r.engine_id,
            unix_time(r.expire_time),
            error(r.status) if r.status.code else None,
        )
        for r in m.results
    ]


def transfer(m: pb.Transfer) -> TransferInfo:
    """A transfer message as a record."""
    return convert.transfer(m, TransferInfo)


def event(m: pb.Event) -> ServerEvent:
    """An event message as a record."""
    return Event(
        sequence=m.sequence,
        type=EventType(m.type),
        transfer=transfer(m.transfer) if m.HasField("transfer") else None,
        generation=m.generation,
        peer=engine(m.peer) if m.HasField("peer") else None,
        time=unix_time(m.event_time),
    )


def item_result(m: pb.ItemResult) -> ItemResult:
    """A batch item's result; a non-OK status becomes its error."""
    failure = error(m.status) if m.status.code else None
    return ItemResult(m.transfer_id, TransferState(m.state), failure, m.revoking_generation)


def item_results(m: _BatchResponse) -> list[ItemResult]:
    """The results of a batched call, in request order."""
    return [item_result(r) for r in m.results]


def registration(m: pb.RegisterEngineResponse) -> Registration:
    """A RegisterEngine answer as a record."""
    return Registration(engine(m.engine), m.watch_start_sequence, m.header.epoch)


def lease_renewal(m: pb.KeepAliveResponse) -> LeaseRenewal:
    """A KeepAlive answer as a record."""
    return LeaseRenewal(m.engine_id, seconds(m.lease_ttl), m.header.epoch)


def watch_batch(m: pb.WatchResponse) -> WatchBatch:
    """A Watch message as a record."""
    return WatchBatch(tuple(event(e) for e in m.events), m.resync_required, m.resync_sequence, m.header.epoch)


def engine_page(m: pb.ListEnginesResponse) -> EnginePage[EngineInfo]:
    """A ListEngines answer as a record."""
    return EnginePage(tuple(engine(e) for e in m.engines), m.next_page_token)


def transfer_page(m: pb.ListTransfersResponse) -> TransferPage[TransferInfo]:
    """A ListTransfers answer as a record."""
    return TransferPage(tuple(transfer(t) for t in m.transfers), m.next_page_token)


def server_status(m: pb.GetStatusResponse) -> ServerStatus:
    """A GetStatus answer as a record."""
    counts: dict[TransferState, int] = {}
    for name, n in m.transfers_by_state.items():  # a state this SDK does not know counts as UNSPECIFIED
        state = TransferState.__members__.get(name, TransferState.UNSPECIFIED)
        counts[state] = counts.get(state, 0) + n
    return ServerStatus(
        version=m.version,
        store=m.store,
        live_engines=m.live_engines,
        transfers_by_state=counts,
        watchers=m.watchers,
        start_time=unix_time(m.start_time),
        epoch=m.header.epoch,
    )
