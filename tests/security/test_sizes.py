"""Every free-form size is bounded: labels and agent metadata over their limits are refused with a reason
naming the field and the limit, abort and completion messages are clipped, and no peer's data makes
another engine's Watch undeliverable to a client with gRPC's default 4 MiB receive limit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import fields

import grpc
import pytest

from rendezvous import wire
from rendezvous.core import engines as engine_rules
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Event, EventType, State, Transfer
from rendezvous.core.validation import check_engine_spec
from rendezvous.protocol import convert
from rendezvous.protocol.errors import clip
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.test_service import error_info

LIMITS = Limits()
CLIENT_RECEIVE_LIMIT = 4 << 20
"""gRPC's default max_receive_message_length: what a client gets that sets no channel options."""
Stub = pb_grpc.RendezvousServiceStub
CONSUMER, PRODUCER = pb.ENGINE_ROLE_CONSUMER, pb.ENGINE_ROLE_PRODUCER


def largest_labels() -> dict[str, str]:
    """Labels at every label limit at once: the most keys and the longest each, filling max_labels_bytes."""
    count = LIMITS.max_labels_bytes // LIMITS.max_label_value_bytes
    key_bytes = LIMITS.max_label_key_bytes
    value_bytes = LIMITS.max_labels_bytes // count - key_bytes
    labels = {f"{i:03d}".ljust(key_bytes, "k"): "v" * value_bytes for i in range(count)}
    assert sum(len(k) + len(v) for k, v in labels.items()) == LIMITS.max_labels_bytes
    return labels


def region(device: int, num_blocks: int = (1 << 32) - 1) -> pb.KvRegion:
    """A region whose every field is as long on the wire as its type allows."""
    top = (1 << 64) - 1
    return pb.KvRegion(
        base_address=top, block_stride_bytes=top, block_length_bytes=top, num_blocks=num_blocks, device_id=device
    )


def largest_engine_request(engine_id: str, role: pb.EngineRole) -> pb.RegisterEngineRequest:
    """The largest registration the default limits accept: every id, name, string, label, byte of agent
    metadata and region at its limit, on the most agents."""
    agents = LIMITS.max_agents_per_engine
    regions = LIMITS.max_regions_per_engine // agents
    top32 = (1 << 32) - 1
    return pb.RegisterEngineRequest(
        engine_id=engine_id.ljust(LIMITS.max_id_length, "e"),
        pool="p".ljust(LIMITS.max_id_length, "p"),
        role=role,
        layout=pb.KvLayout(
            model_fingerprint="m" * LIMITS.max_id_length,
            dtype="d" * LIMITS.max_id_length,
            kv_layout="l" * LIMITS.max_id_length,
            block_size=top32,
            num_layers=regions,
            tp_size=agents,
            pp_size=1,
        ),
        agents=[
            pb.NixlAgent(
                name=f"{rank:03d}".ljust(LIMITS.max_id_length, "a"),
                metadata=b"m" * (LIMITS.max_engine_agent_metadata_bytes // agents),
                rank=rank,
                memory_kind=pb.MEMORY_KIND_VRAM,
                regions=[region(top32 - i) for i in range(regions)],
            )
            for rank in range(agents)
        ],
        labels=largest_labels(),
    )


def test_clip_cuts_utf8_bytes_on_a_character_boundary() -> None:
    assert clip("short", 10) == "short"
    assert clip("x" * 11, 10) == "xxxxxxx..."
    cut = clip("\u00e9" * 10, 10)  # two bytes each: 3.5 characters fit before "..."
    assert cut == "\u00e9\u00e9\u00e9..." and len(cut.encode()) <= 10
    assert clip("abcdef", 2) == ".."


def test_under_the_default_limits_the_largest_event_fits_a_default_client() -> None:
    request = largest_engine_request("d", CONSUMER)
    spec = convert.engine_spec(request)
    check_engine_spec(spec, LIMITS)  # accepted: this is within the limits, not beyond them
    peer = engine_rules.register_engine(1e9, None, spec, LIMITS, Timeouts())
    blocks = tuple(range((1 << 32) - 1 - LIMITS.max_blocks_per_target, (1 << 32) - 1))
    transfer = Transfer(
        "t".ljust(LIMITS.max_id_length, "t"),
        State.ABORTED,
        deadline=1e9,
        generation=(1 << 64) - 1,
        consumer_engine_id=peer.engine_id,
        consumer_incarnation=(1 << 64) - 1,
        producer_engine_id="p".ljust(LIMITS.max_id_length, "p"),
        producer_incarnation=(1 << 64) - 1,
        target_block_ids=blocks,
        source_block_ids=blocks,
        num_tokens=(1 << 32) - 1,
        abort_message="x" * LIMITS.max_abort_message_bytes,
        reported_ranks=tuple(range(LIMITS.max_agents_per_engine)),
        progressive=True,
    )
    event = Event(EventType.TRANSFER_ASSIGNED, 1e9, transfer, (1 << 64) - 1, peer, (1 << 64) - 1)
    header = pb.ResponseHeader(epoch=(1 << 64) - 1, revision=(1 << 64) - 1, server_id="s" * 255)
    response = pb.WatchResponse(header=header, events=[wire.event_message(event)])
    assert response.ByteSize() < CLIENT_RECEIVE_LIMIT
    assert response.ByteSize() > LIMITS.max_engine_agent_metadata_bytes + LIMITS.max_labels_bytes  # all there


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", limits=LIMITS, grace=0.2))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:  # gRPC's default limits
            yield pb_grpc.RendezvousServiceStub(channel)
    finally:
        await server.stop(0)


def ranked_request(
    engine_id: str, role: pb.EngineRole, metadata_bytes: int = 8, ranks: int = 2
) -> pb.RegisterEngineRequest:
    """A registration of an engine of TP ranks, each agent with metadata_bytes of metadata."""
    layout = pb.KvLayout(
        model_fingerprint="tiny", dtype="float32", block_size=16, num_layers=2, tp_size=ranks, pp_size=1
    )
    agents = [
        pb.NixlAgent(
            name=f"{engine_id}-{rank}",
            metadata=b"m" * metadata_bytes,
            rank=rank,
            memory_kind=pb.MEMORY_KIND_DRAM,
            regions=[pb.KvRegion(base_address=1 << 20, block_stride_bytes=64, block_length_bytes=64, num_blocks=64)],
        )
        for rank in range(ranks)
    ]
    pool = "decode" if role == CONSUMER else "prefill"
    return pb.RegisterEngineRequest(engine_id=engine_id, pool=pool, role=role, layout=layout, agents=agents)


async def refused(stub: Stub, request: pb.RegisterEngineRequest, reason: str, field: str, limit: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.RegisterEngine(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    info = error_info(caught.value)
    assert (info.reason, info.metadata["field"], info.metadata["limit"]) == (reason, field, str(limit))
    assert str(limit) in (caught.value.details() or "")


async def test_labels_over_their_key_value_or_total_limit_are_refused_naming_the_field(stub: Stub) -> None:
    def with_labels(labels: dict[str, str]) -> pb.RegisterEngineRequest:
        request = ranked_request("d", CONSUMER)
        request.labels.update(labels)
        return request

    long_key = {"k" * (LIMITS.max_label_key_bytes + 1): "v"}
    await refused(stub, with_labels(long_key), "LABELS_INVALID", "labels.key", LIMITS.max_label_key_bytes)
    long_value = {"k": "\u00e9" * (LIMITS.max_label_value_bytes // 2 + 1)}  # counted in UTF-8 bytes
    await refused(stub, with_labels(long_value), "LABELS_INVALID", "labels.value", LIMITS.max_label_value_bytes)
    too_much = {**largest_labels(), "one": "more"}
    await refused(stub, with_labels(too_much), "LABELS_INVALID", "labels", LIMITS.max_labels_bytes)
    many = {f"k{i}": "" for i in range(LIMITS.max_labels + 1)}
    await refused(stub, with_labels(many), "LABELS_INVALID", "labels", LIMITS.max_labels)
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.GetEngine(pb.GetEngineRequest(engine_id="d"))  # nothing was registered
    accepted = await stub.RegisterEngine(with_labels(largest_labels()))
    assert dict(accepted.engine.labels) == largest_labels()


async def test_agent_metadata_over_its_limit_per_agent_or_per_engine_is_refused(stub: Stub) -> None:
    one_too_large = ranked_request("d", CONSUMER)
    one_too_large.agents[0].metadata = b"m" * (LIMITS.max_agent_metadata_bytes + 1)
    await refused(stub, one_too_large, "AGENTS_INVALID", "agents.metadata", LIMITS.max_agent_metadata_bytes)
    each_within = ranked_request("d", CONSUMER, LIMITS.max_engine_agent_metadata_bytes // 4 + 1, ranks=4)
    assert len(each_within.agents[0].metadata) <= LIMITS.max_agent_metadata_bytes
    await refused(stub, each_within, "AGENTS_INVALID", "agents.metadata", LIMITS.max_engine_agent_metadata_bytes)
    at_limit = ranked_request("d", CONSUMER, LIMITS.max_engine_agent_metadata_bytes // 4, ranks=4)
    assert (await stub.RegisterEngine(at_limit)).engine.engine_id == "d"


async def test_layout_strings_and_regions_over_their_limits_are_refused(stub: Stub) -> None:
    long_model = ranked_request("d", CONSUMER)
    long_model.layout.model_fingerprint = "m" * (LIMITS.max_id_length + 1)
    await refused(stub, long_model, "LAYOUT_INVALID", "model_fingerprint", LIMITS.max_id_length)
    many_regions = ranked_request("d", CONSUMER)
    for agent in many_regions.agents:
        del agent.regions[:]
        agent.regions.extend(region(i, 1) for i in range(LIMITS.max_regions_per_engine // 2 + 1))
    await refused(stub, many_regions, "AGENTS_INVALID", "regions", LIMITS.max_regions_per_engine)


async def test_a_peer_at_every_size_limit_cannot_make_the_other_sides_watch_undeliverable(stub: Stub) -> None:
    # The consumer carries the most labels and agent metadata allowed; every assignment to the producer
    # repeats them. Then both sides end transfers with huge messages: aborts by the consumer, failed
    # completions by the producer. Both Watches must deliver everything to a default client.
    consumer = ranked_request("d", CONSUMER, LIMITS.max_engine_agent_metadata_bytes // 2)
    consumer.labels.update(largest_labels())
    d = await stub.RegisterEngine(consumer)
    p = await stub.RegisterEngine(ranked_request("p", PRODUCER))
    ids = [f"t{i}" for i in range(8)]
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d", targets=[pb.TargetSpec(transfer_id=t, block_ids=[1, 2]) for t in ids])
    )
    claimed = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(engine_id="p", claims=[pb.ClaimSpec(transfer_id=t) for t in ids])
    )
    assert all(r.state == pb.TRANSFER_STATE_MATCHED for r in claimed.results)
    huge = "\u00e9" * (1 << 20)  # 2 MiB: one a request, under the server's 4 MiB message size
    for t in ids[:4]:
        await stub.AbortTransfers(
            pb.AbortTransfersRequest(engine_id="d", aborts=[pb.AbortSpec(transfer_id=t, message=huge)])
        )
    for t in ids[4:]:
        failed = pb.CompletionSpec(transfer_id=t, outcome=pb.COMPLETION_OUTCOME_FAILED, message=huge)
        await stub.CompleteTransfers(pb.CompleteTransfersRequest(engine_id="p", completions=[failed]))

    producer_events = await watch_until(stub, "p", p.watch_start_sequence, 12)
    assigned = [e for e in producer_events if e.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED]
    assert [e.transfer.transfer_id for e in assigned] == ids
    assert all(dict(e.peer.labels) == largest_labels() for e in assigned)
    assert all(sum(len(a.metadata) for a in e.peer.agents) == LIMITS.max_engine_agent_metadata_bytes for e in assigned)
    consumer_events = await watch_until(stub, "d", d.watch_start_sequence, 4)
    aborted = [e for e in producer_events + consumer_events if e.type == pb.EVENT_TYPE_TRANSFER_ABORTED]
    assert sorted(e.transfer.transfer_id for e in aborted) == ids
    for event in aborted:
        message = event.transfer.abort_message
        assert message.startswith("\u00e9") and len(message.encode()) <= LIMITS.max_abort_message_bytes
    stored = await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t0"))
    assert len(stored.transfer.abort_message.encode()) <= LIMITS.max_abort_message_bytes


async def watch_until(stub: Stub, engine_id: str, start: int, count: int) -> list[pb.Event]:
    """The first count events of an engine's Watch from start, as a default client receives them."""
    stream = stub.Watch(pb.WatchRequest(engine_id=engine_id, start_sequence=start))
    events: list[pb.Event] = []
    try:
        async for response in stream:
            assert response.ByteSize() < CLIENT_RECEIVE_LIMIT
            events += response.events
            if len(events) >= count:
                return events
    finally:
        stream.cancel()
    raise AssertionError(f"the watch of {engine_id} ended after {len(events)} events")


def test_every_limit_is_a_serve_flag() -> None:
    from rendezvous.cli import build_parser

    args = build_parser(entry_point_commands=False).parse_args(
        ["serve", "--max-label-value-bytes", "7", "--max-response-bytes", "9"]
    )
    assert (args.max_label_value_bytes, args.max_response_bytes) == (7, 9)
    assert all(hasattr(args, f.name) for f in fields(Limits))
