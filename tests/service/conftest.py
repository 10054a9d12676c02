"""A real rendezvous server on a free loopback port, and a raw stub to talk to it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rendezvous.core import Limits, Timeouts
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

LAYOUT = pb.KvLayout(model_fingerprint="tiny", dtype="float32", block_size=16, num_layers=2, tp_size=1, pp_size=1)


def agent(name: str, num_blocks: int = 64) -> pb.NixlAgent:
    region = pb.KvRegion(base_address=1 << 20, block_stride_bytes=4096, block_length_bytes=4096, num_blocks=num_blocks)
    return pb.NixlAgent(name=name, metadata=b"md-" + name.encode(), memory_kind=pb.MEMORY_KIND_DRAM, regions=[region])


def engine_request(engine_id: str, role: pb.EngineRole, **kw: Any) -> pb.RegisterEngineRequest:
    pool = "decode" if role == pb.ENGINE_ROLE_CONSUMER else "prefill"
    return pb.RegisterEngineRequest(
        engine_id=engine_id, pool=pool, role=role, layout=LAYOUT, agents=[agent(engine_id + "-0")], **kw
    )


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(
        listen="127.0.0.1:0",
        limits=Limits(max_events_per_engine=64, max_batch_items=128, max_watchers_per_engine=2),
        timeouts=Timeouts(default_lease_ttl=5),
        sweep_interval=0.02,
        grace=0.2,
    )


@pytest.fixture
async def server(server_config: ServerConfig) -> AsyncIterator[RendezvousServer]:
    srv = RendezvousServer(server_config)
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.fixture
async def stub(server: RendezvousServer) -> AsyncIterator[pb_grpc.RendezvousServiceStub]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield pb_grpc.RendezvousServiceStub(channel)
