"""The gRPC servicer of KvIndexService (proto/rendezvous/v1/index.proto): maps its RPCs onto the coordinator's
KV index (rendezvous.cache_index), with RendezvousService's error mapping, metrics and response header (`_rpc`).
Who may call what is the auth guard's (rendezvous.server.auth): reports only for an engine the caller may act
for, queries for any authenticated caller.
"""

from __future__ import annotations

import grpc

from rendezvous import wire
from rendezvous.core import paging
from rendezvous.protocol import index_wire
from rendezvous.server.authfile import Caller
from rendezvous.server.servicer import RendezvousServicer, _rpc
from rendezvous.v1 import index_pb2 as ipb
from rendezvous.v1 import index_pb2_grpc as ipb_grpc


class KvIndexServicer(ipb_grpc.KvIndexServiceServicer):
    """KvIndexService over the coordinator of a RendezvousServicer (its store, metrics and header)."""

    def __init__(self, rendezvous: RendezvousServicer) -> None:
        self.coordinator = rendezvous.coordinator
        self.metrics = rendezvous.metrics
        self.idempotency_ttl = rendezvous.idempotency_ttl
        self._header = rendezvous._header  # the same header as RendezvousService's answers

    @_rpc(ipb.ReportCacheEventsResponse)
    async def ReportCacheEvents(
        self, request: ipb.ReportCacheEventsRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> ipb.ReportCacheEventsResponse:
        at = await self.coordinator.index.report(index_wire.report(request))
        return ipb.ReportCacheEventsResponse(
            header=await self._header(),
            sequence=at.sequence,
            duplicate=at.duplicate,
            block_count=at.block_count,
        )

    @_rpc(ipb.ReplaceCachedBlocksResponse)
    async def ReplaceCachedBlocks(
        self, request: ipb.ReplaceCachedBlocksRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> ipb.ReplaceCachedBlocksResponse:
        at = await self.coordinator.index.replace(index_wire.snapshot(request))
        return ipb.ReplaceCachedBlocksResponse(
            header=await self._header(),
            sequence=at.sequence,
            block_count=at.block_count,
            left_out=at.left_out,
            cut_by=at.cut_by,
        )

    @_rpc(ipb.MatchPrefixesResponse)
    async def MatchPrefixes(
        self, request: ipb.MatchPrefixesRequest, context: grpc.aio.ServicerContext, caller: Caller
    ) -> ipb.MatchPrefixesResponse:
        wire.role_filter(request.role)  # a role this server does not know is refused, as ListEngines refuses it
        found = await self.coordinator.index.match(index_wire.query(request))
        messages = [index_wire.match_message(m) for m in found]
        # Best first: past max_response_bytes the rest, the engines that match least, are left out.
        best = paging.cut(messages, len(messages), _size, self.coordinator.limits.max_response_bytes)
        return ipb.MatchPrefixesResponse(header=await self._header(), matches=best, left_out=len(messages) - len(best))


def _size(match: ipb.PrefixMatch) -> int:
    return match.ByteSize() + 8  # its field tag and length in the response
