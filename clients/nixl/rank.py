"""`RankAgent`: what a producer and a consumer rank have alike, around their own NIXL threads.

Both join one rank's NIXL agent to an engine session: `open` starts the rank's NIXL side and returns its
`NixlAgentInfo`; `start` then either registers the engine (rank 0, or a single-rank engine) with every rank's
agent, in a session of its role, or follows that registration from another rank (`RankSession`); `close` ends
it. Callbacks from the NIXL thread hop onto the loop the agent was started on. Both time their side of the data
plane in Prometheus histograms (`rendezvous.clients.nixl.metrics`), kept in the registry given as `metrics_registry`
(default: prometheus_client's global `REGISTRY`).

A multi-rank engine (tensor or pipeline parallel) runs one agent per rank, usually in one process each:

    info = await agent.open()                       # every rank
    infos = gather(info)                            # the engine's own channel (e.g. torch.distributed)
    await agent.start(agents=infos)                 # rank 0: registers every rank
    await agent.start(follow=incarnation)           # other ranks, once rank 0 registered

`start_ranks` does all of that for ranks hosted in one process (tests, benchmarks, a single-process engine).
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, Self, TypedDict, TypeVar, Unpack

from rendezvous.clients._config import SessionConfig
from rendezvous.clients._roles import RoleSession
from rendezvous.clients._session import RankSession
from rendezvous.clients._types import (
    CompletionSpec,
    EngineCapacity,
    EngineInfo,
    KvLayout,
    NixlAgentInfo,
    SessionEvent,
)
from rendezvous.clients.aio import AsyncRendezvousClient
from rendezvous.clients.nixl.batching import Batcher, batcher_of
from rendezvous.clients.nixl.metrics import DataPlaneMetrics
from rendezvous.protocol.dataplane import DATA_PLANE_VERSION
from rendezvous.protocol.errors import RendezvousError

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

SessionT = TypeVar("SessionT", bound=RoleSession)

logger = logging.getLogger(__name__)

FOLLOWER_CHECK_S = 5.0
"""How often a following rank asks the service about a transfer it holds (a target it expects, a source handed
over) and has heard nothing of: rank 0's registration or claim of it may have failed, and then no event comes."""


class RankOptions(TypedDict, total=False):
    """The keyword arguments every rank agent takes (`ProducerAgent`, `ConsumerAgent`); all optional."""

    agent_name: str | None
    """This rank's NIXL agent name; default "<engine_id>-rank<rank>"."""
    rank: int
    """This rank's place in its engine (tensor-parallel rank, then pipeline stages); default 0."""
    layout: KvLayout | None
    """The engine's KV layout, registered with it (with this data plane's `data_plane_version`); required,
    stating at least model_fingerprint and num_layers."""
    labels: Mapping[str, str] | None
    """Engine labels (the router reads `url`)."""
    lease_ttl: float
    """Seconds of lease per renewal; default 0: the server's."""
    session_config: SessionConfig | None
    """The engine session's batching, reconnect and lease settings."""
    metrics_registry: CollectorRegistry | None
    """Where the data-plane histograms go; default prometheus_client's global `REGISTRY`."""


class RankAgent(abc.ABC, Generic[SessionT]):
    """One rank's NIXL agent and its engine session (of type `session_type`). `start()`, then `close()`."""

    session_type: type[SessionT]
    writes: bool = False
    """Whether the rank WRITEs into another engine's blocks (a producer's): a following rank's session then keeps
    a write fence (`RankSession`, `fenced`)."""

    def __init__(
        self,
        client: AsyncRendezvousClient,
        engine_id: str,
        pool: str,
        tensors: Sequence[torch.Tensor],
        *,
        capacity: EngineCapacity | None = None,
        **options: Unpack[RankOptions],
    ) -> None:
        self.engine_id = engine_id
        self.rank = rank = options.get("rank", 0)
        self.metrics = DataPlaneMetrics.of(options.get("metrics_registry"))
        """This rank's data-plane histograms (`rendezvous.clients.nixl.metrics`), in the registry the agent was
        given."""
        layout = options.get("layout")
        if layout is None or not layout.model_fingerprint or layout.num_layers < 1:
            raise ValueError(
                f"{type(self).__name__} needs layout=KvLayout(...) stating at least model_fingerprint and num_layers,"
                f" got {layout}: the service checks the producer's layout against the consumer's before any byte is"
                " written, and an empty one matches only another empty one"
            )
        # This data plane states the version it speaks, whatever layout it was given: the service pairs by it.
        self.layout = replace(layout, data_plane_version=DATA_PLANE_VERSION)
        self._tensors = tuple(tensors)
        self._agent_name = options.get("agent_name") or f"{engine_id}-rank{rank}"
        self._session_args = (
            client,
            engine_id,
            pool,
            self.layout,
            options.get("labels"),
            options.get("lease_ttl", 0.0),
            options.get("session_config"),
        )
        self._capacity = capacity
        self._session: SessionT | None = None
        self._follower: RankSession | None = None
        self._announced: NixlAgentInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._completions: dict[tuple[int, int], Batcher[CompletionSpec]] = {}  # by the incarnation they answer

    async def open(self) -> NixlAgentInfo:
        """Start this rank's NIXL side (idempotent); its agent, to register with the engine's other ranks."""
        if self._announced is None:
            self._loop = asyncio.get_running_loop()
            self._announced = await self._open()
        return self._announced

    async def start(self, *, agents: Sequence[NixlAgentInfo] = (), follow: int | None = None) -> None:
        """Register the engine with `agents` (every rank's, this one's included; default: this rank alone) and
        watch its events; or, with `follow`, follow the registration rank 0 made (incarnation `follow` or a later
        one) as this rank. Opens the NIXL side first if `open` was not called."""
        announced = await self.open()
        try:
            if follow is not None:
                client, engine_id, *_, config = self._session_args
                follower = RankSession(client, engine_id, config=config, handler=self.handle_event, fenced=self.writes)
                self._follower = follower
                self._on_session(follower)
                await follower.start(follow)
            else:
                session = self._new_session(tuple(agents) or (announced,))
                self._session = session
                self._on_session(session)
                await session.start()
        except BaseException:
            await self._stop_threads()
            raise

    @abc.abstractmethod
    async def _open(self) -> NixlAgentInfo:
        """Start the NIXL side; this rank's agent."""

    @abc.abstractmethod
    def _on_session(self, session: SessionT | RankSession) -> None:
        """Set up what calls the service through `session` (before it starts)."""

    @abc.abstractmethod
    async def _stop_threads(self) -> None:
        """Stop the NIXL side."""

    @abc.abstractmethod
    async def close(self, *, deregister: bool = True) -> None:
        """Stop the NIXL side, then end the session."""

    @abc.abstractmethod
    async def handle_event(self, item: SessionEvent) -> None:
        """React to one session event; the session calls this for each, in order."""

    @property
    def leader(self) -> bool:
        """Whether this rank registered the engine (and makes its engine-wide calls), rather than follows."""
        return self._follower is None

    def _new_session(self, agents: tuple[NixlAgentInfo, ...]) -> SessionT:
        """The engine session announcing `agents`, its events going to `handle_event`."""
        client, engine_id, pool, layout, labels, lease_ttl, config = self._session_args
        return self.session_type(
            client,
            engine_id,
            pool,
            layout=layout,
            agents=agents,
            labels=labels,
            lease_ttl=lease_ttl,
            config=config,
            handler=self.handle_event,
            capacity=self._capacity,
        )

    async def _finish_calls(self, batchers: Sequence[Batcher[Any] | None]) -> None:
        """Closing: end the calls the batchers made, before the session is closed. The session stops waiting for a
        re-registration (`begin_close`): the calls waiting for one (on a following rank, for rank 0 to register
        again, which it may never do) fail with `Cancelled` at once, while a healthy session still sends the rest,
        until its lease may have lapsed, so that what the rank submitted last is reported before it closes."""
        session = self._session or self._follower
        if session is not None:
            session.begin_close()
        for batcher in batchers:
            if batcher is not None:
                await batcher.close()

    def _completions_of(self, assigned_to: tuple[int, int]) -> Batcher[CompletionSpec]:
        """The batcher of the outcomes answering `assigned_to`'s events (a producer's TRANSFER_ASSIGNED, a pull
        consumer's SOURCE_READY), sent as that incarnation only (`EngineSession.complete_transfers`); a replaced
        incarnation's is dropped once its calls are done."""
        send = functools.partial(self.engine_session.complete_transfers, assigned_to=assigned_to)
        return batcher_of(self._completions, assigned_to, "CompleteTransfers", send)

    async def _close_session(self, deregister: bool) -> None:
        if self._session is not None:
            await self._session.close(deregister=deregister)
        if self._follower is not None:
            await self._follower.close()

    def _on_loop(self, callback: Callable[..., None]) -> Callable[..., None]:
        """callback as a function another thread may call: it runs on the agent's loop (not once that closed)."""

        def hop(*args: object) -> None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(callback, *args)

        return hop

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def session(self) -> SessionT:
        """The engine session (registration, lease, events) of the rank that registered the engine."""
        if self._session is None:
            raise RuntimeError("the agent is not started" if self._follower is None else "a following rank has none")
        return self._session

    @property
    def engine_session(self) -> SessionT | RankSession:
        """This rank's session: the registering one, or the one following it."""
        session = self._session or self._follower
        if session is None:
            raise RuntimeError("the agent is not started")
        return session

    async def _peer_after_resync(self, engine_id: str, incarnation: int, transfer_id: str) -> EngineInfo | None:
        """A transfer's peer engine as the service has it now, if still the incarnation a resync's listing names
        (None: gone or replaced since, a loss the service reports by aborting the transfer; or unreadable now)."""
        try:
            peer = await self.engine_session.client.get_engine(engine_id, transfer_id=transfer_id)
        except RendezvousError as e:
            logger.warning("transfer %s: its peer %s could not be read after a resync: %s", transfer_id, engine_id, e)
            return None
        return peer if peer.incarnation == incarnation else None

    @property
    def agent_name(self) -> str:
        """This rank's NIXL agent name."""
        return self._agent_name


async def start_ranks(agents: Sequence[RankAgent[Any]]) -> None:
    """Start one engine's ranks, all in this process: open each, register the engine from `agents[0]` with every
    rank's agent, and have the others follow that registration."""
    infos = [await agent.open() for agent in agents]
    await agents[0].start(agents=infos)
    for follower in agents[1:]:
        await follower.start(follow=agents[0].session.incarnation)
