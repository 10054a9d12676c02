"""Engines of several ranks through the SDK and a real service: every rank its own agent, client and NIXL
thread; producer and consumer engines in separate processes. Every consumer byte is checked against where the
model's (layer, head, token) must land, and the service holds no live transfer afterwards."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rendezvous.clients import AbortReason, RendezvousClient, TransferState
from rendezvous.clients.nixl import AgentReason
from rendezvous.clients.testing import TestServer
from tests.dataplane.checks import transfer_id
from tests.dataplane.engines import EngineProcess, EngineSpec, expected

pytestmark = pytest.mark.timeout(90)


@dataclasses.dataclass(frozen=True)
class Case:
    producer: EngineSpec
    consumer: EngineSpec
    src: list[int]
    dst: list[int]
    prompt: int = 0
    """Tokens in `src` (0: all of them); with different block sizes the consumer receives the last `target`."""
    target: int = 0


def _engine(role: str, name: str, **shape: Any) -> EngineSpec:
    return EngineSpec(role, "", name, num_blocks=12, **shape)


CASES = {
    "tp4_to_tp1": Case(
        _engine("producer", "p-tp4", tp=4, block_size=8),
        _engine("consumer", "d-tp1", block_size=8),
        [5, 1, 2, 6],
        [3, 4, 7],
    ),
    "tp1_to_tp4_nhd": Case(
        _engine("producer", "p-tp1", block_size=8, kv_layout="NHD"),
        _engine("consumer", "d-tp4", tp=4, block_size=8, kv_layout="NHD"),
        [0, 1, 2],
        [6, 2, 3],
    ),
    "tp2_to_tp4": Case(
        _engine("producer", "p-tp2", tp=2, block_size=8),
        _engine("consumer", "d-tp4b", tp=4, block_size=8),
        [1, 2, 3, 4],
        [0, 1],
    ),
    "blocks_16_to_32": Case(  # 80 prompt tokens in 5 blocks; the consumer holds the first 32, receives the last 48
        _engine("producer", "p-b16", tp=2, block_size=16),
        _engine("consumer", "d-b32", block_size=32),
        [4, 0, 1, 2, 5],
        [3, 1],
        prompt=80,
        target=48,
    ),
    "tp2_to_tp2": Case(
        _engine("producer", "p-tp2b", tp=2, block_size=8),
        _engine("consumer", "d-tp2", tp=2, block_size=8),
        [6, 7, 8],
        [2, 3],
    ),
    "pp2_to_tp1": Case(
        _engine("producer", "p-pp2", pp=2, layers=4, block_size=8),
        _engine("consumer", "d-pp1", layers=4, block_size=8),
        [0, 1, 2],
        [5, 4, 3],
    ),
}


def _tp2_pair(name: str, follower_check_s: float) -> Case:
    """TP 2 -> TP 2 whose consumer's following ranks check their expectations with the service that often."""
    return Case(
        _engine("producer", f"p-{name}", tp=2, block_size=8),
        _engine("consumer", f"d-{name}", tp=2, block_size=8, follower_check_s=follower_check_s),
        [6, 7, 8],
        [2, 3],
    )


FOLLOWERS = {"late_follower": _tp2_pair("late", 3600.0), "checking_follower": _tp2_pair("checking", 0.2)}


def _checked(case: Case) -> Case:
    """`case` with end-to-end integrity on both engines: each producer rank writes only some of a consumer rank's
    bytes (heads, re-blocked tokens or layers), so it sends scoped digests (data-plane version 4)."""
    return dataclasses.replace(
        case,
        producer=dataclasses.replace(case.producer, integrity=True),
        consumer=dataclasses.replace(case.consumer, integrity=True),
    )


CHECKED = {
    f"checked_{name}": _checked(CASES[name])
    for name in ("tp4_to_tp1", "tp1_to_tp4_nhd", "blocks_16_to_32", "pp2_to_tp1")
}


@pytest.fixture
def engines(request: pytest.FixtureRequest, server: TestServer) -> Iterator[tuple[Case, EngineProcess, EngineProcess]]:
    case: Case = {**CASES, **FOLLOWERS, **CHECKED}[request.param]
    case = dataclasses.replace(
        case,
        producer=dataclasses.replace(case.producer, address=server.address),
        consumer=dataclasses.replace(case.consumer, address=server.address),
    )
    producer = EngineProcess(case.producer)
    try:
        consumer = EngineProcess(case.consumer)
        try:
            yield case, producer, consumer
        finally:
            consumer.close()
    finally:
        producer.close()


def assert_no_live_transfer(server: TestServer, *engine_ids: str, timeout: float = 15.0) -> None:
    """Every transfer of the engines ends (a committed one once the consumer released it: rank 0 does that after
    its results, which a notification may bring before the commit)."""
    deadline = time.monotonic() + timeout
    with RendezvousClient(server.address) as client:
        for engine_id in engine_ids:
            while live := [t for t in client.iter_transfers(engine_id) if not t.state.terminal]:
                assert time.monotonic() < deadline, f"{engine_id} has live transfers: {live}"
                time.sleep(0.05)


@pytest.mark.parametrize("engines", list(CASES) + list(CHECKED), indirect=True)
def test_every_rank_writes_its_share_byte_exact(
    engines: tuple[Case, EngineProcess, EngineProcess], server: TestServer
) -> None:
    case, producer, consumer = engines
    tid, seed = transfer_id("ranks"), 1234
    prompt = case.prompt or len(case.src) * case.producer.block_size
    target = case.target or len(case.dst) * case.consumer.block_size
    producer.call("fill", seed, case.src)
    assert consumer.call("register", tid, case.dst, case.target) == "TARGETED"
    assert producer.call("claim", tid) == "MATCHED"
    producer.call("ready", tid, case.src, prompt)
    assert [r[1:4] for r in consumer.all_results(tid)] == [
        (True, tuple(case.dst), AbortReason.UNSPECIFIED)
    ] * case.consumer.ranks
    producer.all_freed(tid)
    assert [r[1:3] for r in producer.all_reports(tid)] == [(True, None)] * case.producer.ranks
    memory = consumer.call("memory")
    want = expected(case.producer, case.consumer, seed, len(case.src), case.dst, prompt, target)
    for rank, (got_regions, want_regions) in enumerate(zip(memory, want, strict=True)):
        for region, (got, w) in enumerate(zip(got_regions, want_regions, strict=True)):
            np.testing.assert_array_equal(got, w, err_msg=f"consumer rank {rank} region {region}")
    assert_no_live_transfer(server, case.producer.engine_id, case.consumer.engine_id)


@pytest.mark.parametrize("engines", ["tp2_to_tp2"], indirect=True)
def test_one_rank_failing_aborts_the_transfer_and_frees_the_blocks_once_no_write_can_land(
    engines: tuple[Case, EngineProcess, EngineProcess], server: TestServer
) -> None:
    case, producer, consumer = engines
    tid, seed, dst = transfer_id("rank-fails"), 99, case.dst
    prompt = len(case.src) * case.producer.block_size
    producer.call("fill", seed, case.src)
    producer.call("hold", 0)  # rank 0 lags: it has not even seen the assignment when rank 1 fails
    assert consumer.call("register", tid, dst) == "TARGETED"
    assert producer.call("claim", tid) == "MATCHED"
    producer.call("ready", tid, case.src, prompt, [0])
    producer.call("ready", tid, case.src[:1], prompt, [1])  # too few source blocks: rank 1 cannot write
    failed = producer.expect(lambda e: e[:3] == ("report", 1, tid))
    assert failed[4] is False and "source blocks" in failed[5]

    with RendezvousClient(server.address) as client:
        info = client.get_transfer(tid)
        assert info.state is TransferState.ABORTED and info.abort_reason.name == "TRANSFER_FAILED"
        assert info.revoking_generation == 1  # rank 0 may still write: the consumer's blocks stay fenced
        assert not [e for e in consumer.pending() if e[0] == "result"]
        producer.call("release", 0)
        results = consumer.all_results(tid)
        freed = producer.all_freed(tid)
        assert [r[1:4] for r in results] == [(False, tuple(dst), AbortReason.TRANSFER_FAILED)] * case.consumer.ranks
        # No result before rank 0 stopped (its source is free), however long it held: the results' times say so.
        assert min(r[4] for r in results) >= freed[0]
        assert client.get_transfer(tid).revoking_generation == 0

    memory = consumer.call("memory")
    want = expected(case.producer, case.consumer, seed, len(case.src), dst, prompt, len(dst) * case.consumer.block_size)
    untouched = expected(case.producer, case.consumer, seed, len(case.src), [], prompt, 0)
    for got, w, blank in zip(memory[0], want[0], untouched[0], strict=True):  # rank 0's share whole or not at all
        assert np.array_equal(got, w) or np.array_equal(got, blank)
    for got, blank in zip(memory[1], untouched[1], strict=True):  # nothing from the rank that failed
        np.testing.assert_array_equal(got, blank)
    assert_no_live_transfer(server, case.producer.engine_id, case.consumer.engine_id)
    for before, after in zip(memory, consumer.call("memory"), strict=True):  # and nothing landed since
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("engines", ["late_follower"], indirect=True)
def test_a_following_rank_that_expects_a_transfer_after_its_commit_reports_it_at_once(
    engines: tuple[Case, EngineProcess, EngineProcess], server: TestServer
) -> None:
    """Consumer rank 1's worker lags: the transfer commits (and rank 1 hears so) before rank 1 expects it. Its
    expectation ends at once with ok, not after its next check with the service (an hour away here)."""
    case, producer, consumer = engines
    tid, seed = transfer_id("late-follower"), 7
    prompt = len(case.src) * case.producer.block_size
    producer.call("fill", seed, case.src)
    assert consumer.call("register", tid, case.dst, 0, False) == "TARGETED"  # rank 0 only
    assert producer.call("claim", tid) == "MATCHED"
    producer.call("ready", tid, case.src, prompt)
    assert consumer.expect(lambda e: e[:3] == ("result", 0, tid))[4] is True
    deadline = time.monotonic() + 15
    while "TRANSFER_COMMITTED" not in consumer.call("events_of", 1, tid):
        assert time.monotonic() < deadline, "rank 1 never heard of the commit"
        time.sleep(0.05)
    consumer.call("follow", tid, case.dst)
    rank1 = consumer.expect(lambda e: e[:3] == ("result", 1, tid), 15)
    assert (rank1[4], rank1[5]) == (True, tuple(case.dst))
    memory = consumer.call("memory")
    target = len(case.dst) * case.consumer.block_size
    want = expected(case.producer, case.consumer, seed, len(case.src), case.dst, prompt, target)
    for got, w in zip(memory[1], want[1], strict=True):
        np.testing.assert_array_equal(got, w)
    assert_no_live_transfer(server, case.producer.engine_id, case.consumer.engine_id)


@pytest.mark.parametrize("engines", ["checking_follower"], indirect=True)
def test_a_following_rank_gives_up_a_transfer_the_service_does_not_have(
    engines: tuple[Case, EngineProcess, EngineProcess], server: TestServer
) -> None:
    """Rank 1 expects a transfer whose registration by rank 0 never happened (or failed): its next check with the
    service ends the expectation as LOST instead of waiting forever."""
    case, _, consumer = engines
    tid = transfer_id("never-registered")
    consumer.call("follow", tid, case.dst)
    result = consumer.expect(lambda e: e[:3] == ("result", 1, tid), 15)
    assert (result[4], result[5]) == (False, tuple(case.dst)) and result[6] is AgentReason.LOST
