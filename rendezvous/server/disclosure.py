"""What an engine learns of a transfer it takes no part in: no more than of an unknown id.

The service's rule refuses an engine that is neither half of a transfer with NOT_PARTICIPANT,
which confirms that the id exists. With auth on, every identity but admin gets such an item
answered exactly as an unknown id is answered by that call (the guard says so in the `Caller` it hands the
servicer, which answers the item so): NOT_FOUND / TRANSFER_NOT_FOUND with the
same message for CompleteTransfers, AcknowledgeRevocations and ReleaseTargets; for AbortTransfers, which
accepts an unknown id, what it answers for one: OK with state ABORTED (an unknown id leaves an aborted
tombstone). Nothing changes for such an item: the transfer belongs to others. GetTransfer by an engine identity
answers a transfer none of whose halves it acts for as an unknown id too (`takes_part`; the router role and admin
read every transfer).

An engine's record holds its NIXL agents' metadata: region addresses with which whoever reaches its UCX endpoint
reads and writes its KV memory. The service hands it to the one peer that moves bytes with it, no other: the
producer of a push transfer gets its consumer (TRANSFER_ASSIGNED), the consumer of a pull transfer its producer
once the source is ready (SOURCE_READY). GetEngine through a transfer reads no more (`peer_reader`): the side
that moves no bytes, an ended transfer, or a later incarnation of the peer than the transfer names, none.

MarkSourcesReady takes the producer half as ClaimTransfers does and is refused as it is (CLAIM_CONFLICT for
another producer's transfer): an answer "claimed" for a transfer the caller did not claim would be
contradicted by its next call on the id (ClaimTransfers, CompleteTransfers, AcknowledgeRevocations). Who holds an
id is hidden from other engines by the router's bindings (required with a binding key unless --allow-unbound):
then a foreign and an unknown id are answered alike by every call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rendezvous.core.model import Mode, Transfer
from rendezvous.protocol import convert
from rendezvous.protocol.errors import transfer_not_found
from rendezvous.v1 import rendezvous_pb2 as pb

# The answer to an unknown id of the calls that accept one: its state afterwards, OK.
_UNKNOWN_ID_STATE = {"AbortTransfers": pb.TRANSFER_STATE_ABORTED}


def answer_as_unknown(method: str, result: pb.ItemResult) -> None:
    """Answer a NOT_PARTICIPANT item of a batched transfer call (result: its ItemResult, holding only its
    transfer id) as that call answers an unknown id; the servicer does for callers that must not learn more
    (rendezvous.server.authfile.Caller.hides_non_participation)."""
    state = _UNKNOWN_ID_STATE.get(method)
    if state is not None:
        result.state = state
    else:
        result.status.CopyFrom(convert.error_status(transfer_not_found(result.transfer_id)))


async def takes_part(acts_for: Callable[[str], Awaitable[bool]], transfer: Transfer) -> bool:
    """Whether a caller that acts for the engines `acts_for` allows (rendezvous.server.authfile.Caller.acts_for)
    may read transfer: one of its halves is one of them."""
    for engine_id in transfer.participants():
        if await acts_for(engine_id):
            return True
    return False


def peer_reader(transfer: Transfer, engine_id: str) -> tuple[str, int] | None:
    """Who may read engine_id's record through transfer, and at which incarnation: the half that moves the bytes,
    as long as the transfer is live and the service handed it engine_id as its peer (push: the producer its
    consumer; pull: the consumer its producer, once the source is ready), at the incarnation the transfer names.
    None: nobody (engine_id is no such half)."""
    consumer, producer = transfer.consumer_engine_id, transfer.producer_engine_id
    if transfer.state.terminal or not consumer or not producer:
        return None
    if transfer.mode == Mode.PUSH and engine_id == consumer:
        return producer, transfer.consumer_incarnation
    if transfer.mode == Mode.PULL and engine_id == producer and transfer.source_block_ids is not None:
        return consumer, transfer.producer_incarnation
    return None
