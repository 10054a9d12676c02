"""The data-plane version table: what the service's pairing rule rests on."""

from __future__ import annotations

from rendezvous.protocol.dataplane import DATA_PLANE_VERSION, READS, data_plane_mismatch, known


def test_every_version_reads_itself_so_equal_versions_always_pair() -> None:
    assert DATA_PLANE_VERSION in READS
    for version, reads in READS.items():
        assert version in reads and data_plane_mismatch(version, version) is None


def test_an_unstated_version_is_version_1_and_unknown_ones_are_not_known() -> None:
    assert known(0) and data_plane_mismatch(0, 1) is None and data_plane_mismatch(1, 0) is None
    assert not known(DATA_PLANE_VERSION + 1)
    assert data_plane_mismatch(2, 0) == "producer data-plane version 2; consumer data-plane version 1 reads 1"
