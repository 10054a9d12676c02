"""Prometheus metrics: RPCs by method and status, live state, aborts by reason, phase histograms.

Each server owns a registry, so several servers in one process (tests) do not collide.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rendezvous.core import budget, phases
from rendezvous.core.budget import Usage
from rendezvous.core.limits import Limits
from rendezvous.core.model import LIVE_STATES, State, Transfer
from rendezvous.store.base import StoreCounts

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_MATCH_WAITS = frozenset(("target_to_match", "claim_to_match"))
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


INDEX_BLOCKS = "index_blocks"
"""The budget gauges' name for the blocks the KV index holds (KvIndexService)."""


class Metrics:
    """The server's metrics; also the coordinator's transition observer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rpcs = Counter(
            "kv_rendezvous_rpcs", "RPCs handled, by method and status code", ["method", "code"], registry=r
        )
        self.rpc_seconds = Histogram(
            "kv_rendezvous_rpc_duration_seconds", "RPC handling time", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.items = Counter("kv_rendezvous_batch_items", "Items in batched mutating RPCs", ["method"], registry=r)
        self.live_engines = Gauge("kv_rendezvous_live_engines", "Engines holding a lease", registry=r)
        self.live_transfers = Gauge("kv_rendezvous_live_transfers", "Live transfers by state", ["state"], registry=r)
        self.watchers = Gauge("kv_rendezvous_watchers", "Open Watch streams on this replica", registry=r)
        self.budget_used = Gauge(
            "kv_rendezvous_budget_used",
            "Memory budget in use, server-wide",
            ["budget"],
            registry=r,
        )
        self.budget_limit = Gauge(
            "kv_rendezvous_budget_limit", "Memory budget limit, server-wide", ["budget"], registry=r
        )
        self.events_sent = Counter("kv_rendezvous_events_sent", "Events written to Watch streams", registry=r)
        self.resyncs = Counter("kv_rendezvous_watch_resyncs", "Watchers told to resync", registry=r)
        self.watch_buffer_bytes = Gauge(
            "kv_rendezvous_watch_buffer_bytes", "Bytes of Watch responses their readers have not taken", registry=r
        )
        self.watch_dropped = Counter(
            "kv_rendezvous_watch_dropped",
            "Watch streams dropped for a reader too slow (watch_buffer_bytes)",
            registry=r,
        )
        self.committed = Counter("kv_rendezvous_transfers_committed", "Transfers whose bytes arrived", registry=r)
        self.written_parts = Counter(
            "kv_rendezvous_written_parts",
            "Parts of progressive writes in accepted CompleteTransfers reports",
            registry=r,
        )
        self.aborts = Counter("kv_rendezvous_transfer_aborts", "Aborted transfers by reason", ["reason"], registry=r)
        self.match_wait = Histogram(
            "kv_rendezvous_match_wait_seconds",
            "Time the first half of a transfer waited for the second",
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "kv_rendezvous_transfer_phase_seconds",
            "Duration of each transfer phase, observed once when it ends: " + ", ".join(phases.PHASES),
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self._phases = {name: self.phase.labels(name) for name in phases.PHASES}  # bound once: on every transition
        self.rejected = Counter(
            "kv_rendezvous_rejected_calls",
            "Calls refused before reaching the service (auth, quotas), by reason",
            ["reason"],
            registry=r,
        )
        self.store_up = Gauge("kv_rendezvous_store_up", "1 when the store answers", registry=r)
        self.credits = Counter(
            "kv_rendezvous_credit_items",
            "ReserveCredits and ReleaseCredits items by method and outcome (OK or the error reason)",
            ["method", "outcome"],
            registry=r,
        )
        # Children of the per-call metrics, bound once per label set: every call counts in them.
        self._rpc_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._item_children: dict[str, Counter] = {}
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http[0].server_port)

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self._http is not None:
            self._http[0].shutdown()
            self._http[0].server_close()
            self._http = None

    def rpc_done(self, method: str, code: str, seconds: float) -> None:
        """Count a finished unary call under its method and status code, and observe how long it took."""
        children = self._rpc_children.get((method, code))
        if children is None:
            children = self._rpc_children[(method, code)] = (
                self.rpcs.labels(method, code),
                self.rpc_seconds.labels(method),
            )
        children[0].inc()
        children[1].observe(seconds)

    def batch_items(self, method: str, count: int) -> None:
        """Count the items of a batched call."""
        child = self._item_children.get(method)
        if child is None:
            child = self._item_children[method] = self.items.labels(method)
        child.inc(count)

    def on_transition(self, before: Transfer | None, after: Transfer | None, now: float) -> None:
        """Observe the phases a transfer just completed and count the state it entered."""
        if after is None:
            return
        was_released = before is not None and before.state == State.RELEASED
        ended = phases.ended(before.times if before else None, was_released, after.times, after.state == State.RELEASED)
        wait = -1.0
        for phase, seconds in ended:
            self._phases[phase].observe(seconds)
            if phase in _MATCH_WAITS and seconds > wait:
                wait = seconds
        if wait >= 0:  # the match just happened: the first half waited for the second this long
            self.match_wait.observe(wait)
        if before is not None and before.state == after.state:
            return
        if after.state == State.COMMITTED:
            self.committed.inc()
        elif after.state == State.ABORTED:
            self.aborts.labels(after.abort_reason.name).inc()

    def update_budget(self, used: Usage, limits: Limits, index_blocks: int) -> None:
        """Refresh the memory-budget gauges (server-wide; per-identity tallies are not exported), the KV index's
        blocks (`index_blocks`, bounded by max_index_blocks_total) among them."""
        for name, value, limit in (
            (budget.ENGINES, used.engines, limits.max_engines),
            (budget.LIVE_BLOCKS, used.blocks, limits.max_live_blocks),
            (budget.AGENT_METADATA_BYTES, used.metadata_bytes, limits.max_agent_metadata_bytes_total),
            (INDEX_BLOCKS, index_blocks, limits.max_index_blocks_total),
        ):
            self.budget_used.labels(name).set(value)
            self.budget_limit.labels(name).set(limit)

    def update_counts(self, counts: StoreCounts) -> None:
        """Refresh the live-state gauges."""
        self.live_engines.set(counts.live_engines)
        for state in LIVE_STATES:
            self.live_transfers.labels(state.name).set(counts.transfers_by_state.get(state, 0))
