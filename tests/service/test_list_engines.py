"""ListEngines pages (AIP-158): a default and a maximum page size, tokens bound to the listing, pages
bounded in bytes (ListTransfers pages too), and labels or agent metadata left out on request."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous import cli
from rendezvous.core import Limits, Timeouts
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import agent, engine_request
from tests.service.test_service import error_info, expect_error

Stub = pb_grpc.RendezvousServiceStub
CONSUMER, PRODUCER = pb.ENGINE_ROLE_CONSUMER, pb.ENGINE_ROLE_PRODUCER
LIMITS = Limits(default_engine_page=2, max_engine_page=3, max_response_bytes=4_000)


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(listen="127.0.0.1:0", limits=LIMITS, timeouts=Timeouts(default_lease_ttl=5), grace=0.2)


async def register(stub: Stub, count: int, role: pb.EngineRole = CONSUMER, metadata_bytes: int = 0) -> list[str]:
    ids = [f"{'d' if role == CONSUMER else 'p'}{i:02d}" for i in range(count)]
    for engine_id in reversed(ids):
        request = engine_request(engine_id, role, labels={"url": f"http://{engine_id}"})
        if metadata_bytes:
            request.agents[0].metadata = b"m" * metadata_bytes
        await stub.RegisterEngine(request)
    return ids


async def every_page(stub: Stub, request: pb.ListEnginesRequest) -> list[pb.ListEnginesResponse]:
    pages = []
    while True:
        pages.append(await stub.ListEngines(request))
        request.page_token = pages[-1].next_page_token
        if not request.page_token:
            return pages


async def test_a_request_without_a_page_size_gets_the_default_and_a_larger_one_the_maximum(stub: Stub) -> None:
    ids = await register(stub, 7)
    first = await stub.ListEngines(pb.ListEnginesRequest())
    assert [e.engine_id for e in first.engines] == ids[:2] and first.next_page_token
    capped = await stub.ListEngines(pb.ListEnginesRequest(page_size=1000))
    assert [e.engine_id for e in capped.engines] == ids[:3]


async def test_paging_through_lists_every_engine_once_in_id_order(stub: Stub) -> None:
    ids = await register(stub, 7)
    pages = await every_page(stub, pb.ListEnginesRequest(page_size=3))
    assert [[e.engine_id for e in p.engines] for p in pages] == [ids[:3], ids[3:6], ids[6:]]
    assert pages[-1].next_page_token == ""


async def test_pages_keep_to_the_pool_and_role_asked_for(stub: Stub) -> None:
    consumers = await register(stub, 4)
    await register(stub, 4, PRODUCER)
    pages = await every_page(stub, pb.ListEnginesRequest(pool="decode", role=CONSUMER))
    assert [e.engine_id for p in pages for e in p.engines] == consumers


@pytest.mark.parametrize("token", ["%%%", "bm90IGEgdG9rZW4=", "ZW5naW5lcyAgCg==", "ZW5naW5lcyAgCmQgMQ=="])
async def test_a_page_token_this_server_did_not_issue_is_invalid_argument(stub: Stub, token: str) -> None:
    # Not base64; base64 of no token; a token of this listing with no id; one whose id has a space.
    await register(stub, 1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListEngines(pb.ListEnginesRequest(page_token=token))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert (info.reason, info.metadata["field"]) == ("PAGE_TOKEN_INVALID", "page_token")


async def test_a_page_token_does_not_continue_another_listing(stub: Stub) -> None:
    await register(stub, 3)
    await register(stub, 3, PRODUCER)
    decode = await stub.ListEngines(pb.ListEnginesRequest(pool="decode"))
    assert decode.next_page_token
    for other in (
        pb.ListEnginesRequest(pool="prefill", page_token=decode.next_page_token),
        pb.ListEnginesRequest(pool="decode", role=CONSUMER, page_token=decode.next_page_token),
    ):
        await expect_error(stub.ListEngines(other), grpc.StatusCode.INVALID_ARGUMENT, "PAGE_TOKEN_INVALID")
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(
            engine_id="d00", targets=[pb.TargetSpec(transfer_id=f"t{i}", block_ids=[i]) for i in range(3)]
        )
    )
    transfers = await stub.ListTransfers(pb.ListTransfersRequest(page_size=1))
    assert transfers.next_page_token
    await expect_error(
        stub.ListEngines(pb.ListEnginesRequest(page_token=transfers.next_page_token)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PAGE_TOKEN_INVALID",
    )


async def test_a_page_is_cut_before_it_outgrows_the_response_byte_limit(stub: Stub) -> None:
    ids = await register(stub, 6, metadata_bytes=1_500)
    pages = await every_page(stub, pb.ListEnginesRequest(page_size=3))
    assert [e.engine_id for p in pages for e in p.engines] == ids
    assert all(len(p.engines) < 3 and p.ByteSize() <= LIMITS.max_response_bytes + 200 for p in pages)
    slim = await every_page(stub, pb.ListEnginesRequest(page_size=3, view=pb.ENGINE_VIEW_PLACEMENT))
    assert [len(p.engines) for p in slim] == [3, 3]


async def test_one_engine_larger_than_the_response_byte_limit_still_gets_a_page_of_its_own(stub: Stub) -> None:
    ids = await register(stub, 2, metadata_bytes=LIMITS.max_response_bytes)
    pages = await every_page(stub, pb.ListEnginesRequest())
    assert [[e.engine_id for e in p.engines] for p in pages] == [[ids[0]], [ids[1]]]


async def test_the_view_leaves_out_labels_and_agent_metadata(stub: Stub) -> None:
    await stub.RegisterEngine(engine_request("d0", CONSUMER, labels={"url": "http://d0"}))
    default = (await stub.ListEngines(pb.ListEnginesRequest())).engines[0]
    assert dict(default.labels) == {"url": "http://d0"} and default.agents[0].metadata == agent("d0-0").metadata
    full = (await stub.ListEngines(pb.ListEnginesRequest(view=pb.ENGINE_VIEW_FULL))).engines[0]
    for listed in full, default:
        listed.ClearField("lease_remaining")  # as of each answer: time passed between them
    assert full == default
    basic = (await stub.ListEngines(pb.ListEnginesRequest(view=pb.ENGINE_VIEW_BASIC))).engines[0]
    assert dict(basic.labels) == {} and basic.agents[0].metadata == b""
    assert basic.agents[0].regions == full.agents[0].regions
    placement = (await stub.ListEngines(pb.ListEnginesRequest(view=pb.ENGINE_VIEW_PLACEMENT))).engines[0]
    assert dict(placement.labels) == {"url": "http://d0"} and placement.agents[0].metadata == b""


async def test_an_unknown_view_is_refused(stub: Stub) -> None:
    request = pb.ListEnginesRequest()
    request.view = 99  # type: ignore[assignment]  # a number no view has (a newer client's, or garbage)
    await expect_error(stub.ListEngines(request), grpc.StatusCode.INVALID_ARGUMENT, "VIEW_INVALID")


@pytest.mark.parametrize("listing", ["ListEngines", "ListTransfers"])
async def test_a_negative_page_size_is_refused(stub: Stub, listing: str) -> None:
    request = pb.ListEnginesRequest(page_size=-1) if listing == "ListEngines" else pb.ListTransfersRequest(page_size=-1)
    await expect_error(getattr(stub, listing)(request), grpc.StatusCode.INVALID_ARGUMENT, "PAGE_SIZE_INVALID")


async def test_the_engines_command_lists_every_page(
    stub: Stub, server: RendezvousServer, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = await register(stub, 5)
    assert await asyncio.to_thread(cli.main, ["engines", "--address", server.address]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == ids


async def test_health_answers_within_its_deadline_while_every_page_of_a_large_fleet_is_listed() -> None:
    # Default page limits: 400 engines with the most label bytes allowed, listed at the largest page size
    # with their metadata, while a probe with a 1 s deadline (a Kubernetes gRPC probe's default) checks health.
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", grace=0.2))
    await server.start()
    labels = {f"k{i}": "v" * (Limits().max_labels_bytes // 4 - 3) for i in range(4)}
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = Stub(channel)
            for i in range(400):
                await stub.RegisterEngine(engine_request(f"d{i:03d}", CONSUMER, labels=labels))
            health = health_pb2_grpc.HealthStub(channel)
            listing = asyncio.ensure_future(every_page(stub, pb.ListEnginesRequest(page_size=1000)))
            probes = 0
            while not listing.done():
                answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
                probes += 1
            pages = await listing
    finally:
        await server.stop(0)
    assert sum(len(p.engines) for p in pages) == 400 and len(pages) > 1  # cut by bytes, not by count
    assert all(p.ByteSize() < 4 << 20 for p in pages) and probes >= 1


async def test_a_list_transfers_page_is_cut_by_bytes_the_same_way(stub: Stub) -> None:
    await register(stub, 1)
    ids = [f"t{i:02d}" for i in range(40)]
    targets = [pb.TargetSpec(transfer_id=t, block_ids=list(range(60))) for t in ids]
    await stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id="d00", targets=targets))
    pages = []
    token = ""
    while True:
        pages.append(await stub.ListTransfers(pb.ListTransfersRequest(page_size=1000, page_token=token)))
        token = pages[-1].next_page_token
        if not token:
            break
    assert [t.transfer_id for p in pages for t in p.transfers] == ids
    assert len(pages) > 1 and all(p.ByteSize() <= LIMITS.max_response_bytes + 200 for p in pages)
