"""Progressive push: a TransferWriter posting parts (layers, token ranges) before the source is ready, into
consumer endpoints in a peer process. The consumer polls only while a test waits on it, so the first WRITEs
to a fresh consumer stay in flight until it does. Each WRITE of parts carries the notification of what it
carried, and the notifications of a generation tile its target (`PartsArrival`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from rendezvous.clients._types import KvLayout
from rendezvous.clients.nixl import (
    NixlAgentInfo,
    NixlEndpoint,
    TransferNotification,
    TransferWriter,
    WriterConfig,
    WrittenPart,
)
from rendezvous.clients.nixl.arrival import PartsArrival
from rendezvous.clients.nixl.device import KvReady
from rendezvous.clients.nixl.granularity import PartCost
from rendezvous.clients.nixl.integrity import scope_digests
from rendezvous.clients.nixl.notifications import DigestScope
from rendezvous.clients.nixl.plan import RankGeometry
from rendezvous.clients.nixl.regions import regions_from_tensors
from rendezvous.clients.nixl.writer import ConsumerEngine
from tests.nixl.helpers import Event, Recorder, region_views, unique
from tests.nixl.peer import SENTINEL, Layout, PeerProcess
from tests.nixl.test_multirank import Engine, expected

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

BLOCK = 4  # tokens per block
LAYERS = 2
REGION = 16384  # bytes per block and region: large enough that a WRITE waits for the consumer to poll
LAYOUT = Layout((REGION,) * (2 * LAYERS), 16)  # K and V of each layer, layer-major
SRC = [0, 1, 7, 3, 11]  # a 20-token prompt
PROMPT = 20


@dataclass
class Pair:
    writer: TransferWriter
    recorder: Recorder
    agent: NixlAgentInfo
    dest: str
    views: list[torch.Tensor]

    def expected(self, moved: dict[int, tuple[Sequence[int], Sequence[int]]]) -> list[npt.NDArray[np.uint8]]:
        """The consumer's regions when region r holds source blocks `moved[r][0]` in blocks `moved[r][1]`."""
        out = []
        for r, view in enumerate(self.views):
            region = np.full((LAYOUT.num_blocks, REGION), SENTINEL, dtype=np.uint8)
            src, dst = moved.get(r, ([], []))
            region[np.asarray(dst, dtype=np.int64)] = view.numpy()[np.asarray(src, dtype=np.int64)]
            out.append(region)
        return out

    def landed(
        self, peer: PeerProcess, moved: dict[int, tuple[Sequence[int], Sequence[int]]], notifications: int = 0
    ) -> list[TransferNotification]:
        """Let the consumer poll until exactly `moved` landed (and `notifications` came); the notifications it got
        meanwhile."""
        ok, received = peer.call("wait_landed", self.dest, self.expected(moved), 10.0, notifications)
        assert ok, "the parts did not land"
        return list(received)

    def drained(self, peer: PeerProcess) -> Event:
        """The next callback, while the consumer polls (a WRITE is done at the writer only after that)."""
        peer.send("wait_notifications", self.dest, 1, 2.0)
        event = self.recorder.next()
        assert peer.result()[0] == []
        return event

    def settled(self) -> list[Event]:
        assert self.writer.barrier(5)
        return self.recorder.pending()


MakePair = Callable[..., Pair]


@pytest.fixture
def make_pair(peer: PeerProcess) -> Iterator[MakePair]:
    pairs: list[Pair] = []

    def make(
        layers: int = LAYERS,
        max_parts_in_flight: int = 8,
        kv_ready_timeout_s: float = 60.0,
        start: bool = True,
        part_compute_ratio: float = 0.0,  # every part at once, unless a test is about grouping them
        part_cost: PartCost | None = None,
        clock: Callable[[], float] = time.monotonic,  # when parts are handed over
        writable_until: Callable[[], float] | None = None,
    ) -> Pair:
        layout = Layout((REGION,) * (2 * layers), 16)
        dest = unique("dst")
        agent = peer.call("create", dest, layout)
        views = region_views(layout, seed=len(pairs) + 21)
        recorder = Recorder()
        writer = TransferWriter(
            NixlEndpoint.from_tensors(unique("src"), views),
            on_complete_parts=recorder.on_complete_parts,
            on_revoked=recorder.on_revoked,
            on_source_free=recorder.on_source_free,
            config=WriterConfig(
                max_parts_in_flight=max_parts_in_flight,
                kv_ready_timeout_s=kv_ready_timeout_s,
                part_compute_ratio=part_compute_ratio,
            ),
            layout=KvLayout("m", "uint8", BLOCK, layers, kv_layout="HND"),
            part_cost=part_cost,
            clock=clock,
            writable_until=writable_until,
        )
        if start:
            writer.start()
        pairs.append(Pair(writer, recorder, agent, dest, views))
        return pairs[-1]

    yield make
    for pair in pairs:
        assert pair.writer.stop(10)
        peer.call("close", pair.dest)


def layers(regions: range, src: Sequence[int], dst: Sequence[int]) -> dict[int, tuple[Sequence[int], Sequence[int]]]:
    return {r: (src, dst) for r in regions}


def complete(generation: int, *parts: WrittenPart) -> Event:
    return Event("complete", ("t", generation, True, None, parts))


def carried(notifications: Sequence[TransferNotification]) -> list[tuple[str, int, tuple[WrittenPart, ...] | None]]:
    """What each notification entry says its WRITE carried."""
    return [(n.transfer_id, n.generation, n.parts) for n in notifications]


def tiles(notifications: Sequence[TransferNotification], num_tokens: int, held: range = range(LAYERS)) -> bool:
    """Whether a consumer rank holding layers `held` takes the target as arrived on these notifications."""
    arrival, done = PartsArrival(num_tokens, held), False
    for n in notifications:
        done = arrival.add(n)
    return done and arrival.disputed is None


class LateStream:
    """A FAKE compute stream (a GPU's cannot run here): the points it records complete only when the test says
    so, as a kernel still queued when the engine hands its layer over would."""

    def __init__(self) -> None:
        self.recorded = 0
        self.completed = 0
        self.error: str | None = None

    def record(self) -> KvReady:
        self.recorded += 1
        return _Point(self, self.recorded)


@dataclass(frozen=True)
class _Point:
    stream: LateStream
    index: int

    def done(self) -> bool:
        if self.stream.error is not None:
            raise RuntimeError(self.stream.error)
        return self.stream.completed >= self.index


class Gate:
    """A KvReady whose `done` holds the writer thread until the test opens it: the commands queued meanwhile are
    then handled in one turn of the thread."""

    def __init__(self) -> None:
        self.entered, self.open = threading.Event(), threading.Event()

    def done(self) -> bool:
        self.entered.set()
        return self.open.wait(10)


def spy_posts(writer: TransferWriter) -> list[int]:
    """A spy on the writer's real endpoint: the descriptors of each WRITE it posts by index, as it posts them."""
    endpoint = writer._endpoint
    posts: list[int] = []
    post_indices = endpoint.post_indices

    def spy(op: Any, name: str, local: npt.NDArray[np.int32], remote: npt.NDArray[np.int32], note: bytes = b"") -> Any:
        posts.append(len(local))
        return post_indices(op, name, local, remote, note)

    endpoint.post_indices = spy  # type: ignore[method-assign,assignment]
    return posts


def untouched(peer: PeerProcess, p: Pair) -> bool:
    """Whether the consumer's regions still hold only the sentinel."""
    blocks = peer.call("blocks", p.dest)
    return all(np.array_equal(got, want) for got, want in zip(blocks, p.expected({}), strict=True))


def test_each_layer_part_notifies_what_it_carried_and_an_empty_final_nothing(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    p = make_pair()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)  # the consumer holds the first 2 blocks

    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    first = p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)
    assert first == [
        TransferNotification(p.writer.agent_info().name, "t", 1, 1, range(LAYERS), (WrittenPart(0, 12, 0, 1),))
    ]
    p.writer.source_part("t", SRC, PROMPT, (1, 2), prompt_tokens=PROMPT)
    second = p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]), 1)
    assert carried(second) == [("t", 1, (WrittenPart(0, 12, 1, 1),))]
    assert p.settled() == []  # no outcome before the final
    assert not tiles(first, 12) and tiles(first + second, 12)  # the consumer knows by itself

    p.writer.source_ready("t", SRC)

    assert p.drained(peer) == complete(1, WrittenPart(0, 12, 0, 1), WrittenPart(0, 12, 1, 1))  # nothing to notify
    assert p.recorder.next() == Event("source_free", ("t",))
    p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]))


def test_chunk_parts_write_the_blocks_computed_after_a_prefix_hit(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)  # target: prompt tokens 8..20

    p.writer.source_part("t", SRC[:2], 6, prompt_tokens=PROMPT)  # all of the consumer's prefix
    assert p.settled() == [] and p.writer.parts_in_flight == 0
    p.writer.source_part("t", SRC[:3], 12)  # target block 0 (tokens 8..12)
    first = p.landed(peer, layers(range(4), SRC[2:3], [9]), 1)
    assert carried(first) == [("t", 1, (WrittenPart(0, 4, 0, 2),))]  # chunks: all layers, stated
    p.writer.source_part("t", SRC, 18)  # block 1; block 2 (tokens 16..20) is not all computed
    second = p.landed(peer, layers(range(4), SRC[2:4], [9, 2]), 1)
    assert carried(second) == [("t", 1, (WrittenPart(4, 4, 0, 2),))]

    p.writer.source_ready("t", SRC)

    received, _ = peer.call("wait_notifications", p.dest, 1, 5.0)
    assert carried(received) == [("t", 1, (WrittenPart(8, 4, 0, 2),))]
    assert tiles(first + second + received, 12)
    parts = (WrittenPart(0, 4, 0, 0), WrittenPart(4, 4, 0, 0), WrittenPart(8, 4, 0, 0))
    assert p.recorder.next() == complete(1, *parts)
    assert p.recorder.next() == Event("source_free", ("t",))
    p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]))


def test_parts_in_flight_stay_under_the_cap_and_the_rest_goes_together(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair(layers=4, max_parts_in_flight=2)
    p.writer.assign("t", 1, p.agent, 1, [3, 4], progressive=True)
    for layer in range(4):
        p.writer.source_part("t", SRC[:2], 8, (layer, layer + 1), prompt_tokens=8)
        assert p.writer.barrier(5)  # a turn of its own: parts handed over in one turn go in one WRITE

    assert p.settled() == [] and p.writer.parts_in_flight == 2  # the consumer does not poll yet

    received = p.landed(peer, layers(range(8), SRC[:2], [3, 4]), 3)
    # Layers 2 and 3 waited for a free slot and went in one WRITE.
    assert sorted(part.first_layer for n in received for part in n.parts or ()) == [0, 1, 2]
    assert WrittenPart(0, 8, 2, 2) in {part for n in received for part in n.parts or ()}
    assert tiles(received, 8, range(4))
    p.writer.source_ready("t", SRC[:2])
    assert p.drained(peer) == complete(1, WrittenPart(0, 8, 0, 1), WrittenPart(0, 8, 1, 1), WrittenPart(0, 8, 2, 2))
    assert p.writer.parts_in_flight == 0


def test_abort_mid_way_posts_no_more_and_frees_the_source_once_parts_drained(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    p = make_pair()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    assert p.writer.barrier(5)  # posted
    p.writer.abort("t")
    p.writer.source_part("t", SRC, PROMPT, (1, 2))  # ended: ignored
    assert p.settled() == []  # layer 0 is still in flight

    assert carried(p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)) == [("t", 1, (WrittenPart(0, 12, 0, 1),))]

    assert p.drained(peer) == Event("source_free", ("t",))
    p.writer.source_ready("t", SRC)
    assert p.settled() == [Event("source_free", ("t",))]  # a late source is freed at once, nothing written
    assert p.writer.parts_in_flight == 0
    p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]))


def test_revoke_mid_way_is_acknowledged_after_parts_drained_and_the_next_generation_writes_its_own(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    p = make_pair()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    assert p.writer.barrier(5)  # posted
    p.writer.revoke("t", 1)
    p.writer.source_part("t", SRC, PROMPT, (1, 2))  # for a revoked generation: not written
    assert p.settled() == []

    assert carried(p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)) == [("t", 1, (WrittenPart(0, 12, 0, 1),))]

    assert p.drained(peer) == Event("revoked", ("t", 1))
    assert p.settled() == [] and p.writer.parts_in_flight == 0

    p.writer.assign("t", 2, p.agent, 1, [12, 13, 14], progressive=True)
    received = p.landed(
        peer,
        {**layers(range(2), SRC[2:] * 2, [9, 2, 5, 12, 13, 14]), **layers(range(2, 4), SRC[2:], [12, 13, 14])},
        1,
    )
    assert carried(received) == [("t", 2, (WrittenPart(0, 12, 0, 2),))]  # both layers were computed: one part
    p.writer.source_ready("t", SRC)
    assert p.drained(peer) == complete(2, WrittenPart(0, 12, 0, 0))
    assert p.recorder.next() == Event("source_free", ("t",))


def test_a_write_in_parts_when_the_engine_re_registers_posts_no_more_and_fails_once_parts_drained(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """`drop_assignments`: the rest of a generation written in parts for the replaced incarnation is not posted; it
    fails with the reason once its parts drained (reported with them), and the source stays for a new assignment."""
    p = make_pair()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    assert p.writer.barrier(5)  # posted
    assert p.writer.drop_assignments("re-registered", 5)
    p.writer.source_part("t", SRC, PROMPT, (1, 2))  # not written
    assert p.settled() == []  # layer 0 is still in flight

    assert carried(p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)) == [("t", 1, (WrittenPart(0, 12, 0, 1),))]

    assert p.drained(peer) == Event("complete", ("t", 1, False, "re-registered", (WrittenPart(0, 12, 0, 1),)))
    assert p.settled() == [] and p.writer.parts_in_flight == 0
    p.writer.source_ready("t", SRC)
    assert p.settled() == []  # held for a later assignment
    p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]))


def test_a_non_progressive_assignment_remembers_parts_and_writes_once(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5])
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    p.writer.source_part("t", SRC, PROMPT, (1, 2), prompt_tokens=PROMPT)
    assert p.settled() == [] and p.writer.parts_in_flight == 0

    p.writer.source_ready("t", SRC)

    received, _ = peer.call("wait_notifications", p.dest, 1, 5.0)
    assert [(n.transfer_id, n.generation) for n in received] == [("t", 1)]
    assert p.recorder.next() == complete(1)  # no parts: one write
    assert p.recorder.next() == Event("source_free", ("t",))
    p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]))


def test_parts_before_the_assignment_are_posted_when_it_comes(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    p.writer.source_part("t", SRC, PROMPT, (1, 2))
    assert p.settled() == []

    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)

    assert p.settled() == [] and p.writer.parts_in_flight == 1  # both layers at once: one WRITE
    assert carried(p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]), 1)) == [("t", 1, (WrittenPart(0, 12, 0, 2),))]
    p.writer.source_ready("t", SRC)
    assert p.drained(peer) == complete(1, WrittenPart(0, 12, 0, 0))


def test_chunks_into_bigger_blocks_of_fewer_ranks_land_byte_exact(peer: PeerProcess) -> None:
    # 80 prompt tokens in blocks of 16 on 2 ranks; the consumer (1 rank, blocks of 32) holds the first 32.
    p, c = Engine(2, 1, 16, 6), Engine(1, 1, 32, 4)
    src, dst, prompt, target = [4, 0, 1, 2, 5], [3, 1], 80, 48
    name = unique("c")
    consumer = ConsumerEngine(c.layout, (dataclasses.replace(peer.call("create", name, c.region_layout(0)), rank=0),))
    views = [region_views(p.region_layout(r), seed=200 + r) for r in range(2)]
    recorders = [Recorder(), Recorder()]
    writers = [
        TransferWriter(
            NixlEndpoint.from_tensors(unique(f"p{r}"), views[r]),
            on_complete_parts=recorders[r].on_complete_parts,
            on_revoked=recorders[r].on_revoked,
            on_source_free=recorders[r].on_source_free,
            layout=p.layout,
            rank=r,
        )
        for r in range(2)
    ]
    sources = [[v.numpy() for v in rank] for rank in views]

    def landed(blocks: list[int], notifications: int = 0) -> list[TransferNotification]:
        want = [w.reshape(c.num_blocks, -1) for w in expected(p, c, sources, 0, src, blocks, prompt, target)]
        ok, received = peer.call("wait_landed", name, want, 10.0, notifications)
        assert ok
        return list(received)

    try:
        for w in writers:
            w.start()
            w.assign("t", 1, consumer, 1, dst, target_tokens=target, progressive=True)
            w.source_part("t", src[:3], 48, prompt_tokens=prompt)  # target block 0 holds tokens 32..64: not yet
        assert all(w.barrier(5) and w.parts_in_flight == 0 for w in writers)
        for w in writers:
            w.source_part("t", src[:4], 64)
        first = landed(dst[:1], 2)
        assert len(first) == 2 and not tiles(first, target, range(c.layout.num_layers))

        for w in writers:
            w.source_ready("t", src)

        received = peer.call("wait_all", {name: 2}, 10.0)[name]
        assert sorted((n.transfer_id, n.generation, n.writers) for n in received) == [("t", 1, 2)] * 2
        assert tiles(first + received, target, range(c.layout.num_layers))  # each of the 2 writers tiled
        for recorder in recorders:
            assert recorder.next(10) == complete(1, WrittenPart(0, 32, 0, 0), WrittenPart(32, 16, 0, 0))
            assert recorder.next() == Event("source_free", ("t",))
        landed(dst)
    finally:
        for w in writers:
            assert w.stop(10)
        peer.call("close", name)


STAGES = (Engine(1, 1, 4, 6), Engine(1, 2, 4, 6))
"""A producer rank of two layers and a consumer of two pipeline stages: stage r holds layer r."""
STAGES_SRC, STAGES_DST = [0, 1, 2], [5, 4, 3]


@contextlib.contextmanager
def writing_into(
    peer: PeerProcess, p: Engine, c: Engine, dst: list[int], seed: int, config: WriterConfig
) -> Iterator[tuple[list[str], list[torch.Tensor], Recorder, TransferWriter]]:
    """`p`'s rank 0 (a started writer with `config`, its KV random from `seed`) assigned transfer "t" into `dst`
    of every rank of `c`, progressive: (the consumer ranks' agent names, the KV, the recorder, the writer)."""
    names = [unique(f"c{r}") for r in range(c.tp * c.pp)]
    agents = tuple(
        dataclasses.replace(peer.call("create", n, c.region_layout(r)), rank=r, **c.agent_fields(r))
        for r, n in enumerate(names)
    )
    views = region_views(p.region_layout(0), seed=seed)
    recorder = Recorder()
    writer = TransferWriter(
        NixlEndpoint.from_tensors(unique("p"), views),
        on_complete_parts=recorder.on_complete_parts,
        on_revoked=recorder.on_revoked,
        on_source_free=recorder.on_source_free,
        config=config,
        layout=p.layout,
    )
    try:
        writer.start()
        writer.assign("t", 1, ConsumerEngine(c.layout, agents), 1, dst, progressive=True)
        yield names, views, recorder, writer
    finally:
        assert writer.stop(10)
        for n in names:
            peer.call("close", n)


def into_two_stages(
    peer: PeerProcess, seed: int, config: WriterConfig
) -> contextlib.AbstractContextManager[tuple[list[str], list[torch.Tensor], Recorder, TransferWriter]]:
    """`STAGES`' producer rank writing transfer "t" into the consumer's two stages (`writing_into`)."""
    return writing_into(peer, *STAGES, STAGES_DST, seed, config)


def test_layer_parts_go_only_to_the_consumer_stage_holding_the_layer(peer: PeerProcess) -> None:
    p, c = STAGES
    src, dst = STAGES_SRC, STAGES_DST
    config = WriterConfig(part_compute_ratio=0.0)  # each layer a part, however soon after the last
    with into_two_stages(peer, 300, config) as (names, views, recorder, writer):
        writer.source_part("t", src, 12, (0, 1), prompt_tokens=12)
        assert writer.barrier(5) and writer.parts_in_flight == 1  # one WRITE, into stage 0
        writer.source_part("t", src, 12, (1, 2))
        assert writer.barrier(5) and writer.parts_in_flight == 2

        writer.source_ready("t", src)

        received = peer.call("wait_all", {n: 1 for n in names}, 10.0)
        for r, n in enumerate(names):  # stage r heard of layer r only, which is all it holds
            assert carried(received[n]) == [("t", 1, (WrittenPart(0, 12, r, 1),))]
            assert tiles(received[n], 12, range(r, r + 1))
        assert recorder.next(10) == complete(1, WrittenPart(0, 12, 0, 1), WrittenPart(0, 12, 1, 1))
        assert recorder.next() == Event("source_free", ("t",))
        sources = [[v.numpy() for v in views]]
        for r, n in enumerate(names):
            got = [c.canonical(b) for b in peer.call("blocks", n)]
            for g, w in zip(got, expected(p, c, sources, r, src, dst, 12, 12), strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"consumer rank {r}")


def test_a_part_is_posted_only_once_the_device_computed_it(peer: PeerProcess, make_pair: MakePair) -> None:
    p, stream = make_pair(), LateStream()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)

    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT, kv_ready=stream.record())

    assert p.settled() == [] and p.writer.parts_in_flight == 0  # still being computed: nothing posted
    assert untouched(peer, p)
    stream.completed = 1
    assert carried(p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)) == [("t", 1, (WrittenPart(0, 12, 0, 1),))]
    p.writer.source_ready("t", SRC)
    received, _ = peer.call("wait_notifications", p.dest, 1, 5.0)
    assert len(received) == 1 and p.recorder.next() == complete(1, WrittenPart(0, 12, 0, 1), WrittenPart(0, 12, 1, 1))


def test_the_final_waits_behind_its_parts_still_computing(peer: PeerProcess, make_pair: MakePair) -> None:
    p, stream = make_pair(), LateStream()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT, kv_ready=stream.record())

    p.writer.source_ready("t", SRC)  # computed already, but handed over after the part

    assert p.settled() == [] and p.writer.parts_in_flight == 0
    assert untouched(peer, p)
    stream.completed = 1
    received, _ = peer.call("wait_notifications", p.dest, 2, 5.0)
    assert carried(received) == [("t", 1, (WrittenPart(0, 12, 0, 1),)), ("t", 1, (WrittenPart(0, 12, 1, 1),))]
    assert p.recorder.next() == complete(1, WrittenPart(0, 12, 0, 1), WrittenPart(0, 12, 1, 1))
    assert p.recorder.next() == Event("source_free", ("t",))
    p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]))


def test_a_device_error_fails_the_transfer_and_writes_nothing(peer: PeerProcess, make_pair: MakePair) -> None:
    p, stream = make_pair(), LateStream()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT, kv_ready=stream.record())
    p.writer.source_ready("t", SRC, kv_ready=stream.record())

    stream.error = "an illegal memory access was encountered"

    failed = p.recorder.next()
    assert failed.kind == "complete" and failed.args[2] is False
    assert "the device failed computing the KV: an illegal memory access" in failed.args[3]
    assert p.recorder.next() == Event("source_free", ("t",))
    assert p.writer.parts_in_flight == 0 and untouched(peer, p)


def test_an_assignment_after_a_device_failure_before_it_fails_with_that_failure(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """Layer-wise prefill hands parts over before decode registered (the claim goes at admission): a part whose
    device fails then ends the transfer here with nobody to tell. Before, the assignment that came next was
    ignored as of an ended transfer: no outcome, and decode waited for the deadline (found by an audit)."""
    p, stream = make_pair(), LateStream()
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT, kv_ready=stream.record())
    stream.error = "an illegal memory access was encountered"
    assert p.recorder.next() == Event("source_free", ("t",))

    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)

    failed = p.recorder.next()
    assert failed.args[:3] == ("t", 1, False) and "an illegal memory access" in failed.args[3]
    assert p.settled() == [] and untouched(peer, p)


def test_a_device_failure_while_a_revoked_generation_drains_fails_the_next_generation(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """Generation 1 is revoked while its layer 0 is in flight; then the device fails on layer 1. The KV was never
    computed, so generation 2, assigned once 1 drained, must fail with that failure. Before, the failure was
    dropped (the revoked write was draining, no assignment held) and generation 2 wrote the uncomputed blocks and
    reported success (found by an audit)."""
    p, stream = make_pair(), LateStream()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    assert p.writer.barrier(5)  # layer 0 posted
    p.writer.source_part("t", SRC, PROMPT, (1, 2), kv_ready=stream.record())
    p.writer.source_ready("t", SRC, kv_ready=stream.record())
    p.writer.revoke("t", 1)
    assert p.writer.barrier(5)  # revoked: layer 0 drains, layer 1 and the final wait for the device
    stream.error = "an illegal memory access was encountered"
    assert p.writer.barrier(5) and p.writer.barrier(5)  # the failure was seen, layer 0 still in flight
    assert p.settled() == []

    p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)
    assert p.drained(peer) == Event("revoked", ("t", 1))
    assert p.recorder.next() == Event("source_free", ("t",))  # drained: nothing of the source is written again

    p.writer.assign("t", 2, p.agent, 1, [12, 13, 14], progressive=True)
    failed = p.recorder.next()
    assert failed.args[:3] == ("t", 2, False) and "an illegal memory access" in failed.args[3]
    assert p.settled() == [] and p.writer.parts_in_flight == 0
    p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]))  # nothing of generation 2


def test_what_an_ended_transfer_is_handed_is_freed_at_once_or_at_stop(peer: PeerProcess, make_pair: MakePair) -> None:
    """After an abort nothing more of a transfer is written: a part handed over later is freed at once, and a
    source still computing when the writer stops is freed then. Before, neither was ever freed (found by an
    audit): the engine's blocks leaked."""
    p, stream = make_pair(), LateStream()
    p.writer.source_ready("t", SRC, kv_ready=stream.record())
    p.writer.abort("t")
    p.writer.source_part("u", SRC, 4, (0, 1), prompt_tokens=PROMPT)
    p.writer.abort("u")
    assert p.recorder.next() == Event("source_free", ("u",))  # its first part, held until the abort
    p.writer.source_part("u", SRC, 8, (0, 1))  # late
    assert p.recorder.next() == Event("source_free", ("u",))
    assert p.settled() == []

    assert p.writer.stop(10)

    assert p.recorder.pending() == [Event("source_free", ("t",))]
    assert untouched(peer, p)


def test_a_part_for_a_peer_s_old_incarnation_never_lands_in_its_new_one(peer: PeerProcess, make_pair: MakePair) -> None:
    """In one turn, a first part placed as its assignment (to incarnation 1) comes waits in the turn's batch, and
    an assignment to the peer's new incarnation reconnects the peer: it must wait for that batch, whose WRITE
    goes to incarnation 1 and fails. Before, the reconnect did not see the batch, and the old incarnation's part
    landed in the new one's memory (found by an audit)."""
    p = make_pair()
    p.writer.assign("t0", 1, p.agent, 1, [3])  # incarnation 1 loaded
    p.writer.source_ready("t0", SRC[:1])
    p.landed(peer, {r: (SRC[:1], [3]) for r in range(2 * LAYERS)}, 1)
    assert p.recorder.next().args[:3] == ("t0", 1, True)
    assert p.recorder.next() == Event("source_free", ("t0",))
    peer.call("close", p.dest)
    restarted = peer.call("create", p.dest, LAYOUT)  # the same agent name, new memory: incarnation 2

    gate = Gate()
    p.writer.source_part("tx", SRC, 4, prompt_tokens=PROMPT, kv_ready=gate)
    assert gate.entered.wait(5)  # the writer thread is held: the next three commands go in one turn
    p.writer.source_part("t1", SRC, PROMPT, prompt_tokens=PROMPT)
    p.writer.assign("t1", 1, p.agent, 1, [9, 2, 5], progressive=True)  # incarnation 1: gone
    p.writer.assign("t2", 1, restarted, 2, [1])
    gate.open.set()

    failed = p.recorder.next(10)  # (its bytes may land all the same here: both incarnations share one process)
    assert failed.args[:3] == ("t1", 1, False) and "DISCONNECT" in failed.args[3]


def test_reports_of_a_prompt_restarted_in_other_blocks_start_over(peer: PeerProcess, make_pair: MakePair) -> None:
    """vLLM preempts a prompt mid chunked prefill and resumes it from its first token in other blocks: the next
    report names other blocks and fewer tokens. Before, the writer kept the longest block list and the most tokens
    reported, so the old blocks (freed, and reused by other requests) went out as parts and the final skipped
    them: decode got other bytes (found by an audit). Nothing was posted yet: the reports start over."""
    p = make_pair()
    dst = [9, 10, 11, 12, 13]
    p.writer.source_part("t", [0, 1, 7], 12, prompt_tokens=PROMPT)
    p.writer.source_part("t", [2, 4], 8, prompt_tokens=PROMPT)  # restarted: tokens 0-8 in blocks 2 and 4
    p.writer.assign("t", 1, p.agent, 1, dst, progressive=True)
    p.landed(peer, layers(range(2 * LAYERS), [2, 4], dst[:2]), 1)  # what the new report says is computed
    p.writer.source_ready("t", [2, 4, 6, 8, 10])

    p.landed(peer, layers(range(2 * LAYERS), [2, 4, 6, 8, 10], dst))
    assert p.recorder.next().args[:3] == ("t", 1, True)


def test_a_prompt_restarted_after_parts_of_it_were_posted_fails_its_write(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """Parts already posted may have read blocks the engine reused after preempting the prompt: the write fails
    rather than finish with them, and nothing more of it is posted."""
    p = make_pair()
    dst = [9, 10, 11, 12, 13]
    p.writer.assign("t", 1, p.agent, 1, dst, progressive=True)
    p.writer.source_part("t", [0, 1, 7], 12, prompt_tokens=PROMPT)
    p.landed(peer, layers(range(2 * LAYERS), [0, 1, 7], dst[:3]), 1)

    p.writer.source_part("t", [2, 4], 8, prompt_tokens=PROMPT)
    p.writer.source_ready("t", [2, 4, 6, 8, 10])

    failed = p.recorder.next()
    assert failed.args[:3] == ("t", 1, False) and "preempted" in failed.args[3]
    p.landed(peer, layers(range(2 * LAYERS), [0, 1, 7], dst[:3]))  # nothing more
    p.writer.abort("t")  # a failed generation keeps its source for another, until the transfer ends
    assert p.recorder.next() == Event("source_free", ("t",))


def test_a_part_the_device_never_computes_fails_its_transfer(peer: PeerProcess, make_pair: MakePair) -> None:
    p, stream = make_pair(kv_ready_timeout_s=0.05), LateStream()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)

    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT, kv_ready=stream.record())

    failed = p.recorder.next()
    assert failed.args[:3] == ("t", 1, False) and "did not compute the KV within 0.05 s" in failed.args[3]
    assert p.recorder.next() == Event("source_free", ("t",))
    assert untouched(peer, p)


def test_one_layer_of_several_transfers_handed_over_together_goes_in_one_write(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    p = make_pair(start=False)  # what is queued before the start is handled in one turn
    posts = spy_posts(p.writer)
    p.writer.assign("a", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.assign("b", 1, p.agent, 1, [12, 13, 14], progressive=True)
    p.writer.source_part("a", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    p.writer.source_part("b", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)

    p.writer.start()

    assert p.writer.barrier(5) and posts == [2 * 3 * 2]  # layer 0's K and V, 3 blocks each, of both
    assert p.writer.parts_in_flight == 2  # one WRITE, held by both transfers, one notification of both
    layer_0 = (WrittenPart(0, 12, 0, 1),)
    assert carried(p.landed(peer, layers(range(2), SRC[2:] * 2, [9, 2, 5, 12, 13, 14]), 2)) == [
        ("a", 1, layer_0),
        ("b", 1, layer_0),
    ]
    for transfer_id in ("a", "b"):
        p.writer.source_ready(transfer_id, SRC)
    received, _ = peer.call("wait_notifications", p.dest, 2, 5.0)
    assert sorted(n.transfer_id for n in received) == ["a", "b"]
    outcomes = [p.recorder.next() for _ in range(4)]
    for transfer_id in ("a", "b"):
        parts = (WrittenPart(0, 12, 0, 1), WrittenPart(0, 12, 1, 1))
        assert Event("complete", (transfer_id, 1, True, None, parts)) in outcomes
        assert Event("source_free", (transfer_id,)) in outcomes
    assert p.writer.parts_in_flight == 0


class GivenCost(PartCost):
    """A part's fixed cost, given: what the writer measures is recorded, not fitted."""

    def __init__(self, fixed: float) -> None:
        super().__init__()
        self.given = fixed
        self.observed: list[tuple[int, int]] = []  # parts and bytes of each turn

    def observe(self, seconds: float, parts: int, num_bytes: int) -> None:
        self.observed.append((parts, num_bytes))

    @property
    def fixed(self) -> float:
        return self.given


def test_a_part_goes_once_its_compute_pays_for_it_and_what_is_held_goes_with_the_final(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    handed = iter([10.0, 10.5, 11.0, 11.5])  # when the engine hands over layers 0-3
    cost = GivenCost(0.5)
    p = make_pair(layers=4, part_compute_ratio=2.0, part_cost=cost, clock=handed.__next__)  # a part: 1 s of compute
    posts = spy_posts(p.writer)
    p.writer.assign("t", 1, p.agent, 1, [3, 4], progressive=True)
    p.writer.source_part("t", SRC[:2], 8, (0, 1), prompt_tokens=8)  # the first part goes at once
    assert carried(p.landed(peer, layers(range(2), SRC[:2], [3, 4]), 1)) == [("t", 1, (WrittenPart(0, 8, 0, 1),))]
    assert cost.observed == [(1, 2 * 2 * REGION)]  # measured: 2 blocks of K and V

    p.writer.source_part("t", SRC[:2], 8, (1, 2), prompt_tokens=8)  # 0.5 s since the last part: cannot pay
    assert p.settled() == [] and posts == [2 * 2]
    p.writer.source_part("t", SRC[:2], 8, (2, 3), prompt_tokens=8)  # 1 s: pays, and carries layer 1 too
    assert carried(p.landed(peer, layers(range(6), SRC[:2], [3, 4]), 1)) == [("t", 1, (WrittenPart(0, 8, 1, 2),))]
    assert posts == [2 * 2, 4 * 2] and cost.observed[-1] == (1, 2 * 4 * REGION)
    p.writer.source_part("t", SRC[:2], 8, (3, 4), prompt_tokens=8)  # 0.5 s since: held
    assert p.settled() == [] and posts == [2 * 2, 4 * 2]

    p.writer.source_ready("t", SRC[:2])  # the final is never held
    received, _ = peer.call("wait_notifications", p.dest, 1, 5.0)
    assert carried(received) == [("t", 1, (WrittenPart(0, 8, 3, 1),))]
    assert p.recorder.next() == complete(1, WrittenPart(0, 8, 0, 1), WrittenPart(0, 8, 1, 2), WrittenPart(0, 8, 3, 1))
    assert posts == [2 * 2, 4 * 2, 2 * 2]
    p.landed(peer, layers(range(8), SRC[:2], [3, 4]))


@pytest.mark.parametrize("told", ["assign", "part"])
def test_a_target_that_does_not_fit_the_prompt_fails_once_its_length_is_told(
    peer: PeerProcess, make_pair: MakePair, told: str
) -> None:
    p = make_pair()
    on_assign = PROMPT if told == "assign" else 0
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5, 12, 13, 14], prompt_tokens=on_assign, progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT - on_assign)  # 5 blocks, not 6

    failed = p.recorder.next()
    assert failed.args[:3] == ("t", 1, False) and "6 target blocks but the prompt fills 5" in failed.args[3]
    assert p.writer.parts_in_flight == 0 and untouched(peer, p)
    p.writer.abort("t")
    assert p.recorder.next() == Event("source_free", ("t",))


def test_parts_of_one_transfer_handed_over_in_one_turn_are_placed_once(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair(start=False)  # what is queued before the start is handled in one turn: a writer that fell behind
    posts = spy_posts(p.writer)
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    p.writer.source_part("t", SRC, PROMPT, (1, 2), prompt_tokens=PROMPT)

    p.writer.start()

    assert p.writer.barrier(5) and posts == [2 * 2 * 3] and p.writer.parts_in_flight == 1  # both layers, one WRITE
    received = p.landed(peer, layers(range(4), SRC[2:], [9, 2, 5]), 1)
    assert carried(received) == [("t", 1, (WrittenPart(0, 12, 0, 2),))]  # one rectangle, not one per part
    p.writer.source_ready("t", SRC)
    assert p.drained(peer) == complete(1, WrittenPart(0, 12, 0, 0))  # nothing left for the final
    assert p.recorder.next() == Event("source_free", ("t",))


def test_without_a_ratio_every_part_goes_whatever_it_costs(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair(layers=4, part_compute_ratio=0.0, part_cost=GivenCost(3600.0))
    posts = spy_posts(p.writer)
    p.writer.assign("t", 1, p.agent, 1, [3, 4], progressive=True)
    for layer in range(4):
        p.writer.source_part("t", SRC[:2], 8, (layer, layer + 1), prompt_tokens=8)
        p.landed(peer, layers(range(2 * layer + 2), SRC[:2], [3, 4]), 1)
    assert posts == [2 * 2] * 4


def test_with_integrity_each_stage_s_last_cell_waits_for_the_final_which_brings_scoped_digests(
    peer: PeerProcess,
) -> None:
    """Integrity into consumer stages that each take one layer of the producer's (only some of its bytes): each
    layer's part goes ahead without its last block, which goes with the final, whose notification carries the
    digests of that stage's whole target with their scope; the consumer's own hash of its blocks matches them."""
    pytest.importorskip("xxhash", reason="integrity needs the nixl extra's xxhash")
    src, dst = STAGES_SRC, STAGES_DST
    config = WriterConfig(part_compute_ratio=0.0, integrity=True)
    with into_two_stages(peer, 301, config) as (names, _, recorder, writer):
        writer.source_part("t", src, 12, (0, 1), prompt_tokens=12)
        assert writer.barrier(5) and writer.parts_in_flight == 1  # layer 0's first two blocks, into stage 0
        writer.source_part("t", src, 12, (1, 2))
        assert writer.barrier(5) and writer.parts_in_flight == 2
        writer.source_ready("t", src)

        received = peer.call("wait_all", {n: 2 for n in names}, 10.0)
        for r, n in enumerate(names):
            ahead, final = received[n]
            assert (ahead.parts, ahead.digests) == ((WrittenPart(0, 8, r, 1),), ())
            assert final.parts == (WrittenPart(8, 4, r, 1),) and final.scope == DigestScope(range(0, 2), 0, 4, 12)
            assert tiles([ahead, final], 12, range(r, r + 1))
            held = [torch.from_numpy(b.copy()) for b in peer.call("blocks", n)]
            geometry = RankGeometry(regions_from_tensors(held), 4, 4)
            assert scope_digests(geometry, "HND", final.scope, dst) == final.digests
            held[1][dst[0], 0] ^= 0xFF  # a byte of what landed, changed
            assert scope_digests(geometry, "HND", final.scope, dst) != final.digests
        assert recorder.next(10) == complete(1, WrittenPart(0, 8, 0, 1), WrittenPart(0, 8, 1, 1), WrittenPart(8, 4))


def test_with_integrity_a_head_share_s_layers_are_hashed_as_their_parts_go(peer: PeerProcess) -> None:
    """Integrity into a rank of twice the heads (TP 2 -> 1: rank 0 writes heads 0-1 of every layer), in layer
    parts: each layer's regions are hashed once its part is posted, so the final's scoped digests are of the
    bytes those parts wrote even if the source changed after they landed (hashed at the final, they would be
    of the new bytes and fail the consumer's check)."""
    pytest.importorskip("xxhash", reason="integrity needs the nixl extra's xxhash")
    p, c = Engine(2, 1, 4, 6, layers=3), Engine(1, 1, 4, 6, layers=3)
    src, dst, prompt = [0, 1, 2], [5, 4, 3], 12
    config = WriterConfig(part_compute_ratio=0.0, integrity=True)
    with writing_into(peer, p, c, dst, 302, config) as ((name,), views, recorder, writer):
        for layer in (0, 1):
            writer.source_part("t", src, prompt, (layer, layer + 1), prompt_tokens=prompt)
            assert writer.barrier(5)
        ahead = peer.call("wait_all", {name: 2}, 10.0)[name]
        assert [n.parts for n in ahead] == [(WrittenPart(0, 12, 0, 1),), (WrittenPart(0, 12, 1, 1),)]
        for region in views[:4]:  # layers 0 and 1, K and V: reused once landed
            region.bitwise_not_()

        writer.source_part("t", src, prompt, (2, 3))
        writer.source_ready("t", src)

        last = peer.call("wait_all", {name: 2}, 10.0)[name]  # layer 2 but its last cell, and the final (any order)
        (final,) = [n for n in last if n.digests]
        assert {n.parts for n in last} == {(WrittenPart(0, 8, 2, 1),), (WrittenPart(8, 4, 2, 1),)}
        assert final.scope == DigestScope(range(0, 6), 0, 2, 12) and len(final.digests) == 6
        held = [torch.from_numpy(b.copy()) for b in peer.call("blocks", name)]
        geometry = RankGeometry(regions_from_tensors(held), 4, 4)
        assert scope_digests(geometry, "HND", final.scope, dst) == final.digests
        done = recorder.next(10)
        assert (done.kind, done.args[:4]) == ("complete", ("t", 1, True, None))


class Fence:
    """A write fence the test moves: open (`math.inf`) or passed (`-math.inf`), so no outcome hangs on the clock."""

    def __init__(self) -> None:
        self.until = math.inf

    def __call__(self) -> float:
        return self.until

    def lapse(self) -> None:
        self.until = -math.inf


def fenced(event: Event, generation: int = 1) -> bool:
    """Whether `event` fails the generation for its lapsed lease, and says so."""
    transfer_id, gen, ok, error, *_ = event.args
    return event.kind == "complete" and (transfer_id, gen, ok) == ("t", generation, False) and "lease" in (error or "")


def test_past_the_write_fence_a_whole_write_is_not_posted_and_fails(peer: PeerProcess, make_pair: MakePair) -> None:
    """The engine's lease is not certainly held (its session's fence passed): the consumer may have been told
    PEER_LOST and reused its blocks, so the write is never posted (`_post`), and the generation fails."""
    fence = Fence()
    p = make_pair(writable_until=fence)
    posts = spy_posts(p.writer)
    fence.lapse()
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5])
    p.writer.source_ready("t", SRC)

    assert fenced(p.recorder.next())
    assert posts == [] and untouched(peer, p)
    assert p.settled() == []  # a failed generation keeps its source for a later one, until the transfer ends
    p.writer.abort("t")
    assert p.settled() == [Event("source_free", ("t",))]


def test_past_the_write_fence_no_more_parts_are_posted(peer: PeerProcess, make_pair: MakePair) -> None:
    """Parts go in the turn's batch (`_flush_parts`): once the fence passed, the next layer is not posted; the
    generation fails once the layer posted before drained (it landed: posted before the fence, it had the fence's
    margin to land before the service could lapse the lease)."""
    fence = Fence()
    p = make_pair(writable_until=fence)
    posts = spy_posts(p.writer)
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)
    p.writer.source_part("t", SRC, PROMPT, (0, 1), prompt_tokens=PROMPT)
    p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]), 1)
    assert len(posts) == 1

    fence.lapse()
    p.writer.source_part("t", SRC, PROMPT, (1, 2))
    assert p.writer.barrier(5) and len(posts) == 1

    assert fenced(p.drained(peer))
    p.writer.source_ready("t", SRC)  # the final: nothing of a failed generation is posted
    assert p.settled() == [] and len(posts) == 1
    p.landed(peer, layers(range(2), SRC[2:], [9, 2, 5]))  # layer 0 only
    p.writer.abort("t")
    assert p.settled() == [Event("source_free", ("t",))]


def test_past_the_write_fence_the_final_after_parts_is_not_posted(peer: PeerProcess, make_pair: MakePair) -> None:
    """The final (`source_ready` after parts: `_post` of what is left) is checked too."""
    fence = Fence()
    p = make_pair(writable_until=fence)
    posts = spy_posts(p.writer)
    p.writer.assign("t", 1, p.agent, 1, [9, 2, 5], progressive=True)  # target: prompt tokens 8..20
    p.writer.source_part("t", SRC[:3], 12, prompt_tokens=PROMPT)  # target block 0
    p.landed(peer, layers(range(4), SRC[2:3], [9]), 1)

    fence.lapse()
    p.writer.source_ready("t", SRC)  # blocks 1 and 2 are left

    assert fenced(p.drained(peer))
    assert len(posts) == 1
    p.landed(peer, layers(range(4), SRC[2:3], [9]))
