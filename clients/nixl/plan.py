"""Write plans: the bytes one producer rank WRITEs into one consumer rank, as NIXL descriptor lists.

`rendezvous.protocol.kvmap` says what moves (a `RankShare`: which regions and heads; `TokenRun`s: which tokens
of which blocks); `plan_write` turns that into two Nx3 uint64 (address, length, device) arrays, local[i] ->
remote[i]. A block of region r holds `block_size` tokens of each of the rank's heads, one unit (one token of
one head, `block_length_bytes / (heads * block_size)` bytes) each:

- "HND": [heads, tokens, unit], so a run of tokens of one head is contiguous;
- "NHD": [tokens, heads, unit], so the share's heads of one token are contiguous;
- "HKTV" (vLLM-CPU): heads one after the other; per head the keys transposed, [head_dim, tokens], then the
  values, [tokens, head_dim]: a run of tokens of one head is head_dim key pieces and one value piece (the
  element size, `RankGeometry.element_bytes`, tells them apart); whole blocks of some heads move as one slab per
  head, as in HEAD_MAJOR (planned without the key rows: 100x faster for 1,024 blocks);
- "HEAD_MAJOR": heads one after the other, each opaque: head slices of whole blocks move as in HND;
- any other layout is opaque: only whole blocks move, which needs the share to hold all heads on both sides
  and equal block sizes.

Descriptors come out region by region, run by run (in destination order), then head by head (HND) or token by
token (NHD); neighbours contiguous on both sides are merged into one, so a whole-head transfer of consecutive
blocks becomes one descriptor per region. Everything is numpy broadcasting: no Python loop per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rendezvous.clients.nixl.errors import BlockRangeError, LayoutMismatchError
from rendezvous.protocol.kvmap import HEAD_MAJOR, HEAD_SPLIT_LAYOUTS, HKTV, RankShare, TokenRun
from rendezvous.protocol.records import KvRegion

__all__ = ["RankGeometry", "WritePlan", "merge_descriptors", "plan_write"]

Descriptors = npt.NDArray[np.uint64]
_Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class RankGeometry:
    """One side of a write: a rank's regions, how many KV heads it holds and its tokens per block."""

    regions: Sequence[KvRegion]
    num_heads: int
    block_size: int
    element_bytes: int = 0
    """Bytes of one element of the KV dtype; needed by the HKTV layout only."""


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Descriptor lists of one WRITE: `local[i]` (producer memory) goes to `remote[i]` (consumer memory)."""

    local: Descriptors
    remote: Descriptors

    @property
    def num_descriptors(self) -> int:
        return len(self.local)

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum())


def _column(regions: Sequence[KvRegion], indices: range, field: str) -> _Ints:
    try:
        return np.array([getattr(regions[i], field) for i in indices], dtype=np.int64)[:, None]
    except OverflowError:  # a peer's region stated a uint64 no process maps
        raise LayoutMismatchError(f"a region's {field} is beyond 2**63: not an address of this machine") from None


def _block_ids(ids: Sequence[int] | npt.NDArray[np.integer], regions: Sequence[KvRegion], indices: range) -> _Ints:
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise BlockRangeError(f"block ids must be a flat list of integers, got {array.dtype} shape {array.shape}")
    limit = min(regions[i].num_blocks for i in indices)
    if int(array.min()) < 0 or int(array.max()) >= limit:
        raise BlockRangeError(f"block ids must be in [0, {limit}), got ids in [{int(array.min())}, {int(array.max())}]")
    return array.astype(np.int64)


def _units(side: RankGeometry, indices: range, what: str) -> _Ints:
    lengths = _column(side.regions, indices, "block_length_bytes")
    per_block = side.num_heads * side.block_size
    if per_block < 1 or np.any(lengths % per_block):
        raise LayoutMismatchError(
            f"{what} block lengths {lengths.ravel().tolist()} do not split into {side.num_heads} heads x "
            f"{side.block_size} tokens"
        )
    return lengths // per_block


def plan_write(
    producer: RankGeometry,
    consumer: RankGeometry,
    share: RankShare,
    src_block_ids: Sequence[int] | npt.NDArray[np.integer],
    dst_block_ids: Sequence[int] | npt.NDArray[np.integer],
    kv_layout: str,
    runs: Sequence[TokenRun] | None = None,
    *,
    merge: bool = True,
) -> WritePlan:
    """The descriptors that move `share` of the transfer's tokens from `producer` to `consumer`.

    `runs` pairs the blocks (`kvmap.token_runs`); None means equal block sizes, the last `len(dst_block_ids)`
    source blocks going whole to the destination blocks in order (what `token_runs` says for equal sizes,
    without building a run per block). Raises `BlockRangeError` for block ids or runs outside the regions and
    `LayoutMismatchError` when the regions, heads or layout cannot address the share.
    """
    if len(share.producer_regions) != len(share.consumer_regions):
        raise LayoutMismatchError(
            f"{len(share.producer_regions)} producer regions pair with {len(share.consumer_regions)} consumer regions"
        )
    for side, regions, first, what in (
        (producer, share.producer_regions, share.producer_head, "producer"),
        (consumer, share.consumer_regions, share.consumer_head, "consumer"),
    ):
        if regions and (regions.start < 0 or regions.stop > len(side.regions)):
            raise LayoutMismatchError(f"{what} regions {regions} outside its {len(side.regions)} regions")
        if share.num_heads < 1 or first < 0 or first + share.num_heads > side.num_heads:
            raise LayoutMismatchError(f"{what} heads [{first}, +{share.num_heads}) outside its {side.num_heads}")
    src = _block_ids(src_block_ids, producer.regions, share.producer_regions)
    dst = _block_ids(dst_block_ids, consumer.regions, share.consumer_regions)
    bp, bd = producer.block_size, consumer.block_size
    if runs is None:
        if bp != bd:
            raise BlockRangeError(f"block sizes {bp} and {bd} differ: the token runs are needed")
        if len(src) < len(dst):
            raise BlockRangeError(f"{len(dst)} destination blocks but only {len(src)} source blocks")
        run_src = np.arange(len(src) - len(dst), len(src), dtype=np.int64)
        run_dst = np.arange(len(dst), dtype=np.int64)
        src_token = dst_token = np.zeros(len(dst), dtype=np.int64)
        tokens = np.full(len(dst), bd, dtype=np.int64)
    else:
        fields = np.array([(r.src, r.dst, r.src_token, r.dst_token, r.tokens) for r in runs], dtype=np.int64)
        run_src, run_dst, src_token, dst_token, tokens = fields.reshape(-1, 5).T
        if len(fields) and (
            run_src.min() < 0
            or run_src.max() >= len(src)
            or run_dst.min() < 0
            or run_dst.max() >= len(dst)
            or tokens.min() < 1
            or src_token.min() < 0
            or dst_token.min() < 0
            or (src_token + tokens).max() > bp
            or (dst_token + tokens).max() > bd
        ):
            raise BlockRangeError("token runs outside the block lists or the blocks")
    hp, hd, nh = producer.num_heads, consumer.num_heads, share.num_heads
    whole_blocks = nh == hp == hd and bp == bd and bool(np.all(tokens == bp))

    p_regions, c_regions = share.producer_regions, share.consumer_regions
    valid: npt.NDArray[np.bool_] | None = None
    p_len, c_len = (
        _column(producer.regions, p_regions, "block_length_bytes"),
        _column(consumer.regions, c_regions, "block_length_bytes"),
    )
    # (region, run) start of each block, local and remote.
    p_block = _column(producer.regions, p_regions, "base_address") + src[run_src][None, :] * _column(
        producer.regions, p_regions, "block_stride_bytes"
    )
    c_block = _column(consumer.regions, c_regions, "base_address") + dst[run_dst][None, :] * _column(
        consumer.regions, c_regions, "block_stride_bytes"
    )
    if whole_blocks:
        if np.any(p_len != c_len):
            raise LayoutMismatchError(
                f"block lengths differ region by region: {p_len.ravel().tolist()} and {c_len.ravel().tolist()}"
            )
        local, remote, length = p_block, c_block, np.broadcast_to(p_len, p_block.shape)
    elif kv_layout == HEAD_MAJOR and bp != bd:
        raise LayoutMismatchError(f"kv_layout {HEAD_MAJOR} does not split blocks by token ({bp} and {bd} tokens)")
    elif kv_layout not in HEAD_SPLIT_LAYOUTS:
        raise LayoutMismatchError(
            f"kv_layout {kv_layout!r} moves whole blocks only: the share must hold all heads "
            f"({nh} of {hp} and {hd}) with equal block sizes ({bp} and {bd})"
        )
    else:
        unit = _units(producer, p_regions, "producer")
        if np.any(unit != _units(consumer, c_regions, "consumer")):
            raise LayoutMismatchError("the unit (one token of one head) differs between producer and consumer")
        ph, ch = share.producer_head, share.consumer_head
        whole_heads = bp == bd and bool(np.all(tokens == bp))  # each head's part of a block moves whole
        if kv_layout == HKTV and not whole_heads:  # (region, run, head, part): head_dim key rows, then the values
            elt = producer.element_bytes
            if elt < 1 or np.any(unit % (2 * elt)):
                raise LayoutMismatchError(f"{HKTV} needs an element size dividing half the unit, got {elt}")
            dim = unit[:, :, None, None] // (2 * elt)
            head = np.arange(nh, dtype=np.int64)[None, None, :, None]
            part = np.arange(int(dim.max()) + 1, dtype=np.int64)[None, None, None, :]
            p_slab = p_block[:, :, None, None] + (ph + head) * bp * unit[:, :, None, None]
            c_slab = c_block[:, :, None, None] + (ch + head) * bd * unit[:, :, None, None]
            st, dt, n = (x[None, :, None, None] for x in (src_token, dst_token, tokens))
            key = part < dim  # rows 0..head_dim-1 are keys, the last part the values
            local = np.where(key, p_slab + (part * bp + st) * elt, p_slab + (bp + st) * dim * elt)
            remote = np.where(key, c_slab + (part * bd + dt) * elt, c_slab + (bd + dt) * dim * elt)
            length = np.where(key, n * elt, n * dim * elt)
            local, remote, length = np.broadcast_arrays(local, remote, length)
            valid = np.broadcast_to(part <= dim, local.shape)  # regions of a smaller head_dim have fewer parts
        elif kv_layout in ("HND", HEAD_MAJOR, HKTV):  # (region, run, head): a run of tokens of one head (HKTV:
            # only whole blocks come here, where a head's keys and values are one slab, as in HEAD_MAJOR)
            head = np.arange(nh, dtype=np.int64)[None, None, :]
            u = unit[:, :, None]
            local = p_block[:, :, None] + ((ph + head) * bp + src_token[None, :, None]) * u
            remote = c_block[:, :, None] + ((ch + head) * bd + dst_token[None, :, None]) * u
            length = np.broadcast_to(tokens[None, :, None] * u, local.shape)
        elif nh == hp == hd:  # NHD, all heads: a run of whole tokens
            local = p_block + src_token[None, :] * hp * unit
            remote = c_block + dst_token[None, :] * hd * unit
            length = np.broadcast_to(tokens[None, :] * hp * unit, local.shape)
        else:  # NHD, some heads: (region, token) the share's heads of one token
            run = np.repeat(np.arange(len(tokens)), tokens)
            offset = np.arange(len(run), dtype=np.int64) - np.repeat(np.cumsum(tokens) - tokens, tokens)
            local = p_block[:, run] + ((src_token[run] + offset)[None, :] * hp + ph) * unit
            remote = c_block[:, run] + ((dst_token[run] + offset)[None, :] * hd + ch) * unit
            length = np.broadcast_to(nh * unit, local.shape)
    shape = local.shape
    p_dev = np.broadcast_to(
        _column(producer.regions, p_regions, "device_id").reshape(-1, *[1] * (len(shape) - 1)), shape
    )
    c_dev = np.broadcast_to(
        _column(consumer.regions, c_regions, "device_id").reshape(-1, *[1] * (len(shape) - 1)), shape
    )
    local_rows = np.stack([local.ravel(), length.ravel(), p_dev.ravel()], axis=1).astype(np.uint64)
    remote_rows = np.stack([remote.ravel(), length.ravel(), c_dev.ravel()], axis=1).astype(np.uint64)
    if valid is not None:
        local_rows, remote_rows = local_rows[valid.ravel()], remote_rows[valid.ravel()]
    if merge:
        local_rows, remote_rows = merge_descriptors(local_rows, remote_rows)
    return WritePlan(local_rows, remote_rows)


def merge_descriptors(local: Descriptors, remote: Descriptors) -> tuple[Descriptors, Descriptors]:
    """Merge each run of neighbouring descriptor pairs that are contiguous on both sides (same devices)."""
    if len(local) < 2:
        return local, remote
    length = local[:, 1]
    joins = (
        (local[1:, 0] == local[:-1, 0] + length[:-1])
        & (remote[1:, 0] == remote[:-1, 0] + length[:-1])
        & (local[1:, 2] == local[:-1, 2])
        & (remote[1:, 2] == remote[:-1, 2])
    )
    if not joins.any():
        return local, remote
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = np.add.reduceat(length, starts)
    out_local, out_remote = local[starts].copy(), remote[starts].copy()
    out_local[:, 1] = out_remote[:, 1] = merged
    return out_local, out_remote
