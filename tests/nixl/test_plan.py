"""Write plans against a brute-force model: fake rank memories, a "copy" by descriptors, byte by byte."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvous.clients._types import KvLayout, KvRegion, NixlAgentInfo
from rendezvous.clients.nixl.errors import BlockRangeError, LayoutMismatchError
from rendezvous.clients.nixl.plan import RankGeometry, WritePlan, plan_write
from rendezvous.protocol import kvmap
from tests.ci import examples

BASE = 64  # arenas start at a non-zero "address"


@dataclass
class FakeEngine:
    """An engine's ranks as byte arenas; region addresses are offsets into their rank's arena."""

    layout: KvLayout
    agents: tuple[NixlAgentInfo, ...]
    arenas: list[npt.NDArray[np.uint8]]
    units: tuple[int, ...]

    @property
    def heads(self) -> int:
        return self.layout.num_kv_heads // self.layout.tp_size

    def stage_layers(self, rank: int) -> range:
        agent = self.agents[rank]
        return range(agent.first_layer, agent.first_layer + (agent.num_layers or self.layout.num_layers))

    def offset(self, unit: int, head: npt.NDArray[np.int64], token: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Byte offset of (head, token) in a block of this engine (opaque and HEAD_MAJOR blocks are laid out HND:
        a HEAD_MAJOR head's order within is the engine's own, the same on both sides)."""
        b = self.layout.block_size
        if self.layout.kv_layout == "NHD":
            return (token * self.heads + head) * unit
        return (head * b + token) * unit


def make_engine(
    tp: int,
    pp: int,
    layers: int,
    heads: int,
    block_size: int,
    kv_layout: str,
    units: tuple[int, ...],
    blocks: int,
    pad: int,
    seed: int,
) -> FakeEngine:
    layout = KvLayout("m", "u8", block_size, layers, tp, pp, kv_layout, heads)
    bounds = np.linspace(0, layers, pp + 1).astype(int)
    rng = np.random.default_rng(seed)
    agents, arenas = [], []
    for rank in range(tp * pp):
        stage = rank // tp
        first, count = int(bounds[stage]), int(bounds[stage + 1] - bounds[stage])
        regions, address = [], BASE
        for _ in range(count):
            for unit in units:
                length = heads // tp * block_size * unit
                regions.append(KvRegion(address, length + pad, length, blocks))
                address += (length + pad) * blocks
        arenas.append(rng.integers(0, 256, address, dtype=np.uint8))
        agents.append(
            NixlAgentInfo(
                f"r{rank}",
                b"",
                rank,
                regions=tuple(regions),
                first_layer=first if pp > 1 else 0,
                num_layers=count if pp > 1 else 0,
            )
        )
    return FakeEngine(layout, tuple(agents), arenas, units)


@dataclass(frozen=True)
class Case:
    producer: FakeEngine
    consumer: FakeEngine
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    prompt_tokens: int
    target_tokens: int
    explicit_runs: bool
    merge: bool


TP_PAIRS = [(n, 1) for n in range(1, 9)] + [(1, n) for n in range(2, 9)] + [(2, 4), (4, 2), (2, 8), (8, 4)]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tp_p, tp_d = draw(st.sampled_from(TP_PAIRS))
    heads = max(tp_p, tp_d) * draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(1, 3))
    pp_p, pp_d = draw(st.integers(1, min(layers, 2))), draw(st.integers(1, min(layers, 2)))
    units = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    base = draw(st.sampled_from([1, 2, 4]))
    bp, bd = draw(
        st.sampled_from([(base, base), (base, 2 * base), (2 * base, base), (base, 4 * base), (4 * base, base)])
    )
    opaque_ok = tp_p == tp_d and bp == bd
    layouts = ["HND", "NHD"] + (["HEAD_MAJOR"] if bp == bd else []) + (["opaque"] if opaque_ok else [])
    kv_layout = draw(st.sampled_from(layouts))
    if bp == bd:
        num_src = draw(st.integers(1, 5))
        num_dst = draw(st.integers(0, num_src))  # fewer destination blocks: a prefix hit
        prompt = target = 0
    else:
        prompt = draw(st.integers(1, 24))
        start = bd * draw(st.integers(0, (prompt - 1) // bd))
        target = prompt - start
        num_src, num_dst = -(-prompt // bp) + draw(st.integers(0, 1)), -(-target // bd)
    blocks_p, blocks_d = num_src + draw(st.integers(0, 3)), num_dst + draw(st.integers(0, 3)) + 1
    pad = draw(st.sampled_from([0, 3]))
    seed = draw(st.integers(0, 2**16))
    producer = make_engine(tp_p, pp_p, layers, heads, bp, kv_layout, units, blocks_p, pad, seed)
    consumer = make_engine(tp_d, pp_d, layers, heads, bd, kv_layout, units, blocks_d, pad, seed + 1)
    rng = np.random.default_rng(seed)
    src = rng.permutation(blocks_p)[:num_src] if draw(st.booleans()) else np.arange(num_src)
    dst = rng.permutation(blocks_d)[:num_dst] if draw(st.booleans()) else np.arange(num_dst) + 1
    return Case(producer, consumer, src, dst, prompt, target, draw(st.booleans()), draw(st.booleans()))


def plans(case: Case) -> list[tuple[kvmap.RankShare, WritePlan]]:
    """Every producer rank's plan for every consumer rank it has a share in."""
    p, c = case.producer, case.consumer
    shares = kvmap.shares(kvmap.rank_shapes(p.layout, p.agents), kvmap.rank_shapes(c.layout, c.agents))
    bp, bd = p.layout.block_size, c.layout.block_size
    runs = None
    if bp != bd or case.explicit_runs:
        runs = kvmap.token_runs(len(case.src), len(case.dst), bp, bd, case.prompt_tokens, case.target_tokens)
    out = []
    for share in shares:
        producer = RankGeometry(p.agents[share.producer_rank].regions, p.heads, bp)
        consumer = RankGeometry(c.agents[share.consumer_rank].regions, c.heads, bd)
        plan = plan_write(producer, consumer, share, case.src, case.dst, p.layout.kv_layout, runs, merge=case.merge)
        out.append((share, plan))
    return out


def expected(case: Case) -> tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.bool_]]]:
    """Per consumer rank: the bytes it should hold after the transfer, and which of them must be written."""
    p, c = case.producer, case.consumer
    bp, bd, rpl = p.layout.block_size, c.layout.block_size, len(p.units)
    num_src, num_dst = len(case.src), len(case.dst)
    values = [a.copy() for a in c.arenas]
    needed = [np.zeros(a.shape, dtype=bool) for a in c.arenas]
    head, token = np.meshgrid(np.arange(c.heads), np.arange(bd), indexing="ij")
    for c_rank, agent in enumerate(c.agents):
        global_head = (c_rank % c.layout.tp_size) * c.heads + head
        p_tp, p_head = global_head // p.heads, global_head % p.heads
        for j, region in enumerate(agent.regions):
            layer, kind = c.stage_layers(c_rank)[j // rpl], j % rpl
            unit = c.units[kind]
            p_rank = next(r for r in range(len(p.agents)) if r % p.layout.tp_size == 0 and layer in p.stage_layers(r))
            p_region = (layer - p.stage_layers(p_rank).start) * rpl + kind
            for di in range(num_dst):
                if bp == bd:
                    si, slot, valid = np.full_like(token, num_src - num_dst + di), token, np.ones_like(token, bool)
                else:
                    pos = case.prompt_tokens - case.target_tokens + di * bd + token
                    si, slot, valid = pos // bp, pos % bp, pos < case.prompt_tokens
                for h, t, s, sl in zip(head[valid], token[valid], si[valid], slot[valid], strict=True):
                    src_rank = p_rank + int(p_tp[h, t])
                    src_region = p.agents[src_rank].regions[p_region]
                    src_at = src_region.base_address + int(case.src[s]) * src_region.block_stride_bytes
                    src_at += int(p.offset(unit, p_head[h, t], sl))
                    dst_at = region.base_address + int(case.dst[di]) * region.block_stride_bytes
                    dst_at += int(c.offset(unit, h, t))
                    values[c_rank][dst_at : dst_at + unit] = p.arenas[src_rank][src_at : src_at + unit]
                    needed[c_rank][dst_at : dst_at + unit] = True
    return values, needed


def apply(
    case: Case, planned: list[tuple[kvmap.RankShare, WritePlan]]
) -> tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.int64]]]:
    """The consumer arenas after "copying" by every plan, and how often each byte was written."""
    arenas = [a.copy() for a in case.consumer.arenas]
    writes = [np.zeros(a.shape, dtype=np.int64) for a in arenas]
    for share, plan in planned:
        source = case.producer.arenas[share.producer_rank]
        for (la, n, ld), (ra, rn, rd) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
            assert n == rn > 0 and ld == rd == 0
            assert la + n <= len(source) and ra + n <= len(arenas[share.consumer_rank])
            arenas[share.consumer_rank][ra : ra + n] = source[la : la + n]
            writes[share.consumer_rank][ra : ra + n] += 1
    return arenas, writes


@settings(max_examples=examples(300), deadline=None)
@given(cases())
def test_every_needed_destination_byte_is_written_exactly_once_with_its_source_byte(case: Case) -> None:
    got, writes = apply(case, plans(case))
    want, needed = expected(case)
    for rank in range(len(got)):
        np.testing.assert_array_equal(writes[rank], needed[rank].astype(np.int64), err_msg=f"consumer rank {rank}")
        np.testing.assert_array_equal(got[rank], want[rank], err_msg=f"consumer rank {rank}")


@settings(max_examples=examples(100), deadline=None)
@given(cases())
def test_merging_moves_the_same_bytes_in_fewer_descriptors(case: Case) -> None:
    merged = plans(Case(**{**case.__dict__, "merge": True}))
    unmerged = plans(Case(**{**case.__dict__, "merge": False}))
    for (_, m), (_, u) in zip(merged, unmerged, strict=True):
        assert m.num_descriptors <= u.num_descriptors and m.num_bytes == u.num_bytes
    assert [a.tobytes() for a in apply(case, merged)[0]] == [a.tobytes() for a in apply(case, unmerged)[0]]


def whole_head_case(kv_layout: str, pad: int) -> tuple[FakeEngine, FakeEngine, kvmap.RankShare]:
    producer = make_engine(1, 1, 4, 2, 16, kv_layout, (2, 2), 200, pad, 0)
    consumer = make_engine(1, 1, 4, 2, 16, kv_layout, (2, 2), 200, pad, 1)
    (share,) = kvmap.shares(
        kvmap.rank_shapes(producer.layout, producer.agents), kvmap.rank_shapes(consumer.layout, consumer.agents)
    )
    return producer, consumer, share


@pytest.mark.parametrize("kv_layout", ["HND", "NHD", "opaque"])
def test_consecutive_whole_blocks_merge_into_one_descriptor_per_region(kv_layout: str) -> None:
    producer, consumer, share = whole_head_case(kv_layout, pad=0)
    geometry = [RankGeometry(e.agents[0].regions, 2, 16) for e in (producer, consumer)]
    plan = plan_write(geometry[0], geometry[1], share, np.arange(10, 130), np.arange(50, 168), kv_layout)
    assert plan.num_descriptors == 8  # 4 layers x K and V
    assert plan.num_bytes == 8 * 118 * 2 * 16 * 2


def test_padded_blocks_stay_one_descriptor_per_block() -> None:
    producer, consumer, share = whole_head_case("HND", pad=3)
    geometry = [RankGeometry(e.agents[0].regions, 2, 16) for e in (producer, consumer)]
    plan = plan_write(geometry[0], geometry[1], share, np.arange(10), np.arange(10), "HND")
    assert plan.num_descriptors == 8 * 10


def test_an_opaque_layout_refuses_a_head_split() -> None:
    producer = make_engine(2, 1, 1, 2, 4, "opaque", (1,), 4, 0, 0)
    consumer = make_engine(1, 1, 1, 2, 4, "opaque", (1,), 4, 0, 1)
    share = kvmap.shares(
        kvmap.rank_shapes(producer.layout, producer.agents), kvmap.rank_shapes(consumer.layout, consumer.agents)
    )[0]
    with pytest.raises(LayoutMismatchError, match="whole blocks only"):
        plan_write(
            RankGeometry(producer.agents[0].regions, 1, 4),
            RankGeometry(consumer.agents[0].regions, 2, 4),
            share,
            [0],
            [0],
            "opaque",
        )


def test_head_major_blocks_refuse_a_split_by_token() -> None:
    producer = make_engine(1, 1, 1, 2, 4, "HEAD_MAJOR", (1,), 4, 0, 0)
    consumer = make_engine(1, 1, 1, 2, 8, "HEAD_MAJOR", (1,), 4, 0, 1)
    share = kvmap.shares(
        kvmap.rank_shapes(producer.layout, producer.agents), kvmap.rank_shapes(consumer.layout, consumer.agents)
    )[0]
    runs = kvmap.token_runs(2, 1, 4, 8, 8, 8)
    with pytest.raises(LayoutMismatchError, match="does not split blocks by token"):
        plan_write(
            RankGeometry(producer.agents[0].regions, 2, 4),
            RankGeometry(consumer.agents[0].regions, 2, 8),
            share,
            [0, 1],
            [0],
            "HEAD_MAJOR",
            runs,
        )


def test_block_ids_outside_a_region_are_refused() -> None:
    producer, consumer, share = whole_head_case("HND", pad=0)
    geometry = [RankGeometry(e.agents[0].regions, 2, 16) for e in (producer, consumer)]
    with pytest.raises(BlockRangeError):
        plan_write(geometry[0], geometry[1], share, [0, 200], [0, 1], "HND")
    with pytest.raises(BlockRangeError, match="only 1 source"):
        plan_write(geometry[0], geometry[1], share, [0], [0, 1], "HND")


class CpuCache:
    """One rank's layer cache as vLLM-CPU lays it out ([blocks, heads, tokens, 2 * head_dim] float32, each head's
    keys transposed then its values: what `cpu_attn_reshape_and_cache` writes), in a byte arena at `BASE`."""

    BASE = 1 << 20

    def __init__(self, blocks: int, heads: int, block_size: int, dim: int) -> None:
        self.heads, self.block_size, self.dim = heads, block_size, dim
        self.cache = np.zeros((blocks, heads, block_size, 2 * dim), dtype=np.float32)

    def region(self) -> KvRegion:
        block = self.cache[0].nbytes
        return KvRegion(self.BASE, block, block, self.cache.shape[0])

    def slab(self, block: int, head: int) -> npt.NDArray[np.float32]:
        slab: npt.NDArray[np.float32] = self.cache[block, head].reshape(-1)
        return slab  # keys [dim, block_size], then values [block_size, dim]

    def put(
        self, block: int, head: int, token: int, key: npt.NDArray[np.float32], value: npt.NDArray[np.float32]
    ) -> None:
        slab, b = self.slab(block, head), self.block_size
        slab[token : b * self.dim : b] = key
        slab[b * self.dim + token * self.dim : b * self.dim + (token + 1) * self.dim] = value

    def get(self, block: int, head: int, token: int) -> tuple[list[float], list[float]]:
        slab, b = self.slab(block, head), self.block_size
        return slab[token : b * self.dim : b].tolist(), slab[b * self.dim + token * self.dim :][: self.dim].tolist()


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "bp", "bd", "hit"),
    [(1, 1, 32, 64, 0), (1, 2, 32, 64, 1), (2, 1, 64, 32, 2), (2, 2, 16, 32, 1), (1, 2, 32, 32, 1), (2, 1, 8, 8, 0)],
)
def test_vllm_cpu_blocks_move_by_token_with_their_transposed_keys(
    tp_p: int, tp_d: int, bp: int, bd: int, hit: int
) -> None:
    """Every (head, token) the consumer needs gets the producer's key and value, whatever the TP and block-size
    ratio, from a cache laid out as vLLM-CPU's kernels lay it out; nothing else is written."""
    heads, dim, prompt = 4, 4, 3 * max(bp, bd) + 5
    start = hit * bd
    lp = KvLayout("m", "float32", bp, 1, tp_p, 1, kvmap.HKTV, heads)
    ld = KvLayout("m", "float32", bd, 1, tp_d, 1, kvmap.HKTV, heads)
    num_src, num_dst = -(-prompt // bp), -(-(prompt - start) // bd)
    producers = [CpuCache(num_src + 1, heads // tp_p, bp, dim) for _ in range(tp_p)]
    consumers = [CpuCache(num_dst + 2, heads // tp_d, bd, dim) for _ in range(tp_d)]
    rng = np.random.default_rng(bp * 100 + bd + tp_p)
    truth = rng.standard_normal((heads, prompt, 2, dim)).astype(np.float32)
    src = list(range(1, num_src + 1))  # block 0 unused: a stray write would show there
    for token in range(prompt):
        for head in range(heads):
            rank, local = divmod(head, heads // tp_p)
            producers[rank].put(src[token // bp], local, token % bp, truth[head, token, 0], truth[head, token, 1])
    dst = list(range(2, num_dst + 2))
    agents = [NixlAgentInfo(f"p{r}", b"", rank=r, regions=(c.region(),)) for r, c in enumerate(producers)]
    c_agents = [NixlAgentInfo(f"d{r}", b"", rank=r, regions=(c.region(),)) for r, c in enumerate(consumers)]
    assert kvmap.layout_mismatch(lp, agents, ld, c_agents) is None
    runs = kvmap.token_runs(num_src, num_dst, bp, bd, prompt, prompt - start) if bp != bd else None
    shapes_p, shapes_d = kvmap.rank_shapes(lp, agents), kvmap.rank_shapes(ld, c_agents)
    for share in kvmap.shares(shapes_p, shapes_d):
        p, c = producers[share.producer_rank], consumers[share.consumer_rank]
        plan = plan_write(
            RankGeometry((p.region(),), p.heads, bp, 4),
            RankGeometry((c.region(),), c.heads, bd, 4),
            share,
            src,
            dst,
            kvmap.HKTV,
            runs,
        )
        source, target = p.cache.view(np.uint8).reshape(-1), c.cache.view(np.uint8).reshape(-1)
        for (la, n, _), (ra, _, _) in zip(plan.local.tolist(), plan.remote.tolist(), strict=True):
            target[ra - CpuCache.BASE : ra - CpuCache.BASE + n] = source[la - CpuCache.BASE : la - CpuCache.BASE + n]
    for token in range(start, prompt):
        for head in range(heads):
            rank, local = divmod(head, heads // tp_d)
            key, value = consumers[rank].get(dst[(token - start) // bd], local, (token - start) % bd)
            assert key == truth[head, token, 0].tolist() and value == truth[head, token, 1].tolist(), (head, token)
    for c in consumers:
        assert not c.cache[:2].any()  # the blocks not in the target stay untouched


def test_vllm_cpu_whole_blocks_of_some_heads_move_as_one_slab_per_block() -> None:
    """TP 2 -> 1, equal block sizes: a producer rank's heads of a consumer block (keys and values of each, one
    after the other) are one slab on both sides, so the plan is one descriptor per block, made without a
    descriptor per key row (that plan took ~190 ms for 1,024 blocks; this one ~1 ms)."""
    heads, dim, bs, blocks = 4, 4, 8, 6
    producer, consumer = CpuCache(blocks, heads // 2, bs, dim), CpuCache(blocks, heads, bs, dim)
    share = kvmap.RankShare(1, 0, range(1), range(1), 0, 2, 2)  # rank 1's two heads are the consumer's 2 and 3
    p = RankGeometry((producer.region(),), 2, bs, 4)
    c = RankGeometry((consumer.region(),), heads, bs, 4)
    plan = plan_write(p, c, share, [1, 2, 3], [5, 0, 4], kvmap.HKTV)
    slab = 2 * bs * 2 * dim * 4  # two heads' keys and values, float32
    assert plan.num_descriptors == 3 and plan.local[:, 1].tolist() == [slab] * 3
    block = consumer.cache[0].nbytes
    assert (plan.remote[:, 0] - CpuCache.BASE).tolist() == [5 * block + slab, 0 * block + slab, 4 * block + slab]
