"""What both clients share below the commands: endpoints with failover, call metadata, epochs."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import grpc

from rendezvous.clients._commands import Call
from rendezvous.clients._config import ClientConfig
from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.protocol import tracing
from rendezvous.protocol.errors import Internal, RendezvousError
from rendezvous.protocol.reasons import Reason
from rendezvous.protocol.tracing import Span
from rendezvous.v1 import index_pb2_grpc as ipb_grpc
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

ChannelT = TypeVar("ChannelT")

Metadata = tuple[tuple[str, str], ...]
EpochListener = Callable[[int, int], None]


class ServiceStubs:
    """The stubs of both services on one channel, as one: a call names its RPC (`Call.method`), and no RPC name
    is in both RendezvousService and KvIndexService."""

    def __init__(self, channel: Any) -> None:
        for stub in (pb_grpc.RendezvousServiceStub(channel), ipb_grpc.KvIndexServiceStub(channel)):
            vars(self).update(vars(stub))


class Endpoints(Generic[ChannelT]):
    """The configured endpoints, in order; one channel and stub each, opened on first use.

    Calls go to the current endpoint. A caller that saw it UNAVAILABLE reports it with
    `failover`, which moves on to the next endpoint (once, however many callers report it).
    """

    def __init__(self, targets: tuple[str, ...], open_channel: Callable[[str], ChannelT]) -> None:
        self._targets = targets
        self._open_channel = open_channel
        self._channels: list[ChannelT | None] = [None] * len(targets)
        self._stubs: list[Any] = [None] * len(targets)
        self._current = 0
        self._opening = threading.Lock()

    def __len__(self) -> int:
        return len(self._targets)

    @property
    def current_target(self) -> str:
        """The endpoint calls go to now."""
        return self._targets[self._current]

    def current(self) -> tuple[int, Any]:
        """The current endpoint's index and stubs (ServiceStubs)."""
        index = self._current
        stub = self._stubs[index]
        if stub is None:
            with self._opening:  # threads of a sync client may race to open the same channel
                stub = self._stubs[index]
                if stub is None:
                    channel = self._open_channel(self._targets[index])
                    self._channels[index] = channel
                    stub = self._stubs[index] = ServiceStubs(channel)
        return index, stub

    def failover(self, index: int) -> None:
        """Endpoint index failed: move on to the next, unless someone already did."""
        if index == self._current:
            self._current = (index + 1) % len(self._targets)

    def take_channels(self) -> list[ChannelT]:
        """The opened channels, forgotten here so the caller can close them."""
        channels = [c for c in self._channels if c is not None]
        self._channels = [None] * len(self._targets)
        self._stubs = [None] * len(self._targets)
        return channels


class CallMetadata:
    """The metadata of every call: static (token, configured pairs) plus the hook's, if any, plus the trace
    context (`traceparent`) while tracing is on."""

    __slots__ = ("_hook", "_static")

    def __init__(self, config: ClientConfig) -> None:
        self._static = config.static_metadata()
        self._hook = config.metadata_hook

    def __call__(self) -> Metadata | None:
        metadata = self._static if self._hook is None else (*self._static, *self._hook())
        if tracing.enabled():  # inside the call's client span: the server's span is its child
            metadata = (*metadata, *tracing.carrier().items())
        return metadata or None


class EpochTracker:
    """The server epoch seen in response headers, and who to tell when it changes.

    A changed epoch means the server lost its soft state (a restart of a memory store): engines
    must register again and re-assert their transfers. An epoch never comes back (each is random,
    never reused), so an answer that carries one this client has already left was sent before the
    change and arrived late (calls and streams answer out of order): it changes nothing. Were it
    taken as news, a session would register a third incarnation and abort what it had re-asserted.
    """

    __slots__ = ("_left", "_listeners", "epoch")

    # How many left epochs are remembered; a late answer can only be from a recent one.
    LEFT_REMEMBERED = 16

    def __init__(self) -> None:
        self.epoch = 0
        self._listeners: list[EpochListener] = []
        self._left: deque[int] = deque(maxlen=self.LEFT_REMEMBERED)

    def observe(self, epoch: int) -> None:
        """Note the epoch of a response; listeners hear of a change as (old, new)."""
        if epoch == self.epoch or not epoch or epoch in self._left:
            return
        old, self.epoch = self.epoch, epoch
        if old:
            self._left.append(old)
            for listener in list(self._listeners):
                listener(old, epoch)

    def add_listener(self, listener: EpochListener) -> Callable[[], None]:
        """Call listener(old, new) on every change; returns a function that removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)


class ClientBase(Generic[ChannelT]):
    """What the sync and the asyncio client hold alike: configuration, endpoints, metadata and epochs.

    The subclass passes its gRPC flavour's channel constructors; only sending differs between them.
    """

    def __init__(
        self,
        config: ClientConfig | str | Sequence[str],
        insecure_channel: Callable[..., ChannelT],
        secure_channel: Callable[..., ChannelT],
    ) -> None:
        self._config = config if isinstance(config, ClientConfig) else ClientConfig(targets=config)
        options = self._config.channel.as_grpc_options()
        credentials = self._config.channel_credentials()

        def open_channel(target: str) -> ChannelT:
            if credentials is None:
                return insecure_channel(target, options=options)
            return secure_channel(target, credentials, options=options)

        self._endpoints: Endpoints[ChannelT] = Endpoints(tuple(self._config.targets), open_channel)
        self._metadata = CallMetadata(self._config)
        self._epochs = EpochTracker()

    @property
    def config(self) -> ClientConfig:
        """The client's configuration."""
        return self._config

    @property
    def target(self) -> str:
        """The endpoint calls go to now ("host:port"); it moves on when one is UNAVAILABLE."""
        return self._endpoints.current_target

    @property
    def epoch(self) -> int:
        """The server epoch of the latest answer (0 before the first)."""
        return self._epochs.epoch

    def add_epoch_listener(self, listener: EpochListener) -> Callable[[], None]:
        """Call listener(old_epoch, new_epoch) when answers show a new epoch; returns a remover."""
        return self._epochs.add_listener(listener)

    @staticmethod
    def _span(call: Call[Any]) -> AbstractContextManager[Span]:
        """The client span of one unary call, its retries included."""
        return tracing.rpc_span(call.method, getattr(call.request, "engine_id", ""))

    def _ended(self, index: int) -> None:
        """A stream from endpoint index ended without an error while the client still read it: the server (a replica
        shutting down, a proxy's stream timeout) let it go, so the next stream goes to the next endpoint, as after
        an UNAVAILABLE one."""
        self._endpoints.failover(index)

    @staticmethod
    def _answered(call: Call[Any], response: Any) -> Any:
        """A unary call's answer. gRPC hands None for a call ended OK without one (a proxy between the client and
        the server can do that): INTERNAL, not retried, as the call may have been applied."""
        if response is None:
            raise Internal(Reason.INTERNAL_ERROR, f"{call.method} ended without an answer (status OK, no message)")
        return response

    def _failed(self, error: grpc.RpcError, index: int) -> RendezvousError:
        converted = from_rpc_error(error)
        if converted.code == grpc.StatusCode.UNAVAILABLE:
            self._endpoints.failover(index)
        return converted
