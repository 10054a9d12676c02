"""The NIXL notification that accompanies a transfer's bytes: "<version> <transfer_id>:<generation>" in UTF-8, or
"<version> <transfer_id>:<generation>/<writers>" when several producer ranks write into the same consumer rank.

<version> is the data-plane version that wrote it (rendezvous.protocol.dataplane); transfer ids hold no
whitespace, so the untagged form of version 1 ("<transfer_id>:<generation>[/<writers>]") reads too.

A consumer uses it to learn that the blocks of one generation of a transfer have landed (from every one of
`writers` senders; 0 = unknown: wait for TRANSFER_COMMITTED), and ignores a notification for a generation it
no longer expects (fencing). Transfer ids may contain ':'; the generation is what follows the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.protocol.dataplane import DATA_PLANE_VERSION, READS

__all__ = ["TransferNotification", "encode_notification", "parse_notification"]


@dataclass(frozen=True, slots=True)
class TransferNotification:
    """A transfer notification received from agent `sender`."""

    sender: str
    transfer_id: str
    generation: int
    writers: int = 1
    """Producer ranks whose notifications together say the consumer rank's blocks have landed (0 = unknown)."""


_TAG = f"{DATA_PLANE_VERSION} "


def encode_notification(transfer_id: str, generation: int, writers: int = 1) -> bytes:
    """The notification payload for one generation of a transfer, written by `writers` producer ranks."""
    suffix = "" if writers == 1 else f"/{writers}"
    return f"{_TAG}{transfer_id}:{generation}{suffix}".encode()


def parse_notification(sender: str, payload: bytes) -> TransferNotification | None:
    """The notification in `payload`, or None when it is not one of a version this data plane reads."""
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return None
    version, space, rest = text.partition(" ")
    if space:
        if not _number(version) or int(version) not in READS[DATA_PLANE_VERSION]:
            return None
        text = rest
    transfer_id, sep, tail = text.rpartition(":")
    generation, slash, writers = tail.partition("/")
    if not sep or not transfer_id or not _number(generation) or (slash and not _number(writers)):
        return None
    return TransferNotification(sender, transfer_id, int(generation), int(writers) if slash else 1)


def _number(text: str) -> bool:
    return text.isdigit() and text.isascii()
