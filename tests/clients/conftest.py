"""Fixtures of the SDK tests: a real server (the SDK's own harness), clients, a breakable TCP proxy."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import pytest

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClientConfig,
    ConsumerSession,
    Event,
    EventHandler,
    EventType,
    KvLayout,
    ProducerSession,
    RetryPolicy,
    SessionConfig,
    SessionEvent,
)
from rendezvous.clients.testing import AsyncTestServer, start_test_server
from rendezvous.core.limits import Limits, Timeouts
from tests.factories import SDK_LAYOUT as LAYOUT
from tests.factories import sdk_agent as agent

__all__ = ["LAYOUT", "agent"]  # the SDK suites' names for tests/factories.py's builders

FAST_RETRY = RetryPolicy(initial_backoff=0.01, max_backoff=0.1, deadline=10.0)
FAST_SESSION = SessionConfig(reconnect=RetryPolicy(initial_backoff=0.01, max_backoff=0.1))
WAIT = 10.0
"""Seconds any test waits for something that should happen at once; only a failing test waits that long."""


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def client_config(*targets: str) -> ClientConfig:
    return ClientConfig(targets=targets, retry=FAST_RETRY, call_timeout=5.0)


def consumer_session(
    client: AsyncRendezvousClient,
    engine_id: str = "d0",
    *,
    lease_ttl: float = 0.0,
    handler: EventHandler | None = None,
    layout: KvLayout = LAYOUT,
) -> ConsumerSession:
    """A consumer session with fast reconnects."""
    agents = [agent(f"{engine_id}-0")]
    return ConsumerSession(
        client,
        engine_id,
        "decode",
        layout=layout,
        agents=agents,
        lease_ttl=lease_ttl,
        config=FAST_SESSION,
        handler=handler,
    )


def producer_session(
    client: AsyncRendezvousClient,
    engine_id: str = "p0",
    *,
    lease_ttl: float = 0.0,
    handler: EventHandler | None = None,
) -> ProducerSession:
    """A producer session with fast reconnects."""
    agents = [agent(f"{engine_id}-0")]
    return ProducerSession(
        client,
        engine_id,
        "prefill",
        layout=LAYOUT,
        agents=agents,
        lease_ttl=lease_ttl,
        config=FAST_SESSION,
        handler=handler,
    )


def of_type(kind: EventType, transfer_id: str | None = None) -> Callable[[SessionEvent], bool]:
    """Matches events of a kind (and transfer)."""

    def match(event: SessionEvent) -> bool:
        return (
            isinstance(event, Event)
            and event.type == kind
            and (transfer_id is None or (event.transfer is not None and event.transfer.transfer_id == transfer_id))
        )

    return match


async def next_event(events: AsyncIterator[SessionEvent], match: Callable[[SessionEvent], bool]) -> SessionEvent:
    """The first event that matches, skipping others; fails after WAIT seconds."""

    async def find() -> SessionEvent:
        async for event in events:
            if match(event):
                return event
        raise AssertionError("the session ended before the event came")

    return await asyncio.wait_for(find(), WAIT)


async def wait_until(condition: Callable[[], object], timeout: float = WAIT) -> None:
    """Yield to the loop until condition() is true; fails after timeout seconds."""

    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 (any condition: there is no event to wait on)
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


@pytest.fixture
async def server() -> AsyncIterator[AsyncTestServer]:
    async with start_test_server(
        limits=Limits(max_events_per_engine=64, max_batch_items=128),
        timeouts=Timeouts(default_lease_ttl=5.0),
        sweep_interval=0.02,
        grace=0.1,
    ) as srv:
        yield srv


@pytest.fixture
async def client(server: AsyncTestServer) -> AsyncIterator[AsyncRendezvousClient]:
    async with AsyncRendezvousClient(client_config(server.address)) as c:
        yield c


class TcpProxy:
    """A loopback TCP proxy whose connections a test can cut, which can refuse new ones, and which can go silent
    (`freeze`: bytes are held, connections stay open, as behind a node lost without a reset)."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._refusing = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.accepted = 0
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        """Close every open connection, both ways."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def refuse(self, refusing: bool) -> None:
        """While refusing, new connections are closed as soon as they are accepted."""
        self._refusing = refusing

    def freeze(self) -> None:
        """From now on no byte goes through, either way, and nothing is closed."""
        self._flowing.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self._writers.discard(writer)


@pytest.fixture
async def proxy(server: AsyncTestServer) -> AsyncIterator[TcpProxy]:
    p = TcpProxy(server.port)
    await p.start()
    yield p
    await p.close()
