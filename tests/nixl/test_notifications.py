"""The notification that accompanies a transfer's bytes carries the data-plane version that wrote it; this data
plane reads the versions its consumers are paired with (rendezvous.protocol.dataplane.READS)."""

from __future__ import annotations

from rendezvous.clients.nixl.notifications import (
    DigestScope,
    PartsEntry,
    TransferNotification,
    encode_notification,
    encode_parts,
    parse_notification,
)
from rendezvous.protocol.dataplane import DATA_PLANE_VERSION
from rendezvous.protocol.records import WrittenPart


def test_a_notification_names_its_data_plane_version_and_reads_back() -> None:
    assert encode_notification("t:1", 3) == f"{DATA_PLANE_VERSION} t:1:3".encode()
    assert encode_notification("t", 2, writers=4) == f"{DATA_PLANE_VERSION} t:2/4".encode()
    assert parse_notification("p", encode_notification("t:1", 3)) == (TransferNotification("p", "t:1", 3),)
    assert parse_notification("p", encode_notification("t", 2, 4)) == (TransferNotification("p", "t", 2, 4),)


def test_a_parts_notification_says_what_its_write_carried_for_each_transfer() -> None:
    layer_0 = (WrittenPart(0, 32, 0, 1),)
    chunk = (WrittenPart(16, 16), WrittenPart(0, 16, 1, 1))
    payload = encode_parts([PartsEntry("a:b", 1, 2, range(0, 2), layer_0), PartsEntry("c", 4, 1, None, chunk)])
    assert payload == f"{DATA_PLANE_VERSION} a:b:1/2@0-2=0+32x0+1 c:4/1@*=16+16,0+16x1+1".encode()
    assert parse_notification("p", payload) == (
        TransferNotification("p", "a:b", 1, 2, range(0, 2), layer_0),
        TransferNotification("p", "c", 4, 1, None, chunk),
    )


def test_versions_1_and_2_still_read() -> None:
    assert parse_notification("p", b"t:1:3") == (TransferNotification("p", "t:1", 3),)
    assert parse_notification("p", b"t:2/0") == (TransferNotification("p", "t", 2, 0),)
    assert parse_notification("p", b"2 t:2/3") == (TransferNotification("p", "t", 2, 3),)


def test_a_notification_of_a_version_this_data_plane_does_not_read_is_malformed() -> None:
    assert parse_notification("p", f"{DATA_PLANE_VERSION + 1} t:3".encode()) is None
    assert parse_notification("p", b"v2 t:3") is None
    assert parse_notification("p", b"2 t:x") is None


def test_numbers_longer_than_a_uint64_are_malformed_not_an_error() -> None:
    """A peer's notification is bad input: a 5,000-digit generation made `int()` raise (Python's digit limit)
    out of the receiver's poll instead of counting the notification as malformed."""
    huge = "9" * 5000
    for bad in (f"t:{huge}", f"t:1/{huge}", f"t:1/1@*=0+{huge}", f"t:1#0-1/0+1/{huge}=0000000000000001"):
        assert parse_notification("p", f"{DATA_PLANE_VERSION} {bad}".encode()) is None, bad[:20]
    assert parse_notification("p", f"{DATA_PLANE_VERSION} t:{2**64 - 1}".encode()) is not None


def test_a_span_of_more_layers_or_regions_than_any_rank_holds_is_malformed() -> None:
    """A scope of 1e20 regions parsed as a range whose `len()` overflows a C ssize_t: OverflowError out of the
    parser ended the consumer's receiver thread (found by an audit). Spans are at most 65,536 long."""
    huge, digest = "9" * 20, "0000000000000000"
    for bad in (f"t:1#0-{huge}/0+1/1={digest}", f"t:1/1@0-{huge}=0+4", "t:1/1@0-65537=0+4"):
        assert parse_notification("p", f"{DATA_PLANE_VERSION} {bad}".encode()) is None, bad
    assert parse_notification("p", f"{DATA_PLANE_VERSION} t:1/1@0-65536=0+4".encode()) is not None


def test_a_malformed_parts_entry_spoils_the_whole_notification() -> None:
    for bad in ("t:1@*=0+4", "t:1/1@*=", "t:1/1@2-1=0+4", "t:1/1@*=0+4x1+0", "t:1/1@*=0-4", "t:1/1@0-2=a+4"):
        assert parse_notification("p", f"{DATA_PLANE_VERSION} ok:1 {bad}".encode()) is None, bad


def test_digests_with_a_scope_say_which_regions_heads_and_tokens_they_cover() -> None:
    scope = DigestScope(range(2, 4), 1, 2, 40)
    payload = encode_notification("t", 5, writers=2, digests=(1, 0xABC), scope=scope)
    assert payload == f"{DATA_PLANE_VERSION} t:5/2#2-4/1+2/40=0000000000000001,0000000000000abc".encode()
    assert parse_notification("p", payload) == (TransferNotification("p", "t", 5, 2, digests=(1, 0xABC), scope=scope),)
    parts = encode_parts([PartsEntry("t", 5, 2, None, (WrittenPart(0, 40),), (7,), DigestScope(range(0, 1), 0, 1, 40))])
    assert parse_notification("p", parts) == (
        TransferNotification("p", "t", 5, 2, None, (WrittenPart(0, 40),), (7,), DigestScope(range(0, 1), 0, 1, 40)),
    )
    digest = "0000000000000001"
    for bad in ("2-4/1+2/40", "3-2/1+2/40", "2-3/1+0/40", "2-3/1+2/0", "2-3/1/40", "2-3/x+1/40"):
        assert parse_notification("p", f"{DATA_PLANE_VERSION} t:5#{bad}={digest}".encode()) is None, bad
