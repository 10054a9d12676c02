"""Whether rectangles of a target's tokens x the model's layers tile it exactly: the check of progressive push.

Each part (`WrittenPart`) is tokens `[first_token, first_token + num_tokens)` of the target (0 = its first) x
layers `[first_layer, first_layer + num_layers)` of the model (`num_layers` 0: every held layer). The service
checks the parts a completion reports (`rendezvous.core.parts`), and a consumer rank checks the parts its
producers' notifications say landed (`rendezvous.clients.nixl.arrival`): one check, so both sides agree on what tiles.

The check is a sweep over the layers: parts start and end at layer boundaries, the parts spanning the current
layer interval are kept sorted by first token, and each newcomer is compared with its two neighbours (disjoint
intervals overlap a newcomer only if a neighbour does). Between boundaries the spanning parts' tokens must add
up to the target's (the first shortfall is raised after the sweep, so an overlap anywhere is named first).
O(n log n) comparisons for n parts (the list inserts move pointers, O(n) each, cheap up to a few thousand parts);
no part is stored.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.records import WrittenPart

__all__ = ["check_parts"]


class _Layers:
    """The held layers as one dense axis [0, total): the layers of the ranges one after the other."""

    def __init__(self, held: tuple[range, ...]) -> None:
        self.held = held
        self.starts = [r.start for r in held]
        self.offsets: list[int] = []
        total = 0
        for r in held:
            self.offsets.append(total)
            total += len(r)
        self.total = max(total, 1)  # no layers stated: one opaque layer

    def span(self, index: int, part: WrittenPart) -> tuple[int, int]:
        """The part's layers on the dense axis; PART_OUT_OF_RANGE unless the ranks hold all of them."""
        if not part.num_layers:
            if part.first_layer:
                raise _out_of_range(index, f"part {index} names first_layer {part.first_layer} with num_layers 0")
            return 0, self.total
        first, stop = part.first_layer, part.first_layer + part.num_layers
        i = bisect_right(self.starts, first) - 1
        if i < 0 or stop > self.held[i].stop:
            raise _out_of_range(
                index, f"part {index} has layers [{first}, {stop}); the reporting ranks hold {self.describe()}"
            )
        return self.offsets[i] + first - self.held[i].start, self.offsets[i] + stop - self.held[i].start

    def layer(self, position: int) -> str:
        """The model layer at a position of the dense axis, for messages."""
        if not self.held:
            return "(all layers)"
        i = bisect_right(self.offsets, position) - 1
        return str(self.held[i].start + position - self.offsets[i])

    def describe(self) -> str:
        if not self.held:
            return "no stated layers (use num_layers 0)"
        return ", ".join(f"[{r.start}, {r.stop})" for r in self.held)


def _out_of_range(index: int, message: str) -> RendezvousError:
    return RendezvousError(Reason.PART_OUT_OF_RANGE, message, part=index)


def check_parts(parts: Sequence[WrittenPart], num_tokens: int, held: tuple[range, ...]) -> None:
    """The parts tile tokens [0, num_tokens) x the held layers exactly, or the first fault is raised:
    PART_OUT_OF_RANGE (empty, or outside), PARTS_OVERLAP, PARTS_INCOMPLETE."""
    layers = _Layers(held)
    events: list[tuple[int, int, int]] = []  # (layer position, 0 = ends / 1 = starts, part index)
    for index, part in enumerate(parts):
        if not part.num_tokens:
            raise _out_of_range(index, f"part {index} holds no token")
        if part.first_token + part.num_tokens > num_tokens:
            raise _out_of_range(
                index,
                f"part {index} has tokens [{part.first_token}, {part.first_token + part.num_tokens}); "
                f"the target has {num_tokens}",
            )
        first, stop = layers.span(index, part)
        events += [(first, 1, index), (stop, 0, index)]
    events.sort()  # at a boundary, parts that end leave before parts that start arrive
    starts: list[int] = []  # first tokens of the parts spanning the current layers, sorted
    stops: list[int] = []
    owners: list[int] = []
    covered = position = k = 0
    gap: RendezvousError | None = None  # the first unwritten cell; raised once no overlap can come
    while True:
        while k < len(events) and events[k][0] == position:
            _, arrives, index = events[k]
            first, stop = parts[index].first_token, parts[index].first_token + parts[index].num_tokens
            if arrives:
                j = bisect_right(starts, first)
                for other in (j - 1, j):
                    if 0 <= other < len(starts) and starts[other] < stop and stops[other] > first:
                        raise RendezvousError(
                            Reason.PARTS_OVERLAP,
                            f"parts {owners[other]} and {index} both write tokens of layer {layers.layer(position)}",
                            part=index,
                            other=owners[other],
                        )
                starts.insert(j, first)
                stops.insert(j, stop)
                owners.insert(j, index)
                covered += stop - first
            else:
                j = bisect_left(starts, first)
                del starts[j], stops[j], owners[j]
                covered -= stop - first
            k += 1
        if position >= layers.total:
            break
        if covered < num_tokens and gap is None:
            token = _first_gap(starts, stops)
            gap = RendezvousError(
                Reason.PARTS_INCOMPLETE,
                f"no part writes token {token} of layer {layers.layer(position)}",
                layer=layers.layer(position),
                token=token,
            )
        position = events[k][0] if k < len(events) else layers.total
    if gap is not None:
        raise gap


def _first_gap(starts: list[int], stops: list[int]) -> int:
    """The first token no interval holds, of sorted disjoint intervals."""
    token = 0
    for first, stop in zip(starts, stops, strict=True):
        if first > token:
            return token
        token = stop
    return token
