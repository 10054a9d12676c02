"""A producer whose watch fell behind the service's event log (resync) still writes what was assigned to it
meanwhile: the TRANSFER_ASSIGNED events it lost are taken from the listing it resyncs from. Before, those
transfers waited, MATCHED and never written, until their deadline aborted them. Real service, real NIXL; the
producer's connection goes through a loopback proxy the test cuts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, TransferState
from rendezvous.clients._types import Resynced, SessionEvent
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.testing import start_test_server
from rendezvous.core.limits import Limits
from tests.clients.conftest import WAIT, TcpProxy, client_config
from tests.nixl.test_producer_parts import LAYOUT

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

TRANSFERS = 6


async def test_assignments_lost_with_the_watch_s_events_are_written_after_the_resync() -> None:
    kv = [torch.arange(8 * 256, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 256) for _ in range(2)]
    decode = [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(2)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    async with (
        start_test_server(limits=Limits(max_events_per_engine=4), grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy = TcpProxy(server.port)
        await proxy.start()
        try:
            async with AsyncRendezvousClient(client_config(proxy.address)) as proxied:
                producer = ProducerAgent(proxied, "p0", "prefill", kv, layout=LAYOUT)
                consumer = ConsumerAgent(client, "d0", "decode", decode, layout=LAYOUT, on_result=results.put_nowait)
                resynced = asyncio.Event()
                handle = producer.handle_event

                async def seen(item: SessionEvent) -> None:
                    await handle(item)
                    if isinstance(item, Resynced):
                        resynced.set()

                producer.handle_event = seen  # type: ignore[method-assign]
                await producer.start()
                await consumer.start()
                try:
                    ids = [f"t{i}" for i in range(TRANSFERS)]
                    for i, t in enumerate(ids):
                        assert (await producer.claim(t)).state is TransferState.CLAIMED
                        producer.ready(t, [i])
                    proxy.refuse(True)
                    proxy.cut()  # the producer's watch is away while 6 assignments pass its log's 4 events
                    for i, t in enumerate(ids):
                        assert (await consumer.register_target(t, [7 - i])).state is TransferState.MATCHED
                    proxy.refuse(False)
                    await asyncio.wait_for(resynced.wait(), WAIT)
                    arrived = [await asyncio.wait_for(results.get(), WAIT) for _ in ids]
                finally:
                    await producer.close()
                    await consumer.close()
        finally:
            await proxy.close()
    assert sorted(r.transfer_id for r in arrived) == ids and all(r.ok for r in arrived)
    for d, s in zip(decode, kv, strict=True):
        assert all(torch.equal(d[7 - i], s[i]) for i in range(TRANSFERS))
