"""Which engine was sent which prompt blocks: the router's approximate view of the engines' prefix caches.

An engine's cache is not observed; the index assumes an engine still holds the blocks of the prompts it was
sent most recently, up to `capacity` (engine, block) entries across all engines, forgetting the oldest
first (engines evict least recently used blocks too). Dynamo's and vLLM's KV-aware routers make the same
approximation when they do not subscribe to the engines' cache events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """A bounded LRU of (engine id, chained block hash)."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, engine_id: str, blocks: Sequence[int]) -> None:
        """engine_id was sent a prompt with these chained block hashes."""
        seen = self._seen
        for block in blocks:
            key = (engine_id, block)
            if key in seen:
                seen.move_to_end(key)
            else:
                seen[key] = None
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def matched(self, engine_id: str, blocks: Sequence[int]) -> int:
        """How many leading blocks engine_id likely holds (hashes chain: the first miss ends the match)."""
        seen = self._seen
        for count, block in enumerate(blocks):
            if (engine_id, block) not in seen:
                return count
        return len(blocks)
