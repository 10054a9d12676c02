"""The rank/head/layer/block mapping (rendezvous.protocol.kvmap): which engine pairs are compatible, and that the
shares and token runs it computes put every needed (layer, head, token) of the consumer exactly once, from the
right place of the producer, for every TP ratio up to 8 -> 1 and 1 -> 8, block-size ratios, pipeline stages and
prefix-cache hits."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.protocol import KvLayout, KvRegion, NixlAgent
from rendezvous.protocol.kvmap import (
    BlockPairingError,
    ShapeError,
    layout_mismatch,
    rank_shapes,
    shares,
    token_runs,
)

HEADS = 8
UNIT = 64  # bytes of one token of one head
LAYERS = 4
REGIONS_PER_LAYER = 2  # K and V


def engine(tp: int, pp: int = 1, block_size: int = 16, **layout: object) -> tuple[KvLayout, tuple[NixlAgent, ...]]:
    """A layout and one agent per rank, with the block bytes the heads and block size imply."""
    lay = KvLayout("m", "float16", block_size, LAYERS, tp, pp, "HND", HEADS)
    lay = replace(lay, **layout)  # type: ignore[arg-type]
    block_bytes = (HEADS // tp) * block_size * UNIT
    per_stage = LAYERS // pp
    agents = []
    for rank in range(tp * pp):
        stage = rank // tp
        regions = tuple(
            KvRegion((i + 1) << 28, block_bytes, block_bytes, 64) for i in range(per_stage * REGIONS_PER_LAYER)
        )
        first, count = (stage * per_stage, per_stage) if pp > 1 else (0, 0)
        agents.append(NixlAgent(f"r{rank}", b"", rank=rank, regions=regions, first_layer=first, num_layers=count))
    return lay, tuple(agents)


RATIOS = [(p, c) for p in (1, 2, 4, 8) for c in (1, 2, 4, 8)]


@pytest.mark.parametrize(("p_tp", "c_tp"), RATIOS)
def test_tp_sizes_where_one_divides_the_other_match(p_tp: int, c_tp: int) -> None:
    assert layout_mismatch(*engine(p_tp), *engine(c_tp)) is None


@pytest.mark.parametrize(("p_tp", "c_tp"), [(1, 2), (2, 1), (2, 2), (4, 8)])
def test_head_major_blocks_pair_across_tp_sizes_with_equal_block_sizes(p_tp: int, c_tp: int) -> None:
    assert layout_mismatch(*engine(p_tp, kv_layout="HEAD_MAJOR"), *engine(c_tp, kv_layout="HEAD_MAJOR")) is None


@pytest.mark.parametrize(("p_bs", "c_bs"), [(16, 32), (32, 16), (16, 64), (64, 16), (32, 32)])
def test_block_sizes_where_one_divides_the_other_match(p_bs: int, c_bs: int) -> None:
    assert layout_mismatch(*engine(2, block_size=p_bs), *engine(4, block_size=c_bs)) is None


@pytest.mark.parametrize(
    ("producer", "consumer", "text"),
    [
        ({"tp_size": 3, "num_kv_heads": 6}, {"tp_size": 2, "num_kv_heads": 6}, "tp_size ratio unsupported"),
        ({"block_size": 16}, {"block_size": 24}, "block_size ratio unsupported (one must divide the other): "),
        ({"dtype": "float16"}, {"dtype": "bfloat16"}, "dtype differs: producer 'float16', consumer 'bfloat16'"),
        # A fingerprint that hashes the dtype (connector/compat.py) differs too: the dtype is what the message names.
        (
            {"dtype": "float16", "model_fingerprint": "m#1"},
            {"dtype": "bfloat16", "model_fingerprint": "m#2"},
            "dtype differs: producer 'float16', consumer 'bfloat16'",
        ),
        ({"model_fingerprint": "m#1"}, {"model_fingerprint": "m#2"}, "model_fingerprint differs: producer 'm#1'"),
        ({"num_layers": 4}, {"num_layers": 2}, "num_layers differs: producer 4, consumer 2"),
        ({"num_kv_heads": 8}, {"num_kv_heads": 4}, "num_kv_heads differs"),
        ({"tp_size": 1, "num_kv_heads": 0}, {"tp_size": 2, "num_kv_heads": 0}, "num_kv_heads must be stated"),
        ({"kv_layout": "opaque"}, {"kv_layout": "opaque", "tp_size": 2}, "kv_layout must be one of HND, NHD"),
        (
            {"kv_layout": "HEAD_MAJOR", "block_size": 16},
            {"kv_layout": "HEAD_MAJOR", "block_size": 32},
            "block_size must be equal with kv_layout 'HEAD_MAJOR' (its blocks do not split by token): producer 16",
        ),
    ],
)
def test_incompatible_layouts_name_the_field_and_both_values(
    producer: dict[str, object], consumer: dict[str, object], text: str
) -> None:
    p = replace(engine(1)[0], **producer)  # type: ignore[arg-type]
    c = replace(engine(1)[0], **consumer)  # type: ignore[arg-type]
    mismatch = layout_mismatch(p, (), c, ())
    assert mismatch is not None and text in str(mismatch), mismatch


def test_regions_whose_token_unit_differs_do_not_match() -> None:
    p_layout, p_agents = engine(2)
    c_layout, c_agents = engine(2)
    bigger = replace(c_agents[1].regions[0], block_length_bytes=2 * c_agents[1].regions[0].block_length_bytes)
    c_agents = (c_agents[0], replace(c_agents[1], regions=(bigger, *c_agents[1].regions[1:])))
    mismatch = layout_mismatch(p_layout, p_agents, c_layout, c_agents)
    assert mismatch is not None and mismatch.field == "rank 1 region 0 bytes per token and head", mismatch


@pytest.mark.parametrize(
    ("agents", "field"),
    [
        (lambda a: a[:3], "rank"),
        (lambda a: (*a[:3], replace(a[3], rank=2)), "rank"),
        (lambda a: (*a[:3], replace(a[3], rank=9)), "rank"),
        (lambda a: (*a[:2], replace(a[2], first_layer=1), a[3]), "first_layer"),
        (lambda a: (*a[:3], replace(a[3], regions=a[3].regions[:3])), "regions"),
    ],
    ids=["missing", "twice", "out-of-range", "stage-ranks-disagree", "regions-not-per-layer"],
)
def test_ranks_that_do_not_add_up_are_refused(agents: object, field: str) -> None:
    layout, good = engine(2, pp=2)
    with pytest.raises(ShapeError) as error:
        rank_shapes(layout, agents(good))  # type: ignore[operator]
    assert error.value.field == field and error.value.agents


def placement(tp: int, pp: int) -> dict[tuple[int, int], tuple[int, int, int]]:
    """(layer, head) -> (rank, first region of the layer in the rank's agent, head local to the rank)."""
    layout, agents = engine(tp, pp)
    out = {}
    for shape in rank_shapes(layout, agents):
        layers = shape.layers if shape.num_layers else range(LAYERS)
        for layer in layers:
            for head in shape.heads:
                out[(layer, head)] = (
                    shape.rank,
                    shape.region_range(range(layer, layer + 1))[0],
                    head - shape.first_head,
                )
    return out


@given(
    p_tp=st.sampled_from([1, 2, 4, 8]),
    c_tp=st.sampled_from([1, 2, 4, 8]),
    p_pp=st.sampled_from([1, 2, 4]),
    c_pp=st.sampled_from([1, 2]),
)
def test_shares_put_every_consumer_layer_and_head_exactly_once_from_the_right_producer_place(
    p_tp: int, c_tp: int, p_pp: int, c_pp: int
) -> None:
    p_layout, p_agents = engine(p_tp, p_pp)
    c_layout, c_agents = engine(c_tp, c_pp)
    assert layout_mismatch(p_layout, p_agents, c_layout, c_agents) is None
    source, destination = placement(p_tp, p_pp), placement(c_tp, c_pp)
    written: Counter[tuple[int, int]] = Counter()
    p_shapes = {s.rank: s for s in rank_shapes(p_layout, p_agents)}
    for share in shares(rank_shapes(p_layout, p_agents), rank_shapes(c_layout, c_agents)):
        assert len(share.producer_regions) == len(share.consumer_regions)
        p_shape = p_shapes[share.producer_rank]
        for offset in range(0, len(share.producer_regions), REGIONS_PER_LAYER):
            layer = p_shape.first_layer + share.producer_regions[offset] // REGIONS_PER_LAYER
            for h in range(share.num_heads):
                head = p_shape.first_head + share.producer_head + h
                assert source[(layer, head)] == (
                    share.producer_rank,
                    share.producer_regions[offset],
                    share.producer_head + h,
                )
                assert destination[(layer, head)] == (
                    share.consumer_rank,
                    share.consumer_regions[offset],
                    share.consumer_head + h,
                )
                written[(layer, head)] += 1
    assert written == Counter({key: 1 for key in destination})


@given(
    bp=st.sampled_from([16, 32, 64]),
    bd=st.sampled_from([16, 32, 64]),
    prompt=st.integers(1, 600),
    data=st.data(),
)
def test_token_runs_move_every_needed_token_once_to_its_position(
    bp: int, bd: int, prompt: int, data: st.DataObject
) -> None:
    consumer_blocks = -(-prompt // bd)
    hit = data.draw(st.integers(0, consumer_blocks - 1), label="consumer blocks already cached")
    target = prompt - hit * bd
    num_src = -(-prompt // bp)
    runs = token_runs(num_src, consumer_blocks - hit, bp, bd, prompt, target)
    moved: Counter[int] = Counter()
    for run in runs:
        assert run.tokens > 0 and run.src_token + run.tokens <= bp and run.dst_token + run.tokens <= bd
        for k in range(run.tokens):
            token = run.src * bp + run.src_token + k
            assert token == hit * bd + run.dst * bd + run.dst_token + k  # lands where the consumer expects it
            moved[token] += 1
    if bp == bd:  # whole blocks: the tail of the last block is moved too
        assert set(moved) >= set(range(hit * bd, prompt)) and max(moved.values()) == 1
    else:
        assert moved == Counter(range(hit * bd, prompt))


def test_equal_block_sizes_pair_the_last_source_blocks_with_the_destination() -> None:
    runs = token_runs(5, 2, 16, 16)
    assert [(r.src, r.dst, r.tokens) for r in runs] == [(3, 0, 16), (4, 1, 16)]


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ((2, 3, 16, 16), "3 destination blocks but only 2 source blocks"),
        ((4, 2, 16, 32, 64, 40), "not on a 32-token block boundary"),
        ((4, 3, 16, 32, 64, 64), "64 tokens fill 2 blocks of 32, not 3"),
        ((3, 2, 16, 32, 64, 64), "64 tokens need 4 source blocks, got 3"),
        ((4, 2, 16, 32), "different block sizes need the token counts"),
    ],
)
def test_blocks_that_cannot_pair_are_refused(args: tuple[int, ...], text: str) -> None:
    with pytest.raises(BlockPairingError, match=text):
        token_runs(*args)
