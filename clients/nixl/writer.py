"""`TransferWriter`: the producer's background writer, one thread that owns a `NixlEndpoint`.

Other threads hand it commands (thread-safe, non-blocking): `assign` (a consumer's destination blocks for one
generation of a transfer), `source_ready` (the producer's computed blocks), `revoke`, `abort` and
`forget_peer`. Once a transfer has both an assignment and its source blocks the writer WRITEs them, with the
notification "<transfer_id>:<generation>", and polls until NIXL is done. The endpoint belongs to the writer
from construction on. Outcomes come back through callbacks, which run on the writer thread: keep them short.

Outcomes, per transfer:

- every assignment ends in exactly one `on_complete` or `on_revoked`, unless a newer generation of the same
  transfer replaces it before it started;
- a bad assignment (block id out of range, regions that do not pair, unreadable metadata, a stale peer
  incarnation, fewer source than destination blocks) fails through `on_complete(ok=False)` without writing;
  so does a write that NIXL reports failed (the peer died), after it was posted;
- the LAST `len(dst)` source blocks go to the destination (the consumer may hold a prefix already); an empty
  destination completes at once;
- `on_source_free` tells the engine it may reuse the source blocks: after a successful write, on abort (once
  a write in flight has drained) or at stop. A revoked or failed generation keeps the source for a later
  generation until the transfer is aborted;
- a transfer that succeeded or was aborted has ended: a late `source_ready` is freed at once, a late
  `revoke` acknowledged at once, a late `assign` ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from clients._types import NixlAgentInfo
from clients.nixl.agent import NixlEndpoint, PostedTransfer, XferStatus
from clients.nixl.errors import DataPlaneError, TransferFailedError
from clients.nixl.notifications import encode_notification
from clients.nixl.polling import Backoff, PollConfig
from clients.nixl.regions import BlockIds, DescriptorTable

__all__ = ["OnComplete", "OnRevoked", "OnSourceFree", "TransferWriter", "WriterConfig"]

logger = logging.getLogger(__name__)

OnComplete = Callable[[str, int, bool, str | None], None]
"""on_complete(transfer_id, generation, ok, error): the WRITE of a generation finished or could not start."""
OnRevoked = Callable[[str, int], None]
"""on_revoked(transfer_id, generation): the generation will not be written (any write of it has drained)."""
OnSourceFree = Callable[[str], None]
"""on_source_free(transfer_id): the engine may free the transfer's source blocks."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriterConfig:
    """Tuning of a `TransferWriter`."""

    poll: PollConfig = dataclasses.field(default_factory=PollConfig)
    """Waits between polls while writes are in flight (idle, the thread blocks on its queue)."""
    drain_timeout_s: float = 10.0
    """How long `stop` lets writes in flight finish."""
    ended_transfers_kept: int = 65536
    """Ids of finished and aborted transfers remembered, so late commands for them are answered."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Assign:
    transfer_id: str
    generation: int
    agent: NixlAgentInfo
    incarnation: int
    dst: npt.NDArray[Any]  # checked against the peer's regions on the writer thread


@dataclasses.dataclass(frozen=True, slots=True)
class _SourceReady:
    transfer_id: str
    src: npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True, slots=True)
class _Revoke:
    transfer_id: str
    generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Abort:
    transfer_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class _ForgetPeer:
    name: str
    incarnation: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Barrier:
    done: threading.Event


@dataclasses.dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Assign | _SourceReady | _Revoke | _Abort | _ForgetPeer | _Barrier | _Stop


@dataclasses.dataclass(eq=False)
class _Write:
    generation: int
    transfer: PostedTransfer
    revoked: bool = False
    aborted: bool = False


@dataclasses.dataclass(eq=False)
class _Transfer:
    assignment: _Assign | None = None
    source: npt.NDArray[np.int64] | None = None
    write: _Write | None = None
    fence: int = -1  # highest revoked generation: never write it or an older one

    @property
    def idle(self) -> bool:
        return self.assignment is None and self.source is None and self.write is None


class TransferWriter:
    """The background writer thread of one producer rank. Commands may be queued before `start`."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        *,
        on_complete: OnComplete,
        on_revoked: OnRevoked,
        on_source_free: OnSourceFree,
        config: WriterConfig | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._on_complete = on_complete
        self._on_revoked = on_revoked
        self._on_source_free = on_source_free
        self._config = config or WriterConfig()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"nixl-writer-{endpoint.name}", daemon=True)
        # Owned by the writer thread:
        self._transfers: dict[str, _Transfer] = {}
        self._in_flight: dict[str, _Write] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._forget: set[str] = set()

    def agent_info(self, rank: int = 0) -> NixlAgentInfo:
        """The endpoint's identity for engine registration (immutable data; safe from any thread)."""
        return self._endpoint.agent_info(rank)

    def start(self) -> None:
        """Start the writer thread."""
        if self._stopped:
            raise RuntimeError(f"writer {self._endpoint.name!r} is stopped")
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop after the commands queued so far: fail assignments not started, let writes in flight drain,
        free held sources, close the endpoint, and join. False if the thread still runs after `timeout`."""
        if not self._stopped:
            self._stopped = True
            self._commands.put(_Stop())
            if self._thread.ident is None:  # never started: handle the queued commands here, then shut down
                self._run()
        if self._thread.ident is None:
            return True
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> TransferWriter:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def assign(
        self, transfer_id: str, generation: int, agent: NixlAgentInfo, incarnation: int, dst_block_ids: BlockIds
    ) -> None:
        """Write generation `generation` of a transfer into `dst_block_ids` of `agent` (incarnation
        `incarnation`) once its source is ready. A newer generation replaces an older one not yet started."""
        self._put(_Assign(transfer_id, generation, agent, incarnation, np.array(dst_block_ids)))

    def source_ready(self, transfer_id: str, src_block_ids: BlockIds) -> None:
        """The transfer's KV is computed in `src_block_ids`. Raises `BlockRangeError` for ids outside the
        endpoint's regions (checked here, in the caller's thread)."""
        src = self._endpoint.table.check_block_ids(src_block_ids).copy()
        self._put(_SourceReady(transfer_id, src))

    def revoke(self, transfer_id: str, generation: int) -> None:
        """Do not write `generation` (or older); `on_revoked` acknowledges once no write of it can land."""
        self._put(_Revoke(transfer_id, generation))

    def abort(self, transfer_id: str) -> None:
        """The transfer ended without success: drop it and free its source once no write is in flight."""
        self._put(_Abort(transfer_id))

    def forget_peer(self, agent_name: str, incarnation: int | None = None) -> None:
        """The peer (up to `incarnation`, or any) is gone: fail its assignments not started and drop its
        metadata once its writes drain. Assignments to a newer incarnation are kept."""
        self._put(_ForgetPeer(agent_name, incarnation))

    def barrier(self, timeout: float | None = None) -> bool:
        """Wait until every command queued before this call was handled (and its immediate callbacks ran)."""
        done = threading.Event()
        self._put(_Barrier(done))
        return done.wait(timeout)

    def _put(self, command: _Command) -> None:
        if self._stopped:
            raise RuntimeError(f"writer {self._endpoint.name!r} is stopped")
        self._commands.put(command)

    # Everything below runs on the writer thread.

    def _run(self) -> None:
        backoff = Backoff(self._config.poll)
        while True:
            command = self._next_command(backoff.wait if self._in_flight else None)
            progressed = False
            while command is not None:
                if isinstance(command, _Stop):
                    self._shutdown()
                    return
                self._handle(command)
                progressed = True
                command = self._next_command(0.0)
            try:
                progressed = self._poll_writes() or progressed
            except Exception:
                logger.exception("writer %s: failed to finish a write", self._endpoint.name)
            if progressed:
                backoff.reset()
            else:
                backoff.next()

    def _next_command(self, wait: float | None) -> _Command | None:
        try:
            if wait == 0.0:
                return self._commands.get_nowait()
            return self._commands.get(timeout=wait)
        except queue.Empty:
            return None

    def _handle(self, command: _Command) -> None:
        try:
            match command:
                case _Assign():
                    self._assign(command)
                case _SourceReady():
                    self._source_ready(command)
                case _Revoke():
                    self._revoke(command.transfer_id, command.generation)
                case _Abort():
                    self._abort(command.transfer_id)
                case _ForgetPeer():
                    self._forget_peer(command.name, command.incarnation)
                case _Barrier():
                    command.done.set()
        except Exception:
            logger.exception("writer %s: failed to handle %r", self._endpoint.name, command)

    def _assign(self, a: _Assign) -> None:
        if a.transfer_id in self._ended:
            logger.debug("assignment of ended transfer %s ignored", a.transfer_id)
            return
        t = self._transfers.setdefault(a.transfer_id, _Transfer())
        newest = max([t.fence, *(x.generation for x in (t.assignment, t.write) if x is not None)])
        if a.generation <= newest:
            logger.debug("stale or repeated assignment %s:%d ignored", a.transfer_id, a.generation)
            return
        try:
            peer_table = DescriptorTable(a.agent.regions)
            self._endpoint.table.check_pairs_with(peer_table)
            dst = peer_table.check_block_ids(a.dst)
        except ValueError as e:  # BlockRangeError and LayoutMismatchError are ValueErrors
            self._emit(self._on_complete, a.transfer_id, a.generation, False, str(e))
            self._drop_if_idle(a.transfer_id, t)
            return
        t.assignment = dataclasses.replace(a, dst=dst)
        self._try_write(a.transfer_id, t)

    def _source_ready(self, s: _SourceReady) -> None:
        if s.transfer_id in self._ended:
            self._emit(self._on_source_free, s.transfer_id)
            return
        t = self._transfers.setdefault(s.transfer_id, _Transfer())
        t.source = s.src
        self._try_write(s.transfer_id, t)

    def _revoke(self, transfer_id: str, generation: int) -> None:
        t = self._transfers.get(transfer_id)
        if t is None:
            self._emit(self._on_revoked, transfer_id, generation)
            return
        t.fence = max(t.fence, generation)
        if t.assignment is not None and t.assignment.generation <= generation:
            t.assignment = None
        if t.write is not None and t.write.generation == generation:
            t.write.revoked = True  # acknowledged when the write drains
        else:
            self._emit(self._on_revoked, transfer_id, generation)
        self._drop_if_idle(transfer_id, t)

    def _abort(self, transfer_id: str) -> None:
        self._remember_ended(transfer_id)
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        t.assignment = None
        if t.write is not None:
            t.write.aborted = True  # the source is freed when the write drains
        else:
            self._end(transfer_id, t)

    def _forget_peer(self, name: str, incarnation: int | None) -> None:
        def lost(inc: int) -> bool:
            return incarnation is None or inc <= incarnation

        for transfer_id, t in list(self._transfers.items()):
            a = t.assignment
            if a is not None and a.agent.name == name and lost(a.incarnation):
                t.assignment = None
                self._emit(self._on_complete, transfer_id, a.generation, False, f"peer agent {name!r} is gone")
                self._drop_if_idle(transfer_id, t)
        cached = self._endpoint.peer_incarnation(name)
        if cached is None or not lost(cached):
            return
        if self._writing_to(name):
            self._forget.add(name)
        else:
            self._endpoint.remove_peer(name)

    def _connect(self, a: _Assign) -> bool:
        """Make the assignment's peer incarnation current; False while writes to that agent must drain first."""
        name = a.agent.name
        if self._endpoint.peer_incarnation(name) == a.incarnation and name not in self._forget:
            return True
        if self._writing_to(name):
            return False
        if name in self._forget:
            self._forget.discard(name)
            self._endpoint.remove_peer(name)
        self._endpoint.add_peer(a.agent, a.incarnation)
        return True

    def _try_write(self, transfer_id: str, t: _Transfer) -> None:
        a = t.assignment
        if a is None or t.write is not None:
            return
        try:
            connected = self._connect(a)  # early, even before the source is ready: off the critical path
        except DataPlaneError as e:
            t.assignment = None
            self._emit(self._on_complete, transfer_id, a.generation, False, str(e))
            self._drop_if_idle(transfer_id, t)
            return
        if not connected or t.source is None:
            return
        t.assignment = None
        n = len(a.dst)
        if n == 0:
            self._emit(self._on_complete, transfer_id, a.generation, True, None)
            self._end(transfer_id, t)
            return
        if len(t.source) < n:
            error = f"{n} destination blocks but only {len(t.source)} source blocks"
            self._emit(self._on_complete, transfer_id, a.generation, False, error)
            return
        try:
            src, notification = t.source[len(t.source) - n :], encode_notification(transfer_id, a.generation)
            posted = self._endpoint.post("WRITE", a.agent.name, src, a.dst, notification)
        except DataPlaneError as e:
            self._emit(self._on_complete, transfer_id, a.generation, False, str(e))
            return
        t.write = self._in_flight[transfer_id] = _Write(a.generation, posted)
        if posted.status is not XferStatus.IN_PROGRESS:
            self._finish_write(transfer_id)

    def _poll_writes(self) -> bool:
        poll = self._endpoint.poll
        done = [tid for tid, w in self._in_flight.items() if poll(w.transfer) is not XferStatus.IN_PROGRESS]
        for transfer_id in done:
            self._finish_write(transfer_id)
        return bool(done)

    def _finish_write(self, transfer_id: str) -> None:
        w = self._in_flight.pop(transfer_id)
        t = self._transfers[transfer_id]
        t.write = None
        try:
            self._endpoint.release(w.transfer)
        except TransferFailedError:
            logger.exception("writer %s: releasing the write of %s failed", self._endpoint.name, transfer_id)
        ok = w.transfer.status is XferStatus.DONE
        if w.revoked:
            self._emit(self._on_revoked, transfer_id, w.generation)
        elif not w.aborted:
            self._emit(self._on_complete, transfer_id, w.generation, ok, w.transfer.error)
        if w.aborted or (ok and not w.revoked and t.assignment is None):
            self._end(transfer_id, t)
        else:
            self._try_write(transfer_id, t)
        self._after_drain(w.transfer.peer)

    def _after_drain(self, peer: str) -> None:
        if self._writing_to(peer):
            return
        if peer in self._forget:
            self._forget.discard(peer)
            self._endpoint.remove_peer(peer)
        for transfer_id, t in list(self._transfers.items()):
            if t.assignment is not None and t.assignment.agent.name == peer:
                self._try_write(transfer_id, t)

    def _writing_to(self, peer: str) -> bool:
        return any(w.transfer.peer == peer for w in self._in_flight.values())

    def _end(self, transfer_id: str, t: _Transfer) -> None:
        del self._transfers[transfer_id]
        self._remember_ended(transfer_id)
        if t.source is not None:
            self._emit(self._on_source_free, transfer_id)

    def _remember_ended(self, transfer_id: str) -> None:
        self._ended[transfer_id] = None
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > self._config.ended_transfers_kept:
            self._ended.popitem(last=False)

    def _drop_if_idle(self, transfer_id: str, t: _Transfer) -> None:
        if t.idle and self._transfers.get(transfer_id) is t:
            del self._transfers[transfer_id]

    def _shutdown(self) -> None:
        for transfer_id, t in self._transfers.items():
            if t.assignment is not None:
                self._emit(self._on_complete, transfer_id, t.assignment.generation, False, "writer stopped")
                t.assignment = None
        self._drain()
        for transfer_id, t in list(self._transfers.items()):
            if t.write is None:
                self._end(transfer_id, t)
        self._release_barriers()
        if self._in_flight:
            logger.error("writer %s: %d writes still in flight at stop", self._endpoint.name, len(self._in_flight))
            return  # their memory may still be read: keep it registered
        self._endpoint.close()

    def _drain(self) -> None:
        backoff = Backoff(self._config.poll)
        deadline = time.monotonic() + self._config.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            if self._poll_writes():
                backoff.reset()
            else:
                time.sleep(backoff.next())

    def _release_barriers(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Barrier):
                command.done.set()

    def _emit(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            logger.exception("writer %s: callback %s%r raised", self._endpoint.name, callback, args)
