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
digests have come by the time the parts tile the target. A consumer that requires digests hashes such a target's
blocks as its parts land too (`LandedDigests`: per region, the prefix of the target's blocks whose every token
landed in the region's layer), so that at arrival only what the last parts carried is left to hash. Memory is read
on the host: DRAM regions only (a GPU would hash on the device).

A producer rank that writes only some of a consumer rank's bytes (hetero TP: some heads; other block sizes: the
target's tokens re-blocked; pipeline stages: some layers' regions) sends scoped digests instead
(`notifications.DigestScope`): per consumer region it writes, the xxh3-64 of the bytes it wrote there in ascending
address order, read from its source in that order (`plan_digests`). The consumer makes the same plan for itself,
its own memory on both sides (`scope_digests`), and hashes it in the same order; the senders' scopes must tile its
regions and heads (`scope_gaps`). Written in parts, a producer rank hashes each consumer region once every cell of
it is posted (`ScopedDigests`), and the final the rest; the consumer hashes them when the target is complete.

xxh3 hashes ~7.5 GiB/s per core here against zlib.crc32's ~0.2 (benchmarks/RESULTS.md, "Integrity"), so the
cost per GiB is a few tenths of a second of one core on each side, off the engine's step loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvous.clients.nixl.notifications import DigestScope
from rendezvous.clients.nixl.plan import RankGeometry, WritePlan, plan_write
from rendezvous.clients.nixl.regions import BlockIds
from rendezvous.protocol.kvmap import RankShape, RankShare, TokenRun
from rendezvous.protocol.records import KvRegion, WrittenPart

__all__ = [
    "HashJob",
    "LandedDigests",
    "RunningDigests",
    "ScopedDigests",
    "block_digests",
    "plan_digests",
    "scope_digests",
    "scope_gaps",
]

HashJob = tuple[int, Sequence[int]]
"""(region, block ids): the next blocks of a region to hash, in the target's order."""


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


class LandedDigests:
    """A consumer rank's digests of a target written in parts, hashed as the parts land. `land` (on the caller's
    thread, cheap) records a part and returns the blocks it completed, per region, as jobs; `hash` (anywhere,
    the jobs in the order they were returned) hashes them; `rest` returns the jobs for every block not handed out
    yet, after which `digests` is `block_digests` of the target. A block is complete in a region once every token
    of it (the target's tokens, 0 = its first) landed in the region's layer; each layer's landed tokens are
    tracked as a prefix (what a writer posts per layer) plus the intervals beyond it."""

    @classmethod
    def of(
        cls, regions: Sequence[KvRegion], shape: RankShape, block_ids: Sequence[int], block_size: int, tokens: int
    ) -> LandedDigests | None:
        """For a target of `tokens` in `block_ids`; None when the rank's regions are not grouped by layer or the
        blocks do not hold exactly the target's tokens (then its blocks are hashed at arrival)."""
        if not shape.num_layers or not block_ids or len(block_ids) != -(-tokens // block_size):
            return None
        return cls(regions, shape, block_ids, block_size, tokens)

    def __init__(
        self, regions: Sequence[KvRegion], shape: RankShape, block_ids: Sequence[int], block_size: int, tokens: int
    ) -> None:
        self._running = RunningDigests(regions)
        self._shape, self._block_ids = shape, list(block_ids)
        self._block_size, self._tokens = block_size, tokens
        self._prefix = [0] * shape.num_layers  # per layer, tokens landed from the target's first
        self._beyond: list[list[tuple[int, int]]] = [[] for _ in range(shape.num_layers)]
        self._taken = [0] * shape.num_layers  # per layer, blocks handed out as jobs

    def land(self, part: WrittenPart, share: range) -> list[HashJob]:
        """`part` landed (`num_layers` 0: all of `share`, the sender's layers); the jobs for the blocks it completed."""
        first_token, num_tokens = part.first_token, part.num_tokens
        layers = range(part.first_layer, part.first_layer + part.num_layers) if part.num_layers else share
        held = range(self._shape.first_layer, self._shape.first_layer + self._shape.num_layers)
        jobs: list[HashJob] = []
        for layer in range(max(layers.start, held.start), min(layers.stop, held.stop)):  # others: not held here
            i = layer - self._shape.first_layer
            beyond, landed = self._beyond[i], (first_token, first_token + num_tokens)
            if landed in beyond:
                continue  # a repeat
            beyond.append(landed)
            beyond.sort()
            while beyond and beyond[0][0] <= self._prefix[i]:
                self._prefix[i] = max(self._prefix[i], beyond.pop(0)[1])
            complete = len(self._block_ids) if self._prefix[i] >= self._tokens else self._prefix[i] // self._block_size
            jobs += self._take(i, complete)
        return jobs

    def rest(self) -> list[HashJob]:
        """The jobs for every block not handed out yet (all of them have landed: the target arrived)."""
        return [job for i in range(self._shape.num_layers) for job in self._take(i, len(self._block_ids))]

    def hash(self, jobs: Sequence[HashJob]) -> None:
        for region, blocks in jobs:
            self._running.extend(region, blocks)

    def digests(self) -> tuple[int, ...]:
        return self._running.digests()

    def _take(self, i: int, complete: int) -> list[HashJob]:
        if complete <= self._taken[i]:
            return []
        layer = self._shape.first_layer + i
        blocks = self._block_ids[self._taken[i] : complete]
        self._taken[i] = complete
        return [(region, blocks) for region in self._shape.region_range(range(layer, layer + 1))]


def plan_digests(plan: WritePlan, regions: Sequence[KvRegion], indices: range) -> tuple[int, ...]:
    """Per region `indices` of `regions` (the plan's remote side), the xxh3-64 of the bytes `plan` writes there in
    ascending address order, read from the plan's local side (host memory the caller keeps alive and does not
    write meanwhile). How the plan splits or merges its descriptors does not change the digest."""
    import xxhash

    order = np.argsort(plan.remote[:, 0], kind="stable")
    remote = plan.remote[order, 0].astype(np.int64)
    local, length = plan.local[order, 0].astype(np.int64), plan.local[order, 1].astype(np.int64)
    out: list[int] = []
    for i in indices:
        base, end = _span(regions[i])
        # A merged descriptor may run on from one region into the next: each region hashes its own bytes of it.
        lo = max(int(np.searchsorted(remote, base, side="right")) - 1, 0)
        hi = int(np.searchsorted(remote, end))
        first, stop = np.maximum(remote[lo:hi], base), np.minimum(remote[lo:hi] + length[lo:hi], end)
        keep = stop > first
        h = xxhash.xxh3_64()
        _hash_ranges(h, (local[lo:hi] + first - remote[lo:hi])[keep], (stop - first)[keep])
        out.append(h.intdigest())
    return tuple(out)


def _span(region: KvRegion) -> tuple[int, int]:
    """The addresses from `region`'s first byte to its last block's end."""
    base = region.base_address
    return base, base + region.block_stride_bytes * max(region.num_blocks - 1, 0) + region.block_length_bytes


class ScopedDigests:
    """A producer rank's scoped digests of one target written in parts, made region by region: a consumer region's
    as soon as every cell of it is posted (`add`, on the writer thread while later layers compute), the others at
    the final (`digests`). A region's digest is `plan_digests` of that region's plan alone, the same bytes in the
    same order as in the whole plan, unless the consumer's regions interleave (one's span holds another's blocks,
    whose bytes the whole plan hashes into both): then every region waits for the final."""

    def __init__(self, producer: RankGeometry, consumer: RankGeometry, share: RankShare, kv_layout: str) -> None:
        self._producer, self._consumer, self._share, self._kv_layout = producer, consumer, share, kv_layout
        spans = sorted(_span(r) for r in consumer.regions)
        self._early = all(end <= start for (_, end), (start, _) in pairwise(spans))
        self._src: npt.NDArray[np.int64] | None = None
        self._done: dict[int, int] = {}
        """Consumer region -> the digest of what the plan of `_src` writes there."""

    @property
    def hashed(self) -> int:
        """How many of the share's consumer regions are hashed."""
        return len(self._done)

    def add(
        self, producer_regions: Iterable[int], src: BlockIds, dst: BlockIds, runs: Sequence[TokenRun] | None
    ) -> None:
        """Hash the consumer regions that receive the producer rank's `producer_regions`, every cell of them
        posted, with source blocks `src` into `dst` (`runs`: as `plan_write` takes them). Raises ValueError
        (`DataPlaneError`) when they do not fit the regions."""
        if not self._early:
            return
        if self._src is None or not np.array_equal(self._src, src):  # more source blocks: planned anew
            self._src, self._done = np.array(src, dtype=np.int64), {}
        first = self._share.producer_regions.start
        self._hash([r - first for r in producer_regions if r in self._share.producer_regions], dst, runs)

    def digests(self, src: BlockIds, dst: BlockIds, runs: Sequence[TokenRun] | None) -> tuple[int, ...]:
        """Per consumer region of the share, in order, the digest of what the whole write puts there: those not
        hashed yet (or planned from other source blocks) hashed now."""
        if self._src is None or not np.array_equal(self._src, src):
            self._src, self._done = np.array(src, dtype=np.int64), {}
        self._hash(range(len(self._share.consumer_regions)), dst, runs)
        return tuple(self._done[c] for c in self._share.consumer_regions)

    def _hash(self, offsets: Iterable[int], dst: BlockIds, runs: Sequence[TokenRun] | None) -> None:
        """Hash the share's regions at `offsets` not hashed yet, one plan per run of neighbours."""
        share, src = self._share, self._src
        assert src is not None
        todo = sorted({i for i in offsets if share.consumer_regions[i] not in self._done})
        while todo:
            stop = next((k for k in range(1, len(todo)) if todo[k] != todo[k - 1] + 1), len(todo))
            first, end = todo[0], todo[stop - 1] + 1
            part = dataclasses.replace(
                share,
                producer_regions=share.producer_regions[first:end],
                consumer_regions=share.consumer_regions[first:end],
            )
            plan = plan_write(self._producer, self._consumer, part, src, dst, self._kv_layout, runs)
            digests = plan_digests(plan, self._consumer.regions, part.consumer_regions)
            self._done.update(zip(part.consumer_regions, digests, strict=True))
            todo = todo[stop:]


_GATHER_BELOW, _GATHER_ROWS_BYTES = 4096, 8 << 20
"""Ranges of one length below `_GATHER_BELOW` bytes (a head split of NHD blocks makes one range per token) are
gathered with numpy, `_GATHER_ROWS_BYTES` at a time, rather than hashed one Python call each; longer ones are
hashed in place (the copy would cost more than the calls)."""


def _hash_ranges(h: Any, addresses: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> None:
    """Feed `h` the bytes of host memory ranges (`addresses`, `lengths`), in order, as one stream."""
    if not len(addresses):
        return
    start = int(addresses.min())
    span = int((addresses + lengths).max()) - start
    memory = np.frombuffer(memoryview((ctypes.c_char * span).from_address(start)).cast("B"), dtype=np.uint8)
    offsets = addresses - start
    size = int(lengths[0])
    if len(offsets) > 16 and size < _GATHER_BELOW and not bool((lengths != size).any()):
        rows = np.lib.stride_tricks.sliding_window_view(memory, size)  # row k: the `size` bytes from byte k
        step = max(_GATHER_ROWS_BYTES // size, 1)
        for first in range(0, len(offsets), step):
            h.update(rows[offsets[first : first + step]])
        return
    for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
        h.update(memory[offset : offset + length])


def scope_digests(geometry: RankGeometry, kv_layout: str, scope: DigestScope, block_ids: BlockIds) -> tuple[int, ...]:
    """A consumer rank's digests of what `scope` covers of its target in `block_ids`: its own memory planned as a
    write into itself (`plan_write`), so its bytes are those a producer's plan of that scope writes. Raises
    ValueError (`DataPlaneError`) when the scope does not fit the rank's layout or blocks."""
    bs = geometry.block_size
    if bs < 1 or -(-scope.tokens // bs) != len(block_ids):
        raise ValueError(f"{scope.tokens} tokens do not fill the target's {len(block_ids)} blocks of {bs}")
    runs = None
    if scope.tokens != len(block_ids) * bs:
        runs = [TokenRun(j, j, 0, 0, min(bs, scope.tokens - j * bs)) for j in range(len(block_ids))]
    share = RankShare(0, 0, scope.regions, scope.regions, scope.first_head, scope.first_head, scope.num_heads)
    plan = plan_write(geometry, geometry, share, block_ids, block_ids, kv_layout, runs)
    return plan_digests(plan, geometry.regions, scope.regions)


def scope_gaps(scopes: Iterable[DigestScope], num_regions: int, num_heads: int, tokens: int) -> str:
    """Why `scopes` (one per sender) do not cover a consumer rank's `num_regions` regions x `num_heads` heads
    exactly once, each at least the target's first `tokens` tokens; "" when they do."""
    counts = np.zeros((num_regions, num_heads), dtype=np.int64)
    for s in scopes:
        if s.regions.stop > num_regions or s.first_head + s.num_heads > num_heads:
            return f"digests of regions {s.regions} heads +{s.first_head}:{s.num_heads} outside the rank's"
        if s.tokens < tokens:
            return f"digests of only {s.tokens} tokens ({tokens} needed)"
        counts[s.regions.start : s.regions.stop, s.first_head : s.first_head + s.num_heads] += 1
    if (counts != 1).any():
        region, head = (int(x) for x in np.argwhere(counts != 1)[0])
        times = int(counts[region, head])
        if not times:
            return f"no digests cover region {region} head {head} (a producer rank without integrity wrote it?)"
        return f"the digests cover region {region} head {head} {times} times, not once"
    return ""


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
