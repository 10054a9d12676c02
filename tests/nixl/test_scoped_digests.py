"""Scoped integrity digests (data-plane version 4): a producer rank that writes only some of a consumer rank's bytes
(other head counts, block sizes or pipeline stages) hashes what its plan writes in the consumer's address order,
and the consumer, planning its own memory as a write into itself, hashes the same bytes: equal digests exactly
when the bytes landed. Checked on every pairing `tests/nixl/test_plan.py` draws, in real host memory."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings

from rendezvous.clients._types import KvRegion
from rendezvous.clients.nixl.integrity import plan_digests, scope_digests, scope_gaps
from rendezvous.clients.nixl.notifications import DigestScope
from rendezvous.clients.nixl.plan import RankGeometry, WritePlan
from rendezvous.protocol import kvmap
from tests.ci import examples
from tests.nixl.test_plan import Case, FakeEngine, apply, cases, make_engine, plans

pytest.importorskip("xxhash", reason="integrity needs the nixl extra's xxhash")


def in_memory(engine: FakeEngine) -> FakeEngine:
    """`engine` with each rank's regions at its arena's real address (the arenas stay referenced by it)."""
    agents = []
    for agent, arena in zip(engine.agents, engine.arenas, strict=True):
        base = arena.ctypes.data
        regions = tuple(dataclasses.replace(r, base_address=base + r.base_address) for r in agent.regions)
        agents.append(dataclasses.replace(agent, regions=regions))
    return dataclasses.replace(engine, agents=tuple(agents))


def scope(case: Case, share: kvmap.RankShare) -> DigestScope:
    """What the writer says its digests cover (`writer._scoped`)."""
    bp, bd = case.producer.layout.block_size, case.consumer.layout.block_size
    tokens = len(case.dst) * bd if bp == bd else case.target_tokens
    return DigestScope(share.consumer_regions, share.consumer_head, share.num_heads, tokens)


def geometry(engine: FakeEngine, rank: int) -> RankGeometry:
    return RankGeometry(engine.agents[rank].regions, engine.heads, engine.layout.block_size)


def land(case: Case, planned: list[tuple[kvmap.RankShare, WritePlan]]) -> list[npt.NDArray[np.int64]]:
    """Copy every plan's bytes into the consumer's arenas, in place; how often each byte was written."""
    got, writes = apply(case, [(share, at_offsets(case, share, plan)) for share, plan in planned])
    for arena, new in zip(case.consumer.arenas, got, strict=True):
        arena[:] = new
    return writes


def at_offsets(case: Case, share: kvmap.RankShare, plan: WritePlan) -> WritePlan:
    """`plan` with its addresses as offsets into the two ranks' arenas (what `apply` copies by)."""
    local, remote = plan.local.copy(), plan.remote.copy()
    local[:, 0] -= np.uint64(case.producer.arenas[share.producer_rank].ctypes.data)
    remote[:, 0] -= np.uint64(case.consumer.arenas[share.consumer_rank].ctypes.data)
    return WritePlan(local, remote)


@settings(max_examples=examples(200), deadline=None)
@given(cases())
def test_a_consumer_hashes_what_each_writer_hashed_and_a_changed_byte_shows(case: Case) -> None:
    if not len(case.dst):
        return  # nothing is written: nothing to hash (a target of no blocks arrives on the commit)
    case = dataclasses.replace(case, producer=in_memory(case.producer), consumer=in_memory(case.consumer))
    planned = plans(case)
    sent = [(share, scope(case, share), plan_digests(plan, geometry(case.consumer, share.consumer_rank).regions,
             share.consumer_regions)) for share, plan in planned]  # fmt: skip
    writes = land(case, planned)
    kv_layout = case.consumer.layout.kv_layout
    for share, s, digests in sent:
        assert scope_digests(geometry(case.consumer, share.consumer_rank), kv_layout, s, case.dst) == digests
    for rank in range(len(case.consumer.agents)):
        scopes = [s for share, s, _ in sent if share.consumer_rank == rank]
        regions = len(case.consumer.agents[rank].regions)
        assert scope_gaps(scopes, regions, case.consumer.heads, case.target_tokens) == ""
    rank = next(r for r, w in enumerate(writes) if w.any())
    changed = int(np.flatnonzero(writes[rank])[0])
    case.consumer.arenas[rank][changed] ^= 0xFF
    got = [scope_digests(geometry(case.consumer, share.consumer_rank), kv_layout, s, case.dst)
           for share, s, _ in sent if share.consumer_rank == rank]  # fmt: skip
    assert got != [digests for share, _, digests in sent if share.consumer_rank == rank]


def test_a_descriptor_merged_across_two_regions_counts_for_each_its_own_bytes() -> None:
    """Region 0's last target block and region 1's first lie side by side in the consumer's memory, so its own
    plan merges them into one descriptor, where the producer's plan (not contiguous at the source) does not: each
    region's digest takes its own byte of it (found by the property test above)."""
    producer, consumer = (
        in_memory(make_engine(1, 1, 2, 1, 1, "HND", (1,), n, 0, seed)) for n, seed in ((2, 1), (6, 2))
    )
    case = Case(producer, consumer, np.array([1, 0]), np.array([0, 5]), 0, 0, False, True)
    ((share, plan),) = plans(case)
    assert plan.num_descriptors == 4  # 1 -> 0, 0 -> 5 in each region: nothing contiguous on both sides
    sent = plan_digests(plan, geometry(consumer, 0).regions, share.consumer_regions)
    land(case, [(share, plan)])
    assert scope_digests(geometry(consumer, 0), "HND", scope(case, share), case.dst) == sent


def test_scopes_must_cover_every_region_and_head_once_with_the_whole_target() -> None:
    half = [DigestScope(range(0, 4), 0, 2, 32), DigestScope(range(0, 4), 2, 2, 32)]
    assert scope_gaps(half, 4, 4, 32) == ""
    assert "region 0 head 2 0 times" in scope_gaps(half[:1], 4, 4, 32)
    assert "region 0 head 0 2 times" in scope_gaps([half[0], half[0], half[1]], 4, 4, 32)
    assert "digests of only 16 tokens (32 needed)" in scope_gaps([DigestScope(range(0, 4), 0, 4, 16)], 4, 4, 32)
    assert "outside the rank's" in scope_gaps([DigestScope(range(0, 5), 0, 4, 32)], 4, 4, 32)


def test_a_scope_that_does_not_fill_the_blocks_is_refused() -> None:
    arena = np.zeros(4 * 64, dtype=np.uint8)
    geometry = RankGeometry((KvRegion(arena.ctypes.data, 64, 64, 4),), 2, 16)
    with pytest.raises(ValueError, match="40 tokens do not fill the target's 2 blocks of 16"):
        scope_digests(geometry, "HND", DigestScope(range(0, 1), 0, 2, 40), [0, 1])
