"""bench_vllm's split of a request's TTFT into phases from its transfer's record, and its overhead over plain."""

from __future__ import annotations

import pytest
from vllm_phases import PHASES, median_ms, overhead_ms, phases, pull_phases

from rendezvous.clients import TransferTimes


def row(*seconds: float) -> dict[str, float]:
    return dict(zip(PHASES, seconds, strict=True))


def test_a_request_splits_at_its_transfers_moments() -> None:
    times = TransferTimes(target_time=100.010, claim_time=100.004, match_time=100.010, commit_time=100.050)
    split = phases(100.0, 100.065, times)
    assert split == pytest.approx(row(0.010, 0.004, 0.010, 0.040, 0.015))
    assert split is not None and split["to_match"] + split["match_to_commit"] + split["commit_to_first_token"] == (
        pytest.approx(0.065)
    )


@pytest.mark.parametrize("missing", ["target_time", "claim_time", "match_time", "commit_time"])
def test_a_transfer_that_never_got_there_has_no_split(missing: str) -> None:
    moments = {"target_time": 1.0, "claim_time": 1.0, "match_time": 1.0, "commit_time": 2.0, missing: 0.0}
    assert phases(0.5, 3.0, TransferTimes(**moments)) is None


def test_medians_are_per_phase_in_milliseconds() -> None:
    rows = [
        row(0.001, 0.002, 0.002, 0.010, 0.1),
        row(0.003, 0.004, 0.004, 0.030, 0.3),
        row(0.002, 0.009, 0.009, 0.020, 0.2),
    ]
    assert median_ms(rows) == pytest.approx(row(2.0, 4.0, 4.0, 20.0, 200.0))
    assert median_ms([]) == {}


def test_overhead_is_each_modes_ttft_minus_plains() -> None:
    summaries = {
        "plain": {"ttft_p50_ms": 40.0, "ttft_mean_ms": 45.0},
        "ours": {"ttft_p50_ms": 65.0, "ttft_mean_ms": 80.0},
        "pull": {"ttft_p50_ms": 140.0},
    }
    assert overhead_ms(summaries) == {"ours": {"ttft_p50": 25.0, "ttft_mean": 35.0}, "pull": {"ttft_p50": 100.0}}
    assert overhead_ms({"ours": {"ttft_p50_ms": 1.0}}) == {}


def test_a_pull_request_splits_at_its_prefill_legs_end() -> None:
    split = pull_phases(prefill_leg=0.030, ttft=0.100)
    assert split == pytest.approx({"prefill_leg": 0.030, "decode_leg": 0.070})
    rows = [pull_phases(0.01, 0.05), pull_phases(0.03, 0.04), pull_phases(0.02, 0.10)]
    assert median_ms(rows) == pytest.approx({"prefill_leg": 20.0, "decode_leg": 40.0})
