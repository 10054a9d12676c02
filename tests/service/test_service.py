"""The service over real gRPC sockets: lifecycle, watch semantics, errors on the wire, idempotency."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rendezvous.clients.testing import FakeClock
from rendezvous.protocol.errors import ERROR_DOMAIN
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import engine_request

Stub = pb_grpc.RendezvousServiceStub
CONSUMER, PRODUCER = pb.ENGINE_ROLE_CONSUMER, pb.ENGINE_ROLE_PRODUCER


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)
    assert status is not None, "the error carries no google.rpc.Status"
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    assert info.domain == ERROR_DOMAIN
    return info


def item_reason(status: status_pb2.Status) -> str:
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return str(info.reason)


async def expect_error(call: object, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code() == code, caught.value.details()
    assert error_info(caught.value).reason == reason


async def register_pair(stub: Stub) -> tuple[pb.RegisterEngineResponse, pb.RegisterEngineResponse]:
    d = await stub.RegisterEngine(engine_request("d1", CONSUMER))
    p = await stub.RegisterEngine(engine_request("p1", PRODUCER))
    return d, p


async def next_events(stream: grpc.aio.UnaryStreamCall, n: int = 1) -> list[pb.Event]:
    events: list[pb.Event] = []
    while len(events) < n:
        response = await asyncio.wait_for(stream.read(), 5)
        assert response is not grpc.aio.EOF
        events.extend(response.events)
    return events


async def test_push_lifecycle_over_grpc_delivers_the_assignment_to_the_watching_producer(stub: Stub) -> None:
    d, p = await register_pair(stub)
    watch = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=p.watch_start_sequence))
    established = await watch.read()
    assert established.header.epoch == p.header.epoch and not established.events
    claimed = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t1")])
    )
    assert claimed.results[0].state == pb.TRANSFER_STATE_CLAIMED
    targeted = await stub.RegisterTargets(
        pb.RegisterTargetsRequest(
            engine_id="d1",
            incarnation=d.engine.incarnation,
            targets=[pb.TargetSpec(transfer_id="t1", block_ids=[5, 9], generation=1)],
        )
    )
    assert targeted.results[0].state == pb.TRANSFER_STATE_MATCHED
    (assigned,) = await next_events(watch)
    assert assigned.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED
    assert list(assigned.transfer.target_block_ids) == [5, 9]
    assert assigned.peer.agents[0].metadata == b"md-d1-0"
    assert assigned.sequence == p.watch_start_sequence
    done = await stub.CompleteTransfers(
        pb.CompleteTransfersRequest(
            engine_id="p1",
            completions=[pb.CompletionSpec(transfer_id="t1", generation=1, outcome=pb.COMPLETION_OUTCOME_SUCCEEDED)],
        )
    )
    assert done.results[0].state == pb.TRANSFER_STATE_COMMITTED
    released = await stub.ReleaseTargets(
        pb.ReleaseTargetsRequest(engine_id="d1", releases=[pb.ReleaseSpec(transfer_id="t1", generation=1)])
    )
    assert released.results[0].state == pb.TRANSFER_STATE_RELEASED
    got = await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t1"))
    assert got.transfer.times.commit_time.ToNanoseconds() >= got.transfer.times.match_time.ToNanoseconds() > 0
    watch.cancel()


async def test_watch_resumes_from_a_sequence_after_a_disconnect(stub: Stub) -> None:
    _, p = await register_pair(stub)
    for i in range(3):
        await stub.RegisterTargets(
            pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id=f"t{i}", block_ids=[i])])
        )
        await stub.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id=f"t{i}")]))
    first = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=p.watch_start_sequence, max_batch=1))
    await first.read()
    (e1,) = await next_events(first)
    first.cancel()
    resumed = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=e1.sequence + 1))
    await resumed.read()
    rest = await next_events(resumed, 2)
    assert [e.transfer.transfer_id for e in [e1, *rest]] == ["t0", "t1", "t2"]
    assert [e.sequence for e in rest] == [e1.sequence + 1, e1.sequence + 2]
    resumed.cancel()


async def test_a_watcher_behind_the_retained_log_is_told_to_resync(stub: Stub) -> None:
    await register_pair(stub)
    # The fixture keeps 64 events per engine; 70 assignments push the first ones out.
    for chunk in range(7):
        ids = [f"t{chunk}-{i}" for i in range(10)]
        await stub.RegisterTargets(
            pb.RegisterTargetsRequest(
                engine_id="d1", targets=[pb.TargetSpec(transfer_id=t, block_ids=[1]) for t in ids]
            )
        )
        await stub.ClaimTransfers(
            pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id=t) for t in ids])
        )
    watch = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=1))
    await watch.read()
    resync = await watch.read()
    assert resync.resync_required and resync.resync_sequence == 71
    watch.cancel()


async def test_a_retry_with_the_same_request_id_returns_the_first_answer(stub: Stub) -> None:
    await register_pair(stub)
    request = pb.ClaimTransfersRequest(request_id="r-1", engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t1")])
    first = await stub.ClaimTransfers(request)
    await stub.AbortTransfers(pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id="t1")]))
    retry = await stub.ClaimTransfers(request)
    assert retry == first
    fresh = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(request_id="r-2", engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t1")])
    )
    assert fresh.results[0].state == pb.TRANSFER_STATE_ABORTED


async def test_keepalive_stream_renews_and_rejects_a_stale_incarnation(stub: Stub) -> None:
    d, _ = await register_pair(stub)
    stream = stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(engine_id="d1", incarnation=d.engine.incarnation))
    renewed = await stream.read()
    assert renewed.engine_id == "d1" and renewed.lease_ttl.seconds == 5
    await stream.write(pb.KeepAliveRequest(engine_id="d1", incarnation=d.engine.incarnation - 1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert error_info(caught.value).reason == "STALE_INCARNATION"


async def test_keepalive_of_an_engine_the_server_does_not_know_ends_with_engine_not_found(stub: Stub) -> None:
    stream = stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(engine_id="never-registered", incarnation=1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).reason == "ENGINE_NOT_FOUND"


async def test_an_expired_lease_aborts_transfers_and_tells_the_peer(server_config: ServerConfig) -> None:
    # The server's clock moves only when the test moves it: on the wall clock p1's 1 s lease had to outlast the
    # calls up to its claim, which a loaded machine could stretch past it (the claim then failed).
    clock = FakeClock()
    server = RendezvousServer(server_config, clock)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = Stub(channel)
            d = await stub.RegisterEngine(engine_request("d1", CONSUMER))
            p = await stub.RegisterEngine(engine_request("p1", PRODUCER, lease_ttl={"seconds": 1}))
            watch = stub.Watch(pb.WatchRequest(engine_id="d1", start_sequence=d.watch_start_sequence))
            await watch.read()
            await stub.RegisterTargets(
                pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t1", block_ids=[1])])
            )
            claims = [pb.ClaimSpec(transfer_id="t1")]
            await stub.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p1", claims=claims))
            keep = stub.KeepAlive()
            clock.advance(1.5)  # past p1's lease, within d1's (5 s)
            await server.coordinator.sweep()
            aborted, lost = await next_events(watch, 2)
            assert aborted.type == pb.EVENT_TYPE_TRANSFER_ABORTED
            assert aborted.transfer.abort_reason == pb.ABORT_REASON_PEER_LOST
            assert lost.type == pb.EVENT_TYPE_PEER_LOST and lost.peer.engine_id == "p1"
            await keep.write(pb.KeepAliveRequest(engine_id="p1", incarnation=p.engine.incarnation))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await keep.read()
            assert error_info(caught.value).reason == "LEASE_EXPIRED"
            watch.cancel()
    finally:
        await server.stop(0)


async def test_list_and_get_engines_filter_by_pool_and_role(stub: Stub) -> None:
    await register_pair(stub)
    producers = await stub.ListEngines(pb.ListEnginesRequest(role=PRODUCER))
    assert [e.engine_id for e in producers.engines] == ["p1"]
    slim = await stub.ListEngines(pb.ListEnginesRequest(pool="decode", view=pb.ENGINE_VIEW_PLACEMENT))
    assert [e.engine_id for e in slim.engines] == ["d1"] and slim.engines[0].agents[0].metadata == b""
    got = await stub.GetEngine(pb.GetEngineRequest(engine_id="d1"))
    assert got.engine.agents[0].metadata == b"md-d1-0"


async def test_list_transfers_pages_in_id_order(stub: Stub) -> None:
    await register_pair(stub)
    ids = [f"t{i:02d}" for i in range(5)]
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id=t, block_ids=[1]) for t in ids])
    )
    seen: list[str] = []
    token = ""
    while True:
        page = await stub.ListTransfers(pb.ListTransfersRequest(engine_id="d1", page_size=2, page_token=token))
        seen.extend(t.transfer_id for t in page.transfers)
        token = page.next_page_token
        if not token:
            break
    assert seen == ids


async def test_status_counts_engines_transfers_and_watchers(stub: Stub) -> None:
    _, p = await register_pair(stub)
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t1", block_ids=[1])])
    )
    watch = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=p.watch_start_sequence))
    await watch.read()
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert (status.live_engines, dict(status.transfers_by_state), status.watchers) == (2, {"TARGETED": 1}, 1)
    assert status.store == "memory"
    watch.cancel()


async def test_a_cancelled_watch_ends_even_when_the_store_loses_the_cancellation(
    server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py 8.2 on Python 3.11 loses a cancellation that lands while it reconnects a watch connection, and
    wait_events then returns as if it timed out: the stream of a client that had gone looped on, counted in
    `watchers` and polling Redis, until the server stopped. Here the store loses it every time."""
    srv = RendezvousServer(server_config)
    wait_events = srv.store.wait_events
    lost, waited_again = asyncio.Event(), asyncio.Event()

    async def losing(engine_id: str, after_sequence: int, timeout: float) -> None:
        if lost.is_set():
            waited_again.set()
        try:
            await wait_events(engine_id, after_sequence, timeout)
        except asyncio.CancelledError:
            lost.set()

    monkeypatch.setattr(srv.store, "wait_events", losing)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(srv.address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            d = await stub.RegisterEngine(engine_request("d1", CONSUMER))
            watch = stub.Watch(pb.WatchRequest(engine_id="d1", start_sequence=d.watch_start_sequence))
            await watch.read()
            assert (await stub.GetStatus(pb.GetStatusRequest())).watchers == 1
            watch.cancel()
            await lost.wait()
            while (await stub.GetStatus(pb.GetStatusRequest())).watchers:
                assert not waited_again.is_set(), "the cancelled stream went on waiting for events"
                await asyncio.sleep(0.01)
    finally:
        await srv.stop(0)


async def test_status_counts_live_transfers_only_not_tombstones(stub: Stub) -> None:
    await register_pair(stub)
    targets = [pb.TargetSpec(transfer_id=t, block_ids=[1]) for t in ("t1", "t2")]
    await stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id="d1", targets=targets))
    await stub.AbortTransfers(pb.AbortTransfersRequest(engine_id="d1", aborts=[pb.AbortSpec(transfer_id="t2")]))
    assert (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t2"))).transfer.state == pb.TRANSFER_STATE_ABORTED
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert dict(status.transfers_by_state) == {"TARGETED": 1}


async def test_a_watcher_that_stops_reading_never_blocks_the_server_and_resyncs_or_sees_every_event(
    stub: Stub,
) -> None:
    _, p = await register_pair(stub)
    slow = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=p.watch_start_sequence))
    await slow.read()
    # 600 assignments while the watcher reads nothing: ~10x the 64 events the fixture retains.
    for chunk in range(6):
        ids = [f"s{chunk}-{i}" for i in range(100)]
        targets = [pb.TargetSpec(transfer_id=t, block_ids=[1]) for t in ids]
        await asyncio.wait_for(stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id="d1", targets=targets)), 5)
        claims = [pb.ClaimSpec(transfer_id=t) for t in ids]
        await asyncio.wait_for(stub.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p1", claims=claims)), 5)
    expected = p.watch_start_sequence
    resynced = False
    while expected <= 600:
        response = await asyncio.wait_for(slow.read(), 5)
        if response.resync_required:
            resynced = True
            expected = response.resync_sequence
            continue
        for event in response.events:
            assert event.sequence == expected, "a gap in sequences without a resync"
            expected += 1
    assert resynced, "600 events cannot all have been buffered for a reader that stopped"
    slow.cancel()


async def test_an_abort_after_assignment_tells_the_consumer_which_generation_to_wait_for(stub: Stub) -> None:
    await register_pair(stub)
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    )
    await stub.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t")]))
    aborted = await stub.AbortTransfers(
        pb.AbortTransfersRequest(engine_id="d1", aborts=[pb.AbortSpec(transfer_id="t", message="gone")])
    )
    assert (aborted.results[0].state, aborted.results[0].revoking_generation) == (pb.TRANSFER_STATE_ABORTED, 1)
