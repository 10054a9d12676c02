"""A NIXL peer in a separate (spawned) process, driven over a pipe, and its parent-side proxy.

The child hosts any number of endpoints over numpy buffers filled with a sentinel byte. It progresses an
endpoint only while it runs a command, like a real engine that polls between steps; `wait_notifications`
is the command that keeps it polling until the expected notifications arrive.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

SENTINEL = 0xA5


@dataclass(frozen=True)
class Layout:
    """Regions of `num_blocks` blocks of `block_lengths[r]` bytes.

    Separate: one buffer per region, block stride = length + `pad` (the pad bytes must never change).
    Interleaved: one buffer whose row b holds block b of regions 0..R-1 back to back, so the regions'
    memory spans overlap.
    """

    block_lengths: tuple[int, ...]
    num_blocks: int
    pad: int = 0
    interleaved: bool = False


class _Host:
    def __init__(self) -> None:
        self.endpoints: dict[str, tuple[Any, Layout, list[npt.NDArray[np.uint8]]]] = {}

    def create(self, name: str, layout: Layout) -> Any:
        from rendezvous.clients.nixl import KvRegion, NixlEndpoint, TransferReceiver

        lengths, nb = layout.block_lengths, layout.num_blocks
        if layout.interleaved:
            row = sum(lengths)
            buffers = [np.full(nb * row, SENTINEL, dtype=np.uint8)]
            starts = buffers[0].ctypes.data + np.cumsum((0, *lengths[:-1]))
            regions = [KvRegion(int(s), row, n, nb) for s, n in zip(starts, lengths, strict=True)]
        else:
            buffers = [np.full(nb * (n + layout.pad), SENTINEL, dtype=np.uint8) for n in lengths]
            regions = [KvRegion(b.ctypes.data, n + layout.pad, n, nb) for b, n in zip(buffers, lengths, strict=True)]
        receiver = TransferReceiver(NixlEndpoint(name, regions))
        self.endpoints[name] = (receiver, layout, buffers)
        return receiver.agent_info()

    def fill_random(self, name: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for buf in self.endpoints[name][2]:
            buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)

    def blocks(self, name: str) -> list[npt.NDArray[np.uint8]]:
        """Per region, a [num_blocks, stride] copy of its memory (the interleaved buffer split by region)."""
        _, layout, buffers = self.endpoints[name]
        if not layout.interleaved:
            return [b.reshape(layout.num_blocks, -1).copy() for b in buffers]
        rows = buffers[0].reshape(layout.num_blocks, -1)
        offsets = np.cumsum((0, *layout.block_lengths))
        return [rows[:, offsets[i] : offsets[i + 1]].copy() for i in range(len(layout.block_lengths))]

    def wait_notifications(self, name: str, count: int, timeout: float) -> tuple[list[Any], int]:
        """Poll until `count` transfer notifications arrived or `timeout` passed; also the malformed count."""
        receiver = self.endpoints[name][0]
        received: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(received) < count and time.monotonic() < deadline:
            new = receiver.poll_notifications()
            received.extend(new)
            if not new:
                time.sleep(50e-6)
        return received, receiver.malformed_notifications

    def wait_landed(
        self, name: str, expected: list[npt.NDArray[np.uint8]], timeout: float, notifications: int = 0
    ) -> tuple[bool, list[Any]]:
        """Poll until the regions hold `expected` (as `blocks` returns them) and at least `notifications`
        transfer notifications arrived, or `timeout` passed: whether they do, and the notifications that
        arrived meanwhile (a notification may come a poll after the bytes it follows are visible)."""
        receiver = self.endpoints[name][0]
        received: list[Any] = []
        deadline = time.monotonic() + timeout
        while True:
            received.extend(receiver.poll_notifications())
            landed = all(np.array_equal(b, e) for b, e in zip(self.blocks(name), expected, strict=True))
            if landed and len(received) >= notifications:
                return True, received
            if time.monotonic() >= deadline:
                return False, received
            time.sleep(50e-6)

    def pending_notifications(self, name: str) -> list[Any]:
        """The transfer notifications that arrived since the last poll (one poll, no waiting)."""
        return list(self.endpoints[name][0].poll_notifications())

    def wait_all(self, counts: dict[str, int], timeout: float) -> dict[str, list[Any]]:
        """Poll every named endpoint until each got its count of notifications or `timeout` passed."""
        received: dict[str, list[Any]] = {name: [] for name in counts}
        deadline = time.monotonic() + timeout
        while any(len(received[n]) < c for n, c in counts.items()) and time.monotonic() < deadline:
            new = 0
            for name in counts:
                got = self.endpoints[name][0].poll_notifications()
                received[name].extend(got)
                new += len(got)
            if not new:
                time.sleep(50e-6)
        return received

    def add_peer(self, name: str, agent: Any, incarnation: int) -> bool:
        return bool(self.endpoints[name][0].add_peer(agent, incarnation))

    def write(self, name: str, peer: str, src: list[int], dst: list[int], notification: bytes, timeout: float) -> str:
        """WRITE and poll until it finished; its final status ("DONE", "ERR", or "PROC" on timeout)."""
        endpoint = self.endpoints[name][0].endpoint
        posted = endpoint.post("WRITE", peer, src, dst, notification)
        deadline = time.monotonic() + timeout
        while endpoint.poll(posted).value == "PROC" and time.monotonic() < deadline:
            time.sleep(50e-6)
        endpoint.release(posted)
        return str(posted.status.value)

    def close(self, name: str) -> None:
        self.endpoints.pop(name)[0].close()


def _serve(conn: Connection) -> None:
    import rendezvous.clients.nixl  # noqa: F401  (NIXL and torch load here, before the parent's first call is timed)

    host = _Host()
    conn.send((0, "ok", "ready"))
    while True:
        request = conn.recv()
        if request is None:
            return
        seq, command, args = request
        try:
            conn.send((seq, "ok", getattr(host, command)(*args)))
        except Exception:
            conn.send((seq, "error", traceback.format_exc()))


STARTUP_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 30.0
"""Only a failing test waits this long; a loaded 2-core machine can take over 10 s to register memory."""


class PeerProcess:
    """Parent-side proxy of a spawned peer process. `call` waits for a command; `send` + `result` let the
    parent work (poll its own endpoint) while the child runs one."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child_conn,), daemon=True)
        self._process.start()
        child_conn.close()
        self._sent = 0
        # Spawning and importing NIXL take seconds, many more on a loaded machine: wait for that once,
        # so each call's own timeout measures only the call.
        assert self.result(STARTUP_TIMEOUT_S) == "ready"

    def send(self, command: str, *args: Any) -> None:
        self._sent += 1
        self._conn.send((self._sent, command, args))

    def result(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The answer to the latest command; answers to earlier ones that timed out are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"peer process did not answer within {timeout} s")
            seq, status, value = self._conn.recv()
            if seq == self._sent:
                break
        if status != "ok":
            raise RuntimeError(f"peer process failed:\n{value}")
        return value

    def call(self, command: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.send(command, *args)
        return self.result(timeout)

    def kill(self) -> None:
        """End the process abruptly, as a crashed engine."""
        self._process.kill()
        self._process.join()

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
