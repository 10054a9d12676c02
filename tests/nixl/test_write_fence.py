"""The write fence: a producer cut off from the service, while it still reaches the consumer over NIXL, writes
nothing once its lease may have lapsed (`EngineSession.writable_until`, checked by the `TransferWriter` before every
post), nor does a rank that follows rank 0's registration (`RankSession.writable_until`). Real service and NIXL agents
on 127.0.0.1; the cut-off rank's client goes through a `GrpcProxy` that cuts it off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar

import pytest
import torch

from rendezvous.clients import (
    AbortReason,
    AsyncRendezvousClient,
    EventType,
    KvLayout,
    SessionConfig,
    TransferState,
)
from rendezvous.clients.nixl.consumer import ConsumerAgent, OnResult, TransferResult
from rendezvous.clients.nixl.producer import OnReport, ProducerAgent, WriteReport
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.nixl.writer import WrittenPart
from rendezvous.clients.testing import TEST_LAYOUT, AsyncTestServer, FakeClock, start_test_server
from rendezvous.core.limits import Timeouts
from rendezvous.protocol.errors import NotFound
from tests.clients.conftest import FAST_SESSION, MUST, WAIT, GrpcProxy, client, client_config, grpc_proxy, server
from tests.nixl.helpers import on_assignment, on_reregistered

__all__ = ["client", "grpc_proxy", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

LEASE = 3.0
"""The producer's lease: the consumer is told PEER_LOST about this long after the cut."""
METHODS = (
    "AbortTransfers", "AcknowledgeRevocations", "ClaimTransfers", "CompleteTransfers", "DeregisterEngine", "GetEngine",
    "GetStatus", "GetTransfer", "KeepAlive", "ListEngines", "ListTransfers", "MarkSourcesReady", "RegisterEngine",
    "RegisterTargets", "ReleaseCredits", "ReleaseTargets", "ReserveCredits", "Watch",
)  # fmt: skip

T = TypeVar("T")


class First(Generic[T]):
    """A callback (`on_result`, `on_report`) that keeps the first value it is called with in `future`."""

    def __init__(self) -> None:
        self.future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def __call__(self, value: T) -> None:
        if not self.future.done():
            self.future.set_result(value)


def prefill_agent(client: AsyncRendezvousClient, on_report: OnReport, lease_ttl: float = 0.0) -> ProducerAgent:
    """Producer p0 in pool "prefill", its source 8 blocks of 256 bytes of ones; `lease_ttl` 0: the server's."""
    source = [torch.ones(8, 256, dtype=torch.uint8)]
    return ProducerAgent(
        client,
        "p0",
        "prefill",
        source,
        layout=TEST_LAYOUT,
        lease_ttl=lease_ttl,
        session_config=FAST_SESSION,
        on_report=on_report,
    )


def decode_agent(
    client: AsyncRendezvousClient,
    memory: list[torch.Tensor],
    on_result: OnResult,
    session_config: SessionConfig | None = None,
) -> ConsumerAgent:
    """Consumer d0 in pool "decode", its blocks `memory`."""
    return ConsumerAgent(
        client, "d0", "decode", memory, layout=TEST_LAYOUT, session_config=session_config, on_result=on_result
    )


@asynccontextmanager
async def running(producer: ProducerAgent, consumer: ConsumerAgent) -> AsyncIterator[None]:
    """Start the producer, then the consumer; close them in that order, whatever the test did."""
    await producer.start()
    await consumer.start()
    try:
        yield
    finally:
        await producer.close()
        await consumer.close()


async def test_a_producer_cut_off_from_the_service_does_not_write_into_blocks_the_consumer_was_told_are_free(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The producer holds an assignment whose source is not ready; then it is cut off from the service (every call
    held, its KeepAlive and Watch streams ended), not from the consumer. Its lease lapses at the service, which
    aborts the transfer with PEER_LOST: the consumer may reuse its blocks at once. Then prefill finishes. Before the
    fence, the writer (which never heard of the abort) WROTE into those blocks; now it posts nothing and the
    generation fails, reported with the reason once the service can be reached again.

    Deterministic whatever the load, with no sleep: the service lapses the lease no earlier than its TTL after it
    got the producer's last renewal that it answered, which the producer sent before that (or, unanswered, the
    producer did not count it), while the producer's fence is two thirds of the TTL after that send. The test makes
    the source ready only once the consumer was told PEER_LOST, so the writer looks at the fence after the lapse,
    after the fence: a slow machine only makes it look later. (Both clocks are this machine's: the service's wall
    clock and the session's monotonic one run at the same rate; the third of a TTL between them is the margin.)"""
    lost, reported = First[TransferResult](), First[WriteReport]()
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        producer = prefill_agent(proxied, reported, lease_ttl=LEASE)
        consumer = decode_agent(client, decode, lost)
        assigned = on_assignment(producer)
        async with running(producer, consumer):
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)  # the writer holds the assignment; prefill is still computing

            for method in METHODS:  # the partition: the producer reaches the consumer, not the service
                grpc_proxy.hold(method)
            grpc_proxy.end_streams("KeepAlive")
            grpc_proxy.end_streams("Watch")
            result = await asyncio.wait_for(lost.future, MUST)
            assert (result.ok, result.reason) == (False, AbortReason.PEER_LOST)  # its blocks are free now

            producer.ready("t1", [2])  # prefill finished
            assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]
            for method in METHODS:  # the service can be reached again: it is told the write failed
                grpc_proxy.release(method)
            report = await asyncio.wait_for(reported.future, MUST)

            assert not report.ok and "lease" in (report.error or "") and "not writing" in (report.error or "")
            assert int(torch.count_nonzero(decode[0])) == 0  # the consumer's memory is untouched


async def test_a_write_attempted_while_re_registering_after_a_restart_fails_and_lands_nothing(
    server: AsyncTestServer, client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The service restarts (a new epoch: it forgot every transfer, and which generation it assigned to whom) while
    the producer holds an assignment whose source is not ready; the producer's re-registration is held. The consumer
    re-registered and aborted the transfer in the new epoch, which never matched it: nothing fences the old
    assignment there, so its blocks are free at once. Then prefill finishes: the writer asks the fence, which the
    re-registration closed though the old lease's fence was far ahead, and fails the generation instead of waiting
    for the re-registration: an assignment of a replaced incarnation is not the service's to fence any more (see
    `EngineSession.writable_until`). Nothing lands, and the failure is reported to the engine (`on_report`), not to
    the service: the assignment was the replaced incarnation's (`EngineSession.complete_transfers`)."""
    loop = asyncio.get_running_loop()
    aborted, reported = First[TransferResult](), First[WriteReport]()
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        # the old lease's fence is 20 s ahead: only the re-registration closes it
        producer = prefill_agent(proxied, reported, lease_ttl=MUST)
        consumer = decode_agent(client, decode, aborted)
        assigned = on_assignment(producer)
        async with running(producer, consumer):
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)  # the writer holds the assignment; prefill is still computing
            assert producer.session.writable_until > loop.time() + WAIT

            grpc_proxy.hold("RegisterEngine")
            await server.restart()
            await grpc_proxy.wait_for(lambda: grpc_proxy.calls["RegisterEngine"] == 2)  # the producer's recovery
            assert (await consumer.abort("t1", "decode gave up")).ok  # as its new incarnation, in the new epoch
            result = await asyncio.wait_for(aborted.future, MUST)
            assert (result.ok, result.reason) == (False, AbortReason.REQUESTED)  # its blocks are free now

            producer.ready("t1", [2])  # prefill finished, during the producer's re-registration
            assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]
            assert int(torch.count_nonzero(decode[0])) == 0
            grpc_proxy.release("RegisterEngine")  # the next RegisterEngine goes through; the report follows
            report = await asyncio.wait_for(reported.future, MUST)

            assert (report.transfer_id, report.ok) == ("t1", False) and "not writing" in (report.error or "")
            assert int(torch.count_nonzero(decode[0])) == 0  # the consumer's memory is untouched


async def test_a_revocation_ack_refused_across_a_restart_is_not_sent_again_as_the_new_incarnation(
    server: AsyncTestServer, client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The producer holds an assignment whose source is not ready; decode is preempted (generation 2) and the
    producer acknowledges the revocation of generation 1 at once, but the call is held at the proxy while the
    service restarts and the producer's re-registration is held. Let through, it reaches the new epoch, which does
    not know the engine (ENGINE_NOT_FOUND). Before the fix the SDK waited for the re-registration and sent the ack
    again as the new incarnation: in a new epoch generations are numbered anew, and such an ack could confirm the
    revocation of the new match's generation while the new incarnation's WRITE of it is in flight. Now an ack goes
    as the incarnation that was told of the revocation only (`acknowledge_revocations(revoked_to=...)`), and is
    dropped once that one is replaced: the service ended or forgot the revocation."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        producer = prefill_agent(proxied, First[WriteReport](), lease_ttl=MUST)
        consumer = decode_agent(client, decode, First[TransferResult](), session_config=FAST_SESSION)
        assigned, producer_back = on_assignment(producer), on_reregistered(producer)
        async with running(producer, consumer):
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)  # the writer holds the assignment; prefill is still computing

            grpc_proxy.delay("AcknowledgeRevocations")
            assert (await consumer.register_target("t1", [6], 2)).ok  # preempted: generation 1 is revoked
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["AcknowledgeRevocations"] == 1)  # the ack, held
            grpc_proxy.hold("RegisterEngine")
            await server.restart()
            await grpc_proxy.wait_for(lambda: grpc_proxy.calls["RegisterEngine"] == 2)  # the producer's recovery
            grpc_proxy.let_through("AcknowledgeRevocations")  # the new epoch does not know p0 yet
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["AcknowledgeRevocations"] == 0)
            grpc_proxy.release("RegisterEngine")
            await asyncio.wait_for(producer_back, MUST)
        # closed: every call the producer queued went out
        assert grpc_proxy.calls["AcknowledgeRevocations"] == 1  # before the fix: 2, the second as the new incarnation


TOMBSTONE = 1.0
"""The service's tombstone TTL in the re-registration tests (on its fake clock): an aborted transfer is forgotten
once the clock moved this far."""
CLAIM_WAIT = 5.0
"""How long a claim waits for its target there (on the fake clock); both are below every lease TTL."""


async def test_an_assignment_of_the_replaced_incarnation_is_not_written_once_the_claim_is_new_to_the_service() -> None:
    """The service restarts (a new epoch) while the producer holds an assignment whose source is not ready, and
    its re-registration waits. The consumer re-registers and aborts the transfer in the new epoch; its blocks are
    free at once (nothing fences the old assignment there), and the abort's tombstone outlives its TTL. Then the
    producer re-registers: its claim, re-sent, is new to the service (CLAIMED: no target, not matched), and the
    fence opens on the new lease. Then prefill finishes. Before the fix the writer still held the replaced
    incarnation's assignment and WROTE the source into the consumer's freed block; now the re-registration dropped
    it, nothing is posted, and the claim waits under its deadline, which ends it: ABORTED, the source freed.

    No wall-clock bound: the service runs on a fake clock, moved by the test past the tombstone's TTL and then
    past the claim's deadline; every other step waits for what it needs."""
    clock = FakeClock()
    timeouts = Timeouts(default_lease_ttl=10.0, tombstone_ttl=TOMBSTONE, default_claim_timeout=CLAIM_WAIT)
    aborted, freed = First[TransferResult](), First[str]()
    reports: list[WriteReport] = []
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with start_test_server(clock, timeouts=timeouts, sweep_interval=0.02, grace=0.1) as server:
        proxy = GrpcProxy(server.address)
        await proxy.start()
        try:
            async with (
                AsyncRendezvousClient(client_config(server.address)) as client,
                AsyncRendezvousClient(client_config(proxy.address)) as proxied,
            ):
                producer = prefill_agent(proxied, reports.append, lease_ttl=MUST)
                consumer = decode_agent(client, decode, aborted)
                assigned = on_assignment(producer)
                reregistered = on_reregistered(producer)
                async with running(producer, consumer):
                    assert (await consumer.register_target("t1", [5], 1)).ok
                    assert (await producer.claim("t1")).ok
                    await asyncio.wait_for(
                        assigned, WAIT
                    )  # the writer holds the assignment; prefill is still computing

                    proxy.delay("RegisterEngine")
                    await server.restart()
                    await proxy.wait_for(lambda: proxy.delayed["RegisterEngine"] >= 1)  # the producer's recovery waits
                    assert (await consumer.abort("t1", "decode gave up")).ok  # as its new incarnation, in the new epoch
                    result = await asyncio.wait_for(aborted.future, MUST)
                    assert (result.ok, result.reason) == (False, AbortReason.REQUESTED)  # its blocks are free now
                    clock.advance(TOMBSTONE)
                    await server.sweep()  # the abort's tombstone is gone: the transfer is new to the service again
                    with pytest.raises(NotFound):
                        await client.get_transfer("t1")

                    proxy.let_through("RegisterEngine")
                    taken = await asyncio.wait_for(reregistered, MUST)  # and the fence opened on the new lease
                    assert [(r.transfer_id, r.ok, r.state) for r in taken.results] == [
                        ("t1", True, TransferState.CLAIMED)
                    ]
                    producer.ready("t1", [2], freed)  # prefill finished
                    assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]

                    clock.advance(CLAIM_WAIT)
                    await server.sweep()  # the claim waited for a target in vain: its deadline aborts it
                    # the producer's source is the engine's again
                    assert await asyncio.wait_for(freed.future, MUST) == "t1"
                    info = await client.get_transfer("t1")
                    assert (info.state, info.abort_reason) == (TransferState.ABORTED, AbortReason.DEADLINE_EXCEEDED)
                    assert reports == []  # nothing was written, nor reported written
                    assert int(torch.count_nonzero(decode[0])) == 0  # the consumer's memory is untouched
        finally:
            await proxy.close()


async def test_a_transfer_both_sides_re_assert_after_a_restart_is_assigned_again_and_written(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """The service restarts while the producer holds an assignment whose source is not ready; both sides re-register
    and re-assert the transfer, which the new epoch matches again and assigns to the producer's new incarnation,
    with the same generation. The re-registration dropped the replaced incarnation's assignment: the writer takes
    the new one (not as a repeat of the dropped one) and writes it once prefill finishes; nothing is lost."""
    arrived, reported = First[TransferResult](), First[WriteReport]()
    assignments: list[int] = []
    assigned, reassigned = asyncio.Event(), asyncio.Event()
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    producer = prefill_agent(client, reported)
    consumer = decode_agent(client, decode, arrived)
    handle = producer.handle_event

    async def handle_event(item: Any) -> None:
        await handle(item)
        if getattr(item, "type", None) is EventType.TRANSFER_ASSIGNED:
            assignments.append(item.generation)
            (assigned if len(assignments) == 1 else reassigned).set()

    producer.handle_event = handle_event  # type: ignore[method-assign]
    reregistered = on_reregistered(producer)
    async with running(producer, consumer):
        assert (await consumer.register_target("t1", [5], 1)).ok
        assert (await producer.claim("t1")).ok
        await asyncio.wait_for(assigned.wait(), WAIT)  # the writer holds the assignment; prefill is still computing
        await server.restart()
        await asyncio.wait_for(reregistered, MUST)  # the fence opened on the new lease
        await asyncio.wait_for(reassigned.wait(), MUST)  # the new epoch matched the transfer again
        producer.ready("t1", [2])  # prefill finished

        result = await asyncio.wait_for(arrived.future, MUST)
        report = await asyncio.wait_for(reported.future, MUST)
        assert (result.ok, result.generation, report.ok, report.generation) == (True, 1, True, 1)
        assert assignments == [1, 1]
        assert bool((decode[0][5] == 1).all()) and int(torch.count_nonzero(decode[0])) == 256


async def test_a_write_failed_while_re_registering_does_not_abort_the_transfer_matched_again(
    server: AsyncTestServer, client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The service restarts while the producer holds an assignment whose source is not ready, and the producer's
    re-registration is held. The consumer re-registers and re-asserts its target in the new epoch. Then prefill
    finishes: the write fails against the fence the re-registration closed, and says so. Then the producer
    re-registers and re-asserts its claim: the new epoch matches the transfer again and assigns generation 1 again,
    to the new incarnation. Before the fix the failure went to the service as the new incarnation (FAILED, generation
    1) and aborted the new match, and the producer let go of the source: a transfer both sides want was lost. Now the
    failure belongs to the replaced incarnation's assignment, which the new epoch forgot: it is not sent, the source
    is kept, and the new assignment is written and committed."""
    failed, arrived, written = First[str | None](), First[TransferResult](), First[WriteReport]()
    reports: list[WriteReport] = []

    def on_report(report: WriteReport) -> None:
        reports.append(report)
        if report.ok:
            written(report)

    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        # the old lease's fence is far ahead: only the re-registration closes it
        producer = prefill_agent(proxied, on_report, lease_ttl=MUST)
        consumer = decode_agent(client, decode, arrived, session_config=FAST_SESSION)
        assigned = on_assignment(producer)
        write_finished = producer._write_finished

        def on_write_finished(
            transfer_id: str, generation: int, ok: bool, error: str | None, parts: tuple[WrittenPart, ...] = ()
        ) -> None:
            write_finished(transfer_id, generation, ok, error, parts)
            if not ok:
                failed(error)

        producer._write_finished = on_write_finished  # type: ignore[method-assign]
        consumer_back = on_reregistered(consumer)
        async with running(producer, consumer):
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)  # the writer holds the assignment; prefill is still computing

            grpc_proxy.hold("RegisterEngine")
            await server.restart()
            await grpc_proxy.wait_for(lambda: grpc_proxy.calls["RegisterEngine"] == 2)  # the producer's recovery
            taken = await asyncio.wait_for(consumer_back, MUST)  # the consumer re-asserted its target
            assert [(r.transfer_id, r.ok, r.state) for r in taken.results] == [("t1", True, TransferState.TARGETED)]

            producer.ready("t1", [2])  # prefill finished, during the producer's re-registration
            error = await asyncio.wait_for(failed.future, MUST)  # the replaced incarnation's assignment: not written
            assert "re-registering" in (error or "") and "not writing" in (error or "")
            assert int(torch.count_nonzero(decode[0])) == 0
            grpc_proxy.release("RegisterEngine")  # the claim is re-asserted: the new epoch matches t1 again

            result = await asyncio.wait_for(arrived.future, MUST)
            assert (result.ok, result.generation) == (True, 1), result  # before the fix: aborted by the old report
            report = await asyncio.wait_for(written.future, MUST)
            assert report.generation == 1
            assert bool((decode[0][5] == 1).all()) and int(torch.count_nonzero(decode[0])) == 256
            assert [(r.generation, r.ok, r.error) for r in reports if not r.ok] == [(1, False, error)]
            info = await client.get_transfer("t1")
            assert info.state in (TransferState.COMMITTED, TransferState.RELEASED), info


async def test_a_write_whose_report_is_lost_across_a_restart_is_written_again_for_the_new_match(
    server: AsyncTestServer, client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The producer writes t1 (the consumer arrives on the notification) and reports it, but the report is held at
    the proxy while the service restarts (a new epoch: it forgot the transfer), and so is the producer's
    re-registration. The consumer re-registers and re-asserts its target. Let through, the report reaches the new
    epoch as the replaced incarnation and is dropped (STALE_INCARNATION). Then the producer re-registers and
    re-asserts its claim: the new epoch matches t1 again and assigns generation 1 again, to the new incarnation.
    Before the fix the writer freed the source as the write ended and ended the transfer: the new assignment was
    ignored, nothing committed the new match, and the consumer waited for its deadline. Now the source is kept until
    the report is answered; dropped, it is kept for the new assignment, which is written again and committed, and
    then the source is freed. The consumer's block is cleared after the first write, so the bytes checked are the
    second write's."""
    loop = asyncio.get_running_loop()
    arrived, freed = First[TransferResult](), First[str]()
    reported: list[asyncio.Future[WriteReport]] = [loop.create_future(), loop.create_future()]

    def on_report(report: WriteReport) -> None:
        next(f for f in reported if not f.done()).set_result(report)

    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        # the old lease's fence is far ahead: only the re-registration closes it
        producer = prefill_agent(proxied, on_report, lease_ttl=MUST)
        consumer = decode_agent(client, decode, arrived, session_config=FAST_SESSION)
        assigned, consumer_back = on_assignment(producer), on_reregistered(consumer)
        async with running(producer, consumer):
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)

            grpc_proxy.delay("CompleteTransfers")
            producer.ready("t1", [2], freed)  # prefill finished: written, and reported
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 1)  # the report, held
            result = await asyncio.wait_for(arrived.future, MUST)  # on the notification
            assert (result.ok, result.generation) == (True, 1)
            decode[0].zero_()

            grpc_proxy.hold("RegisterEngine")
            await server.restart()
            await grpc_proxy.wait_for(lambda: grpc_proxy.calls["RegisterEngine"] == 2)  # the producer's recovery
            taken = await asyncio.wait_for(consumer_back, MUST)  # the consumer re-asserted its target
            assert [(r.transfer_id, r.ok, r.state) for r in taken.results] == [("t1", True, TransferState.TARGETED)]
            grpc_proxy.let_through("CompleteTransfers")  # the new epoch does not know the old incarnation
            first = await asyncio.wait_for(reported[0], MUST)  # answered: dropped as the replaced incarnation's
            assert (first.generation, first.ok) == (1, True)
            assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]
            assert not freed.future.done()  # before the fix: freed as the write ended

            grpc_proxy.release("RegisterEngine")  # the claim is re-asserted: the new epoch matches t1 again
            second = await asyncio.wait_for(reported[1], MUST)  # before the fix: never written again
            assert (second.generation, second.ok) == (1, True)
            assert await asyncio.wait_for(freed.future, MUST) == "t1"  # its report was answered
            info = await client.get_transfer("t1")
            assert info.state in (TransferState.COMMITTED, TransferState.RELEASED), info
            assert bool((decode[0][5] == 1).all()) and int(torch.count_nonzero(decode[0])) == 256


TP2 = KvLayout("test-model", "uint8", 16, 1, tp_size=2, kv_layout="HND", num_kv_heads=2)
"""The producer: two ranks, a head each (256 bytes of a block)."""
TP1 = KvLayout("test-model", "uint8", 16, 1, kv_layout="HND", num_kv_heads=2)
"""The consumer: one rank, both heads (512 bytes of a block): rank 1 writes its second half."""


async def test_a_following_rank_cut_off_from_the_service_does_not_write_into_blocks_the_consumer_was_told_are_free(
    server: AsyncTestServer, client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The same partition, of a tensor-parallel engine's rank 1, which follows rank 0's registration (no lease of its
    own): rank 1 holds an assignment whose source is not ready when it is cut off from the service, not from the
    consumer, and so is rank 0 (or it died): the lease lapses, and the service aborts the transfer with PEER_LOST.
    Then rank 1's
    prefill finishes. Before rank 1 was fenced, it WROTE its half into the freed blocks; now it posts nothing and
    the generation fails with the fence's reason.

    Deterministic for the test's reason: rank 1's fence is at most the send time of its last answered read of the
    lease plus what the server said was left then, less a third of the TTL; the service lapses the lease no earlier
    than that send time plus what was left; and the source is made ready only after the consumer was told."""
    finished: asyncio.Future[tuple[bool, str | None]] = asyncio.get_running_loop().create_future()
    lost, reported = First[TransferResult](), First[WriteReport]()
    decode = [torch.zeros(8, 512, dtype=torch.uint8)]
    leader_proxy = GrpcProxy(server.address)
    await leader_proxy.start()
    async with (
        AsyncRendezvousClient(client_config(leader_proxy.address)) as leader_client,
        AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied,
    ):
        ranks = [
            ProducerAgent(
                c,
                "p0",
                "prefill",
                [torch.ones(8, 256, dtype=torch.uint8)],
                layout=TP2,
                rank=r,
                lease_ttl=LEASE,
                session_config=FAST_SESSION,
                on_report=reported,
            )
            for r, c in enumerate((leader_client, proxied))
        ]
        follower = ranks[1]
        consumer = ConsumerAgent(client, "d0", "decode", decode, layout=TP1, on_result=lost)
        assigned = on_assignment(follower)
        write_finished = follower._write_finished

        def on_write_finished(
            transfer_id: str, generation: int, ok: bool, error: str | None, parts: tuple[WrittenPart, ...] = ()
        ) -> None:
            if not finished.done():
                finished.set_result((ok, error))
            write_finished(transfer_id, generation, ok, error, parts)

        follower._write_finished = on_write_finished  # type: ignore[method-assign]
        await start_ranks(ranks)
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await ranks[0].claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)  # rank 1's writer holds the assignment; prefill is still computing

            for proxy in (grpc_proxy, leader_proxy):  # the partition: the ranks reach the consumer, not the service
                for method in METHODS:
                    proxy.hold(method)
                proxy.end_streams("KeepAlive")
                proxy.end_streams("Watch")
            result = await asyncio.wait_for(lost.future, MUST)
            assert (result.ok, result.reason) == (False, AbortReason.PEER_LOST)  # its blocks are free now

            follower.ready("t1", [2])  # rank 1's prefill finished
            assert await asyncio.to_thread(follower._writer.barrier, WAIT)  # type: ignore[union-attr]
            ok, error = await asyncio.wait_for(finished, MUST)

            assert not ok and "lease" in (error or "") and "not writing" in (error or "")
            assert int(torch.count_nonzero(decode[0])) == 0  # the consumer's memory is untouched
            for proxy in (grpc_proxy, leader_proxy):  # the service can be reached again: rank 0 registers anew,
                for method in METHODS:  # and rank 1 follows; the failed write's report, the lapsed incarnation's,
                    proxy.release(method)  # is answered STALE_INCARNATION (`EngineSession.complete_transfers`)
            report = await asyncio.wait_for(reported.future, MUST)
            assert (report.transfer_id, report.ok, report.error) == ("t1", False, error)
        finally:
            for proxy in (grpc_proxy, leader_proxy):
                for method in METHODS:
                    proxy.release(method)
            for rank in ranks:  # any order: a call waiting for rank 0 to register again ends on close (`begin_close`)
                await rank.close()
            await consumer.close()
            await leader_proxy.close()
