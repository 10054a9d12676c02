"""Data-plane versions: which formats of the bytes an engine's connector moves can work together.

The data plane (rendezvous.clients.nixl) is what producer and consumer agree on without the service in between: the NIXL
notification that accompanies a transfer's bytes (rendezvous.clients.nixl.notifications) and the blocks' layout in
memory. Each engine states the version it speaks in its layout (`KvLayout.data_plane_version`); the service refuses a
version it does not know at registration, and aborts a transfer whose consumer cannot read what its producer
writes (AbortReason.DATA_PLANE_MISMATCH), naming both versions.

Versions:
1. "<transfer_id>:<generation>[/<writers>]" notifications (engines that state no version, 0, speak it).
2. The same, tagged: "2 <transfer_id>:<generation>[/<writers>]" (ids hold no whitespace). Its consumers read 1
   too, so during a rolling upgrade consumers go first (docs/operations.md, "Upgrading").
3. Several entries per notification, and parts entries: "3 <transfer_id>:<generation>/<writers>@<layers>=<parts>"
   says which rectangles of a progressive target the WRITE it came with carried, so the consumer declares
   arrival itself once they tile the target (rendezvous.clients.nixl.notifications, rendezvous.clients.nixl.arrival).
   Its consumers read 1 and 2 (where a progressive target arrives on TRANSFER_COMMITTED, as before).
4. Integrity digests with a scope, "#<regions>/<heads>/<tokens>=<digest>,...": a producer rank that writes only
   some of a consumer rank's bytes (other head counts, block sizes or pipeline stages) says what its digests
   cover, so such transfers can be checked end to end too. Its consumers read 1 to 3.
"""

from __future__ import annotations

DATA_PLANE_VERSION = 4
"""The version this release's data plane speaks, and the newest the service knows."""

READS: dict[int, frozenset[int]] = {
    1: frozenset({1}),
    2: frozenset({1, 2}),
    3: frozenset({1, 2, 3}),
    4: frozenset({1, 2, 3, 4}),
}
"""The producer versions a consumer of each version reads (its own among them). A new version adds its row and
keeps the others."""


def effective(version: int) -> int:
    """The version an engine stating `version` speaks (0, not stated: 1)."""
    return version or 1


def known(version: int) -> bool:
    """Whether this service knows how `version` pairs with the others."""
    return effective(version) in READS


def data_plane_mismatch(producer: int, consumer: int) -> str | None:
    """Why a consumer of data-plane version `consumer` cannot read what a producer of `producer` writes, or None."""
    p, c = effective(producer), effective(consumer)
    readable = READS.get(c, frozenset())
    if p in readable:
        return None
    reads = ", ".join(str(v) for v in sorted(readable)) or "none this server knows"
    return f"producer data-plane version {p}; consumer data-plane version {c} reads {reads}"


__all__ = ["DATA_PLANE_VERSION", "READS", "data_plane_mismatch", "effective", "known"]
