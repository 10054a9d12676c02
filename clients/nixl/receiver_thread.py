"""`ReceiverThread`: the consumer's background thread, the one thread that owns its `TransferReceiver`.

It polls NIXL notifications steadily (a producer's WRITE only completes while the receiving agent is polled
on UCX shm/tcp) and runs pull-mode READs. Other threads hand it commands (`read`, `forget_peer`) and say
whether writes are expected (`set_expecting`): then it polls under `PollConfig`, otherwise every
`idle_wait_s`. Results come back through callbacks, which run on this thread: keep them short.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from rendezvous.clients._types import NixlAgentInfo
from rendezvous.clients.nixl.agent import PostedTransfer
from rendezvous.clients.nixl.errors import DataPlaneError
from rendezvous.clients.nixl.notifications import TransferNotification
from rendezvous.clients.nixl.polling import Backoff, PollConfig
from rendezvous.clients.nixl.receiver import TransferReceiver
from rendezvous.clients.nixl.regions import BlockIds

__all__ = ["OnNotifications", "OnReadDone", "ReceiverThread"]

logger = logging.getLogger(__name__)

OnNotifications = Callable[[list[TransferNotification]], None]
"""on_notifications(notifications): transfer notifications that arrived, in order."""
OnReadDone = Callable[[str, int, bool, str | None], None]
"""on_read_done(transfer_id, generation, ok, error): a pull-mode READ finished or could not start."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Read:
    transfer_id: str
    generation: int
    agent: NixlAgentInfo
    incarnation: int
    src: BlockIds
    dst: BlockIds


@dataclasses.dataclass(frozen=True, slots=True)
class _ForgetPeer:
    name: str


class _Stop:
    pass


_Command = _Read | _ForgetPeer | _Stop


class ReceiverThread:
    """Polls a `TransferReceiver` for notifications and runs its READs, on one background thread."""

    def __init__(
        self,
        receiver: TransferReceiver,
        *,
        on_notifications: OnNotifications,
        on_read_done: OnReadDone,
        poll: PollConfig | None = None,
        idle_wait_s: float = 0.005,
    ) -> None:
        self._receiver = receiver
        self._on_notifications = on_notifications
        self._on_read_done = on_read_done
        self._poll = poll or PollConfig()
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._expecting = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nixl-receiver-{receiver.endpoint.name}", daemon=True)
        # Owned by the thread:
        self._reads: list[tuple[_Read, PostedTransfer]] = []
        self._waiting: list[_Read] = []  # for a new peer incarnation while reads from the old one drain
        self._forget: set[str] = set()

    def agent_info(self, rank: int = 0) -> NixlAgentInfo:
        """The endpoint's identity for engine registration (immutable data; safe from any thread)."""
        return self._receiver.agent_info(rank)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> bool:
        """Stop: reads in flight are awaited for up to `timeout`, then the endpoint is closed."""
        self._commands.put(_Stop())
        if self._thread.ident is None:
            self._receiver.close()
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def set_expecting(self, expecting: bool) -> None:
        """Whether pushed writes are expected (poll fast) or not (poll every `idle_wait_s`)."""
        if expecting:
            self._expecting.set()
        else:
            self._expecting.clear()

    def read(
        self, transfer_id: str, generation: int, agent: NixlAgentInfo, incarnation: int, src: BlockIds, dst: BlockIds
    ) -> None:
        """READ the peer's `src` blocks into our `dst` blocks; `on_read_done` reports the outcome."""
        self._commands.put(_Read(transfer_id, generation, agent, incarnation, src, dst))

    def forget_peer(self, name: str) -> None:
        """Drop a producer's metadata once no read from it is in flight."""
        self._commands.put(_ForgetPeer(name))

    # Everything below runs on the thread.

    def _run(self) -> None:
        backoff = Backoff(self._poll)
        try:
            while True:
                busy = bool(self._reads) or self._expecting.is_set()
                command = self._next(backoff.wait if busy else self._idle_wait_s)
                progressed = False
                while command is not None:
                    if isinstance(command, _Stop):
                        self._drain()
                        return
                    self._handle(command)
                    progressed = True
                    command = self._next(0.0)
                progressed = self._progress() or progressed
                if progressed:
                    backoff.reset()
                else:
                    backoff.next()
        finally:
            if self._reads:
                logger.error(
                    "receiver %s: %d reads still in flight at stop", self._receiver.endpoint.name, len(self._reads)
                )
            else:
                self._receiver.close()

    def _next(self, wait: float) -> _Command | None:
        try:
            return self._commands.get_nowait() if wait == 0.0 else self._commands.get(timeout=wait)
        except queue.Empty:
            return None

    def _handle(self, command: _Command) -> None:
        if isinstance(command, _Read):
            self._start_read(command)
        elif isinstance(command, _ForgetPeer):
            self._forget.add(command.name)
            self._settle_peer(command.name)

    def _reading_from(self, name: str) -> bool:
        return any(read.agent.name == name for read, _ in self._reads)

    def _settle_peer(self, name: str) -> None:
        """Once reads from `name` drained: forget it if asked, then start reads waiting for it."""
        if self._reading_from(name):
            return
        if name in self._forget:
            self._forget.discard(name)
            self._receiver.remove_peer(name)
        waiting = [r for r in self._waiting if r.agent.name == name]
        self._waiting = [r for r in self._waiting if r.agent.name != name]
        for read in waiting:
            self._start_read(read)

    def _start_read(self, read: _Read) -> None:
        name = read.agent.name
        endpoint = self._receiver.endpoint
        try:
            if endpoint.peer_incarnation(name) != read.incarnation or name in self._forget:
                if self._reading_from(name):
                    self._waiting.append(read)
                    return
                if name in self._forget:
                    self._forget.discard(name)
                    self._receiver.remove_peer(name)
                self._receiver.add_peer(read.agent, read.incarnation)
            posted = self._receiver.start_read(name, read.src, read.dst)
        except DataPlaneError as e:
            self._emit(self._on_read_done, read.transfer_id, read.generation, False, str(e))
            return
        self._reads.append((read, posted))

    def _progress(self) -> bool:
        progressed = False
        notifications = self._receiver.poll_notifications()
        if notifications:
            self._emit(self._on_notifications, notifications)
            progressed = True
        still: list[tuple[_Read, PostedTransfer]] = []
        finished: list[str] = []
        for read, posted in self._reads:
            try:
                if not self._receiver.poll_read(posted):
                    still.append((read, posted))
                    continue
                self._emit(self._on_read_done, read.transfer_id, read.generation, True, None)
            except DataPlaneError as e:
                self._emit(self._on_read_done, read.transfer_id, read.generation, False, str(e))
            finished.append(read.agent.name)
        self._reads = still
        for name in set(finished):
            self._settle_peer(name)
        return progressed or bool(finished)

    def _drain(self, timeout: float = 10.0) -> None:
        backoff = Backoff(self._poll)
        deadline = time.monotonic() + timeout
        while self._reads and time.monotonic() < deadline:
            if self._progress():
                backoff.reset()
            else:
                time.sleep(backoff.next())

    def _emit(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            logger.exception("receiver %s: callback %s raised", self._receiver.endpoint.name, callback)
