"""The wire mapping of the service's own records (its engines, events); requests, errors, engine views and
credits map in rendezvous.protocol.convert."""

from __future__ import annotations

from rendezvous.core.model import Engine, Event, Role, Transfer
from rendezvous.protocol import convert
from rendezvous.protocol.convert import fill_transfer, number, set_time
from rendezvous.protocol.enums import EngineView
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.v1 import rendezvous_pb2 as pb


def engine_view(value: int) -> EngineView:
    """ListEngines' and GetEngine's view: unset is FULL; a value this server does not know is refused, not served
    as FULL."""
    view = EngineView(value)
    if value and view is EngineView.UNSPECIFIED:
        raise RendezvousError(
            Reason.VIEW_INVALID, f"view {value} is not BASIC, PLACEMENT, FULL or unset (FULL)", field="view"
        )
    return view


def role_filter(value: int) -> Role | None:
    """ListEngines' role: unset lists every role; a value this server does not know is refused, not ignored
    (which would list every role to a caller that asked for one)."""
    if value == pb.ENGINE_ROLE_UNSPECIFIED:
        return None
    role = Role(value)
    if role is Role.UNSPECIFIED:
        raise RendezvousError(
            Reason.ROLE_UNSPECIFIED, f"role {value} is not PRODUCER, CONSUMER or unset (every role)", field="role"
        )
    return role


# Domain -> responses


def engine_message(
    e: Engine,
    include_metadata: bool = True,
    live_transfers: int = 0,
    include_labels: bool = True,
    now: float | None = None,
) -> pb.Engine:
    """An engine record as a message; without agent metadata bytes or labels when asked. An answer's engine
    (`now`: the server's clock as it answers, the one its leases lapse by) says what is left of the lease then; an
    event's (no `now`) does not: it is a record of when the event happened, delivered any time later."""
    return convert.engine_message(
        e,
        lease_expire_time=e.lease_expires_at,
        register_time=e.registered_at,
        watch_start_sequence=e.watch_start_sequence,
        capacity=e.capacity,
        live_transfers=live_transfers,
        include_metadata=include_metadata,
        include_labels=include_labels,
        lease_remaining=None if now is None else e.lease_expires_at - now,
    )


_PEERS_KEPT = 256
_PEER_BYTES_KEPT = 64 << 10
_peers: dict[str, tuple[Engine, pb.Engine]] = {}
"""The message of the engine record events last carried as their peer, per engine: events of one record
(every assignment to a consumer's blocks until its next keep-alive) build its message once. Records are
immutable, so a message is right for as long as its record is the one an event names. Bounded: at most
_PEERS_KEPT engines, none with more than _PEER_BYTES_KEPT of agent metadata (those are built each time)."""


def _peer_message(e: Engine) -> pb.Engine:
    entry = _peers.get(e.engine_id)
    if entry is not None and entry[0] is e:
        return entry[1]
    message = engine_message(e)
    if sum(len(a.metadata) for a in e.agents) <= _PEER_BYTES_KEPT:
        if len(_peers) >= _PEERS_KEPT and e.engine_id not in _peers:
            _peers.clear()
        _peers[e.engine_id] = (e, message)
    return message


def event_message(e: Event[Transfer, Engine]) -> pb.Event:
    """An event as a message."""
    m = pb.Event()
    fill_event(m, e)
    return m


def fill_event(m: pb.Event, e: Event[Transfer, Engine]) -> None:
    """Set an empty Event message (a new one, or an item of a response: no copy) to an event."""
    m.sequence = e.sequence
    m.type = number(e.type)
    if e.transfer is not None:
        fill_transfer(m.transfer, e.transfer)
    m.generation = e.generation
    if e.peer is not None:
        m.peer.CopyFrom(_peer_message(e.peer))
    if e.time:
        set_time(m.event_time, e.time)
