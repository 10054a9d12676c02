"""FakeNixlAgent: a FAKE of NIXL's `nixl._api.nixl_agent`, for agents that live in one process (no NIXL, no UCX).

The connector's worker half is unit-tested with it: `install(monkeypatch)` makes `rendezvous.clients.nixl.agent` build
these instead of real agents. A WRITE copies the bytes at once (`ctypes.memmove` between the registered CPU tensors of
the two agents) and queues its notification for the peer; a READ copies the other way. It checks what NIXL would
refuse here: memory outside what the agents registered, an unknown peer. It is not a model of NIXL's timing or
failures: tests/nixl and tests/dataplane run the real one.
"""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

_agents: dict[str, FakeNixlAgent] = {}
"""Every live fake agent by name: the "network" between them."""
_lock = threading.Lock()
"""Guards the notifications: a writer thread queues them while the peer's receiver thread takes them."""


class FakeNixlError(RuntimeError):
    """What the fake raises where NIXL would raise one of its errors."""


@dataclass
class FakeNixlConfig:
    enable_prog_thread: bool = True
    backends: list[str] = field(default_factory=list)


@dataclass
class _Dlist:
    agent: str
    rows: np.ndarray[Any, np.dtype[np.uint64]]


@dataclass
class _Xfer:
    operation: str
    local: list[tuple[int, int]]
    remote: list[tuple[int, int]]
    peer: str
    notification: bytes

    def release(self) -> None:
        pass


class FakeNixlAgent:
    """The calls of nixl_agent that clients/nixl makes, on CPU memory in this process."""

    def __init__(self, name: str, config: FakeNixlConfig) -> None:
        if name in _agents:
            raise FakeNixlError(f"agent {name!r} exists already")
        self.name = name
        self.registered: list[tuple[int, int]] = []
        self.peers: set[str] = set()
        self.notifications: defaultdict[str, list[bytes]] = defaultdict(list)
        _agents[name] = self

    # Memory and descriptors

    def register_memory(self, spans: Any, mem_type: str) -> list[tuple[int, int]]:
        registered = [(int(address), int(length)) for address, length, _ in np.asarray(spans, dtype=np.uint64)]
        self.registered += registered
        return registered

    def deregister_memory(self, spans: list[tuple[int, int]]) -> None:
        for span in spans:
            self.registered.remove(span)
        if not self.registered:
            _agents.pop(self.name, None)

    def prep_xfer_dlist(self, agent: str, descriptors: Any, mem_type: str) -> _Dlist:
        owner = self.name if agent == "NIXL_INIT_AGENT" else agent
        if owner != self.name and owner not in self.peers:
            raise FakeNixlError(f"unknown peer {owner!r}")
        return _Dlist(owner, np.asarray(descriptors, dtype=np.uint64).reshape(-1, 3))

    def get_xfer_descs(self, descriptors: Any, mem_type: str) -> np.ndarray[Any, np.dtype[np.uint64]]:
        return np.asarray(descriptors, dtype=np.uint64).reshape(-1, 3)

    def release_dlist_handle(self, dlist: _Dlist) -> None:
        pass

    # Peers

    def get_agent_metadata(self) -> bytes:
        return b"fake-nixl:" + self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        if not metadata.startswith(b"fake-nixl:"):
            raise FakeNixlError("not a fake agent's metadata")
        name = metadata.removeprefix(b"fake-nixl:").decode()
        self.peers.add(name)
        return name.encode()

    def remove_remote_agent(self, name: str) -> None:
        self.peers.discard(name)

    # Transfers

    def make_prepped_xfer(
        self, operation: str, local: _Dlist, local_idx: Any, remote: _Dlist, remote_idx: Any, notification: bytes
    ) -> _Xfer:
        rows = [(int(a), int(n)) for a, n, _ in local.rows[np.asarray(local_idx, dtype=np.int64)]]
        peer_rows = [(int(a), int(n)) for a, n, _ in remote.rows[np.asarray(remote_idx, dtype=np.int64)]]
        return _Xfer(operation, rows, peer_rows, remote.agent, notification)

    def initialize_xfer(self, operation: str, local: Any, remote: Any, peer: str, notification: bytes) -> _Xfer:
        rows = [(int(a), int(n)) for a, n, _ in local]
        peer_rows = [(int(a), int(n)) for a, n, _ in remote]
        return _Xfer(operation, rows, peer_rows, peer, notification)

    def transfer(self, xfer: _Xfer) -> str:
        peer = _agents.get(xfer.peer)
        if peer is None or xfer.peer not in self.peers:
            raise FakeNixlError(f"unknown peer {xfer.peer!r}")
        for (address, length), (peer_address, peer_length) in zip(xfer.local, xfer.remote, strict=True):
            if length != peer_length:
                raise FakeNixlError(f"descriptors of {length} and {peer_length} bytes")
            self._check(address, length)
            peer._check(peer_address, length)
            source, destination = (address, peer_address) if xfer.operation == "WRITE" else (peer_address, address)
            ctypes.memmove(destination, source, length)
        if xfer.notification:
            with _lock:
                peer.notifications[self.name].append(xfer.notification)
        return "DONE"

    def check_xfer_state(self, xfer: _Xfer) -> str:
        return "DONE"

    def send_notif(self, peer: str, notification: bytes) -> None:
        if peer not in self.peers or peer not in _agents:
            raise FakeNixlError(f"unknown peer {peer!r}")
        with _lock:
            _agents[peer].notifications[self.name].append(notification)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with _lock:
            notifications, self.notifications = dict(self.notifications), defaultdict(list)
        return notifications

    def _check(self, address: int, length: int) -> None:
        if not any(start <= address and address + length <= start + size for start, size in self.registered):
            raise FakeNixlError(f"agent {self.name!r}: {length} bytes at {address:#x} are not registered memory")


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """rendezvous.clients.nixl endpoints made from now on (until the test ends) get fake agents."""
    import rendezvous.clients.nixl.agent

    _agents.clear()
    monkeypatch.setattr(
        rendezvous.clients.nixl.agent, "_nixl_api", lambda: (FakeNixlAgent, FakeNixlConfig, (FakeNixlError,))
    )
