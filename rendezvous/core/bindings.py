"""Halves bound to the router's choice: the check of a transfer binding (rendezvous.protocol.bindings).

With binding keys configured, a consumer's target and a producer's claim (or a MarkSourcesReady that
claims) carrying a binding are admitted only if the binding verifies for the item's transfer id, has not
expired, and names the caller for its half. With `required`, a half without a binding is refused too,
unless the call is exempt (an admin identity). An engine that already holds its half of the transfer
needs no binding and is not refused for an expired one: it was admitted when it joined, so a
re-registration after preemption goes through, and so does a re-assertion after a restart of a Redis-backed
service (the record survives). A memory store forgets the transfer on restart: the engines' sessions then
re-assert with the binding they were given, which must still be live (the router's TTL bounds that).

With `required`, an engine aborts only a transfer it takes part in (check_abort): an engine's abort of an
id not yet known would leave a tombstone that ends the router-minted id for the halves the router bound to it,
whatever their bindings. The router (AbortTransfers without an engine id) and exempt callers pre-abort freely.

A refusal names no other engine and is the same whether the transfer exists or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.core.model import Role, Transfer
from rendezvous.protocol.bindings import Binding, verifies
from rendezvous.protocol.errors import Reason, RendezvousError


@dataclass(frozen=True)
class BindingRules:
    """The service's binding keys, and whether every half must carry a binding."""

    keys: tuple[bytes, ...]
    required: bool = False

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("binding rules need at least one key")


def _holds(cur: Transfer | None, engine_id: str, half: Role) -> bool:
    if cur is None:
        return False
    holder = cur.consumer_engine_id if half == Role.CONSUMER else cur.producer_engine_id
    return holder == engine_id


def check_binding(
    rules: BindingRules,
    now: float,
    cur: Transfer | None,
    transfer_id: str,
    binding: Binding | None,
    engine_id: str,
    half: Role,
    exempt: bool = False,
) -> None:
    """Refuse engine_id taking `half` of transfer_id unless its binding admits it (see the module)."""
    holds = _holds(cur, engine_id, half)
    side = "consumer" if half == Role.CONSUMER else "producer"
    if binding is None:
        if rules.required and not exempt and not holds:
            raise RendezvousError(
                Reason.BINDING_REQUIRED,
                f"transfer {transfer_id}: this server requires the router's binding for the {side} half",
                transfer_id=transfer_id,
            )
        return
    if not verifies(rules.keys, transfer_id, binding):
        raise RendezvousError(
            Reason.BINDING_INVALID,
            f"transfer {transfer_id}: the binding does not verify (forged, for another transfer, or another key)",
            transfer_id=transfer_id,
            field="mac",
        )
    bound = binding.consumer_engine_id if half == Role.CONSUMER else binding.producer_engine_id
    if bound != engine_id:
        raise RendezvousError(
            Reason.BINDING_MISMATCH,
            f"transfer {transfer_id} is bound to another {side}",
            transfer_id=transfer_id,
            field=f"{side}_engine_id",
        )
    if binding.expires_at <= now and not holds:
        raise RendezvousError(
            Reason.BINDING_INVALID,
            f"transfer {transfer_id}: the binding expired",
            transfer_id=transfer_id,
            field="expire_time",
        )


def check_abort(rules: BindingRules, cur: Transfer | None, transfer_id: str, engine_id: str, exempt: bool) -> None:
    """Refuse engine_id aborting transfer_id under required bindings unless it takes part in it (see the module)."""
    if not rules.required or exempt or (cur is not None and engine_id in cur.participants()):
        return
    raise RendezvousError(
        Reason.BINDING_REQUIRED,
        f"transfer {transfer_id}: this server requires the router's binding; an engine aborts only the transfers it"
        " takes part in (the router aborts the others)",
        transfer_id=transfer_id,
    )
