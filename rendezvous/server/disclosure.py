"""What an engine learns of a transfer it takes no part in: no more than of an unknown id.

The service's rule refuses an engine that is neither half of a transfer with NOT_PARTICIPANT,
which confirms that the id exists. With auth on, every identity but admin gets such an item
answered exactly as an unknown id is answered by that call: NOT_FOUND / TRANSFER_NOT_FOUND with the
same message for CompleteTransfer, AcknowledgeRevocation and ReleaseTarget; for AbortTransfer, which
accepts an unknown id, what it answers for one: OK with state ABORTED (an unknown id leaves an aborted
tombstone). Nothing changes for such an item: the transfer belongs to others.

MarkSourceReady takes the producer half as ClaimTransfer does and is refused as it is (CLAIM_CONFLICT for
another producer's transfer): an answer "claimed" for a transfer the caller did not claim would be
contradicted by its next call on the id (ClaimTransfer, CompleteTransfer, AcknowledgeRevocation). Who holds an
id is hidden from other engines by the router's bindings (required with a binding key unless --allow-unbound):
then a foreign and an unknown id are answered alike by every call.
"""

from __future__ import annotations

from google.protobuf.message import Message
from google.rpc import error_details_pb2

from rendezvous.protocol import convert
from rendezvous.protocol.errors import Reason, transfer_not_found
from rendezvous.v1 import rendezvous_pb2 as pb

# The batched transfer calls: those whose answers are ItemResults, which may carry NOT_PARTICIPANT.
TRANSFER_CALLS = frozenset(
    m.name
    for m in pb.DESCRIPTOR.services_by_name["RendezvousService"].methods
    if "results" in m.output_type.fields_by_name
    and getattr(m.output_type.fields_by_name["results"].message_type, "name", "") == "ItemResult"
)


def _is_not_participant(result: pb.ItemResult) -> bool:
    if not result.HasField("status"):
        return False
    info = error_details_pb2.ErrorInfo()
    return any(d.Unpack(info) and info.reason == Reason.NOT_PARTICIPANT for d in result.status.details)


# The answer to an unknown id of the calls that accept one: its state afterwards, OK.
_UNKNOWN_ID_STATE = {"AbortTransfer": pb.TRANSFER_STATE_ABORTED}


def _as_unknown(method: str, transfer_id: str) -> pb.ItemResult:
    state = _UNKNOWN_ID_STATE.get(method)
    if state is not None:
        return pb.ItemResult(transfer_id=transfer_id, state=state)
    return pb.ItemResult(transfer_id=transfer_id, status=convert.error_status(transfer_not_found(transfer_id)))


def hide_non_participation(method: str, response: Message) -> None:
    """Answer every NOT_PARTICIPANT item of a batched transfer call's response as that call answers an
    unknown id."""
    results = getattr(response, "results")  # noqa: B009 - the batched responses share the field, not a type
    for result in results:
        if _is_not_participant(result):
            result.CopyFrom(_as_unknown(method, result.transfer_id))
