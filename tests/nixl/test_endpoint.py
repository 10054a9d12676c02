"""NixlEndpoint between this process and a peer process: block-exact WRITEs, validation, peer incarnations."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from rendezvous.clients.nixl import (
    BlockRangeError,
    KvRegion,
    LayoutMismatchError,
    NixlAgentInfo,
    NixlEndpoint,
    PeerError,
    TransferNotification,
    XferStatus,
)
from rendezvous.clients.nixl.regions import BlockIds
from tests.nixl.helpers import as_numpy, assert_moved, region_views, unique
from tests.nixl.peer import Layout, PeerProcess

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(30)]


def write(
    endpoint: NixlEndpoint, peer: PeerProcess, dest: str, src: BlockIds, dst: BlockIds, notification: bytes
) -> list[TransferNotification]:
    """WRITE src -> dst while the peer polls for the notification; the notifications it received."""
    peer.send("wait_notifications", dest, 1, 5.0)
    posted = endpoint.post("WRITE", dest, src, dst, notification)
    deadline = time.monotonic() + 5.0
    while endpoint.poll(posted) is XferStatus.IN_PROGRESS:
        assert time.monotonic() < deadline, "WRITE did not complete"
    endpoint.release(posted)
    assert posted.status is XferStatus.DONE, posted.error
    received: list[TransferNotification] = peer.result()[0]
    return received


@pytest.mark.parametrize(
    ("src_layout", "dst_layout"),
    [
        (Layout((64,), 16), Layout((64,), 16)),
        (Layout((4096, 4096), 24, interleaved=True), Layout((4096, 4096), 40, pad=512)),
        (Layout((1000, 24, 333), 20, pad=8), Layout((1000, 24, 333), 12, interleaved=True)),
        (Layout((65536,) * 4, 8), Layout((65536,) * 4, 10, pad=4096)),
    ],
    ids=["one-region-64B", "interleaved-to-padded", "odd-sizes", "four-64KiB-regions"],
)
def test_write_moves_exactly_the_paired_blocks(peer: PeerProcess, src_layout: Layout, dst_layout: Layout) -> None:
    rng = np.random.default_rng(len(src_layout.block_lengths) * 1000 + src_layout.num_blocks)
    dest = unique("dst")
    agent = peer.call("create", dest, dst_layout)
    views = region_views(src_layout, seed=7)
    endpoint = NixlEndpoint.from_tensors(unique("src"), views)
    try:
        assert endpoint.add_peer(agent, incarnation=1)
        count = min(src_layout.num_blocks, dst_layout.num_blocks) - 2
        src_ids = rng.permutation(src_layout.num_blocks)[:count]
        dst_ids = rng.permutation(dst_layout.num_blocks)[:count]

        received = write(endpoint, peer, dest, src_ids, dst_ids, b"t-1:3")

        assert received == [TransferNotification(endpoint.name, "t-1", 3)]
        assert_moved(peer.call("blocks", dest), as_numpy(views), src_ids, dst_ids)
    finally:
        endpoint.close()
        peer.call("close", dest)


def test_a_write_of_some_regions_moves_their_blocks_only(peer: PeerProcess) -> None:
    layout = Layout((512,) * 4, 8)
    dest = unique("dst")
    agent = peer.call("create", dest, layout)
    views = region_views(layout, seed=11)
    endpoint = NixlEndpoint.from_tensors(unique("src"), views)
    try:
        endpoint.add_peer(agent, incarnation=1)
        peer.send("wait_notifications", dest, 1, 5.0)
        posted = endpoint.post("WRITE", dest, [5, 1], [2, 6], b"t-2:1", regions=range(1, 3))
        deadline = time.monotonic() + 5.0
        while endpoint.poll(posted) is XferStatus.IN_PROGRESS:
            assert time.monotonic() < deadline, "WRITE did not complete"
        endpoint.release(posted)
        assert peer.result()[0] == [TransferNotification(endpoint.name, "t-2", 1)]

        blocks = peer.call("blocks", dest)
        source = as_numpy(views)
        assert_moved(blocks[1:3], source[1:3], [5, 1], [2, 6])
        assert_moved([blocks[0], blocks[3]], [source[0], source[3]], [], [])
    finally:
        endpoint.close()
        peer.call("close", dest)


def test_block_ids_out_of_range_are_rejected_before_anything_is_posted(peer: PeerProcess) -> None:
    layout = Layout((256, 256), 8)
    dest = unique("dst")
    agent = peer.call("create", dest, layout)
    views = region_views(layout, seed=1)
    endpoint = NixlEndpoint.from_tensors(unique("src"), views)
    try:
        endpoint.add_peer(agent, incarnation=1)
        bad: list[tuple[Any, Any]] = [([0], [8]), ([8], [0]), ([-1], [0]), ([0, 1], [2]), ([], []), ([0.5], [1])]
        for src, dst in bad:
            with pytest.raises(BlockRangeError):
                endpoint.post("WRITE", dest, src, dst, b"bad:1")

        received = write(endpoint, peer, dest, [3], [4], b"good:1")

        assert [n.transfer_id for n in received] == ["good"]
        assert_moved(peer.call("blocks", dest), as_numpy(views), [3], [4])
    finally:
        endpoint.close()
        peer.call("close", dest)


def test_a_new_peer_incarnation_replaces_the_cached_metadata(peer: PeerProcess) -> None:
    layout = Layout((512,), 6)
    dest = unique("dst")
    first = peer.call("create", dest, layout)
    views = region_views(layout, seed=2)
    endpoint = NixlEndpoint.from_tensors(unique("src"), views)
    try:
        assert endpoint.add_peer(first, incarnation=1)
        write(endpoint, peer, dest, [0], [0], b"a:1")
        peer.call("close", dest)
        second = peer.call("create", dest, layout)  # the engine restarted: same agent name, new memory
        assert second.metadata != first.metadata

        assert endpoint.add_peer(second, incarnation=2)
        assert not endpoint.add_peer(second, incarnation=2)
        with pytest.raises(PeerError, match="older"):
            endpoint.add_peer(first, incarnation=1)
        write(endpoint, peer, dest, [5], [1], b"b:1")

        assert endpoint.peer_incarnation(dest) == 2
        assert_moved(peer.call("blocks", dest), as_numpy(views), [5], [1])
    finally:
        endpoint.close()
        peer.call("close", dest)


def test_unreadable_or_misattributed_metadata_is_a_peer_error(peer: PeerProcess) -> None:
    layout = Layout((128,), 4)
    dest = unique("dst")
    agent = peer.call("create", dest, layout)
    endpoint = NixlEndpoint.from_tensors(unique("src"), region_views(layout))
    try:
        with pytest.raises(PeerError, match="unreadable"):
            endpoint.add_peer(NixlAgentInfo("ghost", b"not metadata", regions=agent.regions), 1)
        with pytest.raises(PeerError, match="belongs to agent"):
            endpoint.add_peer(NixlAgentInfo("impostor", agent.metadata, regions=agent.regions), 1)
        with pytest.raises(PeerError, match="unknown peer"):
            endpoint.post("WRITE", "ghost", [0], [0])
        assert endpoint.peer_incarnation("ghost") is None
        assert endpoint.add_peer(agent, 1)  # the real owner of the metadata still loads
    finally:
        endpoint.close()
        peer.call("close", dest)


def test_regions_that_do_not_pair_are_a_layout_mismatch() -> None:
    endpoint = NixlEndpoint.from_tensors(unique("src"), region_views(Layout((128, 64), 4)))
    try:
        for regions in [(KvRegion(4096, 128, 128, 4),), (KvRegion(4096, 128, 128, 4), KvRegion(8192, 128, 128, 4))]:
            with pytest.raises(LayoutMismatchError):
                endpoint.add_peer(NixlAgentInfo("other", b"", regions=regions), 1)
    finally:
        endpoint.close()
