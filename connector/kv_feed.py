"""An engine's KV events into the fleet's KV index (KvIndexService; docs/vllm.md, "The KV index").

vLLM publishes its prefix cache's changes (`--kv-events-config`, vllm/distributed/kv_events.py): numbered
KVEventBatch messages of BlockStored / BlockRemoved / AllBlocksCleared on a ZMQ PUB socket, the recent ones kept
for a ROUTER replay socket. `KvFeed` subscribes to them on a thread of its own and forwards each batch as a
ReportCacheEvents for its engine id (the live incarnation: the server checks the caller), numbered by the feed
(vLLM's numbers detect lost batches; a batch with nothing of the engine's own cache is not sent).

It keeps a mirror of what the engine holds, from the events it has seen, and repairs with it. Its first call is a
snapshot (ReplaceCachedBlocks), taken at the entry's own sequence: a feed that starts again (its process restarted)
never reports at a sequence the entry applied, which the server would answer as a duplicate without applying it (a
sequence names one batch). Then:
- a batch it already applied (a replay overlapping the live stream) is skipped;
- a gap in vLLM's sequence (a message the SUB socket dropped, a feed that joined late) is filled from the
  replay socket; what the replay no longer holds is lost, and the index is then replaced by the mirror
  (ReplaceCachedBlocks), the best knowledge there is;
- an unreadable batch is a lost one;
- any refused report (a gap or stale sequence at the server, a parent the server does not hold, the engine
  re-registered and its entry dropped, the server unreachable) is repaired by the same snapshot, at once and
  then on every later batch or idle tick until one is accepted;
- a report or snapshot refused INDEX_SEQUENCE_STALE (the entry's sequence is ahead of the feed's: a previous
  feed of the same incarnation wrote it, e.g. the feed's process restarted without the worker's) moves the
  feed's sequence up to the server's `expected_sequence`, and the snapshot goes again at once, once: a server
  still refusing it (another writer racing ahead) is tried again on the next batch or idle tick, never in a loop;
- an accepted report whose block count differs from the mirror's (an entry the server dropped and restarted
  from this batch) is repaired by a snapshot too.
A snapshot larger than one request may carry (the server's max_index_blocks_per_request) goes as a snapshot of
the first blocks and reports storing the rest. Blocks go shallowest first (a chain's first block before its
second: the mirror keeps each block's depth), so that whatever a bound cuts off is the deep end of chains, never a
block prefix matching needs to reach others.

Bounds: the server indexes at most so many blocks of one engine (max_index_blocks_per_engine), of one identity's
engines together, and of all engines; it cuts a snapshot past one of them (`left_out`, and `cut_by` naming the
bound) and refuses a report that would grow past one (INDEX_FULL, its `scope`). While the index holds a cut of the
mirror, the feed forwards only removals (the index never holds a block the engine dropped) and sends the whole
mirror again once the engine holds no more blocks than the cut kept. The engine's own bound (`engine_bound`, which
the server names) is the same for every later snapshot, so only the shallowest that many are ever sent. A shared
bound (the identity's or the server's) frees room when other engines shrink, which the engine cannot see: the feed
sends the whole mirror again every `refill_interval` while such a cut lasts. A report a shared bound refuses is not
repaired by a snapshot (the server is full: it would gain nothing, at the cost of the whole mirror): its removals go
alone, at the same sequence (the refused batch applied nothing), and the index holds a cut from then on.
Only the engine's own cache is mirrored: events of another medium (vLLM's CPU offloading tier) are left out.

The engine registers in its worker process, the feed runs in the engine-core (scheduler) process, so the feed
learns the incarnation it reports for: the worker labels its registration with vLLM's instance id
(`INSTANCE_LABEL`, VllmConfig.instance_id, the same in both processes, new in every vLLM process), and the feed
takes the incarnation of the live registration (GetEngine) carrying its own instance's label, again whenever the
server refuses that one (STALE_INCARNATION, LEASE_EXPIRED, ENGINE_NOT_FOUND: its worker re-registered, or another
process took the engine id over). While the live registration is another instance's, the feed sends nothing: a
late report from an old process with the same engine id is refused (STALE_INCARNATION), never applied to the
new process's entry (with incarnation 0, "whichever is current", it was, and a stale feed whose sequence ran ahead
locked the new one out with INDEX_SEQUENCE_STALE).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
from vllm.distributed.kv_events import BlockStored as VllmStored
from vllm.distributed.kv_events import KVEventBatch

from rendezvous.clients import (
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    IndexPosition,
    Reason,
    RendezvousError,
    hash_of,
)
from rendezvous.clients.sync import RendezvousClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "INSTANCE_LABEL",
    "OWN_MEDIA",
    "KvFeed",
    "cache_events",
    "engine_hashing",
    "start_feed",
    "subscriber_endpoint",
]

log = logging.getLogger(__name__)

OWN_MEDIA = frozenset({None, "GPU"})
"""The `medium` of events about the engine's own KV cache (vLLM-CPU's cache reports "GPU" too)."""
REQUEST_BLOCKS = 65_536
"""The most block hashes the feed puts in one request at first: the server's default max_index_blocks_per_request
(a server configured lower names its limit when it refuses, and the feed keeps to that)."""
INSTANCE_LABEL = "vllm_instance"
"""The engine label naming the vLLM instance (VllmConfig.instance_id) that registered it: whose registration a
feed reports for."""
INCARNATION_GONE = frozenset({Reason.STALE_INCARNATION, Reason.LEASE_EXPIRED, Reason.ENGINE_NOT_FOUND})
"""Refusals that say the incarnation the feed reports for is not the live one: it learns it again."""
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""vLLM's replay socket ends its answer with this sequence (ZmqEventPublisher.END_SEQ)."""


def subscriber_endpoint(endpoint: str) -> str:
    """Where a subscriber on the engine's host connects to a publisher bound at `endpoint`: a wildcard host
    becomes 127.0.0.1. A publisher that connects out (to a proxy) or binds port 0 cannot be subscribed to here."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            port = endpoint[len(wildcard) :]
            if port in ("", "0"):
                raise ValueError(f"kv_index: the KV events endpoint {endpoint!r} needs a fixed port")
            return f"tcp://127.0.0.1:{port}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    raise ValueError(
        f"kv_index: vLLM connects its KV events publisher to {endpoint!r} instead of binding it; bind it "
        "(tcp://*:PORT or ipc://PATH) so the connector can subscribe"
    )


def cache_events(events: Iterable[Any]) -> list[CacheEvent]:
    """vLLM's events of the engine's own cache as the index's events (token ids, LoRA and medium dropped)."""
    out: list[CacheEvent] = []
    for event in events:
        if isinstance(event, VllmStored) and event.medium in OWN_MEDIA and event.block_hashes:
            parent = b"" if event.parent_block_hash is None else hash_of(event.parent_block_hash)
            hashes = tuple(hash_of(h) for h in event.block_hashes)
            out.append(BlocksStored(hashes, parent, event.group_idx or 0, len(event.token_ids)))
        elif isinstance(event, VllmRemoved) and event.medium in OWN_MEDIA and event.block_hashes:
            out.append(BlocksRemoved(tuple(hash_of(h) for h in event.block_hashes), event.group_idx or 0))
        elif isinstance(event, VllmCleared):
            out.append(AllBlocksCleared())
    return out


class KvFeed:
    """Forwards one engine's KV events to the rendezvous's KV index, on a thread of its own (`start`, `stop`).

    `endpoint` and `replay_endpoint` are ZMQ addresses to connect to (`subscriber_endpoint`); `topic` is vLLM's
    KVEventsConfig.topic. `retry_interval`: how long the feed waits for a batch before it catches up from the
    replay socket and repairs an index that lags. `instance`: the vLLM instance whose registration (labelled
    `INSTANCE_LABEL`) the feed reports for; "" reports for whichever incarnation is live (incarnation 0).
    `refill_interval`: how often, by `clock` (seconds), an index a shared bound cut gets the whole mirror again.
    """

    def __init__(
        self,
        client: RendezvousClient,
        engine_id: str,
        hashing: BlockHashing,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        replay_timeout: float = 5.0,
        retry_interval: float = 1.0,
        instance: str = "",
        refill_interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.instance = instance
        self.incarnation = 0
        """The incarnation reported for: the live one of `instance` as last learned (0 with no instance, or none
        learned yet)."""
        self.engine_id = engine_id
        self.hashing = hashing
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self._retry_interval = retry_interval
        self._refill_interval = refill_interval
        self._clock = clock
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._held: dict[int, dict[bytes, int]] = {}
        """The mirror: per KV cache group, each block held and its depth in its chain (0: a chain's first block)."""
        self.sequence: int | None = None
        """The last vLLM sequence applied: mirrored and forwarded (or repaired); None before the first."""
        self.index_sequence = 0
        """The index's sequence for the engine: batches forwarded since the feed started (a batch with no event
        of the engine's own cache is not forwarded, so vLLM's numbers would leave gaps)."""
        self.in_sync = False
        """Whether the index holds what the mirror holds, as of `index_sequence`."""
        self.snapshots = 0
        """How many times the index was replaced by the mirror (repairs, and the first report)."""
        self.engine_bound: int | None = None
        """The most blocks the server indexes for this engine (max_index_blocks_per_engine), once it said so (a
        snapshot cut by the engine's bound, a report refused INDEX_FULL for the engine); None before."""
        self.cut = False
        """Whether the index holds only part of the mirror (a bound had no room for all of it)."""
        self.kept = 0
        """The blocks the index held when the cut began: once the engine holds no more, the whole mirror goes."""
        self.refill_at: float | None = None
        """When (by the clock) the whole mirror goes again while a shared bound cuts the index; None when no shared
        bound does."""
        self._indexed = 0
        """The blocks the index held for the engine as of its last accepted answer."""
        self.request_blocks = REQUEST_BLOCKS
        """The most block hashes the feed puts in one request (the server's max_index_blocks_per_request, as far
        as the feed knows: a refusal naming a smaller one lowers it)."""
        self._context = zmq.Context()
        self._stopping = threading.Event()
        self._subscribed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-feed-{engine_id}", daemon=True)

    def start(self) -> None:
        """Subscribe and forward until `stop`; returns once the subscription is made."""
        self._thread.start()
        self._subscribed.wait()

    def stop(self) -> None:
        """Stop forwarding and close the sockets (the client is the caller's)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._context.term()

    def held(self) -> dict[int, frozenset[bytes]]:
        """The mirror: the block hashes the engine holds by group, as far as the events seen tell."""
        return {group: frozenset(hashes) for group, hashes in self._held.items() if hashes}

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            sub.connect(self._endpoint)
            self._subscribed.set()
            self._idle()
            last = time.monotonic()
            while not self._stopping.is_set():
                if sub.poll(100):
                    _topic, seq, payload = sub.recv_multipart()
                    self.receive(int.from_bytes(seq, "big"), payload)
                    last = time.monotonic()
                elif time.monotonic() - last >= self._retry_interval:
                    self._idle()
                    last = time.monotonic()
        except Exception:
            log.exception("the KV index feed of %s stopped", self.engine_id)
        finally:
            self._subscribed.set()
            sub.close(linger=0)

    def _idle(self) -> None:
        """What an idle feed does: catch up from the replay socket (a SUB socket drops what is published before
        its subscription took hold, and a dropped last batch leaves no gap to notice), and repair a lagging
        index."""
        self._catch_up(None)
        if self._whole_again():
            self.in_sync = False
        if not self.in_sync and self.sequence is not None:
            self._replace()

    def receive(self, seq: int, payload: bytes) -> None:
        """Apply one published batch: skip a duplicate, fill a gap first, then forward it."""
        if self.sequence is not None and seq <= self.sequence:
            return
        if seq > self._next():
            self._catch_up(seq)
            if self._next() < seq:
                log.warning(
                    "KV events %d..%d of %s are lost: a snapshot repairs", self._next(), seq - 1, self.engine_id
                )
                self.in_sync = False
        self._apply(seq, payload)

    def _catch_up(self, before: int | None) -> None:
        """Apply the batches vLLM's replay socket holds from the next one on (up to `before`), in order."""
        for seq, payload in self._replay(self._next()):
            if seq == self._next() and (before is None or seq < before):
                self._apply(seq, payload)

    def _next(self) -> int:
        return 0 if self.sequence is None else self.sequence + 1

    def _replay(self, start: int) -> Sequence[tuple[int, bytes]]:
        """The batches from `start` on that vLLM's replay socket still holds (none without one)."""
        if self._replay_endpoint is None:
            return []
        dealer = self._context.socket(zmq.DEALER)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(self._replay_timeout_ms):
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_OF_REPLAY:
                    return batches
                batches.append((int.from_bytes(seq, "big"), payload))
            log.warning("vLLM's KV events replay for %s did not answer in time", self.engine_id)
            return batches
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        """Forward one batch; `sequence` says it was applied only once its report (or repair) is done."""
        try:
            self._forward(seq, payload)
        finally:
            self.sequence = seq

    def _forward(self, seq: int, payload: bytes) -> None:
        try:
            events = cache_events(self._decoder.decode(payload).events)
        except msgspec.DecodeError as e:  # a batch this vLLM's schema cannot read is a lost batch
            log.warning("KV events batch %d of %s is unreadable (%s): a snapshot repairs", seq, self.engine_id, e)
            events, self.in_sync = [], False
        for event in events:
            self._mirror(event)
        if self._whole_again():
            self.in_sync = False
        if not self.in_sync:
            self._replace()
            return
        if self.cut:  # the index holds a cut of the mirror: keep it free of dropped blocks, add none
            events = [e for e in events if not isinstance(e, BlocksStored)]
        if not events:
            return
        report = CacheReport(
            self.engine_id, self.index_sequence + 1, tuple(events), hashing=self.hashing, incarnation=self.incarnation
        )
        try:
            position = self.client.report_cache_events(report)
        except RendezvousError as e:
            self._learn_bound(e)
            self._forget_incarnation(e)
            self._learn_sequence(e)
            if _shared_scope(e) and self._removals_alone(events):
                log.warning("KV index is full (%s): %s's removals went alone, its stores wait", e, self.engine_id)
                return
            log.info("KV index refused %s's batch %d (%s): a snapshot repairs", self.engine_id, seq, e)
            self._replace()
            return
        self.index_sequence = report.sequence
        self._indexed = position.block_count
        if not self.cut and position.block_count != self._count():
            held = self._count()
            log.info(
                "KV index holds %d blocks of %s, not %d: a snapshot repairs", position.block_count, self.engine_id, held
            )
            self._replace()

    def _whole_again(self) -> bool:
        """Whether an index holding a cut of the mirror should get the whole mirror again: the engine holds no more
        blocks than the cut kept, or a shared bound's cut is due for another try (room may have freed)."""
        if not self.cut:
            return False
        return self._count() <= self.kept or (self.refill_at is not None and self._clock() >= self.refill_at)

    def _removals_alone(self, events: Sequence[CacheEvent]) -> bool:
        """After a report a shared bound refused (it applied nothing): send its removals (and clears) alone at its
        sequence (they never grow the index, so no bound refuses them), and hold the index as a cut of the mirror:
        every block it holds the engine holds. Whether that went; if not, a snapshot repairs."""
        removals = tuple(e for e in events if not isinstance(e, BlocksStored))
        if removals:
            report = CacheReport(
                self.engine_id, self.index_sequence + 1, removals, hashing=self.hashing, incarnation=self.incarnation
            )
            try:
                position = self.client.report_cache_events(report)
            except RendezvousError as e:
                self._forget_incarnation(e)
                self._learn_sequence(e)
                return False
            self.index_sequence = report.sequence
            self._indexed = position.block_count
        self._cut(shared=True)
        return True

    def _cut(self, shared: bool) -> None:
        """The index holds a cut of the mirror from now on: `_indexed` blocks of it. A shared bound's cut is tried
        again after refill_interval."""
        self.cut, self.kept = True, self._indexed
        self.refill_at = self._clock() + self._refill_interval if shared else None

    def _mirror(self, event: CacheEvent) -> None:
        match event:
            case BlocksStored(block_hashes=hashes, parent=parent, group=group):
                held = self._held.setdefault(group, {})
                first = held[parent] + 1 if parent in held else 0  # a parent not held (or none): a chain's start
                for depth, block in enumerate(hashes, first):
                    held[block] = depth
            case BlocksRemoved(block_hashes=hashes, group=group):
                held = self._held.get(group, {})
                for block in hashes:
                    held.pop(block, None)
            case AllBlocksCleared():
                self._held.clear()

    def _count(self) -> int:
        return sum(len(hashes) for hashes in self._held.values())

    def _learn_bound(self, error: RendezvousError) -> None:
        """A report refused because the engine would hold more blocks than the server indexes for one engine says
        how many that is."""
        if error.reason == Reason.INDEX_FULL and error.metadata.get("scope") == "engine":
            with contextlib.suppress(KeyError, ValueError):
                self.engine_bound = int(error.metadata["limit"])

    def _learn_sequence(self, error: RendezvousError) -> bool:
        """Whether a refusal as stale moved `index_sequence` up to the entry's (the server's `expected_sequence`
        less one), so that the next snapshot (`index_sequence + 1`, the expected sequence) is accepted: the server
        takes a snapshot at or past the entry's sequence. Never moves it back (a gap: the feed is ahead, and any
        snapshot it sends is accepted)."""
        if error.reason != Reason.INDEX_SEQUENCE_STALE:
            return False
        try:
            last = int(error.metadata["expected_sequence"]) - 1
        except (KeyError, ValueError):
            return False
        if last <= self.index_sequence:
            return False
        log.info(
            "KV index entry of %s is at sequence %d, the feed at %d: it follows",
            self.engine_id,
            last,
            self.index_sequence,
        )
        self.index_sequence = last
        return True

    def _forget_incarnation(self, error: RendezvousError) -> None:
        if self.instance and error.reason in INCARNATION_GONE:
            self.incarnation = 0

    def _learn_incarnation(self) -> bool:
        """Whether the feed knows the incarnation to report for: with an instance, the live registration's if it
        carries the instance's label (GetEngine); else nothing may be sent (none yet, or another process's)."""
        if not self.instance or self.incarnation:
            return True
        try:
            engine = self.client.get_engine(self.engine_id)
        except RendezvousError as e:
            log.info("KV index feed of %s: no live registration to report for (%s)", self.engine_id, e)
            return False
        if engine.labels.get(INSTANCE_LABEL) != self.instance:
            log.warning(
                "KV index feed of %s: the live registration is another vLLM instance's (%s, not %s): sending nothing",
                self.engine_id,
                engine.labels.get(INSTANCE_LABEL, "unlabelled"),
                self.instance,
            )
            return False
        self.incarnation = engine.incarnation
        return True

    def _replace(self) -> None:
        """Replace the index's entry by the mirror, as of a new `index_sequence`: a snapshot of its first
        `request_blocks` blocks, then reports storing the rest as many at a time (a request carries at most the
        server's max_index_blocks_per_request hashes; a refusal naming a smaller limit lowers `request_blocks`).
        Nothing is sent while the feed does not know its incarnation (`_learn_incarnation`)."""
        if not self._learn_incarnation():
            self.in_sync = False
            return
        # Shallowest first, groups in order (as the server keeps a snapshot's first blocks when it cuts one).
        held = [
            (group, block)
            for group, blocks in sorted(self._held.items())
            for block, _ in sorted(blocks.items(), key=lambda item: item[1])
        ]
        resynced = False  # the sequence is followed once a call: a server refusing still waits for the next
        while True:
            sent = held if self.engine_bound is None else held[: self.engine_bound]
            try:
                position = self._send_mirror(sent)
                break
            except RendezvousError as e:
                limit = int(e.metadata.get("limit", 0)) if e.reason == Reason.INDEX_QUERY_TOO_LARGE else 0
                if 0 < limit < self.request_blocks:
                    self.request_blocks = limit
                    continue
                bound = self.engine_bound
                self._learn_bound(e)
                self._forget_incarnation(e)
                if self.engine_bound != bound:  # a part past the engine's bound: send what it indexes
                    continue
                if not resynced and self._learn_sequence(e):  # the entry is ahead: from its sequence on
                    resynced = True
                    continue
                log.warning("KV index snapshot of %s failed (%s): retrying", self.engine_id, e)
                self.in_sync = False
                return
        if position.cut_by == "engine":  # the engine's own bound: every later snapshot is cut the same
            self.engine_bound = position.block_count
        self._indexed = position.block_count
        self.cut, self.refill_at = False, None
        if position.block_count < len(held):
            # A cut the server did not name ("" with left_out: a server older than cut_by) may be a shared bound's.
            self._cut(shared=position.left_out > 0 and position.cut_by != "engine")
            log.warning(
                "KV index keeps %d of the %d blocks %s caches (%s bound): the shallowest",
                position.block_count,
                len(held),
                self.engine_id,
                position.cut_by or "its",
            )
        self.snapshots += 1
        self.in_sync = True

    def _send_mirror(self, held: Sequence[tuple[int, bytes]]) -> IndexPosition:
        """Replace the entry by `held`: a snapshot of its first `request_blocks`, reports storing the rest; where
        the entry stands after the last of them."""
        size = self.request_blocks
        parts = [held[first : first + size] for first in range(0, len(held), size)] or [[]]
        groups = tuple((g, tuple(h for gh, h in parts[0] if gh == g)) for g in sorted({g for g, _ in parts[0]}))
        sequence = self.index_sequence + 1
        snapshot = CacheSnapshot(self.engine_id, sequence, self.hashing, groups, incarnation=self.incarnation)
        position = self.client.replace_cached_blocks(snapshot)
        self.index_sequence = sequence
        if position.left_out:
            return position  # cut by a bound: nothing more goes in
        for i, part in enumerate(parts[1:], 1):
            events = tuple(
                BlocksStored(tuple(h for gh, h in part if gh == g), b"", g) for g in sorted({g for g, _ in part})
            )
            report = CacheReport(
                self.engine_id, self.index_sequence + 1, events, hashing=self.hashing, incarnation=self.incarnation
            )
            try:
                position = self.client.report_cache_events(report)
            except RendezvousError as e:
                if not _shared_scope(e):
                    raise
                # A shared bound has no room for the rest: the entry holds the parts sent, a cut as a snapshot's.
                left_out, scope = sum(len(rest) for rest in parts[i:]), str(e.metadata["scope"])
                return IndexPosition(self.index_sequence, position.block_count, left_out=left_out, cut_by=scope)
            self.index_sequence = report.sequence
        return position


def _shared_scope(error: RendezvousError) -> bool:
    """Whether a refusal is INDEX_FULL for a bound the engine shares with others (its identity's, the server's)."""
    return error.reason == Reason.INDEX_FULL and error.metadata.get("scope") in ("identity", "server")


def engine_hashing(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> BlockHashing:
    """How the engine hashes its blocks, announced with its reports so routers compute the same chain: vLLM's
    --prefix-caching-hash-algo, the seed of its first parent (PYTHONHASHSEED, else vLLM's fixed seed for a
    cryptographic algorithm; "" when the engine draws a secret random one), its hash block size, and whether its
    events carry 64-bit integer hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, vLLM's default)."""
    from vllm import envs
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    algorithm = str(vllm_config.cache_config.prefix_caching_hash_algo)
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = "" if algorithm.startswith("xxhash") else DEFAULT_NONE_HASH_SEED
    block_size = getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
    return BlockHashing(algorithm, seed, int(block_size), bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES))


def start_feed(
    client: RendezvousClient, engine_id: str, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> KvFeed:
    """The feed of an engine whose KV events vLLM publishes (`--kv-events-config`), started. Raises ValueError
    when the engine publishes none, or where the connector cannot subscribe."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    events = vllm_config.kv_events_config
    if events is None or not events.enable_kv_cache_events or events.publisher != "zmq":
        raise ValueError(
            "kv_index needs vLLM's KV events: --kv-events-config '{\"enable_kv_cache_events\": true, "
            '"publisher": "zmq", "endpoint": "tcp://*:5557"}\''
        )
    if not vllm_config.cache_config.enable_prefix_caching:
        raise ValueError("kv_index needs prefix caching (--enable-prefix-caching)")
    rank = vllm_config.parallel_config.data_parallel_index
    endpoint = ZmqEventPublisher.offset_endpoint_port(events.endpoint, rank)
    replay = ZmqEventPublisher.offset_endpoint_port(events.replay_endpoint, rank)
    assert endpoint is not None
    feed = KvFeed(
        client,
        engine_id,
        engine_hashing(vllm_config, kv_cache_config),
        subscriber_endpoint(endpoint),
        subscriber_endpoint(replay) if replay else None,
        events.topic,
        instance=vllm_config.instance_id,
    )
    feed.start()
    return feed
