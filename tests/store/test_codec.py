"""The shared stores' record codec: records round-trip exactly, into records of their own class, and the bytes
stay those earlier versions wrote (Redis holds them across upgrades)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rendezvous.core.model import (
    AbortReason,
    Engine,
    Event,
    EventType,
    KvLayout,
    Mode,
    NixlAgent,
    Role,
    State,
    Transfer,
    TransferTimes,
)
from rendezvous.store.codec import (
    CodecError,
    decode_engine,
    decode_event,
    decode_transfer,
    encode_engine,
    encode_event,
    encode_transfer,
    to_json,
)

TRANSFER = Transfer(
    transfer_id="t-1",
    state=State.MATCHED,
    deadline=1764621000.123456,
    mode=Mode.PULL,
    generation=2,
    consumer_engine_id="c",
    consumer_incarnation=3,
    producer_engine_id="p",
    producer_incarnation=4,
    target_block_ids=(5, 6),
    source_block_ids=(7, 8),
    num_tokens=9,
    abort_reason=AbortReason.UNSPECIFIED,
    abort_message="",
    assigned_generation=2,
    revoking_generation=1,
    times=TransferTimes(1.5, 2.5, 3.5, 0.0, 0.0, 0.0),
    reported_ranks=(0, 1),
    block_digests="d",
    progressive=True,
)
# What encode_transfer wrote for TRANSFER before decoding was made cheaper (a9b0469).
TRANSFER_BYTES = (
    b'[1,"t-1",3,1764621000.123456,2,2,"c",3,"p",4,[5,6],[7,8],9,0,"",2,1,[1.5,2.5,3.5,0.0,0.0,0.0],[0,1],"d",true]'
)


def test_a_transfer_keeps_its_bytes_and_decodes_to_an_equal_transfer() -> None:
    assert encode_transfer(TRANSFER).encode() == TRANSFER_BYTES
    decoded = decode_transfer(TRANSFER_BYTES)
    assert decoded == TRANSFER and type(decoded) is Transfer and type(decoded.times) is TransferTimes
    assert decoded.state is State.MATCHED and decoded.mode is Mode.PULL
    assert decoded.abort_reason is AbortReason.UNSPECIFIED and decoded.unsettled
    assert encode_transfer(decoded) == encode_transfer(TRANSFER)
    with pytest.raises(AttributeError):
        decoded.state = State.RELEASED  # type: ignore[misc]


def test_an_older_layout_reads_with_the_defaults_of_fields_it_lacks() -> None:
    # Written before reported_ranks, block_digests and progressive existed.
    decoded = decode_transfer(b'[1,"t",1,10.0,1,0,"c",1,"",0,[1],null,0,0,"",0,0,[1.0,0,0,0,0,0]]')
    assert decoded == Transfer(
        "t",
        State.TARGETED,
        10.0,
        Mode.PUSH,
        consumer_engine_id="c",
        consumer_incarnation=1,
        target_block_ids=(1,),
        times=TransferTimes(1.0, 0, 0, 0, 0, 0),
    )


def test_unknown_numbers_read_as_unspecified_and_broken_records_are_codec_errors() -> None:
    # A newer server's state, mode or reason reads as UNSPECIFIED, as the protocol's enums do.
    decoded = decode_transfer(b'[1,"t",99,10.0,"x",0,"",0,"",0,[],null,0,[0],"",0,0,[0,0,0,0,0,0]]')
    assert (decoded.state, decoded.mode, decoded.abort_reason) == (
        State.UNSPECIFIED,
        Mode.UNSPECIFIED,
        AbortReason.UNSPECIFIED,
    )
    for bad in (b"[2]", b"{}", b'[1,"t"]', b"not json"):
        with pytest.raises(CodecError):
            decode_transfer(bad)
    with pytest.raises(CodecError):
        decode_event(b'[1,1,2.0,[1,"t"],0]', 1)


def test_an_event_round_trips_with_its_sequence_and_peer() -> None:
    peer = Engine(
        engine_id="p",
        pool="pool",
        role=Role.PRODUCER,
        layout=KvLayout("m", "bf16", 16, 2, 1, 1, "nhd", 8),
        agents=(NixlAgent("a", b"\x00\xffmeta", 0),),
        labels={"k": "v"},
        incarnation=4,
        lease_ttl=10.0,
        lease_expires_at=20.0,
        registered_at=1.0,
    )
    assert decode_engine(encode_engine(peer)) == peer
    event: Event[Transfer, Engine] = Event(EventType.TRANSFER_ASSIGNED, 4.25, TRANSFER, 2)
    data = encode_event(event, encode_transfer(TRANSFER)).encode()
    assert data == encode_event(event).encode() == b"[1,%d,4.25,%s,2]" % (EventType.TRANSFER_ASSIGNED, TRANSFER_BYTES)
    decoded = decode_event(data, 17, peer)
    assert decoded == Event(EventType.TRANSFER_ASSIGNED, 4.25, TRANSFER, 2, peer, 17) and type(decoded) is Event
    assert decoded.type is EventType.TRANSFER_ASSIGNED and decode_event(b"[1,0,1.0,null,0]", 1).transfer is None


def test_to_json_writes_what_the_compact_encoder_writes_and_refuses_what_it_refuses() -> None:
    reference = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
    objects: list[Any] = [[1, 'é"\n', 2.5, None, True, (3, 4), {"k": [State.MATCHED]}], 1e300, "x", [[], {}]]
    for obj in objects:
        assert to_json(obj) == reference(obj)
    with pytest.raises(ValueError, match="Out of range float"):
        to_json([float("nan")])
    with pytest.raises(TypeError, match="not JSON serializable"):
        to_json([object()])
    assert to_json([1]) == "[1]"  # the encoder keeps no state across a refusal
