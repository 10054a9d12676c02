"""The one mapping between the wire (rendezvous.v1 messages) and the protocol's shared records and scalars.

Service (rendezvous.wire) and SDK (clients._convert) both build on it; each keeps only the mapping of
the records that are its own (the service's engines and events, the SDK's views of engines and its
requests). A transfer maps here, both ways, as the `TransferRecord` that both sides extend.
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from rendezvous.protocol.enums import AbortReason, MemoryKind, TransferMode, TransferState
from rendezvous.protocol.records import KvLayout, KvRegion, NixlAgent, TransferTimes, WrittenPart
from rendezvous.protocol.transfer import TransferRecord
from rendezvous.v1 import rendezvous_pb2 as pb

T = TypeVar("T", bound=TransferRecord)

# Scalars


def number(value: int) -> Any:
    """A protocol enum member as the message enum of the same number (the stubs type those apart)."""
    return int(value)


def seconds(d: Duration) -> float:
    """A Duration in seconds."""
    return d.seconds + d.nanos * 1e-9


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
        set_time(m.deadline, t.deadline)
    set_times(m.times, t.times)


def transfer(m: pb.Transfer, record: type[T]) -> T:
    """A transfer message as a record of the class `record` (the SDK's `TransferInfo`). Source blocks read as
    a tuple: a message does not tell blocks not yet said from none."""
    return record(
        transfer_id=m.transfer_id,
        state=TransferState(m.state),
        deadline=unix_time(m.deadline),
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
