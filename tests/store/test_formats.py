"""Stored record formats across versions: records the previous release wrote (tests/store/golden, made by its own
encoders) read as they were meant, this version writes the current format, and a record of a newer format is
refused, never misread (docs/operations.md, "Stored record formats")."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import redis.asyncio as redis

from rendezvous.core.credits import Reservation
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
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.store import StoreUnavailableError
from rendezvous.store.codec import (
    FORMAT,
    CodecError,
    FutureFormatError,
    decode_engine,
    decode_event,
    decode_transfer,
    encode_engine,
    encode_transfer,
)
from rendezvous.store.redis import RedisStore
from rendezvous.store.redis.credits import decode as decode_reservation
from rendezvous.store.redis.credits import encode as encode_reservation
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.redis_fixtures import fresh_prefix, with_prefix
from tests.service.test_service import error_info
from tests.store.test_contract import make_engine, make_transfer, put_engine, put_transfer

GOLDEN = json.loads((Path(__file__).parent / "golden" / "format1.json").read_text())
"""Records as kv-rendezvous 0.1.0 (codec format 1) wrote them."""

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
ABORTED = Transfer(
    transfer_id="t:2",
    state=State.ABORTED,
    deadline=20.0,
    mode=Mode.PUSH,
    generation=1,
    consumer_engine_id="c",
    consumer_incarnation=3,
    target_block_ids=(1,),
    abort_reason=AbortReason.LAYOUT_MISMATCH,
    abort_message="dtype: 'bf16' != 'fp8'",
    times=TransferTimes(1.0, 0, 0, 0, 0, 5.0),
)
ENGINE = Engine(
    engine_id="p",
    pool="pool-a",
    role=Role.PRODUCER,
    layout=KvLayout("model@rev", "bfloat16", 16, 2, 2, 1, "HKTV", 8),
    agents=(
        NixlAgent("p-0", b"\x00\xffmeta", 0, MemoryKind.VRAM, (KvRegion(4096, 512, 256, 10, 1),), 0, 2),
        NixlAgent("p-1", b"meta-1", 1, MemoryKind.DRAM, (KvRegion(8192, 512, 256, 10, 0),), 0, 2),
    ),
    labels={"zone": "a"},
    incarnation=4,
    lease_ttl=10.0,
    lease_expires_at=20.5,
    registered_at=1.25,
    ended_at=0.0,
    unlost_incarnation=3,
    watch_start_sequence=7,
    owner="spiffe://p",
    capacity=EngineCapacity(8, 100),
)


def _future(record: str) -> str:
    """record as a newer version might write it: the next format number, a field added in front."""
    fields = json.loads(record)
    return json.dumps([FORMAT + 1, "new", *fields[1:]])


def test_the_previous_releases_records_read_as_they_were_written() -> None:
    assert decode_transfer(GOLDEN["transfer"]) == TRANSFER
    assert decode_transfer(GOLDEN["transfer_aborted"]) == ABORTED
    engine = decode_engine(GOLDEN["engine"])
    assert engine == ENGINE and engine.layout.data_plane_version == 0  # stated by no engine of that release
    assert decode_event(GOLDEN["event"], 9, ENGINE) == Event(EventType.TRANSFER_ASSIGNED, 4.25, TRANSFER, 2, ENGINE, 9)
    assert decode_event(GOLDEN["event_without_transfer"], 3) == Event(EventType.PEER_LOST, 5.5, None, 0, None, 3)
    assert decode_reservation(GOLDEN["reservation"]) == Reservation("t-1", "c", 3, 2, 30.5)


def test_this_version_writes_the_current_format_which_appends_to_the_previous_one() -> None:
    assert encode_transfer(TRANSFER) == GOLDEN["transfer"]  # unchanged since: the previous release reads it
    assert encode_reservation(Reservation("t-1", "c", 3, 2, 30.5)) == GOLDEN["reservation"]
    # The data-plane version is appended: the previous release's reader stops before it and reads the rest.
    written = encode_engine(ENGINE)
    assert written == GOLDEN["engine"][:-1] + ",0]"
    stated = KvLayout("model@rev", "bfloat16", 16, 2, 2, 1, "HKTV", 8, 2)
    engine = replace(ENGINE, layout=stated)
    assert json.loads(encode_engine(engine))[16] == 2 and decode_engine(encode_engine(engine)) == engine


def test_fields_appended_by_a_newer_version_of_the_same_format_are_skipped() -> None:
    transfer = [*json.loads(GOLDEN["transfer"]), "a later field"]
    assert decode_transfer(json.dumps(transfer)) == TRANSFER
    engine = json.loads(GOLDEN["engine"])
    engine[4].append("a later layout field")
    engine[5][0].append("a later agent field")
    engine += [0, "a later engine field"]
    assert decode_engine(json.dumps(engine)) == ENGINE


@pytest.mark.parametrize("kind", ["transfer", "engine", "event"])
def test_a_record_of_a_newer_format_is_refused_as_a_store_error_naming_both_formats(kind: str) -> None:
    decoders: dict[str, Callable[[str], object]] = {
        "transfer": decode_transfer,
        "engine": decode_engine,
        "event": lambda data: decode_event(data, 1),
    }
    decode = decoders[kind]
    with pytest.raises(FutureFormatError, match=f"{kind} record has format {FORMAT + 1}; .* up to {FORMAT}") as err:
        decode(_future(GOLDEN[kind]))
    assert isinstance(err.value, StoreUnavailableError)  # the servicer answers STORE_UNAVAILABLE: retry elsewhere


def test_a_credit_reservation_of_a_newer_format_is_refused() -> None:
    with pytest.raises(FutureFormatError, match="credit reservation record has format 2"):
        decode_reservation(json.dumps([2, *json.loads(GOLDEN["reservation"])]))


def test_a_transfer_inside_an_event_of_a_newer_format_is_refused_too() -> None:
    event = json.loads(GOLDEN["event"])
    event[3][0] = FORMAT + 1
    with pytest.raises(FutureFormatError):
        decode_event(json.dumps(event), 1)
    with pytest.raises(CodecError, match="format 0"):  # an older format than any release wrote: broken
        decode_transfer(json.dumps([0, *json.loads(GOLDEN["transfer"])[1:]]))


@pytest.mark.redis
async def test_a_redis_store_reads_the_previous_releases_records_and_refuses_newer_ones(redis_url: str) -> None:
    namespace = fresh_prefix()
    url = with_prefix(redis_url, namespace)
    writer = RedisStore(url)
    await writer.open()
    try:
        await put_engine(writer, make_engine("p"))
        await put_transfer(writer, make_transfer("t-1"))
    finally:
        await writer.close()
    engine_key, transfer_key = f"{{{namespace}}}:e:p", f"{{{namespace}}}:t:t-1"
    client = redis.Redis.from_url(redis_url)
    try:
        assert await client.exists(engine_key, transfer_key) == 2
        await client.hset(engine_key, "d", GOLDEN["engine"])
        await client.hset(transfer_key, "d", GOLDEN["transfer"])
        reader = RedisStore(url)  # a replica that has cached nothing
        await reader.open()
        try:
            assert await reader.get_engine("p") == ENGINE
            assert await reader.get_transfer("t-1") == TRANSFER
        finally:
            await reader.close()
        await client.hset(transfer_key, "d", _future(GOLDEN["transfer"]))
        reader = RedisStore(url)
        await reader.open()
        try:
            with pytest.raises(FutureFormatError):
                await reader.get_transfer("t-1")
        finally:
            await reader.close()
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_a_server_answers_store_unavailable_for_a_record_of_a_newer_format(redis_url: str) -> None:
    namespace = fresh_prefix()
    url = with_prefix(redis_url, namespace)
    writer = RedisStore(url)
    await writer.open()
    try:
        await put_transfer(writer, make_transfer("t-1"))
    finally:
        await writer.close()
    client = redis.Redis.from_url(redis_url)
    try:
        await client.hset(f"{{{namespace}}}:t:t-1", "d", _future(GOLDEN["transfer"]))  # as a newer replica would
    finally:
        await client.aclose()
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", store=url, grace=0.2))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t-1"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(caught.value).reason == "STORE_UNAVAILABLE"
        assert f"transfer record has format {FORMAT + 1}" in (caught.value.details() or "")
    finally:
        await server.stop(0)
