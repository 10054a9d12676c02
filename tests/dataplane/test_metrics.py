"""The agents' data-plane histograms over real NIXL transfers between processes, read from each worker's
default Prometheus registry (where an agent given no registry keeps them, as in a vLLM worker)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from rendezvous.clients.nixl.metrics import ARRIVAL_TO_RESULT_SECONDS, WRITE_SECONDS, DataPlaneMetrics
from tests.dataplane.checks import transfer_id
from tests.dataplane.worker import WorkerProcess

pytestmark = pytest.mark.timeout(30)

WRITES_OK = {"rank": "0", "outcome": "ok"}


def arrivals(consumer: WorkerProcess, via: str) -> float:
    return float(consumer.call("metric", f"{ARRIVAL_TO_RESULT_SECONDS}_count", {"rank": "0", "via": via}))


def test_each_push_is_timed_once_by_the_producers_write_and_the_consumers_arrival_to_result(
    producer: WorkerProcess, consumer: WorkerProcess
) -> None:
    writes, write_seconds = (producer.call("metric", f"{WRITE_SECONDS}_{s}", WRITES_OK) for s in ("count", "sum"))
    pushed, pulled = arrivals(consumer, "notification") + arrivals(consumer, "commit"), arrivals(consumer, "read")
    ids = [transfer_id("timed") for _ in range(3)]
    for i, tid in enumerate(ids):
        consumer.call("register", tid, [i, i + 10])
        producer.call("claim", tid)
        producer.call("ready", tid, [i + 20, i + 30])
    for tid in ids:
        assert consumer.result(tid)[3] is True
        assert producer.report(tid)[3] is True  # the write was observed before the writer reported it

    assert producer.call("metric", f"{WRITE_SECONDS}_count", WRITES_OK) == writes + 3
    assert 0 < producer.call("metric", f"{WRITE_SECONDS}_sum", WRITES_OK) - write_seconds < 3 * 5
    assert arrivals(consumer, "notification") + arrivals(consumer, "commit") == pushed + 3
    assert arrivals(consumer, "read") == pulled


def test_a_pull_is_timed_from_its_finished_read(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    before = arrivals(consumer, "read")
    writes = producer.call("metric", f"{WRITE_SECONDS}_count", WRITES_OK)
    tid = transfer_id("timed-pull")
    assert consumer.call("register", tid, [3, 4], 1, True) == "TARGETED"
    producer.call("ready", tid, [5, 6], True)
    assert consumer.result(tid)[3] is True
    assert arrivals(consumer, "read") == before + 1
    assert producer.call("metric", f"{WRITE_SECONDS}_count", WRITES_OK) == writes  # the consumer READ; no WRITE


def test_the_histograms_are_made_once_per_registry() -> None:
    registry = CollectorRegistry()
    metrics = DataPlaneMetrics.of(registry)
    assert DataPlaneMetrics.of(registry) is metrics
    assert DataPlaneMetrics.of(CollectorRegistry()) is not metrics
    metrics.observe_write(1, 0.25, ok=False)
    assert registry.get_sample_value(f"{WRITE_SECONDS}_sum", {"rank": "1", "outcome": "failed"}) == 0.25
