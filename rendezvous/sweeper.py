"""The sweeper: what time does on its own. Run periodically by the server (RendezvousServer's sweeper loop; a
test with a fake clock calls Coordinator.sweep instead), it ends lapsed leases (their transfers abort, peers get
PEER_LOST: Coordinator.lose_engine), forgets aged engine tombstones, expires transfers past their deadline and
drops lapsed credit reservations. The rules are the core's (engines.lapse, engines.sweep_engine,
transfers.expire); this module only finds the candidates and applies them.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

from rendezvous.core import engines as engine_rules
from rendezvous.core import transfers as lifecycle
from rendezvous.core.model import Engine
from rendezvous.store.base import StoreUnavailableError

if TYPE_CHECKING:
    from rendezvous.coordinator import Coordinator

log = logging.getLogger(__name__)


async def sweep(coordinator: Coordinator, max_transfers: int) -> None:
    """End lapsed leases, expire due transfers (at most max_transfers), drop old tombstones and reservations."""
    store = coordinator.store
    now = coordinator.clock()
    for engine in await store.lapse_candidates(now, coordinator.timeouts.tombstone_ttl):
        try:
            await _sweep_engine(coordinator, engine, now)
        except StoreUnavailableError:
            raise
        except Exception:
            # One bad record must not stop the leases of every other engine from being enforced.
            log.exception("cannot sweep engine", extra={"engine_id": engine.engine_id})
    ctx = coordinator.context()
    due = await store.due_transfers(ctx.now, max_transfers)
    await coordinator.apply_each(due, partial(lifecycle.expire, ctx), "cannot expire transfer")
    await coordinator.credits.expire(ctx.now, max_transfers)


async def _sweep_engine(coordinator: Coordinator, engine: Engine, now: float) -> None:
    """End a lapsed lease, or forget an aged tombstone; the core decides which (engines.lapse)."""
    ttl = coordinator.timeouts.tombstone_ttl
    verdict = engine_rules.lapse(engine, now, ttl)
    if verdict is None:
        return
    if verdict is engine_rules.Lapse.TOMBSTONE_AGED:
        # Apply the loss again before forgetting: the replica that ended it may have died before it could.
        await coordinator.lose_engine(engine)
    swept = await coordinator.store.update_engine(
        engine.engine_id, partial(engine_rules.sweep_engine, now, ttl, engine)
    )
    if (
        verdict is engine_rules.Lapse.LEASE_PASSED
        and swept is not None
        and swept.incarnation == engine.incarnation
        and swept.ended_at == now
    ):
        log.warning("engine lease expired", extra={"engine_id": engine.engine_id})
        await coordinator.lose_engine(swept)
