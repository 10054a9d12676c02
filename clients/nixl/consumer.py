"""`ConsumerAgent`: one consumer (decode) rank's side of the data plane, wired to the rendezvous service.

It registers the rank's KV tensors with NIXL and announces the agent through engine registration. The engine
registers destination blocks (`register_target`, batched per loop turn) and learns how each transfer ended
from `results()` (or the `on_result` callback), as `TransferResult`s:

- ok: the generation's bytes are in its blocks. Push: the first of the NIXL notification "T:g" and the
  TRANSFER_COMMITTED event says so; notifications of other generations are ignored (fencing). A progressive
  target (written in parts) arrives on the first of the part notification that completes its tiling
  (`rendezvous.clients.nixl.arrival`: each sender's parts tile its share, as the service checks them) and
  TRANSFER_COMMITTED (the service commits once the parts the producer reports tile the target); a whole-write
  notification is not arrival for it, and notifications that cannot tile it (overlapping, outside) leave it to the
  commit, so decode never starts on missing bytes. Pull: on SOURCE_READY the agent READs the producer's blocks itself,
  then reports CompleteTransfers as the incarnation the SOURCE_READY was sent to; the bytes arrive once the service
  took the report (or the call went unanswered: the report is then sent again while the service has the generation
  MATCHED). A READ that ends after a re-registration (or whose report is
  refused as the replaced incarnation's) is not reported as the new one: the new incarnation's SOURCE_READY is read
  again. A report answered with the transfer ended (aborted while it was read: its producer may have reused the
  source) is no arrival: the result fails as the abort says, whichever of the answer and TRANSFER_ABORTED comes
  first; another refusal fails it LOST.
- failed: the transfer aborted (`reason` is its `AbortReason`) or the agent saw it fail (an `AgentReason`: a READ
  failed, or the service lost the transfer). When the service still fences a generation the producer may be
  writing (`revoking_generation`), the result waits for REVOCATION_CONFIRMED: once it is reported, no byte of
  that generation can land in its blocks. So do the transfers an incarnation of this engine lost (its lease lapsed,
  e.g. the process hung): after `Reregistered` (and after a `Resynced`) the agent asks the service, since a WRITE
  posted before the hang may still land once the process runs again. A resync's listing holds live transfers only:
  the agent asks the service about each target it lacks (ended while the watch was away) and ends it as the
  service's record says (ok when committed, released since; failed as an abort says; LOST when forgotten). So it
  does about each target a re-registration re-asserted and found committed, released or aborted (its event went to
  the replaced incarnation).
- REVOKED (`AgentReason.REVOKED`): registering a newer generation of a transfer retires the older one; its blocks
  are reported free the same way, once no write of it can land.

The release contract: the agent releases every committed transfer itself (ReleaseTargets, once TRANSFER_COMMITTED
came, in pull mode too when another rank's READ's report committed it; or once its own report committed it); the
engine never calls ReleaseTargets for a transfer it registered through the agent. An ok result's blocks
are the engine's to read and then reuse; a failed or REVOKED result's are free at once. To give a transfer up
before its result, `abort` it (its failed result still comes, once no write can land).

A background `ReceiverThread` owns NIXL. Everything public runs on the event loop the agent was started on, and
so do `on_result` and every `results()` item: never on the receiver thread.

A rank of a multi-rank engine reports its own share: ok once every producer rank writing into it notified
(or on TRANSFER_COMMITTED). Another rank's share may still fail (the transfer then aborts), so an engine treats a
transfer as arrived only once every rank reported ok, as vLLM does with its workers' results. Rank 0 registers,
aborts and releases for the engine; the other ranks only expect their share (`register_target` answers TARGETED
at once). A following rank may hear of a commit before it expects the transfer or that generation of it (its
worker lagged behind rank 0's registration): it remembers the last `EARLY_COMMITS` such commits, so the expectation
ends at once, and so it does of pull sources ready (SOURCE_READY) of a generation it did not expect yet, read once
it does (`_read_early`); and it asks the service every `follower_check_s` (default `FOLLOWER_CHECK_S`) about a
transfer it has heard nothing of.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Unpack

from rendezvous.clients._memo import remember
from rendezvous.clients._roles import ConsumerSession
from rendezvous.clients._session import RankSession
from rendezvous.clients._types import (
    AbortReason,
    AbortSpec,
    Binding,
    CompletionOutcome,
    CompletionSpec,
    EngineCapacity,
    EventType,
    ItemResult,
    NixlAgentInfo,
    ReleaseSpec,
    Reregistered,
    Resynced,
    ServerEvent,
    SessionEvent,
    TargetSpec,
    TransferInfo,
    TransferMode,
    TransferState,
)
from rendezvous.clients.aio import AsyncRendezvousClient
from rendezvous.clients.nixl.agent import NixlEndpoint
from rendezvous.clients.nixl.arrival import PartsArrival
from rendezvous.clients.nixl.batching import Batcher, log_refusal
from rendezvous.clients.nixl.integrity import HashJob, LandedDigests, block_digests, scope_digests, scope_gaps
from rendezvous.clients.nixl.notifications import DigestScope, TransferNotification
from rendezvous.clients.nixl.plan import RankGeometry
from rendezvous.clients.nixl.polling import PollConfig
from rendezvous.clients.nixl.producer import agent_for_rank
from rendezvous.clients.nixl.rank import FOLLOWER_CHECK_S, RankAgent, RankOptions
from rendezvous.clients.nixl.receiver import TransferReceiver
from rendezvous.clients.nixl.receiver_thread import ReceiverThread
from rendezvous.clients.nixl.regions import KvRegion, MemoryKind
from rendezvous.protocol import kvmap
from rendezvous.protocol.errors import (
    Cancelled,
    DeadlineExceeded,
    NotFound,
    Reason,
    RendezvousError,
    Unavailable,
    Unknown,
)
from rendezvous.protocol.events import Event

if TYPE_CHECKING:
    import torch

__all__ = ["AgentReason", "ConsumerAgent", "OnResult", "TransferResult"]

logger = logging.getLogger(__name__)

_IN_DOUBT = (DeadlineExceeded, Unavailable, Cancelled, Unknown)
"""Failures of a call that say nothing of whether the service applied it."""
ABORT_IN_DOUBT_S = 60.0
"""How long an agent tries to abort a transfer whose registration is in doubt, when it has no timeout of its own."""
_ARRIVED = frozenset({TransferState.COMMITTED, TransferState.RELEASED})
_ENDED = _ARRIVED | {TransferState.ABORTED}
_TAKEN = _ARRIVED | {TransferState.MATCHED}
"""What a READ's SUCCEEDED may answer when the service took it: MATCHED while other ranks' shares are to come."""
EARLY_COMMITS = 4096
"""How many commits (and ready pull sources) of transfers it did not expect (yet) a following rank remembers."""
DIGESTS_AFTER_COMMIT_S = 10.0
"""How long a target to be checked, committed before all of its digests came (their notifications trail the commit,
or the number of producer ranks writing it is unknown), waits for the rest before it is checked with what came."""


class AgentReason(StrEnum):
    """Why a `TransferResult` failed when the service did not abort the transfer: what the agent saw itself."""

    REVOKED = "REVOKED"
    """A newer generation of the transfer retired this one."""
    READ_FAILED = "READ_FAILED"
    """A pull-mode READ of the producer's blocks failed."""
    LOST = "LOST"
    """The service no longer has the transfer (or the engine's registration of it failed, or it refused a pull READ's
    report: the bytes read are not to be trusted)."""
    CORRUPTED = "CORRUPTED"
    """The bytes in the blocks do not match the digests the producer sent (`rendezvous.clients.nixl.integrity`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TransferResult:
    """How one generation of a transfer ended for the consumer; its `block_ids` are the engine's again."""

    transfer_id: str
    generation: int
    ok: bool
    block_ids: tuple[int, ...]
    reason: AbortReason | AgentReason = AbortReason.UNSPECIFIED
    """`AbortReason.UNSPECIFIED` (falsy) when ok; else the transfer's `AbortReason`, or an `AgentReason`."""
    message: str = ""


OnResult = Callable[[TransferResult], None]


@dataclasses.dataclass(eq=False)
class _Target:
    generation: int
    block_ids: tuple[int, ...]
    mode: TransferMode
    parts: PartsArrival | None = None  # progressive: arrives once its part notifications tile it (or on the commit)
    arrived: bool = False
    senders: set[str] = dataclasses.field(default_factory=set)  # producer agents whose notification came
    tokens: int = 0  # the target's tokens, when its registration said
    digests: tuple[int, ...] = ()  # integrity: what the producer says its blocks hold, checked before arrival
    scoped: dict[str, tuple[DigestScope, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    """Integrity: per sender that wrote only some of the target's bytes, what its digests cover and them."""
    checking: bool = False  # the digests are being checked: neither a notification nor the commit is arrival
    committed: bool = False  # TRANSFER_COMMITTED came while checking
    corrupted: str = ""  # the check failed: why
    landed: LandedDigests | None = None  # integrity, in parts: its blocks hashed as the parts land
    hashing: asyncio.Task[None] | None = None  # the last of `landed`'s hash jobs handed to a thread, in order
    watched: bool = False  # the service is asked about it every `follower_check_s` until it ends
    unanswered: tuple[int, int] | None = None
    """Pull: the incarnation as which its READ's SUCCEEDED was sent, while that call went unanswered."""


class _Closed:
    pass


class ConsumerAgent(RankAgent[ConsumerSession]):
    """One consumer rank: NIXL endpoint + receiver thread + engine session. `start()`, then `close()`."""

    session_type = ConsumerSession

    def __init__(
        self,
        client: AsyncRendezvousClient,
        engine_id: str,
        pool: str,
        tensors: Sequence[torch.Tensor],
        *,
        poll: PollConfig | None = None,
        on_result: OnResult | None = None,
        follower_check_s: float = FOLLOWER_CHECK_S,
        capacity: EngineCapacity | None = None,
        integrity: bool = False,
        digests_after_commit_s: float = DIGESTS_AFTER_COMMIT_S,
        **options: Unpack[RankOptions],
    ) -> None:
        """`options`: those of every rank agent (`RankOptions`: agent_name, rank, layout, labels, lease_ttl,
        session_config, metrics_registry). `layout` is required and must state the model_fingerprint and
        num_layers (ValueError otherwise): the service compares it with each producer's before a byte is written,
        and a consumer without one would take any producer whose layout is as empty.

        `on_result(result)` (else `results()`) runs on the event loop the agent was started on; `poll` sets how
        the receiver thread polls NIXL; `follower_check_s` how often a following rank asks the service about a
        transfer it heard nothing of (and any rank about a pull READ whose report went unanswered, sent again while
        the service has it MATCHED); `capacity` what the engine admits at once (routers reserve within it).
        `integrity`: every pushed transfer must come with the producer's digests (`rendezvous.clients.nixl.integrity`,
        its writer's `WriterConfig.integrity`), checked before it counts as arrived; without, it fails
        (`AgentReason.CORRUPTED`). Digests that come are checked either way. A target to be checked that is
        committed before all its digests came waits `digests_after_commit_s` for the rest, then is checked with
        what came.
        """
        super().__init__(client, engine_id, pool, tensors, capacity=capacity, **options)
        self.stale_notifications = 0
        """Notifications ignored: for a generation or transfer no longer expected, or a whole-write one for a
        progressive target."""
        self.disputed_targets = 0
        """Progressive targets whose part notifications could not tile them (they arrive on the commit only)."""
        self._poll = poll
        self._on_result = on_result
        self._follower_check_s = follower_check_s
        self._integrity = integrity
        self._digests_after_commit_s = digests_after_commit_s
        self._late_checks: dict[str, asyncio.TimerHandle] = {}  # committed targets waiting for their digests
        self._held = range(self.layout.num_layers)  # the model layers this rank holds (its stage's), once open
        self._thread: ReceiverThread | None = None
        self._results: asyncio.Queue[TransferResult | _Closed] = asyncio.Queue()
        self._targets: dict[str, _Target] = {}
        self._fenced: dict[tuple[str, int], TransferResult] = {}
        self._reading: dict[tuple[str, int], tuple[int, int]] = {}
        """Pull READs not over, by the incarnation whose SOURCE_READY they answer: in flight (their blocks are still
        written), or done and their SUCCEEDED not answered yet (the bytes arrive once it is taken)."""
        self._after_read: dict[tuple[str, int], TransferResult] = {}  # results waiting for our READ to be over
        self._read_again: dict[tuple[str, int], ServerEvent] = {}  # a newer incarnation's SOURCE_READY, waiting too
        self._checks: set[asyncio.Task[None]] = set()  # following ranks' checks of their expectations, digest checks
        self._regions: tuple[KvRegion, ...] = ()  # this rank's, once open (digest checks read them)
        self._shape: kvmap.RankShape | None = None  # this rank's, once open (where each layer's regions are)
        self._early_commits: OrderedDict[str, int] = OrderedDict()  # following ranks: commits heard before expected
        self._early_sources: OrderedDict[str, tuple[ServerEvent, tuple[int, int]]] = OrderedDict()
        """Following ranks: SOURCE_READY of a generation heard before it was expected, with the incarnation it was
        sent to (`_read_early`)."""
        self._registrations: Batcher[TargetSpec] | None = None
        self._releases: Batcher[ReleaseSpec] | None = None

    # Lifecycle

    async def _open(self) -> NixlAgentInfo:
        """Register the tensors with NIXL and start the receiver thread."""
        receiver = TransferReceiver(NixlEndpoint.from_tensors(self._agent_name, self._tensors), self._poll)
        self._thread = ReceiverThread(
            receiver,
            on_notifications=self._stamped(self._notified),
            on_read_done=self._stamped(self._read_done),
            poll=self._poll,
        )
        self._thread.start()
        agent = self._thread.agent_info(self.rank)
        if self._integrity and agent.memory_kind is not MemoryKind.DRAM:
            await self._stop_threads()
            raise ValueError("integrity checks read host memory: DRAM regions only")
        self._regions = agent.regions if agent.memory_kind is MemoryKind.DRAM else ()
        try:  # regions not grouped by layer hold every layer, as one
            self._shape = kvmap.rank_shape(self.layout, agent)
            self._held = self._shape.layers or range(self.layout.num_layers)
        except kvmap.ShapeError:  # the service refuses such a layout at registration
            self._held = range(self.layout.num_layers)
        return agent

    def _stamped(self, callback: Callable[..., None]) -> Callable[..., None]:
        """callback on the loop, given as its last argument when the receiver thread called it (time.monotonic()):
        the arrival of what it reports, for the arrival-to-result histogram."""
        hop = self._on_loop(callback)
        return lambda *args: hop(*args, time.monotonic())

    def _on_session(self, session: ConsumerSession | RankSession) -> None:
        if isinstance(session, ConsumerSession):
            self._registrations = Batcher("RegisterTargets", session.register_targets)
            self._releases = Batcher("ReleaseTargets", session.release_targets)

    async def _stop_threads(self) -> None:
        if self._thread is not None:
            await asyncio.to_thread(self._thread.stop)

    async def close(self, *, deregister: bool = True) -> None:
        """Stop the receiver thread (reads in flight finish), end the session and `results()`."""
        for check in list(self._checks):
            check.cancel()
        for late in self._late_checks.values():
            late.cancel()
        self._late_checks.clear()
        await self._stop_threads()
        await self._finish_calls((self._registrations, *self._completions.values(), self._releases))
        await self._close_session(deregister)
        self._results.put_nowait(_Closed())

    # Engine API

    async def register_target(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        generation: int = 1,
        *,
        mode: TransferMode = TransferMode.PUSH,
        timeout: float = 0.0,
        num_tokens: int = 0,
        binding: Binding | None = None,
        progressive: bool = False,
    ) -> ItemResult:
        """Register destination blocks (batched with the other registrations of this loop turn).

        `binding` is the router's binding of the transfer to this engine (`Binding.from_params` of the
        request's `kv_transfer_params`), which a service with binding keys checks. `progressive`: the producer
        may write the KV in parts while it computes (it needs `num_tokens`); the target then arrives once the
        part notifications tile it, or on TRANSFER_COMMITTED, once the service checked the parts reported.

        A newer generation of a transfer retires the older one: its blocks are reported (reason `AgentReason.REVOKED`)
        once no write of it can land. A failed item is returned, not raised, and leaves nothing registered. A
        call that fails in transit may have been applied: it is sent once more, and should that fail too the
        agent aborts the transfer, whose failed `TransferResult` then comes as well, once no write can land
        (`awaiting_result` says whether it is still to come).
        On a following rank of a multi-rank engine the registration is rank 0's: this rank only expects its
        share of the bytes into `block_ids` (the same ids on every rank) and answers TARGETED.
        """
        spec = TargetSpec(
            transfer_id,
            tuple(int(b) for b in block_ids),
            generation=generation,
            num_tokens=num_tokens,
            timeout=timeout,
            mode=mode,
            binding=binding,
            progressive=progressive,
        )
        if not self.leader:
            target = self._target(spec)
            self._targets[transfer_id] = target
            self._update_expecting()
            if self._early_commits.pop(transfer_id, None) == generation:
                self._committed(transfer_id, generation)
            else:
                self._watch_target(transfer_id, target)
                self._read_early(transfer_id, target)
            return ItemResult(transfer_id, TransferState.TARGETED)
        assert self._registrations is not None, "the agent is not started"
        old = self._targets.get(transfer_id)
        new = self._target(spec)
        if old is not None and generation <= old.generation:
            old = None  # a repeat (or a stale one, which the service refuses)
        else:
            self._targets[transfer_id] = new  # first: a notification may come before the answer
            self._update_expecting()
        try:
            result = await self._submit_target(spec)
        except BaseException:
            self._undo_register(transfer_id, new, old)
            raise
        if not result.ok or result.state is TransferState.ABORTED:
            self._undo_register(transfer_id, new, old)
        elif old is not None:
            retired = TransferResult(transfer_id, old.generation, False, old.block_ids, AgentReason.REVOKED)
            await self._when_unfenced(retired, maybe_fenced=result.state is not TransferState.TARGETED)
        return result

    def _target(self, spec: TargetSpec) -> _Target:
        parts = PartsArrival(spec.num_tokens, self._held) if spec.progressive else None
        target = _Target(spec.generation, tuple(spec.block_ids), TransferMode(spec.mode), parts, tokens=spec.num_tokens)
        if parts is not None and self._integrity and self._shape is not None:  # else hashed at arrival
            bs = self.layout.block_size
            target.landed = LandedDigests.of(self._regions, self._shape, target.block_ids, bs, spec.num_tokens)
        return target

    async def _submit_target(self, spec: TargetSpec) -> ItemResult:
        """Send the registration. A call that failed in transit (`_IN_DOUBT`) may still have been applied, and a
        producer may be writing into the blocks: so it is sent again (the same blocks again are harmless), and if
        that fails too the transfer is aborted before a failed item is returned."""
        assert self._registrations is not None
        try:
            return await self._registrations.submit(spec)
        except _IN_DOUBT as e:
            logger.warning("RegisterTargets %s: %s; registering again", spec.transfer_id, e)
        try:
            return await self._registrations.submit(spec)
        except _IN_DOUBT as e:
            logger.warning("RegisterTargets %s: %s again; aborting the transfer", spec.transfer_id, e)
            await self._abort_in_doubt(spec.transfer_id, spec.timeout, f"its registration failed in transit: {e}")
            return ItemResult(spec.transfer_id, TransferState.ABORTED, e)

    async def _abort_in_doubt(self, transfer_id: str, timeout: float, message: str) -> None:
        """Abort a transfer whose registration may stand, until the service answers (its failed result comes once
        no write can land), the transfer ends otherwise, or its deadline passed: the service has ended it then,
        and its end comes through the session's events."""
        deadline = time.monotonic() + (timeout or ABORT_IN_DOUBT_S)
        delay = 0.05
        while transfer_id in self._targets and time.monotonic() < deadline:
            try:
                refused = (await self.abort(transfer_id, message)).error
            except _IN_DOUBT as e:
                logger.warning("AbortTransfers %s: %s; trying again", transfer_id, e)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            except RendezvousError as e:
                refused = e
            if refused is not None:  # answered: the registration did not stand, or the transfer ended
                await self._give_back(transfer_id, f"{message}; {refused}")
            return

    def awaiting_result(self, transfer_id: str) -> bool:
        """Whether a `TransferResult` of this transfer is still to come: its blocks are expected, or its failure
        waits for the service to stop fencing a generation."""
        return transfer_id in self._targets or any(key[0] == transfer_id for key in self._fenced)

    def _watch_target(self, transfer_id: str, target: _Target) -> None:
        """Ask the service about the target every `follower_check_s` until it ends (`_check_target`), unless that
        is under way already."""
        if not target.watched:
            target.watched = True
            self._checks.add(asyncio.create_task(self._check_target(transfer_id, target)))

    async def _check_target(self, transfer_id: str, target: _Target) -> None:
        """A following rank's expectation ends with an event of the transfer; should rank 0's registration
        have failed (then no event comes), it would wait forever: so it looks every `follower_check_s`. So does
        any rank for a pull target whose READ's report went unanswered (`_read_taken`): should that report have
        committed it naming every rank, no event tells of the commit, and it is rank 0's to release; should the
        service not have taken it, the generation stays MATCHED, and the report is sent again (`_report_again`).
        And so does a rank whose asking after a resync went unanswered (`_ask_ended`)."""
        try:
            while True:
                await asyncio.sleep(self._follower_check_s)
                if self._targets.get(transfer_id) is not target:
                    return
                info = await self._ask(transfer_id, target)
                if (
                    info is not None
                    and target.unanswered is not None
                    and self._targets.get(transfer_id) is target
                    and (info.state, info.generation) == (TransferState.MATCHED, target.generation)
                ):
                    self._report_again(transfer_id, target, target.unanswered)
        finally:
            self._checks.discard(asyncio.current_task())

    async def _ask_ended(self, transfer_id: str, target: _Target) -> None:
        """A target whose transfer may have ended while this rank did not hear of it: a resync's listing lacks it (the
        listing holds live transfers only: it ended while the watch was away, released, aborted or forgotten, or was
        registered after the listing was read), or a re-registration re-asserted it as committed, released or
        aborted. The service's record says which (`_ask`); should it not answer, the target is watched until it
        does."""
        if await self._ask(transfer_id, target) is None and self._targets.get(transfer_id) is target:
            self._watch_target(transfer_id, target)

    async def _ask(self, transfer_id: str, target: _Target) -> TransferInfo | None:
        """Ask the service about the target's transfer, and end the target as its record says if it ended: ok when
        its generation committed (released since, maybe), failed as an abort says (once no write can land), LOST when
        the service forgot it or another engine targets it. The record; None when the service did not answer, or
        forgot the transfer."""
        try:
            info = await self.engine_session.client.get_transfer(transfer_id)
        except NotFound as e:
            if self._targets.get(transfer_id) is target:
                self._fail(transfer_id, AgentReason.LOST, f"the service does not have this transfer: {e}")
            return None
        except RendezvousError as e:  # the service is slow or away: that says nothing of the transfer
            logger.warning("transfer %s: checking on it failed, looking again later: %s", transfer_id, e)
            return None
        if self._targets.get(transfer_id) is not target:
            return info
        if info.consumer_engine_id != self.engine_session.engine_id:
            self._fail(transfer_id, AgentReason.LOST, "the engine's registration of this transfer failed")
        elif info.state in _ARRIVED and info.generation == target.generation:
            # Committed while this rank did not hear of it (before it expected the transfer, or while its watch was
            # away; rank 0 may have released it since, or `release_timeout`): the bytes are in.
            self._committed(transfer_id, target.generation)
        elif info.state.terminal:  # aborted, or a newer generation came and was released
            reason = info.abort_reason if info.state is TransferState.ABORTED else AgentReason.REVOKED
            if info.revoking_generation == target.generation:
                # Fenced when answered; its REVOCATION_CONFIRMED may have been handled since (outside the handler):
                # waited for as `_when_unfenced` does, which notes the result first and asks again.
                await self._give_back(transfer_id, info.abort_message, reason)
            else:
                self._fail(transfer_id, reason, info.abort_message)
        return info

    async def abort(self, transfer_id: str, message: str = "") -> ItemResult:
        """Abort a transfer (rank 0 tells the service; another rank just stops expecting it); its failed result
        comes once no write can land in its blocks. A refused item is returned, not raised (and changes
        nothing: the transfer is still expected); a refused call raises."""
        if self.leader:
            (result,) = await self.session.abort_transfers((AbortSpec(transfer_id, message),))
        else:
            result = ItemResult(transfer_id, TransferState.ABORTED)
        if result.ok:
            await self._give_back(
                transfer_id, message, AgentReason.CORRUPTED if self._corrupted(transfer_id) else AbortReason.REQUESTED
            )
        return result

    def _corrupted(self, transfer_id: str) -> bool:
        target = self._targets.get(transfer_id)
        return target is not None and bool(target.corrupted)

    async def _give_back(
        self, transfer_id: str, message: str, reason: AbortReason | AgentReason = AbortReason.REQUESTED
    ) -> None:
        """Stop expecting an aborted transfer; its failed result comes once no write can land."""
        target = self._targets.pop(transfer_id, None)
        if target is not None and not target.arrived:
            self._update_expecting()
            failed = TransferResult(transfer_id, target.generation, False, target.block_ids, reason, message)
            await self._when_unfenced(failed, maybe_fenced=True)

    async def results(self) -> AsyncIterator[TransferResult]:
        """Each transfer result as it comes; ends when the agent closes. Unused when `on_result` is given."""
        while True:
            item = await self._results.get()
            if isinstance(item, _Closed):
                self._results.put_nowait(item)
                return
            yield item

    # Events (on the loop)

    async def handle_event(self, item: SessionEvent) -> None:
        """React to one session event; the session calls this for each, in order."""
        if isinstance(item, Resynced):
            live = {t.transfer_id: t for t in item.transfers}  # live transfers only: none RELEASED or ABORTED
            unlisted: list[tuple[str, _Target]] = []
            for transfer_id, target in list(self._targets.items()):
                info = live.get(transfer_id)
                if info is None:
                    unlisted.append((transfer_id, target))
                elif info.state is TransferState.COMMITTED:
                    self._committed(transfer_id, info.generation)
                elif info.state is TransferState.MATCHED and info.mode is TransferMode.PULL and info.source_block_ids:
                    await self._read_missed(info)
            fenced, self._fenced = list(self._fenced.values()), {}  # their REVOCATION_CONFIRMED may be among the lost
            # Asked while the handler waits: no REVOCATION_CONFIRMED is taken before a result it confirms is fenced.
            await asyncio.gather(
                *(self._when_unfenced(result, maybe_fenced=True) for result in fenced),
                *(self._ask_ended(transfer_id, target) for transfer_id, target in unlisted),
            )
        elif isinstance(item, Reregistered):
            lost = [r.transfer_id for r in item.results if not r.ok]
            # Re-asserted unchanged though it ended while no event of it reached this incarnation: committed
            # (released since, maybe: the replaced incarnation's lease lapsing releases it), or aborted (the lapse
            # itself, or the router; maybe still fenced). The answer names no generation nor abort reason: the
            # service's record says whether it is the target's generation, and why it ended.
            ended = [
                (r.transfer_id, held)
                for r in item.results
                if r.ok and r.state in _ENDED and (held := self._targets.get(r.transfer_id)) is not None
            ]
            await asyncio.gather(
                *(self._give_back(t, "the transfer did not survive re-registration", AgentReason.LOST) for t in lost),
                *(self._ask_ended(transfer_id, held) for transfer_id, held in ended),
            )
        else:
            self._on_server_event(item)

    def _on_server_event(self, event: ServerEvent) -> None:
        info = event.transfer
        if event.type is EventType.PEER_LOST and event.peer is not None:
            assert self._thread is not None
            for agent in event.peer.agents:
                self._thread.forget_peer(agent.name)
            return
        if info is None:
            return
        match event.type:
            case EventType.TRANSFER_COMMITTED:
                target = self._targets.get(info.transfer_id)
                if not self.leader and (target is None or target.generation < event.generation):
                    remember(self._early_commits, info.transfer_id, event.generation, EARLY_COMMITS)
                self._committed(info.transfer_id, event.generation)
            case EventType.TRANSFER_ABORTED:
                self._fail(info.transfer_id, info.abort_reason, info.abort_message, info.revoking_generation)
            case EventType.REVOCATION_CONFIRMED:
                fenced = self._fenced.pop((info.transfer_id, event.generation), None)
                if fenced is not None:
                    self._deliver(fenced)
            case EventType.SOURCE_READY:
                target = self._targets.get(info.transfer_id)
                if not self.leader and (target is None or target.generation < event.generation):
                    sent_to = self.engine_session.events_incarnation
                    remember(self._early_sources, info.transfer_id, (event, sent_to), EARLY_COMMITS)
                else:
                    self._source_ready(event)

    def _committed(self, transfer_id: str, generation: int) -> None:
        """The generation is committed: its target ends (ok, unless its digests failed to match) and the registering
        rank releases it. Push: on TRANSFER_COMMITTED (a following rank may hear of it first by asking). Pull: on
        the answer to the READ's report that committed it, and on the TRANSFER_COMMITTED the service sends the
        consumer when that report named only some of its ranks (so the ranks that reported before hear of it);
        rank 0 asks about one whose report went unanswered (`_check_target`). Both: or in a resync's listing."""
        target = self._targets.get(transfer_id)
        if target is None or target.generation != generation:
            return
        if target.mode is TransferMode.PUSH and (
            target.checking or (not target.arrived and not target.corrupted and self._needs_check(target))
        ):
            target.committed = True  # its digests decide, and the check ends the commit
            if target.checking:
                return
            if self._digests_complete(target):
                self._check_committed(transfer_id, target)
            else:  # the notifications with the rest may still be on their way (or writers unknown): not for ever
                self._late_checks[transfer_id] = asyncio.get_running_loop().call_later(
                    self._digests_after_commit_s, self._check_committed, transfer_id, target
                )
            return
        del self._targets[transfer_id]
        self._update_expecting()
        if target.corrupted:  # committed all the same: every write landed, so its blocks are free
            failed = TransferResult(transfer_id, generation, False, target.block_ids, AgentReason.CORRUPTED)
            self._deliver(dataclasses.replace(failed, message=target.corrupted))
        elif not target.arrived:
            self._deliver(TransferResult(transfer_id, generation, True, target.block_ids), time.monotonic(), "commit")
        if self._releases is not None:  # the registering rank releases for the engine
            self._releases.submit_logged(ReleaseSpec(transfer_id, generation))

    def _fail(
        self, transfer_id: str, reason: AbortReason | AgentReason, message: str, revoking_generation: int = 0
    ) -> None:
        target = self._targets.pop(transfer_id, None)
        if target is None:
            return
        self._update_expecting()
        if target.arrived:
            return  # its bytes are in place and were reported
        result = TransferResult(transfer_id, target.generation, False, target.block_ids, reason, message)
        if revoking_generation == target.generation:
            self._fenced[(transfer_id, target.generation)] = result
        else:
            self._deliver(result)

    async def _read_missed(self, info: TransferInfo) -> None:
        """A pull transfer whose source is ready in a resync's listing: its SOURCE_READY may be among the events the
        watch lost, so it is read now, from the listing and the producer's record (`_source_ready` skips a read
        under way; a producer gone since is a loss, which aborts the transfer)."""
        target = self._targets.get(info.transfer_id)
        if target is None or target.arrived or target.generation != info.generation:
            return
        peer = await self._peer_after_resync(info.producer_engine_id, info.producer_incarnation, info.transfer_id)
        if peer is not None:
            self._source_ready(Event(EventType.SOURCE_READY, time.time(), info, info.generation, peer))

    def _read_early(self, transfer_id: str, target: _Target) -> None:
        """A following rank's worker may lag behind rank 0's registration: the source of the generation it now
        expects may have been ready before (its SOURCE_READY then found no target, or an older generation's), and
        no other event tells of it. Read it now, unless it was sent to a replaced incarnation (the new one is sent
        SOURCE_READY again, or reads it from its resync's listing)."""
        early = self._early_sources.pop(transfer_id, None)
        if early is not None:
            event, sent_to = early
            if event.generation == target.generation and sent_to == self.engine_session.events_incarnation:
                self._source_ready(event)

    def _source_ready(self, event: ServerEvent) -> None:
        info, peer = event.transfer, event.peer
        assert info is not None and self._thread is not None
        target = self._targets.get(info.transfer_id)
        if (
            target is None
            or target.generation != event.generation
            or target.mode is not TransferMode.PULL
            or target.arrived  # decode may be reading its blocks
        ):
            return
        key = (info.transfer_id, event.generation)
        read_as = self.engine_session.events_incarnation  # the incarnation this SOURCE_READY was sent to
        reading = self._reading.get(key)
        if reading is not None:  # a READ under way, or its report
            if reading != read_as:  # a replaced incarnation's: read again once it is over
                self._read_again[key] = event
            return
        self._reading[key] = read_as
        agent = None if peer is None else agent_for_rank(peer.agents, self.rank)
        if peer is None or agent is None:
            self._read_done(info.transfer_id, event.generation, False, f"the producer has no agent of rank {self.rank}")
            return
        dst = target.block_ids
        if not dst:
            self._read_done(info.transfer_id, event.generation, True, None)
            return
        src = info.source_block_ids[len(info.source_block_ids) - len(dst) :]
        self._thread.read(info.transfer_id, event.generation, agent, peer.incarnation, src, dst)

    # Receiver-thread callbacks, run on the loop

    def _notified(self, notifications: list[TransferNotification], arrived: float) -> None:
        for n in notifications:
            target = self._targets.get(n.transfer_id)
            if (
                target is None
                or target.generation != n.generation
                or target.mode is not TransferMode.PUSH
                or (target.parts is None) != (n.parts is None)  # in parts: only the parts say what landed
            ):
                self.stale_notifications += 1
                continue
            if n.scope is not None:
                target.scoped[n.sender] = (n.scope, n.digests)
            else:
                target.digests = n.digests or target.digests
            if target.committed and not target.checking and self._digests_complete(target):
                self._check_committed(n.transfer_id, target)  # the commit came first, waiting for these
                continue
            if target.parts is not None:
                self._part_notified(n, target, arrived)
                continue
            target.senders.add(n.sender)
            # Several producer ranks may write into this rank: the bytes are in once each of them said so.
            if not target.arrived and n.writers and len(target.senders) >= n.writers:
                self._arrive(n.transfer_id, target, arrived, "notification")

    def _part_notified(self, n: TransferNotification, target: _Target, arrived: float) -> None:
        parts = target.parts
        assert parts is not None
        if target.arrived or parts.disputed is not None:
            return
        if n.writers != 1:  # several writers send scoped digests, checked at arrival: nothing to hash as it lands
            target.landed = None
        done = parts.add(n)  # first: parts it disputes (layers or tokens outside the target) are not hashed
        if target.landed is not None and parts.disputed is None:  # before arrival, whose check hashes the rest
            share = n.layers or self._held
            jobs = [job for part in n.parts or () for job in target.landed.land(part, share)]
            self._hash_landed(target, target.landed, jobs)
        if done:
            self._arrive(n.transfer_id, target, arrived, "parts")
        elif parts.disputed is not None:
            self.disputed_targets += 1
            logger.warning("transfer %s:%d: waiting for the commit: %s", n.transfer_id, n.generation, parts.disputed)

    def _needs_check(self, target: _Target) -> bool:
        """Whether the target's bytes are checked before they count as arrived: with integrity on, or when digests
        came that this rank can check (its blocks in host memory)."""
        checkable = bool(self._regions) and bool(target.digests or target.scoped)
        return bool(target.block_ids) and (self._integrity or checkable)

    def _digests_complete(self, target: _Target) -> bool:
        """Whether the digests that came cover the whole target: unscoped ones, or scopes that tile this rank."""
        if target.digests:
            return True
        if not target.scoped or self._shape is None:
            return False
        scopes = (scope for scope, _ in target.scoped.values())
        return not scope_gaps(scopes, len(self._regions), self._shape.num_heads, self._scope_tokens(target))

    def _scope_tokens(self, target: _Target) -> int:
        """The tokens the senders' scopes must cover: the target's, or (unknown) as many as its blocks need."""
        return target.tokens or (len(target.block_ids) - 1) * self.layout.block_size + 1

    def _check_committed(self, transfer_id: str, target: _Target) -> None:
        """Check a committed target with the digests that came, unless it is checked, decided or gone already."""
        late = self._late_checks.pop(transfer_id, None)
        if late is not None:
            late.cancel()
        if self._targets.get(transfer_id) is not target or target.checking or target.arrived or target.corrupted:
            return
        target.checking = True
        self._start_check(transfer_id, target, time.monotonic(), "commit")

    def _arrive(self, transfer_id: str, target: _Target, at: float, via: str) -> None:
        """The target's bytes are in (`via` says how it knows): ok, once its digests matched when it has any."""
        if target.checking or target.corrupted:
            return
        # Digests that came are checked where the blocks can be read on the host; with integrity on, none is a failure.
        if self._needs_check(target):
            target.checking = True
            self._start_check(transfer_id, target, at, via)
            return
        target.arrived = True
        self._deliver(TransferResult(transfer_id, target.generation, True, target.block_ids), at, via)

    def _start_check(self, transfer_id: str, target: _Target, at: float, via: str) -> None:
        task = asyncio.create_task(self._check_digests(transfer_id, target, at, via))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def _hash_landed(self, target: _Target, landed: LandedDigests, jobs: list[HashJob]) -> None:
        """Hash `jobs` in a thread once the target's earlier jobs are done (one region's blocks go in order)."""
        if not jobs:
            return
        previous = target.hashing

        async def run() -> None:
            if previous is not None:
                await previous
            await asyncio.to_thread(landed.hash, jobs)

        task = target.hashing = asyncio.create_task(run())
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _target_digests(self, target: _Target) -> tuple[int, ...]:
        """The digests of the target's blocks: what was hashed as its parts landed and the rest, or all of it at
        once (not written in parts, its parts disputed or a hash of them failed)."""
        landed = target.landed
        if landed is not None and target.parts is not None and target.parts.disputed is None:
            self._hash_landed(target, landed, landed.rest())
            try:
                if target.hashing is not None:
                    await target.hashing
                return landed.digests()
            except ValueError as e:  # a block outside the regions: hashed again, the whole target
                logger.warning("hashing a target's parts as they landed failed: %s", e)
        return await asyncio.to_thread(block_digests, self._regions, target.block_ids)

    async def _check_digests(self, transfer_id: str, target: _Target, at: float, via: str) -> None:
        """Compare the target's blocks with the producer's digests (off the loop); ok if they match, else fail
        the transfer (`AgentReason.CORRUPTED`), aborting it at the service so that the producer hears why."""
        if target.scoped:
            why = await self._check_scoped(target)
        elif not target.digests:
            why = "integrity is required here, but the producer sent no checksums (turn it on for both pools)"
        elif len(self._regions) != len(target.digests):
            why = f"{len(target.digests)} digests for {len(self._regions)} host-memory regions here: cannot check"
        else:
            got = await self._target_digests(target)
            bad = next((r for r, (a, b) in enumerate(zip(got, target.digests, strict=True)) if a != b), None)
            why = "" if bad is None else (
                f"integrity check failed: region {bad} of the {len(target.block_ids)} blocks from block "
                f"{target.block_ids[0]} hashes to {got[bad]:016x}, the producer wrote {target.digests[bad]:016x}"
            )  # fmt: skip
        if self._targets.get(transfer_id) is not target:
            return  # ended meanwhile (aborted, retired): its result was reported
        target.checking = False
        if not why:
            target.arrived = True
            self._deliver(TransferResult(transfer_id, target.generation, True, target.block_ids), at, via)
            if target.committed:
                self._committed(transfer_id, target.generation)
            return
        target.corrupted = why
        logger.error("transfer %s:%d: %s", transfer_id, target.generation, why)
        if target.committed:
            self._committed(transfer_id, target.generation)
            return
        try:
            refused = (await self.abort(transfer_id, why)).error
        except RendezvousError as e:
            refused = e
        if refused is not None:  # it committed, or ended: its event ends the target
            logger.warning("AbortTransfers %s after a failed integrity check: %s", transfer_id, refused)

    async def _check_scoped(self, target: _Target) -> str:
        """Why the scoped digests of `target`'s senders do not show its bytes as written; "" when they do."""
        if self._shape is None or not self._regions:
            return "scoped digests, but this rank's layout does not place its regions: cannot check"
        bs, blocks = self.layout.block_size, len(target.block_ids)
        gaps = scope_gaps(
            (scope for scope, _ in target.scoped.values()),
            len(self._regions),
            self._shape.num_heads,
            self._scope_tokens(target),
        )
        if gaps:
            return f"integrity check failed: {gaps}"
        geometry = RankGeometry(self._regions, self._shape.num_heads, bs, kvmap.element_bytes(self.layout.dtype))
        for sender, (scope, digests) in sorted(target.scoped.items()):
            try:
                got = await asyncio.to_thread(scope_digests, geometry, self.layout.kv_layout, scope, target.block_ids)
            except ValueError as e:
                return f"integrity check failed: {sender}'s digests of {scope}: {e}"
            bad = next((i for i, (a, b) in enumerate(zip(got, digests, strict=True)) if a != b), None)
            if bad is not None:
                return (
                    f"integrity check failed: {sender} wrote heads +{scope.first_head}:{scope.num_heads} of region "
                    f"{scope.regions[bad]} of the {blocks} blocks from block {target.block_ids[0]}, hashing to "
                    f"{digests[bad]:016x}; they hash to {got[bad]:016x} here"
                )
        return ""

    def _read_done(
        self, transfer_id: str, generation: int, ok: bool, error: str | None, arrived: float | None = None
    ) -> None:
        """Report a READ's outcome as the incarnation whose SOURCE_READY it answers, and only while that one is
        current (`EngineSession.complete_transfers`): sent as a newer one, it would end that one's match of the same
        transfer and generation (a FAILED aborting it, a SUCCEEDED committing it whatever source blocks it names). A
        replaced incarnation's READ is not reported: its bytes are not taken as arrived, and the target is read
        again on the new incarnation's SOURCE_READY. A current one's bytes arrive once the service took the report
        (`_read_reported`); a failure ends the target at once (no byte lands any more)."""
        key = (transfer_id, generation)
        read_as = self._reading[key]
        outcome = CompletionOutcome.SUCCEEDED if ok else CompletionOutcome.FAILED
        future = self._completions_of(read_as).submit(
            CompletionSpec(transfer_id, generation, outcome, error or "", (self.rank,))
        )
        target = self._targets.get(transfer_id)
        expected = target is not None and target.generation == generation and self.engine_session.is_current(read_as)
        if ok and expected:
            at = time.monotonic() if arrived is None else arrived
            future.add_done_callback(functools.partial(self._read_reported, transfer_id, generation, at))
            return
        future.add_done_callback(functools.partial(log_refusal, "CompleteTransfers", transfer_id, generation))
        again = self._read_over(key)
        if expected:
            self._fail(transfer_id, AgentReason.READ_FAILED, error or "")
        if again is not None:
            self._source_ready(again)

    def _read_reported(
        self, transfer_id: str, generation: int, arrived: float, future: asyncio.Future[ItemResult]
    ) -> None:
        """A READ's SUCCEEDED was answered, or its call failed (`_read_taken` says what follows)."""
        log_refusal("CompleteTransfers", transfer_id, generation, future)
        read_as = self._reading[(transfer_id, generation)]
        again = self._read_over((transfer_id, generation))
        result = None if future.cancelled() or future.exception() else future.result()
        target = self._targets.get(transfer_id)
        if target is not None and target.generation == generation:
            self._read_taken(transfer_id, target, result, arrived, read_as)
        if again is not None:
            self._source_ready(again)

    def _read_taken(
        self, transfer_id: str, target: _Target, result: ItemResult | None, arrived: float, read_as: tuple[int, int]
    ) -> None:
        """The bytes of a READ whose SUCCEEDED was answered `result` (None: the call failed, which leaves them in
        the blocks all the same) arrive if the service took the report: the generation is MATCHED (other ranks'
        shares to come) or committed. Not if it refused it: as a replaced incarnation's (STALE_INCARNATION: read
        again on the new one's SOURCE_READY), or because the transfer ended while it was read (aborted by its
        deadline, the router, a lost peer): its producer frees the source then, which may have been reused
        mid-READ. An aborted transfer fails as its TRANSFER_ABORTED says (sent before the answer: the same result
        whichever comes first); any other refusal fails it at once (`AgentReason.LOST`, the service's error). The
        report that commits the generation ends the target; one answered MATCHED ends on the TRANSFER_COMMITTED of
        the last rank's report, which the service sends the consumer (that report names only its own rank). Only
        when the call went unanswered does the rank ask (`_check_target`; a following rank asks anyway): had this
        report committed the generation naming every rank (a single-rank consumer), no event would tell of it; had
        the service not taken it, the generation would stay MATCHED until its deadline aborted it, so the report is
        sent again (`_report_again`)."""
        error = None if result is None else result.error
        if error is not None:
            if error.reason != Reason.STALE_INCARNATION:
                self._fail(transfer_id, AgentReason.LOST, f"the service refused the READ's report: {error}")
            return
        if result is not None and result.state not in _TAKEN:
            return  # ended while it was read: its TRANSFER_ABORTED (or rank 0's own abort) ends the target
        if not target.arrived:
            target.arrived = True
            self._deliver(TransferResult(transfer_id, target.generation, True, target.block_ids), arrived, "read")
        if result is None:
            target.unanswered = read_as
            self._watch_target(transfer_id, target)
        elif result.state in _ARRIVED:
            self._committed(transfer_id, target.generation)

    def _report_again(self, transfer_id: str, target: _Target, read_as: tuple[int, int]) -> None:
        """Send the SUCCEEDED of the target's READ again, as the incarnation it was sent as: that call went unanswered
        and the service still has the generation MATCHED, so it did not take it (or took it, and waits for other
        ranks: the same report again changes nothing). One at a time: unanswered again, the next check sends it
        again; taken, it commits the generation or leaves it to the other ranks' reports."""
        target.unanswered = None
        spec = CompletionSpec(transfer_id, target.generation, CompletionOutcome.SUCCEEDED, "", (self.rank,))
        future = self._completions_of(read_as).submit(spec)
        future.add_done_callback(functools.partial(self._reported_again, transfer_id, target, read_as))

    def _reported_again(
        self, transfer_id: str, target: _Target, read_as: tuple[int, int], future: asyncio.Future[ItemResult]
    ) -> None:
        log_refusal("CompleteTransfers", transfer_id, target.generation, future)
        if self._targets.get(transfer_id) is not target:
            return
        if future.cancelled() or future.exception() is not None:
            target.unanswered = read_as  # the next check sends it again
            return
        result = future.result()
        if result.ok and result.state in _ARRIVED:
            self._committed(transfer_id, target.generation)

    def _read_over(self, key: tuple[str, int]) -> ServerEvent | None:
        """Our READ of `key` neither writes into its blocks nor waits for its report any more: deliver the result
        that waited for it; return the newer incarnation's SOURCE_READY that came meanwhile, to read again."""
        del self._reading[key]
        retired = self._after_read.pop(key, None)
        if retired is not None:
            self._deliver(retired)
        return self._read_again.pop(key, None)

    # Helpers

    def _undo_register(self, transfer_id: str, new: _Target, old: _Target | None) -> None:
        if self._targets.get(transfer_id) is new:
            if old is None:
                del self._targets[transfer_id]
            else:
                self._targets[transfer_id] = old
            self._update_expecting()

    async def _when_unfenced(self, result: TransferResult, *, maybe_fenced: bool) -> None:
        """Deliver `result` once the service no longer fences its generation (REVOCATION_CONFIRMED)."""
        if not maybe_fenced:
            self._deliver(result)
            return
        key = (result.transfer_id, result.generation)
        self._fenced[key] = result  # first: the confirmation may arrive while we ask
        try:
            revoking = (await self.engine_session.client.get_transfer(result.transfer_id)).revoking_generation
        except NotFound:  # forgotten: nothing is fenced any more
            revoking = 0
        except RendezvousError as e:
            # Unanswered (past the client's retries): a WRITE may still land, so the blocks stay held until the
            # REVOCATION_CONFIRMED event, or the next resync asks again.
            logger.warning("transfer %s stays fenced, the service did not answer: %s", result.transfer_id, e)
            return
        if revoking != result.generation and self._fenced.pop(key, None) is not None:
            self._deliver(result)

    def _update_expecting(self) -> None:
        if self._thread is not None:
            self._thread.set_expecting(bool(self._targets))

    def _deliver(self, result: TransferResult, arrived: float | None = None, via: str = "") -> None:
        """Hand `result` to the engine; an arrival (`arrived`, a time.monotonic() stamp, and how) is timed."""
        key = (result.transfer_id, result.generation)
        if key in self._reading:  # our own READ may still write into these blocks
            self._after_read[key] = result
            return
        if arrived is not None:
            self.metrics.observe_result(self.rank, via, time.monotonic() - arrived)
        if self._on_result is None:
            self._results.put_nowait(result)
            return
        try:
            self._on_result(result)
        except Exception:
            logger.exception("on_result(%s) raised", result)
