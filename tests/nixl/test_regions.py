"""Regions, the descriptor table, notifications and poll backoff: pure logic, no NIXL agent."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rendezvous.clients.nixl import (
    BlockRangeError,
    DescriptorTable,
    KvRegion,
    LayoutMismatchError,
    MemoryKind,
    TransferNotification,
    encode_notification,
    memory_kind_of,
    parse_notification,
    regions_from_tensors,
    registration_spans,
)
from rendezvous.clients.nixl.polling import Backoff, PollConfig

REGIONS = [KvRegion(1 << 20, 256, 200, 5), KvRegion(2 << 20, 64, 64, 3, device_id=1), KvRegion(3 << 20, 512, 512, 4)]


def test_descriptors_enumerate_every_block_of_every_region_region_major() -> None:
    rows = DescriptorTable(REGIONS).descriptors()

    expected = [
        (r.base_address + b * r.block_stride_bytes, r.block_length_bytes, r.device_id)
        for r in REGIONS
        for b in range(r.num_blocks)
    ]
    assert rows.dtype == np.uint64 and rows.tolist() == [list(e) for e in expected]


def test_indices_address_each_block_in_every_region() -> None:
    table = DescriptorTable(REGIONS)
    rows = table.descriptors()
    ids = [2, 0, 1]

    idx = table.indices(ids)

    assert idx.dtype == np.int32 and len(idx) == len(REGIONS) * len(ids)
    expected = [(r.base_address + b * r.block_stride_bytes) for r in REGIONS for b in ids]
    assert rows[idx, 0].tolist() == expected


def test_indices_of_a_range_of_regions_address_those_regions_only() -> None:
    table = DescriptorTable(REGIONS)
    rows = table.descriptors()

    idx = table.indices([2, 0], range(1, 3))

    expected = [(r.base_address + b * r.block_stride_bytes) for r in REGIONS[1:] for b in (2, 0)]
    assert rows[idx, 0].tolist() == expected
    for regions in (range(2, 4), range(0, 3, 2)):
        with pytest.raises(BlockRangeError, match="regions"):
            table.indices([0], regions)


def test_valid_block_ids_are_those_of_the_smallest_region() -> None:
    table = DescriptorTable(REGIONS)
    assert table.num_blocks == 3
    assert table.check_block_ids(np.array([0, 2], dtype=np.uint32)).tolist() == [0, 2]
    assert table.check_block_ids([]).tolist() == []
    bad: list[Any] = [[3], [-1], [[0, 1]], [1.0]]
    for ids in bad:
        with pytest.raises(BlockRangeError):
            table.indices(ids)


def test_tables_pair_when_region_count_and_block_lengths_agree() -> None:
    table = DescriptorTable(REGIONS)
    other = DescriptorTable([KvRegion(9 << 20, r.block_length_bytes, r.block_length_bytes, 7) for r in REGIONS])
    table.check_pairs_with(other)
    with pytest.raises(LayoutMismatchError, match="regions"):
        table.check_pairs_with(DescriptorTable(REGIONS[:2]))
    with pytest.raises(LayoutMismatchError, match="region 1"):
        table.check_pairs_with(DescriptorTable([REGIONS[0], REGIONS[0], REGIONS[2]]))


@pytest.mark.parametrize(
    "region",
    [KvRegion(0, 64, 64, 4), KvRegion(4096, 64, 64, 0), KvRegion(4096, 64, 0, 4), KvRegion(4096, 32, 64, 4)],
    ids=["no-address", "no-blocks", "empty-blocks", "overlapping-blocks"],
)
def test_invalid_regions_are_rejected(region: KvRegion) -> None:
    with pytest.raises(ValueError, match="region 0"):
        DescriptorTable([region])


def test_registration_merges_overlapping_spans_per_device() -> None:
    interleaved = [KvRegion(1000, 200, 100, 10), KvRegion(1100, 200, 100, 10)]  # K and V alternate
    elsewhere = [KvRegion(50_000, 10, 10, 2), KvRegion(1000, 10, 10, 2, device_id=1)]

    spans = registration_spans(interleaved + elsewhere)

    assert spans.tolist() == [[1000, 2000, 0], [50_000, 20, 0], [1000, 20, 1]]


def test_regions_from_tensors_follow_the_block_dimension() -> None:
    cache = torch.zeros(6, 2, 4, 8, dtype=torch.float16)  # [blocks, K/V, heads, head size]
    plain = torch.zeros(3, 16, dtype=torch.float32)

    k, v, p = regions_from_tensors([cache[:, 0], cache[:, 1], plain])

    assert (k.block_stride_bytes, k.block_length_bytes, k.num_blocks) == (128, 64, 6)
    assert v.base_address == k.base_address + 64
    assert (p.base_address, p.block_stride_bytes, p.block_length_bytes, p.num_blocks) == (plain.data_ptr(), 64, 64, 3)
    assert memory_kind_of([cache, plain]) is MemoryKind.DRAM


def test_regions_from_tensors_need_contiguous_blocks() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        regions_from_tensors([torch.zeros(4, 8, 2)[:, :, 0]])
    with pytest.raises(ValueError, match="block dimension"):
        regions_from_tensors([torch.zeros(())])


@pytest.mark.parametrize(("transfer_id", "generation"), [("t1", 0), ("req:42:x", 7), ("é", 2**64 - 1)])
def test_notifications_round_trip(transfer_id: str, generation: int) -> None:
    payload = encode_notification(transfer_id, generation)
    assert parse_notification("p", payload) == (TransferNotification("p", transfer_id, generation),)


@pytest.mark.parametrize("payload", [b"", b"t1", b":3", b"t1:", b"t1:-1", b"t1:x", b"t1:\xd9\xa3", b"\xff:1"])
def test_malformed_notifications_parse_to_none(payload: bytes) -> None:
    assert parse_notification("p", payload) is None


def test_backoff_doubles_from_the_minimum_to_the_maximum_and_resets() -> None:
    backoff = Backoff(PollConfig(min_wait_s=1e-5, max_wait_s=5e-5))
    assert [backoff.next() for _ in range(4)] == [1e-5, 2e-5, 4e-5, 5e-5]
    backoff.reset()
    assert backoff.wait == 0.0 and backoff.next() == 1e-5
    with pytest.raises(ValueError):
        PollConfig(min_wait_s=0.0)
