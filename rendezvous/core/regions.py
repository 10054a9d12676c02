"""The KV regions of one NIXL agent: non-empty, and no two share a byte.

Regions are swept in address order per device, so checking n regions costs O(n log n): a peer
that registers the maximum number of regions cannot stall the server with pairwise comparisons.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from rendezvous.core.model import KvRegion, NixlAgent
from rendezvous.protocol.errors import Reason, RendezvousError


def check_regions(agent: NixlAgent) -> None:
    """An agent publishes at least one region; regions are non-empty and no two share a byte.

    Without a region no block id could be checked against the engine's pool. Agents of different
    ranks live in different processes, so only the regions of one agent are compared.
    """
    if not agent.regions:
        raise RendezvousError(Reason.AGENTS_INVALID, f"agent {agent.name} has no KV region", field="regions")
    for region in agent.regions:
        if region.block_length_bytes <= 0 or region.num_blocks <= 0:
            raise RendezvousError(Reason.AGENTS_INVALID, f"agent {agent.name} has an empty region")
        if region.num_blocks > 1 and region.block_stride_bytes < region.block_length_bytes:
            raise RendezvousError(
                Reason.AGENTS_INVALID, f"agent {agent.name} has a region whose blocks overlap (stride < length)"
            )
    pair = overlapping_pair(agent.regions)
    if pair is not None:
        raise RendezvousError(
            Reason.AGENTS_INVALID, f"agent {agent.name}: regions {pair[0]} and {pair[1]} overlap", field="regions"
        )


def overlapping_pair(regions: Sequence[KvRegion]) -> tuple[int, int] | None:
    """The indices (i < j) of two regions that share a byte (`regions_overlap`), or None if none do.

    A sweep by (device, start address) keeps the regions whose span the sweep is inside. Any two
    of them share an address range, so they may only coexist as interleaved views of one tensor:
    all with one stride and many blocks, their blocks at disjoint offsets modulo that stride. A
    new region is then compared with the active ones whose offsets precede and follow its own:
    if it meets any, it meets one of those two.
    """
    order = sorted(range(len(regions)), key=lambda i: (regions[i].device_id, regions[i].base_address))
    ends: list[tuple[int, int]] = []  # (span end, index) of the active regions, a heap
    offsets: list[tuple[int, int]] = []  # (offset modulo the stride, index) of the active regions, sorted
    stride = 0  # of the active regions; 0 while one single-block region is active
    device = None
    for i in order:
        region = regions[i]
        start, end = _span(region)
        if region.device_id != device:
            device, ends, offsets = region.device_id, [], []
        while ends and ends[0][0] <= start:
            _, gone = heapq.heappop(ends)
            if stride:
                del offsets[bisect.bisect_left(offsets, (regions[gone].base_address % stride, gone))]
        own_stride = region.block_stride_bytes if region.num_blocks > 1 else 0
        if ends:
            if not stride or own_stride != stride:
                return _ordered(i, ends[0][1])
            offset = region.base_address % stride
            at = bisect.bisect_right(offsets, (offset, len(regions)))
            for _, j in (offsets[at - 1], offsets[at % len(offsets)]):
                if regions_overlap(region, regions[j]):
                    return _ordered(i, j)
        stride = own_stride
        heapq.heappush(ends, (end, i))
        if stride:
            bisect.insort(offsets, (region.base_address % stride, i))
    return None


def _ordered(i: int, j: int) -> tuple[int, int]:
    return (i, j) if i < j else (j, i)


def _span(r: KvRegion) -> tuple[int, int]:
    return r.base_address, r.base_address + (r.num_blocks - 1) * r.block_stride_bytes + r.block_length_bytes


def regions_overlap(a: KvRegion, b: KvRegion) -> bool:
    """Whether two regions share a byte. Interleaved regions (K and V views of one [blocks, 2, ...]
    tensor: same stride, offset by a block length) do not; regions of different strides whose spans
    meet are refused, as no engine lays out its cache that way."""
    if a.device_id != b.device_id:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.block_stride_bytes != b.block_stride_bytes or a.num_blocks == 1 or b.num_blocks == 1:
        return True
    if b0 < a0:
        a, b = b, a
    offset = (b.base_address - a.base_address) % a.block_stride_bytes
    return offset < a.block_length_bytes or a.block_stride_bytes - offset < b.block_length_bytes
