"""Limits and Timeouts refuse values no server could run by, as the CLI's flags do (a library user builds them
directly: NaN, a negative or zero limit, disordered lease TTLs started a server that misbehaved later)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rendezvous.core.limits import Limits, Timeouts


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "10"])
def test_a_limit_is_a_whole_number_of_at_least_one(value: Any) -> None:
    with pytest.raises(ValueError, match="max_batch_items"):
        Limits(max_batch_items=value)


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, True, "10"])
def test_a_timeout_is_a_finite_number_of_seconds_above_zero(value: Any) -> None:
    with pytest.raises(ValueError, match="release_timeout"):
        Timeouts(release_timeout=value)


def test_lease_ttls_are_ordered() -> None:
    with pytest.raises(ValueError, match="ordered"):
        Timeouts(default_lease_ttl=0.5)  # below the default minimum, 1 s
    with pytest.raises(ValueError, match="ordered"):
        Timeouts(default_lease_ttl=10, max_lease_ttl=5)
    assert Timeouts(default_lease_ttl=0.5, min_lease_ttl=0.1).default_lease_ttl == 0.5


def test_the_defaults_and_small_test_values_pass() -> None:
    assert Limits() == Limits(**{f: getattr(Limits(), f) for f in Limits.__dataclass_fields__})
    assert Limits(max_events_per_engine=1).max_events_per_engine == 1
    assert Timeouts(tombstone_ttl=0.01).tombstone_ttl == 0.01
