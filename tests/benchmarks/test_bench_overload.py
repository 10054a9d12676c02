"""bench_overload's pure parts: the CPU lists of --server-cpus and --client-cpus, the pinning they ask for, and
the admitted load with the others' share."""

from __future__ import annotations

import pytest
from bench_overload import Pinning, admitted_in_all, parse_cpus, pinning

FOUR = frozenset(range(4))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("1,3", {1, 3}), ("0-2", {0, 1, 2}), ("0-1, 3", {0, 1, 3}), ("2-2", {2}), ("1,1", {1})],
)
def test_a_cpu_list_is_read_as_taskset_writes_it(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "-1", "1-", "2-1", "0,,1", "1.5", "0-1-2"])
def test_a_malformed_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpus(text)


def test_the_clients_default_to_every_cpu_but_the_servers() -> None:
    assert pinning("0", None, "server", FOUR) == Pinning(frozenset({0}), frozenset({1, 2, 3}), "server")
    assert pinning("0-1", "3", "clients", FOUR) == Pinning(frozenset({0, 1}), frozenset({3}), "clients")


def test_redis_goes_with_the_server_or_the_clients() -> None:
    with_server = pinning("0", "1", "server", FOUR)
    with_clients = pinning("0", "1", "clients", FOUR)
    assert with_server is not None and with_server.redis_cpus == {0}
    assert with_clients is not None and with_clients.redis_cpus == {1}
    assert with_server.describe() == {
        "server_cpus": [0],
        "client_cpus": [1],
        "redis_with": "server",
        "redis_cpus": [0],
        "front_cpus": [1],
    }


def test_no_pinning_without_server_cpus() -> None:
    assert pinning(None, None, "server", FOUR) is None
    with pytest.raises(ValueError, match="needs --server-cpus"):
        pinning(None, "1", "server", FOUR)


@pytest.mark.parametrize(
    ("server", "clients", "redis", "message"),
    [
        ("0-3", None, "server", "no CPU left"),  # nothing left for the clients
        ("0", "0-1", "server", "overlap"),
        ("4", None, "server", "not among"),
        ("0", "5", "server", "not among"),
        ("0", "1", "elsewhere", "server or clients"),
    ],
)
def test_a_pinning_that_cannot_hold_is_refused(server: str, clients: str | None, redis: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pinning(server, clients, redis, FOUR)


def test_the_admitted_load_counts_the_others_share_in_flood_calls() -> None:
    # Capacity 1,000 calls/s, 800 beside the others: the others take 200; 700 admitted is 90% in all.
    assert admitted_in_all(700.0, 1000.0, 800.0) == pytest.approx(0.9)
    assert admitted_in_all(800.0, 1000.0, 800.0) == pytest.approx(1.0)
