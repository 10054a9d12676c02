"""`ProducerAgent`: one producer (prefill) rank's side of the data plane, wired to the rendezvous service.

It registers the rank's KV tensors with NIXL (DRAM for CPU tensors, VRAM for CUDA ones), announces the agent
through engine registration, and turns the engine's events into commands for its `TransferWriter`, the one
thread that makes NIXL calls:

- TRANSFER_ASSIGNED   -> write the consumer's blocks (its agent for our rank, cached by incarnation);
- TRANSFER_REVOKED    -> stop; AcknowledgeRevocations once no write of that generation can land;
- TRANSFER_ABORTED    -> revoke a generation the service still fences, drop the transfer, free the source;
- PEER_LOST           -> forget that incarnation's agents;
- Resynced            -> write what the listing shows matched to it and not assigned yet; end what it shows COMMITTED,
                         and what it holds or claimed that it lacks (live transfers only: ended meanwhile) as the
                         service's record says, revoking a generation the service still fences;
- Reregistered        -> drop every assignment of the replaced incarnation, before the session opens the write fence
                         on the new lease (the service assigns a transfer again if it matches it again), and end
                         the transfers that did not survive. An outcome is reported as the incarnation whose
                         assignment it answers, and dropped once that one is replaced (the source is then kept).

A written source is freed once the write's report is answered, not as the write ends: should the report be lost
with the incarnation it answers (the service restarted, and forgot the transfer), both sides re-assert the transfer
and the new epoch assigns it again, the same generation, to the new incarnation, which writes it again from the
source kept. Otherwise the new incarnation's match ends it: written, aborted, or its claim's deadline.

The engine calls `claim` at admission and `ready` when the KV is computed (and, for a consumer that accepts
parts, `ready_part` as prefill computes layers or chunks, which the writer posts ahead); the source blocks come
back through the `on_free` callback once written and the write's report answered (or once the transfer ended
otherwise). Each finished write is reported with CompleteTransfers. In pull mode (`serve_reads=True`)
`ready(..., mode=PULL)` calls MarkSourcesReady instead and the consumer READs; the blocks are freed when the
consumer commits or the transfer aborts. Without a progress thread NIXL serves a peer's READ only while the target
agent is polled, and the writer polls only while it writes, so pull mode announces a second agent over the same
tensors, polled by a `ReceiverThread`.

The registering rank's writer is fenced by the engine's lease (`EngineSession.writable_until`): once the lease is
not certainly held any more (the rank cannot renew it: cut off from the service, while it may still reach the
consumer), it posts nothing more and fails the generations it would write, each reported FAILED with the reason
(once the service can be reached) and its source freed; a WRITE posted before the fence has a third of the lease
(by default) to land before the service can lapse the lease and let the consumer reuse its blocks. A following
rank (`start(follow=...)`) holds no lease but is fenced by the one rank 0 holds (`RankSession.writable_until`): it
reads what is left of it (GetEngine's `lease_remaining`) every sixth of the TTL by default, so a following rank cut
off from the service (not from the consumer), or whose rank 0 died, stops writing before the service can lapse the
lease, with the same margin. (From a server older than `lease_remaining` it is not fenced; its session warns.)

Everything public runs on the event loop the agent was started on; writer callbacks hop onto it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Unpack

from rendezvous.clients._memo import remember
from rendezvous.clients._roles import ProducerSession
from rendezvous.clients._session import RankSession
from rendezvous.clients._types import (
    AbortSpec,
    Binding,
    ClaimSpec,
    CompletionOutcome,
    CompletionSpec,
    EventType,
    ItemResult,
    NixlAgentInfo,
    Reregistered,
    Resynced,
    RevocationAck,
    ServerEvent,
    SessionEvent,
    SourceReadySpec,
    TransferInfo,
    TransferMode,
    TransferState,
)
from rendezvous.clients.aio import AsyncRendezvousClient
from rendezvous.clients.nixl.agent import NixlEndpoint
from rendezvous.clients.nixl.batching import Batcher, batcher_of, log_refusal, stale
from rendezvous.clients.nixl.device import COMPLETE, KvReady
from rendezvous.clients.nixl.rank import FOLLOWER_CHECK_S, RankAgent, RankOptions
from rendezvous.clients.nixl.receiver import TransferReceiver
from rendezvous.clients.nixl.receiver_thread import ReceiverThread
from rendezvous.clients.nixl.regions import BlockIds
from rendezvous.clients.nixl.writer import ConsumerEngine, TransferWriter, WriterConfig, WrittenPart
from rendezvous.protocol import tracing
from rendezvous.protocol.errors import NotFound, RendezvousError
from rendezvous.protocol.events import Event

if TYPE_CHECKING:
    import torch

__all__ = ["OnFree", "OnReport", "ProducerAgent", "WriteReport"]

logger = logging.getLogger(__name__)

OnFree = Callable[[str], None]
"""on_free(transfer_id): the engine may reuse the transfer's source blocks. Runs on the agent's event loop."""
CLAIMS_KEPT = 65536
"""How many of its latest claims a registering rank remembers, to refuse `ready` of a transfer it never claimed."""


@dataclasses.dataclass(frozen=True, slots=True)
class WriteReport:
    """How one generation of a pushed transfer ended on the producer; `time.monotonic()` stamps, 0.0 = never."""

    transfer_id: str
    generation: int
    ok: bool
    error: str | None
    ready_time: float
    """When the engine called `ready`."""
    assigned_time: float
    """When the assignment reached this agent."""
    written_time: float
    """When the writer reported the WRITE finished (or failed)."""
    completed_time: float
    """When the service acknowledged CompleteTransfers."""
    parts: tuple[WrittenPart, ...] = ()
    """The rectangles written in parts (`ready_part`), the final piece included; () for one write."""


OnReport = Callable[[WriteReport], None]


@dataclasses.dataclass(eq=False)
class _Source:
    on_free: OnFree | None
    mode: TransferMode
    ready_time: float


def _ignore(*args: object) -> None:
    """A callback for what the read-serving agent reports: nothing this producer acts on."""


def agent_for_rank(agents: Sequence[NixlAgentInfo], rank: int) -> NixlAgentInfo | None:
    """The agent of `rank` among a peer engine's agents, if it has one."""
    return next((a for a in agents if a.rank == rank), None)


class ProducerAgent(RankAgent[ProducerSession]):
    """One producer rank: NIXL endpoint + background writer + engine session. `start()`, then `close()`."""

    session_type = ProducerSession
    writes = True

    def __init__(
        self,
        client: AsyncRendezvousClient,
        engine_id: str,
        pool: str,
        tensors: Sequence[torch.Tensor],
        *,
        writer_config: WriterConfig | None = None,
        on_report: OnReport | None = None,
        serve_reads: bool = False,
        first_layer: int = 0,
        num_layers: int = 0,
        follower_check_s: float = FOLLOWER_CHECK_S,
        **options: Unpack[RankOptions],
    ) -> None:
        """`options`: those of every rank agent (`RankOptions`: agent_name, rank, layout, labels, lease_ttl,
        session_config, metrics_registry). `layout` is required and must state the model_fingerprint and
        num_layers (ValueError otherwise): the service compares it with the consumer's before a byte is written.

        `rank`, `layout` and (with pipeline parallelism) `first_layer`/`num_layers` place this rank in its engine;
        the writer writes this rank's share of each assignment (`rendezvous.protocol.kvmap`). `on_report` gets a
        `WriteReport` per finished write, and `ready`'s `on_free` the source back: both on the event loop the
        agent was started on. `writer_config` tunes the writer thread; `serve_reads` serves pull-mode READs.
        `follower_check_s`: how often a following rank asks the service about a transfer whose source it holds and
        of which it has heard nothing (rank 0's claim may have been refused: then no event comes, and the source
        is freed once the service says the transfer is not this engine's to write)."""
        super().__init__(client, engine_id, pool, tensors, **options)
        self.serve_reads = serve_reads
        self._layers = (first_layer, num_layers)
        self._writer_config = writer_config
        self._on_report = on_report
        self._follower_check_s = follower_check_s
        self._checks: set[asyncio.Task[None]] = set()  # following ranks' checks of the sources they hold
        self._writer: TransferWriter | None = None
        self._server: ReceiverThread | None = None
        self._sources: dict[str, _Source] = {}
        self._assigned: dict[str, tuple[float, int]] = {}  # when the current assignment arrived, its generation
        self._prompt_tokens: dict[str, int] = {}  # from `ready`: what pairs blocks of different sizes
        self._deferred: dict[str, ServerEvent] = {}  # assignments that wait for `ready` to tell the prompt's tokens
        self._writing: dict[str, tracing.Span] = {}  # push: producer.write, from `ready` to the write's end
        self._claimed: OrderedDict[str, None] = OrderedDict()  # the latest CLAIMS_KEPT transfers claimed here
        self._claims: Batcher[ClaimSpec] | None = None
        self._ready: Batcher[SourceReadySpec] | None = None
        self._acks: dict[tuple[int, int], Batcher[RevocationAck]] = {}  # by the incarnation they answer
        self._revoked_by: dict[tuple[str, int], tuple[int, int]] = {}  # revocations in the writer's hands: by whom

    # Lifecycle

    async def _open(self) -> NixlAgentInfo:
        """Register the tensors with NIXL and start the writer thread (and the read-serving agent)."""
        writer_name = f"{self._agent_name}-writer" if self.serve_reads else self._agent_name
        self._writer = TransferWriter(
            NixlEndpoint.from_tensors(writer_name, self._tensors),
            on_complete_parts=self._on_loop(self._write_finished),
            on_revoked=self._on_loop(self._write_revoked),
            on_source_free=self._on_loop(self._source_free),
            on_written=functools.partial(self.metrics.observe_write, self.rank),
            writable_until=self._writable_until,
            fence_reason=self._fence_reason,
            keep_written=True,  # until the write's report is answered: see `_completed`
            config=self._writer_config,
            layout=self.layout,
            rank=self.rank,
            first_layer=self._layers[0],
            num_layers=self._layers[1],
        )
        self._writer.start()
        announced = self._writer.agent_info(self.rank)
        if self.serve_reads:
            endpoint = NixlEndpoint.from_tensors(self._agent_name, self._tensors)
            self._server = ReceiverThread(TransferReceiver(endpoint), on_notifications=_ignore, on_read_done=_ignore)
            self._server.start()
            announced = dataclasses.replace(
                self._server.agent_info(self.rank), first_layer=announced.first_layer, num_layers=announced.num_layers
            )
        return announced

    @property
    def writes_in_flight(self) -> int:
        """Transfers this rank's writer has WRITEs in flight for (`TransferWriter.writes_in_flight`)."""
        return 0 if self._writer is None else self._writer.writes_in_flight

    def _writable_until(self) -> float:
        """The writer's fence, asked on its thread: the registering rank's session's, or the following rank's (see
        the module doc); an agent not started yet holds no assignment."""
        session = self._session or self._follower
        return math.inf if session is None else session.writable_until

    def _fence_reason(self) -> str | None:
        """Why the writer's fence closed, when a re-registration closed it (asked on the writer's thread)."""
        session = self._session or self._follower
        if session is None or not session.replacing:
            return None
        return (
            f"engine {self.engine_id} is re-registering (incarnation {session.events_incarnation[1]} is replaced):"
            " its assignments are not the service's to fence any more"
        )

    def _on_session(self, session: ProducerSession | RankSession) -> None:
        if isinstance(session, ProducerSession):
            self._claims = Batcher("ClaimTransfers", session.claim_transfers)
            self._ready = Batcher("MarkSourcesReady", session.mark_sources_ready)

    async def close(self, *, deregister: bool = True) -> None:
        """Stop the writer (writes in flight drain; held sources are freed), then end the session."""
        for check in list(self._checks):
            check.cancel()
        await self._stop_threads()
        await asyncio.sleep(0)  # run the callbacks the writer posted while stopping
        await self._finish_calls((self._claims, self._ready, *self._completions.values(), *self._acks.values()))
        await self._close_session(deregister)

    async def _stop_threads(self) -> None:
        if self._writer is not None:
            await asyncio.to_thread(self._writer.stop)
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)

    # Engine API

    async def claim(self, transfer_id: str, timeout: float = 0.0, binding: Binding | None = None) -> ItemResult:
        """Claim a transfer at admission (batched with other claims of this loop turn); rank 0's call.

        `binding` is the router's binding of the transfer to this engine (`Binding.from_params` of the
        request's `kv_transfer_params`), which a service with binding keys checks. A refused item is returned,
        not raised (a `ready` for it then frees the blocks at once); a refused call raises.
        """
        if self._claims is None:
            raise RuntimeError("the agent is not started" if self.leader else "claims are the registering rank's")
        remember(self._claimed, transfer_id, None, CLAIMS_KEPT)
        result = await self._claims.submit(ClaimSpec(transfer_id, timeout, binding))
        if not result.ok or result.state.terminal:  # no assignment will come: a `ready` after this frees at once
            self._end(transfer_id)
        return result

    def ready(
        self,
        transfer_id: str,
        block_ids: BlockIds,
        on_free: OnFree | None = None,
        *,
        mode: TransferMode = TransferMode.PUSH,
        prompt_tokens: int = 0,
        binding: Binding | None = None,
    ) -> None:
        """The transfer's KV is computed in `block_ids`; `on_free(transfer_id)` is called once they may be reused.

        Push: the writer WRITEs this rank's share as soon as it holds the assignment (at once if it already
        does); raises `BlockRangeError` for ids outside the registered regions, and ValueError on the registering
        rank for a transfer it never claimed (its blocks would wait for an assignment that cannot come; parts
        handed for it with `ready_part` are freed). A transfer that ended (aborted, or its claim refused) is
        freed at once. `prompt_tokens` (the tokens the blocks hold, from the first) is needed when the consumer's
        block size differs. Pull (needs `serve_reads`, rank 0): MarkSourcesReady is sent (batched), with the
        router's `binding` in case it claims; a refused item is not raised but logged, and the blocks freed.
        """
        writer, ready = self._writer, self._ready
        assert writer is not None, "the agent is not started"
        source = _Source(on_free, TransferMode(mode), time.monotonic())
        if source.mode is TransferMode.PULL:
            if self._server is None or ready is None:
                raise ValueError("pull mode needs a registering ProducerAgent created with serve_reads=True")
            self._sources[transfer_id] = source
            self._server.set_expecting(True)
            future = ready.submit(SourceReadySpec(transfer_id, [int(b) for b in block_ids], binding))
            future.add_done_callback(lambda f: self._pull_source_marked(transfer_id, f))
            return
        self._check_claimed(transfer_id)
        writer.source_ready(transfer_id, block_ids)  # validates first: nothing is recorded if it raises
        earlier = self._sources.get(transfer_id)
        if on_free is None and earlier is not None:
            source.on_free = earlier.on_free  # given with a part
        self._sources[transfer_id] = source
        about = tracing.about(transfer_id=transfer_id, engine_id=self.engine_id, rank=self.rank)
        span = self._writing[transfer_id] = tracing.start("producer.write", about)
        early = self._assigned.get(transfer_id)
        if early is not None:  # the assignment came before the KV was ready: the span says so at its start
            span.add_event("assigned", tracing.about(generation=early[1]))
        self._prompt_tokens[transfer_id] = prompt_tokens or self._prompt_tokens.get(transfer_id, 0)
        deferred = self._deferred.pop(transfer_id, None)
        if deferred is not None:
            self._assign(deferred)
        if not self.leader and transfer_id not in self._assigned:
            check = asyncio.get_running_loop().create_task(self._check_source(transfer_id, source))
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)

    async def _check_source(self, transfer_id: str, source: _Source) -> None:
        """A following rank holds a source until the transfer's events end it; should rank 0's claim have been
        refused (the transfer ended before prefill claimed it), none comes: so it asks every `follower_check_s`
        until an assignment came, and frees the source once the transfer is not this engine's to write. Nor does
        one come when its TRANSFER_ABORTED was lost with the watch (a resync): a generation the service still
        fences for this rank is then revoked, and so acknowledged, as that event would have."""
        while True:
            await asyncio.sleep(self._follower_check_s)
            if self._sources.get(transfer_id) is not source or transfer_id in self._assigned:
                return  # freed, or its events flow
            try:
                info = await self.engine_session.client.get_transfer(transfer_id)
            except NotFound:
                self._end(transfer_id)
                return
            except RendezvousError as e:  # the service is slow or away: that says nothing of the transfer
                logger.warning("transfer %s: checking on it failed, looking again later: %s", transfer_id, e)
                continue
            if info.producer_engine_id != self.engine_id or info.state.terminal:
                if info.producer_engine_id == self.engine_id and info.revoking_generation:
                    self._revoke(transfer_id, info.revoking_generation)
                self._end(transfer_id)
                return

    def ready_part(
        self,
        transfer_id: str,
        block_ids: BlockIds,
        num_computed_tokens: int,
        layers: tuple[int, int] | None = None,
        *,
        prompt_tokens: int = 0,
        on_free: OnFree | None = None,
        kv_ready: KvReady = COMPLETE,
    ) -> None:
        """Push only: the prompt's first `num_computed_tokens` tokens are computed in model layers `[first, end)`
        (None = all) in `block_ids`, the prompt's blocks so far, or will be once `kv_ready` is done (recorded on
        the compute stream where the engine calls this: `rendezvous.clients.nixl.device`); `ready` still follows once
        all is computed.

        Layer-wise prefill calls this once per layer, chunked prefill once per chunk. When the consumer accepts
        parts, this rank's writer posts what is new at once (`TransferWriter.source_part`, which needs the
        prompt's length: pass `prompt_tokens`); else the write waits for `ready`. `on_free` (or the one given
        to `ready`) is called once the blocks may be reused, also when the transfer ends before `ready`.
        """
        writer = self._writer
        assert writer is not None, "the agent is not started"
        writer.source_part(
            transfer_id, block_ids, num_computed_tokens, layers, prompt_tokens=prompt_tokens, kv_ready=kv_ready
        )
        if on_free is not None and transfer_id not in self._sources:
            self._sources[transfer_id] = _Source(on_free, TransferMode.PUSH, time.monotonic())
        if prompt_tokens and not self._prompt_tokens.get(transfer_id):
            self._prompt_tokens[transfer_id] = prompt_tokens
            deferred = self._deferred.pop(transfer_id, None)
            if deferred is not None:
                self._assign(deferred)

    def stop_writing(self, transfer_id: str) -> None:
        """Drop the transfer from this rank's writer now, without telling the service (`abort` does): its parts
        not posted yet never are, a WRITE of it posted before drains, a later `ready_part` is ignored and a later
        `ready` freed at once. For an engine whose source blocks are freed or reused at once (vLLM preempted the
        request after parts of it were handed over, or it ended without `ready`). Unlike the rest of the agent, it
        may be called from any thread: the writer takes it in order with the parts handed before and after."""
        writer = self._writer
        assert writer is not None, "the agent is not started"
        with contextlib.suppress(RuntimeError):  # stopped: nothing is posted any more
            writer.abort(transfer_id)

    def _check_claimed(self, transfer_id: str) -> None:
        """Only a claim brings the assignment a pushed source waits for: refuse a registering rank's source of a
        transfer it never claimed, rather than hold its blocks forever, and free the parts handed for it.
        (Following ranks do not claim. `ready_part` is not checked: a connector may hand a part while its claim,
        sent at admission, is still queued on the loop.)"""
        if self.leader and transfer_id not in self._claimed:
            self._end(transfer_id)
            raise ValueError(
                f"transfer {transfer_id} was never claimed by this engine: claim() it at admission, before ready();"
                " its blocks would wait for an assignment that cannot come"
            )

    async def abort(self, transfer_id: str, message: str = "") -> ItemResult:
        """Abort a transfer (e.g. the request was cancelled); its source is freed once no write is in flight.
        Rank 0 tells the service (and so every rank); another rank only drops it here. A refused item is
        returned, not raised (and changes nothing); a refused call raises."""
        if not self.leader:
            self._end(transfer_id)
            return ItemResult(transfer_id, TransferState.ABORTED)
        (result,) = await self.session.abort_transfers((AbortSpec(transfer_id, message),))
        if result.ok:
            self._end(transfer_id)
        return result

    # Events (on the loop)

    async def handle_event(self, item: SessionEvent) -> None:
        """React to one session event; the session calls this for each, in order."""
        if isinstance(item, Resynced):
            listed = {t.transfer_id: t for t in item.transfers}  # live transfers only: none RELEASED or ABORTED
            asserted = self.engine_session.live_transfers  # what a call asserted while the listing was read is kept
            held = self._sources.keys() | self._assigned.keys() | self._deferred.keys()
            # And its claims the listing lacks: one claimed before its KV is computed is held nowhere here yet, its
            # TRANSFER_ASSIGNED and TRANSFER_ABORTED lost alike (a generation fenced, and a later `ready` held).
            unlisted = [t for t in (held | set(item.unlisted)) - listed.keys() if t not in asserted]
            for info in listed.values():
                if info.state is TransferState.COMMITTED:  # pull: the consumer read the source; push: it was written
                    self._end(info.transfer_id)
                else:
                    await self._assign_missed(info)
            # Asked while the handler waits: the events that follow the listing come after what it finds.
            await asyncio.gather(*(self._end_unlisted(transfer_id) for transfer_id in unlisted))
            return
        if isinstance(item, Reregistered):
            await self._drop_replaced(item)
            for result in item.results:  # COMMITTED too: the write was, or the consumer read it
                if not result.ok or result.state.terminal or result.state is TransferState.COMMITTED:
                    self._end(result.transfer_id)
            return
        self._on_server_event(item)

    async def _drop_replaced(self, item: Reregistered) -> None:
        """The engine registered a new incarnation: what was assigned to the replaced one is not written (the
        service forgot it or no longer fences it: a consumer may have reused the blocks it names), nor reported;
        the service assigns a transfer again to the new incarnation if it matches it again, and ends it otherwise
        (a claim waits for its target under its deadline). A generation written in parts when the re-registration
        began fails (the fence stopped it). The handler returns, and the session opens the fence on the new lease,
        only once the writer dropped them, behind whatever was handed to it before."""
        self._deferred.clear()
        self._assigned.clear()
        writer = self._writer
        if writer is None or writer.stopped:
            return
        why = (
            f"engine {self.engine_id} re-registered (incarnation {item.previous_incarnation} replaced by"
            f" {item.incarnation}) while this generation was written in parts: not writing the rest"
        )
        with contextlib.suppress(RuntimeError):  # stopped meanwhile: nothing is posted any more
            await asyncio.to_thread(writer.drop_assignments, why)

    async def _end_unlisted(self, transfer_id: str) -> None:
        """A transfer this rank holds a source or an assignment of, or claimed (`Resynced.unlisted`), which a resync's
        listing lacks: it ended while the watch was away (the listing holds live transfers only), or was claimed after
        the listing was read. The service's record says which: ended, it ends here as its TRANSFER_ABORTED or
        TRANSFER_COMMITTED would have ended it, revoking (and so acknowledging) a generation the service still fences,
        without which the consumer's blocks would stay fenced, and a later `ready` is freed at once. Unanswered, it
        ends all the same, unacknowledged."""
        try:
            info = await self.engine_session.client.get_transfer(transfer_id)
        except NotFound:
            self._end(transfer_id)
            return
        except RendezvousError as e:
            logger.warning("transfer %s ended while the watch was away; asking how failed: %s", transfer_id, e)
            self._end(transfer_id)
            return
        mine = info.producer_engine_id == self.engine_id
        if mine and not info.state.terminal and info.state is not TransferState.COMMITTED:
            return  # live: its events follow the listing's
        if mine and info.revoking_generation:
            self._revoke(transfer_id, info.revoking_generation)
        self._end(transfer_id)

    async def _assign_missed(self, info: TransferInfo) -> None:
        """A push transfer matched to this engine in a resync's listing: its TRANSFER_ASSIGNED may be among the
        events the watch lost, so it is assigned again from the listing and the consumer's record (the writer
        ignores a generation it has; a consumer gone since is a loss, which aborts the transfer)."""
        if info.state is not TransferState.MATCHED or info.mode is not TransferMode.PUSH:
            return
        known = self._assigned.get(info.transfer_id)
        if info.producer_engine_id != self.engine_id or (known is not None and known[1] >= info.generation):
            return
        peer = await self._peer_after_resync(info.consumer_engine_id, info.consumer_incarnation, info.transfer_id)
        if peer is not None:
            self._on_server_event(Event(EventType.TRANSFER_ASSIGNED, time.time(), info, info.generation, peer))

    def _on_server_event(self, event: ServerEvent) -> None:
        writer, info = self._writer, event.transfer
        assert writer is not None
        if writer.stopped:  # closing: the session still delivers events until it ends; nothing is left to do
            return
        if event.type is EventType.PEER_LOST and event.peer is not None:
            for agent in event.peer.agents:
                writer.forget_peer(agent.name, event.peer.incarnation)
            return
        if info is None:
            return
        transfer_id = info.transfer_id
        match event.type:
            case EventType.TRANSFER_ASSIGNED:
                self._assign(event)
            case EventType.TRANSFER_REVOKED:
                self._drop_deferred(transfer_id, event.generation)
                self._revoke(transfer_id, event.generation)
            case EventType.TRANSFER_ABORTED:
                if info.revoking_generation:
                    self._revoke(transfer_id, info.revoking_generation)
                self._end(transfer_id)
            case EventType.TRANSFER_COMMITTED:  # pull: the consumer read the blocks
                self._end(transfer_id)

    def _revoke(self, transfer_id: str, generation: int) -> None:
        """Revoke `generation` in the writer, noting whose revocation its ack answers: the incarnation whose events
        the handler is taking (a revoked WRITE in flight may drain, and be acknowledged, after a Reregistered).

        A revocation of a generation whose ack has not come yet (TRANSFER_REVOKED, then TRANSFER_ABORTED still
        fencing it, while its WRITE drains) is not handed to the writer again: it would change nothing there (the
        generation is fenced already), and the writer acknowledges the two once when the WRITE drains meanwhile, which
        left one noted revoker for ever. The one ack answers both, as the newer revoker: either both are one
        incarnation, or the older one was replaced, and its ack would be dropped unsent (STALE_INCARNATION), while
        the newer may be current, and the service fences the generation until it hears that ack."""
        assert self._writer is not None
        key = (transfer_id, generation)
        if key not in self._revoked_by:
            self._writer.revoke(transfer_id, generation)
        self._revoked_by[key] = self.engine_session.events_incarnation

    def _drop_deferred(self, transfer_id: str, generation: int) -> None:
        """A held assignment of `generation` or older is revoked: it must never reach the writer."""
        deferred = self._deferred.get(transfer_id)
        if deferred is not None and deferred.generation <= generation:
            del self._deferred[transfer_id]

    def _assign(self, event: ServerEvent) -> None:
        writer, info, peer = self._writer, event.transfer, event.peer
        assert writer is not None and info is not None
        self._assigned.setdefault(info.transfer_id, (time.monotonic(), event.generation))
        self._writing.get(info.transfer_id, tracing.NO_SPAN).add_event(
            "assigned", tracing.about(generation=event.generation)
        )
        if peer is None:
            self._write_finished(info.transfer_id, event.generation, False, "the assignment names no consumer")
            return
        prompt_tokens = self._prompt_tokens.get(info.transfer_id)
        if prompt_tokens is None and peer.layout.block_size != self.layout.block_size:
            self._deferred[info.transfer_id] = event  # blocks of different sizes pair by token: wait for `ready`
            return
        consumer = ConsumerEngine(peer.layout, peer.agents)
        writer.assign(
            info.transfer_id,
            event.generation,
            consumer,
            peer.incarnation,
            info.target_block_ids,
            prompt_tokens=prompt_tokens or 0,
            target_tokens=info.num_tokens,
            progressive=info.progressive,
        )

    def _end(self, transfer_id: str) -> None:
        """The transfer is over for this producer: drop it from the writer, free a pull source."""
        self._assigned.pop(transfer_id, None)
        self._prompt_tokens.pop(transfer_id, None)
        self._deferred.pop(transfer_id, None)
        source = self._sources.get(transfer_id)
        if source is not None and source.mode is TransferMode.PULL:
            self._free(transfer_id)
        elif self._writer is not None:
            with contextlib.suppress(RuntimeError):  # stopped: it freed every source already
                self._writer.abort(transfer_id)

    # Writer callbacks, run on the loop

    def _write_finished(
        self, transfer_id: str, generation: int, ok: bool, error: str | None, parts: tuple[WrittenPart, ...] = ()
    ) -> None:
        written = time.monotonic()
        source = self._sources.get(transfer_id)
        ready_time = source.ready_time if source is not None else 0.0
        assigned, _ = self._assigned.pop(transfer_id, (0.0, 0))
        outcome = CompletionOutcome.SUCCEEDED if ok else CompletionOutcome.FAILED
        session = self.engine_session
        assigned_to = session.events_incarnation  # the assignment came before any Reregistered not taken yet
        completions = self._completions_of(assigned_to)
        span = self._writing.pop(transfer_id, tracing.NO_SPAN)
        span.set_attribute("kv_rendezvous.generation", generation)
        span.set_attribute("kv_rendezvous.ok", ok)
        with tracing.activate(span):  # CompleteTransfers is its child
            spec = CompletionSpec(transfer_id, generation, outcome, error or "", (self.rank,), parts if ok else ())
            future = completions.submit(spec)
        span.end()
        times = (ready_time, assigned, written)
        future.add_done_callback(lambda f: self._completed(transfer_id, generation, ok, error, times, parts, f))
        if not ok and session.is_current(assigned_to):
            self._end(transfer_id)  # the service aborts it: let go of the source
        # Else the assignment was the replaced incarnation's, which the service ended or forgot (the report is not
        # sent): the source is kept for the new incarnation, which the service assigns the transfer to again if it
        # matches it again, and ends otherwise (`Reregistered.results`, a claim's deadline).

    def _completed(
        self,
        transfer_id: str,
        generation: int,
        ok: bool,
        error: str | None,
        times: tuple[float, float, float],
        parts: tuple[WrittenPart, ...],
        future: asyncio.Future[ItemResult],
    ) -> None:
        log_refusal("CompleteTransfers", transfer_id, generation, future)
        if ok and not stale(future) and self._writer is not None:
            # Answered (committed, refused, or the call failed): the writer frees the source it kept, unless it took
            # a newer generation or a Reregistered dropped this one since. Dropped unsent (STALE_INCARNATION), it is
            # kept for the new incarnation's assignment of the transfer, which the writer takes as new.
            with contextlib.suppress(RuntimeError):  # stopped: it freed every source already
                self._writer.release(transfer_id, generation)
        if self._on_report is not None:
            self._on_report(WriteReport(transfer_id, generation, ok, error, *times, time.monotonic(), parts))

    def _write_revoked(self, transfer_id: str, generation: int) -> None:
        self._assigned.pop(transfer_id, None)
        session = self.engine_session
        # Each revocation handed to the writer is acknowledged once (`_revoke` hands one generation once at a time).
        revoked_to = self._revoked_by.pop((transfer_id, generation), session.events_incarnation)
        send = functools.partial(session.acknowledge_revocations, revoked_to=revoked_to)
        acks = batcher_of(self._acks, revoked_to, "AcknowledgeRevocations", send)
        future = acks.submit(RevocationAck(transfer_id, generation, (self.rank,)))
        future.add_done_callback(functools.partial(log_refusal, "AcknowledgeRevocations", transfer_id, generation))

    def _source_free(self, transfer_id: str) -> None:
        self._free(transfer_id)

    def _free(self, transfer_id: str) -> None:
        self._writing.pop(transfer_id, tracing.NO_SPAN).end()  # freed unwritten (aborted, revoked)
        source = self._sources.pop(transfer_id, None)
        if self._server is not None and source is not None and source.mode is TransferMode.PULL:
            self._server.set_expecting(any(s.mode is TransferMode.PULL for s in self._sources.values()))
        if source is not None and source.on_free is not None:
            try:
                source.on_free(transfer_id)
            except Exception:
                logger.exception("on_free(%s) raised", transfer_id)

    def _pull_source_marked(self, transfer_id: str, future: asyncio.Future[ItemResult]) -> None:
        result = None if future.cancelled() or future.exception() else future.result()
        if result is None or not result.ok or result.state in (TransferState.ABORTED, TransferState.RELEASED):
            logger.warning("MarkSourcesReady %s: %s", transfer_id, "failed" if result is None else result)
            self._free(transfer_id)
