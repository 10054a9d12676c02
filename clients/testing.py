"""An in-process rendezvous server for engine authors' tests: real gRPC on 127.0.0.1, a free port.

    async with start_test_server() as server:
        async with AsyncRendezvousClient(server.address) as client:
            ...
        await server.restart()   # same port, new epoch: the memory store forgets everything

`TestServer` does the same for synchronous tests, serving from an event loop in a thread. Keyword
arguments are passed to the server's `ServerConfig` (e.g. `timeouts=Timeouts(...)`), except
`listen`, which the harness chooses. The server package is imported only when a server starts,
so `rendezvous.clients` itself does not depend on it.

An engine registers one NIXL agent per rank; `stand_in_agent` makes one with no NIXL behind it, for tests and
examples that exercise the control plane only. `TEST_LAYOUT` is a KV layout for tests whose KV is no model's.

Time skipping: a test of lease, credit or binding expiry need not sleep for it. Give the server a `FakeClock`,
move the clock past the TTL and call `sweep()`, which applies at once what the background sweeper would:

    clock = FakeClock()
    async with start_test_server(clock=clock) as server:
        ...                       # register an engine with a 2 s lease, and stop renewing it
        clock.advance(3)
        await server.sweep()      # the lease has lapsed: the engine is gone, its transfers aborted

The server judges leases, deadlines, credits and bindings by the clock, and the memory store expires the answers
it keeps for retries by it. A client's own timers (its keep-alive, call deadlines) stay on real time.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

from rendezvous.clients._types import KvLayout, KvRegion, MemoryKind, NixlAgentInfo

_HOST = "127.0.0.1"
T = TypeVar("T")

TEST_LAYOUT = KvLayout(model_fingerprint="test-model", dtype="uint8", block_size=16, num_layers=1)
"""A layout stating what a consumer agent must (`ConsumerAgent` refuses to start without one): give it to both
sides of a test pair, whatever their tensors, so that the service matches them."""


def stand_in_agent(name: str, rank: int = 0, num_blocks: int = 64) -> NixlAgentInfo:
    """A rank's NIXL agent with one DRAM region of num_blocks 4 KiB blocks and no NIXL behind it: what a
    control-plane-only test or example registers (the server takes it as it would a real one)."""
    region = KvRegion(base_address=1 << 20, block_stride_bytes=4096, block_length_bytes=4096, num_blocks=num_blocks)
    return NixlAgentInfo(
        name=name, metadata=b"md-" + name.encode(), memory_kind=MemoryKind.DRAM, regions=(region,), rank=rank
    )


class FakeClock:
    """A clock that stands still until the test moves it: a test server's `clock` for time skipping."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start
        """The time it says, in seconds; wall time when made (bindings and tokens carry wall-clock expiries)."""

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        if not seconds >= 0:
            raise ValueError(f"a clock moves forward, not by {seconds}")
        self.now += seconds


class AsyncTestServer:
    """A rendezvous server on the running event loop; `start`, `restart`, `stop`, and `sweep` with a fake clock."""

    __test__ = False  # not a pytest test class

    def __init__(self, clock: Callable[[], float] | None = None, **config: Any) -> None:
        if "listen" in config:
            raise ValueError("the test server chooses its own address")
        self._clock = clock
        self._config = config
        self._server: Any = None
        self.port = 0

    @property
    def address(self) -> str:
        """The address "127.0.0.1:PORT", once started; the port stays the same across restarts."""
        return f"{_HOST}:{self.port}"

    @property
    def server(self) -> Any:
        """The running `rendezvous.server.RendezvousServer`, for inspection."""
        if self._server is None:
            raise RuntimeError("the test server is not running")
        return self._server

    @property
    def epoch(self) -> int:
        """The running server's store epoch."""
        return int(self.server.store.epoch)

    async def start(self) -> None:
        """Start serving: on a free port the first time, on the same port after a restart."""
        from rendezvous.server import RendezvousServer, ServerConfig

        server = RendezvousServer(ServerConfig(listen=f"{_HOST}:{self.port}", **self._config), self._clock)
        await server.start()
        self._server = server
        self.port = server.port

    async def stop(self, grace: float = 0.0) -> None:
        """Stop serving; open streams end and calls in flight are cancelled after grace seconds."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    async def restart(self) -> None:
        """Stop and start again on the same port with a fresh store: a new epoch, nothing remembered."""
        await self.stop()
        await self.start()

    async def sweep(self) -> None:
        """Apply now what has lapsed by the server's clock (leases, deadlines), as its background sweeper would."""
        await self.server.coordinator.sweep()


@asynccontextmanager
async def start_test_server(clock: Callable[[], float] | None = None, **config: Any) -> AsyncIterator[AsyncTestServer]:
    """A started `AsyncTestServer`, stopped on exit."""
    server = AsyncTestServer(clock, **config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class TestServer:
    """A rendezvous server for synchronous tests, on an event loop in a background thread.

    Use as a context manager, or call `start()` and `stop()`.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, clock: Callable[[], float] | None = None, **config: Any) -> None:
        self._server = AsyncTestServer(clock, **config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """The address "127.0.0.1:PORT", once started; the port stays the same across restarts."""
        return self._server.address

    @property
    def port(self) -> int:
        """The port served on."""
        return self._server.port

    @property
    def epoch(self) -> int:
        """The running server's store epoch."""
        return self._server.epoch

    @property
    def server(self) -> Any:
        """The running `rendezvous.server.RendezvousServer`, for inspection (e.g. its metrics registry)."""
        return self._server.server

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the test server is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def start(self) -> None:
        """Start the loop thread and the server."""
        if self._loop is not None:
            raise RuntimeError("the test server is already running")
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="rendezvous-test-server", daemon=True)
        self._thread.start()
        self._loop = loop
        try:
            self._run(self._server.start())
        except BaseException:
            self._shutdown_loop()
            raise

    def restart(self) -> None:
        """Stop and start again on the same port with a fresh store (a new epoch)."""
        self._run(self._server.restart())

    def sweep(self) -> None:
        """Apply now what has lapsed by the server's clock (see `AsyncTestServer.sweep`)."""
        self._run(self._server.sweep())

    def stop(self) -> None:
        """Stop the server and its loop thread."""
        if self._loop is None:
            return
        try:
            self._run(self._server.stop())
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()

    def __enter__(self) -> TestServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
