"""The one mapping between the wire (rendezvous.v1 messages) and the protocol's records, requests and errors.

Service (rendezvous.wire) and SDK (rendezvous.clients._convert) both build on it: a request maps here both ways (the SDK
sends it, the service reads it), as does an error (google.rpc.Status with one ErrorInfo, AIP-193) and a
transfer (the `TransferRecord` that both sides extend). Each side keeps only the mapping of what is its own
(the service's engines and events, the SDK's views of the answers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2, status_pb2

from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.enums import (
    AbortReason,
    CompletionOutcome,
    EngineRole,
    MemoryKind,
    TransferMode,
    TransferState,
)
from rendezvous.protocol.errors import Reason, RendezvousError, clip, error_for
from rendezvous.protocol.incarnation import EngineInfo, Incarnation
from rendezvous.protocol.records import (
    EngineCapacity,
    EngineCredits,
    KvLayout,
    KvRegion,
    NixlAgent,
    TransferTimes,
    WrittenPart,
)
from rendezvous.protocol.requests import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    CreditSpec,
    EngineSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)
from rendezvous.protocol.transfer import TransferRecord
from rendezvous.v1 import rendezvous_pb2 as pb

T = TypeVar("T", bound=TransferRecord)
V = TypeVar("V")

# Scalars


def number(value: int) -> Any:
    """A protocol enum member as the message enum of the same number (the stubs type those apart)."""
    return int(value)


def seconds(d: Duration) -> float:
    """A Duration in seconds."""
    return d.seconds + d.nanos * 1e-9


def remaining_duration(s: float) -> Duration:
    """What is left of a span as a Duration, set even at zero (nothing left, which unset would not say); not
    below zero."""
    d = Duration()
    d.FromNanoseconds(max(round(s * 1e9), 0))
    return d


def duration(s: float) -> Duration | None:
    """Seconds as a Duration; zero (meaning "not set" or "server default") as unset."""
    if not s:
        return None
    d = Duration()
    d.FromNanoseconds(round(s * 1e9))
    return d


def unix_time(ts: Timestamp) -> float:
    """A Timestamp as seconds since the Unix epoch; unset is 0.0."""
    return ts.seconds + ts.nanos * 1e-9


def timestamp(t: float) -> Timestamp | None:
    """Seconds since the Unix epoch as a Timestamp; 0.0 (not happened) as unset."""
    if not t:
        return None
    ts = Timestamp()
    set_time(ts, t)
    return ts


def set_time(ts: Timestamp, t: float) -> None:
    """Set a Timestamp field in place to seconds since the Unix epoch (as `Timestamp.FromNanoseconds` of the
    rounded nanoseconds would; cheaper than building a message to copy in)."""
    ts.seconds, ts.nanos = divmod(round(t * 1e9), 1_000_000_000)


# Shared records


def layout_message(layout: KvLayout) -> pb.KvLayout:
    """A KV layout as a message."""
    return pb.KvLayout(
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        tp_size=layout.tp_size,
        pp_size=layout.pp_size,
        kv_layout=layout.kv_layout,
        num_kv_heads=layout.num_kv_heads,
        data_plane_version=layout.data_plane_version,
    )


def layout(m: pb.KvLayout) -> KvLayout:
    """A KV layout message as a record (sizes as sent: validation is the service's)."""
    return KvLayout(
        model_fingerprint=m.model_fingerprint,
        dtype=m.dtype,
        block_size=m.block_size,
        num_layers=m.num_layers,
        tp_size=m.tp_size,
        pp_size=m.pp_size,
        kv_layout=m.kv_layout,
        num_kv_heads=m.num_kv_heads,
        data_plane_version=m.data_plane_version,
    )


def region_message(r: KvRegion) -> pb.KvRegion:
    """A KV region as a message."""
    return pb.KvRegion(
        base_address=r.base_address,
        block_stride_bytes=r.block_stride_bytes,
        block_length_bytes=r.block_length_bytes,
        num_blocks=r.num_blocks,
        device_id=r.device_id,
    )


def region(m: pb.KvRegion) -> KvRegion:
    """A KV region message as a record."""
    return KvRegion(m.base_address, m.block_stride_bytes, m.block_length_bytes, m.num_blocks, m.device_id)


def agent_message(agent: NixlAgent, include_metadata: bool = True) -> pb.NixlAgent:
    """A NIXL agent as a message; without its metadata bytes when include_metadata is false."""
    return pb.NixlAgent(
        name=agent.name,
        metadata=agent.metadata if include_metadata else b"",
        rank=agent.rank,
        memory_kind=number(agent.memory_kind),
        regions=[region_message(r) for r in agent.regions],
        first_layer=agent.first_layer,
        num_layers=agent.num_layers,
    )


def agent(m: pb.NixlAgent) -> NixlAgent:
    """A NIXL agent message as a record; an unknown memory kind reads as UNSPECIFIED."""
    return NixlAgent(
        name=m.name,
        metadata=m.metadata,
        rank=m.rank,
        memory_kind=MemoryKind(m.memory_kind),
        regions=tuple(region(r) for r in m.regions),
        first_layer=m.first_layer,
        num_layers=m.num_layers,
    )


def part_message(p: WrittenPart) -> pb.WrittenPart:
    """A written part as a message."""
    return pb.WrittenPart(
        first_token=p.first_token, num_tokens=p.num_tokens, first_layer=p.first_layer, num_layers=p.num_layers
    )


def part(m: pb.WrittenPart) -> WrittenPart:
    """A written part message as a record (as sent: the service checks it)."""
    return WrittenPart(m.first_token, m.num_tokens, m.first_layer, m.num_layers)


def set_times(out: pb.TransferTimes, times: TransferTimes) -> None:
    """Fill a TransferTimes message in place (present, if empty); a moment not reached stays unset."""
    out.SetInParent()
    if times.target_time:
        set_time(out.target_time, times.target_time)
    if times.claim_time:
        set_time(out.claim_time, times.claim_time)
    if times.match_time:
        set_time(out.match_time, times.match_time)
    if times.source_ready_time:
        set_time(out.source_ready_time, times.source_ready_time)
    if times.commit_time:
        set_time(out.commit_time, times.commit_time)
    if times.end_time:
        set_time(out.end_time, times.end_time)


def times(m: pb.TransferTimes) -> TransferTimes:
    """A TransferTimes message as a record; an unset moment reads 0.0."""
    return TransferTimes(
        target_time=unix_time(m.target_time),
        claim_time=unix_time(m.claim_time),
        match_time=unix_time(m.match_time),
        source_ready_time=unix_time(m.source_ready_time),
        commit_time=unix_time(m.commit_time),
        end_time=unix_time(m.end_time),
    )


# Engines (an Incarnation: the service's Engine and the SDK's EngineInfo)


def credits_message(c: EngineCredits) -> pb.EngineCredits:
    """A consumer's use of its capacity as a message."""
    return pb.EngineCredits(
        transfers_in_use=c.transfers_in_use,
        blocks_in_use=c.blocks_in_use,
        transfers_reserved=c.transfers_reserved,
        blocks_reserved=c.blocks_reserved,
    )


def credits(m: pb.EngineCredits) -> EngineCredits:
    """An EngineCredits message as a record."""
    return EngineCredits(m.transfers_in_use, m.blocks_in_use, m.transfers_reserved, m.blocks_reserved)


def engine_message(
    e: Incarnation,
    *,
    lease_expire_time: float,
    register_time: float,
    watch_start_sequence: int,
    capacity: EngineCapacity,
    live_transfers: int = 0,
    include_metadata: bool = True,
    include_labels: bool = True,
    lease_remaining: float | None = None,
) -> pb.Engine:
    """An engine incarnation and what is reported with it as a message; without agent metadata bytes or labels
    when asked, and with what is left of its lease when given. Its credits, counted apart, are set on the message
    by who counts them (`credits_message`)."""
    return pb.Engine(
        engine_id=e.engine_id,
        pool=e.pool,
        role=number(e.role),
        layout=layout_message(e.layout),
        agents=[agent_message(a, include_metadata) for a in e.agents],
        labels=dict(e.labels) if include_labels else None,
        incarnation=e.incarnation,
        lease_ttl=duration(e.lease_ttl),
        lease_expire_time=timestamp(lease_expire_time),
        register_time=timestamp(register_time),
        live_transfers=live_transfers,
        watch_start_sequence=watch_start_sequence,
        capacity=capacity_message(capacity),
        lease_remaining=None if lease_remaining is None else remaining_duration(lease_remaining),
    )


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
        watch_start_sequence=m.watch_start_sequence,
        capacity=EngineCapacity(m.capacity.max_transfers, m.capacity.max_blocks),
        credits=credits(m.credits),
        lease_remaining=seconds(m.lease_remaining) if m.HasField("lease_remaining") else None,
    )


# Transfers (TransferRecord: the service's Transfer and the SDK's TransferInfo)


def transfer_message(t: TransferRecord) -> pb.Transfer:
    """A transfer record as a message."""
    m = pb.Transfer()
    fill_transfer(m, t)
    return m


def fill_transfer(m: pb.Transfer, t: TransferRecord) -> None:
    """Set an empty Transfer message (a new one, or a field of another: no copy) to a transfer record."""
    m.transfer_id = t.transfer_id
    m.state = number(t.state)
    m.mode = number(t.mode)
    m.generation = t.generation
    m.consumer_engine_id = t.consumer_engine_id
    m.consumer_incarnation = t.consumer_incarnation
    m.producer_engine_id = t.producer_engine_id
    m.producer_incarnation = t.producer_incarnation
    m.target_block_ids.extend(t.target_block_ids)
    if t.source_block_ids:
        m.source_block_ids.extend(t.source_block_ids)
    m.num_tokens = t.num_tokens
    m.abort_reason = number(t.abort_reason)
    m.abort_message = t.abort_message
    m.revoking_generation = t.revoking_generation
    m.reported_ranks.extend(t.reported_ranks)
    m.progressive = t.progressive
    # A moment not reached stays unset; `times` is always present, if empty.
    if t.deadline:
        set_time(m.deadline_time, t.deadline)
    set_times(m.times, t.times)


def transfer(m: pb.Transfer, record: type[T]) -> T:
    """A transfer message as a record of the class `record` (the SDK's `TransferInfo`). Source blocks read as
    a tuple: a message does not tell blocks not yet said from none."""
    return record(
        transfer_id=m.transfer_id,
        state=TransferState(m.state),
        deadline=unix_time(m.deadline_time),
        mode=TransferMode(m.mode),
        generation=m.generation,
        consumer_engine_id=m.consumer_engine_id,
        consumer_incarnation=m.consumer_incarnation,
        producer_engine_id=m.producer_engine_id,
        producer_incarnation=m.producer_incarnation,
        target_block_ids=tuple(m.target_block_ids),
        source_block_ids=tuple(m.source_block_ids),
        num_tokens=m.num_tokens,
        abort_reason=AbortReason(m.abort_reason),
        abort_message=m.abort_message,
        revoking_generation=m.revoking_generation,
        times=times(m.times),
        reported_ranks=tuple(m.reported_ranks),
        progressive=m.progressive,
    )


# Errors

# An error travels in trailers, which clients cap (16 KiB by default): a huge id echoed into the
# message or metadata would turn a refusal with a reason into a bare RESOURCE_EXHAUSTED.
_MAX_ERROR_MESSAGE_BYTES = 400
_MAX_ERROR_METADATA_VALUE_BYTES = 100
_CODES_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_status(err: RendezvousError) -> status_pb2.Status:
    """An error as google.rpc.Status with one ErrorInfo detail (AIP-193), and a RetryInfo when it has a
    retry_after; long texts are clipped."""
    metadata = {k: clip(v, _MAX_ERROR_METADATA_VALUE_BYTES) for k, v in err.metadata.items()}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=err.domain, metadata=metadata)
    status = status_pb2.Status(code=err.code.value[0], message=clip(err.message, _MAX_ERROR_MESSAGE_BYTES))
    status.details.add().Pack(info)
    if err.retry_after is not None:
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=duration(err.retry_after)))
    return status


def error(status: status_pb2.Status) -> RendezvousError:
    """The error a google.rpc.Status describes (its first ErrorInfo and its RetryInfo, if any)."""
    code = _CODES_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    info: error_details_pb2.ErrorInfo | None = None
    retry_after: float | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) and info is None:
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = max(0.0, retry.retry_delay.ToTimedelta().total_seconds())
    if info is None:
        return error_for(code, status.message, retry_after=retry_after)
    reason = Reason(info.reason) if info.reason in Reason.__members__ else info.reason
    return error_for(
        code, status.message, reason=reason, domain=info.domain, metadata=info.metadata, retry_after=retry_after
    )


# Requests: to messages (the SDK sends them)


def capacity_message(c: EngineCapacity) -> pb.EngineCapacity | None:
    """A capacity as a message; no limit as unset."""
    return pb.EngineCapacity(max_transfers=c.max_transfers, max_blocks=c.max_blocks) if c.limited else None


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
        capacity=capacity_message(spec.capacity),
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


def target_message(t: TargetSpec) -> pb.TargetSpec:
    """A target as a message."""
    return pb.TargetSpec(
        transfer_id=t.transfer_id,
        block_ids=t.block_ids,
        num_tokens=t.num_tokens,
        generation=t.generation,
        timeout=duration(t.timeout),
        mode=number(t.mode),
        binding=binding_message(t.binding),
        progressive=t.progressive,
    )


def claim_message(c: ClaimSpec) -> pb.ClaimSpec:
    """A claim as a message."""
    return pb.ClaimSpec(transfer_id=c.transfer_id, timeout=duration(c.timeout), binding=binding_message(c.binding))


def source_message(s: SourceReadySpec) -> pb.SourceReadySpec:
    """A ready source as a message."""
    return pb.SourceReadySpec(transfer_id=s.transfer_id, block_ids=s.block_ids, binding=binding_message(s.binding))


def completion_message(c: CompletionSpec) -> pb.CompletionSpec:
    """A completion as a message."""
    return pb.CompletionSpec(
        transfer_id=c.transfer_id,
        generation=c.generation,
        outcome=number(c.outcome),
        message=c.message,
        ranks=c.ranks,
        parts=[part_message(p) for p in c.parts],
    )


def ack_message(a: RevocationAck) -> pb.RevocationAck:
    """A revocation acknowledgement as a message."""
    return pb.RevocationAck(transfer_id=a.transfer_id, generation=a.generation, ranks=a.ranks)


def release_message(r: ReleaseSpec) -> pb.ReleaseSpec:
    """A release as a message."""
    return pb.ReleaseSpec(transfer_id=r.transfer_id, generation=r.generation)


def abort_message(a: AbortSpec) -> pb.AbortSpec:
    """An abort as a message."""
    return pb.AbortSpec(transfer_id=a.transfer_id, message=a.message)


def credit_message(c: CreditSpec) -> pb.CreditSpec:
    """A credit reservation as a message."""
    return pb.CreditSpec(transfer_id=c.transfer_id, engine_id=c.engine_id, blocks=c.blocks)


# Requests: from messages (the service reads them; validation is the service's)


def request_seconds(d: Duration, field: str) -> float:
    """A Duration of a request in seconds; seconds and nanos of opposite signs (not a Duration, by its
    definition) are TIMEOUT_INVALID rather than their sum."""
    if (d.seconds > 0 and d.nanos < 0) or (d.seconds < 0 and d.nanos > 0):
        raise RendezvousError(
            Reason.TIMEOUT_INVALID, f"{field}: seconds and nanos of a Duration must have the same sign", field=field
        )
    return seconds(d)


def engine_spec(req: pb.RegisterEngineRequest, agents: Sequence[NixlAgent] | None = None) -> EngineSpec:
    """A RegisterEngineRequest as a registration; agents: its agents, converted already (`agent`). A role
    other than PRODUCER or CONSUMER reads as UNSPECIFIED."""
    return EngineSpec(
        engine_id=req.engine_id,
        pool=req.pool,
        role=EngineRole(req.role),
        layout=layout(req.layout),
        agents=tuple(agent(a) for a in req.agents) if agents is None else tuple(agents),
        labels=dict(req.labels),
        lease_ttl=request_seconds(req.lease_ttl, "lease_ttl"),
        capacity=EngineCapacity(req.capacity.max_transfers, req.capacity.max_blocks),
    )


def _mode(value: int) -> TransferMode:
    """UNSPECIFIED is push (the default); a mode this code does not know reads as UNSPECIFIED."""
    return TransferMode.PUSH if value == pb.TRANSFER_MODE_UNSPECIFIED else TransferMode(value)


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


def _at_most(values: Sequence[V], limit: int) -> Sequence[V]:
    """An item's list converted no further than one past its limit: a longer one is refused (TOO_MANY_BLOCKS,
    TOO_MANY_PARTS) for being over it, so converting the rest would be work for nothing."""
    return values[: limit + 1] if len(values) > limit else values


def target_spec(t: pb.TargetSpec, max_blocks: int) -> TargetSpec:
    """One target of a RegisterTargetsRequest (block ids past max_blocks: see `_at_most`)."""
    return TargetSpec(
        t.transfer_id,
        block_ids(_at_most(t.block_ids, max_blocks)),
        generation=_generation(t.generation),
        num_tokens=t.num_tokens,
        timeout=request_seconds(t.timeout, "timeout"),
        mode=_mode(t.mode),
        binding=binding(t.binding, t.HasField("binding")),
        progressive=t.progressive,
    )


def claim_spec(c: pb.ClaimSpec) -> ClaimSpec:
    """One claim of a ClaimTransfersRequest."""
    return ClaimSpec(c.transfer_id, request_seconds(c.timeout, "timeout"), binding(c.binding, c.HasField("binding")))


def source_spec(s: pb.SourceReadySpec, max_blocks: int) -> SourceReadySpec:
    """One source of a MarkSourcesReadyRequest (block ids past max_blocks: see `_at_most`)."""
    return SourceReadySpec(
        s.transfer_id, block_ids(_at_most(s.block_ids, max_blocks)), binding(s.binding, s.HasField("binding"))
    )


def completion_spec(c: pb.CompletionSpec, max_parts: int) -> CompletionSpec:
    """One completion of a CompleteTransfersRequest (parts past max_parts: see `_at_most`); an outcome other
    than SUCCEEDED or FAILED reads as UNSPECIFIED."""
    return CompletionSpec(
        c.transfer_id,
        _generation(c.generation),
        CompletionOutcome(c.outcome),
        c.message,
        tuple(c.ranks),
        tuple(part(p) for p in _at_most(c.parts, max_parts)),
    )


def revocation_ack(a: pb.RevocationAck) -> RevocationAck:
    """One acknowledgement of an AcknowledgeRevocationsRequest."""
    return RevocationAck(a.transfer_id, _generation(a.generation), tuple(a.ranks))


def release_spec(r: pb.ReleaseSpec) -> ReleaseSpec:
    """One release of a ReleaseTargetsRequest."""
    return ReleaseSpec(r.transfer_id, _generation(r.generation))


def abort_spec(a: pb.AbortSpec) -> AbortSpec:
    """One abort of an AbortTransfersRequest."""
    return AbortSpec(a.transfer_id, a.message)


def credit_spec(c: pb.CreditSpec) -> CreditSpec:
    """One reservation of a ReserveCreditsRequest."""
    return CreditSpec(c.transfer_id, c.engine_id, c.blocks)
