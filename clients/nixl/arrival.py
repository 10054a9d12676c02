"""`PartsArrival`: when a consumer rank may take a progressive target (written in parts) as arrived by itself.

Each WRITE of a part carries a notification that says which rectangles of the target it carried (tokens x model
layers, `rendezvous.clients.nixl.notifications`), and NIXL delivers it only once that WRITE landed. So the parts a
sender's notifications name are in the consumer's blocks. The target has arrived once, for each of the `writers`
producer ranks that write into this consumer rank, the parts it named tile its share exactly (every token of the target
x every layer of its share, no cell twice: `rendezvous.protocol.tiling.check_parts`, the service's own check), and
the senders' shares together cover every layer the consumer rank holds.

A notification repeated (the same rectangle again) counts once. Anything that cannot be part of an exact tiling
(a rectangle outside the share or the target, rectangles that overlap, a sender that changes its share or its
`writers`, more than `MAX_PARTS` rectangles) marks the target `disputed`: the notifications can no longer make it
arrive, and only the service's TRANSFER_COMMITTED can (which the service emits only once the parts the producer
reports tile it). The check runs only once a sender's distinct rectangles add up to its share's area, so a
layer-wise transfer of L layers costs one O(L log L) check per sender.
"""

from __future__ import annotations

import dataclasses

from rendezvous.clients.nixl.notifications import TransferNotification
from rendezvous.protocol.errors import RendezvousError
from rendezvous.protocol.records import WrittenPart
from rendezvous.protocol.tiling import check_parts

__all__ = ["MAX_PARTS", "PartsArrival"]

MAX_PARTS = 4096
"""Rectangles one sender may name for one target: the service's default `max_parts_per_completion`."""


@dataclasses.dataclass(eq=False)
class _Sender:
    layers: range
    parts: set[WrittenPart] = dataclasses.field(default_factory=set)
    area: int = 0
    tiled: bool = False


class PartsArrival:
    """The part notifications of one generation of a progressive target, as they come (one thread)."""

    def __init__(self, num_tokens: int, held: range) -> None:
        """`num_tokens`: the target's (as registered); `held`: the model layers this consumer rank holds."""
        self.num_tokens = num_tokens
        self.held = held
        self.disputed: str | None = None
        """Why the notifications can no longer make the target arrive (None while they can)."""
        self._writers = 0
        self._senders: dict[str, _Sender] = {}

    @property
    def arrived(self) -> bool:
        """Whether every sender's parts tile its share and the shares cover the held layers."""
        if self.disputed is not None or not self._writers or len(self._senders) < self._writers:
            return False
        if not all(s.tiled for s in self._senders.values()):
            return False
        covered = set().union(*(s.layers for s in self._senders.values()))
        return all(layer in covered for layer in self.held)

    def add(self, n: TransferNotification) -> bool:
        """Take one parts entry (`n.parts` is not None); True once the target has arrived."""
        assert n.parts is not None
        if self.disputed is None:
            self.disputed = self._add(n)
        return self.arrived

    def _add(self, n: TransferNotification) -> str | None:
        assert n.parts is not None
        layers = self.held if n.layers is None else n.layers
        if self._writers and n.writers != self._writers:
            return f"{n.sender} says {n.writers} producer ranks write here, an earlier notification {self._writers}"
        self._writers = n.writers
        if layers.start < self.held.start or layers.stop > self.held.stop:
            return f"{n.sender} writes layers [{layers.start}, {layers.stop}); this rank holds {_span(self.held)}"
        sender = self._senders.setdefault(n.sender, _Sender(layers))
        if sender.layers != layers:
            return f"{n.sender} changed its share from layers {_span(sender.layers)} to {_span(layers)}"
        for part in n.parts:
            explicit = (
                part if part.num_layers else WrittenPart(part.first_token, part.num_tokens, layers.start, len(layers))
            )
            if explicit in sender.parts:
                continue  # a repeat counts once
            end_layer = explicit.first_layer + explicit.num_layers
            if not explicit.num_tokens or explicit.first_token + explicit.num_tokens > self.num_tokens:
                return f"{n.sender} names tokens outside the target's {self.num_tokens}: {explicit}"
            if explicit.first_layer < layers.start or end_layer > layers.stop:
                return f"{n.sender} names layers outside its share {_span(layers)}: {explicit}"
            if len(sender.parts) >= MAX_PARTS:
                return f"{n.sender} named more than {MAX_PARTS} parts"
            sender.parts.add(explicit)
            sender.area += explicit.num_tokens * explicit.num_layers
        share = self.num_tokens * len(layers)
        if sender.area > share:
            return f"{n.sender}'s parts overlap: they hold {sender.area} token-layers of a {share} share"
        if sender.area == share and not sender.tiled:
            try:
                check_parts(list(sender.parts), self.num_tokens, (layers,))
            except RendezvousError as e:
                return f"{n.sender}'s parts do not tile its share: {e.reason}: {e.message}"
            sender.tiled = True
        return None


def _span(layers: range) -> str:
    return f"[{layers.start}, {layers.stop})"
