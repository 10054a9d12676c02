"""Prometheus histograms of the data plane, kept in the process of the engine rank whose agent measures them.

- `kv_rendezvous_write_seconds{rank, outcome}`: a producer rank, from posting a generation's NIXL WRITEs to the
  last one's completion (outcome `ok` or `failed`).
- `kv_rendezvous_arrival_to_result_seconds{rank, via}`: a consumer rank, from a transfer's arrival to its
  `TransferResult` reaching the engine; `via` says how it arrived: `notification` (NIXL, taken when the receiver
  thread polled it), `commit` (the TRANSFER_COMMITTED event) or `read` (a pull-mode READ finished; its result
  waits for the service to take the READ's report, a CompleteTransfers round trip).

Labels stay bounded (a rank, a word): never a transfer id. One set per registry: the agents of several ranks
in one process share it. Histograms are thread-safe, so the writer thread observes directly.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

__all__ = ["ARRIVAL_TO_RESULT_SECONDS", "WRITE_SECONDS", "DataPlaneMetrics"]

WRITE_SECONDS = "kv_rendezvous_write_seconds"
ARRIVAL_TO_RESULT_SECONDS = "kv_rendezvous_arrival_to_result_seconds"
_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

_lock = threading.Lock()
_registered: weakref.WeakKeyDictionary[CollectorRegistry, DataPlaneMetrics] = weakref.WeakKeyDictionary()


class DataPlaneMetrics:
    """The data-plane histograms of one registry; `of(registry)` finds or makes them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        """Register the histograms in `registry` (once per registry: use `of`)."""
        self.write_seconds = Histogram(
            WRITE_SECONDS,
            "Producer rank: from posting a generation's NIXL WRITEs to their completion",
            ["rank", "outcome"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.arrival_to_result_seconds = Histogram(
            ARRIVAL_TO_RESULT_SECONDS,
            "Consumer rank: from a transfer's arrival (notification, commit event, finished READ) to its result",
            ["rank", "via"],
            buckets=_BUCKETS,
            registry=registry,
        )

    @classmethod
    def of(cls, registry: CollectorRegistry | None = None) -> DataPlaneMetrics:
        """The histograms registered in `registry` (default: prometheus_client's global `REGISTRY`)."""
        registry = REGISTRY if registry is None else registry
        with _lock:
            metrics = _registered.get(registry)
            if metrics is None:
                metrics = _registered[registry] = cls(registry)
            return metrics

    def observe_write(self, rank: int, seconds: float, ok: bool) -> None:
        """A producer rank's generation was written (or failed) `seconds` after its WRITEs were posted."""
        self.write_seconds.labels(str(rank), "ok" if ok else "failed").observe(seconds)

    def observe_result(self, rank: int, via: str, seconds: float) -> None:
        """A consumer rank told the engine of a transfer `seconds` after it arrived `via` one of the ways above."""
        self.arrival_to_result_seconds.labels(str(rank), via).observe(seconds)
