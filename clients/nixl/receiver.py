"""`TransferReceiver`: the consumer's side of the data plane.

It owns a `NixlEndpoint` over the destination regions. In push mode producers WRITE into them and
`poll_notifications` reports each notification entry that arrived (rendezvous.clients.nixl.notifications); in pull mode
the receiver READs a producer's blocks itself. Like the endpoint, a receiver belongs to one thread. Call
`poll_notifications` steadily while writes are expected: on UCX over shm/tcp a producer's WRITE only completes
while the receiving agent is polled.
"""

from __future__ import annotations

import logging
import time

from rendezvous.clients.nixl.agent import NixlEndpoint, PostedTransfer, XferStatus
from rendezvous.clients.nixl.errors import TransferFailedError
from rendezvous.clients.nixl.notifications import TransferNotification, parse_notification
from rendezvous.clients.nixl.polling import Backoff, PollConfig
from rendezvous.clients.nixl.regions import BlockIds
from rendezvous.protocol.records import NixlAgent as NixlAgentInfo

__all__ = ["TransferReceiver"]

logger = logging.getLogger(__name__)


class TransferReceiver:
    """Receives pushed transfers into an endpoint's regions and pulls transfers on demand."""

    def __init__(self, endpoint: NixlEndpoint, poll: PollConfig | None = None) -> None:
        self.endpoint = endpoint
        self.malformed_notifications = 0
        """How many notifications this data plane could not read (logged and dropped)."""
        self.failed_polls = 0
        """How many times NIXL raised reading notifications (logged; the next poll tries again)."""
        self._poll = poll or PollConfig()

    def agent_info(self, rank: int = 0) -> NixlAgentInfo:
        """The endpoint's identity for engine registration."""
        return self.endpoint.agent_info(rank)

    def poll_notifications(self) -> list[TransferNotification]:
        """Progress NIXL and return the transfer notifications that arrived since the last call. If NIXL raises
        (a peer's connection failing under it), none are returned this time and `failed_polls` counts it: the
        thread that polls goes on polling, as every write to this consumer depends on it."""
        received: list[TransferNotification] = []
        try:
            arrived = self.endpoint.get_notifications()
        except TransferFailedError:
            self.failed_polls += 1
            if self.failed_polls & (self.failed_polls - 1) == 0:  # the 1st, 2nd, 4th, 8th... failure
                logger.exception("receiver %s: poll %d failed", self.endpoint.name, self.failed_polls)
            return received
        for sender, payloads in arrived.items():
            for payload in payloads:
                try:
                    entries = parse_notification(sender, payload)
                except Exception:  # a peer's bytes must not end the thread that reads them: malformed
                    logger.exception("notification from %s could not be parsed", sender)
                    entries = None
                if entries is None:
                    self.malformed_notifications += 1
                    logger.warning("malformed notification from %s dropped: %r", sender, payload[:64])
                else:
                    received.extend(entries)
        return received

    def add_peer(self, agent: NixlAgentInfo, incarnation: int) -> bool:
        """Load a producer's metadata for pull mode (see `NixlEndpoint.add_peer`)."""
        return self.endpoint.add_peer(agent, incarnation)

    def remove_peer(self, name: str) -> None:
        """Forget a producer; its reads must have finished."""
        self.endpoint.remove_peer(name)

    def start_read(
        self, peer: str, src_block_ids: BlockIds, dst_block_ids: BlockIds, notification: bytes = b""
    ) -> PostedTransfer:
        """Post a READ of the peer's `src_block_ids` into our `dst_block_ids`; `notification` reaches the
        peer when it is done. Block ids are checked first (`BlockRangeError`: nothing was posted)."""
        return self.endpoint.post("READ", peer, dst_block_ids, src_block_ids, notification)

    def poll_read(self, read: PostedTransfer) -> bool:
        """True once the read is done (its handle released); raises `TransferFailedError` if it failed."""
        status = self.endpoint.poll(read)
        if status is XferStatus.IN_PROGRESS:
            return False
        self.endpoint.release(read)
        if status is XferStatus.FAILED:
            raise TransferFailedError(f"READ from {read.peer!r} failed: {read.error}")
        return True

    def read(
        self,
        peer: str,
        src_block_ids: BlockIds,
        dst_block_ids: BlockIds,
        *,
        notification: bytes = b"",
        timeout: float | None = None,
    ) -> None:
        """READ and wait for it. On timeout NIXL is asked to cancel and `TimeoutError` is raised."""
        read = self.start_read(peer, src_block_ids, dst_block_ids, notification)
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff(self._poll)
        while not self.poll_read(read):
            if deadline is not None and time.monotonic() >= deadline:
                try:
                    self.endpoint.release(read)
                except TransferFailedError:
                    logger.exception("endpoint %s: a READ that timed out could not be cancelled", self.endpoint.name)
                raise TimeoutError(f"READ from {peer!r} did not finish in {timeout} s")
            time.sleep(backoff.next())

    def close(self) -> None:
        """Close the endpoint. Reads must have finished."""
        self.endpoint.close()
