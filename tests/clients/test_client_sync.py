"""The blocking client against the blocking test harness over loopback gRPC."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from rendezvous.clients import (
    ClaimSpec,
    CompletionSpec,
    CreditSpec,
    EngineCapacity,
    EngineRole,
    EngineSpec,
    EventType,
    FailedPrecondition,
    InvalidArgument,
    RendezvousClient,
    TargetSpec,
    TransferState,
    Unavailable,
    WatchBatch,
    WatchStream,
)
from rendezvous.clients.testing import TestServer
from tests.clients.conftest import MUST, WAIT, GrpcProxy, client_config, free_port
from tests.factories import sdk_engine


@pytest.fixture(scope="module")
def sync_server() -> Iterator[TestServer]:
    with TestServer(grace=0.1) as server:
        yield server


@pytest.fixture
def client(sync_server: TestServer) -> Iterator[RendezvousClient]:
    sync_server.restart()  # a fresh store per test
    with RendezvousClient(client_config(sync_server.address)) as c:
        yield c


def spec(engine_id: str, role: EngineRole) -> EngineSpec:
    return sdk_engine(engine_id, role)


def next_with_events(stream: WatchStream) -> WatchBatch:
    return next(batch for batch in stream if batch.events)


def test_an_empty_engine_id_is_an_invalid_argument_with_reason_id_empty(client: RendezvousClient) -> None:
    with pytest.raises(InvalidArgument) as caught:
        client.register_engine(EngineSpec("", "decode", EngineRole.CONSUMER))
    assert caught.value.reason == "ID_EMPTY"


def test_push_lifecycle_with_a_blocking_watch(client: RendezvousClient) -> None:
    client.register_engine(spec("d0", EngineRole.CONSUMER))
    p = client.register_engine(spec("p0", EngineRole.PRODUCER))
    with client.watch("p0", p.watch_start_sequence) as stream:
        client.register_target("d0", TargetSpec("t1", [3, 4]))
        assert client.claim_transfers("p0", [ClaimSpec("t1")])[0].state == TransferState.MATCHED
        (assigned,) = next_with_events(stream).events
    assert assigned.type == EventType.TRANSFER_ASSIGNED
    assert assigned.transfer is not None and assigned.transfer.target_block_ids == (3, 4)
    assert client.complete_transfer("p0", CompletionSpec("t1", 1)).state == TransferState.COMMITTED
    assert [t.transfer_id for t in client.iter_transfers("d0")] == ["t1"]


def test_cancelling_a_watch_from_another_thread_ends_its_iteration(client: RendezvousClient) -> None:
    client.register_engine(spec("d0", EngineRole.CONSUMER))
    stream = client.watch("d0")
    established = threading.Event()
    batches: list[WatchBatch] = []

    def consume() -> None:
        for batch in stream:
            batches.append(batch)
            established.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert established.wait(WAIT)
    stream.cancel()
    reader.join(WAIT)
    assert not reader.is_alive()
    assert [b.events for b in batches] == [()]


def test_the_keep_alive_stream_renews_until_the_incarnation_ends(client: RendezvousClient) -> None:
    d = client.register_engine(spec("d0", EngineRole.CONSUMER)).engine
    with client.keep_alive() as stream:
        assert stream.renew("d0", d.incarnation).lease_ttl == d.lease_ttl
        client.deregister_engine("d0")
        with pytest.raises(FailedPrecondition) as caught:
            stream.renew("d0", d.incarnation)
    assert caught.value.reason == "LEASE_EXPIRED"


def test_a_dead_first_endpoint_fails_over_to_the_next(sync_server: TestServer) -> None:
    with RendezvousClient(client_config(f"127.0.0.1:{free_port()}", sync_server.address)) as client:
        assert client.get_status().epoch == sync_server.epoch
        assert client.target == sync_server.address
        assert client.register_engine(spec("d0", EngineRole.CONSUMER)).engine.engine_id == "d0"


@pytest.fixture
def draining_proxy(sync_server: TestServer) -> Iterator[GrpcProxy]:
    """A gRPC proxy in front of the server, on a loop of its own, that ends every Watch and KeepAlive stream at
    once with status OK (a replica shutting down gracefully)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def started() -> GrpcProxy:
        proxy = GrpcProxy(sync_server.address)
        await proxy.start()
        proxy.drain("Watch")
        proxy.drain("KeepAlive")
        return proxy

    proxy = asyncio.run_coroutine_threadsafe(started(), loop).result(MUST)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(MUST)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_streams_the_server_ends_cleanly_move_the_client_to_its_next_endpoint(
    sync_server: TestServer, client: RendezvousClient, draining_proxy: GrpcProxy
) -> None:
    registration = client.register_engine(spec("d0", EngineRole.CONSUMER))
    incarnation = registration.engine.incarnation
    with RendezvousClient(client_config(draining_proxy.address, sync_server.address)) as proxied:
        with proxied.watch("d0", registration.watch_start_sequence) as stream:
            assert list(stream) == []
        assert proxied.target == sync_server.address

        proxied._endpoints.failover(1)  # back to the first
        with proxied.keep_alive() as renewals, pytest.raises(Unavailable):
            renewals.renew("d0", incarnation)
        assert proxied.target == sync_server.address
        with proxied.keep_alive() as renewals:
            assert renewals.renew("d0", incarnation).lease_ttl > 0


def test_a_restart_keeps_the_port_and_changes_the_epoch(sync_server: TestServer, client: RendezvousClient) -> None:
    heard: list[tuple[int, int]] = []
    client.add_epoch_listener(lambda old, new: heard.append((old, new)))
    before = client.get_status().epoch
    port = sync_server.port
    sync_server.restart()
    after = client.get_status().epoch
    assert sync_server.port == port
    assert after == sync_server.epoch != before
    assert heard == [(before, after)]


def test_the_sync_client_reserves_and_releases_credits(client: RendezvousClient) -> None:
    spec = sdk_engine("sync-credit-d", EngineRole.CONSUMER, capacity=EngineCapacity(1))
    client.register_engine(spec)
    [held] = client.reserve_credits([CreditSpec("sync-credit-t1", "sync-credit-d")])
    assert held.ok and held.engine_id == "sync-credit-d"
    [full] = client.reserve_credits([CreditSpec("sync-credit-t2", "sync-credit-d")])
    assert full.error is not None and full.error.reason == "ENGINE_CAPACITY_EXCEEDED"
    assert client.get_engine("sync-credit-d").free_transfers == 0
    [released] = client.release_credits(["sync-credit-t1"])
    assert released.ok and client.get_engine("sync-credit-d").free_transfers == 1
