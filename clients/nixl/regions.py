"""KV regions and the NIXL descriptor table that addresses their blocks.

An engine rank registers its KV memory as regions (`KvRegion`, the protocol's message): block b of region r
is `block_length_bytes` at `base_address + b * block_stride_bytes`. Moving block list src -> dst moves, for
every region r, block src[i] of r to block dst[i] of the peer's region r.

`DescriptorTable` enumerates every (region, block) pair once, region-major: the descriptor of (r, b) sits at
index `offsets[r] + b`. Indices for a block list are then one numpy broadcast, with no Python loop per
block, and consecutive block ids give consecutive descriptors, which NIXL merges into larger transfers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from rendezvous.clients.nixl.errors import BlockRangeError, LayoutMismatchError
from rendezvous.protocol.enums import MemoryKind
from rendezvous.protocol.records import KvRegion

if TYPE_CHECKING:
    import torch

__all__ = [
    "DescriptorTable",
    "KvRegion",
    "MemoryKind",
    "memory_kind_of",
    "nixl_memory_type",
    "regions_from_tensors",
    "registration_spans",
]

_NIXL_MEMORY_TYPES = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}
_MAX_DESCRIPTORS = 2**31 - 1  # NIXL takes int32 descriptor indices

BlockIds = Sequence[int] | npt.NDArray[np.integer]


def nixl_memory_type(kind: MemoryKind) -> str:
    """The NIXL memory type string ("DRAM" or "VRAM") of a memory kind."""
    try:
        return _NIXL_MEMORY_TYPES[MemoryKind(kind)]
    except KeyError:
        raise ValueError(f"memory kind {kind!r} has no NIXL memory type") from None


def memory_kind_of(tensors: Sequence[torch.Tensor]) -> MemoryKind:
    """DRAM for CPU tensors, VRAM for CUDA tensors; all tensors must live on the same kind of device."""
    kinds = {t.device.type for t in tensors}
    if len(kinds) != 1:
        raise ValueError(f"tensors must share one device type, got {sorted(kinds) or 'none'}")
    kind = kinds.pop()
    if kind == "cpu":
        return MemoryKind.DRAM
    if kind == "cuda":
        return MemoryKind.VRAM
    raise ValueError(f"unsupported device type {kind!r}")


def regions_from_tensors(tensors: Sequence[torch.Tensor]) -> list[KvRegion]:
    """One region per tensor shaped [num_blocks, ...], whose block `t[b]` must be contiguous.

    The stride is `t.stride(0) * element_size` and the block length the bytes of `t[b]`; they are equal for a
    contiguous tensor, while a view such as `kv[:, 0]` of a [num_blocks, 2, ...] cache gives stride > length.
    The caller keeps the tensors alive for as long as the regions are registered.
    """
    regions = []
    for i, t in enumerate(tensors):
        if t.dim() < 1 or t.shape[0] < 1:
            raise ValueError(f"tensor {i} must have a leading block dimension, got shape {tuple(t.shape)}")
        if not t[0].is_contiguous():
            raise ValueError(f"tensor {i}: a block (t[b]) must be contiguous")
        size = t.element_size()
        regions.append(
            KvRegion(
                base_address=t.data_ptr(),
                block_stride_bytes=t.stride(0) * size,
                block_length_bytes=t[0].numel() * size,
                num_blocks=t.shape[0],
                device_id=max(t.get_device(), 0),
            )
        )
    return regions


def _check_region(index: int, r: KvRegion) -> None:
    if r.num_blocks < 1 or r.block_length_bytes < 1 or r.base_address < 1:
        raise ValueError(f"region {index} is empty or has no address: {r}")
    if r.num_blocks > 1 and r.block_stride_bytes < r.block_length_bytes:
        raise ValueError(f"region {index}: blocks overlap (stride {r.block_stride_bytes} < length)")


def registration_spans(regions: Sequence[KvRegion]) -> npt.NDArray[np.uint64]:
    """The memory to register for `regions`, as Nx3 (address, length, device) rows.

    Overlapping or touching spans on one device are merged, so regions that interleave in one buffer (K and
    V blocks alternating) are registered once.
    """
    spans = sorted(
        (r.device_id, r.base_address, r.base_address + (r.num_blocks - 1) * r.block_stride_bytes + r.block_length_bytes)
        for r in regions
    )
    merged: list[list[int]] = []
    for device, start, end in spans:
        if merged and merged[-1][0] == device and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([device, start, end])
    return np.array([(start, end - start, device) for device, start, end in merged], dtype=np.uint64).reshape(-1, 3)


class DescriptorTable:
    """Every block of every region as one NIXL descriptor list, with vectorised index lookup.

    A block id is valid when it addresses a block in every region: 0 <= id < `num_blocks`, the smallest
    region's block count.
    """

    def __init__(self, regions: Sequence[KvRegion]) -> None:
        if not regions:
            raise ValueError("at least one region is needed")
        for i, r in enumerate(regions):
            _check_region(i, r)
        self.regions: tuple[KvRegion, ...] = tuple(regions)
        counts = np.array([r.num_blocks for r in self.regions], dtype=np.int64)
        if int(counts.sum()) > _MAX_DESCRIPTORS:
            raise ValueError(f"{int(counts.sum())} descriptors exceed NIXL's int32 indices")
        self._offsets = (np.cumsum(counts) - counts)[:, None]
        self.num_blocks: int = int(counts.min())

    def descriptors(self) -> npt.NDArray[np.uint64]:
        """The Nx3 uint64 (address, length, device) array, one row per (region, block), region-major."""
        parts = []
        for r in self.regions:
            rows = np.empty((r.num_blocks, 3), dtype=np.uint64)
            rows[:, 0] = np.uint64(r.base_address) + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(
                r.block_stride_bytes
            )
            rows[:, 1] = r.block_length_bytes
            rows[:, 2] = r.device_id
            parts.append(rows)
        return np.concatenate(parts)

    def check_block_ids(self, block_ids: BlockIds) -> npt.NDArray[np.int64]:
        """`block_ids` as a 1-D int64 array; raises `BlockRangeError` unless each addresses every region."""
        ids = np.asarray(block_ids)
        if ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise BlockRangeError(f"block ids must be a flat list of integers, got {ids.dtype} shape {ids.shape}")
        ids = ids.astype(np.int64, copy=False)
        if int(ids.view(np.uint64).max()) >= self.num_blocks:  # one pass: negative ids are above 2**63 as unsigned
            low, high = int(ids.min()), int(ids.max())
            raise BlockRangeError(f"block ids must be in [0, {self.num_blocks}), got ids in [{low}, {high}]")
        return ids

    def indices(self, block_ids: BlockIds, regions: range | None = None) -> npt.NDArray[np.int32]:
        """Descriptor indices of `block_ids` in every region (or in `regions`): region-major,
        len(regions) * len(block_ids)."""
        ids = self.check_block_ids(block_ids)
        offsets = self._offsets if regions is None else self._offsets[regions.start : regions.stop]
        if regions is not None and (regions.step != 1 or regions.start < 0 or regions.stop > len(self.regions)):
            raise BlockRangeError(f"regions {regions} are not a range of the {len(self.regions)} regions")
        return (offsets + ids[None, :]).ravel().astype(np.int32)

    def check_pairs_with(self, other: DescriptorTable) -> None:
        """Raise `LayoutMismatchError` unless both tables have as many regions, with equal block lengths."""
        if len(self.regions) != len(other.regions):
            raise LayoutMismatchError(f"{len(self.regions)} regions here, {len(other.regions)} at the peer")
        for i, (mine, theirs) in enumerate(zip(self.regions, other.regions, strict=True)):
            if mine.block_length_bytes != theirs.block_length_bytes:
                raise LayoutMismatchError(
                    f"region {i}: block length {mine.block_length_bytes} here, {theirs.block_length_bytes} at the peer"
                )
