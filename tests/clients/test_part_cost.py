"""Adaptive granularity's cost model (`PartCost`): the fixed cost of a part (what grouping saves) is told apart
from the cost per byte (what it does not), and a part is worth posting once the compute it carries is at least
`ratio` times the fixed cost. Costs are given, not timed."""

from __future__ import annotations

import pytest

from rendezvous.clients.nixl.granularity import PartCost

US = 1e-6
MIB = 1 << 20


def fitted(*observations: tuple[float, int, int]) -> PartCost:
    cost = PartCost()
    for seconds, parts, num_bytes in observations:
        cost.observe(seconds, parts, num_bytes)
    return cost


def test_before_any_part_is_measured_every_part_pays() -> None:
    cost = PartCost()
    assert cost.fixed == 0.0 and cost.per_byte == 0.0
    assert cost.pays(0.0, 8.0)


def test_parts_of_different_sizes_separate_the_fixed_cost_from_the_copy() -> None:
    # 100 us a part plus 200 us per MiB (a copy at ~5 GB/s): one layer (0.5 MiB), groups of 4 and 8 layers.
    def seconds(mib: float) -> float:
        return 100 * US + 200 * US * mib

    cost = fitted(*((seconds(mib), 1, int(mib * MIB)) for mib in (0.5, 2, 4, 0.5, 4, 2)))
    assert cost.fixed == pytest.approx(100 * US, rel=1e-6)
    assert cost.per_byte == pytest.approx(200 * US / MIB, rel=1e-6)


def test_a_big_part_does_not_look_costly_to_group() -> None:
    # The earlier measure (the whole cost of a part) made an 8 MiB layer cost 1.7 ms "per part", so a ratio of 8
    # held back 14 ms of compute: nearly every part of an 8k-token prompt. Its fixed cost is 100 us.
    cost = fitted((100 * US + 200 * US * 0.5, 1, MIB // 2), (100 * US + 200 * US * 8, 1, 8 * MIB))
    cost.observe(100 * US + 200 * US * 8, 1, 8 * MIB)
    assert cost.fixed == pytest.approx(100 * US, rel=1e-6)
    assert cost.pays(2.56e-3, 8.0)  # one layer of an 8k-token prompt at 20 us a token pays for its part


def test_a_turn_of_several_parts_counts_per_part() -> None:
    one = fitted((300 * US, 1, MIB), (500 * US, 1, 2 * MIB))
    three = fitted((900 * US, 3, 3 * MIB), (1500 * US, 3, 6 * MIB))
    assert three.fixed == pytest.approx(one.fixed) and three.per_byte == pytest.approx(one.per_byte)


def test_parts_all_of_one_size_count_as_fixed_until_sizes_differ() -> None:
    cost = fitted((300 * US, 1, MIB), (300 * US, 1, MIB))
    assert cost.fixed == pytest.approx(300 * US) and cost.per_byte == 0.0  # cannot tell: groups (safe side)
    cost.observe(500 * US, 1, 2 * MIB)
    assert cost.fixed == pytest.approx(100 * US, rel=1e-6)


def test_the_per_byte_cost_fitted_stays_while_sizes_do_not_differ() -> None:
    cost = fitted((300 * US, 1, MIB), (500 * US, 1, 2 * MIB))
    for _ in range(200):  # then one size only: the spread decays away
        cost.observe(500 * US, 1, 2 * MIB)
    for _ in range(200):  # slower parts of that size: the fixed cost rises, the per-byte cost stays
        cost.observe(600 * US, 1, 2 * MIB)
    assert cost.per_byte == pytest.approx(200 * US / MIB, rel=1e-6)
    assert cost.fixed == pytest.approx(200 * US, rel=1e-3)


def test_recent_parts_count_most() -> None:
    cost = fitted((300 * US, 1, MIB), (500 * US, 1, 2 * MIB))
    for _ in range(100):  # the fixed cost drops to 20 us (say, the writer's Python got cheaper)
        cost.observe(220 * US, 1, MIB)
        cost.observe(420 * US, 1, 2 * MIB)
    assert cost.fixed == pytest.approx(20 * US, abs=1 * US)


@pytest.mark.parametrize(
    ("computed_s", "ratio", "pays"),
    [
        (800 * US, 8.0, True),  # exactly 8 x the fixed 100 us
        (799 * US, 8.0, False),
        (0.0, 0.0, True),  # 0: every part
        (10.0, 8.0, True),
    ],
)
def test_a_part_pays_once_it_carries_ratio_times_the_fixed_cost(computed_s: float, ratio: float, pays: bool) -> None:
    cost = fitted((300 * US, 1, MIB), (500 * US, 1, 2 * MIB))
    assert cost.pays(computed_s, ratio) is pays


def test_a_cost_never_goes_negative_or_above_what_was_measured() -> None:
    cost = fitted((100 * US, 1, MIB), (1000 * US, 1, 2 * MIB))  # steeper than the small part explains
    assert cost.fixed == 0.0
    cost = fitted((1000 * US, 1, MIB), (100 * US, 1, 2 * MIB))  # bigger parts cheaper: noise, not a copy
    assert cost.per_byte == 0.0 and 100 * US < cost.fixed < 1000 * US  # all of it fixed, the recent part most


def test_decay_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="decay"):
        PartCost(1.0)
