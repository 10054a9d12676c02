"""TransferReceiver in this process: pull-mode READs from, and notifications sent by, a peer process."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from rendezvous.clients.nixl import BlockRangeError, NixlAgentInfo, NixlEndpoint, TransferNotification, TransferReceiver
from tests.nixl.helpers import as_numpy, assert_moved, region_views, unique
from tests.nixl.peer import Layout, PeerProcess

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(30)]

DEST_LAYOUT = Layout((2048, 100, 4096), 20, interleaved=True)


@pytest.fixture
def views() -> list[torch.Tensor]:
    """The consumer's destination regions, all sentinel bytes."""
    return region_views(DEST_LAYOUT)


@pytest.fixture
def receiver(views: list[torch.Tensor]) -> Iterator[TransferReceiver]:
    receiver = TransferReceiver(NixlEndpoint.from_tensors(unique("consumer"), views))
    yield receiver
    receiver.close()


@pytest.fixture
def producer(peer: PeerProcess) -> Iterator[NixlAgentInfo]:
    """A producer endpoint in the peer process, with random bytes in every block."""
    name = unique("producer")
    agent = peer.call("create", name, Layout((2048, 100, 4096), 12, pad=16))
    peer.call("fill_random", name, 5)
    yield agent
    peer.call("close", name)


def test_pull_read_is_byte_exact(
    peer: PeerProcess, receiver: TransferReceiver, views: list[torch.Tensor], producer: NixlAgentInfo
) -> None:
    receiver.add_peer(producer, 1)
    src_ids, dst_ids = [11, 0, 7, 3, 5], [19, 4, 0, 12, 6]
    peer.send("wait_notifications", producer.name, 1, 5.0)

    receiver.read(producer.name, src_ids, dst_ids, notification=b"t1:4", timeout=5.0)

    received, _ = peer.result()
    assert received == [TransferNotification(receiver.endpoint.name, "t1", 4)]
    source = [b[:, :n] for b, n in zip(peer.call("blocks", producer.name), DEST_LAYOUT.block_lengths, strict=True)]
    assert_moved(as_numpy(views), source, src_ids, dst_ids)


def test_reads_with_out_of_range_blocks_are_rejected(receiver: TransferReceiver, producer: NixlAgentInfo) -> None:
    receiver.add_peer(producer, 1)
    with pytest.raises(BlockRangeError):
        receiver.start_read(producer.name, [12], [0])  # the producer has 12 blocks
    with pytest.raises(BlockRangeError):
        receiver.start_read(producer.name, [0], [20])  # the consumer has 20


def test_notifications_are_parsed_and_malformed_ones_counted(
    peer: PeerProcess, receiver: TransferReceiver, producer: NixlAgentInfo
) -> None:
    peer.call("add_peer", producer.name, receiver.agent_info(), 1)
    received: list[TransferNotification] = []
    for payload in [b"no-generation", b"t:x", b"\xff\xfe:1", b"req:7:5"]:
        seen = len(received) + receiver.malformed_notifications
        peer.send("write", producer.name, receiver.endpoint.name, [0], [1], payload, 5.0)
        deadline = time.monotonic() + 5.0
        while len(received) + receiver.malformed_notifications == seen:
            assert time.monotonic() < deadline, f"notification {payload!r} did not arrive"
            received.extend(receiver.poll_notifications())
        assert peer.result() == "DONE"

    assert received == [TransferNotification(producer.name, "req:7", 5)]
    assert receiver.malformed_notifications == 3
