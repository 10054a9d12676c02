"""The NIXL notification that accompanies a transfer's bytes: "<transfer_id>:<generation>" in UTF-8.

A consumer uses it to learn that the blocks of one generation of a transfer have landed, and ignores a
notification for a generation it no longer expects (fencing). Transfer ids may contain ':'; the generation
is what follows the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransferNotification", "encode_notification", "parse_notification"]


@dataclass(frozen=True, slots=True)
class TransferNotification:
    """A transfer notification received from agent `sender`."""

    sender: str
    transfer_id: str
    generation: int


def encode_notification(transfer_id: str, generation: int) -> bytes:
    """The notification payload for one generation of a transfer."""
    return f"{transfer_id}:{generation}".encode()


def parse_notification(sender: str, payload: bytes) -> TransferNotification | None:
    """The notification in `payload`, or None when it is not "<transfer_id>:<generation>"."""
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        return None
    transfer_id, sep, generation = text.rpartition(":")
    if not sep or not transfer_id or not generation.isdigit() or not generation.isascii():
        return None
    return TransferNotification(sender, transfer_id, int(generation))
