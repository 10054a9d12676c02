"""The wire mapping: protocol messages to domain records and back. Nothing else lives here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2

from rendezvous.core.credits import CreditRequest, Usage
from rendezvous.core.errors import ERROR_DOMAIN, Code, Reason, RendezvousError
from rendezvous.core.limits import Limits, clip
from rendezvous.core.model import Engine, EngineCapacity, Event, Mode, Outcome, Role
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
from rendezvous.protocol.convert import duration, fill_transfer, number, seconds, set_time, timestamp
from rendezvous.protocol.records import NixlAgent
from rendezvous.v1 import rendezvous_pb2 as pb

T = TypeVar("T")

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
    if err.retry_after is not None:
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=duration(err.retry_after)))
    return status


# Requests -> domain


def _role(value: int) -> Role | None:
    return Role(value) if value in (pb.ENGINE_ROLE_PRODUCER, pb.ENGINE_ROLE_CONSUMER) else None


def role_filter(value: int) -> Role | None:
    """ListEngines' role: unset lists every role; a value this server does not know is refused, not ignored
    (which would list every role to a caller that asked for one)."""
    if value == pb.ENGINE_ROLE_UNSPECIFIED:
        return None
    role = _role(value)
    if role is None:
        raise RendezvousError(
            Reason.ROLE_UNSPECIFIED, f"role {value} is not PRODUCER, CONSUMER or unset (every role)", field="role"
        )
    return role


def _seconds(d: Duration, field: str) -> float:
    """A Duration of a request in seconds; seconds and nanos of opposite signs (not a Duration, by its
    definition) are TIMEOUT_INVALID rather than their sum."""
    if (d.seconds > 0 and d.nanos < 0) or (d.seconds < 0 and d.nanos > 0):
        raise RendezvousError(
            Reason.TIMEOUT_INVALID, f"{field}: seconds and nanos of a Duration must have the same sign", field=field
        )
    return seconds(d)


def engine_spec(req: pb.RegisterEngineRequest, agents: Sequence[NixlAgent] | None = None) -> EngineSpec:
    """A RegisterEngineRequest as a registration; agents: its agents, converted already (convert.agent)."""
    return EngineSpec(
        engine_id=req.engine_id,
        pool=req.pool,
        role=_role(req.role),
        layout=convert.layout(req.layout),
        agents=tuple(convert.agent(a) for a in req.agents) if agents is None else tuple(agents),
        labels=dict(req.labels),
        lease_ttl=_seconds(req.lease_ttl, "lease_ttl"),
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


_BLOCK_IDS_SHARED = 1 << 18
_block_id_ints: dict[int, int] = {}
"""One int object per block id value seen, shared by every record that names it: a live 16-block transfer
then holds 16 pointers (128 bytes) instead of 16 ints of its own (512 bytes; CPython shares only -5..256).
Bounded: cleared when it passes _BLOCK_IDS_SHARED values (the sharing is an optimisation, never a meaning)."""


def block_ids(values: Iterable[int]) -> tuple[int, ...]:
    """Block ids from the wire as the tuple records keep, made of shared int objects."""
    shared = _block_id_ints
    if len(shared) > _BLOCK_IDS_SHARED:
        shared.clear()
    ids = list(values)
    return tuple(list(map(shared.setdefault, ids, ids)))  # from a list: a tuple of exactly its size


def _at_most(values: Sequence[T], limit: int) -> Sequence[T]:
    """An item's list converted no further than one past its limit: a longer one is refused (TOO_MANY_BLOCKS,
    TOO_MANY_PARTS) for being over it, so converting the rest would be work for nothing."""
    return values[: limit + 1] if len(values) > limit else values


def target_spec(t: pb.TargetSpec, limits: Limits) -> TargetSpec:
    """One target of a RegisterTargetRequest (block ids past the limit: see `_at_most`)."""
    return TargetSpec(
        t.transfer_id,
        block_ids(_at_most(t.block_ids, limits.max_blocks_per_target)),
        _generation(t.generation),
        t.num_tokens,
        _seconds(t.timeout, "timeout"),
        _mode(t.mode),
        binding(t.binding, t.HasField("binding")),
        t.progressive,
    )


def claim_spec(c: pb.ClaimSpec) -> ClaimSpec:
    """One claim of a ClaimTransferRequest."""
    return ClaimSpec(c.transfer_id, _seconds(c.timeout, "timeout"), binding(c.binding, c.HasField("binding")))


def source_spec(s: pb.SourceReadySpec, limits: Limits) -> SourceReadySpec:
    """One source of a MarkSourceReadyRequest (block ids past the limit: see `_at_most`)."""
    return SourceReadySpec(
        s.transfer_id,
        block_ids(_at_most(s.block_ids, limits.max_blocks_per_target)),
        binding(s.binding, s.HasField("binding")),
    )


def completion_spec(c: pb.CompletionSpec, limits: Limits) -> CompletionSpec:
    """One completion of a CompleteTransferRequest (parts past the limit: see `_at_most`)."""
    return CompletionSpec(
        c.transfer_id,
        _generation(c.generation),
        Outcome(c.outcome) if c.outcome in (1, 2) else None,
        c.message,
        tuple(c.ranks),
        tuple(convert.part(p) for p in _at_most(c.parts, limits.max_parts_per_completion)),
    )


def revocation_ack(a: pb.RevocationAck) -> RevocationAck:
    """One acknowledgement of an AcknowledgeRevocationRequest."""
    return RevocationAck(a.transfer_id, _generation(a.generation), tuple(a.ranks))


def release_spec(r: pb.ReleaseSpec) -> ReleaseSpec:
    """One release of a ReleaseTargetRequest."""
    return ReleaseSpec(r.transfer_id, _generation(r.generation))


def abort_spec(a: pb.AbortSpec) -> AbortSpec:
    """One abort of an AbortTransferRequest."""
    return AbortSpec(a.transfer_id, a.message)


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


_PEERS_KEPT = 256
_PEER_BYTES_KEPT = 64 << 10
_peers: dict[str, tuple[Engine, pb.Engine]] = {}
"""The message of the engine record events last carried as their peer, per engine: events of one record
(every assignment to a consumer's blocks until its next keep-alive) build its message once. Records are
immutable, so a message is right for as long as its record is the one an event names. Bounded: at most
_PEERS_KEPT engines, none with more than _PEER_BYTES_KEPT of agent metadata (those are built each time)."""


def _peer_message(e: Engine) -> pb.Engine:
    entry = _peers.get(e.engine_id)
    if entry is not None and entry[0] is e:
        return entry[1]
    message = engine_message(e)
    if sum(len(a.metadata) for a in e.agents) <= _PEER_BYTES_KEPT:
        if len(_peers) >= _PEERS_KEPT and e.engine_id not in _peers:
            _peers.clear()
        _peers[e.engine_id] = (e, message)
    return message


def event_message(e: Event) -> pb.Event:
    """An event as a message."""
    m = pb.Event()
    fill_event(m, e)
    return m


def fill_event(m: pb.Event, e: Event) -> None:
    """Set an empty Event message (a new one, or an item of a response: no copy) to an event."""
    m.revision = e.revision
    m.type = number(e.type)
    if e.transfer is not None:
        fill_transfer(m.transfer, e.transfer)
    m.generation = e.generation
    if e.peer is not None:
        m.peer.CopyFrom(_peer_message(e.peer))
    if e.time:
        set_time(m.time, e.time)
