"""Engines killed with SIGKILL: once the dead engine's lease lapses, the survivor learns and frees its blocks."""

from __future__ import annotations

import time

import pytest

from rendezvous.clients import AbortReason
from rendezvous.clients.testing import FakeClock, TestServer
from tests.dataplane.checks import Landed, assert_pool, reset_pool, transfer_id
from tests.dataplane.conftest import LEASE_TTL
from tests.dataplane.worker import Spec, WorkerProcess

pytestmark = pytest.mark.timeout(60)

WAIT = 15.0
"""Seconds a test waits for what the last step made due; only a failing test waits that long."""


def lapse(clock: FakeClock, server: TestServer) -> None:
    """The killed engine's lease passes and the sweeper runs."""
    clock.advance(LEASE_TTL + 0.1)
    server.sweep()


def test_producer_killed_mid_transfer(clock: FakeClock, server: TestServer, consumer: WorkerProcess) -> None:
    reset_pool(consumer)
    doomed = WorkerProcess(Spec("producer", server.address, "prefill-doomed", lease_ttl=LEASE_TTL))
    try:
        tid = transfer_id("dead-producer")
        consumer.call("register", tid, [1, 2, 3])
        assert doomed.call("claim", tid) == "MATCHED"  # assigned: the writer holds it, its source not ready
        doomed.kill()
        assert not [e for e in consumer.pending() if e[0] == "result"]  # its lease has not lapsed
        lapse(clock, server)
        assert consumer.result(tid, timeout=WAIT) == ("result", tid, 1, False, (1, 2, 3), AbortReason.PEER_LOST)
        assert_pool(consumer, [])
    finally:
        doomed.close()


def test_producer_killed_mid_parts_never_starts_decode(
    clock: FakeClock, server: TestServer, consumer: WorkerProcess
) -> None:
    """The producer wrote the first of three blocks as a part, then died: the consumer does not take the part
    as arrival, hears of the loss once the lease lapsed, and gets its blocks back failed; nothing more lands."""
    reset_pool(consumer)
    doomed = WorkerProcess(Spec("producer", server.address, "prefill-doomed-parts", lease_ttl=LEASE_TTL))
    try:
        tid = transfer_id("dead-mid-parts")
        assert consumer.call("register", tid, [1, 2, 3], 1, False, 48) == "TARGETED"
        assert doomed.call("claim", tid) == "MATCHED"
        doomed.call("fill", 5, [20, 21, 22])
        doomed.call("ready_part", tid, [20, 21, 22], 16, 48)  # block 20 is computed: a part of 16 tokens
        first = Landed(5, 1, [1])  # the first of the pattern's blocks
        deadline = time.monotonic() + WAIT
        while not part_landed(consumer, first):
            assert time.monotonic() < deadline, "the part never landed"
            time.sleep(0.01)
        doomed.kill()
        assert not [e for e in consumer.pending() if e[0] == "result"]  # a part is not arrival; the lease holds
        lapse(clock, server)
        assert consumer.result(tid, timeout=WAIT) == ("result", tid, 1, False, (1, 2, 3), AbortReason.PEER_LOST)
        assert_pool(consumer, [first])  # the part only: blocks 2 and 3 untouched
    finally:
        doomed.close()


def part_landed(consumer: WorkerProcess, landed: Landed) -> bool:
    try:
        assert_pool(consumer, [landed])
    except AssertionError:
        return False
    return True


def test_consumer_killed_producer_frees_its_blocks(
    clock: FakeClock, server: TestServer, producer: WorkerProcess
) -> None:
    doomed = WorkerProcess(Spec("consumer", server.address, "decode-doomed", lease_ttl=LEASE_TTL))
    try:
        tid = transfer_id("dead-consumer")
        doomed.call("register", tid, [1, 2, 3])
        assert producer.call("claim", tid) == "MATCHED"
        doomed.kill()
        producer.call("fill", 11, [30, 31, 32])
        producer.call("ready", tid, [30, 31, 32])
        lapse(clock, server)
        producer.freed(tid, timeout=WAIT)
    finally:
        doomed.close()


def test_survivors_keep_working_after_the_kills(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    reset_pool(consumer)
    tid = transfer_id("after")
    producer.call("fill", 42, [7, 8])
    consumer.call("register", tid, [12, 13])
    producer.call("claim", tid)
    producer.call("ready", tid, [7, 8])
    assert consumer.result(tid)[3] is True
    producer.freed(tid)
    assert_pool(consumer, [Landed(42, 2, [12, 13])])
