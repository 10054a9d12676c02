"""Fixtures of the SDK tests: a real server (the SDK's own harness), clients, a breakable TCP proxy."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import grpc
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
MUST = 30.0
"""Seconds a test waits for something that must happen, however loaded the machine (a failing test waits that long)."""


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
    (`freeze`: bytes are held, connections stay open, as behind a node lost without a reset; `thaw`: new connections
    go through again)."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flows: set[asyncio.Event] = set()  # one per open connection: set while its bytes go through
        self._refusing = False
        self._thawed = asyncio.Event()
        self._thawed.set()
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
        self._thawed.set()  # the connections waiting for a thaw were closed: they end
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        """Close every open connection, both ways."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        for flow in self._flows:  # a frozen connection's pipes end too, now that it is closed
            flow.set()
        self._flows.clear()

    def refuse(self, refusing: bool) -> None:
        """While refusing, new connections are closed as soon as they are accepted."""
        self._refusing = refusing

    def freeze(self) -> None:
        """From now on no byte goes through, either way, and nothing is closed: the connections open now stay silent
        for good; new ones are accepted and wait for `thaw`."""
        self._thawed.clear()
        for flow in self._flows:
            flow.clear()

    def thaw(self) -> None:
        """New connections go through again, those accepted since the freeze too; the frozen ones stay silent."""
        self._thawed.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        self.accepted += 1
        self._writers.add(writer)  # cut while it waits for a thaw, it is closed
        await self._thawed.wait()
        if writer.transport.is_closing():
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        except OSError:
            writer.transport.abort()
            return
        flow = asyncio.Event()
        flow.set()
        self._flows.add(flow)
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer, flow), self._pipe(up_reader, writer, flow))
        self._flows.discard(flow)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flow: asyncio.Event) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await flow.wait()
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


_HOP_BY_HOP = frozenset({"user-agent", "content-type", "te", "host"})


class GrpcProxy:
    """A gRPC proxy in front of a real server: every call is forwarded byte for byte (status, details and the
    ErrorInfo/RetryInfo trailers included), unless the test says otherwise for its method:
    - `end_streams(method)` ends the open calls of method cleanly (status OK, no error: what a proxy with a stream
      timeout, or a replica shutting down gracefully, does); `drain(method)` does so and ends every later call of
      it at once, unforwarded;
    - `hold(method)`: later calls of method are never forwarded nor answered (a replica that stopped answering),
      until `release(method)`;
    - `refuse(method, code)`: later calls of method are answered `code` at once, unforwarded (a front that
      refuses them: an answer, not an outage), until `release(method)`;
    - `delay(method)`: a later (unary) call of method is forwarded only at `let_through(method)`, and then even if
      its caller has given up meanwhile: a request already on its way to the server. `delayed[method]` counts the
      calls waiting, `late` the forwarded calls not yet answered by the server.

    Per method name ("KeepAlive", "Watch", ...): `calls` counts the calls opened, `answers` the messages answered,
    `requests` notes the loop time of each request forwarded and `ends` each call's end as (loop time, status code).
    Every note wakes `wait_for`, so a test waits for a condition instead of sleeping.
    """

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream
        self._channel: grpc.aio.Channel | None = None
        self._server: grpc.aio.Server | None = None
        self._open: dict[str, set[asyncio.Event]] = collections.defaultdict(set)
        self._draining: set[str] = set()
        self._held: set[str] = set()
        self._refused: dict[str, grpc.StatusCode] = {}
        self._delays: dict[str, asyncio.Event] = {}
        self.delayed: collections.Counter[str] = collections.Counter()
        self.late: set[asyncio.Task[bytes]] = set()
        self.calls: collections.Counter[str] = collections.Counter()
        self.answers: collections.Counter[str] = collections.Counter()
        self.requests: dict[str, list[float]] = collections.defaultdict(list)
        self.ends: dict[str, list[tuple[float, grpc.StatusCode]]] = collections.defaultdict(list)
        self._changed = asyncio.Condition()
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._upstream)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((_Forwarding(self),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()

    def end_streams(self, method: str) -> int:
        """End every open call of method with status OK; how many there were."""
        ending = self._open.pop(method, set())
        for end in ending:
            end.set()
        return len(ending)

    def drain(self, method: str) -> None:
        """End the open calls of method cleanly, and every later one at once."""
        self._draining.add(method)
        self.end_streams(method)

    def hold(self, method: str) -> None:
        """Leave every later call of method unforwarded and unanswered."""
        self._held.add(method)

    def release(self, method: str) -> None:
        """Forward later calls of method again, after `hold` or `refuse` (those held stay unanswered until their
        callers give up)."""
        self._held.discard(method)
        self._refused.pop(method, None)

    def refuse(self, method: str, code: grpc.StatusCode) -> None:
        """Answer every later call of method with status code, unforwarded."""
        self._refused[method] = code

    def delay(self, method: str) -> None:
        """Hold every later call of method at the proxy until `let_through(method)`."""
        self._delays[method] = asyncio.Event()

    def let_through(self, method: str) -> None:
        """Forward the calls of method held by `delay`, and every later one at once."""
        self._delays.pop(method).set()

    async def _forward_late(self, full_method: str, request: bytes, metadata: tuple[tuple[str, str | bytes], ...],
                            gate: asyncio.Event) -> bytes:  # fmt: skip
        assert self._channel is not None
        await gate.wait()
        return await self._channel.unary_unary(full_method)(request, metadata=metadata)  # type: ignore[no-any-return]

    async def wait_for(self, condition: Callable[[], object], timeout: float = MUST) -> None:
        """Until condition() holds (checked at every note); fails after timeout seconds."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(condition), timeout)

    async def _note(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def forward(
        self, full_method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        assert self._channel is not None
        loop = asyncio.get_running_loop()
        method = full_method.rsplit("/", 1)[-1]
        self.calls[method] += 1
        if method in self._draining or method in self._held:
            await self._note()
            if method in self._held:
                await asyncio.Event().wait()  # until the caller gives up or the proxy stops
            self.ends[method].append((loop.time(), grpc.StatusCode.OK))
            await self._note()
            return
        if (refusal := self._refused.get(method)) is not None:
            self.ends[method].append((loop.time(), refusal))
            await self._note()
            await context.abort(refusal, f"{method} refused by the proxy")
        metadata = tuple(
            (m.key, m.value)
            for m in context.invocation_metadata() or ()
            if not m.key.startswith((":", "grpc-")) and m.key not in _HOP_BY_HOP
        )
        gate = self._delays.get(method)
        if gate is not None:
            request = await anext(aiter(requests))
            late = asyncio.ensure_future(self._forward_late(full_method, request, metadata, gate))
            self.late.add(late)
            late.add_done_callback(self.late.discard)
            self.delayed[method] += 1
            await self._note()
            try:
                yield await asyncio.shield(late)  # the caller giving up does not stop the forwarded call
            except grpc.RpcError as error:
                await context.abort(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
            finally:
                self.delayed[method] -= 1
                await self._note()
            return
        call = self._channel.stream_stream(full_method)(timeout=context.time_remaining(), metadata=metadata)
        end = asyncio.Event()
        self._open[method].add(end)

        async def pump() -> None:
            with contextlib.suppress(Exception):
                async for request in requests:
                    self.requests[method].append(loop.time())
                    await self._note()
                    await call.write(request)
                await call.done_writing()

        pumping = asyncio.create_task(pump())
        code = grpc.StatusCode.OK
        try:
            while True:
                reading = asyncio.ensure_future(call.read())
                ending = asyncio.ensure_future(end.wait())
                await asyncio.wait({reading, ending}, return_when=asyncio.FIRST_COMPLETED)
                ending.cancel()
                if end.is_set():
                    reading.cancel()
                    return  # ended cleanly: status OK
                try:
                    response = reading.result()
                except grpc.RpcError as error:
                    code = error.code()
                    await context.abort(code, error.details() or "", tuple(error.trailing_metadata() or ()))
                if response is grpc.aio.EOF:
                    return
                self.answers[method] += 1
                await self._note()
                yield response
        finally:
            pumping.cancel()
            call.cancel()
            self._open[method].discard(end)
            self.ends[method].append((loop.time(), code))
            await self._note()


class _Forwarding:
    """The proxy's one generic handler (gRPC takes any object with `service`): every method, forwarded."""

    def __init__(self, proxy: GrpcProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = handler_call_details.method

        async def behavior(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            async for response in self._proxy.forward(method, requests, context):
                yield response

        return grpc.stream_stream_rpc_method_handler(behavior)


@pytest.fixture
async def grpc_proxy(server: AsyncTestServer) -> AsyncIterator[GrpcProxy]:
    p = GrpcProxy(server.address)
    await p.start()
    yield p
    await p.close()
