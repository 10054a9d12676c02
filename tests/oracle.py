"""The chaos run's oracle: what every engine saw and did, and the checks against it.

`benchmarks/chaos.py` drives engines through crashes, replica kills and Redis restarts; its engines' clients record
here (`Ledger`) each registration they sent and got answered, each incarnation and when it ended at the latest, and
each TRANSFER_ASSIGNED they heard (`Assignment`). `Ledger.assignment_violations` then checks that every assignment
names as its peer a consumer incarnation that sent RegisterTargets for that (transfer, generation), the same one
the transfer record names, and was made before that incarnation ended. Tests own it (tests/test_oracle.py shows
each check failing on a made-up violation); the benchmark imports it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rendezvous.clients import ItemResult, Registration, TargetSpec

CRASH_SLACK_S = 1.0
"""A renewal in flight when an engine crashed may extend its lease by about this much beyond crash + TTL."""


@dataclass
class Incarnation:
    engine_id: str
    incarnation: int
    register_time: float
    epoch: int
    ended_by: float = math.inf  # an upper bound of when it ended (wall clock)
    how: str = ""


@dataclass(frozen=True)
class Assignment:
    transfer_id: str
    generation: int
    producer: str
    producer_incarnation: int
    consumer: str
    peer_incarnation: int
    record_incarnation: int
    made_at: float
    received_at: float
    sequence: int


class Ledger:
    """What every engine saw and did: counts, per-transfer traces, registrations, incarnations, assignments."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.counts: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.abort_reasons: dict[str, str] = {}
        self.reregistrations: Counter[str] = Counter()
        # (transfer, generation) -> consumer incarnations that sent RegisterTargets for it; and those answered OK
        self.registrations: defaultdict[tuple[str, int], set[int]] = defaultdict(set)
        self.registrations_ok: defaultdict[tuple[str, int], set[int]] = defaultdict(set)
        self.incarnations: defaultdict[str, dict[int, Incarnation]] = defaultdict(dict)
        self.assignments: list[Assignment] = []
        self.assigned: dict[str, asyncio.Event] = {}
        self.traces: defaultdict[str, list[str]] = defaultdict(list)
        self.waits: list[float] = []
        self.fenced_waits: list[float] = []
        self.freed: Counter[str] = Counter()
        self.epochs: set[int] = set()
        self.task_errors: list[str] = []
        self.completed: set[str] = set()
        self.completed_at: list[float] = []  # monotonic time of each completed lifecycle
        self.notable: dict[str, str] = {}  # transfer id -> why its trace is worth reading
        self.longest_wait: tuple[float, str] = (0.0, "")

    def note(self, transfer_id: str, why: str) -> None:
        self.notable.setdefault(transfer_id, why)

    def now(self) -> float:
        return time.time() - self.t0

    def trace(self, transfer_id: str, who: str, what: str) -> None:
        self.traces[transfer_id].append(f"{self.now():8.3f} {who}: {what}")

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def aborted(self, transfer_id: str, reason: str) -> None:
        self.abort_reasons.setdefault(transfer_id, reason)

    def assigned_signal(self, transfer_id: str) -> asyncio.Event:
        return self.assigned.setdefault(transfer_id, asyncio.Event())

    # Recorded by the engines' clients

    def registered_engine(self, registration: Registration, answered_at: float) -> None:
        """A new incarnation; the older ones ended by the time its answer arrived.

        Not by its register_time: that is when the server began the registration, and the record it replaces
        is written later (a claim in between legitimately sees the old incarnation alive).
        """
        engine = registration.engine
        self.epochs.add(registration.epoch)
        known = self.incarnations[engine.engine_id]
        for older in known.values():
            if older.incarnation < engine.incarnation and answered_at < older.ended_by:
                older.ended_by, older.how = answered_at, f"replaced by {engine.incarnation} (its answer arrived)"
        known[engine.incarnation] = Incarnation(
            engine.engine_id, engine.incarnation, engine.register_time, registration.epoch
        )

    def registering_targets(self, incarnation: int, targets: Sequence[TargetSpec]) -> None:
        """Sent: the answer may never arrive (a crash) while the server applied it."""
        for spec in targets:
            self.registrations[(spec.transfer_id, spec.generation)].add(incarnation)

    def registered_targets(
        self, engine_id: str, incarnation: int, targets: Sequence[TargetSpec], results: Sequence[ItemResult]
    ) -> None:
        for spec, result in zip(targets, results, strict=False):
            outcome = result.state.name if result.ok else f"error {result.error.reason if result.error else '?'}"
            self.trace(
                spec.transfer_id, f"{engine_id}#{incarnation}", f"RegisterTargets g{spec.generation} -> {outcome}"
            )
            if result.ok:
                self.registrations_ok[(spec.transfer_id, spec.generation)].add(incarnation)

    def crashed(self, engine_id: str, incarnation: int, graceful: bool, lease_ttl: float) -> None:
        inc = self.incarnations[engine_id].get(incarnation)
        if inc is None:
            return
        bound = time.time() if graceful else time.time() + lease_ttl + CRASH_SLACK_S
        if bound < inc.ended_by:
            inc.ended_by, inc.how = bound, "deregistered" if graceful else "crashed (bound: crash + lease TTL)"

    # The checks

    def assignment_violations(self) -> list[dict[str, Any]]:
        found = []
        for a in self.assignments:
            problems = []
            registered = sorted(self.registrations.get((a.transfer_id, a.generation), ()))
            if a.peer_incarnation not in registered:
                problems.append(
                    f"peer incarnation {a.peer_incarnation} never sent RegisterTargets g{a.generation}"
                    f" (sent by {registered})"
                )
            if a.record_incarnation != a.peer_incarnation:
                problems.append(
                    f"the transfer names consumer incarnation {a.record_incarnation}, the peer is {a.peer_incarnation}"
                )
            inc = self.incarnations[a.consumer].get(a.peer_incarnation)
            if inc is not None and a.made_at > inc.ended_by:
                problems.append(
                    f"assigned {a.made_at - inc.ended_by:.3f} s after incarnation {a.peer_incarnation} ended"
                    f" ({inc.how})"
                )
            if problems:
                found.append({**asdict(a), "problems": problems})
        return found
