"""Progressive push: what a target that accepts parts needs, and the check of the parts a completion reports.

A producer may write a generation in parts (layers as layer-wise prefill computes them, token ranges as chunked
prefill does) and report them with its success (`CompletionSpec.parts`). Each part is a rectangle of the
target's tokens (0 = the first of `TargetSpec.num_tokens`) x the model's layers. The parts of one completion
must tile exactly the share of the ranks it reports: every token of the target x every layer those ranks hold
(all of the model's without pipeline parallelism; a layout that states no layers has one opaque layer, which
only parts of `num_layers` 0 name). Anything else is refused before the transfer changes, so a generation never
commits with bytes missing.

The tiling check itself is `rendezvous.protocol.tiling.check_parts` (consumers run it too), re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rendezvous.core.limits import Limits
from rendezvous.core.model import Engine, Mode
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.records import WrittenPart
from rendezvous.protocol.requests import TargetSpec
from rendezvous.protocol.tiling import check_parts

__all__ = [
    "check_part_count",
    "check_parts",
    "check_progressive_target",
    "check_request_part_count",
    "held_layers",
]


def check_progressive_target(spec: TargetSpec) -> None:
    """A target that accepts parts is pushed (only a writing producer reports parts) and states its tokens."""
    if not spec.progressive:
        return
    if spec.mode != Mode.PUSH:
        raise RendezvousError(
            Reason.PROGRESSIVE_NEEDS_PUSH, "a progressive target needs push mode", field="progressive"
        )
    if not spec.num_tokens:
        raise RendezvousError(
            Reason.PROGRESSIVE_NEEDS_TOKENS,
            "a progressive target must state num_tokens: its parts are ranges of those tokens",
            field="num_tokens",
        )


def check_part_count(parts: Sequence[WrittenPart], limits: Limits) -> None:
    """A completion reports at most max_parts_per_completion parts."""
    if len(parts) > limits.max_parts_per_completion:
        raise RendezvousError(
            Reason.TOO_MANY_PARTS,
            f"more than {limits.max_parts_per_completion} parts in one completion",
            field="parts",
            limit=limits.max_parts_per_completion,
        )


def check_request_part_count(count: int, limits: Limits) -> None:
    """A request reports at most max_parts_per_request parts over all its completions."""
    if count > limits.max_parts_per_request:
        raise RendezvousError(
            Reason.TOO_MANY_PARTS,
            f"{count} parts in one request; the limit is {limits.max_parts_per_request}",
            field="parts",
            limit=limits.max_parts_per_request,
        )


def held_layers(engine: Engine, ranks: Iterable[int]) -> tuple[range, ...]:
    """The model layers the given ranks of engine hold, as sorted disjoint ranges (merged where they touch);
    () when the layout states no layers."""
    layout = engine.layout
    by_rank = {a.rank: a for a in engine.agents}
    held: list[range] = []
    for r in ranks:
        agent = by_rank.get(r)
        if layout.pp_size == 1 or agent is None:
            held.append(range(layout.num_layers))
        else:
            held.append(range(agent.first_layer, agent.first_layer + agent.num_layers))
    merged: list[range] = []
    for layers in sorted((r for r in held if r), key=lambda r: r.start):
        if merged and layers.start <= merged[-1].stop:
            merged[-1] = range(merged[-1].start, max(merged[-1].stop, layers.stop))
        else:
            merged.append(layers)
    return tuple(merged)
