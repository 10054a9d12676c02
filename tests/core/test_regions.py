"""Region overlap checks: the sweep finds exactly the overlaps a pairwise comparison finds."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rendezvous.core.model import KvRegion, NixlAgent
from rendezvous.core.regions import check_regions, overlapping_pair, regions_overlap
from rendezvous.protocol.errors import RendezvousError


@st.composite
def region(draw: st.DrawFn) -> KvRegion:
    length = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(1, 4))
    stride = draw(st.sampled_from([length, 8, 16])) if num_blocks > 1 else draw(st.integers(0, 16))
    stride = max(stride, length) if num_blocks > 1 else stride
    return KvRegion(
        base_address=draw(st.integers(0, 96)),
        block_stride_bytes=stride,
        block_length_bytes=length,
        num_blocks=num_blocks,
        device_id=draw(st.integers(0, 1)),
    )


def pairwise(regions: list[KvRegion]) -> bool:
    return any(regions_overlap(a, b) for a, b in itertools.combinations(regions, 2))


# The new region's offset follows the last active one's and meets the first's (a wrap-around).
WRAPPED = [KvRegion(2, 16, 3, 4), KvRegion(10, 16, 4, 4), KvRegion(16, 16, 8, 4)]


@settings(max_examples=400)
@given(st.lists(region(), max_size=12))
@example(WRAPPED)
def test_the_sweep_finds_an_overlap_exactly_when_a_pairwise_comparison_does(regions: list[KvRegion]) -> None:
    pair = overlapping_pair(regions)
    assert (pair is not None) == pairwise(regions)
    if pair is not None:
        i, j = pair
        assert i < j and regions_overlap(regions[i], regions[j])


def interleaved(count: int, stride: int, length: int) -> tuple[KvRegion, ...]:
    """count regions interleaved in one tensor: region r's blocks at offset r * length of each stride."""
    return tuple(KvRegion(r * length, stride, length, num_blocks=4) for r in range(count))


def test_interleaved_views_of_one_tensor_do_not_overlap() -> None:
    assert overlapping_pair(interleaved(64, stride=64 * 8, length=8)) is None


def test_a_region_between_interleaved_views_that_meets_one_overlaps() -> None:
    regions = (*interleaved(64, stride=64 * 8, length=8), KvRegion(8 * 30 + 4, 64 * 8, 8, num_blocks=4))
    assert overlapping_pair(regions) == (30, 64)


def test_the_maximum_number_of_regions_validates() -> None:
    # 16,384 regions, each active across the whole sweep: a pairwise check would compare 134 million pairs.
    check_regions(NixlAgent("a", b"", regions=interleaved(16_384, stride=16_384 * 4, length=4)))
    disjoint = tuple(KvRegion(r * 4096, 1024, 1024, num_blocks=4) for r in range(16_384))
    check_regions(NixlAgent("a", b"", regions=disjoint))


def test_an_overlap_names_both_regions() -> None:
    regions = (KvRegion(0, 16, 8, 4), KvRegion(1000, 16, 8, 4), KvRegion(4, 16, 8, 4))
    with pytest.raises(RendezvousError, match="regions 0 and 2 overlap"):
        check_regions(NixlAgent("a", b"", regions=regions))
