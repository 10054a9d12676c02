"""What the server's answers take from the store, on either store: the revision in response headers, and the
end of a Watch whose engine was forgotten."""

from __future__ import annotations

import grpc

from rendezvous.clients.testing import start_test_server
from rendezvous.core import Timeouts
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.redis_fixtures import redis_url, store
from tests.service.conftest import engine_request
from tests.service.test_service import expect_error, register_pair

__all__ = ["redis_url", "store"]  # the fixtures


async def test_headers_carry_a_revision_that_covers_what_the_call_wrote_and_the_events_it_sends(store: str) -> None:
    async with start_test_server(store=store) as server, grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        d, p = await register_pair(stub)
        watch = stub.Watch(pb.WatchRequest(engine_id="p1", start_sequence=p.watch_start_sequence))
        await watch.read()  # established
        targeted = await stub.RegisterTargets(
            pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
        )
        claimed = await stub.ClaimTransfers(
            pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t")])
        )
        assigned = await watch.read()
        now = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))).header.revision
        assert [e.type for e in assigned.events] == [pb.EVENT_TYPE_TRANSFER_ASSIGNED]
        # One server, nothing else writing: the claim's header is the store's revision after it, which is
        # past the target's; the assignment was written by the claim, so its Watch response is as new.
        assert d.header.revision < p.header.revision < targeted.header.revision < claimed.header.revision == now
        assert assigned.header.revision == now
        watch.cancel()


async def test_a_watch_on_an_engine_that_is_forgotten_ends_with_engine_not_found(store: str) -> None:
    timeouts = Timeouts(tombstone_ttl=0.1)
    async with (
        start_test_server(store=store, timeouts=timeouts, sweep_interval=0.02) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.RendezvousServiceStub(channel)
        engine = (await stub.RegisterEngine(engine_request("d1", pb.ENGINE_ROLE_CONSUMER))).engine
        watch = stub.Watch(pb.WatchRequest(engine_id="d1"))
        await watch.read()  # established
        await stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="d1", incarnation=engine.incarnation))
        await expect_error(_until_the_end(watch), grpc.StatusCode.NOT_FOUND, "ENGINE_NOT_FOUND")


async def _until_the_end(watch: grpc.aio.UnaryStreamCall) -> None:
    """Read any events of the ended incarnation; a stream that ends without an error returns."""
    while await watch.read() is not grpc.aio.EOF:
        pass
