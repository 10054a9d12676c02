"""`TransferWriter`: one producer rank's background writer, one thread that owns a `NixlEndpoint`.

Other threads hand it commands (thread-safe, non-blocking): `assign` (a consumer's destination blocks for one
generation of a transfer), `source_part` (part of the KV is computed), `source_ready` (all of it is, in these
source blocks), `revoke`, `abort` and `forget_peer`. Once a transfer has both an assignment and its source
blocks the writer WRITEs them and polls until NIXL is done. The endpoint belongs to the writer from
construction on. Outcomes come back through callbacks, which run on the writer thread: keep them short; the
optional `on_written` is told how long each generation's WRITEs took, from posting (or from the final, when
written in parts) to completion.

An assignment names either one consumer agent, whose regions pair with this rank's region by region (whole
blocks), or the consumer engine (`ConsumerEngine`: its layout and every rank's agent). Then this rank writes
its share of each consumer rank as `rendezvous.protocol.kvmap` says (its heads and layers; tokens paired by
`token_runs` when block sizes differ): one WRITE per consumer rank it has a share in, each with descriptor
lists built for the transfer (`rendezvous.clients.nixl.plan`) and the notification "<transfer_id>:<generation>" (with
`WriterConfig.integrity`, also the digests of what it carries: `rendezvous.clients.nixl.integrity`).

Progressive push (`assign(..., progressive=True)`: the consumer accepts parts). The engine reports what it computed
with `source_part` (layer-wise prefill: each layer of the whole prompt; chunked prefill: each chunk in all layers),
and the writer posts what is new as soon as it holds the assignment: a part covers the target blocks all of whose
tokens are computed in the layers reported (`rendezvous.clients.nixl.parts`), so a partly computed block waits for the
next part or the final write. That needs the writer's `layout` (block sizes, layers) and the prompt's length (from
`source_part` or `assign`); until both are known parts are only remembered. A part goes in one WRITE per consumer
rank with a share in it, with the notification of the rectangles it carries in that rank's share
(`rendezvous.clients.nixl.notifications`: the consumer arrives once they tile the target, before the service's commit).
Parts are placed at the end of each turn of the thread, so the parts of one transfer handed over meanwhile (the writer
fell behind) are placed once, together. For a whole-block share the write's cells are addressed by index in the
prepared lists: the indices of every (region, target block), here and at the peer, are made once per write (ours
again only when the engine reports more source blocks), and a part is a slice of them; the parts of every transfer
handled in one turn (a layer of each prompt of a step) go in one WRITE per consumer rank, held by each of those
transfers and naming each one's. Other shares' cells are merged into as few descriptors as they allow. Every share
works, with different block sizes and TP sizes too. A source or part handed over with a `KvReady` (the device still
computing it: `rendezvous.clients.nixl.device`) waits, in order per transfer, until it is done; one whose device fails
or takes longer than `WriterConfig.kv_ready_timeout_s` fails its transfer. At most
`WriterConfig.max_parts_in_flight` WRITEs of parts per transfer are in flight; what is computed meanwhile goes together
once one drains. New cells wait for more (the next part or the final) until the compute since the transfer's last
part pays for a part (`WriterConfig.part_compute_ratio`, `rendezvous.clients.nixl.granularity`). `source_ready` is the
final: what is left is posted at once, each WRITE with its parts' notification
(none is sent when nothing is left). Without `progressive` (or when nothing went ahead) the generation goes in one
write at `source_ready`; into a progressive target its notification names the whole target. With
`WriterConfig.integrity` each part's source blocks are hashed once it is posted, the cells that would complete the
target wait for the final, and the final's notification carries the digests of the whole target. A target this
rank writes only some of (other heads, block sizes or layers) gets scoped digests (`integrity.plan_digests`) of
its whole plan: each consumer region's hashed once every cell of it is posted (`integrity.ScopedDigests`), the
rest at the final; its last cell waits for the final.

Outcomes, per transfer (a generation's WRITEs, its parts included, count as one write):

- every assignment ends in exactly one `on_complete` (or `on_complete_parts`, also told the parts written, as
  rectangles of target tokens x layers, () for one write) or `on_revoked`, unless a newer generation of the
  same transfer replaces it before it started; a newer generation waits for the one being written (written in
  parts: for its final or its revocation), then writes all it needs itself;
- a bad assignment (block id out of range, regions or layouts that do not pair, unreadable metadata, a stale
  peer incarnation, fewer source than destination blocks) fails through `on_complete(ok=False)` without
  writing; so does a write that NIXL reports failed (the peer died), after it was posted;
- `on_complete(ok=True)` only once every WRITE of the generation is DONE; a whole write's notification goes with its
  WRITE, each part's with its own (so the consumer may hear before the writer sees DONE); if one fails or cannot be
  posted (a part too), no more are posted and `on_complete(ok=False)` comes once the others posted have drained
  (none of them lands later);
- with equal block sizes the LAST `len(dst)` source blocks go to the destination (the consumer may hold a
  prefix already); an empty destination completes at once once the source is ready;
- `revoke` and `abort` stop the posting of parts; `on_revoked` and the abort's `on_source_free` come once
  the WRITEs posted have drained, so no write of the generation lands after them;
- `on_source_free` tells the engine it may reuse the source blocks (handed over ready or in parts): after a
  successful write, on abort (once a write in flight has drained) or at stop. A revoked or failed generation
  keeps the source for a later generation until the transfer is aborted. With `keep_written` a successful write
  keeps it too, until `release` says the write's report was answered (or `abort` ends the transfer): a report
  lost with the incarnation it answers leaves the source for the new incarnation's assignment of the transfer;
- a transfer that succeeded (and was released) or was aborted has ended: a late `source_ready` is freed at once, a
  late `source_part` ignored, a late `revoke` acknowledged at once, a late `assign` ignored; until it is released,
  an assignment of the generation written, or an older one, is ignored as a repeat;
- `drop_assignments` (the engine registered a new incarnation) drops every assignment not started, unreported, and
  fails every generation still written in parts; an assignment that comes after it is taken as new, of the same
  generation as a dropped one or as one written and not released yet too (a generation belongs to the incarnation
  it was assigned to: the new one's is written again from the source kept);
- the write fence (`writable_until`, the engine session's: `EngineSession.writable_until`): before posting any
  WRITE (a whole write, a part, a batch of parts, a final) the writer asks it, and past it posts nothing and fails
  the generation (`on_complete(ok=False)` with a `WriteFencedError`'s message, once the WRITEs posted before have
  drained, and those landed before the lease could lapse): the engine's lease may be gone, the service may have
  told the consumer PEER_LOST, and the consumer may have reused its blocks. A re-registration closes the fence too,
  and a write asked meanwhile fails in the same way, not waits (`EngineSession.writable_until` says why). It asks
  it again at the start of each turn and before every poll (a poll progresses NIXL, which moves every WRITE in
  flight on): past it with WRITEs in flight (the process hung, or starved, after posting them) it drops them all
  without progressing NIXL, by dropping the endpoint's whole agent (`NixlEndpoint.abandon`: NIXL has no call that
  stops a WRITE in flight), and fails their generations with the fence's reason; the next assignment to each
  consumer loads its agent again. A hang that begins inside a poll is not covered: that NIXL call goes on
  progressing after the resume. Without a fence (None) the writer writes whenever it holds an assignment and its
  source.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvous.clients._memo import remember
from rendezvous.clients.nixl.agent import NixlEndpoint, PostedTransfer, XferStatus
from rendezvous.clients.nixl.device import COMPLETE, KvReady
from rendezvous.clients.nixl.errors import (
    BlockRangeError,
    DataPlaneError,
    LayoutMismatchError,
    PeerError,
    TransferFailedError,
    WriteFencedError,
)
from rendezvous.clients.nixl.granularity import PartCost
from rendezvous.clients.nixl.integrity import RunningDigests, ScopedDigests, block_digests, plan_digests
from rendezvous.clients.nixl.notifications import DigestScope, PartsEntry, encode_notification, encode_parts
from rendezvous.clients.nixl.parts import Columns, Computed, Grid, Rectangle, WrittenPart, rectangles
from rendezvous.clients.nixl.plan import RankGeometry, WritePlan, merge_descriptors, plan_write
from rendezvous.clients.nixl.polling import Backoff, PollConfig
from rendezvous.clients.nixl.regions import BlockIds, MemoryKind
from rendezvous.protocol import kvmap
from rendezvous.protocol.records import KvLayout
from rendezvous.protocol.records import NixlAgent as NixlAgentInfo

__all__ = [
    "ConsumerEngine",
    "OnComplete",
    "OnCompleteParts",
    "OnRevoked",
    "OnSourceFree",
    "OnWritten",
    "TransferWriter",
    "WriterConfig",
    "WrittenPart",
]

logger = logging.getLogger(__name__)

_NO_BLOCKS: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)

OnComplete = Callable[[str, int, bool, str | None], None]
"""on_complete(transfer_id, generation, ok, error): the WRITE of a generation finished or could not start."""
OnCompleteParts = Callable[[str, int, bool, str | None, tuple[WrittenPart, ...]], None]
"""on_complete_parts(transfer_id, generation, ok, error, parts): `OnComplete` with the rectangles a generation
written in parts covered (the final piece included); () when it went in one write."""
OnRevoked = Callable[[str, int], None]
"""on_revoked(transfer_id, generation): the generation will not be written (any write of it has drained)."""
OnSourceFree = Callable[[str], None]
"""on_source_free(transfer_id): the engine may free the transfer's source blocks."""
OnWritten = Callable[[float, bool], None]
"""on_written(seconds, ok): a generation's WRITEs drained `seconds` after the first was posted (written in parts:
after the final); ok if all landed."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriterConfig:
    """Tuning of a `TransferWriter`."""

    poll: PollConfig = dataclasses.field(default_factory=PollConfig)
    """Waits between polls while writes are in flight (idle, the thread blocks on its queue)."""
    drain_timeout_s: float = 10.0
    """How long `stop` lets writes in flight finish."""
    ended_transfers_kept: int = 65536
    """Ids of finished and aborted transfers remembered, so late commands for them are answered."""
    max_parts_in_flight: int = 8
    """WRITEs of parts (`source_part`) of one transfer in flight at most; newer parts wait and go together."""
    kv_ready_timeout_s: float = 60.0
    """How long a part or source may wait for its `KvReady` (the device computing it) before its transfer fails."""
    part_compute_ratio: float = 8.0
    """Adaptive granularity: a transfer's new cells are posted as a part only once the engine computed for at
    least this many times the fixed cost of a part since its last part (else they wait for the next part or the
    final, which is never held, and go together). The fixed cost is what grouping saves, fitted apart from the cost
    per byte over the parts posted (`rendezvous.clients.nixl.granularity`), so a part's own cost is at most 1/ratio
    of the compute it carries: in the serving simulation (~0.1-0.5 ms a part, 20 us a token of compute) 8 made
    ~6 parts of a 512-token prompt's 64 layers, ~25 of a 2k one's and ~60 of an 8k one's (benchmarks/RESULTS.md,
    "Adaptive granularity"). 0: every part at once."""
    integrity: bool = False
    """End-to-end integrity (`rendezvous.clients.nixl.integrity`): send the xxh3 digests of what each generation
    writes, per region, for the consumer to check before arrival (written in parts: hashed as the parts go, sent
    with the final, which always carries the cells that complete the target). DRAM regions only."""


@dataclasses.dataclass(frozen=True, slots=True)
class ConsumerEngine:
    """The consumer engine of an assignment: its layout and its agents, one per rank (`EngineInfo` fits)."""

    layout: KvLayout
    agents: tuple[NixlAgentInfo, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """One consumer rank this producer rank writes into, and what it writes there."""

    agent: NixlAgentInfo
    share: kvmap.RankShare
    geometry: RankGeometry
    whole_blocks: bool
    """Every region, every head, equal block sizes: posted from prepared lists by block index, which NIXL
    merges itself (faster than building the lists; see benchmarks/bench_nixl.py)."""
    writers: int = 1
    """Producer ranks that write into this consumer rank (`kvmap.writers_into`), told in the notification."""
    layers: range | None = None
    """The model layers of the share (None: the rank's columns are not layers), told with parts."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Assign:
    transfer_id: str
    generation: int
    peer: NixlAgentInfo | ConsumerEngine
    incarnation: int
    dst: npt.NDArray[Any]  # checked against the peer's regions on the writer thread
    prompt_tokens: int = 0
    target_tokens: int = 0
    targets: tuple[_Target, ...] = ()  # resolved on the writer thread
    kv_layout: str = ""
    producer: RankGeometry | None = None
    progressive: bool = False

    def names(self) -> set[str]:
        return {t.agent.name for t in self.targets}


@dataclasses.dataclass(frozen=True, slots=True)
class _SourceReady:
    transfer_id: str
    src: npt.NDArray[np.int64]
    kv_ready: KvReady = COMPLETE


@dataclasses.dataclass(frozen=True, slots=True)
class _SourcePart:
    transfer_id: str
    src: npt.NDArray[np.int64]
    num_tokens: int
    layers: tuple[int, int] | None
    prompt_tokens: int
    kv_ready: KvReady = COMPLETE
    at: float = 0.0  # time.monotonic() when the engine handed it over


@dataclasses.dataclass(frozen=True, slots=True)
class _Revoke:
    transfer_id: str
    generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Abort:
    transfer_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class _Release:
    transfer_id: str
    generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class _ForgetPeer:
    name: str
    incarnation: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Barrier:
    done: threading.Event


@dataclasses.dataclass(frozen=True, slots=True)
class _Replaced:
    reason: str
    done: threading.Event


@dataclasses.dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = (
    _Assign | _SourceReady | _SourcePart | _Revoke | _Abort | _Release | _ForgetPeer | _Barrier | _Replaced | _Stop
)


@dataclasses.dataclass(frozen=True, slots=True)
class _Waiting:
    """A source or part handed over before the device computed it: handled once its `kv_ready` is done."""

    command: _SourceReady | _SourcePart
    since: float  # time.monotonic() when it arrived


@dataclasses.dataclass(frozen=True, slots=True)
class _Cells:
    """A whole-block target's descriptors in the prepared lists, here and at the peer, per (region, target
    block): made once per source list of the write, then each part is a slice of them (no lists built)."""

    src: npt.NDArray[np.int64]
    """The source blocks they were made from (`Computed.src`, replaced only when it grows)."""
    local: npt.NDArray[np.int32]
    """regions x the target blocks whose source block is known."""
    remote: npt.NDArray[np.int32]
    """regions x target blocks."""


@dataclasses.dataclass(eq=False)
class _Progress:
    """A generation written in parts: the cells posted so far, per column a prefix of the target's blocks."""

    posted: npt.NDArray[np.int64]
    grid: Grid | None = None  # once the prompt's length is known
    written: list[WrittenPart] = dataclasses.field(default_factory=list)
    part_at: float = 0.0  # when the engine handed over the part last posted (`_SourcePart.at`)
    cells: dict[str, _Cells] = dataclasses.field(default_factory=dict)  # per whole-block target agent
    digests: RunningDigests | None = None  # integrity: of the source blocks posted, per region
    hashed: npt.NDArray[np.int64] | None = None  # integrity: per column, the prefix of the target's blocks hashed
    scoped: dict[str, ScopedDigests] = dataclasses.field(default_factory=dict)
    """Integrity: per target agent with scoped digests, those made so far (`_hash_scoped`, `_scope_final`)."""
    scope_columns: npt.NDArray[np.bool_] | None = None  # integrity: the columns whose regions were hashed scoped


@dataclasses.dataclass(eq=False)
class _Write:
    """A generation being written: its WRITEs in flight (one per consumer rank, and per part); `error` is set
    once one failed or could not be posted, `complete` once everything is posted."""

    assignment: _Assign
    posts: list[PostedTransfer] = dataclasses.field(default_factory=list)
    part_posts: set[PostedTransfer] = dataclasses.field(default_factory=set)  # of `posts`: parts (the cap)
    deferred: int = 0  # parts waiting to be posted with this turn's others (`_flush_parts`)
    held_back: bool = False  # parts computed wait for parts in flight to drain (`max_parts_in_flight`)
    posted_at: float = 0.0  # time.monotonic() before the first post; 0.0 = none yet
    progress: _Progress | None = None  # written in parts
    complete: bool = False
    error: str | None = None
    revoked: bool = False
    aborted: bool = False

    @property
    def generation(self) -> int:
        return self.assignment.generation

    @property
    def peers(self) -> set[str]:
        return {p.peer for p in self.posts}

    @property
    def stopped(self) -> bool:
        """Nothing more is posted: everything was, or the generation failed, was revoked or aborted."""
        return self.complete or self.error is not None or self.revoked or self.aborted


@dataclasses.dataclass(frozen=True, slots=True)
class _Piece:
    """What one WRITE moves into one target: descriptors of the prepared lists by index (whole blocks), or a
    plan's lists."""

    target: _Target
    plan: WritePlan | None
    indices: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None = None
    """Without a plan: the prepared descriptors, here and at the target (`NixlEndpoint.post_indices`)."""
    covers: tuple[WrittenPart, ...] = ()
    """Written in parts: the rectangles of the target this WRITE carries, in its layers (`_Target.layers`)."""
    digests: tuple[int, ...] = ()
    """Integrity: per region, the digest of the target's source blocks, sent with its whole write or its final
    (`rendezvous.clients.nixl.integrity`)."""
    scope: DigestScope | None = None
    """Integrity: what `digests` cover, when this rank writes only some of the target's bytes."""


@dataclasses.dataclass(eq=False)
class _Held:
    """One transfer's parts for one peer in a turn's WRITE (`_flush_parts`)."""

    write: _Write
    target: _Target
    local: list[npt.NDArray[np.int32]] = dataclasses.field(default_factory=list)
    remote: list[npt.NDArray[np.int32]] = dataclasses.field(default_factory=list)
    covers: list[WrittenPart] = dataclasses.field(default_factory=list)


def _entry(transfer_id: str, generation: int, piece: _Piece) -> PartsEntry:
    target = piece.target
    return PartsEntry(transfer_id, generation, target.writers, target.layers, piece.covers, piece.digests, piece.scope)


def _told(a: _Assign, t: _Transfer) -> _Assign:
    """`a` with the prompt's length the engine told with the parts, when the assignment did not say it."""
    if not a.prompt_tokens and t.computed is not None:
        return dataclasses.replace(a, prompt_tokens=t.computed.prompt_tokens)
    return a


def _scope(a: _Assign, target: _Target) -> DigestScope:
    """Integrity: what the scoped digests of the whole generation written into `target` cover."""
    assert a.producer is not None
    share, bd = target.share, target.geometry.block_size
    tokens = len(a.dst) * bd if a.producer.block_size == bd else a.target_tokens
    return DigestScope(share.consumer_regions, share.consumer_head, share.num_heads, tokens)


def _same_bytes(target: _Target) -> bool:
    """Whether the consumer rank's regions receive exactly this rank's blocks, region by region (whole blocks,
    the only writer): then both sides' digests are of the same bytes."""
    return target.whole_blocks and target.writers == 1


@dataclasses.dataclass(eq=False)
class _Transfer:
    assignment: _Assign | None = None
    source: npt.NDArray[np.int64] | None = None
    computed: Computed | None = None  # what parts reported computed
    part_at: float = 0.0  # when the engine handed over the latest part
    write: _Write | None = None
    fence: int = -1  # highest revoked generation: never write it or an older one
    written: int = 0  # `keep_written`: the generation written, until released or dropped (0: none)
    failed: str = ""  # the device failed computing its KV while a write drained: ends it once drained

    @property
    def idle(self) -> bool:
        return self.assignment is None and not self.held and self.write is None

    @property
    def held(self) -> bool:
        """Whether the engine handed over source blocks (ready, or in parts) that it gets back."""
        return self.source is not None or self.computed is not None


class TransferWriter:
    """The background writer thread of one producer rank. Commands may be queued before `start`."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        *,
        on_complete: OnComplete | None = None,
        on_complete_parts: OnCompleteParts | None = None,
        on_revoked: OnRevoked,
        on_source_free: OnSourceFree,
        on_written: OnWritten | None = None,
        config: WriterConfig | None = None,
        layout: KvLayout | None = None,
        rank: int = 0,
        first_layer: int = 0,
        num_layers: int = 0,
        part_cost: PartCost | None = None,
        clock: Callable[[], float] = time.monotonic,
        writable_until: Callable[[], float] | None = None,
        fence_reason: Callable[[], str | None] | None = None,
        keep_written: bool = False,
    ) -> None:
        """`layout`, `rank` and the layers (with pipeline parallelism) place this rank in its engine; they
        are needed for assignments to a `ConsumerEngine` and for writes in parts. Exactly one of `on_complete`
        and `on_complete_parts` (which is also told the parts written) reports each generation's outcome.
        `part_cost` (fitted as parts are posted) and `clock` (when `source_part` is called) time the compute and
        the parts for `WriterConfig.part_compute_ratio`; tests inject them. `writable_until()` is the write fence, on
        `time.monotonic()`'s clock (asyncio's `loop.time()`), asked from the writer thread before every post: past it
        nothing is posted and the generation fails (the producer's `EngineSession.writable_until`; None: no fence,
        for a writer used without a session). `fence_reason()`, asked once the fence passed, says why it closed when
        the lease did not simply lapse (a re-registration closes it), None else. `keep_written`: a successful write
        keeps its source until `release` (or `abort`), so that the same generation assigned to the engine's next
        incarnation, once its report was lost with the one it answers, can be written again."""
        if (on_complete is None) == (on_complete_parts is None):
            raise TypeError("pass one of on_complete and on_complete_parts")
        self._endpoint = endpoint
        self._layout = layout
        self._rank = rank
        self._layers = (first_layer, num_layers)
        self._on_complete = on_complete
        self._on_complete_parts = on_complete_parts
        self._on_revoked = on_revoked
        self._on_source_free = on_source_free
        self._on_written = on_written
        self._config = config or WriterConfig()
        if self._config.integrity and endpoint.memory_kind is not MemoryKind.DRAM:
            raise ValueError("integrity checksums read host memory: DRAM regions only")
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"nixl-writer-{endpoint.name}", daemon=True)
        # Owned by the writer thread:
        self._transfers: dict[str, _Transfer] = {}
        self._in_flight: dict[str, _Write] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()
        """Transfers that succeeded or were aborted (""), or failed before any assignment came (why)."""
        self._fences: OrderedDict[str, int] = OrderedDict()
        """Revoked generations of transfers not held here (revoked before their assignment came, or dropped idle
        since): an assignment of one of them or older is stale."""
        self._forget: set[str] = set()
        self._reconnect: set[str] = set()  # peers that assignments wait for (`_connect`) until writes to them drain
        self._columns = Columns.of(layout, self.agent_info())
        self._parts_in_flight = 0
        self._waiting: list[_Waiting] = []  # in arrival order
        self._parts_due: dict[str, None] = {}  # transfers given parts this turn: placed once, at the turn's end
        self._batch: list[tuple[str, _Write, _Piece]] = []  # this turn's parts by index, posted together per peer
        self._holders: dict[PostedTransfer, int] = {}  # a WRITE posted for several transfers: how many hold it
        self._part_cost = part_cost or PartCost()
        self._clock = clock
        self._writable_until = writable_until
        self._fence_reason = fence_reason
        self._keep_written = keep_written
        regions = endpoint.table.regions  # a prepared descriptor's region, and so its bytes, by its index
        self._region_starts = np.cumsum([0, *(r.num_blocks for r in regions)])[:-1]
        self._region_bytes = np.array([r.block_length_bytes for r in regions], dtype=np.int64)
        self._turn = [0.0, 0, 0]  # this turn's CPU seconds placing and posting parts, the parts and their bytes

    def agent_info(self, rank: int | None = None) -> NixlAgentInfo:
        """The endpoint's identity for engine registration (safe from any thread; its metadata changes when the writer
        drops its agent past the write fence, and consumers load it only for pull-mode READs, which another agent
        serves)."""
        info = self._endpoint.agent_info(self._rank if rank is None else rank)
        return dataclasses.replace(info, first_layer=self._layers[0], num_layers=self._layers[1])

    @property
    def parts_in_flight(self) -> int:
        """WRITEs of parts posted and not yet done, all transfers together (kept by the writer thread; exact
        after a `barrier` while no WRITE can complete)."""
        return self._parts_in_flight

    @property
    def writes_in_flight(self) -> int:
        """Transfers with WRITEs posted and not yet drained (kept by the writer thread, read as a snapshot): a WRITE
        to a peer that stopped (hung, not dead) stays here until the peer runs again, its connection fails or the write
        fence passes (`writable_until`)."""
        return len(self._in_flight)

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called (commands are then refused)."""
        return self._stopped

    def start(self) -> None:
        """Start the writer thread."""
        if self._stopped:
            raise RuntimeError(f"writer {self._endpoint.name!r} is stopped")
        self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop after the commands queued so far: fail assignments not started, let writes in flight drain,
        free held sources, close the endpoint, and join. False if the thread still runs after `timeout`."""
        if not self._stopped:
            self._stopped = True
            self._commands.put(_Stop())
            if self._thread.ident is None:  # never started: handle the queued commands here, then shut down
                self._run()
        if self._thread.ident is None:
            return True
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> TransferWriter:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def assign(
        self,
        transfer_id: str,
        generation: int,
        peer: NixlAgentInfo | ConsumerEngine,
        incarnation: int,
        dst_block_ids: BlockIds,
        *,
        prompt_tokens: int = 0,
        target_tokens: int = 0,
        progressive: bool = False,
    ) -> None:
        """Write generation `generation` of a transfer into `dst_block_ids` of `peer` (incarnation
        `incarnation`) once its source is ready: whole blocks into one agent, or this rank's share of every
        rank of a consumer engine. Different block sizes need the prompt's and the destination's token counts
        (`kvmap.token_runs`). A newer generation replaces an older one not yet started. `progressive`: the
        consumer accepts parts (`source_part`), posted as soon as they are computed; without it parts are
        only remembered and the whole generation goes in one write once the source is ready."""
        dst = np.array(dst_block_ids)
        assign = _Assign(transfer_id, generation, peer, incarnation, dst, prompt_tokens, target_tokens)
        self._put(dataclasses.replace(assign, progressive=progressive))

    def source_ready(self, transfer_id: str, src_block_ids: BlockIds, *, kv_ready: KvReady = COMPLETE) -> None:
        """The transfer's KV is computed in `src_block_ids`, or will be once `kv_ready` is done (nothing of it is
        written before: `rendezvous.clients.nixl.device`). Raises `BlockRangeError` for ids outside the endpoint's
        regions (checked here, in the caller's thread)."""
        src = self._endpoint.table.check_block_ids(src_block_ids).copy()
        self._put(_SourceReady(transfer_id, src, kv_ready))

    def source_part(
        self,
        transfer_id: str,
        src_block_ids: BlockIds,
        num_computed_tokens: int,
        layers: tuple[int, int] | None = None,
        *,
        prompt_tokens: int = 0,
        kv_ready: KvReady = COMPLETE,
    ) -> None:
        """The prompt's first `num_computed_tokens` tokens are computed in model layers `[first, end)` (None =
        all), in `src_block_ids` (the prompt's blocks so far, in order), or will be once `kv_ready` is done:
        layer-wise prefill calls this once per layer, chunked prefill once per chunk. Target blocks all of whose
        tokens are computed are written ahead of `source_ready` (see the module docstring); that needs the
        prompt's length, `prompt_tokens` here or in the assignment, and the writer's `layout`. Raises
        `BlockRangeError` for ids outside the regions or too few of them for the tokens, ValueError for
        negative tokens or empty layers."""
        src = self._endpoint.table.check_block_ids(src_block_ids).copy()
        if num_computed_tokens < 0 or prompt_tokens < 0:
            raise ValueError(f"token counts must not be negative: {num_computed_tokens}, {prompt_tokens}")
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise ValueError(f"layers [{layers[0]}, {layers[1]}) are empty")
        block_size = self._layout.block_size if self._layout is not None else 0
        if len(src) * block_size < num_computed_tokens and block_size:
            raise BlockRangeError(f"{num_computed_tokens} tokens do not fit {len(src)} blocks of {block_size}")
        part = _SourcePart(transfer_id, src, num_computed_tokens, layers, prompt_tokens, kv_ready, self._clock())
        self._put(part)

    def revoke(self, transfer_id: str, generation: int) -> None:
        """Do not write `generation` (or older); `on_revoked` acknowledges once no write of it can land."""
        self._put(_Revoke(transfer_id, generation))

    def abort(self, transfer_id: str) -> None:
        """The transfer ended without success: drop it and free its source once no write is in flight."""
        self._put(_Abort(transfer_id))

    def release(self, transfer_id: str, generation: int) -> None:
        """With `keep_written`: the report of `generation`'s successful write was answered, so the transfer ends and
        its source is freed; unless the writer took a newer generation since, or `drop_assignments` came since (the
        generation was a replaced incarnation's: the source is kept for the new one's assignment, whose end frees
        it)."""
        self._put(_Release(transfer_id, generation))

    def forget_peer(self, agent_name: str, incarnation: int | None = None) -> None:
        """The peer (up to `incarnation`, or any) is gone: fail its assignments not started and drop its
        metadata once its writes drain. Assignments to a newer incarnation are kept."""
        self._put(_ForgetPeer(agent_name, incarnation))

    def barrier(self, timeout: float | None = None) -> bool:
        """Wait until every command queued before this call was handled (and its immediate callbacks ran)."""
        done = threading.Event()
        self._put(_Barrier(done))
        return done.wait(timeout)

    def drop_assignments(self, reason: str, timeout: float | None = None) -> bool:
        """The engine registered a new incarnation: every assignment held was made for the one it replaced, whose
        lease is gone and whose assignments the service no longer fences. Drop every assignment not started, without
        reporting it (the service assigns the transfer again, to the new incarnation, if it matches it again, and
        ends it otherwise); fail every generation still written in parts with `reason` (`on_complete(ok=False)` once
        its WRITEs posted drained). Sources and revocations are kept: a later assignment of any generation not
        revoked is taken as new, the same generation as a dropped one included. Waits like `barrier`: a source
        handed over before is handled first (and fails against the write fence, which a re-registration closes).
        False if not done after `timeout`."""
        done = threading.Event()
        self._put(_Replaced(reason, done))
        return done.wait(timeout)

    def _put(self, command: _Command) -> None:
        if self._stopped:
            raise RuntimeError(f"writer {self._endpoint.name!r} is stopped")
        self._commands.put(command)

    # Everything below runs on the writer thread.

    def _run(self) -> None:
        backoff = Backoff(self._config.poll)
        while True:
            command = self._next_command(backoff.wait if self._in_flight or self._waiting else None)
            progressed = self._drop_fenced()  # before anything progresses NIXL
            while command is not None:
                if isinstance(command, _Stop):
                    self._shutdown()
                    return
                self._handle(command)
                progressed = True
                command = self._next_command(0.0)
            try:  # an error here must not end the thread: every transfer would wait for it
                progressed = self._handle_computed() or progressed
                self._place_due()
                self._flush_parts()
                progressed = self._poll_writes() or progressed
                self._flush_parts()  # parts that waited for one that drained
            except Exception:
                logger.exception("writer %s: failed to finish a write", self._endpoint.name)
            if progressed:
                backoff.reset()
            else:
                backoff.next()

    def _next_command(self, wait: float | None) -> _Command | None:
        try:
            if wait == 0.0:
                return self._commands.get_nowait()
            return self._commands.get(timeout=wait)
        except queue.Empty:
            return None

    def _handle(self, command: _Command) -> None:
        try:
            match command:
                case _Assign():
                    self._assign(command)
                case _SourcePart() if command.kv_ready is COMPLETE and not self._waiting:
                    self._source_part(command)  # computed, and nothing is waiting before it
                case _SourceReady() | _SourcePart():
                    self._waiting.append(_Waiting(command, time.monotonic()))
                    self._handle_computed(command.transfer_id)
                case _Revoke():
                    self._revoke(command.transfer_id, command.generation)
                case _Abort():
                    self._abort(command.transfer_id)
                case _Release():
                    self._release(command.transfer_id, command.generation)
                case _ForgetPeer():
                    self._forget_peer(command.name, command.incarnation)
                case _Barrier():
                    self._place_due()
                    self._flush_parts()
                    command.done.set()
                case _Replaced():
                    self._drop_assignments(command.reason)
                    command.done.set()
        except Exception:
            logger.exception("writer %s: failed to handle %r", self._endpoint.name, command)

    def _handle_computed(self, transfer_id: str | None = None) -> bool:
        """Handle the sources and parts waiting (of `transfer_id`, or all) whose KV the device computed, each
        transfer's in order; fail the transfer of one whose device failed or took too long. True if any was."""
        handled, blocked = False, set()
        for entry in list(self._waiting):
            command = entry.command
            tid = command.transfer_id
            if tid in blocked or (transfer_id is not None and tid != transfer_id):
                continue
            try:
                error = None if command.kv_ready.done() else ""
            except Exception as e:  # a device error: its text is the reason
                error = f"the device failed computing the KV: {e}"
            if error == "" and time.monotonic() - entry.since > self._config.kv_ready_timeout_s:
                error = f"the device did not compute the KV within {self._config.kv_ready_timeout_s:g} s"
            handled = handled or error != ""
            if error is not None:
                blocked.add(tid)
                if error:
                    self._kv_failed(tid, error)
                continue
            self._waiting.remove(entry)
            if isinstance(command, _SourceReady):
                self._source_ready(command)
            else:
                self._source_part(command)
        return handled

    def _kv_failed(self, transfer_id: str, error: str) -> None:
        """The transfer's KV will not be computed: fail its write (or assignment), nothing of what waits is
        written, and the source handed over is freed once no WRITE of it is in flight."""
        logger.error("writer %s: transfer %s: %s", self._endpoint.name, transfer_id, error)
        dropped = [x.command for x in self._waiting if x.command.transfer_id == transfer_id]
        self._waiting = [x for x in self._waiting if x.command.transfer_id != transfer_id]
        if transfer_id in self._ended:
            self._free_ended(transfer_id)
            return
        t = self._transfers.setdefault(transfer_id, _Transfer())
        for command in dropped:  # held now, so freed with the transfer
            if isinstance(command, _SourceReady):
                t.source = command.src
            elif t.computed is None:
                t.computed = Computed.empty(self._columns)
        w, a = t.write, t.assignment
        told = True
        if w is not None and not w.stopped:
            w.error = error  # on_complete(ok=False) once its WRITEs posted drained
            self._settle(transfer_id, t)
        elif a is not None:
            t.assignment = None
            self._complete(transfer_id, a.generation, False, error)
        else:
            told = False  # no assignment yet: the one that comes is failed with it (`_assign`)
        if t.write is None:
            self._end(transfer_id, t, "" if told else error)
        else:  # a write drains (revoked, or failing): no generation may write this KV after it (`_finish_write`)
            t.failed = error

    def _assign(self, a: _Assign) -> None:
        if a.transfer_id in self._ended:
            why = self._ended[a.transfer_id]
            if why:  # it failed before its assignment came: the assignment fails with it
                self._complete(a.transfer_id, a.generation, False, why)
            else:
                logger.debug("assignment of ended transfer %s ignored", a.transfer_id)
            return
        t = self._transfers.setdefault(a.transfer_id, _Transfer())
        t.fence = max(t.fence, self._fences.pop(a.transfer_id, 0))
        newest = max([t.fence, t.written, *(x.generation for x in (t.assignment, t.write) if x is not None)])
        if a.generation <= newest:
            logger.debug("stale or repeated assignment %s:%d ignored", a.transfer_id, a.generation)
            return
        try:
            resolved = self._resolve(a)
        except Exception as e:  # ValueError: BlockRangeError, LayoutMismatchError, ShapeError, BlockPairingError
            if not isinstance(e, ValueError):  # a bug here or bytes no check foresaw: failed all the same, not lost
                logger.exception("writer %s: assignment %s:%d", self._endpoint.name, a.transfer_id, a.generation)
            why = str(e) if isinstance(e, ValueError) else f"the assignment could not be planned: {e!r}"
            self._complete(a.transfer_id, a.generation, False, why)
            self._drop_if_idle(a.transfer_id, t)
            return
        t.assignment = resolved
        self._try_write(a.transfer_id, t)

    def _resolve(self, a: _Assign) -> _Assign:
        """The assignment with its targets, checked by planning it with placeholder source blocks."""
        if a.dst.size and (a.dst.ndim != 1 or a.dst.dtype.kind not in "iu"):
            raise BlockRangeError(f"block ids must be a flat list of integers, got {a.dst.dtype} shape {a.dst.shape}")
        dst = a.dst.astype(np.int64) if a.dst.size else np.zeros(0, dtype=np.int64)
        regions = self._endpoint.regions
        if isinstance(a.peer, NixlAgentInfo):  # whole blocks, region by region
            if len(a.peer.regions) != len(regions):
                raise LayoutMismatchError(f"{len(regions)} regions here, {len(a.peer.regions)} at the peer")
            whole = range(len(regions))
            share = kvmap.RankShare(self._rank, a.peer.rank, whole, whole, 0, 0, 1)
            geometry = RankGeometry(a.peer.regions, 1, 1)
            targets: tuple[_Target, ...] = (
                _Target(a.peer, share, geometry, True, layers=self._columns.layers_of(whole)),
            )
            producer, kv_layout = RankGeometry(regions, 1, 1), ""
        else:
            if self._layout is None:
                raise LayoutMismatchError("assignments to a consumer engine need the writer's layout")
            mine, theirs = self._layout, a.peer.layout
            me = kvmap.rank_shape(mine, self.agent_info())
            consumers = kvmap.rank_shapes(theirs, a.peer.agents)
            agents = {agent.rank: agent for agent in a.peer.agents}
            bd = a.peer.layout.block_size
            bp = self._layout.block_size

            def target(s: kvmap.RankShare) -> _Target:
                agent, c = agents[s.consumer_rank], consumers[s.consumer_rank]
                whole = (
                    s.num_heads == me.num_heads == c.num_heads
                    and bp == bd
                    and s.producer_regions == range(len(regions))
                    and s.consumer_regions == range(len(agent.regions))
                )
                writers = kvmap.writers_into(mine, theirs, c)
                geometry = RankGeometry(agent.regions, c.num_heads, bd, kvmap.element_bytes(theirs.dtype))
                layers = self._columns.layers_of(s.producer_regions)
                return _Target(agent, s, geometry, whole, writers, layers)

            targets = tuple(target(s) for s in kvmap.shares((me,), consumers))
            if not targets:
                raise LayoutMismatchError(f"no consumer rank holds the layers and heads of rank {self._rank}")
            producer = RankGeometry(regions, me.num_heads, mine.block_size, kvmap.element_bytes(mine.dtype))
            kv_layout = mine.kv_layout
        resolved = dataclasses.replace(a, dst=dst, targets=targets, kv_layout=kv_layout, producer=producer)
        bp, bd = producer.block_size, targets[0].geometry.block_size
        if len(dst) and (bp == bd or a.prompt_tokens or not a.progressive):  # else the parts tell the prompt's length
            num_src = len(dst) if bp == bd else -(-a.prompt_tokens // max(bp, 1))
            self._plans(resolved, np.zeros(max(num_src, 0), dtype=np.int64), check=True)
        return resolved

    def _plans(
        self, a: _Assign, src: npt.NDArray[np.int64], *, check: bool = False
    ) -> list[tuple[_Target, WritePlan | None]]:
        """Each target with its write plan for source blocks `src` (None: whole blocks by index, planned only
        to `check` the assignment); raises ValueError when they do not fit."""
        assert a.producer is not None
        runs = self._runs(a, src)
        if runs is None and len(src) < len(a.dst):
            raise BlockRangeError(f"{len(a.dst)} destination blocks but only {len(src)} source blocks")
        plans: list[tuple[_Target, WritePlan | None]] = []
        for t in a.targets:
            planned = not t.whole_blocks or check
            plans.append(
                (t, plan_write(a.producer, t.geometry, t.share, src, a.dst, a.kv_layout, runs) if planned else None)
            )
        return plans

    @staticmethod
    def _runs(a: _Assign, src: npt.NDArray[np.int64]) -> tuple[kvmap.TokenRun, ...] | None:
        """How `a`'s tokens pair source blocks `src` with its destination blocks (None: equal block sizes, whole
        blocks in order); raises ValueError when they do not fit."""
        assert a.producer is not None
        bp, bd = a.producer.block_size, a.targets[0].geometry.block_size if a.targets else 0
        if bp == bd:
            return None
        return kvmap.token_runs(len(src), len(a.dst), bp, bd, a.prompt_tokens, a.target_tokens)

    def _source_ready(self, s: _SourceReady) -> None:
        if s.transfer_id in self._ended:
            self._free_ended(s.transfer_id)
            return
        t = self._transfers.setdefault(s.transfer_id, _Transfer())
        if s.transfer_id in self._parts_due:  # its parts of this turn go ahead of the final, as handed over
            del self._parts_due[s.transfer_id]
            if t.write is not None:
                self._post_parts(s.transfer_id, t, t.write)
        t.source = s.src
        w = t.write
        if w is None:
            self._try_write(s.transfer_id, t)
        elif w.progress is not None and not w.stopped:
            self._post_final(s.transfer_id, t, w)

    def _source_part(self, p: _SourcePart) -> None:
        if p.transfer_id in self._ended:
            self._free_ended(p.transfer_id)
            return
        t = self._transfers.setdefault(p.transfer_id, _Transfer())
        columns = self._columns.select(p.layers)
        again = t.computed is not None and t.source is None and t.computed.restarted(p.src, p.num_tokens, columns)
        if again and self._restarted(p.transfer_id, t):
            return
        if t.computed is None:
            t.computed = Computed.empty(self._columns)
        t.computed.add(p.src, p.num_tokens, columns, p.prompt_tokens)
        t.part_at = max(t.part_at, p.at)
        if t.source is not None:
            return  # the final write covers it
        if t.write is None:
            self._try_write(p.transfer_id, t)
        else:  # placed at the end of the turn, with the transfer's other parts of it (`_place_due`)
            self._parts_due[p.transfer_id] = None

    def _restarted(self, transfer_id: str, t: _Transfer) -> bool:
        """The engine computes the prompt again in other blocks (preempted, resumed from its first token): what it
        reported before is void. A write that posted parts of it fails, since they may read blocks the engine has
        reused since; else the reports start over. True when the write failed."""
        w = t.write
        if w is not None and w.progress is not None and bool(w.progress.posted.any()):
            if not w.stopped:
                w.error = "the prefill restarted in other blocks (preempted) after parts of it were posted"
                self._settle(transfer_id, t)
            return True
        t.computed = None
        return False

    def _place_due(self) -> None:
        """Post the parts handed over this turn: each transfer's new cells once, however many parts told them."""
        due, self._parts_due = self._parts_due, {}
        for transfer_id in due:
            t = self._transfers.get(transfer_id)
            if t is not None and t.write is not None and t.source is None:
                self._post_parts(transfer_id, t, t.write)

    def _revoke(self, transfer_id: str, generation: int) -> None:
        t = self._transfers.get(transfer_id)
        if t is None:  # nothing of it to stop, but an assignment of it that comes later must not be written
            self._remember_fence(transfer_id, generation)
            self._emit(self._on_revoked, transfer_id, generation)
            return
        t.fence = max(t.fence, generation)
        if t.assignment is not None and t.assignment.generation <= generation:
            t.assignment = None
        if t.write is not None and t.write.generation == generation:
            t.write.revoked = True  # acknowledged once its WRITEs drained
            if self._settle(transfer_id, t):
                return
        else:
            self._emit(self._on_revoked, transfer_id, generation)
        self._drop_if_idle(transfer_id, t)

    def _abort(self, transfer_id: str) -> None:
        self._remember_ended(transfer_id)
        t = self._transfers.get(transfer_id)
        if t is None:
            return
        t.assignment = None
        if t.write is not None:
            t.write.aborted = True  # the source is freed once its WRITEs drained
            self._settle(transfer_id, t)
        else:
            self._end(transfer_id, t)

    def _release(self, transfer_id: str, generation: int) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None and t.written == generation and t.assignment is None and t.write is None:
            self._end(transfer_id, t)

    def _drop_assignments(self, reason: str) -> None:
        for transfer_id, t in list(self._transfers.items()):
            t.assignment = None  # unreported: the service re-matches the transfer for the new incarnation, or ends it
            t.written = 0  # its report is the replaced incarnation's: the new one's assignment of it is written again
            w = t.write
            if w is not None and not w.stopped:  # written in parts: stop, fail once drained
                w.error = reason
                self._settle(transfer_id, t)
            self._drop_if_idle(transfer_id, t)

    def _forget_peer(self, name: str, incarnation: int | None) -> None:
        def lost(inc: int) -> bool:
            return incarnation is None or inc <= incarnation

        for transfer_id, t in list(self._transfers.items()):
            a = t.assignment
            if a is not None and name in a.names() and lost(a.incarnation):
                t.assignment = None
                self._complete(transfer_id, a.generation, False, f"peer agent {name!r} is gone")
                self._drop_if_idle(transfer_id, t)
            w = t.write
            if w is not None and not w.stopped and name in w.assignment.names() and lost(w.assignment.incarnation):
                w.error = f"peer agent {name!r} is gone"  # written in parts: stop, fail once drained
                self._settle(transfer_id, t)
        cached = self._endpoint.peer_incarnation(name)
        if cached is None or not lost(cached):
            return
        if self._writing_to(name):
            self._forget.add(name)
        else:
            self._endpoint.remove_peer(name)

    def _connect(self, a: _Assign) -> bool:
        """Make the assignment's peer incarnation current on every target agent; False while writes to one of
        them must drain first."""
        connected = True
        for target in a.targets:
            name = target.agent.name
            current = self._endpoint.peer_incarnation(name) == a.incarnation and name not in self._forget
            if current and (not target.whole_blocks or self._endpoint.has_blocks(name)):
                continue
            if self._writing_to(name):
                connected = False
                self._reconnect.add(name)
                continue
            if name in self._forget or current:  # forgotten, or loaded without the blocks prepared
                self._forget.discard(name)
                self._endpoint.remove_peer(name)
            self._endpoint.add_peer(target.agent, a.incarnation, whole_blocks=target.whole_blocks)
        return connected

    def _in_parts(self, a: _Assign) -> bool:
        """Whether the assignment may be written in parts (the consumer accepts them, block sizes known)."""
        return a.progressive and self._layout is not None and len(a.dst) > 0

    def _try_write(self, transfer_id: str, t: _Transfer) -> None:
        a = t.assignment
        if a is None or t.write is not None:
            return
        try:
            connected = self._connect(a)  # early, even before the source is ready: off the critical path
        except DataPlaneError as e:
            t.assignment = None
            self._complete(transfer_id, a.generation, False, str(e))
            self._drop_if_idle(transfer_id, t)
            return
        if not connected or (t.source is None and not self._in_parts(a)):
            return
        t.assignment = None
        if len(a.dst) == 0:
            self._complete(transfer_id, a.generation, True, None)
            t.written = a.generation
            if not self._keep_written:
                self._end(transfer_id, t)
            return
        w = t.write = _Write(a)
        if t.source is not None:
            self._post_whole(transfer_id, t, w)
        else:
            w.progress = _Progress(np.zeros(self._columns.count, dtype=np.int64))
            if self._config.integrity and any(_same_bytes(target) for target in a.targets):
                w.progress.digests = RunningDigests(self._endpoint.regions)
                w.progress.hashed = np.zeros(self._columns.count, dtype=np.int64)
            if self._config.integrity and not all(_same_bytes(target) for target in a.targets):
                assert a.producer is not None
                w.progress.scoped = {
                    x.agent.name: ScopedDigests(a.producer, x.geometry, x.share, a.kv_layout)
                    for x in a.targets
                    if not _same_bytes(x)
                }
                w.progress.scope_columns = np.zeros(self._columns.count, dtype=np.bool_)
            self._prepare_parts(transfer_id, t, w)
            self._post_parts(transfer_id, t, w)

    def _post_whole(self, transfer_id: str, t: _Transfer, w: _Write) -> None:
        """Post the generation in one WRITE per target, each with the notification."""
        a, w.complete = _told(w.assignment, t), True
        assert t.source is not None
        try:
            plans = self._plans(a, t.source)
            source = t.source[len(t.source) - len(a.dst) :]
            indices = [None if plan else self._endpoint.indices(x.agent.name, source, a.dst) for x, plan in plans]
        except (ValueError, DataPlaneError) as e:  # too few source blocks, ids outside the regions, the peer gone
            w.error = str(e)
            self._settle(transfer_id, t)
            return
        whole = (WrittenPart(0, a.target_tokens),) if a.progressive and a.target_tokens else ()
        try:
            digests = self._digests(a, t.source, plans)
        except (ValueError, DataPlaneError) as e:
            w.error = str(e)
            self._settle(transfer_id, t)
            return
        pieces = [
            _Piece(target, plan, cells, whole, *checked)
            for (target, plan), cells, checked in zip(plans, indices, digests, strict=True)
        ]
        self._post(transfer_id, t, w, pieces)

    def _digests(
        self, a: _Assign, src: npt.NDArray[np.int64], plans: list[tuple[_Target, WritePlan | None]]
    ) -> list[tuple[tuple[int, ...], DigestScope | None]]:
        """Integrity: per target, the digests of the whole generation written there and what they cover (None:
        all of the target's bytes, `block_digests` of the source blocks); () without integrity."""
        if not self._config.integrity:
            return [((), None)] * len(plans)
        same = [_same_bytes(target) for target, _ in plans]
        if not all(same) and any(plan is None for _, plan in plans):
            plans = self._plans(a, src, check=True)
        blocks = block_digests(self._endpoint.regions, src[len(src) - len(a.dst) :]) if any(same) else ()
        return [
            (blocks, None) if whole else self._scoped(a, *planned) for planned, whole in zip(plans, same, strict=True)
        ]

    @staticmethod
    def _scoped(a: _Assign, target: _Target, plan: WritePlan | None) -> tuple[tuple[int, ...], DigestScope]:
        """Integrity: the scoped digests of what `plan` writes of the whole generation into `target`."""
        assert plan is not None
        scope = _scope(a, target)
        return plan_digests(plan, target.geometry.regions, scope.regions), scope

    def _post_parts(self, transfer_id: str, t: _Transfer, w: _Write) -> None:
        """Post the cells computed and not posted yet, unless the generation's parts in flight are at the cap."""
        progress, computed = w.progress, t.computed
        if progress is None or computed is None or w.stopped:
            return
        if not self._part_cost.pays(t.part_at - progress.part_at, self._config.part_compute_ratio):
            return  # too little computed since the last part to pay for one: it goes with the next (or the final)
        start = time.thread_time()
        grid = self._grid(w, computed.prompt_tokens)
        if grid is None:
            self._settle(transfer_id, t)  # fails the write if its target does not fit the prompt
            return
        ready = grid.ready(computed)
        if progress.digests is not None and bool((ready >= len(w.assignment.dst)).all()):
            return  # the cells that complete the target go with the final, which brings the digests
        if progress.scoped:
            ready = self._hold_last_cells(w.assignment, ready)
        rects = rectangles(progress.posted, ready)
        if not rects:
            return
        written = [self._columns.part(r, grid) for r in rects]
        try:
            pieces = self._pieces(w, grid, rects, written, computed.src)
        except (ValueError, DataPlaneError) as e:  # ids outside the regions, the peer gone
            w.error = str(e)
            self._settle(transfer_id, t)
            return
        queued = len(w.part_posts) + (w.deferred > 0)  # this turn's parts go in one WRITE
        if queued and queued + len(pieces) > self._config.max_parts_in_flight:
            w.held_back = True  # posted, with what else is computed by then, once parts drain
            return
        w.held_back = False
        self._record(progress, rects, written)
        progress.part_at = t.part_at
        self._post(transfer_id, t, w, pieces, parts=True)
        self._hash(progress, grid, computed.src)
        self._hash_scoped(w, t, computed.src)
        self._turn[0] += time.thread_time() - start
        self._turn[1] += 1
        self._turn[2] += sum(self._bytes(p) for p in pieces)

    def _post_final(self, transfer_id: str, t: _Transfer, w: _Write) -> None:
        """Everything is computed: post what is left, each WRITE with the notification of the parts it carries."""
        progress, src = w.progress, t.source
        assert progress is not None and src is not None
        if not progress.written:  # nothing went ahead: one write, as without parts
            w.progress = None
            self._post_whole(transfer_id, t, w)
            return
        w.complete = True
        grid = progress.grid
        assert grid is not None
        if len(src) < grid.num_src or (grid.runs is None and len(src) != grid.num_src):
            w.error = f"{len(src)} source blocks, but the parts written placed the prompt in {grid.num_src}"
            self._settle(transfer_id, t)
            return
        rects = rectangles(progress.posted, np.full_like(progress.posted, len(w.assignment.dst)))
        written = [self._columns.part(r, grid) for r in rects]
        try:
            pieces = self._pieces(w, grid, rects, written, src)
        except (ValueError, DataPlaneError) as e:
            w.error = str(e)
            self._settle(transfer_id, t)
            return
        self._record(progress, rects, written)
        if progress.digests is not None:
            self._hash(progress, grid, src)
            digests = progress.digests.digests()
            pieces = [dataclasses.replace(p, digests=digests) if _same_bytes(p.target) else p for p in pieces]
        if progress.scoped:
            try:
                pieces = self._scope_final(w, t, pieces)
            except (ValueError, DataPlaneError) as e:
                w.error = str(e)
                self._settle(transfer_id, t)
                return
        w.posted_at = time.monotonic()  # `on_written` times what is left once prefill is done
        self._post(transfer_id, t, w, pieces)

    def _hold_last_cells(self, a: _Assign, ready: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Integrity: `ready` less the last cell of each target with scoped digests that it would complete, so that
        cell goes with the final, which brings the digests."""
        held = ready
        for target in a.targets:
            if _same_bytes(target):
                continue
            layers = target.layers
            columns = range(self._columns.count)
            if layers is not None:
                columns = columns[self._columns.select((layers.start, layers.stop)) or slice(0)]
            if columns and bool((held[columns.start : columns.stop] >= len(a.dst)).all()):
                held = held.copy()
                held[columns.stop - 1] = len(a.dst) - 1
        return held

    def _hash_scoped(self, w: _Write, t: _Transfer, src: npt.NDArray[np.int64]) -> None:
        """Integrity: hash, for each target with scoped digests, the consumer regions whose every cell is posted now
        (`ScopedDigests.add`); what does not fit is left to the final, which fails the write."""
        progress = w.progress
        assert progress is not None
        done = progress.scope_columns
        if done is None:
            return
        complete = progress.posted >= len(w.assignment.dst)
        new = np.flatnonzero(complete & ~done).tolist()
        if not new:
            return
        done |= complete
        a = _told(w.assignment, t)
        regions = [r for column in new for r in self._columns.regions(column, column + 1)]
        try:
            runs = self._runs(a, src)
            for digests in progress.scoped.values():
                digests.add(regions, src, a.dst, runs)
        except (ValueError, DataPlaneError) as e:
            logger.debug("transfer %s: scoped digests left to the final: %s", a.transfer_id, e)

    def _scope_final(self, w: _Write, t: _Transfer, pieces: list[_Piece]) -> list[_Piece]:
        """Integrity: the final's pieces, those of targets with scoped digests carrying them (of the whole plan,
        the regions not hashed as the parts went hashed now)."""
        a, src, progress = _told(w.assignment, t), t.source, w.progress
        assert src is not None and progress is not None
        runs = self._runs(a, src)
        scoped = {
            target.agent.name: (progress.scoped[target.agent.name].digests(src, a.dst, runs), _scope(a, target))
            for target in a.targets
            if target.agent.name in progress.scoped
        }
        return [
            p if p.target.agent.name not in scoped else dataclasses.replace(
                p, digests=scoped[p.target.agent.name][0], scope=scoped[p.target.agent.name][1]
            )
            for p in pieces
        ]  # fmt: skip

    def _prepare_parts(self, transfer_id: str, t: _Transfer, w: _Write) -> None:
        """Place a write in parts in the prompt and make its whole-block targets' descriptors (`_cells`) as soon as
        the prompt's length is known, ahead of its parts; fail it at once if its target does not fit."""
        computed = t.computed
        grid = self._grid(w, computed.prompt_tokens if computed is not None else 0)
        if grid is not None and grid.runs is None:
            src = computed.src if computed is not None else _NO_BLOCKS
            try:
                for target in w.assignment.targets:
                    if target.whole_blocks:
                        self._cells(w, target, grid, src)
            except DataPlaneError as e:
                w.error = str(e)
        self._settle(transfer_id, t)

    def _grid(self, w: _Write, prompt_tokens: int) -> Grid | None:
        """The write's target placed in the prompt, once its length is known; None before (or on failure)."""
        progress, a = w.progress, w.assignment
        assert progress is not None and self._layout is not None
        if progress.grid is None and (prompt_tokens or a.prompt_tokens):
            bp = self._layout.block_size
            bd = a.peer.layout.block_size if isinstance(a.peer, ConsumerEngine) else bp
            try:
                progress.grid = Grid.of(len(a.dst), bp, bd, prompt_tokens or a.prompt_tokens, a.target_tokens)
            except ValueError as e:  # BlockPairingError: the target does not fit the prompt
                w.error = str(e)
        return progress.grid

    def _hash(self, progress: _Progress, grid: Grid, src: npt.NDArray[np.int64]) -> None:
        """Integrity: hash the source blocks of the cells posted since the last call, per region in the target's
        block order (each column's posted cells are a prefix of the target's blocks)."""
        running, hashed = progress.digests, progress.hashed
        if running is None or hashed is None:
            return
        first = grid.start // grid.producer_block_size
        for column in np.flatnonzero(progress.posted > hashed).tolist():
            blocks = src[first + hashed[column] : first + progress.posted[column]]
            for region in self._columns.regions(column, column + 1):
                running.extend(region, blocks)
            hashed[column] = progress.posted[column]

    @staticmethod
    def _record(progress: _Progress, rects: list[Rectangle], written: list[WrittenPart]) -> None:
        for r in rects:
            progress.posted[r.first_column : r.end_column] = r.end_block
        progress.written.extend(written)

    def _pieces(
        self, w: _Write, grid: Grid, rects: list[Rectangle], written: list[WrittenPart], src: npt.NDArray[np.int64]
    ) -> list[_Piece]:
        """Per target, one WRITE of the rectangles' cells (`written`: each in target coordinates): whole blocks of
        its prepared lists, by index (slices of `_cells`), when the target takes whole blocks of equal size; else
        their descriptors, planned and merged; targets without a share in them get none."""
        a = w.assignment
        assert a.producer is not None
        first_src = grid.start // grid.producer_block_size
        per = self._columns.regions_per_column
        pieces: list[_Piece] = []
        for target in a.targets:
            share = target.share
            cut = (self._columns.within(p, target.layers) for p in written)
            covers = tuple(p for p in cut if p is not None)
            if target.whole_blocks and grid.runs is None:
                here, there = self._cells(w, target, grid, src)
                boxes = [
                    (slice(r.first_column * per, r.end_column * per), slice(r.first_block, r.end_block)) for r in rects
                ]
                if len(boxes) == 1:
                    pieces.append(_Piece(target, None, (here[boxes[0]].ravel(), there[boxes[0]].ravel()), covers))
                elif boxes:
                    indices = (
                        np.concatenate([here[box].ravel() for box in boxes]),
                        np.concatenate([there[box].ravel() for box in boxes]),
                    )
                    pieces.append(_Piece(target, None, indices, covers))
                continue
            plans: list[WritePlan] = []
            for r in rects:
                wanted = self._columns.regions(r.first_column, r.end_column)
                regions = range(
                    max(wanted.start, share.producer_regions.start), min(wanted.stop, share.producer_regions.stop)
                )
                if not regions:
                    continue
                shift = share.consumer_regions.start - share.producer_regions.start
                sub = dataclasses.replace(
                    share, producer_regions=regions, consumer_regions=range(regions.start + shift, regions.stop + shift)
                )
                if grid.runs is None:
                    blocks = slice(first_src + r.first_block, first_src + r.end_block)
                    dst = a.dst[r.first_block : r.end_block]
                    plans.append(
                        plan_write(a.producer, target.geometry, sub, src[blocks], dst, a.kv_layout, merge=False)
                    )
                else:
                    runs = grid.runs_of(r)
                    plans.append(
                        plan_write(a.producer, target.geometry, sub, src, a.dst, a.kv_layout, runs, merge=False)
                    )
            if plans:
                local, remote = merge_descriptors(
                    np.concatenate([p.local for p in plans]), np.concatenate([p.remote for p in plans])
                )
                pieces.append(_Piece(target, WritePlan(local, remote), covers=covers))
        return pieces

    def _cells(
        self, w: _Write, target: _Target, grid: Grid, src: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """The whole-block target's prepared descriptors of the write, per (region, target block), here and at
        the peer: made once per source list (`_Cells`). Raises `PeerError` when the peer is no longer the
        assignment's incarnation (nothing of the write may land in another)."""
        progress, a, name = w.progress, w.assignment, target.agent.name
        assert progress is not None
        incarnation = self._endpoint.peer_incarnation(name)
        if incarnation is not None and incarnation != a.incarnation:
            raise PeerError(f"peer agent {name!r} is now incarnation {incarnation}, not {a.incarnation}")
        cells = progress.cells.get(name)
        if cells is None or cells.src is not src:
            regions = len(self._endpoint.regions)
            if cells is None:
                remote = self._endpoint.peer_table(name).indices(a.dst).reshape(regions, len(a.dst))
            else:
                remote = cells.remote
            first = grid.start // grid.producer_block_size
            known = min(len(a.dst), max(len(src) - first, 0))  # target blocks whose source block is known
            local = self._endpoint.table.indices(src[first : first + known]).reshape(regions, known)
            cells = progress.cells[name] = _Cells(src, local, remote)
        return cells.local, cells.remote

    def _bytes(self, piece: _Piece) -> int:
        """The bytes a piece moves."""
        if piece.plan is not None:
            return piece.plan.num_bytes
        assert piece.indices is not None
        regions = np.searchsorted(self._region_starts, piece.indices[0], side="right") - 1
        return int(self._region_bytes[regions].sum())

    @staticmethod
    def _notification(w: _Write, piece: _Piece) -> bytes:
        """A whole write's notification; with parts, what this piece carries
        (`rendezvous.clients.nixl.notifications`)."""
        if piece.covers:
            return encode_parts([_entry(w.assignment.transfer_id, w.generation, piece)])
        if w.progress is None:
            return encode_notification(
                w.assignment.transfer_id, w.generation, piece.target.writers, piece.digests, piece.scope
            )
        return b""

    def _post(self, transfer_id: str, t: _Transfer, w: _Write, pieces: list[_Piece], *, parts: bool = False) -> None:
        """Post each piece with its notification (`_notification`); the first failure stops the generation. Parts
        by index wait for the end of the turn, to be posted with the other transfers' (`_flush_parts`); anything
        else posts those first, so a notification never overtakes a part."""
        if not w.posted_at:
            w.posted_at = time.monotonic()
        if not parts:
            self._flush_parts()
        for piece in pieces:
            if parts and piece.indices is not None:
                self._batch.append((transfer_id, w, piece))
                w.deferred += 1
                continue
            name, notification = piece.target.agent.name, self._notification(w, piece)
            try:
                self._check_fence()
                if piece.plan is not None:
                    plan = piece.plan
                    posted = self._endpoint.post_descriptors("WRITE", name, plan.local, plan.remote, notification)
                else:
                    assert piece.indices is not None
                    posted = self._endpoint.post_indices("WRITE", name, *piece.indices, notification)
            except DataPlaneError as e:
                w.error = str(e)
                break
            w.posts.append(posted)
            if parts:
                w.part_posts.add(posted)
                self._parts_in_flight += 1
        if w.posts:
            self._in_flight[transfer_id] = w
        if parts:  # polled with the others once this turn's commands are handled: a part costs one post
            self._settle(transfer_id, t)
        else:
            self._advance(transfer_id, t, w)

    def _fence_passed(self) -> str | None:
        """Why nothing may be written any more once the engine's write fence passed (see the module doc); None
        before it."""
        if self._writable_until is None:
            return None
        until, now = self._writable_until(), time.monotonic()
        if now < until:
            return None
        why = (self._fence_reason() if self._fence_reason is not None else None) or (
            "its engine's lease was not renewed in time"
        )
        return (
            f"writer {self._endpoint.name}: {why} (its write fence passed {now - until:.3f} s ago): not writing, the"
            " consumer may have reused its blocks"
        )

    def _drop_fenced(self) -> bool:
        """Past the write fence with WRITEs in flight (the process hung, or was starved, after posting them): drop them
        without progressing NIXL, so that nothing more of them moves, and fail their generations. True if any was."""
        if not self._in_flight:
            return False
        reason = self._fence_passed()
        if reason is None:
            return False
        writes = list(self._in_flight.items())
        posts = list(dict.fromkeys(p for _, w in writes for p in w.posts))
        self._endpoint.abandon(posts)  # and forgets every peer: each is loaded again when next written to
        self._forget.clear()
        self._in_flight.clear()
        self._holders.clear()
        self._parts_in_flight = 0
        logger.error("%s; dropped %d WRITEs in flight of %d transfers", reason, len(posts), len(writes))
        for transfer_id, w in writes:
            w.posts.clear()
            w.part_posts.clear()
            if w.error is None:
                w.error = reason
            t = self._transfers.get(transfer_id)
            if t is not None and t.write is w:
                self._settle(transfer_id, t)
        for peer in {p.peer for p in posts}:
            self._after_drain(peer)  # assignments that waited for these WRITEs to drain
        return True

    def _check_fence(self) -> None:
        """Raise `WriteFencedError` once the engine's write fence passed (see the module doc): called before every
        post, as the lease may lapse between two of them."""
        reason = self._fence_passed()
        if reason is not None:
            raise WriteFencedError(reason)

    def _flush_parts(self) -> None:
        """Post the turn's parts by index: one WRITE per peer for all transfers' (a layer of every prompt of a
        step goes in one post), held by each of those transfers; one that cannot be posted fails them all."""
        start = time.thread_time()
        batch, self._batch = self._batch, []
        by_peer: dict[str, dict[str, _Held]] = {}
        for transfer_id, w, piece in batch:
            w.deferred -= 1
            t = self._transfers.get(transfer_id)
            if t is None or t.write is not w or w.error is not None or w.revoked or w.aborted:
                continue  # stopped meanwhile: its cells are not written, and need not be
            assert piece.indices is not None
            held = by_peer.setdefault(piece.target.agent.name, {}).setdefault(transfer_id, _Held(w, piece.target))
            held.local.append(piece.indices[0])
            held.remote.append(piece.indices[1])
            held.covers.extend(piece.covers)
        for name, writes in by_peer.items():
            live = {tid: x for tid, x in writes.items() if x.write.error is None}
            if not live:
                continue
            note = [
                PartsEntry(tid, x.write.generation, x.target.writers, x.target.layers, tuple(x.covers))
                for tid, x in live.items()
                if x.covers
            ]
            try:
                self._check_fence()
                posted = self._endpoint.post_indices(
                    "WRITE",
                    name,
                    np.concatenate([i for x in live.values() for i in x.local]),
                    np.concatenate([i for x in live.values() for i in x.remote]),
                    encode_parts(note) if note else b"",
                )
            except DataPlaneError as e:
                for transfer_id, x in live.items():
                    w = x.write
                    w.error = str(e)
                    t = self._transfers.get(transfer_id)
                    if t is not None:
                        self._settle(transfer_id, t)
                continue
            if len(live) > 1:
                self._holders[posted] = len(live)
            for transfer_id, x in live.items():
                w = x.write
                w.posts.append(posted)
                w.part_posts.add(posted)
                self._parts_in_flight += 1
                self._in_flight[transfer_id] = w
        for peer in {piece.target.agent.name for _, _, piece in batch}:
            self._after_drain(peer)  # an assignment that waited for this batch to reconnect the peer: nothing posted
        seconds, parts, num_bytes = self._turn
        if parts:  # what this turn's parts cost: placing them and the posts
            self._part_cost.observe(seconds + time.thread_time() - start, int(parts), int(num_bytes))
        self._turn = [0.0, 0, 0]

    def _advance(self, transfer_id: str, t: _Transfer, w: _Write) -> bool:
        """Poll the write's WRITEs in the order they were posted, up to the first still in flight (they mostly
        finish in that order: a turn polls a write once, not each of its parts in flight); release those done, then
        finish the generation or post more parts. True if one was done. Past the write fence nothing is polled: a
        poll progresses NIXL, which moves every WRITE in flight on; they are dropped instead (`_drop_fenced`)."""
        if self._drop_fenced():
            return True
        poll = self._endpoint.poll
        drained = []
        for posted in w.posts:
            if poll(posted) is XferStatus.IN_PROGRESS:
                break
            drained.append(posted)
        for posted in drained:
            w.posts.remove(posted)
            if posted in w.part_posts:
                w.part_posts.discard(posted)
                self._parts_in_flight -= 1
            holders = self._holders.pop(posted, 1) - 1
            if holders:  # posted for several transfers: released by the last
                self._holders[posted] = holders
            else:
                try:
                    self._endpoint.release(posted)
                except TransferFailedError:
                    logger.exception("writer %s: releasing a write of %s failed", self._endpoint.name, transfer_id)
            if posted.status is not XferStatus.DONE and w.error is None:
                w.error = posted.error or "the write failed"
        if not w.posts:
            self._in_flight.pop(transfer_id, None)
        if not self._settle(transfer_id, t) and drained and w.held_back:
            self._post_parts(transfer_id, t, w)
        for peer in {p.peer for p in drained}:
            self._after_drain(peer)
        return bool(drained)

    def _poll_writes(self) -> bool:
        progressed = False
        for transfer_id, w in list(self._in_flight.items()):
            t = self._transfers.get(transfer_id)
            if t is not None and t.write is w and self._in_flight.get(transfer_id) is w:  # not dropped meanwhile
                progressed = self._advance(transfer_id, t, w) or progressed
        return progressed

    def _settle(self, transfer_id: str, t: _Transfer) -> bool:
        """Finish the transfer's write if nothing more will be posted and none of its WRITEs is in flight."""
        w = t.write
        if w is None or w.posts or not w.stopped:
            return False
        self._finish_write(transfer_id, t, w)
        return True

    def _finish_write(self, transfer_id: str, t: _Transfer, w: _Write) -> None:
        t.write = None
        ok = w.error is None and w.complete
        error = w.error
        if self._on_written is not None and w.posted_at:
            self._emit(self._on_written, time.monotonic() - w.posted_at, ok)
        parts = tuple(w.progress.written) if w.progress is not None else ()
        if w.revoked:
            self._emit(self._on_revoked, transfer_id, w.generation)
        elif not w.aborted:
            self._complete(transfer_id, w.generation, ok, error, parts)
        succeeded = ok and not w.revoked and not w.aborted
        if succeeded:
            t.written = w.generation
        if w.aborted or (succeeded and t.assignment is None and not self._keep_written):
            self._end(transfer_id, t)
        elif t.failed:  # its KV was never computed: a newer generation fails with that, now or when assigned
            a, t.assignment = t.assignment, None
            if a is not None:
                self._complete(transfer_id, a.generation, False, t.failed)
            self._end(transfer_id, t, t.failed)
        else:
            self._try_write(transfer_id, t)

    def _after_drain(self, peer: str) -> None:
        if (peer not in self._forget and peer not in self._reconnect) or self._writing_to(peer):
            return
        if peer in self._forget:
            self._forget.discard(peer)
            self._endpoint.remove_peer(peer)
        self._reconnect.discard(peer)
        for transfer_id, t in list(self._transfers.items()):
            if t.assignment is not None and peer in t.assignment.names():
                self._try_write(transfer_id, t)

    def _writing_to(self, peer: str) -> bool:
        """Whether a WRITE to `peer` is in flight, or a part for it waits in this turn's batch (`_flush_parts`)."""
        batched = any(piece.target.agent.name == peer for _, _, piece in self._batch)
        return batched or any(peer in w.peers for w in self._in_flight.values())

    def _end(self, transfer_id: str, t: _Transfer, why: str = "") -> None:
        del self._transfers[transfer_id]
        self._remember_ended(transfer_id, why)
        if t.held:
            self._emit(self._on_source_free, transfer_id)

    def _free_ended(self, transfer_id: str) -> None:
        """Blocks handed over for a transfer that ended are the engine's again: at once, or with the rest once the
        WRITEs it still has in flight drained (aborted mid-way)."""
        if transfer_id not in self._transfers:
            self._emit(self._on_source_free, transfer_id)

    def _remember_ended(self, transfer_id: str, why: str = "") -> None:
        remember(self._ended, transfer_id, why, self._config.ended_transfers_kept)

    def _remember_fence(self, transfer_id: str, generation: int) -> None:
        fence = max(generation, self._fences.get(transfer_id, 0))
        remember(self._fences, transfer_id, fence, self._config.ended_transfers_kept)

    def _drop_if_idle(self, transfer_id: str, t: _Transfer) -> None:
        if t.idle and self._transfers.get(transfer_id) is t:
            del self._transfers[transfer_id]
            if t.fence:
                self._remember_fence(transfer_id, t.fence)

    def _shutdown(self) -> None:
        self._batch.clear()  # parts not posted yet: their writes fail below
        for entry in self._waiting:  # never written; a source handed over is freed below with the others
            command = entry.command
            if isinstance(command, _SourceReady) and command.transfer_id in self._ended:
                self._free_ended(command.transfer_id)  # as it would have been once computed
            elif isinstance(command, _SourceReady):
                self._transfers.setdefault(command.transfer_id, _Transfer()).source = command.src
        self._waiting.clear()
        for transfer_id, t in list(self._transfers.items()):
            if t.assignment is not None:
                self._complete(transfer_id, t.assignment.generation, False, "writer stopped")
                t.assignment = None
            if t.write is not None and not t.write.stopped:  # written in parts, not all posted
                t.write.error = "writer stopped"
                self._settle(transfer_id, t)
        self._drain()
        for transfer_id, t in list(self._transfers.items()):
            if t.write is None:
                self._end(transfer_id, t)
        self._release_barriers()
        if self._in_flight:
            logger.error("writer %s: %d writes still in flight at stop", self._endpoint.name, len(self._in_flight))
            return  # their memory may still be read: keep it registered
        self._endpoint.close()

    def _drain(self) -> None:
        backoff = Backoff(self._config.poll)
        deadline = time.monotonic() + self._config.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            if self._poll_writes():
                backoff.reset()
            else:
                time.sleep(backoff.next())

    def _release_barriers(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Barrier | _Replaced):
                command.done.set()

    def _complete(
        self, transfer_id: str, generation: int, ok: bool, error: str | None, parts: tuple[WrittenPart, ...] = ()
    ) -> None:
        if self._on_complete_parts is not None:
            self._emit(self._on_complete_parts, transfer_id, generation, ok, error, parts)
        elif self._on_complete is not None:
            self._emit(self._on_complete, transfer_id, generation, ok, error)

    def _emit(self, callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:
            logger.exception("writer %s: callback %s%r raised", self._endpoint.name, callback, args)
