"""Records as bytes for shared stores: engines, transfers and events as compact JSON arrays.

Why not the protocol messages: a stored record must round-trip exactly, and the wire form does
not (Transfer has no assigned_generation; Timestamps round float seconds through nanoseconds,
which can move a deadline by one ulp). Positional arrays keep records small and decoding fast.
Agent metadata (NIXL bytes) is base64 text. Decoding trusts nothing but JSON: no pickle.

Formats (docs/operations.md, "Stored record formats"): every top-level record starts with its format number,
`FORMAT`. A field is added by appending it to its array (top-level or nested): readers ignore elements past
those they know and give elements a record lacks their defaults, so records of this format written by older and
newer versions read both ways. Anything else (removing, moving or retyping a field) is a new format number,
decoded side by side with the old one for at least a release. A record of a format this version does not know
was written by a newer one: it is refused (`FutureFormatError`), never misread.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import replace
from enum import IntEnum
from typing import Any, TypeVar

from rendezvous import __version__
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
    positional,
)
from rendezvous.store.base import StoreUnavailableError

FORMAT = 1
"""The format this version writes, and the newest it reads."""

_encoder = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)
# Its C encoder, made once: JSONEncoder.encode makes one (and a dict for circular checks) on every call,
# a third of encoding a transfer. Records are trees, so no check for cycles.
_iterencode = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, _encoder.default, json.encoder.encode_basestring, None, ":", ",", False, False, False
)


def to_json(obj: Any) -> str:
    """obj as compact JSON text (no spaces, UTF-8 as is, no NaN or infinities), as JSONEncoder(separators=(",",
    ":"), ensure_ascii=False, allow_nan=False).encode writes it."""
    return "".join(_iterencode(obj, 0))


_loads = json.loads

E = TypeVar("E", bound=IntEnum)


def _member(cls: type[E]) -> Callable[[Any], E]:
    """cls(value) by a table lookup (~0.1 us instead of ~0.7 us; a record decodes three), with cls's own
    answer for what the table lacks (an unknown number reads as cls's _missing_ says)."""
    table: dict[Any, E] = {m.value: m for m in cls}

    def member(value: Any) -> E:
        try:
            found = table.get(value)
        except TypeError:  # unhashable
            found = None
        return cls(value) if found is None else found

    return member


_state, _mode, _abort_reason, _event_type = (_member(c) for c in (State, Mode, AbortReason, EventType))
_new_transfer, _new_times, _new_event = positional(Transfer), positional(TransferTimes), positional(Event)


class CodecError(ValueError):
    """A stored record this version cannot read."""


class FutureFormatError(CodecError, StoreUnavailableError):
    """A record of a format newer than `FORMAT`, written by a newer version of the service sharing the store.

    A store error, so callers see STORE_UNAVAILABLE and retry (on an upgraded replica, during a rolling upgrade)
    rather than get an answer computed on a misread record.
    """


def future_format(kind: str, found: int) -> FutureFormatError:
    """The refusal of a kind of record written in format found (newer than this version reads)."""
    return FutureFormatError(
        f"a stored {kind} record has format {found}; kv-rendezvous {__version__} reads formats up to {FORMAT}: "
        "upgrade this replica (docs/operations.md, Upgrading)"
    )


def _check(obj: Any, kind: str) -> list[Any]:
    if isinstance(obj, list) and obj:
        found = obj[0]
        if found == FORMAT:
            return obj
        if type(found) is int and found > FORMAT:
            raise future_format(kind, found)
    raise CodecError(f"unreadable {kind} record (format {obj[0] if isinstance(obj, list) and obj else '?'})")


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
    n = len(f)
    return _new_transfer(  # Transfer's fields in their order (the array keeps its own: FORMAT 1)
        f[1],
        _state(f[2]),
        f[3],
        _mode(f[4]),
        f[5],
        f[6],
        f[7],
        f[8],
        f[9],
        tuple(f[10]),
        None if f[11] is None else tuple(f[11]),
        f[12],
        _abort_reason(f[13]),
        f[14],
        f[16],
        _new_times(times[0], times[1], times[2], times[3], times[4], times[5]),
        tuple(f[18]) if n > 18 else (),
        bool(f[20]) if n > 20 else False,
        f[15],
        f[19] if n > 19 else "",
    )


def encode_transfer(t: Transfer) -> str:
    """A transfer as JSON text."""
    return to_json(transfer_fields(t))


def decode_transfer(data: bytes | str) -> Transfer:
    """The transfer of encode_transfer's text."""
    try:
        return transfer_from_fields(_loads(data))
    except CodecError:
        raise
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
        e.watch_start_sequence,
        e.owner,
        [e.capacity.max_transfers, e.capacity.max_blocks],
        lay.data_plane_version,  # a field of the layout, kept past the end: older readers stop at the layout's 8
    ]


def engine_from_fields(obj: Any) -> Engine:
    """The engine of an array made by engine_fields."""
    f = _check(obj, "engine")
    lay = f[4]
    layout = KvLayout(*lay[:8])  # readers stop at the fields they know (appended ones are a later version's)
    if len(f) > 16 and f[16]:
        layout = replace(layout, data_plane_version=f[16])
    return Engine(
        engine_id=f[1],
        pool=f[2],
        role=Role(f[3]),
        layout=layout,
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
        watch_start_sequence=f[13] if len(f) > 13 else 0,
        owner=f[14] if len(f) > 14 else "",
        capacity=EngineCapacity(*f[15]) if len(f) > 15 else EngineCapacity(),
    )


def encode_engine(e: Engine) -> str:
    """An engine as JSON text."""
    return to_json(engine_fields(e))


def decode_engine(data: bytes | str) -> Engine:
    """The engine of encode_engine's text."""
    try:
        return engine_from_fields(_loads(data))
    except CodecError:
        raise
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise CodecError(f"unreadable engine record: {err}") from err


# Events


def encode_event(event: Event[Transfer, Engine], transfer_json: str | None = None) -> str:
    """An event as JSON text, without its sequence (the log assigns it) and its peer (stored apart).

    transfer_json is the already encoded event.transfer, when the caller has it (a transition's
    events usually carry the record it writes).
    """
    if transfer_json is None:
        transfer_json = "null" if event.transfer is None else encode_transfer(event.transfer)
    head, tail = event_around(event)
    return head + transfer_json + tail


def event_around(event: Event[Transfer, Engine]) -> tuple[str, str]:
    """encode_event's text before and after its transfer's (which the Redis store sends once per write)."""
    return f"[{FORMAT},{int(event.type)},{to_json(event.time)},", f",{int(event.generation)}]"


def decode_event(data: bytes | str, sequence: int, peer: Engine | None = None) -> Event[Transfer, Engine]:
    """The event of encode_event's text, at a sequence, with its peer engine."""
    try:
        f = _check(_loads(data), "event")
        # Event's fields, in order: type, time, transfer, generation, peer, sequence.
        return _new_event(
            _event_type(f[1]), f[2], None if f[3] is None else transfer_from_fields(f[3]), f[4], peer, sequence
        )
    except CodecError:
        raise
    except (IndexError, KeyError, TypeError, ValueError) as err:
        raise CodecError(f"unreadable event record: {err}") from err


__all__ = [
    "FORMAT",
    "CodecError",
    "FutureFormatError",
    "decode_engine",
    "decode_event",
    "decode_transfer",
    "encode_engine",
    "encode_event",
    "encode_transfer",
    "event_around",
    "to_json",
]
