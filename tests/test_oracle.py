"""The chaos oracle (tests/oracle.py) reports each kind of bad assignment and passes a good one: registrations
come from a real in-process server, assignments are made up around them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from rendezvous.clients import AsyncRendezvousClient, EngineRole, Registration, TargetSpec
from rendezvous.clients.testing import start_test_server
from tests.factories import sdk_engine
from tests.oracle import CRASH_SLACK_S, Assignment, Ledger

LEASE_TTL = 5.0


@pytest.fixture
async def client() -> AsyncIterator[AsyncRendezvousClient]:
    async with start_test_server() as server, AsyncRendezvousClient(server.address) as c:
        yield c


async def register(client: AsyncRendezvousClient, ledger: Ledger, answered_at: float) -> Registration:
    registration = await client.register_engine(sdk_engine("d0", EngineRole.CONSUMER))
    ledger.registered_engine(registration, answered_at)
    return registration


def assigned(incarnation: int, made_at: float, record_incarnation: int | None = None) -> Assignment:
    """TRANSFER_ASSIGNED of t1 generation 1 to p0, naming consumer d0's incarnation as its peer."""
    record = incarnation if record_incarnation is None else record_incarnation
    return Assignment("t1", 1, "p0", 1, "d0", incarnation, record, made_at, made_at, 1)


def problems(ledger: Ledger) -> list[str]:
    return [p for violation in ledger.assignment_violations() for p in violation["problems"]]


async def test_an_assignment_to_the_live_incarnation_that_registered_the_target_passes(
    client: AsyncRendezvousClient,
) -> None:
    ledger = Ledger()
    d0 = (await register(client, ledger, time.time())).engine.incarnation
    ledger.registering_targets(d0, [TargetSpec(transfer_id="t1", block_ids=(1, 2), generation=1)])
    ledger.assignments.append(assigned(d0, time.time()))
    assert problems(ledger) == []


async def test_an_assignment_naming_an_incarnation_that_never_registered_the_target_is_reported(
    client: AsyncRendezvousClient,
) -> None:
    ledger = Ledger()
    d0 = (await register(client, ledger, time.time())).engine.incarnation
    ledger.registering_targets(d0, [TargetSpec(transfer_id="t1", block_ids=(1, 2), generation=2)])
    ledger.assignments.append(assigned(d0, time.time()))
    assert problems(ledger) == [f"peer incarnation {d0} never sent RegisterTargets g1 (sent by [])"]


async def test_an_assignment_whose_record_names_another_incarnation_is_reported(
    client: AsyncRendezvousClient,
) -> None:
    ledger = Ledger()
    d0 = (await register(client, ledger, time.time())).engine.incarnation
    ledger.registering_targets(d0, [TargetSpec(transfer_id="t1", block_ids=(1, 2), generation=1)])
    ledger.assignments.append(assigned(d0, time.time(), record_incarnation=d0 + 1))
    assert problems(ledger) == [f"the transfer names consumer incarnation {d0 + 1}, the peer is {d0}"]


async def test_an_assignment_made_after_the_next_incarnations_answer_is_reported(
    client: AsyncRendezvousClient,
) -> None:
    ledger = Ledger()
    first = (await register(client, ledger, 1000.0)).engine.incarnation
    ledger.registering_targets(first, [TargetSpec(transfer_id="t1", block_ids=(1, 2), generation=1)])
    second = (await register(client, ledger, 2000.0)).engine.incarnation
    assert second > first
    ledger.assignments += [assigned(first, 1999.0), assigned(first, 2000.5)]
    assert problems(ledger) == [
        f"assigned 0.500 s after incarnation {first} ended (replaced by {second} (its answer arrived))"
    ]


async def test_a_crash_ends_an_incarnation_one_lease_and_some_slack_later(client: AsyncRendezvousClient) -> None:
    ledger = Ledger()
    d0 = (await register(client, ledger, time.time())).engine.incarnation
    ledger.registering_targets(d0, [TargetSpec(transfer_id="t1", block_ids=(1, 2), generation=1)])
    crashed = time.time()
    ledger.crashed("d0", d0, graceful=False, lease_ttl=LEASE_TTL)
    within = assigned(d0, crashed + LEASE_TTL)  # the lease had not lapsed yet: fine
    late = replace(within, made_at=crashed + LEASE_TTL + CRASH_SLACK_S + 60)
    ledger.assignments += [within, late]
    [problem] = problems(ledger)
    assert problem.startswith("assigned ") and problem.endswith(
        f"after incarnation {d0} ended (crashed (bound: crash + lease TTL))"
    )
