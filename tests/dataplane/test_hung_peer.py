"""A peer that hangs (SIGSTOP), not dies, while a WRITE to it is in flight: nothing lands in blocks its owner was told
are free. UCX over TCP only (no shm: a stopped process's memory is still written over shared memory), so a stopped
consumer really stops receiving and the producer's WRITE stays in flight until it runs again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from rendezvous.clients import AbortReason, AbortSpec, NotFound, RendezvousClient, TransferState
from rendezvous.clients.nixl.consumer import AgentReason
from rendezvous.clients.testing import FakeClock, TestServer
from tests.dataplane.checks import Landed, assert_pool, transfer_id
from tests.dataplane.conftest import LEASE_TTL
from tests.dataplane.worker import Spec, WorkerProcess

pytestmark = pytest.mark.timeout(120)

BLOCK = 1 << 20
"""Bytes a block: the hung WRITE (32 blocks) is far more than loopback TCP buffers hold (a few MiB), so it cannot
complete, nor its notification arrive, while either side is stopped."""
WAIT = 30.0
"""Seconds a test waits for what the last step made due; only a failing test waits that long."""


@pytest.fixture
def tcp_pair(server: TestServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    """A producer and a consumer (the consumer with a short lease) talking UCX over TCP only; both are always
    resumed and ended, whatever the test did to them."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # the spawned children inherit it
    workers: list[WorkerProcess] = []
    try:
        workers.append(WorkerProcess(Spec("producer", server.address, "prefill-hung", (BLOCK,))))
        workers.append(WorkerProcess(Spec("consumer", server.address, "decode-hung", (BLOCK,), lease_ttl=LEASE_TTL)))
        yield workers[0], workers[1]
    finally:
        for worker in workers:
            if worker.process.is_alive():
                worker.resume()
            worker.close()


def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition()` (a command round trip each time) until it holds; fail after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.01)


def incarnation(client: RendezvousClient, engine_id: str) -> int:
    """The engine's live incarnation; 0 while it is not registered."""
    try:
        return client.get_engine(engine_id).incarnation
    except NotFound:
        return 0


def test_consumer_hung_mid_write_gets_its_blocks_back_only_once_the_producer_let_go(
    clock: FakeClock, server: TestServer, tcp_pair: tuple[WorkerProcess, WorkerProcess]
) -> None:
    """The consumer hangs with the producer's WRITE posted to it; its lease lapses, the service aborts the transfer
    PEER_LOST, fencing the generation the producer may still write (`revoking_generation`). Then the producer hangs
    too, and the consumer runs again: it re-registers, and the transfer did not survive that. The bytes of the WRITE
    posted before the hang land now (the consumer's UCX reads them from its socket), so the consumer must not hand
    the blocks back before the producer acknowledged the revocation, which it does only once that WRITE drained.
    Before the fix the consumer freed them at once on re-registration. Ordering only, no timing: while the producer
    is stopped it cannot acknowledge, and a second transfer's abort, which the consumer hears after its
    re-registration, shows the first's result did not come before."""
    producer, consumer = tcp_pair
    warm = transfer_id("warm")  # the producer connects to the consumer: the hung WRITE's bytes go on the socket
    assert consumer.call("register", warm, [0]) == "TARGETED"
    assert producer.call("claim", warm) == "MATCHED"
    producer.call("fill", 1, [0])
    producer.call("ready", warm, [0])
    assert consumer.result(warm, timeout=WAIT)[3] is True

    tid = transfer_id("hung-consumer")
    dst = list(range(1, 33))
    assert consumer.call("register", tid, dst) == "TARGETED"
    consumer.stop()
    assert producer.call("claim", tid) == "MATCHED"
    producer.call("fill", 2, list(range(32, 64)))
    producer.call("ready", tid, list(range(32, 64)))
    until(lambda: producer.call("writes_in_flight") == 1, "the WRITE to the hung consumer")

    clock.advance(LEASE_TTL + 0.1)  # the consumer's lease lapses (the producer's, 10 s, holds)
    server.sweep()
    with RendezvousClient(server.address) as client:
        info = client.get_transfer(tid)
        assert (info.state, info.abort_reason, info.revoking_generation) == (
            TransferState.ABORTED, AbortReason.PEER_LOST, 1
        )  # fmt: skip
        assert producer.call("writes_in_flight") == 1  # hung: it neither completes nor fails

        producer.stop()  # it cannot acknowledge the revocation now
        consumer.resume()
        until(lambda: incarnation(client, "decode-hung") > consumer.incarnation, "the re-registration")
        later = transfer_id("after-resume")
        assert consumer.call("register", later, [40]) == "TARGETED"
        client.abort_transfers("", [AbortSpec(later, "heard after the re-registration")])
        consumer.result(later, timeout=WAIT)
        assert not [e for e in consumer.pending() if e[0] == "result" and e[1] == tid], "freed while a WRITE may land"
        assert client.get_transfer(tid).revoking_generation == 1

        producer.resume()  # its WRITE drains (the consumer runs), then it acknowledges, then the blocks come back
        assert consumer.result(tid, timeout=WAIT) == ("result", tid, 1, False, tuple(dst), AgentReason.LOST)
        assert client.get_transfer(tid).revoking_generation == 0
    producer.freed(tid, timeout=WAIT)
    assert_pool(consumer, [Landed(1, 1, [0]), Landed(2, 32, dst)])  # the hung WRITE landed, where it was due
