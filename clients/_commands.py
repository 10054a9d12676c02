"""The one definition of the unary commands, shared by the sync and the asyncio client.

A builder turns typed arguments into a `Call`: which RPC, the request message and how to parse
the answer. The clients only send calls (`_invoke`), so both behave the same by construction.
Mutating requests get a fresh AIP-155 request id here, once; the clients' retries resend the
same message, so a retry returns the first answer instead of applying twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message

from rendezvous.clients import _convert
from rendezvous.clients._types import (
    AbortSpec,
    CacheReport,
    CacheSnapshot,
    ClaimSpec,
    CompletionSpec,
    CreditResult,
    CreditSpec,
    EngineInfo,
    EnginePage,
    EngineRole,
    EngineSpec,
    EngineView,
    IndexPosition,
    ItemResult,
    PrefixMatch,
    PrefixQuery,
    Registration,
    ReleaseSpec,
    RevocationAck,
    ServerStatus,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
    TransferPage,
    TransferState,
)
from rendezvous.protocol import convert, index_wire
from rendezvous.protocol.convert import duration, number
from rendezvous.v1 import index_pb2 as ipb
from rendezvous.v1 import rendezvous_pb2 as pb

ResultT = TypeVar("ResultT")


def new_request_id() -> str:
    """A fresh AIP-155 request id."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Call(Generic[ResultT]):
    """One unary call to make: the RPC's name, its request and the parser of its response.

    `idempotent` calls are reads: a timed-out attempt may be retried too.
    """

    method: str
    request: Message
    parse: Callable[[Any], ResultT]
    idempotent: bool = False

    def one(self: Call[list[ItemResult]]) -> Call[ItemResult]:
        """The same call for a one-item batch, answering that item and raising its error."""
        return Call(self.method, self.request, _only_item, self.idempotent)


def _only_item(response: _convert._BatchResponse) -> ItemResult:
    return _convert.item_result(response.results[0]).raise_for_error()


# Engines


def register_engine(spec: EngineSpec) -> Call[Registration]:
    """RegisterEngine: a new incarnation of spec."""
    return Call("RegisterEngine", convert.register_engine_request(spec, new_request_id()), _convert.registration)


def deregister_engine(engine_id: str, incarnation: int) -> Call[int]:
    """DeregisterEngine; answers how many live transfers were aborted."""
    request = pb.DeregisterEngineRequest(request_id=new_request_id(), engine_id=engine_id, incarnation=incarnation)
    return Call("DeregisterEngine", request, _aborted_transfers)


def _aborted_transfers(response: pb.DeregisterEngineResponse) -> int:
    return response.aborted_transfers


def get_engine(engine_id: str, view: EngineView, transfer_id: str = "") -> Call[EngineInfo]:
    """GetEngine, in a view (transfer_id: the transfer through which an engine asks for its peer)."""
    request = pb.GetEngineRequest(engine_id=engine_id, view=number(view), transfer_id=transfer_id)
    return Call("GetEngine", request, _engine, idempotent=True)


def _engine(response: pb.GetEngineResponse) -> EngineInfo:
    return convert.engine(response.engine)


def list_engines(
    pool: str, role: EngineRole | None, view: EngineView, page_size: int, page_token: str
) -> Call[EnginePage[EngineInfo]]:
    """ListEngines: one page in a view, optionally of one pool and role."""
    request = pb.ListEnginesRequest(
        pool=pool,
        role=number(role or 0),
        view=number(view),
        page_size=page_size,
        page_token=page_token,
    )
    return Call("ListEngines", request, _convert.engine_page, idempotent=True)


# Transfers (batched; one ItemResult per item, in order)


def _batched(request_type: type[Message], engine_id: str, incarnation: int, **items: Any) -> Call[list[ItemResult]]:
    """A batched transfer call of request_type (the RPC it names) with a fresh request id."""
    request = request_type(request_id=new_request_id(), engine_id=engine_id, incarnation=incarnation, **items)
    return Call(request_type.__name__.removesuffix("Request"), request, _convert.item_results)


def register_targets(engine_id: str, incarnation: int, targets: Iterable[TargetSpec]) -> Call[list[ItemResult]]:
    """RegisterTargets."""
    return _batched(
        pb.RegisterTargetsRequest, engine_id, incarnation, targets=[convert.target_message(t) for t in targets]
    )


def claim_transfers(engine_id: str, incarnation: int, claims: Iterable[ClaimSpec]) -> Call[list[ItemResult]]:
    """ClaimTransfers."""
    return _batched(pb.ClaimTransfersRequest, engine_id, incarnation, claims=[convert.claim_message(c) for c in claims])


def mark_sources_ready(engine_id: str, incarnation: int, sources: Iterable[SourceReadySpec]) -> Call[list[ItemResult]]:
    """MarkSourcesReady."""
    return _batched(
        pb.MarkSourcesReadyRequest, engine_id, incarnation, sources=[convert.source_message(s) for s in sources]
    )


def complete_transfers(
    engine_id: str, incarnation: int, completions: Iterable[CompletionSpec]
) -> Call[list[ItemResult]]:
    """CompleteTransfers."""
    return _batched(
        pb.CompleteTransfersRequest,
        engine_id,
        incarnation,
        completions=[convert.completion_message(c) for c in completions],
    )


def acknowledge_revocations(engine_id: str, incarnation: int, acks: Iterable[RevocationAck]) -> Call[list[ItemResult]]:
    """AcknowledgeRevocations."""
    return _batched(
        pb.AcknowledgeRevocationsRequest, engine_id, incarnation, acks=[convert.ack_message(a) for a in acks]
    )


def release_targets(engine_id: str, incarnation: int, releases: Iterable[ReleaseSpec]) -> Call[list[ItemResult]]:
    """ReleaseTargets."""
    return _batched(
        pb.ReleaseTargetsRequest, engine_id, incarnation, releases=[convert.release_message(r) for r in releases]
    )


def abort_transfers(engine_id: str, incarnation: int, aborts: Iterable[AbortSpec]) -> Call[list[ItemResult]]:
    """AbortTransfers; engine_id "" aborts as a router or operator."""
    return _batched(pb.AbortTransfersRequest, engine_id, incarnation, aborts=[convert.abort_message(a) for a in aborts])


def reserve_credits(reservations: Iterable[CreditSpec], ttl: float) -> Call[list[CreditResult]]:
    """ReserveCredits (a router's): credit on consumer engines for transfer ids, for ttl seconds (0: default)."""
    request = pb.ReserveCreditsRequest(
        request_id=new_request_id(),
        reservations=[convert.credit_message(r) for r in reservations],
        ttl=duration(ttl),
    )
    return Call("ReserveCredits", request, _convert.credit_results)


def release_credits(transfer_ids: Iterable[str]) -> Call[list[CreditResult]]:
    """ReleaseCredits: drop the reservations of transfer ids."""
    request = pb.ReleaseCreditsRequest(request_id=new_request_id(), transfer_ids=list(transfer_ids))
    return Call("ReleaseCredits", request, _convert.credit_results)


def get_transfer(transfer_id: str) -> Call[TransferInfo]:
    """GetTransfer: a live transfer or a recent tombstone."""
    return Call("GetTransfer", pb.GetTransferRequest(transfer_id=transfer_id), _transfer, idempotent=True)


def _transfer(response: pb.GetTransferResponse) -> TransferInfo:
    return _convert.transfer(response.transfer)


def list_transfers(
    engine_id: str, states: Sequence[TransferState], page_size: int, page_token: str
) -> Call[TransferPage[TransferInfo]]:
    """ListTransfers: one page, by default of live transfers."""
    request = pb.ListTransfersRequest(
        engine_id=engine_id,
        states=[number(s) for s in states],
        page_size=page_size,
        page_token=page_token,
    )
    return Call("ListTransfers", request, _convert.transfer_page, idempotent=True)


# The KV index (KvIndexService). Retried like reads: a report's sequence makes a repeat a no-op, and a snapshot
# of the same sequence replaces the entry with the same blocks.


def report_cache_events(report: CacheReport) -> Call[IndexPosition]:
    """ReportCacheEvents."""
    return Call("ReportCacheEvents", index_wire.report_request(report), index_wire.position, idempotent=True)


def replace_cached_blocks(snapshot: CacheSnapshot) -> Call[IndexPosition]:
    """ReplaceCachedBlocks."""
    return Call("ReplaceCachedBlocks", index_wire.snapshot_request(snapshot), index_wire.position, idempotent=True)


def match_prefixes(query: PrefixQuery) -> Call[list[PrefixMatch]]:
    """MatchPrefixes."""
    return Call("MatchPrefixes", index_wire.query_request(query), _matches, idempotent=True)


def _matches(response: ipb.MatchPrefixesResponse) -> list[PrefixMatch]:
    return index_wire.matches(response.matches)


def get_status() -> Call[ServerStatus]:
    """GetStatus."""
    return Call("GetStatus", pb.GetStatusRequest(), _convert.server_status, idempotent=True)


# Streams


def watch_request(engine_id: str, start_sequence: int, max_batch: int) -> pb.WatchRequest:
    """The request opening a Watch stream."""
    return pb.WatchRequest(engine_id=engine_id, start_sequence=start_sequence, max_batch=max_batch)


def keep_alive_request(engine_id: str, incarnation: int) -> pb.KeepAliveRequest:
    """One lease renewal on a KeepAlive stream."""
    return pb.KeepAliveRequest(engine_id=engine_id, incarnation=incarnation)
