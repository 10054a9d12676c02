"""The wire side of the conformance suite: channels, engines with leases and watches, expectations.

Only gRPC, the generated stubs and google.rpc are used: this is what an engine author's client sees.
Every wait is bounded: unary calls by `Options.rpc_timeout`, event waits by `Options.event_timeout`
(or an explicit bound, e.g. a lease TTL plus `Options.margin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rendezvous.v1 import errors_pb2
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

CONSUMER = pb.ENGINE_ROLE_CONSUMER
PRODUCER = pb.ENGINE_ROLE_PRODUCER
POOLS: dict[int, str] = {CONSUMER: "conformance-decode", PRODUCER: "conformance-prefill"}
LAYOUT = pb.KvLayout(
    model_fingerprint="kv-rendezvous-conformance", dtype="float16", block_size=16, num_layers=2, tp_size=1, pp_size=1
)
NUM_BLOCKS = 64
BLOCK_BYTES = 4096
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _error_domain() -> str:
    """The ErrorInfo domain of the service's reasons, as errors.proto states it (ErrorReason's `error_domain`)."""
    extension: Any = errors_pb2.error_domain  # the generated .pyi types an extension as a plain FieldDescriptor
    return str(errors_pb2.ErrorReason.DESCRIPTOR.GetOptions().Extensions[extension])


ERROR_DOMAIN = _error_domain()


@dataclass(frozen=True)
class Options:
    """Where the service is and how long to wait for it."""

    targets: tuple[str, ...]
    lease_ttl: float = 2.0
    """Lease requested by the engines whose keep-alives a lease-loss check stops."""
    margin: float = 5.0
    """Extra seconds a lease or deadline check waits for the server's sweeper."""
    event_timeout: float = 5.0
    """How long to wait for an event that should follow at once."""
    rpc_timeout: float = 5.0
    """Deadline of each unary call."""
    check_timeout: float = 60.0
    """Bound on one whole check."""
    token: str | None = None
    tls: bool = False
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None


class Failed(Exception):
    """A check's expectation did not hold; the message is the one-line reason."""


class RpcFailure(Failed):
    """A call ended with an error status."""

    def __init__(
        self, method: str, code: grpc.StatusCode, reason: str, message: str, metadata: dict[str, str] | None = None
    ) -> None:
        super().__init__(f"{method} failed: {code.name}/{reason or '-'}: {message}")
        self.method = method
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = metadata or {}


def error_reason(status: status_pb2.Status) -> str:
    """The ErrorInfo reason of a google.rpc.Status, or "" when it has none. A reason in a domain other than the
    service's (ERROR_DOMAIN) reads "REASON@domain", so that it matches no expected reason."""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason) if info.domain == ERROR_DOMAIN else f"{info.reason}@{info.domain}"
    return ""


def error_metadata(status: status_pb2.Status) -> dict[str, str]:
    """The ErrorInfo metadata of a google.rpc.Status."""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return dict(info.metadata)
    return {}


def code_name(code: int) -> str:
    """A numeric status code's name."""
    found = _CODES.get(code)
    return found.name if found else str(code)


def describe_status(status: status_pb2.Status) -> str:
    """CODE/REASON: message."""
    return f"{code_name(status.code)}/{error_reason(status) or '-'}: {status.message}"


def state_name(state: int) -> str:
    """TARGETED, MATCHED, ... for a TransferState value."""
    try:
        return str(pb.TransferState.Name(state)).removeprefix("TRANSFER_STATE_")
    except ValueError:
        return str(state)


def event_name(kind: int) -> str:
    """TRANSFER_ASSIGNED, ... for an EventType value."""
    try:
        return str(pb.EventType.Name(kind)).removeprefix("EVENT_TYPE_")
    except ValueError:
        return str(kind)


def abort_reason_name(reason: int) -> str:
    """REQUESTED, PEER_LOST, ... for an AbortReason value."""
    try:
        return str(pb.AbortReason.Name(reason)).removeprefix("ABORT_REASON_")
    except ValueError:
        return str(reason)


def describe_event(e: pb.Event) -> str:
    """A short rendering for failure reasons."""
    text = f"#{e.sequence} {event_name(e.type)}"
    if e.HasField("transfer"):
        text += f"({e.transfer.transfer_id} g{e.generation}"
        if e.transfer.abort_reason:
            text += f" {abort_reason_name(e.transfer.abort_reason)}"
        text += ")"
    elif e.HasField("peer"):
        text += f"(peer {e.peer.engine_id})"
    return text


def expect(condition: bool, reason: str) -> None:
    """Fail the check with reason unless condition holds."""
    if not condition:
        raise Failed(reason)


def expect_ok(result: pb.ItemResult, what: str) -> pb.ItemResult:
    """The item succeeded."""
    expect(result.status.code == 0, f"{what}: expected OK, got {describe_status(result.status)}")
    return result


def expect_state(result: pb.ItemResult, state: int, what: str) -> pb.ItemResult:
    """The item succeeded and left the transfer in state."""
    expect_ok(result, what)
    expect(
        result.state == state,
        f"{what}: expected state {state_name(state)}, got {state_name(result.state)}",
    )
    return result


def expect_item_error(result: pb.ItemResult, code: grpc.StatusCode, reason: str, what: str) -> None:
    """The item failed with code and ErrorInfo reason."""
    got = (code_name(result.status.code), error_reason(result.status))
    expect(
        got == (code.name, reason),
        f"{what}: expected {code.name}/{reason}, got "
        + (describe_status(result.status) if result.status.code else f"OK (state {state_name(result.state)})"),
    )


async def expect_rpc_error(call: Awaitable[object], code: grpc.StatusCode, reason: str, what: str) -> RpcFailure:
    """The call failed with code and ErrorInfo reason."""
    try:
        await call
    except RpcFailure as err:
        expect(
            (err.code, err.reason) == (code, reason),
            f"{what}: expected {code.name}/{reason}, got {err.code.name}/{err.reason or '-'}: {err.message}",
        )
        return err
    raise Failed(f"{what}: expected {code.name}/{reason}, the call succeeded")


def _rpc_failure(method: str, err: grpc.aio.AioRpcError) -> RpcFailure:
    status = rpc_status.from_call(err)
    if status is None:
        return RpcFailure(method, err.code(), "", str(err.details()))
    return RpcFailure(method, err.code(), error_reason(status), status.message, error_metadata(status))


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _seconds(d: Duration) -> float:
    return float(d.seconds + d.nanos / 1e9)


def _read_pem(value: str | None) -> bytes | None:
    if value is None:
        return None
    if "-----BEGIN" in value:
        return value.encode()
    with open(value, "rb") as f:
        return f.read()


def agent_for(engine_id: str) -> pb.NixlAgent:
    """One DRAM agent at rank 0 with one region of NUM_BLOCKS blocks; the metadata is a stand-in."""
    region = pb.KvRegion(
        base_address=1 << 30, block_stride_bytes=BLOCK_BYTES, block_length_bytes=BLOCK_BYTES, num_blocks=NUM_BLOCKS
    )
    return pb.NixlAgent(
        name=f"{engine_id}-agent0",
        metadata=b"conformance-metadata-" + engine_id.encode(),
        rank=0,
        memory_kind=pb.MEMORY_KIND_DRAM,
        regions=[region],
    )


def engine_request(
    engine_id: str, role: int, lease_ttl: float = 0.0, layout: pb.KvLayout = LAYOUT
) -> pb.RegisterEngineRequest:
    """A realistic registration: TP 1, PP 1, block size 16, 2 layers, one agent."""
    request = pb.RegisterEngineRequest(
        engine_id=engine_id,
        pool=POOLS[role],
        role=role,  # type: ignore[arg-type]
        layout=layout,
        agents=[agent_for(engine_id)],
        labels={"conformance": "true"},
    )
    if lease_ttl:
        request.lease_ttl.CopyFrom(_duration(lease_ttl))
    return request


class Driver:
    """Channels to the targets; mints ids unique to this run."""

    def __init__(self, options: Options) -> None:
        if not options.targets:
            raise ValueError("at least one target")
        self.options = options
        self.run_id = secrets.token_hex(4)
        self._ids = itertools.count(1)
        self._rotation = itertools.count()
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {options.token}"),) if options.token else ()
        )
        secure = options.tls or options.ca or options.client_cert
        if secure:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(options.ca),
                private_key=_read_pem(options.client_key),
                certificate_chain=_read_pem(options.client_cert),
            )
            self._channels = [grpc.aio.secure_channel(t, credentials) for t in options.targets]
        else:
            self._channels = [grpc.aio.insecure_channel(t) for t in options.targets]
        self.stubs: list[Any] = [pb_grpc.RendezvousServiceStub(c) for c in self._channels]

    def new_id(self, kind: str) -> str:
        """A fresh id, e.g. conf-1a2b3c4d-t7."""
        return f"conf-{self.run_id}-{kind}{next(self._ids)}"

    def stub(self, index: int) -> Any:
        """The stub of target index (modulo the number of targets)."""
        return self.stubs[index % len(self.stubs)]

    def next_stub(self) -> Any:
        """Targets in turn, for calls that belong to no engine (router, inspection)."""
        return self.stub(next(self._rotation))

    async def call(self, stub: Any, method: str, request: Any) -> Any:
        """A unary call with the RPC deadline; errors become RpcFailure."""
        try:
            return await getattr(stub, method)(
                request, timeout=self.options.rpc_timeout, metadata=self.metadata or None
            )
        except grpc.aio.AioRpcError as err:
            raise _rpc_failure(method, err) from None

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels:
            await channel.close()


EventPredicate = Callable[[pb.Event], bool]


def is_event(kind: int, transfer_id: str | None = None, generation: int | None = None) -> EventPredicate:
    """Matches events of kind, for transfer_id and generation when given."""

    def match(e: pb.Event) -> bool:
        return (
            e.type == kind
            and (transfer_id is None or e.transfer.transfer_id == transfer_id)
            and (generation is None or e.generation == generation)
        )

    return match


class Watcher:
    """One Watch stream of one engine, from a start sequence; keeps every event it receives."""

    def __init__(self, driver: Driver, stub: Any, engine_id: str, start_sequence: int) -> None:
        self._driver = driver
        self._stub = stub
        self.engine_id = engine_id
        self.start_sequence = start_sequence
        self.events: list[pb.Event] = []
        self.first_response_had_events = False
        self.resyncs: list[int] = []
        self.error: RpcFailure | None = None
        self.ended = False
        self._changed = asyncio.Event()
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the stream and wait for its first response (the watch is established)."""
        request = pb.WatchRequest(engine_id=self.engine_id, start_sequence=self.start_sequence)
        self._call = self._stub.Watch(request, metadata=self._driver.metadata or None)
        try:
            async with asyncio.timeout(self._driver.options.rpc_timeout):
                first = await self._call.read()
        except grpc.aio.AioRpcError as err:
            self._call.cancel()
            raise _rpc_failure("Watch", err) from None
        except TimeoutError:
            self._call.cancel()
            raise Failed(
                f"Watch({self.engine_id}): no first response within {self._driver.options.rpc_timeout} s"
            ) from None
        if first is grpc.aio.EOF:
            raise Failed(f"Watch({self.engine_id}) ended before its first response")
        self.first_response_had_events = bool(first.events)
        self.events.extend(first.events)
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                if response.resync_required:
                    self.resyncs.append(int(response.resync_sequence))
                self.events.extend(response.events)
                self._changed.set()
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.error = _rpc_failure("Watch", err)
        finally:
            self.ended = True
            self._changed.set()

    async def wait_for(self, predicate: EventPredicate, what: str, timeout: float | None = None) -> pb.Event:
        """The first event (since the start sequence) that matches; waits at most timeout seconds."""
        bound = self._driver.options.event_timeout if timeout is None else timeout
        deadline = time.monotonic() + bound
        while True:
            self._changed.clear()
            for e in self.events:
                if predicate(e):
                    return e
            if self.ended:
                raise Failed(
                    f"{self.engine_id} never got {what}: its watch ended"
                    + (f" ({self.error})" if self.error else "")
                    + self._seen()
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed(f"{self.engine_id} got no {what} within {bound:.1f} s{self._seen()}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._changed.wait()

    async def expect(
        self, kind: int, transfer_id: str, generation: int | None = None, timeout: float | None = None
    ) -> pb.Event:
        """The first event of kind for transfer_id (and generation)."""
        what = f"{event_name(kind)} for {transfer_id}" + (f" generation {generation}" if generation else "")
        return await self.wait_for(is_event(kind, transfer_id, generation), what, timeout)

    def before(self, event: pb.Event) -> list[pb.Event]:
        """The events received before event (lower sequences)."""
        return [e for e in self.events if e.sequence < event.sequence]

    def _seen(self) -> str:
        resyncs = f" and resync_required at {self.resyncs}" if self.resyncs else ""
        if not self.events:
            return f"; it saw no events{resyncs}"
        shown = ", ".join(describe_event(e) for e in self.events[-6:])
        return f"; it saw {len(self.events)} events{resyncs}, last: {shown}"

    async def close(self) -> None:
        """Cancel the stream."""
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class Engine:
    """A registered engine: its lease kept alive, its events watched, its transfer calls."""

    def __init__(
        self, scenario: Scenario, target: int, engine_id: str, role: int, layout: pb.KvLayout = LAYOUT
    ) -> None:
        self.scenario = scenario
        self.layout = layout
        self.driver = scenario.driver
        self.target = target
        self.stub = self.driver.stub(target)
        # Another target than the engine's own when there are several: where a failover goes.
        self.other_stub = self.driver.stub(target + 1)
        self.engine_id = engine_id
        self.role = role
        self.incarnation = 0
        self.lease_ttl = 0.0
        self.watch_start_sequence = 0
        self.watcher: Watcher | None = None
        self.keepalive_error: RpcFailure | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._stop_keepalive = asyncio.Event()
        self.deregistered = False
        self.capacity: pb.EngineCapacity | None = None
        """What a consumer declares it admits at once (decode admission credits); None: no limit."""

    @property
    def name(self) -> str:
        """consumer/producer and id, for messages."""
        return f"{'consumer' if self.role == CONSUMER else 'producer'} {self.engine_id}"

    @property
    def events(self) -> Watcher:
        """The engine's watch."""
        if self.watcher is None:
            raise Failed(f"{self.name} is not watched")
        return self.watcher

    async def register(self, lease_ttl: float = 0.0) -> pb.RegisterEngineResponse:
        """Register a new incarnation and keep its lease alive."""
        await self.stop_keepalive()
        request = engine_request(self.engine_id, self.role, lease_ttl, self.layout)
        if self.capacity is not None:
            request.capacity.CopyFrom(self.capacity)
        response: pb.RegisterEngineResponse = await self.driver.call(self.stub, "RegisterEngine", request)
        self.incarnation = int(response.engine.incarnation)
        self.lease_ttl = _seconds(response.engine.lease_ttl)
        if not self.watch_start_sequence:
            self.watch_start_sequence = int(response.watch_start_sequence)
        self.deregistered = False
        self._stop_keepalive = asyncio.Event()
        self._keepalive = asyncio.create_task(self._keep_alive(self.incarnation, self._stop_keepalive))
        return response

    async def watch(self) -> Watcher:
        """Watch from the first registration's watch_start_sequence, so no event is missed."""
        self.watcher = Watcher(self.driver, self.stub, self.engine_id, self.watch_start_sequence)
        await self.watcher.start()
        return self.watcher

    async def _keep_alive(self, incarnation: int, stop: asyncio.Event) -> None:
        interval = max(0.05, min(1.0, self.lease_ttl / 4))
        call = self.stub.KeepAlive(metadata=self.driver.metadata or None)
        try:
            while not stop.is_set():
                await call.write(pb.KeepAliveRequest(engine_id=self.engine_id, incarnation=incarnation))
                async with asyncio.timeout(self.driver.options.rpc_timeout):
                    response = await call.read()
                if response is grpc.aio.EOF:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):  # the renewal period
                        await stop.wait()
        except grpc.aio.AioRpcError as err:
            self.keepalive_error = _rpc_failure("KeepAlive", err)
        except (TimeoutError, asyncio.InvalidStateError) as err:
            self.keepalive_error = RpcFailure("KeepAlive", grpc.StatusCode.DEADLINE_EXCEEDED, "", repr(err))
        finally:
            call.cancel()

    async def keep_alive_once(self, incarnation: int) -> pb.KeepAliveResponse:
        """One KeepAlive message for incarnation on a stream of its own; errors become RpcFailure."""
        call = self.stub.KeepAlive(metadata=self.driver.metadata or None)
        try:
            await call.write(pb.KeepAliveRequest(engine_id=self.engine_id, incarnation=incarnation))
            async with asyncio.timeout(self.driver.options.rpc_timeout):
                response = await call.read()
        except grpc.aio.AioRpcError as err:
            raise _rpc_failure("KeepAlive", err) from None
        except TimeoutError:
            raise Failed(f"KeepAlive: no answer within {self.driver.options.rpc_timeout} s") from None
        finally:
            call.cancel()
        if response is grpc.aio.EOF:
            raise Failed("KeepAlive: the stream ended without an answer")
        return response  # type: ignore[no-any-return]

    async def stop_keepalive(self) -> None:
        """Stop renewing the lease: it lapses lease_ttl seconds after the last renewal."""
        if self._keepalive is not None:
            self._stop_keepalive.set()  # ends the loop even if the cancellation below is lost
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None

    async def deregister(self) -> pb.DeregisterEngineResponse:
        """End this incarnation now."""
        await self.stop_keepalive()
        response: pb.DeregisterEngineResponse = await self.driver.call(
            self.stub,
            "DeregisterEngine",
            pb.DeregisterEngineRequest(engine_id=self.engine_id, incarnation=self.incarnation),
        )
        self.deregistered = True
        return response

    async def _items(
        self, method: str, field: str, items: Sequence[Any], via: Any = None, **request: Any
    ) -> list[pb.ItemResult]:
        """A batched call of this engine (through the stub via, else its own); request sets more fields."""
        request.setdefault("incarnation", self.incarnation)
        request_type = getattr(pb, f"{method}Request")
        response = await self.driver.call(
            via or self.stub, method, request_type(engine_id=self.engine_id, **{field: items}, **request)
        )
        results = list(response.results)
        expect(
            len(results) == len(items),
            f"{method}: {len(items)} items sent, {len(results)} results answered",
        )
        return results

    async def register_target(
        self,
        transfer_id: str,
        blocks: Sequence[int] = (0, 1, 2, 3),
        generation: int = 1,
        mode: int = pb.TRANSFER_MODE_PUSH,
        timeout: float = 0.0,
        via: Any = None,
        **request: Any,
    ) -> pb.ItemResult:
        """RegisterTargets with one target."""
        spec = pb.TargetSpec(
            transfer_id=transfer_id,
            block_ids=blocks,
            num_tokens=16 * len(blocks),
            generation=generation,
            mode=mode,  # type: ignore[arg-type]
        )
        if timeout:
            spec.timeout.CopyFrom(_duration(timeout))
        (result,) = await self._items("RegisterTargets", "targets", [spec], via, **request)
        return result

    async def claim(self, transfer_id: str, via: Any = None, **request: Any) -> pb.ItemResult:
        """ClaimTransfers with one claim."""
        claims = [pb.ClaimSpec(transfer_id=transfer_id)]
        (result,) = await self._items("ClaimTransfers", "claims", claims, via, **request)
        return result

    async def mark_source_ready(self, transfer_id: str, blocks: Sequence[int]) -> pb.ItemResult:
        """MarkSourcesReady with one source."""
        spec = pb.SourceReadySpec(transfer_id=transfer_id, block_ids=blocks)
        (result,) = await self._items("MarkSourcesReady", "sources", [spec])
        return result

    async def complete(
        self, transfer_id: str, generation: int, outcome: int = pb.COMPLETION_OUTCOME_SUCCEEDED
    ) -> pb.ItemResult:
        """CompleteTransfers with one completion."""
        spec = pb.CompletionSpec(transfer_id=transfer_id, generation=generation, outcome=outcome)  # type: ignore[arg-type]
        (result,) = await self._items("CompleteTransfers", "completions", [spec])
        return result

    async def acknowledge(self, transfer_id: str, generation: int) -> pb.ItemResult:
        """AcknowledgeRevocations with one acknowledgement."""
        ack = pb.RevocationAck(transfer_id=transfer_id, generation=generation)
        (result,) = await self._items("AcknowledgeRevocations", "acks", [ack])
        return result

    async def release(self, transfer_id: str, generation: int) -> pb.ItemResult:
        """ReleaseTargets with one release."""
        spec = pb.ReleaseSpec(transfer_id=transfer_id, generation=generation)
        (result,) = await self._items("ReleaseTargets", "releases", [spec])
        return result

    async def abort(self, transfer_id: str, message: str = "conformance") -> pb.ItemResult:
        """AbortTransfers with one abort, as this engine."""
        (result,) = await self._items(
            "AbortTransfers", "aborts", [pb.AbortSpec(transfer_id=transfer_id, message=message)]
        )
        return result

    async def close(self) -> None:
        """Stop the watch and the keep-alives; deregister unless already gone."""
        if self.watcher is not None:
            await self.watcher.close()
        await self.stop_keepalive()
        if not self.deregistered and self.incarnation:
            with contextlib.suppress(Failed):
                await self.deregister()


class Scenario:
    """What one check works with: fresh engines spread over the targets, fresh transfer ids, a router.

    Consumers are placed on the targets in turn starting with the first, producers starting with the
    second, so with two targets the consumer and the producer of a transfer talk to different replicas.
    """

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.options = driver.options
        self.engines: list[Engine] = []
        self._placed: dict[int, int] = {CONSUMER: 0, PRODUCER: 1}

    def transfer_id(self) -> str:
        """A fresh transfer id."""
        return self.driver.new_id("t")

    async def engine(
        self, role: int, lease_ttl: float = 0.0, watch: bool = True, layout: pb.KvLayout = LAYOUT
    ) -> Engine:
        """A fresh registered engine of role, its lease kept alive and (by default) its events watched."""
        index = self._placed[role]
        self._placed[role] += 1
        kind = "d" if role == CONSUMER else "p"
        engine = Engine(self, index, self.driver.new_id(kind), role, layout)
        self.engines.append(engine)
        await engine.register(lease_ttl)
        if watch:
            await engine.watch()
        return engine

    async def consumer(self, lease_ttl: float = 0.0, watch: bool = True) -> Engine:
        """A fresh consumer (decode engine)."""
        return await self.engine(CONSUMER, lease_ttl, watch)

    async def producer(self, lease_ttl: float = 0.0, watch: bool = True, layout: pb.KvLayout = LAYOUT) -> Engine:
        """A fresh producer (prefill engine)."""
        return await self.engine(PRODUCER, lease_ttl, watch, layout)

    async def pair(self) -> tuple[Engine, Engine]:
        """A watched consumer and producer."""
        return await self.consumer(), await self.producer()

    async def register_raw(self, request: pb.RegisterEngineRequest) -> pb.RegisterEngineResponse:
        """RegisterEngine as given (for registrations that should be refused); a success is cleaned up."""
        response: pb.RegisterEngineResponse = await self.driver.call(self.driver.next_stub(), "RegisterEngine", request)
        with contextlib.suppress(Failed):
            await self.driver.call(
                self.driver.next_stub(),
                "DeregisterEngine",
                pb.DeregisterEngineRequest(engine_id=request.engine_id, incarnation=response.engine.incarnation),
            )
        return response

    async def reserve_credit(self, transfer_id: str, engine: Engine, blocks: int = 0) -> pb.CreditResult:
        """ReserveCredits of one reservation, as a router does."""
        spec = pb.CreditSpec(transfer_id=transfer_id, engine_id=engine.engine_id, blocks=blocks)
        request = pb.ReserveCreditsRequest(reservations=[spec])
        response = await self.driver.call(self.driver.next_stub(), "ReserveCredits", request)
        expect(len(response.results) == 1, f"ReserveCredits: 1 item sent, {len(response.results)} results answered")
        return response.results[0]  # type: ignore[no-any-return]

    async def release_credit(self, transfer_id: str) -> pb.CreditResult:
        """ReleaseCredits of one transfer id, as a router does."""
        request = pb.ReleaseCreditsRequest(transfer_ids=[transfer_id])
        response = await self.driver.call(self.driver.next_stub(), "ReleaseCredits", request)
        expect(len(response.results) == 1, f"ReleaseCredits: 1 id sent, {len(response.results)} results answered")
        return response.results[0]  # type: ignore[no-any-return]

    async def router_abort(self, transfer_id: str, message: str = "conformance router") -> pb.ItemResult:
        """AbortTransfers with an empty engine id, as a router does."""
        request = pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id=transfer_id, message=message)])
        response = await self.driver.call(self.driver.next_stub(), "AbortTransfers", request)
        expect(len(response.results) == 1, f"AbortTransfers: 1 item sent, {len(response.results)} results answered")
        return response.results[0]  # type: ignore[no-any-return]

    async def get_transfer(self, transfer_id: str) -> pb.Transfer:
        """GetTransfer."""
        response = await self.driver.call(
            self.driver.next_stub(), "GetTransfer", pb.GetTransferRequest(transfer_id=transfer_id)
        )
        return response.transfer  # type: ignore[no-any-return]

    async def barrier(self, engine: Engine) -> list[pb.Event]:
        """Every event the engine got before now: events are per-engine ordered, so once the abort of a
        fresh transfer of its own arrives, everything emitted before it has arrived too."""
        barrier_id = self.driver.new_id("barrier")
        if engine.role == CONSUMER:
            expect_ok(await engine.register_target(barrier_id, (0,)), "barrier RegisterTargets")
        else:
            expect_ok(await engine.claim(barrier_id), "barrier ClaimTransfers")
        expect_ok(await self.router_abort(barrier_id, "barrier"), "barrier AbortTransfers")
        seen = await engine.events.expect(pb.EVENT_TYPE_TRANSFER_ABORTED, barrier_id)
        return engine.events.before(seen)

    def lease_bound(self, engine: Engine) -> float:
        """How long a lease-loss effect may take: the granted lease plus the sweeper margin."""
        return engine.lease_ttl + self.options.margin

    async def close(self) -> None:
        """Deregister every engine this scenario registered."""
        for engine in reversed(self.engines):
            await engine.close()
