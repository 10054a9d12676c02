"""The wire mapping: protocol messages to domain records and back. Nothing else lives here."""

from __future__ import annotations

from google.rpc import error_details_pb2, status_pb2

from rendezvous.core.credits import CreditRequest, Usage
from rendezvous.core.errors import ERROR_DOMAIN, Code, RendezvousError
from rendezvous.core.limits import clip
from rendezvous.core.model import Engine, EngineCapacity, Event, Mode, Outcome, Role, Transfer
from rendezvous.core.specs import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    EngineSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)
from rendezvous.protocol import convert
from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.convert import duration, number, seconds, timestamp
from rendezvous.v1 import rendezvous_pb2 as pb

_GRPC_CODE_NUMBERS: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 3,
    Code.NOT_FOUND: 5,
    Code.ALREADY_EXISTS: 6,
    Code.PERMISSION_DENIED: 7,
    Code.RESOURCE_EXHAUSTED: 8,
    Code.FAILED_PRECONDITION: 9,
    Code.ABORTED: 10,
    Code.OUT_OF_RANGE: 11,
    Code.INTERNAL: 13,
    Code.UNAVAILABLE: 14,
    Code.UNAUTHENTICATED: 16,
}


# An error travels in trailers, which clients cap (16 KiB by default): a huge id echoed into the
# message or metadata would turn a refusal with a reason into a bare RESOURCE_EXHAUSTED.
_MAX_ERROR_MESSAGE_BYTES = 400
_MAX_ERROR_METADATA_VALUE_BYTES = 100


def error_status(err: RendezvousError) -> status_pb2.Status:
    """A domain error as google.rpc.Status with one ErrorInfo detail (AIP-193); long texts are clipped."""
    metadata = {k: clip(v, _MAX_ERROR_METADATA_VALUE_BYTES) for k, v in err.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=err.reason.value, domain=ERROR_DOMAIN, metadata=metadata)
    status = status_pb2.Status(code=_GRPC_CODE_NUMBERS[err.code], message=clip(err.message, _MAX_ERROR_MESSAGE_BYTES))
    status.details.add().Pack(info)
    return status


# Requests -> domain


def _role(value: int) -> Role | None:
    return Role(value) if value in (pb.ENGINE_ROLE_PRODUCER, pb.ENGINE_ROLE_CONSUMER) else None


def engine_spec(req: pb.RegisterEngineRequest) -> EngineSpec:
    """A RegisterEngineRequest as a registration."""
    return EngineSpec(
        engine_id=req.engine_id,
        pool=req.pool,
        role=_role(req.role),
        layout=convert.layout(req.layout),
        agents=tuple(convert.agent(a) for a in req.agents),
        labels=dict(req.labels),
        lease_ttl=seconds(req.lease_ttl),
        capacity=EngineCapacity(req.capacity.max_transfers, req.capacity.max_blocks),
    )


def credit_requests(req: pb.ReserveCreditsRequest) -> list[CreditRequest]:
    """The items of a ReserveCreditsRequest."""
    return [CreditRequest(c.transfer_id, c.engine_id, c.blocks) for c in req.reservations]


def _mode(value: int) -> Mode | None:
    """UNSPECIFIED is push (the default); an unknown value is None, which the core rejects."""
    if value in (pb.TRANSFER_MODE_UNSPECIFIED, pb.TRANSFER_MODE_PUSH):
        return Mode.PUSH
    return Mode.PULL if value == pb.TRANSFER_MODE_PULL else None


def _generation(value: int) -> int:
    """Generation 0 on the wire means 1, in every call that names one."""
    return value or 1


def binding(b: pb.TransferBinding, present: bool) -> Binding | None:
    """A TransferBinding, or None when the item has none."""
    if not present:
        return None
    return Binding(b.consumer_engine_id, b.producer_engine_id, b.expire_time.seconds, b.mac)


def target_specs(req: pb.RegisterTargetRequest) -> list[TargetSpec]:
    """The targets of a RegisterTargetRequest."""
    return [
        TargetSpec(
            t.transfer_id,
            tuple(t.block_ids),
            _generation(t.generation),
            t.num_tokens,
            seconds(t.timeout),
            _mode(t.mode),
            binding(t.binding, t.HasField("binding")),
        )
        for t in req.targets
    ]


def claim_specs(req: pb.ClaimTransferRequest) -> list[ClaimSpec]:
    """The claims of a ClaimTransferRequest."""
    return [ClaimSpec(c.transfer_id, seconds(c.timeout), binding(c.binding, c.HasField("binding"))) for c in req.claims]


def source_specs(req: pb.MarkSourceReadyRequest) -> list[SourceReadySpec]:
    """The sources of a MarkSourceReadyRequest."""
    return [
        SourceReadySpec(s.transfer_id, tuple(s.block_ids), binding(s.binding, s.HasField("binding")))
        for s in req.sources
    ]


def completion_specs(req: pb.CompleteTransferRequest) -> list[CompletionSpec]:
    """The completions of a CompleteTransferRequest."""
    return [
        CompletionSpec(
            c.transfer_id,
            _generation(c.generation),
            Outcome(c.outcome) if c.outcome in (1, 2) else None,
            c.message,
            tuple(c.ranks),
        )
        for c in req.completions
    ]


def revocation_acks(req: pb.AcknowledgeRevocationRequest) -> list[RevocationAck]:
    """The acknowledgements of an AcknowledgeRevocationRequest."""
    return [RevocationAck(a.transfer_id, _generation(a.generation), tuple(a.ranks)) for a in req.acks]


def release_specs(req: pb.ReleaseTargetRequest) -> list[ReleaseSpec]:
    """The releases of a ReleaseTargetRequest."""
    return [ReleaseSpec(r.transfer_id, _generation(r.generation)) for r in req.releases]


def abort_specs(req: pb.AbortTransferRequest) -> list[AbortSpec]:
    """The aborts of an AbortTransferRequest."""
    return [AbortSpec(a.transfer_id, a.message) for a in req.aborts]


# Domain -> responses


def engine_message(
    e: Engine, include_metadata: bool = True, live_transfers: int = 0, include_labels: bool = True
) -> pb.Engine:
    """An engine record as a message; without agent metadata bytes or labels when asked."""
    return pb.Engine(
        engine_id=e.engine_id,
        pool=e.pool,
        role=number(e.role),
        layout=convert.layout_message(e.layout),
        agents=[convert.agent_message(a, include_metadata) for a in e.agents],
        labels=dict(e.labels) if include_labels else None,
        incarnation=e.incarnation,
        lease_ttl=duration(e.lease_ttl),
        lease_expire_time=timestamp(e.lease_expires_at),
        register_time=timestamp(e.registered_at),
        live_transfers=live_transfers,
        watch_start_revision=e.watch_start_revision,
        capacity=pb.EngineCapacity(max_transfers=e.capacity.max_transfers, max_blocks=e.capacity.max_blocks)
        if e.capacity.limited
        else None,
    )


def credits_message(u: Usage) -> pb.EngineCredits:
    """A consumer's usage of its capacity as a message."""
    return pb.EngineCredits(
        transfers_in_use=u.transfers_in_use,
        blocks_in_use=u.blocks_in_use,
        transfers_reserved=u.transfers_reserved,
        blocks_reserved=u.blocks_reserved,
    )


def transfer_message(t: Transfer) -> pb.Transfer:
    """A transfer record as a message."""
    times = t.times
    return pb.Transfer(
        transfer_id=t.transfer_id,
        state=number(t.state),
        mode=number(t.mode),
        generation=t.generation,
        consumer_engine_id=t.consumer_engine_id,
        consumer_incarnation=t.consumer_incarnation,
        producer_engine_id=t.producer_engine_id,
        producer_incarnation=t.producer_incarnation,
        target_block_ids=t.target_block_ids,
        source_block_ids=t.source_block_ids or (),
        num_tokens=t.num_tokens,
        abort_reason=number(t.abort_reason),
        abort_message=t.abort_message,
        revoking_generation=t.revoking_generation,
        reported_ranks=t.reported_ranks,
        deadline=timestamp(t.deadline),
        times=pb.TransferTimes(
            target_time=timestamp(times.target),
            claim_time=timestamp(times.claim),
            match_time=timestamp(times.match),
            source_ready_time=timestamp(times.source_ready),
            commit_time=timestamp(times.commit),
            end_time=timestamp(times.end),
        ),
    )


def event_message(e: Event) -> pb.Event:
    """An event as a message."""
    return pb.Event(
        revision=e.revision,
        type=number(e.type),
        transfer=transfer_message(e.transfer) if e.transfer is not None else None,
        generation=e.generation,
        peer=engine_message(e.peer) if e.peer is not None else None,
        time=timestamp(e.time),
    )
