"""Scoped integrity digests (data-plane version 4): a producer rank that writes only some of a consumer rank's bytes
(other head counts, block sizes or pipeline stages) hashes what its plan writes in the consumer's address order,
and the consumer, planning its own memory as a write into itself, hashes the same bytes: equal digests exactly
when the bytes landed. Checked on every pairing `tests/nixl/test_plan.py` draws, in real host memory."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvous.clients._types import KvLayout, KvRegion, NixlAgentInfo
from rendezvous.clients.nixl.integrity import ScopedDigests, plan_digests, scope_digests, scope_gaps
from rendezvous.clients.nixl.notifications import DigestScope
from rendezvous.clients.nixl.plan import RankGeometry, WritePlan, plan_write
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


@settings(max_examples=examples(200), deadline=None)
@given(cases(), st.data())
def test_a_writer_hashing_region_by_region_as_parts_go_sends_the_whole_plan_s_digests(
    case: Case, data: st.DataObject
) -> None:
    """`ScopedDigests` (a write in parts): the consumer regions whose cells are all posted hashed in any groups,
    the rest at the final, give the digests of the whole plan; so does a source list that changed meanwhile."""
    if not len(case.dst):
        return
    case = dataclasses.replace(case, producer=in_memory(case.producer), consumer=in_memory(case.consumer))
    p, c = case.producer, case.consumer
    bp, bd = p.layout.block_size, c.layout.block_size
    runs = kvmap.token_runs(len(case.src), len(case.dst), bp, bd, case.prompt_tokens, case.target_tokens)
    runs_or_none = runs if bp != bd else None
    for share, plan in plans(case):
        into = geometry(c, share.consumer_rank)
        made = ScopedDigests(geometry(p, share.producer_rank), into, share, p.layout.kv_layout)
        regions = list(share.producer_regions)
        ahead = data.draw(st.lists(st.sampled_from(regions), max_size=len(regions)))
        if data.draw(st.booleans()):
            made.add(ahead[:1], case.src[::-1], case.dst, runs_or_none)  # planned anew once the source grows
        for k in range(0, len(ahead), 2):
            made.add(ahead[k : k + 2], case.src, case.dst, runs_or_none)
        assert made.hashed == len(set(ahead))
        assert made.digests(case.src, case.dst, runs_or_none) == plan_digests(
            plan, into.regions, share.consumer_regions
        )


def test_interleaved_consumer_regions_are_hashed_at_the_final_only() -> None:
    """K and V of each block side by side (a region's span holds the other's blocks): the whole plan hashes the
    other region's bytes into each digest, so no region is hashed alone as the parts go."""
    arena, source = np.zeros(4 * 2 * 8, dtype=np.uint8), np.arange(2 * 4 * 4, dtype=np.uint8)
    kv = [KvRegion(arena.ctypes.data + 8 * i, 16, 8, 4) for i in range(2)]  # 2 heads x 2 tokens x 2 bytes
    src_kv = [KvRegion(source.ctypes.data + 16 * i, 4, 4, 4) for i in range(2)]  # the first head
    into, producer = RankGeometry(kv, 2, 2), RankGeometry(src_kv, 1, 2)
    share = kvmap.RankShare(0, 0, range(0, 2), range(0, 2), 0, 0, 1)
    made = ScopedDigests(producer, into, share, "HND")
    made.add([0], [0, 1], [2, 3], None)
    assert made.hashed == 0
    plan = plan_write(producer, into, share, [0, 1], [2, 3], "HND")
    assert made.digests([0, 1], [2, 3], None) == plan_digests(plan, into.regions, range(0, 2))


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
    assert "no digests cover region 0 head 2" in scope_gaps(half[:1], 4, 4, 32)
    assert "region 0 head 0 2 times" in scope_gaps([half[0], half[0], half[1]], 4, 4, 32)
    assert "digests of only 16 tokens (32 needed)" in scope_gaps([DigestScope(range(0, 4), 0, 4, 16)], 4, 4, 32)
    assert "outside the rank's" in scope_gaps([DigestScope(range(0, 5), 0, 4, 32)], 4, 4, 32)


def test_a_scope_that_does_not_fill_the_blocks_is_refused() -> None:
    arena = np.zeros(4 * 64, dtype=np.uint8)
    geometry = RankGeometry((KvRegion(arena.ctypes.data, 64, 64, 4),), 2, 16)
    with pytest.raises(ValueError, match="40 tokens do not fill the target's 2 blocks of 16"):
        scope_digests(geometry, "HND", DigestScope(range(0, 1), 0, 2, 40), [0, 1])


@pytest.mark.parametrize(("tp_p", "tp_d", "bp", "bd"), [(2, 1, 16, 16), (1, 2, 16, 16), (2, 1, 16, 32), (1, 2, 32, 16)])
def test_vllm_cpu_caches_check_by_head_and_token_with_their_transposed_keys(
    tp_p: int, tp_d: int, bp: int, bd: int
) -> None:
    """vLLM-CPU's layout (HKTV: per head the keys transposed, then the values): each producer rank's digests of
    what it wrote into each consumer rank match the consumer's own hash of its scope, the scopes tile the rank,
    and a changed byte shows."""
    heads, dim, prompt = 4, 4, 3 * max(bp, bd) + 5
    num_src, num_dst = -(-prompt // bp), -(-prompt // bd)
    rng = np.random.default_rng(bp + bd + tp_p)
    producers = [rng.standard_normal((num_src + 1, heads // tp_p, bp, 2 * dim)).astype(np.float32) for _ in range(tp_p)]
    consumers = [np.zeros((num_dst + 2, heads // tp_d, bd, 2 * dim), dtype=np.float32) for _ in range(tp_d)]

    def region(cache: npt.NDArray[np.float32]) -> KvRegion:
        return KvRegion(cache.ctypes.data, cache[0].nbytes, cache[0].nbytes, len(cache))

    lp = KvLayout("m", "float32", bp, 1, tp_p, 1, kvmap.HKTV, heads)
    ld = KvLayout("m", "float32", bd, 1, tp_d, 1, kvmap.HKTV, heads)
    shapes_p = kvmap.rank_shapes(
        lp, [NixlAgentInfo(f"p{r}", b"", rank=r, regions=(region(c),)) for r, c in enumerate(producers)]
    )
    shapes_d = kvmap.rank_shapes(
        ld, [NixlAgentInfo(f"d{r}", b"", rank=r, regions=(region(c),)) for r, c in enumerate(consumers)]
    )
    src, dst = list(range(1, num_src + 1)), list(range(2, num_dst + 2))
    runs = kvmap.token_runs(num_src, num_dst, bp, bd, prompt, prompt) if bp != bd else None
    tokens = prompt if bp != bd else num_dst * bd
    sent: list[tuple[int, DigestScope, tuple[int, ...]]] = []
    for share in kvmap.shares(shapes_p, shapes_d):
        p, c = producers[share.producer_rank], consumers[share.consumer_rank]
        into = RankGeometry((region(c),), heads // tp_d, bd, 4)
        plan = plan_write(RankGeometry((region(p),), heads // tp_p, bp, 4), into, share, src, dst, kvmap.HKTV, runs)
        scope = DigestScope(share.consumer_regions, share.consumer_head, share.num_heads, tokens)
        sent.append((share.consumer_rank, scope, plan_digests(plan, into.regions, scope.regions)))
        for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
            ctypes.memmove(ra, la, n)
    for rank, c in enumerate(consumers):
        geometry = RankGeometry((region(c),), heads // tp_d, bd, 4)
        mine = [(scope, digests) for r, scope, digests in sent if r == rank]
        assert scope_gaps((scope for scope, _ in mine), 1, heads // tp_d, prompt) == ""
        assert [scope_digests(geometry, kvmap.HKTV, scope, dst) for scope, _ in mine] == [d for _, d in mine]
        c[dst[-1], 0, 0, dim] += 1.0  # the first value of the last block's first token
        assert [scope_digests(geometry, kvmap.HKTV, scope, dst) for scope, _ in mine] != [d for _, d in mine]
