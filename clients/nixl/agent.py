"""`NixlEndpoint`: one NIXL agent with registered KV regions, its known peers and the transfers it posts.

NIXL agents are not thread-safe (this one is created without locking and without a progress thread): one
thread owns an endpoint and makes every call on it. Hand an endpoint to another thread only before that
thread starts using it, as `TransferWriter` does, and never call it from two threads.

Without a progress thread NIXL moves bytes only when its owner calls in, so both sides poll: the initiator
`poll`s each transfer it posted until it is done (a new connection and the notification advance only
then), and the target calls `get_notifications` steadily. On UCX over shm/tcp a WRITE does not complete
while the receiving agent sits idle.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from rendezvous.clients.nixl.errors import BlockRangeError, LayoutMismatchError, PeerError, TransferFailedError
from rendezvous.clients.nixl.regions import (
    BlockIds,
    DescriptorTable,
    memory_kind_of,
    nixl_memory_type,
    regions_from_tensors,
    registration_spans,
)
from rendezvous.protocol.enums import MemoryKind
from rendezvous.protocol.records import KvRegion
from rendezvous.protocol.records import NixlAgent as NixlAgentInfo

if TYPE_CHECKING:
    import torch

__all__ = ["NixlEndpoint", "PostedTransfer", "XferStatus"]

logger = logging.getLogger(__name__)


@functools.cache
def _nixl_api() -> tuple[Any, Any, tuple[type[Exception], ...]]:
    """nixl_agent, nixl_agent_config and the exceptions NIXL raises, imported on first use."""
    if "NIXL_LOG_LEVEL" not in os.environ:
        # NIXL logs every backend it instantiates at INFO, from Python and from C++; keep warnings and errors.
        os.environ["NIXL_LOG_LEVEL"] = "WARN"
        logging.getLogger("nixl").setLevel(logging.WARNING)
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    errors = tuple(getattr(_bindings, n) for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error"))
    return nixl_agent, nixl_agent_config, (RuntimeError, *errors)


Operation = Literal["WRITE", "READ"]


class XferStatus(StrEnum):
    """State of a posted transfer."""

    IN_PROGRESS = "PROC"
    DONE = "DONE"
    FAILED = "ERR"


@dataclass(eq=False)
class PostedTransfer:
    """A transfer this endpoint posted; poll it with `NixlEndpoint.poll`, then `NixlEndpoint.release` it."""

    peer: str
    status: XferStatus
    error: str | None = None
    _handle: Any = field(default=None, repr=False)


@dataclass(eq=False)
class _Peer:
    incarnation: int
    mem_type: str
    table: DescriptorTable | None  # None when its whole-block descriptors were not prepared
    dlist: Any


class NixlEndpoint:
    """One NIXL agent (UCX backend) that registered `regions` once and moves whole blocks of them.

    Peers are cached by (agent name, incarnation): the remote descriptor list is prepared once per peer
    incarnation, the local one once. Owned by one thread; see the module docstring.
    """

    def __init__(
        self,
        name: str,
        regions: Sequence[KvRegion],
        memory_kind: MemoryKind = MemoryKind.DRAM,
        *,
        backends: Sequence[str] = ("UCX",),
    ) -> None:
        self.name = name
        self.memory_kind = MemoryKind(memory_kind)
        self.table = DescriptorTable(regions)
        self._mem_type = nixl_memory_type(self.memory_kind)
        self._backends = list(backends)
        self._errors = _nixl_api()[2]
        self._agent: Any = None
        self._open()
        self._peers: dict[str, _Peer] = {}
        self._keepalive: tuple[object, ...] = ()

    def _open(self) -> None:
        """Create the NIXL agent (a UCX worker of its own), register the regions and prepare their descriptors."""
        nixl_agent, nixl_agent_config, _ = _nixl_api()
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=self._backends))
        self._registered = self._agent.register_memory(registration_spans(self.table.regions), self._mem_type)
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.table.descriptors(), self._mem_type)
        self._metadata: bytes = self._agent.get_agent_metadata()

    @classmethod
    def from_tensors(cls, name: str, tensors: Sequence[torch.Tensor]) -> NixlEndpoint:
        """An endpoint over one region per tensor (see `regions_from_tensors`); it keeps the tensors alive."""
        endpoint = cls(name, regions_from_tensors(tensors), memory_kind_of(tensors))
        endpoint._keepalive = tuple(tensors)
        return endpoint

    @property
    def regions(self) -> tuple[KvRegion, ...]:
        """The registered regions, in descriptor order."""
        return self.table.regions

    @property
    def metadata(self) -> bytes:
        """This agent's serialized NIXL metadata, which peers load to reach it."""
        return self._metadata

    def agent_info(self, rank: int = 0) -> NixlAgentInfo:
        """This agent as engines announce it to the rendezvous service."""
        return NixlAgentInfo(self.name, self._metadata, rank, self.memory_kind, self.table.regions)

    def peer_incarnation(self, name: str) -> int | None:
        """The incarnation of the cached peer `name`, or None when it is not cached."""
        peer = self._peers.get(name)
        return None if peer is None else peer.incarnation

    def has_blocks(self, name: str) -> bool:
        """Whether the cached peer `name` has its whole blocks prepared (see `add_peer`)."""
        peer = self._peers.get(name)
        return peer is not None and peer.table is not None

    def add_peer(self, agent: NixlAgentInfo, incarnation: int, *, whole_blocks: bool = True) -> bool:
        """Load a peer's metadata and prepare its descriptors; True if loaded, False if already cached.

        With `whole_blocks` the peer's regions must pair with ours region by region (`LayoutMismatchError`
        otherwise) and their blocks are prepared for `post`; without, only `post_descriptors` reaches the peer.
        A newer incarnation of a cached agent replaces it. Raises `PeerError` for an older incarnation or
        unreadable metadata.
        """
        agent_nixl = self._nixl()
        cached = self._peers.get(agent.name)
        if cached is not None:
            if incarnation == cached.incarnation:
                return False
            if incarnation < cached.incarnation:
                raise PeerError(f"agent {agent.name!r}: incarnation {incarnation} is older than {cached.incarnation}")
            self.remove_peer(agent.name)
        try:
            table = DescriptorTable(agent.regions) if whole_blocks else None
            mem_type = nixl_memory_type(agent.memory_kind)
        except ValueError as e:
            raise LayoutMismatchError(f"agent {agent.name!r}: {e}") from e
        if table is not None:
            self.table.check_pairs_with(table)
        try:
            loaded = agent_nixl.add_remote_agent(agent.metadata)
        except self._errors as e:
            raise PeerError(f"agent {agent.name!r}: unreadable metadata ({e})") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != agent.name:
            if loaded not in self._peers and loaded != self.name:
                agent_nixl.remove_remote_agent(loaded)
            raise PeerError(f"metadata announced as agent {agent.name!r} belongs to agent {loaded!r}")
        dlist = None
        if table is not None:
            try:
                dlist = agent_nixl.prep_xfer_dlist(agent.name, table.descriptors(), mem_type)
            except self._errors as e:
                agent_nixl.remove_remote_agent(agent.name)
                raise PeerError(f"agent {agent.name!r}: its regions are not registered in its metadata ({e})") from e
        self._peers[agent.name] = _Peer(incarnation, mem_type, table, dlist)
        return True

    def remove_peer(self, name: str) -> None:
        """Forget a peer: release its descriptors and disconnect. Its transfers must have finished."""
        peer = self._peers.pop(name, None)
        if peer is None:
            return
        agent = self._nixl()
        try:
            if peer.dlist is not None:
                agent.release_dlist_handle(peer.dlist)
            agent.remove_remote_agent(name)
        except self._errors as e:  # the peer is forgotten either way; NIXL keeps at worst a stale entry
            logger.warning("endpoint %s: removing peer %s: %s", self.name, name, e)

    def post(
        self,
        operation: Operation,
        peer: str,
        local_block_ids: BlockIds,
        remote_block_ids: BlockIds,
        notification: bytes = b"",
        *,
        regions: range | None = None,
    ) -> PostedTransfer:
        """Post a WRITE (local -> peer) or READ (peer -> local) of whole blocks in every region (or in `regions`).

        Block i of `local_block_ids` pairs with block i of `remote_block_ids`. `notification` reaches the
        peer once the bytes are there. Block ids are checked first: `BlockRangeError` (a ValueError) means
        nothing was posted. Raises `PeerError` for an unknown peer and `TransferFailedError` when NIXL
        refuses the transfer.
        """
        local_idx, remote_idx = self.indices(peer, local_block_ids, remote_block_ids, regions)
        if len(local_idx) == 0:
            raise BlockRangeError("a transfer needs at least one block")
        return self.post_indices(operation, peer, local_idx, remote_idx, notification)

    def indices(
        self, peer: str, local_block_ids: BlockIds, remote_block_ids: BlockIds, regions: range | None = None
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """The prepared descriptors (`post_indices`) of whole blocks in every region (or in `regions`), here and
        at `peer`. Raises `BlockRangeError` for ids outside the regions or lists of different lengths and
        `PeerError` for a peer without prepared blocks."""
        remote = self._prepared(peer)
        assert remote.table is not None
        local_idx = self.table.indices(local_block_ids, regions)
        remote_idx = remote.table.indices(remote_block_ids, regions)
        if len(local_idx) != len(remote_idx):
            raise BlockRangeError(f"{len(local_block_ids)} local blocks but {len(remote_block_ids)} remote")
        return local_idx, remote_idx

    def post_indices(
        self,
        operation: Operation,
        peer: str,
        local_indices: npt.NDArray[np.int32],
        remote_indices: npt.NDArray[np.int32],
        notification: bytes = b"",
    ) -> PostedTransfer:
        """Post a WRITE or READ of descriptors of the prepared lists by index: `local_indices[i]` of this
        endpoint's `table` pairs with `remote_indices[i]` of the peer's (`DescriptorTable.indices`, which
        checks the block ids; these are not checked again). One NIXL call makes the transfer, one posts it:
        the cheapest way to post. Raises `PeerError` for a peer without prepared blocks and
        `TransferFailedError` when NIXL refuses the transfer."""
        remote = self._prepared(peer)
        agent = self._nixl()
        return self._post(
            operation,
            peer,
            lambda: agent.make_prepped_xfer(
                operation, self._local_dlist, local_indices, remote.dlist, remote_indices, notification
            ),
        )

    def peer_table(self, peer: str) -> DescriptorTable:
        """The peer's whole blocks as prepared (`add_peer`), for indices into them (`post_indices`). Raises
        `PeerError` for a peer without prepared blocks."""
        table = self._prepared(peer).table
        assert table is not None
        return table

    def _prepared(self, peer: str) -> _Peer:
        remote = self._peers.get(peer)
        if remote is None or remote.table is None:
            raise PeerError(
                f"unknown peer agent {peer!r}" if remote is None else f"peer {peer!r} has no blocks prepared"
            )
        return remote

    def post_descriptors(
        self,
        operation: Operation,
        peer: str,
        local: npt.NDArray[np.uint64],
        remote: npt.NDArray[np.uint64],
        notification: bytes = b"",
    ) -> PostedTransfer:
        """Post a WRITE (local -> peer) or READ (peer -> local) of descriptor lists built for this transfer.

        `local[i]` pairs with `remote[i]`, Nx3 (address, length, device) rows inside the registered memory of
        each side (see `rendezvous.clients.nixl.plan`). Raises `PeerError` for an unknown peer and `TransferFailedError`
        when NIXL refuses the lists or the transfer.
        """
        agent = self._nixl()
        remote_peer = self._peers.get(peer)
        if remote_peer is None:
            raise PeerError(f"unknown peer agent {peer!r}")
        if len(local) == 0 or len(local) != len(remote):
            raise BlockRangeError(f"descriptor lists of {len(local)} and {len(remote)} rows")

        def make() -> Any:
            local_descs = agent.get_xfer_descs(local, self._mem_type)
            remote_descs = agent.get_xfer_descs(remote, remote_peer.mem_type)
            return agent.initialize_xfer(operation, local_descs, remote_descs, peer, notification)

        return self._post(operation, peer, make)

    def _post(self, operation: Operation, peer: str, make: Callable[[], Any]) -> PostedTransfer:
        handle = None
        try:
            handle = make()
            state = self._nixl().transfer(handle)
        except self._errors as e:
            if handle is not None:
                handle.release()
            raise TransferFailedError(f"{operation} to {peer!r} not posted: {e}") from e
        if state == "ERR":
            handle.release()
            raise TransferFailedError(f"{operation} to {peer!r} not posted")
        return PostedTransfer(peer, XferStatus(state), _handle=handle)

    def poll(self, transfer: PostedTransfer) -> XferStatus:
        """Progress NIXL and return the transfer's status; a failure's text goes to `transfer.error`."""
        if transfer.status is XferStatus.IN_PROGRESS:
            try:
                transfer.status = XferStatus(self._nixl().check_xfer_state(transfer._handle))
            except self._errors as e:
                transfer.status, transfer.error = XferStatus.FAILED, str(e) or type(e).__name__
            if transfer.status is XferStatus.FAILED and transfer.error is None:
                transfer.error = "NIXL reported the transfer failed"
        return transfer.status

    def release(self, transfer: PostedTransfer) -> None:
        """Free a transfer's handle. NIXL tries to cancel one still in progress and raises if it cannot."""
        try:
            transfer._handle.release()
        except self._errors as e:
            raise TransferFailedError(f"transfer to {transfer.peer!r} could not be released: {e}") from e

    def abandon(self, transfers: Sequence[PostedTransfer]) -> None:
        """Stop `transfers` (in progress) without moving any more of their bytes, and forget every peer.

        NIXL has no call for that: releasing a handle in progress first progresses the UCX worker (which sends what
        the peer's socket takes) and the cancel that follows leaves the rest of a started put queued, to go out the
        next time the worker is progressed; removing the peer closes its endpoint in flush mode, sending the rest.
        So the agent goes, its UCX worker with it (every connection closed, nothing flushed), and a new agent of the
        same name takes its place: the regions registered again, new metadata (`metadata`), no peer loaded (each is
        loaded again by `add_peer`). The handles are dropped unreleased (releasing one progresses the old worker).
        Measured in tests/dataplane/test_hung_peer.py."""
        for transfer in transfers:  # no reference to a handle may outlive this loop: it keeps the old agent alive
            if transfer._handle is not None:
                transfer._handle._released = True  # its finalizer would release it: progress, the bytes we stop
                transfer._handle = None
            if transfer.status is XferStatus.IN_PROGRESS:
                transfer.status, transfer.error = XferStatus.FAILED, "abandoned in flight"
        self._drop_agent(deregister=False)
        self._peers.clear()
        self._open()

    def _drop_agent(self, *, deregister: bool) -> None:
        """Release the peers' and the local descriptors (and deregister the regions), then drop the agent: with the
        last reference to it NIXL destroys it and its UCX worker. Nothing here progresses the worker."""
        agent, self._agent = self._agent, None
        try:
            for peer in self._peers.values():
                if peer.dlist is not None:
                    agent.release_dlist_handle(peer.dlist)
            agent.release_dlist_handle(self._local_dlist)
            if deregister:
                agent.deregister_memory(self._registered)
        except self._errors as e:
            logger.warning("endpoint %s: dropping its agent: %s", self.name, e)
        self._local_dlist = self._registered = None

    def get_notifications(self) -> dict[str, list[bytes]]:
        """Progress NIXL and return the notifications that arrived since the last call, by sender agent;
        raises `TransferFailedError` if NIXL raised doing so."""
        try:
            notifs: dict[str, list[bytes]] = self._nixl().get_new_notifs()
        except self._errors as e:
            raise TransferFailedError(f"NIXL could not read notifications: {e or type(e).__name__}") from e
        return notifs

    def close(self) -> None:
        """Forget every peer, deregister the regions and drop the agent. Transfers must have finished."""
        if self._agent is None:
            return
        for name in list(self._peers):
            self.remove_peer(name)
        self._drop_agent(deregister=True)
        self._keepalive = ()

    def _nixl(self) -> Any:
        if self._agent is None:
            raise RuntimeError(f"endpoint {self.name!r} is closed")
        return self._agent
