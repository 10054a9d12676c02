"""End-to-end integrity (optional): checksums of what a producer wrote, checked by the consumer before arrival.

With `WriterConfig.integrity` a producer rank computes, for every region, the xxh3-64 digest of the bytes of the
target's blocks it wrote (in the target's block order), and sends the digests with the notification of the write
(`rendezvous.clients.nixl.notifications`, "#<hex>,..."). A consumer rank that gets digests computes the same over its
own regions and takes the transfer as arrived only if every one matches (`ConsumerAgent`); a mismatch fails the
transfer (`AgentReason.CORRUPTED`) and never reaches decode. Digests are sent only into a consumer rank whose
regions pair with the producer's block for block (equal layouts: one writer, every head, equal block sizes), so
both sides hash the same bytes. A generation written in parts (progressive push) is hashed as its parts go
(`RunningDigests`: per region, the prefix of the target's blocks posted so far), and its final write carries the
digests of the whole target; the writer keeps the cells that would complete the target for that final, so the
digests have come by the time the parts tile the target. Memory is read on the host: DRAM regions only
(a GPU would hash on the device).

xxh3 hashes ~7.5 GiB/s per core here against zlib.crc32's ~0.2 (benchmarks/RESULTS.md, "Integrity"), so the
cost per GiB is a few tenths of a second of one core on each side, off the engine's step loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from rendezvous.clients.nixl.regions import BlockIds
from rendezvous.protocol.records import KvRegion

__all__ = ["RunningDigests", "block_digests"]


def block_digests(regions: Sequence[KvRegion], block_ids: BlockIds) -> tuple[int, ...]:
    """Per region, the xxh3-64 digest of blocks `block_ids` (in that order) of host memory the caller keeps
    alive and does not write meanwhile."""
    running = RunningDigests(regions)
    for region in range(len(regions)):
        running.extend(region, block_ids)
    return running.digests()


class RunningDigests:
    """Per region, the xxh3-64 of blocks appended in order (`extend`): after every block of the target went in,
    `digests` equals `block_digests` of them, however they were split."""

    def __init__(self, regions: Sequence[KvRegion]) -> None:
        import xxhash  # the data plane's optional dependency, needed only with integrity on

        self._regions = tuple(regions)
        self._hashes = [xxhash.xxh3_64() for _ in self._regions]

    def extend(self, region: int, block_ids: BlockIds) -> None:
        """Hash the next blocks of region `region` (host memory the caller keeps alive and does not write)."""
        h = self._hashes[region]
        for run in _runs(self._regions[region], [int(b) for b in block_ids]):
            h.update(run)

    def digests(self) -> tuple[int, ...]:
        """Per region, the digest of the blocks hashed so far."""
        return tuple(h.intdigest() for h in self._hashes)


def _runs(region: KvRegion, blocks: list[int]) -> list[memoryview]:
    """The region's bytes of `blocks`, neighbouring blocks of a dense region as one view."""
    length, stride = region.block_length_bytes, region.block_stride_bytes
    views: list[memoryview] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i < len(blocks) and stride == length and blocks[i] == blocks[i - 1] + 1:
            continue
        first, count = blocks[start], i - start
        if first < 0 or first + count > region.num_blocks:
            raise ValueError(f"block {first + count - 1} is outside a region of {region.num_blocks} blocks")
        size = length if count == 1 else stride * (count - 1) + length
        views.append(memoryview((ctypes.c_char * size).from_address(region.base_address + first * stride)).cast("B"))
        start = i
    return views
