"""`RankAgent`: what a producer and a consumer rank have alike, around their own NIXL threads.

Both join one rank's NIXL agent to an engine session of their role: the session is opened by `start`,
announcing the rank's agent, and ended by `close`; callbacks from the NIXL thread hop onto the loop the
agent was started on.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, Self, TypeVar

from clients._config import SessionConfig
from clients._roles import RoleSession
from clients._types import KvLayout, NixlAgentInfo, SessionEvent
from clients.aio import AsyncRendezvousClient

if TYPE_CHECKING:
    import torch

SessionT = TypeVar("SessionT", bound=RoleSession)


class RankAgent(abc.ABC, Generic[SessionT]):
    """One rank's NIXL agent and its engine session (of type `session_type`). `start()`, then `close()`."""

    session_type: type[SessionT]

    def __init__(
        self,
        client: AsyncRendezvousClient,
        engine_id: str,
        pool: str,
        tensors: Sequence[torch.Tensor],
        *,
        agent_name: str | None,
        rank: int,
        layout: KvLayout | None,
        labels: Mapping[str, str] | None,
        lease_ttl: float,
        session_config: SessionConfig | None,
    ) -> None:
        self.rank = rank
        self._tensors = tuple(tensors)
        self._agent_name = agent_name or f"{engine_id}-rank{rank}"
        self._session_args = (client, engine_id, pool, layout, labels, lease_ttl, session_config)
        self._session: SessionT | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the NIXL side, register the engine and watch its events."""

    @abc.abstractmethod
    async def close(self, *, deregister: bool = True) -> None:
        """Stop the NIXL side, then end the session."""

    @abc.abstractmethod
    async def handle_event(self, item: SessionEvent) -> None:
        """React to one session event; the session calls this for each, in order."""

    def _new_session(self, announced: NixlAgentInfo) -> SessionT:
        """The engine session announcing this rank's agent, its events going to `handle_event`."""
        client, engine_id, pool, layout, labels, lease_ttl, config = self._session_args
        return self.session_type(
            client,
            engine_id,
            pool,
            layout=layout,
            agents=(announced,),
            labels=labels,
            lease_ttl=lease_ttl,
            config=config,
            handler=self.handle_event,
        )

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
        """The engine session (registration, lease, events)."""
        if self._session is None:
            raise RuntimeError("the agent is not started")
        return self._session

    @property
    def agent_name(self) -> str:
        """This rank's NIXL agent name."""
        return self._agent_name
