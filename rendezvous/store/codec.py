"""Records as bytes for shared stores: engines, transfers and events as compact JSON arrays.

Why not the protocol messages: a stored record must round-trip exactly, and the wire form does
not (Transfer has no assigned_generation; Timestamps round float seconds through nanoseconds,
which can move a deadline by one ulp). Positional arrays keep records small and decoding fast.
Every top-level record starts with a format number so a later layout can be read side by side.
Agent metadata (NIXL bytes) is base64 text. Decoding trusts nothing but JSON: no pickle.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from rendezvous.core.model import (
    AbortReason,
    Engine,
    EngineCapacity,
    Event,
    EventType,
    KvLayout,
    KvRegion,
    MemoryKind,
    Mode,
    NixlAgent,
    Role,
    State,
    Transfer,
    TransferTimes,
)

FORMAT = 1

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_loads = json.loads


class CodecError(ValueError):
    """A stored record this version cannot read."""


def _check(obj: Any, kind: str) -> list[Any]:
    if not isinstance(obj, list) or not obj or obj[0] != FORMAT:
        raise CodecError(f"unreadable {kind} record (format {obj[0] if isinstance(obj, list) and obj else '?'})")
    return obj


# Transfers


def transfer_fields(t: Transfer) -> list[Any]:
    """A transfer as a JSON-ready array."""
    times = t.times
    return [
        FORMAT,
        t.transfer_id,
        int(t.state),
        t.deadline,
        int(t.mode),
        t.generation,
        t.consumer_engine_id,
        t.consumer_incarnation,
        t.producer_engine_id,
        t.producer_incarnation,
        list(t.target_block_ids),
        None if t.source_block_ids is None else list(t.source_block_ids),
        t.num_tokens,
        int(t.abort_reason),
        t.abort_message,
        t.assigned_generation,
        t.revoking_generation,
        [
            times.target_time,
            times.claim_time,
            times.match_time,
            times.source_ready_time,
            times.commit_time,
            times.end_time,
        ],
        list(t.reported_ranks),
        t.block_digests,
        t.progressive,
    ]


def transfer_from_fields(obj: Any) -> Transfer:
    """The transfer of an array made by transfer_fields."""
    f = _check(obj, "transfer")
    times = f[17]
    return Transfer(
        transfer_id=f[1],
        state=State(f[2]),
        deadline=f[3],
        mode=Mode(f[4]),
        generation=f[5],
        consumer_engine_id=f[6],
        consumer_incarnation=f[7],
        producer_engine_id=f[8],
        producer_incarnation=f[9],
        target_block_ids=tuple(f[10]),
        source_block_ids=None if f[11] is None else tuple(f[11]),
        num_tokens=f[12],
        abort_reason=AbortReason(f[13]),
        abort_message=f[14],
        assigned_generation=f[15],
        revoking_generation=f[16],
        times=TransferTimes(times[0], times[1], times[2], times[3], times[4], times[5]),
        reported_ranks=tuple(f[18]) if len(f) > 18 else (),
        block_digests=f[19] if len(f) > 19 else "",
        progressive=bool(f[20]) if len(f) > 20 else False,
    )


def encode_transfer(t: Transfer) -> str:
    """A transfer as JSON text."""
    return _dumps(transfer_fields(t))


def decode_transfer(data: bytes | str) -> Transfer:
    """The transfer of encode_transfer's text."""
    try:
        return transfer_from_fields(_loads(data))
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise CodecError(f"unreadable transfer record: {err}") from err


# Engines


def engine_fields(e: Engine) -> list[Any]:
    """An engine as a JSON-ready array."""
    lay = e.layout
    return [
        FORMAT,
        e.engine_id,
        e.pool,
        int(e.role),
        [
            lay.model_fingerprint,
            lay.dtype,
            lay.block_size,
            lay.num_layers,
            lay.tp_size,
            lay.pp_size,
            lay.kv_layout,
            lay.num_kv_heads,
        ],
        [
            [
                a.name,
                base64.b64encode(a.metadata).decode("ascii"),
                a.rank,
                int(a.memory_kind),
                [
                    [r.base_address, r.block_stride_bytes, r.block_length_bytes, r.num_blocks, r.device_id]
                    for r in a.regions
                ],
                a.first_layer,
                a.num_layers,
            ]
            for a in e.agents
        ],
        dict(e.labels),
        e.incarnation,
        e.lease_ttl,
        e.lease_expires_at,
        e.registered_at,
        e.ended_at,
        e.unlost_incarnation,
        e.watch_start_revision,
        e.owner,
        [e.capacity.max_transfers, e.capacity.max_blocks],
    ]


def engine_from_fields(obj: Any) -> Engine:
    """The engine of an array made by engine_fields."""
    f = _check(obj, "engine")
    lay = f[4]
    return Engine(
        engine_id=f[1],
        pool=f[2],
        role=Role(f[3]),
        layout=KvLayout(*lay),
        agents=tuple(
            NixlAgent(
                name=a[0],
                metadata=base64.b64decode(a[1]),
                rank=a[2],
                memory_kind=MemoryKind(a[3]),
                regions=tuple(KvRegion(r[0], r[1], r[2], r[3], r[4]) for r in a[4]),
                first_layer=a[5] if len(a) > 5 else 0,
                num_layers=a[6] if len(a) > 6 else 0,
            )
            for a in f[5]
        ),
        labels=f[6],
        incarnation=f[7],
        lease_ttl=f[8],
        lease_expires_at=f[9],
        registered_at=f[10],
        ended_at=f[11],
        unlost_incarnation=f[12] if len(f) > 12 else 0,
        watch_start_revision=f[13] if len(f) > 13 else 0,
        owner=f[14] if len(f) > 14 else "",
        capacity=EngineCapacity(*f[15]) if len(f) > 15 else EngineCapacity(),
    )


def encode_engine(e: Engine) -> str:
    """An engine as JSON text."""
    return _dumps(engine_fields(e))


def decode_engine(data: bytes | str) -> Engine:
    """The engine of encode_engine's text."""
    try:
        return engine_from_fields(_loads(data))
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise CodecError(f"unreadable engine record: {err}") from err


# Events


def encode_event(event: Event, transfer_json: str | None = None) -> str:
    """An event as JSON text, without its revision (the log assigns it) and its peer (stored apart).

    transfer_json is the already encoded event.transfer, when the caller has it (a transition's
    events usually carry the record it writes).
    """
    if transfer_json is None:
        transfer_json = "null" if event.transfer is None else encode_transfer(event.transfer)
    return f"[{FORMAT},{int(event.type)},{_dumps(event.time)},{transfer_json},{int(event.generation)}]"


def decode_event(data: bytes | str, revision: int, peer: Engine | None = None) -> Event:
    """The event of encode_event's text, at a revision, with its peer engine."""
    try:
        f = _check(_loads(data), "event")
        return Event(
            type=EventType(f[1]),
            time=f[2],
            transfer=None if f[3] is None else transfer_from_fields(f[3]),
            generation=f[4],
            peer=peer,
            revision=revision,
        )
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise CodecError(f"unreadable event record: {err}") from err


__all__ = [
    "FORMAT",
    "CodecError",
    "decode_engine",
    "decode_event",
    "decode_transfer",
    "encode_engine",
    "encode_event",
    "encode_transfer",
]
