"""Multi-rank writes over real NIXL: producer ranks (TransferWriters, this process) write their shares into a
consumer engine's ranks (endpoints in the peer process); every consumer byte is checked against the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
import torch

from rendezvous.clients._types import KvLayout, NixlAgentInfo
from rendezvous.clients.nixl import NixlEndpoint, TransferWriter
from rendezvous.clients.nixl.writer import ConsumerEngine
from tests.nixl.helpers import Event, Recorder, region_views, unique
from tests.nixl.peer import SENTINEL, Layout, PeerProcess

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

HEADS = 4
KINDS = 2  # K and V: regions per layer
UNIT = 2  # bytes of one token of one head


@dataclass(frozen=True)
class Engine:
    tp: int
    pp: int
    block_size: int
    num_blocks: int
    layers: int = 2
    kv_layout: str = "HND"

    @property
    def layout(self) -> KvLayout:
        return KvLayout("m", "u8", self.block_size, self.layers, self.tp, self.pp, self.kv_layout, HEADS)

    @property
    def heads(self) -> int:
        return HEADS // self.tp

    def stage(self, rank: int) -> range:
        per_stage = self.layers // self.pp
        first = rank // self.tp * per_stage
        return range(first, first + per_stage)

    def region_layout(self, rank: int) -> Layout:
        return Layout((self.heads * self.block_size * UNIT,) * (len(self.stage(rank)) * KINDS), self.num_blocks)

    def agent_fields(self, rank: int) -> dict[str, int]:
        """The agent's layer range, stated with pipeline parallelism only."""
        layers = self.stage(rank)
        return {"first_layer": layers.start, "num_layers": len(layers)} if self.pp > 1 else {}

    def layers_of(self, rank: int) -> tuple[int, int]:
        layers = self.stage(rank)
        return (layers.start, len(layers)) if self.pp > 1 else (0, 0)

    def canonical(self, block_bytes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """[num_blocks, bytes] of one region as [num_blocks, heads, tokens, unit]."""
        if self.kv_layout == "NHD":
            return block_bytes.reshape(-1, self.block_size, self.heads, UNIT).transpose(0, 2, 1, 3)
        return block_bytes.reshape(-1, self.heads, self.block_size, UNIT)


def expected(
    p: Engine,
    c: Engine,
    sources: list[list[npt.NDArray[np.uint8]]],
    c_rank: int,
    src: list[int],
    dst: list[int],
    prompt: int,
    target: int,
) -> list[npt.NDArray[np.uint8]]:
    """Consumer rank `c_rank`'s regions as [blocks, heads, tokens, unit] after the transfer, from first principles:
    destination token slot -> prompt token -> source block and slot; consumer head -> model head -> producer rank."""
    out = []
    for j in range(len(c.stage(c_rank)) * KINDS):
        layer, kind = c.stage(c_rank)[j // KINDS], j % KINDS
        region = np.full((c.num_blocks, c.heads, c.block_size, UNIT), SENTINEL, dtype=np.uint8)
        for di, block in enumerate(dst):
            for t in range(c.block_size):
                if p.block_size == c.block_size:
                    si, slot = len(src) - len(dst) + di, t
                else:
                    pos = prompt - target + di * c.block_size + t
                    if pos >= prompt:
                        continue
                    si, slot = pos // p.block_size, pos % p.block_size
                for h in range(c.heads):
                    g = c_rank % c.tp * c.heads + h
                    p_rank = next(r for r in range(p.tp * p.pp) if layer in p.stage(r) and r % p.tp == g // p.heads)
                    p_region = (layer - p.stage(p_rank).start) * KINDS + kind
                    region[block, h, t] = p.canonical(sources[p_rank][p_region])[src[si], g % p.heads, slot]
        out.append(region)
    return out


def run_transfer(
    peer: PeerProcess, p: Engine, c: Engine, src: list[int], dst: list[int], prompt: int = 0, target: int = 0
) -> None:
    names = [unique(f"c{r}") for r in range(c.tp * c.pp)]
    consumer = ConsumerEngine(
        c.layout,
        tuple(
            dataclasses.replace(peer.call("create", name, c.region_layout(r)), rank=r, **c.agent_fields(r))
            for r, name in enumerate(names)
        ),
    )
    views: list[list[torch.Tensor]] = []
    writers: list[tuple[TransferWriter, Recorder]] = []
    try:
        for r in range(p.tp * p.pp):
            views.append(region_views(p.region_layout(r), seed=100 + r))
            recorder = Recorder()
            writer = TransferWriter(
                NixlEndpoint.from_tensors(unique(f"p{r}"), views[-1]),
                on_complete=recorder.on_complete,
                on_revoked=recorder.on_revoked,
                on_source_free=recorder.on_source_free,
                layout=p.layout,
                rank=r,
                first_layer=p.layers_of(r)[0],
                num_layers=p.layers_of(r)[1],
            )
            writer.start()
            writers.append((writer, recorder))
        for writer, _ in writers:
            writer.assign("t", 1, consumer, 1, dst, prompt_tokens=prompt, target_tokens=target)
            writer.source_ready("t", src)
        # Each consumer rank hears once from each producer rank with a share in it.
        counts = {
            name: sum(bool(set(p.stage(q)) & set(c.stage(r))) for q in range(p.tp * p.pp) if _heads_meet(p, q, c, r))
            for r, name in enumerate(names)
        }
        received = peer.call("wait_all", counts, 20.0)
        assert {n: len(v) for n, v in received.items()} == counts
        assert all((x.transfer_id, x.generation) == ("t", 1) for v in received.values() for x in v)
        for _, recorder in writers:
            assert recorder.next(10) == Event("complete", ("t", 1, True, None))
            assert recorder.next() == Event("source_free", ("t",))
        sources = [[v.numpy() for v in rank] for rank in views]
        for r, name in enumerate(names):
            got = [c.canonical(b) for b in peer.call("blocks", name)]
            want = expected(p, c, sources, r, src, dst, prompt, target)
            for j, (g, w) in enumerate(zip(got, want, strict=True)):
                np.testing.assert_array_equal(g, w, err_msg=f"consumer rank {r} region {j}")
    finally:
        for writer, _ in writers:
            assert writer.stop(10)
        for name in names:
            peer.call("close", name)


def _heads_meet(p: Engine, q: int, c: Engine, r: int) -> bool:
    mine = range(q % p.tp * p.heads, (q % p.tp + 1) * p.heads)
    theirs = range(r % c.tp * c.heads, (r % c.tp + 1) * c.heads)
    return bool(set(mine) & set(theirs))


def test_four_producer_ranks_write_their_heads_into_one_consumer_rank(peer: PeerProcess) -> None:
    run_transfer(peer, Engine(4, 1, 4, 8), Engine(1, 1, 4, 8), src=[5, 1, 2, 6], dst=[3, 4, 7])


def test_equal_ranks_write_whole_blocks_rank_to_rank_after_a_prefix_hit(peer: PeerProcess) -> None:
    run_transfer(peer, Engine(2, 1, 4, 8), Engine(2, 1, 4, 8), src=[7, 0, 1, 2], dst=[5, 6])


def test_one_producer_rank_writes_into_four_consumer_ranks(peer: PeerProcess) -> None:
    p, c = Engine(1, 1, 4, 8, kv_layout="NHD"), Engine(4, 1, 4, 8, kv_layout="NHD")
    run_transfer(peer, p, c, src=[0, 1, 2], dst=[6, 2, 3])


def test_two_producer_ranks_write_into_four_consumer_ranks(peer: PeerProcess) -> None:
    run_transfer(peer, Engine(2, 1, 4, 8), Engine(4, 1, 4, 8), src=[1, 2, 3, 4], dst=[0, 1])


def test_blocks_of_16_tokens_fill_blocks_of_32_after_a_prefix_hit(peer: PeerProcess) -> None:
    # 80 prompt tokens in 5 source blocks; the consumer holds the first 32 and receives the last 48.
    p, c = Engine(2, 1, 16, 6), Engine(1, 1, 32, 4)
    run_transfer(peer, p, c, src=[4, 0, 1, 2, 5], dst=[3, 1], prompt=80, target=48)


def test_each_pipeline_stage_writes_its_own_layers(peer: PeerProcess) -> None:
    run_transfer(peer, Engine(1, 2, 4, 6, layers=4), Engine(2, 1, 4, 6, layers=4), src=[0, 1, 2], dst=[5, 4, 3])


def test_a_rank_that_is_not_in_its_layout_fails_the_assignment(peer: PeerProcess) -> None:
    c = Engine(1, 1, 4, 4)
    name = unique("c")
    agent: NixlAgentInfo = peer.call("create", name, c.region_layout(0))
    recorder = Recorder()
    p = Engine(2, 1, 4, 4)
    writer = TransferWriter(
        NixlEndpoint.from_tensors(unique("p"), region_views(p.region_layout(0), seed=1)),
        on_complete=recorder.on_complete,
        on_revoked=recorder.on_revoked,
        on_source_free=recorder.on_source_free,
        layout=p.layout,
        rank=2,
    )
    try:
        writer.start()
        writer.assign("t", 1, ConsumerEngine(c.layout, (agent,)), 1, [0])
        event = recorder.next()
        assert event.kind == "complete" and event.args[2] is False and "rank 2" in str(event.args[3])
    finally:
        assert writer.stop(10)
        peer.call("close", name)


def test_one_failed_write_of_a_generation_fails_it_after_the_others_landed(peer: PeerProcess) -> None:
    p, c = Engine(1, 1, 4, 4), Engine(2, 1, 4, 4)
    doomed = PeerProcess()
    names = [unique("c0"), unique("c1")]
    hosts = [peer, doomed]
    agents = tuple(
        dataclasses.replace(host.call("create", name, c.region_layout(r)), rank=r)
        for r, (host, name) in enumerate(zip(hosts, names, strict=True))
    )
    recorder = Recorder()
    writer = TransferWriter(
        NixlEndpoint.from_tensors(unique("p"), region_views(p.region_layout(0), seed=3)),
        on_complete=recorder.on_complete,
        on_revoked=recorder.on_revoked,
        on_source_free=recorder.on_source_free,
        layout=p.layout,
    )
    try:
        writer.start()
        writer.assign("t", 1, ConsumerEngine(c.layout, agents), 1, [1, 2])
        writer.source_ready("t", [0, 3])
        assert writer.barrier(5) and recorder.pending() == []  # in flight: neither consumer polls yet
        doomed.kill()
        assert len(peer.call("wait_all", {names[0]: 1}, 10.0)[names[0]]) == 1  # rank 0's write lands

        event = recorder.next(15)
        assert event.kind == "complete" and event.args[:3] == ("t", 1, False)
        writer.abort("t")
        assert recorder.next() == Event("source_free", ("t",))
    finally:
        doomed.kill()
        assert writer.stop(10)
        peer.call("close", names[0])
