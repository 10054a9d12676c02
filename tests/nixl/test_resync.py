"""An agent whose watch fell behind the service's event log (resync) still does the work the events it lost
asked of it, taken from the listing it resyncs from: a producer writes what was assigned to it meanwhile
(TRANSFER_ASSIGNED), a pull consumer reads the sources made ready meanwhile (SOURCE_READY). Before, those
transfers waited, MATCHED, until their deadline aborted them. Real service, real NIXL; the lagging agent's
connection goes through a loopback proxy the test cuts while six events pass its log's bound of four. Each also runs
under auth, each engine with its own bound token: the listing's peers are read with GetEngine through their
transfer (`GetEngineRequest.transfer_id`), which an engine's token may; before, that read was refused
(ROLE_REQUIRED) and the lost work was never done."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, ClientConfig, TransferMode, TransferState
from rendezvous.clients._types import Resynced, SessionEvent
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.testing import start_test_server
from rendezvous.core.limits import Limits
from tests.clients.conftest import WAIT, TcpProxy, client_config
from tests.nixl.test_producer_parts import LAYOUT

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

TRANSFERS = 6
IDS = [f"t{i}" for i in range(TRANSFERS)]
TOKENS = {"p0": "tok-p0-resync-producer-41c9", "d0": "tok-d0-resync-consumer-8e27"}
AUTH = {
    "tokens": {
        TOKENS["p0"]: {"name": "p0", "engines": ["p0"], "engine_roles": ["producer"], "engine_pools": ["prefill"]},
        TOKENS["d0"]: {"name": "d0", "engines": ["d0"], "engine_roles": ["consumer"], "engine_pools": ["decode"]},
    }
}


@dataclasses.dataclass
class Lagging:
    """A producer "p0" and a consumer "d0" (one serving pull reads) on a service whose event logs keep 4 events; one
    of them connects through a proxy the test cuts. `resynced` is set once that one handled its Resynced."""

    producer: ProducerAgent
    consumer: ConsumerAgent
    proxy: TcpProxy
    client: AsyncRendezvousClient
    results: asyncio.Queue[TransferResult]
    resynced: asyncio.Event
    kv: list[torch.Tensor]
    decode: list[torch.Tensor]

    async def arrived(self) -> None:
        """Every transfer's result came ok, its bytes in the consumer's blocks: source i in block 7 - i."""
        results = [await asyncio.wait_for(self.results.get(), WAIT) for _ in IDS]
        assert sorted(r.transfer_id for r in results) == IDS and all(r.ok for r in results)
        for d, s in zip(self.decode, self.kv, strict=True):
            assert all(torch.equal(d[7 - i], s[i]) for i in range(TRANSFERS))


def secured(folder: Path | None) -> dict[str, Any]:
    """The server's config: an auth file in folder (None: no auth)."""
    if folder is None:
        return {}
    path = folder / "auth.json"
    path.write_text(json.dumps(AUTH))
    return {"auth_file": str(path)}


def config(address: str, auth: bool, engine_id: str) -> ClientConfig:
    """A client of address for engine_id (its token, under auth)."""
    return dataclasses.replace(client_config(address), token=TOKENS[engine_id] if auth else None)


@contextlib.asynccontextmanager
async def lagging(side: str, auth: Path | None = None) -> AsyncIterator[Lagging]:
    """The pair, the `side` agent through the proxy; under auth (an auth file in `auth`) each agent's client has its
    engine's token, and `client` is the other side's."""
    kv = [torch.arange(8 * 256, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 256) for _ in range(2)]
    decode = [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(2)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    resynced = asyncio.Event()
    watched_id, other_id = ("p0", "d0") if side == "producer" else ("d0", "p0")
    on = auth is not None
    async with (
        start_test_server(limits=Limits(max_events_per_engine=4), grace=0.1, **secured(auth)) as server,
        AsyncRendezvousClient(config(server.address, on, other_id)) as client,
    ):
        proxy = TcpProxy(server.port)
        await proxy.start()
        try:
            async with AsyncRendezvousClient(config(proxy.address, on, watched_id)) as proxied:
                producer = ProducerAgent(
                    proxied if side == "producer" else client, "p0", "prefill", kv, layout=LAYOUT, serve_reads=True
                )
                consumer = ConsumerAgent(
                    proxied if side == "consumer" else client, "d0", "decode", decode, layout=LAYOUT,
                    on_result=results.put_nowait,
                )  # fmt: skip
                watched = producer if side == "producer" else consumer
                handle = watched.handle_event

                async def seen(item: SessionEvent) -> None:
                    await handle(item)
                    if isinstance(item, Resynced):
                        resynced.set()

                watched.handle_event = seen  # type: ignore[method-assign]
                await producer.start()
                await consumer.start()
                try:
                    yield Lagging(producer, consumer, proxy, client, results, resynced, kv, decode)
                finally:
                    await producer.close()
                    await consumer.close()
        finally:
            await proxy.close()


@pytest.mark.parametrize("auth", [False, True], ids=["open", "auth"])
async def test_assignments_lost_with_the_watch_s_events_are_written_after_the_resync(
    auth: bool, tmp_path: Path
) -> None:
    async with lagging("producer", tmp_path if auth else None) as pair:
        for i, t in enumerate(IDS):
            assert (await pair.producer.claim(t)).state is TransferState.CLAIMED
            pair.producer.ready(t, [i])
        pair.proxy.refuse(True)
        pair.proxy.cut()  # the producer's watch is away while 6 assignments pass its log's 4 events
        for i, t in enumerate(IDS):
            assert (await pair.consumer.register_target(t, [7 - i])).state is TransferState.MATCHED
        pair.proxy.refuse(False)
        await asyncio.wait_for(pair.resynced.wait(), WAIT)
        await pair.arrived()


@pytest.mark.parametrize("auth", [False, True], ids=["open", "auth"])
async def test_sources_made_ready_with_the_watch_s_events_lost_are_read_after_the_resync(
    auth: bool, tmp_path: Path
) -> None:
    async with lagging("consumer", tmp_path if auth else None) as pair:
        for i, t in enumerate(IDS):
            registered = await pair.consumer.register_target(t, [7 - i], mode=TransferMode.PULL)
            assert registered.state is TransferState.TARGETED
        pair.proxy.refuse(True)
        pair.proxy.cut()  # the consumer's watch is away while 6 sources become ready
        for i, t in enumerate(IDS):
            assert (await pair.producer.claim(t)).state is TransferState.MATCHED
            pair.producer.ready(t, [i], mode=TransferMode.PULL)
        await eventually_ready(pair.client)
        pair.proxy.refuse(False)
        await asyncio.wait_for(pair.resynced.wait(), WAIT)
        await pair.arrived()


async def eventually_ready(client: AsyncRendezvousClient) -> None:
    """Until the service holds every transfer's source blocks (MarkSourcesReady is batched in the background)."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not all([(await client.get_transfer(t)).source_block_ids for t in IDS]):
        assert asyncio.get_running_loop().time() < deadline, "the sources were never marked ready"
        await asyncio.sleep(0.01)
