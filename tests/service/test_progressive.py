"""Progressive push over gRPC: a progressive target reaches the producer in TRANSFER_ASSIGNED, a complete set of
parts commits, and every bad set is that item's status with its code and ErrorInfo reason, leaving the transfer
MATCHED and the consumer told nothing."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from rendezvous.core import Limits, Timeouts
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import LAYOUT, agent, engine_request
from tests.service.test_service import CONSUMER, PRODUCER, item_reason, next_events, register_pair

Stub = pb_grpc.RendezvousServiceStub
Code = grpc.StatusCode
P = pb.WrittenPart
LAYERS = LAYOUT.num_layers


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(
        listen="127.0.0.1:0",
        limits=Limits(max_parts_per_completion=8),
        timeouts=Timeouts(default_lease_ttl=5),
        sweep_interval=0.02,
        grace=0.2,
    )


async def target(stub: Stub, transfer_id: str, engine_id: str = "d1", **kw: Any) -> pb.ItemResult:
    spec = pb.TargetSpec(transfer_id=transfer_id, block_ids=[1, 2], **kw)
    response: pb.RegisterTargetsResponse = await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id=engine_id, targets=[spec])
    )
    return response.results[0]


async def claim(stub: Stub, transfer_id: str, engine_id: str = "p1") -> pb.ItemResult:
    claims = [pb.ClaimSpec(transfer_id=transfer_id)]
    response: pb.ClaimTransfersResponse = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(engine_id=engine_id, claims=claims)
    )
    return response.results[0]


async def complete(
    stub: Stub, transfer_id: str, *parts: pb.WrittenPart, engine_id: str = "p1", ranks: tuple[int, ...] = ()
) -> pb.ItemResult:
    spec = pb.CompletionSpec(
        transfer_id=transfer_id, generation=1, outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, ranks=ranks, parts=parts
    )
    response: pb.CompleteTransfersResponse = await stub.CompleteTransfers(
        pb.CompleteTransfersRequest(engine_id=engine_id, completions=[spec])
    )
    return response.results[0]


def written_parts(server: RendezvousServer) -> float:
    """The service's count of parts in accepted completions (kv_rendezvous_written_parts)."""
    return server.metrics.registry.get_sample_value("kv_rendezvous_written_parts_total") or 0.0


async def refusal(stub: Stub, result: pb.ItemResult) -> tuple[int, str, int]:
    """A refused item's status code and reason, and its transfer's state now."""
    t = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id=result.transfer_id))).transfer
    return result.status.code, item_reason(result.status), t.state


async def test_the_producer_sees_a_progressive_target_and_its_complete_parts_commit(
    stub: Stub, server: RendezvousServer
) -> None:
    _, p = await register_pair(stub)
    watch = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=p.watch_start_sequence))
    await watch.read()
    await target(stub, "t1", num_tokens=32, progressive=True)
    assert (await claim(stub, "t1")).state == pb.TRANSFER_STATE_MATCHED
    (assigned,) = await next_events(watch)
    assert assigned.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED and assigned.transfer.progressive
    layers = [P(first_token=0, num_tokens=32, first_layer=layer, num_layers=1) for layer in range(LAYERS)]
    assert (await complete(stub, "t1", *layers)).state == pb.TRANSFER_STATE_COMMITTED
    assert written_parts(server) == LAYERS
    got = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t1"))).transfer
    assert got.progressive and got.num_tokens == 32
    watch.cancel()


@pytest.mark.parametrize(
    ("parts", "code", "reason"),
    [
        ([P(first_token=0, num_tokens=16)], Code.INVALID_ARGUMENT, "PARTS_INCOMPLETE"),
        ([P(first_token=0, num_tokens=20), P(first_token=16, num_tokens=16)], Code.INVALID_ARGUMENT, "PARTS_OVERLAP"),
        ([P(first_token=0, num_tokens=33)], Code.OUT_OF_RANGE, "PART_OUT_OF_RANGE"),
        ([P(first_token=0, num_tokens=32, first_layer=1, num_layers=LAYERS)], Code.OUT_OF_RANGE, "PART_OUT_OF_RANGE"),
        ([P(first_token=i, num_tokens=1) for i in range(9)], Code.INVALID_ARGUMENT, "TOO_MANY_PARTS"),
    ],
    ids=["incomplete", "overlap", "past-the-tokens", "past-the-layers", "too-many"],
)
async def test_bad_parts_are_refused_and_the_transfer_stays_matched(
    stub: Stub, server: RendezvousServer, parts: list[pb.WrittenPart], code: grpc.StatusCode, reason: str
) -> None:
    d, _ = await register_pair(stub)
    watch = stub.Watch(pb.WatchRequest(engine_id="d1", start_sequence=d.watch_start_sequence))
    await watch.read()
    await target(stub, "t1", num_tokens=32, progressive=True)
    await claim(stub, "t1")
    assert await refusal(stub, await complete(stub, "t1", *parts)) == (code.value[0], reason, pb.TRANSFER_STATE_MATCHED)
    assert written_parts(server) == 0  # a refused report's parts are not counted
    # A later transfer's abort is the consumer's next event: no TRANSFER_COMMITTED came before it.
    await target(stub, "t2")
    await claim(stub, "t2")
    await stub.AbortTransfers(pb.AbortTransfersRequest(engine_id="p1", aborts=[pb.AbortSpec(transfer_id="t2")]))
    (event,) = await next_events(watch)
    assert (event.type, event.transfer.transfer_id) == (pb.EVENT_TYPE_TRANSFER_ABORTED, "t2")
    # The producer may report again, correctly.
    assert (await complete(stub, "t1", P(first_token=0, num_tokens=32))).state == pb.TRANSFER_STATE_COMMITTED
    (event,) = await next_events(watch)
    assert (event.type, event.transfer.transfer_id) == (pb.EVENT_TYPE_TRANSFER_COMMITTED, "t1")
    watch.cancel()


async def test_parts_for_a_target_that_did_not_accept_them_are_refused(stub: Stub) -> None:
    await register_pair(stub)
    await target(stub, "t1", num_tokens=32)
    await claim(stub, "t1")
    result = await complete(stub, "t1", P(first_token=0, num_tokens=32))
    assert await refusal(stub, result) == (
        Code.FAILED_PRECONDITION.value[0],
        "PROGRESSIVE_NOT_ACCEPTED",
        pb.TRANSFER_STATE_MATCHED,
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"progressive": True}, "PROGRESSIVE_NEEDS_TOKENS"),
        ({"progressive": True, "num_tokens": 32, "mode": pb.TRANSFER_MODE_PULL}, "PROGRESSIVE_NEEDS_PUSH"),
    ],
    ids=["without-tokens", "pull"],
)
async def test_a_progressive_target_needs_tokens_and_push(stub: Stub, fields: dict[str, Any], reason: str) -> None:
    await register_pair(stub)
    result = await target(stub, "t1", **fields)
    assert (result.status.code, item_reason(result.status)) == (Code.INVALID_ARGUMENT.value[0], reason)
    await expect_unknown(stub, "t1")


async def expect_unknown(stub: Stub, transfer_id: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetTransfer(pb.GetTransferRequest(transfer_id=transfer_id))
    assert caught.value.code() == Code.NOT_FOUND


async def test_a_multi_rank_producer_commits_only_when_every_rank_reported_complete_parts(stub: Stub) -> None:
    for engine_id, role in (("d2", CONSUMER), ("p2", PRODUCER)):
        request = engine_request(engine_id, role)
        request.layout.tp_size = 2
        request.agents.append(agent(f"{engine_id}-1"))
        request.agents[1].rank = 1
        await stub.RegisterEngine(request)
    await target(stub, "t1", engine_id="d2", num_tokens=32, progressive=True)
    await claim(stub, "t1", engine_id="p2")
    chunks = P(first_token=0, num_tokens=16), P(first_token=16, num_tokens=16)
    assert (await complete(stub, "t1", *chunks, engine_id="p2", ranks=(0,))).state == pb.TRANSFER_STATE_MATCHED
    result = await complete(stub, "t1", chunks[0], engine_id="p2", ranks=(1,))
    assert await refusal(stub, result) == (
        Code.INVALID_ARGUMENT.value[0],
        "PARTS_INCOMPLETE",
        pb.TRANSFER_STATE_MATCHED,
    )
    got = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t1"))).transfer
    assert list(got.reported_ranks) == [0]
    assert (await complete(stub, "t1", *chunks, engine_id="p2", ranks=(1,))).state == pb.TRANSFER_STATE_COMMITTED
