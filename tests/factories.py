"""The test engine, built once for every layer that takes one.

Every suite registers the same engine: model "tiny" in float32, 16-token blocks, 2 layers; one agent per rank
named after its engine, with metadata b"md-" + its name and DRAM regions of 64 blocks of 4 KiB from 1 MiB on
(`rendezvous.clients.testing.stand_in_agent`, what an engine author's control-plane test registers); a consumer in pool
"decode", a producer in "prefill". The builders differ only in the types of the layer under test:

- `sdk_*`: the SDK's types (`rendezvous.clients`), for tests that go through a client;
- `proto_*`: the protocol's messages (`rendezvous.v1`), for tests that speak raw gRPC;
- `core_*`: the core's records (`rendezvous.core`), for the pure state machine and the stores.

The suites' helper modules (tests/clients/conftest.py, tests/service/conftest.py, tests/core/helpers.py) hand
these on under the names their tests import.
"""

from __future__ import annotations

from typing import Any

from rendezvous import core
from rendezvous.clients import EngineRole, EngineSpec, KvLayout, NixlAgentInfo
from rendezvous.clients.testing import stand_in_agent
from rendezvous.v1 import rendezvous_pb2 as pb

MODEL = "tiny"
DTYPE = "float32"
BLOCK_SIZE = 16
NUM_LAYERS = 2
NUM_BLOCKS = 64
KV_BASES = (1 << 20, 1 << 30)
"""Where a core agent's two regions (K and V) start; the SDK's and the protocol's agents have the first only."""

SDK_LAYOUT = KvLayout(model_fingerprint=MODEL, dtype=DTYPE, block_size=BLOCK_SIZE, num_layers=NUM_LAYERS)
PROTO_LAYOUT = pb.KvLayout(
    model_fingerprint=MODEL, dtype=DTYPE, block_size=BLOCK_SIZE, num_layers=NUM_LAYERS, tp_size=1, pp_size=1
)
CORE_LAYOUT = core.KvLayout(model_fingerprint=MODEL, dtype=DTYPE, block_size=BLOCK_SIZE, num_layers=NUM_LAYERS)


def pool_of(consumer: bool) -> str:
    """The pool the test engines of a role are in."""
    return "decode" if consumer else "prefill"


def sdk_agent(name: str, num_blocks: int = NUM_BLOCKS, rank: int = 0) -> NixlAgentInfo:
    """One rank's agent, as the SDK takes it."""
    return stand_in_agent(name, rank, num_blocks)


def sdk_engine(engine_id: str, role: EngineRole, **kw: Any) -> EngineSpec:
    """A one-rank registration (EngineSpec fields in kw override the defaults: pool, layout, agents, ...)."""
    fields: dict[str, Any] = {
        "pool": pool_of(role == EngineRole.CONSUMER),
        "layout": SDK_LAYOUT,
        "agents": (sdk_agent(engine_id + "-0"),),
    }
    return EngineSpec(engine_id, role=role, **{**fields, **kw})


def proto_agent(name: str, num_blocks: int = NUM_BLOCKS, metadata: bytes | None = None) -> pb.NixlAgent:
    """`sdk_agent` as a protocol message (metadata replaced where given)."""
    agent = sdk_agent(name, num_blocks)
    regions = [
        pb.KvRegion(
            base_address=r.base_address,
            block_stride_bytes=r.block_stride_bytes,
            block_length_bytes=r.block_length_bytes,
            num_blocks=r.num_blocks,
        )
        for r in agent.regions
    ]
    return pb.NixlAgent(
        name=agent.name,
        metadata=agent.metadata if metadata is None else metadata,
        memory_kind=pb.MEMORY_KIND_DRAM,
        regions=regions,
    )


def proto_engine(engine_id: str, role: pb.EngineRole, **kw: Any) -> pb.RegisterEngineRequest:
    """A one-rank RegisterEngine request (its fields in kw override the defaults: pool, layout, agents, ...)."""
    fields: dict[str, Any] = {
        "pool": pool_of(role == pb.ENGINE_ROLE_CONSUMER),
        "layout": PROTO_LAYOUT,
        "agents": [proto_agent(engine_id + "-0")],
    }
    return pb.RegisterEngineRequest(engine_id=engine_id, role=role, **{**fields, **kw})


def core_agent(name: str, num_blocks: int = NUM_BLOCKS, block_bytes: int = 4096) -> core.NixlAgent:
    """One rank with two regions (K and V) of num_blocks blocks, as the core records it."""
    metadata = sdk_agent(name).metadata
    regions = tuple(core.KvRegion(base, block_bytes, block_bytes, num_blocks) for base in KV_BASES)
    return core.NixlAgent(name=name, metadata=metadata, regions=regions)


def core_engine(
    engine_id: str, role: core.Role, layout: core.KvLayout = CORE_LAYOUT, num_blocks: int = NUM_BLOCKS, **kw: Any
) -> core.EngineSpec:
    """A one-rank registration as the core takes it (a pool in kw replaces the role's)."""
    pool = kw.pop("pool", pool_of(role == core.Role.CONSUMER))
    return core.EngineSpec(engine_id, pool, role, layout, (core_agent(f"{engine_id}-rank0", num_blocks),), **kw)
