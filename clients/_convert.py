"""The wire mapping of the SDK: its records to protocol messages and back. Nothing else lives here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from clients._exceptions import from_status
from clients._types import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    CreditResult,
    EngineCapacity,
    EngineCredits,
    EngineInfo,
    EnginePage,
    EngineRole,
    EngineSpec,
    Event,
    EventType,
    ItemResult,
    LeaseRenewal,
    Registration,
    ReleaseSpec,
    RevocationAck,
    ServerStatus,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
    TransferPage,
    TransferState,
    WatchBatch,
)
from rendezvous.protocol import convert
from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.convert import (
    agent,
    agent_message,
    duration,
    layout,
    layout_message,
    number,
    part_message,
    seconds,
    timestamp,
    unix_time,
)
from rendezvous.v1 import rendezvous_pb2 as pb

_BatchResponse = (
    pb.RegisterTargetResponse
    | pb.ClaimTransferResponse
    | pb.MarkSourceReadyResponse
    | pb.CompleteTransferResponse
    | pb.AcknowledgeRevocationResponse
    | pb.ReleaseTargetResponse
    | pb.AbortTransferResponse
)
"""Every batched mutating call answers with one of these; all carry `results`."""


def register_engine_request(spec: EngineSpec, request_id: str) -> pb.RegisterEngineRequest:
    """A registration as a RegisterEngineRequest."""
    return pb.RegisterEngineRequest(
        request_id=request_id,
        engine_id=spec.engine_id,
        pool=spec.pool,
        role=number(spec.role),
        layout=layout_message(spec.layout),
        agents=[agent_message(a) for a in spec.agents],
        labels=dict(spec.labels),
        lease_ttl=duration(spec.lease_ttl),
        capacity=pb.EngineCapacity(max_transfers=spec.capacity.max_transfers, max_blocks=spec.capacity.max_blocks)
        if spec.capacity.limited
        else None,
    )


def binding_message(b: Binding | None) -> pb.TransferBinding | None:
    """A binding as a message; None as unset."""
    if b is None:
        return None
    return pb.TransferBinding(
        consumer_engine_id=b.consumer_engine_id,
        producer_engine_id=b.producer_engine_id,
        expire_time=timestamp(b.expires_at),
        mac=b.mac,
    )


def target_messages(targets: Iterable[TargetSpec]) -> list[pb.TargetSpec]:
    """Targets as messages."""
    return [
        pb.TargetSpec(
            transfer_id=t.transfer_id,
            block_ids=t.block_ids,
            num_tokens=t.num_tokens,
            generation=t.generation,
            timeout=duration(t.timeout),
            mode=number(t.mode),
            binding=binding_message(t.binding),
            progressive=t.progressive,
        )
        for t in targets
    ]


def claim_messages(claims: Iterable[ClaimSpec]) -> list[pb.ClaimSpec]:
    """Claims as messages."""
    return [
        pb.ClaimSpec(transfer_id=c.transfer_id, timeout=duration(c.timeout), binding=binding_message(c.binding))
        for c in claims
    ]


def source_messages(sources: Iterable[SourceReadySpec]) -> list[pb.SourceReadySpec]:
    """Ready sources as messages."""
    return [
        pb.SourceReadySpec(transfer_id=s.transfer_id, block_ids=s.block_ids, binding=binding_message(s.binding))
        for s in sources
    ]


def completion_messages(completions: Iterable[CompletionSpec]) -> list[pb.CompletionSpec]:
    """Completions as messages."""
    return [
        pb.CompletionSpec(
            transfer_id=c.transfer_id,
            generation=c.generation,
            outcome=number(c.outcome),
            message=c.message,
            ranks=c.ranks,
            parts=[part_message(p) for p in c.parts],
        )
        for c in completions
    ]


def ack_messages(acks: Iterable[RevocationAck]) -> list[pb.RevocationAck]:
    """Revocation acknowledgements as messages."""
    return [pb.RevocationAck(transfer_id=a.transfer_id, generation=a.generation, ranks=a.ranks) for a in acks]


def release_messages(releases: Iterable[ReleaseSpec]) -> list[pb.ReleaseSpec]:
    """Releases as messages."""
    return [pb.ReleaseSpec(transfer_id=r.transfer_id, generation=r.generation) for r in releases]


def abort_messages(aborts: Iterable[AbortSpec]) -> list[pb.AbortSpec]:
    """Aborts as messages."""
    return [pb.AbortSpec(transfer_id=a.transfer_id, message=a.message) for a in aborts]


# Messages -> records


def engine(m: pb.Engine) -> EngineInfo:
    """An engine message as a record."""
    return EngineInfo(
        engine_id=m.engine_id,
        pool=m.pool,
        role=EngineRole(m.role),
        layout=layout(m.layout),
        agents=tuple(agent(a) for a in m.agents),
        labels=dict(m.labels),
        incarnation=m.incarnation,
        lease_ttl=seconds(m.lease_ttl),
        lease_expire_time=unix_time(m.lease_expire_time),
        live_transfers=m.live_transfers,
        register_time=unix_time(m.register_time),
        watch_start_revision=m.watch_start_revision,
        capacity=EngineCapacity(m.capacity.max_transfers, m.capacity.max_blocks),
        credits=EngineCredits(
            m.credits.transfers_in_use, m.credits.blocks_in_use, m.credits.transfers_reserved, m.credits.blocks_reserved
        ),
    )


def credit_results(m: pb.ReserveCreditsResponse | pb.ReleaseCreditsResponse) -> list[CreditResult]:
    """The results of ReserveCredits or ReleaseCredits, in request order."""
    return [
        CreditResult(
            r.transfer_id,
            r.engine_id,
            unix_time(r.expire_time),
            from_status(r.status) if r.status.code else None,
        )
        for r in m.results
    ]


def transfer(m: pb.Transfer) -> TransferInfo:
    """A transfer message as a record."""
    return convert.transfer(m, TransferInfo)


def event(m: pb.Event) -> Event:
    """An event message as a record."""
    return Event(
        revision=m.revision,
        type=EventType(m.type),
        transfer=transfer(m.transfer) if m.HasField("transfer") else None,
        generation=m.generation,
        peer=engine(m.peer) if m.HasField("peer") else None,
        time=unix_time(m.time),
    )


def item_result(m: pb.ItemResult) -> ItemResult:
    """A batch item's result; a non-OK status becomes its error."""
    error = from_status(m.status) if m.status.code else None
    return ItemResult(m.transfer_id, TransferState(m.state), error, m.revoking_generation)


def item_results(m: _BatchResponse) -> list[ItemResult]:
    """The results of a batched call, in request order."""
    return [item_result(r) for r in m.results]


def registration(m: pb.RegisterEngineResponse) -> Registration:
    """A RegisterEngine answer as a record."""
    return Registration(engine(m.engine), m.watch_start_revision, m.header.epoch)


def lease_renewal(m: pb.KeepAliveResponse) -> LeaseRenewal:
    """A KeepAlive answer as a record."""
    return LeaseRenewal(m.engine_id, seconds(m.lease_ttl), m.header.epoch)


def watch_batch(m: pb.WatchResponse) -> WatchBatch:
    """A Watch message as a record."""
    return WatchBatch(tuple(event(e) for e in m.events), m.resync_required, m.resync_revision, m.header.epoch)


def engine_page(m: pb.ListEnginesResponse) -> EnginePage:
    """A ListEngines answer as a record."""
    return EnginePage(tuple(engine(e) for e in m.engines), m.next_page_token)


def transfer_page(m: pb.ListTransfersResponse) -> TransferPage:
    """A ListTransfers answer as a record."""
    return TransferPage(tuple(transfer(t) for t in m.transfers), m.next_page_token)


def server_status(m: pb.GetStatusResponse) -> ServerStatus:
    """A GetStatus answer as a record."""
    counts: Mapping[str, int] = dict(m.transfers_by_state)
    return ServerStatus(
        version=m.version,
        store=m.store,
        live_engines=m.live_engines,
        transfers_by_state=counts,
        watchers=m.watchers,
        start_time=unix_time(m.start_time),
        epoch=m.header.epoch,
    )
