"""How many store calls an RPC makes, counted by a thin wrapper around the server's real memory store."""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.store.base import Store
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import engine_request


class CountingStore:
    """Forwards everything to the real store and counts its coroutine calls by method name."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name.startswith("_") or not inspect.iscoroutinefunction(attr):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return await attr(*args, **kwargs)

        return counted


@pytest.fixture
async def counted(server_config: ServerConfig) -> AsyncIterator[tuple[pb_grpc.RendezvousServiceStub, CountingStore]]:
    # The sweeper and the health loop run once at start, then stay out of the counts.
    config = dataclasses.replace(server_config, sweep_interval=3600.0, health_interval=3600.0)
    server = RendezvousServer(config)
    store = CountingStore(server.store)
    server.store = server.coordinator.store = store  # type: ignore[assignment]
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield pb_grpc.RendezvousServiceStub(channel), store
    finally:
        await server.stop(0)


async def test_list_engines_makes_the_same_few_store_calls_for_any_number_of_engines(
    counted: tuple[pb_grpc.RendezvousServiceStub, CountingStore],
) -> None:
    stub, store = counted
    await stub.RegisterEngine(engine_request("d0", pb.ENGINE_ROLE_CONSUMER))
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    )
    store.calls.clear()
    one = await stub.ListEngines(pb.ListEnginesRequest())
    calls_for_one = sum(store.calls.values())
    for i in range(1, 8):
        await stub.RegisterEngine(engine_request(f"d{i}", pb.ENGINE_ROLE_CONSUMER))
    store.calls.clear()
    many = await stub.ListEngines(pb.ListEnginesRequest())
    assert sum(store.calls.values()) == calls_for_one <= 3, dict(store.calls)
    assert "live_transfer_ids" not in store.calls
    assert [(e.engine_id, e.live_transfers) for e in one.engines] == [("d0", 1)]
    assert [(e.engine_id, e.live_transfers) for e in many.engines] == [("d0", 1)] + [(f"d{i}", 0) for i in range(1, 8)]
    got = await stub.GetEngine(pb.GetEngineRequest(engine_id="d0"))
    assert got.engine.live_transfers == 1
