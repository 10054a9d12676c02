"""`FirstSteps`: decode's first step after its KV arrived, traced (the `connector.first_step` span).

The scheduler learns that a request's KV arrived from a step's `finished_recving`; a later step schedules the
request and computes its first token. The span runs from the first to the end of the second, so a trace shows
what decode adds after the completion notice: waiting to be scheduled (`kv_rendezvous.schedule_wait_steps`,
steps that ran without it) and the step itself. Kept apart from `rendezvous.connector.rendezvous_connector` so that it
imports without vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping

from rendezvous.protocol import tracing


@dataclasses.dataclass
class _Open:
    span: tracing.Span
    waited: int = 0
    """Steps that ran since the arrival without scheduling the request."""
    scheduled: bool = False


class FirstSteps:
    """The scheduler's bookkeeping of `connector.first_step` spans (only for requests the router traced)."""

    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id
        self._expected: dict[str, tuple[str, Mapping[str, str]]] = {}
        """Requests waiting for their KV: the transfer id and the router's trace context."""
        self._open: dict[str, _Open] = {}

    def expect(self, request_id: str, transfer_id: str, context: Mapping[str, str]) -> None:
        """A request waits for its KV; `context` is the router's trace context (empty: not traced)."""
        if context and tracing.enabled():
            self._expected[request_id] = (transfer_id, context)

    def scheduled(self, request_ids: Collection[str]) -> None:
        """This step schedules `request_ids` (its `num_scheduled_tokens`)."""
        for request_id, first in self._open.items():
            if not first.scheduled and request_id in request_ids:
                first.scheduled = True
                first.span.set_attribute("kv_rendezvous.schedule_wait_steps", first.waited)

    def stepped(self, arrived: Iterable[str]) -> None:
        """A step ended; its `finished_recving` is `arrived`. The first steps it ran end; arrivals open theirs."""
        for request_id in [r for r, first in self._open.items() if first.scheduled]:
            span = self._open.pop(request_id).span
            span.set_attribute("kv_rendezvous.ok", True)
            span.end()
        for first in self._open.values():
            first.waited += 1
        for request_id in arrived:
            expected = self._expected.pop(request_id, None)
            if expected is not None:
                transfer_id, context = expected
                about = tracing.about(transfer_id=transfer_id, engine_id=self._engine_id)
                self._open[request_id] = _Open(tracing.start("connector.first_step", about, parent=context))

    def forget(self, request_id: str) -> None:
        """The request finished (in its first step, or aborted before it): a span it still has ends here."""
        self._expected.pop(request_id, None)
        first = self._open.pop(request_id, None)
        if first is not None:
            first.span.set_attribute("kv_rendezvous.ok", first.scheduled)
            first.span.end()


__all__ = ["FirstSteps"]
