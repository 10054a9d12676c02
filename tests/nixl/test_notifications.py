"""The notification that accompanies a transfer's bytes carries the data-plane version that wrote it; this data
plane reads the versions its consumers are paired with (rendezvous.protocol.dataplane.READS)."""

from __future__ import annotations

from clients.nixl.notifications import TransferNotification, encode_notification, parse_notification
from rendezvous.protocol.dataplane import DATA_PLANE_VERSION


def test_a_notification_names_its_data_plane_version_and_reads_back() -> None:
    assert encode_notification("t:1", 3) == f"{DATA_PLANE_VERSION} t:1:3".encode()
    assert encode_notification("t", 2, writers=4) == f"{DATA_PLANE_VERSION} t:2/4".encode()
    assert parse_notification("p", encode_notification("t:1", 3)) == TransferNotification("p", "t:1", 3)
    assert parse_notification("p", encode_notification("t", 2, 4)) == TransferNotification("p", "t", 2, 4)


def test_version_1_untagged_notifications_still_read() -> None:
    assert parse_notification("p", b"t:1:3") == TransferNotification("p", "t:1", 3)
    assert parse_notification("p", b"t:2/0") == TransferNotification("p", "t", 2, 0)


def test_a_notification_of_a_version_this_data_plane_does_not_read_is_malformed() -> None:
    assert parse_notification("p", f"{DATA_PLANE_VERSION + 1} t:3".encode()) is None
    assert parse_notification("p", b"v2 t:3") is None
    assert parse_notification("p", b"2 t:x") is None
